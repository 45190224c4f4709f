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
# The global concurrency limit with one slot per GPU (`atelier deploy --gpus N`, or `prefect gcl create gpu --limit N`):
# a trainer holds `nproc` slots while it runs, so runs never share a GPU; without the limit runs are not limited
GPU_LIMIT = "gpu"


def gpu_slots(n: int):
    """Hold n slots of the `gpu` limit (waiting for them) inside a Prefect run; a no-op outside one."""
    import contextlib

    from atelier_studio.flows.report import in_prefect_run

    if not in_prefect_run():
        return contextlib.nullcontext()
    from prefect.concurrency.sync import concurrency

    return concurrency(GPU_LIMIT, occupy=n)


class FlowInputError(DataError):
    """A flow parameter that cannot be used (missing file, bad config, bad line); the message names it.

    A DataError (a ValueError), so `atelier eval` reports it as one line and exits 2 like any input error.
    """


def config_class(kind: Kind) -> type:
    """The trainer's typed config class."""
    if kind == "designer":
        from atelier_studio.designer.config import DesignerConfig as Cls
    elif kind == "imagegen":
        from atelier_studio.imagegen.config import ImagegenConfig as Cls
    else:
        raise FlowInputError(f"unknown trainer kind {kind!r}; expected 'designer' or 'imagegen'")
    return Cls


def resolve(kind: Kind, config: str | Path) -> Path:
    """A config argument as a file: a path, or a shipped config's name (flows/shipped.py)."""
    from atelier_studio.flows.shipped import resolve_config
    from atelier_studio.pipeline.config import ConfigError

    try:
        return resolve_config(config, kind)
    except ConfigError as e:
        raise FlowInputError(f"{kind} {e}") from None


def check_config(kind: Kind, config: str | Path, overrides: Sequence[str] = ()) -> Any:
    """Load and validate a trainer config in-process; any problem becomes FlowInputError naming file and key."""
    from atelier_studio.pipeline.config import ConfigError, load_config

    path = resolve(kind, config)
    try:
        return load_config(config_class(kind), path, list(overrides))
    except (ConfigError, ValueError) as e:
        raise FlowInputError(f"{path}: {e}") from None


def prepare_run(kind: Kind, config: str | Path, params: Any,
                overrides: Sequence[str] | None) -> tuple[Path, list[str], Any]:
    """(config file, override items, checked config) of a training flow's parameters: the keys `params` sets, then
    `overrides`, on top of the TOML file; under Prefect the `train-<kind>-output` artifact states where it writes."""
    from atelier_studio.flows.params import to_overrides

    path = resolve(kind, config)
    items = to_overrides(params) + list(overrides or [])
    cfg = check_config(kind, path, items)
    if not Path(cfg.output.dir).is_absolute() and in_throwaway_dir():
        raise FlowInputError(f"output.dir {cfg.output.dir} is relative, and this flow run's working directory "
                             f"{Path.cwd()} is the process worker's temporary one, deleted when the run ends: set the "
                             f"work pool's working_dir job variable (docs/deploy.md), or an absolute output.dir")
    publish_output(kind, path, items, cfg.output.dir)
    return path, items, cfg


OUTPUT_LINE = "output folder: "


def in_throwaway_dir() -> bool:
    """True in the temporary directory a Prefect process worker runs a flow run in when its pool sets no working_dir
    (tempfile.TemporaryDirectory(suffix="prefect"), removed with everything in it when the run ends)."""
    import tempfile

    cwd = Path.cwd()
    return cwd.parent == Path(tempfile.gettempdir()).resolve() and cwd.name.startswith("tmp") and \
        cwd.name.endswith("prefect")


def publish_output(kind: Kind, path: Path, items: Sequence[str], output_dir: str) -> None:
    """A markdown artifact naming the run's output folder, absolute, and the working directory relative paths in the
    config are resolved against (a worker's, not the machine that started the run); `atelier runs` reads it."""
    from atelier_studio.flows.report import in_prefect_run

    if not in_prefect_run():
        return
    from prefect.artifacts import create_markdown_artifact

    sets = "".join(f"\n    --set {i}" for i in items) or " (none)"
    create_markdown_artifact(
        key=artifact_key(kind, "output"),
        markdown=f"{OUTPUT_LINE}{Path(output_dir).resolve()}\n\nconfig: {path.resolve()}\n\noverrides:{sets}\n\n"
                 f"Relative paths in the config (model.path, data.*, output.dir) are resolved against the flow run's "
                 f"working directory, {Path.cwd()}.",
        description=f"train-{kind}: where this run writes")


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
    with gpu_slots(nproc):
        _, summary = run_trainer(train_argv(kind, config, overrides), nproc=nproc,
                                 progress_key=artifact_key(kind, "progress"), samples_key=artifact_key(kind, "samples"))
    return {"last_step": summary["last_step"], "lines": summary["lines"]}


@task(name="publish-artifacts")
def publish_task(run_dir: str, name: str) -> list[str]:
    """Metrics table, throughput/MFU summary and sample grid of a finished run as Prefect artifacts."""
    return publish_training(Path(run_dir), name)


def training_flow_main(flow_fn: Callable[..., str], kind: Kind, argv: Sequence[str] | None) -> int:
    """`python -m atelier_studio.flows.train_<kind> --config ... --set ... --nproc N`: runs the flow against the running
    server."""
    name = f"atelier_studio.flows.train_{kind}"
    p = argparse.ArgumentParser(prog=f"python -m {name}", description=f"run the train-{kind} flow")
    p.add_argument("--config", default=f"{kind}/demo", help="a TOML file or a shipped config's name")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nproc", type=int, default=1)
    args = p.parse_args(argv)
    from atelier_studio.flows.local_server import require_server

    require_server(f"python -m {name}")
    print(flow_fn(args.config, overrides=args.set, nproc=args.nproc))
    return 0
