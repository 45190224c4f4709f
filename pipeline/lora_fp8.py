"""LoRA over an FP8 frozen base: Float8LoRALinear, the LoRALinear both trainers share with its base matmuls in FP8
(`train.precision = "fp8"` with lora.rank > 0, the designer's and the imagegen's).

y = fp8_base(x) + s · (dropout(x) Aᵀ) Bᵀ (kernels.fp8_linear.fp8_lora_linear): the frozen base weight is quantised
ONCE, when the layer is made (per output channel for the forward GEMM, and a second copy per input channel for
dX = dY W; one scale each for the tensorwise recipe), activations and dY are quantised per step, and the adapters
A, B stay in their own dtype through kernels/lora_linear.py's code. The base gets no dW, as in LoRALinear.

Everything a LoRALinear is stays: the same modules and Parameters (base_layer, lora_A, lora_B, dropout), PEFT key
names, adapter saving and loading, merge_lora. The fp8 copies are non-persistent buffers (never in a state dict),
rebuilt after a load_state_dict or by `refresh_fp8_weight()`. Layers that read one x (q/k/v, gate/up) join a
shared-input group (pipeline/shared_input.py → kernels.fp8_group.fp8_lora_linear_group: x quantised once for their
FP8 bases, one matmul x [A_0; …]ᵀ for their adapters) under LoRALinear's conditions (no bias, no dropout).
"""
from __future__ import annotations

import torch

from atelier_studio.kernels.fp8_linear import (
    RECIPES,
    Fp8FrozenWeight,
    fp8_copies_used,
    fp8_lora_linear,
    quantize_frozen_weight,
)
from atelier_studio.pipeline.lora import LoRALinear, SharedInputOperands

_BUFFERS = ("fp8_q", "fp8_scale", "fp8_qt", "fp8_scale_t")
# LoRALinear's kernel names → kernels.fp8_linear's: "fused" is the fast path there
_IMPL = {"auto": "auto", "fused": "scaled_mm", "ref": "ref"}


class Float8LoRALinear(LoRALinear):
    """A LoRALinear whose frozen base runs in FP8 (module docstring); made from one by `from_lora`."""

    recipe: str
    shared_input: bool  # joins a shared-input group when True; False runs it alone (benchmarks)

    @classmethod
    def from_lora(cls, lora: LoRALinear, recipe: str) -> "Float8LoRALinear":
        """The same layer (its own submodules and Parameters) over an FP8 base, quantised now."""
        if type(lora) is not LoRALinear:
            raise TypeError(f"Float8LoRALinear.from_lora: expected a LoRALinear, got {type(lora).__name__}")
        if recipe not in RECIPES:
            raise ValueError(f"Float8LoRALinear: recipe must be one of {list(RECIPES)}, got {recipe!r}")
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.base_layer, new.lora_A, new.lora_B, new.dropout = lora.base_layer, lora.lora_A, lora.lora_B, lora.dropout
        new.scale, new.rank, new.impl, new.recipe = lora.scale, lora.rank, lora.impl, recipe
        new.shared_input = True
        for name in _BUFFERS:
            new.register_buffer(name, None, persistent=False)
        new.register_load_state_dict_post_hook(_after_load)
        if fp8_copies_used(_IMPL[new.impl], new.base_layer.weight):  # the reference path (a CPU) reads none
            new.refresh_fp8_weight()
        return new

    def refresh_fp8_weight(self) -> Fp8FrozenWeight:
        """(Re)quantise the frozen base weight into its two fp8 copies."""
        f = quantize_frozen_weight(self.base_layer.weight, self.recipe)
        self.fp8_q, self.fp8_scale, self.fp8_qt, self.fp8_scale_t = f.q, f.scale, f.qt, f.scale_t
        return f

    def fp8_weight(self) -> Fp8FrozenWeight | None:
        """The base's fp8 copies, or None where the reference path runs (it quantises from the weight itself)."""
        if not fp8_copies_used(_IMPL[self.impl], self.base_layer.weight):
            return None
        if self.fp8_q is None or self.fp8_q.device != self.base_layer.weight.device:
            return self.refresh_fp8_weight()  # moved to another device without its buffers (never in this trainer)
        return Fp8FrozenWeight(self.recipe, self.fp8_q, self.fp8_scale, self.fp8_qt, self.fp8_scale_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.dropout.p if self.training and isinstance(self.dropout, torch.nn.Dropout) else 0.0
        base = self.base_layer
        return fp8_lora_linear(x, base.weight, base.bias, self.fp8_weight(), self.lora_A.weight, self.lora_B.weight,
                               self.scale, p, self.recipe, _IMPL[self.impl])

    def shared_input_operands(self) -> SharedInputOperands | None:
        """This layer's part in an FP8 shared-input group, or None when it must run alone (a bias, dropout)."""
        ops = super().shared_input_operands()
        if ops is None or not self.shared_input or self.fp8_weight() is None:  # the reference path runs alone
            return None
        return SharedInputOperands(ops.weight, ops.lora_a, ops.lora_b, ops.scale, _IMPL[self.impl], self.fp8_weight())

    def extra_repr(self) -> str:
        return f"recipe={self.recipe}"


def _after_load(module, incompatible_keys) -> None:
    """load_state_dict post hook (a module-level function, so the model still pickles)."""
    if fp8_copies_used(_IMPL[module.impl], module.base_layer.weight):
        module.refresh_fp8_weight()


# What train.precision = "fp8" turns a LoRA layer into (pipeline.float8.apply_fp8's `conversions`).
FP8_CONVERSIONS = {LoRALinear: Float8LoRALinear.from_lora}
