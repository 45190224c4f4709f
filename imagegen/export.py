"""Write a `StableDiffusion3Pipeline` (or `FluxPipeline`) directory: a base pipeline's parts with a trained
transformer swapped in. Both have the same layout (imagegen/sd3_dir.py); the examples below are SD3's.

    export_pipeline(base, out, transformer=run / "ema", vae=vae_dir, flow=flow_args)
    StableDiffusion3Pipeline.from_pretrained(out)   # renders what `atelier imagegen sample --model out` renders

What goes in (imagegen/sd3_dir.py describes the layout):
- transformer/: the given diffusers transformer directory (a full fine-tune's `transformer/` or `ema/`), or the
  base's when `transformer` is None (a LoRA export keeps the base transformer and adds its weights file through
  `extra`, e.g. `pytorch_lora_weights.safetensors`, which `load_lora_weights(out)` reads);
- vae/: the VAE the latents were made with (`vae`: a VAE directory or a pipeline holding vae/; default the base's);
- scheduler/: the base's FlowMatchEulerDiscreteScheduler config, with shift and the dynamic-shift settings taken
  from `flow` when given, so the pipeline samples with the run's settings;
- the text encoders and tokenizers of the base, T5 included even for a run trained without it (`text.use_t5 =
  false`): diffusers' from_pretrained refuses a model_index.json whose text_encoder_3 is null unless the caller
  passes `text_encoder_3=None, tokenizer_3=None`, which is how such a run's pipeline is loaded to render as trained.

Files are hard links to the sources where the file system allows (no copy of a multi-GB T5), else copies.
safetensors files are never modified in place, so a link is as safe as a copy. The directory appears
complete or not at all (pipeline/atomic.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from atelier_studio.imagegen.autoencoder import find_vae_dir
from atelier_studio.imagegen.sd3_dir import (
    MODEL_INDEX,
    SCHEDULER_CONFIG,
    SCHEDULER_FLOW_KEYS,
    has_part,
    part_dir,
    read_model_index,
    scheduler_config,
)
from atelier_studio.pipeline.atomic import atomic_dir
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.progress import log


def _link_tree(src: Path, dst: Path) -> tuple[int, int]:
    """Hard-link (else copy) every file under src to the same place under dst; (linked, copied) file counts.
    Symbolic links (a Hugging Face cache snapshot's files) are followed: the file they point at is linked."""
    linked = copied = 0
    for root, dirs, files in os.walk(src, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .cache, .git: not part of the model
        out = dst / Path(root).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            source = Path(root) / name
            try:
                os.link(source.resolve(), out / name)
                linked += 1
            except OSError:  # another file system, or links not allowed
                shutil.copy2(source, out / name)
                copied += 1
    return linked, copied


def _flow_scheduler(config: dict, flow) -> dict:
    """The scheduler config with the FlowArgs' shift and dynamic-shift settings."""
    values = dataclasses.asdict(flow)
    return {**config, **{k: values[k] for k in SCHEDULER_FLOW_KEYS}}


def export_pipeline(base: str | os.PathLike, out: str | os.PathLike, transformer: str | os.PathLike | None = None,
                    vae: str | os.PathLike | None = None, flow=None,
                    extra: Callable[[Path], None] | None = None) -> Path:
    """`base` (an SD3 pipeline directory) -> `out`, a complete pipeline directory (see the module docstring).

    `transformer`: a diffusers SD3 transformer directory to put in (None: the base's). `vae`: a VAE directory
    or a pipeline holding vae/ (None: the base's). `flow`: an `imagegen.flow.FlowArgs` whose shift settings go
    into the scheduler config (None: the base's as they are). `extra(tmp)` may add files before the directory
    is installed. Returns `out`.
    """
    base, out = Path(base), Path(out)
    index = read_model_index(base)
    sources: dict[str, Path] = {}
    for name, entry in index.items():
        if name.startswith("_") or not has_part(index, name):
            continue
        sources[name] = part_dir(base, name)
    if transformer is not None:
        transformer = Path(transformer)
        if not (transformer / "config.json").is_file():
            raise ModelLoadError(f"{transformer}: not a diffusers transformer directory (no config.json)")
        sources["transformer"] = transformer
    if vae is not None:
        sources["vae"] = find_vae_dir(vae)
    scheduler = scheduler_config(base)
    if flow is not None:
        changed = {k: (scheduler.get(k), getattr(flow, k)) for k in SCHEDULER_FLOW_KEYS
                   if scheduler.get(k) != getattr(flow, k)}
        if changed:
            log(f"export {out}: scheduler settings from the run's [flow] instead of {base}'s: "
                + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))
        scheduler = _flow_scheduler(scheduler, flow)
    linked = copied = 0
    with atomic_dir(out, what="pipeline directory") as tmp:
        for name, src in sorted(sources.items()):
            if name == "scheduler":
                (tmp / name).mkdir()
                (tmp / name / SCHEDULER_CONFIG).write_text(json.dumps(scheduler, indent=2, sort_keys=True) + "\n")
                continue
            n_linked, n_copied = _link_tree(src, tmp / name)
            linked, copied = linked + n_linked, copied + n_copied
        (tmp / MODEL_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if extra is not None:
            extra(tmp)
    log(f"export: pipeline directory {out} ({linked} files linked, {copied} copied from {base}"
        f"{f', transformer/ from {transformer}' if transformer is not None else ''})")
    return out


__all__ = ["export_pipeline"]
