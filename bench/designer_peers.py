"""The transformers(+PEFT) peers of bench/designer.py: which configuration, on which rows, built on the same weights.

A peer's name is a base, then optional modifiers:

    <base>[-gc][-compiled][-1doc]   base: hf | hf-amp | hf-liger | hf-liger-bf16lora | hf-nofla | hf-bnb

  hf                 transformers as installed (SDPA); PEFT LoRA with fp32 adapters (PEFT's default)
  hf-amp             the same under bf16 autocast (transformers' Trainer with bf16=True)
  hf-liger           Liger's kernels patched into the family's transformers module (and undone afterwards)
  hf-liger-bf16lora  Liger, and the adapters stored in bf16 (the fastest LoRA setup measured for transformers)
  hf-nofla           transformers without fla-core (Qwen3.5's torch path for the delta rule and the conv)
  hf-bnb             QLoRA as transformers + PEFT run it: the decoder layers' linears as bitsandbytes Linear4bit (NF4,
                     blocks of 64, double quantisation, bf16 compute: transformers' BitsAndBytesConfig for QLoRA),
                     then PEFT's prepare_model_for_kbit_training (the other weights in fp32, gradient checkpointing
                     when the bench config checkpoints), fp32 adapters under bf16 autocast. CUDA and LoRA only:
                     anywhere else it is skipped with the reason
  -gc                gradient checkpointing of every decoder layer (transformers' gradient_checkpointing_enable,
                     non-reentrant): what a user turns on when the peer does not fit, e.g. PEFT on Qwen3-30B-A3B's
                     stacked experts, whose W + ΔW per layer is otherwise kept for the backward
  -compiled          torch.compile per decoder layer (pipeline/policies.compile_block_list; dynamic shapes on
                     one-document rows, whose padded length changes from micro-batch to micro-batch)
  -1doc              rows of ONE document each instead of Atelier's packed rows (below)

Rows. Without -1doc the peer sees Atelier's packed rows as dense [B, T] tensors with the per-document position
ids: transformers detects the restarts and gives SDPA a block-diagonal causal mask, so attention is exact and the
losses compare step by step with Atelier's, but the dense T×T mask is the peer's real cost (the exact-packing
peer). With -1doc the peer runs what a user who does not pack would run: the same documents (the segments of the
same packed rows, so the same tokens and the same loss tokens), one per row, sorted by length into micro-batches
(transformers' group_by_length), right-padded to the longest of the micro-batch rounded up to a multiple of 8
(pad_to_multiple_of=8), labels -100 on the padding, and no attention mask and no position ids: with right padding
a causal row never attends to its padding, so plain causal SDPA (flash / cuDNN) is exact with no mask at all. A
micro-batch holds as many rows as fit the token budget of Atelier's micro-batch (B·T padded tokens), and the
micro-batches run in a seeded shuffled order. Only real tokens count in tokens/s; the padding is the peer's waste.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from atelier_studio.data.packing import IGNORE_INDEX, Batch, PackResult
from atelier_studio.designer.hf import Args, build_model
from atelier_studio.designer.lora import LoraArgs, lora_targets, peft_tensors
from atelier_studio.designer.registry import family_of_args
from atelier_studio.pipeline.policies import compile_block_list, model_blocks

PEER_BASES = ("hf", "hf-amp", "hf-liger", "hf-liger-bf16lora", "hf-nofla", "hf-bnb")
PAD_MULTIPLE = 8  # one-document rows are padded to a multiple of this (transformers' pad_to_multiple_of=8)


@dataclass(frozen=True)
class PeerSpec:
    """A parsed peer name (module docstring)."""

    name: str
    base: str
    compiled: bool
    one_doc: bool
    checkpointing: bool = False  # -gc

    @property
    def liger(self) -> bool:
        return "liger" in self.base

    @property
    def four_bit(self) -> bool:
        return self.base == "hf-bnb"

    @property
    def autocast(self) -> bool:
        """Under bf16 autocast (fp32 adapters computed in bf16), as transformers' Trainer runs with bf16=True."""
        return self.base in ("hf-amp", "hf-bnb")

    @property
    def rows(self) -> str:
        return "one document per row" if self.one_doc else "packed rows, block-diagonal mask"


class PeerUnavailable(ImportError):
    """A peer that cannot run here (its library's device, or a config it cannot train): the bench records it as
    skipped with this reason, as it does a missing import."""


def parse_peer(name: str) -> PeerSpec:
    """`name` as a PeerSpec; ValueError naming the grammar for anything else."""
    rest = name
    one_doc = rest.endswith("-1doc")
    rest = rest.removesuffix("-1doc")
    compiled = rest.endswith("-compiled")
    rest = rest.removesuffix("-compiled")
    checkpointing = rest.endswith("-gc")
    rest = rest.removesuffix("-gc")
    if rest not in PEER_BASES:
        raise ValueError(f"unknown peer {name!r}: a base of {list(PEER_BASES)}, then optionally -gc, then optionally "
                         "-compiled, then optionally -1doc")
    return PeerSpec(name, rest, compiled, one_doc, checkpointing)


# ------------------------------------------------------------------------------------------------ rows

def row_documents(packed: PackResult, rows: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids [n], labels [n]) of every document segment of `rows`, in row order. Labels are the packed rows'
    own (shifted inside each document, -100 on the last token), so each document trains exactly as in the row."""
    docs = []
    for r in rows:
        t = 0
        for n in packed.doc_lens[r]:
            docs.append((packed.input_ids[r, t:t + n], packed.labels[r, t:t + n]))
            t += n
    return docs


def one_document_batches(packed: PackResult, rows: range, budget_tokens: int, seed: int) -> list[Batch]:
    """The documents of `rows` as micro-batches of one document per row (module docstring): sorted longest first,
    grouped while rows × padded length ≤ budget_tokens, each row right-padded with packed.pad_id (labels -100),
    groups in a shuffled order drawn from `seed`. Positions are 0..L-1 on every row (what transformers makes when
    given none); cu_seqlens splits each row into its document and its padding."""
    docs = sorted(row_documents(packed, rows), key=lambda d: -d[0].numel())
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for doc in docs:
        if groups:
            width = -(-groups[-1][0][0].numel() // PAD_MULTIPLE) * PAD_MULTIPLE
            if (len(groups[-1]) + 1) * width <= budget_tokens:
                groups[-1].append(doc)
                continue
        groups.append([doc])
    random.Random(seed).shuffle(groups)
    return [_padded_batch(g, packed.pad_id) for g in groups]


def _padded_batch(docs: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int) -> Batch:
    L = -(-max(ids.numel() for ids, _ in docs) // PAD_MULTIPLE) * PAD_MULTIPLE
    B = len(docs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    labels = torch.full((B, L), IGNORE_INDEX, dtype=torch.long)
    bounds = [0]
    for i, (ids, lab) in enumerate(docs):
        n = ids.numel()
        input_ids[i, :n], labels[i, :n] = ids, lab
        bounds += [i * L + n] + ([(i + 1) * L] if n < L else [])
    lens = [ids.numel() for ids, _ in docs]
    return Batch(input_ids, labels, torch.arange(L).expand(B, L).clone(), torch.tensor(bounds, dtype=torch.int32),
                 max_seqlen=L, doc_lens=lens, num_tokens=sum(lens), num_loss_tokens=int((labels != IGNORE_INDEX).sum()))


# ------------------------------------------------------------------------------------------------ the model

def hf_model(args: Args) -> nn.Module:
    """The transformers CausalLM of `args` on the meta device (Qwen3ForCausalLM or Qwen3_5ForCausalLM), SDPA
    attention, no KV cache (with one, transformers skips its packed-sequence detection and the mask leaks)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = {k: v for k, v in args.to_hf_config().items() if k not in ("architectures", "torch_dtype", "dtype")}
    kind = hf_cfg.pop("model_type")
    config = AutoConfig.for_model(kind, **hf_cfg)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _reload_modeling(name: str) -> None:
    """Re-import a transformers modeling module and point its (lazy) package's cached names at the fresh classes.

    Patches live on the module (swapped classes, functions) and on its classes (replaced methods): re-executing
    the module makes fresh, unpatched classes, but transformers' package caches each class it has handed out
    (Auto classes look names up there), so those entries must follow.
    """
    module = importlib.reload(importlib.import_module(name))
    package = sys.modules.get(name.rsplit(".", 1)[0])
    if package is not None:
        for attr, value in list(vars(package).items()):
            if getattr(value, "__module__", None) == name and hasattr(module, attr):
                setattr(package, attr, getattr(module, attr))


def _modeling_module(args: Args) -> str:
    """The transformers modeling module of the family's reference class (designer/family.py HFReference)."""
    return family_of_args(args).hf_reference.modeling_module


@contextlib.contextmanager
def with_liger(args: Args) -> Iterator[None]:
    """Liger's kernels patched into transformers' classes for the duration (build AND run inside), then undone
    by re-importing the modeling module. Liger patches process-wide and has no undo: without this, every
    transformers peer built after a Liger peer silently ran with Liger's kernels."""
    import liger_kernel.transformers as lk

    name = _modeling_module(args)
    family = name.rsplit("modeling_", 1)[1]
    apply = getattr(lk, f"apply_liger_kernel_to_{family}", None)
    if apply is None:
        raise ImportError(f"liger_kernel {getattr(lk, '__version__', '?')} has no apply_liger_kernel_to_{family}")
    try:
        apply()
        yield
    finally:
        _reload_modeling(name)


@contextlib.contextmanager
def without_fla(args: Args) -> Iterator[None]:
    """The family's transformers model as a machine without fla-core runs it (Qwen3.5: its torch fallback for the
    delta rule and the conv): fla made unimportable and the modeling module re-imported, for the duration (build
    AND run inside)."""
    name = _modeling_module(args)
    hidden = {k: sys.modules[k] for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    for k in hidden:
        del sys.modules[k]
    sys.modules["fla"] = None  # type: ignore[assignment]  # `import fla` now raises ImportError
    try:
        _reload_modeling(name)
        yield
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)
        _reload_modeling(name)


def peer_context(spec: PeerSpec, args: Args) -> contextlib.AbstractContextManager:
    """What a peer runs inside: Liger's kernels for the liger bases, no fla-core for hf-nofla, transformers as
    installed otherwise. Each undoes itself, so peers never leak into one another.

    Any other peer runs inside its family's own peer context (designer/family.py HFReference.peer_context: a
    Qwen3.5 peer on fla-core gets the lift of fla's Hopper guard that Atelier's fast path applies to itself)."""
    stack = contextlib.ExitStack()
    if spec.liger:
        stack.enter_context(with_liger(args))
    own = family_of_args(args).hf_reference.peer_context
    if spec.base == "hf-nofla":
        stack.enter_context(without_fla(args))
    elif own is not None:
        stack.enter_context(own(args))
    return stack


def build_peer(spec: PeerSpec, lora: bool, args: Args, weights: dict[str, torch.Tensor],
               lora_sd: dict[str, torch.Tensor], device: torch.device, exact: bool, checkpointing: bool = False
               ) -> tuple[nn.Module, Callable[[Batch], torch.Tensor], list[nn.Parameter]]:
    """transformers' model (SDPA) on `weights` (HF names), on `device` (weights kept on the host come over as the
    model is built); + PEFT LoRA with the same A/B (`lora_sd`, Atelier names) on the same linears. → (model, loss
    of a micro-batch, the optimizer's parameters). `checkpointing`: the bench config checkpoints activations (only
    the 4-bit peer's preparation acts on it, as PEFT's QLoRA recipe does).

    Build and run it inside peer_context(spec, args). Exact (tiny, CPU) runs never compile (Inductor's C++ build
    takes minutes on a CPU)."""
    if spec.four_bit and not lora:
        raise PeerUnavailable("a 4-bit base is frozen: it trains adapters only (a LoRA config)")
    if spec.four_bit and device.type != "cuda":
        raise PeerUnavailable(f"bitsandbytes' 4-bit training runs on CUDA only, not on the {device.type}")
    model = hf_model(args)
    model.load_state_dict(weights, assign=True, strict=not args.tie_embeddings)
    if args.tie_embeddings:
        model.tie_weights()
    # non-persistent buffers (RoPE inv_freq) are not in the state dict: rebuild them on the device
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(device)
    if spec.four_bit:
        model = _bitsandbytes_4bit(model, device, checkpointing or spec.checkpointing)
    else:
        model.to(device)  # weights kept on the host (the QLoRA config) come over now; a no-op when they are there
        if spec.checkpointing:  # the newer name where transformers has it (the older one warns there)
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if lora:
        from peft import LoraConfig, get_peft_model

        with torch.device("meta"):
            targets = sorted({leaf for _, _, leaf in lora_targets(build_model(args), LoraArgs(rank=16, alpha=32.0))})
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
        from peft.utils import set_peft_model_state_dict

        dtype = torch.bfloat16 if spec.base.endswith("bf16lora") else torch.float32
        # the same adapters in PEFT's own key layout; a mixture of experts' are per expert, converted by PEFT onto
        # transformers 5's stacked experts as its loader converts a saved adapter (a gate/up pair is then one
        # adapter of rank 2r)
        state = peft_tensors({k: v.to(device) for k, v in lora_sd.items()})
        if any(".experts." in k for k in state):
            from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers

            state = convert_peft_adapter_state_dict_for_transformers(model, model.peft_config["default"], state)
        result = set_peft_model_state_dict(model, state)
        lost = [k for k in result.missing_keys if "lora_" in k]
        if result.unexpected_keys or lost:
            raise RuntimeError(f"build_peer: PEFT did not take the adapters: unexpected {result.unexpected_keys[:3]}, "
                               f"missing {lost[:3]}")
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.data = p.data.to(dtype)
    else:
        model.requires_grad_(True)
    model.train()
    if spec.compiled and not exact:
        compile_block_list(model_blocks(model), dynamic=None if spec.one_doc else False)
    autocast = not exact and (not lora or spec.autocast)
    # a mixture of experts trains as its released config says (Qwen3-30B-A3B: output_router_logits false): no
    # load-balancing loss on either side (Atelier's runs call the plain forward)
    extra = {"output_router_logits": False} if family_of_args(args).forward_with_aux is not None else {}

    def loss(b: Batch) -> torch.Tensor:
        # labels are already shifted (data/packing.py): pass them as shift_labels too so nothing re-shifts.
        # One-document rows take no position ids (transformers makes 0..L-1, and sees no packing); packed rows
        # pass theirs, from which transformers builds the block-diagonal mask.
        positions = {} if spec.one_doc else {"position_ids": b.position_ids}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=b.input_ids, labels=b.labels, shift_labels=b.labels, **positions, **extra)
        return out.loss

    return model, loss, [p for p in model.parameters() if p.requires_grad]


def _bitsandbytes_4bit(model: nn.Module, device: torch.device, checkpointing: bool) -> nn.Module:
    """The decoder layers' linears as bitsandbytes Linear4bit (NF4, blocks of 64, double quantisation, bf16
    compute: transformers' BitsAndBytesConfig for QLoRA), each quantised as it moves to `device`, so the device
    never holds the bf16 layers; the other weights moved there; then PEFT's prepare_model_for_kbit_training, as a
    transformers QLoRA run does (those weights cast to fp32, gradient checkpointing when `checkpointing`)."""
    import bitsandbytes as bnb
    from peft import prepare_model_for_kbit_training

    for layer in model.model.layers:
        for name, mod in list(layer.named_modules()):
            if type(mod) is not nn.Linear:
                continue
            new = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                    compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                    device="meta")
            new.weight = bnb.nn.Params4bit(mod.weight.data, requires_grad=False, compress_statistics=True,
                                           quant_type="nf4", blocksize=64)
            if mod.bias is not None:
                new.bias = mod.bias
            parent, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, leaf, new.to(device))
    model.to(device)
    model.is_loaded_in_4bit = True  # what transformers' loader sets: PEFT then prepares it as a 4-bit model
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})


def peer_kernels(model: nn.Module) -> str:
    """What a built peer really runs, for the report: its final norm's class (Liger's, or transformers')."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(inner.model.norm).__name__


def peer_notes(spec: PeerSpec) -> dict[str, Any]:
    """The report's description of a peer's configuration."""
    return {"rows": spec.rows, "compiled": spec.compiled, "liger": spec.liger,
            "gradient_checkpointing": spec.checkpointing,
            "lora_weights": "bfloat16" if spec.base.endswith("bf16lora") else "float32",
            "autocast": spec.autocast, "base_weights": "nf4 (bitsandbytes)" if spec.four_bit else "model dtype"}
