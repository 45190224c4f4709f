"""Packed rows balanced across ranks by attention cost, so no rank waits on a long row.

Shape legend: W ranks, B rows per rank's micro-batch, G = W·B rows of one global micro-batch.

Every row has the same number of tokens T, so the matmul work per row is equal; attention is not: a row
holding one document of T tokens costs ~T², a row of eight documents of T/8 costs ~T²/8. With FSDP every
rank waits at each collective for the slowest, so the rows of a global micro-batch are split over the
ranks to even out Σ len² (the per-row cost), keeping B rows per rank (one shape: no recompiles).

The set of G rows of global micro-batch c is exactly the one `data.packing.PackedLoader` gives (the same
epoch permutation, cut into global batches of W·B rows); only who gets which row changes. A run's global
batch therefore depends on W·B alone, and a checkpoint resumes on any (W, B) with the same W·B.
"""

from __future__ import annotations

from typing import Sequence

from atelier_studio.data.packing import LoaderStateError, PackedLoader


def row_cost(doc_lens: Sequence[int]) -> int:
    """Attention cost of one packed row: Σ len² over its documents (padding attends nothing useful)."""
    return sum(n * n for n in doc_lens)


def balance_rows(costs: Sequence[int], world_size: int) -> list[list[int]]:
    """Split G = len(costs) items into `world_size` groups of G / world_size, evening out the summed cost.

    Largest cost first, each to the group with the least cost so far that still has room (ties: the lower
    group, then the lower index) — LPT scheduling with equal group sizes. Returns each group's indices in
    ascending order. Deterministic: every rank computes the same split without communicating.
    """
    if world_size < 1 or len(costs) % world_size:
        raise ValueError(f"balance_rows: {len(costs)} rows cannot be split evenly over {world_size} ranks")
    size = len(costs) // world_size
    groups: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = min((g for g in range(world_size) if len(groups[g]) < size), key=lambda g: (load[g], g))
        groups[g].append(i)
        load[g] += costs[i]
    return [sorted(g) for g in groups]


def balance_rows_ref(costs: Sequence[int], world_size: int) -> list[list[int]]:
    """Reference: the same greedy rule, written as a scan over every (group, item) pair."""
    size = len(costs) // world_size
    groups: list[list[int]] = [[] for _ in range(world_size)]
    left = list(range(len(costs)))
    while left:
        i = max(left, key=lambda i: (costs[i], -i))
        left.remove(i)
        open_groups = [g for g in range(world_size) if len(groups[g]) < size]
        best = open_groups[0]
        for g in open_groups:
            if sum(costs[j] for j in groups[g]) < sum(costs[j] for j in groups[best]):
                best = g
        groups[best].append(i)
    return [sorted(g) for g in groups]


class BalancedPackedLoader(PackedLoader):
    """PackedLoader whose ranks split each global micro-batch by attention cost (`balance=True`).

    With one rank, or balance=False, it yields exactly what PackedLoader yields. Its state resumes on any
    world size W' and micro-batch B' with W'·B' = W·B (the cursor counts global micro-batches).
    """

    def __init__(self, *args, balance: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.balance = balance
        self._costs = [row_cost(lens) for lens in self.packed.doc_lens]

    def batch_rows(self, epoch: int, cursor: int) -> list[int]:
        if not self.balance or self.world_size == 1:
            return super().batch_rows(epoch, cursor)
        G = self.micro_batch * self.world_size
        rows = self._epoch_order(epoch)[cursor * G:(cursor + 1) * G]  # the global micro-batch, as PackedLoader
        groups = balance_rows([self._costs[r] for r in rows], self.world_size)
        return [rows[i] for i in groups[self.rank]]

    def load_state_dict(self, state: dict) -> None:
        """Accept a state saved with another (world_size, micro_batch) of the same product, else explain."""
        state = dict(state)
        if "world_size" in state and "micro_batch" in state:
            saved = state["world_size"] * state["micro_batch"]
            mine = self.world_size * self.micro_batch
            if saved != mine:
                raise LoaderStateError(
                    f"the checkpoint's global micro-batch is "
                    f"{state['world_size']} ranks x {state['micro_batch']} rows = {saved} rows, this run's is "
                    f"{self.world_size} x {self.micro_batch} = {mine}; set train.micro_batch so that "
                    f"processes x micro_batch = {saved} to resume exactly")
            state["world_size"], state["micro_batch"] = self.world_size, self.micro_batch
        super().load_state_dict(state)


__all__ = ["row_cost", "balance_rows", "balance_rows_ref", "BalancedPackedLoader"]
