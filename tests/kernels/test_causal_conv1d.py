import pytest
import torch
import torch.nn.functional as F

import atelier_studio.kernels.causal_conv1d as cc
from atelier_studio.kernels.causal_conv1d import causal_conv1d

from tests.kernels._compare import assert_close, assert_error_within, assert_no_leak

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cu(lens: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _math(x: torch.Tensor, w: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Each document on its own through F.conv1d (Hugging Face's causal_conv1d_fn), then SiLU."""
    c, k = w.shape
    outs = [F.silu(F.conv1d(d.t()[None], w[:, None, :], padding=k - 1, groups=c)[0, :, : d.shape[0]].t())
            for d in x.split(lens)]
    return torch.cat(outs)


def _run(lens, c, k, dtype, impl, device=DEV, seed=0):
    """(names, kernel outputs+grads, fp64 math outputs+grads, eager-in-dtype baselines)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    x64, w64 = (torch.randn(n, c, generator=g, dtype=torch.float64),
                torch.randn(c, k, generator=g, dtype=torch.float64) / k)
    dy = torch.randn(n, c, generator=g, dtype=torch.float64).to(device)
    cu = _cu(lens, device)

    def go(fn, dt):
        x, w = x64.to(device, dt).requires_grad_(), w64.to(device, dt).requires_grad_()
        y = fn(x, w)
        return [y, *torch.autograd.grad((y.double() * dy).sum(), (x, w))]

    got = go(lambda x, w: causal_conv1d(x, w, cu, impl=impl), dtype)
    exp = go(lambda x, w: _math(x, w, lens), torch.float64)
    base = go(lambda x, w: _math(x, w, lens), dtype)
    return ["y", "dx", "dw"], got, exp, base


SHAPES = [([1], 1, 4), ([5, 11, 1, 7], 13, 4), ([3, 2], 70, 3), ([40], 130, 4), ([2, 9], 5, 1), ([17, 16], 64, 2)]


@pytest.mark.parametrize("lens,c,k", SHAPES)
def test_causal_conv1d_ref_is_per_document_conv(lens, c, k):
    names, got, exp, _ = _run(lens, c, k, torch.float32, impl="ref", device="cpu")
    for name, a, e in zip(names, got, exp):
        assert_close(a, e, atol=1e-5 * (sum(lens) if name == "dw" else 1), rtol=1e-5, what=f"{name} {lens} C={c} K={k}")


@pytest.mark.parametrize("defer_dw", [False, True])
@pytest.mark.parametrize("lens,c,k", SHAPES)
def test_causal_conv1d_triton_fp32(lens, c, k, defer_dw, monkeypatch):
    monkeypatch.setattr(cc, "_BWD_DEFER_DW", defer_dw)  # both ways of reducing dw (bench/causal_conv1d.py times them)
    names, got, exp, _ = _run(lens, c, k, torch.float32, impl="triton")
    assert got[0].dtype == torch.float32
    for name, a, e in zip(names, got, exp):
        assert_close(a, e, atol=2e-5 * (sum(lens) if name == "dw" else 1), rtol=2e-5, what=f"{name} {lens} C={c} K={k}")


@pytest.mark.parametrize("lens,c,k", [([5, 11, 1, 7], 13, 4), ([40], 130, 4)])
def test_causal_conv1d_triton_fp16_within_2x_eager(lens, c, k):
    names, got, exp, base = _run(lens, c, k, torch.float16, impl="triton", seed=1)
    assert got[0].dtype == torch.float16
    for name, a, e, b in zip(names, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {lens}", atol=1e-3)


# The leak check's rounding bound: each output sums K = 4 taps and goes through SiLU (an exp, an add, a
# division): 4 · K roundings, 2e-6 of the output's scale. A tap that reads the previous document's tail moves
# a document's first K − 1 outputs by O(1) of it (91% in _preceded).
CONV_TERMS = 4 * 4


def _preceded(impl: str, scale_other: float = 1.0):
    """(a 6-token document after a 5-token one in a packed row, the same row as one document, the document alone);
    `scale_other` scales the preceding document, so a leak of any strength can be made."""
    g = torch.Generator().manual_seed(2)
    c, k = 9, 4
    doc, other = torch.randn(6, c, generator=g), torch.randn(5, c, generator=g)
    w = torch.randn(c, k, generator=g)
    row = torch.cat([other * scale_other, doc])
    packed = causal_conv1d(row, w, _cu([5, 6]), impl=impl)[5:]
    one_document = causal_conv1d(row, w, _cu([11]), impl=impl)[5:]  # no boundary: the taps cross it
    return packed, one_document, causal_conv1d(doc, w, _cu([6]), impl=impl)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_a_preceding_document_changes_nothing(impl):
    """The taps of a document's first K−1 tokens read zeros, never the previous document's tail: the document's
    output inside the row is its output alone, up to rounding (the row and the document alone are laid out,
    and so vectorised, differently)."""
    packed, _, alone = _preceded(impl)
    assert_no_leak(packed, alone, f"conv {impl}, packed vs alone", torch.float32, CONV_TERMS)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_the_leak_check_fails_for_taps_that_cross_a_document_start(impl):
    """The check above, fed convolutions that leak on purpose, fails: the row run as one document (the taps read
    the previous document's tail), and the same with that tail scaled down to 1e-3."""
    _, crossing, alone = _preceded(impl)
    with pytest.raises(AssertionError, match="leak across the document boundary"):
        assert_no_leak(crossing, alone, f"conv {impl}, taps cross", torch.float32, CONV_TERMS)
    _, weak, alone = _preceded(impl, scale_other=1e-3)
    with pytest.raises(AssertionError, match="leak across the document boundary"):
        assert_no_leak(weak, alone, f"conv {impl}, 1e-3 of the tail crosses", torch.float32, CONV_TERMS)


def test_causal_conv1d_frozen_weight_gets_no_grad_and_bad_input():
    lens = [3, 4, 17, 16]  # 40 tokens: three token blocks, so the dx-only grid has several programs
    x = torch.randn(40, 6, device=DEV, requires_grad=True)
    w = torch.randn(6, 4, device=DEV)
    dy = torch.randn(40, 6, device=DEV)
    (causal_conv1d(x, w, _cu(lens, DEV), impl="triton") * dy).sum().backward()
    assert w.grad is None  # a frozen weight (LoRA): the kernel skips dw, and dx is still exact
    want, = torch.autograd.grad((causal_conv1d(x, w, _cu(lens, DEV), impl="ref") * dy).sum(), x)
    assert_close(x.grad, want, atol=2e-5, rtol=2e-5, what="dx, frozen weight")
    # the same dx bits as the backward that also computes dw (a different first-pass grid, same arithmetic)
    starts = cc.doc_starts(_cu(lens, DEV), 40)
    dx_frozen, _ = cc.conv_bwd(dy, x.detach(), w, starts, False)
    dx_trained, _ = cc.conv_bwd(dy, x.detach(), w, starts, True)
    assert torch.equal(dx_frozen, dx_trained)
    with pytest.raises(ValueError, match="impl"):
        causal_conv1d(x, w, _cu([7]), impl="cuda")
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(5, 4), _cu([7]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x, w, torch.tensor([0, 7]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lens,c", [pytest.param([300, 1, 63, 64, 65, 37], 512, id="small"),
                                    pytest.param([700, 1348, 2048, 1, 63, 64, 65, 1855, 37, 2011], 8192,
                                                 id="qwen3.5-9b", marks=pytest.mark.slow)])
def test_causal_conv1d_triton_bf16(lens, c):
    """K = 4, uneven packed documents; the slow tier at Qwen3.5-9B: C = 2·16·128 + 32·128 = 8192 channels, four
    packed rows of 2048."""
    names, got, exp, base = _run(lens, c, 4, torch.bfloat16, impl="triton", device="cuda")
    for name, a, e, b in zip(names, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {c} channels", atol=1e-3)
    # a frozen weight (every LoRA run) takes the dx-only grid: the same dx bits (exact by design: each element's
    # dx is the same expression in both launches, only the split of the work over programs differs)
    cu = _cu(lens, "cuda")
    x = torch.randn(sum(lens), c, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(c, 4, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    starts = cc.doc_starts(cu, x.shape[0])
    assert torch.equal(cc.conv_bwd(dy, x, w, starts, False)[0], cc.conv_bwd(dy, x, w, starts, True)[0])
