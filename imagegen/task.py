"""The imagegen task on the shared engine: rectified flow on cached latents, one aspect bucket per batch.

Shape legend: B images, C latent channels, h/w latent size, p MMDiT patch, N = (h/p)(w/p) image tokens,
L text tokens (fixed: every caption is padded to the same length), D text width, P pooled width.

Per micro-batch (conventions in imagegen/flow.py): t from `flow.sample_timesteps` (logit-normal, shifted;
the image token count feeds the dynamic shift), noise ~ N(0, I), x_t = (1 - t) x0 + t noise, the model
predicts v = noise - x0 at timestep t * 1000, and the loss is the per-image `flow_loss` summed (the
trainer divides by the number of images of the optimizer step). Caption dropout (for CFG at sampling,
imagegen/caption_dropout.py) replaces a caption's cached states and pooled vector, or each encoder's part of
them, by the empty caption's (or zeros) with probability text.caption_dropout.

Data (data/latent_stream.py): the training latents stream from the shards with bounded memory, as
data.streams logical streams (default: one per process); global micro-batch k is one chunk of one bucket
from every stream, and a rank runs the chunks of the streams it holds (one, unless it holds several, as
one process replaying a multi-process run does: then each chunk is a micro-batch of the step). With
data.resolutions the latents of each resolution are their own shard set (<shards>/r<px>) and global micro-batch k
is from one resolution, the same on every stream (data/latent_stream.py ResolutionPlan); evaluation reports each
resolution's loss too, and the sample grid renders at each. A chunk's
draws (timesteps, noise, caption dropout) come from a generator seeded by (train.seed, k, stream), so any
number of processes with the same data.streams and global batch draws the same, and resume is exact without
any RNG state. The eval set is small and held in memory (at most data.max_eval_images).

Text: one encoder (its hidden size is both joint_attention_dim and pooled_projection_dim) or SD3's three
(`text.kind = "sd3"`: states of T5's width, pooled of the two CLIP projections; 4096 and 2048 for the released
models). With `text.kind = "sd3"` the export also writes `pipeline/`: the SD3 pipeline the encoders came from
with the trained transformer (EMA weights when EMA is on) in it, so `StableDiffusion3Pipeline.from_pretrained`
renders what `atelier imagegen sample` renders (imagegen/export.py). After the data is read, the only captions the
task encodes are the sample grid's fixed prompts: they are encoded once (`text.EncodedPrompts`) and the text
encoders are freed, so T5-XXL does not hold GPU memory through the run.

Several processes (torchrun, `dist.enabled`): the MMDiT is wrapped by `pipeline.distributed.parallelize`
(activation checkpointing -> compile -> FSDP2, one unit per joint block) and, with
train.distributed.init = "sharded", built on the meta device and filled with only this rank's rows of
each tensor (imagegen/hf.weight_map); "full" loads it whole on every rank first. The EMA is built after
wrapping (sharded like the weights, saved sharded). Everything that runs the model runs on every rank
(evaluation, the sample grid, EMA swaps); only rank 0 writes files. Evaluation sums and counts (and
the training timestep-bin counters) are summed over ranks. The EMA's full copy for the export is
gathered in the evaluation of the last step, which the trainer runs on every rank just before its
rank-0 export.

Precision (docs/training.md): fp32 master weights; `model.dtype = "bfloat16"` runs the forward under bf16
autocast, "float32" is exact. The loss is reduced in fp32.

`train.precision = "fp8"` (pipeline/float8.py) computes the joint blocks' attention projections and MLPs and the
caption projection in FP8 and keeps, in the model's dtype, what the family's `fp8_skip` names (imagegen/model.py:
the linears that run once per image, the timestep and pooled-text embedders and every AdaLN modulation, and the
final projection). One process only.

Evaluation and the sample grid use their own seeded generators, so they never move the training RNG:
eval images get fixed noise and fixed timesteps t = (k + 0.5) / 8 (k = image index mod 8), the loss is
reported overall and in 4 timestep bins (`loss_t00` covers t in [0, 0.25), ... `loss_t75` [0.75, 1)),
plus the same for the EMA weights, plus the training loss by bin accumulated since the last eval.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from atelier_studio.data.buckets import LatentDataset, rank_rows
from atelier_studio.data.latent_stream import LatentStream, StreamConfig, first_sample
from atelier_studio.data.shards import read_index, read_latent_shards
from atelier_studio.data.textfile import read_json, read_lines
from atelier_studio.imagegen.autoencoder import SD3VAE, load_autoencoder, resolve_autoencoder_spec
from atelier_studio.imagegen.cache import CACHE_META, cache_split, check_resolutions
from atelier_studio.imagegen.caption_dropout import drop_captions, drop_mask
from atelier_studio.imagegen.config import ImagegenConfig
from atelier_studio.imagegen.ema import EMA
from atelier_studio.imagegen.flow import add_noise, flow_loss, sample_timesteps
from atelier_studio.imagegen.hf import build_model, load_pretrained, read_args, resolve_dir, save_pretrained, weight_map
from atelier_studio.imagegen.lora import (
    LORA_FILE,
    apply_lora,
    load_lora,
    lora_layers,
    read_lora,
    save_lora,
    target_modules,
)
from atelier_studio.imagegen.model import MMDiT
from atelier_studio.imagegen.registry import family_of_args
from atelier_studio.imagegen.sample import make_grid, make_grid_column, sample_images, write_run_meta
from atelier_studio.imagegen.sd3_dir import scheduler_config
from atelier_studio.imagegen.sd3_text import load_text_encoder
from atelier_studio.imagegen.text import PIPELINE_TEXT_KINDS, EncodedPrompts, text_encoder_dir
from atelier_studio.pipeline.atomic import atomic_file
from atelier_studio.pipeline.config import ConfigError
from atelier_studio.pipeline.distributed import (
    DistContext,
    all_gather_objects,
    all_reduce_sum,
    is_sharded,
    materialize_,
    parallelize,
)
from atelier_studio.pipeline.float8 import apply_precision, check_precision
from atelier_studio.pipeline.lora import LoraArgs, lora_init_like
from atelier_studio.pipeline.lora_fp8 import FP8_CONVERSIONS
from atelier_studio.pipeline.progress import log
from atelier_studio.pipeline.task import Samples, Skipped, Task

NUM_BINS = 4
EVAL_T_GRID = 8  # eval timesteps (k + 0.5) / 8: two per bin


@dataclass
class ImageBatch:
    """One bucket's micro-batch on the device."""

    latent: torch.Tensor  # [B, C, h, w]
    text_states: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor  # [B, D]
    bucket: tuple[int, int]  # pixels (H, W)
    # training batches: (global micro-batch number, data stream) of the chunk it is; keys the random draws
    chunk: tuple[int, int] | None = None
    mask: torch.Tensor | None = None  # [B, h, w] loss weights in [0, 1] (data.mask), None: every position counts

    @property
    def size(self) -> int:
        return self.latent.shape[0]


def _bin_names() -> list[str]:
    return [f"loss_t{round(100 * k / NUM_BINS):02d}" for k in range(NUM_BINS)]


def draw_seed(seed: int, ordinal: int, stream: int) -> int:
    """The seed of the draws of stream `stream`'s chunk of global micro-batch `ordinal`: (seed, ordinal, stream)
    mixed by numpy's SeedSequence."""
    return int(np.random.SeedSequence([seed, ordinal, stream]).generate_state(1, dtype=np.uint64)[0])


class ImagegenTask(Task):
    unit = "images"
    # the inputs' embeddings (patches, timestep, pooled text, text tokens) and the output projection, in diffusers'
    # names: AdamW's under Muon (the blocks and the AdaLN linears are the hidden layers)
    outer_layers = ("pos_embed.", "x_embedder.", "time_text_embed.", "context_embedder.", "proj_out.")

    def __init__(self, cfg: ImagegenConfig, device: torch.device, dist: DistContext | None = None):
        self.cfg, self.device = cfg, device
        self.dist = dist if dist is not None else DistContext(device=device)
        rank, world_size = self.dist.rank, self.dist.world_size
        self.flow = cfg.flow.args()
        self.autocast = cfg.model.dtype != "float32"
        check_precision(cfg.train, device, self.dist.enabled, frozen_bases=cfg.lora.rank > 0)
        self.lora, self.lora_targets = self._lora_settings()
        # full fine-tuning: fp32 master weights; LoRA: the frozen base in the compute dtype, adapters in lora.dtype
        base_dtype = torch.bfloat16 if self.lora is not None and self.autocast else torch.float32
        sharded_init = self.dist.enabled and cfg.train.distributed.init == "sharded"
        self.model = self._build_sharded(base_dtype) if sharded_init else self._wrap(self._build(base_dtype))
        self._gen = torch.Generator(device=device)  # re-seeded per global micro-batch
        self._step = 0  # optimizer steps done (after_optimizer_step / the checkpoint)
        self._ema_export: dict[str, torch.Tensor] | None = None  # gathered at the last step's evaluation
        self.autoencoder = load_autoencoder(resolve_autoencoder_spec(cfg.autoencoder.spec, cfg.model.path)).to(device)
        self.text = load_text_encoder(cfg.text, device, cfg.model.path)
        self._check_dims()
        if cfg.text.kind in PIPELINE_TEXT_KINDS and not self._exports_pipeline():
            log(f"imagegen: autoencoder.spec {cfg.autoencoder.spec!r} is not a diffusers VAE: the run exports "
                f"transformer/ but no pipeline/ directory")
        if self._exports_pipeline():  # the export copies the base's scheduler: a bad one is named now, not at the end
            scheduler_config(text_encoder_dir(cfg.text, cfg.model.path))
        self.empty_states, self.empty_pooled = (x.float() for x in self.text.empty())  # [L, D], [P]

        out = Path(cfg.output.dir)
        d = cfg.data
        check_resolutions(cfg, self.autoencoder.downsample_factor, self.model.args.patch_size)
        # resolution -> its latent shard set (one for data.resolution; <shards>/r<px> for each of data.resolutions)
        self.train_sources = self._latents(d.shards, out / "cache" / "train")
        self.stream = LatentStream(self.train_sources if d.multires else self.train_sources[d.resolution],
                                   StreamConfig(
            cfg.train.micro_batch, rank, world_size, streams=d.streams, shuffle_buffer=d.shuffle_buffer,
            seed=cfg.train.seed, workers=d.loader_workers, max_bad_fraction=d.max_bad_fraction,
            pin_memory=device.type == "cuda", resolution_weights=d.resolution_weights))
        for (resolution, source), shards in zip(self.train_sources.items(), self.stream.sets):
            first = first_sample(shards)
            self._check_latents(first["shapes"], first["key"], first["shard"],
                                list(shards.buckets or [first["bucket"]]), source, resolution)
            self._check_masks(first["shapes"], first["key"], source)
        # held out and small: kept in memory, at most max_eval_images of it per resolution
        self.eval_sets: dict[int, LatentDataset] = {}
        for resolution, source in (self._latents(d.eval_shards, out / "cache" / "eval") if d.eval_shards else
                                   {}).items():
            ds = self.eval_sets[resolution] = LatentDataset(source, max_bad_fraction=d.max_bad_fraction,
                                                            limit=d.max_eval_images)
            s = ds[0]
            self._check_latents({n: tuple(s[n].shape) for n in ("latent", "text_states", "pooled")}, s["key"],
                                s["shard"], ds.buckets, source, resolution)
            self._check_masks({n: tuple(v.shape) for n, v in s.items() if n == "mask"}, s["key"], source)
        self.eval_set = next(iter(self.eval_sets.values()), None)  # the (first) resolution's: default prompts
        # after wrapping: the shadow is sharded like the weights
        self.ema = EMA(self.model, cfg.ema.decay, cfg.ema.update_every) if cfg.ema.decay > 0 else None
        self.prompts = self._prompts()
        # the only captions encoded from here on are the sample grid's: encode them now and let the encoders go
        self.text = EncodedPrompts(self.text, self.prompts)
        # training loss by timestep bin, accumulated on the device (no sync) and read at evaluation
        self._bin_sum = torch.zeros(NUM_BINS, device=device, dtype=torch.float64)
        self._bin_count = torch.zeros(NUM_BINS, device=device, dtype=torch.float64)
        n = sum(p.numel() for p in self.model.parameters())
        trained = (f"LoRA r{self.lora.rank} on {len(lora_layers(self.model))} linears, "
                   f"{sum(p.numel() for p in self.model.parameters() if p.requires_grad) / 1e6:.3f}M trainable"
                   if self.lora is not None else "full fine-tuning")
        log(f"imagegen: {n / 1e6:.3f}M parameters ({trained}), {cfg.model.dtype} on {device}; train data: "
            f"{self.stream.describe()}; EMA {cfg.ema.decay if self.ema else 'off'}")

    # ------------------------------------------------------------------ model

    def _lora_settings(self) -> tuple[LoraArgs | None, tuple[str, ...]]:
        """(the LoRA layers' args, the block paths they wrap), or (None, ()) for full fine-tuning. The targets are
        checked against model.path's family before any weight is read; an init_adapter gives its own alpha."""
        lc = self.cfg.lora
        if lc.rank == 0:
            return None, ()
        family = family_of_args(read_args(self.cfg.model.path))
        try:
            targets = family.resolve_lora_targets(lc.targets)
        except ValueError as e:
            raise ConfigError(f"lora.targets: {e}") from None
        args = lc.args()
        if lc.init_adapter:
            adapter, _ = read_lora(lc.init_adapter)
            if adapter.rank != lc.rank:
                raise ConfigError(f"lora.init_adapter {lc.init_adapter} has rank {adapter.rank}, but lora.rank is "
                                  f"{lc.rank}; set lora.rank = {adapter.rank}")
            args = dataclasses.replace(adapter, dtype=lc.dtype)
        return args, targets

    def _add_lora(self, model: MMDiT) -> dict[str, torch.Tensor]:
        """Wrap the target linears (lora.targets, or init_adapter's modules) in place; returns the adapters'
        initial weights by parameter name: init_adapter's, or on a meta-device model (a sharded build) the draws
        one process makes, so every process count starts from the same adapter."""
        meta = next(model.parameters()).is_meta
        if self.cfg.lora.init_adapter:
            load_lora(model, self.cfg.lora.init_adapter, dtype=self.lora.dtype)
            return read_lora(self.cfg.lora.init_adapter)[1] if meta else {}
        modules = target_modules(model, self.lora_targets)
        init = lora_init_like([(n, model.get_submodule(n)) for n in modules], self.lora, self.device) if meta else {}
        apply_lora(model, self.lora, modules)
        return init

    def _build(self, base_dtype: torch.dtype) -> MMDiT:
        """One process (or init = "full"): load the whole model, then add the LoRA layers (rank > 0)."""
        cfg = self.cfg
        model = load_pretrained(cfg.model.path, dtype=base_dtype, device=self.device, kernels=cfg.model.kernels,
                                attention=cfg.model.attention)
        if self.lora is not None:
            self._add_lora(model)
        return model

    def _wrap(self, model: MMDiT) -> MMDiT:
        """AC -> compile -> FSDP2 per joint block (a no-op wrap on one process without policies).

        First, the parameters the forward never applies are frozen: the last block's text-query projection
        (kept only for diffusers' layout, imagegen/model.py Attention). They never get a gradient, so AdamW
        never makes state for them, and a sharded resume would look for that state in the checkpoint.
        """
        # FP8 linears first: the policies below wrap what runs; the family names what stays in the model's dtype; a
        # LoRA layer's frozen base goes to FP8 with it, its adapters never (pipeline/lora_fp8.py)
        apply_precision(model, self.cfg.train, family_of_args(model.args).fp8_skip, conversions=FP8_CONVERSIONS)
        for block in model.transformer_blocks:
            if block.attn.to_add_out is None:  # context_pre_only: no text output, no text queries
                for m in (block.attn.add_q_proj, getattr(block.attn, "norm_added_q", None)):
                    if m is not None:
                        m.requires_grad_(False)
        choice = self.cfg.train.distributed.param_dtype
        if choice == "auto" and self.lora is not None and self.autocast:
            param_dtype = None  # each its own: the bf16 frozen base, the adapters in lora.dtype
        elif choice == "auto":
            param_dtype = torch.bfloat16 if self.autocast else torch.float32
        else:
            param_dtype = getattr(torch, choice)
        return parallelize(model, family_of_args(model.args).blocks(model), self.dist, self.cfg.train.distributed,
                           param_dtype)

    def _build_sharded(self, base_dtype: torch.dtype) -> MMDiT:
        """Meta model -> LoRA -> wrap -> each rank reads only its rows of every tensor from the safetensors files
        (and of the adapters' initial weights)."""
        from safetensors import safe_open

        model_dir = resolve_dir(self.cfg.model.path)
        where = weight_map(model_dir, read_args(model_dir))
        with torch.device("meta"):
            model = build_model(read_args(model_dir, self.cfg.model.kernels, self.cfg.model.attention)).to(base_dtype)
        lora_init = self._add_lora(model) if self.lora is not None else {}
        self._wrap(model)

        def read(name: str, rows: slice) -> torch.Tensor:
            if name in lora_init:
                return lora_init[name][rows]
            key = name.replace(".base_layer.", ".")  # a LoRA-wrapped linear's base has the diffusers name
            return files[where[key]].get_slice(key)[rows]

        with contextlib.ExitStack() as stack:
            files = {f: stack.enter_context(safe_open(f, framework="pt", device="cpu"))
                     for f in sorted(set(where.values()))}
            materialize_(model, self.device, read)
        return model

    # ------------------------------------------------------------------ setup checks

    def _pooled_input_width(self) -> int:
        """The width of the model's third input: its pooled_projection_dim, or the text length L where the family
        takes the text mask there (Family.text_mask_input)."""
        return family_of_args(self.model.args).pooled_width(self.model.args, self.text.num_tokens)

    def _check_dims(self) -> None:
        a, d, p = self.model.args, self.text.states_width, self.text.pooled_width
        if a.joint_attention_dim != d or self._pooled_input_width() != p:
            what = (f"hidden size {d}" if d == p else
                    f"states {d} wide and a pooled vector of {p} ({self.cfg.text.kind} encoders)")
            raise ConfigError(
                f"text.encoder {self.text.path} gives {what}, but the MMDiT at model.path {self.cfg.model.path} "
                f"has joint_attention_dim {a.joint_attention_dim} and pooled_projection_dim "
                f"{self._pooled_input_width()}; they must be {d} and {p} (re-init with "
                f"joint_attention_dim={d}, pooled_projection_dim={p})")
        if a.in_channels != self.autoencoder.latent_channels:
            raise ConfigError(f"autoencoder.spec {self.cfg.autoencoder.spec!r} gives {self.autoencoder.latent_channels}"
                              f" latent channels, but the MMDiT at model.path has in_channels {a.in_channels}")

    def _check_cache_meta(self, source: str, resolution: int) -> None:
        """Latents cached with other text or VAE settings than this config's (same shapes, other numbers: a
        clip_skip, a T5-less cache, another VAE scaling), or at another resolution than the folder of
        data.resolutions they are read as, are named, with the key, instead of trained on."""
        meta_path = Path(source) / CACHE_META
        if not meta_path.is_file():  # image shards (encoded here, with this config), or a cache from elsewhere
            return
        meta = read_json(meta_path, ConfigError)
        if self.cfg.data.multires and meta.get("resolution", resolution) != resolution:
            raise ConfigError(f"{meta_path}: the latents were cached at resolution {meta['resolution']}, but "
                              f"data.resolutions reads them as its {resolution} px ones; re-run `atelier imagegen "
                              f"cache` with this config")
        now = {**self.text.settings(), "scaling_factor": self.autoencoder.scaling_factor,
               "shift_factor": self.autoencoder.shift_factor}
        keys = {"text_kind": "text.kind", "max_sequence_length": "text.max_sequence_length",
                "clip_skip": "text.clip_skip", "use_t5": "text.use_t5", "max_length": "text.max_length",
                "layer": "text.layer", "pooled": "text.pooled",
                "scaling_factor": "autoencoder.spec (its scaling_factor)",
                "shift_factor": "autoencoder.spec (its shift_factor)"}
        for k, key in keys.items():
            if k in meta and k in now and meta[k] != now[k]:
                raise ConfigError(f"{meta_path}: the latents were cached with {k} {meta[k]!r}, but {key} gives "
                                  f"{now[k]!r}; re-run `atelier imagegen cache` with this config")

    def _check_masks(self, shapes: dict[str, tuple[int, ...]], key: str, source: str) -> None:
        """data.mask asks for loss masks: the cache must hold them (they are made when it is written)."""
        mode = self.cfg.data.mask
        if mode != "none" and "mask" not in shapes:
            raise ConfigError(f"data.mask: {mode!r}, but the latents of {source} (key {key}) carry no loss mask: they "
                              f"were cached with data.mask = \"none\"; re-run `atelier imagegen cache` with "
                              f"--set data.mask={mode} (or train with data.mask = \"none\")")
        meta_path = Path(source) / CACHE_META
        if mode != "none" and meta_path.is_file():
            cached = read_json(meta_path, ConfigError).get("mask", "none")
            if cached != mode:
                raise ConfigError(f"{meta_path}: the latents' masks were cached with data.mask {cached!r}, but this "
                                  f"run asks for {mode!r}; re-run `atelier imagegen cache` with this config")

    def _check_latents(self, shapes: dict[str, tuple[int, ...]], key: str, shard: str,
                       buckets: list[tuple[int, int]], source: str, resolution: int) -> None:
        """A sample's tensor shapes (and the set's buckets and cache settings) against the model and the text config."""
        self._check_cache_meta(source, resolution)
        a = self.model.args
        checks = [("latent channels", shapes["latent"][0], a.in_channels, "MMDiT in_channels"),
                  ("text_states width", shapes["text_states"][1], a.joint_attention_dim, "joint_attention_dim"),
                  ("pooled width", shapes["pooled"][0], self._pooled_input_width(), "pooled_projection_dim"),
                  ("text tokens", shapes["text_states"][0], self.text.num_tokens,
                   {"sd3": "text.max_sequence_length + 77", "flux": "text.max_sequence_length",
                    "qwen-image": "text.max_sequence_length"}.get(
                       self.cfg.text.kind, "text.max_length"))]
        for what, got, want, of in checks:
            if got != want:
                raise ConfigError(f"{source} (key {key} in {shard}): {what} is {got}, but {of} is {want}; "
                                  f"re-run `atelier imagegen cache` with this config")
        bad = [b for b in buckets if not self._tiles(b)]
        if bad:
            raise ConfigError(f"{source}: buckets {bad} do not tile into MMDiT patches of {a.patch_size}")

    def _tiles(self, bucket: tuple[int, int]) -> bool:
        f, p = self.autoencoder.downsample_factor, self.model.args.patch_size
        return (bucket[0] // f) % p == 0 and (bucket[1] // f) % p == 0

    def _latents(self, source: str, cache_dir: Path) -> dict[int, str]:
        """resolution -> latent shards: as given (`DataConfig.latent_sources`: source, or source/r<px> for each of
        data.resolutions); image shards are encoded once into cache_dir (cache_dir/r<px>: small runs) and read
        from there."""
        index = read_index(Path(source)) if Path(source).is_dir() else None
        if index is None or index.get("kind") != "image":
            return self.cfg.data.latent_sources(source)
        if self.dist.world_size > 1:
            raise ConfigError(f"data.shards {source} holds images: with several ranks, cache them first "
                              f"(`atelier imagegen cache`)")
        log(f"{source} holds images: encoding them once into {cache_dir}")
        return cache_split(self.cfg, source, cache_dir, 1000, self.autoencoder, self.text, self.device,
                           patch_size=self.model.args.patch_size)

    def _prompts(self) -> list[str]:
        s = self.cfg.sample
        if s.every == 0:
            return []
        if s.prompts:
            return list(s.prompts)
        if s.prompts_file:
            path = Path(s.prompts_file)
            if not path.is_file():
                raise ConfigError(f"sample.prompts_file: not found: {path}")
            lines = [line.strip() for line in read_lines(path) if line.strip()]  # non-UTF-8: named path:line
            if not lines:
                raise ConfigError(f"sample.prompts_file: {path} has no prompts")
            return lines
        if self.eval_set is not None:  # default: the first captions of the held-out set (else the training set)
            return [self.eval_set[i]["caption"] for i in range(min(2 * s.columns, len(self.eval_set)))]
        first = next(iter(self.train_sources.values()))
        return [x["caption"] for x in itertools.islice(read_latent_shards(first), 2 * s.columns)]

    # ------------------------------------------------------------------ data

    def _to_device(self, b: dict, chunk: tuple[int, int] | None = None) -> ImageBatch:
        d = self.device
        mask = b["mask"].to(d, non_blocking=True).float() if self.cfg.data.mask != "none" else None
        return ImageBatch(b["latent"].to(d, non_blocking=True).float(),
                          b["text_states"].to(d, non_blocking=True).float(),
                          b["pooled"].to(d, non_blocking=True).float(), tuple(b["bucket"]), chunk, mask)

    @property
    def pieces_per_micro_batch(self) -> int:
        """Items of `train_batches` per micro-batch: one chunk per data stream this rank holds (data.streams /
        processes, 1 by default); each runs its own forward and backward, as gradient accumulation does."""
        return self.stream.chunks_per_micro_batch

    def train_batches(self) -> Iterator[ImageBatch]:
        for chunks in self.stream.chunks():
            for c in chunks:
                if not self._tiles(c["bucket"]):
                    raise ConfigError(f"{self.cfg.data.shards}: bucket {list(c['bucket'])} (key {c['keys'][0]}) does "
                                      f"not tile into MMDiT patches of {self.model.args.patch_size}")
                yield self._to_device(c, (c["ordinal"], c["stream"]))

    # ------------------------------------------------------------------ the step

    def batch_weight(self, b: ImageBatch) -> int:
        return b.size

    def batch_units(self, b: ImageBatch) -> int:
        return b.size

    def _image_tokens(self, b: ImageBatch) -> int:
        p = self.model.args.patch_size
        return (b.latent.shape[2] // p) * (b.latent.shape[3] // p)

    def batch_flops(self, b: ImageBatch) -> int:
        return family_of_args(self.model.args).train_flops(self.model, b.size, self._image_tokens(b),
                                                           b.text_states.shape[1])

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def _losses(self, b: ImageBatch, t: torch.Tensor, noise: torch.Tensor, states: torch.Tensor,
                pooled: torch.Tensor) -> torch.Tensor:
        """Per-image flow loss [B] (fp32) at times t [B] with noise [B, C, h, w]."""
        x_t = add_noise(b.latent, noise, t)  # [B, C, h, w]
        # a guidance-distilled model (FLUX.1-dev) trains at a fixed guidance input, model.guidance; others take none
        guidance = family_of_args(self.model.args).guidance_kwargs(self.model.args, self.cfg.model.guidance,
                                                                   b.size, self.device)
        with self._autocast():
            pred = self.model(x_t, states, pooled, t * 1000, **guidance)  # [B, C, h, w]
        return flow_loss(pred, b.latent, noise, t, self.flow, b.mask)

    def _draws(self, b: ImageBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(t [B], noise [B, C, h, w], caption-drop mask [B, K] or None) of a training chunk, from a generator
        seeded by (train.seed, global micro-batch, stream): the same on any number of processes. K = the text
        encoders (one draw per image, or per image and encoder with caption_dropout_encoders "independent")."""
        if b.chunk is None:
            raise ValueError("ImagegenTask.loss_sum: a training batch needs its chunk (train_batches)")
        B = b.size
        g = self._gen.manual_seed(draw_seed(self.cfg.train.seed, *b.chunk))
        t = sample_timesteps(B, g, self.flow, self._image_tokens(b), self.device)  # [B]
        noise = torch.randn((B, *b.latent.shape[1:]), generator=g, device=self.device)  # [B, C, h, w]
        drop = None
        tc, K = self.cfg.text, len(self.text.parts)
        if tc.caption_dropout > 0:
            shape = (B,) if tc.caption_dropout_encoders == "joint" else (B, K)
            uniform = torch.rand(shape, generator=g, device=self.device)  # [B] or [B, K]
            drop = drop_mask(uniform, tc.caption_dropout, tc.caption_dropout_encoders, K)  # [B, K]
        return t, noise, drop

    def loss_sum(self, b: ImageBatch) -> torch.Tensor:
        t, noise, drop = self._draws(b)
        states, pooled = b.text_states, b.pooled
        if drop is not None:
            empty = self.cfg.text.caption_dropout_fill == "empty"
            states, pooled = drop_captions(states, pooled, drop, self.text.parts,  # [B, L, D], [B, P]
                                           self.empty_states if empty else None, self.empty_pooled if empty else None)
        losses = self._losses(b, t, noise, states, pooled)  # [B]
        bins = (t.detach() * NUM_BINS).long().clamp(0, NUM_BINS - 1)
        self._bin_sum.index_add_(0, bins, losses.detach().double())
        self._bin_count.index_add_(0, bins, torch.ones_like(losses, dtype=torch.float64))
        return losses.sum()

    # ------------------------------------------------------------------ evaluation and samples

    def _eval_sums(self, ds: LatentDataset) -> list[float]:
        """[Σ loss, n, then Σ loss and n per timestep bin] over the eval images `ds` (one resolution's), summed over
        ranks.

        Fixed noise (a private CPU generator) and timesteps t = (k + 0.5) / 8 for the k-th image. The images
        go in global batches of world_size x micro_batch (one bucket each), each split over the ranks as the
        training batches are, so the draws and the numbers do not depend on the number of processes. A rank
        whose share of a short last batch is empty runs the forward on one image anyway and drops it: FSDP's
        forward is a collective, every rank must run as many.
        """
        limit = self.cfg.data.max_eval_images or len(ds)
        order = sorted(range(len(ds)), key=lambda i: (ds.bucket_ids[i], i))[:limit]  # bucket-grouped, fixed
        gen = torch.Generator().manual_seed(self.cfg.train.seed + 1)
        G = self.cfg.train.micro_batch * self.dist.world_size
        groups: dict[int, list[int]] = {}
        for i in order:
            groups.setdefault(ds.bucket_ids[i], []).append(i)
        sums = torch.zeros(2, NUM_BINS + 1, dtype=torch.float64)  # [Σ loss | count] x [all, bin 0..3]
        k = 0
        for idx in groups.values():
            for j in range(0, len(idx), G):
                chunk = idx[j:j + G]
                t = (torch.arange(k, k + len(chunk)) % EVAL_T_GRID + 0.5) / EVAL_T_GRID  # [G]
                first = ds[chunk[0]]["latent"]
                noise = torch.randn((len(chunk), *first.shape), generator=gen)  # [G, C, h, w], device independent
                k += len(chunk)
                offset, n = rank_rows(len(chunk), self.dist.rank, self.dist.world_size)
                keep = n > 0
                rows = slice(offset, offset + n) if keep else slice(0, 1)
                b = self._to_device(ds.batch(chunk[rows]))
                tr = t[rows].to(self.device)
                loss = self._losses(b, tr, noise[rows].to(self.device), b.text_states, b.pooled).double().cpu()
                if keep:
                    bins = (t[rows] * NUM_BINS).long().clamp(0, NUM_BINS - 1)
                    sums[0, 0] += loss.sum()
                    sums[1, 0] += len(loss)
                    sums[0, 1:].index_add_(0, bins, loss)
                    sums[1, 1:].index_add_(0, bins, torch.ones_like(loss))
        return all_reduce_sum(self.dist, sums.flatten().tolist())

    @staticmethod
    def _summarise(sums: list[float], prefix: str) -> dict[str, float]:
        total, count = sums[0], sums[NUM_BINS + 1]
        out = {f"{prefix}loss": total / count} if count else {}
        for k, name in enumerate(_bin_names()):
            s, n = sums[1 + k], sums[NUM_BINS + 2 + k]
            if n > 0:
                out[prefix + name] = s / n
        return out

    def _eval_losses(self, prefix: str) -> dict[str, float]:
        """The held-out loss and its timestep bins over every resolution's eval images; with data.resolutions also
        each resolution's loss, `loss_<px>px`."""
        per = {r: self._eval_sums(ds) for r, ds in self.eval_sets.items()}
        out = self._summarise([sum(col) for col in zip(*per.values())], prefix)
        if self.cfg.data.multires:
            for r, sums in per.items():
                loss = self._summarise(sums, prefix).get(f"{prefix}loss")
                if loss is not None:
                    out[f"{prefix}loss_{r}px"] = loss
        return out

    def evaluate(self) -> dict[str, float]:
        """Held-out loss (and the EMA's), by timestep bin, and the training loss by bin since the last call.

        Runs on every rank (the trainer calls it so). At the last step it also gathers the EMA for the
        export, which the trainer runs on rank 0 only right after.
        """
        result: dict[str, float] = {}
        if self.eval_sets:
            result.update(self._eval_losses(prefix=""))
            if self.ema is not None:
                with self.ema.swapped_in():
                    result.update(self._eval_losses(prefix="ema_"))
        counts_sums = all_reduce_sum(self.dist, [*self._bin_count.tolist(), *self._bin_sum.tolist()])
        for k, name in enumerate(_bin_names()):
            if counts_sums[k] > 0:
                result[f"train_{name}"] = counts_sums[NUM_BINS + k] / counts_sums[k]
        self._bin_sum.zero_()
        self._bin_count.zero_()
        if self.ema is not None and is_sharded(self.model) and self._step >= self.cfg.train.max_steps:
            self._ema_export = self.ema.full_state(self.dist)
        return result

    def write_samples(self, path: Path) -> Path:
        """The fixed sample grid (fixed prompts and noise seed; EMA weights when on) as one PNG: one grid per
        resolution of data.resolutions, stacked top to bottom in their order (the same noise seed each).

        Every rank calls it (the sampler's forwards are collectives under FSDP); rank 0 writes the file.
        """
        ctx = self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()
        s = self.cfg.sample
        grids = []
        with ctx:
            for resolution in self.cfg.data.all_resolutions:
                images = sample_images(self.model, self.text, self.autoencoder, self.prompts, resolution,
                                       s.steps, s.guidance, s.seed, self.flow,
                                       autocast_dtype=torch.bfloat16 if self.autocast else None)
                grids.append(make_grid(images, s.columns))
        if self.dist.is_main:
            with atomic_file(path, "wb", what="sample grid") as f:
                (grids[0] if len(grids) == 1 else make_grid_column(grids)).save(f, format="PNG")
        return path

    def after_optimizer_step(self, step: int) -> None:
        if self.ema is not None:
            self.ema.update(step)
        self._step = step

    def samples_due(self, step: int) -> bool:
        return bool(self.cfg.sample.every and step % self.cfg.sample.every == 0)

    def samples(self, step: int) -> Samples | None:
        """The validation grid of optimizer step `step` when it is due (every sample.every steps): the fixed prompts
        rendered with the EMA weights (the trained ones when EMA is off) into output.dir/samples/step-N.png. The
        trainer puts it into TensorBoard and announces it on the progress line (which the flows turn into a
        Prefect image artifact). Every rank calls it; rank 0 writes the file."""
        if not self.samples_due(step):
            return None
        path = self.write_samples(Path(self.cfg.output.dir) / "samples" / f"step-{step}.png")
        return Samples(path, len(self.prompts), "EMA" if self.ema is not None else "trained")

    # ------------------------------------------------------------------ state and export

    def _exports_pipeline(self) -> bool:
        """A pipeline/ export needs SD3's encoders and a diffusers VAE (a pixel codec has no pipeline form)."""
        return self.cfg.text.kind in PIPELINE_TEXT_KINDS and isinstance(self.autoencoder, SD3VAE)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.ema.state_tensors() if self.ema is not None else {}

    def state_meta(self) -> dict[str, Any]:
        """The step and every stream's data position (gathered from the ranks: every rank calls this on a save)."""
        states = all_gather_objects(self.dist, self.stream.state_dict())
        return {"sampler": LatentStream.merge_states(states), "step": self._step}

    def skipped(self) -> Skipped:
        """The training stream's skipped samples so far (bad ones, and those a tar cut short lacks), by shard and
        reason, summed over the ranks' streams (gathered: every rank calls this)."""
        merged: dict[str, dict[str, int]] = {}
        for part in all_gather_objects(self.dist, self.stream.skipped()):
            for shard, reasons in part.items():
                mine = merged.setdefault(shard, {})
                for reason, n in reasons.items():
                    mine[reason] = mine.get(reason, 0) + n
        return Skipped(merged)

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.stream.load_state_dict(meta["sampler"])
        self._step = int(meta.get("step", 0))
        if self.ema is not None:
            self.ema.load_state_tensors(tensors)

    def _ema_weights(self) -> dict[str, torch.Tensor]:
        """The EMA average by parameter name, full tensors (gathered at the last step's evaluation under FSDP)."""
        if not self.dist.enabled:
            return self.ema.full_state(self.dist)
        if self._ema_export is None:
            raise RuntimeError(f"imagegen export at step {self._step}: the EMA was not gathered (it is, in the "
                               f"evaluation of step train.max_steps = {self.cfg.train.max_steps})")
        return self._ema_export

    @property
    def export_reads_frozen(self) -> bool:
        """A LoRA run exports its adapters (and their EMA, gathered separately) and takes the base transformer from
        model.path, so the frozen weights are not gathered for it (pipeline/task.py)."""
        return self.lora is None

    def export(self, out_dir: Path) -> dict[str, Path]:
        """Full fine-tuning: transformer/ (and ema/) in diffusers layout. LoRA: lora/ (and lora_ema/), each a
        pytorch_lora_weights.safetensors that `StableDiffusion3Pipeline.load_lora_weights` reads. Both: imagegen.json
        for `atelier imagegen sample`, and with SD3's encoders pipeline/, a StableDiffusion3Pipeline directory with
        the EMA weights (EMA on) or the trained ones: the trained transformer, or the base transformer plus the LoRA
        file at its top (`pipe.load_lora_weights(dir)`), the VAE the latents came from and the scheduler set to this
        run's flow settings.

        Under FSDP the trainer calls it on rank 0 only, with the model's weights consolidated; the EMA's full
        copy was gathered on every rank at the last step's evaluation (a rank-0-only gather would hang).
        """
        out_dir = Path(out_dir)
        ema = self._ema_weights() if self.ema is not None else None
        paths: dict[str, Path] = {}
        if self.lora is not None:
            paths["lora"] = save_lora(self.model, self.lora, out_dir / "lora")
            if ema is not None:
                paths["lora_ema"] = save_lora(self.model, self.lora, out_dir / "lora_ema", weights=ema)
            final, transformer = paths.get("lora_ema", paths["lora"]), resolve_dir(self.cfg.model.path)
        else:
            dtype = torch.bfloat16 if self.autocast else torch.float32
            paths["transformer"] = save_pretrained(self.model, out_dir / "transformer", dtype=dtype)
            if ema is not None:
                paths["ema"] = save_pretrained(self.model, out_dir / "ema", dtype=dtype, weights=ema)
            final = transformer = paths.get("ema", paths["transformer"])
        if self._exports_pipeline():
            from atelier_studio.imagegen.export import export_pipeline

            def add_lora(tmp: Path) -> None:
                if self.lora is not None:
                    shutil.copy2(final / LORA_FILE, tmp / LORA_FILE)

            paths["pipeline"] = export_pipeline(
                text_encoder_dir(self.cfg.text, self.cfg.model.path), out_dir / "pipeline", transformer=transformer,
                vae=resolve_autoencoder_spec(self.cfg.autoencoder.spec, self.cfg.model.path), flow=self.flow,
                extra=add_lora)
        paths["meta"] = write_run_meta(out_dir, self.cfg)
        return paths


__all__ = ["ImagegenTask", "ImageBatch"]
