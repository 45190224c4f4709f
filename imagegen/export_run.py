"""`atelier imagegen export RUN --out PATH (--lora-format diffusers|kohya | --merge | --single-file)`: an imagegen
run's result in the form a serving stack loads. The forms a family has are its record's `export_forms`
(imagegen/family.py): FLUX.1 has the diffusers LoRA and the merge (the kohya names and the single-file layout below
are SD3's).

    --lora-format diffusers  PATH/pytorch_lora_weights.safetensors, for pipe.load_lora_weights(PATH)
    --lora-format kohya      PATH (.safetensors), for ComfyUI / Forge LoRA loaders (imagegen/lora_kohya.py)
    --merge                  PATH: a StableDiffusion3Pipeline directory with the LoRA merged into transformer/ (the
                             run's pipeline/ with its VAE and scheduler), or a bare transformer directory when the
                             run has no pipeline/; for StableDiffusion3Pipeline / SD3Transformer2DModel.from_pretrained
    --single-file            PATH (.safetensors): the transformer (merged for a LoRA run) in the original SD3 key
                             layout (imagegen/single_file.py), for SD3Transformer2DModel.from_single_file(PATH, config=)

The run's result is its EMA weights when it kept them (lora_ema/, ema/), else the trained ones (lora/,
transformer/): what its pipeline/ export and `atelier imagegen sample` use. A LoRA run's base is its config.toml's
model.path. The merge sums W + s·B·A in fp32 (pipeline/lora.py merged_weight) and writes the base's dtype. Every
output appears complete or not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from atelier_studio.imagegen.hf import load_pretrained, read_args, resolve_dir, save_pretrained, weight_map
from atelier_studio.imagegen.lora import LORA_FILE, load_lora, lora_file, read_lora
from atelier_studio.imagegen.lora_kohya import kohya_metadata, kohya_state_dict
from atelier_studio.imagegen.model import MMDiT
from atelier_studio.imagegen.registry import family_of_args
from atelier_studio.imagegen.sd3_dir import is_pipeline_dir
from atelier_studio.imagegen.single_file import single_file_state_dict
from atelier_studio.pipeline.atomic import atomic_dir, save_safetensors
from atelier_studio.pipeline.errors import ModelLoadError, UsageError
from atelier_studio.pipeline.lora import LoRALinear

FORMS = ("diffusers", "kohya", "merge", "single-file")


@dataclass(frozen=True)
class RunResult:
    """What a run folder holds: its LoRA folder and base transformer (LoRA run) or its transformer folder."""

    run: Path
    lora: Path | None
    transformer: Path  # the base (LoRA run) or the trained transformer (full run)
    pipeline: Path | None  # the run's pipeline/ export, when it wrote one


def run_result(run: Path) -> RunResult:
    run = Path(run)
    if not run.is_dir():
        raise ModelLoadError(f"{run}: not a directory (pass an imagegen run folder, the output.dir of a finished run)")
    pipeline = run / "pipeline" if is_pipeline_dir(run / "pipeline") else None
    lora = next((run / d for d in ("lora_ema", "lora") if (run / d / LORA_FILE).is_file()), None)
    if lora is not None:
        config = run / "config.toml"
        try:
            base = tomllib.loads(config.read_text(encoding="utf-8"))["model"]["path"]
        except FileNotFoundError:
            raise ModelLoadError(f"{config}: missing; a LoRA run's config names the base model to merge into") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{config}: cannot read model.path, the base model ({type(e).__name__}: {e})") \
                from None
        try:
            return RunResult(run, lora, resolve_dir(base), pipeline)
        except FileNotFoundError as e:
            raise ModelLoadError(f"{config}: model.path: {e}") from None
    full = next((run / d for d in ("ema", "transformer") if (run / d / "config.json").is_file()), None)
    if full is None:
        raise ModelLoadError(f"{run}: not a finished imagegen run (no lora/{LORA_FILE}, no transformer/config.json)")
    return RunResult(run, None, full, pipeline)


def _stored_dtype(transformer: Path, model: MMDiT) -> torch.dtype:
    """The dtype the transformer directory stores its weights in (its first tensor's)."""
    file = next(iter(weight_map(transformer, model.args).values()))
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(next(iter(f.keys()))).dtype


def merged_model(result: RunResult) -> tuple[MMDiT, torch.dtype]:
    """The run's transformer with its LoRA (if any) merged, in fp32, and the dtype to write it in."""
    model = load_pretrained(result.transformer, dtype=torch.float32, kernels="ref")
    dtype = _stored_dtype(result.transformer, model)
    if result.lora is None:
        return model, dtype
    load_lora(model, result.lora, dtype="float32")
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.merged_linear())
    return model, dtype


def _write_file(tensors: dict[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> Path:
    """One safetensors file at `out`, atomically (a temporary beside it, renamed)."""
    if out.suffix != ".safetensors":
        raise UsageError(f"--out {out}: this export is one file; give it the .safetensors suffix")
    if out.is_dir():
        raise UsageError(f"--out {out}: is a directory; this export is one .safetensors file")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def export_run(run: Path, out: Path, form: str, log=print) -> Path:
    """Write ``run``'s result at ``out`` in ``form`` (one of FORMS; the module docstring)."""
    result = run_result(Path(run))
    out = Path(out)
    family = family_of_args(read_args(result.transformer))
    if form in FORMS and form not in family.export_forms:
        raise UsageError(f"imagegen export {run}: the {family.name} family has no {form} export yet; it has "
                         f"{', '.join(family.export_forms)}")
    if form in ("diffusers", "kohya") and result.lora is None:
        raise UsageError(f"--lora-format {form}: {run} is a full fine-tuning run, it has no LoRA; export its "
                         f"transformer with --single-file, or use its transformer/ or pipeline/ as they are")
    if form == "diffusers":
        with atomic_dir(out, what="LoRA directory") as tmp:
            shutil.copy2(lora_file(result.lora), tmp / LORA_FILE)
        log(f"wrote {out / LORA_FILE} (diffusers: pipe.load_lora_weights({str(out)!r}))")
        return out
    if form == "kohya":
        args, weights = read_lora(result.lora)
        _write_file(kohya_state_dict(args, weights), out, kohya_metadata(args))
        log(f"wrote {out}: {len(weights) // 2} kohya-named LoRA modules of rank {args.rank} from {result.lora}")
        return out
    if form not in ("merge", "single-file"):
        raise UsageError(f"imagegen export: unknown form {form!r} (one of {', '.join(FORMS)})")
    model, dtype = merged_model(result)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    what = f"{result.transformer} + {result.lora} merged" if result.lora is not None else str(result.transformer)
    if form == "single-file":
        _write_file(single_file_state_dict(state), out, {"format": "pt"})
        log(f"wrote {out}: {what}, {dtype}, in the original SD3 layout (from_single_file)")
        return out
    if result.pipeline is None:
        save_pretrained(model, out, dtype=dtype)
        log(f"wrote {out}: the transformer ({what}, {dtype}); the run has no pipeline/ to put it in")
        return out
    from atelier_studio.imagegen.export import export_pipeline

    with tempfile.TemporaryDirectory(prefix=".merge-", dir=out.parent if out.parent.is_dir() else None) as tmp:
        transformer = save_pretrained(model, Path(tmp) / "transformer", dtype=dtype)
        export_pipeline(result.pipeline, out, transformer=transformer)
    log(f"wrote {out}: {result.pipeline}'s pipeline with the transformer {what} ({dtype})")
    return out


__all__ = ["export_run", "run_result", "merged_model", "FORMS"]
