"""FP8 linears that read one x (kernels/fp8_group.py) against the members one by one (kernels/fp8_linear.py): the
outputs, dW and d(bias) bit-equal, dX and the adapters' gradients equal up to the order of fp32 sums; x quantised
once instead of once per member; the fallback when a member cannot take the fast path; FLOPs, custom ops, compile.
On a GPU the same at real projection shapes."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import atelier_studio.kernels.fp8_group as grp
from atelier_studio.kernels.fp8_group import (
    fp8_frozen_linear_group,
    fp8_linear_group,
    fp8_linear_group_ref,
    fp8_lora_linear_group,
)
from atelier_studio.kernels.fp8_linear import (
    TRAIN_RECIPES,
    fp8_frozen_linear,
    fp8_linear,
    fp8_lora_linear,
    quantize_frozen_weight,
)

U32 = 2.0**-24  # fp32 unit roundoff
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _randn(*shape, seed: int, scale: float = 1.0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype=dtype, device=device)


def _members(outs, k, seed, bias=True, dtype=torch.float32, device="cpu"):
    ws = [_randn(n, k, seed=seed + i, scale=k**-0.5, dtype=dtype, device=device) for i, n in enumerate(outs)]
    bs = [_randn(n, seed=seed + 10 + i, dtype=dtype, device=device) if bias else None for i, n in enumerate(outs)]
    return ws, bs


def _sum_bound(parts: list[torch.Tensor]) -> torch.Tensor:
    """|Σ parts in one order − Σ parts in another| ≤ 2(m−1)·u·Σ|parts| (each of the m−1 fp32 adds rounds once)."""
    m = len(parts)
    return 2 * (m - 1) * U32 * sum(p.double().abs() for p in parts)


def _grads(fn, x0, params, dys):
    x = x0.clone().requires_grad_()
    leaves = [p.clone().requires_grad_() if p is not None else None for p in params]
    ys = fn(x, leaves)
    sum((y * d).sum() for y, d in zip(ys, dys)).backward()
    return [y.detach() for y in ys], x.grad, [p.grad if p is not None else None for p in leaves]


@pytest.mark.parametrize("recipe", [*TRAIN_RECIPES, "rowwise-gwhp"])
@pytest.mark.parametrize("m_tokens", [19, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_trainable_group_equals_the_members_alone(recipe, m_tokens, bias):
    """q/k/v-like members (unequal N), x 3-D, M off 16 or not, and the benchmark recipe whose dW reads x itself:
    y_i, dW_i, d(bias_i) bit-equal (the same operands into the same GEMM calls); dX is the same per-member
    products summed in another order."""
    outs, k = (48, 16, 16), 32
    ws, bs = _members(outs, k, seed=1, bias=bias)
    x0 = _randn(1, m_tokens, k, seed=5)
    dys = [_randn(1, m_tokens, n, seed=6 + i) for i, n in enumerate(outs)]
    n = len(ws)

    def group(x, p):
        return fp8_linear_group(x, p[:n], p[n:], recipe, "scaled_mm")

    def alone(x, p):
        return [fp8_linear(x, w, b, recipe, "scaled_mm") for w, b in zip(p[:n], p[n:])]

    yg, dxg, pg = _grads(group, x0, ws + bs, dys)
    ya, dxa, pa = _grads(alone, x0, ws + bs, dys)
    assert all(torch.equal(a, b) for a, b in zip(yg, ya)), "y"
    assert all(torch.equal(a, b) for a, b in zip(pg[:n], pa[:n])), "dW"
    if bias:
        assert all(torch.equal(a, b) for a, b in zip(pg[n:], pa[n:])), "d(bias)"
    parts = [_grads(lambda x, p, i=i: [fp8_linear(x, p[0], p[1], recipe, "scaled_mm")], x0, [ws[i], bs[i]],
                    [dys[i]])[1] for i in range(n)]
    assert ((dxg - dxa).double().abs() <= _sum_bound(parts)).all(), "dX"


def test_trainable_group_without_x_grad_and_under_autocast():
    """Full fine-tuning's dtypes (fp32 master weights and x, bf16 autocast: y bf16, dW fp32) and layer 0 of a
    frozen-embedding run (x needs no gradient: no dX GEMM, as for the members alone)."""
    ws, bs = _members((32, 16), 48, seed=20)
    x = _randn(21, 48, seed=22)
    dys = [_randn(21, n, seed=23 + i, dtype=torch.bfloat16) for i, n in enumerate((32, 16))]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = []
        for fn in (lambda p: fp8_linear_group(x, p[:2], p[2:], "rowwise", "scaled_mm"),
                   lambda p: [fp8_linear(x, w, b, "rowwise", "scaled_mm") for w, b in zip(p[:2], p[2:])]):
            leaves = [p.clone().requires_grad_() for p in ws + bs]
            ys = fn(leaves)
            with FlopCounterMode(display=False) as fc:
                sum((y.float() * d.float()).sum() for y, d in zip(ys, dys)).backward()
            outs.append((ys, [p.grad for p in leaves], fc.get_total_flops()))
    (yg, gg, fg), (ya, ga, fa) = outs
    assert yg[0].dtype == torch.bfloat16 and gg[0].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(yg, ya)) and all(torch.equal(a, b) for a, b in zip(gg, ga))
    assert fg == fa == sum(2 * 21 * 48 * n for n in (32, 16))  # dW only: no dX for an x without grad


@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
def test_frozen_group_equals_the_members_alone(recipe):
    """Frozen bases (a LoRA run's untargeted linears, bias included): y_i bit-equal, dX within the sum-order bound;
    the weights get no gradient."""
    outs, k = (40, 24, 16), 32
    ws, bs = _members(outs, k, seed=30)
    frozens = [quantize_frozen_weight(w, recipe) for w in ws]
    x0 = _randn(27, k, seed=35)
    dys = [_randn(27, n, seed=36 + i) for i, n in enumerate(outs)]
    group = _grads(lambda x, p: fp8_frozen_linear_group(x, ws, bs, frozens, recipe, "scaled_mm"), x0, [], dys)
    alone = _grads(lambda x, p: [fp8_frozen_linear(x, w, b, f, recipe, "scaled_mm")
                                 for w, b, f in zip(ws, bs, frozens)],
                   x0, [], dys)
    assert all(torch.equal(a, b) for a, b in zip(group[0], alone[0])), "y"
    parts = [_grads(lambda x, p, i=i: [fp8_frozen_linear(x, ws[i], bs[i], frozens[i], recipe, "scaled_mm")], x0, [],
                    [dys[i]])[1] for i in range(3)]
    assert ((group[1] - alone[1]).double().abs() <= _sum_bound(parts)).all(), "dX"
    assert all(w.grad is None for w in ws)


@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_lora_group_equals_the_members_alone(recipe, adapter_dtype):
    """FP8 bases with LoRA adapters (the designer's q/k/v under LoRA), bf16 base: against each member's
    fp8_lora_linear. The bases' GEMMs are the same calls on the same operands; what differs is the adapters' u =
    x [A_0; …]ᵀ from one matmul instead of three, dA from one matmul, and the order of dX's adds. Each of those is
    one rounding (ε: fp32 accumulation over ≤ T + K terms, 2(T + K)·2^-24, or a bf16 result, 2^-8) of a partial
    result bounded by the output's magnitude M (the fp64 sum of |terms| of its computation); at most m + 2 such
    roundings differ between the two orders: |group − alone| ≤ (m + 2)·ε·M, with ε = 2^-8 where a bf16 result
    is on the path (y and dX always, dA and dB with bf16 adapters)."""
    outs, k, r, t = (32, 16, 16), 48, 4, 23
    ws, _ = _members(outs, k, seed=40, bias=False, dtype=torch.bfloat16)
    frozens = [quantize_frozen_weight(w, recipe) for w in ws]
    As = [_randn(r, k, seed=44 + i, scale=0.1, dtype=adapter_dtype) for i in range(3)]
    Bs = [_randn(n, r, seed=47 + i, scale=0.1, dtype=adapter_dtype) for i, n in enumerate(outs)]
    scales = [2.0, 0.5, 1.0]
    x0 = _randn(t, k, seed=50, dtype=torch.bfloat16)
    dys = [_randn(t, n, seed=51 + i, dtype=torch.bfloat16) for i, n in enumerate(outs)]

    def group(x, p):
        return fp8_lora_linear_group(x, ws, frozens, p[:3], p[3:], scales, recipe, "scaled_mm")

    def alone(x, p):
        return [fp8_lora_linear(x, w, None, f, a, b, s, 0.0, recipe, "scaled_mm")
                for w, f, a, b, s in zip(ws, frozens, p[:3], p[3:], scales)]

    (yg, dxg, pg), (ya, dxa, pa) = _grads(group, x0, As + Bs, dys), _grads(alone, x0, As + Bs, dys)
    ax, ad = x0.double().abs(), [d.double().abs() for d in dys]
    aw, aa, ab = ([v.double().abs() for v in vs] for vs in (ws, As, Bs))
    au = [ax @ a.t() for a in aa]  # |x| |A_i|ᵀ
    mags = {"y": [ax @ w.t() + s * u @ b.t() for w, u, b, s in zip(aw, au, ab, scales)],
            "dx": [sum(d @ w + s * (d @ b) @ a for d, w, a, b, s in zip(ad, aw, aa, ab, scales))],
            "dA": [s * (d @ b).t() @ ax for d, b, s in zip(ad, ab, scales)],
            "dB": [s * d.t() @ u for d, u, s in zip(ad, au, scales)]}
    got = {"y": yg, "dx": [dxg], "dA": pg[:3], "dB": pg[3:]}
    want = {"y": ya, "dx": [dxa], "dA": pa[:3], "dB": pa[3:]}
    for name in mags:
        bf16_on_path = name in ("y", "dx") or adapter_dtype == torch.bfloat16
        eps = 2.0**-8 if bf16_on_path else 2 * (t + k) * U32
        for g, a, mag in zip(got[name], want[name], mags[name]):
            assert g.dtype == a.dtype and g.shape == a.shape, name
            excess = (g.double() - a.double()).abs() - (len(outs) + 2) * eps * mag
            assert (excess <= 0).all(), f"{recipe} {adapter_dtype} {name}: max excess {excess.max():.3e}"


def test_group_quantises_x_once(monkeypatch):
    """The point of the group: one quantisation of x for three members in the forward (alone: three)."""
    calls = []
    real = grp.quantize

    def counting(v, *args, **kwargs):
        calls.append(tuple(v.shape))
        return real(v, *args, **kwargs)

    monkeypatch.setattr(grp, "quantize", counting)
    ws, bs = _members((32, 16, 16), 32, seed=60)
    x = _randn(19, 32, seed=61)
    fp8_linear_group(x, ws, bs, "rowwise", "scaled_mm")
    assert calls.count((19, 32)) == 1 and len(calls) == 4  # x once, each W once
    frozens = [quantize_frozen_weight(w, "tensorwise") for w in ws]
    calls.clear()
    fp8_frozen_linear_group(x, ws, bs, frozens, "tensorwise", "scaled_mm")
    assert calls == [(19, 32)]


def test_group_falls_back_to_the_members_when_one_cannot(monkeypatch):
    """A member with N off 16 (what _scaled_mm needs), impl "ref", or a lone member: the members run one by one
    (their own paths, the reference where they need it), so the results are identical to theirs."""
    def refuse(*args, **kwargs):
        raise AssertionError("the group Function ran for members it cannot take")

    monkeypatch.setattr(grp.Float8LinearGroupFunction, "apply", refuse)
    monkeypatch.setattr(grp.Fp8FrozenGroupFunction, "apply", refuse)
    ws, bs = _members((32, 24), 32, seed=70)  # 24: off 16
    x = _randn(5, 32, seed=71)
    got = fp8_linear_group(x, ws, bs, "rowwise", "scaled_mm")
    assert all(torch.equal(g, fp8_linear(x, w, b, "rowwise", "scaled_mm")) for g, w, b in zip(got, ws, bs))
    ws16, bs16 = _members((32, 16), 32, seed=72)
    ref = fp8_linear_group(x, ws16, bs16, "tensorwise", "ref")
    assert all(torch.equal(g, e) for g, e in zip(ref, fp8_linear_group_ref(x, ws16, bs16, "tensorwise")))
    assert torch.equal(fp8_linear_group(x, ws16[:1], bs16[:1], "rowwise", "scaled_mm")[0],
                       fp8_linear(x, ws16[0], bs16[0], "rowwise", "scaled_mm"))
    frozens = [quantize_frozen_weight(w, "rowwise") for w in ws]
    got = fp8_frozen_linear_group(x, ws, bs, frozens, "rowwise", "scaled_mm")
    assert all(torch.equal(g, fp8_frozen_linear(x, w, b, f, "rowwise", "scaled_mm"))
               for g, w, b, f in zip(got, ws, bs, frozens))


def test_bad_arguments_are_named():
    ws, bs = _members((32, 16), 32, seed=80)
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="biases"):
        fp8_linear_group(x, ws, bs[:1])
    with pytest.raises(ValueError, match="weight"):
        fp8_linear_group(x, [ws[0], torch.randn(16, 8)])
    frozens = [quantize_frozen_weight(w, "rowwise") for w in ws]
    a, b = [torch.randn(2, 32), torch.randn(2, 32)], [torch.randn(32, 2), torch.randn(16, 2)]
    with pytest.raises(ValueError, match="frozen"):
        fp8_lora_linear_group(x, [ws[0].clone().requires_grad_(), ws[1]], frozens, a, b, [1.0, 1.0])
    with pytest.raises(ValueError, match="one dtype"):
        fp8_lora_linear_group(x, ws, frozens, [a[0], a[1].double()], b, [1.0, 1.0])
    with pytest.raises(ValueError, match="fp8 copies"):
        fp8_lora_linear_group(x, ws, [frozens[0], None], a, b, [1.0, 1.0], impl="scaled_mm")


def test_flops_are_the_members_flops():
    """FlopCounterMode sees through the group ops: forward + backward FLOPs equal the members' (3 GEMMs each for
    trainable, 2 for frozen, plus the adapters' matmuls)."""
    ws, bs = _members((32, 16), 48, seed=90)
    x0 = _randn(19, 48, seed=91)
    dys = [_randn(19, n, seed=92 + i) for i, n in enumerate((32, 16))]
    counts = []
    for fn in (lambda x, p: fp8_linear_group(x, p[:2], p[2:], "rowwise", "scaled_mm"),
               lambda x, p: [fp8_linear(x, w, b, "rowwise", "scaled_mm") for w, b in zip(p[:2], p[2:])]):
        with FlopCounterMode(display=False) as fc:
            _grads(fn, x0, ws + bs, dys)
        counts.append(fc.get_total_flops())
    assert counts[0] == counts[1] == sum(3 * 2 * 19 * 48 * n for n in (32, 16))
    frozens = [quantize_frozen_weight(w, "rowwise") for w in ws]
    As, Bs = [_randn(4, 48, seed=95 + i) for i in range(2)], [_randn(n, 4, seed=97 + i) for i, n in enumerate((32, 16))]
    counts = []
    for fn in (lambda x, p: fp8_lora_linear_group(x, ws, frozens, p[:2], p[2:], [1.0, 1.0], "rowwise", "scaled_mm"),
               lambda x, p: [fp8_lora_linear(x, w, None, f, a, b, 1.0, 0.0, "rowwise", "scaled_mm")
                             for w, f, a, b in zip(ws, frozens, p[:2], p[2:])]):
        with FlopCounterMode(display=False) as fc:
            _grads(fn, x0, As + Bs, dys)
        counts.append(fc.get_total_flops())
    assert counts[0] == counts[1]


UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def test_group_custom_ops_pass_opcheck():
    """Fake implementations, autograd registration and AOT dispatch of the atelier::fp8_*group* ops (opcheck's
    schema test is left out, as for kernels/fp8_linear.py's ops: it multiplies fp8 outputs, which CPU torch cannot)."""
    ws, bs = _members((32, 16), 32, seed=100)
    x = torch.randn(19, 32)
    for recipe in TRAIN_RECIPES:
        for need_x, need_w in ((True, True), (False, True), (True, False)):
            torch.library.opcheck(grp.fp8_group_fwd, (x, ws, [bs[0], None], recipe, torch.float32, need_x, need_w),
                                  test_utils=UTILS)
        out = grp.fp8_group_fwd(x, ws, bs, recipe, torch.float32, True, True)
        dys = [torch.randn(19, 32), torch.randn(19, 16)]
        torch.library.opcheck(grp.fp8_group_bwd, (dys, out[2], out[3], out[4:6], out[6:8], recipe, torch.float32,
                                                  torch.float32, torch.float32, True, True, [True, False]),
                              test_utils=UTILS)
        fz = [quantize_frozen_weight(w, recipe) for w in ws]
        As, Bs = [torch.randn(2, 32), torch.randn(3, 32)], [torch.randn(32, 2), torch.randn(16, 3)]
        for la, lb in (([], []), (As, Bs)):
            args = (x, [f.q for f in fz], [f.scale for f in fz], [None, bs[1]], la, lb, [1.0, 0.5][:len(la)], recipe,
                    torch.float32, torch.float32)
            torch.library.opcheck(grp.fp8_frozen_group_fwd, args, test_utils=UTILS)
            *_, u = grp.fp8_frozen_group_fwd(*args)
            torch.library.opcheck(grp.fp8_frozen_group_bwd, (dys, x if la else x.new_empty(0), [f.qt for f in fz],
                                                             [f.scale_t for f in fz], la, lb, u, [1.0, 0.5][:len(la)],
                                                             recipe, torch.float32, True, bool(la)), test_utils=UTILS)


def test_groups_compile_whole_and_match_eager():
    """Under torch.compile (fullgraph: no graph break) a group stays its opaque custom ops: eager's bits."""
    ws, bs = _members((32, 16, 16), 32, seed=110)
    frozens = [quantize_frozen_weight(w.bfloat16(), "tensorwise") for w in ws]
    As = [_randn(2, 32, seed=113 + i) for i in range(3)]
    Bs = [_randn(n, 2, seed=116 + i) for i, n in enumerate((32, 16, 16))]
    x0 = _randn(19, 32, seed=119)
    dys = [_randn(19, n, seed=120 + i) for i, n in enumerate((32, 16, 16))]

    def trainable(x, *p):
        return fp8_linear_group(x, p[:3], p[3:], "rowwise", "scaled_mm")

    def lora(x, *p):
        return fp8_lora_linear_group(x.bfloat16(), [w.bfloat16() for w in ws], frozens, p[:3], p[3:], [1.0, 2.0, 0.5],
                                     "tensorwise", "scaled_mm")

    for fn, params in ((trainable, ws + bs), (lora, As + Bs)):
        outs = []
        for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            outs.append(_grads(lambda x, p: f(x, *p), x0, params, dys))
        (ye, dxe, pe), (yc, dxc, pc) = outs
        assert all(torch.equal(a, b) for a, b in zip(ye + [dxe] + pe, yc + [dxc] + pc)), fn.__name__


# --- GPU ------------------------------------------------------------------------------------------------------------
@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
@pytest.mark.parametrize("m_tokens, k, outs", [(2664, 1536, (1536, 1536, 1536)), (4096, 1024, (1024, 256, 256))])
def test_gpu_trainable_group_equals_the_members(recipe, m_tokens, k, outs):
    """On the GPU (the MMDiT's text stream, a GQA q/k/v; fp32 master weights and x, bf16 autocast): the same GEMM
    calls on the same quantised operands give the same bits (y, dW, d(bias)); dX is the members' fp32 products
    summed in another order (the sum-order bound)."""
    ws, bs = _members(outs, k, seed=130, device="cuda")
    x0 = _randn(m_tokens, k, seed=134, device="cuda")
    dys = [_randn(m_tokens, n, seed=135 + i, dtype=torch.bfloat16, device="cuda") for i, n in enumerate(outs)]
    n = len(ws)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        yg, dxg, pg = _grads(lambda x, p: fp8_linear_group(x, p[:n], p[n:], recipe, "scaled_mm"), x0, ws + bs, dys)
        ya, dxa, pa = _grads(lambda x, p: [fp8_linear(x, w, b, recipe, "scaled_mm") for w, b in zip(p[:n], p[n:])],
                             x0, ws + bs, dys)
        parts = [_grads(lambda x, p, i=i: [fp8_linear(x, p[0], p[1], recipe, "scaled_mm")], x0, [ws[i], bs[i]],
                        [dys[i]])[1] for i in range(n)]
    assert all(torch.equal(a, b) for a, b in zip(yg, ya)), "y"
    assert all(torch.equal(a, b) for a, b in zip(pg, pa)), "dW, d(bias)"
    assert ((dxg.double() - dxa.double()).abs() <= _sum_bound(parts)).all(), "dX"
