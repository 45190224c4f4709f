import pytest
import torch

from atelier_studio.kernels.rmsnorm import add_rmsnorm, rmsnorm, rmsnorm_ref

from tests.kernels._compare import assert_close, assert_error_within


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
    assert torch.equal(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))  # exact: CPU "auto" is the reference


# --- the Triton kernel (CPU: through the interpreter; see conftest.py) ------------------------------
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _math_res(x, res, w, eps):
    h = x + res if res is not None else x
    return _math(h, w, eps), h


def _run(shape, dtype, residual, weight_grad, impl, device=DEV, seed=0):
    """Kernel outputs and grads, fp64 expectations, and eager-in-dtype baselines."""
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x64 = torch.randn(shape, generator=g, dtype=torch.float64) * 2
    r64 = torch.randn(shape, generator=g, dtype=torch.float64) if residual else None
    w64 = 1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    dy64, dh64 = (torch.randn(shape, generator=g, dtype=torch.float64),
                  torch.randn(shape, generator=g, dtype=torch.float64))

    def leaves(dt):
        x = x64.to(device, dt).requires_grad_()
        r = r64.to(device, dt).requires_grad_() if residual else None
        w = w64.to(device, dt).requires_grad_(weight_grad)
        return x, r, w

    def grads(outs, x, r, w):
        y, h = outs
        loss = (y.double() * dy64.to(device)).sum() + ((h.double() * dh64.to(device)).sum() if residual else 0)
        want = [t for t in (x, r, w) if t is not None and t.requires_grad]
        return [y, h] + list(torch.autograd.grad(loss, want))

    x, r, w = leaves(dtype)
    got = grads(add_rmsnorm(x, r, w, 1e-6, impl=impl) if residual else (rmsnorm(x, w, 1e-6, impl=impl), x), x, r, w)
    xe, re_, we = leaves(torch.float64)
    exp = grads(_math_res(xe, re_, we, 1e-6), xe, re_, we)
    xb, rb, wb = leaves(dtype)
    base = grads(_math_res(xb, rb, wb, 1e-6), xb, rb, wb)
    names = ["y", "h", "dx"] + (["dresidual"] if residual else []) + (["dweight"] if weight_grad else [])
    return names, got, exp, base


@pytest.mark.parametrize("shape", [(1, 1), (3, 7, 13), (5, 64), (2, 3, 4, 128), (11, 300)])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_triton_fp32(shape, residual):
    names, got, exp, _ = _run(shape, torch.float32, residual, weight_grad=True, impl="triton")
    assert got[0].dtype == torch.float32 and got[0].shape == shape
    for name, a, e in zip(names, got, exp):
        scale = shape[0] * 10 if name == "dweight" else 1  # dw sums over rows
        assert_close(a, e, atol=2e-5 * scale, rtol=2e-5, what=f"{name} {shape}")


@pytest.mark.parametrize("shape", [(3, 7, 13), (2, 3, 4, 128), (11, 300)])
@pytest.mark.parametrize("residual,weight_grad", [(False, True), (True, False)])
def test_rmsnorm_triton_fp16_within_2x_eager(shape, residual, weight_grad):
    names, got, exp, base = _run(shape, torch.float16, residual, weight_grad, impl="triton", seed=1)
    assert got[0].dtype == torch.float16 and len(got) == len(names)
    for name, a, e, b in zip(names, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {shape}", atol=1e-3)


def test_rmsnorm_triton_frozen_weight_gets_no_grad():
    x, w = torch.randn(4, 24, device=DEV, requires_grad=True), torch.randn(24, device=DEV)
    rmsnorm(x, w, 1e-5, impl="triton").sum().backward()
    assert w.grad is None and x.grad is not None and torch.isfinite(x.grad).all()


def test_rmsnorm_bad_input():
    with pytest.raises(ValueError, match="impl"):
        rmsnorm(torch.randn(2, 8), torch.randn(8), 1e-6, impl="cuda")
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape,residual", [
    pytest.param((300, 512), True, id="small-residual"), pytest.param((300, 4, 128), False, id="small-qk"),
    *(pytest.param(s, r, id="qwen3-8b-" + "x".join(map(str, s)) + ("-residual" if r else ""), marks=pytest.mark.slow)
      for s, r in (((8192, 4096), True), ((8192, 4096), False), ((8192, 32, 128), False), ((8192, 8, 128), False)))])
def test_rmsnorm_triton_bf16(shape, residual):
    """A block norm (fused residual) and a QK-norm (Dh=128) at small shapes; the slow tier at Qwen3-8B: the block
    norms (T=8192, D=4096) and QK-norm (H=32 / Hkv=8)."""
    names, got, exp, base = _run(shape, torch.bfloat16, residual, weight_grad=True, impl="triton", device="cuda")
    for name, a, e, b in zip(names, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {shape}", atol=1e-3)
