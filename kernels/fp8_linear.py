"""FP8 linear layers for training: E4M3 / E5M2 operands with tensorwise or rowwise scales, on FP8 tensor cores.

Shapes: M rows (tokens; leading dims flattened), K in-features, N out-features.
  x [M, K], weight W [N, K], bias [N] | None → y = x Wᵀ + b [M, N].

Quantisation: kernels/fp8_quant.py (one rule for every operand: s = max(amax, 1e-12) · fp32(1/fp8_max) per tensor or
per row, q = fp8(clamp(v / s)), RNE; q and the transposed copy qᵀ from the same passes).

Recipes (torchtitan's float8 recipes; torchao names them the same):
  "tensorwise": x and W in E4M3, dY in E5M2 (gradients need range more than precision), one scale per tensor.
  "rowwise":    every operand in E4M3, one scale per row of each GEMM operand along the axis the GEMM does NOT
                contract, so every scale factors out of the dot products:
     y  = x Wᵀ   contracts K:  x per row (token) [M],          W per output channel [N];
     dX = dY W   contracts N:  dY per row [M],                 W per input channel [K]  (a second copy of W);
     dW = dYᵀ x  contracts M:  dY per output channel [N],      x per input channel [K]  (both over tokens).
  In both, each GEMM is  out = (q_a q_bᵀ) · s_a s_bᵀ  with fp32 accumulation: torch._scaled_mm(a [m, k] row-major,
  b [k, n] column-major, scale_a [m, 1] | scalar, scale_b [1, n] | scalar). The forward GEMM uses the tensor cores'
  fast accumulation (torchao's default for the output GEMM); the two gradient GEMMs accumulate in full fp32.
  Variants that only benchmarks use (bench/fp8_linear.py measures what they would buy; the trainers offer the two
  above): "<recipe>-fastgrad" (fast accumulation in dX and dW too), "rowwise-e5m2grad" (dY in E5M2), and
  "rowwise-gwhp" (torchao's rowwise_with_gw_hp: dW = dYᵀ x in the compute dtype from the saved x, so neither x
  nor dY needs a transposed copy: each is quantised by the one-pass row kernel, and the saved x is x itself).

What _scaled_mm needs (PyTorch's CUDA checks): mat1 [m, k] with k a multiple of 16, mat2 [k, n] with k and n
multiples of 16; m is free. So y = x Wᵀ and dX = dY W take any token count M (K and N must be multiples of 16),
and only dW = dYᵀ x, which contracts over M, needs M padded: its two operands are the transposed copies, which the
quantiser writes with M₁₆ = M rounded up to 16 columns, zero-filled in the same pass (zeros add nothing). There is
no padding copy anywhere, whatever M is.

Trainable linear (full fine-tuning, the MMDiT), Float8LinearFunction:
  forward: q(x) and q(W) as above → y (+ b inside the GEMM's epilogue when y is bf16, after it otherwise).
  Saved: the fp8 operands the backward needs, made by the same kernel passes that quantise x and W for the forward:
    x quantised for dW (per input channel, or the transposed copy for tensorwise) as xᵀ [K, M₁₆] (1 byte per
    element instead of x's 2 or 4), W quantised for dX as Wᵀ [K, N], and their scales (each only when that
    gradient is needed). Nothing in x's dtype.
  backward: one quantisation of dY (its two passes) gives both layouts its GEMMs need:
    dX = q(dY) · q(W)  in x.dtype;  dW = q(dY)ᵀ · q(x)  in weight.dtype (fp32 master weights get fp32 grads);
    d(bias) = Σ_rows dY accumulated in fp32, in bias.dtype.
Frozen base (LoRA), Fp8FrozenLoRAFunction and Fp8FrozenLinearFunction:
  the weight is quantised ONCE (quantize_frozen_weight, at load): W per output channel [N, K] for the forward and
  W per input channel, stored transposed [K, N], for dX (tensorwise: one scale, the transposed copy). Per step only
  x (per row or per tensor) and dY are quantised; dX goes through FP8, there is no dW. The adapters stay in the
  adapter dtype through kernels/lora_linear.py's own code (add_adapter_ / adapter_backward):
  y = fp8_base(x) + s · (dropout(x) Aᵀ) Bᵀ, with dA, dB and the adapter's share of dX exactly as lora_linear's.
Projections that read one x (q/k/v, gate/up): kernels/fp8_group.py quantises x once for all of them.

Dtypes: y in the compute dtype (autocast's when it is on, else x.dtype); x and W are quantised straight from their
own dtypes (an fp32 master weight is never rounded to bf16 first).

Where it runs: FP8 tensor cores need CUDA compute capability >= 8.9 (Ada, Hopper); check_fp8_device raises
Fp8UnsupportedError naming `train.precision = "fp8"` and the device below that. Implementations (`impl`):
"scaled_mm" (the Triton quantisers + torch._scaled_mm, any device: torch 2.14's CPU _scaled_mm computes the same
GEMMs, and the quantisers run under TRITON_INTERPRET=1), "ref" (fake quantisation: the same quantised operands,
dequantised, multiplied in fp32 by the reference autograd Functions: numerically what the FP8 GEMMs compute, up to
fp32 accumulation order), "auto" (scaled_mm on CUDA, ref elsewhere, so a CPU run with precision "fp8" trains).
Layers whose K or N is not a multiple of 16 (what _scaled_mm needs) take the reference on every device: they are
tiny (embedders) and the reference computes the same numbers.

Host cost (where the GEMMs are small, the host's issue time, not the GPU, sets the speed): the forward and backward
are torch.library custom ops, so torch.compile keeps them opaque and selective activation checkpointing and
FlopCounterMode see them; plain eager calls their Python bodies directly (call_op), skipping the dispatcher's
Python layers, and autocast is only switched off where it is on.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import register_flop_formula

from atelier_studio.kernels.custom_op import call_op, custom_op
from atelier_studio.kernels.fp8_quant import (  # noqa: F401  (AMAX_EPS, FORMATS, Fp8Quantized: part of this API)
    AMAX_EPS,
    E4M3,
    E5M2,
    FORMATS,
    Fp8Quantized,
    fake_quantize,
    quantize,
    quantize_ref,
)
from atelier_studio.kernels.lora_linear import (
    _compute_dtypes,
    adapter_backward,
    add_adapter_,
    dropout_mask,
    lora_adapter_ref,
)

IMPLS = ("auto", "scaled_mm", "ref")
PAD = 16  # _scaled_mm on CUDA: K, N and the contracted token dim of dW are multiples of this
FAST_ACCUM_FORWARD = True  # the forward GEMM's fast accumulation (torchao's default)
MIN_CAPABILITY = (8, 9)
PRECISION_KEY = 'train.precision = "fp8"'


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast disabled for a block (CPU autocast would round the fp32 scales to bf16); a no-op context where it
    is off already (entering torch.autocast costs several µs of host time, and the ops below run per layer)."""
    return (torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type)
            else contextlib.nullcontext())


def padded(m: int) -> int:
    """m rounded up to a multiple of PAD: the token columns of the transposed copies dW contracts over."""
    return -(-m // PAD) * PAD


@dataclass(frozen=True)
class Fp8Recipe:
    """Which fp8 dtypes and scale granularity each GEMM operand gets (the module docstring's table)."""

    name: str
    rowwise: bool  # one scale per row of each operand (along the non-contracted axis); else one per tensor
    forward_dtype: torch.dtype  # x and W
    grad_dtype: torch.dtype  # dY
    grad_fast_accum: bool = False  # fast (reduced-precision) accumulation in the dX and dW GEMMs too
    dw_high_precision: bool = False  # dW = dYᵀ x in the compute dtype (x saved as is), not from fp8 copies


TRAIN_RECIPES = ("tensorwise", "rowwise")  # what [train] fp8_recipe offers
RECIPES = {"tensorwise": Fp8Recipe("tensorwise", False, E4M3, E5M2),
           "rowwise": Fp8Recipe("rowwise", True, E4M3, E4M3),
           # benchmark variants (module docstring)
           "tensorwise-fastgrad": Fp8Recipe("tensorwise-fastgrad", False, E4M3, E5M2, True),
           "rowwise-fastgrad": Fp8Recipe("rowwise-fastgrad", True, E4M3, E4M3, True),
           "rowwise-e5m2grad": Fp8Recipe("rowwise-e5m2grad", True, E4M3, E5M2),
           "rowwise-gwhp": Fp8Recipe("rowwise-gwhp", True, E4M3, E4M3, dw_high_precision=True)}


class Fp8UnsupportedError(RuntimeError):
    """FP8 was asked for on a device without FP8 tensor cores."""


# --- Triton kernels -------------------------------------------------------------------------------
# (in kernels/fp8_quant.py: the quantisers are shared with kernels/fp8_group.py)


# --- launchers ------------------------------------------------------------------------------------
def _scaled_mm(a: torch.Tensor, b_t: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, rowwise: bool,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
    """(a · s_a)(b_t · s_b)ᵀ: a [m, k] and b_t [n, k] row-major fp8 (b_t.t() is the column-major operand), scales
    [m] and [n] (rowwise) or [1] → [m, n] in out_dtype. The bias is added in the epilogue only for a bf16/fp16 output
    (the op takes none with fp32), else after."""
    m, n = a.shape[0], b_t.shape[0]
    sa, sb = (scale_a.view(m, 1), scale_b.view(1, n)) if rowwise else (scale_a.view(()), scale_b.view(()))
    mm_dtype = out_dtype
    if rowwise and out_dtype == torch.float32 and a.is_cuda and not _rowwise_fp32_output(a.device):
        mm_dtype = torch.bfloat16  # this build's rowwise kernel has no fp32 output: bf16 (2^-9), then widened
    in_epilogue = bias is not None and mm_dtype in (torch.bfloat16, torch.float16)
    with autocast_off(a.device.type):
        y = torch._scaled_mm(a, b_t.t(), scale_a=sa, scale_b=sb, bias=bias.to(mm_dtype) if in_epilogue else None,
                             out_dtype=mm_dtype, use_fast_accum=fast_accum).to(out_dtype)
        if bias is not None and not in_epilogue:
            y += bias.to(out_dtype)
    return y


@functools.lru_cache(maxsize=None)
def _rowwise_fp32_output(device: torch.device) -> bool:
    """Whether _scaled_mm with row scales gives an fp32 output on `device` (cuBLAS >= 12.9 on Hopper does; the
    CUTLASS fallback of older builds may not): one 16³ probe per device, its error swallowed on purpose."""
    a = torch.zeros(16, 16, device=device).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device), scale_b=torch.ones(1, 16, device=device),
                         out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


# torch.library custom ops: under torch.compile the forward and backward stay opaque calls (the Triton quantisers
# are launched eagerly inside them, as every kernel of this package is); plain eager calls their bodies directly
# (call_op). Absent outputs are empty tensors.
@custom_op("atelier::fp8_linear_fwd")
def fp8_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str,
                   out_dtype: torch.dtype, need_xgrad: bool, need_wgrad: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K], weight [N, K] → (y [M, N], xᵀ_q [K, M₁₆] for dW (empty unless need_wgrad and the recipe takes dW
    from fp8 copies), its scales, Wᵀ_q [K, N] for dX (empty unless need_xgrad), its scales)."""
    rc = RECIPES[recipe]
    x_cols = need_wgrad and not rc.dw_high_precision
    xq = quantize(x, rc.forward_dtype, rc.rowwise, rows=True, cols=x_cols, pad_to=PAD)
    wq = quantize(weight, rc.forward_dtype, rc.rowwise, rows=True, cols=need_xgrad)
    y = _scaled_mm(xq.q, wq.q, xq.scale, wq.scale, rc.rowwise, out_dtype, bias, FAST_ACCUM_FORWARD)
    def empty(dtype: torch.dtype) -> torch.Tensor:  # one per absent output: a custom op's outputs must not alias
        return x.new_empty(0, dtype=dtype)

    q8, f32 = rc.forward_dtype, torch.float32
    return (y, xq.qt if x_cols else empty(q8), xq.scale_t if x_cols else empty(f32),
            wq.qt if need_xgrad else empty(q8), wq.scale_t if need_xgrad else empty(f32))


@fp8_linear_fwd.register_fake
def _(x, weight, bias, recipe, out_dtype, need_xgrad, need_wgrad):
    rc = RECIPES[recipe]
    m, k = x.shape
    n = weight.shape[0]
    m16 = padded(m)
    sk = k if rc.rowwise else 1
    q, s = rc.forward_dtype, torch.float32
    x_cols = need_wgrad and not rc.dw_high_precision
    return (x.new_empty(m, n, dtype=out_dtype), x.new_empty((k, m16) if x_cols else (0,), dtype=q),
            x.new_empty((sk,) if x_cols else (0,), dtype=s), x.new_empty((k, n) if need_xgrad else (0,), dtype=q),
            x.new_empty((sk,) if need_xgrad else (0,), dtype=s))


@custom_op("atelier::fp8_linear_bwd")
def fp8_linear_bwd(dy: torch.Tensor, xqt: torch.Tensor, xt_scale: torch.Tensor, wqt: torch.Tensor,
                   wt_scale: torch.Tensor, recipe: str, x_dtype: torch.dtype, w_dtype: torch.dtype,
                   b_dtype: torch.dtype, need_x: bool, need_w: bool, need_b: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy [M, N] → (dX [M, K] in x_dtype, dW [N, K] in w_dtype, d(bias) [N] in b_dtype); unneeded ones empty.
    xqt: x's fp8 copy for dW, or x itself [M, K] for a recipe that takes dW in high precision."""
    rc = RECIPES[recipe]
    dx = dy.new_empty(0, dtype=x_dtype)
    dw = dy.new_empty(0, dtype=w_dtype)
    db = dy.new_empty(0, dtype=b_dtype)
    dy_cols = need_w and not rc.dw_high_precision
    if need_x or dy_cols:
        dq = quantize(dy, rc.grad_dtype, rc.rowwise, rows=need_x, cols=dy_cols, pad_to=PAD)
        if need_x:
            dx = _scaled_mm(dq.q, wqt, dq.scale, wt_scale, rc.rowwise, x_dtype, fast_accum=rc.grad_fast_accum)
        if dy_cols:
            dw = _scaled_mm(dq.qt, xqt, dq.scale_t, xt_scale, rc.rowwise, w_dtype,  # [N, K], contracts M₁₆
                             fast_accum=rc.grad_fast_accum)
    if need_w and rc.dw_high_precision:
        dw = high_precision_dw(dy, xqt, w_dtype)
    if need_b:
        db = dy.sum(0, dtype=torch.float32).to(b_dtype)
    return dx, dw, db


def high_precision_dw(dy: torch.Tensor, x: torch.Tensor, w_dtype: torch.dtype) -> torch.Tensor:
    """dW = dYᵀ x [N, K] in dy's (the compute) dtype, fp32 accumulation, cast to w_dtype: the "-gwhp" recipes'."""
    with autocast_off(dy.device.type):
        return (dy.t() @ x.to(dy.dtype)).to(w_dtype)


@fp8_linear_bwd.register_fake
def _(dy, xqt, xt_scale, wqt, wt_scale, recipe, x_dtype, w_dtype, b_dtype, need_x, need_w, need_b):
    m, n = dy.shape
    k = wqt.shape[0] if need_x else _dw_k(xqt, recipe)
    return (dy.new_empty((m, k) if need_x else (0,), dtype=x_dtype),
            dy.new_empty((n, k) if need_w else (0,), dtype=w_dtype),
            dy.new_empty((n,) if need_b else (0,), dtype=b_dtype))


@custom_op("atelier::fp8_frozen_fwd")
def fp8_frozen_fwd(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   recipe: str, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] (any float dtype) and the frozen W_q [N, K] → y [M, N] in out_dtype."""
    rc = RECIPES[recipe]
    xq = quantize(x, rc.forward_dtype, rc.rowwise)
    return _scaled_mm(xq.q, wq, xq.scale, w_scale, rc.rowwise, out_dtype, bias, FAST_ACCUM_FORWARD)


@fp8_frozen_fwd.register_fake
def _(x, wq, w_scale, bias, recipe, out_dtype):
    return x.new_empty(x.shape[0], wq.shape[0], dtype=out_dtype)


@custom_op("atelier::fp8_frozen_bwd")
def fp8_frozen_bwd(dy: torch.Tensor, wqt: torch.Tensor, wt_scale: torch.Tensor, recipe: str,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """dy [M, N] and the frozen Wᵀ_q [K, N] (per input channel) → dX = dY W [M, K] in out_dtype."""
    rc = RECIPES[recipe]
    dq = quantize(dy, rc.grad_dtype, rc.rowwise)
    return _scaled_mm(dq.q, wqt, dq.scale, wt_scale, rc.rowwise, out_dtype, fast_accum=rc.grad_fast_accum)


@fp8_frozen_bwd.register_fake
def _(dy, wqt, wt_scale, recipe, out_dtype):
    return dy.new_empty(dy.shape[0], wqt.shape[0], dtype=out_dtype)


@custom_op("atelier::fp8_lora_fwd")
def fp8_lora_fwd(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, mask: torch.Tensor | None, p: float,
                 recipe: str, base_dtype: torch.dtype, adapter_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, I] → (y [T, O] = fp8 base + s·(dropout(x) Aᵀ) Bᵀ in base_dtype, u = dropout(x) Aᵀ [T, r])."""
    with autocast_off(x.device.type):
        y = call_op(fp8_frozen_fwd, x, wq, w_scale, bias, recipe, base_dtype)
        u = add_adapter_(y, x, lora_a, lora_b, scale, mask, p, base_dtype, adapter_dtype)
    return y, u


@fp8_lora_fwd.register_fake
def _(x, wq, w_scale, bias, lora_a, lora_b, scale, mask, p, recipe, base_dtype, adapter_dtype):
    return (x.new_empty(x.shape[0], wq.shape[0], dtype=base_dtype),
            x.new_empty(x.shape[0], lora_a.shape[0], dtype=adapter_dtype))


@custom_op("atelier::fp8_lora_bwd")
def fp8_lora_bwd(dy: torch.Tensor, x: torch.Tensor, wqt: torch.Tensor, wt_scale: torch.Tensor, lora_a: torch.Tensor,
                 lora_b: torch.Tensor, u: torch.Tensor, mask: torch.Tensor | None, scale: float, p: float, recipe: str,
                 need_x: bool, need_a: bool, need_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy [T, O] → (dx [T, I] in x.dtype, dA, dB in the adapters' dtypes); unneeded ones empty. No dW."""
    with autocast_off(x.device.type):
        dx_base = call_op(fp8_frozen_bwd, dy, wqt, wt_scale, recipe, dy.dtype) if need_x else None  # dY W, FP8
        return adapter_backward(dy, dx_base, x, lora_a, lora_b, u, mask, scale, p, need_x, need_a, need_b)


@fp8_lora_bwd.register_fake
def _(dy, x, wqt, wt_scale, lora_a, lora_b, u, mask, scale, p, recipe, need_x, need_a, need_b):
    return (torch.empty_like(x) if need_x else x.new_empty(0),
            torch.empty_like(lora_a) if need_a else lora_a.new_empty(0),
            torch.empty_like(lora_b) if need_b else lora_b.new_empty(0))


# FlopCounterMode cannot look inside a custom op: state the matmul FLOPs (2·m·n·k per GEMM; the ops' own inner
# calls are not counted twice, FlopCounterMode counts the outermost op). Tensor arguments arrive as shapes.
@register_flop_formula(torch.ops.atelier.fp8_linear_fwd)
def _fwd_flops(x, weight, *args, out_shape=None, **kwargs) -> int:
    return 2 * x[0] * x[1] * weight[0]


@register_flop_formula(torch.ops.atelier.fp8_linear_bwd)
def _bwd_flops(dy, xqt, xt_scale, wqt, wt_scale, recipe, x_dtype, w_dtype, b_dtype, need_x, need_w, need_b,
               out_shape=None, **kwargs) -> int:
    k = wqt[0] if need_x else _dw_k(xqt, recipe)  # K from whichever saved copy exists
    return 2 * dy[0] * dy[1] * k * (int(need_x) + int(need_w))


def _dw_k(saved_x, recipe: str) -> int:
    """K from what dW reads: xᵀ_q [K, M₁₆], or x [M, K] itself for a high-precision dW (a shape or a tensor)."""
    shape = getattr(saved_x, "shape", saved_x)
    return shape[1] if RECIPES[recipe].dw_high_precision else shape[0]


@register_flop_formula(torch.ops.atelier.fp8_frozen_fwd)
def _frozen_fwd_flops(x, wq, *args, out_shape=None, **kwargs) -> int:
    return 2 * x[0] * x[1] * wq[0]


@register_flop_formula(torch.ops.atelier.fp8_frozen_bwd)
def _frozen_bwd_flops(dy, wqt, *args, out_shape=None, **kwargs) -> int:
    return 2 * dy[0] * dy[1] * wqt[0]


@register_flop_formula(torch.ops.atelier.fp8_lora_fwd)
def _lora_fwd_flops(x, wq, w_scale, bias, lora_a, lora_b, *args, out_shape=None, **kwargs) -> int:
    (t, i), o, r = x, wq[0], lora_a[0]
    return 2 * t * i * o + 2 * t * i * r + 2 * t * r * o


@register_flop_formula(torch.ops.atelier.fp8_lora_bwd)
def _lora_bwd_flops(dy, x, wqt, wt_scale, lora_a, lora_b, u, mask, scale, p, recipe, need_x, need_a, need_b,
                    out_shape=None, **kwargs) -> int:
    (t, i), o, r = x, dy[1], lora_a[0]
    flops = 2 * t * o * r if (need_x or need_a) else 0  # g = s·dy B
    flops += 2 * o * t * r if need_b else 0  # dB
    flops += 2 * r * t * i if need_a else 0  # dA
    flops += 2 * t * o * i + 2 * t * r * i if need_x else 0  # dy W (FP8) + g A
    return flops


# --- autograd.Function ----------------------------------------------------------------------------
class Float8LinearFunction(torch.autograd.Function):
    """x [M, K], weight [N, K] (trainable), bias [N] | None, recipe, out_dtype → y [M, N]."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: str, out_dtype: torch.dtype):  # noqa: D102
        need_x, need_w = ctx.needs_input_grad[:2]
        y, xqt, xt_scale, wqt, wt_scale = call_op(fp8_linear_fwd, x, weight, bias, recipe, out_dtype, need_x, need_w)
        if need_w and RECIPES[recipe].dw_high_precision:
            xqt = x  # dW in high precision reads x itself
        ctx.save_for_backward(xqt, xt_scale, wqt, wt_scale)
        ctx.recipe, ctx.dtypes = recipe, (x.dtype, weight.dtype, bias.dtype if bias is not None else weight.dtype)
        ctx.out_dtype = out_dtype
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        xqt, xt_scale, wqt, wt_scale = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx, dw, db = call_op(fp8_linear_bwd, dy.to(ctx.out_dtype).contiguous(), xqt, xt_scale, wqt, wt_scale,
                             ctx.recipe, *ctx.dtypes, need_x, need_w, need_b)
        return (dx if need_x else None), (dw if need_w else None), (db if need_b else None), None, None


class Fp8FrozenLinearFunction(torch.autograd.Function):
    """x [M, K], the frozen W's fp8 copies, bias [N] | None (frozen), recipe, out_dtype → y [M, N]; dX only."""

    @staticmethod
    def forward(ctx, x, wq, w_scale, wqt, wt_scale, bias, recipe: str, out_dtype: torch.dtype):  # noqa: D102
        y = call_op(fp8_frozen_fwd, x, wq, w_scale, bias, recipe, out_dtype)
        ctx.save_for_backward(wqt, wt_scale)
        ctx.recipe, ctx.x_dtype, ctx.out_dtype = recipe, x.dtype, out_dtype
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        wqt, wt_scale = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = call_op(fp8_frozen_bwd, dy.to(ctx.out_dtype).contiguous(), wqt, wt_scale, ctx.recipe, ctx.x_dtype)
        return dx, None, None, None, None, None, None, None


class Fp8FrozenLoRAFunction(torch.autograd.Function):
    """x [T, I], the frozen W's fp8 copies, bias | None, lora_a [r, I], lora_b [O, r], scale, mask, p, recipe → y."""

    @staticmethod
    def forward(ctx, x, wq, w_scale, wqt, wt_scale, bias, lora_a, lora_b, scale: float, mask, p: float,
                recipe: str):  # noqa: D102
        cb, ca = _compute_dtypes(x, lora_a)
        y, u = call_op(fp8_lora_fwd, x, wq, w_scale, bias, lora_a, lora_b, scale, mask, p, recipe, cb, ca)
        ctx.save_for_backward(x, wqt, wt_scale, lora_a, lora_b, u, mask)
        ctx.scale, ctx.p, ctx.recipe, ctx.base_dtype = scale, p, recipe, cb
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, wqt, wt_scale, lora_a, lora_b, u, mask = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[6], ctx.needs_input_grad[7]
        dx, da, db = call_op(fp8_lora_bwd, dy.to(ctx.base_dtype).contiguous(), x, wqt, wt_scale, lora_a, lora_b, u,
                                  mask, ctx.scale, ctx.p, ctx.recipe, need_x, need_a, need_b)
        return ((dx if need_x else None), None, None, None, None, None, (da if need_a else None),
                (db if need_b else None), None, None, None, None)


# --- public ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fp8FrozenWeight:
    """A frozen weight's two fp8 copies (quantize_frozen_weight), made once and reused every step."""

    recipe: str
    q: torch.Tensor  # [N, K]: per output channel (rowwise) or per tensor, for y = x Wᵀ
    scale: torch.Tensor  # [N] or [1] fp32
    qt: torch.Tensor  # [K, N]: W per input channel (rowwise) or the transposed copy, for dX = dY W
    scale_t: torch.Tensor  # [K] or [1] fp32


def quantize_frozen_weight(weight: torch.Tensor, recipe: str) -> Fp8FrozenWeight:
    """W [N, K] → both fp8 copies a frozen base needs, from one pair of passes over W (no autograd)."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8: recipe must be one of {list(RECIPES)}, got {recipe!r}")
    rc = RECIPES[recipe]
    with torch.no_grad():
        wq = quantize(weight.detach(), rc.forward_dtype, rc.rowwise, rows=True, cols=True)
    # tensorwise: one scale for both; a copy, as dynamo cannot trace a Function given one tensor twice
    scale_t = wq.scale_t.clone() if wq.scale_t is wq.scale else wq.scale_t
    return Fp8FrozenWeight(recipe, wq.q, wq.scale, wq.qt, scale_t)


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores (CUDA compute capability >= 8.9). The CPU runs the reference."""
    return device.type != "cuda" or _capability(device.index) >= MIN_CAPABILITY


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_fp8_device(device: torch.device) -> None:
    """Raise Fp8UnsupportedError, naming the config key and the device, where FP8 tensor cores are missing."""
    device = torch.device(device)
    if fp8_supported(device):
        return
    major, minor = _capability(device.index)
    raise Fp8UnsupportedError(
        f"{PRECISION_KEY} needs FP8 tensor cores (CUDA compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: "
        f"Ada, Hopper or newer); {device} ({torch.cuda.get_device_name(device)}) has compute capability "
        f"{major}.{minor}. Use train.precision = \"bf16\" on this GPU.")


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def fp8_copies_used(impl: str, weight: torch.Tensor) -> bool:
    """Whether a frozen weight's fp8 copies (quantize_frozen_weight, a Triton pass) are read: by the fast path only,
    which "auto" takes on CUDA; the reference path (a CPU, impl "ref") quantises in fp32 from the weight itself."""
    return impl != "ref" and (impl != "auto" or weight.is_cuda)


def _use_scaled_mm(impl: str, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The fast path, unless asked for the reference or the shape does not fit _scaled_mm (K, N multiples of 16)."""
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        return False
    n, k = weight.shape
    if k % PAD or n % PAD:
        return False
    if x.is_cuda and not torch.compiler.is_compiling():
        check_fp8_device(x.device)
    return True


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"fp8 linear: impl must be one of {IMPLS}, got {impl!r}")
    if recipe not in RECIPES:
        raise ValueError(f"fp8 linear: recipe must be one of {list(RECIPES)}, got {recipe!r}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"fp8 linear: expected x [..., K], weight [N, K], bias [N]; got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}, bias {None if bias is None else tuple(bias.shape)}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "rowwise",
               impl: str = "auto") -> torch.Tensor:
    """y = x Wᵀ + b with both operands and every gradient GEMM in FP8 (trainable W). x [..., K] → [..., N]."""
    _check(x, weight, bias, recipe, impl)
    lead, k = x.shape[:-1], x.shape[-1]
    x2, out_dtype = x.reshape(-1, k), _out_dtype(x)
    if _use_scaled_mm(impl, x, weight):
        y = Float8LinearFunction.apply(x2, weight, bias, recipe, out_dtype)
    else:
        y = _Fp8LinearRef.apply(x2, weight, bias, recipe).to(out_dtype)
    return y.view(*lead, weight.shape[0])


def fp8_frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, frozen: Fp8FrozenWeight | None,
                      recipe: str = "rowwise", impl: str = "auto") -> torch.Tensor:
    """x Wᵀ + b over a frozen W whose fp8 copies `frozen` holds (quantize_frozen_weight; None: the reference path
    only). dX through FP8, no dW. x [..., K] → [..., N]."""
    _check(x, weight, bias, recipe, impl)
    lead, k = x.shape[:-1], x.shape[-1]
    x2, out_dtype = x.reshape(-1, k), _out_dtype(x)
    if _use_scaled_mm(impl, x, weight):
        _check_frozen(frozen, weight, recipe)
        y = Fp8FrozenLinearFunction.apply(x2, frozen.q, frozen.scale, frozen.qt, frozen.scale_t, bias, recipe,
                                          out_dtype)
    else:
        y = _Fp8FrozenRef.apply(x2, weight, bias, recipe).to(out_dtype)
    return y.view(*lead, weight.shape[0])


def fp8_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, frozen: Fp8FrozenWeight | None,
                    lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, dropout: float = 0.0,
                    recipe: str = "rowwise", impl: str = "auto") -> torch.Tensor:
    """fp8_frozen_linear(x, W, b) + scale · (dropout(x) Aᵀ) Bᵀ, the adapter as kernels.lora_linear computes it.

    x [..., I] → [..., O] in the base compute dtype. `dropout` is the probability applied now (0 in eval).
    """
    _check(x, weight, bias, recipe, impl)
    if lora_a.dim() != 2 or lora_a.shape[1] != weight.shape[1] or lora_b.shape != (weight.shape[0], lora_a.shape[0]):
        raise ValueError(f"fp8 lora linear: expected lora_a [r, I], lora_b [O, r] for weight {tuple(weight.shape)}; "
                         f"got {tuple(lora_a.shape)}, {tuple(lora_b.shape)}")
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("fp8 lora linear: the base weight and bias must be frozen (requires_grad=False)")
    lead, i = x.shape[:-1], x.shape[-1]
    mask = dropout_mask(x, dropout)
    x2, m2 = x.reshape(-1, i), None if mask is None else mask.reshape(-1, i)
    if _use_scaled_mm(impl, x, weight):
        _check_frozen(frozen, weight, recipe)
        y = Fp8FrozenLoRAFunction.apply(x2, frozen.q, frozen.scale, frozen.qt, frozen.scale_t, bias, lora_a, lora_b,
                                        float(scale), m2, float(dropout), recipe)
    else:
        y = fp8_lora_linear_ref(x2, weight, bias, lora_a, lora_b, scale, m2, dropout, recipe)
    return y.view(*lead, weight.shape[0])


def _check_frozen(frozen: Fp8FrozenWeight | None, weight: torch.Tensor, recipe: str) -> None:
    if frozen is None or frozen.recipe != recipe or frozen.q.shape != weight.shape or frozen.q.device != weight.device:
        got = None if frozen is None else (frozen.recipe, tuple(frozen.q.shape), str(frozen.q.device))
        raise ValueError(f"fp8 frozen linear: needs the weight's fp8 copies "
                         f"(quantize_frozen_weight(weight, {recipe!r})) for weight {tuple(weight.shape)} on "
                         f"{weight.device}; got {got}")


# --- reference ------------------------------------------------------------------------------------
class _Fp8LinearRef(torch.autograd.Function):
    """Fake-quantised trainable linear in fp32: the FP8 GEMMs' operands (same recipe), dequantised → y fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: str):  # noqa: D102
        rc = RECIPES[recipe]
        with torch.autocast(x.device.type, enabled=False):
            y = fake_quantize(x, rc.forward_dtype, rc.rowwise) @ fake_quantize(weight, rc.forward_dtype, rc.rowwise).t()
            if bias is not None:
                y = y + bias.float()
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.has_bias = recipe, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, weight = ctx.saved_tensors
        rc = RECIPES[ctx.recipe]
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:  # contracts N: dY per row, W per input channel (its columns)
                dx = (fake_quantize(dy, rc.grad_dtype, rc.rowwise)
                      @ fake_quantize(weight, rc.forward_dtype, rc.rowwise, dim=0)).to(x.dtype)
            if ctx.needs_input_grad[1] and rc.dw_high_precision:  # dYᵀ x, nothing quantised
                dw = (dy.float().t() @ x.float()).to(weight.dtype)
            elif ctx.needs_input_grad[1]:  # contracts M: dY per output channel, x per input channel (both columns)
                dw = (fake_quantize(dy, rc.grad_dtype, rc.rowwise, dim=0).t()
                      @ fake_quantize(x, rc.forward_dtype, rc.rowwise, dim=0)).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None


class _Fp8FrozenRef(torch.autograd.Function):
    """Fake-quantised frozen linear in fp32 (no dW): y = q(x) q(W)ᵀ (+ b); dX = q(dY) q(W per input channel)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: str):  # noqa: D102
        rc = RECIPES[recipe]
        with torch.autocast(x.device.type, enabled=False):
            y = fake_quantize(x, rc.forward_dtype, rc.rowwise) @ fake_quantize(weight, rc.forward_dtype, rc.rowwise).t()
            if bias is not None:
                y = y + bias.float()
        ctx.save_for_backward(weight)
        ctx.recipe, ctx.x_dtype = recipe, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        (weight,) = ctx.saved_tensors
        rc = RECIPES[ctx.recipe]
        dx = None
        if ctx.needs_input_grad[0]:
            with torch.autocast(dy.device.type, enabled=False):
                dx = (fake_quantize(dy, rc.grad_dtype, rc.rowwise)
                      @ fake_quantize(weight, rc.forward_dtype, rc.rowwise, dim=0)).to(ctx.x_dtype)
        return dx, None, None, None


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   recipe: str = "rowwise") -> torch.Tensor:
    """The reference of fp8_linear: fake quantisation in fp32, cast to the compute dtype. x [..., K] → [..., N]."""
    return fp8_linear(x, weight, bias, recipe, impl="ref")


def fp8_lora_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                        lora_b: torch.Tensor, scale: float, mask: torch.Tensor | None = None, p: float = 0.0,
                        recipe: str = "rowwise") -> torch.Tensor:
    """Fake-quantised frozen base + kernels.lora_linear's fp32 adapter term, summed in fp32, cast once to the base
    compute dtype. mask: the bool keep-mask of dropout (None for p = 0)."""
    out_dtype = _compute_dtypes(x, lora_a)[0]
    with torch.autocast(x.device.type, enabled=False):
        y = _Fp8FrozenRef.apply(x, weight, bias, recipe) + lora_adapter_ref(x, lora_a, lora_b, scale, mask, p)
    return y.to(out_dtype)
