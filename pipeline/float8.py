"""Float8Linear: an nn.Linear whose matmuls run in FP8 (kernels/fp8_linear.py), for `train.precision = "fp8"`.

It IS an nn.Linear (same parameters, names and init; FLOP counters and state dicts see a plain linear), built from
one by `Float8Linear.from_linear`, which keeps the very same Parameter objects (so an optimizer, FSDP or a tied
weight built before the swap still refers to them). The forward depends on the weight:
- trainable: kernels.fp8_linear.fp8_linear, every operand quantised each step (x, W, dY), dX and dW in FP8;
- frozen (requires_grad False, e.g. a linear a LoRA run does not target): fp8_frozen_linear over fp8 copies of the
  weight made once: at the swap when the weight is frozen then, else on the first frozen forward; rebuilt after
  every load_state_dict and by `refresh_fp8_weight()` (call it after changing a frozen weight in place).
  They are non-persistent buffers: a state dict holds exactly the nn.Linear's weight and bias, as before.
The recipe ("rowwise" or "tensorwise") and the kernel choice (`impl`: auto | scaled_mm | ref) are plain attributes.

Projections that read one input (q/k/v, gate/up, the MMDiT's to_q/k/v and add_q/k/v) run as one group through
`float8_group` (kernels/fp8_group.py): x is quantised once for all of them, with the same outputs and weight
gradients as the members one by one (the models call it through pipeline/shared_input.py).

The trainers apply `[train] precision` through check_precision (at the start: refuses what cannot run, naming the
key) and apply_precision (on the loaded model, LoRA applied, before activation checkpointing, compile and FSDP).
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from atelier_studio.kernels.fp8_group import fp8_frozen_linear_group, fp8_linear_group
from atelier_studio.kernels.fp8_linear import (
    IMPLS,
    PRECISION_KEY,
    RECIPES,
    Fp8FrozenWeight,
    Fp8UnsupportedError,
    check_fp8_device,
    fp8_copies_used,
    fp8_frozen_linear,
    fp8_linear,
    quantize_frozen_weight,
)
from atelier_studio.pipeline.config import ConfigError, TrainConfig
from atelier_studio.pipeline.progress import announce_fallback, log

_BUFFERS = ("fp8_q", "fp8_scale", "fp8_qt", "fp8_scale_t")


class Float8Linear(nn.Linear):
    """nn.Linear computed in FP8: y = x Wᵀ + b with the recipe's quantised operands (module docstring)."""

    recipe: str
    impl: str
    shared_input: bool  # joins a shared-input group (float8_group) when True; False runs it alone (benchmarks)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str, impl: str = "auto") -> "Float8Linear":
        """The same layer (its own Parameters, not copies) computing in FP8."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"Float8Linear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        if recipe not in RECIPES:
            raise ValueError(f"Float8Linear: recipe must be one of {list(RECIPES)}, got {recipe!r}")
        if impl not in IMPLS:
            raise ValueError(f"Float8Linear: impl must be one of {IMPLS}, got {impl!r}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.recipe, new.impl, new.shared_input = recipe, impl, True
        for name in _BUFFERS:
            new.register_buffer(name, None, persistent=False)
        new.register_load_state_dict_post_hook(_after_load)
        if not new.weight.requires_grad and fp8_copies_used(impl, new.weight):
            new.refresh_fp8_weight()  # now, not inside a first (perhaps compiled) forward
        return new

    def drop_fp8_weight(self) -> None:
        """Forget the frozen weight's fp8 copies; the next frozen forward rebuilds them from the weight."""
        for name in _BUFFERS:
            setattr(self, name, None)

    def refresh_fp8_weight(self) -> Fp8FrozenWeight:
        """(Re)quantise the weight into its fp8 copies now (after changing a frozen weight in place)."""
        f = quantize_frozen_weight(self.weight, self.recipe)
        self.fp8_q, self.fp8_scale, self.fp8_qt, self.fp8_scale_t = f.q, f.scale, f.qt, f.scale_t
        return f

    def fp8_weight(self) -> Fp8FrozenWeight:
        """The frozen weight's fp8 copies, made on first use."""
        if self.fp8_q is None or self.fp8_q.device != self.weight.device:
            return self.refresh_fp8_weight()
        return Fp8FrozenWeight(self.recipe, self.fp8_q, self.fp8_scale, self.fp8_qt, self.fp8_scale_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad:
            return fp8_linear(x, self.weight, self.bias, self.recipe, self.impl)
        frozen = self.fp8_weight() if fp8_copies_used(self.impl, self.weight) else None
        return fp8_frozen_linear(x, self.weight, self.bias, frozen, self.recipe, self.impl)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, impl={self.impl}"


def float8_group(x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor] | None:
    """[m(x) for m in linears] as one FP8 group (x quantised once), or None when they cannot share: fewer than two,
    not all Float8Linear (with shared_input on), or different recipes, kernel choices or weight dtypes, or
    trainable and frozen mixed."""
    if len(linears) < 2 or any(type(m) is not Float8Linear or not m.shared_input for m in linears):
        return None
    first = linears[0]
    w0 = first.weight
    if any(m.recipe != first.recipe or m.impl != first.impl or m.weight.dtype != w0.dtype
           or m.weight.requires_grad != w0.requires_grad for m in linears):
        return None
    weights, biases = [m.weight for m in linears], [m.bias for m in linears]
    if w0.requires_grad:
        return fp8_linear_group(x, weights, biases, first.recipe, first.impl)
    frozens = [m.fp8_weight() if fp8_copies_used(m.impl, m.weight) else None for m in linears]
    return fp8_frozen_linear_group(x, weights, biases, frozens, first.recipe, first.impl)


def _after_load(module, incompatible_keys) -> None:
    """load_state_dict post hook (a module-level function, so the model still pickles): new weights, new copies.
    A sharded weight (FSDP2's DTensor) holds only this rank's rows: its copies are made at the first forward, from
    the weight FSDP2 has gathered whole."""
    module.drop_fp8_weight()
    if (not module.weight.requires_grad and fp8_copies_used(module.impl, module.weight)
            and not isinstance(module.weight, DTensor)):
        module.refresh_fp8_weight()


def check_precision(train: TrainConfig, device: torch.device, distributed: bool, frozen_bases: bool = False) -> None:
    """Refuse, before anything is loaded, a `train.precision = "fp8"` run that cannot happen (ConfigError, naming
    the key): a GPU without FP8 tensor cores, or several processes over frozen FP8 bases (`frozen_bases`: a LoRA
    run, whose bases' fp8 copies are built once from each whole weight, which a sharded rank does not hold). Full
    fine-tuning runs under FSDP2: each block's weights are gathered whole before its forward, and every trainable
    FP8 linear quantises the gathered weight each step, as one process does."""
    if train.precision != "fp8":
        return
    if distributed and frozen_bases:
        raise ConfigError(f"{PRECISION_KEY} with LoRA runs on one process (the frozen bases' fp8 copies are built "
                          f"from each whole weight, which a sharded rank does not hold); under torchrun use "
                          f"train.precision = \"bf16\", or full fine-tuning (lora.rank = 0) in FP8")
    try:
        check_fp8_device(device)
    except Fp8UnsupportedError as e:
        raise ConfigError(str(e)) from None
    if device.type != "cuda":  # the fake-quantised references (kernels/fp8_linear.py): the same numerics, no speed
        announce_fallback("precision", f"{PRECISION_KEY}: emulated (no FP8 hardware): for tests only; every FP8 "
                                       f"matmul runs as fp32 fake quantisation on {device}")


# The LM head stays in bf16 until a measurement says otherwise; callers add their own.
FP8_ALWAYS_SKIPPED = ("lm_head", "*.lm_head")

# A module type that has its own FP8 form (e.g. a LoRA layer, whose frozen base goes to FP8 and whose adapters do
# not) maps to the function that builds it from the module and the recipe. The model's side passes these in:
# this engine module knows no model family's layers.
Fp8Conversions = Mapping[type, Callable[[nn.Module, str], nn.Module]]


def apply_fp8(model: nn.Module, recipe: str, skip: Sequence[str] = (), impl: str = "auto",
              conversions: Fp8Conversions | None = None) -> list[str]:
    """Swap every nn.Linear of `model` for a Float8Linear, and every module whose exact type is in `conversions`
    for what its conversion builds, in place.

    Not swapped: the LM head and every module whose qualified name matches a glob of `skip` (fnmatch: `*` also
    crosses dots, e.g. "transformer_blocks.*.norm1.linear"); anything inside a converted module (a LoRA layer's
    base is converted with it, its adapters A and B never); anything that is not a plain nn.Linear or a converted
    type (norms, embeddings, convolutions). The swapped modules keep the same Parameters, so state dicts,
    checkpoints and exports are unchanged. `impl` is Float8Linear's (auto | scaled_mm | ref); converted modules
    keep their own kernel choice. Returns the swapped names, in module order.
    """
    conversions = dict(conversions or {})
    patterns = (*FP8_ALWAYS_SKIPPED, *skip)
    swaps: list[tuple[str, nn.Module]] = []
    converted: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(n + ".") for n in converted):  # (the root cannot be swapped in place)
            continue  # inside a converted module: it is swapped as a whole
        kind = type(module)
        if kind in conversions:
            converted.append(name)
        if (kind in conversions or kind is nn.Linear) and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            swaps.append((name, module))
    for name, module in swaps:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        convert = conversions.get(type(module))
        setattr(parent, leaf, convert(module, recipe) if convert else Float8Linear.from_linear(module, recipe, impl))
    return [name for name, _ in swaps]


def apply_precision(model: nn.Module, train: TrainConfig, skip: Sequence[str] = (),
                    conversions: Fp8Conversions | None = None) -> list[str]:
    """`train.precision` on a built model: nothing for "bf16"; for "fp8", apply_fp8 with the recipe (the LM head
    and `skip` stay as they are; `conversions` as apply_fp8's). Returns the swapped module names."""
    if train.precision != "fp8":
        return []
    names = apply_fp8(model, train.fp8_recipe, skip, conversions=conversions)
    if not names:
        raise ConfigError(f"{PRECISION_KEY}: {type(model).__name__} has no linear layer to compute in FP8")
    log(f"fp8 ({train.fp8_recipe}): {len(names)} linear layers in FP8; kept in the model dtype: the LM head, "
        f"norms{', ' + ', '.join(skip) if skip else ''}")
    return names
