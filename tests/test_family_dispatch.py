"""No code outside a family's own file chooses a model family by type, size table or model_type: it asks the
registry (designer/registry.py, imagegen/registry.py).

Read from the source (every module of the project, parsed): outside the files that declare the families,
no `isinstance` / `issubclass` against a family's args or model class, no use of a family module's `SIZES`
table, no comparison with a family's model_type or class name, and no prefix test on a size name. The names
come from the registries, so a family added later is covered too. tests/designer/test_toy_family.py checks
the same behaviourally, with a family that is neither Qwen3 nor Qwen3.5.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from atelier_studio.designer import registry as designer_registry
from atelier_studio.imagegen import registry as imagegen_registry

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "designer", "imagegen", "kernels", "flows", "data", "bench")
FAMILIES = [*designer_registry.families(), *imagegen_registry.families()]
FAMILY_FILES = {Path(inspect.getfile(f.model_cls)).resolve() for f in FAMILIES}
CLASS_NAMES = {c.__name__ for f in FAMILIES for c in (f.args_cls, f.model_cls)}
# what names a family in a config (model_type / _class_name), and its sizes (a prefix test on a size name,
# `size.startswith("qwen3.5")`, guesses the family; comparing with one size picks that size, which is fine)
CONFIG_VALUES = {v for f in designer_registry.families() for v in f.model_types} | {
    v for f in imagegen_registry.families() for v in f.class_names}
SIZES = {s for f in FAMILIES for s in f.sizes}
SOURCES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if p.resolve() not in FAMILY_FILES)


def _names(node: ast.AST) -> set[str]:
    """The class names an isinstance second argument mentions (a name, an attribute, or a tuple of them)."""
    items = node.elts if isinstance(node, ast.Tuple) else [node]
    return {n.id if isinstance(n, ast.Name) else n.attr for n in items if isinstance(n, (ast.Name, ast.Attribute))}


def dispatch_sites(path: Path) -> list[str]:
    """`file:line what` for every family dispatch in one module."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                               "issubclass"):
            hit = _names(node.args[1]) & CLASS_NAMES if len(node.args) == 2 else set()
            if hit:
                found.append((node.lineno, f"{where}:{node.lineno} {node.func.id}(..., {sorted(hit)})"))
        elif isinstance(node, ast.ImportFrom) and any(a.name == "SIZES" for a in node.names):
            if node.module and node.module.rsplit(".", 1)[-1] in {"model", "qwen35"}:
                found.append((node.lineno, f"{where}:{node.lineno} imports SIZES from {node.module}"))
        elif isinstance(node, ast.Attribute) and node.attr == "SIZES":
            found.append((node.lineno, f"{where}:{node.lineno} reads {ast.unparse(node)}"))
        elif isinstance(node, ast.Compare):
            consts = {c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)}
            consts |= {e.value for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set))
                       for e in c.elts if isinstance(e, ast.Constant)}
            hit = {c for c in consts if isinstance(c, str)} & CONFIG_VALUES
            if hit:
                found.append((node.lineno, f"{where}:{node.lineno} compares with {sorted(hit)}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and any(s.startswith(node.args[0].value) for s in SIZES | CONFIG_VALUES)):
            found.append((node.lineno, f"{where}:{node.lineno} {ast.unparse(node)}"))
    return [what for _, what in sorted(found)]


def test_the_scan_sees_the_project_and_the_families():
    assert len(SOURCES) > 50 and {"Qwen3", "Qwen35Args", "MMDiT"} <= CLASS_NAMES
    assert {"qwen3", "qwen3_5_text", "SD3Transformer2DModel"} <= CONFIG_VALUES and {"qwen3.5-9b", "sd3-medium"} <= SIZES


def test_the_scan_finds_each_kind_of_dispatch(tmp_path):
    """Each rule catches the dispatch it is for (so a pass below means something)."""
    bad_text = "\n".join([
        "from atelier_studio.designer.model import SIZES",
        "x = isinstance(args, (Qwen3, Qwen35Args))",
        "y = qwen35.SIZES",
        "z = cfg['model_type'] == 'qwen3'",
        "w = size.startswith('qwen3.5')",
    ])
    probe = tmp_path / "probe.py"
    probe.write_text(bad_text)
    found = dispatch_sites(probe)
    assert [f.split(" ", 1)[0] for f in found] == [f"probe.py:{i}" for i in (1, 2, 3, 4, 5)], found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_family_dispatch_outside_the_family_files(path):
    assert not dispatch_sites(path), "ask the registry instead: " + "; ".join(dispatch_sites(path))
