"""torch's Adafactor stepped on FSDP2's sharded (DTensor) parameters: the same algorithm on each rank's rows, with the
sums that span rows taken over the ranks (pipeline/local_shards.py).

torch's own step cannot run on a row-sharded gradient: it squares the column norm in place, and DTensor refuses an
in-place op on the pending (partial) norm (torch 2.14.1). Per parameter p of R rows, what each term needs
(Shazeer & Stern 2018; torch's formulation, step t, w = t^beta2_decay):

    alpha    = max(eps2, RMS(p)) · min(lr, 1/√t)          RMS(p): ‖p‖ summed over the ranks' shards
    row_var  ← lerp(row_var, mean_cols(g²), w)            local: every rank holds whole rows
    col_var  ← lerp(col_var, mean_rows(g²), w)            a matrix: each rank's column sums of g², summed over ranks
    V        = row_var ⊗ col_var / mean_rows(row_var)     mean_rows(row_var): summed over ranks for a matrix
    (a vector: variance ← lerp(variance, g², w), elementwise and local)
    u        = g / √max(V, eps1²)
    p        ← p·(1 − lr·weight_decay) − alpha / max(1, RMS(u)/d) · u     RMS(u): summed over the ranks

For a tensor of 3 or more dims the factored dims (the last two) are not the sharded one, so only the norms are
summed. The states are placed like the parameter (row_var and variance sharded by rows, a matrix's col_var
replicated) so the sharded checkpoint saves each element once and resumes on any number of ranks. On a plain
tensor every sum over ranks is the identity and this is torch's single-tensor Adafactor op for op, bit for bit
(tests/pipeline/test_sharded_optimizers.py): the norms' fp64 round trip gives them back exactly
(local_shards.norms_over_shards), and a mean is a sum then a division, as torch's CPU mean is. Memory: one update
per parameter of a group is held until the update norms are summed in one all-reduce, as torch's foreach Adafactor
holds them; `foreach` is not read.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from atelier_studio.pipeline.local_shards import local, norms_over_shards, placed_like, shard_groups, sum_over_shards


class ShardedAdafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor whose step works on each parameter's local shard (module docstring)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:  # FSDP2 gives every rank a gradient (an empty shard too): the ranks agree
                self._step_group(group, params)
        return loss

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = torch.tensor(0.0, dtype=scalar)  # torch's: a CPU scalar
            g = local(p.grad)
            if g.dim() > 1:
                row = list(g.shape)
                row[-1] = 1
                col = list(g.shape)
                col[-2] = 1  # a matrix's column factor spans every row: whole on each rank
                state["row_var"] = placed_like(p, g.new_zeros(row), reduced_dim=-1)
                state["col_var"] = placed_like(p, g.new_zeros(col), reduced_dim=-2)
            else:
                state["variance"] = placed_like(p, torch.zeros_like(g, memory_format=torch.preserve_format))
        return state

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for p in params:
            if torch.is_complex(p) or p.grad.is_sparse:
                raise RuntimeError("Adafactor does not support complex parameters or sparse gradients")
        lr = float(group["lr"])
        eps1, eps2 = group["eps"]
        if eps1 is None:
            eps1 = torch.finfo(params[0].dtype).eps  # torch's: the first parameter's dtype, for the whole group
        d, weight_decay, beta2_decay = group["d"], group["weight_decay"], group["beta2_decay"]
        groups = [shard_groups(p) for p in params]
        weights = [local(p) for p in params]
        grads = [-local(p.grad) if group["maximize"] else local(p.grad) for p in params]
        states = [self._state(p) for p in params]
        steps = []
        for state in states:
            state["step"] += 1
            steps.append(state["step"].item())
        alphas = [max(eps2, norm / p.numel() ** 0.5) * min(lr, 1 / t ** 0.5)
                  for norm, p, t in zip(norms_over_shards(weights, groups), params, steps)]

        # the factored second moment: row means first (local), then the two sums over dim -2, which is the sharded
        # dim 0 of a matrix, in one all-reduce
        factored = [i for i, g in enumerate(grads) if g.dim() > 1]
        col_sums, row_var_sums = {}, {}
        for i in factored:
            g, row_var = grads[i], local(states[i]["row_var"])
            row_var.lerp_(torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1)),
                          steps[i] ** beta2_decay)
            col_sums[i] = torch.linalg.vector_norm(g, dim=-2, keepdim=True).square_()
            row_var_sums[i] = row_var.sum(dim=-2, keepdim=True)
        over_rows = [groups[i] if grads[i].dim() == 2 else () for i in factored]
        sum_over_shards([col_sums[i] for i in factored] + [row_var_sums[i] for i in factored], over_rows * 2)

        updates = []
        for i, (p, g, state) in enumerate(zip(params, grads, states)):
            w = steps[i] ** beta2_decay
            if i in col_sums:
                rows = p.shape[-2]  # the full parameter's
                col_var, row_var = local(state["col_var"]), local(state["row_var"])
                col_var.lerp_(col_sums[i].div_(rows), w)
                var_estimate = row_var @ col_var
                var_estimate.div_(row_var_sums[i].div_(rows).clamp_(min=eps1))
            else:
                variance = local(state["variance"])
                variance.lerp_(g * g, w)
                var_estimate = variance.clone()
            updates.append(var_estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(g))  # eps1 squared: it is under a root
        for p, weight, update, norm, alpha in zip(params, weights, updates, norms_over_shards(updates, groups), alphas):
            if weight_decay != 0:
                weight.mul_(1 - lr * weight_decay)
            weight.add_(update, alpha=-alpha / max(1.0, norm / (p.numel() ** 0.5 * d)))


__all__ = ["ShardedAdafactor"]
