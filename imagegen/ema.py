"""Exponential moving average of the trainable weights, kept in fp32.

    shadow <- d * shadow + (1 - d) * param,   d = min(decay, (1 + n) / (10 + n))   (every `update_every` steps)

where n counts the updates so far. The warm-up of d (diffusers' EMAModel default) keeps a short or
early run's average from being dominated by the random initial weights: with a fixed 0.999, after
400 steps the initial weights would still carry 0.999^400 = 67% of the average.

computed as one `torch._foreach_lerp_(shadow, params, 1 - decay)` over all tensors (no Python loop
over tensors on the hot path). The shadow starts as a copy of the weights at construction. It is part
of the trainer's checkpoint (`state_tensors`) so a resumed run continues the same average, and
`swapped_in()` puts it into the model for sampling and evaluation, then restores the weights.

Under FSDP2 (pipeline/distributed.py) build the EMA after wrapping: each shadow is then a DTensor sharded
like its parameter, updated shard by shard (no communication; the same numbers as one process), and
saved sharded by the trainer's checkpoint. `swapped_in()` swaps shards on every rank (a forward inside it
is a collective, so every rank enters it); `full_state(ctx)` gathers the average to full tensors on rank 0
for an export, and is itself a collective.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from atelier_studio.pipeline.distributed import DistContext, is_sharded, local_rows


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the storage itself: in-place ops on it change the DTensor), or `t`."""
    if _is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def _reshard(model: nn.Module) -> None:
    """Free FSDP2's gathered parameters, so the next forward gathers the shards as they are now.

    A unit with reshard_after_forward=False (the root, the last block) stays gathered after an eval
    forward; without this, swapping shards would leave it computing with the weights from before the swap.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def ema_decay(decay: float, num_updates: int) -> float:
    """The decay of update number `num_updates` (0-based), warmed up as in diffusers' EMAModel."""
    return min(decay, (1.0 + num_updates) / (10.0 + num_updates))


def ema_update_ref(shadow: dict[str, torch.Tensor], params: dict[str, torch.Tensor], decay: float) -> None:
    """Plain reference: the formula, one tensor at a time, in fp32 (decay already warmed up)."""
    for name, s in shadow.items():
        s.copy_(decay * s + (1.0 - decay) * params[name].detach().float())


class EMA:
    def __init__(self, model: nn.Module, decay: float, update_every: int = 1):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay} (ema.decay = 0 disables EMA)")
        if update_every < 1:
            raise ValueError(f"EMA update_every must be >= 1, got {update_every}")
        self.decay, self.update_every = decay, update_every
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shadow = [p.detach().float().clone() for p in self.params]  # DTensors (sharded) under FSDP2

    def _sources(self) -> list[torch.Tensor]:
        local = [_local(p.detach()) for p in self.params]
        return [p if p.dtype == torch.float32 else p.float() for p in local]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (1-based): lerp toward the weights when step % update_every == 0."""
        if step % self.update_every == 0:
            d = ema_decay(self.decay, step // self.update_every - 1)
            torch._foreach_lerp_([_local(s) for s in self.shadow], self._sources(), 1.0 - d)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"ema.{n}": s for n, s in zip(self.names, self.shadow)}

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if f"ema.{n}" not in tensors]
        if missing:
            raise ValueError(f"checkpoint has no EMA weights for {len(missing)} parameter(s), e.g. {missing[:3]} "
                             f"(was it written with ema.decay = 0?)")
        for n, s in zip(self.names, self.shadow):
            src = tensors[f"ema.{n}"]
            if src.shape != s.shape:
                raise ValueError(f"checkpoint EMA weight {n} has shape {tuple(src.shape)}, expected {tuple(s.shape)}")
            if src is s:  # a sharded checkpoint was loaded into the shadow itself
                continue
            if _is_dtensor(src) or not _is_dtensor(s):
                s.copy_(src)
            else:  # full tensor into a sharded shadow: this rank's rows
                _local(s).copy_(src[local_rows(s)])

    @torch.no_grad()
    def full_state(self, ctx: DistContext) -> dict[str, torch.Tensor]:
        """{parameter name: full fp32 average} on rank 0 (CPU when sharded), {} on the others; a collective."""
        if not any(_is_dtensor(s) for s in self.shadow):
            return dict(zip(self.names, self.shadow))
        out = {}
        for n, s in zip(self.names, self.shadow):
            full = s.full_tensor()  # all-gather: every rank takes part
            if ctx.is_main:
                out[n] = full.cpu()
            del full
        return out

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside the block the model holds the EMA weights; the trained weights come back afterwards.

        Sharded: every rank swaps its own shards (enter it on every rank: the forwards inside are collectives).
        """
        sharded = is_sharded(self.model)
        params = [_local(p.detach()) for p in self.params]
        with torch.no_grad():
            if sharded:
                _reshard(self.model)
            backup = [p.clone() for p in params]
            torch._foreach_copy_(params, [_local(s) for s in self.shadow])
        try:
            yield
        finally:
            with torch.no_grad():
                if sharded:
                    _reshard(self.model)
                torch._foreach_copy_(params, backup)


__all__ = ["EMA", "ema_decay", "ema_update_ref"]
