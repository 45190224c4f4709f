"""WebDataset shards: image shards in, latent shards out, and the corrupt-sample policy.

Two shard kinds live in a directory `out_dir/shard-000000.tar, shard-000001.tar, ...` with an
`index.json` ({"kind", "shards": [{"name", "count"}], "total"}; a latent shard's entry also counts its samples
per bucket, "buckets": {"HxW": n}; a set written from a folder or parquet source (data/image_sources.py) counts the
images it skipped, "skipped": {reason: n}). A writer builds the whole set in a
temporary directory and installs it at out_dir only once every sample is written (pipeline/atomic.py):
a failed write (a bad input line, a full disk) leaves out_dir as it was, never a partial set. Keys
are `%09d` ordinals (image shards) or the caller's key (latent shards); keys never contain "." or
"/" because webdataset splits a member name at the first dot.

    image shard   <key>.jpg|png|webp  original bytes, never re-encoded (an alpha channel kept: data/masks.py)
                  <key>.txt           caption, UTF-8
                  <key>.json          {"width", "height", "path"} (path relative to images_dir)
                  <key>.mask.png      optional: the image's `<stem>.mask.png` sidecar loss mask, when there is one
    latent shard  <key>.safetensors   {"latent": [C, h, w], "text_states": [L, D], "pooled": [P]}, and with
                                      `data.mask` the loss weights "mask": [h, w] in [0, 1]
                  <key>.json          {"bucket": [H, W], "caption"}      (never pickle)

Shape legend: C latent channels, h/w latent height/width, H/W pixel height/width of the bucket,
L text tokens, D text hidden size, P pooled text size.

Corrupt samples (policy): a truncated or unreadable tar, an undecodable
image or latent, a sample without caption, an image whose shorter side is below `min_side` are
skipped and counted by reason and shard in a `BadSampleCounter`. Once bad / seen exceeds
`max_bad_fraction` (checked after `min_samples_for_check` samples, and always at the end of a finite
pass) a `ShardError` names the worst shard and the last bad key. Here a truncated tar counts as one bad
sample (a webdataset pass cannot know the samples it lost); the training stream (data/latent_stream.py) counts
the samples its index lists that a cut tar lacks. With DataLoader workers each worker counts its own
share. Images are converted to 8-bit RGB: CMYK and YCbCr by Pillow, palette and alpha modes are
composited over white (dropping alpha would expose undefined colours under transparent pixels),
16-bit ("I;16*", and "I" which Pillow's PNG loader produces for 16-bit grey) is scaled by 255/65535
(Pillow's own convert clips at 255 instead).

Several ranks (fewer shards than ranks x workers would hang a rank): shards are dealt to the global worker
g = rank * num_workers + worker out of G = world_size * num_workers. Without resampling, fewer
shards than G raises `ShardError` at construction (a worker without shards would end its epoch
early and hang the others); that mode is for single passes where each rank handles its own slice
(`atelier imagegen cache`, validation, the in-memory eval set). With `resample=True` every worker draws
shards with replacement forever, seeded by (seed, epoch, g). The imagegen trainer reads its training
latents through data/latent_stream.py instead: bounded memory, equal batches per rank, exact resume.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import braceexpand
import numpy as np
import torch
import webdataset as wds
from PIL import Image
from rich.progress import Progress
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from atelier_studio.data.textfile import read_json, read_lines
from atelier_studio.pipeline.atomic import atomic_dir
from atelier_studio.pipeline.errors import AtelierError, DataError

IMAGE_EXTS = ("jpg", "png", "webp")  # "jpeg" is written as "jpg"
LATENT_TENSORS = ("latent", "text_states", "pooled")
LATENT_NDIM = {"latent": 3, "text_states": 2, "pooled": 1}
MASK_NDIM = 2  # a latent sample's optional "mask" [h, w]: loss weights at latent resolution (data/masks.py)
MASK_MEMBER = "mask.png"  # an image sample's optional sidecar mask
SHARD_PATTERN = "shard-{:06d}.tar"
INDEX_NAME = "index.json"


class ShardError(AtelierError, RuntimeError):
    """A shard set is unusable: too many bad samples, missing shards, or too few shards for the ranks."""


class BadSample(Exception):
    """One skipped sample, or `count` of them (a tar cut short: the samples its index lists that it lacks); raised
    inside the pipeline and caught by `BadSampleCounter.handler`."""

    def __init__(self, reason: str, shard: str, key: str, detail: str = "", count: int = 1):
        super().__init__(f"{shard}: key {key}: {reason}" + (f" ({detail})" if detail else ""))
        self.reason, self.shard, self.key, self.detail, self.count = reason, shard, key, detail, count


@dataclass
class BadSampleCounter:
    """Counts good and bad samples by reason and shard; raises `ShardError` past `max_bad_fraction`."""

    max_bad_fraction: float = 0.01
    min_samples_for_check: int = 100
    good: int = 0
    by_reason: Counter = field(default_factory=Counter)
    by_shard: Counter = field(default_factory=Counter)
    by_shard_reason: dict[str, Counter] = field(default_factory=dict)  # shard -> reason -> samples
    last_bad: BadSample | None = None
    current_shard: str = "<unknown shard>"
    _truncated: set = field(default_factory=set)

    @property
    def bad(self) -> int:
        return sum(self.by_reason.values())

    def opened(self, shard: str) -> None:
        self.current_shard = shard
        self._truncated.discard(shard)

    def ok(self) -> None:
        self.good += 1
        self.check(final=False)

    def record(self, exn: BadSample) -> None:
        self.by_reason[exn.reason] += exn.count
        self.by_shard[exn.shard] += exn.count
        self.by_shard_reason.setdefault(exn.shard, Counter())[exn.reason] += exn.count
        self.last_bad = exn
        self.check(final=False)

    def check(self, final: bool) -> None:
        seen = self.good + self.bad
        if seen == 0 or (not final and seen < self.min_samples_for_check):
            return
        if self.bad / seen > self.max_bad_fraction:
            worst, n = self.by_shard.most_common(1)[0]
            raise ShardError(
                f"{self.bad} of {seen} samples bad ({self.bad / seen:.1%} > max_bad_fraction "
                f"{self.max_bad_fraction:.1%}); worst shard {worst} ({n} bad); last bad: {self.last_bad}; "
                f"by reason {dict(self.by_reason)}"
            )

    def sample_handler(self, exn: Exception) -> bool:
        """webdataset `handler=` for decode stages: count `BadSample`, re-raise anything else (a bug)."""
        if not isinstance(exn, BadSample):
            raise exn
        self.record(exn)
        return True

    def tar_handler(self, exn: Exception) -> bool:
        """webdataset `handler=` for tar reading: a broken tar counts once per pass, then skip to the next."""
        if isinstance(exn, FileNotFoundError):
            raise ShardError(f"shard not found: {exn}") from exn
        shard = next((a for a in reversed(exn.args) if isinstance(a, str) and a.endswith(".tar")), None)
        if shard is None:  # the inner tar iterator only appends "@ <BufferedReader name='...'>"
            m = re.search(r"name='([^']+)'", str(exn.args[0]) if exn.args else "")
            shard = m.group(1) if m else self.current_shard
        if isinstance(exn, ValueError) and "duplicate file name" in str(exn):
            self.record(BadSample("duplicate member", shard, "?", str(exn.args[0])[:200]))
        elif shard not in self._truncated:
            self._truncated.add(shard)
            self.record(BadSample("truncated tar", shard, "?", f"{type(exn).__name__}: {str(exn.args[0])[:200]}"))
        return True

    def as_dict(self) -> dict:
        return {"good": self.good, "bad": self.bad, "by_reason": dict(self.by_reason), "by_shard": dict(self.by_shard),
                "by_shard_reason": {s: dict(c) for s, c in self.by_shard_reason.items()}}

    def load(self, state: dict) -> None:
        """Continue counting from `as_dict()` (a checkpoint's; one without by_shard_reason counts its shards' bad
        samples under "bad sample")."""
        self.good = int(state["good"])
        self.by_reason.update(state["by_reason"])
        self.by_shard.update(state["by_shard"])
        per = state.get("by_shard_reason") or {s: {"bad sample": n} for s, n in state["by_shard"].items()}
        for shard, reasons in per.items():
            self.by_shard_reason.setdefault(shard, Counter()).update(reasons)


@dataclass(frozen=True)
class ShardStats:
    """What a writer produced: shard file names, samples per shard, total samples."""

    out_dir: Path
    shards: tuple[str, ...]
    counts: tuple[int, ...]
    total: int


class _ShardSink:
    """Writes samples into numbered shards of `shard_size` inside `out_dir`, then index.json (`finish`).

    `out_dir` is the temporary directory of `_shard_set` (the whole set is installed at once), so a
    shard needs no temporary name of its own. A context manager: the open tar is closed however it ends.
    """

    def __init__(self, out_dir: Path, shard_size: int, kind: str):
        self.out_dir, self.shard_size, self.kind = Path(out_dir), shard_size, kind
        self.names: list[str] = []
        self.counts: list[int] = []
        self.buckets: list[Counter] = []  # latent shards: samples per "HxW" bucket, for the index
        self.index_extra: dict[str, Any] = {}  # more fields for index.json (a source's skipped images)
        self.writer: wds.TarWriter | None = None

    def __enter__(self) -> "_ShardSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_current()

    def write(self, sample: dict, bucket: tuple[int, int] | None = None) -> None:
        if self.writer is None or self.counts[-1] == self.shard_size:
            self._roll()
        self.writer.write(sample)
        self.counts[-1] += 1
        if bucket is not None:
            self.buckets[-1][f"{bucket[0]}x{bucket[1]}"] += 1

    def _roll(self) -> None:
        self._close_current()
        self.names.append(SHARD_PATTERN.format(len(self.names)))
        self.counts.append(0)
        self.buckets.append(Counter())
        # encoder=False: values are bytes already; mtime fixed so the same input gives the same tar
        self.writer = wds.TarWriter(str(self.out_dir / self.names[-1]), encoder=False, mtime=0.0)

    def _close_current(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()

    def finish(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        self._close_current()
        shards = [{"name": n, "count": c} for n, c in zip(self.names, self.counts)]
        if self.kind == "latent":  # the streaming loader plans with these (data/latent_stream.py)
            for entry, hist in zip(shards, self.buckets):
                entry["buckets"] = dict(sorted(hist.items()))
        index = {"kind": self.kind, "shards": shards, "total": sum(self.counts), **self.index_extra}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=1))
        return tuple(self.names), tuple(self.counts)


def _check_shard_size(shard_size: int) -> None:
    if shard_size < 1:
        raise DataError(f"shard size (--shard-size) must be >= 1, got {shard_size}")


def _check_replaceable(out_dir: Path) -> None:
    """A shard set replaces an older one at out_dir, never a directory of other files."""
    if out_dir.is_dir() and not (out_dir / INDEX_NAME).is_file() and any(out_dir.iterdir()):
        raise ShardError(f"{out_dir}: exists and holds files but no {INDEX_NAME}, so it is not a shard set written "
                         f"here; refusing to replace it (choose another output directory, or empty this one)")


def _shard_set(out_dir: Path, shard_size: int, kind: str, write: Callable[[_ShardSink], None]) -> ShardStats:
    """Run `write(sink)` into a temporary directory and install it at out_dir only if it finishes.

    Any error (a bad line, a full disk, too many bad samples) deletes the temporary directory: out_dir
    keeps what it held before (pipeline/atomic.py), and no partial set is ever listed by `list_shards`.
    """
    out_dir = Path(out_dir)
    _check_shard_size(shard_size)
    _check_replaceable(out_dir)
    with atomic_dir(out_dir, what="shard set") as tmp:
        with _ShardSink(tmp, shard_size, kind) as sink:
            write(sink)
            names, counts = sink.finish()
    return ShardStats(out_dir, names, counts, sum(counts))


def read_image_checked(path: Path, where: str) -> tuple[bytes, int, int]:
    """An image file's bytes and (width, height), after decoding every pixel once: a cut-off body is refused here."""
    data = path.read_bytes()
    if not data:
        raise DataError(f"{where}: image {path} is empty (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()  # the container's own checks (PNG chunk CRCs) without decoding
        with Image.open(io.BytesIO(data)) as img:  # verify() leaves the image unusable: open it again
            img.load()  # decode all of it: a truncated body raises here, not at training time
            width, height = img.size
    except Image.UnidentifiedImageError:  # its message names a BytesIO, not the file
        raise DataError(f"{where}: cannot decode image {path} (not an image format Pillow can read)") from None
    except Exception as exn:  # Pillow raises OSError, SyntaxError, ValueError, DecompressionBombError...
        raise DataError(f"{where}: cannot decode image {path} ({type(exn).__name__}: {exn})") from None
    return data, width, height


def write_image_shards(
    images_dir: Path, captions_jsonl: Path, out_dir: Path, shard_size: int, progress: bool = True
) -> ShardStats:
    """Pack images and captions into image shards.

    `captions_jsonl` holds one object per line: {"image": "<path relative to images_dir>",
    "caption": "<non-empty text>"}; blank lines are skipped. Any bad line raises `DataError` (a
    ValueError) naming `file:line`: bad input is refused where it enters, not skipped. Every image is
    decoded in full once. Nothing is written at out_dir unless every line is good (`_shard_set`).
    """
    images_dir, captions_jsonl = Path(images_dir), Path(captions_jsonl)
    if not images_dir.is_dir():
        raise DataError(f"{images_dir}: images directory not found")
    lines = read_lines(captions_jsonl)
    _check_shard_size(shard_size)

    def write(sink: _ShardSink) -> None:
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task(f"sharding {captions_jsonl.name}", total=len(lines))
            for lineno, line in enumerate(lines, start=1):
                bar.advance(task)
                if not line.strip():
                    continue
                where = f"{captions_jsonl}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exn:
                    raise DataError(f"{where}: invalid JSON: {exn}") from None
                if not isinstance(row, dict) or not isinstance(row.get("image"), str):
                    raise DataError(f"{where}: expected an object with a string 'image' key, got {line[:120]!r}")
                caption = row.get("caption")
                if not isinstance(caption, str) or not caption.strip():
                    raise DataError(f"{where}: 'caption' must be a non-empty string, got {caption!r}")
                path = images_dir / row["image"]
                ext = path.suffix.lower().lstrip(".").replace("jpeg", "jpg")
                if ext not in IMAGE_EXTS:
                    raise DataError(
                        f"{where}: image {row['image']!r} has extension {path.suffix!r}; expected {IMAGE_EXTS}"
                    )
                if not path.is_file():
                    raise DataError(f"{where}: image file not found: {path}")
                data, width, height = read_image_checked(path, where)
                key = f"{sum(sink.counts):09d}"
                meta = {"width": width, "height": height, "path": row["image"]}
                sample = {"__key__": key, ext: data, "txt": caption.encode("utf-8"), "json": json.dumps(meta).encode()}
                sidecar = path.with_name(path.stem + ".mask.png")
                if sidecar.is_file():
                    mask, mw, mh = read_image_checked(sidecar, where)
                    if (mw, mh) != (width, height):
                        raise DataError(f"{where}: mask {sidecar} is {mw}x{mh}, its image {width}x{height}; a sidecar "
                                        f"mask must have its image's size")
                    sample[MASK_MEMBER] = mask
                sink.write(sample)

    return _shard_set(Path(out_dir), shard_size, "image", write)


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB (see the module docstring for the per-mode rule)."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        arr = np.asarray(img, dtype=np.float64)  # [H, W] 16-bit values
        arr = np.clip(np.round(arr * (255.0 / 65535.0)), 0, 255).astype(np.uint8)
        return Image.fromarray(arr).convert("RGB")
    if img.mode == "F":
        raise ValueError("float ('F') images have no defined range; convert them before sharding")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")  # CMYK, YCbCr, L, 1, P, LAB, HSV


def decode_image(data: bytes) -> Image.Image:
    """Bytes -> fully decoded 8-bit RGB image (`load()` forces truncation errors to surface here)."""
    return decode_image_and_alpha(data)[0]


def decode_image_and_alpha(data: bytes) -> tuple[Image.Image, Image.Image | None]:
    """Bytes -> (8-bit RGB image, its alpha channel as an 8-bit grey image or None when it has none)."""
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        alpha = None
        if img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (img.mode == "P" and "transparency" in img.info):
            alpha = img.convert("RGBA").getchannel("A")
        return to_rgb(img).copy(), alpha


def _decode_image_sample(sample: dict, min_side: int) -> dict:
    shard, key = sample.get("__url__", "<unknown shard>"), sample.get("__key__", "?")
    exts = [e for e in (*IMAGE_EXTS, "jpeg") if e in sample]
    if not exts:
        raise BadSample("missing image", shard, key, f"members {sorted(k for k in sample if not k.startswith('__'))}")
    text = sample.get("txt")
    try:
        caption = text.decode("utf-8").strip() if text is not None else ""
    except UnicodeDecodeError as exn:
        raise BadSample("undecodable caption", shard, key, str(exn)) from exn
    if not caption:
        raise BadSample("missing caption", shard, key)
    try:
        image, alpha = decode_image_and_alpha(sample[exts[0]])
    except Exception as exn:  # Pillow raises OSError, SyntaxError, ValueError, DecompressionBombError...
        raise BadSample("undecodable image", shard, key, f"{type(exn).__name__}: {exn}") from exn
    mask = None
    if MASK_MEMBER in sample:
        try:
            with Image.open(io.BytesIO(sample[MASK_MEMBER])) as m:
                mask = m.convert("L")
        except Exception as exn:
            raise BadSample("undecodable mask", shard, key, f"{type(exn).__name__}: {exn}") from exn
        if mask.size != image.size:
            raise BadSample("mask size", shard, key, f"mask {mask.size}, image {image.size}")
    if min(image.size) < min_side:
        raise BadSample("image too small", shard, key, f"{image.size[0]}x{image.size[1]} < min_side {min_side}")
    try:
        meta = json.loads(sample["json"]) if "json" in sample else {}
    except ValueError as exn:
        raise BadSample("undecodable metadata", shard, key, str(exn)) from exn
    return {"key": key, "image": image, "caption": caption, "meta": meta, "shard": shard, "alpha": alpha, "mask": mask}


def encode_latent_sample(sample: dict, where: str = "sample") -> dict:
    """{key, latent [C,h,w], text_states [L,D], pooled [P], bucket (H,W), caption} -> tar member bytes."""
    missing = [k for k in ("key", *LATENT_TENSORS, "bucket", "caption") if k not in sample]
    if missing:
        raise ValueError(f"{where}: missing fields {missing}; has {sorted(sample)}")
    key = str(sample["key"])
    if not key or "." in key or "/" in key:
        raise ValueError(f"{where}: key {key!r} must be non-empty without '.' or '/' (webdataset splits on them)")
    tensors = {}
    for name in LATENT_TENSORS:
        t = sample[name]
        if not isinstance(t, torch.Tensor) or t.ndim != LATENT_NDIM[name]:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where} (key {key}): {name} must be a {LATENT_NDIM[name]}-D tensor, got {shape}")
        tensors[name] = t.detach().cpu().contiguous()
    if sample.get("mask") is not None:
        m = sample["mask"]
        if m.ndim != MASK_NDIM or tuple(m.shape) != tuple(tensors["latent"].shape[1:]):
            raise ValueError(f"{where} (key {key}): mask must be [h, w] = {list(tensors['latent'].shape[1:])}, got "
                             f"{list(m.shape)}")
        tensors["mask"] = m.detach().float().cpu().contiguous()
    bucket = [int(v) for v in sample["bucket"]]
    if len(bucket) != 2:
        raise ValueError(f"{where} (key {key}): bucket must be (H, W), got {sample['bucket']!r}")
    meta = {"bucket": bucket, "caption": str(sample["caption"])}
    return {"__key__": key, "safetensors": safetensors_save(tensors), "json": json.dumps(meta).encode("utf-8")}


def _decode_latent_sample(sample: dict) -> dict:
    shard, key = sample.get("__url__", "<unknown shard>"), sample.get("__key__", "?")
    if "safetensors" not in sample or "json" not in sample:
        raise BadSample("missing member", shard, key, f"members {sorted(k for k in sample if not k.startswith('__'))}")
    try:
        tensors = safetensors_load(sample["safetensors"])
        meta = json.loads(sample["json"])
    except Exception as exn:
        raise BadSample("undecodable latent", shard, key, f"{type(exn).__name__}: {exn}") from exn
    bad = [n for n in LATENT_TENSORS if n not in tensors or tensors[n].ndim != LATENT_NDIM[n]]
    if bad or not isinstance(meta.get("bucket"), list) or not isinstance(meta.get("caption"), str):
        detail = f"tensors {bad} missing or of wrong rank, or json lacks bucket/caption"
        raise BadSample("malformed latent", shard, key, detail)
    if "mask" in tensors and tensors["mask"].ndim != MASK_NDIM:
        raise BadSample("malformed latent", shard, key, f"mask of rank {tensors['mask'].ndim}, expected {MASK_NDIM}")
    mask = {"mask": tensors["mask"]} if "mask" in tensors else {}
    return {"key": key, **{n: tensors[n] for n in LATENT_TENSORS}, **mask, "bucket": tuple(meta["bucket"]),
            "caption": meta["caption"], "shard": shard}


def write_latent_shards(samples: Iterable[dict], out_dir: Path, shard_size: int) -> ShardStats:
    """Write cached latents (see `encode_latent_sample`) into latent shards plus index.json, all or nothing."""
    return write_latent_shard_sets(((0, s) for s in samples), [out_dir], shard_size)[0]


def write_latent_shard_sets(samples: Iterable[tuple[int, dict]], out_dirs: Sequence[Path],
                            shard_size: int) -> list[ShardStats]:
    """`write_latent_shards` into several sets from one stream: each (i, sample) goes to out_dirs[i] (one pass over
    the images feeding every resolution of a multi-resolution cache). All or nothing: each set is installed only
    when the stream ends, and an error leaves every out_dir as it was."""
    out_dirs = [Path(d) for d in out_dirs]
    _check_shard_size(shard_size)
    for d in out_dirs:
        _check_replaceable(d)
    with contextlib.ExitStack() as stack:
        tmps = [stack.enter_context(atomic_dir(d, what="shard set")) for d in out_dirs]
        sinks = [stack.enter_context(_ShardSink(t, shard_size, "latent")) for t in tmps]
        for n, (i, sample) in enumerate(samples):
            sinks[i].write(encode_latent_sample(sample, where=f"sample {n}"),
                           bucket=tuple(int(v) for v in sample["bucket"]))
        done = [sink.finish() for sink in sinks]
    return [ShardStats(d, names, counts, sum(counts)) for d, (names, counts) in zip(out_dirs, done)]


def read_index(directory: Path) -> dict | None:
    path = Path(directory) / INDEX_NAME
    return read_json(path, ShardError) if path.is_file() else None


def list_shards(source: str | Path | Sequence[str | Path], must_exist: bool = True) -> list[str]:
    """A shard directory (index.json order, else sorted *.tar), a brace pattern, or a list -> shard paths.

    Local paths must exist (`ShardError` lists the missing ones) unless `must_exist=False`."""
    if isinstance(source, (list, tuple)):
        urls = [str(s) for s in source]
    elif Path(source).is_dir():
        index = read_index(Path(source))
        names = [s["name"] for s in index["shards"]] if index else sorted(p.name for p in Path(source).glob("*.tar"))
        urls = [str(Path(source) / n) for n in names]
    else:
        urls = list(braceexpand.braceexpand(str(source)))
    if not urls:
        raise ShardError(f"no shards found in {source}")
    missing = [u for u in urls if must_exist and "://" not in u and not u.startswith("pipe:") and not Path(u).is_file()]
    if missing:
        raise ShardError(f"{len(missing)} of {len(urls)} shards from {source} are missing, e.g. {missing[:3]}")
    return urls


def _worker() -> tuple[int, int]:
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class ShardReader(torch.utils.data.IterableDataset):
    """A webdataset pipeline over image or latent shards for one rank (see the module docstring).

    Yields image samples {key, image: PIL RGB, caption, meta, shard} or latent samples
    {key, latent [C,h,w], text_states [L,D], pooled [P], bucket (H,W), caption, shard}.
    `num_workers` must equal the DataLoader's (0 = iterate in this process). With
    `shuffle_buffer` > 0 the shard order is permuted too; call `set_epoch` before each pass for a
    new order and shuffle; `counter` holds this process's counts.
    """

    def __init__(
        self,
        source: str | Path | Sequence[str | Path],
        kind: str = "image",
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        shuffle_buffer: int = 0,
        seed: int = 0,
        resample: bool = False,
        min_side: int = 16,
        max_bad_fraction: float = 0.01,
        min_samples_for_check: int = 100,
    ):
        super().__init__()
        if kind not in ("image", "latent"):
            raise ValueError(f"kind must be 'image' or 'latent', got {kind!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.shards = list_shards(source)
        self.kind, self.rank, self.world_size = kind, rank, world_size
        self.num_workers, self.shuffle_buffer, self.seed, self.resample = num_workers, shuffle_buffer, seed, resample
        self.min_side, self.epoch = min_side, 0
        groups = world_size * max(num_workers, 1)
        if not resample and len(self.shards) < groups:
            raise ShardError(
                f"{len(self.shards)} shards in {source} < {world_size} ranks x {max(num_workers, 1)} workers: some "
                f"workers would get no shard and the ranks would hang; write smaller shards or pass resample=True"
            )
        self.counter = BadSampleCounter(max_bad_fraction, min_samples_for_check)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _urls(self) -> Iterator[dict]:
        worker, num_workers = _worker()
        if num_workers != max(self.num_workers, 1):
            raise ShardError(
                f"ShardReader declared num_workers={self.num_workers} but the DataLoader runs {num_workers}"
            )
        g, groups = self.rank * num_workers + worker, self.world_size * num_workers
        if self.resample:
            rng = np.random.default_rng([self.seed, self.epoch, g])
            while True:  # infinite: the trainer fixes the steps per epoch, so every rank takes the same number
                url = self.shards[int(rng.integers(len(self.shards)))]
                self.counter.opened(url)
                yield {"url": url}
        # one shard order shared by all ranks and workers (same seed, epoch), then dealt: disjoint slices;
        # listed order when not shuffling, so single-process passes (cache, validate) keep the file order
        order = np.arange(len(self.shards))
        if self.shuffle_buffer > 0:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.shards))
        for i in order[g::groups]:
            self.counter.opened(self.shards[i])
            yield {"url": self.shards[i]}

    def _count_good(self, samples: Iterator[dict]) -> Iterator[dict]:
        for sample in samples:
            self.counter.ok()
            yield sample
        self.counter.check(final=True)

    def __iter__(self) -> Iterator[dict]:
        worker, _ = _worker()
        stages: list[Any] = [self._urls, wds.tarfile_to_samples(handler=self.counter.tar_handler)]
        if self.shuffle_buffer > 1:
            seed = int(np.random.default_rng([self.seed, self.epoch, self.rank, worker, 1]).integers(2**62))
            stages.append(wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=random.Random(seed)))
        decode = _decode_latent_sample if self.kind == "latent" else (lambda s: _decode_image_sample(s, self.min_side))
        stages += [wds.map(decode, handler=self.counter.sample_handler), self._count_good]
        return iter(wds.DataPipeline(*stages))


def read_latent_shards(source: str | Path | Sequence[str | Path], **reader_kwargs: Any) -> Iterator[dict]:
    """All latent samples of a shard set in order (one process, no resampling, no shuffle)."""
    return iter(ShardReader(source, kind="latent", **reader_kwargs))


@dataclass(frozen=True)
class ShardReport:
    """`validate_shards` result: per shard {"ok", "bad": {reason: n}, "indexed"}; index problems."""

    directory: str
    kind: str
    per_shard: dict
    total_ok: int
    total_bad: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when every sample decoded and the index matches the shards."""
        return self.total_bad == 0 and not self.problems

    def summary(self) -> str:
        """One line: what is wrong, by shard and reason (empty when `ok`)."""
        parts = []
        if self.total_bad:
            bad = [f"{name}: {', '.join(f'{n} {reason}' for reason, n in s['bad'].items())}"
                   for name, s in self.per_shard.items() if s["bad"]]
            parts.append(f"{self.total_bad} bad sample{'s' if self.total_bad > 1 else ''} ({'; '.join(bad)})")
        parts += list(self.problems)
        return f"{self.directory}: " + "; ".join(parts) if parts else ""

    def as_dict(self) -> dict:
        return {"directory": self.directory, "kind": self.kind, "per_shard": self.per_shard,
                "total_ok": self.total_ok, "total_bad": self.total_bad, "problems": list(self.problems)}


def validate_shards(directory: Path, kind: str | None = None, min_side: int = 16) -> ShardReport:
    """Read every shard of `directory` once and count good and bad samples per shard.

    Bad data never raises: it is counted (bad samples, a truncated tar) or listed as a problem (no index,
    a shard the index lists but that is missing, a count that differs from the index, a tar the index
    does not list). A directory that does not exist, or holds no shard at all, is a `ShardError`.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ShardError(f"{directory}: no such directory (expected a shard set from `atelier data shards` or "
                         f"`atelier imagegen cache`)")
    index = read_index(directory)
    kind = kind or (index or {}).get("kind") or "image"
    indexed = {s["name"]: s["count"] for s in index["shards"]} if index else {}
    problems = [] if index else [f"no {INDEX_NAME}"]
    if index:
        problems += [f"{p.name}: not listed in {INDEX_NAME}" for p in sorted(directory.glob("*.tar"))
                     if p.name not in indexed]
    per_shard: dict = {}
    for url in list_shards(directory, must_exist=False):
        name = Path(url).relative_to(directory).as_posix()  # as the index names it (rank-RRRRR/... when merged)
        if not Path(url).is_file():
            problems.append(f"{name}: listed in {INDEX_NAME} but missing")
            continue
        reader = ShardReader([url], kind=kind, min_side=min_side, max_bad_fraction=1.0)
        ok = sum(1 for _ in reader)
        per_shard[name] = {"ok": ok, "bad": dict(reader.counter.by_reason), "indexed": indexed.get(name)}
        if name in indexed and indexed[name] != ok + reader.counter.bad:
            bad = reader.counter.bad
            problems.append(f"{name}: {INDEX_NAME} says {indexed[name]} samples, read {ok} good + {bad} bad")
    return ShardReport(str(directory), kind, per_shard, sum(s["ok"] for s in per_shard.values()),
                       sum(sum(s["bad"].values()) for s in per_shard.values()), tuple(problems))
