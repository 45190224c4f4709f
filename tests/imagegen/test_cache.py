"""`atelier imagegen cache`: latents and text states equal the encoders run by hand; bad samples; rank slices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import webdataset as wds

from atelier_studio.data.buckets import LatentDataset, bucket_pixels
from atelier_studio.data.shards import ShardError, ShardReader, read_latent_shards
from atelier_studio.imagegen.autoencoder import PixelCodec
from atelier_studio.imagegen.cache import CACHE_META, cache_latents
from atelier_studio.imagegen.config import ImagegenConfig
from atelier_studio.imagegen.text import TextEncoder
from atelier_studio.pipeline.config import load_config

from tests.imagegen._world import DEMO, build_world, config_overrides


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.getbasetemp() / "imagegen-world")


def _cfg(world: Path, *extra: str) -> ImagegenConfig:
    return load_config(ImagegenConfig, DEMO, config_overrides(world) + list(extra))


def test_cached_latents_equal_the_encoders_by_hand(world):
    cached = {s["key"]: s for s in read_latent_shards(world / "latents")}
    images = {s["key"]: s for s in ShardReader(world / "shards")}
    assert sorted(cached) == sorted(images)  # every image, once
    meta = json.loads((world / "latents" / CACHE_META).read_text())
    assert meta["samples"] == len(images) and meta["bad"] == 0 and meta["latent_channels"] == 12
    text = TextEncoder(None, "encoder", max_length=24)
    codec = PixelCodec(2)
    for key in sorted(images)[:5]:
        img = images[key]
        c = cached[key]
        want = codec.encode(bucket_pixels(img["image"], (32, 32))[None])[0]
        torch.testing.assert_close(c["latent"], want, rtol=0, atol=0)  # exact: the same codec on the same pixels
        states, pooled, _ = text.encode([img["caption"]])
        torch.testing.assert_close(c["text_states"], states[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c["pooled"], pooled[0], rtol=1e-5, atol=1e-5)
        assert c["caption"] == img["caption"] and tuple(c["bucket"]) == (32, 32)
    assert len(LatentDataset(world / "latents" / "eval")) == len(list(ShardReader(world / "shards-eval")))


def _shard_with_a_corrupt_image(src: Path, out: Path) -> None:
    """Copy the first image shard's samples into a new shard and break one image's bytes."""
    out.mkdir()
    with wds.TarWriter(str(out / "shard-000000.tar"), encoder=False) as w:
        for i, s in enumerate(wds.WebDataset(str(src / "shard-000000.tar"), shardshuffle=False)):
            sample = {k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"}
            if i == 3:
                sample["png"] = b"\x89PNG not really"
            w.write(sample)


def test_bad_samples_are_skipped_counted_and_capped(world, tmp_path):
    _shard_with_a_corrupt_image(world / "shards", tmp_path / "bad")
    cfg = _cfg(world, f"data.image_shards={tmp_path / 'bad'}", "data.eval_image_shards=", "data.max_bad_fraction=0.1")
    cache_latents(cfg, tmp_path / "lat", shard_size=100)
    meta = json.loads((tmp_path / "lat" / CACHE_META).read_text())
    assert meta["bad"] == 1 and meta["bad_by_reason"] == {"undecodable image": 1}
    assert meta["samples"] == 51
    cfg = _cfg(world, f"data.image_shards={tmp_path / 'bad'}", "data.eval_image_shards=", "data.max_bad_fraction=0.0")
    with pytest.raises(ShardError, match="shard-000000.tar"):
        cache_latents(cfg, tmp_path / "lat0", shard_size=100)


def test_each_rank_writes_its_own_slice_and_the_last_merges(world, tmp_path, monkeypatch):
    cfg = _cfg(world, "data.eval_image_shards=")
    out = tmp_path / "lat"
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        cache_latents(cfg, out, shard_size=1000)
        if rank == 1:
            assert not (out / "index.json").exists()  # rank 0 has not finished yet
    keys = [{s["key"] for s in read_latent_shards(out / f"rank-{r:05d}")} for r in (0, 1)]
    assert keys[0] and keys[1] and not keys[0] & keys[1]  # disjoint slices
    merged = LatentDataset(out)
    assert {s["key"] for s in merged.samples} == keys[0] | keys[1] == {s["key"] for s in ShardReader(world / "shards")}
    # resume: a complete rank directory is skipped, not rewritten
    before = (out / "rank-00000" / "shard-000000.tar").stat().st_mtime_ns
    monkeypatch.setenv("RANK", "0")
    cache_latents(cfg, out, shard_size=1000)
    assert (out / "rank-00000" / "shard-000000.tar").stat().st_mtime_ns == before


def test_cache_without_image_shards_is_named(world, tmp_path):
    from atelier_studio.pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="data.image_shards"):
        cache_latents(_cfg(world, "data.image_shards="), tmp_path / "x")
