"""MMDiT weights in diffusers' layout: config.json + diffusion_pytorch_model.safetensors (or shards).

A directory written here loads with ``SD3Transformer2DModel.from_pretrained(dir)`` with no missing or
unexpected keys, and any diffusers SD3 transformer directory (or a pipeline directory with a
``transformer/`` subfolder) loads into :class:`imagegen.model.MMDiT`. The family is config.json's
``_class_name``, looked up in imagegen/registry.py. Weights are read from safetensors only: nothing is
unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import os
from importlib import metadata
from pathlib import Path

import torch
from safetensors import safe_open

from atelier_studio.data.textfile import read_json
from atelier_studio.imagegen.model import MMDiT, MMDiTArgs
from atelier_studio.imagegen.registry import family_of_args, family_of_class_name, family_of_size
from atelier_studio.pipeline.atomic import atomic_dir, save_safetensors
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.hf_files import read_safetensors_header
from atelier_studio.pipeline.hub import resolve_model_path

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


def resolve_dir(path: str | os.PathLike) -> Path:
    """The transformer directory: ``path`` itself, or ``path/transformer`` for a pipeline directory."""
    try:
        root = Path(resolve_model_path(str(path), "the imagegen model"))  # a cached hub id: its snapshot
    except ModelLoadError as e:  # an id not in the cache: a missing directory, as callers expect, with the hub's fix
        raise FileNotFoundError(str(e)) from None
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory (expected a diffusers SD3 transformer directory)")
    for candidate in (root, root / "transformer"):
        if (candidate / CONFIG_NAME).is_file():
            return candidate
    raise FileNotFoundError(f"{root}: no {CONFIG_NAME} here or in {root / 'transformer'}")


def read_args(path: str | os.PathLike, kernels: str = "auto", attention: str = "auto") -> MMDiTArgs:
    """The args of a diffusers directory's config.json, of the family its ``_class_name`` names; ``kernels``
    picks the fused ops' implementation, ``attention`` the SDPA backend."""
    cfg_path = resolve_dir(path) / CONFIG_NAME
    config = read_json(cfg_path, ModelLoadError)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
    if "_class_name" not in config:
        raise ModelLoadError(f"{cfg_path}: no '_class_name' (not a diffusers model config)")
    family = family_of_class_name(config["_class_name"], str(cfg_path))
    try:
        return family.args_from_diffusers_config(config, str(cfg_path), kernels=kernels, attention=attention)
    except ModelLoadError:
        raise
    except ValueError as e:  # the args' checks, which name config.json and the field
        raise ModelLoadError(str(e)) from None


def _weight_files(model_dir: Path) -> dict[str, list[str]]:
    """{file path: [keys]} for the single file or the sharded index."""
    single, index = model_dir / WEIGHTS_NAME, model_dir / INDEX_NAME
    if single.is_file():  # header checked against the file size: a cut or garbage file is named, not a traceback
        return {str(single): list(read_safetensors_header(single))}
    if index.is_file():
        try:
            weight_map = read_json(index, ModelLoadError)["weight_map"]
        except (KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from e
        files: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            files.setdefault(str(model_dir / name), []).append(key)
        for name in files:
            if not Path(name).is_file():
                raise FileNotFoundError(f"{index}: shard {name} is listed but missing")
            read_safetensors_header(name)
        return files
    pickled = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt*")]
    hint = f" (found {pickled}: pickle files are never loaded; convert them to safetensors)" if pickled else ""
    raise FileNotFoundError(f"{model_dir}: neither {WEIGHTS_NAME} nor {INDEX_NAME}{hint}")


def build_model(args: MMDiTArgs) -> MMDiT:
    """The (uninitialised) model of `args`' family, on the current default device."""
    return family_of_args(args).model_cls(args)


def weight_map(model_dir: Path, args: MMDiTArgs) -> dict[str, str]:
    """{state-dict key: safetensors file} of a diffusers directory, every key and shape checked against `args`.

    What a sharded (meta-device) load needs: each rank opens the files and reads only its rows of each key.
    """
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_model(args).state_dict().items()}
    where: dict[str, str] = {}
    for file, keys in _weight_files(model_dir).items():
        unexpected = [k for k in keys if k not in expected]
        if unexpected:
            raise ModelLoadError(f"{file}: {len(unexpected)} unexpected key(s) for {args}: {unexpected[:5]}")
        with safe_open(file, framework="pt") as f:
            for key in keys:
                shape = tuple(f.get_slice(key).get_shape())
                if shape != expected[key]:
                    raise ModelLoadError(f"{file}: key {key!r} has shape {shape}, the config expects {expected[key]}")
                where[key] = file
    missing = [k for k in expected if k not in where]
    if missing:
        raise ModelLoadError(f"{model_dir}: {len(missing)} missing key(s): {missing[:5]}")
    return where


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", kernels: str = "auto", attention: str = "auto") -> MMDiT:
    """Build the model of a diffusers transformer directory (its registered family); every key and shape is
    checked."""
    model_dir = resolve_dir(path)
    args = read_args(model_dir, kernels, attention)
    where = weight_map(model_dir, args)
    with torch.device("meta"):  # no throw-away random init of a multi-GB model
        model = build_model(args)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(where.values())):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in (k for k, v in where.items() if v == file):
                state[key] = f.get_tensor(key).to(dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _diffusers_version() -> str:
    try:
        return metadata.version("diffusers")
    except metadata.PackageNotFoundError:
        return "0.35.0"


def save_pretrained(model: MMDiT, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 10 * 2**30, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` as a diffusers directory, atomically (pipeline/atomic.py: temporary directory, then rename).

    ``weights`` (state-dict key -> tensor of the same shape) are written in place of the model's own
    (the EMA average, without swapping it into the model). Tensors are cast to ``dtype`` (default: as
    stored). Above ``max_shard_bytes`` the weights are split into diffusers-named shards plus an index,
    as ``from_pretrained`` expects.
    """
    out = Path(out_dir)
    with atomic_dir(out, what="model directory") as tmp:
        config = {**model.args.to_diffusers_config(), "_diffusers_version": _diffusers_version()}
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        # clone: save_file refuses tensors that share storage; contiguous: it needs dense tensors.
        own = model.state_dict()
        weights = weights or {}
        bad = [f"{k} {tuple(v.shape)} (model: {tuple(own[k].shape) if k in own else 'no such key'})"
               for k, v in weights.items() if k not in own or v.shape != own[k].shape]
        if bad:
            raise ValueError(f"save_pretrained {out}: weights do not fit the model: {bad[:5]}")
        state = {k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu().clone()
                 for k, v in {**own, **weights}.items()}
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for k, v in state.items():
            nbytes = v.numel() * v.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][k] = v
            size += nbytes
        if len(shards) == 1:
            save_safetensors(shards[0], tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        else:
            weight_map, n = {}, len(shards)
            for i, shard in enumerate(shards, start=1):
                name = f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors"
                save_safetensors(shard, tmp / name, metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
            total = sum(v.numel() * v.element_size() for v in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return out


def init_random(size: str, out_dir: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.float32,
                **overrides) -> Path:
    """Write a randomly initialised (the model's ``init_weights``) model of a registered size, with args field
    ``overrides`` (e.g. ``in_channels=4``). Returns the directory."""
    family = family_of_size(size)  # an unknown size lists the registered ones
    known = {f.name for f in dataclasses.fields(family.args_cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"init_random: unknown {family.args_cls.__name__} override(s) {unknown}; "
                         f"fields are {sorted(known)}")
    args = family.args_of_size(size, **overrides)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(seed)
        model = family.model_cls(args)
    return save_pretrained(model, out_dir, dtype=dtype)
