"""Designer speed on one GPU: Atelier vs transformers+PEFT (+Liger) on the same weights and batches.

    python3 -m bench.designer --config qwen3-8b-lora|qwen3-1.7b-full|qwen3-8b-lora-64k|qwen3.5-9b-lora[-1doc]|qwen3-8b-qlora
        --out DIR [--peers hf,hf-liger,hf-liger-bf16lora,hf-nofla,hf-bnb] [--micro-batches 2,4,8] [--steps 10 --warmup 3]
        [--ablation] [--compile on|off|both] [--lora-dtype bfloat16|float32|mixed] [--profile]
        [--tokenizer .gpu/qwen3-tokenizer] [--tiny]

Shapes: B rows per micro-batch, T tokens per row, N = B·T, D dim, V vocab.

Per config the random bf16 weights are drawn ONCE on the device; every run (Atelier, each peer, each
ablation) is built around those same tensors (frozen LoRA bases share them; full fine-tuning copies them
into fp32 master weights), with the same LoRA A/B init and the same batches in the same order, so losses
are comparable step by step. A step = forward + loss + backward + optimizer step + zero_grad, timed with
CUDA events (wall clock on CPU); `warmup` steps first (per-block compile happens in the first: shapes
and max_seqlen are fixed), then `steps` timed ones: median tok/s and min–max. Only non-padding tokens count.

Data: documents packed best-fit into rows of T (data/packing.py). With --tokenizer, shapes-world briefs and
captions through the chat template (loss on the caption); otherwise random-token documents with a
lognormal length distribution (median 300 tokens, loss on the last 60%). The 64k config is one document.

Peers see the same packed rows as dense [B,T] tensors with the per-document position ids: transformers 5
detects the restarts (masking_utils.find_packed_sequence_indices) and gives SDPA a block-diagonal causal
mask, so the peer's attention is exact (no leaking) and losses are comparable on the packed batches
themselves. The peer's mask is dense T×T and its kernel cannot skip masked blocks: that is its real cost.

QLoRA (`qwen3-8b-qlora`, lora.base_dtype = "nf4"): the LoRA bases in NF4 (designer/lora_nf4.py), and at every
micro-batch the same run over the bf16 base ("bf16_base", same adapters, batches, activation checkpointing), so
tokens/s and peak memory compare at equal micro-batch. The random weights are drawn on the device and kept on the
host, so each run's peak counts only what it puts on the device (the QLoRA run quantises one weight at a time there).
The peer "hf-bnb" is transformers + PEFT over bitsandbytes' 4-bit NF4 linears (double quantisation, bf16 compute),
prepared as PEFT's QLoRA recipe does (prepare_model_for_kbit_training: gradient checkpointing when the config
checkpoints, the remaining weights in fp32) with fp32 adapters under bf16 autocast; CUDA only.

FLOPs: the family's own counter (`Qwen3.train_flops`, designer/family.py) (4·N_mm + 6·N_lora + attention for LoRA, 6·N_mm + attention for full
FT, LM head on the loss tokens: the head FLOPs Atelier performs) — the same count is used for the peers' MFU
(same tokens). `mfu_4n_head_all` is the peers' convention (docs/mfu.md), the LM head counted on every
token (the peers compute it there; Atelier computes it only where a loss is taken). `mfu_6n` is the 6·N_mm
convention most peers quote. MFU against 989 TFLOP/s and against bench.env.matmul_tflops.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from atelier_studio.bench.env import clocks, environment, matmul_tflops
from atelier_studio.bench.harness import (PEAK_TFLOPS, adamw, bar_chart, fmt, guarded, parse_ints, profile_table, timed_steps,
                           train_step, write_report)
from atelier_studio.data.chat import EncodedDoc
from atelier_studio.data.packing import Batch, fixed_shape, make_batch, pack_documents
from atelier_studio.designer.lora import LoraArgs, LoRALinear, apply_lora, lora_targets
from atelier_studio.designer.lora_nf4 import quantize_lora_bases
from atelier_studio.designer.hf import Args, args_from_size, build_model, hf_param_shapes
from atelier_studio.designer.registry import family_of_args, family_of_size
from atelier_studio.kernels.cross_entropy import linear_cross_entropy
from atelier_studio.pipeline.policies import checkpoint_blocks, compile_block_list, cpu_offload

# hf-amp: PEFT's fp32 adapters under bf16 autocast, as transformers' Trainer runs LoRA with bf16=True
PEERS = ("hf", "hf-amp", "hf-liger", "hf-liger-bf16lora", "hf-nofla", "hf-bnb")
ABLATIONS = ("compile", "reference_kernels", "plain_logits", "sdpa_attention", "foreach_adamw", "fp32_lora")
# The peer whose LoRA weights have the same dtype as Atelier's: loss parity is measured against it.
# (the first of each list that ran; "mixed" = fp32 adapters computed in bf16, like hf-amp)
PARITY_PEER = {"bfloat16": ("hf-liger-bf16lora",), "float32": ("hf",), "mixed": ("hf-amp", "hf")}
# QLoRA runs compare with the 4-bit peer (another NF4 quantiser: their losses differ by its rounding, not bit parity)
QLORA_PEER = "hf-bnb"
# The issue's targets for QLoRA on one H200: peak at micro-batch 1, tokens/s against the bf16 base and the peer
QLORA_TARGETS = {"peak_gb_at_mb1": 16.0, "vs_bf16_base": 0.8, "vs_peer": 2.0}


@dataclass(frozen=True)
class BenchConfig:
    size: str                      # a registered designer size (designer/registry.py)
    lora: bool                     # LoRA r16/alpha32 on every linear (all 7 / 12 targets), or full fine-tuning
    seq_len: int                   # T
    micro_batches: tuple[int, ...]
    one_doc: bool = False          # one document of seq_len tokens per row
    ac: str = "none"               # Atelier's activation checkpointing (pipeline/policies.py)
    offload: bool = False          # CPU activation offload (long sequences)
    lr: float = 1e-4
    lora_dtype: str = "bfloat16"   # Atelier's adapter weights (exact runs use float32)
    vocab_size: int = 151936       # Qwen3's embedding rows
    base: str = "bf16"             # the LoRA bases' storage: "bf16", or "nf4" (QLoRA, with a bf16-base twin run)


CONFIGS = {
    "qwen3-8b-lora": BenchConfig("8b", True, 2048, (2, 4, 8)),
    "qwen3-1.7b-full": BenchConfig("1.7b", False, 2048, (8, 16), lr=1e-5),
    # full AC: selective AC would keep every matmul output, ~5 GB per layer at 65,536 tokens
    "qwen3-8b-lora-64k": BenchConfig("8b", True, 65536, (1,), one_doc=True, ac="full"),
    # the hybrid (24 Gated DeltaNet + 8 gated-attention layers), LoRA on every linear of both kinds.
    # transformers gets no document boundaries from position ids in its Gated DeltaNet layers (state and conv
    # leak across documents), so on packed rows only speed compares; loss parity uses rows of one document.
    "qwen3.5-9b-lora": BenchConfig("qwen3.5-9b", True, 2048, (2, 4, 8), vocab_size=248320),
    "qwen3.5-9b-lora-1doc": BenchConfig("qwen3.5-9b", True, 2048, (2, 4), one_doc=True, vocab_size=248320),
    # QLoRA on a 16 GB budget: full AC (a no-AC micro-batch of 2048 tokens keeps ~11 GB of activations on its own)
    "qwen3-8b-qlora": BenchConfig("8b", True, 2048, (1, 2, 4), ac="full", base="nf4"),
}


@dataclass(frozen=True)
class Variant:
    """One Atelier run's switches (the ablation turns each off in turn)."""

    compile: bool = True
    kernels: str = "auto"          # ModelArgs.kernels; "ref": every kernel's plain-PyTorch path
    chunked_ce: bool = True
    attention: str = "auto"        # kernels.attention impl
    fused_adamw: bool = True
    lora_dtype: str = "bfloat16"
    base: str = "bf16"             # "nf4": the LoRA bases quantised on the device (designer/lora_nf4.py)


def tiny_config(cfg: BenchConfig) -> BenchConfig:
    """The same code path at CPU size: tiny model, short rows, fp32."""
    tiny = family_of_size(cfg.size).tiny_size
    return dataclasses.replace(cfg, size=tiny, seq_len=96 if not cfg.one_doc else 64, micro_batches=(1, 2),
                               vocab_size=256)


# ------------------------------------------------------------------------------------------------ data

def random_docs(n: int, vocab: int, seed: int, max_len: int) -> list[EncodedDoc]:
    """Documents of lognormal length (median 300, clipped to [48, max_len]); loss on the last 60%.

    Short rows (tiny runs) scale the median and floor down to max_len/4 and max_len/8, so rows still pack.
    """
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    median, floor = min(300, max_len // 4), min(48, max(2, max_len // 8))
    docs = []
    for _ in range(n):
        n_tok = int(min(max(rng.lognormvariate(math.log(median), 0.6), floor), max_len))
        ids = torch.randint(0, vocab, (n_tok,), generator=g).tolist()
        prompt = int(0.4 * n_tok)
        docs.append(EncodedDoc(ids, [False] * prompt + [True] * (n_tok - prompt)))
    return docs


def world_docs(n: int, tokenizer_dir: str, seed: int) -> list[EncodedDoc]:
    """Shapes-world brief → caption documents through the real tokenizer's chat template."""
    from atelier_studio.data.chat import Example, encode_examples
    from atelier_studio.data.synthetic import HELD_OUT_PAIRS, sample_one
    from atelier_studio.data.tokenizer import load_tokenizer

    rng = random.Random(seed)
    tok = load_tokenizer(tokenizer_dir)
    samples = [sample_one(rng, HELD_OUT_PAIRS, None) for _ in range(n)]
    return encode_examples(tok, [Example.from_brief(s.brief, s.spec.caption()) for s in samples])


def make_batches(cfg: BenchConfig, micro_batch: int, count: int, tokenizer: str | None, seed: int) -> list[Batch]:
    """`count` packed micro-batches of `micro_batch` rows of T tokens (host tensors, host-side counts)."""
    rows_needed = micro_batch * count
    T = cfg.seq_len
    g = torch.Generator().manual_seed(seed)
    if cfg.one_doc:
        docs = [EncodedDoc(torch.randint(0, cfg.vocab_size, (T,), generator=g).tolist(), [False] * (T // 8)
                           + [True] * (T - T // 8)) for _ in range(rows_needed)]
    else:
        per_row = max(1, T // min(300, T // 4))
        n_docs = rows_needed * per_row * 2
        docs = world_docs(n_docs * 4, tokenizer, seed) if tokenizer else random_docs(n_docs, cfg.vocab_size, seed, T)
    packed = pack_documents(docs, T, "split", pad_id=0)
    if len(packed) < rows_needed:
        raise ValueError(f"make_batches: {len(packed)} packed rows < {rows_needed} needed")
    return [make_batch(packed, list(range(i * micro_batch, (i + 1) * micro_batch))) for i in range(count)]


# ------------------------------------------------------------------------------------------------ weights

def random_state_dict(args: Args, dtype: torch.dtype, device: torch.device, seed: int,
                      store: torch.device | None = None) -> dict[str, torch.Tensor]:
    """HF-named weights: normal(0, 0.02) matrices, ones for norms (Qwen3.init_weights' table), drawn on `device`
    and kept on `store` (default: `device`), one tensor at a time: the same values wherever they are kept."""
    g = torch.Generator(device=device).manual_seed(seed)
    store = store or device
    out = {}
    for name, shape in hf_param_shapes(args).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype, device=store)
        else:
            t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0, 0.02, generator=g).to(dtype)
            out[name] = t.to(store)
    return out


def lora_init(args: Args, lora: LoraArgs, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """PEFT's default init for every adapter, by Atelier name: A kaiming-uniform(a=√5) in fp32, B zeros."""
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = hf_param_shapes(args)
    with torch.device("meta"):
        targets = [name for name, _, _ in lora_targets(build_model(args), lora)]  # the linears apply_lora wraps
    out = {}
    for stem in targets:
        out_features, fan_in = shapes[f"{stem}.weight"]
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=√5): gain·√(3/fan_in) = 1/√fan_in
        out[f"{stem}.lora_A.weight"] = torch.empty(lora.rank, fan_in, device=device).uniform_(-bound, bound,
                                                                                              generator=g)
        out[f"{stem}.lora_B.weight"] = torch.zeros(out_features, lora.rank, device=device)
    return out


def weights_for(sd: dict[str, torch.Tensor], full: bool, exact: bool) -> dict[str, torch.Tensor]:
    """Full FT trains its own fp32 master copy; a LoRA base is frozen, so every run shares the same tensors."""
    if full or exact:
        return {k: v.float().clone() if full else v for k, v in sd.items()}
    return sd


# ------------------------------------------------------------------------------------------------ runs

@dataclass
class Run:
    """A built model: its step(batch) → loss tensor (detached, on device) and its optimizer's parameters."""

    model: nn.Module
    loss: Callable[[Batch], torch.Tensor]
    params: list[nn.Parameter]
    fused_adamw: bool


def build_atelier(cfg: BenchConfig, args: Args, sd: dict, lora_sd: dict, v: Variant, exact: bool) -> Run:
    args = dataclasses.replace(args, attention_impl=v.attention, kernels=v.kernels)
    dev = next(iter(lora_sd.values())).device if lora_sd else next(iter(sd.values())).device
    with torch.device("meta"):
        model = build_model(args)
    model.load_state_dict(weights_for(sd, not cfg.lora, exact), assign=True)
    if cfg.lora:
        # "mixed": fp32 adapter weights (the optimizer's master copy) computed in bf16 under autocast
        weights = "float32" if exact or v.lora_dtype == "mixed" else v.lora_dtype
        apply_lora(model, LoraArgs(rank=16, alpha=32.0, dtype=weights))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(lora_sd[name])
        if v.base == "nf4":
            quantize_lora_bases(model, dev)  # from the host weights, one base at a time
    else:
        model.requires_grad_(True)
    model.to(dev)  # host-kept weights (the QLoRA config) come over now; a no-op otherwise
    blocks = family_of_args(args).blocks(model)  # the family's parallelize plan: its repeated blocks
    checkpoint_blocks(blocks, cfg.ac)
    if v.compile:
        compile_block_list(blocks)
    # full FT: fp32 master weights under bf16 autocast (docs/training.md); "mixed" LoRA likewise for its adapters
    autocast = not exact and (not cfg.lora or v.lora_dtype == "mixed")

    def loss(b: Batch) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            hidden = model(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)  # [B,T,D]
            index = b.loss_index  # type: ignore[attr-defined]
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)  # [n,D]
            labels = b.labels.reshape(-1).index_select(0, index)  # [n]
            if v.chunked_ce:
                total = linear_cross_entropy(hidden, model.lm_head_weight, labels,
                                             impl="torch" if v.kernels == "ref" else "auto")
            else:
                total = F.cross_entropy(model.logits(hidden).float(), labels, reduction="sum")  # [n,V] logits
        return total / b.num_loss_tokens

    params = [p for p in model.parameters() if p.requires_grad]
    return Run(model, loss, params, v.fused_adamw)


def _hf_model(args: Args) -> nn.Module:
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
    import importlib
    import sys

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
    import sys

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


def build_peer(name: str, cfg: BenchConfig, args: Args, sd: dict, lora_sd: dict, exact: bool) -> Run:
    """transformers' model (SDPA) on the same weights; + PEFT LoRA with the same A/B on the same linears.

    Build and run it inside peer_context(name, args), which applies Liger or hides fla-core for that peer only.
    """
    model = _hf_model(args)
    weights = weights_for(sd, not cfg.lora, exact)
    model.load_state_dict(weights, assign=True, strict=not args.tie_embeddings)
    if args.tie_embeddings:
        model.tie_weights()
    dev = next(iter(lora_sd.values())).device if lora_sd else next(iter(weights.values())).device
    # non-persistent buffers (RoPE inv_freq) are not in the state dict: rebuild them on the device
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(dev)
    if name == "hf-bnb":
        model = _bitsandbytes_4bit(model, dev, checkpointing=cfg.ac != "none")
    model.to(dev)
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraArgs(rank=16, alpha=32.0)
        with torch.device("meta"):
            targets = sorted({leaf for _, _, leaf in lora_targets(build_model(args), lora)})
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
        dtype = torch.bfloat16 if name.endswith("bf16lora") else torch.float32
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    key = pname.removeprefix("base_model.model.").replace(".default.", ".")
                    p.data = lora_sd[key].to(device=dev, dtype=dtype).clone()
    else:
        model.requires_grad_(True)
    model.train()
    autocast = not exact and (not cfg.lora or name in ("hf-amp", "hf-bnb"))

    def loss(b: Batch) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            # labels are already shifted (data/packing.py): pass them as shift_labels too so nothing re-shifts
            out = model(input_ids=b.input_ids, position_ids=b.position_ids, labels=b.labels, shift_labels=b.labels)
        return out.loss

    params = [p for p in model.parameters() if p.requires_grad]
    return Run(model, loss, params, fused_adamw=dev.type == "cuda")


def _bitsandbytes_4bit(model: nn.Module, device: torch.device, checkpointing: bool) -> nn.Module:
    """The decoder layers' linears as bitsandbytes Linear4bit (NF4, blocks of 64, double quantisation, bf16 compute:
    transformers' BitsAndBytesConfig for QLoRA), quantised as they move to `device` one layer at a time; then
    PEFT's prepare_model_for_kbit_training, as a transformers QLoRA run does."""
    if device.type != "cuda":
        raise ImportError("hf-bnb: bitsandbytes' 4-bit training runs on CUDA only (skipped on the CPU)")
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
    model.is_loaded_in_4bit = True  # what transformers sets: PEFT's preparation then sets up checkpointing
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})


def peer_context(name: str, args: Args) -> contextlib.AbstractContextManager:
    """What a peer runs inside: "hf-liger*" with Liger's kernels, "hf-nofla" without fla-core (Qwen3.5's slow
    path), "hf" as transformers is installed. Each undoes itself, so peers never leak into one another.

    Any other peer runs inside its family's own peer context (designer/family.py HFReference.peer_context: a
    Qwen3.5 peer on fla-core gets the lift of fla's Hopper guard that Atelier's fast path applies to itself)."""
    stack = contextlib.ExitStack()
    if "liger" in name:
        stack.enter_context(with_liger(args))
    own = family_of_args(args).hf_reference.peer_context
    if name == "hf-nofla":
        stack.enter_context(without_fla(args))
    elif own is not None:
        stack.enter_context(own(args))
    return stack


def peer_kernels(run: Run) -> str:
    """What a built peer really runs, for the report: its final norm's class (Liger's, or transformers')."""
    inner = run.model.get_base_model() if hasattr(run.model, "get_base_model") else run.model
    return type(inner.model.norm).__name__


def measure(build: Callable[[], Run], batches: list[Batch], cfg: BenchConfig, warmup: int, steps: int,
            flops: list[int], offload: bool) -> dict[str, Any]:
    """Build, run warmup + steps optimizer steps, time them; OOM is a result (bench.harness.guarded)."""
    cuda = batches[0].input_ids.device.type == "cuda"

    def use(run: Run) -> dict[str, Any]:
        opt = adamw(run.params, cfg.lr, fused=run.fused_adamw and cuda)
        step = train_step(run.loss, batches, opt, lambda: cpu_offload(enabled=offload))
        return timed_steps(step, warmup + steps, cuda)

    r = guarded(build, use, cuda)
    if r["oom"]:
        return r
    t = r["step_s"][warmup:]
    n = len(batches)
    tokens = [batches[(warmup + k) % n].num_tokens for k in range(steps)]
    tps = [tok / s for tok, s in zip(tokens, t)]
    fl = [flops[(warmup + k) % n] for k in range(steps)]
    tflops = statistics.median(f / s for f, s in zip(fl, t)) / 1e12
    r.update(tokens_per_s=statistics.median(tps), tokens_per_s_min=min(tps), tokens_per_s_max=max(tps),
             step_s_median=statistics.median(t), tflops=tflops, mfu_4n=tflops / PEAK_TFLOPS,
             timed_losses=r["losses"][warmup:])
    return r


def step_flops(cfg: BenchConfig, args: Args, batches: list[Batch]) -> tuple[list[int], list[int], list[int]]:
    """Per batch, from a meta model: the model's train_flops (LoRA: 4N+6N_lora+attn, the LM head on loss tokens),
    the 6·N_mm figure, and train_flops with the LM head on every token (the peers' convention)."""
    with torch.device("meta"):
        m = build_model(args)
    if cfg.lora:
        apply_lora(m, LoraArgs(rank=16, alpha=32.0))
    train_flops = family_of_args(args).train_flops  # the family's own counter
    useful = [train_flops(m, b.doc_lens, b.num_loss_tokens) for b in batches]
    head_all = [train_flops(m, b.doc_lens, sum(b.doc_lens)) for b in batches]
    m.requires_grad_(True)  # every matmul with a weight gradient: the 6N convention
    for mod in m.modules():
        if isinstance(mod, LoRALinear):
            mod.lora_A.requires_grad_(False), mod.lora_B.requires_grad_(False)
    six = [train_flops(m, b.doc_lens, b.num_loss_tokens) for b in batches]
    return useful, six, head_all


def mfu_of(flops: list[int], step_s: list[float], warmup: int) -> float:
    """Median over the timed steps of flops / time, against PEAK_TFLOPS."""
    return statistics.median(f / s for f, s in zip(flops[warmup:], step_s[warmup:], strict=True)) / 1e12 / PEAK_TFLOPS


# ------------------------------------------------------------------------------------------------ the bench

def to_device(b: Batch, device: torch.device) -> Batch:
    d = b.to(device)
    d.loss_index = b.labels.reshape(-1).ne(-100).nonzero().squeeze(1).to(device)  # type: ignore[attr-defined]
    return d


def loss_diff(a: list[float], b: list[float]) -> float:
    """Mean |a − b| over the timed steps."""
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def diff_at_largest_shared(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Mean |Δloss| of two sweeps (micro-batch → run) on the same batches: at the largest micro-batch both ran
    without running out of memory; None when there is none."""
    same = [m for m in a if m in b and not a[m]["oom"] and not b[m]["oom"]]
    if not same:
        return None
    m = max(same, key=int)
    return {"micro_batch": int(m), "diff": loss_diff(a[m]["timed_losses"], b[m]["timed_losses"])}


def peer_floor(peer_runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """diff_at_largest_shared between each pair of peers that ran (none when fewer than two did)."""
    ran = sorted(p for p, runs in peer_runs.items() if "skipped" not in runs)
    pairs = ((a, b, diff_at_largest_shared(peer_runs[a], peer_runs[b])) for i, a in enumerate(ran) for b in ran[i + 1:])
    return {f"{a} vs {b}": d for a, b, d in pairs if d}


def ablation_switches(cfg: BenchConfig, main: Variant, exact: bool) -> dict[str, Variant]:
    """Each Atelier optimisation switched off (or, for compile, flipped) in turn, relative to `main`.

    Exact (tiny CPU) runs never compile, so they have no compile switch.
    """
    out = {} if exact else {("no_compile" if main.compile else "with_compile"):
                            dataclasses.replace(main, compile=not main.compile)}
    out.update({"reference_kernels": dataclasses.replace(main, kernels="ref"),
           "plain_logits": dataclasses.replace(main, chunked_ce=False),
           "sdpa_attention": dataclasses.replace(main, attention="sdpa"),
           "foreach_adamw": dataclasses.replace(main, fused_adamw=False)})
    if cfg.lora and main.lora_dtype != "float32":
        out["fp32_lora"] = dataclasses.replace(main, lora_dtype="float32")
    return out


def profile_step(run_build: Callable[[], Run], batches: list[Batch], cfg: BenchConfig, path: Path) -> Path:
    """bench.harness.profile_table over Atelier's step (3 warm-up steps, 2 profiled)."""
    torch._dynamo.reset()
    run: Run = run_build()
    opt = adamw(run.params, cfg.lr, fused=run.fused_adamw)
    return profile_table(train_step(run.loss, batches, opt, lambda: cpu_offload(enabled=cfg.offload)), 3, path)


def bench(name: str, cfg: BenchConfig, out: Path, peers: list[str], micro_batches: list[int], steps: int,
          warmup: int, ablation: bool, tokenizer: str | None, device: torch.device, exact: bool,
          compile_modes: tuple[bool, ...] = (True,), profile: bool = False, seed: int = 0) -> dict[str, Any]:
    """One config: the micro-batch sweep (each micro-batch in each of `compile_modes`, the faster one kept) with
    the peers on the same batches, loss parity, the ablation around the best run, an optional profile."""
    args = args_from_size(cfg.size, vocab_size=cfg.vocab_size)
    dtype = torch.float32 if exact else torch.bfloat16
    report: dict[str, Any] = {**environment(), "config": {"name": name, **dataclasses.asdict(cfg)},
                              "run": {"warmup": warmup, "steps": steps, "seed": seed, "tokenizer": tokenizer},
                              "clocks": {"before": clocks()}, "matmul_tflops": matmul_tflops()}
    # QLoRA: the weights stay on the host, so a run's peak is what it puts on the device
    sd = random_state_dict(args, dtype, device, seed, store=torch.device("cpu") if cfg.base == "nf4" else None)
    lora_sd = lora_init(args, LoraArgs(rank=16, alpha=32.0), device, seed + 1) if cfg.lora else {}
    offload = cfg.offload
    sweep: dict[str, Any] = {}
    peer_runs: dict[str, dict[str, Any]] = {p: {} for p in peers}
    notes = {"peer_attention": "transformers position_ids packing: block-diagonal causal mask through SDPA (exact)",
             "loss_parity_rows": "packed rows (peers see the same document-masked attention)",
             "atelier_shapes": "cu_seqlens padded with empty segments and max_seqlen = T so compiled blocks see "
                               "one shape",
             "data": "shapes-world chat documents through the Qwen3 tokenizer" if tokenizer else
                     "random-token documents (lognormal lengths)"}
    modes = (False,) if exact else tuple(compile_modes)
    variants = {c: Variant(compile=c, lora_dtype="float32" if exact else cfg.lora_dtype, base=cfg.base) for c in modes}
    best_mb, batches_by_mb = None, {}
    bf16_base: dict[str, Any] = {}  # QLoRA: the same runs over the bf16 base, by micro-batch
    for mb in micro_batches:
        host = make_batches(cfg, mb, warmup + steps, tokenizer, seed + mb)
        segments = max(b.cu_seqlens.numel() - 1 for b in host)
        flops, six, head_all = step_flops(cfg, args, host)
        plain = [to_device(b, device) for b in host]
        fixed = [to_device(fixed_shape(b, segments), device) for b in host]
        batches_by_mb[mb] = (plain, fixed, flops, six, head_all)
        by_mode = {}
        for c, v in variants.items():
            r = measure(lambda: build_atelier(cfg, args, sd, lora_sd, v, exact), fixed, cfg, warmup, steps, flops,
                        offload)
            if not r["oom"]:
                r["mfu_6n"] = mfu_of(six, r["step_s"], warmup)
                r["mfu_4n_head_all"] = mfu_of(head_all, r["step_s"], warmup)
            r["compile"] = c
            by_mode[c] = r
            print(f"atelier mb={mb} compile={c}: " + ("OOM" if r["oom"] else
                  f"{r['tokens_per_s']:,.0f} tok/s, {fmt(r['peak_gb'], '.1f')} GB"), flush=True)
        ok_modes = [r for r in by_mode.values() if not r["oom"]]
        sweep[str(mb)] = max(ok_modes, key=lambda r: r["tokens_per_s"]) if ok_modes else next(iter(by_mode.values()))
        if len(by_mode) > 1:
            report.setdefault("sweep_by_compile", {})[str(mb)] = {
                str(c): (None if r["oom"] else r["tokens_per_s"]) for c, r in by_mode.items()}
        if cfg.base == "nf4":  # the twin over the bf16 base, in the compile mode the QLoRA run kept
            twin = dataclasses.replace(variants[sweep[str(mb)]["compile"]], base="bf16")
            r = measure(lambda: build_atelier(cfg, args, sd, lora_sd, twin, exact), fixed, cfg, warmup, steps, flops,
                        offload)
            bf16_base[str(mb)] = r
            print(f"atelier bf16 base mb={mb}: " + ("OOM" if r["oom"] else
                  f"{r['tokens_per_s']:,.0f} tok/s, {fmt(r['peak_gb'], '.1f')} GB"), flush=True)
        for p in peers:
            if "skipped" in peer_runs[p]:
                continue
            try:
                seen: list[str] = []

                def build(p: str = p) -> Run:
                    run = build_peer(p, cfg, args, sd, lora_sd, exact)
                    seen.append(peer_kernels(run))
                    return run

                with peer_context(p, args):
                    peer_runs[p][str(mb)] = measure(build, plain, cfg, warmup, steps, flops, False)
                if not peer_runs[p][str(mb)]["oom"]:
                    peer_runs[p][str(mb)]["mfu_4n_head_all"] = mfu_of(head_all, peer_runs[p][str(mb)]["step_s"], warmup)
                peer_runs[p][str(mb)]["norm_class"] = seen[0] if seen else None
            except ImportError as e:
                peer_runs[p] = {"skipped": f"import failed: {e}"}
                notes[f"{p}_skipped"] = str(e)
                continue
            r = peer_runs[p][str(mb)]
            print(f"{p} mb={mb}: " + ("OOM" if r["oom"] else f"{r['tokens_per_s']:,.0f} tok/s"), flush=True)
        ok = {k: v for k, v in sweep.items() if not v["oom"]}
        if ok:
            best_mb = int(max(ok, key=lambda k: ok[k]["tokens_per_s"]))
    report["sweep"] = sweep
    # the headline variant: the compile mode of the best micro-batch's run (the ablation switches around it)
    main = variants[sweep[str(best_mb)]["compile"]] if best_mb is not None else next(iter(variants.values()))
    report["atelier_variant"] = dataclasses.asdict(main)
    mt = report["matmul_tflops"]
    if best_mb is not None:
        b = sweep[str(best_mb)]
        report["atelier"] = {"tokens_per_s": b["tokens_per_s"], "tokens_per_s_min": b["tokens_per_s_min"],
                             "tokens_per_s_max": b["tokens_per_s_max"], "mfu_4n": b["mfu_4n"], "mfu_6n": b["mfu_6n"],
                             "mfu_4n_head_all": b["mfu_4n_head_all"],
                             "mfu_matmul": b["tflops"] / mt if mt else None, "peak_gb": b["peak_gb"],
                             "micro_batch": best_mb}
    report["peers"], report["peer_runs"] = {}, peer_runs
    report["loss_mean_abs_diff_by_peer"] = {}
    for p, runs in peer_runs.items():
        if "skipped" in runs:
            report["peers"][p] = {"skipped": runs["skipped"]}
            continue
        ok = {k: v for k, v in runs.items() if not v["oom"]}
        if not ok:
            report["peers"][p] = {"oom": True, "micro_batches": list(runs)}
            continue
        k = max(ok, key=lambda k: ok[k]["tokens_per_s"])
        report["peers"][p] = {"tokens_per_s": ok[k]["tokens_per_s"], "mfu_4n": ok[k]["mfu_4n"],
                              "mfu_4n_head_all": ok[k]["mfu_4n_head_all"],
                              "mfu_matmul": ok[k]["tflops"] / mt if mt else None, "peak_gb": ok[k]["peak_gb"],
                              "micro_batch": int(k)}
        diff = diff_at_largest_shared(sweep, runs)
        if diff:
            report["loss_mean_abs_diff_by_peer"][p] = diff
    # The floor parity is measured against: two peers' implementations of the same model on the same batches
    # (e.g. transformers with and without fla-core) differ by bf16 rounding alone.
    report["loss_mean_abs_diff_between_peers"] = peer_floor(peer_runs)
    wanted = (QLORA_PEER,) if cfg.base == "nf4" else PARITY_PEER[main.lora_dtype] if cfg.lora else ("hf", "hf-liger")
    parity_peer = next((p for p in wanted if p in report["loss_mean_abs_diff_by_peer"]), wanted[0])
    parity = report["loss_mean_abs_diff_by_peer"].get(parity_peer)
    report["loss_mean_abs_diff"] = parity["diff"] if parity else None
    report["loss_parity_peer"] = parity_peer
    if cfg.base == "nf4":
        report["bf16_base"] = bf16_base
        report["qlora"] = qlora_summary(sweep, bf16_base, peer_runs.get(QLORA_PEER, {}))
    report["ablation"] = {}
    if ablation and best_mb is not None:
        plain, fixed, flops, _, _ = batches_by_mb[best_mb]
        report["ablation"]["all_on"] = sweep[str(best_mb)]["tokens_per_s"]
        for abl, v in ablation_switches(cfg, main, exact).items():
            r = measure(lambda: build_atelier(cfg, args, sd, lora_sd, v, exact), fixed, cfg, warmup, steps, flops,
                        offload)
            report["ablation"][abl] = None if r["oom"] else r["tokens_per_s"]
            report.setdefault("ablation_runs", {})[abl] = {k: r.get(k) for k in ("tokens_per_s", "peak_gb", "oom")}
            print(f"ablation {abl}: " + ("OOM" if r["oom"] else f"{r['tokens_per_s']:,.0f} tok/s"), flush=True)
            hf_run = peer_runs.get("hf", {}).get(str(best_mb))
            if abl == "fp32_lora" and not r["oom"] and hf_run and not hf_run.get("oom"):
                # fp32 adapters on both sides: the exact-precision parity (PEFT's default dtype)
                report["loss_mean_abs_diff_fp32_lora_vs_hf"] = loss_diff(r["timed_losses"], hf_run["timed_losses"])
    if profile and best_mb is not None and device.type == "cuda":
        _, fixed, _, _, _ = batches_by_mb[best_mb]
        stem = f"designer-{name}-{time.strftime('%Y-%m-%d')}-profile.txt"
        out.mkdir(parents=True, exist_ok=True)
        report["profile"] = str(profile_step(lambda: build_atelier(cfg, args, sd, lora_sd, main, exact), fixed, cfg,
                                             out / stem))
        gc.collect()
        torch.cuda.empty_cache()
    report["notes"] = notes
    report["clocks"]["after"] = clocks()
    return report


def qlora_summary(sweep: dict[str, Any], bf16_base: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """Per micro-batch: QLoRA's tokens/s and peak against the bf16-base twin's and the 4-bit peer's, the loss
    difference from the twin (the NF4 error, same batches), and the issue's targets (QLORA_TARGETS)."""
    rows = {}
    for mb, q in sweep.items():
        twin, other = bf16_base.get(mb, {"oom": True}), peer.get(mb, {"oom": True})

        def rate(r: dict[str, Any]) -> float | None:
            return None if r.get("oom", True) else r["tokens_per_s"]

        tq, tb, tp = rate(q), rate(twin), rate(other)
        rows[mb] = {"tokens_per_s": tq, "peak_gb": None if q["oom"] else q["peak_gb"],
                    "bf16_base_tokens_per_s": tb, "bf16_base_peak_gb": None if twin["oom"] else twin["peak_gb"],
                    "peer_tokens_per_s": tp, "peer_peak_gb": None if other.get("oom", True) else other["peak_gb"],
                    "vs_bf16_base": tq / tb if tq and tb else None, "vs_peer": tq / tp if tq and tp else None,
                    "loss_mean_abs_diff_vs_bf16_base": (loss_diff(q["timed_losses"], twin["timed_losses"])
                                                        if tq and tb else None)}
    def each_at_least(key: str) -> bool | None:  # None: nothing measured to compare with
        ratios = [r[key] for r in rows.values() if r[key] is not None]
        return all(x >= QLORA_TARGETS[key] for x in ratios) if ratios else None

    peak = rows.get("1", {}).get("peak_gb")
    met = {"peak_gb_at_mb1": None if peak is None else peak <= QLORA_TARGETS["peak_gb_at_mb1"],
           "vs_bf16_base": each_at_least("vs_bf16_base"), "vs_peer": each_at_least("vs_peer")}
    return {"by_micro_batch": rows, "targets": QLORA_TARGETS, "met": met}


# ------------------------------------------------------------------------------------------------ report

def markdown(report: dict[str, Any]) -> str:
    """The result table: Atelier and each peer at its best micro-batch, then the ablation."""
    c = report["config"]
    lines = [f"## designer {c['name']} — {report['gpu'].get('name') or 'cpu'}, "
             f"matmul {fmt(report['matmul_tflops'], '.0f')} TFLOP/s", "",
             "| run | micro-batch | tokens/s | MFU 4N (989) | MFU 4N, head on every token | MFU vs matmul | peak GB |",
             "|---|---|---|---|---|---|---|"]
    rows = [("atelier", report.get("atelier", {}))] + list(report["peers"].items())
    for name, r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | — | {'OOM' if r.get('oom') else r.get('skipped', 'no result')} | | | | |")
            continue
        lines.append(f"| {name} | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | {r['mfu_4n']:.1%} | "
                     f"{fmt(r.get('mfu_4n_head_all'), '.1%')} | {fmt(r.get('mfu_matmul'), '.1%')} | "
                     f"{fmt(r['peak_gb'], '.1f')} |")
    lines += ["", f"loss mean abs diff vs {report.get('loss_parity_peer', 'hf')} (same adapter dtype): "
                  f"{fmt(report['loss_mean_abs_diff'], '.2e')}"]
    for pair, d in report.get("loss_mean_abs_diff_between_peers", {}).items():
        lines.append(f"loss mean abs diff between peers, {pair} (the bf16 floor): {d['diff']:.2e}")
    if "loss_mean_abs_diff_fp32_lora_vs_hf" in report:
        lines.append(f"loss mean abs diff, fp32 adapters on both sides (Atelier vs hf): "
                     f"{report['loss_mean_abs_diff_fp32_lora_vs_hf']:.2e}")
    if "qlora" in report:
        q = report["qlora"]
        lines += ["", f"QLoRA (NF4 bases) against the same run over the bf16 base and {QLORA_PEER}, by micro-batch:", "",
                  "| micro-batch | QLoRA tok/s | peak GB | bf16 base tok/s | peak GB | ratio | "
                  f"{QLORA_PEER} tok/s | peak GB | ratio | mean abs Δloss vs bf16 base |", "|---|---|---|---|---|---|---|---|---|---|"]
        for mb, r in q["by_micro_batch"].items():
            lines.append(f"| {mb} | {fmt(r['tokens_per_s'], ',.0f')} | {fmt(r['peak_gb'], '.1f')} | "
                         f"{fmt(r['bf16_base_tokens_per_s'], ',.0f')} | {fmt(r['bf16_base_peak_gb'], '.1f')} | "
                         f"{fmt(r['vs_bf16_base'], '.2f')} | {fmt(r['peer_tokens_per_s'], ',.0f')} | "
                         f"{fmt(r['peer_peak_gb'], '.1f')} | {fmt(r['vs_peer'], '.2f')} | "
                         f"{fmt(r['loss_mean_abs_diff_vs_bf16_base'], '.2e')} |")
        t = q["targets"]
        lines.append(f"targets: peak <= {t['peak_gb_at_mb1']:g} GB at micro-batch 1: {q['met']['peak_gb_at_mb1']}; "
                     f">= {t['vs_bf16_base']:g}x the bf16 base: {q['met']['vs_bf16_base']}; >= {t['vs_peer']:g}x "
                     f"{QLORA_PEER}: {q['met']['vs_peer']}")
    if report["ablation"]:
        lines += ["", "| ablation (one switched off) | tokens/s |", "|---|---|"]
        lines += [f"| {k} | {fmt(v, ',.0f') if v is not None else 'OOM'} |" for k, v in report["ablation"].items()]
    return "\n".join(lines) + "\n"


def ablation_chart(report: dict[str, Any], path: Path) -> Path | None:
    """Bar chart of tokens/s with each optimisation off; None when matplotlib is absent."""
    return bar_chart(report["ablation"].items(), "tokens/s",
                     f"designer {report['config']['name']}: each optimisation switched off", path)


def write(report: dict[str, Any], out: Path) -> Path:
    return write_report(report, out, f"designer-{report['config']['name']}", markdown(report),
                        lambda path: ablation_chart(report, path))


def parser() -> argparse.ArgumentParser:
    """The bench's command line (bench/recount.py reads a report's command back through it)."""
    p = argparse.ArgumentParser(prog="python3 -m bench.designer", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, choices=sorted(CONFIGS))
    p.add_argument("--out", default="bench/results")
    p.add_argument("--peers", default=None, help="comma-separated; default: the bf16 peers, or hf-bnb for QLoRA")
    p.add_argument("--micro-batches", type=parse_ints, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ablation", action="store_true")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (shapes-world docs); default: random-token docs")
    p.add_argument("--lora-dtype", choices=("bfloat16", "float32", "mixed"), default="bfloat16",
                   help="Atelier's LoRA weights: bfloat16, float32 (PEFT's default), or mixed (fp32 weights, bf16 compute)")
    p.add_argument("--offload", action="store_true", help="CPU activation offload for Atelier (long sequences)")
    p.add_argument("--compile", choices=("on", "off", "both"), default="both",
                   help="per-block torch.compile for Atelier; both: each micro-batch both ways, the faster kept")
    p.add_argument("--profile", action="store_true", help="write a torch.profiler kernel table of Atelier's best run")
    p.add_argument("--tiny", action="store_true", help="tiny model, fp32, CPU: the same code path for tests")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    cfg = CONFIGS[a.config]
    default = (QLORA_PEER,) if cfg.base == "nf4" else tuple(x for x in PEERS if x != QLORA_PEER)
    peers = [x for x in a.peers.split(",") if x] if a.peers is not None else list(default)
    bad = [x for x in peers if x not in PEERS]
    if bad:
        p.error(f"--peers: unknown {bad}; known: {list(PEERS)}")
    if a.steps < 1 or a.warmup < (0 if a.tiny else 3):
        p.error(f"--steps must be >= 1 and --warmup >= 3 (got {a.steps}, {a.warmup})")
    device = torch.device("cpu") if a.tiny or not torch.cuda.is_available() else torch.device("cuda")
    if a.tiny:
        cfg = tiny_config(cfg)
    elif device.type != "cuda":
        p.error("a real-size run needs a CUDA GPU; use --tiny on a CPU")
    mbs = a.micro_batches or list(cfg.micro_batches)
    cfg = dataclasses.replace(cfg, offload=cfg.offload or a.offload, lora_dtype=a.lora_dtype)
    report = bench(a.config, cfg, Path(a.out), peers, mbs, a.steps, a.warmup, a.ablation, a.tokenizer, device,
                   exact=a.tiny, compile_modes={"on": (True,), "off": (False,), "both": (True, False)}[a.compile],
                   profile=a.profile)
    path = write(report, Path(a.out))
    print(markdown(report))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
