"""QLoRA against bf16-base LoRA over a whole run: the loss curves of `atelier designer train` on the shapes world.

    python -m atelier_studio.bench.qlora_curve --out DIR [--tokenizer DIR] [--size 8b] [--steps 300] [--micro-batch 2]
        [--work /tmp/atelier-qlora-curve] [--tiny]

Both runs go through the user-facing CLI with the same model directory (random init of the named size), data,
seed, adapter init and schedule; they differ in `lora.base_dtype` alone ("bf16", "nf4"). The shapes world
(`atelier data synth`) is written once; without --tokenizer a byte-level BPE is trained on its corpus. Each
stage is skipped when its output exists under --work (the world, the tokenizer, the model, a finished run), so
an interrupted command picks up where it stopped.

Report (OUT/qlora-curve-<size>-<date>.json, .md, -curves.png): both runs' per-step training losses and eval losses,
the mean |Δloss| over all steps and over the last 50, the largest |Δloss|, the final losses (mean of the last 10
steps), the runs' tokens/s and peak memory from their summary.json, and the environment. The runs start from the
same adapter (B = 0), so the first step's difference is the NF4 error of the base alone; a QLoRA run that tracks
the bf16 base keeps that difference about constant instead of drifting apart.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from atelier_studio.bench.env import clocks, environment
from atelier_studio.bench.harness import atelier, fmt, read_run
from atelier_studio.pipeline.atomic import atomic_write_text

BASES = ("bf16", "nf4")
ROOT = Path(__file__).resolve().parents[1]  # resolved: imported through atelier_studio/ links too


def prepare(work: Path, size: str, tokenizer: str | None, docs: int, dtype: str, log: Path) -> Path:
    """The shapes world, a tokenizer (given, or BPE on the world's corpus) and a random model of `size`; returns
    the model directory. Each is kept when it already exists."""
    world, model = work / "world", work / f"model-{size}"
    if not (world / "train.jsonl").is_file():
        _checked(atelier("data", "synth", "--out", str(world), "--n", str(docs), "--seed", "0", "--image-size", "32",
                         log=log), "data synth", log)
    tok = Path(tokenizer) if tokenizer else work / "tokenizer"
    if tokenizer is None and not (tok / "tokenizer.json").is_file():
        _checked(atelier("data", "tokenizer", "--corpus", str(world / "corpus.txt"), "--vocab-size", "4096", "--out",
                         str(tok), log=log), "data tokenizer", log)
    if not (model / "config.json").is_file():
        _checked(atelier("designer", "init", "--size", size, "--tokenizer", str(tok), "--out", str(model), "--dtype",
                         dtype, log=log), "designer init", log)
    return model


def _checked(result: tuple[int, float], what: str, log: Path) -> None:
    code, _ = result
    if code != 0:
        raise RuntimeError(f"{what} exited with {code}; see {log}")


def train(work: Path, model: Path, base: str, a: argparse.Namespace, log: Path) -> Path:
    """One run of `designer train` (skipped when its summary.json exists); returns its output directory."""
    out = work / f"run-{a.size}-{base}"
    if (out / "summary.json").is_file():
        return out
    world = work / "world"
    sets = {"model.path": model, "model.dtype": a.dtype, "data.train": world / "train.jsonl",
            "data.eval": world / "eval.jsonl", "data.seq_len": a.seq_len, "data.max_eval_batches": a.eval_batches,
            "lora.rank": a.rank, "lora.alpha": 2 * a.rank, "lora.base_dtype": base, "train.max_steps": a.steps,
            "train.micro_batch": a.micro_batch, "train.lr": a.lr, "train.warmup_steps": a.warmup,
            "train.log_every": 1, "train.eval_every": a.eval_every, "train.save_every": a.steps,
            "train.seed": 0, "train.device": a.device, "output.dir": out, "output.tensorboard": "false"}
    argv = ["designer", "train", "--config", str(ROOT / "configs" / "designer" / "qwen3-8b-lora.toml")]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    _checked(atelier(*argv, log=log), f"designer train ({base} base)", log)
    return out


def curves(run: dict[str, Any]) -> dict[str, list[list[float]]]:
    """[step, loss] of the training and the eval records of a run's metrics.jsonl."""
    metrics = run.get("metrics", [])
    return {kind: [[r["step"], r["loss"]] for r in metrics if r["kind"] == kind and "loss" in r]  # eval rows of samples
            for kind in ("train", "eval")}


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The curves side by side: |Δloss| per step (nf4 − bf16 on the same step) and the end of each run."""
    a, b = (dict((int(s), l) for s, l in runs[base]["curves"]["train"]) for base in BASES)
    steps = sorted(set(a) & set(b))
    diffs = [abs(b[s] - a[s]) for s in steps]
    last = steps[-50:]
    ev = [runs[base]["curves"]["eval"] for base in BASES]
    out: dict[str, Any] = {
        "steps_compared": len(steps),
        "mean_abs_diff": statistics.fmean(diffs) if diffs else None,
        "mean_abs_diff_last_50": statistics.fmean(abs(b[s] - a[s]) for s in last) if last else None,
        "max_abs_diff": max(diffs) if diffs else None,
        "first_step_diff": b[steps[0]] - a[steps[0]] if steps else None,
        "final_loss": {base: statistics.fmean(l for _, l in runs[base]["curves"]["train"][-10:])
                       if runs[base]["curves"]["train"] else None for base in BASES},
        "final_eval_loss": {base: e[-1][1] if e else None for base, e in zip(BASES, ev)},
    }
    summaries = {base: runs[base].get("summary", {}) for base in BASES}
    out["tokens_per_s"] = {base: s.get("units_per_s") for base, s in summaries.items()}
    out["peak_gb"] = {base: s.get("peak_gb") for base, s in summaries.items()}
    rates = out["tokens_per_s"]
    out["nf4_vs_bf16_tokens_per_s"] = rates["nf4"] / rates["bf16"] if rates["nf4"] and rates["bf16"] else None
    return out


def markdown(report: dict[str, Any]) -> str:
    c, cmp = report["config"], report["comparison"]
    lines = [f"## QLoRA vs bf16-base LoRA, {c['size']}, {c['steps']} steps of {c['micro_batch']} x {c['seq_len']} "
             f"tokens — {report['gpu'].get('name') or 'cpu'}", "",
             "| base | final loss (last 10) | final eval loss | tokens/s | peak GB |", "|---|---|---|---|---|"]
    for base in BASES:
        lines.append(f"| {base} | {fmt(cmp['final_loss'][base], '.4f')} | {fmt(cmp['final_eval_loss'][base], '.4f')} | "
                     f"{fmt(cmp['tokens_per_s'][base], ',.0f')} | {fmt(cmp['peak_gb'][base], '.1f')} |")
    lines += ["", f"mean |Δloss| over {cmp['steps_compared']} steps: {fmt(cmp['mean_abs_diff'], '.4f')}; over the "
                  f"last 50: {fmt(cmp['mean_abs_diff_last_50'], '.4f')}; largest: {fmt(cmp['max_abs_diff'], '.4f')}; "
                  f"at the first step (the NF4 error of the base alone): {fmt(cmp['first_step_diff'], '+.4f')}",
              f"QLoRA tokens/s against the bf16 base: {fmt(cmp['nf4_vs_bf16_tokens_per_s'], '.2f')}x"]
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any], path: Path) -> Path | None:
    """Both training curves and eval points on one axis; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for base, color in zip(BASES, ("#4a7bb7", "#c0504d")):
        c = report["runs"][base]["curves"]
        if c["train"]:
            ax.plot(*zip(*c["train"]), color=color, linewidth=0.8, label=f"{base} base (train)")
        if c["eval"]:
            ax.plot(*zip(*c["eval"]), "o", color=color, markersize=4, label=f"{base} base (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"QLoRA vs bf16-base LoRA, {report['config']['size']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_curve_arguments(p: argparse.ArgumentParser, size: str, micro_batch: int, lr: float) -> None:
    """The options every shapes-world training-curve bench takes (this one and bench/optimizers.py)."""
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory; default: BPE trained on the world")
    p.add_argument("--size", default=size, help="a registered designer size")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro-batch", type=int, default=micro_batch)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--docs", type=int, default=20000, help="shapes-world samples (train + eval)")
    p.add_argument("--tiny", action="store_true", help="tiny models, fp32, CPU, a few steps: the same path for tests")


def apply_tiny(a: argparse.Namespace) -> None:
    """--tiny's sizes for add_curve_arguments' options, and the dtype and device of either kind of run."""
    if a.tiny:
        a.size, a.steps, a.micro_batch, a.seq_len, a.docs = "tiny", min(a.steps, 12), 2, 128, 200
        a.warmup, a.eval_every, a.lr = 1, 6, 3e-3
    a.dtype, a.device = ("float32", "cpu") if a.tiny else ("bfloat16", "auto")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m atelier_studio.bench.qlora_curve", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--work", default="/tmp/atelier-qlora-curve", help="world, tokenizer, model and runs (kept)")
    add_curve_arguments(p, size="8b", micro_batch=2, lr=2e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--eval-batches", type=int, default=8)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    apply_tiny(a)
    if a.tiny:
        a.eval_batches, a.rank = 2, 4
    if a.steps < 1 or a.micro_batch < 1:
        p.error(f"--steps and --micro-batch must be >= 1 (got {a.steps}, {a.micro_batch})")
    out, work = Path(a.out), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "qlora-curve.log"
    start = time.time()
    report: dict[str, Any] = {**environment(), "command": " ".join([sys.executable, "-m", "bench.qlora_curve",
                                                                     *(argv if argv is not None else sys.argv[1:])]),
                              "config": {k: v for k, v in vars(a).items() if k not in ("out", "work")},
                              "clocks": {"before": clocks()}}
    model = prepare(work, a.size, a.tokenizer, a.docs, a.dtype, log)
    report["runs"] = {}
    for base in BASES:
        run = read_run(train(work, model, base, a, log))
        report["runs"][base] = {"curves": curves(run), "summary": run.get("summary", {})}
    report["comparison"] = compare(report["runs"])
    report["clocks"]["after"] = clocks()
    report["seconds"] = time.time() - start
    stem = f"qlora-curve-{a.size}-{time.strftime('%Y-%m-%d')}"
    path = atomic_write_text(out / f"{stem}.json", json.dumps(report, indent=1), what="benchmark report")
    atomic_write_text(out / f"{stem}.md", markdown(report), what="benchmark report")
    chart(report, out / f"{stem}-curves.png")
    print(markdown(report))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
