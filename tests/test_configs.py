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


def test_each_demo_renderer_names_its_own_model_size_and_folders():
    """`python -m atelier_studio.flows.demo --imagegen NAME`: the config trains the model folder the demo initialises,
    at a size of the family the config's header names, into an output and an evaluation folder of its own."""
    from atelier_studio.flows.demo import IMAGEGENS
    from atelier_studio.imagegen.registry import family_of_size

    outputs = set()
    for name, demo in IMAGEGENS.items():
        cfg = load_config(ImagegenConfig, ROOT / demo.config)
        assert cfg.model.path == str(demo.model), name
        assert f"--size {demo.size} " in (ROOT / demo.config).read_text(), name
        args = family_of_size(demo.size).sizes[demo.size]
        assert (args.in_channels, args.joint_attention_dim, args.pooled_projection_dim) == (12, 384, 384), name
        outputs |= {cfg.output.dir, str(demo.eval_out)}
    assert len(outputs) == 2 * len(IMAGEGENS)
