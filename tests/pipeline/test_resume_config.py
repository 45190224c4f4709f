"""A resume is honest (pipeline/config_diff.py): it refuses a change of what the checkpoint is, warns about every
other change naming old -> new, keeps the run's config history, and writes config.toml only once the checkpoint
has loaded. Through the CLI on a tiny designer (one 2-step run per module, copied per test); `lora.rank = 0` with
adapter keys is an error in both trainers."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest
import torch

from atelier_studio.designer.config import DesignerConfig
from atelier_studio.flows.cli import main
from atelier_studio.imagegen.config import ImagegenConfig
from atelier_studio.pipeline.config import ConfigError, OutputConfig, TrainConfig, config_to_dict, load_config
from atelier_studio.pipeline.config_diff import ResumePolicy, flatten, trained_under
from atelier_studio.pipeline.trainer import Trainer, seed_everything
from tests.pipeline.toy_task import ToyTask

ROOT = Path(__file__).parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "designer" / "briefs.jsonl"
DESIGNER_DEMO = ROOT / "configs" / "designer" / "demo.toml"
IMAGEGEN_DEMO = ROOT / "configs" / "imagegen" / "demo.toml"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A tokenizer, a tiny fp32 Qwen3 (and a copy of it elsewhere), and a LoRA run of 2 steps saved at each."""
    d = tmp_path_factory.mktemp("resume-world")
    assert main(["data", "tokenizer", "--corpus", str(FIXTURE), "--vocab-size", "400", "--out", str(d / "tok")]) == 0
    assert main(["designer", "init", "--size", "tiny", "--tokenizer", str(d / "tok"), "--out", str(d / "model"),
                 "--dtype", "float32"]) == 0
    shutil.copytree(d / "model", d / "model-copy")
    assert main(train(d, d / "run")) == 0
    return d


def train(world: Path, out: Path, *sets: str) -> list[str]:
    base = {"model.path": world / "model", "data.train": FIXTURE, "data.eval": "", "data.seq_len": 128,
            "train.micro_batch": 2, "train.max_steps": 2, "train.warmup_steps": 1, "train.save_every": 1,
            "train.lr": 1e-3, "lora.rank": 4, "output.tensorboard": "false", "output.dir": out}
    argv = ["designer", "train", "--config", str(DESIGNER_DEMO)]
    for item in [f"{k}={v}" for k, v in base.items()] + list(sets):
        argv += ["--set", item]
    return argv


@pytest.fixture
def run(world, tmp_path) -> Path:
    """A copy of the world's finished 2-step run, to resume."""
    return Path(shutil.copytree(world / "run", tmp_path / "run"))


def test_a_changed_lr_resumes_with_a_warning_and_keeps_the_old_config(world, run, capsys):
    before = (run / "config.toml").read_text()
    assert main(train(world, run, "train.max_steps=3", "train.lr=5e-4", "train.weight_decay=0.25")) == 0
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if line.startswith("warning: resuming"))
    assert "train.lr 0.001 → 0.0005" in warning and "train.max_steps 2 → 3" in warning
    assert "train.weight_decay 0.0 → 0.25" in warning
    assert (run / "config.step-2.toml").read_text() == before  # the settings that trained steps 1-2
    now = tomllib.loads((run / "config.toml").read_text())
    assert now["train"]["lr"] == 5e-4 and now["train"]["max_steps"] == 3
    # resuming again from step 3 compares with config.toml (the settings of step 3): nothing changed, no warning
    assert main(train(world, run, "train.max_steps=4", "train.lr=5e-4", "train.weight_decay=0.25")) == 0
    out = capsys.readouterr().out
    assert "train.lr" not in out and "train.max_steps 3 → 4" in out
    assert sorted(p.name for p in run.glob("config*.toml")) == ["config.step-2.toml", "config.step-3.toml",
                                                                 "config.toml"]


@pytest.mark.parametrize("change, old", [("model.path={model_copy}", "{model}"), ("data.seq_len=96", "128"),
                                         ("lora.rank=8", "4"), ("lora.targets=q,v", "[]"), ("lora.alpha=8", "32.0"),
                                         ("train.seed=7", "0")])
def test_a_resume_that_changes_what_the_checkpoint_is_refuses(world, run, capsys, change, old):
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    change = change.format(model_copy=world / "model-copy")
    key, new = change.split("=")
    assert main(train(world, run, "train.max_steps=3", "train.lr=5e-4", change)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atelier: error: cannot resume")
    old = old.format(model=world / "model")
    assert key in err[0] and old.strip("[]") in err[0] and "another output.dir" in err[0]
    assert f"--set {key}=" in err[0]
    assert "train.lr" not in err[0]  # a warned change is not what stops it
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files  # config.toml included


def test_a_checkpoint_that_fails_to_load_leaves_config_toml_as_it_was(world, run, capsys):
    """The config is written once the checkpoint has loaded: a resume that fails there changes no file."""
    (run / "checkpoints" / "step-2" / "model.safetensors").write_bytes(b"cut")
    before = (run / "config.toml").read_bytes()
    assert main(train(world, run, "train.max_steps=3", "train.lr=5e-4")) == 2
    assert "model.safetensors" in capsys.readouterr().err
    assert (run / "config.toml").read_bytes() == before and not list(run.glob("config.step-*"))


def test_free_keys_change_nothing(world, run, capsys):
    """Naming the checkpoint (train.resume) or the MFU peak is not a changed setting: no warning, no history."""
    assert main(train(world, run, f"train.resume={run / 'checkpoints' / 'step-2'}",
                      "train.peak_tflops=5")) == 0
    assert "warning" not in capsys.readouterr().out and not list(run.glob("config.step-*"))


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
                "lora.targets", "lora.alpha", "train.seed", "train.micro_batch"):
        assert policy.rule(key) == ("refuse" if key in keys else None), key
    for key in ("train.lr", "train.schedule", "train.max_steps", "train.eval_every", "train.save_every",
                "train.log_every", "output.tensorboard", "lora.dropout"):
        assert policy.rule(key) == "warn", key
    assert policy.rule("train.resume") == policy.rule("output.dir") == "free"


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


def test_rank_0_with_targets_through_the_cli(world, tmp_path, capsys):
    for argv in (train(world, tmp_path / "d", "lora.rank=0", "lora.targets=q,v"),
                 ["imagegen", "train", "--config", str(IMAGEGEN_DEMO), "--set", "lora.rank=0", "--set",
                  "lora.targets=to_q", "--set", f"output.dir={tmp_path / 'i'}"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "lora.rank: 0 is full fine-tuning" in err[0] and "lora.targets" in err[0]
    assert not (tmp_path / "d").exists() and not (tmp_path / "i").exists()
