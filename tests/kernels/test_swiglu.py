import pytest
import torch

from kernels.swiglu import swiglu, swiglu_ref
from tests.kernels._compare import assert_close


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
