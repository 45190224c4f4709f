"""Aspect-ratio buckets and a deterministic, resumable, rank-aware bucketed sampler.

Shape legend: H/W bucket height/width in pixels, h/w an image's own height/width, B batch,
C latent channels, L text tokens, D text hidden size, P pooled text size. Aspect ratio is W/H.

- `make_buckets` lists (H, W) with sides multiples of `multiple` (= VAE factor × patch) and area
  <= resolution² (never more memory than the square bucket), both orientations, W/H within
  [min_ratio, max_ratio]. `nearest_bucket` picks by |log(w/h) - log(W/H)| (a 2:1 and a 1:2 image are
  equally far from square), ties to the lower index. `resize_and_crop` resizes to cover, then
  centre-crops.
- `BucketSampler` (the training path): every batch comes from one bucket. The unit of an epoch is
  the GLOBAL batch of G = world_size x batch_size samples: epoch e draws from numpy's generator
  seeded by (seed, e): shuffle inside each bucket, cut global batches of G, shuffle their order;
  rank r takes rows [r*B, (r+1)*B) of every global batch. So ranks get disjoint samples, the same
  bucket (one shape on every rank) and the same number of batches (no rank waits at the epoch end,
  a rank running out of a bucket first would deadlock the others), and the global batches depend on G alone: 2 ranks x 4 see exactly what
  1 rank x 8 sees, batch for batch (how multi-process runs match one process). Buckets smaller than
  G are listed in one warning at construction and their samples are skipped every epoch; with
  drop_last the remainder of each bucket is skipped too (a different remainder each epoch, since the
  shuffle changes); without it a remainder of at least world_size samples is split as evenly as it
  goes. `stats` counts all of it. `state_dict` = (epoch, cursor in global batches); it resumes on any
  (world_size, batch_size) of the same G, and `iter_slots` tells each batch's place in its global
  batch (for per-sample random draws that do not depend on the world size).
  When a DataLoader prefetches, save the state of the batches the trainer has consumed, not of the
  sampler the workers ran ahead with: the demo calls `LatentDataset.batch` in the main process.
- `BucketBatcher` groups a stream (webdataset) into per-bucket batches. It is deterministic given
  the stream but has no resume state (its state is the buffered samples themselves); the trainer
  trains from cached latent shards loaded into `LatentDataset` with `BucketSampler` instead.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image

from atelier_studio.data.shards import read_latent_shards


def make_buckets(
    resolution: int, multiple: int, min_ratio: float = 0.25, max_ratio: float = 4.0, step: int | None = None
) -> list[tuple[int, int]]:
    """Buckets (H, W) of area <= resolution², sides multiples of `multiple`, sorted by W/H.

    The shorter side runs over multiples of `step` (default `multiple`) up to `resolution`; the
    longer side is the largest multiple of `multiple` keeping the area <= resolution².
    """
    step = step or multiple
    if multiple < 1 or step % multiple or resolution % multiple:
        raise ValueError(f"need resolution ({resolution}) and step ({step}) to be multiples of multiple ({multiple})")
    if not 0 < min_ratio <= 1 <= max_ratio:
        raise ValueError(f"need 0 < min_ratio ({min_ratio}) <= 1 <= max_ratio ({max_ratio})")
    found = set()
    for short in range(step, resolution + 1, step):
        long = (resolution * resolution // short) // multiple * multiple
        for h, w in ((short, long), (long, short)):
            if min_ratio <= w / h <= max_ratio:
                found.add((h, w))
    return sorted(found, key=lambda hw: (hw[1] / hw[0], hw[0]))


def nearest_bucket(h: int, w: int, buckets: Sequence[tuple[int, int]]) -> int:
    """Index of the bucket nearest an h×w image by log aspect ratio (ties: lowest index)."""
    if h <= 0 or w <= 0:
        raise ValueError(f"image size must be positive, got h={h}, w={w}")
    target = math.log(w / h)
    return min(range(len(buckets)), key=lambda i: (abs(math.log(buckets[i][1] / buckets[i][0]) - target), i))


def assign_buckets(sizes: Sequence[tuple[int, int]], buckets: Sequence[tuple[int, int]]) -> np.ndarray:
    """Vectorised `nearest_bucket` over many (h, w): bucket id per image, int64 [N]."""
    hw = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)  # [N, 2]
    if (hw <= 0).any():
        raise ValueError(f"image sizes must be positive; first bad index {int(np.flatnonzero((hw <= 0).any(1))[0])}")
    b = np.asarray(buckets, dtype=np.float64)  # [K, 2]
    dist = np.abs(np.log(hw[:, 1] / hw[:, 0])[:, None] - np.log(b[:, 1] / b[:, 0])[None, :])  # [N, K]
    return dist.argmin(axis=1)  # argmin takes the first minimum: same tie rule as nearest_bucket


def resize_and_crop(image: Image.Image, bucket: tuple[int, int]) -> Image.Image:
    """Resize (bicubic) so the image covers H×W, then centre-crop to exactly H×W."""
    H, W = bucket
    w, h = image.size
    scale = max(W / w, H / h)
    nw, nh = max(W, round(w * scale)), max(H, round(h * scale))
    if (nw, nh) != (w, h):
        image = image.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - W) // 2, (nh - H) // 2
    return image.crop((left, top, left + W, top + H))


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """8-bit RGB image -> float32 [3, H, W] in [-1, 1] (the autoencoders' input range)."""
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode!r} (decode with data.shards.to_rgb)")
    arr = torch.from_numpy(np.array(image, dtype=np.uint8))  # [H, W, 3]
    return arr.permute(2, 0, 1).float() / 127.5 - 1.0


def rank_rows(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(offset, length) of rank `rank`'s rows in a global batch of `size`: size / world_size each when it
    divides, else as even as it goes with the earlier ranks one longer (numpy's array_split)."""
    base, extra = divmod(size, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class Slot:
    """Where a rank's batch sits: global batch number `ordinal` (counted from the run's start, the same on
    every rank and every world size of the same global batch), rows [offset, offset + len) of its `size`."""

    ordinal: int
    offset: int
    size: int


class BucketSampler:
    """Yields lists of sample indices forever, one bucket per batch, equal batch counts per rank."""

    def __init__(
        self, bucket_of: Sequence[int], batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
        drop_last: bool = True,
    ):
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= rank < world_size, got {batch_size}, {rank}, {world_size}")
        ids = np.asarray(bucket_of, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0 or (ids < 0).any():
            raise ValueError(f"bucket_of must be a non-empty 1-D sequence of ids >= 0, got shape {ids.shape}")
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        self.num_samples = len(ids)
        self.members = {int(b): np.flatnonzero(ids == b) for b in np.unique(ids)}  # bucket -> sample indices
        self.small_buckets = {b: len(m) for b, m in self.members.items() if len(m) < self.global_batch}
        if self.small_buckets:
            warnings.warn(
                f"BucketSampler: {len(self.small_buckets)} buckets have fewer samples than batch_size {batch_size} "
                f"x world_size {world_size} = {self.global_batch} and are skipped every epoch "
                f"({sum(self.small_buckets.values())} samples), bucket id: samples = {self.small_buckets}",
                stacklevel=2,
            )
        self.epoch, self.cursor = 0, 0
        self._cache: tuple[int, list[tuple[list[int], Slot]]] | None = None
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"BucketSampler: no batch for rank {rank} of {world_size}: bucket sizes {self.bucket_sizes()} "
                f"with batch_size {batch_size} (global batch {self.global_batch})"
            )

    def bucket_sizes(self) -> dict[int, int]:
        return {b: len(m) for b, m in self.members.items()}

    def _cut(self, n: int) -> list[int]:
        """Global batch sizes a bucket of n samples is cut into (a remainder only without drop_last)."""
        G = self.global_batch
        if n < G:
            return []
        full, rem = divmod(n, G)
        keep_rem = rem and not self.drop_last and rem >= self.world_size  # every rank gets >= 1 sample
        return [G] * full + ([rem] if keep_rem else [])

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch = batches each rank gets per epoch (the same every epoch)."""
        return sum(len(self._cut(len(m))) for m in self.members.values())

    @property
    def batches_seen(self) -> int:
        """Global batches yielded since the start of the run (the sampler's position as one number)."""
        return self.epoch * self.batches_per_epoch + self.cursor

    @property
    def stats(self) -> dict:
        """Per epoch: batches per rank, the global batch, samples skipped (small buckets + remainders)."""
        used = sum(sum(self._cut(len(m))) for m in self.members.values())
        return {"batches_per_rank": self.batches_per_epoch, "global_batch": self.global_batch,
                "small_buckets": dict(self.small_buckets), "skipped_samples": self.num_samples - used}

    def global_batches(self, epoch: int) -> list[list[int]]:
        """Every global batch of `epoch`, in order (a pure function of seed, epoch and the global batch)."""
        rng = np.random.default_rng([self.seed, epoch])
        batches = []
        for b in sorted(self.members):
            sizes = self._cut(len(self.members[b]))
            if not sizes:
                continue
            idx = rng.permutation(self.members[b])
            starts = np.cumsum([0, *sizes])
            batches += [idx[starts[k]:starts[k + 1]].tolist() for k in range(len(sizes))]
        order = rng.permutation(len(batches))
        return [batches[k] for k in order]

    def epoch_slots(self, epoch: int) -> list[tuple[list[int], Slot]]:
        """This rank's batches of `epoch` with their slots."""
        out = []
        first = epoch * self.batches_per_epoch
        for k, batch in enumerate(self.global_batches(epoch)):
            offset, n = rank_rows(len(batch), self.rank, self.world_size)
            out.append((batch[offset:offset + n], Slot(first + k, offset, len(batch))))
        return out

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of `epoch`, in order (a pure function of seed, epoch, rank, world_size)."""
        return [idx for idx, _ in self.epoch_slots(epoch)]

    def iter_slots(self) -> Iterator[tuple[list[int], Slot]]:
        """(indices, slot) forever, from the current position; `__iter__` yields the indices alone."""
        while True:
            if self._cache is None or self._cache[0] != self.epoch:
                self._cache = (self.epoch, self.epoch_slots(self.epoch))
            batches = self._cache[1]
            while self.cursor < len(batches):
                self.cursor += 1  # before yielding: a state saved after receiving k batches says cursor k
                yield batches[self.cursor - 1]
            self.epoch, self.cursor = self.epoch + 1, 0

    def __iter__(self) -> Iterator[list[int]]:
        return (idx for idx, _ in self.iter_slots())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "batch_size": self.batch_size,
                "world_size": self.world_size, "num_samples": self.num_samples, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved with any (world_size, batch_size) of the same global batch, else explain.

        The cursor counts global batches, so it means the same on every world size of one global batch.
        Without drop_last, remainders are kept only when every rank gets a sample, which depends on the
        world size: such a state resumes on its own world size only.
        """
        mine = self.state_dict()
        for k in ("seed", "num_samples", "drop_last"):
            if state.get(k) != mine[k]:
                raise ValueError(f"BucketSampler state: {k} is {state.get(k)!r} in the checkpoint but {mine[k]!r} now")
        W, B = state.get("world_size"), state.get("batch_size")
        if not isinstance(W, int) or not isinstance(B, int):
            raise ValueError(f"BucketSampler state: world_size and batch_size must be integers, got {W!r}, {B!r}")
        if W * B != self.global_batch:
            same_w = W == self.world_size
            what = (f"batch_size is {B} in the checkpoint but {self.batch_size} now" if same_w else
                    f"the global batch is {W} ranks x {B} = {W * B} in the checkpoint but {self.world_size} x "
                    f"{self.batch_size} = {self.global_batch} now")
            raise ValueError(f"BucketSampler state: {what}; set train.micro_batch so that processes x micro_batch "
                             f"= {W * B} to resume exactly")
        if W != self.world_size and not self.drop_last:
            raise ValueError(f"BucketSampler state: saved with world_size {W} and drop_last=False, which keeps "
                             f"remainders by world size; resume it with {W} processes")
        if not 0 <= state["cursor"] <= self.batches_per_epoch:
            raise ValueError(f"BucketSampler state: cursor {state['cursor']} outside 0..{self.batches_per_epoch}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


class BucketBatcher:
    """Groups a stream of samples into single-bucket batches, one buffer per bucket (no resume state)."""

    def __init__(self, batch_size: int, bucket_of: Callable[[dict], Hashable]):
        self.batch_size, self.bucket_of = batch_size, bucket_of
        self.dropped = 0  # samples left in partial buffers when the stream ended

    def __call__(self, samples: Iterable[dict]) -> Iterator[list[dict]]:
        buffers: dict[Hashable, list[dict]] = defaultdict(list)
        for sample in samples:
            buf = buffers[self.bucket_of(sample)]
            buf.append(sample)
            if len(buf) == self.batch_size:
                yield buf.copy()
                buf.clear()
        self.dropped += sum(len(b) for b in buffers.values())


class LatentDataset:
    """A small latent shard set held in memory (an eval split), indexable, with a bucket id per sample.

    Training sets stream instead (data/latent_stream.py). `limit` > 0 keeps the first `limit` samples in
    shard order (reading stops there). `buckets` are the distinct (H, W) of the samples sorted by (W/H, H),
    unless given (then every sample's bucket must be one of them). `batch(indices)` stacks one bucket's
    samples: {latent [B,C,h,w], text_states [B,L,D], pooled [B,P], captions, keys, bucket (H, W)}.
    """

    def __init__(self, source: str | Path | Sequence[str | Path], buckets: Sequence[tuple[int, int]] | None = None,
                 max_bad_fraction: float = 0.0, limit: int = 0):
        stream = read_latent_shards(source, max_bad_fraction=max_bad_fraction, min_samples_for_check=1)
        self.samples = list(itertools.islice(stream, limit) if limit > 0 else stream)
        if not self.samples:
            raise ValueError(f"no latent samples in {source}")
        found = {tuple(s["bucket"]) for s in self.samples}
        by_ratio = sorted(found, key=lambda hw: (hw[1] / hw[0], hw[0]))
        self.buckets = [tuple(b) for b in buckets] if buckets is not None else by_ratio
        lookup = {b: i for i, b in enumerate(self.buckets)}
        unknown = [s for s in self.samples if tuple(s["bucket"]) not in lookup]
        if unknown:
            raise ValueError(f"{len(unknown)} samples have buckets outside {self.buckets}, e.g. key "
                             f"{unknown[0]['key']} in {unknown[0]['shard']} with bucket {unknown[0]['bucket']}")
        self.bucket_ids = [lookup[tuple(s["bucket"])] for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]

    def batch(self, indices: Sequence[int]) -> dict:
        picked = [self.samples[i] for i in indices]
        if not picked:
            raise ValueError("LatentDataset.batch: empty index list")
        ids = {self.bucket_ids[i] for i in indices}
        if len(ids) != 1:
            raise ValueError(f"LatentDataset.batch: indices {list(indices)[:8]} span buckets {sorted(ids)}")
        out = {"captions": [s["caption"] for s in picked], "keys": [s["key"] for s in picked],
               "bucket": self.buckets[ids.pop()]}
        for name in ("latent", "text_states", "pooled"):
            first = picked[0][name]
            for s in picked[1:]:
                if s[name].shape != first.shape or s[name].dtype != first.dtype:
                    raise ValueError(
                        f"LatentDataset.batch: {name} of key {s['key']} is {tuple(s[name].shape)} {s[name].dtype}, "
                        f"but key {picked[0]['key']} has {tuple(first.shape)} {first.dtype}"
                    )
            out[name] = torch.stack([s[name] for s in picked])  # [B, ...]
        return out
