"""What `train-designer` and `train-imagegen` share: config checks, the training task, the artifacts task.

The trainer runs as a subprocess (flows/launch.py); the config is also loaded here, in the flow's own
process, so a bad key fails the flow at once and names the file and key before any process starts.
The `train` task is retried once: the trainer resumes from its newest checkpoint (train.resume = auto),
so a retry continues where the failed attempt stopped, and nothing here ever deletes a checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from prefect import task

from atelier_studio.data.chat import DataError
from atelier_studio.flows.launch import run_trainer
from atelier_studio.flows.report import artifact_key, publish_training

Kind = Literal["designer", "imagegen"]


class FlowInputError(DataError):
    """A flow parameter that cannot be used (missing file, bad config, bad line); the message names it.

    A DataError (a ValueError), so `atelier eval` reports it as one line and exits 2 like any input error.
    """


def check_config(kind: Kind, config: str | Path, overrides: Sequence[str] = ()) -> Any:
    """Load and validate a trainer config in-process; any problem becomes FlowInputError naming file and key."""
    from atelier_studio.pipeline.config import ConfigError, load_config

    path = Path(config)
    if not path.is_file():
        raise FlowInputError(f"{kind} config {path} does not exist (cwd {Path.cwd()})")
    if kind == "designer":
        from atelier_studio.designer.config import DesignerConfig as Cls
    elif kind == "imagegen":
        from atelier_studio.imagegen.config import ImagegenConfig as Cls
    else:
        raise FlowInputError(f"unknown trainer kind {kind!r}; expected 'designer' or 'imagegen'")
    try:
        return load_config(Cls, path, list(overrides))
    except (ConfigError, ValueError) as e:
        raise FlowInputError(f"{path}: {e}") from None


def require_path(path: str | Path, what: str, hint: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise FlowInputError(f"{what} {p} does not exist ({hint})")
    return p


def train_argv(kind: Kind, config: str | Path, overrides: Sequence[str]) -> list[str]:
    argv = [kind, "train", "--config", str(config)]
    for o in overrides:
        argv += ["--set", o]
    return argv


@task(name="train", retries=1, retry_delay_seconds=2)
def train_task(kind: Kind, config: str, overrides: list[str], nproc: int) -> dict[str, Any]:
    """One trainer run (`atelier <kind> train`); returns the launcher's summary (last step line, tail)."""
    _, summary = run_trainer(train_argv(kind, config, overrides), nproc=nproc,
                             progress_key=artifact_key(kind, "progress"), samples_key=artifact_key(kind, "samples"))
    return {"last_step": summary["last_step"], "lines": summary["lines"]}


@task(name="publish-artifacts")
def publish_task(run_dir: str, name: str) -> list[str]:
    """Metrics table, throughput/MFU summary and sample grid of a finished run as Prefect artifacts."""
    return publish_training(Path(run_dir), name)


def training_flow_main(flow_fn: Callable[[str, list[str], int], str], kind: Kind, argv: Sequence[str] | None) -> int:
    """`python -m atelier_studio.flows.train_<kind> --config ... --set ... --nproc N`: runs the flow against the running
    server."""
    name = f"atelier_studio.flows.train_{kind}"
    p = argparse.ArgumentParser(prog=f"python -m {name}", description=f"run the train-{kind} flow")
    p.add_argument("--config", default=f"configs/{kind}/demo.toml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nproc", type=int, default=1)
    args = p.parse_args(argv)
    from atelier_studio.flows.local_server import require_server

    require_server(f"python -m {name}")
    print(flow_fn(args.config, args.set, args.nproc))
    return 0
