"""Scaling runs on several GPUs of one host, through the user-facing CLI with FSDP2.

    python3 -m atelier_studio.bench.scaling --tokenizer DIR --out DIR [--runs designer-8b-lora,designer-8b-full,...]
        [--gpus 1,2,4,8] [--steps 12] [--work /tmp/atelier-scaling] [--tiny]

Each run is `atelier designer train --nproc N` or `atelier imagegen train --nproc N` (torchrun, FSDP2, one
block per FSDP unit: pipeline/distributed.py) on random-init weights at the real shapes, with a FIXED
per-GPU micro-batch, so N GPUs do N times the work of one (weak scaling). Rank 0's summary.json gives the
per-GPU rate (the trainer counts rank 0's own tokens or images; packed rows are balanced across ranks by
attention cost) and MFU; the median over the logged intervals leaves the first (compile, warm-up) out.

    scaling efficiency(N) = per-GPU rate at N / per-GPU rate at the smallest N that ran
                             (1 GPU, except where one GPU runs out of memory: 8B full fine-tuning)

Runs: designer-8b-lora (LoRA r16 all linear, packed rows of 2048), designer-8b-full and designer-8b-full-4k
(full fine-tuning, fp32 master weights sharded, rows of 2048 / 4096, full activation checkpointing),
imagegen-sd3-1024 (SD3-medium MMDiT at 1024 px, random latents; bench/first_runs_imagegen.py's stand-ins).
NVLink multicast stays off in every launched process (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1): on a shared host it can take the GPUs out of service.

`--tiny` runs the same code path on the CPU (gloo, tiny models, 1 and 2 processes) for the tests.
Writes OUT/scaling-<date>.json and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from atelier_studio.bench.env import clocks, environment
from atelier_studio.bench.harness import fmt, parse_ints
from atelier_studio.pipeline.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]  # resolved: imported through atelier_studio/ links too
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class ScalingRun:
    kind: str                  # "designer" | "imagegen"
    size: str                  # `atelier designer init --size` / the imagegen RunShape
    micro_batch: int           # per GPU
    seq_len: int = 2048        # designer rows
    lora_rank: int = 16        # 0: full fine-tuning
    ac: str = "none"           # train.distributed.activation_checkpointing
    compile: bool = True       # train.distributed.compile


RUNS = {
    "designer-8b-lora": ScalingRun("designer", "8b", micro_batch=4),
    "designer-8b-full": ScalingRun("designer", "8b", micro_batch=2, lora_rank=0, ac="full"),
    "designer-8b-full-4k": ScalingRun("designer", "8b", micro_batch=1, seq_len=4096, lora_rank=0, ac="full"),
    "imagegen-sd3-1024": ScalingRun("imagegen", "sd3m", micro_batch=8),
}


def tiny(run: ScalingRun) -> ScalingRun:
    """The same path at CPU size: tiny models, short rows, no compile (Inductor's C++ build is minutes on a CPU)."""
    if run.kind == "imagegen":
        return replace(run, size="tiny", micro_batch=2, compile=False)
    return replace(run, size="tiny", micro_batch=2, seq_len=128, lora_rank=min(run.lora_rank, 4), compile=False)


# ------------------------------------------------------------------------------------------------ launching

def atelier(*args: str, log: Path, env: dict[str, str]) -> int:
    with open(log, "a") as fh:
        fh.write(f"$ atelier {' '.join(args)}\n")
        fh.flush()
        proc = subprocess.run([sys.executable, "-m", "atelier_studio.flows.cli", *args], cwd=ROOT, stdout=fh,
                              stderr=subprocess.STDOUT, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})
    return proc.returncode


def designer_setup(work: Path, run: ScalingRun, tokenizer: Path, log: Path, dtype: str) -> tuple[Path, Path]:
    """(model dir, train.jsonl): the shapes world and a random-init model, each made once per work dir."""
    world = work / "world"
    if not (world / "train.jsonl").is_file():
        atelier("data", "synth", "--out", str(world), "--n", "4000", "--seed", "0", "--image-size", "32", log=log,
                env={})
    model = work / f"qwen3-{run.size}"
    if not (model / "config.json").is_file():
        if atelier("designer", "init", "--size", run.size, "--tokenizer", str(tokenizer), "--out", str(model),
                   "--dtype", dtype, log=log, env={}) != 0:
            raise RuntimeError(f"designer init --size {run.size} failed; see {log}")
    return model, world / "train.jsonl"


def designer_args(run: ScalingRun, model: Path, data: Path, out: Path, steps: int, dtype: str) -> list[str]:
    s = lambda k, v: ["--set", f"{k}={v}"]  # noqa: E731
    return ["designer", "train", "--config", str(ROOT / "configs" / "designer" / "demo.toml"),
            *s("model.path", model), *s("model.dtype", dtype), *s("data.train", data), *s("data.eval", ""),
            *s("data.seq_len", run.seq_len), *s("lora.rank", run.lora_rank), *s("lora.alpha", 2 * run.lora_rank),
            *s("train.max_steps", steps), *s("train.micro_batch", run.micro_batch), *s("train.lr", "1e-5"),
            *s("train.warmup_steps", 1), *s("train.log_every", 2), *s("train.eval_every", 0),
            *s("train.save_every", 0), *s("train.resume", "never"),
            *s("train.distributed.activation_checkpointing", run.ac),
            *s("train.distributed.compile", str(run.compile).lower()), *s("output.dir", out),
            *s("output.tensorboard", "false")]


def imagegen_setup(work: Path, run: ScalingRun, log: Path, dtype: str) -> Path:
    """The run's TOML over a random-init MMDiT and random latent shards (bench/first_runs_imagegen.py)."""
    import torch

    from atelier_studio.bench.first_runs_imagegen import (
        SD3M,
        TINY,
        write_config,
        write_random_latents,
        write_text_encoder,
        write_vae,
    )

    shape = TINY if run.size == "tiny" else SD3M
    model = work / f"mmdit-{shape.tag}"
    if not (model / "config.json").is_file():
        extra = ["--joint-attention-dim", str(shape.text_width)] if shape is TINY else []
        if atelier("imagegen", "init", "--size", shape.size, "--out", str(model), "--dtype", dtype, "--pooled-dim",
                   str(shape.text_width), *extra, log=log, env={}) != 0:
            raise RuntimeError(f"imagegen init --size {shape.size} failed; see {log}")
    # enough samples for every rank of the largest run to draw its batches
    shape = replace(shape, extra_samples=shape.extra_samples + 8 * run.micro_batch * 16)
    text_enc, vae = work / f"text-enc-{shape.tag}", work / f"vae-{shape.tag}"
    if not (text_enc / "config.json").is_file():
        write_text_encoder(text_enc, shape, getattr(torch, dtype), log)
    if not (vae / "config.json").is_file():
        write_vae(vae, shape)
    latents = write_random_latents(work / f"latents-{shape.tag}", shape, getattr(torch, dtype), text_enc, vae)
    return write_config(work / f"scaling-{shape.tag}.toml", shape, model, text_enc, vae, latents, dtype)


def imagegen_args(run: ScalingRun, config: Path, out: Path, steps: int) -> list[str]:
    s = lambda k, v: ["--set", f"{k}={v}"]  # noqa: E731
    return ["imagegen", "train", "--config", str(config), *s("train.micro_batch", run.micro_batch),
            *s("train.max_steps", steps), *s("train.log_every", 2),
            *s("train.distributed.activation_checkpointing", run.ac),
            *s("train.distributed.compile", str(run.compile).lower()), *s("output.dir", out)]


# ------------------------------------------------------------------------------------------------ the bench

def measure(name: str, run: ScalingRun, gpus: list[int], work: Path, tokenizer: Path | None, steps: int, log: Path,
            dtype: str) -> dict[str, Any]:
    """Every N of `gpus` for one run: rank 0's per-GPU rate, MFU, step time, peak memory; then the efficiency."""
    if run.kind == "designer":
        if tokenizer is None:
            raise ValueError(f"{name}: the designer runs need --tokenizer (a Qwen3 tokenizer directory)")
        model, data = designer_setup(work, run, tokenizer, log, dtype)
    else:
        config = imagegen_setup(work, run, log, dtype)
    by_gpus: dict[str, Any] = {}
    for n in gpus:
        out = work / f"{name}-x{n}"
        shutil.rmtree(out, ignore_errors=True)
        args = designer_args(run, model, data, out, steps, dtype) if run.kind == "designer" else \
            imagegen_args(run, config, out, steps)
        start = time.time()
        code = atelier(*args, "--nproc", str(n), log=log, env=NO_MULTICAST)
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
        by_gpus[str(n)] = {"code": code, "seconds": time.time() - start,
                           **{k: summary.get(k) for k in ("units_per_s", "mfu", "step_time", "peak_gb")}}
        for sub in ("checkpoints", "model", "adapter", "transformer", "ema"):  # random weights: tens of GB
            shutil.rmtree(out / sub, ignore_errors=True)
        print(f"{name} x{n}: code {code}, per-GPU {fmt(summary.get('units_per_s'), ',.1f')}/s, "
              f"mfu {fmt(summary.get('mfu'), '.1%')}", flush=True)
    ran = [int(n) for n, r in by_gpus.items() if r["units_per_s"]]
    base = min(ran) if ran else None
    for n, r in by_gpus.items():
        r["efficiency"] = (r["units_per_s"] / by_gpus[str(base)]["units_per_s"]) if base and r["units_per_s"] else None
    return {"run": asdict(run), "unit": "tokens" if run.kind == "designer" else "images", "baseline_gpus": base,
            "by_gpus": by_gpus}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"## scaling — {report['gpu'].get('name') or 'cpu'}", "",
             "| run | GPUs | per-GPU rate | MFU (989) | step s | peak GB | efficiency |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        for n, x in r["by_gpus"].items():
            rate = f"{x['units_per_s']:,.1f} {r['unit']}/s" if x["units_per_s"] else f"failed (code {x['code']})"
            lines.append(f"| {name} | {n} | {rate} | {fmt(x['mfu'], '.1%')} | {fmt(x['step_time'], '.3f')} | "
                         f"{fmt(x['peak_gb'], '.1f')} | {fmt(x['efficiency'], '.1%')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m atelier_studio.bench.scaling", description=__doc__.split("\n")[0])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--gpus", type=parse_ints, default=None, help="process counts (default 1,2,4,8; tiny: 1,2)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tokenizer", default=None, help="a Qwen3 tokenizer directory (designer runs)")
    p.add_argument("--work", default="/tmp/atelier-scaling")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU with gloo (tests)")
    a = p.parse_args(argv)
    names = [x for x in a.runs.split(",") if x]
    if [x for x in names if x not in RUNS]:
        p.error(f"--runs: unknown {[x for x in names if x not in RUNS]}; known: {list(RUNS)}")
    if any(RUNS[x].kind == "designer" for x in names) and not (a.tokenizer and Path(a.tokenizer).is_dir()):
        p.error(f"--tokenizer: the designer runs need a tokenizer directory, got {a.tokenizer!r}")
    gpus = a.gpus or ([1, 2] if a.tiny else [1, 2, 4, 8])
    if a.steps < 4 or any(n < 1 for n in gpus):
        p.error(f"--steps must be >= 4 (the first interval is warm-up) and --gpus >= 1; got {a.steps}, {gpus}")
    if not a.tiny:
        import torch

        if torch.cuda.device_count() < max(gpus):
            p.error(f"--gpus {max(gpus)} but this machine has {torch.cuda.device_count()} CUDA devices "
                    "(use --tiny on a CPU)")
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"scaling-{time.strftime('%Y-%m-%d')}.log"
    dtype = "float32" if a.tiny else "bfloat16"
    report: dict[str, Any] = {**environment(), "clocks": {"before": clocks()}, "gpus": gpus, "steps": a.steps,
                              "runs": {}}
    for name in names:
        run = tiny(RUNS[name]) if a.tiny else RUNS[name]
        tok = Path(a.tokenizer) if a.tokenizer else None
        report["runs"][name] = measure(name, run, gpus, work, tok, a.steps, log, dtype)
    report["clocks"]["after"] = clocks()
    atomic_write_text(out / f"scaling-{time.strftime('%Y-%m-%d')}.json", json.dumps(report, indent=1),
                      what="benchmark report")
    atomic_write_text(out / f"scaling-{time.strftime('%Y-%m-%d')}.md", markdown(report), what="benchmark report")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
