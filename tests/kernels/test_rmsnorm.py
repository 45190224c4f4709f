import pytest
import torch

from kernels.rmsnorm import rmsnorm, rmsnorm_ref
from tests.kernels._compare import assert_close


def _math(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("shape", [(1, 1), (3, 7, 13), (2, 5, 64), (4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_ref_matches_math_with_grads(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    w64 = torch.randn(shape[-1], generator=g, dtype=torch.float64)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    x, w = x64.to(dtype).requires_grad_(), w64.to(dtype).requires_grad_()
    y = rmsnorm_ref(x, w, 1e-6)
    assert y.dtype == dtype
    (y.double() * dy).sum().backward()
    xe, we = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ye = _math(xe, we, 1e-6)
    (ye * dy).sum().backward()
    # bf16: the only rounding is the final cast (and the inputs' own), so ~one bf16 ulp.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    assert_close(y, ye, **tol, what="y")
    assert_close(x.grad, xe.grad, **tol, what="dx")
    assert_close(w.grad, we.grad, atol=tol["atol"] * shape[0] * 10, rtol=tol["rtol"], what="dw")


def test_rmsnorm_public_checks_shapes():
    with pytest.raises(ValueError, match="last dim"):
        rmsnorm(torch.randn(2, 8), torch.randn(7), 1e-6)
    x, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))
