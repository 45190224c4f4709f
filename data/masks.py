"""Loss masks for imagegen (`data.mask`): which pixels of an image the loss counts, as latent-resolution weights.

Two sources, picked by `data.mask`:
    "alpha"    the image's own alpha channel (opaque = 1, transparent = 0; an image without one counts whole),
               kept by the shard reader as the sample's `alpha` (data/shards.py) before the image becomes RGB
    "sidecar"  a grey `<image stem>.mask.png` beside the image (white = 1, black = 0), packed into the image shard
               as the member `<key>.mask.png` by `atelier data shards`; the same size as its image

A mask goes through the image's own geometry (resized to cover the bucket, centre-cropped: data/buckets.py), then
each latent position gets the mean of the mask over the pixels it encodes (a `factor` x `factor` box, the
autoencoder's downsampling): a weight in [0, 1] per latent position, [h, w] float32, which the latent shard stores
as `mask` and the flow-matching loss weights by (imagegen/flow.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from atelier_studio.data.buckets import resize_and_crop

MASK_MODES = ("none", "alpha", "sidecar")


def mask_weights(mask: Image.Image, bucket: tuple[int, int], factor: int) -> torch.Tensor:
    """A grey mask of the image's size -> float32 [H / factor, W / factor] weights in [0, 1] for `bucket` (H, W)."""
    pixels = torch.from_numpy(np.array(mask.convert("L"), dtype=np.uint8))[None]  # [1, h, w]
    fitted = resize_and_crop(pixels, bucket).float() / 255.0  # [1, H, W], as the image's pixels are fitted
    return F.avg_pool2d(fitted[None], factor)[0, 0]  # [H / factor, W / factor]


__all__ = ["MASK_MODES", "mask_weights"]
