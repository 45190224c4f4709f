"""bench/qlora_curve.py at tiny size on the CPU: both runs through the real CLI, the report's fields and curves,
and a second call that reuses every finished stage."""
from __future__ import annotations

import json
import math

import pytest

from atelier_studio.bench.qlora_curve import BASES, main

pytestmark = pytest.mark.slow  # two CLI training runs and their setup: about a minute on 2 cores


def test_tiny_curves_report_and_resumable_stages(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    assert main(["--tiny", "--out", str(out), "--work", str(work)]) == 0
    (path,) = out.glob("qlora-curve-tiny-*.json")
    assert path.with_suffix(".md").is_file()
    r = json.loads(path.read_text())
    for key in ("gpu", "versions", "clocks", "config", "runs", "comparison", "command"):
        assert key in r, key
    for base in BASES:
        c = r["runs"][base]["curves"]
        assert [s for s, _ in c["train"]] == list(range(1, 13)), base
        assert [s for s, _ in c["eval"]] == [6, 12], base
        losses = [l for _, l in c["train"]]
        assert all(math.isfinite(l) for l in losses)
        assert sum(losses[-3:]) < sum(losses[:3]), (base, losses)  # both learn
        assert r["runs"][base]["summary"]["units_per_s"] > 0
    cmp = r["comparison"]
    assert cmp["steps_compared"] == 12
    # the same start (B = 0, the same draws): the first step differs only by the base's NF4 error, then the curves
    # stay together (a tenth of the loss's scale is far above NF4's effect and far below a broken run's)
    assert cmp["first_step_diff"] != 0.0
    assert 0.0 < cmp["mean_abs_diff"] < 0.1 * cmp["final_loss"]["bf16"]
    assert set(cmp["final_eval_loss"]) == set(BASES) and cmp["nf4_vs_bf16_tokens_per_s"] > 0
    config = (work / "run-tiny-nf4" / "config.toml").read_text()
    assert 'base_dtype = "nf4"' in config
    # a second call finds every stage done: the runs are read again, not repeated
    stamp = (work / "run-tiny-nf4" / "summary.json").stat().st_mtime_ns
    assert main(["--tiny", "--out", str(out), "--work", str(work)]) == 0
    assert (work / "run-tiny-nf4" / "summary.json").stat().st_mtime_ns == stamp
    assert json.loads(path.read_text())["comparison"]["mean_abs_diff"] == cmp["mean_abs_diff"]
