"""The imagegen task on the shared engine: rectified flow on cached latents, one aspect bucket per batch.

Shape legend: B images, C latent channels, h/w latent size, p MMDiT patch, N = (h/p)(w/p) image tokens,
L text tokens (fixed: every caption is padded to text.max_length), D text hidden size.

Per micro-batch (conventions in imagegen/flow.py): t from `flow.sample_timesteps` (logit-normal, shifted;
the image token count feeds the dynamic shift), noise ~ N(0, I), x_t = (1 - t) x0 + t noise, the model
predicts v = noise - x0 at timestep t * 1000, and the loss is the per-image `flow_loss` summed (the
trainer divides by the number of images of the optimizer step). Caption dropout replaces a caption's
cached states by the empty caption's with probability text.caption_dropout (for CFG at sampling).
These draws come from a generator seeded by (train.seed, global batch number), made for the whole GLOBAL
micro-batch (world_size x micro_batch images, data/buckets.py) and sliced to this rank's rows: so any
number of processes draws what one process with the same global batch draws, and resume is exact
without any RNG state.

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

Evaluation and the sample grid use their own seeded generators, so they never move the training RNG:
eval images get fixed noise and fixed timesteps t = (k + 0.5) / 8 (k = image index mod 8), the loss is
reported overall and in 4 timestep bins (`loss_t00` covers t in [0, 0.25), ... `loss_t75` [0.75, 1)),
plus the same for the EMA weights, plus the training loss by bin accumulated since the last eval.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from atelier_studio.data.buckets import BucketSampler, LatentDataset, Slot, rank_rows
from atelier_studio.data.shards import read_index
from atelier_studio.data.textfile import read_lines
from atelier_studio.imagegen.autoencoder import load_autoencoder
from atelier_studio.imagegen.cache import cache_split
from atelier_studio.imagegen.config import ImagegenConfig
from atelier_studio.imagegen.ema import EMA
from atelier_studio.imagegen.flow import add_noise, flow_loss, sample_timesteps
from atelier_studio.imagegen.hf import build_model, load_pretrained, read_args, resolve_dir, save_pretrained, weight_map
from atelier_studio.imagegen.model import MMDiT
from atelier_studio.imagegen.registry import family_of_args
from atelier_studio.imagegen.sample import make_grid, sample_images, write_run_meta
from atelier_studio.imagegen.text import load_text_encoder
from atelier_studio.pipeline.atomic import atomic_file
from atelier_studio.pipeline.config import ConfigError
from atelier_studio.pipeline.distributed import DistContext, all_reduce_sum, is_sharded, materialize_, parallelize
from atelier_studio.pipeline.progress import log

NUM_BINS = 4
EVAL_T_GRID = 8  # eval timesteps (k + 0.5) / 8: two per bin


@dataclass
class ImageBatch:
    """One bucket's micro-batch on the device."""

    latent: torch.Tensor  # [B, C, h, w]
    text_states: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor  # [B, D]
    bucket: tuple[int, int]  # pixels (H, W)
    slot: Slot | None = None  # place in the global micro-batch (training batches): keys the random draws

    @property
    def size(self) -> int:
        return self.latent.shape[0]


def _bin_names() -> list[str]:
    return [f"loss_t{round(100 * k / NUM_BINS):02d}" for k in range(NUM_BINS)]


def draw_seed(seed: int, ordinal: int) -> int:
    """The seed of global micro-batch `ordinal`'s draws: (seed, ordinal) mixed by numpy's SeedSequence."""
    return int(np.random.SeedSequence([seed, ordinal]).generate_state(1, dtype=np.uint64)[0])


class ImagegenTask:
    unit = "images"

    def __init__(self, cfg: ImagegenConfig, device: torch.device, dist: DistContext | None = None):
        self.cfg, self.device = cfg, device
        self.dist = dist if dist is not None else DistContext(device=device)
        rank, world_size = self.dist.rank, self.dist.world_size
        self.flow = cfg.flow.args()
        self.autocast = cfg.model.dtype != "float32"
        sharded_init = self.dist.enabled and cfg.train.distributed.init == "sharded"
        # fp32 master weights
        self.model = self._build_sharded() if sharded_init else self._wrap(
            load_pretrained(cfg.model.path, dtype=torch.float32, device=device, kernels=cfg.model.kernels,
                            attention=cfg.model.attention))
        self._gen = torch.Generator(device=device)  # re-seeded per global micro-batch
        self._step = 0  # optimizer steps done (after_optimizer_step / the checkpoint)
        self._ema_export: dict[str, torch.Tensor] | None = None  # gathered at the last step's evaluation
        self.autoencoder = load_autoencoder(cfg.autoencoder.spec).to(device)
        self.text = load_text_encoder(cfg.text, device)
        self._check_dims()
        self.empty_states, self.empty_pooled = (x.float() for x in self.text.empty())  # [L, D], [D]

        out = Path(cfg.output.dir)
        self.train_set = LatentDataset(self._latents(cfg.data.shards, out / "cache" / "train"),
                                       max_bad_fraction=cfg.data.max_bad_fraction)
        self._check_latents(self.train_set, cfg.data.shards)
        self.sampler = BucketSampler(self.train_set.bucket_ids, cfg.train.micro_batch, cfg.train.seed, rank,
                                     world_size)
        self.eval_set = None
        if cfg.data.eval_shards:
            self.eval_set = LatentDataset(self._latents(cfg.data.eval_shards, out / "cache" / "eval"),
                                          max_bad_fraction=cfg.data.max_bad_fraction)
            self._check_latents(self.eval_set, cfg.data.eval_shards)
        # after wrapping: the shadow is sharded like the weights
        self.ema = EMA(self.model, cfg.ema.decay, cfg.ema.update_every) if cfg.ema.decay > 0 else None
        self.prompts = self._prompts()
        # training loss by timestep bin, accumulated on the device (no sync) and read at evaluation
        self._bin_sum = torch.zeros(NUM_BINS, device=device, dtype=torch.float64)
        self._bin_count = torch.zeros(NUM_BINS, device=device, dtype=torch.float64)
        n = sum(p.numel() for p in self.model.parameters())
        log(f"imagegen: {n / 1e6:.3f}M parameters, {cfg.model.dtype} on {device}; {len(self.train_set)} train "
            f"images in {len(self.train_set.buckets)} buckets, {self.sampler.batches_per_epoch} batches/epoch; "
            f"EMA {cfg.ema.decay if self.ema else 'off'}")

    # ------------------------------------------------------------------ model

    def _wrap(self, model: MMDiT) -> MMDiT:
        """AC -> compile -> FSDP2 per joint block (a no-op wrap on one process without policies).

        First, the parameters the forward never applies are frozen: the last block's text-query projection
        (kept only for diffusers' layout, imagegen/model.py Attention). They never get a gradient, so AdamW
        never makes state for them, and a sharded resume would look for that state in the checkpoint.
        """
        for block in model.transformer_blocks:
            if block.attn.to_add_out is None:  # context_pre_only: no text output, no text queries
                for m in (block.attn.add_q_proj, getattr(block.attn, "norm_added_q", None)):
                    if m is not None:
                        m.requires_grad_(False)
        choice = self.cfg.train.distributed.param_dtype
        if choice == "auto":
            param_dtype = torch.bfloat16 if self.autocast else torch.float32
        else:
            param_dtype = getattr(torch, choice)
        return parallelize(model, family_of_args(model.args).blocks(model), self.dist, self.cfg.train.distributed,
                           param_dtype)

    def _build_sharded(self) -> MMDiT:
        """Meta model -> wrap -> each rank reads only its rows of every tensor from the safetensors files."""
        from safetensors import safe_open

        model_dir = resolve_dir(self.cfg.model.path)
        where = weight_map(model_dir, read_args(model_dir))
        with torch.device("meta"):
            model = build_model(read_args(model_dir, self.cfg.model.kernels, self.cfg.model.attention))
        self._wrap(model)
        with contextlib.ExitStack() as stack:
            files = {f: stack.enter_context(safe_open(f, framework="pt", device="cpu"))
                     for f in sorted(set(where.values()))}
            materialize_(model, self.device, lambda name, rows: files[where[name]].get_slice(name)[rows])
        return model

    # ------------------------------------------------------------------ setup checks

    def _check_dims(self) -> None:
        a, d = self.model.args, self.text.hidden_size
        if a.joint_attention_dim != d or a.pooled_projection_dim != d:
            raise ConfigError(
                f"text.encoder {self.text.path} has hidden size {d}, but the MMDiT at model.path {self.cfg.model.path} "
                f"has joint_attention_dim {a.joint_attention_dim} and pooled_projection_dim "
                f"{a.pooled_projection_dim}; both must equal {d} (re-init with "
                f"joint_attention_dim={d}, pooled_projection_dim={d})")
        if a.in_channels != self.autoencoder.latent_channels:
            raise ConfigError(f"autoencoder.spec {self.cfg.autoencoder.spec!r} gives {self.autoencoder.latent_channels}"
                              f" latent channels, but the MMDiT at model.path has in_channels {a.in_channels}")

    def _check_latents(self, ds: LatentDataset, source: str) -> None:
        s = ds[0]
        a = self.model.args
        checks = [("latent channels", s["latent"].shape[0], a.in_channels, "MMDiT in_channels"),
                  ("text_states width", s["text_states"].shape[1], a.joint_attention_dim, "joint_attention_dim"),
                  ("pooled width", s["pooled"].shape[0], a.pooled_projection_dim, "pooled_projection_dim"),
                  ("text tokens", s["text_states"].shape[0], self.text.max_length, "text.max_length")]
        for what, got, want, of in checks:
            if got != want:
                raise ConfigError(f"{source} (key {s['key']} in {s['shard']}): {what} is {got}, but {of} is {want}; "
                                  f"re-run `atelier imagegen cache` with this config")
        p = a.patch_size
        bad = [b for b in ds.buckets
               if (b[0] // self.autoencoder.downsample_factor) % p or (b[1] // self.autoencoder.downsample_factor) % p]
        if bad:
            raise ConfigError(f"{source}: buckets {bad} do not tile into MMDiT patches of {p}")

    def _latents(self, source: str, cache_dir: Path) -> str:
        """Latent shards as given; image shards are encoded once into cache_dir (small runs) and read from there."""
        index = read_index(Path(source)) if Path(source).is_dir() else None
        if index is None or index.get("kind") != "image":
            return source
        if self.dist.world_size > 1:
            raise ConfigError(f"data.shards {source} holds images: with several ranks, cache them first "
                              f"(`atelier imagegen cache`)")
        log(f"{source} holds images: encoding them once into {cache_dir}")
        return str(cache_split(self.cfg, source, cache_dir, 1000, self.autoencoder, self.text, self.device,
                               patch_size=self.model.args.patch_size))

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
        ds = self.eval_set or self.train_set  # default: the first captions of the held-out set
        return [ds[i]["caption"] for i in range(min(2 * s.columns, len(ds)))]

    # ------------------------------------------------------------------ data

    def _to_device(self, b: dict, slot: Slot | None = None) -> ImageBatch:
        d = self.device
        return ImageBatch(b["latent"].to(d, non_blocking=True).float(),
                          b["text_states"].to(d, non_blocking=True).float(),
                          b["pooled"].to(d, non_blocking=True).float(), tuple(b["bucket"]), slot)

    def train_batches(self) -> Iterator[ImageBatch]:
        return (self._to_device(self.train_set.batch(idx), slot) for idx, slot in self.sampler.iter_slots())

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
        with self._autocast():
            pred = self.model(x_t, states, pooled, t * 1000)  # [B, C, h, w]
        return flow_loss(pred, b.latent, noise, t, self.flow)

    def _draws(self, b: ImageBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(t [B], noise [B, C, h, w], caption-drop mask [B] or None): the global micro-batch's draws, this
        rank's rows. G = the global batch size; drawing all G on every rank is cheap next to the step."""
        if b.slot is None:
            raise ValueError("ImagegenTask.loss_sum: a training batch needs its sampler slot (train_batches)")
        G, rows = b.slot.size, slice(b.slot.offset, b.slot.offset + b.size)
        g = self._gen.manual_seed(draw_seed(self.cfg.train.seed, b.slot.ordinal))
        t = sample_timesteps(G, g, self.flow, self._image_tokens(b), self.device)[rows]  # [B]
        noise = torch.randn((G, *b.latent.shape[1:]), generator=g, device=self.device)[rows]  # [B, C, h, w]
        drop = None
        if self.cfg.text.caption_dropout > 0:
            drop = (torch.rand(G, generator=g, device=self.device) < self.cfg.text.caption_dropout)[rows]  # [B]
        return t, noise, drop

    def loss_sum(self, b: ImageBatch) -> torch.Tensor:
        t, noise, drop = self._draws(b)
        states, pooled = b.text_states, b.pooled
        if drop is not None:
            states = torch.where(drop[:, None, None], self.empty_states, states)  # [B, L, D]
            pooled = torch.where(drop[:, None], self.empty_pooled, pooled)  # [B, D]
        losses = self._losses(b, t, noise, states, pooled)  # [B]
        bins = (t.detach() * NUM_BINS).long().clamp(0, NUM_BINS - 1)
        self._bin_sum.index_add_(0, bins, losses.detach().double())
        self._bin_count.index_add_(0, bins, torch.ones_like(losses, dtype=torch.float64))
        return losses.sum()

    # ------------------------------------------------------------------ evaluation and samples

    def _eval_sums(self) -> list[float]:
        """[Σ loss, n, then Σ loss and n per timestep bin] over the eval images, summed over ranks.

        Fixed noise (a private CPU generator) and timesteps t = (k + 0.5) / 8 for the k-th image. The images
        go in global batches of world_size x micro_batch (one bucket each), each split over the ranks as the
        training batches are, so the draws and the numbers do not depend on the number of processes. A rank
        whose share of a short last batch is empty runs the forward on one image anyway and drops it: FSDP's
        forward is a collective, every rank must run as many.
        """
        ds = self.eval_set
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

    def evaluate(self) -> dict[str, float]:
        """Held-out loss (and the EMA's), by timestep bin, and the training loss by bin since the last call.

        Runs on every rank (the trainer calls it so). At the last step it also gathers the EMA for the
        export, which the trainer runs on rank 0 only right after.
        """
        result: dict[str, float] = {}
        if self.eval_set is not None:
            result.update(self._summarise(self._eval_sums(), prefix=""))
            if self.ema is not None:
                with self.ema.swapped_in():
                    result.update(self._summarise(self._eval_sums(), prefix="ema_"))
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
        """The fixed sample grid (fixed prompts and noise seed; EMA weights when on) as one PNG.

        Every rank calls it (the sampler's forwards are collectives under FSDP); rank 0 writes the file.
        """
        ctx = self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()
        s = self.cfg.sample
        with ctx:
            images = sample_images(self.model, self.text, self.autoencoder, self.prompts, self.cfg.data.resolution,
                                   s.steps, s.guidance, s.seed, self.flow,
                                   autocast_dtype=torch.bfloat16 if self.autocast else None)
        if self.dist.is_main:
            with atomic_file(path, "wb", what="sample grid") as f:
                make_grid(images, s.columns).save(f, format="PNG")
        return path

    def after_optimizer_step(self, step: int) -> None:
        if self.ema is not None:
            self.ema.update(step)
        self._step = step
        if self.cfg.sample.every and step % self.cfg.sample.every == 0:
            self.write_samples(Path(self.cfg.output.dir) / "samples" / f"step-{step}.png")

    # ------------------------------------------------------------------ state and export

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.ema.state_tensors() if self.ema is not None else {}

    def state_meta(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "step": self._step}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.sampler.load_state_dict(meta["sampler"])
        self._step = int(meta.get("step", 0))
        if self.ema is not None:
            self.ema.load_state_tensors(tensors)

    def export(self, out_dir: Path) -> dict[str, Path]:
        """transformer/ (and ema/) in diffusers layout, plus imagegen.json for `atelier imagegen sample`.

        Under FSDP the trainer calls it on rank 0 only, with the model's weights consolidated; the EMA's full
        copy was gathered on every rank at the last step's evaluation (a rank-0-only gather would hang).
        """
        out_dir = Path(out_dir)
        dtype = torch.bfloat16 if self.autocast else torch.float32
        paths = {"transformer": save_pretrained(self.model, out_dir / "transformer", dtype=dtype)}
        if self.ema is not None:
            if self.dist.enabled:
                if self._ema_export is None:
                    raise RuntimeError(f"imagegen export at step {self._step}: the EMA was not gathered (it is, in "
                                       f"the evaluation of step train.max_steps = {self.cfg.train.max_steps})")
                ema = self._ema_export
            else:
                ema = self.ema.full_state(self.dist)
            paths["ema"] = save_pretrained(self.model, out_dir / "ema", dtype=dtype, weights=ema)
        paths["meta"] = write_run_meta(out_dir, self.cfg)
        return paths


__all__ = ["ImagegenTask", "ImageBatch"]
