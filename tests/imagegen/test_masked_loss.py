"""Masked loss (`data.mask`): the weighted flow loss against a reference, masks through the shards and the cache, and
a masked run through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from atelier_studio.data.masks import mask_weights
from atelier_studio.data.shards import ShardReader, read_latent_shards, write_image_shards
from atelier_studio.flows.cli import main
from atelier_studio.imagegen.cache import CACHE_META, cache_latents
from atelier_studio.imagegen.config import ImagegenConfig
from atelier_studio.imagegen.flow import FlowArgs, flow_loss, loss_weight
from atelier_studio.pipeline.config import load_config

from tests.imagegen._world import DEMO, build_world, cli_args, config_overrides
from tests.kernels._compare import assert_within_rounding


def masked_loss_ref(pred, x0, noise, t, args, mask) -> torch.Tensor:
    """sum(m * err) / (C * sum(m)) per sample, element by element in float64."""
    out = []
    for b in range(pred.shape[0]):
        num, den = 0.0, 0.0
        for c in range(pred.shape[1]):
            for i in range(pred.shape[2]):
                for j in range(pred.shape[3]):
                    m = float(mask[b, i, j])
                    v = float(noise[b, c, i, j]) - float(x0[b, c, i, j])
                    num += m * (float(pred[b, c, i, j]) - v) ** 2
                    den += m
        out.append(num / den)
    return torch.tensor(out, dtype=torch.float64) * loss_weight(t, args).double()


def draws(seed: int = 0, shape=(3, 4, 5, 6)):
    g = torch.Generator().manual_seed(seed)
    pred, x0, noise = (torch.randn(shape, generator=g) for _ in range(3))
    t = torch.rand(shape[0], generator=g)
    return pred, x0, noise, t


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt"])
def test_masked_loss_matches_the_reference(weighting):
    pred, x0, noise, t = draws()
    args = FlowArgs(loss_weighting=weighting)
    mask = torch.rand(3, 5, 6, generator=torch.Generator().manual_seed(1))
    mask[0, :2] = 0.0  # a region the loss must not see
    got = flow_loss(pred, x0, noise, t, args, mask)
    assert_within_rounding(got, masked_loss_ref(pred, x0, noise, t, args, mask), "masked loss", torch.float32, 4 * 30)


def test_an_all_ones_mask_is_the_unmasked_loss():
    pred, x0, noise, t = draws(2)
    args = FlowArgs()
    plain = flow_loss(pred, x0, noise, t, args)
    ones = flow_loss(pred, x0, noise, t, args, torch.ones(3, 5, 6))
    # the same sum of C*H*W = 120 squares, divided by the same count (a mean vs a sum over the mask's ones)
    assert_within_rounding(ones, plain, "all-ones mask", torch.float32, 120)


def test_masked_positions_get_no_gradient_and_each_image_one_unit():
    pred, x0, noise, t = draws(3)
    pred.requires_grad_(True)
    mask = torch.ones(3, 5, 6)
    mask[:, :, :3] = 0.0  # the left half is background
    loss = flow_loss(pred, x0, noise, t, FlowArgs(), mask)
    loss.sum().backward()
    assert (pred.grad[..., :3] == 0).all() and (pred.grad[..., 3:] != 0).all()
    # per-sample normalisation: the masked loss is the plain loss of the unmasked half alone
    half = flow_loss(pred.detach()[..., 3:], x0[..., 3:], noise[..., 3:], t, FlowArgs())
    assert_within_rounding(loss.detach(), half, "masked = crop", torch.float32, 60)


def test_mask_weights_follow_the_images_geometry():
    """A 40x20 mask (left half transparent) fitted to a 16x32 bucket (resized to 32x16, as its image would be) and
    averaged over 2x2 boxes: 0 on the left, 1 on the right, the columns at the boundary in between (the resize is
    bicubic and antialiased: it blurs the edge by a pixel or two)."""
    a = np.zeros((20, 40), dtype=np.uint8)
    a[:, 20:] = 255
    w = mask_weights(Image.fromarray(a, mode="L"), (16, 32), 2)  # bucket H=16, W=32: scale 0.8 -> 32x16
    assert w.shape == (8, 16)
    assert (w[:, :7] == 0).all() and (w[:, 9:] == 1).all()
    assert ((w >= 0) & (w <= 1)).all()


# ---------------------------------------------------------------------------------------------- through the cache


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.getbasetemp() / "imagegen-world")


@pytest.fixture(scope="module")
def masked(world, tmp_path_factory) -> Path:
    """16 RGBA images 32x32 (a subject on a transparent background) with the same masks as sidecars, in image
    shards, cached with data.mask = alpha and = sidecar."""
    d = tmp_path_factory.mktemp("masked")
    rng = np.random.default_rng(0)
    rows = []
    for i in range(16):
        rgba = np.zeros((32, 32, 4), dtype=np.uint8)
        rgba[..., :3] = rng.integers(0, 256, 3, dtype=np.uint8)
        top, left = rng.integers(0, 16, 2)
        rgba[top:top + 16, left:left + 16, 3] = 255  # the subject: a 16x16 opaque square
        Image.fromarray(rgba, mode="RGBA").save(d / f"img{i}.png")
        Image.fromarray(rgba[..., 3], mode="L").save(d / f"img{i}.mask.png")
        rows.append(json.dumps({"image": f"img{i}.png", "caption": f"a square number {i}"}))
    (d / "captions.jsonl").write_text("\n".join(rows) + "\n")
    write_image_shards(d, d / "captions.jsonl", d / "shards", 8, progress=False)
    for mode in ("alpha", "sidecar"):
        cfg = load_config(ImagegenConfig, DEMO, config_overrides(world) + [
            f"data.image_shards={d / 'shards'}", "data.eval_image_shards=", f"data.mask={mode}"])
        cache_latents(cfg, d / f"latents-{mode}", shard_size=8)
    return d


def test_the_cache_stores_each_images_mask_at_latent_resolution(masked):
    images = {s["key"]: s for s in ShardReader(masked / "shards")}
    for mode in ("alpha", "sidecar"):
        assert json.loads((masked / f"latents-{mode}" / CACHE_META).read_text())["mask"] == mode
        cached = list(read_latent_shards(masked / f"latents-{mode}"))
        assert len(cached) == 16
        for s in cached:
            img = images[s["key"]]
            source = img["alpha"] if mode == "alpha" else img["mask"]
            want = mask_weights(source, tuple(s["bucket"]), 2)
            assert s["mask"].shape == s["latent"].shape[1:] and torch.equal(s["mask"], want), (mode, s["key"])
            assert s["mask"].sum() == 64  # the 16x16 subject is 8x8 latent positions of weight 1


def test_a_masked_run_trains_and_a_cache_without_masks_is_named(world, masked, tmp_path, capsys):
    common = [f"data.shards={masked / 'latents-alpha'}", "data.eval_shards=", "data.mask=alpha",
              "train.max_steps=3", "train.micro_batch=4", "train.warmup_steps=0"]
    assert main(cli_args(world, tmp_path / "run", *common)) == 0
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    assert len(losses) == 3 and all(np.isfinite(losses))
    # the same latents and draws unmasked: the first step's loss (same weights) is another number
    assert main(cli_args(world, tmp_path / "plain", *common[:-4], "data.mask=none", *common[-3:])) == 0
    plain = json.loads((tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()[0])
    assert plain["kind"] == "train" and plain["step"] == 1 and plain["loss"] != losses[0]
    capsys.readouterr()
    unmasked = cli_args(world, tmp_path / "unmasked", "data.mask=alpha", "train.max_steps=1", "train.warmup_steps=0")
    assert main(unmasked) == 2
    assert "data.mask: 'alpha', but the latents of" in capsys.readouterr().err


def test_sidecar_mode_needs_every_sidecar(world, tmp_path):
    d = tmp_path / "imgs"
    d.mkdir()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(d / "a.png")
    (d / "c.jsonl").write_text(json.dumps({"image": "a.png", "caption": "red"}) + "\n")
    write_image_shards(d, d / "c.jsonl", d / "shards", 8, progress=False)
    cfg = load_config(ImagegenConfig, DEMO, config_overrides(world) + [
        f"data.image_shards={d / 'shards'}", "data.eval_image_shards=", "data.mask=sidecar"])
    with pytest.raises(Exception, match=r"has no mask\.png sidecar mask"):
        cache_latents(cfg, d / "latents", shard_size=8)
