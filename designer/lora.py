"""LoRA for the designer (Hu et al. 2021, arXiv:2106.09685), in PEFT's layout and key names.

The layer, LoRALinear, is the one both trainers share (pipeline/lora.py: y = base(x) + B A dropout(x) · s over a
frozen base, A kaiming-uniform and B zeros as PEFT's default); this module puts it on a designer family's linears
and reads and writes PEFT adapters.

Adapters are saved as PEFT does (adapter_config.json + adapter_model.safetensors, keys
`base_model.model.<module>.lora_{A,B}.weight`), with exactly the target modules and no
`modules_to_save`, so PEFT and vLLM load them.

Targets are short names for the linears of a family, from its Family record (designer/family.py,
`lora_targets`: name → module path inside a block; Qwen3: q k v o gate up down; Qwen3.5 adds its Gated DeltaNet
projections qkv z b a out). A block gets the targets it has: Qwen3.5's full-attention blocks have self_attn,
its Gated DeltaNet blocks linear_attn, every block mlp. No targets (the default) means the family's default,
every linear ("all linear"); a target set that wraps nothing raises.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from atelier_studio.data.textfile import read_json
from atelier_studio.designer.family import Family
from atelier_studio.designer.hf import read_safetensors_header
from atelier_studio.designer.model import CausalLM
from atelier_studio.designer.registry import family_of_args, lora_target_names
from atelier_studio.pipeline import lora as layers
from atelier_studio.pipeline.atomic import atomic_dir, save_safetensors
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.lora import LoRALinear, SharedInputOperands, lora_init_like  # noqa: F401 (re-exported)

Model = CausalLM
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraArgs(layers.LoraArgs):
    """pipeline.lora.LoraArgs whose targets are checked against the designer's families: a name no family has is a
    typo (each family checks its own at apply time)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        known = lora_target_names()
        bad = [t for t in self.targets if t not in known]
        if bad:
            raise ValueError(f"LoraArgs.targets {bad} are no registered family's linears; known: {', '.join(known)}")


def lora_targets(model: Model, args: LoraArgs) -> list[tuple[str, nn.Module, str]]:
    """(full module name, parent, attribute) of every target linear the model's blocks have."""
    family = family_of_args(model.args)
    targets = family.resolve_lora_targets(args.targets)
    names = {m: n for n, m in model.named_modules()}
    out = []
    for block in family.blocks(model):
        for t in targets:
            parent_path, leaf = family.lora_targets[t].rsplit(".", 1)
            try:
                parent = block.get_submodule(parent_path)
            except AttributeError:  # a block without this mixer (a Qwen3.5 block has self_attn or linear_attn)
                continue
            out.append((f"{names[block]}.{family.lora_targets[t]}", parent, leaf))
    if not out:
        raise ValueError(f"LoRA targets {list(targets)} name no linear of this {type(model).__name__}")
    return out


def peft_target_modules(model: nn.Module) -> list[str]:
    """PEFT's target_modules of a model with LoRA applied: the leaf names actually wrapped, in module order."""
    leaves = [name.rsplit(".", 1)[1] for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    return list(dict.fromkeys(leaves))


def apply_lora(model: Model, args: LoraArgs) -> Model:
    """Freeze every base parameter and wrap the target linears in LoRALinear, in place."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("apply_lora: the model already has LoRA layers")
    model.requires_grad_(False)
    impl = {"triton": "fused"}.get(model.args.kernels, model.args.kernels)  # ModelArgs.kernels → lora_linear's name
    for _, parent, leaf in lora_targets(model, args):
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), args, impl))
    return model


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter weights (lora_A, lora_B of every LoRALinear), in module order."""
    return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A.weight, m.lora_B.weight)]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors: base_model.model.<module>.lora_{A,B}.weight."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight
    return out


def save_peft_adapter(model: Model, args: LoraArgs, out_dir: str | os.PathLike, base_model_path: str) -> Path:
    """Write adapter_config.json + adapter_model.safetensors (PEFT format) atomically."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in lora_state_dict(model).items()}
    if not tensors:
        raise ValueError("save_peft_adapter: the model has no LoRA layers (apply_lora first)")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args.rank, "lora_alpha": args.alpha,
        "lora_dropout": args.dropout, "target_modules": peft_target_modules(model), "use_rslora": args.rslora,
        "bias": "none", "base_model_name_or_path": base_model_path, "modules_to_save": None,
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "use_dora": False,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }
    out = Path(out_dir)
    with atomic_dir(out, what="adapter directory") as tmp:
        save_safetensors(tensors, tmp / ADAPTER_FILE, metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def lora_args_from_peft_config(cfg: dict, source: str, family: Family) -> LoraArgs:
    """LoraArgs from a PEFT adapter_config.json dict for a model of `family`; unsupported PEFT features raise,
    naming the key."""
    if cfg.get("peft_type") != "LORA":
        raise ModelLoadError(f"{source}: peft_type must be 'LORA', got {cfg.get('peft_type')!r}")
    for key in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ModelLoadError(f"{source}: {key}={cfg[key]!r} is not supported")
    if cfg.get("use_dora") or cfg.get("bias", "none") != "none":
        raise ModelLoadError(f"{source}: only plain LoRA with bias='none' is supported")
    modules = cfg.get("target_modules")
    if not isinstance(modules, list):
        raise ModelLoadError(f"{source}: target_modules must be a list of module names, got {modules!r}")
    by_leaf = {path.rsplit(".", 1)[-1]: t for t, path in family.lora_targets.items()}
    unknown = [m for m in modules if m not in by_leaf]
    if unknown:
        raise ModelLoadError(f"{source}: target_modules {unknown} are not {family.name} linears {list(by_leaf)}")
    order = [t for t in family.lora_targets if t in {by_leaf[m] for m in modules}]
    try:
        return LoraArgs(rank=cfg["r"], alpha=float(cfg["lora_alpha"]), dropout=float(cfg.get("lora_dropout", 0.0)),
                        targets=tuple(order), rslora=bool(cfg.get("use_rslora", False)))
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{source}: {e}") from None


def load_peft_adapter(model: Model, adapter_dir: str | os.PathLike) -> LoraArgs:
    """Apply LoRA (unless already applied) and load a PEFT adapter's weights; returns its LoraArgs."""
    d = Path(adapter_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"load_peft_adapter: adapter directory {d} does not exist")
    cfg_path = d / "adapter_config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: not found")
    cfg = read_json(cfg_path, ModelLoadError)
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    args = lora_args_from_peft_config(cfg, str(cfg_path), family_of_args(model.args))
    file = d / ADAPTER_FILE
    header = read_safetensors_header(file)
    existing = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if existing:
        if existing[0].rank != args.rank:
            raise ModelLoadError(f"{cfg_path}: adapter rank r={args.rank} but the model's LoRA layers have rank "
                                 f"{existing[0].rank}")
    else:
        a_keys = [k for k in header if k.endswith("lora_A.weight")]
        if a_keys:
            args = LoraArgs(**{**args.__dict__, "dtype": "bfloat16" if header[a_keys[0]]["dtype"] == "BF16" else "float32"})
        apply_lora(model, args)
    params = lora_state_dict(model)
    missing = sorted(set(params) - set(header))
    unexpected = sorted(set(header) - set(params))
    if missing or unexpected:
        raise ModelLoadError(f"{file}: missing keys {missing[:4]}{'...' if len(missing) > 4 else ''}, unexpected keys "
                         f"{unexpected[:4]}{'...' if len(unexpected) > 4 else ''}")
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", device="cpu") as f, torch.no_grad():
        for k, p in params.items():
            if tuple(header[k]["shape"]) != tuple(p.shape):
                raise ModelLoadError(f"{file}: {k} has shape {tuple(header[k]['shape'])}, the model expects "
                                     f"{tuple(p.shape)} (rank or model size mismatch)")
            p.copy_(f.get_tensor(k))
    return args


def merge_lora(model: Model) -> Model:
    """Fold every LoRALinear into a plain nn.Linear (W + s·B·A), in place; the result saves as a full HF model."""
    for name, m in list(model.named_modules()):
        if isinstance(m, LoRALinear):
            parent_name, leaf = name.rsplit(".", 1)
            base = m.base_layer
            with torch.no_grad():
                base.weight.copy_(m.merged_weight())
            setattr(model.get_submodule(parent_name), leaf, base)
    return model
