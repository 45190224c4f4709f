"""Sampling: `sample_images` equals a hand-written Euler + CFG loop; `sample_to_dir` writes PNGs, grid, index."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from atelier_studio.imagegen.autoencoder import PixelCodec
from atelier_studio.imagegen.flow import FlowArgs, sampler_sigmas
from atelier_studio.imagegen.hf import init_random, load_pretrained
from atelier_studio.imagegen.sample import RUN_META, sample_images, sample_to_dir, to_pil, write_run_meta
from atelier_studio.imagegen.text import TextEncoder

from tests.imagegen._world import MODEL_OVERRIDES

CAPTIONS = ["a small blue circle in the upper left on a pale yellow background", "a large red square in the center",
            "a green triangle at the bottom right"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random tiny MMDiT whose output is non-zero (AdaLN-Zero init would make every sample pure noise)."""
    d = tmp_path_factory.mktemp("sample")
    init_random("tiny", d / "run" / "ema", seed=1, dtype=torch.float32, **MODEL_OVERRIDES)
    model = load_pretrained(d / "run" / "ema")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    from atelier_studio.imagegen.hf import save_pretrained

    save_pretrained(model, d / "run" / "ema")
    text = TextEncoder(None, "encoder", max_length=24)
    return d, model, text


def _euler_cfg_ref(model, text, codec, captions, size, steps, guidance, seed, shift):
    """The sampler by hand: the same noise, sigmas and CFG formula, one caption at a time."""
    noise = torch.randn(len(captions), 12, size // 2, size // 2, generator=torch.Generator().manual_seed(seed))
    sig = sampler_sigmas(steps, shift)
    es, ep = text.encode([""])[:2]
    out = []
    for i, c in enumerate(captions):
        s, p = text.encode([c])[:2]
        x = noise[i:i + 1]
        for k in range(steps):
            ts = torch.full((1,), float(sig[k] * 1000))
            v_u, v_c = model(x, es, ep, ts), model(x, s, p, ts)
            x = x + (sig[k + 1] - sig[k]) * (v_u + guidance * (v_c - v_u))
        out.append(codec.decode(x))
    return to_pil(torch.cat(out))


def test_sample_images_equals_the_reference_loop(setup):
    _, model, text = setup
    codec = PixelCodec(2)
    with torch.no_grad():
        want = _euler_cfg_ref(model, text, codec, CAPTIONS, 32, 3, 3.0, 7, 2.0)
    got = sample_images(model, text, codec, CAPTIONS, 32, steps=3, guidance=3.0, seed=7, flow=FlowArgs(shift=2.0),
                        batch_size=2)
    for a, b in zip(got, want):
        assert a.size == (32, 32)
        assert np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max() <= 1  # uint8 rounding
    other = sample_images(model, text, codec, CAPTIONS, 32, steps=3, guidance=3.0, seed=8, flow=FlowArgs(shift=2.0))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, other))  # the seed matters


def test_sample_to_dir_from_an_export(setup, tmp_path):
    d, _, _ = setup
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.pipeline.config import load_config

    from tests.imagegen._world import DEMO

    cfg = load_config(ImagegenConfig, DEMO, ["model.path=x", "data.shards=x"])
    write_run_meta(d / "run", cfg)
    captions = tmp_path / "captions.txt"
    captions.write_text("\n".join(CAPTIONS) + "\n\n")
    paths = sample_to_dir(d / "run" / "ema", captions, tmp_path / "out", steps=2, guidance=2.0, seed=0)
    assert [p.name for p in paths] == ["00000.png", "00001.png", "00002.png"]
    index = [json.loads(line) for line in (tmp_path / "out" / "index.jsonl").read_text().splitlines()]
    assert [r["caption"] for r in index] == CAPTIONS and index[0]["image"] == "00000.png"
    assert (tmp_path / "out" / "grid.png").is_file()
    again = sample_to_dir(d / "run" / "ema", captions, tmp_path / "out2", steps=2, guidance=2.0, seed=0)
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(paths, again))  # deterministic


def test_sample_to_dir_without_metadata_is_named(setup, tmp_path):
    d, _, _ = setup
    init_random("tiny", tmp_path / "lone", dtype=torch.float32, **MODEL_OVERRIDES)
    captions = tmp_path / "c.txt"
    captions.write_text("a red square\n")
    with pytest.raises(FileNotFoundError, match=RUN_META):
        sample_to_dir(tmp_path / "lone", captions, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="captions file"):
        sample_to_dir(d / "run" / "ema", tmp_path / "missing.txt", tmp_path / "out")


def test_sample_to_dir_with_the_run_config(setup, tmp_path):
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.pipeline.config import load_config, save_config

    from tests.imagegen._world import DEMO

    d, _, _ = setup
    cfg = load_config(ImagegenConfig, DEMO, ["model.path=x", "data.shards=x"])
    save_config(cfg, tmp_path / "config.toml")
    write_run_meta(d / "run", cfg)
    captions = tmp_path / "c.txt"
    captions.write_text(CAPTIONS[0] + "\n")
    via_meta = sample_to_dir(d / "run" / "ema", captions, tmp_path / "a", steps=2, guidance=2.0, seed=0)
    via_cfg = sample_to_dir(d / "run" / "ema", captions, tmp_path / "b", steps=2, guidance=2.0, seed=0,
                            config_path=str(tmp_path / "config.toml"))
    assert via_meta[0].read_bytes() == via_cfg[0].read_bytes()
