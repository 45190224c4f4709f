"""Tiny random FLUX.1 pipeline directories for the tests, built locally (nothing is downloaded).

The parts are tests/imagegen/_sd3.py's tokenizers (built from its word list) and small random models whose widths
all differ: CLIP-L 32 wide (CLIPTextModel: its pooled output is the transformer's pooled_projection_dim), T5 96 (its
joint_attention_dim), a VAE that downsamples by 2 with 4 latent channels and FLUX.1's shift / scaling factors, and
diffusers' FluxTransformer2DModel with its random init (16 packed channels, 1 double- and 2 single-stream blocks,
head dim 16 = RoPE axes 4 + 6 + 6): 32-px images -> 16x16 latents -> 8x8 = 64 image tokens. The scheduler is
FLUX.1-dev's (dynamic shifting) or schnell's (no shift, no guidance embedding).

    build_pipeline(dir, schnell=False) -> dir (idempotent)
    load_pipeline(dir) -> FluxPipeline in fp32
    config_overrides(pipe, shards, latents, out) -> --set items pointing configs/imagegen/flux-dev-lora.toml at them
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.imagegen import _sd3
from tests.imagegen._sd3 import RESOLUTION, ROOT, clip_tokenizer, t5_tokenizer

CLIP_L, T5_WIDTH = 32, 96
FLUX_CONFIG = ROOT / "configs" / "imagegen" / "flux-dev-lora.toml"
MAX_SEQUENCE_LENGTH = _sd3.MAX_SEQUENCE_LENGTH  # 16 T5 tokens (FluxPipeline's default 512 is real work on a CPU)
VAE_FACTOR = 2


def build_pipeline(out: Path, schnell: bool = False, seed: int = 0) -> Path:
    """Write a tiny random FluxPipeline directory (FLUX.1-schnell's settings with `schnell`); idempotent."""
    out = Path(out)
    if (out / "model_index.json").is_file():
        return out
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tok_l, tok_t5 = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=CLIP_L, intermediate_size=2 * CLIP_L,
        num_attention_heads=4, num_hidden_layers=2, vocab_size=len(tok_l), max_position_embeddings=77,
        hidden_act="quick_gelu"))
    torch.manual_seed(seed + 2)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tok_t5), d_model=T5_WIDTH, d_kv=16, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu", is_encoder_decoder=False))
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=RESOLUTION, use_quant_conv=False,
                        use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
    torch.manual_seed(seed + 4)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=T5_WIDTH, pooled_projection_dim=CLIP_L, guidance_embeds=not schnell,
        axes_dims_rope=(4, 6, 6))
    scheduler = (FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False) if schnell else
                 FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                 base_image_seq_len=256, max_image_seq_len=4096))
    pipe = FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                        tokenizer=tok_l, text_encoder_2=text_encoder_2, tokenizer_2=tok_t5)
    tmp = out.with_name(out.name + ".tmp")
    pipe.save_pretrained(tmp)
    tmp.rename(out)
    return out


def load_pipeline(path: Path):
    """FluxPipeline.from_pretrained(path) in fp32 on the CPU, progress bars off."""
    return _sd3.load_pipeline(path, "FluxPipeline")


def config_overrides(pipe: Path, shards: Path, latents: Path, out: Path, *extra: str) -> list[str]:
    """The shipped FLUX config pointed at a tiny pipeline as _sd3's points the SD3 one: fp32, 32 px, 16 T5 tokens, 3
    steps of batch 4, EMA 0.5 (the exported LoRA is the EMA's)."""
    return _sd3.config_overrides(pipe, shards, latents, out, *extra)
