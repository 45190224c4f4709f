import pytest
import torch
import torch.nn.functional as F

from atelier_studio.kernels.swiglu import swiglu, swiglu_ref
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
