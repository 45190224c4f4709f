"""A third designer family, declared outside the package: the Phi-3 decoder layout (transformers' Phi3ForCausalLM).

It proves that adding a family is one new file plus one registry line: this file declares `FAMILY` and a test
calls `designer.registry.register(FAMILY)`; nothing else in Atelier changes. Phi-3 is Qwen3's block with its
projections fused and no QK-norm, so it exercises what a family must bring itself:

    x += o_proj(attn(rope(q), rope(k), v)),  [q | k | v] = qkv_proj(n(x))       (one fused projection)
    x += down_proj(silu(gate) · up),         [gate | up] = gate_up_proj(n(x))   (one fused projection)

with n the plain RMSNorm (y = rmsnorm(x) · w) and RoPE over the whole head (Dh = D / H, as Phi3Config has no
head_dim). Its own model_type ("phi3"), args class, module names (so the Qwen3 key layout, LoRA table and
block code cannot load it), LoRA targets (qkv, o, gate_up, down) and FLOP counter; the K/V decoding cache is
designer/decode.py's. Packed rows and `cu_seqlens` work as in designer/decoder.py.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from atelier_studio.designer.decode import kv_cache_batch
from atelier_studio.designer.decoder import (
    KERNEL_IMPLS,
    Attend,
    Backbone,
    CausalLM,
    PackedAttention,
    RMSNorm,
    check_packed_inputs,
    init_param,
)
from atelier_studio.designer.family import Family, HFReference, decoder_layers
from atelier_studio.kernels.attention import IMPLS as ATTENTION_IMPLS
from atelier_studio.kernels.rope import rope, rope_cos_sin
from atelier_studio.kernels.swiglu import swiglu

MODEL_TYPE = "phi3"


@dataclass(frozen=True)
class Phi3Args:
    """Architecture of a Phi-3 decoder (transformers' Phi3Config field names in to/from_hf_config)."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_impl: str = "auto"
    kernels: str = "auto"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for f in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Phi3Args.{f} must be a positive int, got {v!r}")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            raise ValueError(f"Phi3Args.dim={self.dim} must split into {self.num_heads} heads of an even size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Phi3Args.num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.attention_impl not in ATTENTION_IMPLS or self.kernels not in KERNEL_IMPLS:
            raise ValueError(f"Phi3Args: attention_impl {self.attention_impl!r} / kernels {self.kernels!r} unknown")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> Phi3Args:
        if cfg.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{source}: model_type must be {MODEL_TYPE!r}, got {cfg.get('model_type')!r}")
        rp = dict(cfg.get("rope_parameters") or {})
        if rp.get("rope_type", "default") != "default" or rp.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{source}: rope_parameters {rp} is not supported (only full-head default RoPE)")
        if cfg.get("sliding_window") is not None or cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: sliding_window / hidden_act other than None / 'silu' is not supported")
        try:
            return cls(vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
                       num_heads=cfg["num_attention_heads"],
                       num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                       ffn_dim=cfg["intermediate_size"], max_seq_len=cfg.get("max_position_embeddings", 4096),
                       rope_theta=float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                       norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                       tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
                       pad_token_id=cfg.get("pad_token_id"))
        except KeyError as e:
            raise ValueError(f"{source}: missing key {e.args[0]!r}") from None

    def to_hf_config(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": ["Phi3ForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": self.vocab_size,
            "hidden_size": self.dim, "intermediate_size": self.ffn_dim, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads, "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len, "original_max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                                               "partial_rotary_factor": 1.0},
            "tie_word_embeddings": self.tie_embeddings, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attention_dropout": 0.0, "sliding_window": None, "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype_name, "dtype": dtype_name,
        }


SIZES: dict[str, dict[str, Any]] = {
    "phi3-tiny": dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96, max_seq_len=512),
}


class Attention(nn.Module):
    def __init__(self, args: Phi3Args) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.qkv_proj = nn.Linear(args.dim, (args.num_heads + 2 * args.num_kv_heads) * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.dim, bias=False)
        self.kernels = args.kernels

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        b, t, _ = x.shape
        h, hkv, dh = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([h * dh, hkv * dh, hkv * dh], dim=-1)
        q, k = rope(q.reshape(b, t, h, dh), k.reshape(b, t, hkv, dh), cos, sin, self.kernels)
        o = attend(q, k, v.reshape(b, t, hkv, dh))  # [B,T,H,Dh]
        return self.o_proj(o.reshape(b, t, h * dh))


class MLP(nn.Module):
    def __init__(self, args: Phi3Args) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.dim, 2 * args.ffn_dim, bias=False)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.kernels = args.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(swiglu(gate, up, self.kernels))


class Block(nn.Module):
    def __init__(self, args: Phi3Args) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, args.kernels)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, args.kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attend)
        normed, x = self.post_attention_layernorm.add_forward(attn, x)
        return x + self.mlp(normed)


class Phi3(CausalLM):
    """Phi-3 causal LM; `state_dict()` keys equal transformers' Phi3ForCausalLM keys."""

    def __init__(self, args: Phi3Args) -> None:
        super().__init__(args, Backbone(args, (Block(args) for _ in range(args.num_layers))))

    def init_weights(self, seed: int | None = None) -> Phi3:
        """Norms ones, every other weight normal(0, 0.02) (designer.decoder.init_param's rule)."""
        return self.init_by_name(init_param, seed)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      attends: Sequence[Attend]) -> torch.Tensor:
        a = self.args
        cos, sin = rope_cos_sin(position_ids, a.head_dim, a.rope_theta)  # [B,T,Dh] fp32
        x = self.model.embed_tokens(input_ids)
        for block, attend in zip(self.model.layers, attends, strict=True):
            x = block(x, cos, sin, attend)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
        check_packed_inputs("Phi3.forward", input_ids, position_ids, cu_seqlens)
        attend = PackedAttention(cu_seqlens, max_seqlen, self.args.attention_impl)
        return self.hidden_states(input_ids, position_ids, [attend] * self.args.num_layers)

    # FLOPs: CausalLM.train_flops (every weight matmul, causal attention on every layer)


def hf_param_shapes(args: Phi3Args) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = Phi3(dataclasses.replace(args, attention_impl="sdpa"))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


FAMILY = Family(
    name="Phi3", model_types=(MODEL_TYPE,), args_cls=Phi3Args, model_cls=Phi3, sizes=SIZES, tiny_size="phi3-tiny",
    hf_param_shapes=hf_param_shapes, init_param=init_param,
    lora_targets={"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
                  "down": "mlp.down_proj"},
    train_flops=Phi3.train_flops, decode_batch=kv_cache_batch, blocks=decoder_layers,
    hf_reference=HFReference("transformers.models.phi3.modeling_phi3", "Phi3ForCausalLM"),
)
