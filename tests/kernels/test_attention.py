import pytest
import torch

from atelier_studio.kernels.attention import packed_causal_attention, packed_causal_attention_ref

from tests.kernels._compare import assert_close


def _math(q, k, v, lens):
    """Straightforward math: one N×N block-diagonal causal mask, explicit softmax, kv heads repeated."""
    n, h, dh = q.shape
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    i = torch.arange(n)
    allowed = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])  # [N, N]
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / dh**0.5
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def _inputs(lens, h, hkv, dh, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return [torch.randn(n, x, dh, generator=g, dtype=torch.float64).to(dtype) for x in (h, hkv, hkv)]


@pytest.mark.parametrize("lens,h,hkv,dh", [
    ([1], 1, 1, 8), ([5, 7, 1, 3], 4, 2, 16), ([13, 13, 2], 3, 3, 6), ([11, 4, 17], 8, 2, 32),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_math_with_grads(lens, h, hkv, dh, dtype):
    q, k, v = (t.requires_grad_() for t in _inputs(lens, h, hkv, dh, dtype))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    o = packed_causal_attention(q, k, v, cu, max(lens), impl="sdpa")
    assert o.dtype == dtype and o.shape == q.shape
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (o.double() * do).sum().backward()
    qe, ke, ve = (t.detach().double().requires_grad_() for t in (q, k, v))
    oe = _math(qe, ke, ve, lens)
    (oe * do).sum().backward()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    assert_close(o, oe, **tol, what="o")
    for name, a, e in (("dq", q, qe), ("dk", k, ke), ("dv", v, ve)):
        assert_close(a.grad, e.grad, **tol, what=name)


def test_ref_ignores_autocast():
    """Under an enclosing bf16 autocast the reference still computes in fp32 (and returns q's dtype)."""
    q, k, v = _inputs([5, 8], 4, 2, 16, torch.float32)
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    plain = packed_causal_attention_ref(q, k, v, cu, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = packed_causal_attention(q, k, v, cu, 8)
    assert auto.dtype == torch.float32 and torch.equal(auto, plain)  # exact: the same fp32 calls either way


def test_documents_do_not_leak():
    """Changing one document leaves every other document's output bit-identical.

    Exact by design, on any CPU: the reference runs one SDPA call per document (these lengths differ, so none
    are batched together), and the unchanged documents' calls get the same inputs in the same layout."""
    lens = [6, 9, 4]
    q, k, v = _inputs(lens, 4, 2, 16, torch.float32)
    cu = torch.tensor([0, 6, 15, 19], dtype=torch.int32)
    o1 = packed_causal_attention_ref(q, k, v, cu, 9)
    k2, v2 = k.clone(), v.clone()
    k2[6:15] += 1.0
    v2[6:15] -= 2.0
    o2 = packed_causal_attention_ref(q, k2, v2, cu, 9)
    assert torch.equal(o1[:6], o2[:6]) and torch.equal(o1[15:], o2[15:])
    assert not torch.allclose(o1[6:15], o2[6:15])


def test_bad_input_and_unavailable_impls():
    q, k, v = _inputs([4, 4], 4, 2, 8, torch.float32)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="impl must be one of"):
        packed_causal_attention(q, k, v, cu, 4, impl="bogus")
    for impl in ("flash", "varlen"):  # CPU tensors: never silently run the reference instead
        with pytest.raises(RuntimeError, match=impl):
            packed_causal_attention(q, k, v, cu, 4, impl=impl)
    with pytest.raises(ValueError, match="int32"):
        packed_causal_attention(q, k, v, cu.long(), 4)
    with pytest.raises(ValueError, match="max_seqlen"):
        packed_causal_attention(q, k, v, cu, 3)
    with pytest.raises(ValueError, match="rise from 0 to N"):
        packed_causal_attention(q, k, v, torch.tensor([0, 4, 7], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="multiple"):
        packed_causal_attention(q[:, :3], k, v, cu, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["auto", "varlen", "flash"])
def test_fast_paths_match_ref_on_cuda(impl):
    """FlashAttention's rule: the fast path's error vs an fp64 reference is at most ~2× eager bf16's."""
    if impl == "flash":
        pytest.importorskip("flash_attn")
    lens = [37, 128, 1, 90]
    q, k, v = (t.cuda().requires_grad_() for t in _inputs(lens, 8, 2, 128, torch.bfloat16))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    o = packed_causal_attention(q, k, v, cu, max(lens), impl=impl)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    qe, ke, ve = (t.detach().double().requires_grad_() for t in (q, k, v))
    oe = _math(qe.cpu(), ke.cpu(), ve.cpu(), lens).cuda()
    ge = torch.autograd.grad(oe, (qe, ke, ve), do.double())
    # the baseline is eager attention IN bf16 (transformers' eager: bf16 matmuls, fp32 softmax), not the fp32
    # reference rounded at the end, whose gradients are nearly exact
    from atelier_studio.bench.attention import eager_attention

    ob = eager_attention(q, k, v, lens)
    gb = torch.autograd.grad(ob, (q, k, v), do)
    for name, a, b, e in (("o", o, ob, oe), ("dq", dq, gb[0], ge[0]), ("dk", dk, gb[1], ge[1]),
                          ("dv", dv, gb[2], ge[2])):
        err, base = (a.double() - e).abs().max(), (b.double() - e).abs().max()
        assert err <= 2 * base + 1e-3, f"{impl} {name}: max error {err:.3e} vs eager bf16 {base:.3e}"


def test_rows_are_documents_only_when_every_row_is_one_document():
    from atelier_studio.kernels.attention import rows_are_documents

    assert rows_are_documents(2, rows=2, row_len=64, max_seqlen=64)
    assert not rows_are_documents(3, rows=2, row_len=64, max_seqlen=64)  # a row holds two documents
    assert not rows_are_documents(2, rows=2, row_len=64, max_seqlen=40)  # then lengths cannot sum to 128


@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2)])
def test_causal_attention_rows_equals_packed_ref_with_grads(h, hkv):
    from atelier_studio.kernels.attention import causal_attention_rows

    b, t, dh = 3, 17, 16
    q, k, v = (x.float().requires_grad_() for x in _inputs([b * t], h, hkv, dh, torch.float64, seed=3))
    do = torch.randn(b * t, h, dh, generator=torch.Generator().manual_seed(4))
    cu = torch.arange(0, b * t + 1, t, dtype=torch.int32)
    want = packed_causal_attention_ref(q, k, v, cu, t)
    gw = torch.autograd.grad(want, (q, k, v), do)
    got = causal_attention_rows(q.view(b, t, h, dh), k.view(b, t, hkv, dh), v.view(b, t, hkv, dh)).reshape(b * t, h, dh)
    gg = torch.autograd.grad(got, (q, k, v), do)
    assert_close(got, want, atol=1e-5, rtol=1e-5, what="o")
    for name, a, e in zip(("dq", "dk", "dv"), gg, gw):
        assert_close(a, e, atol=1e-5, rtol=1e-5, what=name)
    with pytest.raises(ValueError, match="expected q"):
        causal_attention_rows(q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_document_rows_take_the_sdpa_path_and_agree_with_varlen():
    """The designer's PackedAttention sends one-document rows to causal SDPA; it agrees with varlen."""
    from atelier_studio.designer.decoder import PackedAttention

    b, t, h, hkv, dh = 2, 1024, 8, 2, 128
    q, k, v = (x.view(b, t, -1, dh).cuda().requires_grad_()
               for x in _inputs([b * t], h, hkv, dh, torch.bfloat16, seed=5))
    cu = torch.arange(0, b * t + 1, t, dtype=torch.int32, device="cuda")
    do = torch.randn(b, t, h, dh, device="cuda", dtype=torch.bfloat16)
    import atelier_studio.designer.decoder as model_mod

    calls = []
    real = model_mod.causal_attention_rows
    model_mod.causal_attention_rows = lambda *a: calls.append(1) or real(*a)
    try:
        rows = PackedAttention(cu, t, "auto")(q, k, v)
        assert calls == [1]  # the one-document-rows path ran
        two_docs = torch.tensor([0, t // 2, t, 2 * t], dtype=torch.int32, device="cuda")
        PackedAttention(two_docs, t, "auto")(q, k, v)
        assert calls == [1]  # a row with two documents does not take it
    finally:
        model_mod.causal_attention_rows = real
    varlen = PackedAttention(cu, t, "varlen")(q, k, v)
    g_rows, g_varlen = (torch.autograd.grad(o, (q, k, v), do) for o in (rows, varlen))
    for name, a, e in (("o", rows, varlen), *zip(("dq", "dk", "dv"), g_rows, g_varlen)):
        err = ((a.float() - e.float()).abs().max() / e.float().abs().max()).item()
        assert err < 2e-2, f"{name}: rows path vs varlen, max diff relative to max |varlen| {err:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_varlen_gqa_directly_matches_the_reference():
    """FlashVarlenGQA (aten's flash kernels with Hkv < H) on its own, whatever this torch's varlen_attn offers."""
    from atelier_studio.bench.attention import eager_attention
    from atelier_studio.kernels.attention import FlashVarlenGQA

    lens = [300, 17, 1, 211]
    q, k, v = (t.cuda().requires_grad_() for t in _inputs(lens, 32, 8, 128, torch.bfloat16, seed=7))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to("cuda", torch.bfloat16)
    o = FlashVarlenGQA.apply(q, k, v, cu, max(lens))
    got = (o, *torch.autograd.grad(o, (q, k, v), do))
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    of = packed_causal_attention_ref(qf, kf, vf, cu, max(lens))
    want = (of, *torch.autograd.grad(of, (qf, kf, vf), do.float()))
    ob = eager_attention(q, k, v, lens)
    base = (ob, *torch.autograd.grad(ob, (q, k, v), do))
    for name, a, e, b in zip(("o", "dq", "dk", "dv"), got, want, base):
        err, ref = (a.float() - e).abs().max(), (b.float() - e).abs().max()
        assert err <= 2 * ref + 1e-3, f"{name}: max error {err:.3e} vs eager bf16 {ref:.3e}"


def test_flash_attention_4_alone_is_not_taken_for_flash_attention_2(tmp_path, monkeypatch):
    """flash-attn-4 installs flash_attn/cute/ only: `flash_attn` is then a namespace package without FA2's
    flash_attn_varlen_func, and the "flash" path must not be chosen for it; FA2's package (an __init__.py) is."""
    import importlib
    import importlib.util
    import sys

    from atelier_studio.kernels.attention import _has_flash

    for name in [k for k in sys.modules if k == "flash_attn" or k.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    if importlib.util.find_spec("flash_attn").origin is not None:
        pytest.skip("FlashAttention-2 is installed on this machine, earlier on sys.path")
    assert not _has_flash()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    importlib.invalidate_caches()
    assert _has_flash()
