"""bench/nf4_linear.py on the CPU: every path runs through the interpreter, agrees with the bf16 product over the
dequantised weight, and the report says from which M the dense path wins."""
import json

import pytest

from atelier_studio.bench.nf4_linear import PATHS, TINY_SHAPES, main


def test_tiny_report_has_every_path_shape_and_direction(tmp_path):
    assert main(["--tiny", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("nf4-linear-*.json")).read_text())
    assert set(report["shapes"]) == set(TINY_SHAPES)
    for shape in report["shapes"].values():
        for direction in ("forward", "backward"):
            assert set(shape[direction]) == {"3", "40"}
            for row in shape[direction].values():
                assert set(row) == set(PATHS)
                for r in row.values():  # fp32 on the CPU: the same Ŵ, sums in another order
                    assert r["ms"] > 0 and r["max_rel_err_vs_bf16"] < 1e-5
            faster = shape[f"{direction}_dense_faster_from_m"]
            assert faster is None or faster in (3, 40)
    assert "dense / fused" in next(tmp_path.glob("nf4-linear-*.md")).read_text()


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        main(["--tiny", "--repeats", "0"])
    with pytest.raises(SystemExit):
        main(["--tiny", "--rows", "a,b"])
