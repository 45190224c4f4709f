"""bench/moe_dispatch.py on the CPU: every move runs through the interpreter beside its plain-PyTorch twin, agrees
with it (fp32: the same sums), and the report names the gather's chosen configuration for each micro-batch."""
import json

import pytest
import torch

from atelier_studio.bench.moe_dispatch import MOVES, TINY_LAYER, main


def test_tiny_report_has_every_move_and_micro_batch(tmp_path):
    assert main(["--tiny", "--repeats", "1", "--micro-batches", "1,3", "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("moe-dispatch-*.json")).read_text())
    res = report["result"]
    assert set(res) == {"1", "3"}
    for mb, row in res.items():
        assert row["tokens"] == int(mb) * TINY_LAYER["seq"]
        assert row["slots"] == row["tokens"] * TINY_LAYER["top_k"]
        for move in MOVES:
            m = row[move]
            assert m["triton_ms"] > 0 and m["torch_ms"] > 0 and m["bytes"] > 0
            assert m["max_rel_diff"] < 1e-5, (mb, move)  # fp32: a wrong row or weight is O(1)
        assert set(row["gather_chosen"]) == {"dispatch_dx", "combine"}
        assert all("BLOCK: 512" in c for c in row["gather_chosen"].values())  # the interpreter's one candidate
    md = next(tmp_path.glob("moe-dispatch-*.md")).read_text()
    assert "| micro-batch | move | Triton ms |" in md and "combine_bwd" in md


def test_bad_arguments_are_named(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        main(["--tiny", "--repeats", "0"])
    if not torch.cuda.is_available():  # a CPU without the interpreter: the fix is named, not Triton's driver error
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(SystemExit):
            main(["--tiny"])
        assert "TRITON_INTERPRET=1" in capsys.readouterr().err
