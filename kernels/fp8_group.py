"""FP8 linears that read one input, with x quantised ONCE for all of them: q/k/v and gate/up (Qwen3), Qwen3.5's
in_proj_*, the MMDiT's to_q/to_k/to_v and add_q/k/v.

Shapes: M tokens (leading dims flattened), K in-features, m members with N_i out-features each.
  x [M, K], W_i [N_i, K], b_i [N_i] | None → y_i = x W_iᵀ + b_i [M, N_i], each what kernels/fp8_linear.py computes
  for the member alone (same recipe, same quantised operands, same GEMM call).
Why: x's scales depend on x alone (per row or per tensor, never on W), so every member's forward GEMM takes the same
q(x), and every member's dW the same q(x)ᵀ. Alone, each member reads x and writes its fp8 copies again (two passes
over x, one memset and two kernel launches per member): with three members that is two thirds of x's quantisation
traffic spent twice, and at the smaller projections (k/v, the MMDiT's text stream) the quantisation, not the GEMM,
is where the time goes.

Trainable members (Float8LinearGroupFunction, full fine-tuning):
  forward: q(x) (and xᵀ for dW) once; per member q(W_i) (and W_iᵀ for dX), y_i from one GEMM (bias in its epilogue).
  Saved: xᵀ [K, M₁₆] once instead of m times, each W_iᵀ, their scales.
  backward: per member q(dY_i) in both layouts; dW_i = q(dY_i)ᵀ q(x) from the one saved xᵀ; d(bias_i) = Σ_rows dY_i;
  dX = Σ_i q(dY_i) q(W_i): the first GEMM's output, each further one added to it in place (one add per extra
  member, the adds autograd makes anyway). _scaled_mm has no accumulating epilogue (its bias is a vector), and one
  GEMM over the concatenated dY_i would need one scale across the members, which is not the recipe.
Frozen members, with or without LoRA adapters (Fp8FrozenGroupFunction):
  forward: q(x) once; y_i = q(x) W_i,qᵀ over the weight's fp8 copies (quantize_frozen_weight); the adapters as
  kernels/lora_linear.py's group: u = x [A_0; …]ᵀ in one matmul, y_i += s_i u_i B_iᵀ inside an addmm.
  backward: per member q(dY_i); dX = Σ_i q(dY_i) W_i,q (one add per extra member) + g [A_0; …] by an addmm; every dA
  in one matmul; dB_i. No dW.

Against the members one by one: y_i, dW_i and d(bias_i) are the same computation on the same inputs (bit-equal);
dX is the same per-member GEMMs summed in another order than autograd's (rounding of the sum only); the adapters'
u comes from one matmul over the stacked A, which may round differently from per-member matmuls (as in
lora_linear_group). Where any member cannot take the fast path (impl "ref", "auto" on a CPU, K or N off 16) the
group runs the members one by one through kernels/fp8_linear.py: that is its reference.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.flop_counter import register_flop_formula

from atelier_studio.kernels.custom_op import call_op, custom_op
from atelier_studio.kernels.fp8_linear import (
    FAST_ACCUM_FORWARD,
    PAD,
    RECIPES,
    Fp8FrozenWeight,
    _check,
    _check_frozen,
    _dw_k,
    _out_dtype,
    _scaled_mm,
    _use_scaled_mm,
    autocast_off,
    fp8_frozen_linear,
    fp8_linear,
    fp8_lora_linear,
    high_precision_dw,
    padded,
    quantize,
)
from atelier_studio.kernels.lora_linear import _compute_dtypes, add_group_adapters_, group_adapter_backward

# --- Triton kernels -------------------------------------------------------------------------------
# (none of its own: kernels/fp8_quant.py's quantisers and torch._scaled_mm)


# --- launchers ------------------------------------------------------------------------------------
# torch.library custom ops, opaque under torch.compile, their bodies called directly in plain eager
# (kernels/custom_op.py's custom_op / call_op). Absent outputs are empty.
@custom_op("atelier::fp8_group_fwd")
def fp8_group_fwd(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None], recipe: str,
                  out_dtype: torch.dtype, need_xgrad: bool, need_wgrad: bool) -> list[torch.Tensor]:
    """x [M, K], W_i [N_i, K] → [y_0 [M, N_0], …, y_{m−1}, xᵀ_q [K, M₁₆] for dW (empty unless need_wgrad), its
    scales, W_0ᵀ_q [K, N_0], …, W_{m−1}ᵀ_q for dX (empty unless need_xgrad), their scales …]."""
    rc = RECIPES[recipe]
    x_cols = need_wgrad and not rc.dw_high_precision  # a high-precision dW reads x itself (the Function saves it)
    xq = quantize(x, rc.forward_dtype, rc.rowwise, rows=True, cols=x_cols, pad_to=PAD)  # once for the group
    ys, wqts, wt_scales = [], [], []
    for w, b in zip(weights, biases):
        wq = quantize(w, rc.forward_dtype, rc.rowwise, rows=True, cols=need_xgrad)
        ys.append(_scaled_mm(xq.q, wq.q, xq.scale, wq.scale, rc.rowwise, out_dtype, b, FAST_ACCUM_FORWARD))
        wqts.append(wq.qt if need_xgrad else x.new_empty(0, dtype=rc.forward_dtype))
        wt_scales.append(wq.scale_t if need_xgrad else x.new_empty(0, dtype=torch.float32))
    xqt = xq.qt if x_cols else x.new_empty(0, dtype=rc.forward_dtype)
    xt_scale = xq.scale_t if x_cols else x.new_empty(0, dtype=torch.float32)
    return ys + [xqt, xt_scale] + wqts + wt_scales


@fp8_group_fwd.register_fake
def _(x, weights, biases, recipe, out_dtype, need_xgrad, need_wgrad):
    rc = RECIPES[recipe]
    m, k = x.shape
    sk = k if rc.rowwise else 1
    q, s = rc.forward_dtype, torch.float32
    ys = [x.new_empty(m, w.shape[0], dtype=out_dtype) for w in weights]
    x_cols = need_wgrad and not rc.dw_high_precision
    xs = [x.new_empty((k, padded(m)) if x_cols else (0,), dtype=q), x.new_empty((sk,) if x_cols else (0,), dtype=s)]
    wqts = [x.new_empty((k, w.shape[0]) if need_xgrad else (0,), dtype=q) for w in weights]
    wts = [x.new_empty((sk,) if need_xgrad else (0,), dtype=s) for _ in weights]
    return ys + xs + wqts + wts


@custom_op("atelier::fp8_group_bwd")
def fp8_group_bwd(dys: list[torch.Tensor], xqt: torch.Tensor, xt_scale: torch.Tensor, wqts: list[torch.Tensor],
                  wt_scales: list[torch.Tensor], recipe: str, x_dtype: torch.dtype, w_dtype: torch.dtype,
                  b_dtype: torch.dtype, need_x: bool, need_w: bool, need_bs: list[bool]) -> list[torch.Tensor]:
    """dy_i [M, N_i] → [dX [M, K] in x_dtype, dW_0 [N_0, K], …, dW_{m−1} in w_dtype, d(bias)_0, … in b_dtype];
    unneeded ones empty. xqt: x's fp8 copy for dW, or x itself [M, K] for a recipe with a high-precision dW."""
    rc = RECIPES[recipe]
    dx = None
    dws, dbs = [], []
    dy_cols = need_w and not rc.dw_high_precision
    for dy, wqt, wts, need_b in zip(dys, wqts, wt_scales, need_bs):
        dw = dy.new_empty(0, dtype=w_dtype)
        if need_x or dy_cols:
            dq = quantize(dy, rc.grad_dtype, rc.rowwise, rows=need_x, cols=dy_cols, pad_to=PAD)
            if need_x:
                part = _scaled_mm(dq.q, wqt, dq.scale, wts, rc.rowwise, x_dtype, fast_accum=rc.grad_fast_accum)
                dx = part if dx is None else dx.add_(part)  # [M, K]: Σ_i dY_i W_i
            if dy_cols:
                dw = _scaled_mm(dq.qt, xqt, dq.scale_t, xt_scale, rc.rowwise, w_dtype,  # [N_i, K], contracts M₁₆
                                fast_accum=rc.grad_fast_accum)
        if need_w and rc.dw_high_precision:
            dw = high_precision_dw(dy, xqt, w_dtype)
        dws.append(dw)
        dbs.append(dy.sum(0, dtype=torch.float32).to(b_dtype) if need_b else dy.new_empty(0, dtype=b_dtype))
    return [dx if dx is not None else dys[0].new_empty(0, dtype=x_dtype)] + dws + dbs


@fp8_group_bwd.register_fake
def _(dys, xqt, xt_scale, wqts, wt_scales, recipe, x_dtype, w_dtype, b_dtype, need_x, need_w, need_bs):
    m, k = dys[0].shape[0], wqts[0].shape[0] if need_x else _dw_k(xqt, recipe)
    dx = dys[0].new_empty((m, k) if need_x else (0,), dtype=x_dtype)
    dws = [dy.new_empty((dy.shape[1], k) if need_w else (0,), dtype=w_dtype) for dy in dys]
    dbs = [dy.new_empty((dy.shape[1],) if nb else (0,), dtype=b_dtype) for dy, nb in zip(dys, need_bs)]
    return [dx] + dws + dbs


@custom_op("atelier::fp8_frozen_group_fwd")
def fp8_frozen_group_fwd(x: torch.Tensor, wqs: list[torch.Tensor], w_scales: list[torch.Tensor],
                         biases: list[torch.Tensor | None], lora_as: list[torch.Tensor], lora_bs: list[torch.Tensor],
                         scales: list[float], recipe: str, base_dtype: torch.dtype,
                         adapter_dtype: torch.dtype) -> list[torch.Tensor]:
    """x [M, K], the frozen W_i,q [N_i, K] → [y_0 [M, N_0], …, y_{m−1} in base_dtype, u = x [A_0; …]ᵀ [M, Σ r_i] in
    adapter_dtype (empty without adapters)]."""
    rc = RECIPES[recipe]
    with autocast_off(x.device.type):
        xq = quantize(x, rc.forward_dtype, rc.rowwise)  # once for the group
        ys = [_scaled_mm(xq.q, wq, xq.scale, ws, rc.rowwise, base_dtype, b, FAST_ACCUM_FORWARD)
              for wq, ws, b in zip(wqs, w_scales, biases)]
        u = (add_group_adapters_(ys, x, lora_as, lora_bs, scales, base_dtype, adapter_dtype) if lora_as
             else x.new_empty(0, dtype=adapter_dtype))
    return ys + [u]


@fp8_frozen_group_fwd.register_fake
def _(x, wqs, w_scales, biases, lora_as, lora_bs, scales, recipe, base_dtype, adapter_dtype):
    r = sum(a.shape[0] for a in lora_as)
    return [x.new_empty(x.shape[0], wq.shape[0], dtype=base_dtype) for wq in wqs] + [
        x.new_empty((x.shape[0], r) if lora_as else (0,), dtype=adapter_dtype)]


@custom_op("atelier::fp8_frozen_group_bwd")
def fp8_frozen_group_bwd(dys: list[torch.Tensor], x: torch.Tensor, wqts: list[torch.Tensor],
                         wt_scales: list[torch.Tensor], lora_as: list[torch.Tensor], lora_bs: list[torch.Tensor],
                         u: torch.Tensor, scales: list[float], recipe: str, x_dtype: torch.dtype, need_x: bool,
                         need_adapters: bool) -> list[torch.Tensor]:
    """dy_i [M, N_i] (base dtype) → [dX [M, K] in x_dtype, dA_0, …, dB_0, …] (no adapters: [dX]); unneeded ones
    empty. x is the group's input with adapters (dA needs it), an empty tensor without."""
    rc = RECIPES[recipe]
    # the bases' dX in the dtype the members alone give it: dy's (the adapters' share is added in it, then the
    # sum is cast to x's dtype, as fp8_lora_linear does) or, for bases alone, x's (as fp8_frozen_linear does)
    dx_dtype = dys[0].dtype if lora_as else x_dtype
    with autocast_off(dys[0].device.type):
        dx = None
        if need_x:
            for dy, wqt, wts in zip(dys, wqts, wt_scales):
                dq = quantize(dy, rc.grad_dtype, rc.rowwise)
                part = _scaled_mm(dq.q, wqt, dq.scale, wts, rc.rowwise, dx_dtype, fast_accum=rc.grad_fast_accum)
                dx = part if dx is None else dx.add_(part)  # [M, K]: Σ_i dY_i W_i
        if lora_as:
            return group_adapter_backward(dys, dx, x, lora_as, lora_bs, u, scales, need_x, need_adapters)
        return [dx if need_x else dys[0].new_empty(0, dtype=x_dtype)]


@fp8_frozen_group_bwd.register_fake
def _(dys, x, wqts, wt_scales, lora_as, lora_bs, u, scales, recipe, x_dtype, need_x, need_adapters):
    dx = dys[0].new_empty((dys[0].shape[0], wqts[0].shape[0]) if need_x else (0,), dtype=x_dtype)
    if not lora_as:
        return [dx]
    if not need_adapters:
        return [dx] + [a.new_empty(0) for a in lora_as] + [b.new_empty(0) for b in lora_bs]
    return [dx] + [torch.empty_like(a) for a in lora_as] + [torch.empty_like(b) for b in lora_bs]


# FlopCounterMode cannot look inside a custom op: the matmul FLOPs (2·m·n·k per GEMM). Tensor arguments arrive as
# shapes.
@register_flop_formula(torch.ops.atelier.fp8_group_fwd)
def _group_fwd_flops(x, weights, *args, out_shape=None, **kwargs) -> int:
    return sum(2 * x[0] * x[1] * w[0] for w in weights)


@register_flop_formula(torch.ops.atelier.fp8_group_bwd)
def _group_bwd_flops(dys, xqt, xt_scale, wqts, wt_scales, recipe, x_dtype, w_dtype, b_dtype, need_x, need_w, need_bs,
                     out_shape=None, **kwargs) -> int:
    k = wqts[0][0] if need_x else _dw_k(xqt, recipe)
    return sum(2 * dy[0] * dy[1] * k for dy in dys) * (int(need_x) + int(need_w))


@register_flop_formula(torch.ops.atelier.fp8_frozen_group_fwd)
def _frozen_group_fwd_flops(x, wqs, w_scales, biases, lora_as, lora_bs, *args, out_shape=None, **kwargs) -> int:
    t, i = x
    r = sum(a[0] for a in lora_as)
    return sum(2 * t * i * wq[0] for wq in wqs) + 2 * t * i * r + sum(2 * t * b[1] * b[0] for b in lora_bs)


@register_flop_formula(torch.ops.atelier.fp8_frozen_group_bwd)
def _frozen_group_bwd_flops(dys, x, wqts, wt_scales, lora_as, lora_bs, u, scales, recipe, x_dtype, need_x,
                            need_adapters, out_shape=None, **kwargs) -> int:
    t, i = dys[0][0], wqts[0][0]
    r = sum(a[0] for a in lora_as)
    flops = sum(2 * t * dy[1] * i for dy in dys) if need_x else 0  # Σ dy_i W_i (FP8)
    if lora_as:
        flops += sum(2 * t * dy[1] * b[1] for dy, b in zip(dys, lora_bs))  # g_i = s·dy_i B_i
        if need_adapters:
            flops += 2 * r * t * i + sum(2 * dy[1] * t * b[1] for dy, b in zip(dys, lora_bs))  # dA, dB
        if need_x:
            flops += 2 * t * r * i  # g A
    return flops


# --- autograd.Function ----------------------------------------------------------------------------
class Float8LinearGroupFunction(torch.autograd.Function):
    """x [M, K], recipe, out_dtype, then W_0 … W_{m−1} (trainable), b_0 … b_{m−1} (None allowed) → (y_0, …)."""

    @staticmethod
    def forward(ctx, x, recipe: str, out_dtype: torch.dtype, *params):  # noqa: D102
        m = len(params) // 2
        weights, biases = list(params[:m]), list(params[m:])
        need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[3:3 + m])
        out = call_op(fp8_group_fwd, x, weights, biases, recipe, out_dtype, need_x, need_w)
        saved = list(out[m:])  # xᵀ_q, its scales, the W_iᵀ_q, their scales
        if need_w and RECIPES[recipe].dw_high_precision:
            saved[0] = x  # dW in high precision reads x itself
        ctx.save_for_backward(*saved)
        present = [b for b in biases if b is not None]
        ctx.m, ctx.recipe, ctx.out_dtype = m, recipe, out_dtype
        ctx.dtypes = (x.dtype, weights[0].dtype, present[0].dtype if present else weights[0].dtype)
        ctx.need_bs = [b is not None and ctx.needs_input_grad[3 + m + i] for i, b in enumerate(biases)]
        return tuple(out[:m])

    @staticmethod
    def backward(ctx, *dys):  # noqa: D102
        m = ctx.m
        xqt, xt_scale, *rest = ctx.saved_tensors
        wqts, wt_scales = rest[:m], rest[m:]
        need_x, need_ws = ctx.needs_input_grad[0], ctx.needs_input_grad[3:3 + m]
        dys = [d.to(ctx.out_dtype).contiguous() for d in dys]
        out = call_op(fp8_group_bwd, dys, xqt, xt_scale, list(wqts), list(wt_scales), ctx.recipe, *ctx.dtypes,
                      need_x, any(need_ws), ctx.need_bs)
        dx, dws, dbs = out[0], out[1:1 + m], out[1 + m:]
        return (dx if need_x else None, None, None, *(dw if n else None for dw, n in zip(dws, need_ws)),
                *(db if n else None for db, n in zip(dbs, ctx.need_bs)))


class Fp8FrozenGroupFunction(torch.autograd.Function):
    """x [M, K], recipe, scales (one per adapter; empty without), m, then per member: W_q …, W scales …, Wᵀ_q …,
    Wᵀ scales …, biases … (None allowed), and with adapters A_0 … A_{m−1}, B_0 … B_{m−1} → (y_0, …, y_{m−1})."""

    @staticmethod
    def forward(ctx, x, recipe: str, scales: tuple[float, ...], m: int, *tensors):  # noqa: D102
        wqs, w_scales, wqts, wt_scales, biases = (list(tensors[i * m:(i + 1) * m]) for i in range(5))
        lora_as, lora_bs = list(tensors[5 * m:6 * m]), list(tensors[6 * m:])
        cb, ca = _compute_dtypes(x, lora_as[0]) if lora_as else (_out_dtype(x), x.dtype)
        *ys, u = call_op(fp8_frozen_group_fwd, x, wqs, w_scales, biases, lora_as, lora_bs, list(scales), recipe, cb, ca)
        saved_x = x if lora_as else x.new_empty(0)  # dA needs x; a base alone keeps nothing of x's dtype
        ctx.save_for_backward(saved_x, u, *wqts, *wt_scales, *lora_as, *lora_bs)
        ctx.m, ctx.recipe, ctx.scales, ctx.base_dtype, ctx.x_dtype = m, recipe, scales, cb, x.dtype
        ctx.n_adapters = len(lora_as)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):  # noqa: D102
        m, k = ctx.m, ctx.n_adapters
        x, u, *rest = ctx.saved_tensors
        wqts, wt_scales, lora_as, lora_bs = rest[:m], rest[m:2 * m], rest[2 * m:2 * m + k], rest[2 * m + k:]
        need_x = ctx.needs_input_grad[0]
        need_adapters = k > 0 and any(ctx.needs_input_grad[4 + 5 * m:])
        dys = [d.to(ctx.base_dtype).contiguous() for d in dys]
        out = call_op(fp8_frozen_group_bwd, dys, x, list(wqts), list(wt_scales), list(lora_as), list(lora_bs), u,
                      list(ctx.scales), ctx.recipe, ctx.x_dtype, need_x, need_adapters)
        dx, das, dbs = out[0], out[1:1 + k], out[1 + k:]
        none = [None] * (5 * m)
        adapters = [*das, *dbs] if need_adapters else [None] * (2 * k)
        return (dx if need_x else None, None, None, None, *none, *adapters)


# --- public ---------------------------------------------------------------------------------------
def _fast(impl: str, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    return len(weights) > 1 and all(_use_scaled_mm(impl, x, w) for w in weights)


def fp8_linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor],
                     biases: Sequence[torch.Tensor | None] | None = None, recipe: str = "rowwise",
                     impl: str = "auto") -> list[torch.Tensor]:
    """[fp8_linear(x, W_i, b_i, recipe, impl) for each i] with x quantised once (trainable W_i, full fine-tuning).

    x [..., K], W_i [N_i, K], b_i [N_i] | None → [[..., N_i]] in the compute dtype.
    """
    biases = list(biases) if biases is not None else [None] * len(weights)
    if not weights or len(biases) != len(weights):
        raise ValueError(f"fp8_linear_group: need M >= 1 weights and as many biases (None allowed); got "
                         f"{len(weights)} and {len(biases)}")
    for w, b in zip(weights, biases):
        _check(x, w, b, recipe, impl)
    if not _fast(impl, x, weights):
        return [fp8_linear(x, w, b, recipe, impl) for w, b in zip(weights, biases)]
    lead, k = x.shape[:-1], x.shape[-1]
    ys = Float8LinearGroupFunction.apply(x.reshape(-1, k), recipe, _out_dtype(x), *weights, *biases)
    return [y.view(*lead, w.shape[0]) for y, w in zip(ys, weights)]


def fp8_frozen_linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                            frozens: Sequence[Fp8FrozenWeight | None], recipe: str = "rowwise",
                            impl: str = "auto") -> list[torch.Tensor]:
    """[fp8_frozen_linear(x, W_i, b_i, frozen_i, recipe, impl) for each i] with x quantised once (frozen W_i, their
    fp8 copies in `frozens`). x [..., K] → [[..., N_i]]. dX through FP8, no dW."""
    if not weights or not len(biases) == len(frozens) == len(weights):
        raise ValueError(f"fp8_frozen_linear_group: need M >= 1 weights, biases and fp8 copies alike; got "
                         f"{len(weights)}, {len(biases)}, {len(frozens)}")
    for w, b in zip(weights, biases):
        _check(x, w, b, recipe, impl)
    if not _fast(impl, x, weights):
        return [fp8_frozen_linear(x, w, b, f, recipe, impl) for w, b, f in zip(weights, biases, frozens)]
    return _frozen_group(x, weights, biases, frozens, (), (), (), recipe)


def fp8_lora_linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor], frozens: Sequence[Fp8FrozenWeight | None],
                          lora_as: Sequence[torch.Tensor], lora_bs: Sequence[torch.Tensor], scales: Sequence[float],
                          recipe: str = "rowwise", impl: str = "auto") -> list[torch.Tensor]:
    """[fp8_lora_linear(x, W_i, None, frozen_i, A_i, B_i, s_i, 0, recipe, impl) for each i] with x quantised once for
    the FP8 bases and x [A_0; …]ᵀ in one matmul for the adapters (no bias, no dropout; the adapters in one dtype, all
    trained or all frozen). x [..., I] → [[..., O_i]] in the base compute dtype."""
    m = len(weights)
    if m == 0 or not len(frozens) == len(lora_as) == len(lora_bs) == len(scales) == m:
        raise ValueError(f"fp8_lora_linear_group: need M >= 1 weights, fp8 copies, lora_as, lora_bs and scales alike; "
                         f"got {m}, {len(frozens)}, {len(lora_as)}, {len(lora_bs)}, {len(scales)}")
    for w, a, b in zip(weights, lora_as, lora_bs):
        _check(x, w, None, recipe, impl)
        if a.dim() != 2 or a.shape[1] != w.shape[1] or b.shape != (w.shape[0], a.shape[0]):
            raise ValueError(f"fp8_lora_linear_group: expected lora_a [r, I], lora_b [O, r] for weight "
                             f"{tuple(w.shape)}; got {tuple(a.shape)}, {tuple(b.shape)}")
        if w.requires_grad:
            raise ValueError("fp8_lora_linear_group: the base weights must be frozen (requires_grad=False)")
    if len({a.dtype for a in (*lora_as, *lora_bs)}) != 1 or len({p.requires_grad for p in (*lora_as, *lora_bs)}) != 1:
        raise ValueError("fp8_lora_linear_group: the adapters must share one dtype and all train or all be frozen; got "
                         f"{[(str(a.dtype), a.requires_grad) for a in (*lora_as, *lora_bs)]}")
    if not _fast(impl, x, weights):
        return [fp8_lora_linear(x, w, None, f, a, b, s, 0.0, recipe, impl)
                for w, f, a, b, s in zip(weights, frozens, lora_as, lora_bs, scales)]
    return _frozen_group(x, weights, [None] * m, frozens, lora_as, lora_bs, scales, recipe)


def _frozen_group(x, weights, biases, frozens, lora_as, lora_bs, scales, recipe) -> list[torch.Tensor]:
    for w, f in zip(weights, frozens):
        _check_frozen(f, w, recipe)
    lead, k = x.shape[:-1], x.shape[-1]
    ys = Fp8FrozenGroupFunction.apply(x.reshape(-1, k), recipe, tuple(float(s) for s in scales), len(weights),
                                      *(f.q for f in frozens), *(f.scale for f in frozens), *(f.qt for f in frozens),
                                      *(f.scale_t for f in frozens), *biases, *lora_as, *lora_bs)
    return [y.view(*lead, w.shape[0]) for y, w in zip(ys, weights)]


# --- reference ------------------------------------------------------------------------------------
def fp8_linear_group_ref(x: torch.Tensor, weights: Sequence[torch.Tensor],
                         biases: Sequence[torch.Tensor | None] | None = None,
                         recipe: str = "rowwise") -> list[torch.Tensor]:
    """The group's reference: each member through kernels.fp8_linear's fake-quantised reference."""
    biases = list(biases) if biases is not None else [None] * len(weights)
    return [fp8_linear(x, w, b, recipe, "ref") for w, b in zip(weights, biases)]
