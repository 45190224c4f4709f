"""Flow `train-designer`: fine-tune the designer LM by running `atelier designer train` under Prefect.

    python -m atelier_studio.flows.train_designer --config designer/demo [--set train.max_steps=50]
        [--nproc 2]
    prefect deployment run train-designer/default -p config=designer/demo --watch --watch-timeout 1800

Steps: check the config and the model path (flows/training.py) → the `train` task runs the trainer as a
subprocess, retried once (it resumes from its newest checkpoint) → artifacts: metrics table and the
throughput/MFU summary. Returns the run's output directory: flows pass paths, never tensors.
"""

from __future__ import annotations

import sys
from typing import Sequence

from prefect import flow

from atelier_studio.designer.config import DesignerConfig
from atelier_studio.flows.launch import kill_trainers_hook
from atelier_studio.flows.params import params_model
from atelier_studio.flows.training import prepare_run, publish_task, require_path, train_task, training_flow_main

# the UI's form: every section and key of the config, typed, with its default and help (flows/params.py)
DesignerParams = params_model(DesignerConfig, "DesignerParams")


@flow(name="train-designer", on_cancellation=[kill_trainers_hook], on_crashed=[kill_trainers_hook])
def train_designer(config: str = "designer/demo", params: DesignerParams | None = None,
                   overrides: list[str] | None = None, nproc: int = 1) -> str:
    """Train the designer from `config` (+ `--set` style overrides) on nproc local processes; returns output.dir."""
    path, overrides, cfg = prepare_run("designer", config, params, overrides)
    config = str(path)
    require_path(cfg.model.path, f"{config}: model.path", "create it with `atelier designer init`, or run `make demo`")
    train_task("designer", str(config), overrides, nproc)
    publish_task(cfg.output.dir, "train-designer")
    return cfg.output.dir


def main(argv: Sequence[str] | None = None) -> int:
    return training_flow_main(train_designer, "designer", argv)


if __name__ == "__main__":
    sys.exit(main())
