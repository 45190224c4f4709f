"""Prefect loads a deployment's entrypoint by file path, which puts flows/ first on sys.path in the flow-run
process: a flows/ module named like a top-level package (designer, imagegen, data, ...) would shadow it there."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = {"pipeline", "designer", "imagegen", "kernels", "flows", "data", "bench"}


def test_no_flow_module_shadows_a_package():
    modules = {p.stem for p in (ROOT / "flows").glob("*.py")}
    assert not modules & PACKAGES, f"rename {sorted(modules & PACKAGES)} in flows/"
