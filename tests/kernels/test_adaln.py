"""AdaLN modulation (LayerNorm without affine, then per-image scale/shift) forward and backward against the
reference."""

import pytest
import torch
import torch.nn.functional as F

from atelier_studio.kernels.adaln import adaln_bwd, adaln_fwd, adaln_modulate, adaln_modulate_ref

from tests.kernels._compare import assert_close, assert_error_within

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("y", "dx", "dshift", "dscale")
# The GPU tests' shapes: a small one (the fast tier) and SD3-medium's streams (the slow tier): the image stream at
# 1024 px (4096 tokens) and 512 px (1024), the text stream (333), dim 1536.
SMALL_AND_SD3_MEDIUM = [pytest.param((2, 77, 256), id="small"),
                        *(pytest.param(s, id="sd3-medium-" + "x".join(map(str, s)), marks=pytest.mark.slow)
                          for s in ((4, 4096, 1536), (4, 333, 1536), (2, 1024, 1536)))]


def _math(x, shift, scale, eps):
    """The formula written out (no F.layer_norm), for the reference's own test."""
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * (1 + scale[:, None]) + shift[:, None]


def _eager(x, shift, scale, eps):
    """Eager PyTorch in the inputs' dtype, as the model's plain path wrote it."""
    return F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale[:, None]) + shift[:, None]


def _run(shape, dtype, impl, device=DEV, seed=0, chunked=False):
    """(outputs and grads of the implementation, fp64 expectations, eager-in-dtype baselines)."""
    b, t, d = shape
    g = torch.Generator().manual_seed(seed)
    x64 = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5
    mod64 = torch.randn(b, 3 * d, generator=g, dtype=torch.float64) * 0.5  # shift, scale, (gate) of one linear
    dy64 = torch.randn(shape, generator=g, dtype=torch.float64).to(device)

    def go(dt, fn):
        x = x64.to(device, dt).requires_grad_()
        mod = mod64.to(device, dt).requires_grad_()
        shift, scale, _ = mod.chunk(3, dim=1) if chunked else (mod[:, :d].contiguous(), mod[:, d:2 * d].contiguous(), 0)
        if not chunked:
            shift, scale = shift.detach().requires_grad_(), scale.detach().requires_grad_()
        y = fn(x, shift, scale, 1e-6)
        grads = torch.autograd.grad((y.double() * dy64).sum(), (x, mod) if chunked else (x, shift, scale))
        if chunked:  # the chunk views' gradients, read back out of the linear output's
            grads = (grads[0], grads[1][:, :d], grads[1][:, d:2 * d])
        return [y, *grads]

    got = go(dtype, lambda *a: adaln_modulate(*a, impl=impl))
    exp = go(torch.float64, _math)
    base = go(dtype, _eager)
    return got, exp, base


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 7, 13), (3, 5, 64), (1, 11, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adaln_ref_matches_math_with_grads(shape, dtype):
    got, exp, _ = _run(shape, dtype, impl="ref", device="cpu")
    assert got[0].dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for name, a, e in zip(NAMES, got, exp):
        scale = shape[1] * 4 if name in ("dshift", "dscale") else 1  # token sums
        assert_close(a, e, atol=tol["atol"] * scale, rtol=tol["rtol"], what=f"{name} {shape}")


# --- the Triton kernel (CPU: through the interpreter; see conftest.py) ------------------------------
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 7, 13), (3, 5, 64), (2, 3, 300), (5, 17, 24)])
@pytest.mark.parametrize("chunked", [False, True])
def test_adaln_triton_fp32(shape, chunked):
    got, exp, _ = _run(shape, torch.float32, impl="triton", chunked=chunked)
    assert got[0].dtype == torch.float32 and got[0].shape == shape
    for name, a, e in zip(NAMES, got, exp):
        scale = shape[1] * 4 if name in ("dshift", "dscale") else 1
        assert_close(a, e, atol=3e-5 * scale, rtol=3e-5, what=f"{name} {shape}")


@pytest.mark.parametrize("shape", [(2, 7, 13), (3, 37, 96), (1, 5, 300)])
def test_adaln_triton_fp16_within_2x_eager(shape):
    got, exp, base = _run(shape, torch.float16, impl="triton", seed=1, chunked=True)
    assert got[0].dtype == torch.float16
    for name, a, e, b in zip(NAMES, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {shape}", atol=1e-3)


def test_adaln_custom_ops_pass_opcheck():
    """Schema, fake (meta) impls and AOT dispatch of both launchers, on strided (chunk-view) inputs."""
    x = torch.randn(2, 5, 24, device=DEV)
    shift, scale, _ = torch.randn(2, 72, device=DEV).chunk(3, dim=1)
    torch.library.opcheck(adaln_fwd, (x, shift, scale, 1e-6))
    _, mean, rstd = adaln_fwd(x, shift, scale, 1e-6)
    torch.library.opcheck(adaln_bwd, (torch.randn_like(x), x, scale, mean, rstd))


def test_adaln_compiled_equals_eager():
    """A compiled function around the kernel: the launchers stay opaque ops, output and grads equal eager.

    aot_eager runs torch.compile's tracing and autograd partition (where hand kernels went wrong) without
    Inductor's C++ codegen, so it is quick on a CPU; the GPU test below compiles with Inductor."""
    backend = "inductor" if DEV == "cuda" else "aot_eager"

    def block(x, mod):
        shift, scale = mod.chunk(2, dim=1)
        return adaln_modulate(x * 2, shift, scale, 1e-6, impl="triton").sin()

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    x0, m0 = torch.randn(3, 7, 40, generator=g).to(DEV), torch.randn(3, 80, generator=g).to(DEV)
    outs = []
    for fn in (block, compiled):
        x, mod = x0.clone().requires_grad_(), m0.clone().requires_grad_()
        y = fn(x, mod)
        y.square().sum().backward()
        outs.append((y, x.grad, mod.grad))
    for name, a, e in zip(("y", "dx", "dmod"), *outs):
        assert_close(a, e, atol=1e-5, rtol=1e-5, what=f"compiled {name}")


def test_adaln_bad_input():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="impl"):
        adaln_modulate(x, torch.randn(2, 8), torch.randn(2, 8), 1e-6, impl="cuda")
    with pytest.raises(ValueError, match=r"shift/scale \[B, D\]"):
        adaln_modulate(x, torch.randn(3, 8), torch.randn(3, 8), 1e-6)
    # exact: "auto" on CPU tensors is the reference, the same call twice
    assert torch.equal(adaln_modulate(x, x[:, 0], x[:, 1], 1e-6), adaln_modulate_ref(x, x[:, 0], x[:, 1], 1e-6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SMALL_AND_SD3_MEDIUM)
def test_adaln_triton_bf16(shape):
    """A small shape; the slow tier at SD3-medium: image stream at 1024 px (4096 tokens) and 512 px (1024), text
    stream (333), dim 1536."""
    got, exp, base = _run(shape, torch.bfloat16, impl="triton", device="cuda", chunked=True)
    for name, a, e, b in zip(NAMES, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {shape}", atol=1e-3)
