"""Render captions with a trained MMDiT: Euler + classifier-free guidance (`imagegen.flow.euler_sample`).

Shape legend: B captions, C latent channels, h/w latent size, H/W pixels, L text tokens, D text width.

`sample_images` is the one sampling path (the trainer's sample grid, `atelier imagegen sample`, the
brief-to-image evaluation). Noise is drawn on the CPU from a generator seeded with `seed`, for all
captions at once, so caption i gets the same noise on any device and at any batch size.

A run directory written by `ImagegenTask.export` holds `transformer/`, `ema/` (EMA on) and
`imagegen.json` (autoencoder spec, text encoder settings, resolution, flow shift): what
`sample_to_dir` needs besides the weights, so `atelier imagegen sample --model runs/i1/ema` works
without the training config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from atelier_studio.data.textfile import read_json, read_lines
from atelier_studio.imagegen.flow import FlowArgs, euler_sample
from atelier_studio.pipeline.atomic import atomic_file, atomic_write_text, check_dir_path, ensure_dir
from atelier_studio.pipeline.errors import DataError, ModelLoadError

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


@torch.no_grad()
def sample_images(model, text_encoder, autoencoder, captions: Sequence[str], resolution: int | tuple[int, int],
                  steps: int = 28, guidance: float = 4.0, seed: int = 0, flow: FlowArgs | None = None,
                  batch_size: int = 16, autocast_dtype: torch.dtype | None = None) -> list[Image.Image]:
    """Captions -> PIL images of `resolution` (side, or (H, W)) pixels.

    `text_encoder` has `encode(list[str]) -> (states [B,L,D], pooled [B,D], mask)` and `empty() -> (states
    [L,D], pooled [D])` (CFG's unconditional input). `flow` gives the sampler's shift (default FlowArgs()).
    """
    if not captions:
        raise ValueError("sample_images: no captions")
    flow = flow or FlowArgs()
    H, W = (resolution, resolution) if isinstance(resolution, int) else resolution
    f, C, p = autoencoder.downsample_factor, model.args.in_channels, model.args.patch_size
    if H % (f * p) or W % (f * p):
        raise ValueError(f"sample_images: resolution {H}x{W} must be a multiple of autoencoder factor {f} x patch {p}")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    noise_all = torch.randn(len(captions), C, H // f, W // f, generator=gen)  # [B, C, h, w], CPU: device independent
    image_seq_len = (H // f // p) * (W // f // p)
    neg_states, neg_pooled = text_encoder.empty()  # [L, D], [D]
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    was_training = model.training
    model.eval()
    out: list[Image.Image] = []
    try:
        for i in range(0, len(captions), batch_size):
            chunk = list(captions[i:i + batch_size])
            states, pooled, _ = text_encoder.encode(chunk)  # [b, L, D], [b, D]
            b = len(chunk)
            with amp:
                x0 = euler_sample(model, noise_all[i:i + b].to(device), states.to(device).float(),
                                  pooled.to(device).float(), neg_states.to(device).float().expand(b, -1, -1),
                                  neg_pooled.to(device).float().expand(b, -1), num_steps=steps,
                                  guidance_scale=guidance, shift=flow.shift, image_seq_len=image_seq_len, args=flow)
            out += to_pil(autoencoder.decode(x0.float()))
    finally:
        model.train(was_training)
    return out


def write_run_meta(out_dir: Path, cfg) -> Path:
    """imagegen.json beside transformer/ and ema/: everything sampling needs except the weights."""
    t = cfg.text
    from atelier_studio.imagegen.text import default_text_encoder_path

    meta = {"autoencoder": cfg.autoencoder.spec,
            "text": {"encoder": str(Path(t.encoder).resolve()) if t.encoder else str(default_text_encoder_path()),
                     "kind": t.kind, "max_length": t.max_length, "layer": t.layer, "pooled": t.pooled,
                     "dtype": t.dtype},
            "resolution": cfg.data.resolution, "flow": {k: getattr(cfg.flow, k) for k in cfg.flow.__dataclass_fields__},
            "model_dtype": cfg.model.dtype}
    return atomic_write_text(Path(out_dir) / RUN_META, json.dumps(meta, indent=1) + "\n", what="sampling settings")


def _read_run_meta(model_dir: Path, config_path: str | None) -> dict:
    """The sampling settings: from a run's config.toml if given, else imagegen.json in/next to model_dir."""
    if config_path:
        from atelier_studio.imagegen.config import ImagegenConfig
        from atelier_studio.pipeline.config import load_config

        cfg = load_config(ImagegenConfig, config_path)
        return {"autoencoder": cfg.autoencoder.spec, "text": dataclasses.asdict(cfg.text),
                "resolution": cfg.data.resolution, "flow": dataclasses.asdict(cfg.flow), "model_dtype": cfg.model.dtype}
    for candidate in (model_dir / RUN_META, model_dir.parent / RUN_META):
        if candidate.is_file():
            return read_json(candidate, ModelLoadError)
    raise FileNotFoundError(f"no {RUN_META} in {model_dir} or {model_dir.parent}: pass --config with the run's "
                            f"config.toml (sampling needs the autoencoder and text encoder settings)")


def sample_to_dir(model_dir: Path, captions_file: Path, out_dir: Path, steps: int = 28, guidance: float = 4.0,
                  seed: int = 0, config_path: str | None = None, batch_size: int = 16) -> list[Path]:
    """`atelier imagegen sample`: one PNG per caption line, grid.png, and index.jsonl {caption, image}."""
    from atelier_studio.imagegen.autoencoder import load_autoencoder
    from atelier_studio.imagegen.hf import load_pretrained
    from atelier_studio.imagegen.text import TextEncoder

    model_dir, captions_file, out_dir = Path(model_dir), Path(captions_file), Path(out_dir)
    if not captions_file.is_file():
        raise FileNotFoundError(f"captions file not found: {captions_file}")
    captions = [line.strip() for line in read_lines(captions_file) if line.strip()]  # non-UTF-8: file:line
    if not captions:
        raise DataError(f"{captions_file}: no captions (one per line)")
    check_dir_path(out_dir, "--out")
    meta = _read_run_meta(model_dir, config_path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_pretrained(model_dir, dtype=torch.float32, device=device)
    t = meta["text"]
    text = TextEncoder(t["encoder"] or None, t["kind"], t["max_length"], t["layer"], t["pooled"], device,
                       getattr(torch, t.get("dtype", "float32")))
    autoencoder = load_autoencoder(meta["autoencoder"]).to(device)
    amp = torch.bfloat16 if meta.get("model_dtype") == "bfloat16" and device.type == "cuda" else None
    images = sample_images(model, text, autoencoder, captions, meta["resolution"], steps, guidance, seed,
                           FlowArgs(**meta.get("flow", {})), batch_size, amp)
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


__all__ = ["sample_images", "sample_to_dir", "make_grid", "to_pil", "write_run_meta", "RUN_META"]
