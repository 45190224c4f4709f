"""A tiny imagegen run with every tracker (offline, tests/_trackers.py): the same per-step loss in metrics.jsonl,
TensorBoard, W&B and MLflow, and the validation grid as an image in each."""

from __future__ import annotations

from pathlib import Path

import pytest

from atelier_studio.flows.cli import main

from tests._trackers import assert_same_losses_everywhere, wandb_history
from tests.imagegen._world import build_world, cli_args


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.getbasetemp() / "imagegen-world")


def test_a_run_logs_the_same_losses_and_its_sample_grids_to_every_tracker(world, tracker_env, tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    out = tmp_path / "run"
    assert main(cli_args(world, out, "train.max_steps=4", "train.warmup_steps=1", "train.save_every=0",
                         "sample.every=2", "sample.steps=2", "output.tensorboard=true",
                         "output.trackers=tensorboard,wandb,mlflow")) == 0
    run_id = assert_same_losses_everywhere(out, tracker_env, [1, 2, 3, 4])

    artifacts = MlflowClient(tracker_env.uri).list_artifacts(run_id, "samples")
    assert sorted(a.path for a in artifacts) == ["samples/step-2.png", "samples/step-4.png"]
    assert {r["_step"] for r in wandb_history(out) if r.get("samples/_type") == "image-file"} == {2, 4}
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={IMAGES: 0}).Reload()
    assert [im.step for im in events.Images("samples")] == [2, 4]
