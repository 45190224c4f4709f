"""`atelier imagegen cache`: image shards -> latent shards, once, offline.

Shape legend: B images per encoder call, H/W bucket pixels, C latent channels, h/w latent size,
L text tokens, D text hidden size.

Each image is resized and centre-cropped to its nearest aspect bucket (`data.buckets`), images are
grouped by bucket into batches of `data.cache_batch`, and each batch runs through the autoencoder and
the text encoder together. The latent shards carry per sample {latent [C,h,w], text_states [L,D],
pooled [P]} plus the bucket, caption and the image shard's key; with `data.mask` also the loss weights
{mask [h,w]} (data/masks.py: the alpha channel or the sidecar mask, fitted as the image is and averaged per latent
position). A `cache.json` beside them records what produced them (autoencoder spec and its shift / scaling factors,
the text encoder's settings, resolution, the mask mode, counts) so the trainer can check them. With
`text.kind = "sd3"` the text is SD3's three encoders (imagegen/sd3_text.py): L = 77 + text.max_sequence_length,
D = 4096, P = 2048 for the released models; with `autoencoder.spec = "model"` the latents come from the vae/ of the
pipeline at model.path.

Several resolutions (`data.resolutions`): every image is cached at each, into out_dir/r<px>/ (eval:
out_dir/eval/r<px>/), each a latent shard set with its own cache.json (its resolution recorded), in one pass over the
image shards: each image is decoded once and its caption encoded once (`encode_at_resolutions`). A resolution whose
folder is complete is skipped (adding one later encodes only it).

Ranks (every rank encoding the whole set would write it world-size times): under torchrun each rank reads only its
own slice of the image shards and writes `out_dir/rank-RRRRR/`; the rank that finishes last (it sees every rank's
index) writes the combined `out_dir/index.json`, listing `rank-RRRRR/shard-NNNNNN.tar`. A single
process writes `out_dir/shard-*.tar` directly. Resume: a (rank) directory whose index.json exists is
complete and is skipped. Corrupt image samples are skipped and counted by the shard reader; past
`data.max_bad_fraction` it raises `ShardError` naming the worst shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
from rich.progress import Progress

from atelier_studio.data.buckets import bucket_pixels, make_buckets, nearest_bucket
from atelier_studio.data.masks import mask_weights
from atelier_studio.data.shards import INDEX_NAME, MASK_MEMBER, ShardReader, read_index, write_latent_shard_sets
from atelier_studio.imagegen.autoencoder import load_autoencoder, resolve_autoencoder_spec
from atelier_studio.imagegen.config import ImagegenConfig
from atelier_studio.imagegen.hf import read_args
from atelier_studio.imagegen.sd3_text import load_text_encoder
from atelier_studio.imagegen.text import TextEncoder
from atelier_studio.pipeline.atomic import atomic_write_text
from atelier_studio.pipeline.config import ConfigError
from atelier_studio.pipeline.errors import DataError
from atelier_studio.pipeline.progress import log

CACHE_META = "cache.json"


def dist_env() -> tuple[int, int]:
    """(rank, world_size) from torchrun's environment; (0, 1) for a plain process."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def check_resolutions(cfg: ImagegenConfig, downsample_factor: int, patch_size: int) -> None:
    """Every resolution trained at is a multiple of autoencoder factor x MMDiT patch (its buckets tile into whole
    patches): else a `ConfigError` naming the key and the nearest sizes that fit."""
    multiple = downsample_factor * patch_size
    key = "data.resolutions" if cfg.data.multires else "data.resolution"
    for r in cfg.data.all_resolutions:
        if r % multiple:
            lower, upper = r // multiple * multiple, (r // multiple + 1) * multiple
            fits = f"{lower} or {upper}" if lower else str(upper)
            raise ConfigError(f"{key}: {r} is not a multiple of {multiple} (the autoencoder's factor "
                              f"{downsample_factor} x the MMDiT's patch {patch_size}); use {fits}")


def cache_buckets(cfg: ImagegenConfig, downsample_factor: int, patch_size: int = 2,
                  resolution: int | None = None) -> list[tuple[int, int]]:
    """Pixel buckets of `resolution` (default data.resolution) whose sides are multiples of autoencoder factor x MMDiT
    patch (latents split into patches)."""
    check_resolutions(cfg, downsample_factor, patch_size)
    multiple = downsample_factor * patch_size
    return make_buckets(resolution or cfg.data.resolution, multiple, cfg.data.min_ratio, cfg.data.max_ratio)


def _mask_of(sample: dict, mode: str, bucket: tuple[int, int], factor: int) -> torch.Tensor | None:
    """The sample's loss weights [h, w] for `data.mask` = mode (data/masks.py), or None for "none"."""
    if mode == "none":
        return None
    source = sample.get("alpha") if mode == "alpha" else sample.get("mask")
    if source is None:
        if mode == "sidecar":  # every image of a sidecar-masked set needs its mask: a missing one is a data error
            raise DataError(f"image {sample['key']} of {sample.get('shard', '?')} has no {MASK_MEMBER} sidecar mask "
                            f"(data.mask = \"sidecar\"): put <image stem>.mask.png beside the image and run "
                            f"`atelier data shards` again, or set data.mask")
        h, w = bucket
        return torch.ones(h // factor, w // factor)  # no alpha channel: every pixel is opaque
    return mask_weights(source, bucket, factor)


def encode_samples(samples: Iterable[dict], buckets: list[tuple[int, int]], autoencoder, text: TextEncoder,
                   batch_size: int, device: torch.device, mask: str = "none") -> Iterator[dict]:
    """Image samples {key, image, caption, alpha, mask} -> latent samples, batched per bucket (remainders flushed at
    the end); with `mask` ("alpha" | "sidecar", `data.mask`) each carries its loss weights at latent resolution."""
    for _, sample in encode_at_resolutions(samples, [buckets], autoencoder, text, batch_size, device, mask):
        yield sample


@torch.no_grad()
def encode_at_resolutions(samples: Iterable[dict], bucket_sets: Sequence[list[tuple[int, int]]], autoencoder,
                          text: TextEncoder, batch_size: int, device: torch.device,
                          mask: str = "none") -> Iterator[tuple[int, dict]]:
    """`encode_samples` at several resolutions in one pass: each image in its bucket of every set (one per
    resolution), yielded as (set index, latent sample). Batches are per (set, bucket); a caption is encoded once,
    with the first batch that holds its image, and kept until its image was encoded at every resolution."""
    pending: dict[tuple[int, int], list[int]] = {}  # (set, bucket) -> ingestion numbers
    held: dict[int, dict] = {}  # ingestion number -> the image sample, until every set has encoded it
    text_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # ingestion number -> (states [L, D], pooled [P])
    left: dict[int, int] = {}  # ingestion number -> sets still to encode it

    def flush(key: tuple[int, int]) -> Iterator[tuple[int, dict]]:
        r, b = key
        bucket, group = bucket_sets[r][b], pending.pop(key)
        images = torch.stack([bucket_pixels(held[n]["image"], bucket) for n in group])  # [B,3,H,W]
        latents = autoencoder.encode(images.to(device)).float().cpu()  # [B, C, h, w]
        new = [n for n in group if n not in text_of]
        if new:
            states, pooled, _ = text.encode([held[n]["caption"] for n in new])  # [B', L, D], [B', P]
            text_of.update({n: (states[i].cpu(), pooled[i].cpu()) for i, n in enumerate(new)})
        for i, n in enumerate(group):
            s, (states_n, pooled_n) = held[n], text_of[n]
            weights = _mask_of(s, mask, bucket, autoencoder.downsample_factor)
            yield r, {"key": s["key"], "latent": latents[i], "text_states": states_n, "pooled": pooled_n,
                      "bucket": bucket, "caption": s["caption"], **({"mask": weights} if weights is not None else {})}
            left[n] -= 1
            if not left[n]:
                del held[n], text_of[n], left[n]

    for n, s in enumerate(samples):
        w, h = s["image"].size
        held[n], left[n] = s, len(bucket_sets)
        for r, buckets in enumerate(bucket_sets):
            key = (r, nearest_bucket(h, w, buckets))
            pending.setdefault(key, []).append(n)
            if len(pending[key]) == batch_size:
                yield from flush(key)
    for key in sorted(pending):
        yield from flush(key)


def _write_meta(out_dir: Path, cfg: ImagegenConfig, text: TextEncoder, autoencoder, counts: dict,
                resolution: int) -> None:
    meta = {"autoencoder": resolve_autoencoder_spec(cfg.autoencoder.spec, cfg.model.path),
            "latent_channels": autoencoder.latent_channels,
            "downsample_factor": autoencoder.downsample_factor, "scaling_factor": autoencoder.scaling_factor,
            "shift_factor": autoencoder.shift_factor, **text.settings(), "resolution": resolution,
            "mask": cfg.data.mask, **counts}
    atomic_write_text(out_dir / CACHE_META, json.dumps(meta, indent=1) + "\n", what="cache metadata")


def _merge_rank_indexes(out_dir: Path, world_size: int) -> bool:
    """Write out_dir/index.json from every rank's index once all exist; True when written."""
    dirs = [out_dir / f"rank-{r:05d}" for r in range(world_size)]
    indexes = [read_index(d) for d in dirs]
    if any(i is None for i in indexes):
        return False
    shards = [{**s, "name": f"{d.name}/{s['name']}"}  # keeps each shard's count and bucket counts
              for d, i in zip(dirs, indexes) for s in i["shards"]]
    merged = {"kind": "latent", "shards": shards, "total": sum(s["count"] for s in shards)}
    atomic_write_text(out_dir / INDEX_NAME, json.dumps(merged, indent=1), what="merged shard index")
    return True


def cache_split(cfg: ImagegenConfig, source: str, out_dir: Path, shard_size: int, autoencoder, text: TextEncoder,
                device: torch.device, rank: int = 0, world_size: int = 1, patch_size: int = 2,
                progress: bool = True) -> dict[int, str]:
    """Encode one image shard set into latent shards (this rank's slice), in one pass over the images: at
    data.resolution into out_dir, or at each of data.resolutions into out_dir/r<px>. Returns resolution -> its
    directory (`DataConfig.latent_sources`)."""
    dirs = {r: Path(d) for r, d in cfg.data.latent_sources(out_dir).items()}
    targets = {r: d / f"rank-{rank:05d}" if world_size > 1 else d for r, d in dirs.items()}
    done = {r for r, t in targets.items() if read_index(t) is not None and (t / CACHE_META).is_file()}
    for r in sorted(done):
        log(f"cache: {targets[r]} is complete, skipping")
    todo = [r for r in targets if r not in done]
    if todo:
        bucket_sets = [cache_buckets(cfg, autoencoder.downsample_factor, patch_size, r) for r in todo]
        reader = ShardReader(source, kind="image", rank=rank, world_size=world_size, num_workers=cfg.data.num_workers,
                             max_bad_fraction=cfg.data.max_bad_fraction)
        images: Iterable[dict] = reader
        if cfg.data.num_workers > 0:
            images = torch.utils.data.DataLoader(reader, batch_size=None, num_workers=cfg.data.num_workers)
        index = read_index(Path(source)) if Path(source).is_dir() else None
        total = index["total"] // world_size if index else None
        written = [0] * len(todo)

        def counted(samples: Iterator[tuple[int, dict]], bar: Progress, task) -> Iterator[tuple[int, dict]]:
            for i, s in samples:
                written[i] += 1
                if i == 0:  # the bar counts images, each written once per resolution
                    bar.advance(task)
                yield i, s

        px = ", ".join(str(r) for r in todo)
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task(f"caching {Path(source).name} at {px} px (rank {rank}/{world_size})", total=total)
            stream = encode_at_resolutions(images, bucket_sets, autoencoder, text, cfg.data.cache_batch, device,
                                           cfg.data.mask)
            write_latent_shard_sets(counted(stream, bar, task), [targets[r] for r in todo], shard_size)
        text.report_truncation(f"cache {source}")
        c = reader.counter  # this process's count (each DataLoader worker keeps its own)
        for r, n in zip(todo, written):
            _write_meta(targets[r], cfg, text, autoencoder, {"samples": n, "bad": c.bad,
                                                             "bad_by_reason": dict(c.by_reason)}, r)
            log(f"cache: {n} samples from {source} at {r} px -> {targets[r]}; bad samples skipped: {c.bad} "
                f"{dict(c.by_reason)}")
    for r, d in dirs.items():
        if world_size > 1 and _merge_rank_indexes(d, world_size):
            atomic_write_text(d / CACHE_META, (targets[r] / CACHE_META).read_text(), what="cache metadata")
            log(f"cache: all {world_size} ranks done, wrote {d / INDEX_NAME}")
    return {r: str(d) for r, d in dirs.items()}


def cache_latents(cfg: ImagegenConfig, out_dir: Path, shard_size: int = 1000) -> Path:
    """`atelier imagegen cache`: data.image_shards -> out_dir, data.eval_image_shards -> out_dir/eval; with
    data.resolutions each image at every resolution, into out_dir/r<px> and out_dir/eval/r<px>."""
    if not cfg.data.image_shards:
        raise ConfigError("data.image_shards: required by `atelier imagegen cache` (image shards from `atelier data "
                          "shards`)")
    rank, world_size = dist_env()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else \
        torch.device("cpu")
    autoencoder = load_autoencoder(resolve_autoencoder_spec(cfg.autoencoder.spec, cfg.model.path)).to(device)
    text = load_text_encoder(cfg.text, device, cfg.model.path)
    patch = read_args(cfg.model.path).patch_size  # buckets must tile into whole MMDiT patches
    check_resolutions(cfg, autoencoder.downsample_factor, patch)  # every resolution, before any is encoded
    out_dir = Path(out_dir)
    cache_split(cfg, cfg.data.image_shards, out_dir, shard_size, autoencoder, text, device, rank, world_size, patch)
    if cfg.data.eval_image_shards:
        cache_split(cfg, cfg.data.eval_image_shards, out_dir / "eval", shard_size, autoencoder, text, device, rank,
                    world_size, patch)
    return out_dir


__all__ = ["cache_latents", "cache_split", "encode_samples", "encode_at_resolutions", "cache_buckets",
           "check_resolutions", "dist_env", "CACHE_META"]
