"""RMSNorm: y = x / sqrt(mean(x², -1) + eps) · w, optionally fused with the residual add before it.

Shapes: R rows (all leading dims flattened), D normalised dim.
  rmsnorm:      x [..., D], weight [D] → y [..., D] (x.dtype)
  add_rmsnorm:  x [..., D], residual [..., D], weight [D] → (y, h) with h = x + residual (x.dtype), y = rmsnorm(h)

Forward (per row):  h = x (+ residual, rounded to x.dtype as eager does);  r = rsqrt(mean(h²) + eps);  y = h · r · w.
Backward, with g = dy · w:
  dh = r · g − h · r³ · mean(g · h)  (+ dh_out, the gradient reaching the new residual h);
  dx = dresidual = dh;  dw = Σ_rows dy · h · r.
Saved for backward: h (x itself when there is no residual), w, r (one fp32 scalar per row).
Accumulation dtype: fp32 everywhere (row sums, dw partials); one rounding on store.
dw: each backward program walks a strided set of row blocks and writes one fp32 partial row [D];
the partials [G, D] are summed by torch (deterministic, no atomics).

Note on rounding: Hugging Face's Qwen3RMSNorm rounds the normalised x to the input dtype before
multiplying by w; this file multiplies in fp32 and rounds once (identical in fp32, within one
bf16 ulp otherwise).

Implementations (argument `impl`, chosen by the caller): "triton" (any device; CPU through
TRITON_INTERPRET=1, which tests use), "ref" (rmsnorm_ref, differentiated by autograd), "auto"
(Triton on CUDA, the reference elsewhere).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atelier_studio.kernels.custom_op import call_op, custom_op

IMPLS = ("auto", "triton", "ref")


# --- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _rmsnorm_fwd_kernel(x_ptr, res_ptr, h_ptr, y_ptr, w_ptr, rstd_ptr, n_rows, D, eps,
                        HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program normalises ROWS rows of a contiguous [R, D] matrix (ROWS > 1 for small D, e.g. QK-norm's 128).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        # Round h to the stream dtype first: the next layer sees the rounded residual, so the norm must too.
        x = (x.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + eps)  # [ROWS]
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = h * rstd[:, None] * w[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rmsnorm_bwd_kernel(dy_ptr, dhout_ptr, h_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, D,
                        HAS_DHOUT: tl.constexpr, COMPUTE_DW: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program p handles row blocks p, p + G, p + 2G, ... and writes its fp32 dw partial to row p of [G, D].
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    n_blocks = tl.cdiv(n_rows, ROWS)
    for rb in range(pid, n_blocks, n_prog):
        rows = rb * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * D + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)  # [ROWS]
        g = dy * w[None, :]
        c = tl.sum(g * h, axis=1) / D  # mean(g·h) [ROWS]
        dh = rstd[:, None] * g - h * (rstd * rstd * rstd * c)[:, None]
        if HAS_DHOUT:
            dh += tl.load(dhout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dh.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_acc += tl.sum(dy * h * rstd[:, None], axis=0)
    if COMPUTE_DW:
        tl.store(dw_part_ptr + pid.to(tl.int64) * D + cols, dw_acc, mask=cmask)


# --- launchers ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _num_programs_cap(device: torch.device) -> int:
    """Backward grid cap: 4 programs per SM on CUDA keeps the [G, D] dw partials small; 4 on the interpreter."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _blocks(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps): about 2–4k elements per program, so small D packs several rows."""
    block_d = triton.next_power_of_2(d)
    if block_d > 65536:
        raise ValueError(f"rmsnorm: D={d} is above the 65536 a single Triton program holds")
    rows = max(1, min(16, 2048 // block_d))
    num_warps = 8 if block_d * rows >= 4096 else 4
    return block_d, rows, num_warps


# The launchers are torch.library custom ops: under torch.compile they stay opaque calls with declared
# shapes (the register_fake functions) instead of being traced into the graph. Traced directly inside
# compiled blocks, these kernels gave wrong gradients on the H200 (a LoRA run stopped learning). Eager code
# calls them through kernels/custom_op.py's call_op, which skips the dispatcher where nothing needs it.
# A custom op cannot return None: "absent" outputs are empty tensors and the caller knows which.
@custom_op("atelier::rmsnorm_fwd")
def rmsnorm_fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward on contiguous x/residual [R, D]. Returns (y [R, D], h [R, D] or empty, rstd fp32 [R])."""
    r, d = x.shape
    block_d, rows, num_warps = _blocks(d)
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x.new_empty(0)
    rstd = torch.empty(r, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(r, rows),)
    _rmsnorm_fwd_kernel[grid](x, residual if residual is not None else x, h if residual is not None else y, y, weight,
                              rstd, r, d, eps, HAS_RES=residual is not None, ROWS=rows, BLOCK_D=block_d,
                              num_warps=num_warps)
    return y, h, rstd


@rmsnorm_fwd.register_fake
def _(x, residual, weight, eps):
    h = torch.empty_like(x) if residual is not None else x.new_empty(0)
    return torch.empty_like(x), h, x.new_empty(x.shape[0], dtype=torch.float32)


@custom_op("atelier::rmsnorm_bwd")
def rmsnorm_bwd(dy: torch.Tensor, dh_out: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor,
                rstd: torch.Tensor, compute_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward. dy, dh_out, h [R, D] contiguous → (dh [R, D] in h.dtype, dw fp32 [D] or empty)."""
    r, d = h.shape
    block_d, rows, num_warps = _blocks(d)
    g = max(1, min(triton.cdiv(r, rows), _num_programs_cap(h.device)))
    dx = torch.empty_like(h)
    dw_part = torch.empty(g, d, dtype=torch.float32, device=h.device) if compute_dw else dx
    _rmsnorm_bwd_kernel[(g,)](dy, dh_out if dh_out is not None else dy, h, weight, rstd, dx, dw_part, r, d,
                              HAS_DHOUT=dh_out is not None, COMPUTE_DW=compute_dw, ROWS=rows, BLOCK_D=block_d,
                              num_warps=num_warps)
    return dx, (dw_part.sum(0) if compute_dw else h.new_empty(0, dtype=torch.float32))


@rmsnorm_bwd.register_fake
def _(dy, dh_out, h, weight, rstd, compute_dw):
    return torch.empty_like(h), h.new_empty(h.shape[1] if compute_dw else 0, dtype=torch.float32)


# --- autograd.Function ----------------------------------------------------------------------------
class RMSNormFunction(torch.autograd.Function):
    """x [R, D] (+ residual [R, D]), weight [D] → y, or (y, h) when a residual is given."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):  # noqa: D102
        y, h, rstd = call_op(rmsnorm_fwd, x, residual, weight, eps)
        has_res = residual is not None
        ctx.save_for_backward(h if has_res else x, weight, rstd)
        ctx.has_res = has_res
        if not has_res:
            return y
        return y, h

    @staticmethod
    def backward(ctx, dy, dh_out=None):  # noqa: D102
        h, weight, rstd = ctx.saved_tensors
        compute_dw = ctx.needs_input_grad[2]
        dx, dw = call_op(rmsnorm_bwd, dy.contiguous(), dh_out.contiguous() if dh_out is not None else None, h, weight,
                             rstd, compute_dw)
        dres = dx if ctx.has_res and ctx.needs_input_grad[1] else None
        return dx, dres, (dw.to(weight.dtype) if compute_dw else None), None


# --- public ---------------------------------------------------------------------------------------
def _check(x: torch.Tensor, weight: torch.Tensor, impl: str, residual: torch.Tensor | None = None) -> None:
    if impl not in IMPLS:
        raise ValueError(f"rmsnorm: impl must be one of {IMPLS}, got {impl!r}")
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rmsnorm: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree on the last dim")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"add_rmsnorm: residual {residual.dtype} {tuple(residual.shape)} must match x "
                         f"{x.dtype} {tuple(x.shape)}")


def _use_triton(impl: str, x: torch.Tensor) -> bool:
    return impl == "triton" or (impl == "auto" and x.is_cuda)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim. x [..., D], weight [D] → [..., D] in x.dtype."""
    _check(x, weight, impl)
    if not _use_triton(impl, x):
        return rmsnorm_ref(x, weight, eps)
    y = RMSNormFunction.apply(x.reshape(-1, x.shape[-1]).contiguous(), None, weight, eps)  # [R, D]
    return y.view(x.shape)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; (rmsnorm(h) [..., D], h [..., D]), both in x.dtype — the pre-norm block's add and norm."""
    _check(x, weight, impl, residual)
    if not _use_triton(impl, x):
        return add_rmsnorm_ref(x, residual, weight, eps)
    d = x.shape[-1]
    y, h = RMSNormFunction.apply(x.reshape(-1, d).contiguous(), residual.reshape(-1, d).contiguous(), weight, eps)
    return y.view(x.shape), h.view(x.shape)


# --- reference ------------------------------------------------------------------------------------
def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain PyTorch RMSNorm in fp32, cast back to x.dtype. x [..., D], weight [D]."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * r * weight.float()).to(x.dtype)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm_ref(h), h) with h = x + residual rounded to x.dtype (as an eager residual add rounds)."""
    h = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(h, weight, eps), h
