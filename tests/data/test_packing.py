"""data/packing.py: best-fit packing, shifted labels, boundaries, and the resumable rank-aware loader."""

import json

import pytest
import torch

from atelier_studio.data.chat import EncodedDoc
from atelier_studio.data.packing import (
    IGNORE_INDEX,
    Batch,
    LoaderStateError,
    PackedLoader,
    best_fit_decreasing,
    best_fit_decreasing_ref,
    compile_shape,
    first_fit,
    fixed_shape,
    make_batch,
    overflow_pieces,
    pack_documents,
    pack_documents_ref,
)

PAD = 0


def random_docs(seed: int, n: int, max_len: int) -> list[EncodedDoc]:
    """Random ids in 3..499 (never pad) and a random loss mask per token."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    return [EncodedDoc(torch.randint(3, 500, (k,), generator=g).tolist(),
                       (torch.rand(k, generator=g) < 0.6).tolist()) for k in lens]


def segments(packed, r):
    """[(start, end)] of the real documents of row r."""
    out, t = [], 0
    for n in packed.doc_lens[r]:
        out.append((t, t + n))
        t += n
    return out


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_matches_reference_and_beats_first_fit(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 97, (300,), generator=g).tolist()
    bins = best_fit_decreasing(lengths, 97)
    assert bins == best_fit_decreasing_ref(lengths, 97)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 97 for b in bins)
    assert len(bins) <= len(first_fit(lengths, 97))
    assert len(bins) >= -(-sum(lengths) // 97)


@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_pack_matches_token_by_token_reference(overflow):
    docs, T = random_docs(1, 60, 50), 32
    packed = pack_documents(docs, T, overflow, pad_id=PAD)
    pieces, _ = overflow_pieces(docs, T, overflow)
    bins = [[pieces[i] for i in b] for b in best_fit_decreasing_ref([e - s for _, s, e in pieces], T)]
    ids, labels, pos = pack_documents_ref(docs, bins, T, pad_id=PAD)
    assert packed.input_ids.tolist() == ids
    assert packed.labels.tolist() == labels
    assert packed.position_ids.tolist() == pos
    assert packed.input_ids.shape == (len(bins), T)


def test_split_keeps_every_token_once_and_counts():
    docs, T = random_docs(2, 80, 70), 32
    packed = pack_documents(docs, T, "split", pad_id=PAD)
    got = sorted(tuple(packed.input_ids[r, s:e].tolist()) for r in range(len(packed)) for s, e in segments(packed, r))
    want = sorted(tuple(d.input_ids[s:s + T]) for d in docs for s in range(0, len(d), T))
    assert got == want
    st = packed.stats
    assert st.num_docs == 80 and st.num_split == sum(len(d) > T for d in docs) > 0
    assert st.num_truncated == st.num_dropped == 0
    assert st.num_tokens == sum(map(len, docs))
    assert st.padding_fraction == pytest.approx(1 - st.num_tokens / (st.num_rows * T))


def test_truncate_and_drop_counts():
    docs, T = random_docs(3, 50, 60), 32
    long = sum(len(d) > T for d in docs)
    tr = pack_documents(docs, T, "truncate", pad_id=PAD).stats
    dr = pack_documents(docs, T, "drop", pad_id=PAD).stats
    assert long > 0 and tr.num_truncated == long and dr.num_dropped == long
    assert tr.num_tokens == sum(min(len(d), T) for d in docs)
    assert dr.num_tokens == sum(len(d) for d in docs if len(d) <= T)


def test_positions_restart_and_labels_stay_inside_documents():
    docs, T = random_docs(4, 60, 40), 24
    packed = pack_documents(docs, T, "split", pad_id=7)
    for r in range(len(packed)):
        ids, lab, pos = packed.input_ids[r], packed.labels[r], packed.position_ids[r]
        segs = segments(packed, r)
        for s, e in segs:
            assert pos[s:e].tolist() == list(range(e - s))
            assert lab[e - 1] == IGNORE_INDEX  # the last token of a document predicts nothing
            inside = lab[s:e - 1]
            keep = inside != IGNORE_INDEX
            assert torch.equal(inside[keep], ids[s + 1:e][keep])
        end = segs[-1][1]
        assert pos[end:].tolist() == list(range(T - end))
        assert (lab[end:] == IGNORE_INDEX).all() and (ids[end:] == 7).all()


def test_batch_boundaries_and_host_counts():
    docs, T = random_docs(5, 40, 40), 32
    packed = pack_documents(docs, T, "split", pad_id=PAD)
    rows = [3, 0, 5]
    b = make_batch(packed, rows)
    assert b.input_ids.shape == b.labels.shape == b.position_ids.shape == (3, T)
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == 3 * T
    seg_lens = b.cu_seqlens.diff().tolist()
    assert b.max_seqlen == max(seg_lens) and min(seg_lens) > 0
    # every segment starts at position 0 and positions increase by 1 inside it
    flat_pos = b.position_ids.flatten()
    starts = torch.zeros(3 * T, dtype=torch.bool)
    starts[b.cu_seqlens[:-1].long()] = True
    assert torch.equal(flat_pos == 0, starts)
    # real documents = segments minus each row's padding segment
    want = [n for r in rows for n in packed.doc_lens[r]]
    assert b.doc_lens == want and b.num_tokens == sum(want)
    assert isinstance(b.num_loss_tokens, int) and b.num_loss_tokens == int((b.labels != IGNORE_INDEX).sum())
    assert b.num_loss_tokens > 0
    moved = b.to("cpu")
    assert isinstance(moved, Batch) and torch.equal(moved.labels, b.labels) and moved.doc_lens == b.doc_lens


def test_compile_shape_buckets_the_segment_count_and_keeps_the_tokens():
    docs, T = random_docs(5, 60, 12), 32
    packed = pack_documents(docs, T, "split", pad_id=PAD)
    b = make_batch(packed, [3, 0, 5])
    s = b.cu_seqlens.numel() - 1
    assert s > 3  # really packed
    for multiple in (1, 4, 64):
        c = compile_shape(b, multiple)
        padded = -(-s // multiple) * multiple
        assert c.cu_seqlens.numel() == padded + 1 and c.max_seqlen == T
        assert torch.equal(c.cu_seqlens[: s + 1], b.cu_seqlens) and (c.cu_seqlens[s:] == 3 * T).all()  # empty ones
        assert torch.equal(c.input_ids, b.input_ids) and torch.equal(c.labels, b.labels) and c.doc_lens == b.doc_lens
    # shapes repeat: every batch of this run lands in one of a few buckets
    shapes = {compile_shape(make_batch(packed, [r, r + 1, r + 2])).cu_seqlens.numel() for r in range(8)}
    assert shapes == {65}
    # one document per row: already one shape, and attention's per-row causal kernel needs it as it is
    rows = Batch(b.input_ids, b.labels, b.position_ids, torch.arange(0, 3 * T + 1, T, dtype=torch.int32), T,
                 [T] * 3, 3 * T, b.num_loss_tokens)
    assert compile_shape(rows) is rows
    with pytest.raises(ValueError, match="segments > 2"):
        fixed_shape(b, 2)


def _rows_of(loader: PackedLoader, n: int) -> list[list[int]]:
    return [next(loader).input_ids.tolist() for _ in range(n)]


def test_loader_deterministic_and_reshuffles_per_epoch():
    packed = pack_documents(random_docs(6, 120, 30), 32, "split", pad_id=PAD)
    a, b = PackedLoader(packed, 2, seed=1), PackedLoader(packed, 2, seed=1)
    n = a.len_epoch
    assert n == len(packed) // 2
    ea = _rows_of(a, n)
    assert ea == _rows_of(b, n)
    assert ea != _rows_of(PackedLoader(packed, 2, seed=2), n)
    assert a.batch_rows(0, 0) != a.batch_rows(1, 0) or a.batch_rows(0, 1) != a.batch_rows(1, 1)
    assert _rows_of(a, n) != ea  # the second epoch is another order, each row at most once
    e1 = [r for c in range(n) for r in a.batch_rows(1, c)]
    assert len(set(e1)) == len(e1) == 2 * n and set(e1) <= set(range(len(packed)))


@pytest.mark.parametrize("k", [0, 3, 7, 11])
def test_resume_yields_exactly_the_next_batches(k):
    packed = pack_documents(random_docs(7, 70, 30), 32, "split", pad_id=PAD)
    ref = PackedLoader(packed, 3, seed=5, rank=1, world_size=2)
    expect = [next(ref) for _ in range(k + 6)]  # crosses an epoch boundary for k >= 3
    run = PackedLoader(packed, 3, seed=5, rank=1, world_size=2)
    for _ in range(k):
        next(run)
    state = json.loads(json.dumps(run.state_dict()))
    resumed = PackedLoader(packed, 3, seed=5, rank=1, world_size=2)
    resumed.load_state_dict(state)
    for want in expect[k:]:
        got = next(resumed)
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert (got.doc_lens, got.num_loss_tokens, got.max_seqlen) == (want.doc_lens, want.num_loss_tokens,
                                                                       want.max_seqlen)


@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_disjoint_with_equal_step_counts(drop_last):
    packed = pack_documents(random_docs(8, 91, 30), 32, "split", pad_id=PAD)
    R, ws, mb = len(packed), 3, 2
    loaders = [PackedLoader(packed, mb, seed=9, rank=r, world_size=ws, drop_last=drop_last) for r in range(ws)]
    assert len({ld.len_epoch for ld in loaders}) == 1
    n = loaders[0].len_epoch
    per_rank = [[r for c in range(n) for r in ld.batch_rows(0, c)] for ld in loaders]
    assert all(len(rows) == n * mb for rows in per_rank)
    seen = [r for rows in per_rank for r in rows]
    if drop_last:
        assert len(set(seen)) == len(seen) == (R // (mb * ws)) * mb * ws
    else:
        assert set(seen) == set(range(R)) and len(seen) == -(-R // (mb * ws)) * mb * ws
    assert R % (mb * ws) != 0  # the test needs a ragged tail to mean anything


def test_eval_batches_cover_rows_once_in_order():
    packed = pack_documents(random_docs(10, 50, 30), 32, "split", pad_id=PAD)
    R = len(packed)
    one = list(PackedLoader(packed, 4, seed=0).iter_eval_batches())
    assert torch.equal(torch.cat([b.input_ids for b in one])[:R], packed.input_ids)
    assert sum(b.num_loss_tokens for b in one) == sum(packed.num_loss_tokens)
    two = [list(PackedLoader(packed, 4, seed=0, rank=r, world_size=2).iter_eval_batches()) for r in range(2)]
    assert len(two[0]) == len(two[1])  # same number of forwards on every rank
    assert all(b.input_ids.shape == (4, 32) for bs in two for b in bs)
    assert sum(b.num_loss_tokens for bs in two for b in bs) == sum(packed.num_loss_tokens)
    assert sum(b.num_tokens for bs in two for b in bs) == packed.stats.num_tokens


def test_bad_arguments():
    docs = random_docs(11, 10, 20)
    with pytest.raises(ValueError, match="overflow must be"):
        pack_documents(docs, 32, "wrap")
    with pytest.raises(ValueError, match="document 1 is empty"):
        pack_documents([docs[0], EncodedDoc([], []), docs[1]], 32)
    with pytest.raises(ValueError, match="input_ids has 2 tokens but loss_mask has 1"):
        EncodedDoc([5, 6], [True])
    packed = pack_documents(docs, 32, pad_id=PAD)
    with pytest.raises(ValueError, match="cannot fill one step"):
        PackedLoader(packed, len(packed) + 1, seed=0)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        PackedLoader(packed, 1, seed=0, rank=2, world_size=2)
    loader = PackedLoader(packed, 1, seed=0)
    with pytest.raises(LoaderStateError, match="train.seed is 1 in the checkpoint but 0 now"):
        loader.load_state_dict({"epoch": 0, "cursor": 0, "seed": 1})
    with pytest.raises(LoaderStateError, match="'cursor' must be a non-negative int"):
        loader.load_state_dict({"epoch": 0, "cursor": "3"})


class ToyLM(torch.nn.Module):
    """One causal attention layer with learned absolute positions: enough to see leaks across documents."""

    def __init__(self, vocab: int = 500, dim: int = 16, max_pos: int = 64):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(max_pos, dim)
        self.qkv, self.head = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        """ids, pos, seg [N] (seg = segment id per token) -> logits [N, V]; attention stays inside a segment."""
        x = self.tok(ids) + self.pos(pos)  # [N, D]
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [N, D] each
        n = ids.shape[0]
        allowed = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()  # [N, N]
        return self.head(torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None],
                                                                          attn_mask=allowed)[0])


def test_packed_loss_equals_documents_one_by_one():
    torch.manual_seed(0)
    docs, T = random_docs(12, 12, 30), 32
    model = ToyLM()
    # one by one: shift inside the document, loss on the masked next tokens
    loss_sum, count = 0.0, 0
    for d in docs:
        ids = torch.tensor(d.input_ids)
        logits = model(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
        target = torch.where(torch.tensor(d.loss_mask[1:], dtype=torch.bool), ids[1:], IGNORE_INDEX)
        loss_sum = loss_sum + torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum",
                                                                ignore_index=IGNORE_INDEX)
        count += int((target != IGNORE_INDEX).sum())
    # packed: segment ids from cu_seqlens, labels already shifted
    packed = pack_documents(docs, T, "split", pad_id=PAD)
    b = make_batch(packed, list(range(len(packed))))
    seg = torch.repeat_interleave(torch.arange(len(b.cu_seqlens) - 1), b.cu_seqlens.diff().long())
    logits = model(b.input_ids.flatten(), b.position_ids.flatten(), seg)
    packed_sum = torch.nn.functional.cross_entropy(logits, b.labels.flatten(), reduction="sum",
                                                   ignore_index=IGNORE_INDEX)
    assert b.num_loss_tokens == count > 0
    torch.testing.assert_close(packed_sum, loss_sum, rtol=1e-5, atol=1e-4)


def test_pairs_share_a_row_as_two_documents():
    """pack_pairs: both documents of a pair in one row, chosen first, each its own segment (positions restart, no
    label across); rows equal the token-by-token reference built from the same placement; doc_ids give them back."""
    from atelier_studio.data.packing import pack_pairs

    docs, T = random_docs(4, 40, 30), 64
    pairs = list(zip(docs[::2], docs[1::2]))
    packed = pack_pairs(pairs, T, pad_id=PAD)
    bins = best_fit_decreasing([len(c) + len(r) for c, r in pairs], T)
    flat = [d for pair in pairs for d in pair]
    rows = [[(d, 0, len(flat[d])) for i in b for d in (2 * i, 2 * i + 1)] for b in bins]
    ids, labels, pos = pack_documents_ref(flat, rows, T, pad_id=PAD)
    assert (packed.input_ids.tolist(), packed.labels.tolist(), packed.position_ids.tolist()) == (ids, labels, pos)
    assert packed.doc_ids == [[d for d, _, _ in row] for row in rows]
    assert sorted(d for row in packed.doc_ids for d in row) == list(range(len(flat)))
    for row in packed.doc_ids:
        assert row[0::2] == [d - 1 for d in row[1::2]] and all(d % 2 == 0 for d in row[0::2])
    batch = make_batch(packed, [1, -1, 0])
    assert batch.doc_ids == packed.doc_ids[1] + packed.doc_ids[0]
    assert [len(flat[d]) for d in batch.doc_ids] == batch.doc_lens
