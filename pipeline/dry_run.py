"""`atelier designer train --dry-run` / `imagegen train --dry-run`: what a config will do, before anything loads.

Each trainer builds its model from the model's config alone, on the meta device (no weights are read, no memory is
taken), and fills a `Plan`; this module prints it with the resolved config:

    every config key, its value and where it came from (default, the TOML file, --set)
    parameters total / trainable, tokens or images per optimizer step, model FLOPs per step (the model's own
    train_flops, as MFU counts them), the dataset's size (the designer's after packing), and an estimate of the peak
    GPU memory of one process:

    weights      every parameter in its stored dtype (bf16 base, fp32 master weights or adapters, NF4 bases)
    gradients    one per trainable parameter, in its dtype (torch keeps .grad in the parameter's dtype)
    optimizer    AdamW's two moments per trainable parameter, in its dtype (torch's AdamW state is zeros_like(p))
    fp8 copies   with train.precision = "fp8": every frozen base weight's two fp8 copies and their scales, made once
                 (kernels/fp8_linear.py quantize_frozen_weight: one per output channel for y = x Wᵀ, one per input
                 channel for dX = dY W); a trainable weight is quantised each step, transiently
    activations  saved for backward over one micro-batch, by train.distributed.activation_checkpointing:
                 "none"       every linear's input and output in each block (the norms', SwiGLU's and attention's
                              saved tensors are of those sizes), for each row the linear reads;
                 "selective"  the linears' outputs and the block input (norms, RoPE, SwiGLU recomputed);
                 "full"       the block input per block, plus one block's "none" while it is recomputed.
                 Counted from the model's own linears (the first block's), at the compute dtype's width. A linear
                 reads the rows its trainer says (`rows_of`): every token of the micro-batch for the designer; for
                 imagegen its family's linear_rows (an MMDiT block's image-stream linears read the image tokens,
                 its text-stream linears the text tokens, its AdaLN modulation linears one row per image).

The memory figure is an estimate (no allocator overhead, workspace or fragmentation, the LM head's chunked logits
left out); bench/dry_run_memory.py compares it with the bench's measured peaks on the GPU (docs/training.md).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

from atelier_studio.kernels.fp8_linear import RECIPES
from atelier_studio.pipeline.config import config_to_dict, flatten
from atelier_studio.pipeline.float8 import Float8Linear
from atelier_studio.pipeline.lora_fp8 import Float8LoRALinear


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


def activation_bytes(block: nn.Module, num_blocks: int, dim: int, tokens: int, act_bytes: int, policy: str,
                     rows_of: Callable[[str], int] | None = None) -> int:
    """Saved activations of one micro-batch of `tokens` tokens through `num_blocks` blocks like `block` (module
    docstring). `rows_of(name)`: the rows the block's linear `name` reads (default: every token)."""
    rows = rows_of or (lambda name: tokens)
    linears = [(rows(name), m) for name, m in block.named_modules() if isinstance(m, nn.Linear)]
    ins = sum(n * m.in_features for n, m in linears)
    outs = sum(n * m.out_features for n, m in linears)
    per_block = {"none": ins + outs, "selective": outs + dim * tokens, "full": dim * tokens}[policy]
    total = per_block * num_blocks + (ins + outs if policy == "full" else 0)
    return total * act_bytes


def parameter_bytes(model: nn.Module) -> int:
    """Every parameter at its dtype's width (the meta model carries the dtypes the run would load)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def optimizer_memory(model: nn.Module) -> dict[str, int]:
    """The gradient and AdamW's two moments of every trainable parameter, each at the parameter's width: fp32 for
    full fine-tuning's master weights and fp32 adapters, bf16 for bf16 adapters."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"gradients": trainable, "optimizer": 2 * trainable}


def fp8_memory(model: nn.Module, precision: str) -> dict[str, int]:
    """{"fp8 copies": bytes} with train.precision = "fp8" (the model as apply_fp8 converted it), else {}: the frozen
    weights' two fp8 copies (module docstring), one byte a weight each, and an fp32 scale per row of each (rowwise)
    or one per copy (tensorwise)."""
    if precision != "fp8":
        return {}
    total = 0
    for m in model.modules():
        weight = m.base_layer.weight if isinstance(m, Float8LoRALinear) else (
            m.weight if isinstance(m, Float8Linear) else None)
        if weight is None or weight.requires_grad:
            continue
        n, k = weight.shape
        total += 2 * n * k + 4 * ((n + k) if RECIPES[m.recipe].rowwise else 2)
    return {"fp8 copies": total}


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


__all__ = ["Plan", "config_sources", "activation_bytes", "parameter_bytes", "optimizer_memory", "fp8_memory",
           "format_report"]
