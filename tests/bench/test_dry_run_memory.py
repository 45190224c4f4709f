"""bench/dry_run_memory.py on the CPU: `train --dry-run`'s memory estimate is within 15% of every peak the GPU
benches measured, the committed comparison and docs/training.md's table are what the committed
reports give, and a report whose run used other settings than the row assumes is refused instead of compared."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from atelier_studio.bench import dry_run_memory
from atelier_studio.bench.dry_run_memory import DATE, DOCS, ROWS, TOLERANCE, docs_table, run, with_docs_table

ROOT = Path(__file__).parents[2]
RESULTS = ROOT / "bench" / "results"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    return run(RESULTS, tmp_path_factory.mktemp("out"))


def test_every_estimate_is_within_15_percent_of_the_measured_peak(result):
    assert [r["name"] for r in result["rows"]] == [row.name for row in ROWS]
    for r in result["rows"]:
        assert abs(r["ratio"] - 1) <= TOLERANCE, (r["name"], r["ratio"], r["terms_gb"], r["measured_peak_gb"])
        assert r["within_15"]


def test_the_committed_comparison_is_what_the_committed_reports_give(result):
    committed = json.loads((RESULTS / f"dry-run-memory-{DATE}.json").read_text())
    assert committed == json.loads(json.dumps(result)), \
        "bench/results/dry-run-memory-*.json is stale: run `python3 -m atelier_studio.bench.dry_run_memory`"
    assert (RESULTS / f"dry-run-memory-{DATE}.md").read_text() == dry_run_memory.markdown(result)
    docs = DOCS.read_text()
    assert with_docs_table(docs, docs_table(result)) == docs, \
        "docs/training.md's dry-run table is stale: run `python3 -m atelier_studio.bench.dry_run_memory --docs`"


def test_a_report_run_with_other_settings_is_refused(tmp_path):
    for row in ROWS:
        shutil.copy(RESULTS / f"{row.report}.json", tmp_path)
    path = tmp_path / f"{ROWS[0].report}.json"
    report = json.loads(path.read_text())
    report["atelier_runs"]["4"]["False"]["variant"]["lora_dtype"] = "float32"
    path.write_text(json.dumps(report))
    with pytest.raises(ValueError, match=r"atelier_runs\.4\.False\.variant\.lora_dtype = 'float32'"):
        run(tmp_path, None)
