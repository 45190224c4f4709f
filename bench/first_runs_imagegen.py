"""The first real-size imagegen run on one GPU: SD3-medium's MMDiT at 1024 px, through the user-facing CLI.

    from atelier_studio.bench.first_runs_imagegen import imagegen_run
    report = imagegen_run(Path("/tmp/atelier-first-runs"), Path("out/first-runs.log"))          # the H200 run
    report = imagegen_run(tmp, tmp / "log", tiny=True, dtype="float32")                     # the CPU test

Steps (each skipped when its output already exists, so a re-run only trains again):
1. `atelier imagegen init --size sd3-medium --dtype bfloat16 --pooled-dim 4096` -> WORK/mmdit-sd3m.
2. A stand-in text encoder (no weights can be downloaded): `atelier data tokenizer` on a few generated
   captions, then a random-init 1-layer Qwen3 of width 4096 saved with transformers -> WORK/text-enc.
3. A stand-in autoencoder: a random-init diffusers AutoencoderKL with 16 latent channels at factor 8 and
   tiny widths -> WORK/vae. `ImagegenTask` loads one at startup and checks in_channels == latent_channels
   and that buckets tile by downsample_factor x patch; no `pixel:<p>` spec gives 16 channels (it gives
   3p²). With samples and eval off it is never run.
4. Random latent shards (random data, never zeros: zeros run faster) in the layout `atelier imagegen cache`
   writes: shard-*.tar + index.json (`data.shards.write_latent_shards`) + cache.json -> WORK/latents.
5. `atelier imagegen train` with WORK/ig.toml: bf16 autocast over fp32 master weights, logit-normal
   timesteps with shift 3.0, EMA 0.9999, 20 steps, micro-batch 16, then 8 only if 16 ran out of memory.

Shape legend: N samples, C = 16 latent channels, h = w = 128 latent side (1024 px / 8), L = 333 text
tokens (SD3's 77 CLIP + 256 T5), D = 4096 text width. Per sample: latent [C, h, w], text_states [L, D],
pooled [D], all bf16 (as a bf16 cache would hold them); bucket (1024, 1024).

`tiny=True` runs the very same functions at the shapes of `TINY` (latent 16 x 16 x 16, text width 64,
16 tokens, batch 2, 3 steps) so the CPU test exercises this exact path.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

from atelier_studio.bench.harness import atelier, read_run

# SD3's VAE latent normalisation: the stand-in VAE carries the same constants.
SD3_SCALING, SD3_SHIFT = 1.5305, 0.0609
VAE_FACTOR = 8  # 2^(4 blocks - 1): SD3's VAE downsampling
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory")


@dataclass(frozen=True)
class RunShape:
    """Everything that differs between the real run and the tiny CPU one."""

    tag: str  # directory suffix: WORK/mmdit-<tag>
    size: str  # `atelier imagegen init --size`
    resolution: int  # pixel side of the single (square) bucket
    latent_channels: int
    text_width: int  # the stand-in text encoder's hidden size = joint_attention_dim = pooled_projection_dim
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_intermediate: int
    max_length: int  # L text tokens
    micro_batches: tuple[int, ...]  # tried in order; the next only when the previous ran out of memory
    max_steps: int
    extra_samples: int  # beyond max_steps x the largest micro-batch
    vocab_size: int  # asked of `atelier data tokenizer` (BPE may stop below it)
    shard_size: int

    @property
    def latent_side(self) -> int:
        return self.resolution // VAE_FACTOR

    @property
    def num_samples(self) -> int:
        return self.max_steps * max(self.micro_batches) + self.extra_samples


SD3M = RunShape(tag="sd3m", size="sd3-medium", resolution=1024, latent_channels=16, text_width=4096, text_heads=32,
                text_kv_heads=8, text_head_dim=128, text_intermediate=1024, max_length=333, micro_batches=(16, 8),
                max_steps=20, extra_samples=32, vocab_size=500, shard_size=64)
TINY = RunShape(tag="tiny", size="tiny", resolution=128, latent_channels=16, text_width=64, text_heads=4,
                text_kv_heads=2, text_head_dim=16, text_intermediate=64, max_length=16, micro_batches=(2,),
                max_steps=3, extra_samples=2, vocab_size=300, shard_size=4)

DEVIATIONS = [
    "pooled_projection_dim is 4096 (SD3-medium: 2048) because the stand-in text encoder's width is 4096; "
    "the pooled projection is a negligible share of FLOPs",
    "text encoder: a random-init 1-layer Qwen3 of width 4096 (causal-lm, 333 tokens, mean pooling) stands in "
    "for SD3's CLIP-L/G + T5-XXL; it only encodes the empty caption (caption dropout) once at startup, the "
    "training step reads cached text states, so the step's shapes are SD3's (333 x 4096)",
    "autoencoder: a random-init diffusers AutoencoderKL (16 latent channels, factor 8, tiny widths) stands in "
    "for SD3's VAE: ImagegenTask loads one at startup and checks in_channels == latent_channels, and no "
    "'pixel:<p>' spec has 16 channels (3p²); samples and eval are off, so it never runs",
    "data: random N(0, 1) latents, text states and pooled vectors (bf16), one 1024x1024 bucket, not encoded images",
]


# ----------------------------------------------------------------------------- stand-ins


def _captions(n: int) -> list[str]:
    """Shapes-world-like captions for the tokenizer corpus (deterministic)."""
    sizes, colours = ("small", "medium", "large"), ("red", "blue", "green", "yellow", "purple", "black", "white")
    shapes, places = ("circle", "square", "triangle", "star", "hexagon"), ("upper left", "center", "lower right")
    return [f"a {sizes[i % 3]} {colours[i % 7]} {shapes[i % 5]} in the {places[i % 3]} on a "
            f"{colours[(i + 3) % 7]} background" for i in range(n)]


def write_text_encoder(out: Path, shape: RunShape, dtype: torch.dtype, log: Path) -> Path:
    """`atelier data tokenizer` + a random-init 1-layer Qwen3ForCausalLM of width shape.text_width, in `out`."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    corpus = out.parent / f"{out.name}-corpus.txt"
    corpus.write_text("\n".join(_captions(200)) + "\n")
    code, _ = atelier("data", "tokenizer", "--corpus", str(corpus), "--vocab-size", str(shape.vocab_size),
                      "--out", str(out), log=log)
    if code != 0:
        raise RuntimeError(f"`atelier data tokenizer` failed with code {code}; see {log}")
    vocab = len(AutoTokenizer.from_pretrained(str(out), local_files_only=True))
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=shape.text_width, num_hidden_layers=1,
                      num_attention_heads=shape.text_heads, num_key_value_heads=shape.text_kv_heads,
                      head_dim=shape.text_head_dim, intermediate_size=shape.text_intermediate,
                      max_position_embeddings=max(512, shape.max_length), tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(0)
        Qwen3ForCausalLM(cfg).to(dtype).save_pretrained(out)
    return out


def write_vae(out: Path, shape: RunShape) -> Path:
    """A random-init AutoencoderKL with SD3's latent channels, factor and scaling, at tiny widths (never run)."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=shape.latent_channels,
                            block_out_channels=(8,) * 4, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=4,
                            sample_size=shape.resolution, scaling_factor=SD3_SCALING, shift_factor=SD3_SHIFT,
                            use_quant_conv=False, use_post_quant_conv=False)
    vae.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------- latents


def random_latent_samples(shape: RunShape, dtype: torch.dtype, seed: int = 0) -> Iterator[dict]:
    """N random samples as `atelier imagegen cache` yields them: latent [C,h,w], text_states [L,D], pooled [D]."""
    gen = torch.Generator().manual_seed(seed)
    captions = _captions(shape.num_samples)
    s = shape.latent_side
    for i in range(shape.num_samples):
        yield {"key": f"{i:09d}", "caption": captions[i], "bucket": (shape.resolution, shape.resolution),
               "latent": torch.randn(shape.latent_channels, s, s, generator=gen).to(dtype),  # [C, h, w]
               "text_states": torch.randn(shape.max_length, shape.text_width, generator=gen).to(dtype),  # [L, D]
               "pooled": torch.randn(shape.text_width, generator=gen).to(dtype)}  # [D]


def _cache_meta(shape: RunShape, dtype: torch.dtype, text_enc: Path, vae: Path) -> dict:
    """cache.json with the fields imagegen/cache.py records, plus what makes this set synthetic."""
    return {"autoencoder": str(vae), "latent_channels": shape.latent_channels, "downsample_factor": VAE_FACTOR,
            "text_encoder": str(text_enc.resolve()), "text_kind": "causal-lm", "max_length": shape.max_length,
            "layer": -1, "pooled": "mean", "hidden_size": shape.text_width, "resolution": shape.resolution,
            "samples": shape.num_samples, "bad": 0, "bad_by_reason": {},
            "synthetic": "random normal, seed 0", "dtype": str(dtype).removeprefix("torch.")}


def write_random_latents(out: Path, shape: RunShape, dtype: torch.dtype, text_enc: Path, vae: Path) -> Path:
    """Random latent shards + index.json + cache.json at `out`; kept when an identical set is already there."""
    from atelier_studio.data.shards import read_index, write_latent_shards
    from atelier_studio.imagegen.cache import CACHE_META

    meta = _cache_meta(shape, dtype, text_enc, vae)
    if read_index(out) is not None and (out / CACHE_META).is_file() and \
            json.loads((out / CACHE_META).read_text()) == meta:
        return out
    if out.exists():
        shutil.rmtree(out)
    write_latent_shards(random_latent_samples(shape, dtype), out, shape.shard_size)
    (out / CACHE_META).write_text(json.dumps(meta, indent=1) + "\n")
    return out


# ----------------------------------------------------------------------------- config and runs


def write_config(path: Path, shape: RunShape, model: Path, text_enc: Path, vae: Path, latents: Path,
                 dtype: str) -> Path:
    """The run's TOML (micro_batch and output.dir are set per attempt with --set)."""
    path.write_text(f"""# written by bench/first_runs_imagegen.py
[model]
path = "{model}"
dtype = "{dtype}"

[autoencoder]
spec = "{vae}"            # stand-in: loaded at startup for its channels and factor, never run

[text]
encoder = "{text_enc}"
kind = "causal-lm"
max_length = {shape.max_length}
pooled = "mean"
dtype = "{dtype}"
caption_dropout = 0.1

[data]
shards = "{latents}"
resolution = {shape.resolution}

[flow]
timestep_sampling = "logit_normal"
shift = 3.0

[ema]
decay = 0.9999
update_every = 1

[sample]
every = 0

[train]
max_steps = {shape.max_steps}
lr = 1e-4
warmup_steps = 2
log_every = 1
eval_every = 0
save_every = 0
resume = "never"
seed = 0

[output]
tensorboard = false
""")
    return path


def _log_tail(log: Path, start: int) -> str:
    with open(log, "rb") as fh:
        fh.seek(start)
        return fh.read().decode("utf-8", errors="replace")


def imagegen_run(work: Path, log: Path, tiny: bool = False, dtype: str = "bfloat16",
                 keep_weights: bool = False) -> dict:
    """Init, stand-ins, random latents, then `atelier imagegen train` per micro-batch; returns the report.

    {"init_code", "init_seconds", "setup_seconds", "shape", "deviations",
     "runs": {"bs16": {"code", "seconds", "oom", "summary", "metrics", "weights_deleted"}, ...}}.
    Without keep_weights each run's checkpoints/ and exported transformer/ and ema/ are deleted after it
    (tens of GB of random weights at SD3-medium size) so that a second attempt has disk to write its own.
    """
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"imagegen_run: dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    shape = TINY if tiny else SD3M
    torch_dtype = getattr(torch, dtype)
    work, log = Path(work), Path(log)
    work.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.touch()
    model = work / f"mmdit-{shape.tag}"
    result: dict = {"init_seconds": 0.0, "init_code": 0, "shape": asdict(shape), "deviations": list(DEVIATIONS),
                    "runs": {}}
    if not (model / "config.json").is_file():
        extra = ["--joint-attention-dim", str(shape.text_width)] if tiny else []  # sd3-medium's is 4096 already
        code, seconds = atelier("imagegen", "init", "--size", shape.size, "--out", str(model), "--dtype", dtype,
                                "--pooled-dim", str(shape.text_width), *extra, log=log)
        result.update(init_code=code, init_seconds=seconds)
        if code != 0:
            return result
    start = time.time()
    suffix = "" if shape is SD3M else f"-{shape.tag}"
    text_enc = work / f"text-enc{suffix}"
    if not (text_enc / "config.json").is_file():
        write_text_encoder(text_enc, shape, torch_dtype, log)
    vae = work / f"vae{suffix}"
    if not (vae / "config.json").is_file():
        write_vae(vae, shape)
    latents = write_random_latents(work / f"latents{suffix}", shape, torch_dtype, text_enc, vae)
    config = write_config(work / f"ig{suffix}.toml", shape, model, text_enc, vae, latents, dtype)
    result["setup_seconds"] = time.time() - start

    for micro_batch in shape.micro_batches:
        out = work / f"imagegen-{shape.tag}-bs{micro_batch}"
        if out.exists():  # a stale summary.json must not pass for this run's
            shutil.rmtree(out)
        offset = log.stat().st_size
        code, seconds = atelier("imagegen", "train", "--config", str(config),
                                "--set", f"train.micro_batch={micro_batch}", "--set", f"output.dir={out}", log=log)
        oom = code != 0 and bool(OOM.search(_log_tail(log, offset)))
        result["runs"][f"bs{micro_batch}"] = {"code": code, "seconds": seconds, "oom": oom, **read_run(out)}
        if not keep_weights:  # summary.json's "exports" then name deleted paths: say so
            for name in ("checkpoints", "transformer", "ema"):
                shutil.rmtree(out / name, ignore_errors=True)
            result["runs"][f"bs{micro_batch}"]["weights_deleted"] = True
        if not oom:  # success, or a failure a smaller batch would not fix
            break
    return result


__all__ = ["imagegen_run", "RunShape", "SD3M", "TINY", "DEVIATIONS", "write_text_encoder", "write_vae",
           "random_latent_samples", "write_random_latents", "write_config"]
