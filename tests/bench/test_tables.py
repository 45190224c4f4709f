"""bench/tables.py on the CPU: the README's performance table is exactly what the committed reports give, and the
generator's pieces (the fastest FP8 recipe, the card named when it is not the H200, the marker block) do what they
say."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from atelier_studio.bench import tables
from atelier_studio.bench.tables import Row, date_of, designer_fp8, readme_table, render_row, table, with_table

ROOT = Path(__file__).parents[2]


def test_the_readme_table_is_what_the_committed_reports_give():
    text = (ROOT / "README.md").read_text()
    assert readme_table(text) == table(results=ROOT / "bench" / "results"), \
        "README.md's performance table is stale: run `python3 bench/tables.py --write`"


def test_every_row_names_a_committed_report_with_a_date():
    for row in tables.ROWS:
        assert (ROOT / "bench" / "results" / f"{row.report}.json").is_file(), row.report
        assert len(date_of(row.report)) == 5


def _designer_report(card: str) -> dict:
    run = {"tokens_per_s": 1000.0, "mfu_4n": 0.25}
    return {"gpu": {"name": card}, "atelier": run, "strongest_peer": "p", "speedup_vs_strongest_peer": 1.25,
            "peers": {"p": {"tokens_per_s": 800.0}},
            "fp8": {"rowwise": {"tokens_per_s": 1200.0, "mfu_4n": 0.3, "speedup_vs_strongest_peer": 1.5},
                    "tensorwise": {"tokens_per_s": 1300.4, "mfu_4n": 0.325, "speedup_vs_strongest_peer": 1.627}}}


def test_a_row_shows_the_fastest_fp8_recipe_and_names_a_card_other_than_the_h200(tmp_path):
    (tmp_path / "designer-x-2026-12-05.json").write_text(json.dumps(_designer_report("NVIDIA H100 80GB HBM3")))
    (tmp_path / "designer-y-2026-12-05.json").write_text(json.dumps(_designer_report("NVIDIA H200")))
    h100 = render_row(Row("X", "designer-x-2026-12-05", "peer", designer_fp8), tmp_path)
    h200 = render_row(Row("Y", "designer-y-2026-12-05", "peer", designer_fp8), tmp_path)
    assert h100 == ("| X (12-05, H100 80GB HBM3) | 1,000 tok/s bf16; 1,300 FP8 | peer: 800 | 1.25×; 1.63× FP8 "
                    "| 25.0%; 32.5% |")
    assert h200.startswith("| Y (12-05) | ")


def test_the_marker_block_is_replaced_and_nothing_else():
    text = "intro\n<!-- perf:start -->\nold\n<!-- perf:end -->\nafter\n"
    new = with_table(text, "| a |")
    assert new == "intro\n<!-- perf:start -->\n\n| a |\n\n<!-- perf:end -->\nafter\n"
    assert readme_table(new) == "| a |"
    with pytest.raises(ValueError):
        readme_table("no markers")


def test_same_micro_batch_ratio_uses_atelier_s_best_run_at_the_peer_s_micro_batch():
    r = {"atelier_runs": {"1": {"False": {"tokens_per_s": 300.0}, "True": {"tokens_per_s": 400.0}},
                          "2": {"False": {"oom": True}}}}
    assert tables.same_micro_batch(r, 1, 200.0) == "2.00× at micro-batch 1"
    assert tables.same_micro_batch(r, 2, 200.0) == "no Atelier run at micro-batch 2"
