"""Tiny random SD3 / SD3.5 pipeline directories for the tests, built locally (nothing is downloaded).

The parts are diffusers' own SD3 pipeline test's, shrunk further, with widths that all differ so that a mix-up
of encoders or axes cannot pass: CLIP-L 32 wide (projection 32), CLIP-G 48 (projection 48), T5 96 (> 32 + 48, so
encode_prompt's zero padding is exercised), pooled 32 + 48 = 80. CLIP-L has 3 layers, so clip_skip 1 exists. The
tokenizers are built from a word list: CLIP's byte-level BPE with one merge path per word (any other lowercase
word falls back to letters), T5's unigram with one piece per word. The VAE downsamples by 2 with 4 latent
channels and SD3's shift / scaling factors; the transformer is diffusers' SD3Transformer2DModel with its random
init (whose output is not zero), 32-px images -> 16x16 latents -> 64 image tokens; the SD3.5 variant adds
MMDiT-X dual attention in layer 0 and QK RMSNorm.

    build_pipeline(dir, sd35=False) -> dir (idempotent)
    build_shards(dir) -> image shards of 20 shapes-world images at 32 px (16 train; idempotent)
    config_overrides(pipe, shards, latents, out) -> --set items pointing configs/imagegen/sd3-medium.toml at them
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ("a an the small large tiny big blue red green yellow purple orange pale dark circle square triangle "
         "star in on at of upper lower left right center middle bottom top corner background with and").split()
LETTERS = "abcdefghijklmnopqrstuvwxyz"
CLIP_L, CLIP_G, T5_WIDTH = 32, 48, 96
POOLED = CLIP_L + CLIP_G
ROOT = Path(__file__).parents[2]
SD3_CONFIG = ROOT / "configs" / "imagegen" / "sd3-medium.toml"
RESOLUTION = 32  # pixels; the VAE's factor 2 and the transformer's patch 2 give 8x8 image tokens
MAX_SEQUENCE_LENGTH = 16  # T5 tokens in the tests (diffusers' default 256 is real work on a CPU)


def clip_tokenizer(pad_token: str = "<|endoftext|>"):
    """A CLIPTokenizer (model_max_length 77, as SD3's) whose vocabulary is the letters and WORDS."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for piece in [*LETTERS, *(c + "</w>" for c in LETTERS)]:
        vocab.setdefault(piece, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in WORDS:  # merge left to right: w o r d</w> -> wo r d</w> -> wor d</w> -> word</w>
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            pair = (parts[0], parts[1])
            if pair not in merges:
                merges.append(pair)
            vocab.setdefault(parts[0] + parts[1], len(vocab))
            parts = [parts[0] + parts[1], *parts[2:]]
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77, pad_token=pad_token)


def t5_tokenizer():
    """A T5 (unigram) tokenizer with one piece per word of WORDS and single letters for anything else."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in WORDS] + [(c, -3.0) for c in LETTERS]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def build_pipeline(out: Path, sd35: bool = False, seed: int = 0) -> Path:
    """Write a tiny random StableDiffusion3Pipeline directory (SD3.5's MMDiT-X with `sd35`); idempotent."""
    out = Path(out)
    if (out / "model_index.json").is_file():
        return out
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tok_l, tok_g, tok_t5 = clip_tokenizer(), clip_tokenizer(pad_token="!"), t5_tokenizer()

    def clip(width: int, layers: int, pad_id: int, s: int) -> CLIPTextModelWithProjection:
        torch.manual_seed(s)
        return CLIPTextModelWithProjection(CLIPTextConfig(
            bos_token_id=0, eos_token_id=1, pad_token_id=pad_id, hidden_size=width, intermediate_size=2 * width,
            num_attention_heads=4, num_hidden_layers=layers, vocab_size=len(tok_l), projection_dim=width,
            max_position_embeddings=77, hidden_act="gelu"))

    text_encoder, text_encoder_2 = clip(CLIP_L, 3, 1, seed + 1), clip(CLIP_G, 2, 2, seed + 2)
    torch.manual_seed(seed + 3)
    text_encoder_3 = T5EncoderModel(T5Config(
        vocab_size=len(tok_t5), d_model=T5_WIDTH, d_kv=16, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu", is_encoder_decoder=False))
    torch.manual_seed(seed + 4)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=RESOLUTION, use_quant_conv=False,
                        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5305)
    torch.manual_seed(seed + 5)
    extra = dict(dual_attention_layers=(0,), qk_norm="rms_norm") if sd35 else {}
    transformer = SD3Transformer2DModel(
        sample_size=RESOLUTION // 2, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, caption_projection_dim=32, joint_attention_dim=T5_WIDTH, pooled_projection_dim=POOLED,
        pos_embed_max_size=16, **extra)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    vae=vae, text_encoder=text_encoder, tokenizer=tok_l, text_encoder_2=text_encoder_2,
                                    tokenizer_2=tok_g, text_encoder_3=text_encoder_3, tokenizer_3=tok_t5)
    tmp = out.with_name(out.name + ".tmp")
    pipe.save_pretrained(tmp)
    tmp.rename(out)
    return out


def load_pipeline(path: Path, pipeline: str = "StableDiffusion3Pipeline"):
    """<pipeline>.from_pretrained(path) in fp32 on the CPU, progress bars off."""
    import diffusers

    pipe = getattr(diffusers, pipeline).from_pretrained(path, torch_dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_shards(base: Path) -> Path:
    """Image shards of 16 shapes-world images (32 px, 8 per shard) under base/shards; idempotent."""
    from atelier_studio.data.shards import write_image_shards
    from atelier_studio.data.synthetic import generate_world

    base = Path(base)
    if not (base / "shards" / "index.json").is_file():
        generate_world(base / "world", n=20, seed=3, image_size=RESOLUTION, eval_fraction=0.2)
        write_image_shards(base / "world", base / "world" / "captions.jsonl", base / "shards", 8, progress=False)
    return base / "shards"


def config_overrides(pipe: Path, shards: Path, latents: Path, out: Path, *extra: str) -> list[str]:
    """The shipped SD3 config pointed at a tiny pipeline: fp32, 32 px, 16 T5 tokens, 3 steps of batch 4."""
    return [f"model.path={pipe}", "model.dtype=float32", "text.dtype=float32",
            f"text.max_sequence_length={MAX_SEQUENCE_LENGTH}", f"data.image_shards={shards}", f"data.shards={latents}",
            f"data.resolution={RESOLUTION}", "data.cache_batch=4", "train.max_steps=3", "train.micro_batch=4",
            "train.warmup_steps=0", "train.lr=1e-3", "train.log_every=1", "train.save_every=0", "train.eval_every=0",
            "sample.every=0", "ema.decay=0.5", "output.tensorboard=false", f"output.dir={out}", *extra]
