"""bench/fp8_linear.py at tiny size on the CPU (Triton through the interpreter): every field of the report, the
errors of each variant against fp32, torchao as a peer (or its reason), the markdown."""
from __future__ import annotations

import json

import pytest

from atelier_studio.bench.fp8_linear import MODELS, REQUIRED, main


def test_real_shapes_are_the_models_projections():
    shapes = {p: (m, k, n) for p, m, k, n in MODELS["qwen3-8b"]}
    assert shapes["q"] == (16384, 4096, 4096) and shapes["k"] == (16384, 4096, 1024)
    assert shapes["gate"] == (16384, 4096, 12288) and shapes["down"] == (16384, 12288, 4096)
    sd3 = {p: (m, k, n) for p, m, k, n in MODELS["sd3-medium-1024"]}
    assert sd3["to_q"] == (8 * 4096, 1536, 1536) and sd3["add_q"] == (8 * 333, 1536, 1536)
    assert sd3["ff.up"] == (8 * 4096, 1536, 6144) and sd3["context_embedder"] == (8 * 333, 4096, 1536)


def test_tiny_run_reports_every_variant(tmp_path):
    assert main(["--tiny", "--out", str(tmp_path), "--repeats", "1", "--models", "qwen3-1.7b,sd3-medium-1024"]) == 0
    report = json.loads(next(tmp_path.glob("fp8-linear-*.json")).read_text())
    for key in ("gpu", "versions", "clocks", "source", "matmul_tflops_bf16", "matmul_tflops_fp8", "wall_s"):
        assert key in report, key
    assert report["torchao"] or report["torchao_skipped"]
    for model, r in report["models"].items():
        for s in r["shapes"]:
            v = s["variants"]
            for name in REQUIRED:  # Atelier's own variants always run
                assert "ms" in v[name], (model, name, v[name])
                e = v[name]["rel_rms_err"]
                # bf16 inputs, fp32 ground truth: bf16 products round at 2^-9; fp8 operands at 2^-4 / 2^-3 (E5M2
                # gradients), a relative RMS error of a few 1e-2 (tests/kernels/test_fp8_linear.py derives it)
                bound = 1e-2 if name.startswith("bf16") else 0.15
                assert 0 < e["y"] < bound and 0 < e["dx"] < bound, (model, name, e)
                assert (e["dw"] is None) == name.endswith("-frozen")
                assert name.startswith("bf16") or e["y"] > 1e-2  # fp8 really quantised
            for name in ("torchao-tensorwise", "torchao-rowwise"):
                assert "ms" in v[name] or v[name]["skipped"], name
            if "ms" in v["torchao-tensorwise"]:  # the same recipe written independently: the same error
                ours, theirs = v["fp8-tensorwise"]["rel_rms_err"], v["torchao-tensorwise"]["rel_rms_err"]
                for w in ("y", "dx", "dw"):
                    assert ours[w] == pytest.approx(theirs[w], rel=0.2), (model, s["projections"], w)
            assert "torchao-rowwise-compiled" not in v  # --tiny compiles nothing
        assert set(REQUIRED) <= set(r["block_linears_ms"])
    md = next(tmp_path.glob("fp8-linear-*.md")).read_text()
    assert "qwen3-1.7b" in md and "fp8-rowwise-frozen" in md and "One block's linears" in md
