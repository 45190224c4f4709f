"""Hugging Face layout I/O for the designer: config.json + safetensors (one file, or shards + index).

The architecture is config.json's model_type, looked up in designer/registry.py ("qwen3": designer.qwen3.Qwen3,
"qwen3_5_text": designer.qwen35.Qwen35, ...); the family gives the args, the model class and the key layout.
Directory layout written and read (the one transformers uses for every family):
  config.json, generation_config.json,
  model.safetensors                         — one shard, or
  model-0000i-of-0000n.safetensors + model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"})
  tokenizer files (init_random, or save_pretrained(tokenizer_dir=...))

A family may store some state-dict tensors as several tensors (its Family.hf_layout: Qwen3-MoE's stacked experts
are one tensor per expert in the released checkpoints): both forms are read, the split one is written.
Weights load from safetensors only (nothing is unpickled). Every file's header is checked against its
size before any tensor is read (pipeline/hf_files.py, shared with imagegen), so a truncated or mismatched file
fails with its path and key.
Directories are written by pipeline/atomic.py (a temporary sibling, then renamed into place). A file that
cannot be loaded is a ModelLoadError (or FileNotFoundError) naming it.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from atelier_studio.data.textfile import read_json
from atelier_studio.designer.decoder import CausalLM
from atelier_studio.designer.family import DesignerArgs
from atelier_studio.designer.registry import family_of_args, family_of_model_type, family_of_size
from atelier_studio.pipeline.atomic import atomic_dir, save_safetensors
from atelier_studio.pipeline.errors import ModelLoadError
from atelier_studio.pipeline.hf_files import read_safetensors_header

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
VLM_TEXT = "model.language_model."  # Qwen3_5ForConditionalGeneration's text model
VLM_SKIP = ("model.visual.", "mtp.")  # its vision tower and multi-token-prediction head


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found")
    return read_json(path, ModelLoadError)


def weight_files(d: Path) -> dict[str, Path]:
    """HF key → safetensors file holding it, from the index or the single file.

    A Qwen3.5 vision-language checkpoint (Qwen3_5ForConditionalGeneration: the released Qwen3.5 models) keeps its
    text model under model.language_model.*: those keys are given by their text-model names (model.*, as
    transformers' AutoModelForCausalLM renames them) and the vision tower (model.visual.*) and the multi-token
    prediction head (mtp.*) are left out. file_key() gives a key's name inside the file back.
    """
    if (d / INDEX).is_file():
        weight_map = _read_json(d / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{d / INDEX}: missing 'weight_map'")
        where = {k: d / f for k, f in weight_map.items()}
    elif (d / SINGLE).is_file():
        where = {k: d / SINGLE for k in read_safetensors_header(d / SINGLE)}
    else:
        where = {}
    if any(k.startswith(VLM_TEXT) for k in where):
        where = {"model." + k[len(VLM_TEXT):] if k.startswith(VLM_TEXT) else k: f for k, f in where.items()
                 if not k.startswith(VLM_SKIP)}
    if where:
        return where
    extra = " (only .bin weights found: Atelier loads safetensors only)" if list(d.glob("*.bin")) else ""
    raise FileNotFoundError(f"{d}: neither {SINGLE} nor {INDEX} found{extra}")


def file_key(key: str, file_keys) -> str:
    """The name of model key `key` inside a safetensors file holding `file_keys`: its own, or the VLM layout's."""
    if key in file_keys or not key.startswith("model."):
        return key
    return VLM_TEXT + key[len("model."):]


# --- the families (designer/registry.py) ----------------------------------------------------------
Args = DesignerArgs
Model = CausalLM


def args_from_hf_config(cfg: dict, attention_impl: str = "auto", source: str = "config.json",
                        delta_rule_impl: str = "auto", kernels: str = "auto") -> Args:
    """The args of a config.json dict, of the family its model_type names, with the implementation choices."""
    family = family_of_model_type(cfg.get("model_type"), source)
    try:
        return family.args_from_hf_config(cfg, source, attention_impl=attention_impl, delta_rule_impl=delta_rule_impl,
                                          kernels=kernels)
    except ValueError as e:  # the args' checks, which name config.json and the key
        raise ModelLoadError(str(e)) from None


def args_from_size(size: str, vocab_size: int, **overrides) -> Args:
    """Args of a named size of a registered family; an unknown size lists every registered one."""
    return family_of_size(size).args_of_size(size, vocab_size, **overrides)


def build_model(args: Args) -> Model:
    """The (uninitialised) model of `args`, on the current default device."""
    return family_of_args(args).model_cls(args)


def hf_param_shapes(args: Args) -> dict[str, tuple[int, ...]]:
    return family_of_args(args).hf_param_shapes(args)


def init_param(args: Args, name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return family_of_args(args).init_param(name, shape, gen)


def read_args(d: Path, attention_impl: str = "auto", delta_rule_impl: str = "auto", kernels: str = "auto") -> Args:
    """The Args of the HF directory d (its config.json), with the run's implementation choices."""
    cfg = _read_json(d / "config.json")
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{d / 'config.json'}: expected a JSON object, got {type(cfg).__name__}")
    return args_from_hf_config(cfg, attention_impl, str(d / "config.json"), delta_rule_impl, kernels)


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    attention_impl: str = "auto", delta_rule_impl: str = "auto", kernels: str = "auto") -> Model:
    """The model of an HF directory (config.json + safetensors, any registered family), every key and shape
    checked."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"load_pretrained: model directory {d} does not exist")
    args = read_args(d, attention_impl, delta_rule_impl, kernels)
    with StoredWeights(d, args) as stored:
        state = {k: stored.read(k).to(device=device, dtype=dtype) for k in stored.shapes}
    with torch.device("meta"):
        model = build_model(args)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def stored_shapes(args: Args, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The keys and shapes on disk of the state-dict tensors `shapes`: each key, or its family's split parts."""
    layout = family_of_args(args).hf_layout
    out: dict[str, tuple[int, ...]] = {}
    for k, shape in shapes.items():
        parts = layout.parts(k, shape) if layout is not None else None
        out.update(parts if parts is not None else {k: shape})
    return out


def check_weight_files(d: Path, args: Args) -> dict[str, Path]:
    """Stored key → safetensors file, after checking every key and shape against config.json (nothing is read yet).

    A state-dict tensor the family splits (Family.hf_layout) may be stored joined, under its own key, or as its
    parts; the error for a missing one names the parts.
    """
    expected = hf_param_shapes(args)
    layout = family_of_args(args).hf_layout
    where = weight_files(d)
    if args.tie_embeddings:
        where.pop("lm_head.weight", None)  # some exporters store the tied head too; it is the embedding
    want: dict[str, tuple[int, ...]] = {}  # the stored keys this directory uses, with their shapes
    missing = []
    for k, shape in expected.items():
        parts = layout.parts(k, shape) if layout is not None else None
        if k in where or parts is None:
            want[k] = shape
            missing += [] if k in where else [k]
        else:
            want.update(parts)
            missing += [p for p in parts if p not in where]
    if missing:
        raise ModelLoadError(f"{d}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = [f"{k} (in {where[k].name})" for k in where if k not in want]
    if unexpected:
        raise ModelLoadError(f"{d}: unexpected weights {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for file in sorted(set(where.values())):
        header = read_safetensors_header(file)
        for k in (k for k, f in where.items() if f == file):
            name = file_key(k, header)
            if name not in header:
                raise ModelLoadError(f"{file}: key {name!r} listed in {INDEX} is not in the file")
            if tuple(header[name]["shape"]) != want[k]:
                raise ModelLoadError(f"{file}: {name} has shape {tuple(header[name]['shape'])}, config.json implies "
                                 f"{want[k]}")
    return where


class StoredWeights(contextlib.AbstractContextManager):
    """The state-dict tensors of a checked HF directory, read from whichever form its files store them in.

        with StoredWeights(d, args) as stored:
            t = stored.read("model.layers.0.mlp.experts.gate_up_proj", rows=slice(0, 4))

    Rows are dim 0, the dim FSDP2 shards (pipeline/distributed.py materialize_): only those rows are read.
    """

    def __init__(self, d: Path, args: Args) -> None:
        self.shapes = hf_param_shapes(args)  # state-dict key → shape
        self.where = check_weight_files(d, args)
        self.layout = family_of_args(args).hf_layout
        self._stack = contextlib.ExitStack()
        self._files: dict[Path, Any] = {}
        self._names: dict[Path, set[str]] = {}

    def __enter__(self) -> StoredWeights:
        for f in sorted(set(self.where.values())):
            self._files[f] = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            self._names[f] = set(self._files[f].keys())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _stored(self, key: str, rows: slice | None) -> torch.Tensor:
        file = self.where[key]
        name = file_key(key, self._names[file])
        return self._files[file].get_tensor(name) if rows is None else self._files[file].get_slice(name)[rows]

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        """State-dict tensor `key` (rows `rows` of it, when given)."""
        if key in self.where:
            return self._stored(key, rows)
        shape = self.shapes[key]
        return self.layout.join(key, shape, rows if rows is not None else slice(0, shape[0]),
                                lambda part: self._stored(part, None))


def _plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for k, shape in shapes.items():
        n = math.prod(shape) * itemsize
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(k)
        used += n
    return shards


def write_hf_dir(out_dir: str | os.PathLike, args: Args, shapes: dict[str, tuple[int, ...]],
                 make: Callable[[str], torch.Tensor], dtype: torch.dtype, max_shard_bytes: int,
                 tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Write an HF model directory atomically, building one shard of tensors at a time with `make(key)`.

    Only one shard is in memory at once, so an 8B model is written without holding it twice.
    """
    out = Path(out_dir)
    with atomic_dir(out, what="model directory") as tmp:
        itemsize = torch.empty((), dtype=dtype).element_size()
        shards = _plan_shards(shapes, itemsize, max_shard_bytes)
        weight_map: dict[str, str] = {}
        for i, keys in enumerate(shards):
            name = SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for k in keys:
                t = make(k)
                if tuple(t.shape) != shapes[k]:
                    raise ValueError(f"write_hf_dir: {k} has shape {tuple(t.shape)}, expected {shapes[k]}")
                tensors[k] = t.detach().to(device="cpu", dtype=dtype).contiguous()
                weight_map[k] = name
            save_safetensors(tensors, tmp / name, metadata={"format": "pt"})
            del tensors
        if len(shards) > 1:
            total = sum(math.prod(s) for s in shapes.values()) * itemsize
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))
        (tmp / "config.json").write_text(json.dumps(args.to_hf_config(dtype), indent=2))
        gen = {"_from_model_config": True, "bos_token_id": args.bos_token_id, "eos_token_id": args.eos_token_id,
               "pad_token_id": args.pad_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(str(tmp))
    return out


def save_pretrained(model: Model, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                    max_shard_bytes: int = 5 * 2**30, tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Write `model` as an HF directory of its family (merge LoRA first: designer.lora.merge_lora)."""
    state = model.state_dict()
    lora = [k for k in state if "lora_" in k or ".base_layer." in k]
    if lora:
        raise ValueError(f"save_pretrained: model has LoRA weights ({lora[0]} ...); merge_lora(model) first, "
                         f"or save the adapter with save_peft_adapter")
    layout = family_of_args(model.args).hf_layout
    owner = {}  # stored key → its state-dict key
    for k, v in state.items():
        parts = layout.parts(k, tuple(v.shape)) if layout is not None else None
        owner.update(dict.fromkeys(parts, k) if parts is not None else {k: k})
    shapes = stored_shapes(model.args, {k: tuple(v.shape) for k, v in state.items()})

    def make(key: str) -> torch.Tensor:
        k = owner[key]
        return state[k] if k == key else layout.part(k, state[k], key)

    return write_hf_dir(out_dir, model.args, shapes, make, dtype, max_shard_bytes, tokenizer_dir)


def init_random(size: str, tokenizer_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 5 * 2**30) -> Path:
    """A random-init HF directory of a registered size, vocab and special tokens from the tokenizer (copied in).

    Streams the same draws as the model's init_weights(seed), one tensor at a time, so no model is built.
    """
    from transformers import AutoTokenizer

    family = family_of_size(size)  # an unknown size fails before the tokenizer is read
    if not Path(tokenizer_dir).is_dir():
        raise FileNotFoundError(f"init_random: tokenizer directory {tokenizer_dir} does not exist")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    args = family.args_of_size(size, len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
    shapes = stored_shapes(args, hf_param_shapes(args))
    gen = torch.Generator().manual_seed(seed)
    # make() is called in state-dict order (a split tensor's parts in parts order), which is named_parameters()
    # order: the same draws as init_weights.
    return write_hf_dir(out_dir, args, shapes, lambda k: init_param(args, k, shapes[k], gen), dtype, max_shard_bytes,
                        tokenizer_dir)
