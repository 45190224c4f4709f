"""Multi-resolution imagegen (`data.resolutions`): the config's checks, the cache writing every resolution, and a
two-resolution run through the CLI that evaluates and samples at each and resumes bit-exactly after kill -9."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from atelier_studio.data.buckets import bucket_pixels, nearest_bucket
from atelier_studio.data.shards import ShardReader, read_latent_shards, write_image_shards
from atelier_studio.flows.cli import main
from atelier_studio.imagegen.autoencoder import PixelCodec
from atelier_studio.imagegen.cache import CACHE_META, cache_buckets, cache_latents
from atelier_studio.imagegen.config import ImagegenConfig
from atelier_studio.imagegen.text import TextEncoder
from atelier_studio.pipeline.config import ConfigError, load_config

from tests.imagegen._world import DEMO, build_world, cli_args, config_overrides
from tests.imagegen.test_task import kill_after_checkpoint, records, train_losses

TWO = ["data.resolution=0", "data.resolutions=[16,32]"]  # the demo config sets data.resolution = 32


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The shared test world, plus its images cached at 16 and 32 px into latents-multi/r16, r32 (and eval/)."""
    base = build_world(tmp_path_factory.getbasetemp() / "imagegen-world")
    out = base / "latents-multi"
    if not (out / "eval" / "r32" / CACHE_META).is_file():
        cache_latents(_cfg(base, *TWO), out, shard_size=40)
    return base


def _cfg(world: Path, *extra: str) -> ImagegenConfig:
    return load_config(ImagegenConfig, DEMO, config_overrides(world) + list(extra))


def _multi_args(world: Path, out: Path, *extra: str) -> list[str]:
    return cli_args(world, out, *TWO, f"data.shards={world / 'latents-multi'}",
                    f"data.eval_shards={world / 'latents-multi' / 'eval'}", *extra)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("sets, message", [
    (["data.resolutions=[16,32]"], r"^data\.resolution \(32\) and resolutions \(\[16, 32\]\): set one of them"),
    (["data.resolution=0"], r"^data\.resolution: required, a positive pixel size \(or resolutions"),
    (["data.resolution=0", "data.resolutions=[16,32,16]"], r"^data\.resolutions: 16 is listed twice"),
    (["data.resolution=0", "data.resolutions=[16,0]"], r"^data\.resolutions: every entry must be a positive"),
    (["data.resolution=0", "data.resolutions=[16,32]", "data.resolution_weights=[1]"],
     r"^data\.resolution_weights: 1 weights for 2 resolutions \[16, 32\]; give one per resolution"),
    (["data.resolution=0", "data.resolutions=[16,32]", "data.resolution_weights=[1,0]"],
     r"^data\.resolution_weights: every weight must be a finite number > 0"),
    (["data.resolution_weights=[1]"], r"^data\.resolution_weights: needs resolutions"),
])
def test_bad_resolution_settings_name_the_key(world, sets, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(world, *sets)


def test_existing_single_resolution_config_is_unchanged(world):
    cfg = _cfg(world)
    assert (cfg.data.resolution, cfg.data.resolutions, cfg.data.all_resolutions, cfg.data.multires) == \
        (32, (), (32,), False)
    assert cfg.data.latent_sources("x") == {32: "x"}
    assert _cfg(world, *TWO).data.latent_sources("x") == {16: str(Path("x/r16")), 32: str(Path("x/r32"))}


def test_resolution_off_the_patch_grid_is_one_line_exit_2(world, tmp_path, capsys):
    """pixel:2 x patch 2: sides must be multiples of 4; the run stops before any step, naming key and fix."""
    code = main(_multi_args(world, tmp_path / "run", "data.resolutions=[16,30]", "train.max_steps=1",
                          "train.warmup_steps=0"))
    err = capsys.readouterr().err
    assert code == 2, err
    line = [x for x in err.splitlines() if x.startswith("atelier: error:")]
    assert line == ["atelier: error: data.resolutions: 30 is not a multiple of 4 (the autoencoder's factor 2 x the "
                    "MMDiT's patch 2); use 28 or 32"], err
    assert "Traceback" not in err
    with pytest.raises(ConfigError, match=r"^data\.resolution: 18 is not a multiple of 4"):
        cache_buckets(_cfg(world, "data.resolution=18"), 2, 2)


# ----------------------------------------------------------------------------- the cache


def test_cache_writes_every_image_at_every_resolution(world):
    images = {s["key"]: s for s in ShardReader(world / "shards")}
    codec = PixelCodec(2)
    for r in (16, 32):
        d = world / "latents-multi" / f"r{r}"
        meta = json.loads((d / CACHE_META).read_text())
        assert meta["resolution"] == r and meta["samples"] == len(images)
        cached = {s["key"]: s for s in read_latent_shards(d)}
        assert sorted(cached) == sorted(images)  # every image, at this resolution
        for key in sorted(images)[:4]:
            want = codec.encode(bucket_pixels(images[key]["image"], (r, r))[None])[0]
            torch.testing.assert_close(cached[key]["latent"], want, rtol=0, atol=0)
            assert tuple(cached[key]["bucket"]) == (r, r) and cached[key]["caption"] == images[key]["caption"]
        assert json.loads((world / "latents-multi" / "eval" / f"r{r}" / CACHE_META).read_text())["resolution"] == r


def test_cache_buckets_each_aspect_under_each_resolution(world, tmp_path, monkeypatch):
    """Wide, tall and square images land in their own aspect bucket of each resolution, in one pass that encodes
    each caption once (not once per resolution)."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    sizes = {"wide": (64, 32), "tall": (32, 64), "square": (40, 40)}  # (width, height)
    lines = []
    for name, wh in sizes.items():
        Image.new("RGB", wh, (200, 40, 90)).save(folder / f"{name}.png")
        lines.append(json.dumps({"image": f"{name}.png", "caption": f"a {name} image"}))
    (tmp_path / "captions.jsonl").write_text("\n".join(lines) + "\n")
    write_image_shards(folder, tmp_path / "captions.jsonl", tmp_path / "shards", 10, progress=False)
    cfg = _cfg(world, *TWO, f"data.image_shards={tmp_path / 'shards'}", "data.eval_image_shards=",
               "data.cache_batch=2")
    encoded: list[str] = []
    encode = TextEncoder.encode

    def counting(self, captions):
        encoded.extend(captions)
        return encode(self, captions)

    monkeypatch.setattr(TextEncoder, "encode", counting)
    cache_latents(cfg, tmp_path / "lat", shard_size=10)
    assert sorted(encoded) == sorted(f"a {name} image" for name in sizes)  # each caption once
    wide = set()
    for r in (16, 32):
        buckets = cache_buckets(cfg, 2, 2, r)  # this resolution's aspect buckets (area <= r²)
        got = {s["caption"]: tuple(s["bucket"]) for s in read_latent_shards(tmp_path / "lat" / f"r{r}")}
        for name, (w, h) in sizes.items():
            assert got[f"a {name} image"] == buckets[nearest_bucket(h, w, buckets)], (r, name, got)
        (h, w), (th, tw) = got["a wide image"], got["a tall image"]
        assert w > h and th > tw and got["a square image"] == (r, r), got
        wide.add((h, w))
    assert len(wide) == 2  # each resolution its own wide bucket


# ----------------------------------------------------------------------------- training through the CLI


def test_two_resolutions_train_evaluate_sample_and_resume_exactly_after_kill(world, tmp_path, capsys):
    common = ["train.max_steps=24", "train.save_every=8", "train.eval_every=12", "sample.every=12", "sample.steps=2",
              "text.caption_dropout=0.3", "ema.decay=0.9", "train.micro_batch=4"]
    ref = tmp_path / "ref"
    assert main(_multi_args(world, ref, *common)) == 0
    assert "at 16 px (50% of batches), 32 px (50% of batches)" in capsys.readouterr().out  # as many images at each
    last = records(ref, "eval")[-1]
    assert {"loss", "loss_16px", "loss_32px", "ema_loss_16px", "ema_loss_32px"} <= set(last), last
    assert min(last["loss_16px"], last["loss_32px"]) <= last["loss"] <= max(last["loss_16px"], last["loss_32px"])
    grid = Image.open(ref / "samples" / "step-24.png")
    assert grid.size[1] > 16 + 32 and json.loads((ref / "imagegen.json").read_text())["resolution"] == 32

    out = tmp_path / "killed"
    kill_after_checkpoint(_multi_args(world, out, *common), out, step=8, max_steps=24)
    assert main(_multi_args(world, out, *common)) == 0
    assert train_losses(out) == train_losses(ref)
    assert records(out, "eval")[-1] == last
    for name in ("transformer", "ema"):
        a = load_file(ref / name / "diffusion_pytorch_model.safetensors")
        b = load_file(out / name / "diffusion_pytorch_model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_image_shards_as_training_data_are_cached_at_each_resolution_first(world, tmp_path):
    """data.shards holding images (a small run): the task encodes them once per resolution into
    <output.dir>/cache/train/r<px> and trains on those."""
    out = tmp_path / "run"
    assert main(cli_args(world, out, *TWO, f"data.shards={world / 'shards'}", "data.eval_shards=",
                         "train.max_steps=2", "train.warmup_steps=0")) == 0
    for r in (16, 32):
        meta = json.loads((out / "cache" / "train" / f"r{r}" / CACHE_META).read_text())
        assert meta["resolution"] == r and meta["samples"] > 100
    assert len(train_losses(out)) == 2
