import pytest
import torch
import torch.nn.functional as F

from atelier_studio.kernels.swiglu import swiglu, swiglu_packed, swiglu_ref

from tests.kernels._compare import assert_close, assert_error_within


@pytest.mark.parametrize("shape", [(1,), (3, 7, 13), (2, 5, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_ref_matches_math_with_grads(shape, dtype):
    gen = torch.Generator().manual_seed(1)
    g64, u64, dy = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    g, u = g64.to(dtype).requires_grad_(), u64.to(dtype).requires_grad_()
    y = swiglu_ref(g, u)
    (y.double() * dy).sum().backward()
    ge, ue = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    ye = ge * torch.sigmoid(ge) * ue
    (ye * dy).sum().backward()
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    assert_close(y, ye, **tol, what="y")
    assert_close(g.grad, ge.grad, **tol, what="dgate")
    assert_close(u.grad, ue.grad, **tol, what="dup")


def test_swiglu_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))


# --- the Triton kernel (CPU: through the interpreter; see conftest.py) ------------------------------
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(shape, dtype, device=DEV, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g64, u64, dy = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3 for _ in range(3))
    dy = dy.to(device)

    def go(dt, fn):
        g, u = g64.to(device, dt).requires_grad_(), u64.to(device, dt).requires_grad_()
        y = fn(g, u)
        return [y, *torch.autograd.grad((y.double() * dy).sum(), (g, u))]

    got = go(dtype, lambda g, u: swiglu(g, u, impl="triton"))
    exp = go(torch.float64, lambda g, u: g * torch.sigmoid(g) * u)
    base = go(dtype, lambda g, u: F.silu(g) * u)  # eager in the kernel's dtype
    return got, exp, base


@pytest.mark.parametrize("shape", [(1,), (3, 7, 13), (2, 5, 128), (4099,)])
def test_swiglu_triton_fp32(shape):
    got, exp, _ = _run(shape, torch.float32)
    assert got[0].dtype == torch.float32 and got[0].shape == shape
    for name, a, e in zip(("y", "dgate", "dup"), got, exp):
        assert_close(a, e, atol=1e-5, rtol=1e-5, what=f"{name} {shape}")


@pytest.mark.parametrize("shape", [(3, 7, 13), (4099,)])
def test_swiglu_triton_fp16_within_2x_eager(shape):
    got, exp, base = _run(shape, torch.float16, seed=1)
    assert all(t.dtype == torch.float16 for t in got)
    for name, a, e, b in zip(("y", "dgate", "dup"), got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {shape}", atol=1e-3)


def test_swiglu_triton_non_contiguous_and_bad_impl():
    g, u = torch.randn(6, 10, device=DEV).t(), torch.randn(6, 10, device=DEV).t()  # [10, 6], strided
    assert_close(swiglu(g, u, impl="triton"), swiglu_ref(g, u), atol=1e-6, rtol=1e-6, what="y strided")
    with pytest.raises(ValueError, match="impl"):
        swiglu(g, u, impl="liger")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [pytest.param((300, 1000), id="small"),
                                   pytest.param((8192, 12288), id="qwen3-8b", marks=pytest.mark.slow)])
def test_swiglu_triton_bf16(shape):
    """A small shape; the slow tier at Qwen3-8B's MLP: T=8192 tokens, F=12288."""
    got, exp, base = _run(shape, torch.bfloat16, device="cuda")
    for name, a, e, b in zip(("y", "dgate", "dup"), got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {shape}", atol=1e-3)


# --- packed: h = [g | u] along the last dim (the MoE experts' gate/up GEMM output) -------------------
@pytest.mark.parametrize("shape", [(5, 2 * 13), (2, 3, 2 * 128), (1, 2 * 4099)])
def test_swiglu_packed_triton_is_the_unpacked_kernel_bit_for_bit(shape):
    """swiglu_packed(h) and its gradient dh = [dg | du] against swiglu on the two halves (copied contiguous): the
    same formulas on the same values, so equal bit for bit in fp32 (a wrong offset between rows, a swapped half or
    a half written to the wrong place is O(1)); F = 13 and 4099 leave rows that straddle the kernel's blocks."""
    gen = torch.Generator().manual_seed(3)
    h = (torch.randn(shape, generator=gen) * 3).to(DEV).requires_grad_()
    f = shape[-1] // 2
    dy = torch.randn(*shape[:-1], f, generator=gen).to(DEV)
    y = swiglu_packed(h, impl="triton")
    (dh,) = torch.autograd.grad(y, h, dy)
    g, u = (h.detach()[..., :f].contiguous().requires_grad_(), h.detach()[..., f:].contiguous().requires_grad_())
    want = swiglu(g, u, impl="triton")
    dg, du = torch.autograd.grad(want, (g, u), dy)
    assert torch.equal(y, want)
    assert torch.equal(dh, torch.cat([dg, du], dim=-1))


def test_swiglu_packed_ref_and_fp16_within_2x_eager():
    """The reference path is the unpacked reference on the halves; fp16 through the kernel stays within twice
    eager fp16's error of a float64 SwiGLU (output and gradient)."""
    gen = torch.Generator().manual_seed(4)
    h64 = torch.randn(7, 2 * 33, generator=gen, dtype=torch.float64) * 3
    dy = torch.randn(7, 33, generator=gen, dtype=torch.float64).to(DEV)

    def go(dt, fn):
        h = h64.to(DEV, dt).requires_grad_()
        y = fn(h)
        return [y, *torch.autograd.grad((y.double() * dy).sum(), h)]

    exp = go(torch.float64, lambda h: F.silu(h[:, :33]) * h[:, 33:])
    got = go(torch.float16, lambda h: swiglu_packed(h, impl="triton"))
    base = go(torch.float16, lambda h: F.silu(h[:, :33]) * h[:, 33:])
    for name, a, e, b in zip(("y", "dh"), got, exp, base):
        assert_error_within(a, e, b, what=name, atol=1e-3)
    h = h64.float()
    assert torch.equal(swiglu_packed(h, impl="ref"), swiglu_ref(h[:, :33], h[:, 33:]))
    with pytest.raises(ValueError, match="even last dim"):
        swiglu_packed(torch.randn(3, 5))
    with pytest.raises(ValueError, match="impl"):
        swiglu_packed(h, impl="liger")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swiglu_packed_triton_bf16_is_the_unpacked_kernel_bit_for_bit():
    """The packed kernel in bf16 on the GPU at a 30B-A3B expert width (F = 768), against the unpacked one."""
    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(300, 2 * 768, generator=gen) * 3).to("cuda", torch.bfloat16).requires_grad_()
    dy = torch.randn(300, 768, generator=gen).to("cuda", torch.bfloat16)
    y = swiglu_packed(h, impl="triton")
    (dh,) = torch.autograd.grad(y, h, dy)
    g, u = h.detach()[:, :768].contiguous().requires_grad_(), h.detach()[:, 768:].contiguous().requires_grad_()
    want = swiglu(g, u, impl="triton")
    assert torch.equal(y, want)
    assert torch.equal(dh, torch.cat(torch.autograd.grad(want, (g, u), dy), dim=-1))
