"""Linear + cross-entropy fused over token chunks: the [N, V] logits never exist at once.

Shapes: N tokens, D hidden dim, V vocab, C chunk of tokens.
  hidden [N, D], weight [V, D], labels [N] (ignore_index marks tokens without loss) → loss_sum fp32 [].

Forward per chunk c:  z = h_c Wᵀ (fp32 [C, V]);  loss_i = logsumexp(z_i) − z_i[y_i] for non-ignored i.
Backward (computed during the forward, Liger-Kernel style, so no chunk is recomputed):
  dz = softmax(z) − onehot(y) (0 on ignored rows);  dh_c = dz W;  dW += dzᵀ h_c.
Saved: dh [N, D] and dW [V, D] in fp32 (the backward multiplies them by the incoming scalar grad).
Memory: O(C·V + N·D + V·D) instead of O(N·V). All accumulation is fp32 (PITFALLS.md: drift at
vocab > 250k without fp32 accumulators).

The result is a SUM over non-ignored tokens; the trainer divides by the token count of the whole
accumulated batch, so gradient accumulation is scaled correctly (PITFALLS.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# --- Triton kernels -------------------------------------------------------------------------------
# (none yet: the chunked matmuls below are cuBLAS; a fused online-softmax kernel goes here.)


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
    def forward(ctx, hidden, weight, labels, ignore_index: int, chunk_size: int, grad_enabled: bool):  # noqa: D102
        # needs_input_grad is True even under no_grad (eval): skip the gradient matmuls there.
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        # The matmuls run in one compute dtype: autocast's when it is on (bf16 hidden against fp32 master
        # weights), else the promoted input dtype. Softmax, loss and gradient accumulators stay fp32.
        dev = hidden.device.type
        c = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(hidden.dtype, weight.dtype)
        w = weight.to(c)
        n = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        with torch.autocast(dev, enabled=False):
            for s in range(0, n, chunk_size):
                h, y = hidden[s : s + chunk_size].to(c), labels[s : s + chunk_size]
                z = (h @ w.t()).float()  # [C, V]
                valid = y != ignore_index
                y_safe = torch.where(valid, y, 0)
                lse = torch.logsumexp(z, dim=-1)  # [C]
                loss += ((lse - z.gather(1, y_safe[:, None]).squeeze(1)) * valid).sum()
                if need_h or need_w:
                    dz = torch.softmax(z, dim=-1)  # [C, V], then p − onehot(y), zero on ignored rows
                    dz.scatter_add_(1, y_safe[:, None], -torch.ones_like(dz[:, :1]))
                    dz = (dz * valid[:, None]).to(c)
                    if need_h:
                        dh[s : s + chunk_size] = dz @ w
                    if need_w:
                        dw += dz.t() @ h
        ctx.save_for_backward(dh if need_h else None, dw if need_w else None)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: D102
        dh, dw = ctx.saved_tensors
        gh = (dh * grad_loss).to(ctx.dtypes[0]) if dh is not None else None
        gw = (dw * grad_loss).to(ctx.dtypes[1]) if dw is not None else None
        return gh, gw, None, None, None, None


# --- public ---------------------------------------------------------------------------------------
def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, chunk_size: int = 4096
) -> torch.Tensor:
    """Σ over non-ignored tokens of CE(hidden @ weightᵀ, labels), fp32 scalar, chunked over tokens."""
    _check(hidden, weight, labels)
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    return LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk_size, torch.is_grad_enabled())


# --- reference ------------------------------------------------------------------------------------
def cross_entropy_ref(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> tuple[torch.Tensor, int]:
    """(Σ CE over non-ignored tokens in fp32, number of non-ignored tokens). logits [N, V], labels [N]."""
    loss = F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")
    return loss, int((labels != ignore_index).sum())
