"""The GPU tests' two tiers, chosen with pytest's -m.

fast  `-m gpu`: every kernel and model path at small shapes, minutes on one GPU including autotune and compile.
slow  `-m "gpu and slow"`: the same paths at real model shapes (Qwen3.5-9B, Qwen3-8B, SD3-medium, 64k tokens).

A test marked both gpu and slow runs only when the -m expression names `slow`, so `-m gpu` is the fast tier on
its own. CPU tests marked slow are not affected: `-m "not gpu"` (make test) runs them as before.
"""
from __future__ import annotations

import re
from collections.abc import Iterable


def names_slow(markexpr: str) -> bool:
    """Whether a -m expression mentions the slow marker at all ("gpu and slow", "slow", "not slow")."""
    return re.search(r"\bslow\b", markexpr or "") is not None


def deselected(markers: Iterable[str], markexpr: str) -> bool:
    """Whether a test with these marker names is left out under this -m expression: GPU + slow, unless named."""
    names = set(markers)
    return {"gpu", "slow"} <= names and not names_slow(markexpr)
