"""The import graph of Atelier's own modules, read from the source: arrows point down and never close a loop.

Layers, bottom to top: kernels/ (fused ops) → pipeline/ (the engine) → data/ (the data layer, which may use the
engine's errors, atomic writes and progress, never the reverse) → designer/ and imagegen/ (the two model sides,
which never import each other) → flows/ and bench/ (the command line, the Prefect flows, the benchmarks: they may
import everything). Inside a model side, a family's file (one that declares `FAMILY = Family(...)`) imports no
other family's file: what families share lives in a shared module (designer/decoder.py), so a family is added
without touching, or depending on, another. Every import counts, also one inside a function (an import deferred to
run time is still a dependency); only `if TYPE_CHECKING:` imports, which never run, are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
FOLDERS = ("kernels", "pipeline", "data", "designer", "imagegen", "flows", "bench")
# What each folder may import besides itself.
ALLOWED = {
    "kernels": set(),
    "pipeline": {"kernels"},
    "data": {"kernels", "pipeline"},
    "designer": {"kernels", "pipeline", "data"},
    "imagegen": {"kernels", "pipeline", "data"},
    "flows": {"kernels", "pipeline", "data", "designer", "imagegen"},
    "bench": {"kernels", "pipeline", "data", "designer", "imagegen", "flows"},
}
PREFIX = "atelier_studio."


def _imported_names(tree: ast.AST) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, node.lineno))
            found.extend((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module ("folder.name") -> {imported module: first line that imports it}, over Atelier's modules only."""
    graph: dict[str, dict[str, int]] = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.py")):
            module = f"{folder}.{path.stem}"
            edges = graph.setdefault(module, {})
            for name, line in _imported_names(ast.parse(path.read_text(), str(path))):
                if not name.startswith(PREFIX):
                    continue
                parts = name[len(PREFIX):].split(".")
                if len(parts) >= 2 and (root / parts[0] / f"{parts[1]}.py").is_file():
                    target = f"{parts[0]}.{parts[1]}"
                    if target != module:
                        edges.setdefault(target, line)
    return graph


def family_modules(root: Path = ROOT, extra: tuple[Path, ...] = ()) -> dict[str, Path]:
    """"folder.name" → path of every model-side module that declares `FAMILY = Family(...)`, and of `extra` files
    (a family declared outside the package, as tests/designer/toy_family.py)."""
    found = {}
    paths = [p for folder in ("designer", "imagegen") for p in sorted((root / folder).glob("*.py"))]
    for path in [*paths, *extra]:
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FAMILY" for t in node.targets)
               and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "Family" for node in tree.body):
            found[f"{path.parent.name}.{path.stem}"] = path
    return found


def cross_family_imports(families: dict[str, Path]) -> list[str]:
    """`file:line imports folder.family` for every import of one family's module by another family's file."""
    bad = set()
    for module, path in families.items():
        for name, line in _imported_names(ast.parse(path.read_text(), str(path))):
            target = ".".join(name[len(PREFIX):].split(".")[:2]) if name.startswith(PREFIX) else ""
            if target in families and target != module:
                bad.add((f"{path.parent.name}/{path.name}", line, target))
    return [f"{where}:{line} imports {target}" for where, line, target in sorted(bad)]


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for module, edges in graph.items():
        folder = module.split(".")[0]
        for target, line in edges.items():
            other = target.split(".")[0]
            if other != folder and other not in ALLOWED[folder]:
                bad.append(f"{module.replace('.', '/')}.py:{line} imports {target}")
    return bad


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per back edge of a depth-first search (empty when the graph is acyclic)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    found: list[list[str]] = []

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        path.append(module)
        for target in graph.get(module, {}):
            if state.get(target) == 1:
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                walk(target, path)
        path.pop()
        state[module] = 2

    for module in graph:
        if module not in state:
            walk(module, [])
    return found


def test_arrows_point_down():
    bad = upward_imports(import_graph())
    assert not bad, ("imports against the layering (kernels → pipeline → data → designer, imagegen → flows, "
                     "bench):\n" + "\n".join(bad))


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:])) for c in found)


def test_the_checks_catch_what_they_exist_for(tmp_path):
    """A pipeline module importing a model side or (deferred) the data layer, and two modules importing each other
    inside functions, are found."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "pipeline" / "engine.py").write_text("def f():\n    from atelier_studio.designer.model import X\n")
    (tmp_path / "pipeline" / "config.py").write_text("def f():\n    from atelier_studio.data.textfile import X\n")
    (tmp_path / "data" / "textfile.py").write_text("from atelier_studio.pipeline.errors import E\n")
    (tmp_path / "designer" / "model.py").write_text("from atelier_studio.designer.lora import Y\n")
    (tmp_path / "designer" / "lora.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from atelier_studio.flows.cli import Z\n"
        "def g():\n    import atelier_studio.designer.model\n")
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == ["pipeline/config.py:2 imports data.textfile",
                                     "pipeline/engine.py:2 imports designer.model"]
    assert [sorted(set(c)) for c in cycles(graph)] == [["designer.lora", "designer.model"]]


def test_no_family_imports_another_family():
    """Adding a designer family imports nothing from another family's file: Qwen3, Qwen3.5, Qwen3-MoE and the toy
    Phi-3 (declared outside the package) take what they share from designer/decoder.py."""
    families = family_modules(extra=(ROOT / "tests" / "designer" / "toy_family.py",))
    assert {"designer.qwen3", "designer.qwen35", "designer.qwen3_moe", "designer.toy_family", "imagegen.model"} <= set(
        families), sorted(families)
    bad = cross_family_imports(families)
    assert not bad, "a family file imports another family's (move what they share to designer/decoder.py):\n" + \
        "\n".join(bad)


def test_the_family_check_catches_a_family_importing_another(tmp_path):
    for folder in ("designer", "imagegen"):
        (tmp_path / folder).mkdir()
    (tmp_path / "designer" / "decoder.py").write_text("class CausalLM: ...\n")
    (tmp_path / "designer" / "a.py").write_text(
        "from atelier_studio.designer.decoder import CausalLM\nFAMILY = Family()\n")
    (tmp_path / "designer" / "b.py").write_text(
        "from atelier_studio.designer.decoder import CausalLM\nfrom atelier_studio.designer.a import X\n"
        "FAMILY = Family()\n")
    families = family_modules(tmp_path)
    assert sorted(families) == ["designer.a", "designer.b"]
    assert cross_family_imports(families) == ["designer/b.py:2 imports designer.a"]
