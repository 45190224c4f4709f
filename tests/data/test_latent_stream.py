"""data/latent_stream.py: bucket purity, determinism, the rank split, exact resume, corrupt samples, bounded memory."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from atelier_studio.data.latent_stream import (
    LatentStream,
    ShardSet,
    StreamConfig,
    StreamStateError,
    resolution_schedule,
    stream_ranges,
)
from atelier_studio.data.shards import ShardError, encode_latent_sample, write_latent_shards
from atelier_studio.pipeline.config import ConfigError

BUCKETS = ((32, 32), (32, 64), (64, 32))


def make_samples(n: int, seed: int = 0, buckets=BUCKETS) -> list[dict]:
    """n latent samples of random buckets (unequal counts), random tensors (never zeros), keys s00000..."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    weights = np.arange(1, len(buckets) + 1) / sum(range(1, len(buckets) + 1))  # buckets of 1/6, 2/6, 3/6
    out = []
    for i in range(n):
        h, w = buckets[int(rng.choice(len(buckets), p=weights))]
        out.append({"key": f"s{i:05d}", "latent": torch.randn(4, h // 8, w // 8, generator=g),
                    "text_states": torch.randn(5, 8, generator=g).bfloat16(), "pooled": torch.randn(6, generator=g),
                    "bucket": (h, w), "caption": f"caption {i}"})
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """101 samples in shards of 13 (the last one short), 3 buckets."""
    d = tmp_path_factory.mktemp("latents") / "lat"
    samples = make_samples(101)
    write_latent_shards(samples, d, shard_size=13)
    return d, {s["key"]: s for s in samples}


def stream(d, micro_batch=4, rank=0, world_size=1, **kw) -> LatentStream:
    kw.setdefault("shuffle_buffer", 16)
    return LatentStream(d, StreamConfig(micro_batch, rank, world_size, **kw))


def take(s: LatentStream, n: int) -> list[list[dict]]:
    """The first n global micro-batches (this rank's chunks of each); the iterator is closed after."""
    it = s.chunks()
    try:
        return list(itertools.islice(it, n))
    finally:
        it.close()


def keys(batches: list[list[dict]]) -> list[list[str]]:
    return [c["keys"] for b in batches for c in b]


def assert_same(a: list[list[dict]], b: list[list[dict]]) -> None:
    """The same chunks: keys, buckets and every tensor bit for bit (the loader copies bytes)."""
    assert len(a) == len(b)
    for x, y in zip((c for batch in a for c in batch), (c for batch in b for c in batch)):
        assert ((x["ordinal"], x["stream"], x["keys"], x["bucket"])
                == (y["ordinal"], y["stream"], y["keys"], y["bucket"]))
        for name in ("latent", "text_states", "pooled"):
            assert torch.equal(x[name], y[name]), name


def epoch_len(s: LatentStream) -> int:
    return s.shards.total // s.cfg.global_batch


# ----------------------------------------------------------------------------- batches


def test_chunks_are_one_bucket_and_hold_the_written_tensors(shards):
    d, originals = shards
    s = stream(d)
    seen = []
    for batch in take(s, 3 * epoch_len(s)):  # three epochs
        (c,) = batch
        assert len(c["keys"]) == 4 and {originals[k]["bucket"] for k in c["keys"]} == {c["bucket"]}
        for name in ("latent", "text_states", "pooled"):
            assert c[name].shape[0] == 4
            assert torch.equal(c[name], torch.stack([originals[k][name] for k in c["keys"]])), name
        seen += c["keys"]
    assert len(set(seen)) > 95  # shard shuffling and the shuffle buffer reach (nearly) every sample


def test_batches_depend_on_seed_not_on_workers(shards):
    d, _ = shards
    n = 2 * epoch_len(stream(d))
    ref = take(stream(d), n)
    assert_same(ref, take(stream(d), n))
    assert_same(ref, take(stream(d, workers=3), n))  # workers share the loading, not the order
    assert keys(take(stream(d, seed=1), n)) != keys(ref)
    first = [k for c in keys(ref)[: epoch_len(stream(d))] for k in c]
    assert first != sorted(first)  # shuffled: not the file order


def test_shard_order_is_shuffled_per_epoch_and_split_into_equal_shares():
    counts = [13] * 7 + [10]
    for streams in (1, 2, 3, 4):
        for epoch in range(3):
            shares = [stream_ranges(counts, 0, epoch, streams, v) for v in range(streams)]
            slots = [(s, i) for share in shares for s, a, b in share for i in range(a, b)]
            assert sorted(slots) == [(s, i) for s in range(8) for i in range(counts[s])]  # disjoint, complete
            sizes = [sum(b - a for _, a, b in share) for share in shares]
            assert max(sizes) - min(sizes) <= 1
    orders = [[s for s, _, _ in stream_ranges(counts, 0, e, 1, 0)] for e in range(3)]
    assert orders[0] != orders[1] != orders[2] and sorted(orders[0]) == list(range(8))


def test_two_ranks_see_disjoint_samples_equal_batches_and_what_one_process_sees(shards):
    d, _ = shards
    ranks = [stream(d, micro_batch=2, rank=r, world_size=2) for r in range(2)]  # G = 4, 2 streams of 2
    its = [r.chunks() for r in ranks]
    first_epoch: list[list[str]] = [[], []]
    steps = 3 * 101 // 4
    per_rank = [[], []]
    for _ in range(steps):  # every rank yields a batch at every step, epochs on end
        for r, it in enumerate(its):
            (c,) = next(it)
            per_rank[r].append(c)
            assert c["stream"] == r and len(c["keys"]) == 2
            if ranks[r].plans[r].epoch == 0:
                first_epoch[r] += c["keys"]
    assert first_epoch[0] and first_epoch[1] and not set(first_epoch[0]) & set(first_epoch[1])
    # one process over the same 2 streams: per step, stream 0's chunk then stream 1's
    one = take(stream(d, micro_batch=4, streams=2), steps)
    assert all(len(b) == 2 for b in one)
    assert_same(one, [[a, b] for a, b in zip(*per_rank)])
    for it in its:
        it.close()


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("cut_epochs", [0.4, 1.3])  # mid-epoch; after the first epoch boundary
def test_resume_is_exact(shards, cut_epochs):
    d, _ = shards
    n = epoch_len(stream(d))
    cut, total = int(cut_epochs * n), 3 * n
    ref = take(stream(d), total)
    first = stream(d)
    head = take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))  # saved as JSON in the checkpoint
    assert (state["positions"]["0"]["epoch"] >= 1) == (cut_epochs > 1)
    resumed = stream(d, workers=2)
    resumed.load_state_dict(state)
    assert_same(ref, head + take(resumed, total - cut))


def test_two_process_position_resumes_on_one_process(shards):
    d, _ = shards
    ranks = [stream(d, micro_batch=2, rank=r, world_size=2) for r in range(2)]
    heads = [take(r, 9) for r in ranks]
    state = LatentStream.merge_states([r.state_dict() for r in ranks])
    one = stream(d, micro_batch=4)  # data.streams = 0: takes the checkpoint's 2 streams
    one.load_state_dict(json.loads(json.dumps(state)))
    rest = take(one, 12)
    ref = [take(stream(d, micro_batch=2, rank=r, world_size=2), 21)[9:] for r in range(2)]
    assert_same(rest, [[a, b] for (a,), (b,) in zip(*ref)])
    assert heads[0] and one.chunks_per_micro_batch == 2


def test_mismatched_positions_are_refused(shards, tmp_path):
    d, _ = shards
    s = stream(d, micro_batch=2, rank=0, world_size=2)
    take(s, 3)
    state = LatentStream.merge_states([s.state_dict(), stream(d, micro_batch=2, rank=1, world_size=2).state_dict()])
    with pytest.raises(StreamStateError, match=r"global batch is 2 ranks x 2 = 4 in the checkpoint but 1 x 2 = 2 now; "
                                               r"set train.micro_batch so that processes x micro_batch = 4"):
        stream(d, micro_batch=2).load_state_dict(state)
    with pytest.raises(StreamStateError, match="train.seed is 0 in the checkpoint but 5 now"):
        stream(d, micro_batch=4, seed=5).load_state_dict(state)
    with pytest.raises(StreamStateError, match="data.streams is 2 in the checkpoint but 4 now"):
        stream(d, micro_batch=4, streams=4).load_state_dict(state)
    other = tmp_path / "other"
    write_latent_shards(make_samples(101, seed=1)[:100], other, shard_size=13)
    with pytest.raises(StreamStateError, match="not the shards the run was saved with"):
        stream(other, micro_batch=4).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"global micro-batch of 1 processes x micro_batch 3 = 3 does not split "
                                          r"into 2 streams"):
        stream(d, micro_batch=3, streams=2)
    with pytest.raises(ConfigError, match="3 streams cannot be split over 2 processes"):
        stream(d, micro_batch=3, world_size=2, streams=3)


# ----------------------------------------------------------------------------- several resolutions

# two resolutions' shard sets as `atelier imagegen cache` writes them for data.resolutions = [16, 32]: each its own
# aspect buckets (area <= resolution²), unequal sample counts (60 and 45) so the data-proportional shares differ
RES_BUCKETS = {16: ((16, 16), (16, 32), (32, 16)), 32: ((32, 32), (32, 64), (64, 32))}
RES_COUNTS = {16: 60, 32: 45}


@pytest.fixture(scope="module")
def multires(tmp_path_factory) -> tuple[dict[int, Path], dict[int, dict[str, dict]]]:
    root = tmp_path_factory.mktemp("multires")
    dirs, originals = {}, {}
    for r, n in RES_COUNTS.items():
        samples = make_samples(n, seed=r, buckets=RES_BUCKETS[r])
        dirs[r] = root / f"r{r}"
        write_latent_shards(samples, dirs[r], shard_size=13)
        originals[r] = {s["key"]: s for s in samples}
    return dirs, originals


def test_several_resolutions_give_one_resolution_and_bucket_per_chunk_the_same_on_every_rank(multires):
    dirs, originals = multires
    ranks = [stream(dirs, micro_batch=2, rank=r, world_size=2) for r in range(2)]
    its = [r.chunks() for r in ranks]
    seen = {16: set(), 32: set()}
    for _ in range(120):  # several epochs of each resolution
        pair = [next(it)[0] for it in its]
        assert pair[0]["resolution"] == pair[1]["resolution"]  # every rank runs the same resolution at a step
        for c in pair:
            r = c["resolution"]
            assert c["bucket"] in RES_BUCKETS[r]
            assert {originals[r][k]["bucket"] for k in c["keys"]} == {c["bucket"]}  # one (resolution, aspect)
            for name in ("latent", "text_states", "pooled"):
                assert torch.equal(c[name], torch.stack([originals[r][k][name] for k in c["keys"]])), name
            seen[r] |= set(c["keys"])
    for it in its:
        it.close()
    assert len(seen[16]) > 55 and len(seen[32]) > 40  # every resolution's samples are reached


def test_resolution_shares_follow_the_data_or_the_weights(multires):
    dirs, _ = multires

    def counts(s: LatentStream, n: int) -> tuple[dict[int, int], dict[tuple, int]]:
        by_res: dict[int, int] = {}
        by_bucket: dict[tuple, int] = {}
        for (c,) in take(s, n):
            by_res[c["resolution"]] = by_res.get(c["resolution"], 0) + 1
            by_bucket[c["bucket"]] = by_bucket.get(c["bucket"], 0) + 1
        return by_res, by_bucket

    n = 420  # 16 epochs of each resolution at 4 images a chunk
    by_res, by_bucket = counts(stream(dirs), n)  # default: proportional to the samples, 60 : 45
    assert abs(by_res[16] - n * 60 / 105) <= 3 and abs(by_res[32] - n * 45 / 105) <= 3, by_res
    # within a resolution, each aspect bucket's share of its chunks follows its share of the samples
    for r, buckets in RES_BUCKETS.items():
        data = {b: sum(1 for x in multires[1][r].values() if x["bucket"] == b) for b in buckets}
        for b in buckets:
            assert abs(by_bucket.get(b, 0) / by_res[r] - data[b] / RES_COUNTS[r]) < 0.06, (r, b, by_bucket, data)
    by_res, _ = counts(stream(dirs, resolution_weights=(1.0, 3.0)), 200)
    assert abs(by_res[16] - 50) <= 3 and abs(by_res[32] - 150) <= 3, by_res
    # the schedule alone, over any window: within 3 of each share (random draws would stray by ~sqrt(n))
    for shares in ((1.0, 1.0, 1.0), (1.0, 1.0, 2.0), (60.0, 45.0)):
        for start in (0, 1000):
            picks = [resolution_schedule(5, k, shares) for k in range(start, start + 300)]
            for i, w in enumerate(shares):
                assert abs(picks.count(i) - 300 * w / sum(shares)) <= 3, (shares, start, i, picks.count(i))


def test_several_resolutions_depend_on_seed_not_on_workers(multires):
    dirs, _ = multires
    ref = take(stream(dirs), 60)
    assert_same(ref, take(stream(dirs, workers=3), 60))
    other = take(stream(dirs, seed=1), 60)
    assert [c["resolution"] for (c,) in other] != [c["resolution"] for (c,) in ref]
    assert keys(other) != keys(ref)


@pytest.mark.parametrize("cut", [7, 31])  # mid-epoch of both resolutions; past the first epoch boundary of each
def test_several_resolutions_resume_exactly(multires, cut):
    dirs, _ = multires
    total = 80
    ref = take(stream(dirs), total)
    first = stream(dirs)
    head = take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))
    epochs = [p["epoch"] for p in state["positions"]["0"]["resolutions"].values()]
    assert (min(epochs) >= 1) == (cut > 20) and max(epochs) < 3
    resumed = stream(dirs, workers=2)
    resumed.load_state_dict(state)
    rest = take(resumed, total - cut)
    assert_same(ref, head + rest)
    assert [c["resolution"] for (c,) in ref] == [c["resolution"] for (c,) in head + rest]
    assert {c["resolution"] for (c,) in rest} == {16, 32}
    # two processes' position, resumed on one (data.streams = 0 takes the checkpoint's 2)
    ranks = [stream(dirs, micro_batch=2, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        take(r, cut)
    one = stream(dirs)
    one.load_state_dict(json.loads(json.dumps(LatentStream.merge_states([r.state_dict() for r in ranks]))))
    want = [take(stream(dirs, micro_batch=2, rank=r, world_size=2), cut + 10)[cut:] for r in range(2)]
    assert_same(take(one, 10), [[a, b] for (a,), (b,) in zip(*want)])


def test_several_resolutions_refuse_another_setting(multires, shards):
    dirs, _ = multires
    s = stream(dirs)
    take(s, 5)
    state = json.loads(json.dumps(s.state_dict()))
    with pytest.raises(StreamStateError, match=r"trained at data.resolutions \[16, 32\], this run at one "
                                               r"data.resolution"):
        stream(dirs[16]).load_state_dict(state)
    with pytest.raises(StreamStateError, match=r"trained at data.resolutions \[16, 32\], this run at "
                                               r"data.resolutions \[32, 16\]"):
        stream({32: dirs[32], 16: dirs[16]}).load_state_dict(state)
    with pytest.raises(StreamStateError, match=r"shares \[60.0, 45.0\] of the batches, this run \[1.0, 1.0\]"):
        stream(dirs, resolution_weights=(1.0, 1.0)).load_state_dict(state)
    single = stream(shards[0])
    with pytest.raises(StreamStateError, match=r"trained at one data.resolution, this run at data.resolutions"):
        stream(dirs).load_state_dict(json.loads(json.dumps(single.state_dict())))
    with pytest.raises(ValueError, match="one positive weight per resolution"):
        stream(dirs, resolution_weights=(1.0,))


# ----------------------------------------------------------------------------- corrupt samples


def _write_raw(path: Path, members: list[dict]) -> None:
    with wds.TarWriter(str(path), encoder=False) as w:
        for m in members:
            w.write(m)


def test_corrupt_samples_are_skipped_and_counted(tmp_path):
    good = make_samples(24, seed=3, buckets=((32, 32),))
    enc = [encode_latent_sample(s) for s in good]
    d = tmp_path / "bad"
    d.mkdir()
    bad = [
        {"__key__": "nojson", "safetensors": enc[0]["safetensors"]},
        {"__key__": "garbage", "safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all",
         "json": enc[0]["json"]},
        {"__key__": "nobucket", "safetensors": enc[0]["safetensors"], "json": b'{"caption": "x"}'},
        {"__key__": "badjson", "safetensors": enc[0]["safetensors"], "json": b"{"},
    ]
    _write_raw(d / "a.tar", enc[:6] + bad + enc[6:12])
    _write_raw(d / "b.tar", enc[12:])
    data = (d / "b.tar").read_bytes()
    (d / "b.tar").write_bytes(data[: len(data) // 2 + 100])  # cut inside a payload
    tars = [d / "a.tar", d / "b.tar"]
    got = [k for b in take(stream(tars, micro_batch=2, max_bad_fraction=1.0), 30) for c in b for k in c["keys"]]
    assert set(got) == {x["key"] for x in good[:12]} | {x["key"] for x in good[12:18]}  # what b.tar kept
    plan = stream(tars, micro_batch=2, max_bad_fraction=1.0).plans[0]
    while plan.epoch == 0:  # one pass (both tars start with good samples: the pass ends on a good one)
        plan.next_ref()
    c = plan.counter
    assert dict(c.by_reason) == {"missing member": 1, "undecodable latent": 2, "malformed latent": 1,
                                 "truncated tar": 1}
    assert c.by_shard[str(d / "a.tar")] == 4 and c.by_shard[str(d / "b.tar")] == 1 and c.good == 18 + 1
    # past max_bad_fraction the stream stops, naming the worst shard
    strict = stream([d / "a.tar"], micro_batch=2, max_bad_fraction=0.05, min_samples_for_check=5)
    with pytest.raises(ShardError, match=r"worst shard .*a\.tar \(\d bad\)"):
        take(strict, 8)


def test_index_count_larger_than_the_tar_counts_as_truncated(tmp_path):
    d = tmp_path / "lat"
    write_latent_shards(make_samples(20, buckets=((32, 32),)), d, shard_size=10)
    index = json.loads((d / "index.json").read_text())
    index["shards"][1]["count"] = 14  # 4 more than the tar holds
    (d / "index.json").write_text(json.dumps(index))
    plan = stream(d, micro_batch=2, shuffle_buffer=1).plans[0]
    while plan.epoch < 2:  # two passes (each ends with a good sample: the next pass's first)
        plan.next_ref()
    assert plan.counter.by_reason["truncated tar"] == 2 * 4  # the 4 listed samples it lacks, on each pass
    assert plan.counter.by_shard_reason == {str(d / "shard-000001.tar"): {"truncated tar": 8}}
    assert "index lists" in plan.counter.last_bad.detail


def test_remote_shards_are_refused():
    with pytest.raises(ShardError, match="local shard files"):
        ShardSet.open(["pipe:curl -s http://example.com/shard-000000.tar"])


# ----------------------------------------------------------------------------- memory

_CHILD = """
import itertools, re, sys
from atelier_studio.data.buckets import LatentDataset
from atelier_studio.data.latent_stream import LatentStream, StreamConfig

def status(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

src, how = sys.argv[1], sys.argv[2]
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from here: after the imports
start = status("VmRSS")
if how == "stream":
    s = LatentStream(src, StreamConfig(8, shuffle_buffer=64))
    n = 0
    for batch in itertools.islice(s.chunks(), s.shards.total // 8):  # one epoch: every sample read once
        n += sum(c["latent"].shape[0] for c in batch)
else:
    n = len(LatentDataset(src))
print(n, status("VmHWM") - start)
"""


def _peak_rss(src: Path, how: str) -> tuple[int, int]:
    """(samples read, peak RSS growth in bytes) of a fresh process reading `src` by stream or into memory."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(src), how], capture_output=True, text=True, check=True)
    n, peak = out.stdout.split()
    return int(n), int(peak)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux procfs")
def test_peak_memory_does_not_grow_with_the_number_of_samples(tmp_path):
    """Peak RSS of a process streaming one epoch of N vs 4N samples (each ~140 kB), against the in-memory set.

    Linux: the peak is /proc/self/status's VmHWM, reset after the imports (clear_refs), so import-time peaks
    do not hide what the reading itself takes."""
    n = 96
    g = torch.Generator().manual_seed(7)
    big = make_samples(4 * n, seed=7, buckets=((256, 256),))
    for s in big:  # ~140 kB a sample: latent 16x32x32 fp32 + text 77x256 fp32
        s["latent"] = torch.randn(16, 32, 32, generator=g)
        s["text_states"] = torch.randn(77, 256, generator=g)
        s["pooled"] = torch.randn(256, generator=g)
    write_latent_shards(big[:n], tmp_path / "n", shard_size=32)
    write_latent_shards(big, tmp_path / "4n", shard_size=32)
    sample_bytes = 4 * (16 * 32 * 32 + 77 * 256 + 256)
    extra = 3 * n * sample_bytes  # what holding the 3N more samples would take: 41 MB
    read_n, peak_n = _peak_rss(tmp_path / "n", "stream")
    read_4n, peak_4n = _peak_rss(tmp_path / "4n", "stream")
    assert read_4n > 3.5 * read_n  # the big pass really read ~4x the samples
    # The stream holds, whatever N: 64 references in the shuffle buffer, < 3 buckets x 8 in the bucket buffers
    # (a few hundred bytes each) and one chunk of 8 samples (1.1 MB). A quarter of `extra` (10 MB) leaves room for
    # allocator noise between two processes (5 MB seen on a loaded 2-core machine); a loader that kept the samples
    # would grow by all of `extra`.
    assert peak_4n - peak_n < extra / 4, (peak_n, peak_4n, extra)
    # the same measurement sees the in-memory dataset grow by (nearly) every extra sample: it can fail
    _, held_n = _peak_rss(tmp_path / "n", "memory")
    _, held_4n = _peak_rss(tmp_path / "4n", "memory")
    assert held_4n - held_n > 0.8 * extra, (held_n, held_4n, extra)
