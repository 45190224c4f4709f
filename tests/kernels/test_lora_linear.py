import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from atelier_studio.kernels.lora_linear import (
    lora_group_bwd,
    lora_group_fwd,
    lora_linear,
    lora_linear_group,
    lora_linear_ref,
)

from tests.kernels._compare import assert_close, assert_error_within, assert_within_rounding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("y", "dx", "dA", "dB")


def _leaves(lead, i, o, r, bias, base_dtype, ad_dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, i, generator=g, dtype=torch.float64)
    w = torch.randn(o, i, generator=g, dtype=torch.float64) * i ** -0.5
    b = torch.randn(o, generator=g, dtype=torch.float64) if bias else None
    a = torch.randn(r, i, generator=g, dtype=torch.float64) * i ** -0.5
    bb = torch.randn(o, r, generator=g, dtype=torch.float64) * r ** -0.5  # non-zero B (PEFT's init is 0)
    dy = torch.randn(*lead, o, generator=g, dtype=torch.float64).to(device)

    def make(bd, ad):
        return (x.to(device, bd).requires_grad_(), w.to(device, bd), None if b is None else b.to(device, bd),
                a.to(device, ad).requires_grad_(), bb.to(device, ad).requires_grad_())
    return make, dy


def _grads(y, dy, x, a, b):
    return [y, *torch.autograd.grad((y.double() * dy).sum(), (x, a, b))]


@pytest.mark.parametrize("lead,i,o,r,bias", [((1,), 5, 3, 1, False), ((2, 7), 13, 11, 4, True),
                                             ((37,), 24, 40, 8, False)])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lora_linear_fused_matches_ref_fp32(lead, i, o, r, bias, dropout):
    make, dy = _leaves(lead, i, o, r, bias, torch.float32, torch.float32, DEV, seed=i)
    x, w, b, a, bb = make(torch.float32, torch.float32)
    torch.manual_seed(7)
    got = _grads(lora_linear(x, w, b, a, bb, 1.7, dropout, impl="fused"), dy, x, a, bb)
    torch.manual_seed(7)  # the same dropout mask
    exp = _grads(lora_linear(x, w, b, a, bb, 1.7, dropout, impl="ref"), dy, x, a, bb)
    assert got[0].shape == (*lead, o) and got[0].dtype == torch.float32
    # two fp32 compositions of the same products: up to reordered sums over the longest reduction (the tokens for
    # dA and dB, the features for y and dx) plus the rank, at each output's scale (measured: at most 2 eps x scale)
    terms = max(x.numel() // i, i, o) + r
    for name, gt, e in zip(NAMES, got, exp):
        assert_within_rounding(gt, e, f"{name} {lead, i, o, r} p={dropout}", torch.float32, terms)


def _eager(x, w, b, a, bb, s):  # PEFT's composition, every op in the inputs' dtypes
    return F.linear(x, w, b) + (F.linear(F.linear(x.to(a.dtype), a), bb) * s).to(x.dtype)



@pytest.mark.parametrize("base_dtype,ad_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
def test_lora_linear_low_precision_within_2x_eager(base_dtype, ad_dtype):
    """fp16 throughout (the addmm-fused chain), and PEFT's default: an fp32 adapter on a bf16 base."""
    make, dy = _leaves((29,), 48, 40, 4, True, base_dtype, ad_dtype, DEV, seed=3)
    out = []
    for fn, (bd, ad) in ((lambda *t: lora_linear(*t, impl="fused"), (base_dtype, ad_dtype)),
                         (_eager, (torch.float64, torch.float64)), (_eager, (base_dtype, ad_dtype))):
        x, w, b, a, bb = make(bd, ad)
        out.append(_grads(fn(x, w, b, a, bb, 2.0), dy, x, a, bb))
    got, exp, base = out
    assert got[0].dtype == got[1].dtype == base_dtype and got[2].dtype == got[3].dtype == ad_dtype
    for name, gt, e, bs in zip(NAMES, got, exp, base):
        assert_error_within(gt, e, bs, what=f"{name} {base_dtype}/{ad_dtype}", atol=1e-3)


def test_lora_linear_under_autocast_matches_ref():
    """Under bf16 autocast both chains run in bf16 (as nn.Linear would) and the output is bf16. The two chains
    round at different points, so the fused one must be as close to fp64 as the reference under the same
    autocast (assert_error_within, in bf16 precision)."""
    make, dy = _leaves((11,), 16, 24, 4, False, torch.float32, torch.float32, DEV, seed=4)
    x, w, b, a, bb = make(torch.float32, torch.float32)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        got = _grads(lora_linear(x, w, b, a, bb, 0.5, impl="fused"), dy, x, a, bb)
        base = _grads(lora_linear_ref(x, w, b, a, bb, 0.5), dy, x, a, bb)
    x64, w64, a64, b64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (x, w, a, bb))
    exp = _grads(lora_linear_ref(x64, w64, None, a64, b64, 0.5), dy, x64, a64, b64)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    for name, gt, e, bs in zip(NAMES, got, exp, base):
        assert_error_within(gt, e, bs, what=f"autocast {name}", dtype=torch.bfloat16)


def test_lora_linear_backward_flops_have_no_dW():
    """Backward = dx (2·T·I·O) + the adapter's four rank-r products; never the 2·T·I·O of dW, never recomputing x·Aᵀ."""
    t, i, o, r = 32, 48, 40, 4
    make, dy = _leaves((t,), i, o, r, False, torch.float32, torch.float32, DEV, seed=5)
    x, w, b, a, bb = make(torch.float32, torch.float32)
    y = lora_linear(x, w, b, a, bb, 1.0, impl="fused")
    with FlopCounterMode(display=False) as fc:
        y.backward(dy.float())
    assert fc.get_total_flops() == 2 * t * i * o + 2 * (t * o * r) * 2 + 2 * (t * r * i) * 2
    assert w.grad is None and x.grad is not None


def test_lora_linear_skips_dx_when_x_needs_none():
    make, dy = _leaves((9,), 8, 6, 2, False, torch.float32, torch.float32, DEV, seed=6)
    x, w, b, a, bb = make(torch.float32, torch.float32)
    x = x.detach()
    y = lora_linear(x, w, b, a, bb, 1.0, impl="fused")
    with FlopCounterMode(display=False) as fc:
        y.backward(dy.float())
    assert fc.get_total_flops() == 2 * (2 * 9 * 6 * 2) + 2 * 9 * 2 * 8  # g = s·dy B, dB, dA; no dy W
    assert a.grad is not None and bb.grad is not None


def test_lora_linear_bad_input():
    x, w, a, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(2, 8), torch.randn(5, 2)
    with pytest.raises(ValueError, match="frozen"):
        lora_linear(x, w.requires_grad_(), None, a, b, 1.0)
    with pytest.raises(ValueError, match=r"lora_a \(2, 7\)"):
        lora_linear(x, w.detach(), None, torch.randn(2, 7), b, 1.0)
    with pytest.raises(ValueError, match="dropout"):
        lora_linear(x, w.detach(), None, a, b, 1.0, dropout=1.0)
    with pytest.raises(ValueError, match="impl"):
        lora_linear(x, w.detach(), None, a, b, 1.0, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,o,i", [
    pytest.param(300, 384, 512, id="small"),
    *(pytest.param(8192, o, i, id=f"qwen3-8b-{o}x{i}", marks=pytest.mark.slow)
      for o, i in ((4096, 4096), (12288, 4096), (4096, 12288), (1024, 4096)))])
@pytest.mark.parametrize("ad_dtype", [torch.bfloat16, torch.float32])
def test_lora_linear_bf16(tokens, o, i, ad_dtype):
    """r=16, bf16 base, bf16 or fp32 adapter; the slow tier at Qwen3-8B's linears (q/o, gate/up, down, k/v) on
    8192 tokens."""
    make, dy = _leaves((tokens,), i, o, 16, False, torch.bfloat16, ad_dtype, "cuda", seed=0)
    out = []
    for fn, (bd, ad) in ((lambda *t: lora_linear(*t, impl="fused"), (torch.bfloat16, ad_dtype)),
                         (lora_linear_ref, (torch.float32, torch.float32)), (_eager, (torch.bfloat16, ad_dtype))):
        x, w, b, a, bb = make(bd, ad)
        out.append(_grads(fn(x, w, b, a, bb, 2.0), dy, x, a, bb))
    got, exp, base = out
    for name, gt, e, bs in zip(NAMES, got, exp, base):
        assert_error_within(gt, e, bs, what=f"{name} [{o}, {i}] adapter {ad_dtype}", atol=1e-2)


# --- shared input: lora_linear_group ---------------------------------------------------------------
def _group_leaves(t, i, outs, ranks, dtype, seed):
    """x [t, i] and, per member, a frozen W [O, I], a trained A [r, I] and a non-zero B [O, r]; dy per member."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, i, generator=g).to(DEV, dtype).requires_grad_()
    ws = [(torch.randn(o, i, generator=g) * i ** -0.5).to(DEV, dtype) for o in outs]
    As = [(torch.randn(r, i, generator=g) * i ** -0.5).to(DEV, dtype).requires_grad_() for r in ranks]
    Bs = [(torch.randn(o, r, generator=g) * r ** -0.5).to(DEV, dtype).requires_grad_() for o, r in zip(outs, ranks)]
    dys = [torch.randn(t, o, generator=g).to(DEV, dtype) for o in outs]
    return x, ws, As, Bs, dys


def _group_grads(ys, dys, x, As, Bs):
    loss = sum((y.double() * dy.double()).sum() for y, dy in zip(ys, dys))
    return list(ys) + list(torch.autograd.grad(loss, (x, *As, *Bs)))


@pytest.mark.parametrize("outs,ranks", [((40, 24, 3, 3), (4, 4, 4, 4)), ((17, 9), (2, 5)), ((12,), (3,))])
def test_lora_linear_group_matches_the_members_alone(outs, ranks):
    """The Gated DeltaNet shape (qkv, z, b, a: two tiny members), unequal ranks, and one member: outputs, dx, every
    dA and dB equal the separate layers' reference."""
    x, ws, As, Bs, dys = _group_leaves(19, 32, outs, ranks, torch.float32, seed=len(outs))
    scales = [0.5 + k for k in range(len(outs))]
    got = _group_grads(lora_linear_group(x, ws, As, Bs, scales, impl="fused"), dys, x, As, Bs)
    exp = _group_grads([lora_linear_ref(x, w, None, a, b, s) for w, a, b, s in zip(ws, As, Bs, scales)], dys, x, As, Bs)
    for k, (gt, e) in enumerate(zip(got, exp)):
        assert_close(gt, e, atol=1e-5, rtol=1e-5, what=f"group output/grad {k} {outs} {ranks}")


def test_lora_linear_group_under_autocast_and_with_x_frozen():
    """Under bf16 autocast the group and the layers alone round bf16 products at different points, so they differ
    by bf16 roundings (1 ulp is 6e-2 at the gradients' size of 10): the group must be as close to fp64 as the
    layers alone under the same autocast (assert_error_within: 2× their error, plus one bf16 rounding of the
    output's scale)."""
    x, ws, As, Bs, dys = _group_leaves(11, 16, (24, 8), (4, 4), torch.float32, seed=9)
    scales = [0.5, 2.0]
    with torch.autocast(DEV, dtype=torch.bfloat16):
        got = _group_grads(lora_linear_group(x, ws, As, Bs, scales, impl="fused"), dys, x, As, Bs)
        alone = _group_grads([lora_linear_ref(x, w, None, a, b, s) for w, a, b, s in zip(ws, As, Bs, scales)],
                             dys, x, As, Bs)
    exp = _group_grads([lora_linear_ref(x.double(), w.double(), None, a.double(), b.double(), s)
                        for w, a, b, s in zip(ws, As, Bs, scales)], dys, x, As, Bs)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    for k, (gt, e, a) in enumerate(zip(got, exp, alone)):
        assert_error_within(gt, e, a, what=f"autocast group {k}", dtype=torch.bfloat16)
    # layer 0 of a frozen-embedding run: x needs no grad, so no Σ dy_i W_i is computed
    xd = x.detach()
    ys = lora_linear_group(xd, ws, As, Bs, [1.0, 1.0], impl="fused")
    with FlopCounterMode(display=False) as fc:
        sum((y * dy).sum() for y, dy in zip(ys, dys)).backward()
    t, i, r = 11, 16, 8
    assert fc.get_total_flops() == sum(2 * (2 * t * o * 4) for o in (24, 8)) + 2 * t * r * i  # g, dB each; one dA
    assert all(a.grad is not None for a in As)


def test_lora_linear_group_backward_counts_no_dW_and_one_pass_for_every_dA():
    t, i, outs, r = 16, 24, (32, 8), 4
    x, ws, As, Bs, dys = _group_leaves(t, i, outs, (r, r), torch.float32, seed=11)
    ys = lora_linear_group(x, ws, As, Bs, [1.0, 1.0], impl="fused")
    with FlopCounterMode(display=False) as fc:
        sum((y * dy).sum() for y, dy in zip(ys, dys)).backward()
    per_member = sum(2 * t * o * r * 2 + 2 * t * o * i for o in outs)  # g_i, dB_i, dy_i W_i
    assert fc.get_total_flops() == per_member + 2 * (2 * r) * t * i * 2  # + one dA and one g·A over Σr = 2r
    assert all(w.grad is None for w in ws) and x.grad is not None


def test_lora_linear_group_frozen_adapters_and_bad_input():
    x, ws, As, Bs, dys = _group_leaves(7, 8, (6, 5), (2, 2), torch.float32, seed=12)
    frozen_a, frozen_b = [a.detach() for a in As], [b.detach() for b in Bs]
    ys = lora_linear_group(x, ws, frozen_a, frozen_b, [1.0, 1.0], impl="fused")
    sum((y * dy).sum() for y, dy in zip(ys, dys)).backward()
    exp = _group_grads([lora_linear_ref(x, w, None, a, b, 1.0) for w, a, b in zip(ws, frozen_a, frozen_b)], dys, x,
                       [], [])
    assert_close(x.grad, exp[2], atol=1e-5, rtol=1e-5, what="dx, frozen adapters")
    with pytest.raises(ValueError, match="all train or all be frozen"):
        lora_linear_group(x, ws, [As[0], frozen_a[1]], Bs, [1.0, 1.0])
    with pytest.raises(ValueError, match="M >= 1"):
        lora_linear_group(x, ws, As[:1], Bs, [1.0, 1.0])
    with pytest.raises(ValueError, match="frozen"):
        lora_linear_group(x, [ws[0].requires_grad_(), ws[1]], As, Bs, [1.0, 1.0])


def test_lora_group_custom_ops_pass_opcheck():
    x, ws, As, Bs, dys = _group_leaves(5, 8, (6, 3), (2, 2), torch.float32, seed=13)
    x, As, Bs = x.detach(), [a.detach() for a in As], [b.detach() for b in Bs]
    torch.library.opcheck(lora_group_fwd, (x, ws, As, Bs, [1.0, 0.5], torch.float32, torch.float32))
    u = x @ torch.cat(As).t()
    torch.library.opcheck(lora_group_bwd, (dys, x, ws, As, Bs, u, [1.0, 0.5], True, True))


def test_lora_linear_group_compiles_whole_and_matches_eager():
    """Under torch.compile (fullgraph: no graph break) the group stays two opaque custom ops with eager's gradients."""
    x, ws, As, Bs, dys = _group_leaves(9, 16, (12, 4, 4), (2, 2, 2), torch.float32, seed=14)

    def f(x, *adapters):
        return lora_linear_group(x, ws, adapters[:3], adapters[3:], [1.0, 0.5, 2.0], impl="fused")

    eager = _group_grads(f(x, *As, *Bs), dys, x, As, Bs)
    compiled = _group_grads(torch.compile(f, fullgraph=True, backend="aot_eager")(x, *As, *Bs), dys, x, As, Bs)
    for k, (c, e) in enumerate(zip(compiled, eager)):
        assert_close(c, e, atol=1e-6, rtol=1e-6, what=f"compiled group {k}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,d,outs", [pytest.param(300, 512, (1024, 512, 32, 32), id="small"),
                                           pytest.param(4096, 4096, (8192, 4096, 32, 32), id="qwen3.5-9b",
                                                        marks=pytest.mark.slow)])
def test_lora_linear_group_bf16_gated_deltanet_projections(tokens, d, outs):
    """Gated DeltaNet input projections (qkv, z, b, a; the slow tier at Qwen3.5-9B's: 8192, 4096, 32, 32 over D 4096
    on 4096 tokens), r 16, bf16 base and fp32 adapters under bf16 autocast (the bench's mixed setting): the group
    is as close to fp64 as the same layers run alone."""
    scales = [2.0] * 4
    x, ws, As, Bs, dys = _group_leaves(tokens, d, outs, (16,) * 4, torch.float32, seed=15)
    ws = [w.to(torch.bfloat16) for w in ws]
    exp = _group_grads([lora_linear_ref(x.double(), w.double(), None, a.double(), b.double(), s)
                        for w, a, b, s in zip(ws, As, Bs, scales)], dys, x, As, Bs)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _group_grads(lora_linear_group(x, ws, As, Bs, scales, impl="fused"), dys, x, As, Bs)
        alone = _group_grads([lora_linear(x, w, None, a, b, s, impl="fused") for w, a, b, s in zip(ws, As, Bs, scales)],
                             dys, x, As, Bs)
    for k, (g, e, a) in enumerate(zip(got, exp, alone)):
        assert_error_within(g, e, a, what=f"group vs alone, output/grad {k}", atol=1e-2)


def test_lora_linear_group_fp32_adapters_on_a_bf16_base_without_autocast():
    """PEFT's default dtypes (bf16 base, fp32 adapters, no autocast): the adapter products run in fp32 and are
    cast before the adds, as the layers alone do; as close to fp64 as the layers alone."""
    x, ws, As, Bs, dys = _group_leaves(13, 24, (20, 6, 6), (4, 4, 4), torch.float32, seed=16)
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    wb, dyb = [w.to(torch.bfloat16) for w in ws], [d.to(torch.bfloat16) for d in dys]
    scales = [2.0, 1.0, 0.5]
    exp = _group_grads([lora_linear_ref(xb.double(), w.double(), None, a.double(), b.double(), s)
                        for w, a, b, s in zip(wb, As, Bs, scales)], dyb, xb, As, Bs)
    got = _group_grads(lora_linear_group(xb, wb, As, Bs, scales, impl="fused"), dyb, xb, As, Bs)
    alone = _group_grads([lora_linear(xb, w, None, a, b, s, impl="fused") for w, a, b, s in zip(wb, As, Bs, scales)],
                         dyb, xb, As, Bs)
    assert got[0].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16 and got[4].dtype == torch.float32
    for k, (g, e, a) in enumerate(zip(got, exp, alone)):
        assert_error_within(g, e, a, what=f"bf16 base, fp32 adapters, output/grad {k}", atol=1e-3)
