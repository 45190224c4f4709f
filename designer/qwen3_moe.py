"""Qwen3-MoE causal LM (Qwen3-30B-A3B, Qwen3-235B-A22B), with Hugging Face Qwen3MoeForCausalLM state-dict names.

Shape legend: B rows, T tokens per row, N = B·T packed tokens, D dim, H / Hkv heads, Dh head dim, E experts,
k experts per token, F expert ffn dim (moe_intermediate_size), Fd dense ffn dim, V vocab, Ls sparse layers.

Block: Qwen3's (designer/decoder.py's Attention with QK-norm, pre-norm residuals), with the MLP of a sparse
layer replaced by the sparse MoE block:
    x += o_proj(attn(...))                              designer.decoder.Attention
    x += moe(n(x))                                      sparse layers: router → top-k experts (kernels/moe.py)
    x += down_proj(silu(gate_proj(n(x))) · up_proj(n(x)))  dense layers (designer.decoder.MLP, Fd)
Layer i is sparse iff i ∉ mlp_only_layers, E > 0 and (i + 1) % decoder_sparse_step == 0 (transformers' rule).
Routing is dropless (kernels/moe.py): tokens never interact, so packed rows (positions restarting per document,
`cu_seqlens` at the boundaries, designer/decoder.py) equal their documents run one by one.

Load-balancing loss (Switch Transformer, Fedus et al. 2021, arXiv:2101.03961, eqs. 4-6), as transformers'
load_balancing_loss_func computes it, over the sparse layers and the REAL tokens of a micro-batch (padding is
excluded, as transformers excludes it through the attention mask), R = Ls · n_real:
    p = softmax(router logits) per token (in the logits' dtype, as transformers), c_e = #(token, layer) pairs whose
    top-k of p holds e, P_e = Σ p_e;   aux = E · Σ_e (c_e / R) · (P_e / R).
Training adds router_aux_loss_coef · aux to the mean loss when config.json's output_router_logits is true (as
transformers does) or model.router_aux_loss = "on" (designer/task.py).

Checkpoint key layout. In memory a sparse layer's experts are two stacked tensors (transformers 5's names):
    model.layers.i.mlp.experts.gate_up_proj [E, 2F, D] ([gate; up] per expert), ....experts.down_proj [E, D, F],
    and the router model.layers.i.mlp.gate.weight [E, D].
On disk the released checkpoints (and transformers 5's save_pretrained) store one matrix per expert:
    model.layers.i.mlp.experts.{e}.gate_proj.weight [F, D], ....up_proj.weight [F, D], ....down_proj.weight [D, F].
designer/hf.py reads both and writes the per-expert one (ExpertKeys, this family's hf_layout).

LoRA: q k v o on attention (designer/lora.py's LoRALinear) and gate up down on the experts, one adapter per expert
(GroupedLoRA), saved in PEFT's per-expert layout. A dense layer's MLP (mlp_only_layers) takes no adapter, as PEFT
leaves it on transformers 5 (its expert targets become the stacked expert parameters there).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
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
    linear_train_flops,
    meta_shapes,
)
from atelier_studio.designer.family import Family, HFReference, decoder_layers
from atelier_studio.kernels.moe import ExpertLoRA, moe
from atelier_studio.kernels.rope import rope_cos_sin
from atelier_studio.pipeline.nf4 import NF4ExpertStack

MODEL_TYPE = "qwen3_moe"


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeArgs(DecoderArgs):
    """Architecture of a Qwen3-MoE model: the decoder's fields (DecoderArgs; ffn_dim is the dense layers' MLP,
    intermediate_size; kernels also picks the MoE dispatch) and the experts'."""

    moe_ffn_dim: int  # each expert's (moe_intermediate_size)
    num_experts: int
    top_k: int  # num_experts_per_tok
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False  # config.json's switch for the load-balancing loss in training

    POSITIVE = (*DecoderArgs.POSITIVE, "moe_ffn_dim", "num_experts", "top_k", "decoder_sparse_step")

    def __post_init__(self) -> None:
        super().__post_init__()  # POSITIVE, heads, RoPE, kernel choices
        if self.top_k > self.num_experts:
            raise ValueError(f"Qwen3MoeArgs.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"Qwen3MoeArgs.mlp_only_layers {bad} are not layers 0..{self.num_layers - 1}")

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it is a sparse MoE layer (transformers' Qwen3MoeDecoderLayer rule)."""
        return tuple(i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_layers))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> Qwen3MoeArgs:
        """Qwen3MoeArgs from a transformers `qwen3_moe` config.json dict (4.x or 5.x layout: `num_experts` or
        `num_local_experts`, rope in `rope_theta` / `rope_scaling` or `rope_parameters`)."""
        if cfg.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{source}: model_type must be {MODEL_TYPE!r}, got {cfg.get('model_type')!r}")
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        missing = [k for k in ("moe_intermediate_size", "num_experts_per_tok") if k not in cfg]
        if missing or experts is None:
            raise ValueError(f"{source}: missing keys {missing + ([] if experts is not None else ['num_experts'])}")
        if not experts:
            raise ValueError(f"{source}: num_experts = 0 is a dense model (load it as model_type 'qwen3')")
        shared = hf_decoder_fields(cfg, source)
        try:
            return cls(**shared, moe_ffn_dim=cfg["moe_intermediate_size"], num_experts=experts,
                       top_k=cfg["num_experts_per_tok"], norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                       decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                       mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
                       router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
                       output_router_logits=bool(cfg.get("output_router_logits", False)))
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf_config(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
        """config.json dict that AutoModelForCausalLM loads as Qwen3MoeForCausalLM (the released configs' keys)."""
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": MODEL_TYPE, **self.hf_config(dtype),
                **hf_rope_and_window(self), "moe_intermediate_size": self.moe_ffn_dim, "num_experts": self.num_experts,
                "num_experts_per_tok": self.top_k, "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers),
                "router_aux_loss_coef": self.router_aux_loss_coef, "output_router_logits": self.output_router_logits}


_QWEN3_MOE = dict(head_dim=128, moe_ffn_dim=768, num_experts=128, top_k=8, norm_topk_prob=True, max_seq_len=40960,
                  rope_theta=1e6, norm_eps=1e-6, tie_embeddings=False)
SIZES: dict[str, dict[str, Any]] = {
    # Odd on purpose: Dh 32 != D/H, one dense layer (mlp_only_layers) between two sparse ones, F != Fd, and the
    # aux loss on, so every path a real checkpoint can take runs on a CPU.
    "qwen3-moe-tiny": dict(dim=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=96, moe_ffn_dim=32,
                           num_experts=8, top_k=2, norm_topk_prob=True, mlp_only_layers=(1,), max_seq_len=512,
                           output_router_logits=True, tie_embeddings=False),
    # The released shapes (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B config.json).
    "qwen3-30b-a3b": dict(dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, ffn_dim=6144, **_QWEN3_MOE),
    "qwen3-235b-a22b": dict(dim=4096, num_layers=94, num_heads=64, num_kv_heads=4, ffn_dim=12288,
                            **{**_QWEN3_MOE, "moe_ffn_dim": 1536}),
}


class Experts(nn.Module):
    """HF's `mlp.experts`: every expert's SwiGLU FFN, stacked (gate_up_proj [E, 2F, D], down_proj [E, D, F]).

    A grouped-weight host for designer/lora.py: leaves gate_proj / up_proj / down_proj name the per-expert
    matrices, and adapters (after apply_lora) live in `lora_adapters`.
    """

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        e, d, f = args.num_experts, args.dim, args.moe_ffn_dim
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))
        self.kernels = args.kernels

    @property
    def quantized(self) -> bool:
        """Whether the stacks are stored in NF4 (quantize_nf4)."""
        return isinstance(self.gate_up_proj, NF4ExpertStack)

    def grouped_lora_weight(self, leaf: str) -> torch.Tensor | None:
        """The [E, O, I] matrices of `leaf` (views of the stacked parameters), None for another name."""
        if self.quantized:  # merge_lora would write into a view of them: merge onto the bf16 base instead (PEFT)
            raise TypeError(f"Experts.grouped_lora_weight({leaf!r}): the experts are stored in NF4; load the adapter "
                            f"onto the unquantised base to merge it")
        f = self.down_proj.shape[2]
        return {"gate_proj": self.gate_up_proj[:, :f], "up_proj": self.gate_up_proj[:, f:],
                "down_proj": self.down_proj}.get(leaf)

    def quantize_nf4(self, device: torch.device | str | None = None) -> list[str]:
        """QLoRA: store both frozen stacks in NF4 (pipeline/nf4.py NF4ExpertStack), each quantised on `device` (default:
        where it is) on its own, in place; their adapters are untouched. Returns the names of the stacks."""
        if self.gate_up_proj.requires_grad or self.down_proj.requires_grad:
            raise ValueError("Experts.quantize_nf4: the expert weights train (full fine-tuning); only a frozen base is "
                             "stored in NF4")
        for name in ("gate_up_proj", "down_proj"):
            stack = NF4ExpertStack.from_weight(getattr(self, name), device, self.kernels)
            delattr(self, name)  # the bf16 Parameter goes; the module of the same name takes its place
            setattr(self, name, stack)
        return ["gate_up_proj", "down_proj"]

    def local(self) -> tuple[Any, Any, ExpertLoRA | None]:
        """(gate_up, down, adapters) as this process computes with them: all of them, or under expert parallelism
        (pipeline/expert_parallel.py: DTensors sharded by expert) this rank's experts. NF4 stacks come as
        kernels/nf4_moe.py's NF4Experts."""
        adapters = self._modules.get("lora_adapters")
        lora = None
        if adapters:
            pair = lambda leaf: ((_local(adapters[leaf].lora_A), _local(adapters[leaf].lora_B))  # noqa: E731
                                 if leaf in adapters else None)
            lora = ExpertLoRA(next(iter(adapters.values())).scale, pair("gate_proj"), pair("up_proj"),
                              pair("down_proj"))
        if self.quantized:
            return self.gate_up_proj.experts(), self.down_proj.experts(), lora
        return _local(self.gate_up_proj), _local(self.down_proj), lora

    def shard(self, shard: Callable[[torch.Tensor], nn.Parameter], experts: slice) -> None:
        """Replace the stacked weights and their adapters by `shard(...)` of each (expert parallelism: this rank
        keeps `experts`); NF4 stacks shard their bytes the same way (pipeline/nf4.py NF4ExpertStack.shard)."""
        if self.quantized:
            self.gate_up_proj.shard(shard, experts)
            self.down_proj.shard(shard, experts)
        else:
            self.gate_up_proj, self.down_proj = shard(self.gate_up_proj), shard(self.down_proj)
        for adapter in (self._modules.get("lora_adapters") or {}).values():
            adapter.lora_A, adapter.lora_B = shard(adapter.lora_A), shard(adapter.lora_B)

    def train_flops(self, slots: int) -> int:
        """Training FLOPs of the experts on `slots` routed rows (N·k): gate/up and down, forward and input-gradient,
        weight-gradient when they train; the adapters' own."""
        _, two_f, d = self.gate_up_proj.shape
        per = 2 * slots * (two_f * d + d * self.down_proj.shape[2])
        trains = not self.quantized and self.gate_up_proj.requires_grad
        total = per * (3 if trains else 2)
        adapters = self._modules.get("lora_adapters") or {}  # designer.lora.GroupedLoRA, by leaf
        return total + sum(a.train_flops(slots) for a in adapters.values())


class SparseMoeBlock(nn.Module):
    """HF's `mlp` of a sparse layer: the router `gate` (E logits per token) and the `experts`."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)
        self.experts = Experts(args)
        self.num_experts, self.top_k, self.norm_topk_prob = args.num_experts, args.top_k, args.norm_topk_prob
        self.kernels = args.kernels
        self.exchange = None  # expert parallelism's all-to-all (use_exchange), None: every expert is here

    def use_exchange(self, exchange: Any, shard: Callable[[torch.Tensor], nn.Parameter]) -> None:
        """Expert parallelism (pipeline/expert_parallel.py): keep this rank's experts (`shard` of each stacked weight
        and adapter) and send the tokens of the others through `exchange` (kernels.moe.Exchange)."""
        self.experts.shard(shard, exchange.experts)
        self.exchange = exchange

    def forward(self, x: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B,T,D] → (y [B,T,D], router statistics [2, E] over the real tokens `real` [N] (0/1), or None)."""
        b, t, d = x.shape
        gate_up, down, lora = self.experts.local()
        # args.kernels picks the MoE path too: auto (Triton dispatch + grouped GEMMs on CUDA) | triton | ref
        out, routing = moe(x.reshape(b * t, d), self.gate.weight, gate_up, down, self.top_k, self.norm_topk_prob, lora,
                           self.kernels, self.kernels, self.exchange)  # [N,D]
        stats = None if real is None else router_stats(routing.logits, self.top_k, real)
        return out.view(b, t, d), stats


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (expert parallelism), any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def router_stats(logits: torch.Tensor, top_k: int, real: torch.Tensor) -> torch.Tensor:
    """[P; c] [2, E] fp32 for the load-balancing loss: P_e = Σ_n real_n p_n,e and c_e = Σ_n real_n #(e ∈ top-k(p_n)),
    p = softmax(logits) in the logits' dtype (transformers' load_balancing_loss_func). logits [N, E], real [N]."""
    probs = torch.softmax(logits, dim=-1)  # [N, E]
    chosen = torch.topk(probs, top_k, dim=-1).indices  # [N, k]
    counts = torch.zeros(logits.shape[1], dtype=torch.float32, device=logits.device)
    counts.scatter_add_(0, chosen.reshape(-1), real[:, None].expand(-1, top_k).reshape(-1))
    return torch.stack([(probs.float() * real[:, None]).sum(0), counts])


def load_balancing_loss(stats: torch.Tensor, real_tokens: torch.Tensor) -> torch.Tensor:
    """aux = E · Σ_e (c_e / R)(P_e / R) from the sparse layers' router_stats [Ls, 2, E]; R = Ls · Σ real tokens."""
    rows = stats.shape[0] * real_tokens.sum().float()
    probs, counts = stats[:, 0].sum(0) / rows, stats[:, 1].sum(0) / rows
    return stats.shape[-1] * (probs * counts).sum()


class Block(nn.Module):
    def __init__(self, args: Qwen3MoeArgs, sparse: bool) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = SparseMoeBlock(args) if sparse else MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, args.kernels)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, args.kernels)
        self.sparse = sparse

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """→ (x, this layer's router statistics [2, E], or None for a dense layer or when `real` is None)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attend)
        normed, x = self.post_attention_layernorm.add_forward(attn, x)  # x += attn, fused with the norm
        if not self.sparse:
            return x + self.mlp(normed), None
        y, stats = self.mlp(normed, real)
        return x + y, stats


class Qwen3Moe(CausalLM):
    """Qwen3-MoE causal LM. `state_dict()` keys equal transformers 5's Qwen3MoeForCausalLM keys."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args, Backbone(args, (Block(args, sparse) for sparse in args.sparse_layers)))

    def init_weights(self, seed: int | None = None) -> Qwen3Moe:
        """Initialise every parameter from one CPU generator (CausalLM.init_by_name), the experts drawn one stored
        per-expert matrix at a time in ExpertKeys order (as `designer init` streams them to disk).

        | parameter                                        | init            |
        |--------------------------------------------------|-----------------|
        | model.embed_tokens.weight, lm_head.weight        | normal(0, 0.02) |
        | *_proj.weight (q, k, v, o; dense gate, up, down) | normal(0, 0.02) |
        | mlp.gate.weight (router)                         | normal(0, 0.02) |
        | mlp.experts.gate_up_proj, down_proj (per expert) | normal(0, 0.02) |
        | *_proj.bias (attention_bias=True)                | zeros           |
        | *norm.weight                                     | ones            |
        """
        def rule(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
            parts = EXPERT_KEYS.parts(name, shape)
            if parts is None:
                return init_param(name, shape, gen)
            return EXPERT_KEYS.join(name, shape, slice(0, shape[0]), lambda key: init_param(key, parts[key], gen))

        return self.init_by_name(rule, seed)

    def _layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attends: Sequence[Attend],
                real: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        a = self.args
        cos, sin = rope_cos_sin(position_ids, a.head_dim, a.rope_theta, a.rope_scaling)  # [B,T,Dh] fp32
        x = self.model.embed_tokens(input_ids)  # [B,T,D]
        stats = []
        for block, attend in zip(self.model.layers, attends):
            x, s = block(x, cos, sin, attend, real)
            if s is not None:
                stats.append(s)
        return self.model.norm(x), stats

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      attends: Sequence[Attend]) -> torch.Tensor:
        """input_ids, position_ids [B,T] → final-normed hidden [B,T,D]; layer i attends through `attends[i]`."""
        if len(attends) != self.args.num_layers:
            raise ValueError(f"Qwen3Moe.hidden_states: {len(attends)} attends for {self.args.num_layers} layers")
        return self._layers(input_ids, position_ids, attends, None)[0]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                real_tokens: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Packed forward. input_ids, position_ids int64 [B,T]; cu_seqlens int32 [S+1] over B·T → hidden [B,T,D].

        With `real_tokens` [B,T] bool (False on padding): (hidden, router statistics [Ls, 2, E] of those tokens,
        for load_balancing_loss)."""
        check_packed_inputs("Qwen3Moe.forward", input_ids, position_ids, cu_seqlens)
        attend = PackedAttention(cu_seqlens, max_seqlen, self.args.attention_impl)
        real = None if real_tokens is None else real_tokens.reshape(-1).float()  # [N]
        hidden, stats = self._layers(input_ids, position_ids, [attend] * self.args.num_layers, real)
        return hidden if real is None else (hidden, torch.stack(stats))

    # --- FLOPs ----------------------------------------------------------------------------------------
    def matmul_flops(self, tokens: int, head_tokens: int) -> int:
        """Every nn.Linear (attention, dense MLPs, routers, LoRA A/B; designer.decoder.linear_train_flops) plus the
        experts on the N·k slots they run: the active parameters, the k chosen experts and the router."""
        experts = [m for m in self.model.layers.modules() if isinstance(m, Experts)]
        return (linear_train_flops(self.model.layers, self.lm_head_weight, tokens, head_tokens)
                + sum(e.train_flops(tokens * self.args.top_k) for e in experts))

    # attention_flops, train_flops: CausalLM's (causal attention on every layer)


def active_params(args: Qwen3MoeArgs) -> int:
    """Parameters one token uses: attention, dense MLPs, routers, its k experts, final norm and LM head (the input
    embedding is a lookup)."""
    shapes = hf_param_shapes(args)
    per_expert_share = args.top_k / args.num_experts
    total = 0
    for k, s in shapes.items():
        if k == "model.embed_tokens.weight" and not args.tie_embeddings:
            continue
        total += math.prod(s) * (per_expert_share if ".mlp.experts." in k else 1)
    return int(total)


# --- the checkpoint key layout ----------------------------------------------------------------------
_STACKED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class ExpertKeys:
    """Stacked experts in memory, one matrix per expert on disk (designer/family.py KeyLayout)."""

    def parts(self, key: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]] | None:
        m = _STACKED.match(key)
        if m is None:
            return None
        stem, which = m.groups()
        if which == "down_proj":  # [E, D, F]
            return {f"{stem}{e}.down_proj.weight": shape[1:] for e in range(shape[0])}
        half = (shape[1] // 2, shape[2])  # gate_up_proj [E, 2F, D]: [gate; up] per expert
        return {f"{stem}{e}.{p}.weight": half for e in range(shape[0]) for p in ("gate_proj", "up_proj")}

    def part(self, key: str, tensor: torch.Tensor, part_key: str) -> torch.Tensor:
        m = _PER_EXPERT.match(part_key)
        if m is None or _STACKED.match(key) is None:
            raise KeyError(f"ExpertKeys.part: {part_key} is not a per-expert key of {key}")
        e, proj = int(m.group(2)), m.group(3)
        if proj == "down_proj":
            return tensor[e]
        f = tensor.shape[1] // 2
        return tensor[e, :f] if proj == "gate_proj" else tensor[e, f:]

    def join(self, key: str, shape: tuple[int, ...], rows: slice,
             read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        stem, which = _STACKED.match(key).groups()
        experts = range(*rows.indices(shape[0]))
        if which == "down_proj":
            return torch.stack([read(f"{stem}{e}.down_proj.weight") for e in experts])
        return torch.stack([torch.cat([read(f"{stem}{e}.gate_proj.weight"), read(f"{stem}{e}.up_proj.weight")])
                            for e in experts])


EXPERT_KEYS = ExpertKeys()


def hf_param_shapes(args: Qwen3MoeArgs) -> dict[str, tuple[int, ...]]:
    """State-dict key → shape of every parameter (experts stacked), in state-dict order, without allocating."""
    return meta_shapes(Qwen3Moe, args)


def num_params(args: Qwen3MoeArgs) -> int:
    """Parameter count (the tied LM head counted once; every expert)."""
    return sum(math.prod(s) for s in hf_param_shapes(args).values())


def forward_with_aux(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, real_tokens: torch.Tensor,
                     setting: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden, router_aux_loss_coef · aux) when the load-balancing loss is on (setting "on", or "auto" with
    config.json's output_router_logits, as transformers), else (hidden, None). `model` may be FSDP-wrapped."""
    args = model.args
    if setting == "off" or (setting == "auto" and not args.output_router_logits):
        return model(input_ids, position_ids, cu_seqlens, max_seqlen), None
    hidden, stats = model(input_ids, position_ids, cu_seqlens, max_seqlen, real_tokens=real_tokens)
    return hidden, args.router_aux_loss_coef * load_balancing_loss(stats, real_tokens)


@torch.no_grad()
def expert_counts(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seqlen: int, real_tokens: torch.Tensor) -> torch.Tensor:
    """Real tokens routed to each expert, [Ls, E] (each token counts once for each of its k experts)."""
    _, stats = model(input_ids, position_ids, cu_seqlens, max_seqlen, real_tokens=real_tokens)
    return stats[:, 1]


FAMILY = Family(
    name="Qwen3-MoE", model_types=(MODEL_TYPE,), args_cls=Qwen3MoeArgs, model_cls=Qwen3Moe, sizes=SIZES,
    tiny_size="qwen3-moe-tiny", hf_param_shapes=hf_param_shapes, init_param=init_param,
    # attention's linears and the experts' per-expert matrices (a dense layer's MLP takes none: module docstring)
    lora_targets={"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                  "gate": "mlp.experts.gate_proj", "up": "mlp.experts.up_proj", "down": "mlp.experts.down_proj"},
    train_flops=Qwen3Moe.train_flops, decode_batch=kv_cache_batch, blocks=decoder_layers,
    read_hf_config=lambda cfg, source: Qwen3MoeArgs.from_hf_config(cfg, source=source),
    hf_layout=EXPERT_KEYS, forward_with_aux=forward_with_aux, expert_counts=expert_counts,
    hf_reference=HFReference("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeForCausalLM"),
)
