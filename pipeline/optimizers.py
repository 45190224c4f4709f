"""The optimizer `[train] optimizer` names, built over the trainable parameters, as one object the loop steps.

Every choice is a library's optimizer (docs/training.md#optimizers): torch's AdamW (fused on CUDA), Adafactor and
Muon, torchao's AdamW8bit / AdamW4bit, schedulefree's AdamWScheduleFree and prodigyopt's Prodigy. What this module
adds is what the trainer needs around them:

- parameter groups: weight decay on tensors of 2 or more dimensions only (norms and biases get none);
- Muon as its authors prescribe: Muon on the hidden 2-D weights, AdamW on the rest (the task names its input
  embeddings and output head, `Task.outer_layers`), two torch optimizers stepped as one (`Optimizers.parts`);
- Adafactor (under FSDP2) and Prodigy (always) as subclasses that step each rank's shard and sum what spans rows
  over the ranks (pipeline/sharded_adafactor.py, pipeline/sharded_prodigy.py): the libraries' own steps fail on
  DTensors;
- one learning rate written to every group (torchao keeps it as a tensor, which must be filled, not replaced);
- each group's configured hyper-parameters, re-applied after a checkpoint load restored the saved ones (a resume
  that changed them, with a warning, trains with the new);
- schedule-free's two sets of weights: `eval_weights()` swaps in the averaged weights x around evaluation,
  validation samples and the export, and copies y back after (one transient copy of the trainable weights: y
  interpolated back from x would differ in its last bits, so a run that evaluates would drift from one that does
  not). Checkpoints hold y with the optimizer in train mode, so a
  resume continues bit-exactly (schedulefree's README saves in eval mode, x, from which y comes back only up to
  rounding).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from atelier_studio.pipeline.config import ConfigError, TrainConfig
from atelier_studio.pipeline.sharded_adafactor import ShardedAdafactor


class Optimizers:
    """One or more torch optimizers over disjoint parameters, stepped as one."""

    def __init__(self, parts: list[torch.optim.Optimizer], hyper: list[list[dict[str, Any]]], swaps_weights: bool):
        self.parts = parts
        self._hyper = hyper  # per part, per group: the configured hyper-parameters (lr excluded)
        self.swaps_weights = swaps_weights  # schedule-free: train (y) and eval (x) weights

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for part in self.parts for g in part.param_groups]

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            if torch.is_tensor(group["lr"]):  # torchao's optimizers refuse a float (a compiled step reads the tensor)
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def reapply_hyperparameters(self) -> None:
        """This run's configured hyper-parameters on every group (a checkpoint's load restored the saved ones); a
        torchao group gets its learning rate back as a tensor (the JSON of a checkpoint holds a float)."""
        for part, hyper in zip(self.parts, self._hyper):
            for group, values in zip(part.param_groups, hyper):
                group.update(values)
                if _TENSOR_LR.get(type(part).__name__) and not torch.is_tensor(group["lr"]):
                    group["lr"] = torch.tensor(float(group["lr"]))

    def train_mode(self) -> None:
        """Schedule-free: the weights the gradient is taken at (y); a no-op for the others."""
        if self.swaps_weights:
            for part in self.parts:
                part.train()  # type: ignore[attr-defined]
                _drop_empty_state(part)

    @contextmanager
    def eval_weights(self) -> Iterator[None]:
        """Schedule-free: the averaged weights (x) in the model for the block; a no-op for the others."""
        if not self.swaps_weights:
            yield
            return
        params = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            train_weights = [p.detach().clone() for p in params]
        for part in self.parts:
            part.eval()  # type: ignore[attr-defined]
            _drop_empty_state(part)
        try:
            yield
        finally:
            # y back as it was, copied rather than interpolated back from x (which would round it differently from a
            # run that did not evaluate at this step)
            with torch.no_grad():
                for p, y in zip(params, train_weights):
                    p.copy_(y)
            for group in self.param_groups:
                group["train_mode"] = True


_TENSOR_LR = {"AdamW8bit": True, "AdamW4bit": True}


def _drop_empty_state(part: torch.optim.Optimizer) -> None:
    """schedulefree's train()/eval() read `state[p]` of every parameter, which adds an empty entry for one that has
    none yet; torch.distributed.checkpoint takes a non-empty `state` for an initialised optimizer and skips the
    zero-gradient step that creates the tensors a sharded load fills, so a resume would lose every state tensor."""
    for p in [p for p, st in part.state.items() if not st]:
        del part.state[p]


def build_optimizers(named_params: list[tuple[str, nn.Parameter]], cfg: TrainConfig, device: torch.device,
                     outer_layers: tuple[str, ...] = (), sharded: bool = False) -> Optimizers:
    """The optimizer `cfg.optimizer` over `named_params`. `outer_layers`: name prefixes of the input embeddings and
    output head (Muon leaves them to AdamW); `sharded`: the parameters are FSDP2 DTensors (Adafactor then steps
    their local shards and sums what spans rows over the ranks: pipeline/sharded_adafactor.py)."""
    name = cfg.optimizer
    decay = [p for _, p in named_params if p.ndim >= 2]
    no_decay = [p for _, p in named_params if p.ndim < 2]
    if name == "muon":
        return _muon(named_params, cfg, device, outer_layers)
    groups = _decay_groups(decay, no_decay, cfg.weight_decay)
    shared = {"betas": cfg.betas, "eps": cfg.adam_eps}
    if name == "adamw":
        part: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=cfg.lr, fused=device.type == "cuda", **shared)
    elif name in ("adamw8bit", "adamw4bit"):
        part = _lowbit(name, groups, cfg, shared)
    elif name == "adafactor":
        a = cfg.adafactor
        shared = {"beta2_decay": a.beta2_decay, "eps": (a.eps1 or None, a.eps2), "d": a.d}
        adafactor = ShardedAdafactor if sharded else torch.optim.Adafactor  # torch's cannot step DTensor shards
        part = adafactor(groups, lr=cfg.lr, **shared)
    elif name == "schedulefree_adamw":
        schedulefree = _library("schedulefree", name)
        # warmup comes from train.warmup_steps through the lr the loop sets: schedulefree's own warmup stays 0
        shared |= {"r": cfg.schedulefree.r, "weight_lr_power": cfg.schedulefree.weight_lr_power, "warmup_steps": 0}
        part = schedulefree.AdamWScheduleFree(groups, lr=cfg.lr, **shared)
    elif name == "prodigy":
        _library("prodigyopt", name)  # installed, or the one-line error
        p = cfg.prodigy
        shared |= {"beta3": p.beta3 or None, "d0": p.d0, "d_coef": p.d_coef,
                   "growth_rate": p.growth_rate or float("inf"), "use_bias_correction": p.use_bias_correction,
                   "safeguard_warmup": p.safeguard_warmup}
        # prodigyopt's step on local shards, on one process too: one state layout for both, so a sharded checkpoint
        # resumes on one process (pipeline/sharded_prodigy.py)
        from atelier_studio.pipeline.sharded_prodigy import ShardedProdigy

        part = ShardedProdigy(groups, lr=cfg.lr, **shared)
    else:  # a name the config's Literal allows and this function does not know: a bug here
        raise ConfigError(f"train.optimizer: {name!r} has no builder")
    hyper = [[_group_hyper(g, shared) for g in groups]]
    opt = Optimizers([part], hyper, swaps_weights=name == "schedulefree_adamw")
    opt.train_mode()
    return opt


def _decay_groups(decay: list[nn.Parameter], no_decay: list[nn.Parameter], weight_decay: float) -> list[dict]:
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _group_hyper(group: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return {"weight_decay": group["weight_decay"], **shared}


def _library(module: str, optimizer: str) -> Any:
    """The optional package an optimizer comes from, or the one-line error that says how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"train.optimizer: {optimizer!r} needs the package {module!r}, which is not installed: "
                          f"pip install 'atelier-studio[optimizers]'") from None


def _lowbit(name: str, groups: list[dict], cfg: TrainConfig, shared: dict[str, Any]) -> torch.optim.Optimizer:
    optim = _library("torchao.optim", name)
    cls = optim.AdamW8bit if name == "adamw8bit" else optim.AdamW4bit
    extra: dict[str, Any] = {"bf16_stochastic_round": cfg.lowbit.bf16_stochastic_round}
    if cfg.lowbit.block_size:
        extra["block_size"] = cfg.lowbit.block_size
    return cls(groups, lr=cfg.lr, **shared, **extra)


def _muon(named_params: list[tuple[str, nn.Parameter]], cfg: TrainConfig, device: torch.device,
          outer_layers: tuple[str, ...]) -> Optimizers:
    """Muon on the hidden 2-D weights; AdamW on the input embeddings, the output head and every tensor that is not
    2-D (Jordan et al.: Muon is for hidden layers; the first and last layers and scalars go to AdamW)."""
    def hidden(name: str, p: nn.Parameter) -> bool:
        return p.ndim == 2 and not name.startswith(outer_layers)

    muon_params = [p for n, p in named_params if hidden(n, p)]
    rest = [(n, p) for n, p in named_params if not hidden(n, p)]
    m = cfg.muon
    muon_hyper = {"weight_decay": cfg.weight_decay, "momentum": m.momentum, "nesterov": m.nesterov,
                  "ns_steps": m.ns_steps, "eps": m.eps,
                  "adjust_lr_fn": "match_rms_adamw" if m.adjust_lr == "match_rms_adamw" else "original"}
    parts: list[torch.optim.Optimizer] = []
    hyper: list[list[dict[str, Any]]] = []
    if muon_params:
        parts.append(torch.optim.Muon(muon_params, lr=cfg.lr, **muon_hyper))
        hyper.append([muon_hyper])
    if rest:
        groups = _decay_groups([p for _, p in rest if p.ndim >= 2], [p for _, p in rest if p.ndim < 2],
                               cfg.weight_decay)
        shared = {"betas": cfg.betas, "eps": cfg.adam_eps}
        parts.append(torch.optim.AdamW(groups, lr=cfg.lr, fused=device.type == "cuda", **shared))
        hyper.append([_group_hyper(g, shared) for g in groups])
    return Optimizers(parts, hyper, swaps_weights=False)


__all__ = ["Optimizers", "build_optimizers"]
