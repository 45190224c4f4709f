"""NF4Linear: a frozen linear layer whose weight is stored in NF4 (kernels/nf4.py), computed by kernels/nf4_linear.py;
NF4ExpertStack: a mixture of experts' frozen stack of expert matrices in NF4 (kernels/nf4_moe.py), below.

y = x Ŵᵀ + b, with Ŵ dequantised tile by tile inside the matmul (never a bf16 copy of W in memory), and dX = dY Ŵ
in backward (no dW: the layer is frozen). It replaces an nn.Linear that training will never update: the frozen
base of a LoRA layer (pipeline/lora_nf4.py, `lora.base_dtype = "nf4"`).

Its tensors, named as torchao's NF4Tensor names them:
  quantized_data     uint8 [O, I/2]   Parameter (requires_grad False): FSDP2 shards it by rows
  quantized_scalers  int8  [O, I/64]  Parameter (requires_grad False): sharded by rows with it
  quantization_factor [G], scaler_mean [], nf4 [16]   buffers in the original weight's dtype, whole on every rank
  bias               [O] | None       Parameter (requires_grad False), in the original dtype
Two row-aligned Parameters and not one tensor subclass: FSDP2's all-gather moves the 4-bit rows as plain bytes, a
meta-device model materialises them by rows like any parameter (pipeline/distributed.materialize_), and nothing
outside this file needs to know a weight is quantised. FSDP2's mixed precision casts only floating-point
parameters, so the uint8 / int8 ones keep their bytes under any `param_dtype`.
`in_features` and `out_features` are an nn.Linear's; FLOP counters treat the layer as a frozen linear.

NF4ExpertStack: the same for a frozen stack of expert matrices [E, O, I] (a mixture of experts' gate_up or down),
in kernels/nf4_moe.py's format: each expert flattened and quantised on its own, the same five names, with
quantized_data uint8 [E, O·I/2] and quantized_scalers int8 [E, O·I/64] Parameters (FSDP2 shards them by whole
experts), quantization_factor [E, G] and scaler_mean [E] buffers (whole on every rank), nf4 [16]. The host module
(designer/qwen3_moe.py's Experts) hands `experts()` to kernels/moe.py, which runs the grouped GEMMs over it.
Under expert parallelism (pipeline/expert_parallel.py, `shard`) the two Parameters become DTensors sharded by
expert, holding this rank's experts' bytes; the small buffers stay whole (as under FSDP2, so checkpoints and
exports see one layout), and `experts()` slices this rank's rows of them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from atelier_studio.kernels.nf4 import NF4Weight, dequantize_nf4, nf4_code, nf4_shapes, nf4_supported, quantize_nf4
from atelier_studio.kernels.nf4_linear import IMPLS, nf4_linear
from atelier_studio.kernels.nf4_moe import NF4Experts, nf4_experts_shapes, quantize_experts

# The state-dict names of NF4Linear's quantised tensors, in materialisation order (parameters, then buffers)
NF4_TENSORS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")



def _register_nf4_tensors(module: nn.Module, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                          device: torch.device | str | None) -> None:
    """The NF4 tensors of a layer or an expert stack, empty, under the names both keep: the codes and block
    scalers as frozen parameters (so FSDP2 shards them), the scale factors, mean and code table as buffers; the
    code table filled unless on the meta device."""
    frozen = dict(requires_grad=False)
    module.quantized_data = nn.Parameter(torch.empty(shapes["data"], dtype=torch.uint8, device=device), **frozen)
    module.quantized_scalers = nn.Parameter(torch.empty(shapes["scalers"], dtype=torch.int8, device=device), **frozen)
    module.register_buffer("quantization_factor", torch.empty(shapes["factor"], dtype=dtype, device=device))
    module.register_buffer("scaler_mean", torch.empty(shapes["mean"], dtype=dtype, device=device))
    module.register_buffer("nf4", torch.empty(shapes["code"], dtype=dtype, device=device))
    if module.nf4.device.type != "meta":
        with torch.no_grad():
            module.nf4.copy_(nf4_code(dtype))

class NF4Linear(nn.Module):
    """A frozen y = x Ŵᵀ + b over an NF4 weight (module docstring); made from an nn.Linear by `from_linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None, impl: str = "auto") -> None:
        super().__init__()
        if not nf4_supported(in_features):
            raise ValueError(f"NF4Linear: in_features {in_features} is not a multiple of 64 (NF4 blocks of 64 stay "
                             f"inside a row)")
        if impl not in IMPLS:
            raise ValueError(f"NF4Linear: impl must be one of {IMPLS}, got {impl!r}")
        self.in_features, self.out_features, self.impl = in_features, out_features, impl
        shapes = nf4_shapes((out_features, in_features))
        _register_nf4_tensors(self, shapes, dtype, device)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, device: torch.device | str | None = None,
                    impl: str = "auto") -> "NF4Linear":
        """The layer with `linear`'s weight quantised on `device` (default: the weight's own), bias kept.

        A weight on the meta device gives an empty layer of the right shapes (filled later, e.g. by
        pipeline/distributed.materialize_); otherwise the weight is moved to `device` one layer at a time and
        quantised there, so a model loaded on the host never has all its bf16 weights on the device at once."""
        w = linear.weight
        device = torch.device(device) if device is not None else w.device
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype,
                  "meta" if w.is_meta else device, impl)
        if not w.is_meta:
            new.load_nf4(quantize_nf4(w.detach().to(device)))
            if linear.bias is not None:
                with torch.no_grad():
                    new.bias.copy_(linear.bias.detach())
        return new

    @torch.no_grad()
    def load_nf4(self, w: NF4Weight) -> None:
        """Copy a quantised weight of this layer's shape and dtype into its tensors."""
        if w.shape != (self.out_features, self.in_features) or w.dtype != self.nf4.dtype:
            raise ValueError(f"NF4Linear.load_nf4: expected an NF4 weight {(self.out_features, self.in_features)} in "
                             f"{self.nf4.dtype}, got {w.shape} in {w.dtype}")
        for name, t in zip(NF4_TENSORS, (w.data, w.scalers, w.factor, w.mean, w.code)):
            getattr(self, name).copy_(t)

    @staticmethod
    def owns_parameter(name: str) -> bool:
        """Whether a parameter name is one of an NF4Linear's quantised tensors (bytes, not weights)."""
        return name.rpartition(".")[2] in NF4_TENSORS[:2]

    def nf4_weight(self) -> NF4Weight:
        return NF4Weight(self.quantized_data, self.quantized_scalers, self.quantization_factor, self.scaler_mean,
                         self.nf4)

    def dequantized_weight(self) -> torch.Tensor:
        """Ŵ [O, I] in the original dtype (kernels.nf4.dequantize_nf4): for merges and references, not the step."""
        return dequantize_nf4(self.nf4_weight())

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.nf4.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.nf4_weight(), self.bias, self.impl)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"nf4 of {str(self.weight_dtype).removeprefix('torch.')}, impl={self.impl}")


class NF4ExpertStack(nn.Module):
    """A frozen stack W [E, O, I] in NF4 (module docstring); made from the bf16 stack by `from_weight`."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str | None = None,
                 kernels: str = "auto") -> None:
        super().__init__()
        shapes = nf4_experts_shapes(tuple(shape))  # raises for a stack whose experts are not whole blocks
        if kernels not in IMPLS:
            raise ValueError(f"NF4ExpertStack: kernels must be one of {IMPLS}, got {kernels!r}")
        self.shape, self.kernels = tuple(shape), kernels
        self.local_experts: slice | None = None  # this rank's experts under expert parallelism (shard), else all
        _register_nf4_tensors(self, shapes, dtype, device)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, device: torch.device | str | None = None,
                    kernels: str = "auto") -> "NF4ExpertStack":
        """The stack `weight` [E, O, I] quantised on `device` (default: its own): moved there alone, so a model held
        on the host never has more than this one bf16 stack on the device. A meta weight gives empty tensors."""
        device = torch.device(device) if device is not None else weight.device
        new = cls(tuple(weight.shape), weight.dtype, "meta" if weight.is_meta else device, kernels)
        if not weight.is_meta:
            new.load_experts(quantize_experts(weight.detach().to(device)))
        return new

    @torch.no_grad()
    def load_experts(self, w: NF4Experts) -> None:
        """Copy a quantised stack of this module's shape and dtype into its tensors."""
        if tuple(w.shape) != self.shape or w.dtype != self.nf4.dtype:
            raise ValueError(f"NF4ExpertStack.load_experts: expected NF4 experts {self.shape} in {self.nf4.dtype}, got "
                             f"{tuple(w.shape)} in {w.dtype}")
        for name, t in zip(NF4_TENSORS, (w.data, w.scalers, w.factor, w.mean, w.code)):
            getattr(self, name).copy_(t)

    def shard(self, shard: Callable[[torch.Tensor], nn.Parameter], experts: slice) -> None:
        """Expert parallelism: keep the bytes of `experts` (this rank's, a slice of dim 0) as `shard(...)` of the
        two Parameters (pipeline/expert_parallel.py's DTensors sharded by expert); the buffers stay whole."""
        if self.local_experts is not None:
            raise ValueError(f"NF4ExpertStack.shard: already sharded to experts {self.local_experts}")
        held = len(range(*experts.indices(self.shape[0])))
        if held == 0 or experts.step not in (None, 1):
            raise ValueError(f"NF4ExpertStack.shard: experts must be a contiguous non-empty run of the "
                             f"{self.shape[0]}, got {experts}")
        self.quantized_data, self.quantized_scalers = shard(self.quantized_data), shard(self.quantized_scalers)
        self.local_experts = experts

    def experts(self) -> NF4Experts:
        """The stack as kernels/moe.py computes with it (this module's tensors, no copy): every expert, or under
        expert parallelism this rank's (the local shards of the bytes, its rows of the small buffers)."""
        if self.local_experts is None:
            return NF4Experts(self.quantized_data, self.quantized_scalers, self.quantization_factor, self.scaler_mean,
                              self.nf4, self.shape, self.kernels)
        data, scalers = (t.to_local() if hasattr(t, "to_local") else t
                         for t in (self.quantized_data, self.quantized_scalers))
        rows = self.local_experts
        if data.shape[0] != len(range(*rows.indices(self.shape[0]))):
            raise ValueError(f"NF4ExpertStack.experts: the local bytes hold {data.shape[0]} experts, the shard "
                             f"{rows} names {len(range(*rows.indices(self.shape[0])))}")
        return NF4Experts(data, scalers, self.quantization_factor[rows], self.scaler_mean[rows], self.nf4,
                          (data.shape[0], *self.shape[1:]), self.kernels)

    @property
    def numel(self) -> int:
        """The weights the stack stands for (E·O·I)."""
        e, o, i = self.shape
        return e * o * i

    def extra_repr(self) -> str:
        rows = self.local_experts
        local = "" if rows is None else f", local experts {rows.start}:{rows.stop}"
        return f"shape={self.shape}, nf4 of {str(self.nf4.dtype).removeprefix('torch.')}, kernels={self.kernels}{local}"
