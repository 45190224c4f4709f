"""The experiment trackers in tests, offline: one MLflow SQLite store per session, W&B in offline mode, and readers
that get each tracker's logged values back from what the real library wrote (MlflowClient; the W&B run files through
wandb's own record reader; TensorBoard's event files).

`tracker_store` (session; tests/conftest.py exposes it) creates the store once: MLflow builds its SQLite schema in
~10 s, which every test then shares. `tracker_env` (per test) points the libraries at it and at the test's folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

EXPERIMENT = "atelier"  # output.project's default: the trainers log into this experiment


@dataclass(frozen=True)
class TrackerStore:
    uri: str  # MLflow's tracking URI (SQLite)


@pytest.fixture(scope="session")
def tracker_store(tmp_path_factory) -> TrackerStore:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    base = tmp_path_factory.mktemp("trackers")
    uri = f"sqlite:///{base / 'mlflow.db'}"
    # the artifacts beside it (a URI from the environment would otherwise put them under the working directory)
    MlflowClient(uri).create_experiment(EXPERIMENT, artifact_location=(base / "mlartifacts").as_uri())
    return TrackerStore(uri)


@pytest.fixture
def tracker_env(tracker_store, monkeypatch, tmp_path) -> TrackerStore:
    """W&B offline with its own folders under tmp_path; MLflow at the session's store."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker_store.uri)
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
                       "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                       "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}.items():
        monkeypatch.setenv(var, value)
    return tracker_store


def checkpoint_trackers(out: Path) -> dict:
    """The trackers' state in the newest checkpoint of a run (the ids a resume continues)."""
    newest = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    return json.loads((newest / "state.json").read_text())["trackers"]


def jsonl_losses(out: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def wandb_runs(out: Path) -> list[Path]:
    """The offline run folders W&B wrote under a run's output.dir, oldest first (a resume adds one)."""
    return sorted((out / "wandb").glob("offline-run-*"))


def wandb_records(out: Path) -> list[tuple[str, object]]:
    """Every record of every offline run folder, in order, as (type, message), read with wandb's own reader."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    found = []
    for folder in wandb_runs(out):
        (path,) = folder.glob("run-*.wandb")
        store = datastore.DataStore()
        store.open_for_scan(str(path))
        while (data := store.scan_data()) is not None:
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            found.append((kind, getattr(record, kind)))
    return found


def wandb_history(out: Path) -> list[dict[str, object]]:
    """The history rows (one per logged step) of a run's W&B files, in order: {key: value} with "_step"."""
    rows = []
    for kind, message in wandb_records(out):
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in message.item})
    return rows


def wandb_losses(out: Path) -> list[tuple[int, float]]:
    return [(row["_step"], row["train/loss"]) for row in wandb_history(out) if "train/loss" in row]


def wandb_run_ids(out: Path) -> set[str]:
    return {message.run_id for kind, message in wandb_records(out) if kind == "run"}


def tensorboard_losses(out: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def assert_same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    """The same steps, and each value equal to want's within float32 rounding (TensorBoard stores float32)."""
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=torch.finfo(torch.float32).eps)


def assert_same_losses_everywhere(out: Path, store: TrackerStore, steps: list[int]) -> str:
    """metrics.jsonl's train losses at `steps`, the same in TensorBoard, W&B and MLflow; returns the MLflow run id."""
    want = jsonl_losses(out)
    assert [s for s, _ in want] == steps
    assert_same(tensorboard_losses(out), want)
    assert_same(wandb_losses(out), want)
    run_id = checkpoint_trackers(out)["mlflow"]["run_id"]
    assert_same(mlflow_history(store.uri, run_id, "train/loss"), want)
    return run_id
