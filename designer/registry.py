"""The designer's model families, one line each, and how the rest of the code finds one.

    family_of_model_type(cfg["model_type"], source)   # designer/hf.py reading a config.json
    family_of_size("qwen3.5-9b")                       # `atelier designer init --size`, the bench
    family_of_args(model.args)                         # LoRA, decoding, the task, the bench

Each family declares its Family record (designer/family.py) in its own file; adding one is that file plus a
line below, or `register(FAMILY)` at run time (tests/designer/toy_family.py). An unknown model_type or size
is an error that lists the registered ones.
"""
from __future__ import annotations

from atelier_studio.designer import qwen3, qwen3_moe, qwen35
from atelier_studio.designer.family import Family
from atelier_studio.pipeline.registry import FamilyRegistry

REGISTRY: FamilyRegistry[Family] = FamilyRegistry("designer", "model_type", lambda f: f.model_types)

REGISTRY.register(qwen3.FAMILY)  # Qwen3: model_type qwen3
REGISTRY.register(qwen35.FAMILY)  # Qwen3.5: model_type qwen3_5_text, and qwen3_5 (its vision-language checkpoint)
REGISTRY.register(qwen3_moe.FAMILY)  # Qwen3-MoE: model_type qwen3_moe

register = REGISTRY.register
unregister = REGISTRY.unregister
families = REGISTRY.families
family_of_model_type = REGISTRY.by_config
family_of_size = REGISTRY.by_size
family_of_args = REGISTRY.by_args


def lora_target_names() -> tuple[str, ...]:
    """Every registered family's LoRA target names, in registration order (each family takes its own)."""
    return tuple(dict.fromkeys(t for f in REGISTRY.families() for t in f.lora_targets))
