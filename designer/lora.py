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

Grouped weights (Qwen3-MoE's experts: W [G, O, I], one [O, I] matrix per expert, stacked) take one adapter per
group, GroupedLoRA: A [G, r, I], B [G, O, r]. The module holding such a weight names it by a leaf through
`grouped_lora_weight(leaf)` (a [G, O, I] view; None for a leaf it does not hold), and keeps its adapters in a
ModuleDict `lora_adapters` by leaf. They are saved as PEFT saves a per-expert Linear's adapter, one pair per group:
`base_model.model.<module>.<g>.<leaf>.lora_{A,B}.weight` (the released checkpoints' per-expert key layout), which
PEFT loads both on transformers 4's per-expert modules and, converted on load, on transformers 5's stacked
experts. Dropout is not supported there (PEFT's own adapter on a stacked weight refuses it too).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from atelier_studio.data.textfile import read_json
from atelier_studio.designer.decoder import CausalLM
from atelier_studio.designer.family import Family
from atelier_studio.designer.registry import family_of_args, lora_target_names
from atelier_studio.pipeline import lora as layers
from atelier_studio.pipeline.atomic import atomic_dir, save_safetensors
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.hf_files import read_safetensors_header
from atelier_studio.pipeline.lora import LoRALinear, lora_init_like  # noqa: F401 (re-exported)

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


class GroupedLoRA(nn.Module):
    """One adapter per group of a grouped weight W [G, O, I]: group g adds s · (x A[g]ᵀ) B[g]ᵀ.

    lora_A [G, r, I] is kaiming-uniform(a=√5) per group (bound 1/√I, PEFT's init of each expert's A) and lora_B
    [G, O, r] zeros, in the adapter dtype. The computation is the host's (kernels/moe.py experts_ffn).
    """

    def __init__(self, groups: int, out_features: int, in_features: int, leaf: str, args: LoraArgs,
                 device: torch.device) -> None:
        super().__init__()
        if args.dropout > 0:
            raise ValueError(f"LoRA dropout {args.dropout} is not supported on grouped weights ({leaf}: one adapter "
                             f"per expert); set lora.dropout = 0")
        dtype = layers.DTYPES[args.dtype]
        self.leaf, self.scale, self.rank = leaf, args.scale, args.rank
        self.lora_A = nn.Parameter(torch.empty(groups, args.rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(groups, out_features, args.rank, device=device, dtype=dtype))
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform(a=√5) on each [r, I]: gain·√(3/fan_in) = 1/√fan_in
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound)

    @classmethod
    def of(cls, weight: torch.Tensor, leaf: str, args: LoraArgs) -> GroupedLoRA:
        """The adapters of grouped weight `weight` [G, O, I], on its device."""
        g, o, i = weight.shape
        return cls(g, o, i, leaf, args, weight.device)

    def delta(self) -> torch.Tensor:
        """s · B[g] A[g] for every group, [G, O, I] in fp32."""
        return torch.bmm(self.lora_B.float(), self.lora_A.float()) * self.scale

    def train_flops(self, slots: int) -> int:
        """Training FLOPs of the adapters on `slots` routed rows: x Aᵀ and (x Aᵀ) Bᵀ, forward, input- and weight-grad
        (the weight gradient only when the adapter trains)."""
        _, r, i = self.lora_A.shape
        per = 2 * slots * (i * r + r * self.lora_B.shape[1])
        return per * (3 if self.lora_A.requires_grad else 2)


def grouped_weight(parent: nn.Module, leaf: str) -> torch.Tensor | None:
    """The grouped weight [G, O, I] that module `parent` names `leaf`, or None (not a grouped-weight host)."""
    lookup = getattr(parent, "grouped_lora_weight", None)
    return lookup(leaf) if lookup is not None else None


def grouped_lora_names(target: str) -> tuple[str, str]:
    """State-dict names of the (A, B) adapters of grouped target `<module>.<leaf>`."""
    module, leaf = target.rsplit(".", 1)
    return f"{module}.lora_adapters.{leaf}.lora_A", f"{module}.lora_adapters.{leaf}.lora_B"


def lora_targets(model: Model, args: LoraArgs) -> list[tuple[str, nn.Module, str]]:
    """(full module name, parent, attribute) of every target linear or grouped weight the model's blocks have."""
    family = family_of_args(model.args)
    targets = family.resolve_lora_targets(args.targets)
    names = {m: n for n, m in model.named_modules()}
    out = []
    for block in family.blocks(model):
        for t in targets:
            parent_path, leaf = family.lora_targets[t].rsplit(".", 1)
            try:
                parent = block.get_submodule(parent_path)
            except AttributeError:  # a block without this mixer (a Qwen3.5 block has self_attn or linear_attn; a
                continue  # Qwen3-MoE dense layer has no experts)
            out.append((f"{names[block]}.{family.lora_targets[t]}", parent, leaf))
    if not out:
        raise ValueError(f"LoRA targets {list(targets)} name no linear of this {type(model).__name__}")
    return out


def peft_target_modules(model: nn.Module) -> list[str]:
    """PEFT's target_modules of a model with LoRA applied: the leaf names actually wrapped, in module order."""
    leaves = [name.rsplit(".", 1)[1] if isinstance(m, LoRALinear) else m.leaf for name, m in model.named_modules()
              if isinstance(m, (LoRALinear, GroupedLoRA))]
    return list(dict.fromkeys(leaves))


def apply_lora(model: Model, args: LoraArgs) -> Model:
    """Freeze every base parameter and wrap the target linears in LoRALinear, in place."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("apply_lora: the model already has LoRA layers")
    model.requires_grad_(False)
    impl = {"triton": "fused"}.get(model.args.kernels, model.args.kernels)  # DecoderArgs.kernels → lora_linear's name
    for _, parent, leaf in lora_targets(model, args):
        grouped = grouped_weight(parent, leaf)
        if grouped is None:
            setattr(parent, leaf, LoRALinear(getattr(parent, leaf), args, impl))
            continue
        if "lora_adapters" not in parent._modules:
            parent.lora_adapters = nn.ModuleDict()
        parent.lora_adapters[leaf] = GroupedLoRA.of(grouped, leaf, args)
    return model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The frozen base alone inside the block: every adapter's scale is 0 (LoRALinear, its FP8 and NF4 forms,
    GroupedLoRA), so each layer computes base(x) + 0 = base(x) exactly (PEFT's disable_adapter; DPO's reference
    model without a second copy in memory). Put the model in eval mode too, or LoRA dropout still draws."""
    scaled = [(m, m.scale) for m in model.modules() if isinstance(m, (LoRALinear, GroupedLoRA))]
    try:
        for m, _ in scaled:
            m.scale = 0.0
        yield
    finally:
        for m, scale in scaled:
            m.scale = scale


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter weights (lora_A, lora_B of every LoRALinear and GroupedLoRA), in module order."""
    return [p for m in model.modules() if isinstance(m, (LoRALinear, GroupedLoRA))
            for p in ((m.lora_A.weight, m.lora_B.weight) if isinstance(m, LoRALinear) else (m.lora_A, m.lora_B))]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors: base_model.model.<module>.lora_{A,B}.weight; a grouped weight's adapters one
    pair per group, base_model.model.<module>.<g>.<leaf>.lora_{A,B}.weight (views of the stacked parameters)."""
    named = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            named[f"{name}.lora_A.weight"], named[f"{name}.lora_B.weight"] = m.lora_A.weight, m.lora_B.weight
        elif isinstance(m, GroupedLoRA):
            named[f"{name}.lora_A"], named[f"{name}.lora_B"] = m.lora_A, m.lora_B
    return peft_tensors(named)


def peft_tensors(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors by their state-dict names (a LoRALinear's `<module>.lora_A.weight`, a GroupedLoRA's
    `<module>.lora_adapters.<leaf>.lora_A` [G, ...]) → PEFT's keys, a grouped one split into its groups (views)."""
    out = {}
    for name, t in named.items():
        if ".lora_adapters." not in name:
            out[f"{PEFT_PREFIX}{name}"] = t
            continue
        host, rest = name.split(".lora_adapters.")
        leaf, ab = rest.split(".")
        for g in range(t.shape[0]):
            out[f"{PEFT_PREFIX}{host}.{g}.{leaf}.{ab}.weight"] = t[g]
    return out


def lora_tensors_of_adapter(model: nn.Module, file: Path) -> dict[str, torch.Tensor]:
    """A PEFT adapter file's weights by the state-dict names of `model`'s adapters (LoRA applied; load_peft_adapter
    has checked the keys and shapes): a grouped adapter's per-group tensors stacked."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name, m in model.named_modules():
            if isinstance(m, LoRALinear):
                for ab in ("lora_A", "lora_B"):
                    out[f"{name}.{ab}.weight"] = f.get_tensor(f"{PEFT_PREFIX}{name}.{ab}.weight")
            elif isinstance(m, GroupedLoRA):
                host = name.rsplit(".", 2)[0]
                for ab in ("lora_A", "lora_B"):
                    out[f"{name}.{ab}"] = torch.stack([f.get_tensor(f"{PEFT_PREFIX}{host}.{g}.{m.leaf}.{ab}.weight")
                                                       for g in range(m.lora_A.shape[0])])
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
    for key in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern", "target_parameters"):
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
    existing = [m for m in model.modules() if isinstance(m, (LoRALinear, GroupedLoRA))]
    if existing:
        if existing[0].rank != args.rank:
            raise ModelLoadError(f"{cfg_path}: adapter rank r={args.rank} but the model's LoRA layers have rank "
                                 f"{existing[0].rank}")
    else:
        a_keys = [k for k in header if k.endswith("lora_A.weight")]
        if a_keys:
            args = LoraArgs(**{**args.__dict__,
                               "dtype": "bfloat16" if header[a_keys[0]]["dtype"] == "BF16" else "float32"})
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
    """Fold every LoRALinear into a plain nn.Linear (W + s·B·A) and every GroupedLoRA into its grouped weight
    (W[g] + s·B[g]·A[g]), in place; the result saves as a full HF model."""
    for name, m in list(model.named_modules()):
        if isinstance(m, LoRALinear):
            parent_name, leaf = name.rsplit(".", 1)
            setattr(model.get_submodule(parent_name), leaf, m.merged_linear())
        elif isinstance(m, GroupedLoRA):
            host = model.get_submodule(name.rsplit(".", 2)[0])
            w = host.grouped_lora_weight(m.leaf)  # a view of the stacked parameter
            with torch.no_grad():
                w.copy_((w.float() + m.delta()).to(w.dtype))
    for m in list(model.modules()):
        if "lora_adapters" in m._modules:
            del m.lora_adapters
    return model
