"""bench/fp8_linear.py at tiny size on the CPU (Triton through the interpreter): every field of the report, the
errors of each variant against fp32, torchao as a peer (or its reason), the diagnostics sections (host cost per
piece, the GPU-time breakdown per variant, the shared-input groups, whole blocks, the quantiser sweep), the
markdown."""
from __future__ import annotations

import json

import pytest

from atelier_studio.bench.fp8_blocks import QWEN_VARIANTS, SD3_VARIANTS
from atelier_studio.bench.fp8_linear import GROUP_VARIANTS, MODELS, REQUIRED, main
from atelier_studio.bench.fp8_parts import FLAVOURS


def test_real_shapes_are_the_models_projections():
    shapes = {p: (m, k, n) for p, m, k, n in MODELS["qwen3-8b"]}
    assert shapes["q"] == (16384, 4096, 4096) and shapes["k"] == (16384, 4096, 1024)
    assert shapes["gate"] == (16384, 4096, 12288) and shapes["down"] == (16384, 12288, 4096)
    sd3 = {p: (m, k, n) for p, m, k, n in MODELS["sd3-medium-1024"]}
    assert sd3["to_q"] == (8 * 4096, 1536, 1536) and sd3["add_q"] == (8 * 333, 1536, 1536)
    assert sd3["ff.up"] == (8 * 4096, 1536, 6144) and sd3["context_embedder"] == (8 * 333, 4096, 1536)


def _report(tmp_path, *args: str) -> dict:
    assert main(["--tiny", "--out", str(tmp_path), "--repeats", "1", *args]) == 0
    return json.loads(next(tmp_path.glob("fp8-linear-*.json")).read_text())


def test_tiny_run_reports_every_variant(tmp_path):
    report = _report(tmp_path, "--sections", "linears", "--models", "qwen3-1.7b,sd3-medium-1024")
    for key in ("gpu", "versions", "clocks", "source", "matmul_tflops_bf16", "matmul_tflops_fp8", "wall_s", "args"):
        assert key in report, key
    assert report["torchao"] or report["torchao_skipped"]
    for model, r in report["sections"]["linears"].items():
        for i, s in enumerate(r["shapes"]):
            v = s["variants"]
            for name in REQUIRED:  # Atelier's own variants always run
                assert "ms" in v[name] and v[name]["host_ms"] > 0, (model, name, v[name])
                e = v[name]["rel_rms_err"]
                # bf16 inputs, fp32 ground truth: bf16 products round at 2^-9; fp8 operands at 2^-4 / 2^-3 (E5M2
                # gradients), a relative RMS error of a few 1e-2 (tests/kernels/test_fp8_linear.py derives it)
                bound = 1e-2 if name.startswith("bf16") else 0.15
                assert 0 < e["y"] < bound and 0 < e["dx"] < bound, (model, name, e)
                assert (e["dw"] is None) == name.endswith("-frozen")
                assert name.startswith("bf16") or e["y"] > 1e-2  # fp8 really quantised
                if i == 0:  # the breakdown (on a CPU at each model's first shape): every GEMM, every quantisation
                    st = v[name]["stages"]
                    gemms = {"y", "dx"} if name.endswith("-frozen") else {"y", "dx", "dw"}
                    assert set(st["gemm_ms"]) == gemms and all(t > 0 for t in st["gemm_ms"].values())
                    quants = set() if name.startswith("bf16") else ({"x", "dy"} if name.endswith("-frozen")
                                                                   else {"x", "w", "dy"})
                    assert set(st["quant_ms"]) == set(st["quant_gbps"]) == quants
            for name in ("torchao-tensorwise", "torchao-rowwise"):
                assert "ms" in v[name] or v[name]["skipped"], name
            if "ms" in v["torchao-tensorwise"]:  # the same recipe written independently: the same error
                ours, theirs = v["fp8-tensorwise"]["rel_rms_err"], v["torchao-tensorwise"]["rel_rms_err"]
                for w in ("y", "dx", "dw"):
                    assert ours[w] == pytest.approx(theirs[w], rel=0.2), (model, s["projections"], w)
            for name in ("fp8-rowwise-fastgrad", "fp8-rowwise-e5m2grad"):  # benchmark recipes: run or a reason
                assert "ms" in v[name] or v[name]["skipped"], name
            assert "torchao-rowwise-compiled" not in v  # --tiny compiles nothing
        assert set(REQUIRED) <= set(r["block_linears_ms"])
    md = next(tmp_path.glob("fp8-linear-*.md")).read_text()
    assert "qwen3-1.7b" in md and "fp8-rowwise-frozen" in md and "One block's linears" in md
    assert "Where the time goes" in md


def test_tiny_run_reports_the_diagnostics(tmp_path):
    report = _report(tmp_path, "--sections", "components,blocks,groups,quant", "--models", "qwen3-1.7b")
    sections = report["sections"]
    comp = sections["components"]
    assert "nn.Linear fwd+bwd (bf16)" in comp and "fp8_linear_group of 3 fwd+bwd (rowwise)" in comp
    assert all(t > 0 for t in comp.values())
    blocks = sections["blocks"]
    for model, variants in (("qwen3-8b", QWEN_VARIANTS), ("sd3-medium", SD3_VARIANTS)):
        assert set(blocks[model]) == set(variants)
        for v in variants:
            assert blocks[model][v]["ms"] > 0 and blocks[model][v]["speedup_vs_bf16"] > 0, (model, v)
    for group in sections["groups"]["qwen3-1.7b"]:
        assert set(group["variants"]) == set(GROUP_VARIANTS)
        assert all(r["ms"] > 0 for r in group["variants"].values()), group
    quant = sections["quant"]
    assert {q["flavour"] for q in quant} == set(FLAVOURS)
    assert all(q["ms"] > 0 and q["eff_gbps"] > 0 for q in quant)
    md = next(tmp_path.glob("fp8-linear-*.md")).read_text()
    assert "Whole blocks" in md and "Shared-input groups" in md and "Quantisers" in md and "Host cost" in md
