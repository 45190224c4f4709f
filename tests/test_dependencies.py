"""The installed libraries import beside Atelier's own top-level packages."""
import importlib.metadata

from packaging.version import Version


def test_transformers_modeling_code_imports_beside_atelier_kernels():
    """transformers >= 5.25 depends on Hugging Face's `kernels` package and imports it by that name, which
    Atelier's `kernels/` shadows (pyproject.toml pins transformers < 5.25 for this reason)."""
    import transformers.modeling_utils  # noqa: F401  (fails on the name clash)
    from transformers import Qwen3ForCausalLM  # noqa: F401

    assert Version(importlib.metadata.version("transformers")) < Version("5.25")
