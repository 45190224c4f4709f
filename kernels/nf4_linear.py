"""Linear layers over a frozen NF4 weight (QLoRA): fused kernels that dequantise each 4-bit tile inside the matmul,
and, for training-sized inputs, one dequantisation into a transient buffer before cuBLAS (the paths below).

Shapes: M rows (tokens; leading dims flattened), K in-features (a multiple of 64), N out-features, r rank.
  x [M, K], W [N, K] as kernels/nf4.py's NF4Weight (Ŵ its dequantised values), bias [N] | None (frozen).

Frozen linear (nf4_linear):  y = x Ŵᵀ + b;  backward dX = dY Ŵ only (no dW, no d(bias)).
LoRA over it (nf4_lora_linear): y = x Ŵᵀ + b + s · (dropout(x) Aᵀ) Bᵀ, with A [r, I], B [O, r] trained. The adapter
runs through kernels/lora_linear.py's own code (add_adapter_ / adapter_backward): u = dropout(x) Aᵀ saved for dB,
g = s · dY B, dA = gᵀ dropout(x), dB = s · dYᵀ u, dX = dY Ŵ + (g A) ∘ mask. So the numbers are lora_linear's with W
replaced by Ŵ, and the adapter's dtypes follow the same rule (autocast's, else the base in x.dtype and the adapter
in A's dtype).
Saved for backward: x, the dropout mask (bool, only with dropout), u, and the NF4 tensors themselves (no copies);
Ŵ is rebuilt tile by tile in the backward as in the forward.

The two Triton kernels (both read W's packed bytes, int8 block scalers, group factors, mean and code table):
  _nf4_xwt_kernel  y [BM, BN] tiles:  for each K-block of BK (a multiple of 64, so whole NF4 blocks): load x
                   [BM, BK], load W's bytes [BN, BK/2], split each byte into its two code indices (high nibble:
                   the even column), look both up in the 16-entry code table, scale every block of 64 by its
                   s_b = d(d(q_b / f_g) + mean), round to W's dtype d, and tl.dot(x, Ŵ_tileᵀ) into an fp32 accumulator.
  _nf4_dyw_kernel  dX [BM, BK] tiles: the same dequantisation of W [BN, BK] per N-block of BN, tl.dot(dY, Ŵ_tile).
Ŵ's values are bit for bit kernels/nf4.py's dequantize_nf4 (same roundings, q / f correctly rounded by div_rn);
the products accumulate in fp32 in the kernels' order, so a kernel differs from dequantise-then-matmul only by
the order of an fp32 sum of K (or N) terms, then one rounding to the output dtype.
Regimes, and the two paths of nf4_matmul / nf4_matmul_t (argument `path`):
  "fused"  the kernels above. In decoding (M ≤ 64) they are bound by reading W (0.52 bytes per element instead of
           2): small BM (16, 32) and long BK stream it once, and nothing beats not writing Ŵ anywhere.
  "dense"  _nf4_dequant_kernel writes Ŵ [N, K] once into a transient buffer in W's dtype (the same _dequant_tile,
           so the same values bit for bit), then cuBLAS multiplies; the buffer is freed when the op returns, so the
           memory cost is one layer's Ŵ at a time (Qwen3-8B's largest, 12288 × 4096 in bf16: 100 MB), never the
           model's. In training M is thousands: the fused kernel dequantises every W tile once per M tile (M / BM
           times) and its mainloop interleaves table lookups with the tensor-core work, while writing Ŵ once costs
           2 bytes per weight, far below M multiply-adds per weight.
  "auto"   dense on CUDA from DENSE_MIN_M rows up, fused below and on the CPU. Measured on an H200 at Qwen3-8B's
           shapes (bench/results/nf4-linear-2026-12-04): from 64 rows the dense path is 1.3–3.6× faster than the
           fused kernels (2–3.6× from 1024 rows, within 3–12% of the bf16 weight there) except the k/v dX product
           at 64–512 rows (0.83–0.97×); below 64 rows both are bound by launches and the fused kernels keep the
           transient buffer away.
fp32 operands (exact CPU runs, parity tests) multiply with input_precision "ieee" (no TF32).

Implementations (argument `impl`): "triton" (any device; the CPU through TRITON_INTERPRET=1), "ref" (dequantise with
kernels/nf4.py's dequantize_nf4, then the fp32 reference of kernels/lora_linear.py, differentiated by autograd),
"auto" (triton on CUDA, ref elsewhere). The forward and backward are torch.library custom ops: torch.compile keeps
them opaque, and FlopCounterMode and selective activation checkpointing see them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.utils.flop_counter import register_flop_formula

from atelier_studio.kernels.custom_op import call_op, custom_op
from atelier_studio.kernels.fp8_linear import autocast_off
from atelier_studio.kernels.lora_linear import (
    _compute_dtypes,
    adapter_backward,
    add_adapter_,
    dropout_mask,
    lora_bwd_flops,
    lora_fwd_flops,
    lora_linear_ref,
)
from atelier_studio.kernels.nf4 import BLOCK, NF4Weight, dequantize_nf4, nf4_supported

IMPLS = ("auto", "triton", "ref")
PATHS = ("auto", "fused", "dense")
DENSE_MIN_M = 64  # rows from which "auto" takes the dense path: measured faster there on an H200 (bench/nf4_linear.py)


def _configs(kind: str) -> list[triton.Config]:
    """Launch candidates: one small tile under the interpreter; on CUDA training tiles and decoding tiles."""
    if not torch.cuda.is_available():
        return [triton.Config({"BM": 16, "BN": 32, "BK": 64}, num_warps=4, num_stages=1)]
    # (BM, BN, BK, warps, stages): BK (the reduction for xWᵀ, the output width for dY·W) a multiple of 64
    tiles = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3),
             (64, 128, 128, 4, 4), (128, 64, 128, 4, 4),  # training
             (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (32, 64, 256, 4, 3), (64, 64, 128, 4, 4)]  # decoding
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bm, bn, bk, w, s in tiles]


def _prune(configs, named_args, **kwargs):
    """Keep the tiles that fit: BK must divide K (no masks along K), and decoding tiles only for small M."""
    k, m_bucket = named_args["K"], named_args["M_BUCKET"]
    keep = [c for c in configs if k % c.kwargs["BK"] == 0 and (c.kwargs["BM"] >= 64) == (m_bucket > 64)]
    return keep or [c for c in configs if k % c.kwargs["BK"] == 0][:1]


# --- Triton kernels -------------------------------------------------------------------------------
@triton.jit
def _dequant_tile(data_ptr, scalers_ptr, factor_ptr, mean, code_ptr, rows, row_mask, k0, K,
                  BR: tl.constexpr, BC: tl.constexpr):
    """Ŵ[rows, k0 : k0 + BC] as a [BR, BC] tile in W's dtype (k0 and BC multiples of 64; masked rows finite)."""
    wdt = code_ptr.dtype.element_ty
    r64 = rows.to(tl.int64)
    half = tl.arange(0, BC // 2)
    packed = tl.load(data_ptr + r64[:, None] * (K // 2) + (k0 // 2 + half)[None, :], mask=row_mask[:, None],
                     other=0)  # [BR, BC/2] uint8
    high = tl.load(code_ptr + (packed >> 4).to(tl.int32)).to(tl.float32)  # the even columns
    low = tl.load(code_ptr + (packed & 15).to(tl.int32)).to(tl.float32)  # the odd columns
    levels = tl.reshape(tl.join(high, low), (BR, BC))  # [BR, BC/2, 2] → interleaved columns
    NB: tl.constexpr = BC // 64
    block = r64[:, None] * (K // 64) + (k0 // 64 + tl.arange(0, NB))[None, :]  # [BR, NB] block ids
    q = tl.load(scalers_ptr + block, mask=row_mask[:, None], other=0).to(tl.float32)
    f = tl.load(factor_ptr + block // 256, mask=row_mask[:, None], other=1.0).to(tl.float32)
    s = tl.math.div_rn(q, f).to(wdt).to(tl.float32) + mean  # d(d(q / f) + mean), as dequantize_nf4
    s = s.to(wdt).to(tl.float32)
    w = tl.reshape(levels, (BR, NB, 64)) * s[:, :, None]
    return tl.reshape(w, (BR, BC)).to(wdt)


@triton.jit
def _grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program id → (m tile, n tile), GROUP_M tiles down before moving right (the W tiles stay in L2)."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.autotune(configs=_configs("xwt"), key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _nf4_xwt_kernel(x_ptr, data_ptr, scalers_ptr, factor_ptr, mean_ptr, code_ptr, bias_ptr, y_ptr, M, N, K, M_BUCKET,
                    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), 8)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = rm < M, rn < N
    mean = tl.load(mean_ptr).to(tl.float32)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + tl.arange(0, BK)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)  # [BM, BK]
        w = _dequant_tile(data_ptr, scalers_ptr, factor_ptr, mean, code_ptr, rn, n_mask, k0, K, BN, BK)  # [BN, BK]
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.autotune(configs=_configs("dyw"), key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _nf4_dyw_kernel(dy_ptr, data_ptr, scalers_ptr, factor_ptr, mean_ptr, code_ptr, dx_ptr, M, N, K, M_BUCKET,
                    PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = _grouped_tile(tl.program_id(0), tl.cdiv(M, BM), K // BK, 8)
    rm = pid_m * BM + tl.arange(0, BM)
    k0 = pid_k * BK
    m_mask = rm < M
    mean = tl.load(mean_ptr).to(tl.float32)
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for n0 in range(0, N, BN):
        rn = n0 + tl.arange(0, BN)
        n_mask = rn < N
        dy = tl.load(dy_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], mask=m_mask[:, None] & n_mask[None, :],
                     other=0.0)  # [BM, BN]
        w = _dequant_tile(data_ptr, scalers_ptr, factor_ptr, mean, code_ptr, rn, n_mask, k0, K, BN, BK)  # [BN, BK]
        acc = tl.dot(dy, w.to(dy.dtype), acc, input_precision=PRECISION)
    tl.store(dx_ptr + rm[:, None].to(tl.int64) * K + (k0 + tl.arange(0, BK))[None, :],
             acc.to(dx_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def _nf4_dequant_kernel(data_ptr, scalers_ptr, factor_ptr, mean_ptr, code_ptr, out_ptr, N, K, G,
                        BR: tl.constexpr, BC: tl.constexpr):
    """out[e, rows, k0 : k0 + BC] = Ŵ tile of matrix e (the "dense" path's transient weight; e > 0 only for a
    stack of matrices quantised each on its own, kernels/nf4_moe.py's experts: its own mean and G group factors)."""
    e = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    k0 = tl.program_id(1) * BC
    row_mask = rows < N
    mean = tl.load(mean_ptr + e).to(tl.float32)
    w = _dequant_tile(data_ptr + e * N * (K // 2), scalers_ptr + e * N * (K // 64), factor_ptr + e * G, mean, code_ptr,
                      rows, row_mask, k0, K, BR, BC)
    tl.store(out_ptr + e * N * K + rows[:, None].to(tl.int64) * K + (k0 + tl.arange(0, BC))[None, :], w,
             mask=row_mask[:, None])


# --- launchers ------------------------------------------------------------------------------------
def nf4_dequantize(data: torch.Tensor, scalers: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor,
                   code: torch.Tensor) -> torch.Tensor:
    """Ŵ [E…, N, K] in W's dtype (code.dtype) from data [E…, N, K/2]: kernels/nf4.py's dequantize_nf4 in one Triton
    pass; a leading dim E is a stack of matrices quantised each on its own (factor [E, G], mean [E])."""
    *lead, n, half = data.shape
    k, e = 2 * half, math.prod(lead)
    out = torch.empty(*lead, n, k, dtype=code.dtype, device=data.device)
    if n and e:
        br, bc = (32, 64) if not data.is_cuda else (32, 256 if k % 256 == 0 else 64)
        _nf4_dequant_kernel[(triton.cdiv(n, br), k // bc, e)](data, scalers, factor, mean, code, out, n, k,
                                                             factor.shape[-1], BR=br, BC=bc, num_warps=4)
    return out


def _dense(x: torch.Tensor, path: str) -> bool:
    if path not in PATHS:
        raise ValueError(f"nf4 matmul: path must be one of {PATHS}, got {path!r}")
    return path == "dense" or (path == "auto" and x.is_cuda and x.shape[0] >= DENSE_MIN_M)


def _m_bucket(m: int) -> int:
    return 1 << max(4, (m - 1).bit_length())  # the next power of two, at least 16: the tuning key


def _precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # fp32 exactly (no TF32); 16-bit operands have one choice


def nf4_matmul(x: torch.Tensor, data: torch.Tensor, scalers: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor,
               code: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
               path: str = "auto") -> torch.Tensor:
    """x [M, K] (the compute dtype) · Ŵᵀ (+ bias) → y [M, N] in out_dtype; `path` as the module docstring says."""
    m, k = x.shape
    n = data.shape[0]
    if data.shape != (n, k // 2) or k % BLOCK:
        raise ValueError(f"nf4_matmul: x [M, K] with K % {BLOCK} == 0 and data [N, K/2]; got x {tuple(x.shape)}, "
                         f"data {tuple(data.shape)}")
    x = x.contiguous()
    if _dense(x, path):
        w = nf4_dequantize(data, scalers, factor, mean, code).to(x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype)).to(out_dtype)
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return y

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

    _nf4_xwt_kernel[grid](x, data, scalers, factor, mean, code, bias if bias is not None else x, y, m, n, k,
                          _m_bucket(m), HAS_BIAS=bias is not None, PRECISION=_precision(x.dtype))
    return y


def nf4_matmul_t(dy: torch.Tensor, data: torch.Tensor, scalers: torch.Tensor, factor: torch.Tensor,
                 mean: torch.Tensor, code: torch.Tensor, out_dtype: torch.dtype, path: str = "auto") -> torch.Tensor:
    """dY [M, N] (the compute dtype) · Ŵ → dX [M, K] in out_dtype; `path` as the module docstring says."""
    m, n = dy.shape
    k = 2 * data.shape[1]
    if data.shape[0] != n or k % BLOCK:
        raise ValueError(f"nf4_matmul_t: dY [M, N] and data [N, K/2] with K % {BLOCK} == 0; got dY {tuple(dy.shape)}, "
                         f"data {tuple(data.shape)}")
    dy = dy.contiguous()
    if _dense(dy, path):
        return (dy @ nf4_dequantize(data, scalers, factor, mean, code).to(dy.dtype)).to(out_dtype)
    dx = torch.empty(m, k, dtype=out_dtype, device=dy.device)
    if m == 0:
        return dx

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * (k // meta["BK"]),)

    _nf4_dyw_kernel[grid](dy, data, scalers, factor, mean, code, dx, m, n, k, _m_bucket(m),
                          PRECISION=_precision(dy.dtype))
    return dx


# torch.library custom ops (bodies called directly in eager, through the dispatcher under compile or a dispatch
# mode: kernels/custom_op.py's call_op). Absent outputs are empty tensors.
@custom_op("atelier::nf4_linear_fwd")
def nf4_linear_fwd(x: torch.Tensor, data: torch.Tensor, scalers: torch.Tensor, factor: torch.Tensor,
                   mean: torch.Tensor, code: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] → y = x Ŵᵀ + b [M, N] in out_dtype."""
    with autocast_off(x.device.type):
        return nf4_matmul(x.to(out_dtype), data, scalers, factor, mean, code, bias, out_dtype)


@nf4_linear_fwd.register_fake
def _(x, data, scalers, factor, mean, code, bias, out_dtype):
    return x.new_empty(x.shape[0], data.shape[0], dtype=out_dtype)


@custom_op("atelier::nf4_linear_bwd")
def nf4_linear_bwd(dy: torch.Tensor, data: torch.Tensor, scalers: torch.Tensor, factor: torch.Tensor,
                   mean: torch.Tensor, code: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dY [M, N] → dX = dY Ŵ [M, K] in out_dtype (the frozen Ŵ gets no gradient)."""
    with autocast_off(dy.device.type):
        return nf4_matmul_t(dy, data, scalers, factor, mean, code, out_dtype)


@nf4_linear_bwd.register_fake
def _(dy, data, scalers, factor, mean, code, out_dtype):
    return dy.new_empty(dy.shape[0], 2 * data.shape[1], dtype=out_dtype)


@custom_op("atelier::nf4_lora_fwd")
def nf4_lora_fwd(x: torch.Tensor, data: torch.Tensor, scalers: torch.Tensor, factor: torch.Tensor,
                 mean: torch.Tensor, code: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                 lora_b: torch.Tensor, scale: float, mask: torch.Tensor | None, p: float, base_dtype: torch.dtype,
                 adapter_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, I] → (y [T, O] = x Ŵᵀ + b + s·(dropout(x) Aᵀ) Bᵀ in base_dtype, u = dropout(x) Aᵀ [T, r])."""
    with autocast_off(x.device.type):
        y = nf4_matmul(x.to(base_dtype), data, scalers, factor, mean, code, bias, base_dtype)
        u = add_adapter_(y, x, lora_a, lora_b, scale, mask, p, base_dtype, adapter_dtype)
    return y, u


@nf4_lora_fwd.register_fake
def _(x, data, scalers, factor, mean, code, bias, lora_a, lora_b, scale, mask, p, base_dtype, adapter_dtype):
    return (x.new_empty(x.shape[0], data.shape[0], dtype=base_dtype),
            x.new_empty(x.shape[0], lora_a.shape[0], dtype=adapter_dtype))


@custom_op("atelier::nf4_lora_bwd")
def nf4_lora_bwd(dy: torch.Tensor, x: torch.Tensor, data: torch.Tensor, scalers: torch.Tensor, factor: torch.Tensor,
                 mean: torch.Tensor, code: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, u: torch.Tensor,
                 mask: torch.Tensor | None, scale: float, p: float, need_x: bool, need_a: bool,
                 need_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy [T, O] → (dx [T, I] in x.dtype, dA, dB in the adapters' dtypes); unneeded ones empty. No dW."""
    with autocast_off(x.device.type):
        dx_base = nf4_matmul_t(dy, data, scalers, factor, mean, code, dy.dtype) if need_x else None  # dY Ŵ
        return adapter_backward(dy, dx_base, x, lora_a, lora_b, u, mask, scale, p, need_x, need_a, need_b)


@nf4_lora_bwd.register_fake
def _(dy, x, data, scalers, factor, mean, code, lora_a, lora_b, u, mask, scale, p, need_x, need_a, need_b):
    return (torch.empty_like(x) if need_x else x.new_empty(0),
            torch.empty_like(lora_a) if need_a else lora_a.new_empty(0),
            torch.empty_like(lora_b) if need_b else lora_b.new_empty(0))


# FlopCounterMode cannot look inside a custom op: the matmul FLOPs, 2·m·n·k each (the dequantisation is overhead,
# never counted). Tensor arguments arrive as shapes.
@register_flop_formula(torch.ops.atelier.nf4_linear_fwd)
def _linear_fwd_flops(x, data, *args, out_shape=None, **kwargs) -> int:
    return 2 * x[0] * x[1] * data[0]


@register_flop_formula(torch.ops.atelier.nf4_linear_bwd)
def _linear_bwd_flops(dy, data, *args, out_shape=None, **kwargs) -> int:
    return 2 * dy[0] * dy[1] * 2 * data[1]


@register_flop_formula(torch.ops.atelier.nf4_lora_fwd)
def _lora_fwd_flops(x, data, scalers, factor, mean, code, bias, lora_a, *args, out_shape=None, **kwargs) -> int:
    (t, i), o, r = x, data[0], lora_a[0]
    return lora_fwd_flops(t, i, o, r)


@register_flop_formula(torch.ops.atelier.nf4_lora_bwd)
def _lora_bwd_flops(dy, x, data, scalers, factor, mean, code, lora_a, lora_b, u, mask, scale, p, need_x, need_a,
                    need_b, out_shape=None, **kwargs) -> int:
    (t, i), o, r = x, dy[1], lora_a[0]
    return lora_bwd_flops(t, i, o, r, need_x, need_a, need_b)


# --- autograd.Function ----------------------------------------------------------------------------
class NF4LinearFunction(torch.autograd.Function):
    """x [M, K], the NF4 tensors of W [N, K], bias [N] | None (frozen), out_dtype → y [M, N]; dX only."""

    @staticmethod
    def forward(ctx, x, data, scalers, factor, mean, code, bias, out_dtype: torch.dtype):  # noqa: D102
        y = call_op(nf4_linear_fwd, x, data, scalers, factor, mean, code, bias, out_dtype)
        ctx.save_for_backward(data, scalers, factor, mean, code)
        ctx.x_dtype, ctx.out_dtype = x.dtype, out_dtype
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        dx = None
        if ctx.needs_input_grad[0]:
            dx = call_op(nf4_linear_bwd, dy.to(ctx.out_dtype).contiguous(), *ctx.saved_tensors, ctx.x_dtype)
        return dx, None, None, None, None, None, None, None


class NF4LoRAFunction(torch.autograd.Function):
    """x [T, I], the NF4 tensors of W [O, I], bias | None, lora_a [r, I], lora_b [O, r], scale, mask, p → y [T, O]."""

    @staticmethod
    def forward(ctx, x, data, scalers, factor, mean, code, bias, lora_a, lora_b, scale: float, mask,
                p: float):  # noqa: D102
        cb, ca = _compute_dtypes(x, lora_a)
        y, u = call_op(nf4_lora_fwd, x, data, scalers, factor, mean, code, bias, lora_a, lora_b, scale, mask, p, cb,
                       ca)
        ctx.save_for_backward(x, data, scalers, factor, mean, code, lora_a, lora_b, u, mask)
        ctx.scale, ctx.p, ctx.base_dtype = scale, p, cb
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, data, scalers, factor, mean, code, lora_a, lora_b, u, mask = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[7], ctx.needs_input_grad[8]
        dx, da, db = call_op(nf4_lora_bwd, dy.to(ctx.base_dtype).contiguous(), x, data, scalers, factor, mean, code,
                             lora_a, lora_b, u, mask, ctx.scale, ctx.p, need_x, need_a, need_b)
        return ((dx if need_x else None), None, None, None, None, None, None, (da if need_a else None),
                (db if need_b else None), None, None, None)


# --- public ---------------------------------------------------------------------------------------
def _parts(w: NF4Weight) -> tuple[torch.Tensor, ...]:
    return w.data, w.scalers, w.factor, w.mean, w.code


def _check(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"nf4 linear: impl must be one of {IMPLS}, got {impl!r}")
    shape = w.shape
    if len(shape) != 2 or x.shape[-1] != shape[1] or (bias is not None and bias.shape != (shape[0],)):
        raise ValueError(f"nf4 linear: expected x [..., K], an NF4 weight [N, K], bias [N]; got x {tuple(x.shape)}, "
                         f"weight {shape}, bias {None if bias is None else tuple(bias.shape)}")
    if not nf4_supported(shape[1]):
        raise ValueError(f"nf4 linear: in_features {shape[1]} is not a multiple of {BLOCK}")
    if bias is not None and bias.requires_grad:
        raise ValueError("nf4 linear: the bias of a frozen NF4 layer must be frozen (requires_grad=False)")


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def nf4_linear(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """x Ŵᵀ + b over a frozen NF4 weight (dX only). x [..., K] → [..., N] in the compute dtype (autocast's, else
    x.dtype)."""
    _check(x, w, bias, impl)
    lead, k = x.shape[:-1], x.shape[-1]
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        return nf4_linear_ref(x, w, bias)
    y = NF4LinearFunction.apply(x.reshape(-1, k), *_parts(w), bias, _out_dtype(x))
    return y.view(*lead, w.shape[0])


def nf4_lora_linear(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, scale: float, dropout: float = 0.0, impl: str = "auto") -> torch.Tensor:
    """nf4_linear(x, w, b) + scale · (dropout(x) Aᵀ) Bᵀ, the adapter as kernels.lora_linear computes it.

    x [..., I] → [..., O] in the base compute dtype. `dropout` is the probability applied now (0 in eval); the
    mask comes from torch's global RNG.
    """
    _check(x, w, bias, impl)
    o, i = w.shape
    if lora_a.dim() != 2 or lora_a.shape[1] != i or lora_b.shape != (o, lora_a.shape[0]):
        raise ValueError(f"nf4 lora linear: expected lora_a [r, {i}], lora_b [{o}, r]; got {tuple(lora_a.shape)}, "
                         f"{tuple(lora_b.shape)}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"nf4 lora linear: dropout must be in [0, 1), got {dropout}")
    lead = x.shape[:-1]
    mask = dropout_mask(x, dropout)
    x2, m2 = x.reshape(-1, i), None if mask is None else mask.reshape(-1, i)
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        y = nf4_lora_linear_ref(x2, w, bias, lora_a, lora_b, scale, m2, dropout)
    else:
        y = NF4LoRAFunction.apply(x2, *_parts(w), bias, lora_a, lora_b, float(scale), m2, float(dropout))
    return y.view(*lead, o)


# --- reference ------------------------------------------------------------------------------------
def nf4_linear_ref(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantise (kernels.nf4.dequantize_nf4), then x Ŵᵀ + b in fp32, cast to the compute dtype."""
    out_dtype = _out_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        y = F.linear(x.float(), dequantize_nf4(w).float(), bias.float() if bias is not None else None)
    return y.to(out_dtype)


def nf4_lora_linear_ref(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None, lora_a: torch.Tensor,
                        lora_b: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
                        p: float = 0.0) -> torch.Tensor:
    """Dequantise, then kernels.lora_linear's fp32 reference (autograd gives dx, dA, dB). mask: the bool keep-mask."""
    return lora_linear_ref(x, dequantize_nf4(w), bias, lora_a, lora_b, scale, mask, p)


__all__ = ["IMPLS", "PATHS", "DENSE_MIN_M", "nf4_dequantize", "nf4_linear", "nf4_lora_linear", "nf4_linear_ref",
           "nf4_lora_linear_ref", "nf4_matmul", "nf4_matmul_t"]
