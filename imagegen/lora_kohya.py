"""An MMDiT LoRA in kohya's key naming, the `.safetensors` ComfyUI's LoRA loader (and Forge / SD.Next) read for
SD3 / SD3.5, beside the diffusers file (imagegen/lora.py) that `load_lora_weights` reads.

    diffusers  transformer.transformer_blocks.0.attn.to_q.lora_A.weight   [r, I]
               transformer.transformer_blocks.0.attn.to_q.lora_B.weight   [O, r]
    kohya      lora_transformer_transformer_blocks_0_attn_to_q.lora_down.weight   [r, I]  (= A)
               lora_transformer_transformer_blocks_0_attn_to_q.lora_up.weight     [O, r]  (= B)
               lora_transformer_transformer_blocks_0_attn_to_q.alpha              []      (fp32 scalar)

The name is `lora_transformer_` + the diffusers module path with "." -> "_", the key ComfyUI's
`model_lora_keys_unet` maps onto the MMDiT's weights for SD3 (the OneTrainer / kohya layout). A kohya loader scales
up @ down by alpha / r; an rsLoRA adapter (scale alpha / √r) is written with alpha · √r so the product is the same.
"""

from __future__ import annotations

import torch

from atelier_studio.pipeline.lora import LoraArgs

KOHYA_PREFIX = "lora_transformer_"


def kohya_name(module: str) -> str:
    return KOHYA_PREFIX + module.replace(".", "_")


def kohya_alpha(args: LoraArgs) -> float:
    """The alpha a kohya loader needs for Atelier's scale: alpha / r == args.scale."""
    return args.scale * args.rank


def kohya_state_dict(args: LoraArgs, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"<module>.lora_A.weight": A, "<module>.lora_B.weight": B} (imagegen/lora.py read_lora) -> kohya keys."""
    out: dict[str, torch.Tensor] = {}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in weights})
    for module in modules:
        name = kohya_name(module)
        out[f"{name}.lora_down.weight"] = weights[f"{module}.lora_A.weight"].contiguous()
        out[f"{name}.lora_up.weight"] = weights[f"{module}.lora_B.weight"].contiguous()
        out[f"{name}.alpha"] = torch.tensor(kohya_alpha(args), dtype=torch.float32)
    return out


def kohya_metadata(args: LoraArgs) -> dict[str, str]:
    """The sd-scripts metadata fields LoRA browsers show (rank, alpha, base model family)."""
    return {"format": "pt", "ss_network_module": "networks.lora", "ss_network_dim": str(args.rank),
            "ss_network_alpha": f"{kohya_alpha(args):g}", "ss_base_model_version": "sd3"}


__all__ = ["kohya_state_dict", "kohya_metadata", "kohya_name", "kohya_alpha", "KOHYA_PREFIX"]
