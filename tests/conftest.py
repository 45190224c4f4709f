"""Session-wide test setup.

Without CUDA, Triton kernels run through Triton's interpreter. TRITON_INTERPRET is read when `@triton.jit`
decorates a kernel, i.e. when a kernels module is first imported — by whichever test directory is collected
first — so it is set here, before any test module is imported. On a GPU host it stays unset and the kernels
compile for real. CPU tests elsewhere call the public functions on CPU tensors, which run the plain-PyTorch
references and never launch a kernel.

`--portable-numerics` (tests/_portable_numerics.py): checks that torch runs its DEFAULT CPU kernels (the
environment's ATEN_CPU_CAPABILITY=default) and sets one thread, here and for every subprocess.
GPU tiers (tests/_gpu_tiers.py): a test marked gpu and slow runs only when the -m expression names `slow`; on a GPU,
a run that leaves the slow tier out pins every Triton autotuner to one configuration (`--all-autotune-configs`:
autotune in full).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import _gpu_tiers, _portable_numerics

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--portable-numerics", action="store_true", default=False,
                     help="run on torch's DEFAULT CPU kernels with one thread (needs ATEN_CPU_CAPABILITY=default "
                          "in the environment; `make test-portable`)")
    parser.addoption("--all-autotune-configs", action="store_true", default=False,
                     help="autotune Triton kernels over every configuration in the GPU fast tier too (by default "
                          "it runs the first configuration only; tests/_gpu_tiers.py)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--portable-numerics"):
        why = _portable_numerics.problem(os.environ, torch.backends.cpu.get_cpu_capability())
        if why:
            raise pytest.UsageError(why)
        _portable_numerics.apply()
    if _gpu_tiers.pins_autotune(config.getoption("markexpr") or "", torch.cuda.is_available(),
                                config.getoption("--all-autotune-configs")):
        _gpu_tiers.pin_autotuners_to_one_config()


def pytest_report_header(config: pytest.Config) -> str:
    mode = "portable" if config.getoption("--portable-numerics") else "this machine's"
    threads = torch.get_num_threads()
    return (f"numerics ({mode}): torch's {torch.backends.cpu.get_cpu_capability()} CPU kernels, {threads} "
            f"thread{'s' if threads != 1 else ''}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expr = config.getoption("markexpr") or ""
    out = [item for item in items if _gpu_tiers.deselected((m.name for m in item.iter_markers()), expr)]
    if out:
        drop = set(map(id, out))
        items[:] = [item for item in items if id(item) not in drop]
        config.hook.pytest_deselected(items=out)


# the offline tracker store (MLflow SQLite, W&B offline), built once per session for every test that logs to trackers
from tests._trackers import tracker_env, tracker_store  # noqa: E402,F401
