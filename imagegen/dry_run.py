"""Imagegen's `--dry-run` plan (pipeline/dry_run.py): the MMDiT from its config.json on the meta device, LoRA
applied as the run would, the latent shards counted from their index files; no weights read, nothing encoded.

An image at data.resolution (the largest of data.resolutions) becomes (resolution / f / patch)² image tokens, f the
autoencoder's downsampling (8 for an SD3 VAE, p for the pixel codec "pixel:p"); the text stream has text.max_length
tokens (an SD3 pipeline's encoders: 77 CLIP + text.max_sequence_length T5 tokens; a FLUX pipeline's: the T5 tokens).
Both streams run through every block (FLUX's blocks are estimated as its first, double-stream one: its activations
bound a single-stream block's).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from atelier_studio.imagegen.config import ImagegenConfig
from atelier_studio.imagegen.hf import build_model, read_args
from atelier_studio.imagegen.lora import apply_lora, target_modules
from atelier_studio.imagegen.registry import family_of_args
from atelier_studio.pipeline.config import ConfigError
from atelier_studio.pipeline.dry_run import Plan, activation_bytes, fp8_memory, optimizer_memory, parameter_bytes
from atelier_studio.pipeline.float8 import apply_fp8
from atelier_studio.pipeline.lora_fp8 import FP8_CONVERSIONS


def imagegen_plan(cfg: ImagegenConfig) -> Plan:
    try:
        args = read_args(cfg.model.path)
    except FileNotFoundError as e:
        raise ConfigError(f"model.path: {e}") from None
    family = family_of_args(args)
    full = cfg.lora.rank == 0
    base_dtype = torch.float32 if (cfg.model.dtype == "float32" or full) else torch.bfloat16
    act_bytes = 4 if cfg.model.dtype == "float32" else 2
    spec = cfg.autoencoder.spec
    down = int(spec.split(":")[1]) if spec.startswith("pixel:") else (2 if spec == "pixel" else 8)
    resolution = max(cfg.data.all_resolutions) or args.sample_size * down  # the largest bucket sets the peak
    image_tokens = (resolution // down // args.patch_size) ** 2
    # SD3's encoders: 77 CLIP + T5 tokens; FLUX's: T5's alone (CLIP gives only the pooled vector); Qwen-Image's: its
    # max_sequence_length
    text_tokens = {"sd3": 77 + cfg.text.max_sequence_length, "flux": cfg.text.max_sequence_length,
                   "qwen-image": cfg.text.max_sequence_length}.get(
        cfg.text.kind, cfg.text.max_length)
    train = cfg.train
    with torch.device("meta"):
        model = build_model(args).to(base_dtype)
        blocks = family.blocks(model)
        tokens = train.micro_batch * (image_tokens + text_tokens)  # both streams run through every joint block
        rows_of = None if family.linear_rows is None else (  # each linear over its own stream's rows
            lambda name: family.linear_rows(name, train.micro_batch, image_tokens, text_tokens))
        activations = activation_bytes(blocks[0], len(blocks), args.num_heads * args.head_dim, tokens, act_bytes,
                                       train.distributed.activation_checkpointing, rows_of)
        if not full:
            try:
                targets = family.resolve_lora_targets(cfg.lora.targets)
            except ValueError as e:
                raise ConfigError(f"lora.targets: {e}") from None
            apply_lora(model, cfg.lora.args(), target_modules(model, targets))
        if train.precision == "fp8":  # as the task applies it (imagegen/task.py): after LoRA, fp8_skip kept
            apply_fp8(model, train.fp8_recipe, family.fp8_skip, conversions=FP8_CONVERSIONS)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    images = train.micro_batch * train.grad_accum
    flops = family.train_flops(model, images, image_tokens, text_tokens)
    memory = {"weights": parameter_bytes(model), **optimizer_memory(model), **fp8_memory(model, train.precision),
              "activations": activations}
    if cfg.ema.decay > 0:
        memory["ema"] = 4 * trainable  # an fp32 copy of the trained weights
    notes = [f"{image_tokens} image tokens ({resolution} px, downsampling {down}, patch {args.patch_size}) and "
             f"{text_tokens} text tokens per image",
             "per process; under torchrun FSDP2 divides weights, gradients and optimizer state by the processes",
             "the frozen text encoders and VAE are not counted: training reads cached latents"]
    return Plan(params_total=total, params_trainable=trainable, unit="images", units_per_step=images,
                flops_per_step=int(flops), memory=memory,
                dataset="; ".join(_latent_count(src) for src in cfg.data.latent_sources(cfg.data.shards).values()),
                notes=tuple(notes))


def _latent_count(shards: str) -> str:
    """The training shards' sample count, from each tar's index.json (written by `atelier imagegen cache`)."""
    folder = Path(shards)
    if not folder.is_dir():
        return f"data.shards {shards} not found (cache it with `atelier imagegen cache`)"
    indexes = sorted(folder.glob("*.index.json")) or sorted(folder.glob("index.json"))
    counted = 0
    for index in indexes:
        data = json.loads(index.read_text())
        counted += len(data) if isinstance(data, list) else int(data.get("count", len(data.get("samples", []))))
    tars = len(list(folder.glob("*.tar")))
    return f"{shards}: {tars} shards" + (f", {counted:,} samples" if indexes else "")


__all__ = ["imagegen_plan"]
