"""The portable-numerics pass: torch on its default (non-vectorised) CPU kernels and one thread.

A test whose tolerance was tuned to one CPU's vector path (AVX2, AVX-512) or to one thread count's BLAS blocking
passes there and fails elsewhere. Running the numerics-sensitive tests a second time on ATen's DEFAULT kernels
with one thread puts them on a different summation order from the usual pass, so such a test fails in CI.

ATen reads ATEN_CPU_CAPABILITY once, when torch is imported, so it must be in the environment before Python
starts (`make test-portable` sets it); `check` only verifies that torch picked it up.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"
WANTED_ENV = "default"  # what ATen accepts (lower case) ...
WANTED_CAPABILITY = "DEFAULT"  # ... and what torch.backends.cpu.get_cpu_capability() reports for it
THREAD_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # for every subprocess the tests start (torchrun workers)


def problem(env: Mapping[str, str], capability: str) -> str | None:
    """Why this process cannot run the portable pass (None when it can): env is its environment, capability
    what torch reports running on."""
    if env.get(CAPABILITY_ENV) != WANTED_ENV:
        return (f"--portable-numerics needs {CAPABILITY_ENV}={WANTED_ENV} in the environment before Python starts "
                f"(torch reads it once, at import); it is {env.get(CAPABILITY_ENV, 'unset')!r}. "
                f"Run `make test-portable`, or "
                f"`{CAPABILITY_ENV}={WANTED_ENV} python -m pytest --portable-numerics ...`")
    if capability != WANTED_CAPABILITY:
        return (f"--portable-numerics: {CAPABILITY_ENV}={WANTED_ENV} is set but torch runs its {capability} kernels: "
                f"torch was imported before the variable was set")
    return None


def apply() -> None:
    """One thread here and in every subprocess started from now on."""
    import torch

    torch.set_num_threads(1)
    for name in THREAD_ENVS:
        os.environ[name] = "1"
