"""Flow `train-imagegen`: train the MMDiT by running `atelier imagegen train` under Prefect.

    python -m atelier_studio.flows.train_imagegen --config imagegen/demo [--set train.max_steps=50]
        [--nproc 2]
    prefect deployment run train-imagegen/default -p config=imagegen/demo --watch --watch-timeout 1800

Steps: check the config and the model path → `cache` task, only when needed → `train` task (a subprocess,
retried once; it resumes from its newest checkpoint) → artifacts: metrics table, throughput/MFU summary and
the newest sample grid from output.dir/samples/. Returns the run's output directory.

The cache decision: frozen encoders run once, offline, so training reads latent shards at
`data.shards`. When `data.image_shards` is set and `data.shards` holds no `.tar` shard yet, the flow runs
`atelier imagegen cache --out <data.shards>` first (same config and overrides); when latents exist it never
re-encodes (delete the directory to rebuild). Without `data.image_shards` the trainer reads `data.shards`
as they are (the trainer encodes image shards at start, see imagegen/config.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

from prefect import flow, task

from atelier_studio.flows.launch import kill_trainers_hook, run_trainer
from atelier_studio.flows.params import params_model
from atelier_studio.flows.report import artifact_key
from atelier_studio.flows.training import (
    FlowInputError,
    gpu_slots,
    prepare_run,
    publish_task,
    require_path,
    train_task,
    training_flow_main,
)
from atelier_studio.imagegen.config import ImagegenConfig

# the UI's form: every section and key of the config, typed, with its default and help (flows/params.py)
ImagegenParams = params_model(ImagegenConfig, "ImagegenParams")


def needs_cache(cfg: Any) -> bool:
    """True when the config names image shards to cache and its latent directory has no shard yet."""
    if not cfg.data.image_shards:
        return False
    return not any(Path(cfg.data.shards).glob("**/*.tar"))


def cache_argv(config: str | Path, overrides: Sequence[str], out: str | Path) -> list[str]:
    argv = ["imagegen", "cache", "--config", str(config), "--out", str(out)]
    for o in overrides:
        argv += ["--set", o]
    return argv


@task(name="cache-latents", retries=1, retry_delay_seconds=2)
def cache_task(config: str, overrides: list[str], out: str) -> str:
    """Encode image shards into latent shards once (the autoencoder and text encoder never run in the step)."""
    with gpu_slots(1):  # the autoencoder and text encoder run on one GPU
        run_trainer(cache_argv(config, overrides, out), progress_key=artifact_key("imagegen", "cache"))
    return out


@flow(name="train-imagegen", on_cancellation=[kill_trainers_hook], on_crashed=[kill_trainers_hook])
def train_imagegen(config: str = "imagegen/demo", params: ImagegenParams | None = None,
                   overrides: list[str] | None = None, nproc: int = 1) -> str:
    """Train the MMDiT from `config` (+ overrides) on nproc local processes, caching latents first if missing."""
    path, overrides, cfg = prepare_run("imagegen", config, params, overrides)
    config = str(path)
    require_path(cfg.model.path, f"{config}: model.path", "create it with `atelier imagegen init`, or run `make demo`")
    if needs_cache(cfg):
        require_path(cfg.data.image_shards, f"{config}: data.image_shards",
                     "write them with `atelier data shards`, or run `make demo`")
        cache_task(str(config), overrides, cfg.data.shards)
    elif not Path(cfg.data.shards).exists():
        raise FlowInputError(f"{config}: data.shards {cfg.data.shards} does not exist and data.image_shards is not "
                             f"set, so there is nothing to cache it from")
    train_task("imagegen", str(config), overrides, nproc)
    publish_task(cfg.output.dir, "train-imagegen")
    return cfg.output.dir


def main(argv: Sequence[str] | None = None) -> int:
    return training_flow_main(train_imagegen, "imagegen", argv)


if __name__ == "__main__":
    sys.exit(main())
