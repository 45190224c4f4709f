"""Caption dropout for classifier-free guidance: some training captions lose their text conditioning.

Shape legend: B images, L text tokens, E text width, P pooled width, K text encoders (`parts`).

`drop_mask` draws which (image, encoder) pairs are dropped; `drop_captions` replaces their parts of the
cached states and pooled vector. Settings (imagegen/config.py `[text]`):
- `caption_dropout_encoders = "joint"` (default): one draw per image drops every encoder at once: the caption
  becomes "" (diffusers' SD3 training scripts, train_controlnet_sd3.py's --proportion_empty_prompts);
  "independent": one draw per image and encoder (the SD3 paper's scheme, which lets the model run without T5).
- `caption_dropout_fill = "empty"` (default): a dropped part takes the empty caption's encoding of that part;
  "zero": zeros.
SD3's parts (imagegen/sd3_text.py): CLIP-L's states (rows 0..76, columns 0..Dl-1) and pooled columns, CLIP-G's
(columns Dl..Dl+Dg-1), and T5's rows 77.. (no pooled part). The columns past the CLIPs in rows 0..76 are the
zero padding of encode_prompt, the same in every caption, so no part needs them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from atelier_studio.imagegen.text import TextPart


def drop_mask(uniform: torch.Tensor, probability: float, encoders: str, num_parts: int) -> torch.Tensor:
    """[B, K] bool: which parts of which images are dropped, from uniform draws in [0, 1): [B] for "joint" (one
    per image, shared by its K parts) or [B, K] for "independent"."""
    if encoders == "joint":
        if uniform.ndim != 1:
            raise ValueError(f"drop_mask: joint dropout takes [B] draws, got {tuple(uniform.shape)}")
        return (uniform < probability)[:, None].expand(-1, num_parts)
    if encoders == "independent":
        if uniform.ndim != 2 or uniform.shape[1] != num_parts:
            raise ValueError(f"drop_mask: independent dropout takes [B, {num_parts}] draws, got {tuple(uniform.shape)}")
        return uniform < probability
    raise ValueError(f"drop_mask: encoders must be 'joint' or 'independent', got {encoders!r}")


def drop_captions(states: torch.Tensor, pooled: torch.Tensor, drop: torch.Tensor, parts: Sequence[TextPart],
                  empty_states: torch.Tensor | None = None, empty_pooled: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """states [B, L, E], pooled [B, P], drop [B, K] -> new (states, pooled) where part k of image b is the empty
    caption's (empty_states [L, E], empty_pooled [P]) or, with no empty encoding given, zeros."""
    if drop.shape != (states.shape[0], len(parts)):
        raise ValueError(f"drop_captions: drop must be [B={states.shape[0]}, K={len(parts)}], got {tuple(drop.shape)}")
    if (empty_states is None) != (empty_pooled is None):
        raise ValueError("drop_captions: give both empty_states and empty_pooled (fill 'empty') or neither ('zero')")
    states, pooled = states.clone(), pooled.clone()
    for k, part in enumerate(parts):
        d = drop[:, k]  # [B]
        region = states[:, part.rows, part.cols]  # [B, l, e]
        fill = empty_states[part.rows, part.cols] if empty_states is not None else torch.zeros_like(region[0])
        states[:, part.rows, part.cols] = torch.where(d[:, None, None], fill.to(region.dtype), region)
        if part.pooled_cols is not None:
            region = pooled[:, part.pooled_cols]  # [B, p]
            fill = empty_pooled[part.pooled_cols] if empty_pooled is not None else torch.zeros_like(region[0])
            pooled[:, part.pooled_cols] = torch.where(d[:, None], fill.to(region.dtype), region)
    return states, pooled


__all__ = ["drop_mask", "drop_captions"]
