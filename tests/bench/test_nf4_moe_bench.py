"""bench/nf4_moe.py on the CPU: both the bf16 and the NF4 experts run forward and backward through the interpreter,
agree (the same grouped GEMMs on the same values), and the report has every micro-batch."""
import json

import pytest

from atelier_studio.bench.nf4_moe import TINY_LAYER, main


def test_tiny_report_has_both_paths_and_every_micro_batch(tmp_path):
    assert main(["--tiny", "--repeats", "1", "--micro-batches", "1,3", "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("nf4-moe-*.json")).read_text())
    res = report["result"]
    assert set(res["by_micro_batch"]) == {"1", "3"}
    for mb, row in res["by_micro_batch"].items():
        assert row["slots"] == int(mb) * TINY_LAYER["seq"] * TINY_LAYER["top_k"]
        assert row["bf16"]["ms"] > 0 and row["nf4"]["ms"] > 0 and row["dequantise_ms"] > 0
        assert row["max_rel_diff"] < 1e-5  # fp32: the same values through the same kernels
    # 0.516 bytes per weight (plus each expert's factor and mean, and the code) against 4 (fp32 here)
    assert 0.129 < res["nf4_stacks_mb"] / res["bf16_stacks_mb"] < 0.14
    md = next(tmp_path.glob("nf4-moe-*.md")).read_text()
    assert "| micro-batch | slots | bf16 ms | NF4 ms |" in md


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        main(["--tiny", "--repeats", "0"])
