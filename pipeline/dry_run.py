"""`atelier designer train --dry-run` / `imagegen train --dry-run`: what a config will do, before anything loads.

Each trainer builds its model from the model's config alone, on the meta device (no weights are read, no memory is
taken), and fills a `Plan`; this module prints it with the resolved config:

    every config key, its value and where it came from (default, the TOML file, --set)
    parameters total / trainable, tokens or images per optimizer step, model FLOPs per step (the model's own
    train_flops, as MFU counts them), the dataset's size (the designer's after packing), and an estimate of the peak
    GPU memory of one process:

    weights      every parameter in its stored dtype (bf16 base, fp32 master weights or adapters, NF4 bases)
    gradients    fp32, one per trainable parameter
    optimizer    AdamW's two fp32 moments per trainable parameter
    activations  saved for backward over one micro-batch, by train.distributed.activation_checkpointing:
                 "none"       every linear's input and output in each block (the norms', SwiGLU's and attention's
                              saved tensors are of those sizes), per token and block;
                 "selective"  the linears' outputs and the block input (norms, RoPE, SwiGLU recomputed);
                 "full"       the block input per block, plus one block's "none" while it is recomputed.
                 Counted from the model's own linears (the first block's), at the compute dtype's width.

The memory figure is an estimate (no allocator overhead, workspace or fragmentation, the LM head's chunked logits
left out); docs/training.md says how it compares with measured peaks.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from atelier_studio.pipeline.config import config_to_dict, flatten


@dataclass(frozen=True)
class Plan:
    """What one optimizer step of a run costs, from the model's config alone."""

    params_total: int
    params_trainable: int
    unit: str  # "tokens" or "images"
    units_per_step: int
    flops_per_step: int
    memory: dict[str, int]  # bytes: weights, gradients, optimizer, activations
    dataset: str  # its size, in words
    notes: tuple[str, ...] = field(default_factory=tuple)


def config_sources(cfg: Any, path: str | Path | None, overrides: Sequence[str]) -> dict[str, tuple[Any, str]]:
    """Every key of the resolved config -> (its value, where it came from: "--set", the TOML file, or "default")."""
    in_file: set[str] = set()
    if path is not None:
        in_file = set(flatten(tomllib.loads(Path(path).read_text(encoding="utf-8"))))
    set_keys = {item.split("=", 1)[0].strip() for item in overrides}
    out = {}
    for key, value in flatten(config_to_dict(cfg)).items():
        source = "--set" if key in set_keys else (str(path) if key in in_file else "default")
        out[key] = (value, source)
    return out


def activation_bytes(block: nn.Module, num_blocks: int, dim: int, tokens: int, act_bytes: int, policy: str) -> int:
    """Saved activations of one micro-batch of `tokens` tokens through `num_blocks` blocks like `block` (module
    docstring)."""
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    ins = sum(m.in_features for m in linears)
    outs = sum(m.out_features for m in linears)
    per_block = {"none": ins + outs, "selective": outs + dim, "full": dim}[policy]
    total = per_block * num_blocks + (ins + outs if policy == "full" else 0)
    return total * tokens * act_bytes


def parameter_bytes(model: nn.Module) -> int:
    """Every parameter at its dtype's width (the meta model carries the dtypes the run would load)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def optimizer_memory(trainable: int) -> dict[str, int]:
    """fp32 gradients and AdamW's two fp32 moments per trainable parameter."""
    return {"gradients": 4 * trainable, "optimizer": 8 * trainable}


def format_report(trainer: str, sources: dict[str, tuple[Any, str]], plan: Plan) -> str:
    width = max(len(k) for k in sources)
    lines = [f"{trainer} train --dry-run: the resolved config (key, value, from)"]
    lines += [f"  {k:<{width}}  {v!r:<28} {src}" for k, (v, src) in sources.items()]
    total = sum(plan.memory.values())
    lines += [
        "",
        f"parameters: {plan.params_total:,} total, {plan.params_trainable:,} trainable "
        f"({100 * plan.params_trainable / max(plan.params_total, 1):.2f}%)",
        f"{plan.unit} per optimizer step: {plan.units_per_step:,}",
        f"model FLOPs per step: {plan.flops_per_step:.3e} (forward + backward, as MFU counts them)",
        f"dataset: {plan.dataset}",
        f"peak GPU memory (estimate, one process): {total / 2**30:.2f} GiB = "
        + " + ".join(f"{name} {b / 2**30:.2f}" for name, b in plan.memory.items()),
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


__all__ = ["Plan", "config_sources", "activation_bytes", "parameter_bytes", "optimizer_memory", "format_report"]
