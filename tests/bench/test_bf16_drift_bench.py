"""bench/bf16_drift.py at tiny depth on the CPU: both families' four losses, the report, and Atelier's own bf16 drift
bounded (a GPU report's loss difference against diffusers is mostly diffusers' own rounding: docs/performance.md)."""
from __future__ import annotations

import json
import math

from atelier_studio.bench.bf16_drift import main


def test_tiny_report_splits_the_bf16_difference_by_side(tmp_path):
    assert main(["--tiny", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("bf16-drift-tiny-*.json")
    r = json.loads(path.read_text())
    assert set(r["configs"]) == {"flux-dev-1024", "qwen-image-1024"}
    for name, c in r["configs"].items():
        (s,) = c["seeds"]
        assert math.isclose(s["atelier_fp32"], s["diffusers_fp32"], rel_tol=1e-5), name  # the same network in fp32
        assert s["gain"] > 1 and s["atelier_bf16"] != s["atelier_fp32"]  # the bf16 run really ran in bf16
        assert 0 < s["atelier_drift"] < 2e-3, name
        assert math.isfinite(s["diffusers_drift"])
    md = path.with_suffix(".md").read_text()
    assert "| flux-dev-1024 | 4 |" in md and "| qwen-image-1024 | 2 |" in md


def test_bad_options_are_refused(capsys):
    import pytest

    for argv in (["--configs", "sd3-medium-1024"], ["--seeds", "0"], ["--width-heads", "-1"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    assert "--configs" in capsys.readouterr().err
