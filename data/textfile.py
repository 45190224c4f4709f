"""UTF-8 text files read line by line, so a byte that is not UTF-8 is reported as `file:line`; JSON files too.

Every input file of one record per line (training JSONL, briefs, captions, prompts, tokenizer corpora)
is read through here, and `read_json` reads the JSON files a user may hand over (model and adapter
configs, shard indexes), turning bad bytes or bad JSON into the caller's error class naming the file.
Each line is decoded on its own: Python's whole-file decoding would fail with a byte offset and no file
name. Lines end at "\\n" (a "\\r" before it is dropped, so CRLF files read the same); a UTF-8 byte-order
mark at the start of the file is skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from atelier_studio.pipeline.errors import AtelierError, DataError, decode_utf8

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


def iter_json_lines(path: str | os.PathLike, error: type[AtelierError] = DataError) -> Iterator[tuple[str, Any]]:
    """("path:line", parsed value) for every non-blank line of a JSONL file; a line that is not JSON is ``error``
    naming path:line (a non-UTF-8 line is a DataError, as in `iter_lines`)."""
    for lineno, line in iter_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None


def read_lines(path: str | os.PathLike) -> list[str]:
    """Every line of a UTF-8 text file, in order (line i + 1 is element i), without line endings."""
    return [text for _, text in iter_lines(path)]


def read_json(path: str | os.PathLike, error: type[AtelierError] = DataError) -> Any:
    """The JSON value in ``path``; bytes that are not UTF-8 or text that is not JSON are ``error`` naming the file."""
    path = Path(path)
    text = decode_utf8(path.read_bytes(), path, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None


__all__ = ["iter_lines", "iter_json_lines", "read_lines", "read_json"]
