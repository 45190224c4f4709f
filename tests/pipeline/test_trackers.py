"""The experiment trackers (pipeline/trackers.py) with the real libraries, offline: what the trainer logs is read back
from each one's own store (tests/_trackers.py), per step, equal everywhere; a resume continues the same tracker runs
with no step twice; a tracker that is not installed is one line naming its extra, before anything trains."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from atelier_studio.pipeline.config import OutputConfig, TrainConfig
from atelier_studio.pipeline.task import Samples, SampleTable
from atelier_studio.pipeline.trainer import Trainer, seed_everything

from tests._trackers import (
    EXPERIMENT,
    assert_same,
    assert_same_losses_everywhere,
    checkpoint_trackers,
    jsonl_losses,
    mlflow_history,
    tensorboard_losses,
    wandb_history,
    wandb_losses,
    wandb_run_ids,
    wandb_runs,
)
from tests.pipeline.toy_task import ToyTask

ALL = ("tensorboard", "wandb", "mlflow")


class SamplingTask(ToyTask):
    """ToyTask with an image every 3 steps and a caption table at each evaluation."""

    def __init__(self, out):
        super().__init__(0)
        self.out = out

    def samples(self, step: int) -> Samples | None:
        if step % 3:
            return None
        path = self.out / "samples" / f"step-{step}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((6, 10, 3), 20 * step, dtype=np.uint8)).save(path)
        return Samples(path, 2, "EMA")

    def sample_table(self, step: int) -> SampleTable | None:
        return SampleTable("captions", ("brief", "caption", "step"),
                           (("a red circle", f"caption at {step}", step), ("a blue square", "b", step)),
                           scores={"judge": step / 10})


def fit(tmp_path, name="run", trackers=ALL, **train):
    out = tmp_path / name
    seed_everything(0)
    cfg = TrainConfig(**{"max_steps": 6, "micro_batch": 1, "lr": 1e-2, "warmup_steps": 0, "save_every": 3,
                         "eval_every": 3, **train})
    output = OutputConfig(dir=str(out), trackers=trackers, run_name="toy", group="g1")
    return Trainer(SamplingTask(out), cfg, output, torch.device("cpu")).fit(), out


def test_every_tracker_logs_the_same_losses_params_images_and_tables(tracker_env, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from atelier_studio.flows.launch import parse_table_line

    _, out = fit(tmp_path)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("table ")]
    sample_file = out / "samples" / "captions-step-6.jsonl"
    assert parse_table_line(lines[-1]) == {"step": 6, "total": 6, "path": str(sample_file), "rows": 2}
    run_id = assert_same_losses_everywhere(out, tracker_env, [1, 2, 3, 4, 5, 6])
    want = jsonl_losses(out)
    ids = checkpoint_trackers(out)
    assert [s for s, _ in mlflow_history(tracker_env.uri, run_id, "eval/judge")] == [3, 6]

    client = MlflowClient(tracker_env.uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "toy" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == EXPERIMENT
    assert run.data.params["train.lr"] == "0.01" and run.data.params["output.trackers"] == str(ALL)
    assert run.data.tags["group"] == "g1" and "mlflow.source.git.commit" in run.data.tags
    assert float(run.data.tags["summary.final_loss"]) == pytest.approx(want[-1][1])
    assert sorted(a.path for a in client.list_artifacts(run_id, "samples")) == ["samples/step-3.png",
                                                                                "samples/step-6.png"]
    table = json.loads(client.download_artifacts(run_id, "captions/step-6.json", str(tmp_path / "dl")) and
                       (tmp_path / "dl" / "step-6.json").read_text())
    assert table["columns"] == ["brief", "caption", "step"] and table["data"][0] == ["a red circle", "caption at 6", 6]

    rows = wandb_history(out)
    assert {r["_step"] for r in rows if "samples/_type" in r} == {3, 6}  # the image, as W&B files it
    assert {r["_step"] for r in rows if r.get("captions/_type") == "table-file"} == {3, 6}
    assert wandb_run_ids(out) == {ids["wandb"]["run_id"]}
    assert json.loads(sample_file.read_text().splitlines()[0]) == {"brief": "a red circle", "caption": "caption at 6",
                                                                   "step": 6}


def test_a_resumed_run_continues_the_same_tracker_runs_without_repeating_a_step(tracker_env, tmp_path):
    """Stopped at step 6 (its checkpoint), resumed to 9: one W&B run id, one MLflow run, steps 1..9 once each, the
    losses those of an uninterrupted run; the resumed run's re-evaluation of step 6 is not logged again."""
    _, whole = fit(tmp_path, "whole", max_steps=9, schedule="constant", trackers=("tensorboard",))
    fit(tmp_path, "run", max_steps=6, schedule="constant")  # a constant lr: 6 steps of 9 are the 6 of 6
    first = checkpoint_trackers(tmp_path / "run")
    _, out = fit(tmp_path, "run", max_steps=9, schedule="constant")
    assert checkpoint_trackers(out) == first
    want = jsonl_losses(whole)
    assert_same(jsonl_losses(out), want)
    assert len(wandb_runs(out)) == 2 and wandb_run_ids(out) == {first["wandb"]["run_id"]}
    assert_same(wandb_losses(out), want)
    run_id = first["mlflow"]["run_id"]
    assert_same(mlflow_history(tracker_env.uri, run_id, "train/loss"), want)
    assert [s for s, _ in mlflow_history(tracker_env.uri, run_id, "eval/judge")] == [3, 6, 9]
    rows = len(wandb_history(out))
    fit(tmp_path, "run", max_steps=9, schedule="constant")  # resumed at its end: re-evaluates step 9, logs nothing
    assert len(wandb_history(out)) == rows
    assert [s for s, _ in mlflow_history(tracker_env.uri, run_id, "eval/judge")] == [3, 6, 9]


def test_a_resume_that_repeats_logged_steps_logs_them_once(tracker_env, tmp_path):
    """A run that crashed after logging past its last checkpoint replays those steps: MLflow keeps one point each,
    TensorBoard purges the first attempt's."""
    fit(tmp_path, "run", max_steps=6, save_every=3, trackers=("mlflow", "tensorboard"))
    out = tmp_path / "run"
    run_id = checkpoint_trackers(out)["mlflow"]["run_id"]
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-6")  # as if killed after logging step 6, before its checkpoint
    # TensorBoard reads event files in name order, whose first field is the writer's start in whole seconds: a real
    # resume starts seconds after the crash, this tiny run may not, so the first attempt's file is dated back
    for f in (out / "tensorboard").glob("events.out.tfevents.*"):
        head, stamp, tail = f.name.split(".", 3)[:3], f.name.split(".")[3], f.name.split(".", 4)[4]
        f.rename(f.with_name(".".join([*head, str(int(stamp) - 60), tail])))
    fit(tmp_path, "run", max_steps=6, save_every=3, trackers=("mlflow", "tensorboard"))
    assert [s for s, _ in mlflow_history(tracker_env.uri, run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in tensorboard_losses(out)] == [1, 2, 3, 4, 5, 6]  # the replayed steps replace the first


def test_a_tracker_that_is_not_installed_names_its_extra(monkeypatch, tmp_path, capsys):
    import importlib.util

    from atelier_studio.flows.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    config = Path(__file__).parents[2] / "configs" / "designer" / "demo.toml"
    assert main(["designer", "train", "--config", str(config), "--set", f"output.dir={tmp_path / 'run'}",
                 "--set", "output.trackers=tensorboard,wandb"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("atelier: error: output.trackers: 'wandb' is not installed; install it with "
                   "`pip install 'atelier-studio[wandb]'`, or remove it from output.trackers")
    assert not (tmp_path / "run").exists()  # nothing started


def test_trackers_config_rejects_unknown_and_repeated_names():
    from atelier_studio.pipeline.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="output.trackers\\[1\\]: must be one of 'tensorboard', 'wandb', 'mlflow'"):
        config_from_dict(_Root, {"output": {"trackers": ["wandb", "comet"]}})
    with pytest.raises(ConfigError, match="trackers: wandb listed twice"):
        config_from_dict(_Root, {"output": {"trackers": ["wandb", "wandb"]}})
    legacy = config_from_dict(_Root, {"output": {"trackers": ["tensorboard", "mlflow"], "tensorboard": False}})
    assert legacy.output.active_trackers() == ("mlflow",)


from dataclasses import dataclass, field  # noqa: E402


@dataclass(frozen=True)
class _Root:
    output: OutputConfig = field(default_factory=OutputConfig)
