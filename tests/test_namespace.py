"""The namespace `atelier_studio` is the same whether installed or read from a plain checkout.

An install maps each top-level folder to `atelier_studio.<folder>` (pyproject.toml's package-dir); `atelier_studio/`
at the root holds a relative link to each, so `PYTHONPATH=.`, pyright and graph tools see the same modules with
nothing installed. These tests keep the two lists equal and show the links work without site-packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_links_and_package_dir_name_the_same_folders():
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert all(name == f"atelier_studio.{folder}" for name, folder in mapping.items()), mapping
    links = {p.name: p for p in (ROOT / "atelier_studio").iterdir()}
    assert sorted(links) == sorted(mapping.values())
    for name, link in links.items():
        assert link.is_symlink() and os.readlink(link) == f"../{name}", f"{link} must be a relative link to ../{name}"
        assert link.resolve() == (ROOT / name).resolve()


def test_a_plain_checkout_imports_through_the_links():
    """`python -S` (no site-packages, so no editable install) with the checkout on the path finds the modules."""
    code = ("import atelier_studio.pipeline.errors as e, atelier_studio.data.textfile as t; "
            "print(e.__file__); print(t.__file__)")
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd="/", env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    files = [Path(line) for line in out.stdout.split()]
    assert files == [ROOT / "atelier_studio" / "pipeline" / "errors.py",
                     ROOT / "atelier_studio" / "data" / "textfile.py"]
