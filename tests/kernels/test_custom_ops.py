"""The kernels' launchers as torch.library custom ops: schemas and fake (meta) implementations agree with
the real ones (torch.library.opcheck), and a torch.compile'd function over the Triton paths gives the
eager outputs and gradients. CPU: the Triton kernels run in the interpreter (conftest.py) and compile
uses the aot_eager backend (the graph capture and autograd split that Inductor would see, without a C
compiler); the GPU test at the model level is tests/kernels/test_compile.py."""

from __future__ import annotations

import pytest
import torch

from atelier_studio.kernels.causal_conv1d import causal_conv1d, conv_bwd, conv_fwd, doc_starts
from atelier_studio.kernels.custom_op import call_op, custom_op
from atelier_studio.kernels.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_bwd, gated_rmsnorm_fwd
from atelier_studio.kernels.lora_linear import lora_linear, lora_linear_bwd, lora_linear_fwd
from atelier_studio.kernels.rmsnorm import add_rmsnorm, rmsnorm, rmsnorm_bwd, rmsnorm_fwd
from atelier_studio.kernels.rope import rope, rope_apply
from atelier_studio.kernels.swiglu import swiglu, swiglu_bwd, swiglu_fwd

from tests.kernels._compare import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV)


OPCHECK_TESTS = ("test_schema", "test_faketensor")


def test_rmsnorm_ops_pass_opcheck():
    x, r, w = _randn(6, 24, seed=0), _randn(6, 24, seed=1), 1 + 0.1 * _randn(24, seed=2)
    torch.library.opcheck(rmsnorm_fwd, (x, None, w, 1e-6), test_utils=OPCHECK_TESTS)
    torch.library.opcheck(rmsnorm_fwd, (x, r, w, 1e-6), test_utils=OPCHECK_TESTS)
    _, h, rstd = rmsnorm_fwd(x, r, w, 1e-6)
    dy = _randn(6, 24, seed=3)
    torch.library.opcheck(rmsnorm_bwd, (dy, None, h, w, rstd, True), test_utils=OPCHECK_TESTS)
    torch.library.opcheck(rmsnorm_bwd, (dy, dy, h, w, rstd, False), test_utils=OPCHECK_TESTS)


def test_rope_swiglu_lora_ops_pass_opcheck():
    q, k = _randn(5, 4, 8, seed=0), _randn(5, 2, 8, seed=1)
    cos, sin = _randn(5, 8, seed=2), _randn(5, 8, seed=3)
    torch.library.opcheck(rope_apply, (q, k, cos, sin, False), test_utils=OPCHECK_TESTS)
    g, u = _randn(7, 33, seed=4), _randn(7, 33, seed=5)
    torch.library.opcheck(swiglu_fwd, (g, u), test_utils=OPCHECK_TESTS)
    torch.library.opcheck(swiglu_bwd, (_randn(7, 33, seed=6), g, u), test_utils=OPCHECK_TESTS)
    x, w, a, b = _randn(9, 12, seed=7), _randn(10, 12, seed=8), _randn(3, 12, seed=9), _randn(10, 3, seed=10)
    f32 = torch.float32
    torch.library.opcheck(lora_linear_fwd, (x, w, None, a, b, 2.0, None, 0.0, f32, f32), test_utils=OPCHECK_TESTS)
    _, uu = lora_linear_fwd(x, w, None, a, b, 2.0, None, 0.0, f32, f32)
    dy = _randn(9, 10, seed=11)
    for need in ((True, True, True), (False, True, True), (True, False, False)):
        torch.library.opcheck(lora_linear_bwd, (dy, x, w, a, b, uu, None, 2.0, 0.0, *need), test_utils=OPCHECK_TESTS)


def test_qwen35_ops_pass_opcheck():
    x, w = _randn(11, 6, seed=0), _randn(6, 4, seed=1)
    starts = doc_starts(torch.tensor([0, 4, 11], dtype=torch.int32, device=DEV), 11)
    torch.library.opcheck(conv_fwd, (x, w, starts), test_utils=OPCHECK_TESTS)
    for dw in (True, False):
        torch.library.opcheck(conv_bwd, (_randn(11, 6, seed=2), x, w, starts, dw), test_utils=OPCHECK_TESTS)
    xs, z, g = _randn(7, 16, seed=3), _randn(7, 16, seed=4), 1 + 0.1 * _randn(16, seed=5)
    torch.library.opcheck(gated_rmsnorm_fwd, (xs, z, g, 1e-6), test_utils=OPCHECK_TESTS)
    _, rstd = gated_rmsnorm_fwd(xs, z, g, 1e-6)
    for dw in (True, False):
        torch.library.opcheck(gated_rmsnorm_bwd, (_randn(7, 16, seed=6), xs, z, g, rstd, dw), test_utils=OPCHECK_TESTS)


def test_compiled_qwen35_kernels_give_the_eager_gradients():
    cu = torch.tensor([0, 5, 13], dtype=torch.int32, device=DEV)

    def f(x, w, z, g):
        y = causal_conv1d(x, w, cu, impl="triton")  # [13, 16]
        return gated_rmsnorm(y, z, g, 1e-6, impl="triton").pow(2).sum()

    leaves = [_randn(13, 16, seed=0), _randn(16, 4, seed=1) * 0.5, _randn(13, 16, seed=2), 1 + 0.1 * _randn(16, seed=3)]

    def run(fn):
        args = [t.clone().requires_grad_() for t in leaves]
        fn(*args).backward()
        return [a.grad for a in args]

    torch._dynamo.reset()
    eager = run(f)
    compiled = run(torch.compile(f, backend="aot_eager", fullgraph=True))
    for i, (gc, ge) in enumerate(zip(compiled, eager)):
        assert ge.abs().sum() > 0
        assert_close(gc, ge, atol=1e-5, rtol=1e-5, what=f"grad of input {i}")


def _block(x, res, w_norm, q, k, cos, sin, gate, up, w_base, lora_a, lora_b):
    """A little of everything a designer block does, through the Triton paths."""
    y, h = add_rmsnorm(x, res, w_norm, 1e-6, impl="triton")
    y = rmsnorm(y, w_norm, 1e-6, impl="triton")
    qr, kr = rope(q, k, cos, sin, impl="triton")
    s = swiglu(gate, up, impl="triton")
    z = lora_linear(y, w_base, None, lora_a, lora_b, 2.0, impl="fused")
    return (y * h).sum() + (qr * 1.5).sum() + kr.pow(2).sum() + (s * s).sum() + z.pow(2).sum()


def test_compiled_triton_paths_give_the_eager_outputs_and_gradients():
    n, d, hq, hk, dh, f, r = 12, 24, 4, 2, 8, 20, 4
    pos = torch.arange(n, device=DEV).float()[:, None] * 0.1
    cos, sin = pos.cos().expand(n, dh).contiguous(), pos.sin().expand(n, dh).contiguous()
    leaves = [_randn(n, d, seed=0), _randn(n, d, seed=1), 1 + 0.1 * _randn(d, seed=2), _randn(n, hq, dh, seed=3),
              _randn(n, hk, dh, seed=4), _randn(n, f, seed=5), _randn(n, f, seed=6)]
    lora = [_randn(r, d, seed=8) * 0.1, _randn(d, r, seed=9) * 0.1]
    w_base = _randn(d, d, seed=7) * 0.2

    def run(fn):
        args = [t.clone().requires_grad_() for t in leaves]
        lo = [t.clone().requires_grad_() for t in lora]
        out = fn(*args[:5], cos, sin, *args[5:], w_base, *lo)
        out.backward()
        return out.detach(), [t.grad for t in args + lo]

    torch._dynamo.reset()
    eager_out, eager_grads = run(_block)
    compiled_out, compiled_grads = run(torch.compile(_block, backend="aot_eager", fullgraph=True))
    assert_close(compiled_out, eager_out, atol=1e-5, rtol=1e-5, what="output")
    for i, (gc, ge) in enumerate(zip(compiled_grads, eager_grads)):
        assert ge is not None and ge.abs().sum() > 0
        assert_close(gc, ge, atol=1e-5, rtol=1e-5, what=f"grad of input {i}")


@pytest.mark.parametrize("fn", ["rmsnorm", "swiglu"])
def test_custom_ops_are_opaque_to_dynamo(fn):
    """The compiled graph holds the atelier:: op as one node (Dynamo did not trace into the Triton launch)."""
    x, w = _randn(4, 16, seed=0), _randn(16, seed=1)
    call = ((lambda a: rmsnorm(a, w, 1e-6, impl="triton")) if fn == "rmsnorm"
            else (lambda a: swiglu(a, a * 2, impl="triton")))
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(call, backend=backend, fullgraph=True)(x)
    assert any(f"atelier.{fn}_fwd" in t for t in seen), seen
    assert not any("triton" in t.lower() for t in seen), seen


# --- kernels/custom_op.py: which calls skip the dispatcher --------------------------------------------
@custom_op("atelier_test::returns_its_input")
def _returns_its_input(x: torch.Tensor) -> torch.Tensor:
    return x  # the dispatcher refuses an output that aliases an input: a call that went through it raises


@_returns_its_input.register_fake
def _(x):
    return torch.empty_like(x)


def test_call_op_calls_the_body_in_eager_and_the_registered_op_under_a_dispatch_mode():
    """Eager code outside any mode gets the body itself (here: its input back, which the dispatcher would refuse);
    inside a TorchDispatchMode (FlopCounterMode, FakeTensorMode, selective checkpointing) and while the profiler
    records, the call goes through the dispatcher, so they see the registered op; a meta tensor reaches the fake
    implementation; a plain function in the op's place (a test's spy) is called."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.randn(3)
    assert call_op(_returns_its_input, x) is x

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Names() as mode, pytest.raises(RuntimeError, match="alias"):
        call_op(_returns_its_input, x)
    assert any("returns_its_input" in n for n in mode.names)
    assert call_op(lambda t: t + 1, x).equal(x + 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):  # through the dispatcher
        with pytest.raises(RuntimeError, match="alias"):
            call_op(_returns_its_input, x)
    meta = call_op(_returns_its_input, torch.empty(3, device="meta"))  # the fake implementation: a new tensor
    assert meta.is_meta and meta.shape == (3,)
    assert call_op(_returns_its_input, [x][0]) is x
