"""Add BENCHMARKS.md's head-on-every-token MFU to a designer report written before the bench computed it.

    python3 -m bench.recount bench/results/designer-<config>-<date>.json [--tokenizer DIR]

The report keeps every run's per-step times; the batches are rebuilt exactly as the bench built them (same
config, seed, micro-batch, tokenizer: `--tokenizer` overrides the path in the report's command), so the step
FLOPs are recomputed on the CPU. The recomputed MFU of the report's own count must equal its stored `mfu_4n`
(proof that these are the same batches) before `mfu_4n_head_all` is written, in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from bench.designer import BenchConfig, make_batches, mfu_of, step_flops
from designer.hf import args_from_size


def _flag(command: str, name: str, default: str | None) -> str | None:
    words = shlex.split(command)
    return words[words.index(name) + 1] if name in words else default


def recount(report: dict[str, Any], tokenizer: str | None, warmup: int | None = None,
            steps: int | None = None) -> dict[str, Any]:
    """report with `mfu_4n_head_all` beside every `mfu_4n` of a run that has step times (warmup, steps and
    tokenizer from the report's command unless given)."""
    cmd = report["command"]
    warmup = int(_flag(cmd, "--warmup", "3")) if warmup is None else warmup
    steps = int(_flag(cmd, "--steps", "10")) if steps is None else steps
    tokenizer = tokenizer or _flag(cmd, "--tokenizer", None)
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in report["config"].items() if k in fields})
    args = args_from_size(cfg.size, vocab_size=cfg.vocab_size)
    runs = {mb: [report["sweep"].get(mb)] + [r.get(mb) for r in report["peer_runs"].values()]
            for mb in report["sweep"]}
    for mb, rs in runs.items():
        batches = make_batches(cfg, int(mb), warmup + steps, tokenizer, int(mb))  # the bench's seed + mb, seed 0
        useful, _, head_all = step_flops(cfg, args, batches)
        for r in rs:
            if not r or r.get("oom") or "step_s" not in r:
                continue
            if not math.isclose(mfu_of(useful, r["step_s"], warmup), r["mfu_4n"], rel_tol=1e-9):
                raise ValueError(f"micro-batch {mb}: the rebuilt batches do not give the report's mfu_4n "
                                 f"({mfu_of(useful, r['step_s'], warmup)} vs {r['mfu_4n']}): wrong tokenizer?")
            r["mfu_4n_head_all"] = mfu_of(head_all, r["step_s"], warmup)
    if "atelier" in report:
        report["atelier"]["mfu_4n_head_all"] = report["sweep"][str(report["atelier"]["micro_batch"])]["mfu_4n_head_all"]
    for name, p in report["peers"].items():
        if "micro_batch" in p:
            p["mfu_4n_head_all"] = report["peer_runs"][name][str(p["micro_batch"])]["mfu_4n_head_all"]
    report.setdefault("notes", {})["mfu_4n_head_all"] = ("added by bench/recount.py from the stored step times "
                                                         "(LM head counted on every token, BENCHMARKS.md)")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.recount", description=__doc__.split("\n")[0])
    p.add_argument("report", type=Path)
    p.add_argument("--tokenizer", default=None)
    a = p.parse_args(argv)
    report = recount(json.loads(a.report.read_text()), a.tokenizer)
    a.report.write_text(json.dumps(report, indent=1))
    for name, r in [("atelier", report.get("atelier", {}))] + list(report["peers"].items()):
        if "mfu_4n_head_all" in r:
            print(f"{name}: MFU 4N {r['mfu_4n']:.1%}, head on every token {r['mfu_4n_head_all']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
