"""Causal depthwise conv1d + SiLU over packed documents (the short convolution of a Gated DeltaNet layer).

Shapes: N packed tokens (all documents of all rows, flattened), C channels, K taps (Qwen3.5: 4), S documents.
  x [N, C], weight [C, K], cu_seqlens int32 [S+1] (0, end of doc 0, ..., N) → y [N, C] (x.dtype).

Forward, for token t of the document that starts at s(t):
  a[t, c] = Σ_{k<K, t−(K−1−k) ≥ s(t)} w[c, k] · x[t − (K−1−k), c];   y = silu(a) = a · σ(a).
This is F.conv1d(x, w, padding=K−1, groups=C)[..., :T] (Hugging Face's causal_conv1d_fn) run on each
document alone: the taps that would reach into the previous document read zeros instead, so a packed
row equals its documents one by one (the conv mixes neighbouring tokens, so without the boundary it would leak one
document into the next).
Backward, with da[t] = dy[t] · σ(a[t]) · (1 + a[t] · (1 − σ(a[t]))):
  dx[s', c] = Σ_{j<K, t = s'+j in the same document} w[c, K−1−j] · da[t, c];
  dw[c, k]  = Σ_t da[t, c] · x[t − (K−1−k), c]   (same masking as the forward).
Saved for backward: x, w and the per-token document start (int32 [N]); a is recomputed (K taps are cheap),
so no [N, C] activation is stored besides x. The backward runs in two passes: the first recomputes a once
per token and writes da (fp32 [N, C], transient: 512 MiB at the 9B shape) and the dw partials (only when the
weight trains: a LoRA run freezes it); the second gathers dx from K shifted
reads of da. (One pass would recompute a K times, once per output each input feeds: 4× the forward's work,
which the Qwen3.5-9B profile showed as 5% of the step.) Accumulation: fp32 in registers; dw partials fp32
[G, C, K] summed by torch (deterministic, no atomics).

Implementations (argument `impl`, from the model config): "triton" (any device; CPU through
TRITON_INTERPRET=1, which tests use), "ref" (causal_conv1d_ref, differentiated by autograd), "auto"
(Triton on CUDA, the reference elsewhere). The launchers are torch.library custom ops, so they stay
opaque calls inside torch.compile'd blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atelier_studio.kernels.custom_op import call_op, custom_op

IMPLS = ("auto", "triton", "ref")


# --- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _weights(w_ptr, cols, cmask, K: tl.constexpr, KP: tl.constexpr):
    """The taps of channels `cols`, fp32 [BLOCK_C, KP] (zero past K)."""
    kk = tl.arange(0, KP)
    return tl.load(w_ptr + cols[:, None] * K + kk[None, :], mask=cmask[:, None] & (kk[None, :] < K),
                   other=0.0).to(tl.float32)


@triton.jit
def _taps(x_ptr, w2, t, tmask, start, C, cols, cmask, K: tl.constexpr, KP: tl.constexpr):
    """(pre-activation a [BLOCK_T, BLOCK_C] fp32, the taps' x [BLOCK_T, KP, BLOCK_C]) of tokens t < N."""
    kk = tl.arange(0, KP)
    src = t[:, None] - (K - 1 - kk[None, :])  # [BLOCK_T, KP] the token each tap reads
    ok = tmask[:, None] & (src >= start[:, None]) & (kk[None, :] < K)  # taps inside this document
    offs = src[:, :, None].to(tl.int64) * C + cols[None, None, :]  # [BLOCK_T, KP, BLOCK_C]
    x3 = tl.load(x_ptr + offs, mask=ok[:, :, None] & cmask[None, None, :], other=0.0).to(tl.float32)
    return tl.sum(x3 * tl.trans(w2)[None, :, :], axis=1), x3


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, start_ptr, y_ptr, N, C,
                     K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tmask, cmask = t < N, cols < C
    w2 = _weights(w_ptr, cols, cmask, K, KP)
    start = tl.load(start_ptr + t, mask=tmask, other=0)
    a, _ = _taps(x_ptr, w2, t, tmask, start, C, cols, cmask, K, KP)
    y = a * tl.sigmoid(a)
    offs = t[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


@triton.jit
def _conv_bwd_da_kernel(x_ptr, w_ptr, start_ptr, dy_ptr, da_ptr, dw_part_ptr, N, C,
                        K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                        COMPUTE_DW: tl.constexpr, DEFER_DW: tl.constexpr):
    # Pass 1 of the backward: da (fp32) and dw. Program (p, cb) walks token blocks p, p + G, ... of channel
    # block cb; its dw partial is row p of [G, C, KP]. DEFER_DW: keep the dw products per token row in
    # registers and reduce over the rows once at the end, instead of a cross-thread reduction per block.
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    kk = tl.arange(0, KP)
    w2 = _weights(w_ptr, cols, cmask, K, KP)
    dw_acc = tl.zeros((BLOCK_C, KP), dtype=tl.float32)
    dw_rows = tl.zeros((BLOCK_T, KP, BLOCK_C), dtype=tl.float32)
    for tb in range(pid, tl.cdiv(N, BLOCK_T), n_prog):
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < N
        start = tl.load(start_ptr + t, mask=tmask, other=0)
        a, x3 = _taps(x_ptr, w2, t, tmask, start, C, cols, cmask, K, KP)
        sig = tl.sigmoid(a)
        offs = t[:, None].to(tl.int64) * C + cols[None, :]
        io_mask = tmask[:, None] & cmask[None, :]
        dy = tl.load(dy_ptr + offs, mask=io_mask, other=0.0).to(tl.float32)
        da = dy * sig * (1.0 + a * (1.0 - sig))  # [BLOCK_T, BLOCK_C]
        tl.store(da_ptr + offs, da, mask=io_mask)
        if COMPUTE_DW:  # x3 is zero where a tap left the document
            if DEFER_DW:
                dw_rows += da[:, None, :] * x3
            else:
                dw_acc += tl.trans(tl.sum(da[:, None, :] * x3, axis=0))
    if COMPUTE_DW:
        if DEFER_DW:
            dw_acc = tl.trans(tl.sum(dw_rows, axis=0))
        part = pid.to(tl.int64) * C * KP + cols[:, None] * KP + kk[None, :]
        tl.store(dw_part_ptr + part, dw_acc, mask=cmask[:, None] & (kk[None, :] < KP))


@triton.jit
def _conv_bwd_dx_kernel(da_ptr, w_ptr, start_ptr, dx_ptr, N, C,
                        K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # Pass 2: dx[s] = Σ_j w[K−1−j] · da[s + j] over the outputs s + j still in s's document.
    s = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    smask, cmask = s < N, cols < C
    kk = tl.arange(0, KP)
    w2 = _weights(w_ptr, cols, cmask, K, KP)
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        t = s + j
        tmask = smask & (t < N)
        start = tl.load(start_ptr + t, mask=tmask, other=0)
        live = tmask & (start <= s)  # output t is in s's document
        da = tl.load(da_ptr + t[:, None].to(tl.int64) * C + cols[None, :], mask=live[:, None] & cmask[None, :],
                     other=0.0)
        w_tap = tl.sum(tl.where(kk[None, :] == K - 1 - j, w2, 0.0), axis=1)  # [BLOCK_C]
        dx += da * w_tap[None, :]
    offs = s[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=smask[:, None] & cmask[None, :])


# --- launchers ------------------------------------------------------------------------------------
_BLOCK_T, _BLOCK_C = 16, 64
_BWD_PROGRAMS_PER_SM = 32
_BWD_DEFER_DW = True  # 0.82 ms at the 9B shape with dw, vs 1.79 without (bench/results/causal-conv1d-2026-12-03.json)


def doc_starts(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [N]: the index of the first token of each token's document (no host sync: output_size given)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=n).to(torch.int32)


def _bwd_programs(device: torch.device, n: int, c_blocks: int, compute_dw: bool) -> int:
    """Token-block programs of the backward's first pass. Without dw (a frozen weight), one per token block, as
    in the forward: nothing is carried across blocks, and a loop in each program would only serialise loads.
    With dw, _BWD_PROGRAMS_PER_SM per SM in all on CUDA (this bounds the dw partials to G rows); 2 interpreted."""
    if not compute_dw:
        return triton.cdiv(n, _BLOCK_T)
    if device.type != "cuda":
        return max(1, min(2, triton.cdiv(n, _BLOCK_T)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(n, _BLOCK_T), triton.cdiv(_BWD_PROGRAMS_PER_SM * sms, c_blocks)))


# torch.library custom ops: opaque to torch.compile (see kernels/rmsnorm.py's launchers for why).
@custom_op("atelier::causal_conv1d_fwd")
def conv_fwd(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """x [N, C] contiguous, weight [C, K] contiguous, starts int32 [N] → y [N, C]."""
    n, c = x.shape
    k = weight.shape[1]
    y = torch.empty_like(x)
    grid = (triton.cdiv(n, _BLOCK_T), triton.cdiv(c, _BLOCK_C))
    _conv_fwd_kernel[grid](x, weight, starts, y, n, c, K=k, KP=triton.next_power_of_2(k), BLOCK_T=_BLOCK_T,
                           BLOCK_C=_BLOCK_C, num_warps=4)
    return y


@conv_fwd.register_fake
def _(x, weight, starts):
    return torch.empty_like(x)


@custom_op("atelier::causal_conv1d_bwd")
def conv_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor,
             compute_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x [N, C] contiguous → (dx [N, C] in x.dtype, dw fp32 [C, K], or empty when not computed)."""
    n, c = x.shape
    k = weight.shape[1]
    kp = triton.next_power_of_2(k)
    c_blocks = triton.cdiv(c, _BLOCK_C)
    g = _bwd_programs(x.device, n, c_blocks, compute_dw)
    da = torch.empty(n, c, dtype=torch.float32, device=x.device)
    dw_part = torch.empty(g if compute_dw else 1, c if compute_dw else 1, kp, dtype=torch.float32, device=x.device)
    _conv_bwd_da_kernel[(g, c_blocks)](x, weight, starts, dy, da, dw_part, n, c, K=k, KP=kp, BLOCK_T=_BLOCK_T,
                                       BLOCK_C=_BLOCK_C, COMPUTE_DW=compute_dw, DEFER_DW=_BWD_DEFER_DW, num_warps=4)
    dx = torch.empty_like(x)
    _conv_bwd_dx_kernel[(triton.cdiv(n, _BLOCK_T), c_blocks)](da, weight, starts, dx, n, c, K=k, KP=kp,
                                                              BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C, num_warps=4)
    return dx, (dw_part.sum(0)[:, :k].contiguous() if compute_dw else x.new_empty(0, dtype=torch.float32))


@conv_bwd.register_fake
def _(dy, x, weight, starts, compute_dw):
    return torch.empty_like(x), x.new_empty(tuple(weight.shape) if compute_dw else (0,), dtype=torch.float32)


# --- autograd.Function ----------------------------------------------------------------------------
class CausalConv1dFunction(torch.autograd.Function):
    """x [N, C], weight [C, K], starts int32 [N] → silu(causal depthwise conv) [N, C]."""

    @staticmethod
    def forward(ctx, x, weight, starts):  # noqa: D102
        ctx.save_for_backward(x, weight, starts)
        return call_op(conv_fwd, x, weight, starts)

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, weight, starts = ctx.saved_tensors
        compute_dw = ctx.needs_input_grad[1]
        dx, dw = call_op(conv_bwd, dy.contiguous(), x, weight, starts, compute_dw)
        return dx, (dw.to(weight.dtype) if compute_dw else None), None


# --- public ---------------------------------------------------------------------------------------
def _check(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"causal_conv1d: impl must be one of {IMPLS}, got {impl!r}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"causal_conv1d: expected x [N, C] and weight [C, K]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise ValueError(f"causal_conv1d: cu_seqlens must be int32 [S+1] with S >= 1, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """silu(causal depthwise conv1d) within each document. x [N, C], weight [C, K] → [N, C] in x.dtype."""
    _check(x, weight, cu_seqlens, impl)
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        return causal_conv1d_ref(x, weight, cu_seqlens)
    starts = doc_starts(cu_seqlens, x.shape[0])
    return CausalConv1dFunction.apply(x.contiguous(), weight.contiguous(), starts)


# --- reference ------------------------------------------------------------------------------------
def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch in fp32, cast back: tap k reads x shifted down K−1−k rows, zeroed across a document start."""
    n, k = x.shape[0], weight.shape[1]
    starts = doc_starts(cu_seqlens, n)
    t = torch.arange(n, device=x.device)
    xf, wf = x.float(), weight.float()
    a = torch.zeros_like(xf)
    for tap in range(k):
        shift = k - 1 - tap
        shifted = F.pad(xf, (0, 0, shift, 0))[:n]  # [N, C]: row t holds x[t − shift]
        inside = (t - shift >= starts).unsqueeze(1)  # [N, 1]
        a = a + torch.where(inside, shifted, 0.0) * wf[:, tap]
    return F.silu(a).to(x.dtype)
