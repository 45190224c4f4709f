"""The record of one designer model family: what the generic designer code needs to know about an architecture.

A family's own file (designer/qwen3.py for Qwen3, designer/qwen35.py for Qwen3.5) declares its `Family` and takes
what families share from designer/decoder.py, never from another family's file;
designer/registry.py lists the families, and everything else (HF I/O, LoRA, decoding, the task, the bench,
the CLI) asks the registry instead of testing types. What a family supplies:

  args_cls        a frozen dataclass with the fields the shared code reads (vocab_size, dim, num_layers,
                  num_heads, num_kv_heads, head_dim, max_seq_len, tie_embeddings, kernels, attention_impl and
                  the special token ids; designer/decoder.py's DecoderArgs holds them with their checks),
                  `from_hf_config(cfg, source=...)` and `to_hf_config(dtype)`
  model_cls       a designer.decoder.CausalLM subclass built from the args (HF state-dict names)
  sizes           named sizes: args fields, the vocabulary coming from the tokenizer (`designer init --size`)
  HF key layout   hf_param_shapes(args) (every state-dict key and shape, nothing allocated) and init_param(name,
                  shape, gen) (one stored tensor's fp32 init, in state-dict order), read by designer/hf.py;
                  hf_layout when some state-dict tensors are stored as several tensors on disk (Qwen3-MoE's
                  stacked experts, one tensor per expert in the released checkpoints)
  LoRA            lora_targets: short target name → module path inside a block (PEFT's target_modules are
                  the leaf names); default_lora_targets, () for all of them
  train_flops     the model's own FLOP counter: train_flops(model, doc_lens, head_tokens)
  decode_batch    its decoding cache (designer/decode.py's kv_cache_batch, or the family's own)
  blocks          the parallelize plan: the repeated blocks of a built model, each its own activation
                  checkpointing / compile / FSDP2 unit; the rest (embeddings, final norm, head) is the root unit
  preflight       an optional check before anything is loaded (Qwen3.5: fla-core on CUDA)
  forward_with_aux  the forward of a family with an auxiliary training loss (Qwen3-MoE's load balancing): the
                  hidden states and the loss term to add, or None
  expert_counts   an MoE family's tokens per expert and layer on a batch (the bench reports their spread)
  hf_reference    the transformers class it is compared with in tests and bench/designer.py

Adding a family is its own file declaring a Family plus one line in designer/registry.py (or a
`registry.register(...)` call, as tests/designer/toy_family.py does).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from atelier_studio.designer.config import ModelConfig
    from atelier_studio.designer.decoder import CausalLM

# (model, prompts as id lists, max_new_tokens, temperature, top_p, generator, eos ids [E]) → new ids per prompt
DecodeBatch = Callable[["CausalLM", list[list[int]], int, float, float, torch.Generator, torch.Tensor],
                       list[list[int]]]
# The implementation choices a run sets on the args read from config.json (never part of the checkpoint).
IMPL_FIELDS = ("attention_impl", "delta_rule_impl", "kernels")


class DesignerArgs(Protocol):
    """The fields of a family's args that the shared code reads (HF I/O, LoRA, decoding, the task)."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    tie_embeddings: bool
    attention_impl: str
    kernels: str
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None

    def to_hf_config(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]: ...


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks of a model in Hugging Face's decoder layout: `model.model.layers`."""
    return list(model.model.layers)


class KeyLayout(Protocol):
    """How a family stores some of its state-dict tensors on disk as several tensors (designer/hf.py reads both
    the joined and the split form, and writes the split one). Keys it does not split are stored as they are."""

    def parts(self, key: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]] | None:
        """The stored keys and shapes of state-dict tensor `key`, in init-draw order; None: stored as itself."""
        ...

    def part(self, key: str, tensor: torch.Tensor, part_key: str) -> torch.Tensor:
        """Stored tensor `part_key` of state-dict tensor `key` (a view of `tensor`)."""
        ...

    def join(self, key: str, shape: tuple[int, ...], rows: slice,
             read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Rows `rows` (dim 0) of state-dict tensor `key` from its stored parts, each read by `read(part_key)`
        (called in parts order, so init draws stream in the order designer/hf.py writes them)."""
        ...


# (model, input_ids, position_ids, cu_seqlens, max_seqlen, real tokens [B, T] bool, the model.router_aux_loss
# setting) → (hidden [B, T, D], the auxiliary loss term to add to the mean loss, or None when it is off)
ForwardWithAux = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, str],
                          tuple[torch.Tensor, "torch.Tensor | None"]]
# (model, input_ids, position_ids, cu_seqlens, max_seqlen, real tokens [B, T] bool) → real tokens routed to each
# expert, [sparse layers, E]
ExpertCounts = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HFReference:
    """The transformers implementation of a family: what tests and the bench compare against."""

    modeling_module: str  # e.g. "transformers.models.qwen3.modeling_qwen3"
    causal_lm: str  # its causal-LM class in that module, e.g. "Qwen3ForCausalLM"
    # What a transformers peer runs inside in bench/designer.py, given the args (None: nothing)
    peer_context: Callable[[Any], AbstractContextManager] | None = None

    def causal_lm_class(self) -> type:
        return getattr(importlib.import_module(self.modeling_module), self.causal_lm)


@dataclass(frozen=True)
class Family:
    """One designer architecture (the module docstring lists what each field is for)."""

    name: str  # shown to users: "Qwen3", "Qwen3.5"
    model_types: tuple[str, ...]  # config.json model_type values this family reads; the first is the one it writes
    args_cls: type
    model_cls: type
    sizes: Mapping[str, Mapping[str, Any]]
    tiny_size: str  # the size CPU runs of the bench use (bench/designer.py --tiny)
    hf_param_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    init_param: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]
    lora_targets: Mapping[str, str]
    train_flops: Callable[[Any, Sequence[int], int], int]
    decode_batch: DecodeBatch
    hf_reference: HFReference
    blocks: Callable[[nn.Module], list[nn.Module]] = decoder_layers
    default_lora_targets: tuple[str, ...] = ()  # () = every entry of lora_targets
    # config.json dict → args (None: args_cls.from_hf_config(cfg, source=source)); raises ValueError naming source
    read_hf_config: Callable[[dict, str], Any] | None = None
    preflight: Callable[[Any, ModelConfig, torch.device], None] | None = None
    hf_layout: KeyLayout | None = None  # None: every state-dict tensor is stored under its own key
    forward_with_aux: ForwardWithAux | None = None  # None: no auxiliary loss (model.router_aux_loss must not be on)
    expert_counts: ExpertCounts | None = None  # None: not a mixture of experts

    def __post_init__(self) -> None:
        problems = []
        if not self.model_types:
            problems.append("model_types is empty")
        if self.tiny_size not in self.sizes:
            problems.append(f"tiny_size {self.tiny_size!r} is not one of its sizes {list(self.sizes)}")
        if not dataclasses.is_dataclass(self.args_cls):
            problems.append(f"args_cls {self.args_cls.__name__} is not a dataclass")
        if not self.lora_targets:
            problems.append("lora_targets is empty")
        leaves = [path.rsplit(".", 1)[-1] for path in self.lora_targets.values()]
        if len(set(leaves)) != len(leaves):  # PEFT names targets by leaf: two equal leaves cannot round-trip
            problems.append(f"lora_targets' leaf names repeat: {leaves}")
        unknown = [t for t in self.default_lora_targets if t not in self.lora_targets]
        if unknown:
            problems.append(f"default_lora_targets {unknown} are not in lora_targets {list(self.lora_targets)}")
        if problems:
            raise ValueError(f"Family {self.name!r}: {'; '.join(problems)}")
        object.__setattr__(self, "model_types", tuple(self.model_types))
        object.__setattr__(self, "default_lora_targets", tuple(self.default_lora_targets) or tuple(self.lora_targets))

    def args_of_size(self, size: str, vocab_size: int, **overrides: Any) -> Any:
        """The args of a named size with the tokenizer's vocabulary and field `overrides`."""
        return self.args_cls(vocab_size=vocab_size, **{**self.sizes[size], **overrides})

    def args_from_hf_config(self, cfg: dict, source: str, **impls: str) -> Any:
        """The args of a config.json dict, with the implementation choices `impls` (IMPL_FIELDS) this family's
        args have (a family without a delta rule ignores delta_rule_impl)."""
        unknown = sorted(set(impls) - set(IMPL_FIELDS))
        if unknown:
            raise TypeError(f"args_from_hf_config: unknown implementation choices {unknown}; known: {IMPL_FIELDS}")
        args = (self.read_hf_config(cfg, source) if self.read_hf_config is not None
                else self.args_cls.from_hf_config(cfg, source=source))
        fields = {f.name for f in dataclasses.fields(args)}
        return dataclasses.replace(args, **{k: v for k, v in impls.items() if k in fields})

    def resolve_lora_targets(self, targets: Sequence[str]) -> tuple[str, ...]:
        """`targets` checked against this family's table; () gives the default. ValueError names the unknown ones."""
        unknown = [t for t in targets if t not in self.lora_targets]
        if unknown:
            raise ValueError(f"LoRA targets {unknown} are not {self.name} linears; its targets: "
                             f"{', '.join(self.lora_targets)}")
        return tuple(targets) or self.default_lora_targets
