"""Add the head-on-every-token MFU (docs/mfu.md) to a designer report written before the bench computed it.

    python3 -m atelier_studio.bench.recount bench/results/designer-<config>-<date>.json [--tokenizer DIR]

The report keeps every run's per-step times; the batches are rebuilt exactly as the bench built them (same
config, seed, micro-batch, tokenizer: `--tokenizer` says where the report's tokenizer is on this machine), so
the step FLOPs are recomputed on the CPU. The recomputed MFU of the report's own count must equal its stored
`mfu_4n` (for packed rows, proof that these are the same batches) before `mfu_4n_head_all` is written, in
place, and the markdown's result table is rewritten beside it (notes under it stay).
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

from atelier_studio.bench.designer import BenchConfig, make_batches, markdown, mfu_of, parser, step_flops
from atelier_studio.bench.designer_peers import parse_peer
from atelier_studio.designer.hf import args_from_size
from atelier_studio.pipeline.atomic import atomic_write_text


def run_settings(report: dict[str, Any]) -> dict[str, Any]:
    """warmup, steps, seed and tokenizer of the run: recorded in the report ("run") since the bench wrote them;
    before that, the report's command read back through the bench's own parser (argparse: the last of a
    repeated flag wins) and bench()'s seed, 0."""
    if "run" in report:
        return dict(report["run"])
    a, _ = parser().parse_known_args(shlex.split(report["command"])[1:])
    return {"warmup": a.warmup, "steps": a.steps, "seed": 0, "tokenizer": a.tokenizer}


def recount(report: dict[str, Any], tokenizer: str | None = None, warmup: int | None = None,
            steps: int | None = None) -> dict[str, Any]:
    """report with `mfu_4n_head_all` beside every `mfu_4n` of a run that has step times (the run's settings
    from run_settings unless given; `tokenizer`: where the tokenizer is on this machine)."""
    run = run_settings(report)
    warmup = run["warmup"] if warmup is None else warmup
    steps = run["steps"] if steps is None else steps
    tokenizer = tokenizer or run["tokenizer"]
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in report["config"].items() if k in fields})
    args = args_from_size(cfg.size, vocab_size=cfg.vocab_size)
    packed_peers = [r for name, r in report["peer_runs"].items() if not parse_peer(name).one_doc]  # Atelier's rows
    runs = {mb: [report["sweep"].get(mb)] + [r.get(mb) for r in packed_peers] for mb in report["sweep"]}
    for mb, rs in runs.items():
        batches = make_batches(cfg, int(mb), warmup + steps, tokenizer, run["seed"] + int(mb))  # as bench() does
        useful, _, head_all = step_flops(cfg, args, batches)
        for r in rs:
            if not r or r.get("oom") or "step_s" not in r:
                continue
            if len(r["step_s"]) != warmup + steps:
                raise ValueError(f"micro-batch {mb}: {len(r['step_s'])} step times, but warmup {warmup} + steps "
                                 f"{steps} were read from the report")
            if not math.isclose(mfu_of(useful, r["step_s"], warmup), r["mfu_4n"], rel_tol=1e-9):
                raise ValueError(f"micro-batch {mb}: the rebuilt batches do not give the report's mfu_4n "
                                 f"({mfu_of(useful, r['step_s'], warmup)} vs {r['mfu_4n']}): wrong tokenizer?")
            r["mfu_4n_head_all"] = mfu_of(head_all, r["step_s"], warmup)
    if "atelier" in report:
        report["atelier"]["mfu_4n_head_all"] = report["sweep"][str(report["atelier"]["micro_batch"])]["mfu_4n_head_all"]
    for name, p in report["peers"].items():
        if "micro_batch" in p and not parse_peer(name).one_doc:
            p["mfu_4n_head_all"] = report["peer_runs"][name][str(p["micro_batch"])]["mfu_4n_head_all"]
    report.setdefault("notes", {})["mfu_4n_head_all"] = ("added by bench/recount.py from the stored step times "
                                                         "(LM head counted on every token, docs/mfu.md)")
    return report


def replace_table(old_md: str, new_md: str) -> str:
    """old_md with its result table (the lines from "| run |" to the first non-table line) taken from new_md:
    notes written under a report by hand stay."""
    def span(lines: list[str]) -> tuple[int, int]:
        i = next(k for k, line in enumerate(lines) if line.startswith("| run |"))
        j = i
        while j < len(lines) and lines[j].startswith("|"):
            j += 1
        return i, j

    old, new = old_md.splitlines(), new_md.splitlines()
    (oi, oj), (ni, nj) = span(old), span(new)
    return "\n".join(old[:oi] + new[ni:nj] + old[oj:]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m atelier_studio.bench.recount", description=__doc__.split("\n")[0])
    p.add_argument("report", type=Path)
    p.add_argument("--tokenizer", default=None)
    a = p.parse_args(argv)
    report = recount(json.loads(a.report.read_text()), a.tokenizer)
    atomic_write_text(a.report, json.dumps(report, indent=1), what="benchmark report")  # a committed file: never torn
    md = a.report.with_suffix(".md")
    atomic_write_text(md, replace_table(md.read_text(), markdown(report)) if md.exists() else markdown(report),
                      what="benchmark report")
    for name, r in [("atelier", report.get("atelier", {}))] + list(report["peers"].items()):
        if "mfu_4n_head_all" in r:
            print(f"{name}: MFU 4N {r['mfu_4n']:.1%}, head on every token {r['mfu_4n_head_all']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
