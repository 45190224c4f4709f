"""FLUX.1 pipelines in and out: a tiny random FluxPipeline directory (tests/imagegen/_flux.py, dev and schnell) is
encoded as FluxPipeline.encode_prompt encodes, sampled as FluxPipeline samples (the embedded guidance, its sigma
grid, the dynamic shift), and goes through the CLI: `imagegen init --size flux-tiny`, `imagegen cache` ->
`imagegen train` (LoRA, model.family from the transformer's config.json) -> the exported pipeline/ loaded by
FluxPipeline.from_pretrained with the LoRA, rendering what `atelier imagegen sample` renders.

Tolerances (fp32 on the CPU), from the dtype (tests/kernels/_compare.py rounding_tolerance: n roundings at the
output's scale):
- text states: diffusers runs T5 under autograd, Atelier under no_grad, which may pick other kernels: 16 roundings;
- sampled latents: the two transformers agree within 32 roundings per forward (tests/imagegen/test_flux.py), 3 Euler
  steps carry 3 of them: 128;
- rendered PNGs: the same latents through the same VAE quantised to 8 bits by two formulas: one level at most;
- a merged LoRA (W + s B A summed in fp32) against the LoRA applied on the fly: the sampled latents' bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from atelier_studio.flows.cli import main
from atelier_studio.imagegen.autoencoder import SD3VAE
from atelier_studio.imagegen.flow import FlowArgs
from atelier_studio.imagegen.flux import Flux
from atelier_studio.imagegen.flux_text import FluxTextEncoders
from atelier_studio.imagegen.hf import load_pretrained
from atelier_studio.imagegen.sample import sample_latents
from atelier_studio.imagegen.sd3_dir import scheduler_flow

from tests.imagegen._flux import (
    CLIP_L,
    FLUX_CONFIG,
    MAX_SEQUENCE_LENGTH,
    T5_WIDTH,
    VAE_FACTOR,
    build_pipeline,
    config_overrides,
    load_pipeline,
)
from tests.imagegen._sd3 import RESOLUTION, build_shards
from tests.kernels._compare import rounding_tolerance

PROMPTS = ["a small blue circle in the upper left on a pale yellow background", "a large red square in the center"]
STEPS, GUIDANCE, SEED = 3, 3.5, 5


@pytest.fixture(scope="module")
def dev(tmp_path_factory) -> Path:
    return build_pipeline(tmp_path_factory.getbasetemp() / "flux-dev-pipe")


def within(got: torch.Tensor, want: torch.Tensor, roundings: int) -> None:
    err, bound = (got - want).abs().max().item(), rounding_tolerance(want, torch.float32, roundings)
    assert err <= bound, f"max difference {err:.3e} > {bound:.3e} ({roundings} fp32 roundings at the output's scale)"


def pipeline_render(pipe_dir: Path, output_type: str, lora: bool = False, true_cfg: float = 1.0):
    pipe = load_pipeline(pipe_dir)
    if lora:
        pipe.load_lora_weights(str(pipe_dir))
    cfg = {"true_cfg_scale": true_cfg, "negative_prompt": ""} if true_cfg != 1.0 else {}
    out = pipe(PROMPTS, height=RESOLUTION, width=RESOLUTION, num_inference_steps=STEPS, guidance_scale=GUIDANCE, **cfg,
               max_sequence_length=MAX_SEQUENCE_LENGTH, generator=torch.Generator().manual_seed(SEED),
               output_type=output_type).images
    if output_type == "latent":  # FluxPipeline returns the packed latents
        return pipe._unpack_latents(out, RESOLUTION, RESOLUTION, VAE_FACTOR)
    return out


def test_text_encoding_is_encode_prompt(dev):
    text = FluxTextEncoders(dev, MAX_SEQUENCE_LENGTH)
    assert (text.num_tokens, text.states_width, text.pooled_width) == (MAX_SEQUENCE_LENGTH, T5_WIDTH, CLIP_L)
    pipe = load_pipeline(dev)
    states, pooled, mask = text.encode(PROMPTS)
    want_states, want_pooled, text_ids = pipe.encode_prompt(PROMPTS, None, max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert states.shape == want_states.shape and pooled.shape == want_pooled.shape
    within(states, want_states.detach(), 16)
    within(pooled, want_pooled.detach(), 16)
    assert not text_ids.any()  # FluxPipeline's text ids are zeros: Atelier's position_ids give text (0, 0, 0)
    assert mask.shape == (2, MAX_SEQUENCE_LENGTH) and 0 < mask[1].sum() < mask[0].sum() < MAX_SEQUENCE_LENGTH
    empty_states, empty_pooled = text.empty()
    want_states, want_pooled, _ = pipe.encode_prompt("", None, max_sequence_length=MAX_SEQUENCE_LENGTH)
    within(empty_states, want_states[0].detach(), 16)
    within(empty_pooled, want_pooled[0].detach(), 16)


@pytest.mark.parametrize("schnell,guidance", [(False, GUIDANCE), (True, 1.0), (True, 0.0), (True, GUIDANCE)],
                         ids=["dev", "schnell-1", "schnell-0", "schnell-cfg"])
def test_sampling_matches_flux_pipeline(schnell, guidance, dev, tmp_path_factory):
    """The same seed gives FluxPipeline's latents: dev with its embedded guidance (no CFG) and dynamic shift; schnell
    (no guidance embedding) unguided at a scale of at most 1 and, above 1, with true CFG against the empty prompt
    (FluxPipeline's true_cfg_scale and negative_prompt = "")."""
    pipe_dir = build_pipeline(tmp_path_factory.getbasetemp() / "flux-schnell-pipe", schnell=True) if schnell else dev
    model = load_pretrained(pipe_dir)
    assert type(model) is Flux and model.args.guidance_embeds is not schnell
    text, vae = FluxTextEncoders(pipe_dir, MAX_SEQUENCE_LENGTH), SD3VAE.from_dir(pipe_dir)
    assert (vae.shift_factor, vae.scaling_factor) == (0.1159, 0.3611)
    got = sample_latents(model, text, vae, PROMPTS, RESOLUTION, STEPS, guidance, SEED,
                         FlowArgs(**scheduler_flow(pipe_dir)))
    true_cfg = guidance if schnell and guidance > 1 else 1.0
    want = pipeline_render(pipe_dir, "latent", true_cfg=true_cfg)
    within(got, want, 128)
    if true_cfg > 1:  # the guided render is not the unguided one
        assert (want - pipeline_render(pipe_dir, "latent")).abs().max() > 1e-3


def test_init_flux_tiny_through_the_cli(tmp_path, capsys):
    assert main(["imagegen", "init", "--size", "flux-tiny", "--out", str(tmp_path / "m"), "--in-channels", "12",
                 "--out-channels", "12", "--joint-attention-dim", "384", "--pooled-projection-dim", "384"]) == 0
    assert "random-init FLUX.1 flux-tiny" in capsys.readouterr().out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["_class_name"] == "FluxTransformer2DModel" and config["in_channels"] == 48  # 12 latent x 2x2
    assert main(["imagegen", "init", "--size", "flux-tiny", "--out", str(tmp_path / "bad"), "--sample-size", "8"]) == 2
    assert "unknown FluxArgs override(s) ['sample_size']" in capsys.readouterr().err


def test_cache_train_lora_export_and_render_through_the_cli(dev, tmp_path, monkeypatch, capsys):
    """`imagegen cache` -> `imagegen train` (LoRA on both block types, dev's guidance input at model.guidance) ->
    pipeline/ with the LoRA at its top: diffusers renders it as Atelier samples it, and the adapters moved."""
    from safetensors.torch import load_file

    shards = build_shards(tmp_path / "world")
    latents, run = tmp_path / "latents", tmp_path / "run"
    sets = [a for item in config_overrides(dev, shards, latents, run, "lora.targets=[\"to_q\", \"proj_mlp\"]",
                                           "model.guidance=2.5") for a in ("--set", item)]
    assert main(["imagegen", "cache", "--config", str(FLUX_CONFIG), "--out", str(latents), *sets]) == 0
    meta = json.loads((latents / "cache.json").read_text())
    assert meta["text_kind"] == "flux" and meta["text_tokens"] == MAX_SEQUENCE_LENGTH
    guidance_seen: list[torch.Tensor] = []
    forward = Flux.forward

    def recording(self, *args, guidance=None, **kwargs):
        guidance_seen.append(guidance)
        return forward(self, *args, guidance=guidance, **kwargs)

    monkeypatch.setattr(Flux, "forward", recording)
    assert main(["imagegen", "train", "--config", str(FLUX_CONFIG), *sets]) == 0
    monkeypatch.undo()
    assert len(guidance_seen) == 3 * 4  # 3 steps of grad_accum 4 (the shipped config)
    assert all(torch.equal(g, torch.full((4,), 2.5)) for g in guidance_seen)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 3 and np.isfinite(summary["final_loss"])

    exported = run / "pipeline"
    assert json.loads((exported / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    adapters = load_file(exported / "pytorch_lora_weights.safetensors")
    assert any(".single_transformer_blocks.1.proj_mlp." in k for k in adapters)
    assert any(".transformer_blocks.0.attn.to_q." in k for k in adapters)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapters.items())  # trained

    # diffusers loads the export with its LoRA and samples Atelier's latents, which the adapters moved
    from atelier_studio.imagegen.sample import load_for_sampling

    model = load_for_sampling(exported, json.loads((run / "imagegen.json").read_text()), torch.device("cpu"))
    text, vae = FluxTextEncoders(exported, MAX_SEQUENCE_LENGTH), SD3VAE.from_dir(exported)
    got = sample_latents(model, text, vae, PROMPTS, RESOLUTION, STEPS, GUIDANCE, SEED, FlowArgs(**scheduler_flow(dev)))
    want, base = pipeline_render(exported, "latent", lora=True), pipeline_render(dev, "latent")
    within(got, want, 128)
    assert (want - base).abs().max() > 100 * rounding_tolerance(want, torch.float32, 128)
    # `imagegen export --merge`: a FluxPipeline with the adapters merged renders as the base with the LoRA loaded; the
    # forms that are SD3's layouts are refused in one line
    assert main(["imagegen", "export", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0
    within(pipeline_render(tmp_path / "merged", "latent"), want, 128)
    assert main(["imagegen", "export", str(run), "--single-file", "--out", str(tmp_path / "f.safetensors")]) == 2
    assert "the FLUX.1 family has no single-file export yet; it has diffusers, merge" in capsys.readouterr().err
    # `atelier imagegen sample` on the export writes what diffusers renders
    captions = tmp_path / "prompts.txt"
    captions.write_text("\n".join(PROMPTS) + "\n")
    assert main(["imagegen", "sample", "--model", str(exported), "--captions", str(captions), "--out",
                 str(tmp_path / "s"), "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--seed", str(SEED)]) == 0
    for i, want in enumerate(pipeline_render(exported, "pil", lora=True)):
        got = np.asarray(Image.open(tmp_path / "s" / f"{i:05d}.png"), dtype=int)
        assert got.shape == (RESOLUTION, RESOLUTION, 3)
        assert np.abs(got - np.asarray(want, dtype=int)).max() <= 1  # 8-bit rounding (module docstring)
