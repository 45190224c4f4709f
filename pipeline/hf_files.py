"""Hugging Face model and tokenizer folders, checked before anything loads them.

Both trainers read folders a user hands over (a designer model, an SD3 pipeline's parts, a text encoder). What
transformers and diffusers do with a damaged one is not an error a user can act on: a truncated safetensors file
is a `SafetensorError` traceback, a VAE folder without weights an `OSError` about a file name it guessed, and a
CLIP tokenizer folder without its vocabulary loads without complaint as a 3-token tokenizer that turns every
caption into unknown tokens. These checks run first and raise a ModelLoadError naming the file or folder:

- `read_safetensors_header`: the header of one file, every tensor's byte range checked against the file size
  (a cut file, a garbage header, a dtype whose size does not match the shape);
- `check_weights_dir`: every safetensors file of a model folder (the single file, or each shard its index
  lists), and that there are some: pickle files (.bin, .pt) are never loaded;
- `check_tokenizer_dir` / `check_vocab_size`: a tokenizer folder holds its vocabulary (CLIP: vocab.json +
  merges.txt or tokenizer.json; T5: spiece.model or tokenizer.json), and the loaded tokenizer's size fits the
  text encoder's embedding (no id past it, and not a small fraction of it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from atelier_studio.pipeline.errors import ModelLoadError

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1}
# What a tokenizer folder must hold, by kind: any one of the alternatives (each a set of files), as
# transformers' CLIPTokenizer and T5 tokenizers read them.
TOKENIZER_FILES = {"clip": (("tokenizer.json",), ("vocab.json", "merges.txt")),
                   "t5": (("tokenizer.json",), ("spiece.model",)),
                   "qwen": (("tokenizer.json",), ("vocab.json", "merges.txt"))}
# A tokenizer of fewer tokens than this fraction of its encoder's vocabulary lost its vocabulary file: released
# pairs differ by padding rows only (T5: 32100 tokens, 32128 embedding rows).
MIN_VOCAB_FRACTION = 0.9


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """Tensor entries of a safetensors header, after checking every tensor lies inside the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: safetensors file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        n = int.from_bytes(raw, "little")
        if 8 + n > size:
            raise ModelLoadError(f"{path}: truncated safetensors file (header claims {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # not JSON, or not even UTF-8
            raise ModelLoadError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    data_bytes = size - 8 - n
    header.pop("__metadata__", None)
    for key, info in header.items():
        try:
            start, end = info["data_offsets"]
            want = math.prod(info["shape"]) * ITEMSIZE.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{path}: corrupt safetensors header (entry {key!r} is {info!r})") from None
        if end - start != want:
            raise ModelLoadError(f"{path}: tensor {key!r} {info['dtype']}{info['shape']} needs {want} bytes, "
                                 f"header gives {end - start}")
        if end > data_bytes:
            raise ModelLoadError(f"{path}: tensor {key!r} ends at data byte {end} but the file holds {data_bytes} "
                                 f"(truncated file?)")
    return header


def check_weights_dir(folder: str | Path, what: str = "") -> list[Path]:
    """The safetensors files of a model folder, each header checked; ModelLoadError naming what is wrong.

    A folder with an index (`*.safetensors.index.json`) is checked shard by shard as the index lists them;
    otherwise every `*.safetensors` file in it. `what` names the folder's role in the message ("vae", ...).
    """
    folder = Path(folder)
    subject = f"{what} {folder}" if what else str(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{subject}: not a directory")
    files: list[Path] = []
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shard {folder / missing[0]} is listed but missing")
        files += [folder / name for name in names]
    if not files:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {pickled}: pickle files are never loaded; convert them to safetensors)" if pickled else ""
        raise ModelLoadError(f"{subject}: no safetensors weights in this folder{hint}")
    for f in files:
        read_safetensors_header(f)
    return files


def check_tokenizer_dir(folder: str | Path, kind: str) -> Path:
    """A tokenizer folder of `kind` ("clip", "t5" or "qwen") that holds its vocabulary files; ModelLoadError naming
    it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: tokenizer folder not found")
    options = TOKENIZER_FILES[kind]
    if not any(all((folder / name).is_file() for name in option) for option in options):
        need = " or ".join(" + ".join(option) for option in options)
        raise ModelLoadError(f"{folder}: no tokenizer vocabulary ({kind.upper()} needs {need}); copy the "
                             f"tokenizer's files from the released model into it")
    return folder


def check_vocab_size(tokenizer, folder: str | Path, vocab_size: int, encoder: str | Path) -> None:
    """The tokenizer loaded from `folder` fits the embedding of size `vocab_size` of the text encoder `encoder`."""
    n = len(tokenizer)
    if n > vocab_size:
        raise ModelLoadError(f"{folder}: the tokenizer has {n} tokens but {encoder}'s config.json vocab_size is "
                             f"{vocab_size}: ids past it have no embedding (a tokenizer of another model?)")
    if n < MIN_VOCAB_FRACTION * vocab_size:
        raise ModelLoadError(f"{folder}: the tokenizer has {n} tokens for {encoder}'s vocab_size {vocab_size}: its "
                             f"vocabulary did not load (a missing or damaged tokenizer.json?)")


__all__ = ["read_safetensors_header", "check_weights_dir", "check_tokenizer_dir", "check_vocab_size", "ITEMSIZE",
           "TOKENIZER_FILES", "MIN_VOCAB_FRACTION"]
