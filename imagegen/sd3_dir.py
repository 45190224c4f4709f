"""A diffusers `StableDiffusion3Pipeline` (or `FluxPipeline`) directory: its parts, checked, and its scheduler's
sampling settings.

The layout `StableDiffusion3Pipeline.save_pretrained` writes (and the stabilityai SD3 / SD3.5 repos hold):

    model_index.json      {"_class_name": "StableDiffusion3Pipeline", "<part>": ["<library>", "<class>"], ...}
    transformer/          SD3Transformer2DModel (MMDiT or SD3.5's MMDiT-X)
    vae/                  AutoencoderKL (16 latent channels; shift_factor and scaling_factor in its config.json)
    text_encoder/         CLIP-L, CLIPTextModelWithProjection      tokenizer/    CLIPTokenizer
    text_encoder_2/       CLIP-G (OpenCLIP bigG), the same class    tokenizer_2/  CLIPTokenizer
    text_encoder_3/       T5EncoderModel (T5-XXL)                   tokenizer_3/  T5 tokenizer
    scheduler/            FlowMatchEulerDiscreteScheduler (scheduler_config.json)

A `FluxPipeline` directory has the same layout with two text encoders: text_encoder/ CLIP-L (CLIPTextModel, its
pooled output), tokenizer/ CLIPTokenizer, text_encoder_2/ T5EncoderModel (T5-XXL), tokenizer_2/ its T5 tokenizer, and
a FluxTransformer2DModel in transformer/ (imagegen/flux_text.py encodes its prompts). A `QwenImagePipeline` directory
has one text encoder: text_encoder/ Qwen2_5_VLForConditionalGeneration, tokenizer/ its Qwen2 tokenizer
(imagegen/qwen_image_text.py), a QwenImageTransformer2DModel and an AutoencoderKLQwenImage. `PIPELINES` lists each
pipeline class's required parts and tokenizer kinds; model_index.json's `_class_name` picks the row.

A part saved as None (the pipeline loaded with `text_encoder_3=None`, SD3's T5-less mode) is `[null, null]` in
model_index.json and has no folder. Every problem is a `ModelLoadError` naming the file or folder;
`check_pipeline_files` checks every part's files before any part is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from atelier_studio.data.textfile import read_json
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.hf_files import check_tokenizer_dir, check_weights_dir

MODEL_INDEX = "model_index.json"
SCHEDULER_CONFIG = "scheduler_config.json"
SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"
TEXT_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZER_PARTS = ("tokenizer", "tokenizer_2", "tokenizer_3")
MAX_T5_TOKENS = 512  # StableDiffusion3Pipeline.check_inputs refuses a longer max_sequence_length
REQUIRED_PARTS = ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


@dataclass(frozen=True)
class PipelineKind:
    """What a pipeline class's directory must hold: its required parts and the kind of each tokenizer folder."""

    required: tuple[str, ...]
    tokenizers: dict[str, str]


PIPELINES = {
    "StableDiffusion3Pipeline": PipelineKind(REQUIRED_PARTS, {"tokenizer": "clip", "tokenizer_2": "clip",
                                                              "tokenizer_3": "t5"}),
    "FluxPipeline": PipelineKind(REQUIRED_PARTS, {"tokenizer": "clip", "tokenizer_2": "t5"}),
    "QwenImagePipeline": PipelineKind(("transformer", "vae", "scheduler", "text_encoder", "tokenizer"),
                                      {"tokenizer": "qwen"}),
}

# FlowMatchEulerDiscreteScheduler options and the value the Euler sampler of imagegen/flow.py implements. A
# scheduler config with any other value would sample differently, so it is refused instead of approximated.
_SCHEDULER_FIXED = {"num_train_timesteps": 1000, "invert_sigmas": False, "shift_terminal": None,
                    "use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
                    "stochastic_sampling": False, "time_shift_type": "exponential"}
# Scheduler config keys that are FlowArgs fields of the same name and meaning.
SCHEDULER_FLOW_KEYS = ("shift", "use_dynamic_shifting", "base_image_seq_len", "max_image_seq_len", "base_shift",
                       "max_shift")


def is_pipeline_dir(path: str | os.PathLike) -> bool:
    """True when `path` is a directory holding a model_index.json (a diffusers pipeline)."""
    return bool(path) and (Path(path) / MODEL_INDEX).is_file()


def read_model_index(path: str | os.PathLike, expect: str | None = None) -> dict:
    """model_index.json of a pipeline directory of one of `PIPELINES` (`expect`: that one), its class and required
    parts checked."""
    index_path = Path(path) / MODEL_INDEX
    known = [expect] if expect else list(PIPELINES)
    if not index_path.is_file():
        raise ModelLoadError(f"{path}: no {MODEL_INDEX} (expected a diffusers {' or '.join(known)} directory)")
    index = read_json(index_path, ModelLoadError)
    if not isinstance(index, dict):
        raise ModelLoadError(f"{index_path}: expected a JSON object, got {type(index).__name__}")
    name = index.get("_class_name")
    if name not in known:
        raise ModelLoadError(f"{index_path}: _class_name is {name!r}, expected {' or '.join(map(repr, known))}")
    missing = [p for p in PIPELINES[name].required if not has_part(index, p)]
    if missing:
        raise ModelLoadError(f"{index_path}: no {', '.join(missing)} (a {name} needs "
                             f"{', '.join(PIPELINES[name].required)})")
    return index


def has_part(index: dict, name: str) -> bool:
    """Whether model_index.json lists `name` as a saved part (not absent, not [null, null])."""
    entry = index.get(name)
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None and entry[1] is not None


def part_dir(path: str | os.PathLike, name: str) -> Path:
    """The folder of part `name`, which model_index.json lists and which must exist with a config or tokenizer."""
    index = read_model_index(path)
    folder = Path(path) / name
    if not has_part(index, name):
        raise ModelLoadError(f"{Path(path) / MODEL_INDEX}: {name} is not part of this pipeline (saved as None)")
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: missing (model_index.json lists {name})")
    return folder


WEIGHT_PARTS = ("transformer", "vae") + TEXT_PARTS


def check_pipeline_files(path: str | os.PathLike) -> None:
    """Every part model_index.json lists holds what loading it needs, checked before any is loaded (so the error is
    the only line, not the last after the load progress of the parts before it): whole safetensors files in each
    model folder, a vocabulary in each tokenizer folder (pipeline/hf_files.py)."""
    index = read_model_index(path)
    for name in WEIGHT_PARTS:
        if has_part(index, name):
            check_weights_dir(part_dir(path, name), name)
    for name, kind in PIPELINES[index["_class_name"]].tokenizers.items():
        if has_part(index, name):
            check_tokenizer_dir(part_dir(path, name), kind)


def scheduler_config(path: str | os.PathLike) -> dict:
    """The pipeline's scheduler/scheduler_config.json, checked to be a scheduler imagegen/flow.py samples exactly."""
    cfg_path = part_dir(path, "scheduler") / SCHEDULER_CONFIG
    if not cfg_path.is_file():
        raise ModelLoadError(f"{cfg_path}: missing")
    cfg = read_json(cfg_path, ModelLoadError)
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("_class_name") != SCHEDULER_CLASS:
        raise ModelLoadError(f"{cfg_path}: _class_name is {cfg.get('_class_name')!r}; only {SCHEDULER_CLASS} is "
                             f"supported (the Euler sampler of SD3)")
    bad = {k: cfg[k] for k, want in _SCHEDULER_FIXED.items() if k in cfg and cfg[k] != want}
    if bad:
        raise ModelLoadError(f"{cfg_path}: unsupported scheduler settings {bad}; Atelier's sampler implements "
                             f"{ {k: _SCHEDULER_FIXED[k] for k in bad} }")
    return cfg


def scheduler_flow(path: str | os.PathLike) -> dict:
    """The FlowArgs fields the pipeline's scheduler sets (shift and the dynamic-shift settings), by name."""
    cfg = scheduler_config(path)
    return {k: cfg[k] for k in SCHEDULER_FLOW_KEYS if k in cfg}


def transformer_config(path: str | os.PathLike) -> dict:
    """The pipeline's transformer/config.json (as JSON; imagegen/hf.py turns it into MMDiTArgs)."""
    cfg_path = part_dir(path, "transformer") / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{cfg_path}: missing")
    cfg = read_json(cfg_path, ModelLoadError)
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def default_resolution(path: str | os.PathLike) -> int:
    """The pipeline's default image side, as StableDiffusion3Pipeline computes it: transformer sample_size x the
    VAE's downsampling 2^(len(block_out_channels) - 1); QwenImagePipeline's: 128 x 2^len(temperal_downsample)."""
    vae_cfg_path = part_dir(path, "vae") / "config.json"
    vae_cfg = read_json(vae_cfg_path, ModelLoadError) if vae_cfg_path.is_file() else None
    if isinstance(vae_cfg, dict) and isinstance(vae_cfg.get("temperal_downsample"), list):  # AutoencoderKLQwenImage
        return 128 * 2 ** len(vae_cfg["temperal_downsample"])  # QwenImagePipeline: default_sample_size x its factor
    if not isinstance(vae_cfg, dict) or not isinstance(vae_cfg.get("block_out_channels"), list):
        raise ModelLoadError(f"{vae_cfg_path}: missing, or without a block_out_channels list")
    return int(transformer_config(path).get("sample_size", 128)) * 2 ** (len(vae_cfg["block_out_channels"]) - 1)


__all__ = ["PIPELINES", "is_pipeline_dir", "read_model_index", "has_part", "part_dir", "check_pipeline_files",
           "scheduler_config", "scheduler_flow", "transformer_config", "default_resolution", "MODEL_INDEX",
           "SCHEDULER_CONFIG", "SCHEDULER_FLOW_KEYS", "TEXT_PARTS", "TOKENIZER_PARTS", "MAX_T5_TOKENS"]
