"""Every shipped config under configs/ loads through its trainer's typed config and validates, and the
commands its header tells a user to run exist (an `atelier` subcommand, a known model size)."""
import re
from pathlib import Path

import pytest

from atelier_studio.designer.config import DesignerConfig
from atelier_studio.imagegen.config import ImagegenConfig
from atelier_studio.pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*/*.toml"))
CLASSES = {"designer": DesignerConfig, "imagegen": ImagegenConfig}


def test_there_are_configs_for_both_trainers():
    assert {p.parent.name for p in CONFIGS} == set(CLASSES)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_loads_and_validates(path):
    cfg = load_config(CLASSES[path.parent.name], path)
    assert cfg.model.path and cfg.output.dir


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.parent.name == "designer"], ids=lambda p: p.name)
def test_designer_config_header_names_real_sizes(path):
    from atelier_studio.designer.hf import args_from_size

    for size in re.findall(r"designer init --size (\S+)", path.read_text()):
        args_from_size(size, vocab_size=1024)  # raises on an unknown size
