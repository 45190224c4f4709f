"""The README stays true: its quick start, its links, and docs/layout.md's tree, which lists every file of the
project."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
LAYOUT = (ROOT / "docs" / "layout.md").read_text()
LISTED_DIRS = ("pipeline/", "designer/", "imagegen/", "kernels/", "flows/", "data/", "bench/", "configs/", "tests/",
               ".ci/", "docs/")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines()
            if f.startswith(LISTED_DIRS) and not f.endswith("__init__.py") and "/fixtures/" not in f
            and "/results/" not in f and (ROOT / f).exists()]


def test_quick_start_is_two_make_commands():
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^make (\w+)", section, flags=re.M)
    assert commands == ["demo", "test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_tree_lists_every_file():
    tree = LAYOUT.split("<!-- tree:start -->", 1)[1].split("<!-- tree:end -->", 1)[0]
    missing = [f for f in tracked_files() if f not in tree]
    assert not missing, f"docs/layout.md's file tree lacks: {missing}"
    listed = set(re.findall(r"^([\w./-]+\.\w+)\s", tree, flags=re.M))
    stale = sorted(f for f in listed if not (ROOT / f).exists())
    assert not stale, f"docs/layout.md's file tree lists files that do not exist: {stale}"


def test_relative_links_resolve():
    """Every relative link in the README and docs/ points at a file that exists (the docs moved out of the README)."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to files that do not exist: {broken}"
