"""LoRA for the MMDiT families (Hu et al. 2021, arXiv:2106.09685), saved as the file the diffusers pipelines'
`load_lora_weights` read (`StableDiffusion3Pipeline`'s, `FluxPipeline`'s: the same layout).

The layers are the ones both trainers share (pipeline/lora.py LoRALinear over kernels/lora_linear.py): a frozen
base linear, A [r, I] kaiming-uniform and B [O, r] zeros (a fresh adapter is the identity), y = base(x) + s · B A
dropout(x), s = alpha / r (alpha / √r with rslora); no weight gradient for the base, the adapters in `lora.dtype`
and, under bf16 autocast, computed in bf16. The MMDiT's target names are resolved against its family's
`lora_targets` (imagegen/family.py) into the module paths inside a block that `target_modules` wraps.

Targets are module paths inside a block, diffusers' names (attn.to_q … attn.to_add_out, attn2.* in SD3.5's
dual-attention blocks, ff.net.0.proj, ff.net.2, ff_context.*; FLUX's single-stream blocks add proj_mlp and
proj_out, and have only attn.to_q/k/v of the attention's). A block gets the ones it has: the last block has no
text output (no attn.to_add_out, no ff_context), and its attn.add_q_proj is never applied (imagegen/model.py
Attention), so it gets no adapter.

The file: <dir>/pytorch_lora_weights.safetensors with keys `transformer.<module>.lora_{A,B}.weight` (diffusers'
`save_lora_weights` layout, PEFT's key names) and, in the safetensors metadata under `lora_adapter_metadata`, the
LoraConfig fields prefixed `transformer.`: r, lora_alpha, lora_dropout, use_rslora and target_modules (the full
names of the wrapped modules, so PEFT wraps exactly those). diffusers reads alpha from there; a file without that
metadata (one diffusers' scripts wrote before they saved it) is read as diffusers reads it: alpha = r.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from atelier_studio.imagegen.registry import family_of_args
from atelier_studio.pipeline.atomic import atomic_dir, save_safetensors
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.lora import LoraArgs, LoRALinear, lora_layers

LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
PREFIX = "transformer."  # the pipeline component the adapter belongs to


def lora_impl(kernels: str) -> str:
    """The LoRA linear's kernel choice (kernels/lora_linear.py) for MMDiTArgs.kernels."""
    return {"triton": "fused"}.get(kernels, kernels)


def target_modules(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Full names of the linears `targets` (block paths, already resolved by the family) wrap, block by block, in
    module order. A block's `unused_linears` (the MMDiT's last text-query projection, never applied) are left out."""
    family = family_of_args(model.args)
    names = {m: n for n, m in model.named_modules()}
    out = []
    for block in family.blocks(model):
        unused = getattr(block, "unused_linears", ())
        for path in targets:
            if path in unused:
                continue
            try:
                module = block.get_submodule(path)
            except AttributeError:  # a block without it: no attn2 outside dual attention, no ff_context at the end
                continue
            if not isinstance(module, nn.Linear):
                raise TypeError(f"LoRA target {path} of {type(block).__name__} is a {type(module).__name__}, "
                                f"not a linear")
            out.append(f"{names[block]}.{path}")
    if not out:
        raise ValueError(f"LoRA targets {list(targets)} name no linear of this {type(model).__name__}")
    return out


def apply_lora(model: nn.Module, args: LoraArgs, modules: list[str]) -> nn.Module:
    """Freeze every parameter of `model` and wrap the linears named `modules` (full names) in LoRALinear, in place."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("apply_lora: the model already has LoRA layers")
    model.requires_grad_(False)
    impl = lora_impl(model.args.kernels)
    for name in modules:
        parent, leaf = name.rsplit(".", 1)
        owner = model.get_submodule(parent)
        setattr(owner, leaf, LoRALinear(getattr(owner, leaf), args, impl))
    return model


def lora_state_dict(model: nn.Module, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """diffusers' key names: transformer.<module>.lora_{A,B}.weight. `weights` (parameter name -> tensor, e.g. the
    EMA average) replaces the model's own adapter values."""
    weights = weights or {}
    out = {}
    for name, m in lora_layers(model).items():
        for part, p in (("lora_A", m.lora_A.weight), ("lora_B", m.lora_B.weight)):
            key = f"{name}.{part}.weight"
            out[PREFIX + key] = weights.get(key, p)
    return out


def lora_metadata(model: nn.Module, args: LoraArgs) -> dict:
    """The LoraConfig fields diffusers builds the adapter from, prefixed with the component name."""
    config = {"r": args.rank, "lora_alpha": args.alpha, "lora_dropout": args.dropout, "use_rslora": args.rslora,
              "target_modules": list(lora_layers(model)), "bias": "none"}
    return {PREFIX + k: v for k, v in config.items()}


def save_lora(model: nn.Module, args: LoraArgs, out_dir: str | os.PathLike,
              weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write <out_dir>/pytorch_lora_weights.safetensors (module docstring) atomically; `weights` as lora_state_dict."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in lora_state_dict(model, weights).items()}
    if not tensors:
        raise ValueError("save_lora: the model has no LoRA layers (apply_lora first)")
    out = Path(out_dir)
    with atomic_dir(out, what="LoRA directory") as tmp:
        save_safetensors(tensors, tmp / LORA_FILE,
                         metadata={"format": "pt",
                                   METADATA_KEY: json.dumps(lora_metadata(model, args), sort_keys=True)})
    return out


def lora_file(path: str | os.PathLike) -> Path:
    """The LoRA file of `path`: the file itself, or pytorch_lora_weights.safetensors in the directory."""
    p = Path(path)
    f = p / LORA_FILE if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{p}: no {LORA_FILE} (a LoRA written by `atelier imagegen train` or diffusers' "
                                f"save_lora_weights)")
    return f


def read_lora(path: str | os.PathLike) -> tuple[LoraArgs, dict[str, torch.Tensor]]:
    """(the adapter's args, {full module name: (A, B)} flattened to {"<module>.lora_A.weight": A, ...}) of a diffusers
    SD3 LoRA file. What the layers cannot be (text-encoder adapters, DoRA, per-module ranks, LoRA biases, other key
    layouts) is a ModelLoadError naming the file and the key."""
    from safetensors import safe_open

    f = lora_file(path)
    with safe_open(str(f), framework="pt", device="cpu") as sf:
        raw_meta = (sf.metadata() or {}).get(METADATA_KEY)
        tensors = {k: sf.get_tensor(k) for k in sf.keys()}
    bad = [k for k in tensors if not (k.startswith(PREFIX) and (k.endswith(".lora_A.weight") or
                                                                 k.endswith(".lora_B.weight")))]
    if bad:
        raise ModelLoadError(f"{f}: key {bad[0]!r} is not a transformer LoRA weight (transformer.<module>.lora_A/B."
                             f"weight; adapters of the text encoders, DoRA and LoRA biases are not supported)")
    if not tensors:
        raise ModelLoadError(f"{f}: holds no LoRA weights")
    weights = {k[len(PREFIX):]: v for k, v in tensors.items()}
    ranks = {v.shape[0] for k, v in weights.items() if k.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise ModelLoadError(f"{f}: the adapters have several ranks {sorted(ranks)}; one rank is supported")
    rank = ranks.pop()
    meta = {}
    if raw_meta:
        try:
            meta = {k[len(PREFIX):]: v for k, v in json.loads(raw_meta).items() if k.startswith(PREFIX)}
        except (json.JSONDecodeError, AttributeError) as e:
            raise ModelLoadError(f"{f}: its {METADATA_KEY} metadata is not a JSON object ({e})") from None
    for key in ("rank_pattern", "alpha_pattern", "use_dora", "lora_bias", "layers_to_transform"):
        if meta.get(key):
            raise ModelLoadError(f"{f}: {METADATA_KEY} {PREFIX}{key} = {meta[key]!r} is not supported")
    if meta.get("r", rank) != rank:
        raise ModelLoadError(f"{f}: {METADATA_KEY} says r = {meta['r']}, its lora_A weights have rank {rank}")
    # bf16 adapters stay bf16; fp32 and fp16 ones load as fp32 (exact for both)
    dtype = "bfloat16" if next(iter(weights.values())).dtype == torch.bfloat16 else "float32"
    try:
        args = LoraArgs(rank=rank, alpha=float(meta.get("lora_alpha", rank)),
                        dropout=float(meta.get("lora_dropout", 0.0)), rslora=bool(meta.get("use_rslora", False)),
                        dtype=dtype)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{f}: {e}") from None
    return args, weights


def load_lora(model: nn.Module, path: str | os.PathLike, dtype: str | None = None) -> LoraArgs:
    """Wrap the modules a diffusers SD3 LoRA file names and load its weights; returns its args. Every key and shape is
    checked against the model (a LoRA of another model size names the first key that does not fit). `dtype`: the
    adapters' dtype (default: the file's). On a meta-device model only the layers are made (nothing to copy into)."""
    f = lora_file(path)
    args, weights = read_lora(f)
    if dtype is not None:
        args = dataclasses.replace(args, dtype=dtype)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in weights}, key=lambda n: (order.get(n, len(order)), n))
    family = family_of_args(model.args)
    blocks = {id(m) for m in family.blocks(model)}
    block_names = [n for n, m in model.named_modules() if id(m) in blocks]
    for name in modules:
        if not any(name.startswith(b + ".") and name[len(b) + 1:] in family.lora_targets for b in block_names):
            raise ModelLoadError(f"{f}: {name} is not a linear a LoRA of this {family.name} may wrap (a block's "
                                 f"{', '.join(family.lora_targets)})")
    try:
        apply_lora(model, args, modules)
    except AttributeError as e:  # e.g. attn2 of a block without dual attention: a LoRA of another model
        raise ModelLoadError(f"{f}: names a module this model does not have ({e})") from None
    layers = lora_layers(model)
    with torch.no_grad():
        for name, m in layers.items():
            for part, p in (("lora_A", m.lora_A.weight), ("lora_B", m.lora_B.weight)):
                key = f"{name}.{part}.weight"
                if key not in weights:
                    raise ModelLoadError(f"{f}: {PREFIX}{key} is missing (its {'B' if part == 'lora_A' else 'A'} is "
                                         f"there)")
                if tuple(weights[key].shape) != tuple(p.shape):
                    raise ModelLoadError(f"{f}: {PREFIX}{key} has shape {tuple(weights[key].shape)}, this model "
                                         f"expects {tuple(p.shape)} (a LoRA of another model size?)")
                if not p.is_meta:
                    p.copy_(weights[key])
    return args


__all__ = ["LORA_FILE", "apply_lora", "target_modules", "lora_layers", "lora_state_dict", "save_lora", "read_lora",
           "load_lora", "lora_file", "lora_impl"]
