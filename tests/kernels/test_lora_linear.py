import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from kernels.lora_linear import lora_linear, lora_linear_ref
from tests.kernels._compare import assert_close, assert_error_within

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


@pytest.mark.parametrize("lead,i,o,r,bias", [((1,), 5, 3, 1, False), ((2, 7), 13, 11, 4, True), ((37,), 24, 40, 8, False)])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lora_linear_fused_matches_ref_fp32(lead, i, o, r, bias, dropout):
    make, dy = _leaves(lead, i, o, r, bias, torch.float32, torch.float32, DEV, seed=i)
    x, w, b, a, bb = make(torch.float32, torch.float32)
    torch.manual_seed(7)
    got = _grads(lora_linear(x, w, b, a, bb, 1.7, dropout, impl="fused"), dy, x, a, bb)
    torch.manual_seed(7)  # the same dropout mask
    exp = _grads(lora_linear(x, w, b, a, bb, 1.7, dropout, impl="ref"), dy, x, a, bb)
    assert got[0].shape == (*lead, o) and got[0].dtype == torch.float32
    for name, gt, e in zip(NAMES, got, exp):
        assert_close(gt, e, atol=1e-5, rtol=1e-5, what=f"{name} {lead, i, o, r} p={dropout}")


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
    """Under bf16 autocast both chains run in bf16 (as nn.Linear would) and the output is bf16."""
    make, dy = _leaves((11,), 16, 24, 4, False, torch.float32, torch.float32, DEV, seed=4)
    x, w, b, a, bb = make(torch.float32, torch.float32)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        got = _grads(lora_linear(x, w, b, a, bb, 0.5, impl="fused"), dy, x, a, bb)
        exp = _grads(lora_linear_ref(x, w, b, a, bb, 0.5), dy, x, a, bb)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    for name, gt, e in zip(NAMES, got, exp):
        assert_close(gt, e, atol=3e-2, rtol=3e-2, what=f"autocast {name}")


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
@pytest.mark.parametrize("o,i", [(4096, 4096), (12288, 4096), (4096, 12288), (1024, 4096)])
@pytest.mark.parametrize("ad_dtype", [torch.bfloat16, torch.float32])
def test_lora_linear_bf16_real_shapes(o, i, ad_dtype):
    """Qwen3-8B's linears (q/o, gate/up, down, k/v) on 8192 tokens, r=16, bf16 base, bf16 or fp32 adapter."""
    make, dy = _leaves((8192,), i, o, 16, False, torch.bfloat16, ad_dtype, "cuda", seed=0)
    out = []
    for fn, (bd, ad) in ((lambda *t: lora_linear(*t, impl="fused"), (torch.bfloat16, ad_dtype)),
                         (lora_linear_ref, (torch.float32, torch.float32)), (_eager, (torch.bfloat16, ad_dtype))):
        x, w, b, a, bb = make(bd, ad)
        out.append(_grads(fn(x, w, b, a, bb, 2.0), dy, x, a, bb))
    got, exp, base = out
    for name, gt, e, bs in zip(NAMES, got, exp, base):
        assert_error_within(gt, e, bs, what=f"{name} [{o}, {i}] adapter {ad_dtype}", atol=1e-2)
