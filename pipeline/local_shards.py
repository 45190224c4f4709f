"""What an optimizer that reduces across a parameter (a norm, a column mean, a dot product) needs to step FSDP2's
sharded parameters on their local shards: the shard, the process groups its rows are split over, sums over them,
and state tensors placed like the parameter.

Shape legend: R rows of a parameter (its dim 0, the one FSDP2 shards), W ranks of a sharding mesh dimension.

FSDP2 places every parameter as Shard(0) on each sharding mesh dimension (Replicate on HSDP's replicating one): a
rank holds whole rows, torch.chunk's split of R over W (the last shards may be short or empty). So a reduction that
keeps dim 0 (a row mean) is complete on each rank, and one over dim 0 or over the whole tensor is this rank's
partial sum, to be summed over the groups of the sharding mesh dimensions. A plain tensor (one process, or a
parameter FSDP2 leaves alone) is its own shard with no group: the same code then runs exactly torch's ops on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from atelier_studio.pipeline.distributed import DistributedError

Groups = tuple[dist.ProcessGroup, ...]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `t` (an alias: in-place ops on it change `t`); `t` itself when it is a plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_groups(t: torch.Tensor) -> Groups:
    """The process groups over which `t`'s rows are split, one per sharding mesh dimension; () for a plain tensor."""
    if not isinstance(t, DTensor):
        return ()
    groups = []
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            groups.append(t.device_mesh.get_group(mesh_dim))
        elif not isinstance(placement, Replicate):
            raise DistributedError(f"an optimizer stepping local shards needs row (dim 0) sharding or replication, "
                                   f"got placement {placement} of a {tuple(t.shape)} parameter")
    return tuple(groups)


def sum_over_shards(tensors: list[torch.Tensor], groups: list[Groups]) -> None:
    """In place: each `tensors[i]` summed over the ranks of `groups[i]`. One all-reduce per distinct groups, of the
    concatenation of every tensor that has them (all ranks call this with the same list); no group, no change."""
    by_groups: dict[Groups, list[int]] = {}
    for i, g in enumerate(groups):
        if g:
            by_groups.setdefault(g, []).append(i)
    for g, idx in by_groups.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        for group in g:
            dist.all_reduce(flat, group=group)
        for i, part in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            tensors[i].copy_(part.view_as(tensors[i]))


def norms_over_shards(shards: list[torch.Tensor], groups: list[Groups]) -> list[float]:
    """The 2-norm of each full tensor from its local shards: each shard's norm squared, summed over the ranks, and
    the root, in fp64 (the sum of many ranks' squares rounds less, and cannot overflow). A tensor held whole gives
    torch's own `norm(2)` bit for bit: an fp32 or bf16 value squares exactly in fp64, and the root of an exact
    square is the value again."""
    if not shards:
        return []
    squares = [s.norm(2).double().square() for s in shards]
    sum_over_shards(squares, groups)
    return torch.stack(squares).sqrt().tolist()  # one host sync for all of them


def placed_like(p: torch.Tensor, shard: torch.Tensor, reduced_dim: int | None = None) -> torch.Tensor:
    """`shard`, this rank's part of an optimizer state of parameter `p`, as a tensor placed like `p`: sharded by rows
    as `p` is, or replicated when the state reduced `p`'s dim 0 to 1 (`reduced_dim`, keepdim). Placed states are
    what torch.distributed.checkpoint saves once per element and re-shards on load; a plain `p` gives `shard`."""
    if not isinstance(p, DTensor):
        return shard
    shape = list(p.shape)
    reduces_rows = reduced_dim is not None and reduced_dim % p.ndim == 0
    if reduced_dim is not None:
        shape[reduced_dim] = 1
    placements = [Replicate() if reduces_rows and isinstance(pl, Shard) else pl for pl in p.placements]
    stride = torch.empty(shape, device="meta").stride()  # contiguous, as the shard is
    return DTensor.from_local(shard, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


__all__ = ["local", "shard_groups", "sum_over_shards", "norms_over_shards", "placed_like"]
