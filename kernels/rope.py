"""Rotary position embedding, rotate-half convention (GPT-NeoX / Hugging Face Qwen3).

Shapes: N tokens (any leading dims), H heads, Dh head dim (even).
  q [N, H, Dh], k [N, Hkv, Dh], cos/sin [N, Dh] (broadcast over heads) → q', k' same shapes.

Forward:  x' = x · cos + rotate_half(x) · sin,  rotate_half([x1, x2]) = [−x2, x1] (halves of Dh), i.e.
          x1' = x1·c1 − x2·s1,  x2' = x2·c2 + x1·s2  (c1, c2 the halves of cos; Qwen3's are equal).
Backward: dx = dy · cos − rotate_half(dy · sin)  (the rotation is orthogonal, so its transpose), i.e.
          dx1 = dy1·c1 + dy2·s2,  dx2 = dy2·c2 − dy1·s1.
Saved: cos, sin (no activation). Accumulation dtype: fp32 in registers, one rounding on store.
cos/sin are constants of the integer positions: the Triton path gives them no gradient (and refuses
cos/sin that require one). Out of place: q and k are left untouched, so autograd needs no version
bookkeeping and q/k may be views of the projection outputs.

Implementations (argument `impl`): "triton" (any device; CPU through TRITON_INTERPRET=1), "ref",
"auto" (Triton on CUDA, the reference elsewhere). One Triton launch rotates q and k together.

Frequencies: inv_freq[i] = θ^(−2i/Dh), i < Dh/2, optionally rescaled by `scaling`, a Hugging Face
config.json ``rope_scaling`` dict ({"rope_type": "linear" | "yarn" | "llama3", "factor": ..., ...}).
YaRN also scales cos/sin by its attention factor, exactly as transformers does.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from atelier_studio.kernels.custom_op import call_op, custom_op

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
IMPLS = ("auto", "triton", "ref")


# --- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(x_ptr, y_ptr, n_heads, half, c1, c2, s1, s2, tok,
                  BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # x/y [N, n_heads, 2·half] contiguous; c*/s* [BLOCK_HALF] fp32 of this token.
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < n_heads) & (cols[None, :] < half)
    offs = tok.to(tl.int64) * n_heads * 2 * half + heads[:, None] * 2 * half + cols[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation
        y1 = x1 * c1[None, :] + x2 * s2[None, :]
        y2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        y1 = x1 * c1[None, :] - x2 * s1[None, :]
        y2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(y_ptr + offs, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + offs + half, y2.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, H, HKV, half,
                 BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # One program per token: cos/sin are read once and applied to all H + Hkv heads.
    tok = tl.program_id(0)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < half
    row = tok.to(tl.int64) * 2 * half
    c1 = tl.load(cos_ptr + row + cols, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + half + cols, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row + cols, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + half + cols, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, H, half, c1, c2, s1, s2, tok, BACKWARD, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, ko_ptr, HKV, half, c1, c2, s1, s2, tok, BACKWARD, BLOCK_HKV, BLOCK_HALF)


# --- launchers ------------------------------------------------------------------------------------
# A torch.library custom op: opaque to torch.compile (see kernels/rmsnorm.py's launchers for why).
@custom_op("atelier::rope_apply")
def rope_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, H, Dh], k [N, Hkv, Dh], cos/sin [N, Dh], all contiguous → rotated copies (or the transpose)."""
    n, h, dh = q.shape
    hkv = k.shape[1]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if n == 0:
        return qo, ko
    block_h, block_hkv, block_half = (triton.next_power_of_2(h), triton.next_power_of_2(hkv),
                                      triton.next_power_of_2(dh // 2))
    num_warps = 8 if block_h * block_half >= 4096 else 4
    _rope_kernel[(n,)](q, k, qo, ko, cos, sin, h, hkv, dh // 2, BACKWARD=backward, BLOCK_H=block_h,
                       BLOCK_HKV=block_hkv, BLOCK_HALF=block_half, num_warps=num_warps)
    return qo, ko


@rope_apply.register_fake
def _(q, k, cos, sin, backward):
    return torch.empty_like(q), torch.empty_like(k)


# --- autograd.Function ----------------------------------------------------------------------------
class RoPEFunction(torch.autograd.Function):
    """q [N, H, Dh], k [N, Hkv, Dh], cos/sin [N, Dh] → (q', k'); cos/sin get no gradient."""

    @staticmethod
    def forward(q, k, cos, sin):  # noqa: D102
        return call_op(rope_apply, q, k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):  # noqa: D102
        cos, sin = ctx.saved_tensors
        # An unused output arrives as None: rotate zeros so both grads exist (rare; costs one small tensor).
        dq = dq.contiguous() if dq is not None else torch.zeros(ctx.shapes[0], dtype=ctx.dtypes[0], device=cos.device)
        dk = dk.contiguous() if dk is not None else torch.zeros(ctx.shapes[1], dtype=ctx.dtypes[1], device=cos.device)
        gq, gk = call_op(rope_apply, dq, dk, cos, sin, True)
        return gq, gk, None, None

    @staticmethod
    def setup_context(ctx, inputs, output):  # noqa: D102
        q, k, cos, sin = inputs
        ctx.save_for_backward(cos, sin)
        ctx.shapes, ctx.dtypes = (q.shape, k.shape), (q.dtype, k.dtype)


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The rope type named by an HF ``rope_scaling`` dict (None → "default")."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    return kind


def _need(scaling: dict[str, Any], key: str) -> Any:
    if scaling.get(key) is None:
        raise ValueError(f"rope_scaling of type {rope_type(scaling)!r} needs key {key!r}; got {scaling}")
    return scaling[key]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [Dh/2] (fp32, CPU) and the cos/sin multiplier, as transformers computes them."""
    if head_dim % 2:
        raise ValueError(f"rope: head_dim must be even, got {head_dim}")
    kind = rope_type(scaling)
    dim = head_dim
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / pos_freqs
    if kind == "default":
        return inv_freq, 1.0
    factor = float(_need(scaling, "factor"))
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low, high = float(_need(scaling, "low_freq_factor")), float(_need(scaling, "high_freq_factor"))
        old_len = float(_need(scaling, "original_max_position_embeddings"))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    # YaRN (Peng et al. 2023, arXiv:2309.00071), following transformers' _compute_yarn_parameters.
    orig = float(_need(scaling, "original_max_position_embeddings"))

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = mscale_of(factor, m) / mscale_of(factor, m_all) if (m and m_all) else mscale_of(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # avoid 0/0 in the ramp, as transformers does
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*position_ids.shape, Dh] in fp32 for integer positions (any leading shape)."""
    inv_freq, attn_scale = rope_inv_freq(head_dim, theta, scaling)
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)  # [..., Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., Dh]
    return emb.cos() * attn_scale, emb.sin() * attn_scale


# --- public ---------------------------------------------------------------------------------------
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [..., H, Dh] and k [..., Hkv, Dh] by cos/sin [..., Dh] (leading dims equal)."""
    if impl not in IMPLS:
        raise ValueError(f"rope: impl must be one of {IMPLS}, got {impl!r}")
    for name, t in (("q", q), ("k", k)):
        if t.shape[:-2] != cos.shape[:-1] or t.shape[-1] != cos.shape[-1]:
            raise ValueError(f"rope: {name} {tuple(t.shape)} does not match cos {tuple(cos.shape)} "
                             "([..., H, Dh] vs [..., Dh])")
    if sin.shape != cos.shape:
        raise ValueError(f"rope: sin {tuple(sin.shape)} and cos {tuple(cos.shape)} must have the same shape")
    if q.shape[-1] % 2:
        raise ValueError(f"rope: head_dim must be even, got q {tuple(q.shape)}")
    if impl == "ref" or (impl == "auto" and not q.is_cuda):
        return rope_ref(q, k, cos, sin)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("rope: the Triton path treats cos/sin as constants; got cos/sin that require grad "
                         "(use impl='ref' to differentiate through them)")
    dh = q.shape[-1]
    qo, ko = RoPEFunction.apply(q.reshape(-1, q.shape[-2], dh).contiguous(),  # [N,H,Dh], [N,Hkv,Dh]
                                k.reshape(-1, k.shape[-2], dh).contiguous(),
                                cos.reshape(-1, dh).contiguous(), sin.reshape(-1, dh).contiguous())
    return qo.view(q.shape), ko.view(k.shape)


# --- reference ------------------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch rotate-half RoPE in fp32, cast back. cos/sin [..., Dh] get a heads axis inserted."""
    c, s = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)  # [..., 1, Dh]
    qf, kf = q.float(), k.float()
    return (qf * c + _rotate_half(qf) * s).to(q.dtype), (kf * c + _rotate_half(kf) * s).to(k.dtype)
