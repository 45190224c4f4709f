"""Qwen3.5 hybrid causal LM (text): Gated DeltaNet layers interleaved with gated full-attention layers,
with Hugging Face Qwen3_5ForCausalLM state-dict names (transformers' `qwen3_5_text` model type).

Shape legend: B rows, T tokens per row, N = B·T packed tokens, D dim, S documents in a packed batch,
H query heads, Hkv kv heads, Dh head dim (full attention; RoPE turns the first R = Dh·partial_rotary_factor
dims), Hk / Hv Gated DeltaNet key / value heads, Dk / Dv their head dims, C = 2·Hk·Dk + Hv·Dv conv channels,
K conv taps, F ffn dim, V vocab.

Every block is pre-norm:  x += mixer(n(x));  x += down_proj(silu(gate_proj(n(x))) · up_proj(n(x)))
where n is a zero-centred RMSNorm (y = rmsnorm(x) · (1 + w), weights initialised to 0) and the mixer is
  full attention (every `full_attention_interval`-th layer; Qwen3 attention plus an output gate):
    [q | gate] = q_proj(x) per head;  o = attn(rope_R(q_norm(q)), rope_R(k_norm(k_proj(x))), v_proj(x));
    out = o_proj(o · sigmoid(gate))
  Gated DeltaNet (Yang et al. 2024, arXiv:2412.06464; the rest):
    [q | k | v] = silu(causal_conv1d(in_proj_qkv(x)));  β = sigmoid(in_proj_b(x));
    g = −exp(A_log) · softplus(in_proj_a(x) + dt_bias);  o = gated_delta_rule(q, k, v, g, β);
    out = out_proj(rmsnorm(o) · w · silu(in_proj_z(x)))   (per value head; the delta rule L2-normalises q and k
    and scales q by Dk^−½ itself, kernels/gated_delta_rule.py)
The model runs PACKED rows as every designer family does (designer/decoder.py): positions restart per document
and `cu_seqlens` marks document boundaries over the B·T tokens. The boundaries reach all three sequence-mixing ops —
attention, the causal conv (taps never cross a document start) and the delta rule (the state restarts
at zero per document) — so a packed row equals its documents run one by one (without the boundaries, the conv
and the state would carry one document into the next). HF layout I/O lives in designer/hf.py; FAMILY (at the
end) is this architecture's registry record (model_type qwen3_5_text, or qwen3_5: the text model of the
released vision-language checkpoints).

Decoding (designer/generate.py, through `hybrid_cache_batch`) runs the same blocks through
`decode_hidden_states`: full attention from a K/V cache (designer/decode.py), each Gated DeltaNet layer from
a LinearAttentionState (the last K−1 conv inputs and S) advanced by the recurrence above one token at a time.

Qwen3.5 uses M-RoPE (separate t/h/w position sections) for images; for text the three position streams
are equal, so it is plain RoPE on the first R dims (mrope_section / mrope_interleaved only round-trip).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from atelier_studio.designer.decode import KVCache, decode_loop, left_padded
from atelier_studio.designer.decoder import MLP, Attend, CausalLM, DecoderArgs, PackedAttention, check_packed_inputs
from atelier_studio.designer.decoder import init_param as decoder_init_param
from atelier_studio.designer.family import Family, HFReference, decoder_layers
from atelier_studio.kernels import gated_delta_rule as gdr
from atelier_studio.kernels.causal_conv1d import causal_conv1d
from atelier_studio.kernels.gated_delta_rule import CHUNK, ChunkIndex, chunk_index, gated_delta_rule, l2norm
from atelier_studio.kernels.gated_delta_rule import IMPLS as DELTA_RULE_IMPLS
from atelier_studio.kernels.gated_rmsnorm import gated_rmsnorm
from atelier_studio.kernels.rmsnorm import add_rmsnorm, rmsnorm
from atelier_studio.kernels.rope import rope, rope_cos_sin
from atelier_studio.pipeline.config import ConfigError
from atelier_studio.pipeline.shared_input import shared_input_linears

if TYPE_CHECKING:
    from atelier_studio.designer.config import ModelConfig

MODEL_TYPES = ("qwen3_5_text",)
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, kw_only=True)
class Qwen35Args(DecoderArgs):
    """Architecture of a Qwen3.5 text model: the decoder's fields (DecoderArgs; RoPE turns rotary_dim of each full
    attention head, no rope_scaling) and the Gated DeltaNet layers'."""

    max_seq_len: int = 262144
    rope_theta: float = 1e7
    gdn_num_key_heads: int
    gdn_num_value_heads: int
    gdn_key_head_dim: int
    gdn_value_head_dim: int
    gdn_conv_kernel: int = 4
    full_attention_interval: int = 4  # layer i is full attention iff (i + 1) % interval == 0 (HF's default rule)
    layer_types: tuple[str, ...] = ()  # () = from full_attention_interval; else one of LINEAR / FULL per layer
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] | None = None  # round-trips only (see the module docstring)
    mrope_interleaved: bool | None = None
    delta_rule_impl: str = "auto"  # kernels.gated_delta_rule impl: auto | fla | ref
    # (kernels also picks the conv and the gated norm)

    POSITIVE = (*DecoderArgs.POSITIVE, "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim",
                "gdn_value_head_dim", "gdn_conv_kernel", "full_attention_interval")

    def __post_init__(self) -> None:
        super().__post_init__()  # POSITIVE, heads, rotary_dim, kernel choices
        if self.rope_scaling is not None:
            raise ValueError(f"Qwen35Args.rope_scaling must be None (plain RoPE), got {self.rope_scaling!r}")
        if self.gdn_num_value_heads % self.gdn_num_key_heads:
            raise ValueError(f"Qwen35Args.gdn_num_value_heads={self.gdn_num_value_heads} is not a multiple of "
                             f"gdn_num_key_heads={self.gdn_num_key_heads}")
        types = tuple(self.layer_types) or tuple(FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR
                                                 for i in range(self.num_layers))
        if len(types) != self.num_layers or any(t not in (LINEAR, FULL) for t in types):
            raise ValueError(f"Qwen35Args.layer_types must list {LINEAR!r} or {FULL!r} for each of the "
                             f"{self.num_layers} layers, got {list(types)}")
        object.__setattr__(self, "layer_types", types)
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.delta_rule_impl not in DELTA_RULE_IMPLS:
            raise ValueError(f"Qwen35Args.delta_rule_impl must be one of {DELTA_RULE_IMPLS}, "
                             f"got {self.delta_rule_impl!r}")

    @property
    def rotary_dim(self) -> int:
        """The first R dims of a full-attention head that RoPE turns."""
        return int(self.head_dim * self.partial_rotary_factor)  # HF: int(head_dim · partial_rotary_factor)

    @classmethod
    def from_size(cls, size: str, vocab_size: int, **overrides: Any) -> Qwen35Args:
        if size not in SIZES:
            raise ValueError(f"unknown Qwen3.5 size {size!r}; known: {sorted(SIZES)}")
        return cls(vocab_size=vocab_size, **{**SIZES[size], **overrides})

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], attention_impl: str = "auto", delta_rule_impl: str = "auto",
                       source: str = "config.json") -> Qwen35Args:
        """Qwen35Args from a transformers `qwen3_5_text` config.json dict (flat, rope in "rope_parameters")."""
        if cfg.get("model_type") not in MODEL_TYPES:
            raise ValueError(f"{source}: model_type must be one of {MODEL_TYPES}, got {cfg.get('model_type')!r}")
        need = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ValueError(f"{source}: missing keys {missing}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        rp = dict(cfg.get("rope_parameters") or {})
        if rp.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: rope_parameters.rope_type {rp['rope_type']!r} is not supported "
                             "(only 'default')")
        heads = cfg["num_attention_heads"]
        try:
            return cls(
                vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
                num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn_dim=cfg["intermediate_size"],
                gdn_num_key_heads=cfg["linear_num_key_heads"], gdn_num_value_heads=cfg["linear_num_value_heads"],
                gdn_key_head_dim=cfg["linear_key_head_dim"], gdn_value_head_dim=cfg["linear_value_head_dim"],
                gdn_conv_kernel=cfg.get("linear_conv_kernel_dim", 4), layer_types=tuple(cfg.get("layer_types") or ()),
                full_attention_interval=cfg.get("full_attention_interval", 4),
                partial_rotary_factor=float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
                max_seq_len=cfg.get("max_position_embeddings", 32768),
                rope_theta=float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                mrope_section=rp.get("mrope_section"), mrope_interleaved=rp.get("mrope_interleaved"),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)), attention_impl=attention_impl,
                delta_rule_impl=delta_rule_impl, bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"), pad_token_id=cfg.get("pad_token_id"),
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf_config(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
        """config.json dict that AutoModelForCausalLM loads as Qwen3_5ForCausalLM."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                           "partial_rotary_factor": self.partial_rotary_factor}
        if self.mrope_section is not None:
            rope_parameters["mrope_section"] = list(self.mrope_section)
        if self.mrope_interleaved is not None:
            rope_parameters["mrope_interleaved"] = self.mrope_interleaved
        return {
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **self.hf_config(dtype),
            "linear_num_key_heads": self.gdn_num_key_heads, "linear_num_value_heads": self.gdn_num_value_heads,
            "linear_key_head_dim": self.gdn_key_head_dim, "linear_value_head_dim": self.gdn_value_head_dim,
            "linear_conv_kernel_dim": self.gdn_conv_kernel, "layer_types": list(self.layer_types),
            "full_attention_interval": self.full_attention_interval, "rope_parameters": rope_parameters,
        }


SIZES: dict[str, dict[str, Any]] = {
    # Odd on purpose: Dh 32 != D/H, Dk 16 != Dv 24, Hv = 2·Hk, 8 rotary dims of 32, 3 GDN + 1 full layer.
    "qwen3.5-tiny": dict(dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=128,
                         gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_head_dim=16, gdn_value_head_dim=24,
                         max_seq_len=512, tie_embeddings=True),
    # The real 9B text shapes. Layers (32 = 24 GDN + 8 full, interval 4) and vocab (248,320, from the tokenizer)
    # are the released model's; every other number is transformers 5.24's Qwen3_5TextConfig default, whose docstring
    # calls it "the Qwen3.5-9B style configuration". Not from there: rope_theta 1e7 and 262,144 positions (the
    # released Qwen3.5 / Qwen3-Next configs; transformers' defaults are 1e4 and 32,768) and untied embeddings
    # (transformers' default, and 9B-class Qwen models untie). See num_params: 8.95e9 with vocab 248,320.
    "qwen3.5-9b": dict(dim=4096, num_layers=32, num_heads=16, num_kv_heads=4, head_dim=256, ffn_dim=12288,
                       gdn_num_key_heads=16, gdn_num_value_heads=32, gdn_key_head_dim=128, gdn_value_head_dim=128,
                       gdn_conv_kernel=4, full_attention_interval=4, partial_rotary_factor=0.25,
                       max_seq_len=262144, rope_theta=1e7, norm_eps=1e-6, tie_embeddings=False),
}


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: rmsnorm(x) · (1 + w), w initialised to 0 (HF's Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float, impl: str = "auto") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps, self.impl = eps, impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, 1.0 + self.weight.float(), self.eps, self.impl)  # 1 + w in fp32, as HF computes it

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm, x promoted to the stream's
        dtype first (designer.decoder.RMSNorm.add_forward)."""
        return add_rmsnorm(x.to(residual.dtype), residual, 1.0 + self.weight.float(), self.eps, self.impl)


class GatedAttention(nn.Module):
    """Qwen3 attention (QK-norm, GQA) with partial RoPE and a sigmoid output gate from q_proj's second half."""

    def __init__(self, args: Qwen35Args) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.dim, args.num_heads * args.head_dim * 2, bias=bias)  # [q | gate] per head
        self.k_proj = nn.Linear(args.dim, args.num_kv_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.dim, args.num_kv_heads * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.dim, bias=bias)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.kernels)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.kernels)
        self.kernels = args.kernels

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        b, t, _ = x.shape
        h, dh, r = self.num_heads, self.head_dim, cos.shape[-1]
        q_and_gate, k, v = shared_input_linears(x, self.q_proj, self.k_proj, self.v_proj)
        q, gate = q_and_gate.view(b, t, h, 2 * dh).chunk(2, dim=-1)  # [B,T,H,Dh] each
        q = self.q_norm(q)
        k = self.k_norm(k.view(b, t, self.num_kv_heads, dh))  # [B,T,Hkv,Dh]
        v = v.view(b, t, self.num_kv_heads, dh)  # [B,T,Hkv,Dh]
        q_rot, k_rot = rope(q[..., :r], k[..., :r], cos, sin, self.kernels)  # partial RoPE: the first R dims turn
        q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
        o = attend(q, k, v) * torch.sigmoid(gate)  # [B,T,H,Dh]
        return self.o_proj(o.reshape(b, t, h * dh))  # [B,T,D]


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) · w · silu(z) over a value head (w initialised to 1; HF's Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float, impl: str = "auto") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.impl = eps, impl

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rmsnorm(x, z, self.weight, self.eps, self.impl)


@dataclass(frozen=True)
class PackedDocs:
    """The packed documents as the Gated DeltaNet layers see them (the full-attention layers' twin is
    PackedAttention). Built once per forward: the delta rule's chunk index costs a host sync to build
    (kernels.gated_delta_rule.chunk_index), so every layer shares one instead of each building its own."""

    cu_seqlens: torch.Tensor  # int32 [S+1] over the B·T tokens
    delta_rule_impl: str
    chunks: ChunkIndex | None  # chunk_index(cu_seqlens) on CUDA (fla's); None on the CPU (the reference's)

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, delta_rule_impl: str) -> PackedDocs:
        if not cu_seqlens.is_cuda or delta_rule_impl == "ref":
            return cls(cu_seqlens, delta_rule_impl, None)
        return cls(cu_seqlens, delta_rule_impl, chunk_index(cu_seqlens))


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer: projections → short causal conv → gated delta rule → gated norm → out_proj."""

    def __init__(self, args: Qwen35Args) -> None:
        super().__init__()
        self.hk, self.hv = args.gdn_num_key_heads, args.gdn_num_value_heads
        self.dk, self.dv = args.gdn_key_head_dim, args.gdn_value_head_dim
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        channels = 2 * key_dim + value_dim  # C
        self.in_proj_qkv = nn.Linear(args.dim, channels, bias=False)
        self.in_proj_z = nn.Linear(args.dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(args.dim, self.hv, bias=False)
        self.in_proj_a = nn.Linear(args.dim, self.hv, bias=False)
        # Depthwise, no bias; an nn.Conv1d only to hold HF's conv1d.weight [C, 1, K] (kernels/causal_conv1d runs it).
        self.conv1d = nn.Conv1d(channels, channels, args.gdn_conv_kernel, groups=channels, bias=False,
                                padding=args.gdn_conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))  # init_weights draws log(uniform(0.01, 16))
        self.norm = GatedRMSNorm(self.dv, args.norm_eps, args.kernels)
        self.kernels = args.kernels
        self.out_proj = nn.Linear(value_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, docs: PackedDocs) -> torch.Tensor:
        """x [B,T,D] → [B,T,D]."""
        b, t, _ = x.shape
        n = b * t
        w = self.conv1d.weight
        qkv, z, b_logits, a_logits = self.project(x)
        qkv = causal_conv1d(qkv.view(n, -1), w.view(w.shape[0], w.shape[2]), docs.cu_seqlens,
                            self.kernels)  # [N,C]: packed documents, one after another; silu'd
        q, k, v = self.split_heads(qkv)
        beta, g = self.gates(b_logits, a_logits)
        o = gated_delta_rule(q, k, v, g.view(n, self.hv), beta.view(n, self.hv), docs.cu_seqlens,
                             docs.delta_rule_impl, docs.chunks)  # [N,Hv,Dv]
        return self.gated_output(o, z)

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [B,T,D] → in_proj_qkv(x) [B,T,C], in_proj_z(x) [B,T,Hv·Dv], in_proj_b(x), in_proj_a(x) [B,T,Hv]."""
        return shared_input_linears(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N,C] conv outputs → q, k [N,Hk,Dk], v [N,Hv,Dv]."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        return q.view(n, self.hk, self.dk), k.view(n, self.hk, self.dk), v.view(n, self.hv, self.dv)

    def gates(self, b_logits: torch.Tensor, a_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj_b(x), in_proj_a(x) [B,T,Hv] → β = sigmoid(in_proj_b(x)) [B,T,Hv] and the log-decay g [B,T,Hv]
        in fp32 (HF: an fp16 A would overflow to -inf)."""
        beta = torch.sigmoid(b_logits)
        g = -self.A_log.float().exp() * F.softplus(a_logits.float() + self.dt_bias.float())
        return beta, g

    def gated_output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The delta rule's o [N,Hv,Dv] and in_proj_z(x) [B,T,Hv·Dv] → out_proj(norm(o) · silu(z)) [B,T,D]."""
        b, t, _ = z.shape
        z = z.view(b * t, self.hv, self.dv)  # [N,Hv,Dv]
        return self.out_proj(self.norm(o, z).view(b, t, self.hv * self.dv))

    def decode(self, x: torch.Tensor, state: LinearAttentionState, valid: torch.Tensor) -> torch.Tensor:
        """Decoding: x [B,T,D] (row b is sequence b; T is a prompt's left-padded length at prefill, 1 after) →
        [B,T,D], advancing `state` token by token with the recurrent form of the delta rule (module docstring),
        in fp32. valid [B,T] marks real tokens: a pad leaves the state untouched (its output is never read)."""
        b, t, _ = x.shape
        qkv_all, z, b_logits, a_logits = self.project(x)  # [B,T,C], [B,T,Hv·Dv], [B,T,Hv] ×2
        beta_all, g_all = self.gates(b_logits, a_logits)  # [B,T,Hv]
        w = self.conv1d.weight[:, 0, :].float().t()  # [K,C]
        rep = self.hv // self.hk
        outs = []
        for i in range(t):
            keep = valid[:, i]  # [B]
            window = torch.cat([state.conv, qkv_all[:, i, None].float()], dim=1)  # [B,K,C]: the conv's taps
            q, k, v = self.split_heads(F.silu((window * w).sum(1)))  # [B,Hk,Dk] ×2, [B,Hv,Dv]
            q = l2norm(q.float()).repeat_interleave(rep, dim=1) * self.dk ** -0.5  # [B,Hv,Dk]
            k = l2norm(k.float()).repeat_interleave(rep, dim=1)
            decayed = state.recurrent * g_all[:, i].exp()[..., None, None]  # e^g S  [B,Hv,Dk,Dv]
            delta = (v - torch.einsum("bhkv,bhk->bhv", decayed, k)) * beta_all[:, i].float()[..., None]
            s_new = decayed + k[..., :, None] * delta[..., None, :]  # + β k (v − (e^g S)ᵀ k)ᵀ
            outs.append(torch.einsum("bhkv,bhk->bhv", s_new, q))  # o = Sᵀ q  [B,Hv,Dv]
            state.recurrent = torch.where(keep[:, None, None, None], s_new, state.recurrent)
            state.conv = torch.where(keep[:, None, None], window[:, 1:], state.conv)
        o = torch.stack(outs, dim=1).to(x.dtype).view(b * t, self.hv, self.dv)  # [N,Hv,Dv]
        return self.gated_output(o, z)


@dataclass
class LinearAttentionState:
    """One Gated DeltaNet layer's decoding state for B sequences (designer/generate.py builds one per layer)."""

    conv: torch.Tensor  # [B, K−1, C] fp32: the conv inputs of the latest K−1 tokens (zeros before the start)
    recurrent: torch.Tensor  # [B, Hv, Dk, Dv] fp32: the delta rule's state S

    @classmethod
    def zeros(cls, layer: GatedDeltaNet, batch: int, device: torch.device) -> LinearAttentionState:
        k, c = layer.conv1d.weight.shape[2], layer.conv1d.weight.shape[0]
        return cls(torch.zeros(batch, k - 1, c, device=device, dtype=torch.float32),
                   torch.zeros(batch, layer.hv, layer.dk, layer.dv, device=device, dtype=torch.float32))


class Block(nn.Module):
    def __init__(self, args: Qwen35Args, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == FULL:
            self.self_attn = GatedAttention(args)
        else:
            self.linear_attn = GatedDeltaNet(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, args.kernels)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, args.kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                docs: PackedDocs) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixed = self.self_attn(h, cos, sin, attend) if self.layer_type == FULL else self.linear_attn(h, docs)
        normed, x = self.post_attention_layernorm.add_forward(mixed, x)  # x += mixer, fused with the norm
        return x + self.mlp(normed)

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
               state: LinearAttentionState | None, valid: torch.Tensor) -> torch.Tensor:
        """forward for decoding: full attention through a cache-aware `attend`, Gated DeltaNet through `state`."""
        h = self.input_layernorm(x)
        if self.layer_type == FULL:
            mixed = self.self_attn(h, cos, sin, attend)
        else:
            mixed = self.linear_attn.decode(h, state, valid)
        normed, x = self.post_attention_layernorm.add_forward(mixed, x)
        return x + self.mlp(normed)


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, blocks, final norm."""

    def __init__(self, args: Qwen35Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, kind) for kind in args.layer_types)
        self.norm = RMSNorm(args.dim, args.norm_eps, args.kernels)


class Qwen35(CausalLM):
    """Qwen3.5 text LM. `state_dict()` keys equal transformers' Qwen3_5ForCausalLM keys."""

    def __init__(self, args: Qwen35Args) -> None:
        super().__init__(args, Backbone(args))

    def init_weights(self, seed: int | None = None) -> Qwen35:
        """Initialise every parameter from one CPU generator (CausalLM.init_by_name with this table).

        | parameter                                               | init                          |
        |---------------------------------------------------------|-------------------------------|
        | model.embed_tokens.weight, lm_head.weight (untied)      | normal(0, 0.02)               |
        | *_proj.weight, in_proj_*.weight, out_proj.weight        | normal(0, 0.02)               |
        | linear_attn.conv1d.weight                               | normal(0, 0.02)               |
        | *_proj.bias (attention_bias=True)                       | zeros                         |
        | zero-centred norms (input/post/q/k/final) .weight       | zeros (the norm scales 1 + w) |
        | linear_attn.norm.weight (gated norm)                    | ones                          |
        | linear_attn.dt_bias                                     | ones                          |
        | linear_attn.A_log                                       | log(uniform(0.01, 16))        |
        """
        return self.init_by_name(init_param, seed)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
        """Packed forward. input_ids, position_ids int64 [B,T]; cu_seqlens int32 [S+1] over B·T → hidden [B,T,D]."""
        check_packed_inputs("Qwen35.forward", input_ids, position_ids, cu_seqlens)
        a = self.args
        attend = PackedAttention(cu_seqlens, max_seqlen, a.attention_impl)
        docs = PackedDocs.of(cu_seqlens, a.delta_rule_impl)
        cos, sin = rope_cos_sin(position_ids, a.rotary_dim, a.rope_theta)  # [B,T,R] fp32
        x = self.model.embed_tokens(input_ids)  # [B,T,D]
        for block in self.model.layers:
            x = block(x, cos, sin, attend, docs)
        return self.model.norm(x)

    def decode_hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                             attends: Sequence[Attend | None], states: Sequence[LinearAttentionState | None],
                             valid: torch.Tensor) -> torch.Tensor:
        """Decoding (designer/generate.py): input_ids, position_ids, valid [B,T] → final-normed hidden [B,T,D].
        Layer i attends through attends[i] (full attention) or advances states[i] (Gated DeltaNet)."""
        a = self.args
        if len(attends) != a.num_layers or len(states) != a.num_layers:
            raise ValueError(f"Qwen35.decode_hidden_states: {len(attends)} attends and {len(states)} states for "
                             f"{a.num_layers} layers")
        cos, sin = rope_cos_sin(position_ids, a.rotary_dim, a.rope_theta)  # [B,T,R] fp32
        x = self.model.embed_tokens(input_ids)  # [B,T,D]
        for block, attend, state in zip(self.model.layers, attends, states):
            x = block.decode(x, cos, sin, attend, state, valid)
        return self.model.norm(x)

    # --- FLOPs (matmul_flops: CausalLM, every nn.Linear and the LM head) ---------------------------
    def attention_flops(self, doc_lens: Sequence[int]) -> int:
        """Causal attention training FLOPs of the full-attention layers: 6·L²·H·Dh per doc and layer."""
        a = self.args
        n_full = a.layer_types.count(FULL)
        return 6 * n_full * sum(n * n for n in doc_lens) * a.num_heads * a.head_dim

    def delta_rule_flops(self, doc_lens: Sequence[int]) -> int:
        """Training FLOPs of the chunked gated delta rule, from fla's kernel shapes (chunks of c = 64 per document).

        Forward, per value head and chunk of c tokens (triangular products counted half, as causal attention):
          (βk)kᵀ c²·Dk, the triangular inverse c³/3, u = A⁻¹βv c²·Dv, w = A⁻¹βk c²·Dk, v' = u − wS 2c·Dk·Dv,
          qS 2c·Dk·Dv, qkᵀ c²·Dk, (qkᵀ)v' c²·Dv, S += kᵀv' 2c·Dk·Dv
          = c²·(3·Dk + 2·Dv) + 6·c·Dk·Dv + c³/3.
        Training = 3 × forward (docs/mfu.md's convention for attention). The conv (2·K·C per token) and
        the elementwise gates are not matmuls and are not counted.
        """
        a = self.args
        dk, dv = a.gdn_key_head_dim, a.gdn_value_head_dim
        per_head = 0
        for length in doc_lens:
            full, rest = divmod(length, CHUNK)
            for c, count in ((CHUNK, full), (rest, 1 if rest else 0)):
                per_head += count * (c * c * (3 * dk + 2 * dv) + 6 * c * dk * dv + c ** 3 // 3)
        return 3 * a.layer_types.count(LINEAR) * a.gdn_num_value_heads * per_head

    def train_flops(self, doc_lens: Sequence[int], head_tokens: int) -> int:
        """Useful FLOPs of one forward+backward over documents of lengths `doc_lens` (padding excluded)."""
        return (self.matmul_flops(sum(doc_lens), head_tokens) + self.attention_flops(doc_lens)
                + self.delta_rule_flops(doc_lens))


def init_param(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """The fp32 CPU init of one parameter by its HF name (the table in Qwen35.init_weights)."""
    if name.endswith(("linear_attn.norm.weight", "dt_bias")):
        return torch.ones(shape)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.01, 16.0, generator=gen).log_()
    if name.endswith("norm.weight"):  # zero-centred: the norm scales by 1 + w
        return torch.zeros(shape)
    return decoder_init_param(name, shape, gen)  # weights normal(0, 0.02), biases 0, LoRA weights refused


def hf_param_shapes(args: Qwen35Args) -> dict[str, tuple[int, ...]]:
    """HF key → shape of every parameter, in state-dict order, without allocating."""
    with torch.device("meta"):
        model = Qwen35(dataclasses.replace(args, attention_impl="sdpa", delta_rule_impl="ref"))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def num_params(args: Qwen35Args) -> int:
    """Parameter count (the tied LM head counted once)."""
    return sum(math.prod(s) for s in hf_param_shapes(args).values())


def args_from_hf_config(cfg: dict[str, Any], source: str) -> Qwen35Args:
    """Qwen35Args of a `qwen3_5_text` config.json dict, or of the text model of a vision-language `qwen3_5` one
    (designer/hf.py's weight_files reads its text-model keys under their text-model names)."""
    if cfg.get("model_type") != "qwen3_5":
        return Qwen35Args.from_hf_config(cfg, source=source)
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{source}: model_type 'qwen3_5' needs a 'text_config' dict")
    inherited = {k: cfg[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
                 if k in cfg and k not in text}
    return Qwen35Args.from_hf_config({**text, **inherited, "model_type": "qwen3_5_text"},
                                     source=f"{source} text_config")


def hybrid_cache_batch(model: Qwen35, ids: list[list[int]], max_new: int, temperature: float, top_p: float,
                       gen: torch.Generator, eos: torch.Tensor) -> list[list[int]]:
    """Decode one batch of prompts: K/V for the full-attention layers, conv and recurrent state for the Gated
    DeltaNet layers (a pad leaves a state untouched, so it stays zero until the prompt's first token)."""
    device = model.lm_head_weight.device
    pads, tokens, positions = left_padded(ids, device)
    layers = model.model.layers
    cache = KVCache(model, pads, tokens.shape[1], max_new,
                    [i for i, blk in enumerate(layers) if blk.layer_type == FULL])
    states = [None if blk.layer_type == FULL else LinearAttentionState.zeros(blk.linear_attn, len(ids), device)
              for blk in layers]

    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        valid = cache.valid[:, cache.length: cache.length + tok.shape[1]]  # [B,T]
        hidden = model.decode_hidden_states(tok, pos, cache.attends, states, valid)
        cache.length += tok.shape[1]
        return hidden

    return decode_loop(step, len(ids), (tokens, positions), max_new, temperature, top_p, gen, eos, model.logits)


def check_delta_rule(args: Qwen35Args, model: ModelConfig, device: torch.device) -> None:
    """Fail before loading anything when a bf16 run on CUDA would need fla-core and it is missing.

    The forward would raise the same at step 1 (kernels/gated_delta_rule.py); saying it here names the config
    key and costs no model load.
    """
    if device.type != "cuda" or model.delta_rule == "ref" or gdr.has_fla():
        return
    if model.dtype == "float32" and model.delta_rule == "auto":
        return  # "auto" runs the fp32 reference for fp32 compute
    raise ConfigError(f"model.delta_rule={model.delta_rule!r}: {gdr.FLA_MISSING} (or set model.delta_rule=ref)")


def transformers_peer_context(args: Qwen35Args) -> contextlib.ExitStack:
    """What transformers' Qwen3.5 runs inside in bench/designer.py: on a Hopper GPU with Triton < 3.7.1, the same
    lift of fla's guard that Atelier's fast path applies to itself (kernels/gated_delta_rule.py), so both run the
    same fla kernels."""
    stack = contextlib.ExitStack()
    if torch.cuda.is_available() and gdr.has_fla():
        try:
            stack.enter_context(gdr.fla_guard_lifted(args.gdn_key_head_dim, torch.device("cuda")))
        except RuntimeError:  # not a case Atelier lifts: the peer meets fla's own guard in its backward
            pass
    return stack


FAMILY = Family(
    name="Qwen3.5", model_types=(*MODEL_TYPES, "qwen3_5"), args_cls=Qwen35Args, model_cls=Qwen35, sizes=SIZES,
    tiny_size="qwen3.5-tiny", hf_param_shapes=hf_param_shapes, init_param=init_param,
    # a block takes the targets it has: full-attention blocks self_attn, Gated DeltaNet blocks linear_attn, all mlp
    lora_targets={"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                  "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
                  "qkv": "linear_attn.in_proj_qkv", "z": "linear_attn.in_proj_z", "b": "linear_attn.in_proj_b",
                  "a": "linear_attn.in_proj_a", "out": "linear_attn.out_proj"},
    train_flops=Qwen35.train_flops, decode_batch=hybrid_cache_batch, blocks=decoder_layers,
    read_hf_config=args_from_hf_config, preflight=check_delta_rule,
    hf_reference=HFReference("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5ForCausalLM",
                             peer_context=transformers_peer_context),
)
