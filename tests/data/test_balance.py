"""Rows balanced across ranks by attention cost: a valid split, the greedy rule, the same global batches."""

from __future__ import annotations

import random

import pytest

from atelier_studio.data.balance import BalancedPackedLoader, balance_rows, balance_rows_ref, row_cost
from atelier_studio.data.chat import EncodedDoc
from atelier_studio.data.packing import PackedLoader, pack_documents


def docs(n: int, seed: int, max_len: int = 60) -> list[EncodedDoc]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.choice([rng.randint(2, 8), rng.randint(20, max_len)])  # short and long documents
        ids = [rng.randint(1, 99) for _ in range(k)]
        out.append(EncodedDoc(input_ids=ids, loss_mask=[i > 0 for i in range(k)]))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(5))
def test_balance_rows_matches_reference_and_is_a_partition(world, seed):
    rng = random.Random(seed)
    per = rng.randint(1, 5)
    costs = [rng.choice([rng.randint(1, 50), rng.randint(1000, 4000)]) for _ in range(world * per)]
    groups = balance_rows(costs, world)
    assert groups == balance_rows_ref(costs, world)
    assert sorted(i for g in groups for i in g) == list(range(len(costs)))
    assert all(len(g) == per for g in groups)


def test_balance_beats_the_contiguous_split_on_skewed_rows():
    costs = [4000, 3900, 10, 12, 3800, 11, 9, 3700]  # contiguous halves: 7922 vs 7520; balanced: 7721 vs 7721
    groups = balance_rows(costs, 2)
    balanced = max(sum(costs[i] for i in g) for g in groups)
    contiguous = max(sum(costs[:4]), sum(costs[4:]))
    assert balanced < contiguous
    assert balanced - min(sum(costs[i] for i in g) for g in groups) <= 10


def test_balance_rows_rejects_an_uneven_split():
    with pytest.raises(ValueError, match="5 rows cannot be split evenly over 2 ranks"):
        balance_rows([1, 2, 3, 4, 5], 2)


def test_row_cost_is_sum_of_squares():
    assert row_cost([3, 4]) == 25 and row_cost([]) == 0


def test_same_global_batches_as_packed_loader_on_any_world_size():
    packed = pack_documents(docs(80, 0), 64)
    one = PackedLoader(packed, micro_batch=4, seed=3)
    for world in (1, 2, 4):
        ranks = [BalancedPackedLoader(packed, 4 // world, 3, r, world) for r in range(world)]
        for epoch in range(2):
            for cursor in range(one.len_epoch):
                rows = [x for loader in ranks for x in loader.batch_rows(epoch, cursor)]
                assert sorted(rows) == sorted(one.batch_rows(epoch, cursor)), (world, epoch, cursor)


def test_one_rank_yields_exactly_packed_loader():
    packed = pack_documents(docs(40, 1), 64)
    a, b = PackedLoader(packed, 3, 7), BalancedPackedLoader(packed, 3, 7)
    for _ in range(2 * a.len_epoch + 1):
        assert a.batch_rows(a.epoch, a.cursor) == b.batch_rows(b.epoch, b.cursor)
        next(a), next(b)


def test_balanced_ranks_are_more_even_than_contiguous():
    packed = pack_documents(docs(200, 2, max_len=120), 128)
    costs = [row_cost(lens) for lens in packed.doc_lens]
    worst = {True: 0, False: 0}
    for balance in (True, False):
        ranks = [BalancedPackedLoader(packed, 2, 0, r, 4, balance=balance) for r in range(4)]
        for cursor in range(ranks[0].len_epoch):
            loads = [sum(costs[i] for i in loader.batch_rows(0, cursor)) for loader in ranks]
            worst[balance] += max(loads)
    assert worst[True] < worst[False]


def test_state_resumes_on_another_world_size_with_the_same_global_batch():
    packed = pack_documents(docs(60, 3), 64)
    two = [BalancedPackedLoader(packed, 1, 5, r, 2) for r in range(2)]
    for _ in range(5):
        for loader in two:
            next(loader)
    one = BalancedPackedLoader(packed, 2, 5)
    one.load_state_dict(two[0].state_dict())
    assert (one.epoch, one.cursor) == (two[0].epoch, two[0].cursor)
    nxt = sorted(next(one).input_ids.sum(dim=1).tolist())
    assert nxt == sorted(next(two[0]).input_ids.sum(dim=1).tolist() + next(two[1]).input_ids.sum(dim=1).tolist())


def test_state_from_another_global_batch_is_refused():
    packed = pack_documents(docs(60, 3), 64)
    saved = BalancedPackedLoader(packed, 1, 5, 0, 2).state_dict()
    with pytest.raises(ValueError, match="2 ranks x 1 rows = 2 rows.*1 x 3 = 3"):
        BalancedPackedLoader(packed, 3, 5).load_state_dict(saved)
