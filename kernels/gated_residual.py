"""Gated residual (AdaLN-Zero): out = x + gate · y, with a per-image gate broadcast over tokens.

Shapes: B images, T tokens per image, D dim.
  x [B, T, D], y [B, T, D], gate [B, D] → out [B, T, D] in the promoted dtype of (x, y, gate), as eager's
  `x + gate[:, None] * y` gives. gate may be a strided view (a `.chunk` of a modulation linear's output): only
  its last dim must be contiguous.

Forward:   out = x + gate_b · y   (fp32 in registers, one rounding on store; eager rounds gate·y first).
Backward:  dx = dout;  dy = dout · gate_b;  dgate_b = Σ_{rows of b} dout · y.
Saved for backward: y and gate (x is not needed: its gradient is dout itself, passed through without a copy).
Accumulation dtype: fp32. dgate: program (b, g) walks the row blocks g, g + G, … of image b and writes one fp32
partial row [D]; the partials [B, G, D] are summed by torch (deterministic, no atomics).

The launchers are torch.library custom ops (opaque to torch.compile; see kernels/adaln.py).

Implementations (argument `impl`, from MMDiTArgs.kernels): "triton" (any device; CPU through TRITON_INTERPRET=1),
"ref", "auto" (Triton on CUDA, the reference elsewhere).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atelier_studio.kernels.adaln import _rowwise
from atelier_studio.kernels.custom_op import call_op, custom_op
from atelier_studio.kernels.rmsnorm import _blocks, _num_programs_cap

IMPLS = ("auto", "triton", "ref")


# --- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _gated_residual_fwd_kernel(x_ptr, y_ptr, gate_ptr, out_ptr, n_rows, T, D, gate_stride,
                               ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + (rows // T).to(tl.int64)[:, None] * gate_stride + cols[None, :], mask=mask,
                   other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + gate * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_residual_bwd_kernel(dout_ptr, y_ptr, gate_ptr, dy_ptr, dgate_part_ptr, T, D, gate_stride,
                               ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    b, g, n_prog = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    gate = tl.load(gate_ptr + b.to(tl.int64) * gate_stride + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for tb in range(g, tl.cdiv(T, ROWS), n_prog):
        t = tb * ROWS + tl.arange(0, ROWS)
        mask = (t < T)[:, None] & cmask[None, :]
        offs = (b.to(tl.int64) * T + t)[:, None] * D + cols[None, :]
        dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dy_ptr + offs, (dout * gate[None, :]).to(dy_ptr.dtype.element_ty), mask=mask)
        acc += tl.sum(dout * y, axis=0)
    tl.store(dgate_part_ptr + (b.to(tl.int64) * n_prog + g) * D + cols, acc, mask=cmask)


# --- launchers ------------------------------------------------------------------------------------
def _out_dtype(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.promote_types(y.dtype, gate.dtype))


@custom_op("atelier::gated_residual_fwd")
def gated_residual_fwd(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, y [B, T, D], gate [B, D] → x + gate · y [B, T, D] (promoted dtype)."""
    bsz, t, d = x.shape
    x, y, gate = x.contiguous(), y.contiguous(), _rowwise(gate)
    block_d, rows, num_warps = _blocks(d)
    out = torch.empty(x.shape, dtype=_out_dtype(x, y, gate), device=x.device)
    _gated_residual_fwd_kernel[(triton.cdiv(bsz * t, rows),)](x, y, gate, out, bsz * t, t, d, gate.stride(0),
                                                              ROWS=rows, BLOCK_D=block_d, num_warps=num_warps)
    return out


@gated_residual_fwd.register_fake
def _(x, y, gate):
    return x.new_empty(x.shape, dtype=_out_dtype(x, y, gate))


@custom_op("atelier::gated_residual_bwd")
def gated_residual_bwd(dout: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dout, y [B, T, D], gate [B, D] → (dy [B, T, D] in y.dtype, dgate fp32 [B, D])."""
    bsz, t, d = y.shape
    dout, y, gate = dout.contiguous(), y.contiguous(), _rowwise(gate)
    block_d, rows, num_warps = _blocks(d)
    g = max(1, min(triton.cdiv(t, rows), _num_programs_cap(y.device) // bsz))
    dy = torch.empty_like(y)
    part = torch.empty(bsz, g, d, dtype=torch.float32, device=y.device)
    _gated_residual_bwd_kernel[(bsz, g)](dout, y, gate, dy, part, t, d, gate.stride(0), ROWS=rows, BLOCK_D=block_d,
                                         num_warps=num_warps)
    return dy, part.sum(1)


@gated_residual_bwd.register_fake
def _(dout, y, gate):
    return torch.empty_like(y, memory_format=torch.contiguous_format), \
        y.new_empty(y.shape[0], y.shape[2], dtype=torch.float32)


# --- autograd.Function ----------------------------------------------------------------------------
class GatedResidualFunction(torch.autograd.Function):
    """x [B, T, D], y [B, T, D], gate [B, D] → x + gate · y."""

    @staticmethod
    def forward(ctx, x, y, gate):  # noqa: D102
        ctx.save_for_backward(y, gate)
        ctx.x_dtype = x.dtype
        return call_op(gated_residual_fwd, x, y, gate)

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        y, gate = ctx.saved_tensors
        dx = dout if ctx.needs_input_grad[0] else None
        if dx is not None and dx.dtype != ctx.x_dtype:
            dx = dx.to(ctx.x_dtype)
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            return dx, None, None
        dy, dgate = call_op(gated_residual_bwd, dout, y, gate)
        return dx, dy, dgate.to(gate.dtype)


# --- public ---------------------------------------------------------------------------------------
def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x + gate · y with gate [B, D] broadcast over the T tokens of x, y [B, T, D]."""
    if impl not in IMPLS:
        raise ValueError(f"gated_residual: impl must be one of {IMPLS}, got {impl!r}")
    if x.dim() != 3 or y.shape != x.shape or gate.shape != (x.shape[0], x.shape[2]):
        raise ValueError(f"gated_residual: expected x, y [B, T, D] and gate [B, D]; got x {tuple(x.shape)}, "
                         f"y {tuple(y.shape)}, gate {tuple(gate.shape)}")
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        return gated_residual_ref(x, y, gate)
    return GatedResidualFunction.apply(x, y, gate)


# --- reference ------------------------------------------------------------------------------------
def gated_residual_ref(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch in fp32, cast back to the promoted dtype of the inputs."""
    return (x.float() + gate.float()[:, None] * y.float()).to(_out_dtype(x, y, gate))
