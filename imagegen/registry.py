"""The imagegen model families, one line each, and how the rest of the code finds one.

    family_of_class_name(config["_class_name"], source)   # imagegen/hf.py reading a diffusers config.json
    family_of_size("sd3.5-medium")                         # `atelier imagegen init --size`, the bench
    family_of_args(model.args)                             # the task, the bench

Each family declares its Family record (imagegen/family.py) in its own file; adding one is that file plus a
line below, or `register(FAMILY)` at run time. An unknown class name or size lists the registered ones.
"""
from __future__ import annotations

from atelier_studio.imagegen import flux, model, qwen_image
from atelier_studio.imagegen.family import Family
from atelier_studio.pipeline.registry import FamilyRegistry

REGISTRY: FamilyRegistry[Family] = FamilyRegistry("imagegen", "_class_name", lambda f: f.class_names)

REGISTRY.register(model.FAMILY)  # MMDiT (SD3, SD3.5 MMDiT-X): SD3Transformer2DModel
REGISTRY.register(flux.FAMILY)  # FLUX.1 (dev, schnell): FluxTransformer2DModel
REGISTRY.register(qwen_image.FAMILY)  # Qwen-Image: QwenImageTransformer2DModel

register = REGISTRY.register
unregister = REGISTRY.unregister
families = REGISTRY.families
family_of_class_name = REGISTRY.by_config
family_of_size = REGISTRY.by_size
family_of_args = REGISTRY.by_args
