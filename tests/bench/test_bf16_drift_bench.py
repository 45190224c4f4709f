"""bench/bf16_drift.py at tiny depth on the CPU: both families' four losses, the report, and Atelier's own bf16 drift
bounded (a GPU report's loss difference against diffusers is mostly diffusers' own rounding: docs/performance.md)."""
from __future__ import annotations

import contextlib
import json
import math

import pytest

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


@pytest.mark.parametrize("arg, value", [("--seeds", "0"), ("--seeds", "-2"), ("--seeds", "1" + "0" * 30),
                                        ("--seeds", "abc"), ("--width-heads", "0"), ("--width-heads", "-1"),
                                        ("--width-heads", "99999"), ("--width-heads", "x"),
                                        ("--configs", "sd3-medium-1024")])
def test_bad_options_are_one_line_before_anything_runs(tmp_path, capsys, arg, value):
    with pytest.raises(SystemExit) if value.isalpha() else contextlib.nullcontext() as stopped:
        code = main(["--out", str(tmp_path), arg, value])
    code = stopped.value.code if value.isalpha() else code
    err = capsys.readouterr()
    assert code == 2 and err.out == "" and err.err.count("\n") == 1, err
    assert err.err.startswith("atelier: error:") and arg in err.err and "Traceback" not in err.err
    assert not list(tmp_path.iterdir())  # nothing written
