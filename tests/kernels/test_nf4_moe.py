"""kernels/nf4_moe.py: NF4 expert stacks. The Triton dequantiser equals kernels/nf4.py's bit for bit; the stack format
is kernels/nf4.py's row layout where in_features allow it; the MoE over NF4 experts gives the output and every
gradient (x, router, each adapter's A and B) of the same MoE over the dequantised weights as plain tensors; no
dequantised weight is kept for the backward; and, on a GPU, the same in bf16.

Tolerances. The NF4 path and the tensor path over Ŵ run the same grouped GEMMs on the same values (Ŵ is the
reference's bit for bit) in the same order, so they agree to fp32 rounding: assert_within_rounding with the
chain of reductions of tests/kernels/test_moe.py (D + F + k for the output; + N·k for a gradient). Against moe_ref
(fp32 expert loop, index_add) on Ŵ the same bound holds, as in test_moe.py. A wrong expert, a missing or doubled
term, or a weight off by one NF4 level (~10% of a block's absmax) is far outside.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from atelier_studio.kernels.moe import ExpertLoRA, _groupable, moe, moe_ref
from atelier_studio.kernels.nf4 import dequantize_nf4, nf4_error_bound, quantize_nf4
from atelier_studio.kernels.nf4_moe import (
    NF4GroupedMM,
    dequantize_experts_ref,
    nf4_experts_shapes,
    nf4_grouped_mm_ref,
    quantize_experts,
)

from tests.kernels._compare import assert_within_rounding

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _stack(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.05).to(device, dtype)


# (E, O, I): one expert of one block; I = 32 (blocks cross rows: Qwen3-MoE-tiny's down_proj); odd O with I a
# multiple of 64; 260 blocks per expert (two scale groups, the second short)
STACKS = [(1, 2, 32), (3, 24, 32), (5, 7, 192), (2, 130, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", STACKS, ids=lambda s: "x".join(map(str, s)))
def test_triton_dequantiser_equals_the_reference_bit_for_bit(shape, dtype):
    """The kernel rounds every step to W's dtype as dequantize_nf4 does (q / f correctly rounded): equal exactly.
    (fp16 stands in for bf16 on the CPU: Triton's interpreter computes bf16 wrongly; the GPU test covers bf16.)"""
    w = quantize_experts(_stack(shape, dtype, seed=sum(shape)), kernels="triton")
    assert {k: tuple(getattr(w, k).shape) for k in ("data", "scalers", "factor", "mean", "code")} == \
        nf4_experts_shapes(shape)
    got, want = w.dequantize(), dequantize_experts_ref(w)
    assert got.dtype == want.dtype == dtype and got.shape == shape
    assert torch.equal(got, want)
    assert torch.equal(w.dequantize(torch.float64), want.double())  # out_dtype: one cast after W's roundings


def test_each_expert_is_kernels_nf4_format_of_its_own_matrix():
    """Where I is a multiple of 64, expert e's bytes, scalers, factor and mean are quantize_nf4 of W[e] alone (its
    row layout, i.e. torchao's NF4Tensor of that matrix); and experts do not share scales (a stack whose experts
    differ in size by 100× quantises each at its own resolution)."""
    w = _stack((3, 24, 128), torch.float32, seed=1)
    w[1] *= 100
    q = quantize_experts(w)
    for e in range(3):
        one = quantize_nf4(w[e])
        assert torch.equal(q.data[e].view(24, 64), one.data) and torch.equal(q.scalers[e].view(24, 2), one.scalers)
        assert torch.equal(q.factor[e], one.factor) and torch.equal(q.mean[e], one.mean)
        assert torch.equal(dequantize_experts_ref(q)[e], dequantize_nf4(one))
        # within the format's bound from this expert's own block maxima (a scale shared with the 100× expert
        # would make the int8 step 1/f 100× coarser for the others)
        assert ((dequantize_experts_ref(q)[e] - w[e]).abs() <= nf4_error_bound(one, w[e])).all()


def _inputs(n, d, e, f, r, seed, device=DEV, dtype=torch.float32):
    """x, router and NF4-representable expert stacks (their values are their own dequantisation), LoRA on every
    projection with non-zero B; the NF4Experts of the stacks."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(device, dtype)  # noqa: E731
    t = dict(x=rnd(n, d), router=rnd(e, d, scale=d ** -0.5))
    if r:
        t.update(ga=rnd(e, r, d, scale=d ** -0.5), gb=rnd(e, f, r, scale=0.3), ua=rnd(e, r, d, scale=d ** -0.5),
                 ub=rnd(e, f, r, scale=0.3), da=rnd(e, r, f, scale=f ** -0.5), db=rnd(e, d, r, scale=0.3))
    kernels = "triton"
    gate_up = quantize_experts(rnd(e, 2 * f, d, scale=d ** -0.5), kernels)
    down = quantize_experts(rnd(e, d, f, scale=f ** -0.5), kernels)
    return {k: v.requires_grad_() for k, v in t.items()}, gate_up, down


def _run(t, gate_up, down, top_k, impl, dy_seed=7):
    lora = ExpertLoRA(0.5, (t["ga"], t["gb"]), (t["ua"], t["ub"]), (t["da"], t["db"])) if "ga" in t else None
    if impl == "moe_ref":
        out, routing = moe_ref(t["x"], t["router"], gate_up, down, top_k, True, lora)
    else:
        out, routing = moe(t["x"], t["router"], gate_up, down, top_k, True, lora, impl=impl)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(dy_seed), dtype=torch.float64).to(out)
    grads = torch.autograd.grad((out * dy).sum(), list(t.values()))
    return out, routing, dict(zip(t, grads))


SHAPES = [  # (N, D, E, F, k, rank): one token on one expert; F = 6 (each expert's down_proj: 3 blocks, rows of 6);
    (1, 64, 1, 32, 1, 0),  # a prime token count with k = E; 16-byte aligned shapes (torch._grouped_mm where the
    (17, 32, 3, 6, 3, 2),  # CPU torch has it) and not (the per-expert loop)
    (37, 64, 8, 32, 2, 4),
    (29, 96, 6, 20, 4, 8),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_nf4_experts_equal_the_moe_over_their_dequantised_weights(shape):
    n, d, e, f, k, r = shape
    t, gate_up, down = _inputs(n, d, e, f, r, seed=n + d + f)
    calls = []
    real = NF4GroupedMM.apply
    NF4GroupedMM.apply = lambda *a: calls.append(1) or real(*a)
    try:
        got, routing, g_got = _run(t, gate_up, down, k, "triton")
    finally:
        NF4GroupedMM.apply = real
    assert len(calls) == 2  # gate_up and down ran as NF4 grouped GEMMs
    plain = (gate_up.dequantize(), down.dequantize())
    want, routing_plain, g_want = _run(t, *plain, k, "triton")
    assert torch.equal(routing.experts, routing_plain.experts)
    assert_within_rounding(got, want, "out vs the tensor path on Ŵ", torch.float32, d + f + k)
    for name in t:
        assert_within_rounding(g_got[name], g_want[name], f"d{name} vs the tensor path on Ŵ", torch.float32,
                               d + f + n * k)
    ref, _, g_ref = _run(t, *plain, k, "moe_ref")
    assert_within_rounding(got, ref, "out vs moe_ref on Ŵ", torch.float32, d + f + k)
    for name in t:
        assert_within_rounding(g_got[name], g_ref[name], f"d{name} vs moe_ref on Ŵ", torch.float32, d + f + n * k)
    # the reference path (impl "ref", the CPU's default) dequantises and runs moe_ref: the same numbers exactly
    same, _, g_same = _run(t, gate_up, down, k, "ref")
    assert torch.equal(same, ref) and all(torch.equal(g_same[n_], g_ref[n_]) for n_ in t)


def _saved_bytes(fn) -> tuple[int, list[tuple[tuple[int, ...], torch.dtype]]]:
    """Run fn() recording every tensor autograd saves for the backward: (float bytes in all, their shapes)."""
    seen = []

    def pack(x):
        seen.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    floats = [x for x in seen if x.is_floating_point()]
    return sum(x.numel() * x.element_size() for x in floats), [(tuple(x.shape), x.dtype) for x in floats], out


def test_no_dequantised_expert_weight_is_saved_for_the_backward():
    """Every tensor saved for the backward (through saved_tensors_hooks, which see custom Functions' saves too):
    the NF4 path keeps no float tensor of a stack's size; the same MoE over the weights as tensors keeps both (so
    the check can fail), and the NF4 path's saved float bytes are the tensor path's less the weights. Its backward works
    afterwards (the weights are dequantised again)."""
    n, d, e, f, k, r = 23, 64, 4, 32, 2, 4
    t, gate_up, down = _inputs(n, d, e, f, r, seed=3)
    stacks = {(e, 2 * f, d), (e, d, f), (e, d, 2 * f), (e, f, d)}  # either stack, or its transpose

    def run(gu, dn):
        lora = ExpertLoRA(0.5, (t["ga"], t["gb"]), (t["ua"], t["ub"]), (t["da"], t["db"]))
        return moe(t["x"], t["router"], gu, dn, k, True, lora, impl="triton")[0]

    nf4_bytes, nf4_shapes, out = _saved_bytes(lambda: run(gate_up, down))
    assert not any(s in stacks for s, _ in nf4_shapes), nf4_shapes
    plain_bytes, plain_shapes, _ = _saved_bytes(lambda: run(gate_up.dequantize(), down.dequantize()))
    assert sum(s in stacks for s, _ in plain_shapes) >= 2, plain_shapes  # the positive control
    # everything else is the same graph: the NF4 path saves exactly the fp32 weights less, and its small float
    # tensors (factor, mean, code of each stack) more
    weights = e * 3 * f * d * 4
    small = sum(t_.numel() * t_.element_size() for w in (gate_up, down) for t_ in (w.factor, w.mean, w.code))
    assert nf4_bytes == plain_bytes - weights + small, (plain_bytes, nf4_bytes, weights, small)
    grads = torch.autograd.grad(out.sum(), [t["x"], t["ga"]])
    assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in grads)


def test_the_grouped_gemm_equals_its_reference_and_skips_empty_experts():
    """NF4GroupedMM against nf4_grouped_mm_ref (autograd through grouped_mm on Ŵ): forward and da, experts 1 and 3
    with no rows."""
    w = quantize_experts(_stack((4, 48, 64), torch.float32, seed=5), kernels="triton")
    offs = torch.tensor([3, 3, 10, 10], dtype=torch.int32)
    a = _stack((10, 64), torch.float32, seed=6).requires_grad_()
    got = w.grouped_mm(a, offs)
    want = nf4_grouped_mm_ref(a, w, offs)
    assert_within_rounding(got, want, "y", torch.float32, 64)
    dy = _stack(got.shape, torch.float32, seed=7)
    (ga,), (gw,) = torch.autograd.grad(got, a, dy), torch.autograd.grad(want, a, dy)
    assert_within_rounding(ga, gw, "da", torch.float32, 48)
    assert _groupable(dy, dequantize_experts_ref(w).transpose(1, 2)) == hasattr(torch, "_grouped_mm")


def test_a_stack_whose_experts_are_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_experts(torch.randn(2, 3, 7))
    with pytest.raises(ValueError, match=r"\[E, O, I\]"):
        quantize_experts(torch.randn(64, 64))


# --- GPU: bf16 at a small shape (fast tier) -------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_nf4_experts_on_the_gpu():
    """bf16 on the GPU (the compiled dequantiser, torch._grouped_mm): the dequantiser equals dequantize_nf4 bit for
    bit, and the MoE over NF4 experts gives the output and every gradient of the same MoE over Ŵ as bf16 tensors
    (the same grouped GEMMs on the same values: bf16 rounding of the output, 2^-8 of each value's scale, allowed
    twice over the chain of three reductions; a wrong expert or a missing term is O(1)); no host sync in either
    direction."""
    n, d, e, f, k, r = 512, 256, 16, 128, 4, 16
    t, gate_up, down = _inputs(n, d, e, f, r, seed=11, device="cuda", dtype=torch.bfloat16)
    for w in (gate_up, down):
        assert torch.equal(w.dequantize(), dequantize_experts_ref(w))
        assert dataclasses.replace(w, kernels="auto").dequantize().dtype == torch.bfloat16
    assert _groupable(t["x"].detach(), gate_up.dequantize())
    got, _, g_got = _run(t, gate_up, down, k, "triton")
    want, _, g_want = _run(t, gate_up.dequantize(), down.dequantize(), k, "triton")
    for what, a, b in [("out", got, want)] + [(f"d{x}", g_got[x], g_want[x]) for x in t]:
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err <= 1e-2, f"{what}: norm-relative error {err:.2e}"
    torch.cuda.synchronize()
    dy = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora = ExpertLoRA(0.5, (t["ga"], t["gb"]), (t["ua"], t["ub"]), (t["da"], t["db"]))
        out, _ = moe(t["x"], t["router"], gate_up, down, k, True, lora, impl="triton")
        grads = torch.autograd.grad((out * dy).sum(), list(t.values()))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(g).all() for g in grads)
