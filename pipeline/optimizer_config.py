"""`[train] optimizer` and each optimizer's own section (`[train.lowbit]`, `[train.adafactor]`, ...).

The keys every Adam-family optimizer shares stay in `[train]` (`betas`, `adam_eps`, `weight_decay`); what one
optimizer alone reads lives in its own section, so an unknown key is the config loader's usual error and a key of
another optimizer's section is refused by `check_optimizer_sections` (it would be silently ignored otherwise).
pipeline/optimizers.py builds the optimizers from these; docs/training.md#optimizers describes each.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

OptimizerName = Literal["adamw", "adamw8bit", "adamw4bit", "adafactor", "schedulefree_adamw", "prodigy", "muon"]


@dataclass(frozen=True)
class LowBitConfig:
    """`[train.lowbit]`: torchao's AdamW with 8-bit or 4-bit states (optimizer = "adamw8bit" / "adamw4bit")."""

    block_size: int = 0  # values sharing one scale; 0 = torchao's default (256 for 8-bit, 128 for 4-bit)
    bf16_stochastic_round: bool = False  # bf16 weights updated with stochastic rounding (no fp32 master copy)

    def validate(self) -> None:
        if self.block_size < 0:
            raise ValueError(f"block_size: must be >= 0 (0 = torchao's default), got {self.block_size}")


@dataclass(frozen=True)
class AdafactorConfig:
    """`[train.adafactor]`: torch.optim.Adafactor (factored second moments, no first moment)."""

    beta2_decay: float = -0.8  # the second-moment decay is 1 - step^beta2_decay
    eps1: float = 0.0  # added to the second moment; 0 = torch's default (the dtype's eps)
    eps2: float = 1e-3  # the update's relative floor
    d: float = 1.0  # clipping threshold of the update's RMS

    def validate(self) -> None:
        if self.beta2_decay > 0:
            raise ValueError(f"beta2_decay: must be <= 0, got {self.beta2_decay}")
        if self.eps1 < 0 or self.eps2 < 0:
            raise ValueError(f"eps1, eps2: must be >= 0, got {self.eps1}, {self.eps2}")
        if self.d < 1.0:
            raise ValueError(f"d: must be >= 1, got {self.d}")


@dataclass(frozen=True)
class ScheduleFreeConfig:
    """`[train.schedulefree]`: schedulefree's AdamWScheduleFree (Defazio et al. 2024): no decay schedule."""

    r: float = 0.0  # polynomial weighting of the average (power r of the step)
    weight_lr_power: float = 2.0  # the average's weights are lr^weight_lr_power (warmup steps count less)

    def validate(self) -> None:
        if self.r < 0 or self.weight_lr_power < 0:
            raise ValueError(f"r, weight_lr_power: must be >= 0, got {self.r}, {self.weight_lr_power}")


@dataclass(frozen=True)
class ProdigyConfig:
    """`[train.prodigy]`: prodigyopt's Prodigy (Mishchenko & Defazio 2023): Adam whose step size d it estimates;
    train.lr multiplies d (its authors use 1.0)."""

    d0: float = 1e-6  # the initial estimate of d
    d_coef: float = 1.0  # multiplies the estimate
    beta3: float = 0.0  # the decay of d's running sums; 0 = sqrt(beta2)
    growth_rate: float = 0.0  # d grows at most this factor per step; 0 = unbounded
    use_bias_correction: bool = False
    safeguard_warmup: bool = False  # keep d from growing during a warmup (its authors advise it with one)

    def validate(self) -> None:
        if self.d0 <= 0 or self.d_coef <= 0:
            raise ValueError(f"d0, d_coef: must be > 0, got {self.d0}, {self.d_coef}")
        if not 0.0 <= self.beta3 < 1.0:
            raise ValueError(f"beta3: must be in [0, 1) (0 = sqrt(beta2)), got {self.beta3}")
        if self.growth_rate != 0 and self.growth_rate < 1.0:
            raise ValueError(f"growth_rate: must be >= 1 or 0 (unbounded), got {self.growth_rate}")


@dataclass(frozen=True)
class MuonConfig:
    """`[train.muon]`: torch.optim.Muon (Jordan et al. 2024) on the hidden 2-D weights; AdamW (train.betas,
    adam_eps, weight_decay) on the rest: embeddings, the output head, norms, biases, tensors of other ranks."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations of the orthogonalisation
    eps: float = 1e-7
    # "match_rms_adamw": updates scaled to AdamW's RMS (Moonshot's Muon is Scalable), so train.lr and weight_decay
    # suit both parts; "original": Keller Jordan's sqrt(max(1, rows/cols)), which wants a larger lr than AdamW's
    adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"

    def validate(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum: must be in [0, 1), got {self.momentum}")
        if self.ns_steps < 1:
            raise ValueError(f"ns_steps: must be >= 1, got {self.ns_steps}")


# the section each optimizer reads besides [train]'s own keys
SECTION_OF: dict[str, str] = {"adamw8bit": "lowbit", "adamw4bit": "lowbit", "adafactor": "adafactor",
                              "schedulefree_adamw": "schedulefree", "prodigy": "prodigy", "muon": "muon"}


def check_optimizer_sections(train: Any) -> None:
    """A section of an optimizer the run does not use must be left at its defaults: its keys would be ignored, and a
    run that trains with other settings than the file says is found out only from its curve."""
    for section in sorted(set(SECTION_OF.values())):
        if SECTION_OF.get(train.optimizer) == section:
            continue
        cfg = getattr(train, section)
        changed = [f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(type(cfg)(), f.name)]
        if changed:
            users = " / ".join(repr(o) for o, s in SECTION_OF.items() if s == section)
            raise ValueError(f"{section}: {', '.join(f'{section}.{k}' for k in changed)} configure optimizer {users}, "
                             f"but train.optimizer = {train.optimizer!r}; set train.optimizer, or remove them")


__all__ = ["OptimizerName", "LowBitConfig", "AdafactorConfig", "ScheduleFreeConfig", "ProdigyConfig", "MuonConfig",
           "SECTION_OF", "check_optimizer_sections"]
