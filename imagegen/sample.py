"""Render captions with a trained MMDiT: Euler + classifier-free guidance (`imagegen.flow.euler_sample`); for a
family whose guidance is a model input (FLUX.1-dev's embedding: imagegen/family.py guidance_input) the guidance
scale goes into the model and no CFG runs, on its pipeline's sigma grid (FluxPipeline's linspace), as its diffusers
pipeline renders; a FLUX model without the embedding (schnell) runs CFG only above 1 (FluxPipeline's
true_cfg_scale against the empty prompt).

Shape legend: B captions, C latent channels, h/w latent size, H/W pixels, L text tokens, D text width.

`sample_images` is the one sampling path (the trainer's sample grid, `atelier imagegen sample`, the
brief-to-image evaluation). Noise is drawn on the CPU from a generator seeded with `seed`, for all
captions at once, so caption i gets the same noise on any device and at any batch size.

A run directory written by `ImagegenTask.export` holds `transformer/`, `ema/` (EMA on) — or, for a LoRA run,
`lora/` and `lora_ema/` (diffusers LoRA files) — and `imagegen.json` (autoencoder spec, text encoder settings,
resolution, flow shift, the base transformer): what `sample_to_dir` needs besides the weights, so
`atelier imagegen sample --model runs/i1/ema` (or `runs/i1/lora_ema`) works without the training config.

`sample_to_dir` also takes a diffusers StableDiffusion3Pipeline directory (a released SD3 / SD3.5 model, or a
run's exported `pipeline/`): its three text encoders, its VAE and its scheduler's shift are used, and a LoRA file
at its top (pytorch_lora_weights.safetensors, a LoRA run's export) is applied, so the images are
StableDiffusion3Pipeline's (after `load_lora_weights(dir)`) for the same seed, steps and guidance (the noise is drawn
as the pipeline draws it from a CPU generator: `torch.randn` of the whole batch; the Euler steps and CFG are
diffusers', see imagegen/flow.py). The pipeline renders with guidance only above 1; here any guidance other than 1
runs CFG.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Iterator, Sequence

import torch
from PIL import Image

from atelier_studio.data.textfile import read_json, read_lines
from atelier_studio.imagegen.flow import FlowArgs, euler_sample
from atelier_studio.pipeline.atomic import atomic_file, atomic_write_text, check_dir_path, ensure_dir
from atelier_studio.pipeline.errors import DataError, ModelLoadError, UsageError

RUN_META = "imagegen.json"


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """images [B, 3, H, W] in [-1, 1] -> 8-bit RGB PIL images (clamped)."""
    arr = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [B, 3, H, W]
    return [Image.fromarray(a.permute(1, 2, 0).cpu().numpy(), "RGB") for a in arr]


def make_grid(images: Sequence[Image.Image], columns: int, pad: int = 2) -> Image.Image:
    """Images of one size tiled row-major on a white canvas, `pad` pixels apart."""
    if not images:
        raise ValueError("make_grid: no images")
    w, h = images[0].size
    cols = max(1, min(columns, len(images)))
    rows = (len(images) + cols - 1) // cols
    grid = Image.new("RGB", (cols * (w + pad) + pad, rows * (h + pad) + pad), (255, 255, 255))
    for i, im in enumerate(images):
        grid.paste(im, (pad + (i % cols) * (w + pad), pad + (i // cols) * (h + pad)))
    return grid


def make_grid_column(images: Sequence[Image.Image], pad: int = 2) -> Image.Image:
    """Images of any sizes (one grid per resolution) stacked top to bottom, left-aligned, on a white canvas."""
    if not images:
        raise ValueError("make_grid_column: no images")
    width, height = max(im.size[0] for im in images), sum(im.size[1] for im in images) + pad * (len(images) - 1)
    column = Image.new("RGB", (width, height), (255, 255, 255))
    top = 0
    for im in images:
        column.paste(im, (0, top))
        top += im.size[1] + pad
    return column


@torch.no_grad()
def _sample_chunks(model, text_encoder, captions: Sequence[str], latent_hw: tuple[int, int], steps: int,
                   guidance: float, seed: int, flow: FlowArgs, batch_size: int,
                   autocast_dtype: torch.dtype | None) -> Iterator[torch.Tensor]:
    """Latents x0 [b, C, h, w] (fp32, on the model's device) for consecutive chunks of `captions`."""
    from atelier_studio.imagegen.registry import family_of_args

    h, w = latent_hw
    C, p = model.args.in_channels, model.args.patch_size
    family = family_of_args(model.args)  # its pipeline's sigma grid, and whether guidance is CFG or a model input
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    noise_all = torch.randn(len(captions), C, h, w, generator=gen)  # [B, C, h, w], CPU: device independent
    image_seq_len = (h // p) * (w // p)
    neg_states, neg_pooled = text_encoder.negative()  # [L, D], [P]
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(captions), batch_size):
            chunk = list(captions[i:i + batch_size])
            states, pooled, _ = text_encoder.encode(chunk)  # [b, L, D], [b, P]
            b = len(chunk)
            with amp:
                x0 = euler_sample(model, noise_all[i:i + b].to(device), states.to(device).float(),
                                  pooled.to(device).float(), neg_states.to(device).float().expand(b, -1, -1),
                                  neg_pooled.to(device).float().expand(b, -1), num_steps=steps,
                                  guidance_scale=family.sampling_cfg(guidance, model.args), shift=flow.shift,
                                  image_seq_len=image_seq_len, args=flow, grid=family.sigma_grid,
                                  model_kwargs=family.guidance_kwargs(model.args, guidance, b, device),
                                  cfg_rescale=family.cfg_rescale)
            yield x0.float()
    finally:
        model.train(was_training)


def _latent_hw(model, autoencoder, resolution: int | tuple[int, int], who: str) -> tuple[int, int]:
    H, W = (resolution, resolution) if isinstance(resolution, int) else resolution
    f, p = autoencoder.downsample_factor, model.args.patch_size
    step = f * p
    if H <= 0 or W <= 0 or H % step or W % step:
        near = sorted({max(step, H // step * step), (H // step + 1) * step})
        raise UsageError(f"{who}: resolution {H}x{W} must be a positive multiple of {step} (the autoencoder's factor "
                         f"{f} x the patch size {p}), e.g. {' or '.join(map(str, near))}")
    return H // f, W // f


@torch.no_grad()
def sample_latents(model, text_encoder, autoencoder, captions: Sequence[str], resolution: int | tuple[int, int],
                   steps: int = 28, guidance: float = 4.0, seed: int = 0, flow: FlowArgs | None = None,
                   batch_size: int = 16, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Captions -> the sampled model latents [B, C, h, w] (fp32, CPU) before decoding (`sample_images`' arguments;
    what StableDiffusion3Pipeline returns with output_type="latent")."""
    if not captions:
        raise ValueError("sample_latents: no captions")
    hw = _latent_hw(model, autoencoder, resolution, "sample_latents")
    return torch.cat([x.cpu() for x in _sample_chunks(model, text_encoder, captions, hw, steps, guidance, seed,
                                                      flow or FlowArgs(), batch_size, autocast_dtype)])


@torch.no_grad()
def sample_images(model, text_encoder, autoencoder, captions: Sequence[str], resolution: int | tuple[int, int],
                  steps: int = 28, guidance: float = 4.0, seed: int = 0, flow: FlowArgs | None = None,
                  batch_size: int = 16, autocast_dtype: torch.dtype | None = None) -> list[Image.Image]:
    """Captions -> PIL images of `resolution` (side, or (H, W)) pixels.

    `text_encoder` has `encode(list[str]) -> (states [B,L,D], pooled [B,P], mask)` and `negative() -> (states
    [L,D], pooled [P])` (CFG's unconditional input). `flow` gives the sampler's shift (default FlowArgs()).
    """
    if not captions:
        raise ValueError("sample_images: no captions")
    hw = _latent_hw(model, autoencoder, resolution, "sample_images")
    out: list[Image.Image] = []
    for x0 in _sample_chunks(model, text_encoder, captions, hw, steps, guidance, seed, flow or FlowArgs(),
                             batch_size, autocast_dtype):
        out += to_pil(autoencoder.decode(x0))
    return out


def run_meta(cfg) -> dict:
    """The sampling settings of a run (imagegen.json): everything sampling needs except the weights, with every
    path absolute (a run directory can be sampled from anywhere)."""
    from atelier_studio.imagegen.autoencoder import resolve_autoencoder_spec
    from atelier_studio.imagegen.text import default_text_encoder_path, text_encoder_dir

    spec = resolve_autoencoder_spec(cfg.autoencoder.spec, cfg.model.path)
    if not (spec == "pixel" or spec.startswith("pixel:")):
        spec = str(Path(spec).resolve())
    text = dataclasses.asdict(cfg.text)
    encoder = text_encoder_dir(cfg.text, cfg.model.path)
    text["encoder"] = str(Path(encoder).resolve()) if encoder else str(default_text_encoder_path())
    from atelier_studio.imagegen.hf import resolve_dir

    try:  # the transformer a LoRA run's adapters apply to (a pipeline's transformer/)
        base = resolve_dir(cfg.model.path)
    except FileNotFoundError:  # a config read for its settings only: sampling a LoRA names the path if it matters
        base = Path(cfg.model.path)
    # several resolutions (data.resolutions): `atelier imagegen sample` renders at the largest by default
    return {"autoencoder": spec, "text": text, "resolution": max(cfg.data.all_resolutions),
            "flow": dataclasses.asdict(cfg.flow), "model_dtype": cfg.model.dtype, "base_model": str(base.resolve())}


def write_run_meta(out_dir: Path, cfg) -> Path:
    """imagegen.json beside transformer/ and ema/: everything sampling needs except the weights."""
    return atomic_write_text(Path(out_dir) / RUN_META, json.dumps(run_meta(cfg), indent=1) + "\n",
                             what="sampling settings")


def _find_run_meta(model_dir: Path, config_path: str | None) -> dict | None:
    """The sampling settings: from a run's config.toml if given, else imagegen.json in/next to model_dir, else None."""
    if config_path:
        from atelier_studio.imagegen.config import ImagegenConfig
        from atelier_studio.pipeline.config import load_config

        return run_meta(load_config(ImagegenConfig, config_path))
    for candidate in (model_dir / RUN_META, model_dir.parent / RUN_META):
        if candidate.is_file():
            return read_json(candidate, ModelLoadError)
    return None


def _read_run_meta(model_dir: Path, config_path: str | None) -> dict:
    meta = _find_run_meta(model_dir, config_path)
    if meta is None:
        raise FileNotFoundError(f"no {RUN_META} in {model_dir} or {model_dir.parent}: pass --config with the run's "
                                f"config.toml (sampling needs the autoencoder and text encoder settings)")
    return meta


def text_encoder_from_meta(text: dict, device: torch.device, pipeline_dir: Path | None = None):
    """The text encoder of imagegen.json's "text" settings; `pipeline_dir` replaces an SD3 run's encoder path (the
    pipeline being sampled holds the same encoders)."""
    from atelier_studio.imagegen.text import TextEncoder

    dtype = getattr(torch, text.get("dtype", "float32"))
    if text["kind"] == "qwen-image":
        from atelier_studio.imagegen.qwen_image_text import QwenImageTextEncoder

        return QwenImageTextEncoder(pipeline_dir or text["encoder"], text["max_sequence_length"], device, dtype)
    if text["kind"] == "flux":
        from atelier_studio.imagegen.flux_text import FluxTextEncoders

        return FluxTextEncoders(pipeline_dir or text["encoder"], text["max_sequence_length"], device, dtype)
    if text["kind"] == "sd3":
        from atelier_studio.imagegen.sd3_text import SD3TextEncoders

        return SD3TextEncoders(pipeline_dir or text["encoder"], text["max_sequence_length"], text["clip_skip"],
                               text["use_t5"], device, dtype)
    return TextEncoder(text["encoder"] or None, text["kind"], text["max_length"], text["layer"], text["pooled"],
                       device, dtype)


def _pipeline_settings(pipeline_dir: Path, meta: dict | None, device: torch.device):
    """(text encoder, autoencoder, flow, resolution, model_dtype) for sampling an SD3 pipeline directory: its parts
    and scheduler; a run's imagegen.json (when one is next to it) gives the text settings and the resolution."""
    from atelier_studio.imagegen.autoencoder import SD3VAE
    from atelier_studio.imagegen.flux_text import PIPELINE as FLUX_PIPELINE
    from atelier_studio.imagegen.flux_text import FluxTextEncoders
    from atelier_studio.imagegen.qwen_image_text import PIPELINE as QWEN_IMAGE_PIPELINE
    from atelier_studio.imagegen.qwen_image_text import QwenImageTextEncoder
    from atelier_studio.imagegen.sd3_dir import (
        check_pipeline_files,
        default_resolution,
        has_part,
        read_model_index,
        scheduler_flow,
    )
    from atelier_studio.imagegen.sd3_text import SD3TextEncoders
    from atelier_studio.imagegen.text import PIPELINE_TEXT_KINDS

    index = read_model_index(pipeline_dir)
    flow = FlowArgs(**{**(meta or {}).get("flow", {}), **scheduler_flow(pipeline_dir)})  # the cheap checks first
    resolution = meta["resolution"] if meta is not None else default_resolution(pipeline_dir)
    check_pipeline_files(pipeline_dir)  # every part's files, before the first is loaded
    if meta is not None and meta.get("text", {}).get("kind") in PIPELINE_TEXT_KINDS:
        text = text_encoder_from_meta(meta["text"], device, pipeline_dir)
    elif index["_class_name"] == FLUX_PIPELINE:  # a released FLUX pipeline: FluxPipeline's default 512 T5 tokens
        text = FluxTextEncoders(pipeline_dir, device=device)
    elif index["_class_name"] == QWEN_IMAGE_PIPELINE:  # a released Qwen-Image pipeline: its default 1024 tokens
        text = QwenImageTextEncoder(pipeline_dir, device=device)
    else:  # a released pipeline: StableDiffusion3Pipeline's defaults (T5 when the pipeline has it)
        text = SD3TextEncoders(pipeline_dir, use_t5=has_part(index, "text_encoder_3"), device=device)
    autoencoder = SD3VAE.from_dir(pipeline_dir)
    return text, autoencoder, flow, resolution, (meta or {}).get("model_dtype", "float32")


def load_for_sampling(model_dir: Path, meta: dict | None, device: torch.device):
    """The MMDiT (fp32) to sample: a diffusers transformer directory; an SD3 pipeline directory's transformer/, with
    the LoRA file at its top applied when there is one; or a LoRA directory (a run's lora/ or lora_ema/) applied to
    the base transformer its run's imagegen.json names."""
    from atelier_studio.imagegen.hf import CONFIG_NAME, load_pretrained
    from atelier_studio.imagegen.lora import LORA_FILE, load_lora

    lora = model_dir / LORA_FILE
    if lora.is_file() and not (model_dir / CONFIG_NAME).is_file() and not (model_dir / "transformer").is_dir():
        if meta is None or not meta.get("base_model"):
            raise FileNotFoundError(f"{model_dir}: a LoRA with no {RUN_META} naming its base model next to it: pass "
                                    f"--config with the run's config.toml")
        base = load_pretrained(meta["base_model"], dtype=torch.float32, device=device)
    else:
        base = load_pretrained(model_dir, dtype=torch.float32, device=device)
    if lora.is_file():
        load_lora(base, lora, dtype="float32")
    return base


def sample_to_dir(model_dir: Path, captions_file: Path, out_dir: Path, steps: int = 28, guidance: float = 4.0,
                  seed: int = 0, config_path: str | None = None, batch_size: int = 16,
                  resolution: int = 0) -> list[Path]:
    """`atelier imagegen sample`: one PNG per caption line, grid.png, and index.jsonl {caption, image}.

    `model_dir`: a run's transformer/, ema/, lora/ or lora_ema/ (settings from imagegen.json or `config_path`), or
    an SD3 pipeline directory (module docstring). `resolution` (pixels, square) overrides the run's or the
    pipeline's default.
    """
    from atelier_studio.imagegen.autoencoder import load_autoencoder
    from atelier_studio.imagegen.sd3_dir import is_pipeline_dir

    model_dir, captions_file, out_dir = Path(model_dir), Path(captions_file), Path(out_dir)
    if not captions_file.is_file():
        raise FileNotFoundError(f"captions file not found: {captions_file}")
    captions = [line.strip() for line in read_lines(captions_file) if line.strip()]  # non-UTF-8: file:line
    if not captions:
        raise DataError(f"{captions_file}: no captions (one per line)")
    if resolution < 0:
        raise UsageError(f"--resolution: must be a positive pixel size (0 = the model's default), got {resolution}")
    check_dir_path(out_dir, "--out")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if is_pipeline_dir(model_dir):
        meta = _find_run_meta(model_dir, config_path)
        text, autoencoder, flow, default, model_dtype = _pipeline_settings(model_dir, meta, device)
    else:
        meta = _read_run_meta(model_dir, config_path)
        autoencoder = load_autoencoder(meta["autoencoder"])
        flow, default, model_dtype = FlowArgs(**meta.get("flow", {})), meta["resolution"], meta.get("model_dtype")
        text = None  # loaded once the resolution is known to fit
    model = load_for_sampling(model_dir, meta, device)
    _latent_hw(model, autoencoder, resolution or default, "--resolution")  # before the text encoder loads
    text = text if text is not None else text_encoder_from_meta(meta["text"], device)
    autoencoder = autoencoder.to(device)
    amp = torch.bfloat16 if model_dtype == "bfloat16" and device.type == "cuda" else None
    images = sample_images(model, text, autoencoder, captions, resolution or default, steps, guidance, seed, flow,
                           batch_size, amp)
    ensure_dir(out_dir, "--out")
    paths = []
    for i, im in enumerate(images):
        with atomic_file(out_dir / f"{i:05d}.png", "wb", what="sample") as f:
            im.save(f, format="PNG")
        paths.append(out_dir / f"{i:05d}.png")
    with atomic_file(out_dir / "grid.png", "wb", what="sample grid") as f:
        make_grid(images, columns=min(8, len(images))).save(f, format="PNG")
    # last: an index.jsonl means every image it lists is complete
    atomic_write_text(out_dir / "index.jsonl", "".join(json.dumps({"caption": c, "image": p.name}) + "\n"
                                                       for c, p in zip(captions, paths)), what="sample index")
    return paths


__all__ = ["sample_images", "sample_latents", "sample_to_dir", "load_for_sampling", "make_grid", "make_grid_column",
           "to_pil", "write_run_meta", "run_meta", "text_encoder_from_meta", "RUN_META"]
