import pytest
import torch
import torch.nn.functional as F

from atelier_studio.kernels.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_ref

from tests.kernels._compare import assert_close, assert_error_within

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _math(x, z, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w * F.silu(z)


def _run(shape, dtype, impl, weight_grad=True, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    x64 = torch.randn(shape, generator=g, dtype=torch.float64) * 2
    z64 = torch.randn(shape, generator=g, dtype=torch.float64)
    w64 = 1 + 0.3 * torch.randn(shape[-1], generator=g, dtype=torch.float64)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(device)

    def go(fn, dt):
        x, z = x64.to(device, dt).requires_grad_(), z64.to(device, dt).requires_grad_()
        w = w64.to(device, dt).requires_grad_(weight_grad)
        y = fn(x, z, w)
        return [y, *torch.autograd.grad((y.double() * dy).sum(), [t for t in (x, z, w) if t.requires_grad])]

    got = go(lambda x, z, w: gated_rmsnorm(x, z, w, 1e-6, impl=impl), dtype)
    exp = go(lambda x, z, w: _math(x, z, w, 1e-6), torch.float64)
    base = go(lambda x, z, w: _math(x, z, w, 1e-6), dtype)
    return ["y", "dx", "dz"] + (["dw"] if weight_grad else []), got, exp, base


SHAPES = [(1, 1), (3, 7, 13), (5, 24), (2, 3, 4, 128), (11, 300)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_gated_rmsnorm_fp32(shape, impl):
    names, got, exp, _ = _run(shape, torch.float32, impl)
    assert got[0].dtype == torch.float32 and got[0].shape == shape
    for name, a, e in zip(names, got, exp):
        scale = shape[0] * 10 if name == "dw" else 1  # dw sums over rows
        assert_close(a, e, atol=2e-5 * scale, rtol=2e-5, what=f"{impl} {name} {shape}")


@pytest.mark.parametrize("shape", [(3, 7, 13), (2, 3, 4, 128)])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_gated_rmsnorm_triton_fp16_within_2x_eager(shape, weight_grad):
    names, got, exp, base = _run(shape, torch.float16, "triton", weight_grad, seed=1)
    assert got[0].dtype == torch.float16 and len(got) == len(names)
    for name, a, e, b in zip(names, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {shape}", atol=1e-3)


def test_gated_rmsnorm_public_checks():
    x, z, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    assert torch.equal(gated_rmsnorm(x, z, w, 1e-6), gated_rmsnorm_ref(x, z, w, 1e-6))  # CPU "auto" = reference
    with pytest.raises(ValueError, match="disagree"):
        gated_rmsnorm(x, torch.randn(3, 7), w, 1e-6)
    with pytest.raises(ValueError, match="impl"):
        gated_rmsnorm(x, z, w, 1e-6, impl="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [pytest.param((300, 4, 128), id="small"),
                                   pytest.param((8192, 32, 128), id="qwen3.5-9b", marks=pytest.mark.slow)])
def test_gated_rmsnorm_triton_bf16(shape):
    """Dv = 128 (Qwen3.5's); the slow tier at Qwen3.5-9B: 8192 tokens × 32 value heads."""
    names, got, exp, base = _run(shape, torch.bfloat16, "triton", device="cuda")
    for name, a, e, b in zip(names, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {shape}", atol=1e-3)
