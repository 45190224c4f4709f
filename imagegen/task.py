"""The imagegen task on the shared engine: rectified flow on cached latents, one aspect bucket per batch.

Shape legend: B images, C latent channels, h/w latent size, p MMDiT patch, N = (h/p)(w/p) image tokens,
L text tokens (fixed: every caption is padded to text.max_length), D text hidden size.

Per micro-batch (conventions in imagegen/flow.py): t from `flow.sample_timesteps` (logit-normal, shifted;
the image token count feeds the dynamic shift), noise ~ N(0, I), x_t = (1 - t) x0 + t noise, the model
predicts v = noise - x0 at timestep t * 1000, and the loss is the per-image `flow_loss` summed (the
trainer divides by the number of images of the optimizer step). Caption dropout replaces a caption's
cached states by the empty caption's with probability text.caption_dropout (for CFG at sampling).
All of this draws from torch's global RNG, which the trainer checkpoints: resume is exact.

Precision (DESIGN.md): fp32 master weights; `model.dtype = "bfloat16"` runs the forward under bf16
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

import torch

from data.buckets import BucketSampler, LatentDataset
from data.shards import read_index
from imagegen.autoencoder import load_autoencoder
from imagegen.cache import cache_split
from imagegen.config import ImagegenConfig
from imagegen.ema import EMA
from imagegen.flow import add_noise, flow_loss, sample_timesteps
from imagegen.hf import load_pretrained, save_pretrained
from imagegen.sample import make_grid, sample_images, write_run_meta
from imagegen.text import load_text_encoder
from pipeline.config import ConfigError
from pipeline.progress import log

NUM_BINS = 4
EVAL_T_GRID = 8  # eval timesteps (k + 0.5) / 8: two per bin


@dataclass
class ImageBatch:
    """One bucket's micro-batch on the device."""

    latent: torch.Tensor  # [B, C, h, w]
    text_states: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor  # [B, D]
    bucket: tuple[int, int]  # pixels (H, W)

    @property
    def size(self) -> int:
        return self.latent.shape[0]


def _bin_names() -> list[str]:
    return [f"loss_t{round(100 * k / NUM_BINS):02d}" for k in range(NUM_BINS)]


class ImagegenTask:
    unit = "images"

    def __init__(self, cfg: ImagegenConfig, device: torch.device, rank: int = 0, world_size: int = 1):
        self.cfg, self.device, self.rank, self.world_size = cfg, device, rank, world_size
        self.flow = cfg.flow.args()
        self.model = load_pretrained(cfg.model.path, dtype=torch.float32, device=device)  # fp32 master weights
        self.autocast = cfg.model.dtype != "float32"
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
        self.ema = EMA(self.model, cfg.ema.decay, cfg.ema.update_every) if cfg.ema.decay > 0 else None
        self.prompts = self._prompts()
        # training loss by timestep bin, accumulated on the device (no sync) and read at evaluation
        self._bin_sum = torch.zeros(NUM_BINS, device=device, dtype=torch.float64)
        self._bin_count = torch.zeros(NUM_BINS, device=device, dtype=torch.float64)
        n = sum(p.numel() for p in self.model.parameters())
        log(f"imagegen: {n / 1e6:.3f}M parameters, {cfg.model.dtype} on {device}; {len(self.train_set)} train "
            f"images in {len(self.train_set.buckets)} buckets, {self.sampler.batches_per_epoch} batches/epoch; "
            f"EMA {cfg.ema.decay if self.ema else 'off'}")

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
        if self.world_size > 1:
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
            lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            if not lines:
                raise ConfigError(f"sample.prompts_file: {path} has no prompts")
            return lines
        ds = self.eval_set or self.train_set  # default: the first captions of the held-out set
        return [ds[i]["caption"] for i in range(min(2 * s.columns, len(ds)))]

    # ------------------------------------------------------------------ data

    def _to_device(self, b: dict) -> ImageBatch:
        d = self.device
        return ImageBatch(b["latent"].to(d, non_blocking=True).float(),
                          b["text_states"].to(d, non_blocking=True).float(),
                          b["pooled"].to(d, non_blocking=True).float(), tuple(b["bucket"]))

    def train_batches(self) -> Iterator[ImageBatch]:
        return (self._to_device(self.train_set.batch(idx)) for idx in self.sampler)

    # ------------------------------------------------------------------ the step

    def batch_weight(self, b: ImageBatch) -> int:
        return b.size

    def batch_units(self, b: ImageBatch) -> int:
        return b.size

    def _image_tokens(self, b: ImageBatch) -> int:
        p = self.model.args.patch_size
        return (b.latent.shape[2] // p) * (b.latent.shape[3] // p)

    def batch_flops(self, b: ImageBatch) -> int:
        return self.model.train_flops(b.size, self._image_tokens(b), b.text_states.shape[1])

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def _losses(self, b: ImageBatch, t: torch.Tensor, noise: torch.Tensor, states: torch.Tensor,
                pooled: torch.Tensor) -> torch.Tensor:
        """Per-image flow loss [B] (fp32) at times t [B] with noise [B, C, h, w]."""
        x_t = add_noise(b.latent, noise, t)  # [B, C, h, w]
        with self._autocast():
            pred = self.model(x_t, states, pooled, t * 1000)  # [B, C, h, w]
        return flow_loss(pred, b.latent, noise, t, self.flow)

    def loss_sum(self, b: ImageBatch) -> torch.Tensor:
        B = b.size
        t = sample_timesteps(B, None, self.flow, self._image_tokens(b), self.device)  # [B]
        noise = torch.randn_like(b.latent)
        states, pooled = b.text_states, b.pooled
        if self.cfg.text.caption_dropout > 0:
            drop = torch.rand(B, device=self.device) < self.cfg.text.caption_dropout  # [B]
            states = torch.where(drop[:, None, None], self.empty_states, states)  # [B, L, D]
            pooled = torch.where(drop[:, None], self.empty_pooled, pooled)  # [B, D]
        losses = self._losses(b, t, noise, states, pooled)  # [B]
        bins = (t.detach() * NUM_BINS).long().clamp(0, NUM_BINS - 1)
        self._bin_sum.index_add_(0, bins, losses.detach().double())
        self._bin_count.index_add_(0, bins, torch.ones_like(losses, dtype=torch.float64))
        return losses.sum()

    # ------------------------------------------------------------------ evaluation and samples

    def _eval_losses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss [n], t [n]) over the eval images at fixed noise and timesteps, from a private generator."""
        ds = self.eval_set
        limit = self.cfg.data.max_eval_images or len(ds)
        order = sorted(range(len(ds)), key=lambda i: (ds.bucket_ids[i], i))[:limit]  # bucket-grouped, fixed
        gen = torch.Generator().manual_seed(self.cfg.train.seed + 1)
        losses, times = [], []
        mb = self.cfg.train.micro_batch
        groups: dict[int, list[int]] = {}
        for i in order:
            groups.setdefault(ds.bucket_ids[i], []).append(i)
        k = 0
        for idx in groups.values():
            for j in range(0, len(idx), mb):
                b = self._to_device(ds.batch(idx[j:j + mb]))
                t = (torch.arange(k, k + b.size) % EVAL_T_GRID + 0.5) / EVAL_T_GRID  # [B]
                noise = torch.randn(b.latent.shape, generator=gen)  # CPU generator: device independent
                k += b.size
                t = t.to(self.device)
                losses.append(self._losses(b, t, noise.to(self.device), b.text_states, b.pooled))
                times.append(t)
        return torch.cat(losses), torch.cat(times)

    def _summarise(self, loss: torch.Tensor, t: torch.Tensor, prefix: str) -> dict[str, float]:
        out = {f"{prefix}loss": float(loss.mean())}
        bins = (t * NUM_BINS).long().clamp(0, NUM_BINS - 1)
        for k, name in enumerate(_bin_names()):
            sel = bins == k
            if sel.any():
                out[prefix + name] = float(loss[sel].mean())
        return out

    def evaluate(self) -> dict[str, float]:
        result: dict[str, float] = {}
        if self.eval_set is not None:
            result.update(self._summarise(*self._eval_losses(), prefix=""))
            if self.ema is not None:
                with self.ema.swapped_in():
                    result.update(self._summarise(*self._eval_losses(), prefix="ema_"))
        counts = self._bin_count.cpu()
        sums = self._bin_sum.cpu()
        for k, name in enumerate(_bin_names()):
            if counts[k] > 0:
                result[f"train_{name}"] = float(sums[k] / counts[k])
        self._bin_sum.zero_()
        self._bin_count.zero_()
        return result

    def write_samples(self, path: Path) -> Path:
        """The fixed sample grid (fixed prompts and noise seed; EMA weights when on) as one PNG."""
        ctx = self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()
        s = self.cfg.sample
        with ctx:
            images = sample_images(self.model, self.text, self.autoencoder, self.prompts, self.cfg.data.resolution,
                                   s.steps, s.guidance, s.seed, self.flow,
                                   autocast_dtype=torch.bfloat16 if self.autocast else None)
        path.parent.mkdir(parents=True, exist_ok=True)
        make_grid(images, s.columns).save(path)
        return path

    def after_optimizer_step(self, step: int) -> None:
        if self.ema is not None:
            self.ema.update(step)
        if self.cfg.sample.every and step % self.cfg.sample.every == 0 and self.rank == 0:
            self.write_samples(Path(self.cfg.output.dir) / "samples" / f"step-{step}.png")

    # ------------------------------------------------------------------ state and export

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.ema.state_tensors() if self.ema is not None else {}

    def state_meta(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.sampler.load_state_dict(meta["sampler"])
        if self.ema is not None:
            self.ema.load_state_tensors(tensors)

    def export(self, out_dir: Path) -> dict[str, Path]:
        """transformer/ (and ema/) in diffusers layout, plus imagegen.json for `atelier imagegen sample`."""
        out_dir = Path(out_dir)
        dtype = torch.bfloat16 if self.autocast else torch.float32
        paths = {"transformer": save_pretrained(self.model, out_dir / "transformer", dtype=dtype)}
        if self.ema is not None:
            with self.ema.swapped_in():
                paths["ema"] = save_pretrained(self.model, out_dir / "ema", dtype=dtype)
        paths["meta"] = write_run_meta(out_dir, self.cfg)
        return paths


__all__ = ["ImagegenTask", "ImageBatch"]
