"""bench/causal_conv1d.py on the CPU: the sweep runs through Triton's interpreter and every backward is exact."""
import json

import pytest

import atelier_studio.kernels.causal_conv1d as cc
from atelier_studio.bench.causal_conv1d import TINY, main, packed_inputs


def test_packed_inputs_fill_the_tokens_with_documents():
    import torch

    x, w, dy, cu = packed_inputs(TINY, torch.device("cpu"), torch.float32)
    assert x.shape == dy.shape == (TINY["tokens"], TINY["channels"]) and w.shape == (TINY["channels"], TINY["taps"])
    lens = (cu[1:] - cu[:-1]).tolist()
    assert cu[0] == 0 and cu[-1] == TINY["tokens"] and len(lens) > 2 and min(lens) >= 1


def test_tiny_sweep_is_exact_and_restores_the_default(tmp_path):
    default = cc._BWD_PROGRAMS_PER_SM, cc._BWD_DEFER_DW
    assert main(["--tiny", "--programs", "1,3", "--repeats", "1", "--out", str(tmp_path)]) == 0
    assert (cc._BWD_PROGRAMS_PER_SM, cc._BWD_DEFER_DW) == default
    report = json.loads(next(tmp_path.glob("causal-conv1d-*.json")).read_text())
    assert set(report["backward"]) == {"1", "3", "1 deferred dw", "3 deferred dw"} and report["forward_ms"] > 0
    for r in report["backward"].values():
        assert r["dx_err"] < 1e-5 and r["dw_err"] < 1e-5
    assert report["backward_frozen_weight"]["dx_err"] < 1e-5 and report["backward_frozen_weight"]["ms"] > 0


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        main(["--tiny", "--repeats", "0"])
    with pytest.raises(SystemExit):
        main(["--tiny", "--programs", "a,b"])
