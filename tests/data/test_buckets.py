"""data/buckets.py: bucket geometry, bucket assignment, the sampler's determinism, resume and rank split."""

import itertools
import math
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from atelier_studio.data.buckets import (
    BucketBatcher,
    BucketSampler,
    LatentDataset,
    assign_buckets,
    image_to_tensor,
    make_buckets,
    nearest_bucket,
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
    out = resize_and_crop(Image.fromarray(arr), (32, 32))
    assert out.size == (32, 32)
    t = image_to_tensor(out)
    assert t.shape == (3, 32, 32) and t.dtype == torch.float32
    assert t[:, :, 16].min() > 0.9 and t[:, :, 0].max() < -0.9
    tall = resize_and_crop(Image.fromarray(np.full((90, 30, 3), 7, dtype=np.uint8)), (16, 48))
    assert tall.size == (48, 16)


def _random_buckets(n, n_buckets, seed):
    return np.random.default_rng(seed).integers(0, n_buckets, size=n).tolist()


def test_batches_never_mix_buckets_and_epochs_are_deterministic():
    bucket_of = _random_buckets(203, 5, 1)
    s = BucketSampler(bucket_of, batch_size=4, seed=3)
    batches = list(itertools.islice(iter(s), 3 * s.batches_per_epoch))
    assert all(len(b) == 4 and len({bucket_of[i] for i in b}) == 1 for b in batches)
    epoch0 = batches[: s.batches_per_epoch]
    flat = [i for b in epoch0 for i in b]
    assert len(set(flat)) == len(flat)  # no sample twice in an epoch
    assert epoch0 == BucketSampler(bucket_of, batch_size=4, seed=3).epoch_batches(0)
    assert epoch0 != batches[s.batches_per_epoch : 2 * s.batches_per_epoch]  # epoch 1 is reshuffled
    assert epoch0 != BucketSampler(bucket_of, batch_size=4, seed=4).epoch_batches(0)
    assert s.stats["skipped_samples"] == 203 - 4 * s.batches_per_epoch


def test_resumed_sampler_continues_exact_sequence():
    bucket_of = _random_buckets(97, 4, 2)
    s = BucketSampler(bucket_of, batch_size=3, seed=11, rank=1, world_size=2)
    it = iter(s)
    head = list(itertools.islice(it, s.batches_per_epoch + 5))  # into the second epoch
    state = s.state_dict()
    tail = list(itertools.islice(it, 2 * s.batches_per_epoch))
    fresh = BucketSampler(bucket_of, batch_size=3, seed=11, rank=1, world_size=2)
    fresh.load_state_dict(state)
    assert list(itertools.islice(iter(fresh), len(tail))) == tail
    assert state["epoch"] == 1 and state["cursor"] == 5 and head
    with pytest.raises(ValueError, match="batch_size is 3 in the checkpoint but 4 now"):
        BucketSampler(bucket_of, batch_size=4, seed=11, rank=1, world_size=2).load_state_dict(state)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_get_disjoint_samples_and_equal_batch_counts(world_size):
    bucket_of = _random_buckets(250, 6, world_size)
    samplers = [BucketSampler(bucket_of, 5, seed=0, rank=r, world_size=world_size) for r in range(world_size)]
    for epoch in range(2):
        per_rank = [s.epoch_batches(epoch) for s in samplers]
        assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == samplers[0].batches_per_epoch
        flat = [i for batches in per_rank for b in batches for i in b]
        assert len(flat) == len(set(flat))
    total = sum(len(m) // (5 * world_size) for m in samplers[0].members.values())
    assert samplers[0].batches_per_epoch == total and samplers[0].stats["global_batch"] == 5 * world_size


def test_ranks_split_the_one_process_global_batches():
    """W ranks x B see exactly 1 rank x W*B's batches: rank r holds rows [r*B, (r+1)*B) of each, one bucket."""
    bucket_of = _random_buckets(300, 5, 7)
    one = BucketSampler(bucket_of, 6, seed=2)
    two = [BucketSampler(bucket_of, 3, seed=2, rank=r, world_size=2) for r in range(2)]
    its = [s.iter_slots() for s in two]
    for idx, slot in itertools.islice(one.iter_slots(), 2 * one.batches_per_epoch + 3):
        parts = [next(it) for it in its]
        assert [i for p, _ in parts for i in p] == idx
        assert [s.offset for _, s in parts] == [0, 3] and {s.ordinal for _, s in parts} == {slot.ordinal}
        assert len({bucket_of[i] for i in idx}) == 1
    # a position saved by 2 ranks resumes on 1 (and back) at the same global batch
    state = two[1].state_dict()
    resumed = BucketSampler(bucket_of, 6, seed=2)
    resumed.load_state_dict(state)
    back = BucketSampler(bucket_of, 3, seed=2, rank=0, world_size=2)
    back.load_state_dict(one.state_dict())
    assert resumed.batches_seen == one.batches_seen == back.batches_seen
    assert next(iter(resumed)) == next(iter(one))
    assert next(iter(back)) == next(iter(two[0]))
    with pytest.raises(ValueError, match=r"global batch is 2 ranks x 3 = 6 in the checkpoint but 1 x 4 = 4"):
        BucketSampler(bucket_of, 4, seed=2).load_state_dict(state)


def test_uneven_remainders_give_every_rank_a_sample():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = [BucketSampler([0] * 11, 2, rank=r, world_size=3, drop_last=False) for r in range(3)]
    slots = [x.epoch_slots(0) for x in s]
    sizes = sorted(tuple(len(sl[k][0]) for sl in slots) for k in range(2))
    assert sizes == [(2, 2, 1), (2, 2, 2)]  # 6 + 5: the remainder 5 split 2/2/1
    assert sorted(i for sl in slots for b, _ in sl for i in b) == list(range(11))


def test_small_buckets_are_warned_and_skipped():
    bucket_of = [0] * 10 + [1] * 2 + [2] * 7
    with pytest.warns(UserWarning, match=r"fewer samples than batch_size 4 .*\{1: 2\}"):
        s = BucketSampler(bucket_of, batch_size=4, seed=0)
    batches = s.epoch_batches(0)
    assert sorted({bucket_of[b[0]] for b in batches}) == [0, 2] and len(batches) == 3
    assert s.stats["skipped_samples"] == 2 + 2 + 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keep = BucketSampler(bucket_of, batch_size=4, seed=0, drop_last=False)
    assert sorted(len(b) for b in keep.epoch_batches(0)) == [2, 3, 4, 4, 4]
    with pytest.raises(ValueError, match="no batch for rank"):
        BucketSampler([0, 0, 0, 0], batch_size=4, rank=1, world_size=2)


def test_bucket_batcher_groups_stream():
    rng = np.random.default_rng(5)
    stream = [{"i": i, "b": int(rng.integers(3))} for i in range(50)]
    batcher = BucketBatcher(4, lambda s: s["b"])
    batches = list(batcher(iter(stream)))
    assert all(len(b) == 4 and len({s["b"] for s in b}) == 1 for b in batches)
    assert len(batches) >= 10 and batches == list(BucketBatcher(4, lambda s: s["b"])(stream))  # deterministic
    assert batcher.dropped == 50 - 4 * len(batches)


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
    sampler = BucketSampler(ds.bucket_ids, batch_size=2, seed=0)
    for indices in itertools.islice(iter(sampler), 6):
        batch = ds.batch(indices)
        assert batch["latent"].shape == (2, 12, *shapes[batch["bucket"]])
        assert batch["text_states"].shape == (2, 5, 8) and batch["pooled"].shape == (2, 6)
        for j, i in enumerate(indices):
            assert torch.equal(batch["latent"][j], samples[i]["latent"]) and batch["captions"][j] == f"c{i}"
    with pytest.raises(ValueError, match=r"span buckets \[0, 1\]"):
        ds.batch([0, 1])
    with pytest.raises(ValueError, match=r"key k0 .* bucket \(32, 64\)"):
        LatentDataset(tmp_path / "lat", buckets=[(32, 32)])
