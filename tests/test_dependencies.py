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
    import atelier_studio.kernels.rmsnorm, atelier_studio.designer.model, atelier_studio.imagegen.model
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
    out = subprocess.run([sys.executable, "-c", PROBE.format(more=more)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
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
