"""Released SD3 / SD3.5 pipelines in and out, through the CLI: a tiny random SD3 pipeline directory and an SD3.5-style
one (MMDiT-X dual attention, QK RMSNorm) go through `imagegen cache` -> `imagegen train` -> the exported pipeline/
loaded by `StableDiffusion3Pipeline.from_pretrained` -> rendered; it renders what `atelier imagegen sample` renders.

Tolerances (fp32 on the CPU):
- cached states, pooled vectors and latents against encode_prompt / the VAE run one caption or image at a time:
  the same modules on the same inputs, but the cache batches captions and images by bucket, and a matmul or conv
  of another batch size may round differently: a few ulp of values ~1, 1e-5 relative + 1e-6 absolute for the
  text (a few layers), 1e-5 absolute for the latents (the VAE encoder's deeper conv stack);
- sampled latents: Atelier's MMDiT and diffusers' SD3Transformer2DModel agree to 1e-5 relative per forward
  (tests/imagegen/test_model.py); 3 Euler steps with CFG 4 (the difference of the two branches is scaled by 4)
  keep that under 1e-4 relative;
- rendered PNGs: the same latents through the same VAE, quantised to 8 bits by two formulas ((x + 1) * 127.5 here,
  (x / 2 + 0.5) * 255 in diffusers): a value on a rounding boundary may land one level apart, never more.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from atelier_studio.data.buckets import bucket_pixels
from atelier_studio.data.shards import ShardReader, read_latent_shards
from atelier_studio.flows.cli import main
from atelier_studio.imagegen.cache import CACHE_META

from tests.imagegen._sd3 import (
    MAX_SEQUENCE_LENGTH,
    POOLED,
    RESOLUTION,
    T5_WIDTH,
    build_pipeline,
    build_shards,
    config_overrides,
    load_pipeline,
)
from tests.imagegen._sd3 import SD3_CONFIG as CONFIG

PROMPTS = ["a small blue circle in the upper left on a pale yellow background", "a large red square in the center"]
STEPS, GUIDANCE, SEED = 3, 4.0, 5


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return build_shards(tmp_path_factory.getbasetemp() / "sd3-world")


def sets(pipe: Path, shards: Path, latents: Path, out: Path, *extra: str) -> list[str]:
    """--set arguments: the shipped SD3 config pointed at the tiny pipeline (tests/imagegen/_sd3.py)."""
    return [a for item in config_overrides(pipe, shards, latents, out, *extra) for a in ("--set", item)]


def run_cli(*args: str) -> None:
    code = main(list(args))
    assert code == 0


@pytest.fixture(scope="module")
def cached(tmp_path_factory, shards) -> tuple[Path, Path]:
    """(the tiny SD3 pipeline, its latents cached through the CLI)."""
    pipe_dir = build_pipeline(tmp_path_factory.getbasetemp() / "sd3-pipe")
    latents = tmp_path_factory.mktemp("sd3-cache") / "latents"
    run_cli("imagegen", "cache", "--config", str(CONFIG), "--out", str(latents),
            *sets(pipe_dir, shards, latents, latents.parent / "unused"))
    return pipe_dir, latents


def test_cache_stores_encode_prompt_states_and_vae_latents(cached, shards):
    pipe_dir, latents = cached
    meta = json.loads((latents / CACHE_META).read_text())
    assert (meta["scaling_factor"], meta["shift_factor"]) == (1.5305, 0.0609)  # from vae/config.json
    assert meta["text_kind"] == "sd3" and meta["text_tokens"] == 77 + MAX_SEQUENCE_LENGTH
    assert (meta["states_width"], meta["pooled_width"]) == (T5_WIDTH, POOLED)
    pipe = load_pipeline(pipe_dir)
    images = {s["key"]: s for s in ShardReader(shards)}
    cached = list(read_latent_shards(latents))
    assert sorted(s["key"] for s in cached) == sorted(images)
    for s in cached[:6]:
        with torch.no_grad():
            states, _, pooled, _ = pipe.encode_prompt(s["caption"], None, None, device="cpu",
                                                      do_classifier_free_guidance=False,
                                                      max_sequence_length=MAX_SEQUENCE_LENGTH)
            pixels = bucket_pixels(images[s["key"]]["image"], tuple(s["bucket"]))[None]
            z = pipe.vae.encode(pixels).latent_dist.mode()
        torch.testing.assert_close(s["text_states"], states[0], rtol=1e-5, atol=1e-6)  # batch of 4 vs 1
        torch.testing.assert_close(s["pooled"], pooled[0], rtol=1e-5, atol=1e-6)
        # the VAE encoder's ~20 conv / norm layers at another batch size: ~1e-6 apart on latents of unit scale
        torch.testing.assert_close(s["latent"], ((z - 0.0609) * 1.5305)[0], rtol=1e-5, atol=1e-5)


def test_training_on_a_cache_of_other_settings_is_refused(cached, shards, tmp_path, capsys):
    pipe_dir, latents = cached
    code = main(["imagegen", "train", "--config", str(CONFIG),
                 *sets(pipe_dir, shards, latents, tmp_path / "run", "text.clip_skip=1")])
    err = capsys.readouterr().err
    assert code == 2 and "clip_skip 0" in err and "text.clip_skip gives 1" in err and "imagegen cache" in err
    assert not (tmp_path / "run" / "config.toml").exists()


def _pipeline_render(pipe_dir: Path, output_type: str):
    pipe = load_pipeline(pipe_dir)
    out = pipe(PROMPTS, height=RESOLUTION, width=RESOLUTION, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
               max_sequence_length=MAX_SEQUENCE_LENGTH, generator=torch.Generator().manual_seed(SEED),
               output_type=output_type)
    return out.images


@pytest.mark.parametrize("variant", ["sd3", "sd3.5"])
def test_cache_train_export_and_render_through_the_cli(variant, tmp_path, shards):
    from safetensors.torch import load_file

    from atelier_studio.imagegen.autoencoder import SD3VAE
    from atelier_studio.imagegen.flow import FlowArgs
    from atelier_studio.imagegen.hf import load_pretrained, read_args
    from atelier_studio.imagegen.sample import sample_latents, text_encoder_from_meta

    pipe_dir = build_pipeline(tmp_path / "base", sd35=variant == "sd3.5", seed=11)
    if variant == "sd3.5":
        args = read_args(pipe_dir)
        assert args.dual_attention_layers == (0,) and args.qk_norm == "rms_norm"  # MMDiT-X in the trained model
    latents, run = tmp_path / "latents", tmp_path / "run"
    grid = ("sample.every=3", "sample.steps=2") if variant == "sd3.5" else ()  # the training sample grid, once
    common = sets(pipe_dir, shards, latents, run, *grid)
    run_cli("imagegen", "cache", "--config", str(CONFIG), "--out", str(latents), *common)
    run_cli("imagegen", "train", "--config", str(CONFIG), *common)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 3 and np.isfinite(summary["final_loss"])
    if grid:
        assert Image.open(run / "samples" / "step-3.png").size[1] == RESOLUTION + 4  # one row of 2 prompts, padded

    exported = run / "pipeline"
    index = json.loads((exported / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline" and index["text_encoder_3"] == ["transformers",
                                                                                             "T5EncoderModel"]
    # the pipeline holds the EMA weights, bit for bit; they moved away from the base's
    got = load_file(exported / "transformer" / "diffusion_pytorch_model.safetensors")
    ema = load_file(run / "ema" / "diffusion_pytorch_model.safetensors")
    base = load_file(pipe_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert got.keys() == ema.keys() == base.keys() and all(torch.equal(got[k], ema[k]) for k in got)
    assert any(not torch.equal(got[k], base[k]) for k in got)
    assert (exported / "text_encoder_3" / "config.json").is_file() and (exported / "vae" / "config.json").is_file()

    # diffusers renders the exported pipeline; Atelier samples the same latents from it
    want_latents = _pipeline_render(exported, "latent")
    meta = json.loads((run / "imagegen.json").read_text())
    model = load_pretrained(exported)
    text = text_encoder_from_meta(meta["text"], torch.device("cpu"), exported)
    vae = SD3VAE.from_dir(exported)
    got_latents = sample_latents(model, text, vae, PROMPTS, RESOLUTION, STEPS, GUIDANCE, SEED, FlowArgs(**meta["flow"]))
    err = ((got_latents - want_latents).norm() / want_latents.norm()).item()
    assert err <= 1e-4, err  # module docstring: two MMDiT implementations, 3 CFG steps

    # and `atelier imagegen sample` on the pipeline directory writes what StableDiffusion3Pipeline renders
    captions = tmp_path / "prompts.txt"
    captions.write_text("\n".join(PROMPTS) + "\n")
    run_cli("imagegen", "sample", "--model", str(exported), "--captions", str(captions), "--out", str(tmp_path / "s"),
            "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--seed", str(SEED))
    for i, want in enumerate(_pipeline_render(exported, "pil")):
        got_png = np.asarray(Image.open(tmp_path / "s" / f"{i:05d}.png"), dtype=int)
        assert got_png.shape == (RESOLUTION, RESOLUTION, 3)
        assert np.abs(got_png - np.asarray(want, dtype=int)).max() <= 1  # 8-bit rounding (module docstring)


def test_sample_a_released_pipeline_as_diffusers_does(tmp_path_factory, tmp_path):
    """A pipeline directory with no run next to it: its encoders (T5 with diffusers' 256 tokens), VAE, scheduler
    and default size, as StableDiffusion3Pipeline renders it."""
    pipe_dir = build_pipeline(tmp_path_factory.getbasetemp() / "sd3-pipe")
    captions = tmp_path / "prompts.txt"
    captions.write_text("\n".join(PROMPTS) + "\n")
    run_cli("imagegen", "sample", "--model", str(pipe_dir), "--captions", str(captions), "--out", str(tmp_path / "s"),
            "--steps", "2", "--guidance", str(GUIDANCE), "--seed", str(SEED))
    pipe = load_pipeline(pipe_dir)
    want = pipe(PROMPTS, num_inference_steps=2, guidance_scale=GUIDANCE, generator=torch.Generator().manual_seed(SEED),
                output_type="pil").images
    for i, w in enumerate(want):
        got = np.asarray(Image.open(tmp_path / "s" / f"{i:05d}.png"), dtype=int)
        assert got.shape == (RESOLUTION, RESOLUTION, 3)  # the pipeline's default: sample_size 16 x the VAE's 2
        assert np.abs(got - np.asarray(w, dtype=int)).max() <= 1  # 8-bit rounding (module docstring)
