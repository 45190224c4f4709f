"""LoRA linear over a frozen base: y = x Wᵀ + b + s · (dropout(x) Aᵀ) Bᵀ, with dX, dA, dB only (never dW).

Shapes: T tokens (leading dims flattened), I in-features, O out-features, r rank.
  x [..., I], weight [O, I] (frozen), bias [O] or None (frozen), lora_a [r, I], lora_b [O, r] → y [..., O].

Forward, with m the dropout mask (scaled by 1/(1−p)) and xd = x ∘ m:
  u = xd Aᵀ [T, r] (saved: it is the only input dB needs, so x·Aᵀ is never recomputed);
  y = x Wᵀ + b, then y += s · u Bᵀ accumulated into y by one addmm (cuBLAS adds in its fp32
  accumulator: no [T, O] temporary, no extra pass) when base and adapter compute in one dtype.
Backward, for dy [T, O]:
  g = s · dy B [T, r];  dB = s · dyᵀ u [O, r];  dA = gᵀ xd [r, I];
  dx = dy W + (g A) ∘ m, again one addmm into dy W when there is no dropout and one dtype.
  No dW and no d(bias): the base is frozen (a weight gradient for it would be a third of the FLOPs, thrown away); dx
  is skipped when x needs no gradient (layer 0 of a frozen-embedding LoRA run), which autograd over nn.Linear also
  does.
Saved: x, the dropout mask (bool, only with dropout), u, and the weights (no copies).
Dtypes: under autocast both matmul chains run in the autocast dtype (as nn.Linear would); otherwise
the base runs in x.dtype and the adapter in lora_a's dtype (PEFT: fp32 adapters on a bf16 base), and
the adapter's [T, O] product is cast to the base dtype before the add, exactly as PEFT computes it.
Fusing x·[W; A]ᵀ into one matmul is not done: W is bf16 and A may be fp32, and casting A would
change PEFT's numerics; the frozen W is what makes the big saving (no dW matmul, 1/3 of the FLOPs).
Accumulation: fp32 inside cuBLAS; dA, dB returned in the adapter weights' dtypes.

Shared input (lora_linear_group): M LoRA linears over one x (q/k/v, gate/up, the four Gated DeltaNet input
projections), no bias, no dropout. The adapters' A are stacked, so x·[A_0; …; A_{M−1}]ᵀ = [u_0 | … | u_{M−1}]
[T, M·r] reads x once instead of M times, and dA for all of them is one matmul gᵀ x with g = [g_0 | … ].
Backward: dx = dy_0 W_0 + Σ_{i>0} dy_i W_i + g [A_0; …], every term after the first accumulated into dx by an
addmm (no [T, I] temporaries, no separate adds: autograd would otherwise sum M dx's with M−1 add kernels).
The base matmuls stay one per member (concatenating W would make each y a strided view of one output).

No Triton here: every product is a cuBLAS matmul; the win is skipping dW, reusing u and fusing the
adds into the matmuls' epilogues. Implementations (argument `impl`): "fused" (the Function below,
any device), "ref" (lora_linear_ref, differentiated by autograd), "auto" (fused on CUDA, ref elsewhere).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from atelier_studio.kernels.custom_op import call_op, custom_op

IMPLS = ("auto", "fused", "ref")


# --- Triton kernels -------------------------------------------------------------------------------
# (none: see the docstring; the matmuls are cuBLAS.)


# --- helpers --------------------------------------------------------------------------------------
def _compute_dtypes(x: torch.Tensor, lora_a: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(base dtype, adapter dtype): autocast's for both when it is on, else x's and the adapter's."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        c = torch.get_autocast_dtype(dev)
        return c, c
    return x.dtype, lora_a.dtype


def _dropped(x: torch.Tensor, mask: torch.Tensor | None, p: float) -> torch.Tensor:
    return x if mask is None else x * mask * (1.0 / (1.0 - p))


def dropout_mask(x: torch.Tensor, p: float) -> torch.Tensor | None:
    """Bool keep-mask [..., I] with P(keep) = 1 − p (None for p = 0), from torch's global RNG."""
    if p == 0.0:
        return None
    return torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - p)


def add_adapter_(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                 mask: torch.Tensor | None, p: float, base_dtype: torch.dtype,
                 adapter_dtype: torch.dtype) -> torch.Tensor:
    """y [T, O] (the base's output, in base_dtype) += s · u Bᵀ in place; returns u = dropout(x) Aᵀ [T, r] in
    adapter_dtype. Call with autocast off. Shared by the bf16 base here and the fp8 base (kernels/fp8_linear.py)."""
    cb, ca = base_dtype, adapter_dtype
    a, b = lora_a.to(ca), lora_b.to(ca)
    u = _dropped(x.to(ca), mask, p) @ a.t()  # [T, r]
    if ca == cb:
        torch.addmm(y, u, b.t(), alpha=scale, out=y)  # y += s·u Bᵀ inside the matmul
    else:
        y += ((u @ b.t()) * scale).to(cb)  # PEFT's order: adapter product in its dtype, then cast
    return u


def adapter_backward(dy: torch.Tensor, dx_base: torch.Tensor | None, x: torch.Tensor, lora_a: torch.Tensor,
                     lora_b: torch.Tensor, u: torch.Tensor, mask: torch.Tensor | None, scale: float, p: float,
                     need_x: bool, need_a: bool, need_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The adapter's share of the backward for dy [T, O] (base dtype): (dx, dA, dB), unneeded ones empty.

    dx_base [T, I] is the base's dY W (in dy's dtype; needed when need_x): g A is accumulated into it, then it is
    cast to x.dtype. Call with autocast off.
    """
    cb, ca = dy.dtype, u.dtype
    a, b = lora_a.to(ca), lora_b.to(ca)
    dy_a = dy.to(ca)  # a no-op unless the adapter is fp32 on a bf16 base
    g = (dy_a @ b).mul_(scale) if (need_x or need_a) else None  # [T, r]
    db = (dy_a.t() @ u).mul_(scale).to(lora_b.dtype) if need_b else lora_b.new_empty(0)  # [O, r]
    da = (g.t() @ _dropped(x.to(ca), mask, p)).to(lora_a.dtype) if need_a else lora_a.new_empty(0)  # [r, I]
    dx = x.new_empty(0)
    if need_x:
        dx = dx_base
        if mask is None and ca == cb:
            torch.addmm(dx, g, a, out=dx)  # dx += g A inside the matmul
        else:
            dx += _dropped(g @ a, mask, p).to(cb)
        dx = dx.to(x.dtype)
    return dx, da, db


# --- launchers ------------------------------------------------------------------------------------
# torch.library custom ops: under torch.compile the forward and backward stay opaque calls (the addmm
# epilogue fusions and the skipped dW survive, and the compiled graph cannot reorder or re-derive them).
# Absent outputs are empty tensors (a custom op cannot return None).
@custom_op("atelier::lora_linear_fwd")
def lora_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, scale: float, mask: torch.Tensor | None, p: float, base_dtype: torch.dtype,
                    adapter_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, I] → (y [T, O] in base_dtype, u = dropout(x) Aᵀ [T, r] in adapter_dtype)."""
    cb = base_dtype
    with torch.autocast(x.device.type, enabled=False):
        y = F.linear(x.to(cb), weight.to(cb), bias.to(cb) if bias is not None else None)  # [T, O]
        u = add_adapter_(y, x, lora_a, lora_b, scale, mask, p, cb, adapter_dtype)
    return y, u


@lora_linear_fwd.register_fake
def _(x, weight, bias, lora_a, lora_b, scale, mask, p, base_dtype, adapter_dtype):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=base_dtype), x.new_empty(x.shape[0], lora_a.shape[0],
                                                                                    dtype=adapter_dtype)


@custom_op("atelier::lora_linear_bwd")
def lora_linear_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, u: torch.Tensor, mask: torch.Tensor | None, scale: float, p: float,
                    need_x: bool, need_a: bool, need_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy [T, O] → (dx [T, I] in x.dtype, dA [r, I], dB [O, r] in the adapter weights' dtypes); unneeded ones empty."""
    with torch.autocast(x.device.type, enabled=False):
        dx_base = dy @ weight.to(dy.dtype) if need_x else None  # [T, I]; the frozen W gets no dW
        return adapter_backward(dy, dx_base, x, lora_a, lora_b, u, mask, scale, p, need_x, need_a, need_b)


@lora_linear_bwd.register_fake
def _(dy, x, weight, lora_a, lora_b, u, mask, scale, p, need_x, need_a, need_b):
    return (torch.empty_like(x) if need_x else x.new_empty(0),
            torch.empty_like(lora_a) if need_a else lora_a.new_empty(0),
            torch.empty_like(lora_b) if need_b else lora_b.new_empty(0))


# FlopCounterMode cannot look inside a custom op: state its matmul FLOPs (so MFU accounting and the no-dW
# test see them). Tensor arguments arrive as shapes.
def lora_fwd_flops(t: int, i: int, o: int, r: int) -> int:
    """Matmul FLOPs of one LoRA linear's forward on t tokens: the base x Wᵀ, u = x Aᵀ, u Bᵀ."""
    return 2 * t * i * o + 2 * t * i * r + 2 * t * r * o


def lora_bwd_flops(t: int, i: int, o: int, r: int, need_x: bool, need_a: bool, need_b: bool) -> int:
    """Matmul FLOPs of one LoRA linear's backward (no dW), whichever base computes dY W."""
    flops = 2 * t * o * r if (need_x or need_a) else 0  # g = s·dy B
    flops += 2 * o * t * r if need_b else 0  # dB
    flops += 2 * r * t * i if need_a else 0  # dA
    flops += 2 * t * o * i + 2 * t * r * i if need_x else 0  # dy W + g A
    return flops


@register_flop_formula(torch.ops.atelier.lora_linear_fwd)
def _fwd_flops(x, weight, bias, lora_a, lora_b, *args, out_shape=None, **kwargs) -> int:
    (t, i), o, r = x, weight[0], lora_a[0]
    return lora_fwd_flops(t, i, o, r)


@register_flop_formula(torch.ops.atelier.lora_linear_bwd)
def _bwd_flops(dy, x, weight, lora_a, lora_b, u, mask, scale, p, need_x, need_a, need_b, out_shape=None,
               **kwargs) -> int:
    (t, i), o, r = x, weight[0], lora_a[0]
    return lora_bwd_flops(t, i, o, r, need_x, need_a, need_b)


def _rank_slices(lora_bs: list[torch.Tensor]) -> list[slice]:
    """Each member's columns of the stacked u [T, Σ r_i]."""
    out, r0 = [], 0
    for b in lora_bs:
        out.append(slice(r0, r0 + b.shape[1]))
        r0 += b.shape[1]
    return out


def add_group_adapters_(ys: list[torch.Tensor], x: torch.Tensor, lora_as: Sequence[torch.Tensor],
                        lora_bs: Sequence[torch.Tensor], scales: Sequence[float], base_dtype: torch.dtype,
                        adapter_dtype: torch.dtype) -> torch.Tensor:
    """ys[i] [T, O_i] (the bases' outputs, in base_dtype) += s_i · u_i B_iᵀ in place, with u = x [A_0; …]ᵀ [T, Σ r_i]
    from one matmul (one pass over x for every adapter); returns u. No dropout. Call with autocast off. Shared by
    the bf16 group here and the fp8 group (kernels/fp8_group.py)."""
    cb, ca = base_dtype, adapter_dtype
    u = x.to(ca) @ torch.cat([a.to(ca) for a in lora_as]).t()  # [T, Σr]
    for y, b, s, cols in zip(ys, lora_bs, scales, _rank_slices(list(lora_bs))):
        if ca == cb:
            torch.addmm(y, u[:, cols], b.to(ca).t(), alpha=s, out=y)
        else:
            y += ((u[:, cols] @ b.to(ca).t()) * s).to(cb)
    return u


def group_adapter_backward(dys: Sequence[torch.Tensor], dx_base: torch.Tensor | None, x: torch.Tensor,
                           lora_as: Sequence[torch.Tensor], lora_bs: Sequence[torch.Tensor], u: torch.Tensor,
                           scales: Sequence[float], need_x: bool, need_adapters: bool) -> list[torch.Tensor]:
    """The adapters' share of a group's backward: [dx, dA_0, …, dA_{M−1}, dB_0, …], unneeded ones empty.

    dx_base [T, I] is the bases' Σ dy_i W_i in dys' dtype (needed when need_x): g [A_0; …] is accumulated into it,
    then it is cast to x.dtype. Call with autocast off.
    """
    cb, ca = dys[0].dtype, u.dtype
    slices = _rank_slices(list(lora_bs))
    dy_a = [dy.to(ca) for dy in dys]
    g = torch.cat([(d @ b.to(ca)).mul_(s) for d, b, s in zip(dy_a, lora_bs, scales)], dim=1)  # [T, Σr]
    if need_adapters:
        da = g.t() @ x.to(ca)  # [Σr, I]: every adapter's dA in one matmul
        das = [da[cols].to(a.dtype, copy=True) for a, cols in zip(lora_as, slices)]  # outputs must not alias
        dbs = [(d.t() @ u[:, cols]).mul_(s).to(b.dtype) for d, b, s, cols in zip(dy_a, lora_bs, scales, slices)]
    else:
        das, dbs = [a.new_empty(0) for a in lora_as], [b.new_empty(0) for b in lora_bs]
    dx = x.new_empty(0)
    if need_x:
        dx = dx_base
        a_all = torch.cat([a.to(ca) for a in lora_as])  # [Σr, I]
        if ca == cb:
            torch.addmm(dx, g, a_all, out=dx)
        else:
            dx += (g @ a_all).to(cb)
        dx = dx.to(x.dtype)
    return [dx] + das + dbs


@custom_op("atelier::lora_group_fwd")
def lora_group_fwd(x: torch.Tensor, weights: list[torch.Tensor], lora_as: list[torch.Tensor],
                   lora_bs: list[torch.Tensor], scales: list[float], base_dtype: torch.dtype,
                   adapter_dtype: torch.dtype) -> list[torch.Tensor]:
    """x [T, I] → [y_0 [T, O_0], …, y_{M−1}, u [T, Σ r_i]] (u = x [A_0; …]ᵀ in adapter_dtype)."""
    cb = base_dtype
    with torch.autocast(x.device.type, enabled=False):
        xb = x.to(cb)
        ys = [F.linear(xb, w.to(cb)) for w in weights]  # [T, O_i]
        u = add_group_adapters_(ys, x, lora_as, lora_bs, scales, cb, adapter_dtype)
    return ys + [u]


@lora_group_fwd.register_fake
def _(x, weights, lora_as, lora_bs, scales, base_dtype, adapter_dtype):
    r = sum(a.shape[0] for a in lora_as)
    return [x.new_empty(x.shape[0], w.shape[0], dtype=base_dtype) for w in weights] + [
        x.new_empty(x.shape[0], r, dtype=adapter_dtype)]


@custom_op("atelier::lora_group_bwd")
def lora_group_bwd(dys: list[torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor], lora_as: list[torch.Tensor],
                   lora_bs: list[torch.Tensor], u: torch.Tensor, scales: list[float], need_x: bool,
                   need_adapters: bool) -> list[torch.Tensor]:
    """dy_i [T, O_i] → [dx [T, I], dA_0, …, dA_{M−1}, dB_0, …, dB_{M−1}]; unneeded ones empty."""
    cb = dys[0].dtype
    with torch.autocast(x.device.type, enabled=False):
        dx_base = None
        if need_x:
            dx_base = dys[0] @ weights[0].to(cb)  # [T, I]; the frozen W get no dW
            for dy, w in zip(dys[1:], weights[1:]):
                torch.addmm(dx_base, dy, w.to(cb), out=dx_base)  # dx += dy_i W_i inside the matmul
        return group_adapter_backward(dys, dx_base, x, lora_as, lora_bs, u, scales, need_x, need_adapters)


@lora_group_bwd.register_fake
def _(dys, x, weights, lora_as, lora_bs, u, scales, need_x, need_adapters):
    dx = torch.empty_like(x) if need_x else x.new_empty(0)
    if not need_adapters:
        return [dx] + [a.new_empty(0) for a in lora_as] + [b.new_empty(0) for b in lora_bs]
    return [dx] + [torch.empty_like(a) for a in lora_as] + [torch.empty_like(b) for b in lora_bs]


@register_flop_formula(torch.ops.atelier.lora_group_fwd)
def _group_fwd_flops(x, weights, lora_as, lora_bs, *args, out_shape=None, **kwargs) -> int:
    (t, i), r = x, sum(a[0] for a in lora_as)
    return 2 * t * i * r + sum(2 * t * i * w[0] + 2 * t * b[1] * w[0] for w, b in zip(weights, lora_bs))


@register_flop_formula(torch.ops.atelier.lora_group_bwd)
def _group_bwd_flops(dys, x, weights, lora_as, lora_bs, u, scales, need_x, need_adapters, out_shape=None,
                     **kwargs) -> int:
    (t, i), r = x, sum(a[0] for a in lora_as)
    flops = sum(2 * t * w[0] * b[1] for w, b in zip(weights, lora_bs))  # g_i = s·dy_i B_i
    if need_adapters:
        flops += 2 * r * t * i + sum(2 * w[0] * t * b[1] for w, b in zip(weights, lora_bs))  # dA, dB
    if need_x:
        flops += sum(2 * t * w[0] * i for w in weights) + 2 * t * r * i  # Σ dy_i W_i + g A
    return flops


# --- autograd.Function ----------------------------------------------------------------------------
class LoRALinearFunction(torch.autograd.Function):
    """x [T, I], weight [O, I], bias [O] | None, lora_a [r, I], lora_b [O, r], scale, mask [T, I] | None, p →
    y [T, O]."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale: float, mask, p: float):  # noqa: D102
        cb, ca = _compute_dtypes(x, lora_a)
        y, u = call_op(lora_linear_fwd, x, weight, bias, lora_a, lora_b, scale, mask, p, cb, ca)
        ctx.save_for_backward(x, weight, lora_a, lora_b, u, mask)
        ctx.scale, ctx.p, ctx.base_dtype = scale, p, cb
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, weight, lora_a, lora_b, u, mask = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dx, da, db = call_op(lora_linear_bwd, dy.to(ctx.base_dtype).contiguous(), x, weight, lora_a, lora_b, u, mask,
                                     ctx.scale, ctx.p, need_x, need_a, need_b)
        return ((dx if need_x else None), None, None, (da if need_a else None), (db if need_b else None), None, None,
                None)


class LoRALinearGroupFunction(torch.autograd.Function):
    """x [T, I], scales (M floats), then W_0…W_{M−1}, A_0…, B_0… → (y_0, …, y_{M−1})."""

    @staticmethod
    def forward(ctx, x, scales: tuple[float, ...], *params):  # noqa: D102
        m = len(scales)
        weights, lora_as, lora_bs = list(params[:m]), list(params[m:2 * m]), list(params[2 * m:])
        cb, ca = _compute_dtypes(x, lora_as[0])
        *ys, u = call_op(lora_group_fwd, x, weights, lora_as, lora_bs, list(scales), cb, ca)
        ctx.save_for_backward(x, u, *params)
        ctx.scales, ctx.base_dtype = scales, cb
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):  # noqa: D102
        x, u, *params = ctx.saved_tensors
        m = len(ctx.scales)
        weights, lora_as, lora_bs = params[:m], params[m:2 * m], params[2 * m:]
        need_x, need_adapters = ctx.needs_input_grad[0], any(ctx.needs_input_grad[2 + m:])
        dys = [x.new_zeros(x.shape[0], w.shape[0], dtype=ctx.base_dtype) if d is None else
               d.to(ctx.base_dtype).contiguous() for d, w in zip(dys, weights)]  # an output nobody used
        out = call_op(lora_group_bwd, dys, x, list(weights), list(lora_as), list(lora_bs), u, list(ctx.scales), need_x,
                             need_adapters)
        dx, das, dbs = out[0], out[1:1 + m], out[1 + m:]
        none = [None] * m
        return (dx if need_x else None, None, *none, *(das if need_adapters else none),
                *(dbs if need_adapters else none))


# --- public ---------------------------------------------------------------------------------------
def _check(x, weight, bias, lora_a, lora_b, dropout, impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"lora_linear: impl must be one of {IMPLS}, got {impl!r}")
    o, i = weight.shape if weight.dim() == 2 else (None, None)
    r = lora_a.shape[0] if lora_a.dim() == 2 else None
    if (i is None or r is None or x.shape[-1] != i or lora_a.shape != (r, i) or lora_b.shape != (o, r)
            or (bias is not None and bias.shape != (o,))):
        raise ValueError(f"lora_linear: expected x [..., I], weight [O, I], bias [O], lora_a [r, I], lora_b [O, r]; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}, "
                         f"lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}")
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("lora_linear: the base weight and bias must be frozen (requires_grad=False); "
                         "no dW is computed")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora_linear: dropout must be in [0, 1), got {dropout}")


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float, dropout: float = 0.0, impl: str = "auto") -> torch.Tensor:
    """x Wᵀ + b + scale · (dropout(x) Aᵀ) Bᵀ over a frozen W. x [..., I] → [..., O] (the base compute dtype).

    `dropout` is the probability applied now: pass 0 in eval. The mask comes from torch's global RNG.
    """
    _check(x, weight, bias, lora_a, lora_b, dropout, impl)
    mask = dropout_mask(x, dropout)
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        return lora_linear_ref(x, weight, bias, lora_a, lora_b, scale, mask, dropout)
    lead, i = x.shape[:-1], x.shape[-1]
    y = LoRALinearFunction.apply(x.reshape(-1, i), weight, bias, lora_a, lora_b, float(scale),
                                 None if mask is None else mask.reshape(-1, i), float(dropout))  # [T, O]
    return y.view(*lead, weight.shape[0])


def lora_linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor], lora_as: Sequence[torch.Tensor],
                      lora_bs: Sequence[torch.Tensor], scales: Sequence[float],
                      impl: str = "auto") -> list[torch.Tensor]:
    """[lora_linear(x, W_i, None, A_i, B_i, s_i) for each i] as one op over the shared x (no bias, no dropout).

    The adapters must all train or all be frozen, in one dtype. x [..., I] → [[..., O_i]] (the base compute dtype).
    """
    m = len(weights)
    if m == 0 or not len(lora_as) == len(lora_bs) == len(scales) == m:
        raise ValueError(f"lora_linear_group: need M >= 1 weights, lora_as, lora_bs and scales alike; got {m}, "
                         f"{len(lora_as)}, {len(lora_bs)}, {len(scales)}")
    for w, a, b in zip(weights, lora_as, lora_bs):
        _check(x, w, None, a, b, 0.0, impl)
    if len({a.dtype for a in (*lora_as, *lora_bs)}) != 1 or len({p.requires_grad for p in (*lora_as, *lora_bs)}) != 1:
        raise ValueError("lora_linear_group: the adapters must share one dtype and all train or all be frozen; got "
                         f"{[(str(a.dtype), a.requires_grad) for a in (*lora_as, *lora_bs)]}")
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        return [lora_linear_ref(x, w, None, a, b, s) for w, a, b, s in zip(weights, lora_as, lora_bs, scales)]
    lead, i = x.shape[:-1], x.shape[-1]
    ys = LoRALinearGroupFunction.apply(x.reshape(-1, i), tuple(float(s) for s in scales), *weights, *lora_as, *lora_bs)
    return [y.view(*lead, w.shape[0]) for y, w in zip(ys, weights)]


# --- reference ------------------------------------------------------------------------------------
def lora_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
                    p: float = 0.0) -> torch.Tensor:
    """Plain PyTorch in fp32, cast back to the base compute dtype (autocast's, else x.dtype). mask: bool keep-mask."""
    out_dtype = _compute_dtypes(x, lora_a)[0]
    with torch.autocast(x.device.type, enabled=False):
        y = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
        y = y + lora_adapter_ref(x, lora_a, lora_b, scale, mask, p)
    return y.to(out_dtype)


def lora_adapter_ref(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None, p: float = 0.0) -> torch.Tensor:
    """The adapter term s · (dropout(x) Aᵀ) Bᵀ in fp32 (plain PyTorch, autograd): lora_linear_ref's, and the fp8
    base's reference (kernels/fp8_linear.py). Call with autocast off."""
    return F.linear(F.linear(_dropped(x.float(), mask, p), lora_a.float()), lora_b.float()) * scale
