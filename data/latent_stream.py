"""Training batches streamed from latent shards with bounded memory, deterministic and exactly resumable.

Shape legend: G images per global micro-batch (world_size x micro_batch), V streams, c = G / V images per
chunk, C latent channels, h/w latent size, L text tokens, D text width, P pooled width, S shuffle buffer.

Streams. The shard set is read as V logical streams (`data.streams`, fixed for a run). Global micro-batch
k is one chunk of c images from every stream; a chunk is one aspect bucket, so no batch mixes shapes. Rank r
of W (W divides V) owns streams [r V/W, (r+1) V/W): with V = W (the default) each rank reads its own stream
and its micro-batch is one chunk; with V = m W it runs its m chunks as m micro-batches of the step. What a
stream yields depends on (shards, seed, V, c) only, never on W or the number of loader workers: a run
resumes on any W dividing V with the same batches, and one process with V = 2 sees what two processes see.

Epochs. Epoch e lays the shards end to end in the order of a permutation seeded by (seed, e) (shard-order
shuffling), N index slots in all, and stream v takes slots [v N/V, (v+1) N/V): ranks get disjoint samples
and shares equal to within one sample (a shard may be split between two streams). A stream is endless: it
runs into its next epoch without draining its buffers, so every rank yields a batch at every step and none
can run out of a bucket before the others (the "resample" choice: nothing is dropped at an epoch end; a
bucket with fewer than c samples in a stream's share fills across epochs, and its batch can hold a sample
twice).

Buffers hold references, not tensors. A stream plans from the tar headers, the json member and the
safetensors header (a few hundred bytes a sample; data/tarscan.py): a shuffle buffer of min(S, N/V)
references (each sample read replaces a uniformly drawn one, which moves on) feeds per-bucket buffers, and a
bucket's chunk is emitted when it holds c. Only then are its tensors read, straight from the shard into the
batch. Memory: O(S + buckets x c) references plus the chunks in flight, whatever N.

Workers. `workers` threads load the chunks ahead (2 x workers in flight), from a copy of the plan; chunks
are handed out in plan order, so the batches do not depend on the number of workers. Loading is file reads
straight into the batch tensors (page-locked with `pin_memory`): the reads release the GIL and nothing is
copied between processes (DataLoader worker processes hand each batch over in a fresh shared-memory
segment: 3x slower end to end than these reads, measured on a 2-core CPU). The stream's own plan advances by the
chunks handed out: its position is the state, whatever the loaders ran ahead to.

Several resolutions (`data.resolutions`). The source is then one shard set per resolution, and each stream a
`ResolutionPlan`: one stream plan as above per resolution (its own epochs, shuffle and bucket buffers), and chunk k
from the resolution `resolution_schedule` picks for (seed, k): the same on every stream, in shares proportional to
each set's samples or to the given weights. A resolution's buckets all have its own area, so a chunk is one
(resolution, aspect) bucket.

State (per stream, JSON): epoch, slot offset, the shuffle RNG, the buffered references, chunks emitted, the
bad-sample counts. Resume rebuilds the buffers from the references (no data re-read) and continues with
exactly the batches an uninterrupted run would have seen. A state names the shard set's fingerprint (names,
index counts, file sizes); other shards, another seed, another V or c are refused with the reason. Several
resolutions: per stream the chunk count and each resolution's position; other resolutions or shares are refused.

Corrupt samples follow data/shards.py's policy, counted per stream while planning: a missing member, an
undecodable or malformed latent, a duplicate member, a truncated tar (once per stream pass; a tar with fewer
samples than its index says counts as truncated) are skipped; a tar cut short counts every listed sample it
lacks, on every pass (each pass skips them again). Past `max_bad_fraction` a `ShardError` names the worst shard.
`LatentStream.skipped()` is what was skipped so far, per shard and reason (the trainer reports it). Shards are local
files (random access to a sample's tensors).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping, Sequence

import numpy as np
import torch

from atelier_studio.data.shards import (
    LATENT_NDIM,
    LATENT_TENSORS,
    BadSample,
    BadSampleCounter,
    ShardError,
    list_shards,
    read_index,
)
from atelier_studio.data.tarscan import TarSample, TruncatedTar, iter_tar_samples, read_at, read_into
from atelier_studio.pipeline.config import ConfigError
from atelier_studio.pipeline.errors import AtelierError
from atelier_studio.pipeline.progress import log

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_MAX_HEADER = 1 << 20  # a latent sample's safetensors header is ~250 bytes; more is corruption
_TAG_SHARD_ORDER, _TAG_SHUFFLE, _TAG_RESOLUTION = 0x5348, 0x5342, 0x5352  # separate seed domains of the draws
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio (odd): the Weyl step of the resolution schedule
_OPEN_FILES = 8  # shard files a loader keeps open (a chunk's samples come from the last few shards)


class StreamStateError(AtelierError, ValueError):
    """A saved stream position that does not fit this run (other shards, seed, streams or global batch)."""


# ----------------------------------------------------------------------------- the shard set


@dataclass(frozen=True)
class ShardSet:
    """The latent shards of a run: local paths, samples per shard (the index's slots), bucket counts."""

    source: str
    paths: tuple[str, ...]
    names: tuple[str, ...]  # relative to the source directory (or base names): what the fingerprint hashes
    counts: tuple[int, ...]
    buckets: dict[tuple[int, int], int] | None  # samples per (H, W) when the index records them

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def fingerprint(self) -> str:
        """Names, index counts and file sizes: a rewritten shard set gets another fingerprint."""
        sizes = [Path(p).stat().st_size for p in self.paths]
        raw = json.dumps([list(self.names), list(self.counts), sizes]).encode()
        return hashlib.sha256(raw).hexdigest()[:16]

    @classmethod
    def open(cls, source: str | Path | Sequence[str | Path]) -> "ShardSet":
        paths = list_shards(source)
        remote = [p for p in paths if "://" in p or p.startswith("pipe:")]
        if remote:
            raise ShardError(f"{source}: streaming reads local shard files (it seeks to each sample), got {remote[0]}; "
                             f"copy the shards to a local or mounted directory")
        base = Path(source) if not isinstance(source, (list, tuple)) and Path(source).is_dir() else None
        names = tuple(Path(p).relative_to(base).as_posix() if base else Path(p).name for p in paths)
        index = read_index(base) if base else None
        if index is not None and index.get("kind") not in (None, "latent"):
            raise ShardError(f"{source}: holds {index.get('kind')} shards, not latent shards (`atelier imagegen cache` "
                             f"writes those)")
        by_name = {s["name"]: s for s in index["shards"]} if index else {}
        if index is not None and all(n in by_name for n in names):
            counts = tuple(int(by_name[n]["count"]) for n in names)
            hist: dict[tuple[int, int], int] | None = {}
            for n in names:
                if "buckets" not in by_name[n]:
                    hist = None
                    break
                for hw, k in by_name[n]["buckets"].items():
                    h, w = (int(x) for x in hw.split("x"))
                    hist[(h, w)] = hist.get((h, w), 0) + int(k)
        else:  # no index (a pattern or a list of tars): count the samples once, from the headers
            log(f"{source}: no index.json lists these shards; counting their samples from the tar headers")
            counts = tuple(_count_samples(p) for p in paths)
            hist = None
        if sum(counts) == 0:
            raise ShardError(f"{source}: the shards hold no samples")
        return cls(str(source), tuple(paths), names, counts, hist)


def _count_samples(path: str) -> int:
    n = 0
    with open(path, "rb") as f:
        try:
            for _ in iter_tar_samples(f):
                n += 1
        except TruncatedTar:
            pass
    return n


def stream_ranges(counts: Sequence[int], seed: int, epoch: int, streams: int, v: int) -> list[tuple[int, int, int]]:
    """Stream v's share of epoch `epoch`: [(shard id, first sample, end sample), ...] in reading order."""
    order = np.random.default_rng([_TAG_SHARD_ORDER, seed, epoch]).permutation(len(counts))
    total = sum(counts)
    lo, hi = v * total // streams, (v + 1) * total // streams
    out, pos = [], 0
    for s in order.tolist():
        a, b = max(lo, pos), min(hi, pos + counts[s])
        if a < b:
            out.append((s, a - pos, b - pos))
        pos += counts[s]
    return out


# ----------------------------------------------------------------------------- one sample's metadata


@dataclass(frozen=True)
class LatentRef:
    """Where a sample's tensors are: shard id, the safetensors member's offset and size; its key and bucket."""

    shard: int
    offset: int
    size: int
    key: str
    bucket: tuple[int, int]

    def to_json(self) -> list:
        return [self.shard, self.offset, self.size, self.key, *self.bucket]

    @classmethod
    def from_json(cls, raw: list) -> "LatentRef":
        shard, offset, size, key, h, w = raw
        return cls(int(shard), int(offset), int(size), str(key), (int(h), int(w)))


def _tensor_table(header: bytes, member_size: int, shard: str, key: str) -> dict[str, tuple[torch.dtype, tuple, int]]:
    """safetensors header JSON -> {name: (dtype, shape, byte offset in the member)}; `BadSample` when malformed."""
    try:
        table = json.loads(header)
        out = {}
        for name, spec in table.items():
            if name == "__metadata__":
                continue
            dtype, shape = _DTYPES[spec["dtype"]], tuple(int(d) for d in spec["shape"])
            start, end = (int(x) for x in spec["data_offsets"])
            if end - start != math.prod(shape) * dtype.itemsize or 8 + len(header) + end > member_size:
                raise ValueError(f"{name}: data offsets {start}..{end} do not fit shape {list(shape)} {dtype}")
            out[name] = (dtype, shape, 8 + len(header) + start)
    except (ValueError, KeyError, TypeError, AttributeError) as exn:
        raise BadSample("undecodable latent", shard, key, f"safetensors header: {type(exn).__name__}: {exn}") from None
    bad = [n for n in LATENT_TENSORS if n not in out or len(out[n][1]) != LATENT_NDIM[n]]
    if bad:
        raise BadSample("malformed latent", shard, key, f"tensors {bad} missing or of wrong rank")
    return out


def _names(table: dict) -> tuple[str, ...]:
    """The tensors a batch reads from a sample: the latent, the text, and the loss mask when the cache has one."""
    return (*LATENT_TENSORS, "mask") if "mask" in table else LATENT_TENSORS


def _read_table(f: BinaryIO, offset: int, size: int, shard: str, key: str) -> dict:
    if size < 8:
        raise BadSample("undecodable latent", shard, key, f"safetensors member of {size} bytes")
    (n,) = struct.unpack("<Q", read_at(f, offset, 8))
    if n > min(size - 8, _MAX_HEADER):
        raise BadSample("undecodable latent", shard, key, f"safetensors header length {n} in a {size}-byte member")
    return _tensor_table(read_at(f, offset + 8, n), size, shard, key)


def _plan_ref(f: BinaryIO, shard_id: int, shard: str, sample: TarSample) -> LatentRef:
    """A tar sample -> its reference, after checking what the loader will rely on; `BadSample` otherwise."""
    key = sample.key
    if sample.duplicate:
        raise BadSample("duplicate member", shard, key, f"two .{sample.duplicate} members")
    if "safetensors" not in sample.members or "json" not in sample.members:
        raise BadSample("missing member", shard, key, f"members {sorted(sample.members)}")
    raw = read_at(f, *sample.members["json"])
    try:
        meta = json.loads(raw)
    except ValueError as exn:
        raise BadSample("undecodable latent", shard, key, f"json: {exn}") from None
    bucket = meta.get("bucket") if isinstance(meta, dict) else None
    if (not isinstance(bucket, list) or len(bucket) != 2 or not all(isinstance(x, int) and x > 0 for x in bucket)
            or not isinstance(meta.get("caption"), str)):
        raise BadSample("malformed latent", shard, key, "json lacks bucket [H, W] or caption")
    offset, size = sample.members["safetensors"]
    _read_table(f, offset, size, shard, key)
    return LatentRef(shard_id, offset, size, key, (bucket[0], bucket[1]))


def first_sample(shards: ShardSet) -> dict:
    """The first readable sample's {key, shard, bucket, caption, shapes: {name: shape}, dtypes}, for startup checks."""
    for shard_id, path in enumerate(shards.paths):
        with open(path, "rb") as f:
            try:
                for sample in iter_tar_samples(f):
                    try:
                        ref = _plan_ref(f, shard_id, path, sample)
                    except BadSample:
                        continue
                    table = _read_table(f, ref.offset, ref.size, path, ref.key)
                    meta = json.loads(read_at(f, *sample.members["json"]))
                    names = _names(table)
                    return {"key": ref.key, "shard": path, "bucket": ref.bucket, "caption": meta["caption"],
                            "shapes": {n: table[n][1] for n in names}, "dtypes": {n: table[n][0] for n in names}}
            except TruncatedTar:
                continue
    raise ShardError(f"{shards.source}: no readable latent sample in {len(shards.paths)} shards")


# ----------------------------------------------------------------------------- one stream's plan


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk `ordinal` of stream `stream`: one bucket's samples, in row order, from shard set `source` (the index of
    its resolution in a multi-resolution stream; 0 otherwise)."""

    ordinal: int
    stream: int
    bucket: tuple[int, int]
    refs: tuple[LatentRef, ...]
    source: int = 0


class StreamPlan:
    """Which samples form each chunk of one stream, from references only; its state is the stream position."""

    def __init__(self, shards: ShardSet, stream: int, streams: int, chunk: int, shuffle_buffer: int, seed: int,
                 max_bad_fraction: float = 0.01, min_samples_for_check: int = 100, state: dict | None = None):
        self.shards, self.stream, self.streams, self.chunk, self.seed = shards, stream, streams, chunk, seed
        self.share = shards.total // streams  # a stream's smallest share of an epoch
        self.shuffle_size = max(1, min(shuffle_buffer, self.share))
        self.counter = BadSampleCounter(max_bad_fraction, min_samples_for_check)
        self.epoch, self.offset, self.chunks = 0, 0, 0
        self.rng = np.random.default_rng([_TAG_SHUFFLE, seed, stream])
        self.shuffle: list[LatentRef] = []
        self.buckets: dict[tuple[int, int], list[LatentRef]] = {}
        if state is not None:
            self._load(state)
        self._items = self._slots()

    # the position: slots of (epoch, offset) consumed; every item read advances it before it is returned
    def _slots(self) -> Iterator[LatentRef | BadSample]:
        while True:
            base = 0
            for shard_id, start, end in stream_ranges(self.shards.counts, self.seed, self.epoch, self.streams,
                                                      self.stream):
                n = end - start
                if self.offset < base + n:
                    yield from self._shard_slots(shard_id, start + self.offset - base, end)
                base += n
            self.epoch, self.offset = self.epoch + 1, 0

    def _shard_slots(self, shard_id: int, start: int, end: int) -> Iterator[LatentRef | BadSample]:
        """Slots [start, end) of one shard. A tar that breaks is reported where it breaks: with the slots it
        lost, or, when it breaks just after its last listed sample, just before that sample (so a position saved
        after any sample has counted exactly what an uninterrupted pass counted by then)."""
        path, listed = self.shards.paths[shard_id], self.shards.counts[shard_id]
        broken: list[str] = []

        def advance(samples: Iterator[TarSample]) -> TarSample | None:
            try:
                return next(samples)
            except StopIteration:
                return None
            except TruncatedTar as exn:
                broken.append(str(exn))
                return None

        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise ShardError(f"shard not found: {path} (data.shards changed during the run?)") from None
        with f:
            samples = iter_tar_samples(f)
            index, cur = 0, advance(samples)
            while cur is not None and index < start:
                index, cur = index + 1, advance(samples)
            while cur is not None and index < end:
                try:
                    item: LatentRef | BadSample = _plan_ref(f, shard_id, path, cur)
                except BadSample as bad:
                    item = bad
                except TruncatedTar as exn:  # a member's payload runs past the end of the file
                    broken.append(str(exn))
                    break
                index += 1
                cur = advance(samples) if index < end or end == listed else None
                if cur is None and broken and index == end:
                    yield BadSample("truncated tar", path, "?", broken[0])  # no slot of its own
                self.offset += 1
                yield item
        lost = end - max(index, start)
        if lost > 0:  # cut off, or fewer samples than the index lists: the rest of this share is gone
            self.offset += lost
            detail = broken[0] if broken else f"ends after {index} of the {listed} samples its index lists"
            yield BadSample("truncated tar", path, "?", detail, count=lost)  # each missing sample counts

    def next_ref(self) -> LatentRef:
        """The next good sample's reference (bad ones are counted and skipped)."""
        for misses in range(self.share + 1):
            item = next(self._items)
            if isinstance(item, BadSample):
                self.counter.record(item)
                continue
            self.counter.ok()
            return item
        raise ShardError(f"{self.shards.source}: stream {self.stream} read {self.share + 1} samples in a row and "
                         f"none was readable; by reason {dict(self.counter.by_reason)}")

    def next_chunk(self) -> ChunkPlan:
        while True:
            ref = self.next_ref()
            if len(self.shuffle) < self.shuffle_size:  # filling the shuffle buffer
                self.shuffle.append(ref)
                continue
            if self.shuffle_size > 1:
                i = int(self.rng.integers(self.shuffle_size))
                ref, self.shuffle[i] = self.shuffle[i], ref
            else:
                ref, self.shuffle[0] = self.shuffle[0], ref
            buf = self.buckets.setdefault(ref.bucket, [])
            buf.append(ref)
            if len(buf) == self.chunk:
                del self.buckets[ref.bucket]
                plan = ChunkPlan(self.chunks, self.stream, ref.bucket, tuple(buf))
                self.chunks += 1
                return plan

    def state_dict(self) -> dict:
        c = self.counter
        last = c.last_bad
        return {"epoch": self.epoch, "offset": self.offset, "chunks": self.chunks, "rng": self.rng.bit_generator.state,
                "shuffle": [r.to_json() for r in self.shuffle],
                "buckets": [[*b, [r.to_json() for r in refs]] for b, refs in self.buckets.items()],
                "counter": {**c.as_dict(),
                            "last_bad": [last.reason, last.shard, last.key, last.detail, last.count] if last else None}}

    def _load(self, s: dict) -> None:
        try:
            self.epoch, self.offset, self.chunks = int(s["epoch"]), int(s["offset"]), int(s["chunks"])
            self.rng.bit_generator.state = s["rng"]
            self.shuffle = [LatentRef.from_json(r) for r in s["shuffle"]]
            self.buckets = {(int(h), int(w)): [LatentRef.from_json(r) for r in refs] for h, w, refs in s["buckets"]}
            c = s["counter"]
            self.counter.load(c)
            self.counter.last_bad = BadSample(*c["last_bad"]) if c["last_bad"] else None
        except (KeyError, TypeError, ValueError) as exn:
            raise StreamStateError(f"stream {self.stream}'s saved position is malformed ({type(exn).__name__}: "
                                   f"{exn})") from None
        if len(self.shuffle) > self.shuffle_size or any(len(b) >= self.chunk for b in self.buckets.values()):
            raise StreamStateError(f"stream {self.stream}'s saved buffers do not fit a shuffle buffer of "
                                   f"{self.shuffle_size} and chunks of {self.chunk}")
        if any(r.shard >= len(self.shards.paths) for r in self.shuffle):
            raise StreamStateError(f"stream {self.stream}'s saved position names shards this set does not have")


# ----------------------------------------------------------------------------- several resolutions


def resolution_schedule(seed: int, ordinal: int, shares: Sequence[float]) -> int:
    """The resolution (an index into `shares`) of global micro-batch `ordinal`: u = frac(s + ordinal / golden ratio)
    in 64-bit integers (s from the seed), the first resolution whose cumulative share exceeds u.

    A Weyl sequence, not random draws: stateless (a resume needs no state for it), the same on every stream (every
    rank runs the same resolution at a step, so none waits on a larger one), and low-discrepancy: over any n
    micro-batches each resolution's count is within a few of n x its share, where random draws stray by ~sqrt(n).
    """
    start = int(np.random.SeedSequence([_TAG_RESOLUTION, seed]).generate_state(1, dtype=np.uint64)[0])
    u = ((start + ordinal * _GOLDEN) % (1 << 64)) / float(1 << 64)
    total, cum = float(sum(shares)), 0.0
    for i, share in enumerate(shares[:-1]):
        cum += share
        if u * total < cum:
            return i
    return len(shares) - 1


class ResolutionPlan:
    """One stream over several resolutions' shard sets (`data.resolutions`): a `StreamPlan` per resolution, each with
    its own epochs, shuffle and bucket buffers, and chunk k (the global micro-batch) taken from the resolution
    `resolution_schedule` picks for k. A chunk is one (resolution, aspect) bucket: a resolution's buckets all have
    its own area, so no two resolutions share one. Its state: the chunk count and each resolution's position."""

    def __init__(self, sets: Sequence[ShardSet], resolutions: Sequence[int], shares: Sequence[float], stream: int,
                 streams: int, chunk: int, shuffle_buffer: int, seed: int, max_bad_fraction: float = 0.01,
                 min_samples_for_check: int = 100, state: dict | None = None):
        self.resolutions, self.shares, self.stream, self.seed = tuple(resolutions), tuple(shares), stream, seed
        positions: dict = {}
        self.chunks = 0
        if state is not None:
            try:
                self.chunks, positions = int(state["chunks"]), state["resolutions"]
                missing = [r for r in self.resolutions if str(r) not in positions]
            except (KeyError, TypeError, ValueError, AttributeError) as exn:
                raise StreamStateError(f"stream {stream}'s saved position is malformed ({type(exn).__name__}: "
                                       f"{exn})") from None
            if missing:
                raise StreamStateError(f"stream {stream}'s saved position lacks resolutions {missing}")
        self.plans = [StreamPlan(s, stream, streams, chunk, shuffle_buffer, seed, max_bad_fraction,
                                 min_samples_for_check, positions.get(str(r))) for s, r in zip(sets, self.resolutions)]
        self.shuffle_size = self.plans[0].shuffle_size

    def next_chunk(self) -> ChunkPlan:
        i = resolution_schedule(self.seed, self.chunks, self.shares)
        c = self.plans[i].next_chunk()
        plan = ChunkPlan(self.chunks, self.stream, c.bucket, c.refs, source=i)
        self.chunks += 1
        return plan

    def state_dict(self) -> dict:
        return {"chunks": self.chunks, "resolutions": {str(r): p.state_dict() for r, p in zip(self.resolutions,
                                                                                             self.plans)}}


# ----------------------------------------------------------------------------- loading a chunk


class _OpenFiles:
    """A few shard files kept open for random reads (least recently used closed first)."""

    def __init__(self, paths: Sequence[str]):
        self.paths, self.files = paths, OrderedDict()

    def get(self, shard: int) -> BinaryIO:
        if shard in self.files:
            self.files.move_to_end(shard)
            return self.files[shard]
        if len(self.files) >= _OPEN_FILES:
            self.files.popitem(last=False)[1].close()
        try:
            f = open(self.paths[shard], "rb", buffering=0)
        except FileNotFoundError:
            raise ShardError(f"shard not found: {self.paths[shard]} (data.shards changed during the run?)") from None
        self.files[shard] = f
        return f

    def close(self) -> None:
        while self.files:
            self.files.popitem()[1].close()


def load_chunk(plan: ChunkPlan, shards: ShardSet, files: _OpenFiles, pin_memory: bool = False) -> dict[str, Any]:
    """Read a chunk's tensors straight into its batch: {ordinal, stream, bucket, source, keys, latent [c,C,h,w],
    text_states [c,L,D], pooled [c,P]}, and mask [c,h,w] when the cache has loss masks (in page-locked memory with
    `pin_memory`: no copy before the GPU's)."""
    out: dict[str, torch.Tensor] = {}
    first: dict | None = None
    views: dict[str, memoryview] = {}
    for i, ref in enumerate(plan.refs):
        path = shards.paths[ref.shard]
        f = files.get(ref.shard)
        try:
            table = _read_table(f, ref.offset, ref.size, path, ref.key)
            if first is None:
                first = {n: table[n][:2] for n in _names(table)}
                for n in first:
                    out[n] = torch.empty((len(plan.refs), *first[n][1]), dtype=first[n][0], pin_memory=pin_memory)
                    views[n] = memoryview(out[n].view(torch.uint8).reshape(-1).numpy())
            if set(_names(table)) != set(first):
                raise ShardError(f"{path}: key {ref.key} {'has' if 'mask' in table else 'lacks'} a loss mask, key "
                                 f"{plan.refs[0].key} of the same bucket does not: the latents come from different "
                                 f"`imagegen cache` runs; re-cache them with one config")
            for n in first:
                dtype, shape, at = table[n]
                if (dtype, shape) != first[n]:
                    raise ShardError(
                        f"{path}: key {ref.key}: {n} is {list(shape)} {dtype}, but key {plan.refs[0].key} of the same "
                        f"bucket {list(plan.bucket)} has {list(first[n][1])} {first[n][0]}: the latents come from "
                        f"different `imagegen cache` runs; re-cache them with one config")
                nbytes = math.prod(shape) * dtype.itemsize
                read_into(f, ref.offset + at, views[n][i * nbytes:(i + 1) * nbytes])
        except (BadSample, TruncatedTar) as exn:  # it was whole when planned: the file changed under the run
            raise ShardError(f"{path}: key {ref.key} can no longer be read ({exn}); was data.shards rewritten during "
                             f"the run?") from None
    return {"ordinal": plan.ordinal, "stream": plan.stream, "bucket": plan.bucket, "source": plan.source,
            "keys": [r.key for r in plan.refs], **out}


class _Prefetcher:
    """One stream's chunks loaded ahead by `workers` threads, handed out in plan order.

    Loading is file reads straight into the batch tensors (the reads release the GIL, so threads run them in
    parallel, with no copy between processes); the plan that feeds them is this object's own, ahead of the
    trainer's by at most 2 x workers chunks, which is also all the memory it holds. workers = 0 loads each
    chunk when it is asked for.
    """

    def __init__(self, sets: Sequence[ShardSet], plan: StreamPlan | ResolutionPlan, workers: int, pin_memory: bool):
        self.sets, self.plan, self.pin_memory = sets, plan, pin_memory
        self.depth = 2 * workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="latent-loader") if workers else None
        self.local = threading.local()
        self.pending: deque[Future] = deque()

    def _load(self, chunk: ChunkPlan) -> dict[str, Any]:
        files = getattr(self.local, "files", None)
        if files is None:  # each thread seeks its own file objects, per shard set
            files = self.local.files = [_OpenFiles(s.paths) for s in self.sets]
        return load_chunk(chunk, self.sets[chunk.source], files[chunk.source], self.pin_memory)

    def next(self) -> dict[str, Any]:
        if self.pool is None:
            return self._load(self.plan.next_chunk())
        while len(self.pending) < self.depth:
            self.pending.append(self.pool.submit(self._load, self.plan.next_chunk()))
        return self.pending.popleft().result()

    def close(self) -> None:
        for f in self.pending:
            f.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.pending.clear()


# ----------------------------------------------------------------------------- a rank's view


@dataclass(frozen=True)
class StreamConfig:
    """How a rank streams: its place, the global micro-batch, and the stream settings (imagegen [data])."""

    micro_batch: int  # images per rank per micro-batch
    rank: int = 0
    world_size: int = 1
    streams: int = 0  # V; 0 = world_size (or the saved run's V on resume)
    shuffle_buffer: int = 1000  # references: a few hundred bytes each, never tensors
    seed: int = 0
    workers: int = 0  # loader threads per stream; 0 = read when asked, in the calling thread
    max_bad_fraction: float = 0.01
    min_samples_for_check: int = 100
    pin_memory: bool = False  # page-locked batches for a fast, asynchronous copy to the GPU
    # several resolutions: the share of global micro-batches each gets (one per resolution); () = proportional to
    # the samples of each resolution's shard set
    resolution_weights: tuple[float, ...] = ()

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size


class LatentStream:
    """This rank's batches: `chunks()` yields, per global micro-batch, one loaded chunk per owned stream.

    `source` is one shard set (a directory, a pattern or a list of tars), or for several resolutions a mapping
    resolution -> its shard set (`data.resolutions`): then every stream is a `ResolutionPlan` and each chunk names its
    `source` (the resolution's index) and `resolution`."""

    def __init__(self, source: str | Path | Sequence[str | Path] | Mapping[int, str | Path], cfg: StreamConfig):
        if cfg.micro_batch < 1 or not 0 <= cfg.rank < cfg.world_size or cfg.streams < 0 or cfg.workers < 0:
            raise ValueError(f"need micro_batch >= 1, 0 <= rank < world_size, streams >= 0, workers >= 0; got {cfg}")
        self.cfg = cfg
        if isinstance(source, Mapping):
            if not source:
                raise ValueError("LatentStream: no resolutions given")
            self.resolutions: tuple[int, ...] | None = tuple(int(r) for r in source)
            self.sets = [ShardSet.open(src) for src in source.values()]
            self.shares = cfg.resolution_weights or tuple(float(s.total) for s in self.sets)
            if len(self.shares) != len(self.sets) or not all(w > 0 for w in self.shares):
                raise ValueError(f"need one positive weight per resolution {list(self.resolutions)}, got "
                                 f"{list(cfg.resolution_weights)}")
            self.fingerprint: str | dict[str, str] = {str(r): s.fingerprint for r, s in zip(self.resolutions,
                                                                                            self.sets)}
        else:
            if cfg.resolution_weights:
                raise ValueError("LatentStream: resolution_weights need a shard set per resolution")
            self.resolutions, self.sets, self.shares = None, [ShardSet.open(source)], (1.0,)
            self.fingerprint = self.sets[0].fingerprint
        self.shards = self.sets[0]  # the only one, or the first resolution's
        self._configure(cfg.streams or cfg.world_size,
                        what="data.streams" if cfg.streams else "the number of processes")
        self.plans = {v: self._plan(v, None) for v in self.owned}
        self._rare_bucket_note()

    def _configure(self, streams: int, what: str, error: type[AtelierError] = ConfigError) -> None:
        cfg, G = self.cfg, self.cfg.global_batch
        if streams % cfg.world_size:
            raise error(f"{what} = {streams} streams cannot be split over {cfg.world_size} processes; use a "
                                   f"number of processes that divides {streams}")
        if G % streams:
            raise error(f"the global micro-batch of {cfg.world_size} processes x micro_batch "
                                   f"{cfg.micro_batch} = {G} does not split into {streams} streams ({what}); set "
                                   f"train.micro_batch so that it does")
        for shards in self.sets:
            if shards.total < streams:
                raise ShardError(f"{shards.source}: {shards.total} samples cannot feed {streams} streams")
        self.streams, self.chunk = streams, G // streams
        per_rank = streams // cfg.world_size
        self.owned = range(cfg.rank * per_rank, (cfg.rank + 1) * per_rank)

    def _plan(self, v: int, state: dict | None, max_bad_fraction: float | None = None) -> StreamPlan | ResolutionPlan:
        """Stream v's plan (from a saved position when `state` is given)."""
        args = {"stream": v, "streams": self.streams, "chunk": self.chunk, "shuffle_buffer": self.cfg.shuffle_buffer,
                "seed": self.cfg.seed, "min_samples_for_check": self.cfg.min_samples_for_check, "state": state,
                "max_bad_fraction": self.cfg.max_bad_fraction if max_bad_fraction is None else max_bad_fraction}
        if self.resolutions is None:
            return StreamPlan(self.shards, **args)
        return ResolutionPlan(self.sets, self.resolutions, self.shares, **args)

    def _leaf_plans(self) -> Iterator[StreamPlan]:
        for plan in self.plans.values():
            yield from plan.plans if isinstance(plan, ResolutionPlan) else (plan,)

    def _rare_bucket_note(self) -> None:
        for shards in self.sets:
            hist = shards.buckets or {}
            rare = {f"{h}x{w}": n for (h, w), n in sorted(hist.items()) if n < self.chunk * self.streams}
            if rare:
                log(f"{shards.source}: {len(rare)} buckets hold fewer samples than a global micro-batch of "
                    f"{self.chunk * self.streams}: they fill across epochs and a batch of them can repeat a sample "
                    f"({rare})")

    def skipped(self) -> dict[str, dict[str, int]]:
        """This rank's streams' skipped samples up to what the trainer consumed: shard path -> reason -> samples."""
        out: dict[str, dict[str, int]] = {}
        for plan in self._leaf_plans():
            for shard, reasons in plan.counter.by_shard_reason.items():
                mine = out.setdefault(shard, {})
                for reason, n in reasons.items():
                    mine[reason] = mine.get(reason, 0) + n
        return out

    @property
    def chunks_per_micro_batch(self) -> int:
        """Chunks (forward + backward passes) per micro-batch of this rank: V / W."""
        return len(self.owned)

    def describe(self) -> str:
        total = sum(s.total for s in self.sets)
        n_buckets = sum(len(s.buckets) for s in self.sets if s.buckets)
        buckets = f" in {n_buckets} buckets" if n_buckets else ""
        if self.resolutions is not None:
            share = sum(self.shares)
            buckets += " at " + ", ".join(f"{r} px ({100 * w / share:.0f}% of batches)"
                                          for r, w in zip(self.resolutions, self.shares))
        plan = next(iter(self.plans.values()))
        mine = (f"stream {self.owned.start}" if len(self.owned) == 1 else
                f"streams {self.owned.start}-{self.owned.stop - 1}")
        return (f"{total} samples{buckets} from {sum(len(s.paths) for s in self.sets)} shards as {self.streams} stream"
                f"{'s' if self.streams > 1 else ''} of {self.chunk} images per global micro-batch of "
                f"{self.cfg.global_batch} ({mine} here), shuffle buffer {plan.shuffle_size}, {self.cfg.workers} loader "
                f"workers; an epoch is ~{total // self.cfg.global_batch} global micro-batches")

    def chunks(self) -> Iterator[list[dict]]:
        """Per global micro-batch, this rank's chunks (one per owned stream, in stream order), forever; with several
        resolutions each chunk also names its `resolution`.

        `self.plans` advance by exactly the chunks handed out (their state is what the trainer consumed); the
        loaders run copies of them ahead."""
        loaders = [_Prefetcher(self.sets, self._plan(v, self.plans[v].state_dict(), max_bad_fraction=1.0),
                               self.cfg.workers, self.cfg.pin_memory) for v in self.owned]
        try:
            while True:
                out = []
                for v, loader in zip(self.owned, loaders):
                    want = self.plans[v].next_chunk()  # counts the bad samples, raises past max_bad_fraction
                    got = loader.next()
                    if (got["ordinal"] != want.ordinal or got["source"] != want.source
                            or got["keys"] != [r.key for r in want.refs]):
                        raise RuntimeError(f"stream {v}: the loader is out of step with its plan (chunk "
                                           f"{got['ordinal']} vs {want.ordinal})")
                    if self.resolutions is not None:
                        got["resolution"] = self.resolutions[got["source"]]
                    out.append(got)
                yield out
        finally:
            for loader in loaders:
                loader.close()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """This rank's streams' positions (merge the ranks' with `merge_states` before saving)."""
        cfg = self.cfg
        several = {} if self.resolutions is None else {"resolutions": list(self.resolutions),
                                                       "shares": list(self.shares)}
        return {"streams": self.streams, "chunk": self.chunk, "world_size": cfg.world_size,
                "batch_size": cfg.micro_batch, "seed": cfg.seed, "shards": self.fingerprint, **several,
                "positions": {str(v): self.plans[v].state_dict() for v in self.owned}}

    @staticmethod
    def merge_states(states: Sequence[dict]) -> dict:
        """Every rank's `state_dict` -> one state holding all streams' positions."""
        merged = {k: v for k, v in states[0].items() if k != "positions"}
        merged["positions"] = {k: p for s in states for k, p in s["positions"].items()}
        return merged

    def load_state_dict(self, state: dict) -> None:
        """Continue from a merged state saved by any number of processes of the same global micro-batch."""
        cfg = self.cfg
        try:
            V, c, W, B = (int(state[k]) for k in ("streams", "chunk", "world_size", "batch_size"))
            seed, shards, positions = int(state["seed"]), state["shards"], state["positions"]
            saved_res = state.get("resolutions")
            saved_res = [int(r) for r in saved_res] if saved_res is not None else None
            saved_shares = [float(w) for w in state["shares"]] if saved_res is not None else None
        except (KeyError, TypeError, ValueError) as exn:
            raise StreamStateError(f"the saved data position is not a stream position ({type(exn).__name__}: {exn}); "
                                   f"it was written by another version of the trainer") from None
        now_res = list(self.resolutions) if self.resolutions is not None else None
        if saved_res != now_res:
            def name(res: list[int] | None) -> str:
                return f"data.resolutions {res}" if res is not None else "one data.resolution"

            raise StreamStateError(f"the checkpoint trained at {name(saved_res)}, this run at {name(now_res)}; resume "
                                   f"with the same resolutions, or start a new run in another output.dir")
        if saved_shares is not None and saved_shares != list(self.shares):
            raise StreamStateError(f"the checkpoint gave the resolutions shares {saved_shares} of the batches, this "
                                   f"run {list(self.shares)} (data.resolution_weights, or the cached sample counts, "
                                   f"differ); resume with the same ones")
        if shards != self.fingerprint:
            raise StreamStateError(f"data.shards {self.shards.source} are not the shards the run was saved with "
                                   f"(names, counts or sizes differ); resume with the same shards, or start a new run "
                                   f"in another output.dir")
        if seed != cfg.seed:
            raise StreamStateError(f"train.seed is {seed} in the checkpoint but {cfg.seed} now")
        if V * c != cfg.global_batch:
            what = (f"batch_size is {B} in the checkpoint but {cfg.micro_batch} now" if W == cfg.world_size else
                    f"the global batch is {W} ranks x {B} = {W * B} in the checkpoint but {cfg.world_size} x "
                    f"{cfg.micro_batch} = {cfg.global_batch} now")
            raise StreamStateError(f"{what}; set train.micro_batch so that processes x micro_batch = {V * c} to "
                                   f"resume exactly")
        if cfg.streams and cfg.streams != V:
            raise StreamStateError(f"data.streams is {V} in the checkpoint but {cfg.streams} now (set it to {V} or 0)")
        self._configure(V, what="the checkpoint's data.streams", error=StreamStateError)
        missing = [v for v in self.owned if str(v) not in positions]
        if missing:
            raise StreamStateError(f"the saved data position lacks streams {missing}")
        self.plans = {v: self._plan(v, positions[str(v)]) for v in self.owned}


__all__ = ["LatentStream", "StreamConfig", "StreamPlan", "ResolutionPlan", "resolution_schedule", "ShardSet",
           "LatentRef", "ChunkPlan", "StreamStateError",
           "first_sample", "load_chunk", "stream_ranges"]
