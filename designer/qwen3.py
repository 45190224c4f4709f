"""Qwen3 dense causal LM (the "designer"), with Hugging Face Qwen3ForCausalLM state-dict names.

Shape legend: B rows, T tokens per row, N = B·T packed tokens, D dim, H query heads, Hkv kv heads,
Dh head dim (not necessarily D/H), F ffn dim, V vocab, S documents in a packed batch.

Block (pre-norm, as Qwen3):  x += o_proj(attn(rope(q_norm(q_proj(n(x)))), rope(k_norm(k_proj(n(x)))), v_proj(n(x))))
                             x += down_proj(silu(gate_proj(n(x))) · up_proj(n(x)))
The model runs PACKED rows: several documents share a row, positions restart at 0 per document and
`cu_seqlens` marks document boundaries over the flattened B·T tokens, so no document attends to
another. HF layout I/O lives in designer/hf.py; FAMILY (at the end) is this architecture's registry record.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from atelier_studio.designer.decode import kv_cache_batch
from atelier_studio.designer.family import Family, HFReference, decoder_layers
from atelier_studio.kernels.attention import IMPLS, causal_attention_rows, packed_causal_attention, rows_are_documents
from atelier_studio.kernels.fp8_group import fp8_lora_linear_group
from atelier_studio.kernels.lora_linear import lora_linear_group
from atelier_studio.kernels.rmsnorm import add_rmsnorm, rmsnorm
from atelier_studio.kernels.rope import rope, rope_cos_sin, rope_type
from atelier_studio.kernels.swiglu import swiglu
from atelier_studio.pipeline.float8 import float8_group
from atelier_studio.pipeline.nf4 import NF4Linear

KERNEL_IMPLS = ("auto", "triton", "ref")  # ModelArgs.kernels: rmsnorm / rope / swiglu / LoRA linear

# (q [B,T,H,Dh], k [B,T,Hkv,Dh], v [B,T,Hkv,Dh]) -> o [B,T,H,Dh], one per layer; the packed forward
# (PackedAttention) and the KV-cache generator (designer/generate.py) each supply them, so there is one
# copy of the block. No layer index reaches a block: under per-block torch.compile an int argument is a
# guard, and 36 layers would mean 36 compiled graphs.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of a Qwen3 dense model. Field names are shared with imagegen's config."""

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
    kernels: str = "auto"  # rmsnorm / rope / swiglu / lora_linear: auto (Triton on CUDA) | triton | ref
    # Special token ids are carried so that config.json / generation_config.json round-trip.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for f in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelArgs.{f} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelArgs.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelArgs.head_dim must be even for RoPE, got {self.head_dim}")
        if self.attention_impl not in IMPLS:
            raise ValueError(f"ModelArgs.attention_impl must be one of {IMPLS}, got {self.attention_impl!r}")
        if self.kernels not in KERNEL_IMPLS:
            raise ValueError(f"ModelArgs.kernels must be one of {KERNEL_IMPLS}, got {self.kernels!r}")
        rope_type(self.rope_scaling)  # raises on an unsupported rope type

    @classmethod
    def from_size(cls, size: str, vocab_size: int, **overrides: Any) -> ModelArgs:
        """ModelArgs for a named size in SIZES with the tokenizer's vocab size."""
        if size not in SIZES:
            raise ValueError(f"unknown designer size {size!r}; known: {sorted(SIZES)}")
        return cls(vocab_size=vocab_size, **{**SIZES[size], **overrides})

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], attention_impl: str = "auto", source: str = "config.json",
                       kernels: str = "auto") -> ModelArgs:
        """ModelArgs from a Hugging Face Qwen3 config.json dict (transformers 4.x or 5.x layout)."""
        if cfg.get("model_type") != "qwen3":
            raise ValueError(f"{source}: model_type must be 'qwen3', got {cfg.get('model_type')!r}")
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
        try:
            return cls(
                vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
                num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn_dim=cfg["intermediate_size"],
                max_seq_len=cfg.get("max_position_embeddings", 40960), rope_theta=float(theta), rope_scaling=scaling,
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)), attention_impl=attention_impl, kernels=kernels,
                bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
                pad_token_id=cfg.get("pad_token_id"),
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf_config(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
        """config.json dict that AutoModelForCausalLM loads as Qwen3ForCausalLM."""
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "intermediate_size": self.ffn_dim,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len, "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_embeddings, "attention_bias": self.attention_bias,
            "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": self.num_layers, "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype_name, "dtype": dtype_name,
        }


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


def shared_input_linears(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """[m(x) for m in linears]: the projections that read one x (q/k/v, gate/up, Qwen3.5's in_proj_*).

    When every one is a LoRA layer that can share (designer.lora.LoRALinear.shared_input_operands: no bias, no
    dropout in effect; _groupable: one kernel choice and adapter dtype, all adapters trained or all frozen), they
    run as one kernels.lora_linear.lora_linear_group: x·Aᵀ once for all adapters, dx accumulated inside the
    matmuls instead of M−1 separate adds; over FP8 bases (train.precision = "fp8") as
    kernels.fp8_group.fp8_lora_linear_group, x also quantised once for every base. FP8 full fine-tuning's
    Float8Linear layers group through pipeline.float8.float8_group (x quantised once). Anything else (plain
    nn.Linear: bf16 full fine-tuning, the reference path) runs layer by layer.
    """
    if len(linears) > 1:
        grouped = float8_group(x, linears)
        if grouped is not None:
            return grouped
    operands = [getattr(m, "shared_input_operands", lambda: None)() for m in linears]
    if len(linears) > 1 and all(o is not None for o in operands) and _groupable(operands):
        first = operands[0]
        weights, lora_as, lora_bs = [o.weight for o in operands], [o.lora_a for o in operands], [o.lora_b for o in operands]
        scales = [o.scale for o in operands]
        if first.fp8 is not None:
            return fp8_lora_linear_group(x, weights, [o.fp8 for o in operands], lora_as, lora_bs, scales,
                                         first.fp8.recipe, first.impl)
        return lora_linear_group(x, weights, lora_as, lora_bs, scales, first.impl)
    return [m(x) for m in linears]


def _groupable(operands: list[Any]) -> bool:
    """One kernel choice, one adapter dtype, every adapter weight trained or every one frozen (a frozen A
    with a trained B, as LoRA-FA trains, runs layer by layer), and every base bf16 or every one FP8 in one recipe."""
    first = operands[0]
    recipe = first.fp8.recipe if first.fp8 is not None else None
    return all(o.impl == first.impl and o.lora_a.dtype == o.lora_b.dtype == first.lora_a.dtype
               and o.lora_a.requires_grad == o.lora_b.requires_grad == first.lora_a.requires_grad
               and (o.fp8.recipe if o.fp8 is not None else None) == recipe for o in operands)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
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
        q, k, v = shared_input_linears(x, self.q_proj, self.k_proj, self.v_proj)
        q = self.q_norm(q.view(b, t, self.num_heads, self.head_dim))  # [B,T,H,Dh]
        k = self.k_norm(k.view(b, t, self.num_kv_heads, self.head_dim))  # [B,T,Hkv,Dh]
        v = v.view(b, t, self.num_kv_heads, self.head_dim)  # [B,T,Hkv,Dh]
        q, k = rope(q, k, cos, sin, self.kernels)
        o = attend(q, k, v)  # [B,T,H,Dh]
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))  # [B,T,D]


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.kernels = args.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = shared_input_linears(x, self.gate_proj, self.up_proj)
        return self.down_proj(swiglu(gate, up, self.kernels))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, args.kernels)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, args.kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attend)
        normed, x = self.post_attention_layernorm.add_forward(attn, x)  # x += attn, fused with the norm
        return x + self.mlp(normed)


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, blocks (Qwen3's, or a family's own `blocks`), final norm."""

    def __init__(self, args: ModelArgs, blocks: Iterable[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(blocks if blocks is not None else (Block(args) for _ in range(args.num_layers)))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.kernels)


class CausalLM(nn.Module):
    """What the designer architectures share around their blocks (Qwen3 here, Qwen35 in designer/qwen35.py):
    `model` (embeddings → blocks → final norm, HF's `model.` prefix), the LM head, init by parameter name,
    logits and the weight-matmul FLOPs."""

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


class Qwen3(CausalLM):
    """Qwen3 dense causal LM. `state_dict()` keys equal transformers' Qwen3ForCausalLM keys."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Backbone(args))

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

    # --- FLOPs (matmul_flops: CausalLM) -------------------------------------------------------------
    def attention_flops(self, doc_lens: Sequence[int]) -> int:
        """Causal attention training FLOPs: (4 forward + 8 backward)·L²·H·Dh per doc and layer, halved by the mask."""
        a = self.args
        return 6 * a.num_layers * sum(n * n for n in doc_lens) * a.num_heads * a.head_dim

    def train_flops(self, doc_lens: Sequence[int], head_tokens: int) -> int:
        """Useful FLOPs of one forward+backward over documents of lengths `doc_lens` (padding excluded)."""
        return self.matmul_flops(sum(doc_lens), head_tokens) + self.attention_flops(doc_lens)


def check_packed_inputs(who: str, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """The packed forward's input contract (shared by every designer architecture); raises naming `who`."""
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
    """The fp32 CPU init of one parameter by its HF name (the table in Qwen3.init_weights)."""
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


def hf_param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF key → shape of every parameter of a Qwen3 with `args`, in state-dict order, without allocating."""
    return meta_shapes(Qwen3, args)


def num_params(args: ModelArgs) -> int:
    """Parameter count (the tied LM head counted once)."""
    return sum(math.prod(s) for s in hf_param_shapes(args).values())


FAMILY = Family(
    name="Qwen3", model_types=("qwen3",), args_cls=ModelArgs, model_cls=Qwen3, sizes=SIZES, tiny_size="tiny",
    hf_param_shapes=hf_param_shapes, init_param=init_param,
    # short LoRA target names → module paths inside a block; the default is all of them ("all linear")
    lora_targets={"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                  "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"},
    train_flops=Qwen3.train_flops, decode_batch=kv_cache_batch, blocks=decoder_layers,
    hf_reference=HFReference("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
)
