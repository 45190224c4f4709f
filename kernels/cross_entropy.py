"""Linear + cross-entropy fused over token chunks: the [N, V] logits never exist at once.

Shapes: N tokens, D hidden dim, V vocab, C chunk of tokens.
  hidden [N, D], weight [V, D], labels [N] (ignore_index marks tokens without loss) → loss_sum fp32 [].

Forward per chunk c (cuBLAS matmul, then one Triton program per row):
  z = h_c Wᵀ  ([C, V] in the compute dtype, fp32 accumulation inside the matmul);
  online logsumexp over vocab blocks in fp32 (running max m, running Σ exp(z − m));
  loss_i = lse_i − z_i[y_i] for non-ignored i (0 for ignored rows; NaN for a label outside [0, V),
  so a bad label shows in the loss without a host sync).
Backward (computed during the forward, Liger-Kernel style, so no chunk is recomputed):
  dz = softmax(z) − onehot(y) (0 on ignored rows), written over z in place by the same program's
  second pass;  dh_c = dz W;  dW += dzᵀ h_c (fp32 accumulator; on CUDA the chunk product itself is
  returned in fp32 by cuBLAS, so no bf16 rounding of a chunk's contribution).
Saved: dh [N, D] and dW [V, D] in fp32 (the backward multiplies them by the incoming scalar grad),
or only the one that is needed (a frozen LM head saves no dW). Memory: O(C·V + N·D + V·D) instead of
O(N·V). All reductions are fp32 (bf16 accumulators drift at vocabularies past 250k).

The result is a SUM over non-ignored tokens; the trainer divides by the token count of the whole
accumulated batch, so gradient accumulation is scaled correctly (docs/training.md): the gradient of the
sum is exactly Σ_i ∂loss_i, with no per-chunk or per-micro-batch mean anywhere.

Implementations (argument `impl`): "triton" (the per-row kernel; any device, CPU through
TRITON_INTERPRET=1), "torch" (the same chunk loop with torch's logsumexp/softmax), "auto" (Triton
on CUDA, torch elsewhere). `linear_cross_entropy_ref` materialises the logits and is for tests only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

IMPLS = ("auto", "triton", "torch")


# --- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _ce_rows_kernel(z_ptr, stride_z, labels_ptr, loss_ptr, V, ignore_index,
                    COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    # One program per row of the chunk's logits z [C, V]; pass 1 reduces, pass 2 overwrites z with dz.
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_z
    y = tl.load(labels_ptr + row)
    valid = y != ignore_index
    in_range = (y >= 0) & (y < V)
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    z_y = tl.load(z_row + tl.where(in_range, y, 0)).to(tl.float32)
    loss = tl.where(valid, lse - z_y, 0.0)
    loss = tl.where(valid & ~in_range, float("nan"), loss)
    tl.store(loss_ptr + row, loss)
    if COMPUTE_GRAD:
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(z_row + cols, mask=cols < V, other=0.0).to(tl.float32)
            p = tl.exp(z - lse)
            p = tl.where(cols == y, p - 1.0, p)
            p = tl.where(valid, p, 0.0)
            tl.store(z_row + cols, p.to(z_ptr.dtype.element_ty), mask=cols < V)


# --- launchers ------------------------------------------------------------------------------------
def ce_rows(z: torch.Tensor, labels: torch.Tensor, loss_out: torch.Tensor, ignore_index: int,
            compute_grad: bool) -> None:
    """z [C, V] (row-contiguous), labels int64 [C] → per-row loss into loss_out fp32 [C]; z := dz when compute_grad."""
    c, v = z.shape
    if c == 0:
        return
    if z.stride(1) != 1 or not labels.is_contiguous() or not loss_out.is_contiguous():
        raise ValueError(f"ce_rows: z must be row-contiguous (strides {z.stride()}), labels and loss_out contiguous")
    block_v = min(triton.next_power_of_2(v), 4096)
    _ce_rows_kernel[(c,)](z, z.stride(0), labels, loss_out, v, ignore_index, COMPUTE_GRAD=compute_grad,
                          BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4)


def _ce_rows_torch(z: torch.Tensor, labels: torch.Tensor, loss_out: torch.Tensor, ignore_index: int,
                   compute_grad: bool) -> torch.Tensor:
    """The same contract in torch ops (fp32 copy of z); returns dz in z.dtype (or z untouched)."""
    zf = z.float()
    valid = labels != ignore_index
    y_safe = torch.where(valid, labels, 0)
    lse = torch.logsumexp(zf, dim=-1)  # [C]
    loss_out.copy_((lse - zf.gather(1, y_safe[:, None]).squeeze(1)) * valid)
    if not compute_grad:
        return z
    dz = torch.softmax(zf, dim=-1)  # [C, V], then p − onehot(y), zero on ignored rows
    dz.scatter_add_(1, y_safe[:, None], -torch.ones_like(dz[:, :1]))
    return (dz * valid[:, None]).to(z.dtype)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result; on CUDA half-precision inputs keep cuBLAS's fp32 accumulator unrounded."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"linear_cross_entropy: expected hidden [N,D], weight [V,D], labels [N]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                         f"labels {tuple(labels.shape)} disagree")
    if labels.dtype != torch.long:
        raise ValueError(f"linear_cross_entropy: labels must be int64, got {labels.dtype}")


# --- autograd.Function ----------------------------------------------------------------------------
class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, chunk_size: int, grad_enabled: bool, use_triton: bool):  # noqa: D102
        # needs_input_grad is True even under no_grad (eval): skip the gradient matmuls there.
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        # The matmuls run in one compute dtype: autocast's when it is on (bf16 hidden against fp32 master
        # weights), else the promoted input dtype. Softmax, loss and gradient accumulators stay fp32.
        dev = hidden.device.type
        c = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
             else torch.promote_types(hidden.dtype, weight.dtype))
        w = weight.to(c)
        labels = labels.contiguous()
        n = hidden.shape[0]
        loss_rows = torch.empty(n, dtype=torch.float32, device=hidden.device)
        dh = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        with torch.autocast(dev, enabled=False):
            for s in range(0, n, chunk_size):
                h, y = hidden[s : s + chunk_size].to(c), labels[s : s + chunk_size]
                z = h @ w.t()  # [C, V] in c
                rows = loss_rows[s : s + chunk_size]
                if use_triton:
                    ce_rows(z, y, rows, ignore_index, need_h or need_w)  # z now holds dz
                    dz = z
                else:
                    dz = _ce_rows_torch(z, y, rows, ignore_index, need_h or need_w)
                if need_h:
                    dh[s : s + chunk_size] = _mm_fp32(dz, w)  # [C, D]
                if need_w:
                    dw += _mm_fp32(dz.t(), h)  # [V, D]
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss_rows.sum()

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: D102
        dh, dw = ctx.saved_tensors
        gh = (dh * grad_loss).to(ctx.dtypes[0]) if dh is not None else None
        gw = (dw * grad_loss).to(ctx.dtypes[1]) if dw is not None else None
        return gh, gw, None, None, None, None, None


# --- public ---------------------------------------------------------------------------------------
def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, chunk_size: int = 4096,
    impl: str = "auto",
) -> torch.Tensor:
    """Σ over non-ignored tokens of CE(hidden @ weightᵀ, labels), fp32 scalar, chunked over tokens."""
    _check(hidden, weight, labels)
    if impl not in IMPLS:
        raise ValueError(f"linear_cross_entropy: impl must be one of {IMPLS}, got {impl!r}")
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    if not hidden.is_cuda:  # free on CPU; on CUDA a bad label turns the loss into NaN instead of a host sync
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"linear_cross_entropy: labels[{i}] = {int(labels[i])} is outside [0, {weight.shape[0]}) "
                             f"and is not ignore_index={ignore_index}")
    use_triton = impl == "triton" or (impl == "auto" and hidden.is_cuda)
    return LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk_size, torch.is_grad_enabled(),
                                    use_triton)


# --- reference ------------------------------------------------------------------------------------
def cross_entropy_ref(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> tuple[torch.Tensor, int]:
    """(Σ CE over non-ignored tokens in fp32, number of non-ignored tokens). logits [N, V], labels [N]."""
    loss = F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")
    return loss, int((labels != ignore_index).sum())


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             ignore_index: int = -100) -> torch.Tensor:
    """Σ CE over non-ignored tokens with the full [N, V] logits in fp32 (tests only: O(N·V) memory)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return cross_entropy_ref(hidden.float() @ weight.float().t(), labels, ignore_index)[0]
