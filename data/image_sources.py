"""Image/caption data in the layouts trainers' users keep it in -> image shards (data/shards.py's format).

`atelier data shards --from SRC --out DIR` reads SRC (a path, or a hub dataset id in the local cache: pipeline/hub.py)
as one of:

    parquet      a .parquet file, or a folder holding only .parquet files: an image column (bytes, or datasets'
                 Image struct {bytes, path}) and a caption column
    imagefolder  Hugging Face's layout: metadata.jsonl or metadata.csv (in SRC or any sub-folder) with `file_name`,
                 relative to the metadata file's folder, and a caption column
    sidecars     images anywhere below SRC with a caption file beside each: `a.png` + `a.txt` (or `a.caption`),
                 the kohya / ai-toolkit / OneTrainer layout

The caption column (imagefolder, parquet) is `caption_column` when given, else the one text column other than
`file_name` / the image; several text columns are an error naming them. A folder right below SRC named `N_name`
(kohya's repeat folders, `10_cat`) repeats each of its images N times in the shards, each copy its own sample, so an
epoch sees it N times as it would in kohya's trainer.

Bad input in the listing (a metadata line without `file_name`, a file it names that does not exist, no caption
column) is a DataError naming `file:line`. A bad image is skipped and counted: an empty or undecodable file, an image
format the shards do not carry (jpg, png, webp only: the original bytes are stored, never re-encoded), an image with
no caption or an empty one. The counts go into the shard set's index.json ("skipped": {reason: n}) and the command's
summary line, with the first file skipped for each reason; a source that leaves no sample is an error.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from PIL import Image
from rich.progress import Progress

from atelier_studio.data.shards import ShardStats, _shard_set, _ShardSink
from atelier_studio.data.textfile import iter_json_lines, iter_lines
from atelier_studio.pipeline.errors import DataError
from atelier_studio.pipeline.hub import resolve_dataset_path

FILE_EXTS = ("jpg", "jpeg", "png", "webp")  # the image files a folder source lists
PIL_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}  # what Pillow says the bytes are -> shard member
CAPTION_EXTS = (".txt", ".caption")
METADATA = ("metadata.jsonl", "metadata.csv")
REPEAT_FOLDER = re.compile(r"^(\d+)_(.+)$")


@dataclass(frozen=True)
class SourceImage:
    """One image of a source: ``where`` names it in messages, ``name`` is stored in the sample's json."""

    where: str
    name: str
    read: Callable[[], bytes]
    caption: str
    repeats: int = 1


@dataclass
class Skipped:
    """Images left out, by reason, with the first one of each reason."""

    by_reason: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.by_reason[reason] += 1
        self.first.setdefault(reason, where)

    def summary(self) -> str:
        if not self.by_reason:
            return "skipped 0 images"
        parts = [f"{reason} {n} (first: {self.first[reason]})" for reason, n in sorted(self.by_reason.items())]
        return f"skipped {sum(self.by_reason.values())} images: " + "; ".join(parts)


# ----------------------------------------------------------------------------------------------------------------------
# Layouts


def repeats_of(src: Path, path: Path) -> int:
    """N for an image below SRC/N_name/ (kohya's repeat folders), else 1."""
    parts = path.relative_to(src).parts
    m = REPEAT_FOLDER.match(parts[0]) if len(parts) > 1 else None
    if m is None:
        return 1
    if int(m[1]) < 1:
        raise DataError(f"{src / parts[0]}: a repeat folder with {m[1]} repeats; name it with N >= 1 (e.g. 1_{m[2]})")
    return int(m[1])


def _caption_column(first: dict, skip: set[str], given: str | None, where: str) -> str:
    """`given`, or the one column of the first row holding text (numbers, sizes and ids are no captions)."""
    columns = list(first)
    if given:
        if given not in columns:
            raise DataError(f"{where}: no column {given!r} (--caption-column; columns: {', '.join(columns)})")
        return given
    text = [c for c in columns if c not in skip and isinstance(first[c], str)]
    if len(text) == 1:
        return text[0]
    if not text:
        raise DataError(f"{where}: no caption column (columns: {', '.join(columns)}); add one, e.g. 'text'")
    raise DataError(f"{where}: several columns could be the caption ({', '.join(text)}); choose one with "
                    f"--caption-column")


def _metadata_rows(meta: Path) -> Iterator[tuple[str, dict]]:
    if meta.suffix == ".jsonl":
        for where, row in iter_json_lines(meta):
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object with 'file_name' and a caption")
            yield where, row
        return
    lines = [text for _, text in iter_lines(meta)]  # non-UTF-8 is named file:line here
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    for row in reader:
        yield f"{meta}:{reader.line_num}", row


def iter_imagefolder(src: Path, metas: list[Path], caption_column: str | None) -> Iterator[SourceImage]:
    for meta in metas:
        column = None
        for where, row in _metadata_rows(meta):
            if "file_name" not in row:
                raise DataError(f"{where}: no 'file_name' (imagefolder metadata names each image in 'file_name')")
            if column is None:
                column = _caption_column(row, {"file_name"}, caption_column, where)
            path = meta.parent / str(row["file_name"])
            if not path.is_file():
                raise DataError(f"{where}: file_name {row['file_name']!r}: no such file {path}")
            caption = row.get(column)
            yield SourceImage(where, path.relative_to(src).as_posix(), path.read_bytes,
                              caption if isinstance(caption, str) else "", repeats_of(src, path))


def iter_sidecars(src: Path, skipped: Skipped) -> Iterator[SourceImage]:
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        if path.suffix.lower().lstrip(".") not in FILE_EXTS:
            continue
        side = next((path.with_suffix(ext) for ext in CAPTION_EXTS if path.with_suffix(ext).is_file()), None)
        if side is None:
            skipped.add("no caption file", str(path))
            continue
        caption = "\n".join(text for _, text in iter_lines(side)).strip()
        yield SourceImage(str(path), path.relative_to(src).as_posix(), path.read_bytes, caption,
                          repeats_of(src, path))


def _image_bytes(value: object) -> bytes | None:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)):
        return bytes(value["bytes"])
    return None


def iter_parquet(files: list[Path], caption_column: str | None) -> Iterator[SourceImage]:
    import datasets

    datasets.disable_progress_bars()
    for file in files:
        try:
            ds = datasets.load_dataset("parquet", data_files=str(file), split="train", streaming=True)
            features = ds.features or {}
            for col, feat in features.items():  # datasets' Image columns: the stored bytes, not a decoded image
                if isinstance(feat, datasets.Image):
                    ds = ds.cast_column(col, datasets.Image(decode=False))
            rows = iter(ds)
            first = next(rows, None)
        except Exception as e:  # pyarrow and datasets raise many kinds for a file that is not parquet
            raise DataError(f"{file}: cannot be read as parquet ({str(e).strip().splitlines()[0][:200]})") from None
        if first is None:
            continue
        images = [c for c, v in first.items() if _image_bytes(v) is not None]
        if len(images) != 1:
            raise DataError(f"{file}: expected one image column (bytes, or an Image struct with 'bytes'), found "
                            f"{', '.join(images) or 'none'} among {', '.join(first)}")
        image_col = images[0]
        column = _caption_column(first, {image_col}, caption_column, f"{file}")
        for i, row in enumerate(_chain(first, rows), start=1):
            data = _image_bytes(row.get(image_col)) or b""
            caption = row.get(column)
            yield SourceImage(f"{file} row {i}", f"{file.name}#{i}", lambda d=data: d,
                              caption if isinstance(caption, str) else "")


def _chain(first: dict, rest: Iterator[dict]) -> Iterator[dict]:
    yield first
    yield from rest


def iter_source(src: Path, caption_column: str | None, skipped: Skipped) -> tuple[str, Iterator[SourceImage]]:
    """(layout name, images) of SRC (module docstring)."""
    src = Path(resolve_dataset_path(str(src), "--from"))  # a hub dataset id: its cached snapshot
    if not src.exists():
        raise DataError(f"{src}: no such file or folder")
    if src.is_file():
        if src.suffix != ".parquet":
            raise DataError(f"{src}: a file source must be .parquet; give a folder for images with caption files or "
                            f"an imagefolder with metadata.jsonl / metadata.csv")
        return "parquet", iter_parquet([src], caption_column)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    if files and all(p.suffix == ".parquet" for p in files):
        return "parquet", iter_parquet(files, caption_column)
    metas = [p for p in files if p.name in METADATA]
    if metas:
        return "imagefolder", iter_imagefolder(src, metas, caption_column)
    return "sidecars", iter_sidecars(src, skipped)


# ----------------------------------------------------------------------------------------------------------------------
# Checking one image and writing the shards


def check_image(data: bytes) -> tuple[str, int, int] | str:
    """(shard member, width, height) of good image bytes, or the reason they are skipped."""
    if not data:
        return "empty image file"
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()  # the container's own checks (PNG chunk CRCs)
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # every pixel decoded once: a truncated body shows here, not at training time
            fmt, (width, height) = img.format, img.size
    except Exception:  # Pillow raises OSError, SyntaxError, ValueError, DecompressionBombError...
        return "undecodable image"
    if fmt not in PIL_FORMATS:
        return f"unsupported format {fmt} (not jpg, png or webp)"
    return PIL_FORMATS[fmt], width, height


@dataclass(frozen=True)
class SourceStats:
    layout: str
    images: int  # distinct images written
    shards: ShardStats  # samples: images × their repeats
    skipped: Skipped


def write_source_shards(src: Path, out_dir: Path, shard_size: int, caption_column: str | None = None,
                        progress: bool = True) -> SourceStats:
    """Image shards from SRC in any layout of the module docstring; nothing is written unless it all goes through."""
    skipped = Skipped()
    layout, images = iter_source(Path(src), caption_column, skipped)
    written = 0

    def write(sink: _ShardSink) -> None:
        nonlocal written
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task(f"sharding {src}", total=None)
            for image in images:
                bar.advance(task)
                if not image.caption.strip():
                    skipped.add("empty caption", image.where)
                    continue
                data = image.read()
                checked = check_image(data)
                if isinstance(checked, str):
                    skipped.add(checked, image.where)
                    continue
                member, width, height = checked
                for copy in range(image.repeats):
                    meta = {"width": width, "height": height, "path": image.name}
                    if image.repeats > 1:
                        meta["repeat"] = copy
                    sink.write({"__key__": f"{sum(sink.counts):09d}", member: data,
                                "txt": image.caption.strip().encode("utf-8"), "json": json.dumps(meta).encode()})
                written += 1
        if written == 0:
            raise DataError(f"{src}: no usable image ({layout} layout); {skipped.summary()}")
        sink.index_extra["skipped"] = dict(skipped.by_reason)

    stats = _shard_set(Path(out_dir), shard_size, "image", write)
    return SourceStats(layout, written, stats, skipped)


__all__ = ["SourceImage", "Skipped", "SourceStats", "iter_source", "check_image", "write_source_shards"]
