"""bench/fp8_first_step.py on the CPU (tiny model, the FP8 reference forward): every init × gradient × forward
loss is there, and the report gives how much of the step each forward's view of the weights carries."""
import json
import math

import pytest

from atelier_studio.bench.fp8_first_step import INITS, PRECISIONS, main


def test_tiny_report_has_every_loss_and_share(tmp_path):
    assert main(["--tiny", "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("fp8-first-step-*.json")).read_text())
    res = report["result"]
    assert set(res) == set(INITS)
    for init, r in res.items():
        assert set(r["loss_before_step"]) == set(PRECISIONS)
        assert set(r["after_step"]) == set(PRECISIONS)
        for grads, a in r["after_step"].items():
            assert all(math.isfinite(v) for v in a["loss"].values()), (init, grads)
            seen = a["update_seen"]
            assert all(math.isfinite(v) for v in seen.values()), (init, grads)
            assert 0.0 <= seen["bf16_elements_changed"] <= 1.0
    md = next(tmp_path.glob("fp8-first-step-*.md")).read_text()
    assert "| init | gradients |" in md and "bf16-grid" in md


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        main(["--tiny", "--lr", "0"])
    assert "--lr" in capsys.readouterr().err
