"""An SD3 / SD3.5 transformer as one safetensors file in Stability AI's original key layout, the file
`SD3Transformer2DModel.from_single_file` (and ComfyUI's checkpoint loader, A1111 / Forge) reads.

    single_file_state_dict(diffusers_state_dict) -> {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
                                                     ...}

The mapping is the inverse of diffusers' `convert_sd3_transformer_checkpoint_to_diffusers` (its single-file
reader), written from the two layouts:

    diffusers (Atelier's)                             original (MMDiT of sd3_impls)
    pos_embed.pos_embed / pos_embed.proj              pos_embed / x_embedder.proj
    time_text_embed.timestep_embedder.linear_1|2      t_embedder.mlp.0|2
    time_text_embed.text_embedder.linear_1|2          y_embedder.mlp.0|2
    context_embedder                                  context_embedder
    transformer_blocks.i.attn.to_q|to_k|to_v          joint_blocks.i.x_block.attn.qkv       (q, k, v stacked on dim 0)
    transformer_blocks.i.attn.add_{q,k,v}_proj        joint_blocks.i.context_block.attn.qkv
    ….attn.norm_q|norm_k, norm_added_q|norm_added_k   x_block.attn.ln_q|ln_k, context_block.attn.ln_q|ln_k
    ….attn.to_out.0 / to_add_out                      x_block.attn.proj / context_block.attn.proj
    ….attn2.*  (SD3.5's dual attention)               x_block.attn2.qkv|ln_q|ln_k|proj
    ….norm1.linear / norm1_context.linear             x_block / context_block .adaLN_modulation.1
    ….ff.net.0.proj|ff.net.2, ff_context.*            x_block / context_block .mlp.fc1|fc2
    proj_out / norm_out.linear                        final_layer.linear / final_layer.adaLN_modulation.1

The last block's context modulation and the final layer's modulation hold (scale, shift) in the original and
(shift, scale) in diffusers: their halves are swapped (a swap is its own inverse). Tensors keep their dtype.
"""

from __future__ import annotations

import torch

PREFIX = "model.diffusion_model."
_TOP = {"pos_embed.pos_embed": "pos_embed", "pos_embed.proj": "x_embedder.proj",
        "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
        "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
        "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
        "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2", "context_embedder": "context_embedder",
        "proj_out": "final_layer.linear"}
# inside a block: diffusers module -> original module (q/k/v are stacked separately)
_BLOCK = {"attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
          "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
          "attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
          "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k",
          "attn2.to_out.0": "x_block.attn2.proj", "norm1.linear": "x_block.adaLN_modulation.1",
          "norm1_context.linear": "context_block.adaLN_modulation.1", "ff.net.0.proj": "x_block.mlp.fc1",
          "ff.net.2": "x_block.mlp.fc2", "ff_context.net.0.proj": "context_block.mlp.fc1",
          "ff_context.net.2": "context_block.mlp.fc2"}
_QKV = {"attn.to_{}": "x_block.attn.qkv", "attn.add_{}_proj": "context_block.attn.qkv",
        "attn2.to_{}": "x_block.attn2.qkv"}


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """(a, b) -> (b, a) along dim 0: diffusers' (shift, scale) <-> the original's (scale, shift)."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def single_file_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers SD3 transformer state dict -> the original layout with the `model.diffusion_model.` prefix.
    Every key is used exactly once; a key of no known place is a ValueError naming it (a model this file cannot
    describe)."""
    num_layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks."))
    last = f"transformer_blocks.{num_layers - 1}."
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def put(src_module: str, dst_module: str, swap: bool = False) -> None:
        for suffix in ("weight", "bias"):
            key = f"{src_module}.{suffix}" if src_module != "pos_embed.pos_embed" else src_module
            if key in state and key not in used:
                used.add(key)
                dst = dst_module if src_module == "pos_embed.pos_embed" else f"{dst_module}.{suffix}"
                out[PREFIX + dst] = swap_halves(state[key]) if swap else state[key]

    for src, dst in _TOP.items():
        put(src, dst)
    put("norm_out.linear", "final_layer.adaLN_modulation.1", swap=True)
    for i in range(num_layers):
        block, orig = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        for src, dst in _BLOCK.items():
            put(block + src, orig + dst, swap=block == last and src == "norm1_context.linear")
        for pattern, dst in _QKV.items():
            for suffix in ("weight", "bias"):
                parts = [f"{block}{pattern.format(x)}.{suffix}" for x in "qkv"]
                if all(p in state for p in parts):
                    used.update(parts)
                    out[f"{PREFIX}{orig}{dst}.{suffix}"] = torch.cat([state[p] for p in parts], dim=0)
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"single-file export: {left[0]} has no place in the original SD3 layout "
                         f"({len(left)} such keys)")
    return out


__all__ = ["single_file_state_dict", "swap_halves", "PREFIX"]
