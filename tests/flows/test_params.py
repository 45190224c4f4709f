"""flows/params.py: the parameter model mirrors the config dataclasses (types, defaults, help), only the keys a run
sets become overrides, and they land above the TOML and below the explicit `overrides`."""

from __future__ import annotations

import pydantic
import pytest

from atelier_studio.flows.params import field_help, to_overrides
from atelier_studio.flows.train_designer import DesignerParams
from atelier_studio.flows.train_imagegen import ImagegenParams
from atelier_studio.flows.training import prepare_run
from atelier_studio.pipeline.config import TrainConfig

from tests.flows.conftest import designer_config


def test_the_model_has_every_key_typed_with_its_default_and_help():
    schema = DesignerParams.model_json_schema()
    train = schema["$defs"]["DesignerParams_train"]
    assert train["properties"]["grad_clip"] == {"default": 1.0, "description": "max global grad norm; 0 disables "
                                                "clipping", "title": "Grad Clip", "type": "number"}
    assert train["properties"]["schedule"]["enum"] == ["cosine", "linear", "constant"]
    # the designer's [train] is the engine's plus its objective (designer/config.py DesignerTrainConfig), each
    # inherited key with the engine's help
    assert set(train["properties"]) == set(TrainConfig.__dataclass_fields__) | {"objective", "dpo"}
    assert train["properties"]["objective"]["enum"] == ["sft", "dpo"]
    assert field_help(TrainConfig)["min_lr_ratio"] == "the schedule decays to lr * min_lr_ratio"
    assert "ema" in ImagegenParams.model_fields and "lora" in DesignerParams.model_fields


@pytest.mark.parametrize("bad", [{"train": {"lr": "fast"}}, {"train": {"nope": 1}}, {"lora": {"rank": 1.5}},
                                 {"train": {"schedule": "step"}}, {"nope": {}}])
def test_a_value_that_does_not_fit_is_refused(bad):
    with pytest.raises(pydantic.ValidationError):
        DesignerParams.model_validate(bad)


def test_only_the_keys_set_become_overrides():
    p = DesignerParams.model_validate({"train": {"lr": 0.5, "betas": [0.8, 0.9], "distributed": {"compile": True}},
                                       "output": {"dir": "runs/x"}})
    assert to_overrides(p) == ["train.lr=0.5", "train.betas=[0.8, 0.9]", "train.distributed.compile=true",
                               "output.dir=runs/x"]
    assert to_overrides(DesignerParams()) == [] and to_overrides(None) == []


def test_params_beat_the_toml_and_overrides_beat_params(designer_world, tmp_path):
    cfg = designer_config(designer_world, tmp_path / "run")  # lr = 1e-3, max_steps = 6
    p = DesignerParams.model_validate({"train": {"lr": 0.5, "max_steps": 9}})
    _, items, merged = prepare_run("designer", str(cfg), p, ["train.max_steps=7"])
    assert items == ["train.max_steps=9", "train.lr=0.5", "train.max_steps=7"]  # field order, then overrides
    assert (merged.train.lr, merged.train.max_steps, merged.train.micro_batch) == (0.5, 7, 2)  # micro_batch: TOML's
