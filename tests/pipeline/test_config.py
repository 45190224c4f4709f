"""Typed configs: TOML + --set overrides, and errors that name the key."""

from __future__ import annotations

import pytest

from atelier_studio.designer.config import DesignerConfig
from atelier_studio.pipeline.config import ConfigError, config_to_toml, load_config

BASE = """
[model]
path = "models/tiny"
[data]
train = "data/train.jsonl"
seq_len = 256
[train]
max_steps = 20
lr = 3e-4
"""


@pytest.fixture
def toml_file(tmp_path):
    p = tmp_path / "cfg.toml"
    p.write_text(BASE)
    return p


def test_loads_file_and_defaults(toml_file):
    cfg = load_config(DesignerConfig, toml_file)
    assert cfg.model.path == "models/tiny"
    assert cfg.data.seq_len == 256
    assert cfg.train.max_steps == 20 and cfg.train.lr == 3e-4
    assert cfg.lora.rank == 16 and cfg.train.grad_accum == 1


def test_overrides_are_typed(toml_file):
    cfg = load_config(DesignerConfig, toml_file, [
        "lora.rank=8", "train.lr=1e-3", "output.dir=runs/x", "lora.targets=q,v", "train.betas=[0.9, 0.99]",
        "model.dtype=float32", "output.tensorboard=false",
    ])
    assert cfg.lora.rank == 8
    assert cfg.train.lr == 1e-3
    assert cfg.output.dir == "runs/x"
    assert cfg.lora.targets == ("q", "v")
    assert cfg.train.betas == (0.9, 0.99)
    assert cfg.model.dtype == "float32"
    assert cfg.output.tensorboard is False
    # a comma list of numbers, as the comma lists of words (lora.targets) are written
    assert load_config(DesignerConfig, toml_file, ["train.betas=0.9,0.98"]).train.betas == (0.9, 0.98)
    with pytest.raises(ConfigError, match=r"train\.betas\[1\]: expected a number, got str 'fast'"):
        load_config(DesignerConfig, toml_file, ["train.betas=0.9,fast"])


@pytest.mark.parametrize("override, expected", [
    ("train.lrate=1", "train.lrate: unknown key"),
    ("nosuch.x=1", "nosuch: unknown key"),
    ("train.lr=fast", "train.lr: expected a number"),
    ("train.max_steps=2.5", "train.max_steps: expected an integer"),
    ("train.schedule=step", "train.schedule: must be one of 'cosine', 'linear', 'constant'"),
    ("lora.dropout=1.5", "lora.dropout: must be in [0, 1), got 1.5"),
    ("train.max_steps=0", "train.max_steps: must be > 0"),
    ("output.tensorboard=maybe", "output.tensorboard: expected true or false"),
    ("train", "expected KEY=VALUE"),
    ("train=1", "train: is a section"),
])
def test_bad_overrides_name_the_key(toml_file, override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(DesignerConfig, toml_file, [override])
    assert expected in str(e.value)


def test_unknown_key_in_file_lists_allowed(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(BASE + "\n[lora]\nrnak = 8\n")
    with pytest.raises(ConfigError,
                       match=r"lora.rnak: unknown key, did you mean lora.rank\?; allowed keys in \[lora\]: alpha, "
                             r"base_dtype, dropout"):
        load_config(DesignerConfig, p)


@pytest.mark.parametrize("override,expected", [
    ("train.max_step=1", "train.max_step: unknown key, did you mean train.max_steps?"),
    ("train.warmup=1", "train.warmup: unknown key, did you mean train.warmup_steps?"),
    ("outptu.dir=x", "outptu: unknown key, did you mean output?"),
    ("train.zebra=1", "train.zebra: unknown key (--set"),  # nothing close: no guess
])
def test_unknown_key_suggests_the_closest_one(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(DesignerConfig, None, [override])
    assert expected in str(e.value)


def test_wrong_type_in_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(BASE.replace("seq_len = 256", 'seq_len = "long"'))
    with pytest.raises(ConfigError, match="data.seq_len: expected an integer, got str 'long'"):
        load_config(DesignerConfig, p)


def test_missing_required_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="model.path: required"):
        load_config(DesignerConfig, None, ["data.train=x.jsonl"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(DesignerConfig, tmp_path / "nope.toml")
    p = tmp_path / "broken.toml"
    p.write_text("[model\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(DesignerConfig, p)


def test_toml_round_trip(toml_file, tmp_path):
    cfg = load_config(DesignerConfig, toml_file, ["lora.targets=q,k", "train.seed=7"])
    out = tmp_path / "resolved.toml"
    out.write_text(config_to_toml(cfg))
    assert load_config(DesignerConfig, out) == cfg


def test_both_trainers_read_lora_through_the_engines_section():
    """[lora] is one type (pipeline.config.LoraConfig) that each trainer extends: the same checks refuse the same
    values in both, naming the key, and alpha 0 means the rank in both."""
    from atelier_studio.designer.config import LoraConfig as DesignerLora
    from atelier_studio.imagegen.config import LoraConfig as ImagegenLora
    from atelier_studio.pipeline.config import LoraConfig, config_from_dict

    assert issubclass(DesignerLora, LoraConfig) and issubclass(ImagegenLora, LoraConfig)
    for cls in (DesignerLora, ImagegenLora):
        for bad, says in (({"rank": -1}, "rank: "), ({"alpha": -2.0}, "alpha: "), ({"dropout": 1.0}, "dropout: "),
                          ({"targets": ["q", " "]}, "targets: "),
                          ({"init_adapter": "x", "rank": 0}, "rank: 0 is full fine-tuning .* init_adapter = 'x'")):
            with pytest.raises(ConfigError, match=f"^lora.{says}"):
                config_from_dict(cls, bad, "lora.")
    for lora in (DesignerLora(rank=8, alpha=0.0), ImagegenLora(rank=8)):
        assert lora.args().scale == 1.0 and lora.args(("q",)).targets == ("q",)
