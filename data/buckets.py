"""Aspect-ratio buckets: their geometry, assigning images to them, and a small in-memory latent set.

Shape legend: H/W bucket height/width in pixels, h/w an image's own height/width, B batch,
C latent channels, L text tokens, D text hidden size, P pooled text size. Aspect ratio is W/H.

- `make_buckets` lists (H, W) with sides multiples of `multiple` (= VAE factor × patch) and area
  <= resolution² (never more memory than the square bucket), both orientations, W/H within
  [min_ratio, max_ratio]. `nearest_bucket` picks by |log(w/h) - log(W/H)| (a 2:1 and a 1:2 image are
  equally far from square), ties to the lower index. `resize_and_crop` resizes to cover, then
  centre-crops (torch's antialiased bicubic on uint8 tensors); `bucket_pixels` takes a decoded image to the
  autoencoder's input.
- `rank_rows` splits a global batch into each rank's rows (the eval loop's split).
- `LatentDataset` holds a small latent shard set in memory (the eval split). Training sets are larger than
  memory and stream instead: data/latent_stream.py (per-bucket buffers, shard shuffling, the rank split and
  exact resume).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
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


def image_to_uint8(image: Image.Image) -> torch.Tensor:
    """8-bit RGB image -> uint8 [3, H, W] (no copy beyond the one numpy makes)."""
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode!r} (decode with data.shards.to_rgb)")
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)  # [H, W, 3] -> [3, H, W]


def resize_and_crop(pixels: torch.Tensor, bucket: tuple[int, int]) -> torch.Tensor:
    """uint8 [3, h, w] -> uint8 [3, H, W]: resize (bicubic, antialiased) so the image covers H×W, then centre-crop.

    torch's own uint8 resize (`interpolate`, bicubic, antialiased: the kernel torchvision's `resize` calls for uint8
    bicubic, bit for bit), not Pillow's: on a 1400x1100 photo resized to 1303x1024 it took 6.6 ms against 33-41 ms
    for Pillow (one thread, 2-core x86 CPU), with pixels within one level of Pillow's. No torchvision: installing it
    would pin the user's torch to its own release.
    """
    H, W = bucket
    h, w = pixels.shape[-2:]
    scale = max(W / w, H / h)
    nw, nh = max(W, round(w * scale)), max(H, round(h * scale))
    if (nw, nh) != (w, h):
        pixels = F.interpolate(pixels[None], size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)[0]
    left, top = (nw - W) // 2, (nh - H) // 2
    return pixels[..., top:top + H, left:left + W]


def image_to_tensor(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [3, H, W] -> float32 [3, H, W] in [-1, 1] (the autoencoders' input range)."""
    return pixels.float() / 127.5 - 1.0


def bucket_pixels(image: Image.Image, bucket: tuple[int, int]) -> torch.Tensor:
    """An 8-bit RGB image as the autoencoder's input for `bucket` (H, W): float32 [3, H, W] in [-1, 1]."""
    return image_to_tensor(resize_and_crop(image_to_uint8(image), bucket))


def rank_rows(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(offset, length) of rank `rank`'s rows in a global batch of `size`: size / world_size each when it
    divides, else as even as it goes with the earlier ranks one longer (numpy's array_split)."""
    base, extra = divmod(size, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


class LatentDataset:
    """A small latent shard set held in memory (an eval split), indexable, with a bucket id per sample.

    Training sets stream instead (data/latent_stream.py). `limit` > 0 keeps the first `limit` samples in
    shard order (reading stops there). `buckets` are the distinct (H, W) of the samples sorted by (W/H, H),
    unless given (then every sample's bucket must be one of them). `batch(indices)` stacks one bucket's
    samples: {latent [B,C,h,w], text_states [B,L,D], pooled [B,P], captions, keys, bucket (H, W)}, and mask
    [B,h,w] when the cache has loss masks.
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
        for name in ("latent", "text_states", "pooled", *(("mask",) if "mask" in picked[0] else ())):
            first = picked[0][name]
            for s in picked[1:]:
                if s[name].shape != first.shape or s[name].dtype != first.dtype:
                    raise ValueError(
                        f"LatentDataset.batch: {name} of key {s['key']} is {tuple(s[name].shape)} {s[name].dtype}, "
                        f"but key {picked[0]['key']} has {tuple(first.shape)} {first.dtype}"
                    )
            out[name] = torch.stack([s[name] for s in picked])  # [B, ...]
        return out
