"""What every designer family shares: the decoder's args base, norm, packed attention, attention, MLP, the causal LM
around the blocks, init, FLOP counting. A family's own file (designer/qwen3.py, designer/qwen35.py,
designer/qwen3_moe.py) takes these pieces and brings its blocks; no family file imports another's.

Shape legend: B rows, T tokens per row, N = B·T packed tokens, D dim, H query heads, Hkv kv heads,
Dh head dim (not necessarily D/H), F ffn dim, V vocab, S documents in a packed batch.

Attention (Qwen3's, GQA with QK-norm):  o_proj(attn(rope(q_norm(q_proj(x))), rope(k_norm(k_proj(x))), v_proj(x)))
MLP (SwiGLU):                          down_proj(silu(gate_proj(x)) · up_proj(x))
Models run PACKED rows: several documents share a row, positions restart at 0 per document and `cu_seqlens` marks
document boundaries over the flattened B·T tokens, so no document attends to another.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from atelier_studio.kernels.attention import IMPLS, causal_attention_rows, packed_causal_attention, rows_are_documents
from atelier_studio.kernels.rmsnorm import add_rmsnorm, rmsnorm
from atelier_studio.kernels.rope import rope, rope_type
from atelier_studio.kernels.swiglu import swiglu
from atelier_studio.pipeline.nf4 import NF4Linear
from atelier_studio.pipeline.shared_input import shared_input_linears

KERNEL_IMPLS = ("auto", "triton", "ref")  # args.kernels: rmsnorm / rope / swiglu / LoRA linear (and a family's own)

# (q [B,T,H,Dh], k [B,T,Hkv,Dh], v [B,T,Hkv,Dh]) -> o [B,T,H,Dh], one per layer; the packed forward
# (PackedAttention) and the KV-cache generator (designer/generate.py) each supply them, so there is one
# copy of the block. No layer index reaches a block: under per-block torch.compile an int argument is a
# guard, and 36 layers would mean 36 compiled graphs.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class DecoderArgs:
    """The fields every designer family shares (the ones designer/family.py's DesignerArgs names, and imagegen's
    config names alike) and their checks. A family's args extend it with their own fields and defaults."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_seq_len: int = 40960
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = None  # HF config.json "rope_scaling"; None = plain RoPE
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    attention_bias: bool = False
    attention_impl: str = "auto"  # kernels.attention impl: auto | flash | varlen | sdpa
    kernels: str = "auto"  # KERNEL_IMPLS: auto (Triton on CUDA) | triton | ref
    # Special token ids are carried so that config.json / generation_config.json round-trip.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    POSITIVE = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim", "max_seq_len")

    def __post_init__(self) -> None:
        name = type(self).__name__
        for f in self.POSITIVE:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}.{f} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{name}.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        r = self.rotary_dim
        if r < 2 or r % 2 or r > self.head_dim:
            raise ValueError(f"{name}: head_dim {self.head_dim} gives {r} rotary dims; RoPE needs an even number "
                             f"in [2, head_dim]")
        if self.attention_impl not in IMPLS:
            raise ValueError(f"{name}.attention_impl must be one of {IMPLS}, got {self.attention_impl!r}")
        if self.kernels not in KERNEL_IMPLS:
            raise ValueError(f"{name}.kernels must be one of {KERNEL_IMPLS}, got {self.kernels!r}")
        rope_type(self.rope_scaling)  # raises on an unsupported rope type

    @property
    def rotary_dim(self) -> int:
        """The dims of a head RoPE turns (all of them; a family with partial RoPE overrides this)."""
        return self.head_dim

    def hf_config(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
        """The config.json keys every family writes alike; a family's to_hf_config adds its own."""
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "intermediate_size": self.ffn_dim,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len, "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings, "attention_bias": self.attention_bias,
            "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype_name, "dtype": dtype_name,
        }


def hf_decoder_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """DecoderArgs fields from a Qwen3-layout config.json dict (qwen3, qwen3_moe; transformers 4.x or 5.x: rope in
    `rope_theta` / `rope_scaling` or `rope_parameters`). Raises ValueError naming `source` and the key."""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key not in cfg:
            raise ValueError(f"{source}: missing key {key!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported")
    theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")  # transformers 5.x: {"rope_type", "rope_theta", ...}
    if params and scaling is None:
        theta = params.get("rope_theta", theta)
        scaling = params
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta",)}
        if rope_type(scaling) == "default":
            scaling = None
    heads = cfg["num_attention_heads"]
    return dict(
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn_dim=cfg["intermediate_size"],
        max_seq_len=cfg.get("max_position_embeddings", 40960), rope_theta=float(theta), rope_scaling=scaling,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"), pad_token_id=cfg.get("pad_token_id"),
    )


def hf_rope_and_window(args: DecoderArgs) -> dict[str, Any]:
    """The rope and sliding-window keys of a Qwen3-layout config.json (qwen3, qwen3_moe: full attention everywhere)."""
    return {"rope_theta": args.rope_theta, "rope_scaling": dict(args.rope_scaling) if args.rope_scaling else None,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": args.num_layers}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, impl: str = "auto") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.impl = eps, impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps, self.impl)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm (one pass over the stream).

        Under autocast the stream stays in its own dtype (fp32 from fp32 embeddings) while x, a matmul output,
        is bf16: x is promoted first, as the eager `residual + x` would.
        """
        return add_rmsnorm(x.to(residual.dtype), residual, self.weight, self.eps, self.impl)


@dataclass(frozen=True)
class PackedAttention:
    """Attend for packed rows: causal within each document; cu_seqlens int32 [S+1] over the B·T tokens."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    impl: str

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, h, dh = q.shape
        if (self.impl == "auto" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
                and rows_are_documents(self.cu_seqlens.numel() - 1, b, t, self.max_seqlen)):
            return causal_attention_rows(q, k, v)  # one document per row: cuDNN's causal kernel
        n = b * t
        o = packed_causal_attention(q.reshape(n, h, dh), k.reshape(n, -1, dh), v.reshape(n, -1, dh),
                                    self.cu_seqlens, self.max_seqlen, self.impl)  # [N,H,Dh]
        return o.view(b, t, h, dh)


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.dim, args.num_heads * args.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.dim, args.num_kv_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.dim, args.num_kv_heads * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.dim, bias=bias)
        # Qwen3's QK-norm: RMSNorm over Dh of each head, before RoPE.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.kernels)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.kernels)
        self.kernels = args.kernels

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = shared_input_linears(x, self.q_proj, self.k_proj, self.v_proj)  # one group where they can share
        q = self.q_norm(q.view(b, t, self.num_heads, self.head_dim))  # [B,T,H,Dh]
        k = self.k_norm(k.view(b, t, self.num_kv_heads, self.head_dim))  # [B,T,Hkv,Dh]
        v = v.view(b, t, self.num_kv_heads, self.head_dim)  # [B,T,Hkv,Dh]
        q, k = rope(q, k, cos, sin, self.kernels)
        o = attend(q, k, v)  # [B,T,H,Dh]
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))  # [B,T,D]


class MLP(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.kernels = args.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = shared_input_linears(x, self.gate_proj, self.up_proj)
        return self.down_proj(swiglu(gate, up, self.kernels))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, a family's blocks, final norm."""

    def __init__(self, args: DecoderArgs, blocks: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(args.dim, args.norm_eps, args.kernels)


class CausalLM(nn.Module):
    """What the designer families share around their blocks: `model` (embeddings → blocks → final norm, HF's
    `model.` prefix), the LM head, init by parameter name, logits and the training FLOPs (weight matmuls walked
    from the modules, causal attention on every layer; a family with other layers overrides attention_flops)."""

    def __init__(self, args: Any, backbone: nn.Module) -> None:
        super().__init__()
        self.args = args
        self.model = backbone
        # Tied: the LM head IS the embedding matrix; there is no lm_head module (and no lm_head.weight key).
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, D]: lm_head.weight, or the embedding weight when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def init_by_name(self, rule: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor],
                     seed: int | None) -> Any:
        """Every parameter, in named_parameters() order, := rule(name, shape, one CPU generator seeded `seed`).

        Values are drawn on the CPU in fp32 and copied, so a seed gives the same weights on any device
        and in any dtype (designer/hf.py's init_random streams the same draws to disk).
        """
        gen = torch.Generator().manual_seed(0 if seed is None else seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(rule(name, tuple(p.shape), gen))
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] → logits [..., V] (materialises V; the trainer uses kernels.linear_cross_entropy)."""
        return hidden @ self.lm_head_weight.t()

    def matmul_flops(self, tokens: int, head_tokens: int) -> int:
        """Training FLOPs of every weight matmul, walked from the modules (so LoRA adapters count themselves).

        Per weight W [in → out] on T tokens: 2·in·out·T forward + 2·in·out·T input-grad
        + 2·in·out·T weight-grad only if W.requires_grad (a LoRA's frozen base gets none).
        The LM head runs on `head_tokens` tokens (the ones with a loss).
        Input-gradients are counted for every matmul (docs/mfu.md's 2·N·T). With LoRA and a frozen
        embedding, autograd skips layer 0's q/k/v/gate/up input-gradients, so this overstates the work
        by 2·(those weights)·T, under 1/num_layers of the input-gradient FLOPs.
        """
        return linear_train_flops(self.model.layers, self.lm_head_weight, tokens, head_tokens)

    def attention_flops(self, doc_lens: Sequence[int]) -> int:
        """Causal attention training FLOPs: (4 forward + 8 backward)·L²·H·Dh per doc and layer, halved by the mask."""
        a = self.args
        return 6 * a.num_layers * sum(n * n for n in doc_lens) * a.num_heads * a.head_dim

    def train_flops(self, doc_lens: Sequence[int], head_tokens: int) -> int:
        """Useful FLOPs of one forward+backward over documents of lengths `doc_lens` (padding excluded)."""
        return self.matmul_flops(sum(doc_lens), head_tokens) + self.attention_flops(doc_lens)

    def forward_flops(self, doc_lens: Sequence[int], head_tokens: int) -> int:
        """FLOPs of one forward without backward (DPO's reference pass): 2·in·out·T per nn.Linear (NF4 bases and
        LoRA A/B included), the LM head on `head_tokens`, and the forward third of attention_flops (4 of its 12).
        A Qwen3-MoE's expert stacks are not nn.Linear and are left out (an undercount)."""
        tokens = sum(doc_lens)
        total = sum(2 * m.in_features * m.out_features * tokens for m in self.model.layers.modules()
                    if isinstance(m, (nn.Linear, NF4Linear)))
        head = self.lm_head_weight
        return total + 2 * head.shape[0] * head.shape[1] * head_tokens + self.attention_flops(doc_lens) // 3


def check_packed_inputs(who: str, input_ids: torch.Tensor, position_ids: torch.Tensor,
                        cu_seqlens: torch.Tensor) -> None:
    """The packed forward's input contract (shared by every designer family); raises naming `who`."""
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"{who}: input_ids must be int64 [B,T], got {input_ids.dtype} {tuple(input_ids.shape)}")
    if position_ids.shape != input_ids.shape or position_ids.dtype != torch.long:
        raise ValueError(f"{who}: position_ids must be int64 {tuple(input_ids.shape)}, got "
                         f"{position_ids.dtype} {tuple(position_ids.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{who}: cu_seqlens must be int32 [S+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")


def linear_train_flops(layers: nn.Module, lm_head_weight: torch.Tensor, tokens: int, head_tokens: int) -> int:
    """Training FLOPs of every nn.Linear under `layers` on `tokens` tokens plus the LM head on `head_tokens`.

    Per weight W [in → out]: 2·in·out·T forward + 2·in·out·T input-grad + 2·in·out·T weight-grad only if
    W.requires_grad (a LoRA's frozen base gets none; a LoRA's own A and B are nn.Linear and count themselves; an
    NF4Linear is a frozen linear: its dequantisation is overhead, never counted).
    """
    total = 0
    for m in layers.modules():
        if isinstance(m, (nn.Linear, NF4Linear)):
            per = 2 * m.in_features * m.out_features * tokens
            total += per * (3 if isinstance(m, nn.Linear) and m.weight.requires_grad else 2)
    per = 2 * lm_head_weight.shape[0] * lm_head_weight.shape[1] * head_tokens
    return total + per * (3 if lm_head_weight.requires_grad else 2)


def init_param(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """The fp32 CPU init of one parameter by its HF name: norms ones, biases zeros, every other weight
    normal(0, 0.02) (a family with other parameters handles those first and falls back to this)."""
    if "lora_" in name:
        raise ValueError(f"init_param: {name} is a LoRA weight; init the base model before apply_lora")
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if name.endswith(".weight"):
        return torch.empty(shape).normal_(0.0, 0.02, generator=gen)
    raise ValueError(f"init_param: no init rule for parameter {name}")


def meta_shapes(model_cls: Callable[[Any], nn.Module], args: Any) -> dict[str, tuple[int, ...]]:
    """State-dict key → shape of every tensor of `model_cls(args)`, in state-dict order, built on the meta device
    (nothing allocated)."""
    with torch.device("meta"):
        model = model_cls(dataclasses.replace(args, attention_impl="sdpa"))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
