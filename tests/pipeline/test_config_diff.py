"""pipeline/config_diff.py: every config key of both trainers has a resume rule, the config a checkpoint was trained
under, changed optimizer settings take effect on resume; `lora.rank = 0` with adapter keys is an error (both
trainers). The CLI side is tests/designer/test_resume.py."""

from __future__ import annotations

import pytest
import torch

from atelier_studio.designer.config import DesignerConfig
from atelier_studio.imagegen.config import ImagegenConfig
from atelier_studio.pipeline.config import (
    ConfigError,
    OutputConfig,
    TrainConfig,
    config_to_dict,
    config_to_toml,
    load_config,
)
from atelier_studio.pipeline.config_diff import ResumePolicy, check_resume, flatten, trained_under
from atelier_studio.pipeline.trainer import Trainer, seed_everything

from tests.pipeline.toy_task import ToyTask


def test_changed_optimizer_settings_take_effect_on_resume(tmp_path):
    """A checkpoint restores the optimizer's saved weight decay, betas and eps; the resumed run's own are used."""
    def trainer(**train):
        seed_everything(0)
        cfg = TrainConfig(**{"max_steps": 2, "micro_batch": 1, "lr": 1e-2, "warmup_steps": 0, **train})
        return Trainer(ToyTask(0), cfg, OutputConfig(dir=str(tmp_path / "run"), tensorboard=False), torch.device("cpu"))

    trainer().fit()
    resumed = trainer(max_steps=3, weight_decay=0.5, betas=(0.8, 0.9), adam_eps=1e-6)
    resumed.resume()
    decay, no_decay = resumed.optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.5, 0.0)
    assert tuple(decay["betas"]) == (0.8, 0.9) and decay["eps"] == 1e-6


@pytest.mark.parametrize("cls", [DesignerConfig, ImagegenConfig])
def test_every_key_has_a_resume_rule(cls):
    """A new config key must be placed in the refuse, warn or free list deliberately (an unplaced key is refused)."""
    policy: ResumePolicy = cls.resume_policy
    keys = flatten(config_to_dict(cls()))
    assert [k for k in keys if policy.rule(k) is None] == []
    for key in ("model.path", "data.seq_len", "data.train", "data.shards", "data.resolution", "lora.rank",
                "lora.targets", "lora.alpha", "train.seed"):
        assert policy.rule(key) == ("refuse" if key in keys else None), key
    for key in ("train.lr", "train.schedule", "train.max_steps", "train.eval_every", "train.save_every",
                "train.log_every", "output.tensorboard", "lora.dropout"):
        assert policy.rule(key) == "warn", key
    assert policy.rule("train.resume") == policy.rule("output.dir") == policy.rule("train.micro_batch") == "free"


def test_the_config_a_checkpoint_was_trained_under(tmp_path):
    for name in ("config.toml", "config.step-4.toml", "config.step-9.toml"):
        (tmp_path / name).write_text("")
    ckpt = tmp_path / "checkpoints"
    assert trained_under(ckpt / "step-3") == tmp_path / "config.step-4.toml"
    assert trained_under(ckpt / "step-4") == tmp_path / "config.step-4.toml"
    assert trained_under(ckpt / "step-7") == tmp_path / "config.step-9.toml"
    assert trained_under(ckpt / "step-12") == tmp_path / "config.toml"


@pytest.mark.parametrize("cls, sets", [
    (DesignerConfig, ["model.path=m", "data.train=t.jsonl"]),
    (ImagegenConfig, ["model.path=m", "data.shards=s", "data.resolution=32", "ema.decay=0"]),
])
@pytest.mark.parametrize("adapter", ["lora.targets=to_q", "lora.dropout=0.1", "lora.rslora=true",
                                     "lora.init_adapter=a"])
def test_rank_0_with_adapter_keys_is_an_error(cls, sets, adapter):
    with pytest.raises(ConfigError, match=rf"lora\.rank: 0 is full fine-tuning .*{adapter.split('=')[0][5:]} = .*"
                                          rf"set lora\.rank > 0"):
        load_config(cls, None, [*sets, "lora.rank=0", adapter])
    load_config(cls, None, [*sets, "lora.rank=4", adapter])  # with adapters, the same key is fine


def test_a_config_of_another_version_compares_by_defaults(tmp_path):
    """The checkpoint's config.toml lacks a key added since (it ran with the default) and has one removed since:
    neither is a change; a real change still is."""
    cfg = load_config(DesignerConfig, None, ["model.path=m", "data.train=t.jsonl", f"output.dir={tmp_path}"])
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)
    old = config_to_toml(cfg).replace("grad_clip = 1.0\n", "").replace("[train]\n", "[train]\nremoved_key = 5\n")
    (tmp_path / "config.toml").write_text(old)
    assert check_resume(cfg, DesignerConfig.resume_policy, tmp_path).changes == ()
    (tmp_path / "config.toml").write_text(old.replace("lr = 0.0001", "lr = 0.001"))
    changes = check_resume(cfg, DesignerConfig.resume_policy, tmp_path).changes
    assert [str(c) for c in changes] == ["train.lr 0.001 → 0.0001"]
