"""`train.optimizer` side by side on one GPU, through the user-facing CLI: peak memory, step time, loss curves.

    python -m atelier_studio.bench.optimizers --out DIR [--parts designer,imagegen] [--optimizers adamw,muon,...]
        [--steps 300] [--imagegen-steps 20] [--work /tmp/atelier-optimizers] [--tiny]

designer  Qwen3-1.7B (random init of the named size, `--size`) full fine-tuning (lora.rank 0) on the shapes world
          (the world, tokenizer and model of bench/qlora_curve.py's `prepare`), `--steps` steps of `--micro-batch`
          rows of `--seq-len` per optimizer, all from the same init, seed and data: per-step training losses, eval
          losses, tokens/s and peak GB from each run's summary.json.
imagegen  SD3-medium's MMDiT full fine-tuning at 1024 px, micro-batch 1, activation checkpointing full, EMA off (an
          fp32 EMA is another 8 GB at 2B parameters: it would hide what the optimizer saves), on bench/scaling.py's
          setup (bench/first_runs_imagegen.py's stand-in encoders and random latents: no images at 1024 px exist
          here, so a curve would say nothing): peak GB and step time per optimizer over `--imagegen-steps` steps.
          The issue's target: adamw8bit under 24 GB peak.

Each optimizer runs with what it needs beside `train.optimizer`: Prodigy `train.lr = 1.0` (its own step size
estimate), schedule-free `train.schedule = "constant"`; the others `--lr` with the cosine schedule. Every stage is
skipped when its output exists under --work, so an interrupted command picks up where it stopped.

Report: OUT/optimizers[-<part> when one part]-<date>.json and .md, rewritten after every run (the memory and speed
table per part, the designer's final losses and mean |Δloss| against AdamW on the same steps) and -curves.png (the
designer's curves). `--tiny` runs the same path on the CPU at the tiny sizes (12 designer steps, 3 imagegen steps,
fp32) for the test.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from atelier_studio.bench.env import clocks, environment
from atelier_studio.bench.harness import atelier, fmt, read_run
from atelier_studio.bench.qlora_curve import ROOT, add_curve_arguments, apply_tiny, curves, prepare
from atelier_studio.bench.scaling import ScalingRun, imagegen_setup
from atelier_studio.pipeline.atomic import atomic_write_text

OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adafactor", "schedulefree_adamw", "prodigy", "muon")
NEEDS = {"prodigy": {"train.lr": 1.0}, "schedulefree_adamw": {"train.schedule": "constant"}}


def _sets(optimizer: str, base: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for k, v in {**base, "train.optimizer": optimizer, **NEEDS.get(optimizer, {})}.items():
        argv += ["--set", f"{k}={v}"]
    return argv


def _failure(code: int, log: Path) -> dict[str, Any]:
    """A failed CLI run: its exit status and the last line it printed (the CLI's one-line error, e.g. a missing
    optimizer package)."""
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()] if log.is_file() else []
    said = [l for l in lines if l.startswith("atelier: error")] or lines[-1:]
    return {"code": code, "error": said[-1][:300] if said else None}


def designer_run(work: Path, model: Path, optimizer: str, a: argparse.Namespace, log: Path) -> dict[str, Any]:
    out = work / f"designer-{a.size}-{optimizer}"
    if not (out / "summary.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        world = work / "world"
        base = {"model.path": model, "model.dtype": a.dtype, "data.train": world / "train.jsonl",
                "data.eval": world / "eval.jsonl", "data.seq_len": a.seq_len, "data.max_eval_batches": 4,
                "lora.rank": 0, "train.max_steps": a.steps, "train.micro_batch": a.micro_batch, "train.lr": a.lr,
                "train.warmup_steps": a.warmup, "train.log_every": 1, "train.eval_every": a.eval_every,
                "train.save_every": 0, "train.seed": 0, "train.device": a.device, "output.dir": out,
                "output.tensorboard": "false"}
        config = ROOT / "configs" / "designer" / "qwen3-8b-lora.toml"
        code, _ = atelier("designer", "train", "--config", str(config), *_sets(optimizer, base), log=log)
        if code != 0:
            return _failure(code, log)
    run = read_run(out)
    return {"code": 0, "curves": curves(run), "summary": run.get("summary", {})}


def imagegen_run(work: Path, config: Path, optimizer: str, a: argparse.Namespace, log: Path) -> dict[str, Any]:
    out = work / f"imagegen-{'tiny' if a.tiny else 'sd3m'}-{optimizer}"
    if not (out / "summary.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        base = {"train.micro_batch": 1, "train.max_steps": a.imagegen_steps, "train.warmup_steps": 1,
                "train.distributed.activation_checkpointing": "full", "ema.decay": 0.0, "output.dir": out,
                "train.device": a.device}
        code, _ = atelier("imagegen", "train", "--config", str(config), *_sets(optimizer, base), log=log)
        if code != 0:
            return _failure(code, log)
    run = read_run(out)
    for name in ("checkpoints", "transformer"):  # 2B random weights each: disk for the next optimizer's run
        shutil.rmtree(out / name, ignore_errors=True)
    steps = [r["step_time"] for r in run.get("metrics", []) if r.get("kind") == "train" and r.get("step_time")]
    return {"code": 0, "summary": run.get("summary", {}),
            "median_step_time": statistics.median(steps[1:] or steps) if steps else None}


def compare_designer(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each optimizer's end of run, and its mean |Δloss| against AdamW on the same steps."""
    ref = dict((int(s), l) for s, l in runs.get("adamw", {}).get("curves", {}).get("train", []))
    out: dict[str, Any] = {}
    for name, run in runs.items():
        train = run.get("curves", {}).get("train", [])
        mine = dict((int(s), l) for s, l in train)
        common = sorted(set(mine) & set(ref))
        out[name] = {"final_loss": statistics.fmean(l for _, l in train[-10:]) if train else None,
                     "final_eval_loss": (run.get("curves", {}).get("eval") or [[None, None]])[-1][1],
                     "mean_abs_diff_vs_adamw": statistics.fmean(abs(mine[s] - ref[s]) for s in common)
                     if common and name != "adamw" else None,
                     "tokens_per_s": run.get("summary", {}).get("units_per_s"),
                     "peak_gb": run.get("summary", {}).get("peak_gb"), "code": run.get("code"),
                     "error": run.get("error")}
    return out


def _exit(r: dict[str, Any]) -> str:
    return "" if not r.get("code") else f" exit {r['code']}: {r.get('error') or 'see the log'}"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"## Optimizers — {report['gpu'].get('name') or 'cpu'}", ""]
    if "designer" in report["parts"]:
        c = report["config"]
        lines += [f"### designer {c['size']} full fine-tuning, {c['steps']} steps of {c['micro_batch']} x "
                  f"{c['seq_len']} tokens", "",
                  "| optimizer | final loss (last 10) | final eval | mean abs Δ vs AdamW | tokens/s | peak GB |",
                  "|---|---|---|---|---|---|"]
        for name, r in report["parts"]["designer"]["comparison"].items():
            lines.append(f"| {name} | {fmt(r['final_loss'], '.4f')} | {fmt(r['final_eval_loss'], '.4f')} | "
                         f"{fmt(r['mean_abs_diff_vs_adamw'], '.4f')} | {fmt(r['tokens_per_s'], ',.0f')} | "
                         f"{fmt(r['peak_gb'], '.1f')} |" + _exit(r))
        lines.append("")
    if "imagegen" in report["parts"]:
        lines += ["### imagegen SD3-medium MMDiT full fine-tuning, 1024 px, micro-batch 1, activation checkpointing, "
                  "EMA off", "", "| optimizer | peak GB | median step time (s) | images/s |", "|---|---|---|---|"]
        for name, r in report["parts"]["imagegen"]["runs"].items():
            s = r.get("summary", {})
            lines.append(f"| {name} | {fmt(s.get('peak_gb'), '.1f')} | {fmt(r.get('median_step_time'), '.3f')} | "
                         f"{fmt(s.get('units_per_s'), '.2f')} |" + _exit(r))
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any], path: Path) -> Path | None:
    """The designer's training curves, one per optimizer; None without matplotlib or without the designer part."""
    runs = report["parts"].get("designer", {}).get("runs")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, run in runs.items():
        train = run.get("curves", {}).get("train")
        if train:
            ax.plot(*zip(*train), linewidth=0.8, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"designer {report['config']['size']} full fine-tuning, same init")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m atelier_studio.bench.optimizers", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--work", default="/tmp/atelier-optimizers", help="world, models and runs (kept)")
    p.add_argument("--parts", default="designer,imagegen")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    add_curve_arguments(p, size="1.7b", micro_batch=4, lr=1e-4)
    p.add_argument("--imagegen-steps", type=int, default=20)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    apply_tiny(a)
    if a.tiny:
        a.imagegen_steps = min(a.imagegen_steps, 3)
    parts = [x for x in a.parts.split(",") if x]
    optimizers = [x for x in a.optimizers.split(",") if x]
    bad = [x for x in optimizers if x not in OPTIMIZERS] + [x for x in parts if x not in ("designer", "imagegen")]
    if bad or not parts or not optimizers:
        p.error(f"unknown or empty --parts / --optimizers: {bad or 'none given'}")
    out, work = Path(a.out), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "optimizers.log"
    start = time.time()
    report: dict[str, Any] = {**environment(), "command": " ".join([sys.executable, "-m", "bench.optimizers",
                                                                     *(argv if argv is not None else sys.argv[1:])]),
                              "config": {k: v for k, v in vars(a).items() if k not in ("out", "work")},
                              "clocks": {"before": clocks()}, "parts": {}}
    stem = f"optimizers{'-' + '-'.join(parts) if parts != ['designer', 'imagegen'] else ''}" \
        f"{'-tiny' if a.tiny else ''}-{time.strftime('%Y-%m-%d')}"

    def save() -> Path:  # after every run: a step killed at its time limit still leaves what it finished
        report["clocks"]["after"] = clocks()
        report["seconds"] = time.time() - start
        path = atomic_write_text(out / f"{stem}.json", json.dumps(report, indent=1), what="benchmark report")
        atomic_write_text(out / f"{stem}.md", markdown(report), what="benchmark report")
        return path

    if "designer" in parts:
        model = prepare(work, a.size, a.tokenizer, a.docs, a.dtype, log)
        runs: dict[str, dict[str, Any]] = {}
        report["parts"]["designer"] = {"runs": runs, "comparison": {}}
        for name in optimizers:
            runs[name] = designer_run(work, model, name, a, log)
            report["parts"]["designer"]["comparison"] = compare_designer(runs)
            save()
    if "imagegen" in parts:
        # bench/scaling.py's model, stand-in encoders (bench/first_runs_imagegen.py) and random latents
        config = imagegen_setup(work, ScalingRun("imagegen", "tiny" if a.tiny else "sd3m", micro_batch=1), log, a.dtype)
        report["parts"]["imagegen"] = {"runs": {}}
        for name in optimizers:
            report["parts"]["imagegen"]["runs"][name] = imagegen_run(work, config, name, a, log)
            save()
    path = save()
    chart(report, out / f"{stem}-curves.png")
    print(markdown(report))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
