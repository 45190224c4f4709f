"""prodigyopt's Prodigy stepped on FSDP2's sharded (DTensor) parameters: the same algorithm on each rank's rows, with
its two sums over every parameter taken over the ranks (pipeline/local_shards.py).

Prodigy (Mishchenko & Defazio 2023) estimates the step size d from two sums over all parameters, at step k:

    numerator ← beta3·numerator + Σ_p (d/d0)·d·lr·⟨g_p, p0_p − p⟩      p0: the weights at the first step
    s_p       ← beta3·s_p + (d/d0)·d·lr·g_p
    d̂         = d_coef · numerator / Σ_p ‖s_p‖₁,   d ← min(max(d, d̂ at first), d_max, d·growth_rate)

and then takes an Adam step with lr·d. Every other term is elementwise, so each rank runs it on its rows and only the
two partial sums cross ranks: one fp64 all-reduce per step.

What prodigyopt 1.1.2 does with DTensors, and why this subclass exists: it flattens each parameter for the dot
product and for `s` and `p0`, which DTensor refuses for rows that do not split evenly over the ranks (and where they
do, every dot and sum is a collective of its own, two per parameter per step). Its `fsdp_in_use` flag is for FSDP1's
flat parameters (plain tensors): it all-reduces the two sums in a `.cuda()` tensor (no CPU, so no gloo), after
DTensor's dot products had already summed them, which would count them W times. Here `s`, `p0` and the moments keep
the parameter's shape and placement (so the sharded checkpoint saves and re-shards them like the parameter), `p0`
is always a copy (prodigyopt keeps a scalar zero for an all-zero parameter, which the ranks would have to agree on
and a sharded load could not fill), and `slice_p` must be 1. On plain tensors this is prodigyopt's step op for op,
bit for bit (tests/pipeline/test_sharded_optimizers.py): the sums stay Python floats accumulated in its order. So
pipeline/optimizers.py runs it on one process too: one layout of the state, and a checkpoint of several ranks
resumes on one (prodigyopt's flat `s` would not take the saved matrix); a one-process checkpoint in prodigyopt's
own layout still loads (`_shape_flat_states`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from prodigyopt import Prodigy

from atelier_studio.pipeline.distributed import DistributedError
from atelier_studio.pipeline.local_shards import local, placed_like, shard_groups, sum_over_shards


class ShardedProdigy(Prodigy):
    """prodigyopt.Prodigy whose step works on each parameter's local shard (module docstring)."""

    def __init__(self, params: Any, **kwargs: Any):
        if kwargs.get("slice_p", 1) != 1 or kwargs.get("fsdp_in_use"):
            raise ValueError("ShardedProdigy sums over the ranks itself and reads every entry: slice_p must be 1 "
                             "and fsdp_in_use unset")
        super().__init__(params, **kwargs)
        every = [p for g in self.param_groups for p in g["params"]]
        groups = {shard_groups(p) for p in every}
        if len(groups) > 1:
            raise DistributedError("train.optimizer: 'prodigy' sums its step-size estimate over every parameter, so "
                                   "all of them must be sharded over the same ranks, and this model's trainable "
                                   "parameters are split over different process groups (or some not at all): pick "
                                   "another train.optimizer")
        self._groups = groups.pop() if groups else ()
        self.register_load_state_dict_post_hook(_shape_flat_states)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = self.param_groups[0]
        beta1, beta2 = first["betas"]
        beta3 = first["beta3"] if first["beta3"] is not None else math.sqrt(beta2)
        k, d, d_max, d_coef = first["k"], first["d"], first["d_max"], first["d_coef"]
        growth_rate, decouple = first["growth_rate"], first["decouple"]
        lr = max(group["lr"] for group in self.param_groups)
        bias_correction = 1
        if first["use_bias_correction"]:
            bias_correction = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1))
        dlr = d * lr * bias_correction
        d_numerator = first["d_numerator"] * beta3
        delta_numerator, d_denom = 0.0, 0.0
        device = None
        for group in self.param_groups:
            decay, group_lr, d0 = group["weight_decay"], group["lr"], group["d0"]
            if group_lr not in [lr, 0.0]:
                raise RuntimeError("Setting different lr values in different parameter groups is only supported for "
                                   "values of 0")
            for p in group["params"]:
                if p.grad is None:
                    continue
                weight, grad = local(p), local(p.grad)
                device = weight.device
                if decay != 0 and not decouple:
                    grad.add_(weight, alpha=decay)  # coupled weight decay, in the gradient as prodigyopt does
                state = self.state[p]
                if "step" not in state:
                    state["step"] = 0
                    state["s"] = placed_like(p, torch.zeros_like(weight))
                    state["p0"] = placed_like(p, weight.clone())
                    if beta1 > 0:
                        state["exp_avg"] = placed_like(p, torch.zeros_like(weight))
                    state["exp_avg_sq"] = placed_like(p, torch.zeros_like(weight))
                if group_lr > 0.0:
                    # d / d0 rather than d: values that are not too small (prodigyopt)
                    delta_numerator += (d / d0) * dlr * torch.dot(
                        grad.flatten(), (local(state["p0"]) - weight).flatten()).item()
                    if beta1 > 0:
                        local(state["exp_avg"]).mul_(beta1).add_(grad, alpha=d * (1 - beta1))
                    local(state["exp_avg_sq"]).mul_(beta2).addcmul_(grad, grad, value=d * d * (1 - beta2))
                    s = local(state["s"])
                    s.mul_(beta3).add_(grad, alpha=(d / d0) * (d if group["safeguard_warmup"] else dlr))
                    d_denom += s.abs().sum().item()
        last_d0 = group["d0"]  # prodigyopt compares d with the last group's d0
        if self._groups and device is not None:
            sums = torch.tensor([delta_numerator, d_denom], dtype=torch.float64, device=device)
            sum_over_shards([sums], [self._groups])
            delta_numerator, d_denom = sums.tolist()

        if d_denom == 0:  # no gradient anywhere yet (also the zero-gradient step that sets up a sharded load)
            return loss
        d_hat = d
        global_numerator = d_numerator + delta_numerator
        if lr > 0.0:
            d_hat = d_coef * global_numerator / d_denom
            if d == last_d0:
                d = max(d, d_hat)
            d_max = max(d_max, d_hat)
            d = min(d_max, d * growth_rate)

        for group in self.param_groups:
            group.update(d_numerator=global_numerator, d_denom=d_denom, d=d, d_max=d_max, d_hat=d_hat)
            decay, eps = group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                weight, grad = local(p), local(p.grad)
                state = self.state[p]
                state["step"] += 1
                denom = local(state["exp_avg_sq"]).sqrt().add_(d * eps)
                if decay != 0 and decouple:
                    weight.add_(weight, alpha=-decay * dlr)
                if beta1 > 0:
                    weight.addcdiv_(local(state["exp_avg"]), denom, value=-dlr)
                else:
                    weight.addcdiv_(grad, denom, value=-dlr * d)
            group["k"] += 1
        return loss


def _shape_flat_states(optimizer: ShardedProdigy) -> None:
    """A state loaded from prodigyopt's own layout (a one-process checkpoint written before this class: `s` and `p0`
    flat) viewed in the parameter's shape; a scalar-zero `p0` stays one (it broadcasts)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in ("s", "p0"):
                v = state.get(key)
                if torch.is_tensor(v) and v.ndim == 1 and v.shape != p.shape and v.numel() == p.numel():
                    state[key] = v.view(p.shape)


__all__ = ["ShardedProdigy"]
