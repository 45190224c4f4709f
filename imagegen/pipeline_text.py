"""Opening the text encoders of a diffusers pipeline directory (StableDiffusion3Pipeline, FluxPipeline,
QwenImagePipeline): what imagegen/sd3_text.py, flux_text.py and qwen_image_text.py share.

`open_text_pipeline` checks the directory, the caption length against the pipeline's limit, its model_index.json
and every part's files before anything loads; `load_text_part` loads one part folder with its files checked first
(a tokenizer's vocabulary, an encoder's whole safetensors files) and turns a loader's error into one line naming the
folder. Every failure is a TextEncoderError.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from atelier_studio.imagegen.sd3_dir import check_pipeline_files, part_dir, read_model_index
from atelier_studio.imagegen.text import TextEncoderError
from atelier_studio.pipeline.hf_files import check_tokenizer_dir, check_weights_dir


def open_text_pipeline(path: str | os.PathLike, pipeline: str, label: str, max_sequence_length: int, limit: int,
                       limit_source: str, check_files: bool = True) -> tuple[Path, dict]:
    """(the directory, its model_index.json) of a `pipeline` directory (named `label` in errors) whose text encoders
    will encode up to `max_sequence_length` tokens, at most `limit` (`limit_source` says whose limit it is).
    check_files=False leaves sd3_dir.check_pipeline_files to the caller, after its own checks of the index."""
    root = Path(path)
    if not root.is_dir():
        raise TextEncoderError(f"text.encoder: {label} pipeline directory not found: {root}")
    if not 1 <= max_sequence_length <= limit:
        raise TextEncoderError(f"text.max_sequence_length: must be in [1, {limit}] ({limit_source}), got "
                               f"{max_sequence_length}")
    index = read_model_index(root, pipeline)
    if check_files:
        check_pipeline_files(root)  # every part's files, before the first is loaded
    return root, index


def load_text_part(root: Path, what: str, load: Callable[[str], Any], tokenizer: str = "") -> Any:
    """Part folder `what` of the pipeline at `root` through `load(folder)`: a tokenizer folder of kind `tokenizer`
    ("clip", "t5", ...: pipeline/hf_files.py) must hold its vocabulary, any other folder whole safetensors files."""
    folder = part_dir(root, what)  # a part model_index.json does not name is one line from sd3_dir
    if tokenizer:
        check_tokenizer_dir(folder, tokenizer)
    else:
        check_weights_dir(folder, what)
    try:
        return load(str(folder))
    except (OSError, ValueError) as e:
        raise TextEncoderError(f"{folder}: cannot load it ({type(e).__name__}: {e})") from e


__all__ = ["open_text_pipeline", "load_text_part"]
