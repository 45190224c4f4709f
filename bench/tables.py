"""The README's performance table, rebuilt from the committed reports in bench/results/ (no hand-copied numbers).

    python3 bench/tables.py            print the table
    python3 bench/tables.py --write    replace the README's table between <!-- perf:start --> and <!-- perf:end -->
    python3 bench/tables.py --check    exit 1 if the README's table is not what the reports give

Each row names its report (bench/results/<report>.json) and which of its fields it shows; the row's date is the
report's, and a report measured on another card than the H200 of the README's heading says so in the row.
Rounding: tokens/s to the unit, images/s to 0.01, ratios to 0.01×, MFU to 0.1%, memory to 0.1 GB.
tests/bench/test_tables.py checks that the README holds exactly this table.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
START, END = "<!-- perf:start -->", "<!-- perf:end -->"
HEADER = ("| workload (date) | Atelier | strongest peer, same run | speed-up | MFU |\n"
          "|---|---|---|---|---|")
HOME_CARD = "NVIDIA H200"  # the README's heading names it; a row from another card names its own


def tok(x: float) -> str:
    return f"{x:,.0f}"


def ratio(x: float) -> str:
    return f"{x:.2f}×"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def gb(x: float) -> str:
    return f"{x:.1f} GB"


def best_fp8(r: dict[str, Any]) -> dict[str, Any]:
    """The fastest FP8 recipe's row of a designer report."""
    runs = [v for v in (r.get("fp8") or {}).values() if "tokens_per_s" in v]
    if not runs:
        raise ValueError("the report has no FP8 row")
    return max(runs, key=lambda v: v["tokens_per_s"])


def designer_fp8(r: dict[str, Any], peer: str) -> list[str]:
    """Atelier bf16 and its fastest FP8 recipe against the report's strongest peer."""
    a, f = r["atelier"], best_fp8(r)
    p = r["peers"][r["strongest_peer"]]
    return [f"{tok(a['tokens_per_s'])} tok/s bf16; {tok(f['tokens_per_s'])} FP8",
            f"{peer}: {tok(p['tokens_per_s'])}",
            f"{ratio(r['speedup_vs_strongest_peer'])}; {ratio(f['speedup_vs_strongest_peer'])} FP8",
            f"{pct(a['mfu_4n'])}; {pct(f['mfu_4n'])}"]


def designer_vs(peer_key: str) -> Callable[[dict[str, Any], str], list[str]]:
    """Atelier against the named peer of the report (for reports written before `strongest_peer` existed)."""
    def cells(r: dict[str, Any], peer: str) -> list[str]:
        a, p = r["atelier"], r["peers"][peer_key]
        return [f"{tok(a['tokens_per_s'])} tok/s", f"{peer}: {tok(p['tokens_per_s'])}",
                ratio(a["tokens_per_s"] / p["tokens_per_s"]), pct(a["mfu_4n"])]
    return cells


def imagegen(peer_key: str) -> Callable[[dict[str, Any], str], list[str]]:
    def cells(r: dict[str, Any], peer: str) -> list[str]:
        a, p = r["atelier"], r["peers"][peer_key]
        return [f"{a['images_per_s']:.2f} img/s", f"{peer}: {p['images_per_s']:.2f}", ratio(r["speedup"][peer_key]),
                pct(a["mfu"])]
    return cells


def qlora(micro_batch: int) -> Callable[[dict[str, Any], str], list[str]]:
    def cells(r: dict[str, Any], peer: str) -> list[str]:
        q = r["qlora"]["by_micro_batch"][str(micro_batch)]
        return [f"{tok(q['tokens_per_s'])} tok/s, {gb(q['peak_gb'])} peak",
                f"{peer}: {tok(q['peer_tokens_per_s'])}, {gb(q['peer_peak_gb'])}", ratio(q["vs_peer"]), "—"]
    return cells


def moe_no_peer(oom_reports: tuple[str, ...]) -> Callable[[dict[str, Any], str], list[str]]:
    """Atelier alone, the peer's cell saying it ran out of memory in every one of `oom_reports` (where it ran)."""
    def cells(r: dict[str, Any], peer: str) -> list[str]:
        for name in oom_reports:
            peers = load(name)["peers"]
            if not peers or not all(p.get("oom") for p in peers.values()):
                raise ValueError(f"{name}: the peer did not run out of memory there")
        a = r["atelier"]
        return [f"{tok(a['tokens_per_s'])} tok/s, {gb(a['peak_gb'])}", f"{peer}: out of memory", "—",
                f"{pct(a['mfu_4n'])} (active)"]
    return cells


def designer_memory(r: dict[str, Any], peer: str) -> list[str]:
    """Atelier bf16 against the report's strongest peer, each with its peak memory (the rows about fitting a card)."""
    a, p = r["atelier"], r["peers"][r["strongest_peer"]]
    return [f"{tok(a['tokens_per_s'])} tok/s, {gb(a['peak_gb'])} (micro-batch {a['micro_batch']})",
            f"{peer}: {tok(p['tokens_per_s'])}, {gb(p['peak_gb'])} (micro-batch {p['micro_batch']})",
            f"{ratio(r['speedup_vs_strongest_peer'])}; {same_micro_batch(r, p['micro_batch'], p['tokens_per_s'])}",
            f"{pct(a['mfu_4n'])} (active)"]


def same_micro_batch(r: dict[str, Any], micro_batch: int, peer_tokens_per_s: float) -> str:
    """Atelier's best run at the peer's micro-batch against the peer: the ratio at equal memory pressure."""
    runs = [v["tokens_per_s"] for v in r["atelier_runs"].get(str(micro_batch), {}).values() if "tokens_per_s" in v]
    if not runs:
        return f"no Atelier run at micro-batch {micro_batch}"
    return f"{ratio(max(runs) / peer_tokens_per_s)} at micro-batch {micro_batch}"


@dataclass(frozen=True)
class Row:
    workload: str
    report: str  # bench/results/<report>.json
    peer: str  # the peer's words in the table
    cells: Callable[[dict[str, Any], str], list[str]]


ROWS = (
    Row("Qwen3-8B LoRA r16, packed rows of 2048", "designer-qwen3-8b-lora-2026-12-04",
        "PEFT + Liger, bf16 adapters", designer_fp8),
    Row("Qwen3-8B LoRA r16, packed rows of 2048", "designer-qwen3-8b-lora-2026-12-05",
        "PEFT + Liger, bf16 adapters", designer_fp8),
    Row("Qwen3-1.7B full fine-tuning, rows of 2048", "designer-qwen3-1.7b-full-2026-12-04",
        "transformers + Liger", designer_fp8),
    Row("Qwen3-1.7B full fine-tuning, rows of 2048, micro-batch 8", "designer-qwen3-1.7b-full-mb8-2026-12-05",
        "transformers + Liger", designer_fp8),
    Row("Qwen3.5-9B LoRA r16, packed rows of 2048", "designer-qwen3.5-9b-lora-side-by-side-2026-12-03",
        "PEFT + fla-core (exact-packing peer)", designer_vs("hf-amp")),
    Row("SD3-medium MMDiT full fine-tuning, 1024 px", "imagegen-sd3-medium-1024-sweep-2026-12-03", "diffusers",
        imagegen("diffusers")),
    Row("SD3.5-medium MMDiT-X LoRA r32, 1024 px", "imagegen-sd3.5-medium-1024-lora32-2026-12-04", "diffusers + PEFT",
        imagegen("diffusers")),
    Row("FLUX.1-dev LoRA r16, 1024 px, batch 2, activation checkpointing",
        "imagegen-flux-dev-1024-lora16-ac-2026-12-06", "diffusers + PEFT, gradient checkpointing",
        imagegen("diffusers")),
    Row("Qwen-Image LoRA r16, 1024 px, batch 2, activation checkpointing",
        "imagegen-qwen-image-1024-lora16-ac-2026-12-05", "diffusers + PEFT, gradient checkpointing",
        imagegen("diffusers")),
    Row("Qwen3-8B QLoRA r16 (NF4 base), rows of 2048, micro-batch 1", "designer-qwen3-8b-qlora-2026-12-04",
        "PEFT + bitsandbytes", qlora(1)),
    Row("Qwen3-30B-A3B (MoE) LoRA r16, packed rows of 2048", "designer-qwen3-30b-a3b-lora-mb2-bf16adapters-2026-12-04",
        "transformers + PEFT", moe_no_peer(("designer-qwen3-30b-a3b-lora-mb1-2026-12-04",
                                            "designer-qwen3-30b-a3b-lora-mb2-2026-12-04"))),
    Row("Qwen3-30B-A3B (MoE) LoRA r16, activation checkpointing, packed rows of 2048",
        "designer-qwen3-30b-a3b-lora-ac-2026-12-05", "transformers + PEFT, checkpointing", designer_memory),
)


def load(report: str, results: Path = RESULTS) -> dict[str, Any]:
    return json.loads((results / f"{report}.json").read_text())


def date_of(report: str) -> str:
    """'designer-x-2026-12-04' (or '...-2026-12-04-suffix') → '12-04'."""
    m = re.search(r"-\d{4}-(\d{2}-\d{2})(?:-|$)", report)
    if not m:
        raise ValueError(f"no date in report name {report!r}")
    return m.group(1)


def render_row(row: Row, results: Path = RESULTS) -> str:
    r = load(row.report, results)
    card = (r.get("gpu") or {}).get("name") or "unknown card"
    where = "" if card == HOME_CARD else f", {card.removeprefix('NVIDIA ')}"
    return "| " + " | ".join([f"{row.workload} ({date_of(row.report)}{where})", *row.cells(r, row.peer)]) + " |"


def table(rows: tuple[Row, ...] = ROWS, results: Path = RESULTS) -> str:
    return "\n".join([HEADER, *(render_row(row, results) for row in rows)])


def readme_table(text: str) -> str:
    """What the README holds between the markers (stripped)."""
    if START not in text or END not in text:
        raise ValueError(f"the README has no {START} … {END} block")
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def with_table(text: str, body: str) -> str:
    head, rest = text.split(START, 1)
    return f"{head}{START}\n\n{body}\n\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 bench/tables.py", description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the README's table")
    g.add_argument("--check", action="store_true", help="exit 1 if the README's table differs")
    a = p.parse_args(argv)
    body = table()
    if a.write:
        README.write_text(with_table(README.read_text(), body))
    elif a.check:
        if readme_table(README.read_text()) != body:
            print("README.md's performance table differs from `python3 bench/tables.py`; run it with --write",
                  file=sys.stderr)
            return 1
    else:
        print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
