"""Packed (varlen) causal attention with grouped-query heads.

Shapes: N packed tokens (all documents of all rows, flattened), H query heads, Hkv kv heads
(H % Hkv == 0), Dh head dim, S documents.
  q [N, H, Dh], k/v [N, Hkv, Dh], cu_seqlens int32 [S+1] (0, end of doc 0, ..., N) → o [N, H, Dh].

Math per document d and head h (query head h reads kv head h // (H/Hkv)):
  P = softmax(q_d k_dᵀ / √Dh + causal mask);  o_d = P v_d.
A token never sees another document: this is what makes a packed row equal its documents run
one by one.
Backward: dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P ∘ (dP − rowsum(dO ∘ O));  dQ = dS K / √Dh;  dK = dSᵀ Q / √Dh.
Accumulation: fp32 softmax statistics in every implementation.

Implementations (chosen by the caller, from DecoderArgs.attention_impl — never an environment variable):
  "flash"  flash_attn.flash_attn_varlen_func (CUDA, fp16/bf16);
  "varlen" torch.nn.attention.varlen.varlen_attn (CUDA, fp16/bf16), causal = window_size (-1, 0); with
           grouped kv heads on a torch whose varlen_attn has no enable_gqa (< 2.14), PyTorch's own flash
           kernels are called directly (aten._flash_attention_forward/_backward take Hkv < H natively):
           repeating the kv heads instead took 2.7% of a Qwen3-8B LoRA step's GPU time (the copy and the
           summed gradients; +1% tok/s once removed, bench/results/designer-qwen3-8b-lora-2026-12-03*);
  "sdpa"   the reference below: SDPA per document with is_causal (any device/dtype; a Python loop);
  "auto"   flash → varlen on CUDA with fp16/bf16; sdpa on CPU or in fp32. On CUDA with fp16/bf16 and
           neither fast path installed it raises instead of silently running the slow loop
           (a silent slow path) — pass impl="sdpa" to accept it.
Asking for an implementation that is not available raises; there is no silent fallback.

`causal_attention_rows` is the special case of rows that each hold ONE document (q [B, T, H, Dh]): plain
causal SDPA, which runs cuDNN's kernel on the H200, 1.7× faster than varlen on a 65,536-token document
(bench/results/attention-*.json). `rows_are_documents` tells the caller when that case holds.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
import torch.nn.functional as F

IMPLS = ("auto", "flash", "varlen", "sdpa")

# --- Triton kernels -------------------------------------------------------------------------------
# (none: the fast paths are flash-attn, PyTorch's flash / varlen kernels and cuDNN through SDPA.)


# --- autograd.Function ----------------------------------------------------------------------------
class FlashVarlenGQA(torch.autograd.Function):
    """q [N, H, Dh], k/v [N, Hkv, Dh], cu_seqlens int32 [S+1] → causal o [N, H, Dh] through aten's flash kernels.

    Saved: q, k, v, o and the fp32 log-sum-exp [H, N]; the backward recomputes P (FlashAttention-2).
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int):  # noqa: D102
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens, rng, unused)
        ctx.max_seqlen = max_seqlen
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        q, k, v, o, lse, cu, rng, unused = ctx.saved_tensors
        m = ctx.max_seqlen
        dq, dk, dv = torch.ops.aten._flash_attention_backward(do.contiguous(), q, k, v, o, lse, cu, cu, m, m, 0.0, True,
                                                              rng, unused)
        return dq, dk, dv, None, None


def _has_flash() -> bool:
    """FlashAttention-2's `flash_attn` package is installed. FlashAttention-4 (flash-attn-4) ships only
    `flash_attn/cute/`, which makes `flash_attn` a namespace package without FA2's functions: no origin file."""
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and spec.origin is not None


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _varlen_has_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"packed_causal_attention: expected q [N,H,Dh], k/v [N,Hkv,Dh]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"packed_causal_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "disagree")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"packed_causal_attention: {q.shape[1]} query heads is not a multiple of "
                         f"{k.shape[1]} kv heads")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise ValueError(f"packed_causal_attention: cu_seqlens must be int32 [S+1] with S >= 1, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")


# --- public ---------------------------------------------------------------------------------------
def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, impl: str = "auto"
) -> torch.Tensor:
    """Causal attention within each document of a packed batch. See the module docstring for shapes."""
    _check(q, k, v, cu_seqlens)
    if impl not in IMPLS:
        raise ValueError(f"packed_causal_attention: impl must be one of {IMPLS}, got {impl!r}")
    fast_dtype = q.dtype in (torch.float16, torch.bfloat16)
    if impl == "auto":
        if not (q.is_cuda and fast_dtype):
            impl = "sdpa"
        elif _has_flash():
            impl = "flash"
        elif _has_varlen():
            impl = "varlen"
        else:
            raise RuntimeError("packed_causal_attention: on CUDA with fp16/bf16 neither flash_attn nor "
                               "torch.nn.attention.varlen is available; install flash-attn or pass impl='sdpa' "
                               "to accept the slow per-document loop")
    if impl in ("flash", "varlen"):
        if not q.is_cuda or not fast_dtype:
            raise RuntimeError(f"packed_causal_attention: impl={impl!r} needs CUDA fp16/bf16 tensors, got "
                               f"{q.device} {q.dtype}")
        if impl == "flash":
            if not _has_flash():
                raise RuntimeError("packed_causal_attention: impl='flash' but flash_attn is not installed")
            from flash_attn import flash_attn_varlen_func

            return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
        if not _has_varlen():
            raise RuntimeError("packed_causal_attention: impl='varlen' but this torch has no "
                               "torch.nn.attention.varlen.varlen_attn")
        from torch.nn.attention.varlen import varlen_attn

        group = q.shape[1] // k.shape[1]
        if group > 1 and not _varlen_has_gqa():
            return FlashVarlenGQA.apply(q, k, v, cu_seqlens, max_seqlen)
        extra = {"enable_gqa": True} if group > 1 else {}
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(-1, 0), **extra)
    return packed_causal_attention_ref(q, k, v, cu_seqlens, max_seqlen)


def rows_are_documents(num_segments: int, rows: int, row_len: int, max_seqlen: int) -> bool:
    """True when `num_segments` documents (cu_seqlens has num_segments + 1 entries) over rows × row_len tokens
    are exactly the rows: the lengths sum to rows·row_len and none exceeds max_seqlen, so with
    num_segments == rows and max_seqlen == row_len every document has row_len tokens. Host ints only.

    Contract (the designer's packed forward, data/packing.py): cu_seqlens covers EVERY token, padding included
    (cu_seqlens[-1] == rows·row_len). Checking that here would cost a device sync per layer; a caller that
    leaves padding outside cu_seqlens must not use this shortcut."""
    return num_segments == rows and max_seqlen == row_len


def causal_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over rows that are one document each: q [B, T, H, Dh], k/v [B, T, Hkv, Dh] → [B, T, H, Dh].

    SDPA with is_causal (cuDNN / flash on CUDA; the math kernel on CPU), grouped kv heads natively.
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"causal_attention_rows: expected q [B,T,H,Dh], k/v [B,T,Hkv,Dh]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"causal_attention_rows: {q.shape[2]} query heads is not a multiple of {k.shape[2]} kv heads")
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=q.shape[2] != k.shape[2])  # [B,H,T,Dh]
    return o.transpose(1, 2)


# --- reference ------------------------------------------------------------------------------------
# Compiler-disabled: it loops over the documents on the host, and Dynamo tracing that loop would guard on
# every document length, recompiling compiled blocks for each new batch.
@torch.compiler.disable
def packed_causal_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """SDPA with a block-diagonal causal mask, run as one causal SDPA per document (GQA: kv heads repeated).

    Running each diagonal block on its own is the block-diagonal mask without building an N×N mask.
    Documents of equal length are batched into one SDPA call. fp32 compute, cast back to q.dtype.
    """
    _check(q, k, v, cu_seqlens)
    bounds = cu_seqlens.tolist()
    n = q.shape[0]
    if bounds[0] != 0 or bounds[-1] != n or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"packed_causal_attention_ref: cu_seqlens must rise from 0 to N={n}, got {bounds}")
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if max(lengths) > max_seqlen:
        raise ValueError(f"packed_causal_attention_ref: a document has {max(lengths)} tokens > max_seqlen={max_seqlen}")
    rep = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(rep, dim=1), v.float().repeat_interleave(rep, dim=1)
    out = torch.empty_like(qf)  # [N, H, Dh]
    by_len: dict[int, list[int]] = {}
    for start, length in zip(bounds[:-1], lengths):
        if length:
            by_len.setdefault(length, []).append(start)
    # fp32 means fp32: an enclosing autocast must not turn the SDPA below into a bf16 one.
    with torch.autocast(q.device.type, enabled=False):
        _per_document(qf, kf, vf, out, by_len)
    return out.to(q.dtype)


def _per_document(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, out: torch.Tensor,
                  by_len: dict[int, list[int]]) -> None:
    """Causal SDPA over each group of equal-length documents, written into out [N, H, Dh]."""
    h, dh = qf.shape[1], qf.shape[2]
    for length, starts in by_len.items():
        dev = qf.device
        idx = (torch.tensor(starts, device=dev)[:, None] + torch.arange(length, device=dev)).reshape(-1)
        shape = (len(starts), length, h, dh)  # [docs, L, H, Dh]
        qd, kd, vd = (t[idx].view(shape).transpose(1, 2) for t in (qf, kf, vf))  # [docs, H, L, Dh]
        od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
        out[idx] = od.transpose(1, 2).reshape(-1, h, dh)
