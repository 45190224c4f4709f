"""The record of one imagegen model family: what the generic imagegen code needs to know about an architecture.

The same shape as the designer's (designer/family.py). A family's own file declares its `Family`
(imagegen/model.py: the MMDiT, whose SD3 and SD3.5 MMDiT-X variants are sizes of one family);
imagegen/registry.py lists the families, and the diffusers I/O, the task, the bench and the CLI ask it.

  args_cls         a frozen dataclass with `from_diffusers_config(config, source=...)` and `to_diffusers_config()`
  model_cls        the model built from the args; its `state_dict()` keys are the diffusers checkpoint's
  class_names      diffusers config.json `_class_name` values this family reads (the first is the one it writes)
  sizes            named sizes: complete args (`atelier imagegen init --size`), fields overridable
  train_flops      the model's own FLOP counter: train_flops(model, batch_size, image_tokens, text_tokens)
  blocks           the parallelize plan: the repeated blocks (each its own AC / compile / FSDP2 unit)
  diffusers_class  the diffusers class it is compared with in tests and bench/imagegen.py ("module:Class")
  lora_targets     the linears a LoRA may wrap, as module paths inside a block (diffusers' names, which are
                   PEFT's target_modules); `default_lora_targets` the ones `lora.targets = []` takes
  fp8_skip         module-name globs kept in the model's dtype under `train.precision = "fp8"` (the task and the
                   bench apply FP8 with them: pipeline/float8.apply_fp8)
  sigma_grid       the sampler's sigma grid as the family's diffusers pipeline sets it (imagegen/flow.py
                   sampler_sigmas): "scheduler" (StableDiffusion3Pipeline) or "linspace" (FluxPipeline)
  guidance_input   None: sampling guides by classifier-free guidance (SD3); else a function of the args telling
                   whether the guidance scale is a model input instead (FLUX.1-dev's distilled guidance embedding:
                   the scale goes into the model in training and sampling and no CFG runs)
  cfg_above_one    True: where the scale is not a model input, classifier-free guidance runs only for a scale above
                   1 (FluxPipeline's true_cfg_scale with the empty negative prompt: a FLUX model without the guidance
                   embedding, e.g. schnell at its usual 0 or 1, samples unguided); False: at any scale but 1 (SD3)
  cfg_rescale      None, or what the family's pipeline does to the classifier-free-guided prediction:
                   cfg_rescale(v_guided, v_cond) -> v, both [B,C,H,W] (QwenImagePipeline rescales each token's vector
                   to the conditional prediction's norm)
  text_mask_input  False: the model's third input is a pooled text vector of args.pooled_projection_dim (SD3, FLUX);
                   True: it is the text mask [B, L] (1: a caption token, 0: padding), which the family's text encoder
                   gives as its "pooled" output, L wide (Qwen-Image)
  export_forms     the forms `atelier imagegen export RUN` writes for it (imagegen/export_run.py FORMS): the kohya
                   LoRA names and the single-file layout are SD3's
  diffusers_forward  the diffusers model called on the model's own arguments (latents [B,C,H,W], text states, pooled,
                   timestep = t*1000, **guidance) -> v [B,C,H,W], as its pipeline calls it: the bench's peer
  linear_rows      the rows a block's linear reads, by its path inside the block: linear_rows(name, images,
                   image_tokens, text_tokens) (the dry run's activation count: imagegen/dry_run.py); None: every
                   token of both streams
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# The implementation choices a run sets on the args read from config.json (never part of the checkpoint).
IMPL_FIELDS = ("kernels", "attention")


@dataclass(frozen=True)
class Family:
    """One imagegen architecture (the module docstring lists what each field is for)."""

    name: str
    class_names: tuple[str, ...]
    args_cls: type
    model_cls: type
    sizes: Mapping[str, Any]
    tiny_size: str  # the size CPU runs of the bench use (bench/imagegen.py --tiny)
    train_flops: Callable[[Any, int, int, int], int]
    blocks: Callable[[nn.Module], list[nn.Module]]
    diffusers_class: str  # "diffusers:SD3Transformer2DModel"
    lora_targets: tuple[str, ...] = ()
    default_lora_targets: tuple[str, ...] = ()
    fp8_skip: tuple[str, ...] = ()
    linear_rows: Callable[[str, int, int, int], int] | None = None
    sigma_grid: str = "scheduler"
    guidance_input: Callable[[Any], bool] | None = None
    cfg_above_one: bool = False
    cfg_rescale: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    text_mask_input: bool = False
    export_forms: tuple[str, ...] = ("diffusers", "kohya", "merge", "single-file")
    diffusers_forward: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.class_names:
            problems.append("class_names is empty")
        if self.tiny_size not in self.sizes:
            problems.append(f"tiny_size {self.tiny_size!r} is not one of its sizes {list(self.sizes)}")
        bad = [k for k, v in self.sizes.items() if type(v) is not self.args_cls]
        if bad:
            problems.append(f"sizes {bad} are not {self.args_cls.__name__}")
        if ":" not in self.diffusers_class:
            problems.append(f"diffusers_class {self.diffusers_class!r} is not 'module:Class'")
        unknown = [t for t in self.default_lora_targets if t not in self.lora_targets]
        if unknown:
            problems.append(f"default_lora_targets {unknown} are not among its lora_targets")
        if self.sigma_grid not in ("scheduler", "linspace"):
            problems.append(f"sigma_grid {self.sigma_grid!r} is not 'scheduler' or 'linspace'")
        if problems:
            raise ValueError(f"Family {self.name!r}: {'; '.join(problems)}")
        for name in ("class_names", "lora_targets", "default_lora_targets"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def resolve_lora_targets(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """The block paths `names` select, in `lora_targets` order: a name selects every path equal to it or ending
        in "." + name, as PEFT's target_modules match ("to_q" is attn.to_q and attn2.to_q); () is the default.
        ValueError names what matches nothing."""
        if not names:
            return self.default_lora_targets
        unmatched = [n for n in names if not any(p == n or p.endswith("." + n) for p in self.lora_targets)]
        if unmatched or not self.lora_targets:
            raise ValueError(f"{unmatched or list(names)} match no {self.name} linear a LoRA may wrap; known: "
                             f"{', '.join(self.lora_targets) or 'none'}")
        return tuple(p for p in self.lora_targets if any(p == n or p.endswith("." + n) for n in names))

    def guidance_kwargs(self, args: Any, scale: float, batch: int, device: torch.device) -> dict:
        """The model's guidance input at `scale` for `batch` images ({"guidance": [B]}); {} for a model without one."""
        if self.guidance_input is None or not self.guidance_input(args):
            return {}
        return {"guidance": torch.full((batch,), float(scale), device=device)}

    def pooled_width(self, args: Any, text_tokens: int) -> int:
        """The width of the model's third input for `text_tokens` text tokens: the text mask's (text_mask_input), or
        the pooled vector's, args.pooled_projection_dim."""
        return text_tokens if self.text_mask_input else args.pooled_projection_dim

    def sampling_cfg(self, scale: float, args: Any) -> float:
        """The classifier-free guidance scale sampling runs at `scale` for a model of `args`: 1 (none) where the scale
        is a model input (guidance_input) or, for a cfg_above_one family, at most 1; else the scale itself."""
        if self.guidance_input is not None and self.guidance_input(args):
            return 1.0
        return 1.0 if self.cfg_above_one and scale <= 1 else scale

    def args_of_size(self, size: str, **overrides: Any) -> Any:
        """The args of a named size with field `overrides` (e.g. in_channels=4)."""
        return dataclasses.replace(self.sizes[size], **overrides)

    def args_from_diffusers_config(self, config: dict, source: str, **impls: str) -> Any:
        """The args of a diffusers config.json dict with the implementation choices `impls` (IMPL_FIELDS)."""
        unknown = sorted(set(impls) - set(IMPL_FIELDS))
        if unknown:
            raise TypeError(f"args_from_diffusers_config: unknown implementation choices {unknown}; "
                            f"known: {IMPL_FIELDS}")
        return self.args_cls.from_diffusers_config(config, source=source, **impls)

    def diffusers_reference(self) -> type:
        """The diffusers class (imported on demand: diffusers is a test and bench dependency only)."""
        module, cls = self.diffusers_class.split(":")
        return getattr(importlib.import_module(module), cls)
