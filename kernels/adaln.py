"""AdaLN modulation: y = LayerNorm(x) · (1 + scale) + shift, LayerNorm without affine (SD3's AdaLN norms).

Shapes: B images, T tokens per image, D dim; R = B·T rows.
  x [B, T, D], shift [B, D], scale [B, D] → y [B, T, D] (x.dtype); shift/scale are per image, broadcast over
  tokens (rows b·T … b·T + T − 1 read image b's vectors). shift/scale may be strided views (the `.chunk` of a
  modulation linear's [B, k·D] output): only their last dim must be contiguous.

Forward (per row r of image b):  μ = mean(x);  r = rsqrt(mean((x − μ)²) + eps);  x̂ = (x − μ) · r;
  y = x̂ · (1 + scale_b) + shift_b.
Backward, with g = dy · (1 + scale_b):
  dx = r · (g − mean(g) − x̂ · mean(g · x̂));
  dscale_b = Σ_{rows of b} dy · x̂;   dshift_b = Σ_{rows of b} dy.
Saved for backward: x, μ and r (one fp32 pair per row), scale.
Accumulation dtype: fp32 everywhere (row statistics, token sums); one rounding on store.
dscale/dshift: program (b, g) walks the row blocks g, g + G, … of image b and writes one fp32 partial row [D]
of each; the partials [B, G, D] are summed by torch (deterministic, no atomics).

The launchers are torch.library custom ops, so torch.compile keeps them as opaque calls with declared output
shapes (their register_fake) and never traces into the Triton launch: hand kernels traced inside compiled
blocks gave wrong gradients on the H200 (kernels/rmsnorm.py has the story).

Implementations (argument `impl`, from MMDiTArgs.kernels): "triton" (any device; CPU through
TRITON_INTERPRET=1, which tests use), "ref" (adaln_modulate_ref, differentiated by autograd), "auto"
(Triton on CUDA, the reference elsewhere).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atelier_studio.kernels.custom_op import call_op, custom_op

# Block shapes and the backward grid cap are RMSNorm's (the same row-wise layout: one heuristic for both).
from atelier_studio.kernels.rmsnorm import _blocks, _num_programs_cap

IMPLS = ("auto", "triton", "ref")


# --- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _adaln_fwd_kernel(x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, T, D, mod_stride, eps,
                      ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program normalises ROWS rows of the contiguous [R, D] matrix; rows may belong to different images.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    rmask, cmask = rows < n_rows, cols < D
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D  # [ROWS]
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)  # [ROWS]
    moffs = (rows // T).to(tl.int64)[:, None] * mod_stride + cols[None, :]  # image b's shift/scale
    scale = tl.load(scale_ptr + moffs, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + moffs, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * (1.0 + scale) + shift
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _adaln_bwd_kernel(dy_ptr, x_ptr, scale_ptr, mean_ptr, rstd_ptr, dx_ptr, dscale_part_ptr, dshift_part_ptr, T, D,
                      mod_stride, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (b, g) handles image b's row blocks g, g + G, ... and writes its fp32 partials to [b, g, :] of [B, G, D].
    b, g, n_prog = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    scale = tl.load(scale_ptr + b.to(tl.int64) * mod_stride + cols, mask=cmask, other=0.0).to(tl.float32)
    dscale_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dshift_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for tb in range(g, tl.cdiv(T, ROWS), n_prog):
        t = tb * ROWS + tl.arange(0, ROWS)
        tmask = t < T
        rows = b.to(tl.int64) * T + t  # [ROWS]
        mask = tmask[:, None] & cmask[None, :]
        offs = rows[:, None] * D + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=tmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=tmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        gx = dy * (1.0 + scale[None, :])
        c1 = tl.sum(gx, axis=1) / D  # mean(g) [ROWS]
        c2 = tl.sum(gx * xhat, axis=1) / D  # mean(g·x̂) [ROWS]
        dx = rstd[:, None] * (gx - c1[:, None] - xhat * c2[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dscale_acc += tl.sum(dy * xhat, axis=0)
        dshift_acc += tl.sum(dy, axis=0)
    part = (b.to(tl.int64) * n_prog + g) * D + cols
    tl.store(dscale_part_ptr + part, dscale_acc, mask=cmask)
    tl.store(dshift_part_ptr + part, dshift_acc, mask=cmask)


# --- launchers ------------------------------------------------------------------------------------
def _rowwise(v: torch.Tensor) -> torch.Tensor:
    """A [B, D] vector set whose last dim is contiguous (a `.chunk` view already is: no copy)."""
    return v if v.stride(1) == 1 else v.contiguous()


@custom_op("atelier::adaln_modulate_fwd")
def adaln_fwd(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, D], shift/scale [B, D] → (y [B, T, D] in x.dtype, mean fp32 [B·T], rstd fp32 [B·T])."""
    bsz, t, d = x.shape
    x = x.contiguous()
    shift, scale = _rowwise(shift), _rowwise(scale)
    if shift.stride(0) != scale.stride(0):
        shift, scale = shift.contiguous(), scale.contiguous()
    block_d, rows, num_warps = _blocks(d)
    y = torch.empty_like(x)
    mean = torch.empty(bsz * t, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    _adaln_fwd_kernel[(triton.cdiv(bsz * t, rows),)](x, shift, scale, y, mean, rstd, bsz * t, t, d, scale.stride(0),
                                                      eps, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps)
    return y, mean, rstd


@adaln_fwd.register_fake
def _(x, shift, scale, eps):
    n = x.shape[0] * x.shape[1]
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(n, dtype=torch.float32), \
        x.new_empty(n, dtype=torch.float32)


@custom_op("atelier::adaln_modulate_bwd")
def adaln_bwd(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor,
              rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy, x [B, T, D] → (dx [B, T, D] in x.dtype, dscale fp32 [B, D], dshift fp32 [B, D])."""
    bsz, t, d = x.shape
    dy, x, scale = dy.contiguous(), x.contiguous(), _rowwise(scale)
    block_d, rows, num_warps = _blocks(d)
    g = max(1, min(triton.cdiv(t, rows), _num_programs_cap(x.device) // bsz))
    dx = torch.empty_like(x)
    dscale_part = torch.empty(bsz, g, d, dtype=torch.float32, device=x.device)
    dshift_part = torch.empty_like(dscale_part)
    _adaln_bwd_kernel[(bsz, g)](dy, x, scale, mean, rstd, dx, dscale_part, dshift_part, t, d, scale.stride(0),
                                ROWS=rows, BLOCK_D=block_d, num_warps=num_warps)
    return dx, dscale_part.sum(1), dshift_part.sum(1)


@adaln_bwd.register_fake
def _(dy, x, scale, mean, rstd):
    vec = x.new_empty(x.shape[0], x.shape[2], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), vec, torch.empty_like(vec)


# --- autograd.Function ----------------------------------------------------------------------------
class AdaLNModulateFunction(torch.autograd.Function):
    """x [B, T, D], shift [B, D], scale [B, D] → y [B, T, D]."""

    @staticmethod
    def forward(ctx, x, shift, scale, eps):  # noqa: D102
        y, mean, rstd = call_op(adaln_fwd, x, shift, scale, eps)
        ctx.save_for_backward(x, scale, mean, rstd)
        ctx.dtypes = (shift.dtype, scale.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, scale, mean, rstd = ctx.saved_tensors
        dx, dscale, dshift = call_op(adaln_bwd, dy, x, scale, mean, rstd)
        shift_dtype, scale_dtype = ctx.dtypes
        return dx, dshift.to(shift_dtype), dscale.to(scale_dtype), None


# --- public ---------------------------------------------------------------------------------------
def _check(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"adaln_modulate: impl must be one of {IMPLS}, got {impl!r}")
    if x.dim() != 3 or shift.shape != (x.shape[0], x.shape[2]) or scale.shape != shift.shape:
        raise ValueError(f"adaln_modulate: expected x [B, T, D] and shift/scale [B, D]; got x {tuple(x.shape)}, "
                         f"shift {tuple(shift.shape)}, scale {tuple(scale.shape)}")


def adaln_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                   impl: str = "auto") -> torch.Tensor:
    """LayerNorm(x) · (1 + scale) + shift, per-image vectors over tokens. x [B, T, D] → [B, T, D] in x.dtype."""
    _check(x, shift, scale, impl)
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        return adaln_modulate_ref(x, shift, scale, eps)
    return AdaLNModulateFunction.apply(x, shift, scale, eps)


# --- reference ------------------------------------------------------------------------------------
def adaln_modulate_ref(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain PyTorch in fp32, cast back to x.dtype: F.layer_norm without affine, then the per-image affine."""
    y = F.layer_norm(x.float(), x.shape[-1:], eps=eps) * (1 + scale.float()[:, None]) + shift.float()[:, None]
    return y.to(x.dtype)
