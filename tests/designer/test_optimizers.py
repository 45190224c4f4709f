"""Every `train.optimizer` on the tiny designer (full fine-tuning: embeddings, hidden matrices, norms, the head)
through the CLI: it trains, and a run resumed from its middle checkpoint repeats the uninterrupted run's losses.

The engine's own resume test for each optimizer is tests/pipeline/test_optimizers.py (a toy model, one and two
processes); this one checks each optimizer on the model's real parameter groups (Muon's hidden matrices beside
AdamW's embeddings and head, Adafactor's factored matrices, the low-bit states)."""

from __future__ import annotations

import math
import shutil

import pytest

from atelier_studio.flows.cli import main

from tests.designer.test_train import train_args, train_losses
from tests.pipeline.test_optimizers import OPTIMIZERS, SETTINGS


def cut_at_middle_checkpoint(full, cut) -> None:
    """`cut` = `full` as a kill -9 after its last step but before its final save would leave it: the step-2
    checkpoint, every metrics line, no exports."""
    shutil.copytree(full, cut)
    for p in ("checkpoints/step-4", "model", "adapter", "summary.json"):
        shutil.rmtree(cut / p, ignore_errors=True) if (cut / p).is_dir() else (cut / p).unlink(missing_ok=True)


@pytest.mark.parametrize("optimizer", [o for o in OPTIMIZERS if o != "adamw"])  # AdamW: test_train.py's kill test
def test_each_optimizer_trains_the_designer_and_resumes_exactly(world, tmp_path, optimizer):
    keys = {"max_steps": 4, "save_every": 2, "eval_every": 0, "lr": 1e-3, "optimizer": optimizer,
            **SETTINGS.get(optimizer, {})}
    args = [x for k, v in keys.items() for x in ("--set", f"train.{k}={v}")] + ["--set", "lora.rank=0"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(train_args(world, full, *args)) == 0
    losses = train_losses(full)
    assert [s for s, _ in losses] == list(range(1, 5)) and all(math.isfinite(l) for _, l in losses)
    assert len({l for _, l in losses}) > 1  # the weights moved
    cut_at_middle_checkpoint(full, cut)
    assert main(train_args(world, cut, *args)) == 0
    assert train_losses(cut) == losses
    assert (cut / "model" / "config.json").is_file()
