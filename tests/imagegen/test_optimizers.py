"""Every `train.optimizer` on the tiny MMDiT (full fine-tuning) through the CLI: it trains, and a run resumed from
its middle checkpoint repeats the uninterrupted run's losses (tests/designer/test_optimizers.py does the designer;
tests/pipeline/test_optimizers.py the engine on one and two processes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from atelier_studio.flows.cli import main

from tests.designer.test_optimizers import cut_at_middle_checkpoint
from tests.imagegen._world import build_world, cli_args
from tests.imagegen.test_task import train_losses
from tests.pipeline.test_optimizers import OPTIMIZERS, SETTINGS


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.getbasetemp() / "imagegen-world")


@pytest.mark.parametrize("optimizer", [o for o in OPTIMIZERS if o != "adamw"])  # AdamW: test_task.py's kill test
def test_each_optimizer_trains_imagegen_and_resumes_exactly(world, tmp_path, optimizer):
    keys = {"max_steps": 4, "save_every": 2, "eval_every": 0, "lr": 1e-3, "log_every": 1, "warmup_steps": 1,
            "optimizer": optimizer, **SETTINGS.get(optimizer, {})}
    args = [f"train.{k}={v}" for k, v in keys.items()] + ["sample.every=0"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(cli_args(world, full, *args)) == 0
    losses = train_losses(full)
    assert [s for s, _ in losses] == list(range(1, 5)) and all(math.isfinite(l) for _, l in losses)
    assert len({l for _, l in losses}) > 1
    cut_at_middle_checkpoint(full, cut)
    assert main(cli_args(world, cut, *args)) == 0
    assert train_losses(cut) == losses
