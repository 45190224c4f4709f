"""The session options of tests/conftest.py: the GPU tiers' selection and the portable-numerics pass."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import _gpu_tiers, _portable_numerics

ROOT = Path(__file__).parents[1]
pytest_plugins = ["pytester"]


def test_a_gpu_test_that_is_slow_runs_only_when_the_expression_names_slow():
    slow_gpu, fast_gpu, slow_cpu = {"gpu", "slow", "parametrize"}, {"gpu"}, {"slow"}
    for expr in ("gpu", "", "not gpu", "gpu or multigpu", "not slowness"):
        assert _gpu_tiers.deselected(slow_gpu, expr), expr
    for expr in ("gpu and slow", "slow", "not slow", "(gpu) and (slow)"):
        assert not _gpu_tiers.deselected(slow_gpu, expr), expr  # named: pytest's own -m decides
    for expr in ("gpu", "", "not gpu", "gpu and slow"):
        assert not _gpu_tiers.deselected(fast_gpu, expr) and not _gpu_tiers.deselected(slow_cpu, expr), expr


def test_the_fast_tier_on_a_gpu_pins_autotuning_and_the_slow_tier_does_not():
    assert _gpu_tiers.pins_autotune("gpu", cuda=True, all_configs=False)
    assert not _gpu_tiers.pins_autotune("gpu and slow", cuda=True, all_configs=False)
    assert not _gpu_tiers.pins_autotune("gpu", cuda=True, all_configs=True)  # --all-autotune-configs
    assert not _gpu_tiers.pins_autotune("gpu", cuda=False, all_configs=False)  # the CPU's runs are untouched


def test_a_pinned_autotuner_keeps_the_first_configuration_its_pruning_leaves(monkeypatch):
    import triton
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(Autotuner, "prune_configs", Autotuner.prune_configs)  # restored after the test
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32, 64) for w in (2, 4)]

    def drop_the_smallest(configs, named_args, **kwargs):
        return [c for c in configs if c.kwargs["BLOCK"] > 16]

    @triton.autotune(configs=configs, key=[], prune_configs_by={"early_config_prune": drop_the_smallest})
    @triton.jit
    def kernel(x_ptr, BLOCK: triton.language.constexpr):
        pass

    kernel.nargs = {}  # what Autotuner.run sets before it prunes
    assert len(kernel.prune_configs({})) == 4  # unpinned: pruning alone leaves four candidates to time
    _gpu_tiers.pin_autotuners_to_one_config()
    _gpu_tiers.pin_autotuners_to_one_config()  # twice is once
    assert kernel.prune_configs({}) == [configs[2]]  # the first that pruning leaves, not the list's first


def test_the_portable_pass_needs_the_variable_and_torch_on_its_default_kernels():
    env = {_portable_numerics.CAPABILITY_ENV: "default"}
    assert _portable_numerics.problem(env, "DEFAULT") is None
    assert "make test-portable" in _portable_numerics.problem({}, "AVX2")
    assert "'avx2'" in _portable_numerics.problem({_portable_numerics.CAPABILITY_ENV: "avx2"}, "AVX2")
    assert "imported before" in _portable_numerics.problem(env, "AVX512")  # set too late: torch never read it


TIERS = '''
import pytest, torch

@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_slow(): pass

@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", pytest.param("big", marks=pytest.mark.slow)])
def test_gpu_param(size): pass

@pytest.mark.slow
def test_cpu_slow(): pass

def test_numerics():
    import os, subprocess, sys
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability(), "
                            "torch.get_num_threads())"], capture_output=True, text=True, check=True).stdout.split()
    print("numerics", torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), *child)
'''


def _pytest(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """A pytest run over TIERS with this repository's conftest as a plugin, in a fresh interpreter (ATen reads
    ATEN_CPU_CAPABILITY when torch is imported, so the portable pass cannot be tried in this process)."""
    (tmp_path / "test_tiers.py").write_text(TIERS)
    environ = {k: v for k, v in __import__("os").environ.items()
               if k not in (_portable_numerics.CAPABILITY_ENV, *_portable_numerics.THREAD_ENVS)}
    environ.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
                           "-s", "-rN", "--rootdir", str(tmp_path), "-W", "ignore::pytest.PytestUnknownMarkWarning",
                           *args, str(tmp_path / "test_tiers.py")],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("expr,ran", [
    ("gpu", ["test_gpu_param[small]"]),
    ("gpu and slow", ["test_gpu_param[big]", "test_gpu_slow"]),
    ("not gpu", ["test_cpu_slow", "test_numerics"]),  # make test: CPU tests marked slow still run
])
def test_the_tiers_through_pytest(pytester, expr, ran):
    """The real collection hook, in this process (collection only: nothing runs)."""
    pytester.makepyfile(test_tiers=TIERS)
    result = pytester.runpytest_inprocess("-p", "tests.conftest", "-p", "no:cacheprovider", "-m", expr,
                                          "--collect-only", "-q", "-W", "ignore::pytest.PytestUnknownMarkWarning")
    assert result.ret == 0, result.outlines
    assert sorted(line.split("::")[1] for line in result.outlines if "::" in line) == sorted(ran)


def test_portable_numerics_fails_loudly_without_the_variable_and_reaches_subprocesses(tmp_path):
    refused = _pytest(tmp_path, "--portable-numerics", "-k", "numerics")
    assert refused.returncode == pytest.ExitCode.USAGE_ERROR, refused.stdout + refused.stderr
    assert "needs ATEN_CPU_CAPABILITY=default" in refused.stderr
    ran = _pytest(tmp_path, "--portable-numerics", "-k", "numerics", ATEN_CPU_CAPABILITY="default")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "numerics DEFAULT 1 DEFAULT 1" in ran.stdout  # this process, then a subprocess it started
