"""Projections that read one input (q/k/v, gate/up, Qwen3.5's in_proj_*, the MMDiT's to_q/k/v and add_q/k/v), run
as one op where their layers allow: `shared_input_linears(x, *linears) == [m(x) for m in linears]`.

Three groups, in this order, else each layer on its own (a plain nn.Linear, a layer with a bias or dropout):
- FP8 full fine-tuning: every layer a pipeline.float8.Float8Linear → float8.float8_group (x quantised once).
- LoRA over bf16 bases: every layer a LoRA layer whose `shared_input_operands()` (pipeline/lora.py) is not None →
  kernels.lora_linear.lora_linear_group: x·Aᵀ once for all adapters, dx accumulated inside the matmuls instead of
  M−1 separate adds.
- LoRA over FP8 bases (pipeline/lora_fp8.py) → kernels.fp8_group.fp8_lora_linear_group: that, with x also quantised
  once for every base.
A LoRA group needs one kernel choice and adapter dtype, every adapter weight trained or every one frozen (a frozen A
with a trained B, as LoRA-FA trains, runs layer by layer), and every base bf16 or every one FP8 in one recipe.
The outputs and gradients are those of the layers one by one (tests/pipeline/test_float8.py,
tests/designer/test_lora.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atelier_studio.kernels.fp8_group import fp8_lora_linear_group
from atelier_studio.kernels.lora_linear import lora_linear_group
from atelier_studio.pipeline.float8 import float8_group


def shared_input_linears(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """[m(x) for m in linears], as one group where the layers can share (module docstring)."""
    if len(linears) > 1:
        grouped = float8_group(x, linears)
        if grouped is not None:
            return grouped
    operands = [getattr(m, "shared_input_operands", lambda: None)() for m in linears]
    if len(linears) > 1 and all(o is not None for o in operands) and _groupable(operands):
        first = operands[0]
        weights, scales = [o.weight for o in operands], [o.scale for o in operands]
        lora_as, lora_bs = [o.lora_a for o in operands], [o.lora_b for o in operands]
        if first.fp8 is not None:
            return fp8_lora_linear_group(x, weights, [o.fp8 for o in operands], lora_as, lora_bs, scales,
                                         first.fp8.recipe, first.impl)
        return lora_linear_group(x, weights, lora_as, lora_bs, scales, first.impl)
    return [m(x) for m in linears]


def _groupable(operands: list[Any]) -> bool:
    """One kernel choice, one adapter dtype, adapters all trained or all frozen, bases all bf16 or all FP8 in one
    recipe (module docstring)."""
    first = operands[0]
    recipe = first.fp8.recipe if first.fp8 is not None else None
    return all(o.impl == first.impl and o.lora_a.dtype == o.lora_b.dtype == first.lora_a.dtype
               and o.lora_a.requires_grad == o.lora_b.requires_grad == first.lora_a.requires_grad
               and (o.fp8.recipe if o.fp8 is not None else None) == recipe for o in operands)
