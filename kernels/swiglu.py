"""SwiGLU gate: y = silu(g) · u, with silu(g) = g · σ(g).

Shapes: E elements (gate and up flattened; any shape, e.g. [T, F]).  gate [..., F], up [..., F] → [..., F].

Forward:   y = g · σ(g) · u.
Backward:  du = dy · silu(g);  dg = dy · u · σ(g) · (1 + g · (1 − σ(g))).
Saved for backward: g, u (σ and silu are recomputed, so nothing [T, F]-sized is added).
Accumulation dtype: fp32 in registers, one rounding on store; y in gate.dtype, dg/du in their inputs' dtypes.
The gradients are written to new tensors (not into g and u in place, as Liger does): g and u may be
referenced elsewhere, and the MLP's peak memory is set by the [T, F] matmul outputs either way.

Packed (swiglu_packed): h [..., 2F] holding [g | u] along the last dim (a mixture of experts' gate/up grouped GEMM
writes them so) → y [..., F], and the backward writes dh [..., 2F] = [dg | du] in one pass. Splitting h into two
views instead would cost a copy of each half before the kernel (it reads contiguous operands) and, in the
backward, a full-size zero tensor per half plus their sum (autograd's slice backward).

Implementations (argument `impl`): "triton" (any device; CPU through TRITON_INTERPRET=1), "ref",
"auto" (Triton on CUDA, the reference elsewhere).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atelier_studio.kernels.custom_op import call_op, custom_op

IMPLS = ("auto", "triton", "ref")
BLOCK = 4096  # elements per program: a 16 B vector per thread at 8 warps for bf16, few tail programs


# --- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(du_ptr + offs, (dy * silu).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_packed_fwd_kernel(h_ptr, y_ptr, n, F, BLOCK: tl.constexpr):
    """y[r, c] = silu(h[r, c]) · h[r, F + c] over the n = R·F outputs."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g_offs = offs + (offs // F) * F  # row r starts at r·2F in h
    g = tl.load(h_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + g_offs + F, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_packed_bwd_kernel(dy_ptr, h_ptr, dh_ptr, n, F, BLOCK: tl.constexpr):
    """dh[r, c] = dg, dh[r, F + c] = du (the unpacked kernel's formulas)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g_offs = offs + (offs // F) * F
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(h_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + g_offs + F, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(dh_ptr + g_offs + F, (dy * silu).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + g_offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(dh_ptr.dtype.element_ty), mask=mask)


# --- launchers ------------------------------------------------------------------------------------
# torch.library custom ops: opaque to torch.compile (see kernels/rmsnorm.py's launchers for why).
@custom_op("atelier::swiglu_fwd")
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up contiguous, same shape → y (gate.dtype)."""
    y = torch.empty_like(gate)
    n = gate.numel()
    _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK, num_warps=8)
    return y


@swiglu_fwd.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@custom_op("atelier::swiglu_bwd")
def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, gate, up contiguous, same shape → (dgate, dup) in gate's and up's dtypes."""
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](dy, gate, up, dg, du, n, BLOCK=BLOCK, num_warps=8)
    return dg, du


@swiglu_bwd.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


@custom_op("atelier::swiglu_packed_fwd")
def swiglu_packed_fwd(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2F] contiguous → y [..., F] (h.dtype)."""
    f = h.shape[-1] // 2
    y = h.new_empty(*h.shape[:-1], f)
    n = y.numel()
    if n:
        _swiglu_packed_fwd_kernel[(triton.cdiv(n, BLOCK),)](h, y, n, f, BLOCK=BLOCK, num_warps=8)
    return y


@swiglu_packed_fwd.register_fake
def _(h):
    return h.new_empty(*h.shape[:-1], h.shape[-1] // 2)


@custom_op("atelier::swiglu_packed_bwd")
def swiglu_packed_bwd(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dy [..., F], h [..., 2F] contiguous → dh [..., 2F] in h's dtype."""
    dh = torch.empty_like(h)
    n = dy.numel()
    if n:
        _swiglu_packed_bwd_kernel[(triton.cdiv(n, BLOCK),)](dy, h, dh, n, h.shape[-1] // 2, BLOCK=BLOCK, num_warps=8)
    return dh


@swiglu_packed_bwd.register_fake
def _(dy, h):
    return torch.empty_like(h)


# --- autograd.Function ----------------------------------------------------------------------------
class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):  # noqa: D102
        ctx.save_for_backward(gate, up)
        return call_op(swiglu_fwd, gate, up)

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        gate, up = ctx.saved_tensors
        return call_op(swiglu_bwd, dy.contiguous(), gate, up)


class SwiGLUPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):  # noqa: D102
        ctx.save_for_backward(h)
        return call_op(swiglu_packed_fwd, h)

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        (h,) = ctx.saved_tensors
        return call_op(swiglu_packed_bwd, dy.contiguous(), h)


# --- public ---------------------------------------------------------------------------------------
def swiglu(gate: torch.Tensor, up: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """silu(gate) · up. gate, up [..., F] (same shape) → [..., F] in gate.dtype."""
    if impl not in IMPLS:
        raise ValueError(f"swiglu: impl must be one of {IMPLS}, got {impl!r}")
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if impl == "ref" or (impl == "auto" and not gate.is_cuda):
        return swiglu_ref(gate, up)
    return SwiGLUFunction.apply(gate.contiguous(), up.contiguous())


def swiglu_packed(h: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """silu(g) · u for h = [g | u] [..., 2F] → [..., F] in h.dtype (module docstring: Packed)."""
    if impl not in IMPLS:
        raise ValueError(f"swiglu_packed: impl must be one of {IMPLS}, got {impl!r}")
    if h.dim() == 0 or h.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: h [..., 2F] must have an even last dim, got {tuple(h.shape)}")
    if impl == "ref" or (impl == "auto" and not h.is_cuda):
        f = h.shape[-1] // 2
        return swiglu_ref(h[..., :f], h[..., f:])
    return SwiGLUPackedFunction.apply(h.contiguous())


# --- reference ------------------------------------------------------------------------------------
def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch silu(gate) · up in fp32, cast back to gate.dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
