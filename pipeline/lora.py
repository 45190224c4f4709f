"""The LoRA layer both trainers share (Hu et al. 2021, arXiv:2106.09685): LoRALinear over kernels/lora_linear.py.

Shapes: T tokens (any leading dims), I in-features, O out-features, r rank.
  LoRALinear(x [..., I]) = base(x) + B(A(dropout(x))) · s,  A [r, I], B [O, r],
  s = alpha / r, or alpha / √r with rslora (Kalajdzievski 2023, arXiv:2312.03732).
A is kaiming-uniform(a=√5) and B zeros, as PEFT's default, so a fresh adapter is the identity.
The base is frozen (no weight gradient); the adapter runs in its own dtype (fp32 by default, as PEFT) and its
output is cast back to x's dtype; under autocast both run in the autocast dtype (kernels/lora_linear.py).

The module names (base_layer, lora_A, lora_B) are PEFT's, so a model's state dict holds PEFT's key names. Which
linears get a layer, and the file formats, are each model side's: the designer's PEFT adapters
(designer/lora.py), the MMDiT's diffusers LoRA file (imagegen/lora.py). `LoraArgs.targets` are names the model side
resolves (and checks) against its families.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from atelier_studio.kernels.lora_linear import lora_linear

if TYPE_CHECKING:
    from atelier_studio.kernels.fp8_linear import Fp8FrozenWeight

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoraArgs:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # names of the family's linears (the model side resolves them); () = its default
    rslora: bool = False
    dtype: str = "float32"  # adapter weights and adapter compute

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraArgs.rank must be a positive int, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraArgs.dropout must be in [0, 1), got {self.dropout}")
        if self.dtype not in DTYPES:
            raise ValueError(f"LoraArgs.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class SharedInputOperands:
    """What kernels.lora_linear.lora_linear_group needs of one LoRA layer."""

    weight: torch.Tensor  # [O, I], frozen
    lora_a: torch.Tensor  # [r, I]
    lora_b: torch.Tensor  # [O, r]
    scale: float
    impl: str  # the group op's kernel choice: lora_linear's names, or fp8_linear's when fp8 is set
    fp8: Fp8FrozenWeight | None = None  # an FP8 base's fp8 copies (pipeline/lora_fp8.py); None: a bf16 base


class LoRALinear(nn.Module):
    """base(x) + lora_B(lora_A(dropout(x))) · scale over a frozen nn.Linear (PEFT's names: base_layer, lora_A,
    lora_B)."""

    def __init__(self, base: nn.Linear, args: LoraArgs, impl: str = "auto") -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps nn.Linear, got {type(base).__name__}")
        self.base_layer = base.requires_grad_(False)
        dtype, device = DTYPES[args.dtype], base.weight.device
        self.lora_A = nn.Linear(base.in_features, args.rank, bias=False, device=device, dtype=dtype)  # weight [r, I]
        self.lora_B = nn.Linear(args.rank, base.out_features, bias=False, device=device, dtype=dtype)  # weight [O, r]
        self.dropout = nn.Dropout(args.dropout) if args.dropout > 0 else nn.Identity()
        self.scale = args.scale
        self.rank = args.rank
        self.impl = impl  # kernels.lora_linear impl: auto | fused | ref
        self.reset_parameters()

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init_lora_weights=True
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # kernels.lora_linear: no dW for the frozen base, x·Aᵀ saved for dB (fused on CUDA, fp32 reference elsewhere).
        p = self.dropout.p if self.training and isinstance(self.dropout, nn.Dropout) else 0.0
        return lora_linear(x, self.base_layer.weight, self.base_layer.bias, self.lora_A.weight, self.lora_B.weight,
                           self.scale, p, self.impl)

    def shared_input_operands(self) -> SharedInputOperands | None:
        """This layer's part in a shared-input group (pipeline/shared_input.py), or None when it must
        run alone: a bias, or dropout in effect (each layer draws its own mask)."""
        p = self.dropout.p if self.training and isinstance(self.dropout, nn.Dropout) else 0.0
        if self.base_layer.bias is not None or p > 0:
            return None
        return SharedInputOperands(self.base_layer.weight, self.lora_A.weight, self.lora_B.weight, self.scale,
                                   self.impl)

    def merged_weight(self) -> torch.Tensor:
        """W + s·B·A in fp32, cast to the base weight's dtype."""
        w = self.base_layer.weight
        return (w.float() + self.scale * (self.lora_B.weight.float() @ self.lora_A.weight.float())).to(w.dtype)

    def merged_linear(self) -> nn.Linear:
        """The base nn.Linear with W + s·B·A written into its weight: what a merge puts in this layer's place."""
        base = self.base_layer
        with torch.no_grad():
            base.weight.copy_(self.merged_weight())
        return base


def lora_init_like(layers: list[tuple[str, nn.Linear]], args: LoraArgs,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """The adapter weights wrapping `layers` (full name, base linear) in this order would draw: {name.lora_A.weight,
    name.lora_B.weight: tensor}. What a sharded (meta-device) build fills its adapters from, so it starts from the
    adapter a one-process run with the same seed starts from.

    Each adapter is made by LoRALinear itself around an uninitialised stand-in for its base (skip_init draws
    nothing), so the draws are exactly apply_lora's; the stand-in is one linear at a time. Adapters are small:
    every rank draws all of them and keeps its rows.
    """
    out = {}
    for name, base in layers:
        stand_in = torch.nn.utils.skip_init(nn.Linear, base.in_features, base.out_features, bias=False, device=device)
        lora = LoRALinear(stand_in, args)
        out[f"{name}.lora_A.weight"] = lora.lora_A.weight.detach()
        out[f"{name}.lora_B.weight"] = lora.lora_B.weight.detach()
    return out


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """{full module name: LoRALinear} of a model with LoRA applied, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


__all__ = ["LoraArgs", "LoRALinear", "SharedInputOperands", "lora_init_like", "lora_layers", "DTYPES"]
