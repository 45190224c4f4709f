"""First real-size runs on one GPU, through the user-facing CLI (the starting point for the speed work).

    python -m atelier_studio.bench.first_runs --tokenizer DIR --out DIR [--only designer|imagegen]

designer: `atelier designer init --size 8b` (random init, bf16) and `atelier designer train` with LoRA r16
on all linear layers, packed rows of 2048 tokens of the shapes world, 20 steps.
imagegen: `atelier imagegen init --size sd3-medium` and `atelier imagegen train` on random 1024-px latents
(128×128×16) with 333 text tokens of width 4096, 20 steps.

Each run's summary.json, metrics.jsonl and the environment (GPU, versions, clocks, matmul rate) are
collected into OUT/first-runs.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from atelier_studio.bench.env import clocks, environment, matmul_tflops
from atelier_studio.bench.harness import atelier, read_run
from atelier_studio.pipeline.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]  # resolved: imported through atelier_studio/ links too


def designer_run(work: Path, tokenizer: Path, log: Path) -> dict:
    world = work / "world"
    if not (world / "train.jsonl").is_file():
        atelier("data", "synth", "--out", str(world), "--n", "8000", "--seed", "0", "--image-size", "32", log=log)
    model = work / "qwen3-8b"
    code, init_s = (0, 0.0)
    if not (model / "config.json").is_file():
        code, init_s = atelier("designer", "init", "--size", "8b", "--tokenizer", str(tokenizer), "--out", str(model),
                               "--dtype", "bfloat16", log=log)
    result: dict = {"init_seconds": init_s, "init_code": code, "runs": {}}
    for micro_batch in (4, 2):
        out = work / f"designer-8b-lora-mb{micro_batch}"
        code, seconds = atelier(
            "designer", "train", "--config", str(ROOT / "configs" / "designer" / "demo.toml"),
            "--set", f"model.path={model}", "--set", "model.dtype=bfloat16",
            "--set", f"data.train={world / 'train.jsonl'}",
            "--set", "data.eval=", "--set", "data.seq_len=2048", "--set", "lora.rank=16", "--set", "lora.alpha=32",
            "--set", "train.max_steps=20", "--set", f"train.micro_batch={micro_batch}", "--set", "train.lr=1e-4",
            "--set", "train.warmup_steps=2", "--set", "train.log_every=1", "--set", "train.eval_every=0",
            "--set", "train.save_every=0", "--set", f"output.dir={out}", "--set", "output.tensorboard=false", log=log)
        result["runs"][f"mb{micro_batch}"] = {"code": code, "seconds": seconds, **read_run(out)}
        if code == 0:
            break
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/atelier-first-runs")
    p.add_argument("--only", default="designer,imagegen")
    args = p.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log = out / "first-runs.log"
    report = {"env": environment(), "clocks_before": clocks(), "matmul_tflops": matmul_tflops()}
    if "designer" in args.only:
        report["designer"] = designer_run(work, Path(args.tokenizer), log)
    if "imagegen" in args.only:
        from atelier_studio.bench.first_runs_imagegen import imagegen_run

        report["imagegen"] = imagegen_run(work, log)
    report["clocks_after"] = clocks()
    atomic_write_text(out / "first-runs.json", json.dumps(report, indent=1), what="benchmark report")
    for name in ("designer", "imagegen"):
        for key, run in report.get(name, {}).get("runs", {}).items():
            s = run.get("summary", {})
            print(f"{name} {key}: code {run['code']} units/s {s.get('units_per_s')} mfu {s.get('mfu')} "
                  f"peak_gb {s.get('peak_gb')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
