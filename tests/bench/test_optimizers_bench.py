"""bench/optimizers.py at tiny size on the CPU: the designer part through the real CLI for AdamW and Muon, the
report's table and curves, and a second call that reuses every finished run. (The imagegen part is bench/scaling.py's
setup and the same CLI runs; its tiny run, by hand: `python -m atelier_studio.bench.optimizers --tiny`.)"""
from __future__ import annotations

import json
import math

import pytest

from atelier_studio.bench.optimizers import main

pytestmark = pytest.mark.slow  # two CLI training runs and the world, tokenizer and model: a minute or two on 2 cores


def test_tiny_report_for_two_optimizers(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--tiny", "--out", str(out), "--work", str(work), "--optimizers", "adamw,muon", "--parts", "designer"]
    assert main(argv) == 0
    (path,) = out.glob("optimizers-designer-tiny-*.json")
    r = json.loads(path.read_text())
    designer = r["parts"]["designer"]
    assert "imagegen" not in r["parts"]
    for name in ("adamw", "muon"):
        train = designer["runs"][name]["curves"]["train"]
        assert [s for s, _ in train] == list(range(1, 13)) and all(math.isfinite(l) for _, l in train), name
    assert designer["comparison"]["muon"]["mean_abs_diff_vs_adamw"] > 0  # another optimizer, another curve
    assert 'optimizer = "muon"' in (work / "designer-tiny-muon" / "config.toml").read_text()
    md = path.with_suffix(".md").read_text()
    assert "| muon |" in md and "SD3-medium" not in md
    stamp = (work / "designer-tiny-muon" / "summary.json").stat().st_mtime
    assert main(argv) == 0  # every run found finished: read again, not repeated
    assert (work / "designer-tiny-muon" / "summary.json").stat().st_mtime == stamp


def test_a_failed_run_reports_the_clis_error_line(tmp_path):
    """A run the CLI refused (here: an optimizer whose package is missing) shows its one-line error in the table."""
    from atelier_studio.bench.optimizers import _failure, compare_designer, markdown

    log = tmp_path / "optimizers.log"
    log.write_text("$ atelier designer train ...\natelier: error: train.optimizer = 'prodigy' needs prodigyopt\n\n")
    failed = _failure(2, log)
    assert failed == {"code": 2, "error": "atelier: error: train.optimizer = 'prodigy' needs prodigyopt"}
    report = {"gpu": {}, "config": {"size": "tiny", "steps": 1, "micro_batch": 1, "seq_len": 8},
              "parts": {"designer": {"comparison": compare_designer({"prodigy": failed})}}}
    assert "| prodigy | — | — | — | — | — | exit 2: atelier: error: train.optimizer = 'prodigy' needs prodigyopt" \
        in markdown(report)
