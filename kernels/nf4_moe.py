"""Frozen mixture-of-experts weights in NF4 (QLoRA on a Qwen3-MoE): the stack format, a Triton dequantiser, and the
experts' grouped GEMM over it, which dequantises into a transient buffer and never keeps the bf16 weights.

Shapes: E experts, O out-features and I in-features of each expert's matrix (O·I a multiple of 64), n_b = O·I / 64
blocks per expert, G = ⌈n_b / 256⌉ scale groups per expert, S routed slots sorted by expert, offs [E] int32
(kernels/moe.py's cumulative slot counts).

Format (NF4Experts). A stack W [E, O, I] (an MoE projection: gate_up [E, 2F, D], down [E, D, F]) is stored with
each expert's matrix flattened row-major and quantised on its own, in kernels/nf4.py's format (blocks of 64 with an
absmax, int8 block scales around the expert's own mean, one factor per 256 blocks):
    data uint8 [E, O·I/2], scalers int8 [E, n_b], factor d [E, G], mean d [E], code d [16]   (d: W's dtype).
Dim 0 is the expert, so FSDP2 shards the bytes by whole experts, and an expert's blocks never mix with another's.
The blocks are those of the flattening, so I need not be a multiple of 64 (Qwen3-MoE-tiny's down_proj reads
F = 32); where it is, the bytes equal quantize_nf4 of each [O, I] matrix in kernels/nf4.py's row layout, i.e.
torchao's NF4Tensor of each expert. Dequantisation is kernels/nf4.py's, bit for bit:
    Ŵ[e] = d(code[idx] · d(d(q_b / f_g) + mean_e)).

The grouped GEMM on NF4 weights (NF4GroupedMM, y[offs[g−1]:offs[g]] = a[...] Ŵ[g]ᵀ, a [S, I] → [S, O]):
    forward   Ŵ = dequantise(W) into a transient [E, O, I] buffer in a's dtype; y = grouped_mm(a, Ŵ); Ŵ freed
    backward  Ŵ dequantised again; da = dy Ŵ[g] per group (grouped_mm over Ŵ's transpose); no dW (frozen)
    saved     offs and the NF4 tensors themselves (references, no copies): never Ŵ, and not a (no dW to make).
The adapters (per-expert LoRA, kernels/moe.py ExpertLoRA) run outside it through plain autograd, as over a bf16
base, so their gradients and dx's adapter part are the bf16 path's on the same Ŵ.

Why dequantise-then-grouped-GEMM, and not a fused NF4 grouped GEMM (kernels/nf4_linear.py's fused kernels, which
dequantise each tile in registers): the grouped GEMM stays torch._grouped_mm (CUTLASS on an H100/H200), the same
kernel as the bf16 base, with its variable-size groups and no host sync; a Triton grouped GEMM of our own would
have to match it first. The dense NF4 linear measured the same trade on an H200 (kernels/nf4_linear.py's "dense"
path, bench/results/nf4-linear-2026-12-04): from 64 rows, a transient Ŵ then cuBLAS beat its fused kernels 1.3–3.6×.
The price is memory traffic, not memory: per weight the dequantiser reads 0.52 bytes and writes 2, and the GEMM reads
the 2 again, against 2 for a bf16 base. At Qwen3-30B-A3B's shapes a micro-batch of 2048 tokens routes 16,384 slots,
~128 rows per expert, so each Ŵ element takes 256 FLOPs: the expert GEMMs are then near the H200's bandwidth bound
(~200 FLOPs per byte) and the extra 2.5 bytes can cost up to ~2× their time; at micro-batch 4 (512 rows per
expert) they are compute-bound and the dequantiser is a few percent. The transient buffer is one projection's
stack at a time (gate_up of 30B-A3B: 128 × 1536 × 2048 × 2 bytes = 0.8 GB), freed before the next: the bf16 MoE is
never resident (61 GB for 30B-A3B against 15.6 GB of NF4). A fused kernel (dequantise each tile in registers inside
a grouped GEMM) would remove both the traffic and the buffer; it is the next step, not needed for correctness.

Implementations (`kernels`, Qwen3MoeArgs.kernels): "triton" dequantises with kernels/nf4_linear.py's Triton
dequantiser (the dense NF4 path's, one grid slice per expert; any device, the CPU through TRITON_INTERPRET=1),
"ref" with kernels/nf4.py's dequantize_nf4, "auto" triton on CUDA. The dequantiser is a torch.library custom op
(opaque to torch.compile, seen by FlopCounterMode as no FLOPs: it is overhead). kernels/moe.py runs the whole
reference MoE (moe_ref) on the dequantised weights where its impl is "ref".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from atelier_studio.kernels.custom_op import call_op, custom_op
from atelier_studio.kernels.moe import grouped_mm
from atelier_studio.kernels.nf4 import BLOCK, GROUP, NF4Weight, dequantize_nf4, quantize_nf4
from atelier_studio.kernels.nf4_linear import nf4_dequantize

IMPLS = ("auto", "triton", "ref")


def nf4_experts_supported(shape: tuple[int, ...]) -> bool:
    """Whether a stack [E, O, I] fits the format: each expert a whole number of blocks of 64."""
    return len(shape) == 3 and shape[1] * shape[2] % BLOCK == 0


def nf4_experts_shapes(shape: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
    """The shapes of NF4Experts' tensors for a stack of `shape` [E, O, I] (for meta-device construction)."""
    if not nf4_experts_supported(shape):
        raise ValueError(f"nf4 experts: each expert of {tuple(shape)} must hold a multiple of {BLOCK} weights")
    e, o, i = shape
    n_b = o * i // BLOCK
    return {"data": (e, o * i // 2), "scalers": (e, n_b), "factor": (e, math.ceil(n_b / GROUP)), "mean": (e,),
            "code": (16,)}


@dataclass(frozen=True)
class NF4Experts:
    """A frozen stack [E, O, I] in NF4 (the module docstring's format), as kernels/moe.py's experts take it."""

    data: torch.Tensor  # uint8 [E, O·I/2]
    scalers: torch.Tensor  # int8 [E, n_b]
    factor: torch.Tensor  # d [E, G]
    mean: torch.Tensor  # d [E]
    code: torch.Tensor  # d [16]
    shape: tuple[int, int, int]  # (E, O, I)
    kernels: str = "auto"  # the dequantiser: auto | triton | ref

    @property
    def dtype(self) -> torch.dtype:
        return self.code.dtype

    def nf4_weight(self) -> NF4Weight:
        """The same tensors as kernels/nf4.py's NF4Weight of E matrices [n_b, 64] (views)."""
        e, n_b = self.scalers.shape
        return NF4Weight(self.data.view(e, n_b, BLOCK // 2), self.scalers.view(e, n_b, 1), self.factor, self.mean,
                         self.code)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Ŵ [E, O, I] in `dtype` (default W's), by the chosen implementation."""
        out = dtype or self.dtype
        if self.kernels == "triton" or (self.kernels == "auto" and self.data.is_cuda):
            return call_op(nf4_dequantize_experts, self.data, self.scalers, self.factor, self.mean, self.code,
                           list(self.shape), out)
        return dequantize_experts_ref(self).to(out)

    def grouped_mm(self, a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """a [S, I] (slots sorted by expert) → a Ŵ[g]ᵀ per expert [S, O], in a's dtype (NF4GroupedMM)."""
        return NF4GroupedMM.apply(a, offs, self.data, self.scalers, self.factor, self.mean, self.code, self.shape,
                                  self.kernels)


def quantize_experts(weight: torch.Tensor, kernels: str = "auto") -> NF4Experts:
    """W [E, O, I] → its NF4Experts, quantised on W's device in W's dtype (kernels/nf4.py quantize_nf4, per expert)."""
    if weight.dim() != 3 or not nf4_experts_supported(tuple(weight.shape)):
        raise ValueError(f"quantize_experts: expected a stack [E, O, I] with O·I a multiple of {BLOCK}, got "
                         f"{tuple(weight.shape)}")
    e, o, i = weight.shape
    w = quantize_nf4(weight.reshape(e, o * i // BLOCK, BLOCK))  # each expert: a [n_b, 64] matrix, blocks in order
    shapes = nf4_experts_shapes((e, o, i))
    return NF4Experts(w.data.reshape(shapes["data"]), w.scalers.reshape(shapes["scalers"]), w.factor, w.mean, w.code,
                      (e, o, i), kernels)


# --- the dequantiser (kernels/nf4_linear.py's Triton kernel, one grid slice per expert) ---------------
@custom_op("atelier::nf4_dequantize_experts")
def nf4_dequantize_experts(data: torch.Tensor, scalers: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor,
                           code: torch.Tensor, shape: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    """The NF4Experts tensors of a stack of `shape` (E, O, I) → Ŵ [E, O, I] in out_dtype (W's dtype's roundings
    first, then one cast). Each expert is dequantised as a matrix of rows of I weights where I is a multiple of 64
    (the row layout: wide tiles), else of its blocks, one per row of 64."""
    e, o, i = shape
    rows, width = (o, i) if i % BLOCK == 0 else (o * i // BLOCK, BLOCK)
    w = nf4_dequantize(data.view(e, rows, width // 2), scalers.view(e, rows, width // BLOCK), factor, mean, code)
    return w.view(e, o, i).to(out_dtype)


@nf4_dequantize_experts.register_fake
def _(data, scalers, factor, mean, code, shape, out_dtype):
    return data.new_empty(*shape, dtype=out_dtype)


# --- autograd.Function ----------------------------------------------------------------------------
class NF4GroupedMM(torch.autograd.Function):
    """a [S, I], offs [E], the NF4Experts tensors of W [E, O, I], its shape and dequantiser → y [S, O] = a Ŵ[g]ᵀ per
    expert; da only (module docstring). The tensors come one by one, not as the dataclass, so torch.compile sees
    plain tensor arguments."""

    @staticmethod
    def forward(ctx, a, offs, data, scalers, factor, mean, code, shape: tuple[int, int, int], kernels: str):  # noqa: D102
        w = NF4Experts(data, scalers, factor, mean, code, shape, kernels)
        y = grouped_mm(a, w.dequantize(a.dtype), offs)  # the transient Ŵ dies with this frame
        ctx.save_for_backward(offs, data, scalers, factor, mean, code)
        ctx.shape, ctx.kernels, ctx.a_dtype = shape, kernels, a.dtype
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        none = (None,) * 8
        if not ctx.needs_input_grad[0]:
            return (None, *none)
        offs, *tensors = ctx.saved_tensors
        w = NF4Experts(*tensors, ctx.shape, ctx.kernels).dequantize(ctx.a_dtype)  # [E, O, I], again
        return (grouped_mm(dy.to(ctx.a_dtype).contiguous(), w.transpose(1, 2), offs), *none)  # dy Ŵ[g]


# --- reference ------------------------------------------------------------------------------------
def dequantize_experts_ref(w: NF4Experts) -> torch.Tensor:
    """Ŵ [E, O, I] in W's dtype: kernels/nf4.py's dequantize_nf4 of each expert's blocks (plain PyTorch)."""
    return dequantize_nf4(w.nf4_weight()).view(w.shape)


def nf4_grouped_mm_ref(a: torch.Tensor, w: NF4Experts, offs: torch.Tensor) -> torch.Tensor:
    """grouped_mm on the dequantised stack, differentiated by autograd (which keeps Ŵ for the backward)."""
    return grouped_mm(a, dequantize_experts_ref(w).to(a.dtype), offs)
