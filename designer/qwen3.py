"""Qwen3 dense causal LM (the "designer"), with Hugging Face Qwen3ForCausalLM state-dict names.

Shape legend: B rows, T tokens per row, N = B·T packed tokens, D dim, H query heads, Hkv kv heads,
Dh head dim (not necessarily D/H), F ffn dim, V vocab, S documents in a packed batch.

Block (pre-norm):  x += o_proj(attn(rope(q_norm(q_proj(n(x)))), rope(k_norm(k_proj(n(x)))), v_proj(n(x))))
                   x += down_proj(silu(gate_proj(n(x))) · up_proj(n(x)))
with designer/decoder.py's Attention (QK-norm, GQA), MLP (SwiGLU) and RMSNorm n, on PACKED rows (positions restart
per document, `cu_seqlens` at the boundaries). HF layout I/O lives in designer/hf.py; FAMILY (at the end) is this
architecture's registry record.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from atelier_studio.designer.decode import kv_cache_batch
from atelier_studio.designer.decoder import (
    MLP,
    Attend,
    Attention,
    Backbone,
    CausalLM,
    DecoderArgs,
    PackedAttention,
    RMSNorm,
    check_packed_inputs,
    hf_decoder_fields,
    hf_rope_and_window,
    init_param,
    meta_shapes,
)
from atelier_studio.designer.family import Family, HFReference, decoder_layers
from atelier_studio.kernels.rope import rope_cos_sin

MODEL_TYPE = "qwen3"


@dataclass(frozen=True, kw_only=True)
class Qwen3Args(DecoderArgs):
    """Architecture of a Qwen3 dense model: the decoder's fields (designer/decoder.py DecoderArgs), nothing more."""

    @classmethod
    def from_size(cls, size: str, vocab_size: int, **overrides: Any) -> Qwen3Args:
        """Qwen3Args for a named size in SIZES with the tokenizer's vocab size."""
        if size not in SIZES:
            raise ValueError(f"unknown designer size {size!r}; known: {sorted(SIZES)}")
        return cls(vocab_size=vocab_size, **{**SIZES[size], **overrides})

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], attention_impl: str = "auto", source: str = "config.json",
                       kernels: str = "auto") -> Qwen3Args:
        """Qwen3Args from a Hugging Face Qwen3 config.json dict (transformers 4.x or 5.x layout)."""
        if cfg.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{source}: model_type must be {MODEL_TYPE!r}, got {cfg.get('model_type')!r}")
        fields = hf_decoder_fields(cfg, source)
        try:
            return cls(**fields, attention_impl=attention_impl, kernels=kernels)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf_config(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
        """config.json dict that AutoModelForCausalLM loads as Qwen3ForCausalLM."""
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": MODEL_TYPE, **self.hf_config(dtype),
                **hf_rope_and_window(self)}


_QWEN3 = dict(max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, head_dim=128)
SIZES: dict[str, dict[str, Any]] = {
    # head_dim (32) != dim / num_heads (16) on purpose: it catches code that assumes D = H·Dh.
    "tiny": dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=128, max_seq_len=512,
                 rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True),
    # Big enough to learn the shapes world's brief → caption mapping on a CPU in minutes (the demo).
    "demo": dict(dim=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=384, max_seq_len=1024,
                 rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True),
    # The real Qwen3 dense shapes (Qwen/Qwen3-*/config.json).
    "0.6b": dict(dim=1024, num_layers=28, num_heads=16, num_kv_heads=8, ffn_dim=3072, tie_embeddings=True, **_QWEN3),
    "1.7b": dict(dim=2048, num_layers=28, num_heads=16, num_kv_heads=8, ffn_dim=6144, tie_embeddings=True, **_QWEN3),
    "4b": dict(dim=2560, num_layers=36, num_heads=32, num_kv_heads=8, ffn_dim=9728, tie_embeddings=True, **_QWEN3),
    "8b": dict(dim=4096, num_layers=36, num_heads=32, num_kv_heads=8, ffn_dim=12288, tie_embeddings=False, **_QWEN3),
    "14b": dict(dim=5120, num_layers=40, num_heads=40, num_kv_heads=8, ffn_dim=17408, tie_embeddings=False, **_QWEN3),
    "32b": dict(dim=5120, num_layers=64, num_heads=64, num_kv_heads=8, ffn_dim=25600, tie_embeddings=False, **_QWEN3),
}


class Block(nn.Module):
    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, args.kernels)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, args.kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attend)
        normed, x = self.post_attention_layernorm.add_forward(attn, x)  # x += attn, fused with the norm
        return x + self.mlp(normed)


class Qwen3(CausalLM):
    """Qwen3 dense causal LM. `state_dict()` keys equal transformers' Qwen3ForCausalLM keys."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args, Backbone(args, (Block(args) for _ in range(args.num_layers))))

    def init_weights(self, seed: int | None = None) -> Qwen3:
        """Initialise every parameter from one CPU generator (CausalLM.init_by_name with this table).

        | parameter                                   | init                  |
        |---------------------------------------------|-----------------------|
        | model.embed_tokens.weight                   | normal(0, 0.02)       |
        | *_proj.weight (q, k, v, o, gate, up, down)  | normal(0, 0.02)       |
        | *_proj.bias (attention_bias=True)           | zeros                 |
        | *norm.weight (input/post/q/k/final norms)   | ones                  |
        | lm_head.weight (untied)                     | normal(0, 0.02)       |
        """
        return self.init_by_name(init_param, seed)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      attends: Sequence[Attend]) -> torch.Tensor:
        """input_ids, position_ids [B,T] → final-normed hidden [B,T,D]; layer i's attention is `attends[i]`."""
        a = self.args
        if len(attends) != a.num_layers:
            raise ValueError(f"Qwen3.hidden_states: {len(attends)} attends for {a.num_layers} layers")
        cos, sin = rope_cos_sin(position_ids, a.head_dim, a.rope_theta, a.rope_scaling)  # [B,T,Dh] fp32
        x = self.model.embed_tokens(input_ids)  # [B,T,D]
        for block, attend in zip(self.model.layers, attends):
            x = block(x, cos, sin, attend)
        return self.model.norm(x)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
    ) -> torch.Tensor:
        """Packed forward. input_ids, position_ids int64 [B,T]; cu_seqlens int32 [S+1] over B·T → hidden [B,T,D]."""
        check_packed_inputs("Qwen3.forward", input_ids, position_ids, cu_seqlens)
        attend = PackedAttention(cu_seqlens, max_seqlen, self.args.attention_impl)
        return self.hidden_states(input_ids, position_ids, [attend] * self.args.num_layers)

    # FLOPs: CausalLM.train_flops (every weight matmul, causal attention on every layer)


def hf_param_shapes(args: Qwen3Args) -> dict[str, tuple[int, ...]]:
    """HF key → shape of every parameter of a Qwen3 with `args`, in state-dict order, without allocating."""
    return meta_shapes(Qwen3, args)


def num_params(args: Qwen3Args) -> int:
    """Parameter count (the tied LM head counted once)."""
    return sum(math.prod(s) for s in hf_param_shapes(args).values())


FAMILY = Family(
    name="Qwen3", model_types=(MODEL_TYPE,), args_cls=Qwen3Args, model_cls=Qwen3, sizes=SIZES, tiny_size="tiny",
    hf_param_shapes=hf_param_shapes, init_param=init_param,
    # short LoRA target names → module paths inside a block; the default is all of them ("all linear")
    lora_targets={"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                  "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"},
    train_flops=Qwen3.train_flops, decode_batch=kv_cache_batch, blocks=decoder_layers,
    hf_reference=HFReference("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
)
