"""Gated residual x + gate · y (per-image gate over tokens) forward and backward against the reference."""

import pytest
import torch

from atelier_studio.kernels.gated_residual import (
    gated_residual,
    gated_residual_bwd,
    gated_residual_fwd,
    gated_residual_ref,
)

from tests.kernels._compare import assert_close, assert_error_within

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("out", "dx", "dy", "dgate")
# The GPU tests' shapes: a small one (the fast tier) and SD3-medium's streams (the slow tier): the image stream at
# 1024 px (4096 tokens) and 512 px (1024), the text stream (333), dim 1536.
SMALL_AND_SD3_MEDIUM = [pytest.param((2, 77, 256), id="small"),
                        *(pytest.param(s, id="sd3-medium-" + "x".join(map(str, s)), marks=pytest.mark.slow)
                          for s in ((4, 4096, 1536), (4, 333, 1536), (2, 1024, 1536)))]


def _run(shape, dtype, impl, device=DEV, seed=0):
    """(outputs and grads of the implementation, fp64 expectations, eager-in-dtype baselines); gate is a chunk view."""
    b, t, d = shape
    g = torch.Generator().manual_seed(seed)
    x64, y64 = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    mod64 = torch.randn(b, 3 * d, generator=g, dtype=torch.float64)
    dout = torch.randn(shape, generator=g, dtype=torch.float64).to(device)

    def go(dt, fn):
        x, y, mod = (v.to(device, dt).requires_grad_() for v in (x64, y64, mod64))
        gate = mod.chunk(3, dim=1)[2]
        out = fn(x, y, gate)
        dx, dy, dmod = torch.autograd.grad((out.double() * dout).sum(), (x, y, mod))
        return [out, dx, dy, dmod[:, 2 * d:]]

    got = go(dtype, lambda x, y, gate: gated_residual(x, y, gate, impl=impl))
    exp = go(torch.float64, lambda x, y, gate: x + gate[:, None] * y)
    base = go(dtype, lambda x, y, gate: x + gate[:, None] * y)
    return got, exp, base


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 7, 13), (3, 5, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_residual_ref_matches_math_with_grads(shape, dtype):
    got, exp, _ = _run(shape, dtype, impl="ref", device="cpu")
    assert got[0].dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    for name, a, e in zip(NAMES, got, exp):
        scale = shape[1] * 4 if name == "dgate" else 1
        assert_close(a, e, atol=tol["atol"] * scale, rtol=tol["rtol"], what=f"{name} {shape}")


# --- the Triton kernel (CPU: through the interpreter; see conftest.py) ------------------------------
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 7, 13), (3, 5, 64), (2, 3, 300), (5, 17, 24)])
def test_gated_residual_triton_fp32(shape):
    got, exp, _ = _run(shape, torch.float32, impl="triton")
    assert got[0].dtype == torch.float32 and got[0].shape == shape
    for name, a, e in zip(NAMES, got, exp):
        scale = shape[1] * 4 if name == "dgate" else 1
        assert_close(a, e, atol=2e-5 * scale, rtol=2e-5, what=f"{name} {shape}")


@pytest.mark.parametrize("shape", [(2, 7, 13), (3, 37, 96), (1, 5, 300)])
def test_gated_residual_triton_fp16_within_2x_eager(shape):
    got, exp, base = _run(shape, torch.float16, impl="triton", seed=1)
    assert got[0].dtype == torch.float16
    for name, a, e, b in zip(NAMES, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {shape}", atol=1e-3)


def test_gated_residual_mixed_dtypes_promote_like_eager():
    x = torch.randn(2, 3, 8, device=DEV, requires_grad=True)  # an fp32 stream with a half-precision branch
    y = torch.randn(2, 3, 8, device=DEV, dtype=torch.float16, requires_grad=True)
    gate = torch.randn(2, 8, device=DEV, dtype=torch.float16, requires_grad=True)
    out = gated_residual(x, y, gate, impl="triton")
    assert out.dtype == (x + gate[:, None] * y).dtype == torch.float32
    out.sum().backward()
    assert (x.grad.dtype, y.grad.dtype, gate.grad.dtype) == (torch.float32, torch.float16, torch.float16)


def test_gated_residual_custom_ops_pass_opcheck():
    x, y = torch.randn(2, 5, 24, device=DEV), torch.randn(2, 5, 24, device=DEV)
    gate = torch.randn(2, 72, device=DEV).chunk(3, dim=1)[1]
    torch.library.opcheck(gated_residual_fwd, (x, y, gate))
    torch.library.opcheck(gated_residual_bwd, (torch.randn_like(x), y, gate))


def test_gated_residual_compiled_equals_eager():
    """Compiled (aot_eager on a CPU, Inductor on CUDA) output and grads equal eager (see test_adaln.py)."""
    backend = "inductor" if DEV == "cuda" else "aot_eager"

    def block(x, y, mod):
        return gated_residual(x, y.relu(), mod.chunk(2, dim=1)[1], impl="triton").sin()

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(4)
    x0, y0, m0 = torch.randn(3, 7, 40, generator=g), torch.randn(3, 7, 40, generator=g), torch.randn(3, 80, generator=g)
    outs = []
    for fn in (block, compiled):
        x, y, mod = (v.to(DEV).requires_grad_() for v in (x0, y0, m0))
        out = fn(x, y, mod)
        out.square().sum().backward()
        outs.append((out, x.grad, y.grad, mod.grad))
    for name, a, e in zip(("out", "dx", "dy", "dmod"), *outs):
        assert_close(a, e, atol=1e-5, rtol=1e-5, what=f"compiled {name}")


def test_gated_residual_bad_input():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="impl"):
        gated_residual(x, x, x[:, 0], impl="cuda")
    with pytest.raises(ValueError, match=r"gate \[B, D\]"):
        gated_residual(x, x, torch.randn(2, 3, 8))
    assert torch.equal(gated_residual(x, x, x[:, 0]), gated_residual_ref(x, x, x[:, 0]))  # exact: CPU "auto" = ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SMALL_AND_SD3_MEDIUM)
def test_gated_residual_triton_bf16(shape):
    """A small shape; the slow tier at SD3-medium's streams (as test_adaln_triton_bf16)."""
    got, exp, base = _run(shape, torch.bfloat16, impl="triton", device="cuda")
    for name, a, e, b in zip(NAMES, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {shape}", atol=1e-3)
