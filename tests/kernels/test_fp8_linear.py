"""FP8 linears: the Triton quantisers against torch's cast (scales bit-equal on every device, every launch
configuration the same bits), every Function's output and gradient against the fake-quantised reference, the
16-multiple fallback, dW over a token count off 16 equal to dW over the zero-padded tokens, no dW for frozen bases,
the error against fp32, the device check; on a GPU the _scaled_mm path against the reference in bf16."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import atelier_studio.kernels.fp8_linear as fp8
import atelier_studio.kernels.fp8_quant as fq
from atelier_studio.kernels.fp8_linear import (
    RECIPES,
    TRAIN_RECIPES,
    fp8_frozen_linear,
    fp8_linear,
    fp8_lora_linear,
    fp8_lora_linear_ref,
    quantize_frozen_weight,
)
from atelier_studio.kernels.fp8_quant import (
    E4M3,
    E5M2,
    FORMATS,
    INV_MAX,
    fake_quantize,
    quantize,
    quantize_ref,
    scale_ref,
)

from tests.kernels._compare import assert_close

U32 = 2.0**-24  # fp32 unit roundoff
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, scale: float = 1.0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype=dtype, device=device)


# --- quantisers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("shape", [(1, 16), (37, 50), (130, 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_equals_torch_cast(fp8_dtype, rowwise, shape, dtype):
    """Scales bit-equal to amax · fp32(1/fp8_max); values equal torch's RNE cast of clamp(v / s); qᵀ zero-padded
    to 16."""
    v = _randn(*shape, seed=sum(shape), scale=3.0, dtype=dtype)
    out = quantize(v, fp8_dtype, rowwise, rows=True, cols=True, pad_to=16)
    q, s = quantize_ref(v, fp8_dtype, rowwise)
    qt, st = quantize_ref(v.t(), fp8_dtype, rowwise)
    assert torch.equal(out.scale, s) and torch.equal(out.scale_t, st)
    assert out.q.dtype == fp8_dtype and torch.equal(out.q.float(), q.float())
    r = shape[0]
    assert out.qt.shape == (shape[1], math.ceil(r / 16) * 16)
    assert torch.equal(out.qt[:, :r].float(), qt.float()) and not out.qt[:, r:].float().any()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(1, 16), (37, 50), (130, 1100)])
def test_rowwise_rows_only_one_pass_kernel(fp8_dtype, shape):
    """Rowwise without the transposed copy runs the one-pass kernel (rows longer than its 512-column block too):
    the same bits as torch's cast and as the two-pass kernels' q."""
    v = _randn(*shape, seed=7 + shape[1], scale=2.0, dtype=torch.bfloat16)
    one = quantize(v, fp8_dtype, True, rows=True, cols=False)
    two = quantize(v, fp8_dtype, True, rows=True, cols=True)
    q, s = quantize_ref(v, fp8_dtype, True)
    assert one.qt is None and torch.equal(one.scale, s) and torch.equal(one.q.float(), q.float())
    assert torch.equal(two.scale, s) and torch.equal(two.q.float(), q.float())


def test_quantize_reads_any_strides():
    """A transposed view quantises as its contiguous copy does (x.t() is how the column quantisation is fed)."""
    v = _randn(48, 40, seed=3)
    a, b = quantize(v.t(), E4M3, True), quantize(v.t().contiguous(), E4M3, True)
    assert torch.equal(a.q.float(), b.q.float()) and torch.equal(a.scale, b.scale)


def _amaxes_where_division_and_reciprocal_differ(fp8_dtype: torch.dtype, n: int) -> torch.Tensor:
    """n fp32 amaxes a with fl(a / fp8_max) != fl(a · fl(1/fp8_max)): PyTorch's CUDA `tensor / number` computes the
    second, its CPU one the first, so a scale defined as a division would differ between the two."""
    a = (torch.rand(4096, generator=_gen(90), dtype=torch.float64) * 50 + 0.01).float()
    fmax, inv = FORMATS[fp8_dtype][0], torch.tensor(INV_MAX[fp8_dtype])
    differ = a / fmax != a * inv
    assert differ.sum() >= n  # about half of all values
    return a[differ][:n]


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rowwise", [False, True])
def test_scale_is_amax_times_the_fp32_reciprocal(fp8_dtype, rowwise):
    """The scale is one correctly rounded fp32 product amax · fl(1/fp8_max) (checked in fp64 from first principles),
    for amaxes where that differs from a division, in the Triton kernels (one- and two-pass, q and qᵀ) and in
    quantize_ref: the definition on which the GPU's kernels and its PyTorch reference agree bit for bit."""
    a = _amaxes_where_division_and_reciprocal_differ(fp8_dtype, 24)
    want = (a.double() * INV_MAX[fp8_dtype]).float()  # exact fp64 product of two fp32 values, rounded once
    assert torch.equal(scale_ref(a, fp8_dtype), want)
    assert not torch.equal(want, a / FORMATS[fp8_dtype][0])
    if rowwise:  # row i holds ±a_i and smaller values: each row's amax is a_i
        v = torch.rand(24, 40, generator=_gen(91)) * a[:, None] * 0.9
        v[torch.arange(24), torch.arange(24) % 40] = a * torch.where(torch.arange(24) % 2 == 0, 1.0, -1.0)
        for out in (quantize(v, fp8_dtype, True), quantize(v, fp8_dtype, True, rows=True, cols=True)):
            assert torch.equal(out.scale, want)
        assert torch.equal(quantize(v.t().contiguous(), fp8_dtype, True, rows=False, cols=True).scale_t, want)
        assert torch.equal(quantize_ref(v, fp8_dtype, True)[1], want)
    else:
        for i in range(0, 24, 5):
            v = torch.rand(37, 50, generator=_gen(92 + i)) * a[i] * 0.9
            v[7, 11] = -a[i]
            out = quantize(v, fp8_dtype, False, rows=True, cols=True, pad_to=16)
            assert out.scale.item() == want[i].item() and out.scale_t.item() == want[i].item()
            assert quantize_ref(v, fp8_dtype, False)[1].item() == want[i].item()


@pytest.mark.parametrize("rowwise", [False, True])
def test_every_launch_configuration_gives_the_same_bits(rowwise):
    """Tuning only picks among configurations that compute identical values: each CUDA candidate, run here through
    the interpreter on shapes with partial tiles in both directions, against torch's cast."""
    v = _randn(150, 200, seed=93, scale=3.0, dtype=torch.bfloat16)
    q, s = quantize_ref(v, E4M3, rowwise)
    qt, st = quantize_ref(v.t(), E4M3, rowwise)
    for cfg in fq.CUDA_CONFIGS["tiles"]:
        out = quantize(v, E4M3, rowwise, rows=True, cols=True, pad_to=16, config=cfg)
        assert torch.equal(out.scale, s) and torch.equal(out.q.float(), q.float()), cfg
        assert torch.equal(out.scale_t, st) and torch.equal(out.qt[:, :150].float(), qt.float()), cfg
        assert not out.qt[:, 150:].float().any()
    if rowwise:
        for cfg in fq.CUDA_CONFIGS["rows"]:
            out = quantize(v, E4M3, True, config=cfg)
            assert torch.equal(out.scale, s) and torch.equal(out.q.float(), q.float()), cfg


def test_tuner_keeps_the_fastest_configuration(monkeypatch):
    """The CUDA tuner's choice, with the GPU simulated (each candidate's launch advances a clock that CUDA events
    read): the fastest candidate is kept and reused without timing again; a candidate this build cannot run is
    skipped; none runnable is an error naming them; small tensors and graph captures take the first entry."""
    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.at = 0.0

        def record(self):
            self.at = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(fq, "_TUNED", {})
    first, fast, broken = fq.CUDA_CONFIGS["tiles"]
    cost = {first: 3.0, fast: 1.0}
    runs = []

    def run(cfg):
        runs.append(cfg)
        if cfg is broken:
            raise fq.OutOfResources(1, 0, "shared memory")
        clock[0] += cost[cfg]

    cuda, big = torch.device("cuda"), fq.TUNE_MIN_ELEMENTS
    assert fq._config("tiles", ("k",), cuda, run, None, big) is fast
    assert runs.count(first) == runs.count(fast) == 1 + fq.TUNE_REPS and runs.count(broken) == 1
    runs.clear()
    assert fq._config("tiles", ("k",), cuda, run, None, big) is fast and not runs  # remembered
    assert fq._config("tiles", ("small",), cuda, run, None, big - 1) is first and not runs
    assert "k" in " ".join(fq.launch_configs())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fq._config("tiles", ("capture",), cuda, run, None, big) is first and not runs
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def nothing_runs(cfg):
        raise fq.OutOfResources(1, 0, "shared memory")

    with pytest.raises(RuntimeError, match="no launch configuration"):
        fq._config("tiles", ("none",), cuda, nothing_runs, None, big)


def test_empty_input_gets_the_all_zero_scale():
    """Zero rows: the scale an all-zero group gets (the amax floor's), and an all-zero padded transposed copy."""
    out = quantize(torch.zeros(0, 32), E4M3, rowwise=False, rows=True, cols=True, pad_to=16)
    assert torch.equal(out.scale, scale_ref(torch.zeros(1), E4M3)) and out.qt.shape == (32, 0)
    zero = quantize(torch.zeros(3, 32), E4M3, rowwise=False)
    assert torch.equal(zero.scale, out.scale)


def _e4m3_grid() -> torch.Tensor:
    """Every non-negative finite E4M3 value, from its definition: subnormals m·2^-9, normals (1 + m/8)·2^(e-7)."""
    sub = [m * 2.0**-9 for m in range(8)]
    normal = [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return torch.tensor([x for x in sub + normal if x <= 448.0], dtype=torch.float64)


def test_rounding_rule_from_first_principles():
    """Midpoints between neighbouring E4M3 values round to the one with an even mantissa, points just off a
    midpoint to the nearer one (up into the next binade too): checked against the grid built from the format."""
    grid = _e4m3_grid()
    lo, hi = grid[:-1], grid[1:]
    mid = (lo + hi) / 2
    even = torch.where((torch.arange(len(lo)) % 2) == 0, lo, hi)  # codes alternate even/odd along the grid
    nudge = (hi - lo) / 8
    vals = torch.cat([mid, mid - nudge, mid + nudge, grid])
    want = torch.cat([even, lo, hi, grid])
    vals = torch.cat([vals, -vals, torch.tensor([448.0])]).float()  # 448: sets the scale to exactly 1
    want = torch.cat([want, -want, torch.tensor([448.0], dtype=torch.float64)])
    out = quantize(vals[None, :], E4M3, rowwise=True)
    assert out.scale.item() == 1.0
    assert torch.equal(out.q.double()[0], want)


def test_all_zero_rows_get_a_finite_scale():
    out = quantize(torch.zeros(3, 32), E4M3, rowwise=True, rows=True, cols=True)
    assert torch.isfinite(out.scale).all() and (out.scale > 0).all() and not out.q.float().any()


# --- functions against the reference --------------------------------------------------------------------------------
def _dot_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |fl(a bᵀ) − fl'(a bᵀ)| between two fp32 evaluations of the same dequantised products in
    different orders (and with the scales applied before or after the sum): (2K + 8)·u·(|a| |b|ᵀ)."""
    k = a.shape[1]
    return (2 * k + 8) * U32 * (a.abs().double() @ b.abs().double().t())


def _run(fn, x, w, b, dy, **kw):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = fn(x, w, b, **kw)
    y.backward(dy)
    return y, x.grad, w.grad, (b.grad if b is not None else None)


@pytest.mark.parametrize("recipe", list(RECIPES))  # the benchmark-only variants too
@pytest.mark.parametrize("m", [1, 19, 64])
def test_trainable_matches_reference(recipe, m):
    """Output, dX, dW, d(bias) of the _scaled_mm Function against the fake-quantised reference, fp32, M = 1,
    19 (not a multiple of 16: dW's padded copies), 64; x 3-D."""
    k, n = 48, 32
    x, w, b = _randn(1, m, k, seed=1), _randn(n, k, seed=2, scale=0.2), _randn(n, seed=3)
    dy = _randn(1, m, n, seed=4)
    fast = _run(fp8_linear, x, w, b, dy, recipe=recipe, impl="scaled_mm")
    ref = _run(fp8_linear, x, w, b, dy, recipe=recipe, impl="ref")
    rc = RECIPES[recipe]
    x2, dy2 = x.reshape(m, k), dy.reshape(m, n)
    qx, qw = fake_quantize(x2, rc.forward_dtype, rc.rowwise), fake_quantize(w, rc.forward_dtype, rc.rowwise)
    qdy = fake_quantize(dy2, rc.grad_dtype, rc.rowwise)
    bounds = {"y": _dot_bound(qx, qw) + U32 * 8 * b.abs(),
              "dx": _dot_bound(qdy, fake_quantize(w, rc.forward_dtype, rc.rowwise, dim=0).t()),
              "dw": _dot_bound(fake_quantize(dy2, rc.grad_dtype, rc.rowwise, dim=0).t(),
                               fake_quantize(x2, rc.forward_dtype, rc.rowwise, dim=0).t()),
              "db": m * U32 * 2 * dy2.abs().sum(0)}
    if rc.dw_high_precision:  # dW = dYᵀ x, nothing quantised
        bounds["dw"] = _dot_bound(dy2.t(), x2.t())
    for name, a, r in zip(("y", "dx", "dw", "db"), fast, ref):
        diff = (a.double() - r.double()).reshape(bounds[name].shape).abs()
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert (diff <= bounds[name] + 1e-30).all(), f"{recipe} {name}: max excess {(diff - bounds[name]).max():.3e}"


@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
def test_tokens_off_16_equal_the_zero_padded_tokens(recipe):
    """M = 19: dW's transposed operands are padded to 32 token columns inside the quantiser (no copy). Against the
    same tokens zero-padded to 32 by the caller (nothing left to pad): dW bit-equal (zero tokens change no amax and
    add nothing, so both runs feed identical operands to one identical GEMM); y and dX on the 19 real rows, and
    d(bias), equal up to the fp32 accumulation order (different GEMM and reduction lengths)."""
    m, k, n = 19, 48, 32
    x, w, b = _randn(m, k, seed=15), _randn(n, k, seed=16, scale=0.2), _randn(n, seed=17)
    dy = _randn(m, n, seed=18)
    own = _run(fp8_linear, x, w, b, dy, recipe=recipe, impl="scaled_mm")
    padded = _run(fp8_linear, torch.cat([x, torch.zeros(13, k)]), w, b, torch.cat([dy, torch.zeros(13, n)]),
                  recipe=recipe, impl="scaled_mm")
    assert torch.equal(own[2], padded[2]), "dW"
    rc = RECIPES[recipe]
    qx, qw = fake_quantize(x, rc.forward_dtype, rc.rowwise), fake_quantize(w, rc.forward_dtype, rc.rowwise)
    qdy = fake_quantize(dy, rc.grad_dtype, rc.rowwise)
    bounds = {"y": _dot_bound(qx, qw) + U32 * 8 * b.abs(),
              "dx": _dot_bound(qdy, fake_quantize(w, rc.forward_dtype, rc.rowwise, dim=0).t())}
    for name, a, p in (("y", own[0], padded[0][:m]), ("dx", own[1], padded[1][:m])):
        assert ((a.double() - p.double()).abs() <= bounds[name] + 1e-30).all(), name
    assert ((own[3] - padded[3]).abs() <= m * U32 * 2 * dy.abs().sum(0)).all(), "d(bias)"


def test_trainable_under_bf16_autocast_fp32_master():
    """Full fine-tuning's dtypes: fp32 weight and x, bf16 autocast → y bf16, dX/dW/db fp32, as nn.Linear gives.
    bf16 output: the reference rounds x Wᵀ + b once; _scaled_mm takes the bias in bf16 and the CPU one rounds the
    product and the sum to bf16 in its epilogue: a few roundings of at most 2^-8 relative to the product, the bias
    and the sum each (they can cancel), bounded here by 2^-6 (|x Wᵀ| + |b|) + 2^-7 |y|."""
    x, w, b, dy = _randn(24, 32, seed=5), _randn(16, 32, seed=6, scale=0.3), _randn(16, seed=7), _randn(24, 16, seed=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = _run(fp8_linear, x, w, b, dy.bfloat16(), impl="scaled_mm")
        ref = _run(fp8_linear, x, w, b, dy.bfloat16(), impl="ref")
    assert [t.dtype for t in fast] == [torch.bfloat16, torch.float32, torch.float32, torch.float32]
    yr, bd = ref[0].double(), b.double()
    bound = 2.0**-6 * ((yr - bd).abs() + bd.abs()) + 2.0**-7 * yr.abs()
    assert ((fast[0].double() - ref[0].double()).abs() <= bound + 1e-6).all(), "y (bf16)"
    for name, a, r in zip(("dx", "dw", "db"), fast[1:], ref[1:]):
        assert a.dtype == r.dtype
        assert_close(a, r, atol=1e-5, rtol=1e-5, what=name)  # fp32 outputs: accumulation order only


@pytest.mark.parametrize("k, n", [(20, 32), (32, 24), (7, 5)])
def test_shapes_off_16_fall_back_to_the_reference(k, n, monkeypatch):
    """K or N not a multiple of 16 (what _scaled_mm needs): the reference Function runs, even when asked for
    scaled_mm; it is the same code as impl="ref", so the results are identical."""
    monkeypatch.setattr(fp8.Float8LinearFunction, "apply", _refuse)
    monkeypatch.setattr(fp8.Fp8FrozenLoRAFunction, "apply", _refuse)
    x, w, b, dy = _randn(3, k, seed=9), _randn(n, k, seed=10), _randn(n, seed=11), _randn(3, n, seed=12)
    fast = _run(fp8_linear, x, w, b, dy, impl="scaled_mm")
    ref = _run(fp8_linear, x, w, b, dy, impl="ref")
    for a, r in zip(fast, ref):
        assert torch.equal(a, r)
    a, bb = _randn(4, k, seed=13), _randn(n, 4, seed=14)
    y = fp8_lora_linear(x, w, None, None, a, bb, 2.0, impl="scaled_mm")
    assert torch.equal(y, fp8_lora_linear_ref(x, w, None, a, bb, 2.0))


def _refuse(*args, **kwargs):
    raise AssertionError("the _scaled_mm Function ran for a shape it cannot take")


@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_frozen_lora_matches_reference(recipe, adapter_dtype):
    """The FP8 frozen base + adapter Function: y, dX, dA, dB against the fake-quantised base + lora_linear's fp32
    adapter; the base weight gets no gradient. bf16 base (LoRA's), fp32 or bf16 adapters, no autocast: y in bf16
    (one bf16 rounding on each side: 2^-7 relative), the grads in their dtypes (bf16 ones: a few bf16 roundings)."""
    t, i, o, r = 21, 64, 48, 8
    w, bias = _randn(o, i, seed=20, scale=0.1, dtype=torch.bfloat16), _randn(o, seed=21, dtype=torch.bfloat16)
    frozen = quantize_frozen_weight(w, recipe)
    x = _randn(t, i, seed=22, dtype=torch.bfloat16)
    a0, b0 = (_randn(r, i, seed=23, scale=0.1, dtype=adapter_dtype),
              _randn(o, r, seed=24, scale=0.1, dtype=adapter_dtype))
    dy = _randn(t, o, seed=25, dtype=torch.bfloat16)
    outs = []
    for impl in ("scaled_mm", "ref"):
        xx, a, b = (v.clone().requires_grad_() for v in (x, a0, b0))
        y = fp8_lora_linear(xx, w, bias, frozen, a, b, 1.5, recipe=recipe, impl=impl)
        y.backward(dy)
        outs.append((y, xx.grad, a.grad, b.grad))
    tol = 2.0**-7 if adapter_dtype == torch.float32 else 2.0**-5
    for name, f, rr in zip(("y", "dx", "dA", "dB"), *outs):
        assert f.dtype == rr.dtype, name
        assert_close(f, rr, atol=tol * rr.abs().max().item(), rtol=2.0**-7, what=f"{recipe} {name}")
    assert w.grad is None and bias.grad is None


@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
def test_frozen_linear_matches_reference_and_has_no_dw(recipe):
    """The adapter-less frozen base (a linear LoRA does not target): y and dX against the reference in fp32;
    FLOPs of forward + backward are the two GEMMs (2·2MNK), never a third for dW."""
    m, k, n = 19, 32, 48
    w = _randn(n, k, seed=30)
    frozen = quantize_frozen_weight(w, recipe)
    x0, dy = _randn(m, k, seed=31), _randn(m, n, seed=32)
    res = []
    for impl in ("scaled_mm", "ref"):
        x = x0.clone().requires_grad_()
        with FlopCounterMode(display=False) as fc:
            y = fp8_frozen_linear(x, w, None, frozen, recipe, impl)
            y.backward(dy)
        res.append((y, x.grad, fc.get_total_flops()))
    (yf, dxf, flops), (yr, dxr, _) = res
    assert flops == 2 * (2 * m * n * k)
    rc = RECIPES[recipe]
    assert (yf - yr).abs().le(_dot_bound(fake_quantize(x0, rc.forward_dtype, rc.rowwise),
                                         fake_quantize(w, rc.forward_dtype, rc.rowwise))).all()
    wt = fake_quantize(w, rc.forward_dtype, rc.rowwise, dim=0)
    assert (dxf - dxr).abs().le(_dot_bound(fake_quantize(dy, rc.grad_dtype, rc.rowwise), wt.t())).all()
    assert w.grad is None


def test_frozen_copies_are_both_layouts():
    """quantize_frozen_weight: W per output channel [N, K] and W per input channel transposed [K, N] (rowwise);
    one scale and the transposed copy (tensorwise)."""
    w = _randn(48, 32, seed=40, dtype=torch.bfloat16)
    f = quantize_frozen_weight(w, "rowwise")
    q, s = quantize_ref(w, E4M3, True)
    qt, st = quantize_ref(w.t(), E4M3, True)
    assert torch.equal(f.q.float(), q.float()) and torch.equal(f.scale, s) and f.scale.shape == (48,)
    assert torch.equal(f.qt.float(), qt.float()) and torch.equal(f.scale_t, st) and f.scale_t.shape == (32,)
    g = quantize_frozen_weight(w, "tensorwise")
    assert g.scale.shape == (1,) and torch.equal(g.scale, g.scale_t) and torch.equal(g.qt.float(), g.q.float().t())


# --- error against fp32 ---------------------------------------------------------------------------------------------
# Per element, rounding to fp8 is off by at most half a spacing: 2^-4 relative (E4M3, 3 mantissa bits) or 2^-3
# (E5M2). A product of two quantised values is then off by about δ_a + δ_b relative; summed over K terms with
# independent signs, the error of one output grows as √K while Σ|a_i b_i| grows as K. So the RMS error over the
# outputs is below (δ_a + δ_b) · RMS(Σ_i |a_i b_i|) / √K; the test allows a full spacing, δ = 2^-3 (E4M3) and
# 2^-2 (E5M2), twice the worst case per element (Gaussian inputs measure about 1/4 of this bound). It also
# checks that the error is not far below it: the GEMM really ran on quantised operands, not in bf16.
DELTA = {E4M3: 2.0**-3, E5M2: 2.0**-2}


def _rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item()


@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
def test_error_against_fp32_within_the_fp8_bound(recipe):
    m, k, n = 96, 256, 64
    x, w, dy = _randn(m, k, seed=50), _randn(n, k, seed=51, scale=0.05), _randn(m, n, seed=52)
    y, dx, dw, _ = _run(fp8_linear, x, w, None, dy, recipe=recipe, impl="scaled_mm")
    rc = RECIPES[recipe]
    fwd, grad = rc.forward_dtype, rc.grad_dtype
    checks = [("y", y, x, w.t(), fwd, fwd), ("dx", dx, dy, w, grad, fwd), ("dw", dw, dy.t(), x, grad, fwd)]
    for name, got, a, b, da, db in checks:
        exact = a.double() @ b.double()
        bound = (DELTA[da] + DELTA[db]) * _rms(a.abs().double() @ b.abs().double()) / math.sqrt(a.shape[1])
        err = _rms(got.double() - exact)
        assert err <= bound, f"{recipe} {name}: RMS error {err:.3e} above the fp8 bound {bound:.3e}"
        assert err >= bound / 20, f"{recipe} {name}: RMS error {err:.3e} too small for fp8 operands ({bound:.3e})"


# --- device check ---------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen compute capability, on any machine (the capability lookup is patched)."""
    def make(cap):
        fp8._capability.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    yield make
    fp8._capability.cache_clear()


def test_gpu_without_fp8_is_refused_by_name(fake_gpu):
    fake_gpu((8, 0))
    with pytest.raises(fp8.Fp8UnsupportedError) as e:
        fp8.check_fp8_device(torch.device("cuda:0"))
    msg = str(e.value)
    assert 'train.precision = "fp8"' in msg and "cuda:0" in msg and "A100" in msg and "8.0" in msg and "8.9" in msg
    assert not fp8.fp8_supported(torch.device("cuda:0")) and fp8.fp8_supported(torch.device("cpu"))


@pytest.mark.parametrize("cap", [(8, 9), (9, 0), (10, 0)])
def test_fp8_gpus_pass(fake_gpu, cap):
    fake_gpu(cap)
    fp8.check_fp8_device(torch.device("cuda:0"))


def test_bad_arguments_are_named():
    x, w = torch.randn(4, 16), torch.randn(16, 16)
    with pytest.raises(ValueError, match="recipe"):
        fp8_linear(x, w, recipe="blockwise")
    with pytest.raises(ValueError, match="impl"):
        fp8_linear(x, w, impl="cublas")
    with pytest.raises(ValueError, match="weight"):
        fp8_linear(x, torch.randn(16, 8))
    with pytest.raises(ValueError, match="fp8 copies"):
        fp8_frozen_linear(x, w, None, None, impl="scaled_mm")
    with pytest.raises(ValueError, match="frozen"):
        fp8_lora_linear(x, w.requires_grad_(), None, None, torch.randn(2, 16), torch.randn(16, 2), 1.0)


# --- custom ops and the GPU build -----------------------------------------------------------------------------------
UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def test_custom_ops_pass_opcheck():
    """Fake (meta) implementations, autograd registration and AOT dispatch of the atelier::fp8_* ops (opcheck's
    schema test is left out: its checker multiplies outputs, which CPU torch cannot do for fp8 tensors)."""
    x, w, b = torch.randn(19, 32), torch.randn(16, 32), torch.randn(16)
    for recipe in TRAIN_RECIPES:
        for need_x, need_w in ((True, True), (False, True), (True, False)):
            torch.library.opcheck(fp8.fp8_linear_fwd, (x, w, b, recipe, torch.float32, need_x, need_w),
                                  test_utils=UTILS)
        _, xqt, xs, wqt, ws = fp8.fp8_linear_fwd(x, w, b, recipe, torch.float32, True, True)
        dy = torch.randn(19, 16)
        torch.library.opcheck(fp8.fp8_linear_bwd, (dy, xqt, xs, wqt, ws, recipe, torch.float32, torch.float32,
                                                   torch.float32, True, True, True), test_utils=UTILS)
        f = quantize_frozen_weight(w, recipe)
        torch.library.opcheck(fp8.fp8_frozen_fwd, (x, f.q, f.scale, b, recipe, torch.float32), test_utils=UTILS)
        torch.library.opcheck(fp8.fp8_frozen_bwd, (dy, f.qt, f.scale_t, recipe, torch.float32), test_utils=UTILS)


_COMPILE_FOR_HOPPER = r"""
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import atelier_studio.kernels.fp8_quant as m

target = GPUTarget("cuda", 90, 32)
for src_ty, dst_ty in (("bf16", "fp8e4nv"), ("fp32", "fp8e5")):
    for tw, wq, wqt in itertools.product((True, False), repeat=3):
        if not (wq or wqt):
            continue
        const = dict(TENSORWISE=tw, WANT_Q=wq, WANT_QT=wqt, BLOCK_R=64, BLOCK_C=64)
        sig = {"x_ptr": "*" + src_ty, "amax_q_ptr": "*fp32", "amax_qt_ptr": "*fp32", "R": "i32", "C": "i32",
               "stride_r": "i32", "stride_c": "i32", **{k: "constexpr" for k in const}}
        triton.compile(ASTSource(m._amax_kernel, sig, const), target=target)
        fmt = {"fp8e4nv": (448.0, 3, -6), "fp8e5": (57344.0, 2, -14)}[dst_ty]
        inv = {"fp8e4nv": m.INV_MAX[m.E4M3], "fp8e5": m.INV_MAX[m.E5M2]}[dst_ty]
        const2 = dict(const, FP8_MAX=fmt[0], MANT=fmt[1], EMIN=fmt[2], EPS=m.AMAX_EPS, INV_MAX=inv)
        sig2 = {"x_ptr": "*" + src_ty, "amax_q_ptr": "*fp32", "amax_qt_ptr": "*fp32", "q_ptr": "*" + dst_ty,
                "s_q_ptr": "*fp32", "qt_ptr": "*" + dst_ty, "s_qt_ptr": "*fp32", "R": "i32", "C": "i32",
                "R_PAD": "i32", "stride_r": "i32", "stride_c": "i32", **{k: "constexpr" for k in const2}}
        ptx = triton.compile(ASTSource(m._cast_kernel, sig2, const2), target=target).asm["ptx"]
        assert "cvt.rn.satfinite" in ptx, "the fp8 store is not a round-to-nearest saturating cast"
    fmt = {"fp8e4nv": (448.0, 3, -6), "fp8e5": (57344.0, 2, -14)}[dst_ty]
    inv = {"fp8e4nv": m.INV_MAX[m.E4M3], "fp8e5": m.INV_MAX[m.E5M2]}[dst_ty]
    const3 = dict(FP8_MAX=fmt[0], MANT=fmt[1], EMIN=fmt[2], EPS=m.AMAX_EPS, INV_MAX=inv, BLOCK_R=8, BLOCK_C=512)
    sig3 = {"x_ptr": "*" + src_ty, "q_ptr": "*" + dst_ty, "s_ptr": "*fp32", "R": "i32", "C": "i32",
            "stride_r": "i32", "stride_c": "i32", **{k: "constexpr" for k in const3}}
    ptx = triton.compile(ASTSource(m._quant_rows_kernel, sig3, const3), target=target).asm["ptx"]
    assert "cvt.rn.satfinite" in ptx
# every configuration the CUDA tuner may pick builds, within Hopper's 227 KiB of shared memory per program
SMEM = 227 * 1024
for cfg in m.CUDA_CONFIGS["tiles"]:
    for tw in (True, False):
        blocks = dict(BLOCK_R=cfg.block_r, BLOCK_C=cfg.block_c)
        const = dict(TENSORWISE=tw, WANT_Q=True, WANT_QT=True, **blocks)
        sig = {"x_ptr": "*bf16", "amax_q_ptr": "*fp32", "amax_qt_ptr": "*fp32", "R": "i32", "C": "i32",
               "stride_r": "i32", "stride_c": "i32", **{k: "constexpr" for k in const}}
        k1 = triton.compile(ASTSource(m._amax_kernel, sig, const), target=target, options={"num_warps": cfg.num_warps})
        const2 = dict(const, FP8_MAX=448.0, MANT=3, EMIN=-6, EPS=m.AMAX_EPS, INV_MAX=m.INV_MAX[m.E4M3])
        sig2 = {"x_ptr": "*bf16", "amax_q_ptr": "*fp32", "amax_qt_ptr": "*fp32", "q_ptr": "*fp8e4nv",
                "s_q_ptr": "*fp32", "qt_ptr": "*fp8e4nv", "s_qt_ptr": "*fp32", "R": "i32", "C": "i32",
                "R_PAD": "i32", "stride_r": "i32", "stride_c": "i32", **{k: "constexpr" for k in const2}}
        k2 = triton.compile(ASTSource(m._cast_kernel, sig2, const2), target=target,
                            options={"num_warps": cfg.num_warps})
        assert k1.metadata.shared <= SMEM and k2.metadata.shared <= SMEM, (cfg, k1.metadata.shared, k2.metadata.shared)
for cfg in m.CUDA_CONFIGS["rows"]:
    const3 = dict(FP8_MAX=448.0, MANT=3, EMIN=-6, EPS=m.AMAX_EPS, INV_MAX=m.INV_MAX[m.E4M3], BLOCK_R=cfg.block_r,
                  BLOCK_C=cfg.block_c)
    sig3 = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "R": "i32", "C": "i32",
            "stride_r": "i32", "stride_c": "i32", **{k: "constexpr" for k in const3}}
    k3 = triton.compile(ASTSource(m._quant_rows_kernel, sig3, const3), target=target,
                        options={"num_warps": cfg.num_warps})
    assert k3.metadata.shared <= SMEM, (cfg, k3.metadata.shared)
print("ok")
"""


def test_kernels_compile_for_hopper():
    """The Triton kernels build for sm_90 (through PTX and ptxas) on this CPU machine, every constexpr variant and
    every launch configuration the CUDA tuner may pick (within Hopper's shared memory): the interpreter never
    lowers them, so this is what catches a kernel that would fail only on the GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], capture_output=True, text=True, env=env,
                         cwd=root, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# --- GPU ------------------------------------------------------------------------------------------------------------
@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rowwise", [False, True])
def test_gpu_quantize_equals_torch_cast(fp8_dtype, rowwise):
    v = _randn(4429, 1536, seed=60, scale=2.0, dtype=torch.bfloat16, device="cuda")
    out = quantize(v, fp8_dtype, rowwise, rows=True, cols=True, pad_to=16)
    q, s = quantize_ref(v, fp8_dtype, rowwise)
    qt, st = quantize_ref(v.t(), fp8_dtype, rowwise)
    assert torch.equal(out.scale, s) and torch.equal(out.scale_t, st)
    _assert_same_codes(out.q, q)
    _assert_same_codes(out.qt[:, :4429], qt)
    assert not out.qt[:, 4429:].float().any()
    assert any("R_bucket=8192 C=1536" in k for k in fq.launch_configs())  # 6.8M elements: tuned
    one = quantize(v, fp8_dtype, rowwise, rows=True, cols=False)  # (rowwise: the one-pass kernel)
    assert torch.equal(one.scale, s)
    _assert_same_codes(one.q, q)


def _assert_same_codes(ours: torch.Tensor, torch_cast: torch.Tensor) -> None:
    """The same FP8 codes as torch's cast, except the sign of a zero: a tiny negative value that rounds to zero is
    -0 in torch's cast and +0 in the GPU's conversion (seen on an H200: 28 of 6.8M E4M3 codes, values of -1e-4 to
    -8e-4 times the scale). The two zeros are the same number in every matmul; any other code must match exactly."""
    a, b = ours.view(torch.uint8), torch_cast.view(torch.uint8)
    differ = a != b
    signed_zero = differ & (ours.float() == 0) & (torch_cast.float() == 0)
    other = differ & ~signed_zero
    assert not other.any(), (f"{int(other.sum())} codes differ from torch's cast, first at "
                             f"{other.nonzero()[0].tolist()}: {ours[other][0].item()} vs {torch_cast[other][0].item()}")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
@pytest.mark.parametrize("m, k, n", [(2664, 1536, 1536), (4096, 1024, 3072), (1, 64, 32)])
def test_gpu_trainable_matches_reference(recipe, m, k, n):
    """FP8 tensor cores (fast accumulation in the forward) against the fp32 fake-quantised reference, bf16 autocast
    over fp32 master weights: the same quantised operands, so only accumulation and the bf16 output rounding differ:
    within 2^-6 of each output's scale Σ|a||b| / √K plus one bf16 ulp (fast accumulation keeps fewer bits)."""
    x, w, b = (_randn(m, k, seed=61, device="cuda"), _randn(n, k, seed=62, scale=0.05, device="cuda"),
               _randn(n, seed=63, device="cuda"))
    dy = _randn(m, n, seed=64, dtype=torch.bfloat16, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast = _run(fp8_linear, x, w, b, dy, recipe=recipe, impl="scaled_mm")
        ref = _run(fp8_linear, x, w, b, dy, recipe=recipe, impl="ref")
    for name, a, r in zip(("y", "dx", "dw", "db"), fast, ref):
        assert a.dtype == r.dtype, name
        scale = r.float().abs().max().item()
        assert_close(a, r, atol=2.0**-6 * scale, rtol=2.0**-7, what=f"{recipe} {name} {m}x{k}x{n}")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
def test_gpu_frozen_lora_matches_reference(recipe):
    t, i, o, r = 4096, 4096, 1024, 16
    w = _randn(o, i, seed=70, scale=0.02, dtype=torch.bfloat16, device="cuda")
    frozen = quantize_frozen_weight(w, recipe)
    x0 = _randn(t, i, seed=71, dtype=torch.bfloat16, device="cuda")
    a0, b0 = _randn(r, i, seed=72, scale=0.02, device="cuda"), _randn(o, r, seed=73, scale=0.02, device="cuda")
    dy = _randn(t, o, seed=74, dtype=torch.bfloat16, device="cuda")
    outs = []
    for impl in ("scaled_mm", "ref"):
        x, a, b = (v.clone().requires_grad_() for v in (x0, a0, b0))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fp8_lora_linear(x, w, None, frozen, a, b, 2.0, recipe=recipe, impl=impl)
        y.backward(dy)
        outs.append((y, x.grad, a.grad, b.grad))
    for name, f, rr in zip(("y", "dx", "dA", "dB"), *outs):
        scale = rr.float().abs().max().item()
        assert_close(f, rr, atol=2.0**-6 * scale, rtol=2.0**-6, what=f"{recipe} {name}")


@cuda
@pytest.mark.gpu
def test_gpu_compiled_module_matches_eager():
    from atelier_studio.pipeline.float8 import Float8Linear

    lin = Float8Linear.from_linear(torch.nn.Linear(1024, 2048, device="cuda"), "rowwise")
    x = _randn(3000, 1024, seed=80, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = lin(x)
        compiled = torch.compile(lin)(x)
    assert torch.equal(eager, compiled)
