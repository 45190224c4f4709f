"""A resume is honest, through the CLI on the tiny designer (pipeline/config_diff.py): it refuses a change of what
the checkpoint is, warns about every other change naming old -> new, keeps the run's config history, and writes
config.toml only once the checkpoint has loaded; `lora.rank = 0` with adapter keys is exit 2 in both trainers.
One 2-step LoRA run per module, copied per test."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from atelier_studio.flows.cli import main

ROOT = Path(__file__).parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "designer" / "briefs.jsonl"
DESIGNER_DEMO = ROOT / "configs" / "designer" / "demo.toml"
IMAGEGEN_DEMO = ROOT / "configs" / "imagegen" / "demo.toml"


@pytest.fixture(scope="module")
def resume_world(world, tmp_path_factory) -> Path:
    """The session's tiny model and a copy of it elsewhere, and a LoRA run of 2 steps saved at each."""
    d = tmp_path_factory.mktemp("resume")
    (d / "model").symlink_to(world / "model")
    shutil.copytree(world / "model", d / "model-copy")
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
def run(resume_world, tmp_path) -> Path:
    """A copy of the finished 2-step run, to resume."""
    return Path(shutil.copytree(resume_world / "run", tmp_path / "run"))


def test_a_changed_lr_resumes_with_a_warning_and_keeps_the_old_config(resume_world, run, capsys):
    before = (run / "config.toml").read_text()
    assert main(train(resume_world, run, "train.max_steps=3", "train.lr=5e-4", "train.weight_decay=0.25")) == 0
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if line.startswith("warning: resuming"))
    assert "train.lr 0.001 → 0.0005" in warning and "train.max_steps 2 → 3" in warning
    assert "train.weight_decay 0.0 → 0.25" in warning
    assert (run / "config.step-2.toml").read_text() == before  # the settings that trained steps 1-2
    now = tomllib.loads((run / "config.toml").read_text())
    assert now["train"]["lr"] == 5e-4 and now["train"]["max_steps"] == 3
    # resuming again from step 3 compares with config.toml (the settings of step 3): nothing changed, no warning
    assert main(train(resume_world, run, "train.max_steps=4", "train.lr=5e-4", "train.weight_decay=0.25")) == 0
    out = capsys.readouterr().out
    assert "train.lr" not in out and "train.max_steps 3 → 4" in out
    assert sorted(p.name for p in run.glob("config*.toml")) == ["config.step-2.toml", "config.step-3.toml",
                                                                 "config.toml"]


@pytest.mark.parametrize("change, old", [("model.path={model_copy}", "{model}"), ("data.seq_len=96", "128"),
                                         ("lora.rank=8", "4"), ("lora.targets=q,v", "[]"), ("lora.alpha=8", "32.0"),
                                         ("train.seed=7", "0")])
def test_a_resume_that_changes_what_the_checkpoint_is_refuses(resume_world, run, capsys, change, old):
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    change = change.format(model_copy=resume_world / "model-copy")
    key, new = change.split("=")
    assert main(train(resume_world, run, "train.max_steps=3", "train.lr=5e-4", change)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atelier: error: cannot resume")
    old = old.format(model=resume_world / "model")
    assert key in err[0] and old.strip("[]") in err[0] and "another output.dir" in err[0]
    assert f"--set {key}=" in err[0]
    assert "train.lr" not in err[0]  # a warned change is not what stops it
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files  # config.toml included


def test_a_checkpoint_that_fails_to_load_leaves_config_toml_as_it_was(resume_world, run, capsys):
    """The config is written once the checkpoint has loaded: a resume that fails there changes no file."""
    (run / "checkpoints" / "step-2" / "model.safetensors").write_bytes(b"cut")
    before = (run / "config.toml").read_bytes()
    assert main(train(resume_world, run, "train.max_steps=3", "train.lr=5e-4")) == 2
    assert "model.safetensors" in capsys.readouterr().err
    assert (run / "config.toml").read_bytes() == before and not list(run.glob("config.step-*"))


def test_free_keys_change_nothing(resume_world, run, capsys):
    """Naming the checkpoint (train.resume) or the MFU peak is not a changed setting: no warning, no history."""
    assert main(train(resume_world, run, f"train.resume={run / 'checkpoints' / 'step-2'}",
                      "train.peak_tflops=5")) == 0
    assert "warning" not in capsys.readouterr().out and not list(run.glob("config.step-*"))


def test_rank_0_with_targets_through_the_cli(resume_world, tmp_path, capsys):
    for argv in (train(resume_world, tmp_path / "d", "lora.rank=0", "lora.targets=q,v"),
                 ["imagegen", "train", "--config", str(IMAGEGEN_DEMO), "--set", "lora.rank=0", "--set",
                  "lora.targets=to_q", "--set", f"output.dir={tmp_path / 'i'}"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "lora.rank: 0 is full fine-tuning" in err[0] and "lora.targets" in err[0]
    assert not (tmp_path / "d").exists() and not (tmp_path / "i").exists()
