"""Prefect loads a deployment's entrypoint by file path, which puts flows/ first on sys.path in the flow-run
process: a flows/ module named like an installed top-level package (one of the dependencies, or Atelier's own
folders when run from the checkout) would shadow that package there."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).parents[2]
FOLDERS = {"pipeline", "designer", "imagegen", "kernels", "flows", "data", "bench"}


def test_no_flow_module_shadows_an_installed_package():
    modules = {p.stem for p in (ROOT / "flows").glob("*.py")}
    installed = set(importlib.metadata.packages_distributions())  # every top-level name an installed dist provides
    clashes = modules & (FOLDERS | installed)
    assert not clashes, f"rename {sorted(clashes)} in flows/"
