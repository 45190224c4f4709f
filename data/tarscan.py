"""The samples of a WebDataset tar by position: member offsets from the headers, payloads read only on demand.

A WebDataset sample is a run of consecutive tar members sharing a key (the member path up to the first dot
of its base name; the rest is the extension): `k0.json`, `k0.safetensors`, `k1.json`, ... `iter_tar_samples`
reads the headers of a seekable tar file and yields one `TarSample` per run, with each member's data offset and
size, seeking over the payloads. The caller reads what it needs later with `read_at` (a few hundred bytes of
metadata now, the tensors when the sample is batched), so a shard can be planned without holding it.

Damage: a cut-off tar raises `TruncatedTar` at the point where it ends; the run being read when it ends is
never yielded (its last member's data is what is missing). A run with an extension twice is yielded with
`duplicate` set (WebDataset refuses such a sample), for the caller to count.
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from typing import BinaryIO, Iterator

# WebDataset's split of a member path into (key, extension): the extension starts at the first dot of the base name
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


class TruncatedTar(Exception):
    """The tar ends inside a header or a payload (a partial copy, a full disk during the write)."""


@dataclass(frozen=True)
class TarSample:
    """One sample: `members` maps extension -> (data offset in the file, size in bytes)."""

    key: str
    members: dict[str, tuple[int, int]]
    duplicate: str | None = None  # an extension that appeared twice in this run


def iter_tar_samples(f: BinaryIO) -> Iterator[TarSample]:
    """The samples of the tar open in `f` (seekable, binary), in file order."""
    try:
        tf = tarfile.open(fileobj=f, mode="r:")  # "r:" on a seekable file: payloads are skipped by seeking
    except (tarfile.ReadError, EOFError, OSError) as exn:
        raise TruncatedTar(f"{type(exn).__name__}: {exn}") from None
    key: str | None = None
    members: dict[str, tuple[int, int]] = {}
    duplicate: str | None = None
    while True:
        try:
            info = tf.next()  # also checks that the previous member's payload is complete
        except (tarfile.ReadError, EOFError, OSError) as exn:
            raise TruncatedTar(f"{type(exn).__name__}: {exn}") from None
        tf.members.clear()  # TarFile keeps every header it read; a plan keeps offsets only
        if info is None:
            break
        if not info.isreg():
            continue
        m = _KEY_EXT.match(info.name)
        if m is None:  # no extension: WebDataset skips such members too
            continue
        k, ext = m.group(1), m.group(2).lower()
        if k != key:
            if key is not None:
                yield TarSample(key, members, duplicate)
            key, members, duplicate = k, {}, None
        if ext in members:
            duplicate = duplicate or ext
        members[ext] = (info.offset_data, info.size)
    if key is not None:
        yield TarSample(key, members, duplicate)


def read_at(f: BinaryIO, offset: int, size: int) -> bytes:
    """`size` bytes at `offset`; `TruncatedTar` when the file ends first."""
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise TruncatedTar(f"{size} bytes at offset {offset} wanted, the file ends after {len(data)}")
    return data


def read_into(f: BinaryIO, offset: int, out: memoryview) -> None:
    """Fill `out` with the bytes at `offset` (no intermediate copy); `TruncatedTar` when the file ends first."""
    f.seek(offset)
    got = 0
    while got < len(out):
        n = f.readinto(out[got:])
        if not n:
            raise TruncatedTar(f"{len(out)} bytes at offset {offset} wanted, the file ends after {got}")
        got += n


__all__ = ["TarSample", "TruncatedTar", "iter_tar_samples", "read_at", "read_into"]
