"""Best-fit packing of token documents into fixed-length rows, and the resumable, rank-aware loader over them.

Shape legend: R packed rows, B rows per micro-batch, T = seq_len tokens per row, D segments in a batch
(real documents + one padding segment per row that is not full).

Row layout (T = 12, docs a (4 tokens), b (5 tokens), padding p):

    input_ids     a0 a1 a2 a3 b0 b1 b2 b3 b4 p  p  p
    position_ids  0  1  2  3  0  1  2  3  4  0  1  2
    labels        x  x  a3 x  x  b2 b3 b4 x  x  x  x     (x = -100; a's mask keeps only a3, b's keeps b2..b4)
    cu_seqlens    0 4 9 12 (then + T for the next row)

Labels are shifted here, once: ``labels[t] = input_ids[t+1]`` if t+1 is in the same document and is a loss
token, else -100; so the loss is CE(logits[t], labels[t]) with no shift in the model, and no label crosses a
document boundary. Padding is its own last segment (labels -100), so every token belongs to exactly one
segment and varlen attention never mixes padding into a document.

Fixed-length rows fix every tensor's shape but cu_seqlens' (its length is the segment count). For per-block
compiled models compile_shape pads that too, to a multiple of SEGMENT_BUCKET empty segments, so a run
compiles once per bucket it meets instead of once per segment count. Every count a
trainer logs (tokens, loss tokens, document lengths) is a Python int computed on the host when a batch
is built, so reading it never syncs with the device.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Iterator, Literal, Sequence

import torch

from atelier_studio.data.chat import EncodedDoc
from atelier_studio.pipeline.errors import DataError

IGNORE_INDEX = -100
SEGMENT_BUCKET = 64  # compile_shape rounds a batch's segment count up to a multiple of this
Overflow = Literal["split", "truncate", "drop"]


class LoaderStateError(DataError):
    """A saved loader position that does not fit this run's data or settings; names the setting that changed."""


# the setting behind each key of PackedLoader.state_dict, as the trainer's config names it, and what else moves it
_STATE_SETTING = {"seed": "train.seed", "seq_len": "data.seq_len", "num_rows": "the number of packed rows",
                  "micro_batch": "train.micro_batch", "world_size": "the number of processes"}
_STATE_FIX = {"seed": "", "seq_len": "", "micro_batch": "", "world_size": " (--nproc)",
              "num_rows": " (data.seq_len, data.train or the tokenizer changed since the checkpoint)"}


@dataclass(frozen=True)
class PackStats:
    num_docs: int          # documents given
    num_split: int         # documents longer than a row that were split into row-sized pieces
    num_truncated: int     # ... that were cut to one row
    num_dropped: int       # ... that were left out
    num_rows: int
    num_tokens: int        # real (non-padding) tokens in all rows
    padding_fraction: float


@dataclass
class PackResult:
    """Packed rows: input_ids, labels, position_ids [R, T] long; per-row real document lengths; host-side counts."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_lens: list[list[int]]       # per row, real documents only, in row order
    num_loss_tokens: list[int]      # per row: labels != -100
    pad_id: int
    stats: PackStats
    doc_ids: list[list[int]] | None = None  # per row, the index in `docs` of each document (a split piece: its doc's)

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class Batch:
    """One micro-batch: input_ids, labels, position_ids [B, T] long; cu_seqlens int32 [D+1] over the B*T tokens."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    doc_lens: list[int]          # real documents only (FLOPs: sum of len^2)
    num_tokens: int              # non-padding tokens
    num_loss_tokens: int         # labels != -100
    row_tokens: list[int] | None = None  # non-padding tokens of each row (its padding is its tail); None: no padding
    doc_ids: list[int] | None = None  # the packed input's index of each real document, in doc_lens order

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "Batch":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(move(self.input_ids), move(self.labels), move(self.position_ids), move(self.cu_seqlens),
                     self.max_seqlen, self.doc_lens, self.num_tokens, self.num_loss_tokens, self.row_tokens,
                     self.doc_ids)

    def real_tokens(self) -> torch.Tensor:
        """[B, T] bool on the host: True on the documents' tokens, False on each row's padding tail."""
        b, t = self.input_ids.shape
        if self.row_tokens is None:
            return torch.ones(b, t, dtype=torch.bool)
        return torch.arange(t)[None, :] < torch.tensor(self.row_tokens)[:, None]


# ----------------------------------------------------------------------------------------------------------------------
# Bin packing


def overflow_pieces(docs: Sequence[EncodedDoc], seq_len: int,
                    overflow: str) -> tuple[list[tuple[int, int, int]], dict[str, int]]:
    """(doc index, start, end) token ranges to pack, after the overflow policy; and the overflow counts."""
    if overflow not in ("split", "truncate", "drop"):
        raise ValueError(f"pack_documents: overflow must be 'split', 'truncate' or 'drop', got {overflow!r}")
    counts = {"num_split": 0, "num_truncated": 0, "num_dropped": 0}
    pieces = []
    for i, doc in enumerate(docs):
        n = len(doc.input_ids)
        if n == 0:
            raise ValueError(f"pack_documents: document {i} is empty")
        if n <= seq_len:
            pieces.append((i, 0, n))
        elif overflow == "split":
            counts["num_split"] += 1
            pieces += [(i, s, min(s + seq_len, n)) for s in range(0, n, seq_len)]
        elif overflow == "truncate":
            counts["num_truncated"] += 1
            pieces.append((i, 0, seq_len))
        else:
            counts["num_dropped"] += 1
    return pieces, counts


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` per bin: longest first, each into the fullest bin it fits (ties: the oldest bin).

    O(n log n) with a sorted list of (free space, bin); ``best_fit_decreasing_ref`` is the O(n * bins) definition.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (free space, bin index); full bins are removed
    for i in order:
        n = lengths[i]
        if not 0 < n <= capacity:
            raise ValueError(f"best_fit_decreasing: item {i} has length {n}, outside 1..{capacity}")
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            bins.append([i])
            space, b = capacity - n, len(bins) - 1
        else:
            space, b = free.pop(k)
            bins[b].append(i)
            space -= n
        if space > 0:
            bisect.insort(free, (space, b))
    return bins


def best_fit_decreasing_ref(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Reference: scan every bin for the one with the least free space that still fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        fits = [b for b in range(len(bins)) if free[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (free[b], b))
        else:
            bins.append([])
            free.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        free[b] -= lengths[i]
    return bins


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First fit in arrival order: the baseline that best-fit decreasing must never lose to in the tests."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        b = next((b for b in range(len(bins)) if free[b] >= n), None)
        if b is None:
            bins.append([])
            free.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        free[b] -= n
    return bins


def pack_documents(docs: Sequence[EncodedDoc], seq_len: int, overflow: Overflow = "split", *,
                   pad_id: int = 0) -> PackResult:
    """Pack ``docs`` into rows of exactly ``seq_len`` tokens by best-fit decreasing.

    overflow: a document longer than a row is "split" into row-sized pieces (each its own document, positions
    restarting, no label across the cut), "truncate"d to its first seq_len tokens, or "drop"ped.
    pad_id fills the rest of each row (pass the tokenizer's pad token id; labels there are -100 anyway).
    """
    if seq_len < 2:
        raise ValueError(f"pack_documents: seq_len must be >= 2, got {seq_len}")
    pieces, counts = overflow_pieces(docs, seq_len, overflow)
    bins = best_fit_decreasing([end - start for _, start, end in pieces], seq_len)
    return _fill_rows(docs, [[pieces[p] for p in members] for members in bins], seq_len, pad_id, counts)


def pack_pairs(pairs: Sequence[tuple[EncodedDoc, EncodedDoc]], seq_len: int, *, pad_id: int = 0) -> PackResult:
    """Pack preference pairs (chosen, rejected): each pair's two documents side by side in one row (chosen first),
    each its own document (positions restart, per-document attention, no label across), pairs placed by best-fit
    decreasing on their summed length. Documents are numbered 2i (chosen of pair i) and 2i + 1 (rejected): the
    rows' `doc_ids` give them back. A pair longer than a row is the caller's to refuse or leave out first."""
    if seq_len < 2:
        raise ValueError(f"pack_pairs: seq_len must be >= 2, got {seq_len}")
    docs = [doc for pair in pairs for doc in pair]  # [c0, r0, c1, r1, ...]
    bins = best_fit_decreasing([len(c) + len(r) for c, r in pairs], seq_len)
    rows = [[(d, 0, len(docs[d])) for i in members for d in (2 * i, 2 * i + 1)] for members in bins]
    return _fill_rows(docs, rows, seq_len, pad_id, {"num_split": 0, "num_truncated": 0, "num_dropped": 0})


def _fill_rows(docs: Sequence[EncodedDoc], rows: list[list[tuple[int, int, int]]], seq_len: int, pad_id: int,
               counts: dict[str, int]) -> PackResult:
    """The rows' tensors from an assignment [(doc, start, end), ...] per row, in row order."""
    R, T = len(rows), seq_len
    input_ids = torch.full((R, T), pad_id, dtype=torch.long)
    labels = torch.full((R, T), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.empty((R, T), dtype=torch.long)
    arange = torch.arange(T)
    doc_lens: list[list[int]] = []
    for r, members in enumerate(rows):
        lens, t = [], 0
        for d, start, end in members:
            ids = torch.tensor(docs[d].input_ids[start:end], dtype=torch.long)  # [n]
            mask = torch.tensor(docs[d].loss_mask[start:end], dtype=torch.bool)  # [n]
            n = end - start
            input_ids[r, t:t + n] = ids
            # label of token j is token j+1 of the same piece when that one is a loss token
            labels[r, t:t + n - 1] = torch.where(mask[1:], ids[1:], IGNORE_INDEX)
            position_ids[r, t:t + n] = arange[:n]
            lens.append(n)
            t += n
        position_ids[r, t:] = arange[:T - t]  # the padding segment restarts too
        doc_lens.append(lens)
    num_loss = (labels != IGNORE_INDEX).sum(dim=1).tolist()
    num_tokens = sum(map(sum, doc_lens))
    stats = PackStats(num_docs=len(docs), num_rows=R, num_tokens=num_tokens,
                      padding_fraction=1.0 - num_tokens / (R * T) if R else 0.0, **counts)
    return PackResult(input_ids, labels, position_ids, doc_lens, num_loss, pad_id, stats,
                      doc_ids=[[d for d, _, _ in members] for members in rows])


def pack_documents_ref(docs: Sequence[EncodedDoc], bins: list[list[tuple[int, int, int]]], seq_len: int,
                       pad_id: int = 0) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Reference row construction, token by token, from an explicit assignment [(doc, start, end), ...] per row."""
    rows_ids, rows_labels, rows_pos = [], [], []
    for members in bins:
        ids, labels, pos = [], [], []
        for d, start, end in members:
            for j in range(start, end):
                ids.append(docs[d].input_ids[j])
                pos.append(j - start)
                nxt = j + 1
                labels.append(docs[d].input_ids[nxt] if nxt < end and docs[d].loss_mask[nxt] else IGNORE_INDEX)
        pad = seq_len - len(ids)
        rows_ids.append(ids + [pad_id] * pad)
        rows_labels.append(labels + [IGNORE_INDEX] * pad)
        rows_pos.append(pos + list(range(pad)))
    return rows_ids, rows_labels, rows_pos


def make_batch(packed: PackResult, rows: Sequence[int]) -> Batch:
    """Gather rows (indices into ``packed``; -1 = an all-padding row) into a Batch; all counts on the host."""
    T = packed.seq_len
    real = [r for r in rows if r >= 0]
    idx = torch.tensor([max(r, 0) for r in rows], dtype=torch.long)
    input_ids, labels, position_ids = (x.index_select(0, idx) for x in
                                       (packed.input_ids, packed.labels, packed.position_ids))
    empty = torch.tensor([r < 0 for r in rows], dtype=torch.bool)
    if empty.any():  # an empty row: one padding segment, nothing to learn
        input_ids[empty] = packed.pad_id
        labels[empty] = IGNORE_INDEX
        position_ids[empty] = torch.arange(T)
    bounds, doc_lens = [0], []
    for i, r in enumerate(rows):
        lens = packed.doc_lens[r] if r >= 0 else []
        doc_lens += lens
        for n in lens:
            bounds.append(bounds[-1] + n)
        if bounds[-1] != (i + 1) * T:  # the padding segment of this row
            bounds.append((i + 1) * T)
    segs = [b - a for a, b in zip(bounds, bounds[1:])]
    doc_ids = None if packed.doc_ids is None else [d for r in real for d in packed.doc_ids[r]]
    return Batch(input_ids, labels, position_ids, torch.tensor(bounds, dtype=torch.int32), max_seqlen=max(segs),
                 doc_lens=doc_lens, num_tokens=sum(doc_lens),
                 num_loss_tokens=sum(packed.num_loss_tokens[r] for r in real),
                 row_tokens=[sum(packed.doc_lens[r]) if r >= 0 else 0 for r in rows], doc_ids=doc_ids)


def fixed_shape(batch: Batch, segments: int) -> Batch:
    """cu_seqlens padded with empty segments to `segments`+1 entries, max_seqlen = T (an upper bound, as varlen
    attention allows). The same tokens and the same loss; only the shapes compiled blocks see are fixed."""
    cu = batch.cu_seqlens
    pad = segments + 1 - cu.numel()
    if pad < 0:
        raise ValueError(f"fixed_shape: batch has {cu.numel() - 1} segments > {segments}")
    cu = torch.cat([cu, cu[-1:].expand(pad)])
    return dataclasses.replace(batch, cu_seqlens=cu, max_seqlen=batch.input_ids.shape[1])


def compile_shape(batch: Batch, multiple: int = SEGMENT_BUCKET) -> Batch:
    """The batch as per-block compiled models take it (no recompile per batch): the segment count rounded up
    to a multiple of `multiple` (so a run compiles once per bucket it meets, not once per segment count) and
    max_seqlen = T. Rows that are one document each keep their shape: it is already fixed, and attention takes
    the causal per-row kernel for them."""
    b, t = batch.input_ids.shape
    segments = batch.cu_seqlens.numel() - 1
    if segments == b and batch.max_seqlen == t:
        return batch
    return fixed_shape(batch, -(-segments // multiple) * multiple)


# ----------------------------------------------------------------------------------------------------------------------
# Loader


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed from (seed, epoch), stable across processes and Python versions (unlike hash())."""
    digest = hashlib.blake2b(f"atelier-packed-loader:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class PackedLoader:
    """Endless, deterministic, resumable, rank-aware micro-batches of packed rows.

    Epoch e orders the rows by a permutation drawn from (seed, e) and cuts the order into global micro-batches
    of ``micro_batch`` rows; rank r takes global batches r, r + world_size, ... Every rank gets ``len_epoch``
    batches of the same shape [micro_batch, T] (equal step counts: no rank waits on a collective that others
    never enter):
      - drop_last=True: the tail that does not fill micro_batch * world_size rows is skipped this epoch (another
        tail next epoch); ranks are disjoint;
      - drop_last=False: the order is extended by wrapping around to its start, so every row is seen each epoch
        and a few rows twice.
    ``state_dict()`` is the position of the next batch; a loader given it yields exactly what the original would.
    """

    def __init__(self, packed: PackResult, micro_batch: int, seed: int, rank: int = 0, world_size: int = 1,
                 drop_last: bool = True) -> None:
        if micro_batch < 1:
            raise ValueError(f"PackedLoader: micro_batch must be >= 1, got {micro_batch}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"PackedLoader: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if len(packed) == 0:
            raise ValueError("PackedLoader: no packed rows")
        self.packed, self.micro_batch, self.seed = packed, micro_batch, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        per_step = micro_batch * world_size
        self._len_epoch = len(packed) // per_step if drop_last else -(-len(packed) // per_step)
        if self._len_epoch == 0:
            raise ValueError(f"PackedLoader: {len(packed)} rows cannot fill one step of micro_batch={micro_batch} x "
                             f"world_size={world_size} rows with drop_last=True")
        self.epoch, self.cursor = 0, 0
        self._order_epoch, self._order = -1, []

    @classmethod
    def from_docs(cls, docs: Sequence[EncodedDoc], seq_len: int, micro_batch: int, seed: int, rank: int = 0,
                  world_size: int = 1, drop_last: bool = True, overflow: Overflow = "split",
                  pad_id: int = 0) -> "PackedLoader":
        return cls(pack_documents(docs, seq_len, overflow, pad_id=pad_id), micro_batch, seed, rank, world_size,
                   drop_last)

    @property
    def len_epoch(self) -> int:
        """Micro-batches per epoch on this rank (the same on every rank)."""
        return self._len_epoch

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            order = torch.randperm(len(self.packed), generator=g).tolist()
            need = self._len_epoch * self.micro_batch * self.world_size
            self._order = (order * (-(-need // len(order))))[:need]  # wrap around (drop_last=False) or cut
            self._order_epoch = epoch
        return self._order

    def batch_rows(self, epoch: int, cursor: int) -> list[int]:
        """Row indices of this rank's ``cursor``-th micro-batch of ``epoch``."""
        start = (cursor * self.world_size + self.rank) * self.micro_batch
        return self._epoch_order(epoch)[start:start + self.micro_batch]

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> Batch:
        if self.cursor >= self._len_epoch:
            self.epoch, self.cursor = self.epoch + 1, 0
        batch = make_batch(self.packed, self.batch_rows(self.epoch, self.cursor))
        self.cursor += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch, plus the settings it is only valid for (all plain ints)."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_rows": len(self.packed),
                "seq_len": int(self.packed.input_ids.shape[1]), "micro_batch": self.micro_batch,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; one saved under other settings is a LoaderStateError naming the setting
        (a user-facing error: the trainer's config keys, since the loader is built from them)."""
        for key in ("epoch", "cursor"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise LoaderStateError(f"the saved data position is not a loader position: '{key}' must be a "
                                       f"non-negative int, got {state.get(key)!r} (written by another trainer?)")
        mine = self.state_dict()
        for key in ("seed", "seq_len", "num_rows", "micro_batch", "world_size"):
            if key in state and state[key] != mine[key]:
                raise LoaderStateError(f"{_STATE_SETTING[key]} is {state[key]} in the checkpoint but {mine[key]} "
                                       f"now{_STATE_FIX[key]}; the saved data position ('{key}') means nothing here: "
                                       f"resume with the checkpoint's settings, or start a new run in another "
                                       f"output.dir")
        if state["cursor"] > self._len_epoch:
            raise LoaderStateError(f"the saved data position (cursor {state['cursor']}) is past this run's epoch of "
                                   f"{self._len_epoch} micro-batches: the training data changed since the checkpoint")
        self.epoch, self.cursor = state["epoch"], state["cursor"]

    def iter_eval_batches(self) -> Iterator[Batch]:
        """Every row once, in packed order: global batches of micro_batch rows, round-robin over ranks.

        The last batch is filled with empty (all-padding, no loss) rows, and ranks short of a batch get an empty
        one, so every rank runs the same number of same-shape forwards (FSDP would hang otherwise).
        """
        B, R = self.micro_batch, len(self.packed)
        num_global = -(-R // B)
        per_rank = -(-num_global // self.world_size)
        for k in range(per_rank):
            j = k * self.world_size + self.rank
            rows = [r if r < R else -1 for r in range(j * B, (j + 1) * B)]
            yield make_batch(self.packed, rows)
