"""Rotary position embedding, rotate-half convention (GPT-NeoX / Hugging Face Qwen3).

Shapes: N tokens (any leading dims), H heads, Dh head dim (even).
  q [N, H, Dh], k [N, Hkv, Dh], cos/sin [N, Dh] (broadcast over heads) → q', k' same shapes.

Forward:  x' = x · cos + rotate_half(x) · sin,  rotate_half([x1, x2]) = [−x2, x1] (halves of Dh).
Backward: dx = dy · cos − rotate_half(dy · sin)  (the rotation is orthogonal, so its transpose).
Saved: cos, sin. Accumulation dtype: fp32, cast back.

Frequencies: inv_freq[i] = θ^(−2i/Dh), i < Dh/2, optionally rescaled by `scaling`, a Hugging Face
config.json ``rope_scaling`` dict ({"rope_type": "linear" | "yarn" | "llama3", "factor": ..., ...}).
YaRN also scales cos/sin by its attention factor, exactly as transformers does.
"""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")

# --- Triton kernels -------------------------------------------------------------------------------
# (none yet: every device runs the reference below.)

# --- autograd.Function ----------------------------------------------------------------------------
# (comes with the Triton kernel)


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
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [..., H, Dh] and k [..., Hkv, Dh] by cos/sin [..., Dh] (leading dims equal)."""
    for name, t in (("q", q), ("k", k)):
        if t.shape[:-2] != cos.shape[:-1] or t.shape[-1] != cos.shape[-1]:
            raise ValueError(f"rope: {name} {tuple(t.shape)} does not match cos {tuple(cos.shape)} ([..., H, Dh] vs [..., Dh])")
    return rope_ref(q, k, cos, sin)


# --- reference ------------------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch rotate-half RoPE in fp32, cast back. cos/sin [..., Dh] get a heads axis inserted."""
    c, s = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)  # [..., 1, Dh]
    qf, kf = q.float(), k.float()
    return (qf * c + _rotate_half(qf) * s).to(q.dtype), (kf * c + _rotate_half(kf) * s).to(k.dtype)
