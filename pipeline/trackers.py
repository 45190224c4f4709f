"""Experiment trackers: TensorBoard, Weights & Biases and MLflow behind one small interface.

`[output] trackers = ["tensorboard", "wandb", "mlflow"]` (any subset) picks them; `open_trackers` starts each one
and `Trackers` fans every call out to all of them. A tracker sees:

    start(RunInfo)                  the run's name, group, project, resolved config (flat "section.key" params),
                                    git commit and system info; a resumed run passes the ids its checkpoint stored
    scalars(step, {name: value})    "train/loss", "train/lr", "eval/loss", ... (the metrics.jsonl records, flattened)
    image(tag, path, step)          a PNG (imagegen's validation grid)
    table(tag, columns, rows, step) rows of values (the designer's held-out captions: brief, caption, step)
    finish(summary, interrupted)    the run's summary (summary.json's numbers); the run is closed
    state()                         what a resume needs to continue the same tracker run (W&B run id, MLflow run id),
                                    saved in every checkpoint's state (pipeline/checkpointer.py)

Resume continues the same tracker run: W&B by its stored id (`resume="allow"`), MLflow by its stored run id. Steps
up to the resumed checkpoint's were logged by the run that saved it, so `Trackers` drops records at or below that
step (a resumed run that re-evaluates its last step adds no duplicate point); MLflow, whose history keeps every point,
also skips steps at or below the last one it holds for the run, and TensorBoard purges what an earlier attempt logged
after the checkpoint (a run that crashed after logging past its last checkpoint replays those steps exactly).

W&B and MLflow are extras (`pip install 'atelier-studio[wandb]'`, `[mlflow]`); `check_installed` names the extra of
one asked for but not installed before anything loads. Where W&B and MLflow send their data is their own setting, read
by the libraries from the environment (WANDB_MODE=offline, WANDB_API_KEY, MLFLOW_TRACKING_URI, ...); without a
tracking URI, MLflow writes to a SQLite store in the run's folder, `<output.dir>/mlflow.db`, with the artifacts in
`<output.dir>/mlartifacts` (docs/training.md, "Trackers"). Only rank 0 of a torchrun run starts any tracker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from atelier_studio.pipeline.config import flatten
from atelier_studio.pipeline.errors import AtelierError

TRACKERS = ("tensorboard", "wandb", "mlflow")
# the module each tracker imports, and the extra that installs it
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
_EXTRAS = {"tensorboard": "", "wandb": "wandb", "mlflow": "mlflow"}


class TrackerError(AtelierError, RuntimeError):
    """A tracker asked for that cannot run (not installed, or its store refused the run)."""


def check_installed(names: Sequence[str]) -> None:
    """A TrackerError naming the extra to install for the first tracker in `names` whose library is missing."""
    for name in names:
        if importlib.util.find_spec(_MODULES[name]) is None:
            extra = _EXTRAS[name]
            how = f"pip install 'atelier-studio[{extra}]'" if extra else f"pip install {_MODULES[name]}"
            raise TrackerError(f"output.trackers: {name!r} is not installed; install it with `{how}`, or remove it "
                               f"from output.trackers")


@dataclass(frozen=True)
class RunInfo:
    """What a tracker is told when the run starts."""

    out_dir: Path
    name: str
    group: str
    project: str
    params: dict[str, Any]  # the resolved config, flat: {"train.lr": 1e-4, ...}
    git_commit: str | None
    system: dict[str, Any]
    resume_step: int  # the checkpoint's step a resumed run starts from; 0 for a new run
    resume: dict[str, Any] = field(default_factory=dict)  # this tracker's state() from that checkpoint


class Tracker(ABC):
    name: str

    @abstractmethod
    def start(self, info: RunInfo) -> None: ...

    @abstractmethod
    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    @abstractmethod
    def image(self, tag: str, path: Path, step: int) -> None: ...

    @abstractmethod
    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None: ...

    @abstractmethod
    def finish(self, summary: dict[str, float], interrupted: bool) -> None: ...

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to continue this tracker's run (saved in each checkpoint)."""
        return {}


# ----------------------------------------------------------------------------- TensorBoard


class TensorBoardTracker(Tracker):
    """Event files under `<output.dir>/tensorboard`; the config and the commit as a text summary."""

    name = "tensorboard"

    def start(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resume purges what an earlier attempt logged after its checkpoint (TensorBoard's own purge_step)
        self.writer = SummaryWriter(log_dir=str(info.out_dir / "tensorboard"),
                                    purge_step=info.resume_step + 1 if info.resume_step else None)
        if info.resume_step == 0:
            about = {"git_commit": info.git_commit, "system": info.system, "config": info.params}
            self.writer.add_text("run", "```\n" + json.dumps(about, indent=1, default=str) + "\n```", 0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def image(self, tag: str, path: Path, step: int) -> None:
        self.writer.add_image(tag, _rgb(path), step, dataformats="HWC")
        self.writer.flush()

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        # a markdown table: TensorBoard's text plugin renders it
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |"
                  for row in rows]
        self.writer.add_text(tag, "\n".join(lines), step)
        self.writer.flush()

    def finish(self, summary: dict[str, float], interrupted: bool) -> None:
        self.writer.close()


def _rgb(path: Path):
    """An image file as an [H, W, 3] uint8 array."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


# ----------------------------------------------------------------------------- Weights & Biases


class WandbTracker(Tracker):
    """A W&B run whose id this class chooses and the checkpoints keep: a resume continues it (`resume="allow"`).
    Its local files go under `<output.dir>/wandb`; online or offline is W&B's own setting (WANDB_MODE)."""

    name = "wandb"

    def start(self, info: RunInfo) -> None:
        import wandb

        self.wandb = wandb
        self.run_id = info.resume.get("run_id") or uuid.uuid4().hex[:12]
        config = {**info.params, "git_commit": info.git_commit, "system": info.system}
        try:
            self.run = wandb.init(project=info.project, name=info.name, group=info.group or None, id=self.run_id,
                                  resume="allow", dir=str(info.out_dir), config=config, allow_val_change=True)
        except Exception as e:  # no API key and not offline, a refused login: the one line, not W&B's traceback
            raise TrackerError(f"output.trackers: W&B could not start the run ({type(e).__name__}: {e}); log in "
                               f"with `wandb login`, or set WANDB_MODE=offline") from None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def image(self, tag: str, path: Path, step: int) -> None:
        self.run.log({tag: self.wandb.Image(str(path))}, step=step)

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        self.run.log({tag: self.wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def finish(self, summary: dict[str, float], interrupted: bool) -> None:
        self.run.summary.update(summary)
        self.run.finish(exit_code=1 if interrupted else 0)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}


# ----------------------------------------------------------------------------- MLflow


class MlflowTracker(Tracker):
    """An MLflow run in the experiment named by output.project; its run id is kept in the checkpoints and a resume
    reopens it. Params are the resolved config (a resume adds keys it lacks: MLflow refuses to change a logged
    param's value; config_diff's warning names the change), tags the git commit and the system."""

    name = "mlflow"

    def start(self, info: RunInfo) -> None:
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        self.uri, artifacts = _mlflow_store(info.out_dir)
        self.client = MlflowClient(self.uri)
        run_id = info.resume.get("run_id")
        tags = {"mlflow.runName": info.name, "mlflow.source.git.commit": info.git_commit or "unknown",
                **({"group": info.group} if info.group else {}),
                **{f"system.{k}": str(v) for k, v in info.system.items()}}
        if run_id:
            run = self.client.get_run(run_id)
            self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            logged = set(run.data.params)
            self.floor = max((m.step for m in self.client.get_metric_history(run_id, "train/loss")), default=-1)
        else:
            experiment = self.client.get_experiment_by_name(info.project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(info.project, artifact_location=artifacts))
            run_id = self.client.create_run(experiment_id, run_name=info.name, tags=tags).info.run_id
            logged, self.floor = set(), -1
        self.run_id = run_id
        params = [Param(k, str(v)[:6000]) for k, v in sorted(info.params.items()) if k not in logged]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=params[i:i + 100])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if step <= self.floor:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_mlflow_key(k), v, now, step) for k, v in values.items()])

    def image(self, tag: str, path: Path, step: int) -> None:
        if step > self.floor:
            self.client.log_artifact(self.run_id, str(path), artifact_path=_mlflow_key(tag))

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        if step > self.floor:
            data = {c: [r[i] for r in rows] for i, c in enumerate(columns)}
            self.client.log_table(self.run_id, data=data, artifact_file=f"{_mlflow_key(tag)}/step-{step}.json")

    def finish(self, summary: dict[str, float], interrupted: bool) -> None:
        from mlflow.entities import RunStatus

        for k, v in summary.items():
            self.client.set_tag(self.run_id, f"summary.{k}", str(v))
        status = RunStatus.KILLED if interrupted else RunStatus.FINISHED
        self.client.set_terminated(self.run_id, status=RunStatus.to_string(status))

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}


def _mlflow_store(out_dir: Path) -> tuple[str, str | None]:
    """The tracking URI (MLFLOW_TRACKING_URI, else a SQLite file in the run folder) and, for that local default, the
    artifact folder beside it (a server keeps its own)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri:
        return uri, None
    out = out_dir.resolve()
    return f"sqlite:///{out / 'mlflow.db'}", (out / "mlartifacts").as_uri()


def _mlflow_key(key: str) -> str:
    """MLflow's keys allow letters, digits, _ - . / and space; anything else becomes _."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


# ----------------------------------------------------------------------------- all of them


_CLASSES: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                      "mlflow": MlflowTracker}


class Trackers:
    """Every tracker of the run, called together. Records at or below the resumed step are dropped (module
    docstring)."""

    def __init__(self, trackers: list[Tracker], resume_step: int = 0):
        self.trackers = trackers
        self.floor = resume_step if resume_step > 0 else -1

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if step > self.floor and values:
            for t in self.trackers:
                t.scalars(step, values)

    def record(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record: its numbers as scalars "<kind>/<key>" at its step."""
        kind = record.get("kind", "train")
        self.scalars(record["step"], {f"{kind}/{k}": float(v) for k, v in record.items()
                                      if k not in ("step", "kind") and isinstance(v, (int, float))
                                      and not isinstance(v, bool)})

    def image(self, tag: str, path: Path, step: int) -> None:
        if step > self.floor:
            for t in self.trackers:
                t.image(tag, path, step)

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        if step > self.floor:
            for t in self.trackers:
                t.table(tag, columns, rows, step)

    def finish(self, summary: dict[str, Any], interrupted: bool) -> None:
        numbers = {k: float(v) for k, v in flatten(summary).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for t in self.trackers:
            t.finish(numbers, interrupted)
        self.trackers = []

    def state(self) -> dict[str, dict[str, Any]]:
        return {t.name: t.state() for t in self.trackers if t.state()}


def open_trackers(names: Sequence[str], info: RunInfo, saved: dict[str, dict[str, Any]]) -> Trackers:
    """Start the trackers `names` (each with its state from the resumed checkpoint, `saved`)."""
    check_installed(names)
    started: list[Tracker] = []
    for name in names:
        tracker = _CLASSES[name]()
        tracker.start(RunInfo(**{**info.__dict__, "resume": saved.get(name, {})}))
        started.append(tracker)
    return Trackers(started, info.resume_step)


def git_commit() -> str | None:
    """The commit of the code that runs (None outside a git checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def system_info(world_size: int = 1) -> dict[str, Any]:
    """The machine a run trains on: host, Python, torch, the GPU (when there is one), the number of processes."""
    import torch

    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
                            "world_size": world_size, "command": " ".join(sys.argv)}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    return info


__all__ = ["TRACKERS", "Tracker", "Trackers", "TrackerError", "RunInfo", "open_trackers", "check_installed",
           "git_commit", "system_info"]
