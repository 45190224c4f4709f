"""LoRA over an NF4 frozen base (QLoRA, `lora.base_dtype = "nf4"`): NF4LoRALinear, the shared LoRALinear
(pipeline/lora.py) with its base weight stored in 4 bits (pipeline/nf4.py's NF4Linear) and dequantised inside the
matmul.

y = x Ŵᵀ + b + s · (dropout(x) Aᵀ) Bᵀ (kernels.nf4_linear.nf4_lora_linear): the base weight is quantised ONCE, when
the layer is made (`quantize_lora_bases`, at load), and its bf16 copy is dropped; the adapters A, B stay in their
own dtype and train exactly as LoRALinear's do (the same kernels/lora_linear.py code). The base gets no dW.

Everything a LoRALinear is stays: lora_A, lora_B, dropout, scale, PEFT key names, adapter saving and loading, so an
adapter trained here loads onto the unquantised base with PEFT (`PeftModel.from_pretrained`). `merge_lora` folds
the adapter into the dequantised weight. The base_layer's state-dict entries are NF4Linear's quantised tensors,
never part of an adapter or a checkpoint (the trainer saves trainable parameters only).

The experts of a mixture of experts (Qwen3-MoE) are stored in NF4 too, as whole stacks [E, O, I] (pipeline/nf4.py
NF4ExpertStack, kernels/nf4_moe.py): their per-expert adapters stay GroupedLoRA's, computed by kernels/moe.py.

Layers run alone, never in a shared-input group: the group's gain is one x·[A_0; …]ᵀ instead of three thin
matmuls, small beside the base matmuls. What stays in the model's dtype: the LM head, the embeddings, the norms, and
a target linear whose in_features is not a multiple of 64 (NF4 blocks of 64 stay inside a row); `quantize_lora_bases`
lists those.
"""
from __future__ import annotations

import torch
from torch import nn

from atelier_studio.kernels.nf4 import nf4_supported
from atelier_studio.kernels.nf4_linear import nf4_lora_linear
from atelier_studio.pipeline.lora import LoRALinear, SharedInputOperands
from atelier_studio.pipeline.nf4 import NF4Linear

# LoRALinear's kernel names → kernels.nf4_linear's
_IMPL = {"auto": "auto", "fused": "triton", "ref": "ref"}


class NF4LoRALinear(LoRALinear):
    """A LoRALinear whose frozen base is an NF4Linear (module docstring); made from one by `from_lora`."""

    base_layer: NF4Linear

    @classmethod
    def from_lora(cls, lora: LoRALinear, device: torch.device | str | None = None) -> "NF4LoRALinear":
        """The same layer (its own adapters and dropout) over its base quantised to NF4 on `device` (default: the
        base weight's); a meta-device base gives empty NF4 tensors, filled when the model is materialised."""
        if type(lora) is not LoRALinear:
            raise TypeError(f"NF4LoRALinear.from_lora: expected a LoRALinear, got {type(lora).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.base_layer = NF4Linear.from_linear(lora.base_layer, device, _IMPL[lora.impl])
        new.lora_A, new.lora_B, new.dropout = lora.lora_A, lora.lora_B, lora.dropout
        new.scale, new.rank, new.impl = lora.scale, lora.rank, lora.impl
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.dropout.p if self.training and isinstance(self.dropout, nn.Dropout) else 0.0
        base = self.base_layer
        return nf4_lora_linear(x, base.nf4_weight(), base.bias, self.lora_A.weight, self.lora_B.weight, self.scale, p,
                               _IMPL[self.impl])

    def shared_input_operands(self) -> SharedInputOperands | None:
        return None  # runs alone (module docstring)

    def merged_weight(self) -> torch.Tensor:
        """Ŵ + s·B·A in fp32, cast to the base's original dtype."""
        w = self.base_layer.dequantized_weight()
        return (w.float() + self.scale * (self.lora_B.weight.float() @ self.lora_A.weight.float())).to(w.dtype)

    def merged_linear(self) -> nn.Linear:
        """An nn.Linear holding Ŵ + s·B·A (and the base's bias): what merge_lora puts in this layer's place."""
        base = self.base_layer
        w = self.merged_weight()
        out = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None, device=w.device,
                        dtype=w.dtype).requires_grad_(False)
        with torch.no_grad():
            out.weight.copy_(w)
            if base.bias is not None:
                out.bias.copy_(base.bias)
        return out

    def extra_repr(self) -> str:
        return f"nf4 base of {str(self.base_layer.weight_dtype).removeprefix('torch.')}"


def quantize_lora_bases(model: nn.Module, device: torch.device | str | None = None) -> tuple[list[str], list[str]]:
    """Swap every LoRALinear of `model` whose base can be stored in NF4 for an NF4LoRALinear, and store the frozen
    expert stacks of every mixture-of-experts layer in NF4 (a host module's `quantize_nf4`: designer/qwen3_moe.py's
    Experts, whether or not its experts carry adapters: they are frozen in any LoRA run, and most of the weights),
    in place, quantising each base or stack on `device` (default: where it is) one at a time. Returns (quantised
    names, names kept in the model's dtype because their in_features is not a multiple of 64), in module order."""
    done, kept = [], []
    for name, module in list(model.named_modules()):
        if hasattr(module, "quantize_nf4"):
            done += [f"{name}.{stack}" for stack in module.quantize_nf4(device)]
            continue
        if type(module) is not LoRALinear:
            continue
        if not nf4_supported(module.in_features):
            kept.append(name)
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, NF4LoRALinear.from_lora(module, device))
        done.append(name)
    return done, kept
