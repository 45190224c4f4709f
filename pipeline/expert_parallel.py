"""Expert parallelism under FSDP2: each rank keeps E/P of every MoE layer's experts; tokens travel to their experts
and back by all-to-all (the plan pipeline/distributed.py's parallelize applies before FSDP2).

Shape legend: P ranks in the expert-parallel group (here the whole world), E experts, El = E/P local experts,
S = N·k slots routed on this rank, R rows this rank's experts receive, D dim.

One MoE layer on rank r (kernels/moe.py does the local steps; ExpertExchange the rest):
    route → sort the S slots by expert (experts q·El .. (q+1)·El − 1 live on rank q, so the slots for rank q are
    one contiguous run of the sorted order)
    counts [P, El] → all_to_all: how many rows each rank sends each of my experts (one small collective; the split
        sizes are read on the host: one sync per layer, the price of an exchange without a capacity factor)
    rows → all_to_all_single: R rows grouped by (source rank, local expert); stable-sorted by local expert
    the El local experts' grouped GEMMs on them
    unsort → all_to_all_single back (the reverse splits) → this rank's S slot outputs → combine.
The all-to-alls are differentiable (their backward is the reverse exchange), so expert weights receive every
rank's tokens' gradient contributions through the exchange: they are summed by construction and need no gradient
reduction. Everything else stays FSDP2's (sharded, all-gathered per block, reduce-scattered).

Placement: the expert weights (and their LoRA adapters) are DTensors sharded on dim 0 over the same mesh as FSDP2's
(Shard(0) of [E, ...] over P ranks is exactly the El experts rank r owns), left out of fully_shard (ignored_params):
never all-gathered. To everything else that walks parameters — pipeline/distributed.py materialize_ (each rank
reads its experts' rows from the safetensors files), gradient clipping, sharded checkpoints, the consolidated
export — they look like FSDP2's own shards. The experts' module computes on their local tensors.

Scope: the expert-parallel group is the whole world (P = W, one node of 8 GPUs is the intended case); E must be a
multiple of W. docs/moe.md maps it to 8 and 64 GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from atelier_studio.pipeline.config import ConfigError

if TYPE_CHECKING:
    from atelier_studio.pipeline.distributed import DistContext


class AllToAll(torch.autograd.Function):
    """Rows of x exchanged over `group`: in_splits[q] rows go to rank q, out_splits[q] rows come from it; the
    backward sends the gradient back the same way reversed."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):  # noqa: D102
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


@dataclass(frozen=True)
class ExchangePlan:
    """One layer's exchange, from dispatch to combine."""

    send: list[int]  # rows this rank sends each rank
    recv: list[int]  # rows it receives from each rank
    order: torch.Tensor  # [R] int64: received row of each local slot, in local-expert order
    offs: torch.Tensor  # [El] int32: cumulative rows per local expert


class ExpertExchange:
    """The all-to-all of one rank's routed slots to the ranks owning their experts, and back (kernels.moe.Exchange)."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.size:
            raise ConfigError(f"train.distributed.expert_parallel: {num_experts} experts do not split over "
                              f"{self.size} ranks")
        self.local = num_experts // self.size

    @property
    def experts(self) -> slice:
        """The global experts this rank holds."""
        return slice(self.rank * self.local, (self.rank + 1) * self.local)

    def dispatch(self, xs: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, ExchangePlan]:
        """xs [S, D] sorted by global expert, offs [E] → (rows for the local experts [R, D], sorted by local expert)."""
        counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long()).view(self.size, self.local)  # [P, El]
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)  # row q: rank q's rows for each local expert
        send, recv = counts.sum(1).tolist(), got.sum(1).tolist()  # the host reads the split sizes
        rows = AllToAll.apply(xs, recv, send, self.group)  # [R, D] by (source rank, local expert)
        local = torch.arange(self.local, device=xs.device).repeat(self.size)  # [P·El]
        label = torch.repeat_interleave(local, got.reshape(-1), output_size=sum(recv))  # [R]
        order = torch.sort(label, stable=True).indices
        offs_local = torch.cumsum(got.sum(0), 0, dtype=torch.int32)
        return rows[order], ExchangePlan(send, recv, order, offs_local)

    def combine(self, ys_local: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
        """The local experts' outputs [R, D] (local-expert order) → this rank's slots' outputs [S, D]."""
        rows = torch.empty_like(ys_local).index_copy(0, plan.order, ys_local)  # back to (source rank, expert) order
        return AllToAll.apply(rows, plan.send, plan.recv, self.group)


def own_rows(full: torch.Tensor, rows: slice) -> torch.Tensor:
    """`full`'s rows `rows` in storage of their own: a view would keep the whole tensor alive (every expert's
    weights on every rank) once `full` itself is dropped, as when the model was loaded whole (init = "full")."""
    return full[rows].clone()


def apply_expert_parallel(blocks: Sequence[nn.Module], ctx: DistContext, size: int) -> set[nn.Parameter]:
    """Shard the experts of every block over the world (size must equal it) and route their tokens by all-to-all,
    in place; returns the expert parameters, which FSDP2 must leave alone (fully_shard's ignored_params).

    An MoE layer offers `use_exchange(exchange, shard)` (designer/qwen3_moe.py's SparseMoeBlock): it keeps its
    experts' rows `exchange.experts` as `shard(full)` parameters and passes the exchange to kernels/moe.py.
    """
    if not ctx.enabled or size != ctx.world_size:
        raise ConfigError(f"train.distributed.expert_parallel = {size}: expert parallelism spans every process; "
                          f"set it to the number of processes ({ctx.world_size}) under torchrun, or 1")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    hosts = [m for block in blocks for m in block.modules() if hasattr(m, "use_exchange")]
    if not hosts:
        raise ConfigError(f"train.distributed.expert_parallel = {size}: this model has no mixture-of-experts layers")
    params: set[nn.Parameter] = set()
    for host in hosts:
        exchange = ExpertExchange(host.num_experts)

        def shard(full: torch.Tensor, exchange: ExpertExchange = exchange) -> nn.Parameter:
            local = own_rows(full.detach(), exchange.experts)
            p = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                                stride=full.stride()), requires_grad=full.requires_grad)
            params.add(p)
            return p

        host.use_exchange(exchange, shard)
    return params
