"""UTF-8 text files read line by line, so a byte that is not UTF-8 is reported as `file:line`.

Every input file of one record per line (training JSONL, briefs, captions, prompts, tokenizer corpora)
is read through here. Each line is decoded on its own: Python's whole-file decoding would fail with a
byte offset and no file name. Lines end at "\\n" (a "\\r" before it is dropped, so CRLF files read the
same); a UTF-8 byte-order mark at the start of the file is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from pipeline.errors import DataError

BOM = b"\xef\xbb\xbf"


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(line number from 1, text without its line ending) for every line; a non-UTF-8 line is a DataError."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory; expected a text file")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x}, byte {e.start + 1} "
                                f"of the line); save the file as UTF-8") from None
            yield lineno, text


def read_lines(path: str | os.PathLike) -> list[str]:
    """Every line of a UTF-8 text file, in order (line i + 1 is element i), without line endings."""
    return [text for _, text in iter_lines(path)]


__all__ = ["iter_lines", "read_lines"]
