"""data/shards.py: image and latent shard round trips, corrupt-sample policy, rank splitting."""

import io
import itertools
import json

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from atelier_studio.data.shards import (
    BadSampleCounter,
    ShardError,
    ShardReader,
    list_shards,
    read_latent_shards,
    to_rgb,
    validate_shards,
    write_image_shards,
    write_latent_shards,
)


def _rand_image(rng, h, w):
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def _encode(img, fmt):
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _make_dataset(tmp_path, n, rng):
    """n PNG/WebP-lossless images of random sizes + captions.jsonl; returns (images_dir, jsonl, originals)."""
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    rows, originals = [], {}
    for i in range(n):
        img = _rand_image(rng, int(rng.integers(16, 40)), int(rng.integers(16, 40)))
        rel = f"sub/img{i}.png" if i % 2 else f"img{i}.png"
        img.save(images / rel)
        rows.append({"image": rel, "caption": f"caption number {i} with a red square"})
        originals[rel] = np.asarray(img)
    jsonl = tmp_path / "captions.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return images, jsonl, originals


def test_image_shards_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    images, jsonl, originals = _make_dataset(tmp_path, 7, rng)
    stats = write_image_shards(images, jsonl, tmp_path / "shards", shard_size=3, progress=False)
    assert stats.shards == ("shard-000000.tar", "shard-000001.tar", "shard-000002.tar")
    assert stats.counts == (3, 3, 1) and stats.total == 7
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert index["kind"] == "image" and index["total"] == 7 and [s["count"] for s in index["shards"]] == [3, 3, 1]
    got = {s["meta"]["path"]: s for s in ShardReader(tmp_path / "shards", min_side=1)}
    assert set(got) == set(originals)
    for i, (rel, arr) in enumerate(sorted(originals.items())):
        s = got[rel]
        np.testing.assert_array_equal(np.asarray(s["image"]), arr)
        assert s["image"].mode == "RGB"
        assert (s["meta"]["height"], s["meta"]["width"]) == arr.shape[:2]
        assert s["caption"] == f"caption number {rel.split('img')[1].split('.')[0]} with a red square"


def test_writer_errors_name_the_line(tmp_path):
    images, jsonl, _ = _make_dataset(tmp_path, 2, np.random.default_rng(1))
    lines = jsonl.read_text().splitlines()
    for bad, needle in [
        ("{not json", "invalid JSON"),
        ('{"image": "missing.png", "caption": "x"}', "not found"),
        ('{"image": "img0.png", "caption": ""}', "non-empty"),
        ('{"image": "img0.gif", "caption": "x"}', "extension"),
    ]:
        path = tmp_path / "bad.jsonl"
        path.write_text("\n".join([lines[0], bad, lines[1]]))
        with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{needle}"):
            write_image_shards(images, path, tmp_path / "out", shard_size=2, progress=False)


def test_mode_conversions_to_8bit_rgb():
    cmyk = Image.new("CMYK", (4, 3), (0, 255, 255, 0))  # pure red in CMYK
    assert to_rgb(cmyk).mode == "RGB" and to_rgb(cmyk).getpixel((0, 0)) == (255, 0, 0)
    arr16 = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    img16 = Image.fromarray(arr16)
    np.testing.assert_array_equal(np.asarray(to_rgb(img16))[..., 0], [[0, 1, 128, 255]])
    la = Image.new("LA", (2, 2), (100, 0))  # fully transparent grey -> white background
    assert to_rgb(la).getpixel((0, 0)) == (255, 255, 255)
    la_opaque = Image.new("LA", (2, 2), (100, 255))
    assert to_rgb(la_opaque).getpixel((1, 1)) == (100, 100, 100)
    pal = Image.new("P", (2, 2), 3)
    pal.putpalette([0, 0, 0, 10, 20, 30, 40, 50, 60, 70, 80, 90] + [0] * (768 - 12))
    assert to_rgb(pal).getpixel((0, 0)) == (70, 80, 90)


def _write_tar(path, samples):
    with wds.TarWriter(str(path), encoder=False) as w:
        for s in samples:
            w.write(s)


def _bad_shards(tmp_path, rng):
    """shard 0: 4 good + CMYK + 16-bit (converted) + undecodable jpeg + no caption + 1x1; shard 1: truncated."""
    d = tmp_path / "bad"
    d.mkdir()
    good = [{"__key__": f"g{i}", "png": _encode(_rand_image(rng, 20, 24), "PNG"), "txt": b"a cat"} for i in range(4)]
    jpeg = _encode(_rand_image(rng, 32, 32), "JPEG")
    cmyk = _encode(Image.new("CMYK", (20, 20), (0, 255, 255, 0)), "JPEG")
    i16 = _encode(Image.fromarray(np.full((20, 20), 65535, dtype=np.uint16)), "PNG")
    samples = good + [
        {"__key__": "cmyk", "jpg": cmyk, "txt": b"cmyk red"},
        {"__key__": "i16", "png": i16, "txt": b"16-bit white"},
        {"__key__": "broken", "jpg": jpeg[: len(jpeg) // 3], "txt": b"truncated jpeg"},
        {"__key__": "nocap", "png": _encode(_rand_image(rng, 20, 20), "PNG")},
        {"__key__": "tiny", "png": _encode(_rand_image(rng, 1, 1), "PNG"), "txt": b"one pixel"},
    ]
    _write_tar(d / "shard-000000.tar", samples)
    big = [{"__key__": f"t{i}", "png": _encode(_rand_image(rng, 30, 30), "PNG"), "txt": b"x"} for i in range(6)]
    _write_tar(d / "shard-000001.tar", big)
    data = (d / "shard-000001.tar").read_bytes()
    (d / "shard-000001.tar").write_bytes(data[: len(data) // 2 + 7])
    return d


def test_bad_samples_skipped_and_counted(tmp_path):
    d = _bad_shards(tmp_path, np.random.default_rng(2))
    reader = ShardReader(d, min_side=8, max_bad_fraction=1.0)
    got = {s["key"]: s for s in reader}
    assert {"g0", "g1", "g2", "g3", "cmyk", "i16"} <= set(got)
    assert not {"broken", "nocap", "tiny"} & set(got)
    r, g, b = got["cmyk"]["image"].getpixel((10, 10))
    assert got["cmyk"]["image"].mode == "RGB" and r > 200 and g < 60 and b < 60
    assert got["i16"]["image"].getpixel((3, 3)) == (255, 255, 255)
    c = reader.counter
    assert c.by_reason["undecodable image"] == 1
    assert c.by_reason["missing caption"] == 1
    assert c.by_reason["image too small"] == 1
    assert c.by_reason["truncated tar"] == 1
    assert c.by_shard[str(d / "shard-000001.tar")] >= 1
    # whatever was intact before the truncation point of shard 1 is still served
    assert c.good == len(got) and 6 <= c.good <= 6 + 6


def test_max_bad_fraction_raises_naming_shard(tmp_path):
    d = _bad_shards(tmp_path, np.random.default_rng(3))
    reader = ShardReader([d / "shard-000000.tar"], min_side=8, max_bad_fraction=0.2)
    with pytest.raises(ShardError, match=r"worst shard .*shard-000000\.tar.*last bad: .*key (broken|nocap|tiny)"):
        list(reader)
    # the early check fires mid-stream once enough samples were seen
    counter = BadSampleCounter(max_bad_fraction=0.1, min_samples_for_check=4)
    reader = ShardReader([d / "shard-000000.tar"], min_side=8)
    reader.counter = counter
    with pytest.raises(ShardError, match="shard-000000.tar.*key broken"):
        list(reader)
    assert counter.good == 6 and dict(counter.by_reason) == {"undecodable image": 1}  # stopped at the 1st bad


def test_validate_shards_reports_per_shard(tmp_path):
    d = _bad_shards(tmp_path, np.random.default_rng(4))
    report = validate_shards(d, min_side=8)
    assert report.kind == "image"
    s0 = report.per_shard["shard-000000.tar"]
    assert s0["ok"] == 6 and s0["bad"] == {"undecodable image": 1, "missing caption": 1, "image too small": 1}
    assert report.per_shard["shard-000001.tar"]["bad"] == {"truncated tar": 1}
    assert any("no index.json" in p for p in report.problems)
    json.dumps(report.as_dict())  # serialisable for `atelier data validate`


def _latent_samples(n, rng):
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    out = []
    for i in range(n):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        h, w = (4, 6) if i % 3 else (6, 4)
        out.append({
            "key": f"k{i:04d}",
            "latent": torch.randn(16, h, w, generator=g).to(dtype),
            "text_states": torch.randn(7, 12, generator=g).to(dtype),
            "pooled": torch.randn(10, generator=g),
            "bucket": (8 * h, 8 * w),
            "caption": f"caption {i} ünïcode",
        })
    return out


def test_latent_shards_round_trip_exact(tmp_path):
    samples = _latent_samples(5, np.random.default_rng(5))
    stats = write_latent_shards(iter(samples), tmp_path / "lat", shard_size=2)
    assert stats.counts == (2, 2, 1)
    assert json.loads((tmp_path / "lat" / "index.json").read_text())["kind"] == "latent"
    got = list(read_latent_shards(tmp_path / "lat"))
    assert [s["key"] for s in got] == [s["key"] for s in samples]
    for a, b in zip(samples, got):
        for name in ("latent", "text_states", "pooled"):
            assert b[name].dtype == a[name].dtype and torch.equal(b[name], a[name])
        assert b["bucket"] == a["bucket"] and b["caption"] == a["caption"]
    report = validate_shards(tmp_path / "lat")
    assert report.kind == "latent" and report.total_ok == 5 and report.total_bad == 0 and not report.problems


def test_latent_writer_rejects_bad_samples(tmp_path):
    s = _latent_samples(1, np.random.default_rng(6))[0]
    with pytest.raises(ValueError, match=r"sample 0 \(key k0000\): latent must be a 3-D tensor, got \(6, 4\)"):
        write_latent_shards([{**s, "latent": s["latent"][0]}], tmp_path / "x", 2)
    with pytest.raises(ValueError, match="key 'a.b'"):
        write_latent_shards([{**s, "key": "a.b"}], tmp_path / "y", 2)


def _key_shards(tmp_path, n_shards, per_shard):
    d = tmp_path / "keys"
    samples = ({"key": f"s{i:03d}", "latent": torch.randn(2, 2, 2), "text_states": torch.randn(1, 2),
                "pooled": torch.randn(2), "bucket": (16, 16), "caption": "c"} for i in range(n_shards * per_shard))
    write_latent_shards(samples, d, per_shard)
    return d


def test_ranks_get_disjoint_shards_and_too_few_shards_errors(tmp_path):
    d = _key_shards(tmp_path, 4, 3)
    seen = [[s["key"] for s in ShardReader(d, kind="latent", rank=r, world_size=2, shuffle_buffer=4, seed=9)]
            for r in range(2)]
    assert not set(seen[0]) & set(seen[1]) and len(seen[0]) == len(seen[1]) == 6
    assert sorted(seen[0] + seen[1]) == [f"s{i:03d}" for i in range(12)]
    reader = ShardReader(d, kind="latent", rank=0, world_size=2, shuffle_buffer=4, seed=9)
    assert [s["key"] for s in reader] == seen[0]  # deterministic given (seed, epoch)
    reader.set_epoch(1)
    assert [s["key"] for s in reader] != seen[0]  # a new epoch reshuffles
    with pytest.raises(ShardError, match=r"4 shards .* < 3 ranks x 2 workers"):
        ShardReader(d, kind="latent", rank=0, world_size=3, num_workers=2)


def test_resampling_is_infinite_and_covers_few_shards(tmp_path):
    d = _key_shards(tmp_path, 2, 3)
    streams = [ShardReader(d, kind="latent", rank=r, world_size=4, resample=True, seed=1) for r in range(4)]
    firsts = [[s["key"] for s in itertools.islice(iter(st), 20)] for st in streams]
    assert all(len(f) == 20 for f in firsts)  # 2 shards, 4 ranks: no hang, every rank keeps going
    again = [s["key"] for s in itertools.islice(iter(ShardReader(d, kind="latent", rank=0, world_size=4,
                                                                    resample=True, seed=1)), 20)]
    assert again == firsts[0]


def test_dataloader_workers_split_shards(tmp_path):
    d = _key_shards(tmp_path, 4, 2)
    reader = ShardReader(d, kind="latent", num_workers=2)
    loader = torch.utils.data.DataLoader(reader, batch_size=None, num_workers=2)
    assert sorted(s["key"] for s in loader) == [f"s{i:03d}" for i in range(8)]
    wrong = torch.utils.data.DataLoader(ShardReader(d, kind="latent", num_workers=3), batch_size=None, num_workers=2)
    with pytest.raises(ShardError, match="declared num_workers=3"):
        list(wrong)


def test_list_shards_accepts_patterns(tmp_path):
    d = _key_shards(tmp_path, 3, 1)
    assert list_shards(str(d / "shard-{000000..000002}.tar")) == list_shards(d)
    with pytest.raises(ShardError, match="1 of 4 shards .* missing"):
        list_shards(str(d / "shard-{000000..000003}.tar"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match="no shards"):
        list_shards(tmp_path / "empty")
    (d / "shard-000001.tar").unlink()
    assert "shard-000001.tar: listed in index.json but missing" in validate_shards(d).problems
