"""Gated RMSNorm: y = x / sqrt(mean(x², -1) + eps) · w · silu(z) (the output norm of a Gated DeltaNet layer).

Shapes: R rows (all leading dims flattened; Qwen3.5: tokens × value heads), D normalised dim (value head dim).
  x [..., D], z [..., D] (the gate, same shape), weight [D] → y [..., D] (x.dtype).

Forward (per row):  r = rsqrt(mean(x²) + eps);  n = x · r;  y = n · w · silu(z)   (norm before gate, as
Hugging Face's Qwen3_5RMSNormGated and fla's FusedRMSNormGated with norm_before_gate=True).
Backward, with s = silu(z), σ = sigmoid(z), g = dy · w · s (the gradient reaching n):
  dx = r · g − x · r³ · mean(g · x);   dz = dy · n · w · σ · (1 + z · (1 − σ));   dw = Σ_rows dy · n · s.
Saved for backward: x, z, w, r (one fp32 scalar per row). Accumulation: fp32 everywhere; one rounding on
store. dw: fp32 partial rows [G, D] summed by torch (deterministic), as in kernels/rmsnorm.py.

Note on rounding: Hugging Face rounds n to the input dtype before multiplying by w; this file rounds once
(identical in fp32, within one bf16 ulp otherwise).

Implementations (argument `impl`): "triton" (any device; CPU through TRITON_INTERPRET=1), "ref"
(gated_rmsnorm_ref, differentiated by autograd), "auto" (Triton on CUDA, the reference elsewhere). The
launchers are torch.library custom ops, so they stay opaque calls inside torch.compile'd blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atelier_studio.kernels.custom_op import call_op, custom_op
from atelier_studio.kernels.rmsnorm import _blocks, _num_programs_cap

IMPLS = ("auto", "triton", "ref")


# --- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _gated_fwd_kernel(x_ptr, z_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, D, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program normalises ROWS rows of contiguous [R, D] matrices (ROWS > 1 for small D, e.g. 128).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)  # [ROWS]
    y = x * rstd[:, None] * w[None, :] * (z * tl.sigmoid(z))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _gated_bwd_kernel(dy_ptr, x_ptr, z_ptr, w_ptr, rstd_ptr, dx_ptr, dz_ptr, dw_part_ptr, n_rows, D,
                      COMPUTE_DW: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program p handles row blocks p, p + G, ... and writes its fp32 dw partial to row p of [G, D].
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for rb in range(pid, tl.cdiv(n_rows, ROWS), n_prog):
        rows = rb * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * D + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        sig = tl.sigmoid(z)
        s = z * sig
        n = x * rstd[:, None]
        g = dy * w[None, :] * s
        c = tl.sum(g * x, axis=1) / D  # mean(g·x) [ROWS]
        dx = rstd[:, None] * g - x * (rstd * rstd * rstd * c)[:, None]
        dz = dy * n * w[None, :] * sig * (1.0 + z * (1.0 - sig))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_acc += tl.sum(dy * n * s, axis=0)
    if COMPUTE_DW:
        tl.store(dw_part_ptr + pid.to(tl.int64) * D + cols, dw_acc, mask=cmask)


# --- launchers ------------------------------------------------------------------------------------
@custom_op("atelier::gated_rmsnorm_fwd")
def gated_rmsnorm_fwd(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, z [R, D] contiguous → (y [R, D], rstd fp32 [R])."""
    r, d = x.shape
    block_d, rows, num_warps = _blocks(d)
    y = torch.empty_like(x)
    rstd = torch.empty(r, dtype=torch.float32, device=x.device)
    _gated_fwd_kernel[(triton.cdiv(r, rows),)](x, z, weight, y, rstd, r, d, eps, ROWS=rows, BLOCK_D=block_d,
                                               num_warps=num_warps)
    return y, rstd


@gated_rmsnorm_fwd.register_fake
def _(x, z, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@custom_op("atelier::gated_rmsnorm_bwd")
def gated_rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      compute_dw: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy, x, z [R, D] contiguous → (dx, dz [R, D], dw fp32 [D], or empty when not computed)."""
    r, d = x.shape
    block_d, rows, num_warps = _blocks(d)
    g = max(1, min(triton.cdiv(r, rows), _num_programs_cap(x.device)))
    dx, dz = torch.empty_like(x), torch.empty_like(z)
    dw_part = torch.empty(g, d, dtype=torch.float32, device=x.device) if compute_dw else dx
    _gated_bwd_kernel[(g,)](dy, x, z, weight, rstd, dx, dz, dw_part, r, d, COMPUTE_DW=compute_dw, ROWS=rows,
                            BLOCK_D=block_d, num_warps=num_warps)
    return dx, dz, (dw_part.sum(0) if compute_dw else x.new_empty(0, dtype=torch.float32))


@gated_rmsnorm_bwd.register_fake
def _(dy, x, z, weight, rstd, compute_dw):
    return torch.empty_like(x), torch.empty_like(z), x.new_empty(x.shape[1] if compute_dw else 0, dtype=torch.float32)


# --- autograd.Function ----------------------------------------------------------------------------
class GatedRMSNormFunction(torch.autograd.Function):
    """x [R, D], z [R, D], weight [D] → rmsnorm(x) · w · silu(z) [R, D]."""

    @staticmethod
    def forward(ctx, x, z, weight, eps):  # noqa: D102
        y, rstd = call_op(gated_rmsnorm_fwd, x, z, weight, eps)
        ctx.save_for_backward(x, z, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, z, weight, rstd = ctx.saved_tensors
        compute_dw = ctx.needs_input_grad[2]
        dx, dz, dw = call_op(gated_rmsnorm_bwd, dy.contiguous(), x, z, weight, rstd, compute_dw)
        return dx, dz, (dw.to(weight.dtype) if compute_dw else None), None


# --- public ---------------------------------------------------------------------------------------
def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                  impl: str = "auto") -> torch.Tensor:
    """rmsnorm(x) · weight · silu(z) over the last dim. x, z [..., D], weight [D] → [..., D] in x.dtype."""
    if impl not in IMPLS:
        raise ValueError(f"gated_rmsnorm: impl must be one of {IMPLS}, got {impl!r}")
    if z.shape != x.shape or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"gated_rmsnorm: x {tuple(x.shape)}, z {tuple(z.shape)} and weight {tuple(weight.shape)} "
                         f"disagree (want x, z [..., D], weight [D])")
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        return gated_rmsnorm_ref(x, z, weight, eps)
    d = x.shape[-1]
    y = GatedRMSNormFunction.apply(x.reshape(-1, d).contiguous(), z.reshape(-1, d).contiguous(), weight, eps)  # [R, D]
    return y.view(x.shape)


# --- reference ------------------------------------------------------------------------------------
def gated_rmsnorm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain PyTorch in fp32, cast back to x.dtype: rmsnorm(x) · w · silu(z)."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (n * weight.float() * F.silu(z.float())).to(x.dtype)
