"""The GPU tests' two tiers, chosen with pytest's -m.

fast  `-m gpu`: every kernel and model path at small shapes, minutes on one GPU including autotune and compile.
slow  `-m "gpu and slow"`: the same paths at real model shapes (Qwen3.5-9B, Qwen3-8B, SD3-medium, 64k tokens).

A test marked both gpu and slow runs only when the -m expression names `slow`, so `-m gpu` is the fast tier on
its own. CPU tests marked slow are not affected: `-m "not gpu"` (make test) runs them as before.

In the fast tier every Triton autotuner runs one configuration, the first its pruning leaves (fla's and Atelier's
config lists start with their smallest tiles, the ones sure to fit), instead of compiling and timing every
candidate: autotuning is what made the fast tier slow (fla's kernels have up to 36 candidates per head layout),
and a correctness test needs a configuration that runs, not the fastest one. The slow tier autotunes in full, and
its `test_fla_backward_is_right_under_every_autotune_config` checks each configuration of the kernel whose results
depend on it. `--all-autotune-configs` turns the pin off.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any


def names_slow(markexpr: str) -> bool:
    """Whether a -m expression mentions the slow marker at all ("gpu and slow", "slow", "not slow")."""
    return re.search(r"\bslow\b", markexpr or "") is not None


def deselected(markers: Iterable[str], markexpr: str) -> bool:
    """Whether a test with these marker names is left out under this -m expression: GPU + slow, unless named."""
    names = set(markers)
    return {"gpu", "slow"} <= names and not names_slow(markexpr)


def pins_autotune(markexpr: str, cuda: bool, all_configs: bool) -> bool:
    """Whether this run pins autotuning to one configuration: a fast-tier run on a GPU, unless asked not to."""
    return cuda and not all_configs and not names_slow(markexpr)


def pin_autotuners_to_one_config() -> None:
    """Every triton.autotune'd kernel, fla's included, takes the first configuration its own pruning leaves.

    Wraps Autotuner.prune_configs, which Autotuner.run calls once per new autotune key before it benchmarks:
    with one configuration left, it compiles only that one and times nothing.
    """
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    if getattr(prune, "pinned_to_one_config", False):
        return

    def first_config_only(self: Any, *args: Any, **kwargs: Any) -> list:
        return list(prune(self, *args, **kwargs))[:1]

    first_config_only.pinned_to_one_config = True
    Autotuner.prune_configs = first_config_only
