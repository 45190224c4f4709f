"""data/buckets.py: bucket geometry, bucket assignment, the in-memory latent set, the eval rank split."""

import math

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image

from atelier_studio.data.buckets import (
    LatentDataset,
    assign_buckets,
    bucket_pixels,
    image_to_uint8,
    make_buckets,
    nearest_bucket,
    rank_rows,
    resize_and_crop,
)
from atelier_studio.data.shards import write_latent_shards


@pytest.mark.parametrize("resolution,multiple,step", [(256, 16, None), (64, 8, 8), (1024, 16, 64)])
def test_make_buckets_geometry(resolution, multiple, step):
    buckets = make_buckets(resolution, multiple, step=step)
    assert (resolution, resolution) in buckets
    ratios = [w / h for h, w in buckets]
    assert ratios == sorted(ratios) and len(set(buckets)) == len(buckets)
    for h, w in buckets:
        assert h % multiple == 0 and w % multiple == 0 and 0.25 <= w / h <= 4
        assert h * w <= resolution**2
        # the longer side is as large as the area bound allows
        assert max(h, w) + multiple > resolution**2 / min(h, w)
        assert (w, h) in buckets  # both orientations
    assert min(ratios) < 0.3 and max(ratios) > 3.3


@pytest.mark.parametrize("multiple", [4, 16])
def test_buckets_of_different_resolutions_never_coincide(multiple):
    """What a multi-resolution stream relies on (data/latent_stream.py ResolutionPlan): a bucket (H, W) names its
    resolution. Each bucket's area is within multiple x short side of resolution², and resolutions differ by at
    least one multiple, so the areas of two resolutions' buckets cannot meet."""
    resolutions = [multiple * k for k in range(1, 40)] + [512, 768, 1024]
    owner: dict[tuple[int, int], int] = {}
    for r in sorted(set(resolutions)):
        for b in make_buckets(r, multiple):
            assert owner.setdefault(b, r) == r, (b, owner[b], r)
    assert len(owner) > 100


def test_each_sample_goes_to_nearest_bucket_by_log_ratio():
    buckets = make_buckets(128, 16)
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 2000, size=(300, 2))] + [(100, 100), (50, 400), (400, 50)]
    ids = assign_buckets(sizes, buckets)
    for (h, w), i in zip(sizes, ids):
        assert nearest_bucket(h, w, buckets) == i
        d = abs(math.log(w / h) - math.log(buckets[i][1] / buckets[i][0]))
        assert all(d <= abs(math.log(w / h) - math.log(W / H)) + 1e-12 for H, W in buckets)
    assert buckets[nearest_bucket(100, 100, buckets)] == (128, 128)
    with pytest.raises(ValueError, match="h=0"):
        nearest_bucket(0, 5, buckets)


def test_resize_and_crop_covers_and_centres():
    arr = np.zeros((40, 100, 3), dtype=np.uint8)
    arr[:, 40:60] = 255  # a white vertical band in the middle survives a centre crop
    t = bucket_pixels(Image.fromarray(arr), (32, 32))
    assert t.shape == (3, 32, 32) and t.dtype == torch.float32
    assert t[:, :, 16].min() > 0.9 and t[:, :, 0].max() < -0.9
    tall = resize_and_crop(image_to_uint8(Image.fromarray(np.full((90, 30, 3), 7, dtype=np.uint8))), (16, 48))
    assert tall.shape == (3, 16, 48) and tall.dtype == torch.uint8
    assert (tall == 7).all()  # a flat image stays flat: the resize's weights sum to one, rounded back to uint8


def test_resize_matches_pillow_to_one_level():
    """torch's antialiased uint8 bicubic against Pillow's on a real photo: the same image, within one 8-bit level
    in almost every pixel (the two round their filter taps differently)."""
    photo = Image.fromarray(skimage.data.astronaut()).resize((300, 200))  # [200, 300] RGB
    ours = resize_and_crop(image_to_uint8(photo), (96, 96)).int()
    w, h = round(300 * 96 / 200), 96
    pil = np.array(photo.resize((w, h), Image.Resampling.BICUBIC).crop(((w - 96) // 2, 0, (w - 96) // 2 + 96, 96)))
    diff = (ours - torch.from_numpy(pil).permute(2, 0, 1).int()).abs()
    assert diff.float().mean() < 0.5 and (diff > 2).float().mean() < 0.01, (diff.float().mean(), diff.max())
    with pytest.raises(ValueError, match="expected an RGB image"):
        image_to_uint8(photo.convert("L"))


def test_latent_dataset_batches_from_shards(tmp_path):
    g = torch.Generator().manual_seed(0)
    shapes = {(32, 32): (4, 4), (32, 64): (4, 8)}
    samples = []
    for i in range(9):
        bucket = (32, 64) if i % 3 == 0 else (32, 32)
        samples.append({"key": f"k{i}", "latent": torch.randn(12, *shapes[bucket], generator=g),
                        "text_states": torch.randn(5, 8, generator=g), "pooled": torch.randn(6, generator=g),
                        "bucket": bucket, "caption": f"c{i}"})
    write_latent_shards(samples, tmp_path / "lat", shard_size=4)
    ds = LatentDataset(tmp_path / "lat")
    assert len(ds) == 9 and ds.buckets == [(32, 32), (32, 64)]
    assert ds.bucket_ids == [1 if i % 3 == 0 else 0 for i in range(9)]
    for indices in ([1, 2], [4, 5], [0, 3], [7, 8], [6]):  # one bucket each
        batch = ds.batch(indices)
        B = len(indices)
        assert batch["latent"].shape == (B, 12, *shapes[batch["bucket"]])
        assert batch["text_states"].shape == (B, 5, 8) and batch["pooled"].shape == (B, 6)
        for j, i in enumerate(indices):
            assert torch.equal(batch["latent"][j], samples[i]["latent"]) and batch["captions"][j] == f"c{i}"
    with pytest.raises(ValueError, match=r"span buckets \[0, 1\]"):
        ds.batch([0, 1])
    with pytest.raises(ValueError, match=r"key k0 .* bucket \(32, 64\)"):
        LatentDataset(tmp_path / "lat", buckets=[(32, 32)])
    head = LatentDataset(tmp_path / "lat", limit=5)  # reads the first 5 in shard order, then stops
    assert [s["key"] for s in head.samples] == [f"k{i}" for i in range(5)]


def test_rank_rows_split_evenly_with_earlier_ranks_longer():
    assert [rank_rows(8, r, 2) for r in range(2)] == [(0, 4), (4, 4)]
    assert [rank_rows(11, r, 3) for r in range(3)] == [(0, 4), (4, 4), (8, 3)]
    assert [rank_rows(1, r, 2) for r in range(2)] == [(0, 1), (1, 0)]
