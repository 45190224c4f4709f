"""The training loop: accumulation weighting, schedule, checkpoints, exact resume, signals."""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import atelier_studio.pipeline.checkpoint_files as ckpt_module
from atelier_studio.pipeline.atomic import is_temporary
from atelier_studio.pipeline.checkpoint_files import (
    Checkpoint,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from atelier_studio.pipeline.config import OutputConfig, TrainConfig
from atelier_studio.pipeline.errors import WriteError
from atelier_studio.pipeline.trainer import Trainer, TrainingError, lr_factor, seed_everything

from tests.kernels._compare import assert_within_rounding
from tests.pipeline.toy_task import ToyTask


def make(tmp_path, name="run", seed=0, **train):
    seed_everything(0)
    task = ToyTask(seed=0)  # same init and data in every run; `seed` only scrambles the global RNGs
    seed_everything(seed)
    cfg = TrainConfig(**{"max_steps": 12, "micro_batch": 1, "lr": 1e-2, "warmup_steps": 2, "save_every": 4,
                         "keep_checkpoints": 0, **train})
    return Trainer(task, cfg, OutputConfig(dir=str(tmp_path / name), tensorboard=False), torch.device("cpu")), task


def losses(tmp_path, name):
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] == "train"]


def test_accumulated_loss_is_token_weighted_mean(tmp_path):
    """Two micro-batches of 1 and 5 rows: the step's gradient is that of the mean over all 6 rows."""
    trainer, task = make(tmp_path, max_steps=1, grad_accum=2, warmup_steps=0, grad_clip=0.0)
    task.model[1].p = 0.0  # no dropout: compare gradients exactly
    loader = ToyTask(0).loader
    a, b = next(loader), next(loader)
    assert (a["x"].shape[0], b["x"].shape[0]) == (1, 5)
    x, y = torch.cat([a["x"], b["x"]]), torch.cat([a["y"], b["y"]])
    reference = copy.deepcopy(task.model)
    ((reference(x) - y) ** 2).mean().backward()
    seen = {}
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: (seen.update({i: p.grad.clone() for i, p in enumerate(task.model.parameters())})
                                      or step())
    trainer.fit()
    # the same gradient summed in another order (1 + 5 rows, weighted, vs the mean of 6): fp32 rounding over the
    # longest reduction (16 hidden units, then the 6 rows), at each gradient's scale; a wrong weighting of the
    # micro-batches (mean of the two means) is off by O(1)
    for i, p in enumerate(reference.parameters()):
        assert_within_rounding(seen[i], p.grad, f"parameter {i}'s gradient", torch.float32, 16 + 6)


def test_lr_schedule_shapes():
    cfg = TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(55, cfg) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-6)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    lin = TrainConfig(max_steps=100, warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert lr_factor(50, lin) == pytest.approx(0.5)
    const = TrainConfig(max_steps=100, warmup_steps=0, schedule="constant")
    assert lr_factor(99, const) == 1.0


class Killed(Exception):
    """Stands in for SIGKILL: the run dies between steps, without any chance to save."""


def test_resume_is_exact(tmp_path):
    make(tmp_path, "full", grad_accum=2)[0].fit()
    part, task = make(tmp_path, "part", grad_accum=2)
    task.after_optimizer_step = lambda step: (_ for _ in ()).throw(Killed()) if step == 10 else None
    with pytest.raises(Killed):
        part.fit()  # dies after step 9 was logged; the newest checkpoint is step 8
    assert losses(tmp_path, "part")[-1][0] == 9
    resumed, task = make(tmp_path, "part", seed=123, grad_accum=2)  # other RNG state: it must come from the ckpt
    result = resumed.fit()
    assert result.step == 12 and task.exported
    assert losses(tmp_path, "part") == losses(tmp_path, "full")  # bit-exact, and no duplicate steps


def test_checkpoint_files_and_pruning(tmp_path):
    trainer, _ = make(tmp_path, keep_checkpoints=2)
    trainer.fit()
    ckpts = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in ckpts] == ["step-8", "step-12"]
    ck = load_checkpoint(ckpts[-1])
    assert ck.step == 12 and "0.weight" in ck.model and ck.state["task"] == {"cursor": 12}
    assert not any(is_temporary(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir())


def _ckpt(step: int, value: float) -> Checkpoint:
    return Checkpoint(step=step, model={"w": torch.full((4,), value)}, optimizer={}, extra={}, state={"v": value})


def test_resaving_a_step_keeps_the_old_checkpoint_until_the_new_one_is_in(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, _ckpt(4, 1.0))
    real = ckpt_module.save_safetensors
    seen = []

    def check_old_is_whole(tensors, path, metadata=None):  # runs while the new step-4 is being written
        verify_checkpoint(root / "step-4")
        seen.append(load_checkpoint(root / "step-4").state["v"])
        real(tensors, path, metadata)

    monkeypatch.setattr(ckpt_module, "save_safetensors", check_old_is_whole)
    save_checkpoint(root, _ckpt(4, 2.0))
    assert seen == [1.0, 1.0, 1.0]  # the old one stayed loadable through every file of the new one
    assert load_checkpoint(root / "step-4").state["v"] == 2.0
    assert [p.name for p in root.iterdir()] == ["step-4"]


KILLED_MID_RESAVE = """
import os, sys
from pathlib import Path
import torch
from atelier_studio.pipeline import atomic
from atelier_studio.pipeline.checkpoint_files import Checkpoint, save_checkpoint
real = os.replace
def replace(src, dst):
    real(src, dst)
    if ".old-" in Path(dst).name:
        os._exit(9)  # SIGKILL's effect: no cleanup, right after the old step-4 was moved aside
atomic.os.replace = replace
save_checkpoint(Path(sys.argv[1]), Checkpoint(4, {"w": torch.full((4,), 2.0)}, {}, {}, {"v": 2.0}))
"""


def test_a_kill_mid_resave_leaves_a_loadable_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, _ckpt(4, 1.0))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    code = subprocess.run([sys.executable, "-c", KILLED_MID_RESAVE, str(root)], env=env, timeout=300).returncode
    assert code == 9 and not (root / "step-4").exists()  # killed between the two renames
    assert [p.name for p in list_checkpoints(root)] == ["step-4"]  # the old one, put back
    assert load_checkpoint(root / "step-4").state["v"] == 1.0
    save_checkpoint(root, _ckpt(8, 3.0))
    save_checkpoint(root, _ckpt(4, 2.0))  # a later save of that step clears what the killed one left
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-8"]
    assert load_checkpoint(root / "step-4").state["v"] == 2.0


def test_a_full_disk_during_a_save_leaves_no_temporary_and_the_older_checkpoints(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, _ckpt(4, 1.0))
    real = ckpt_module.save_safetensors

    def full_at_the_optimizer(tensors, path, metadata=None):
        if path.name == "optimizer.safetensors":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(tensors, path, metadata)

    monkeypatch.setattr(ckpt_module, "save_safetensors", full_at_the_optimizer)
    with pytest.raises(WriteError, match=r"checkpoint .*step-8: cannot write it \(at .*step-8/optimizer.safetensors\): "
                                         r"the write failed for lack of space"):
        save_checkpoint(root, _ckpt(8, 2.0))
    assert [p.name for p in root.iterdir()] == ["step-4"]
    assert load_checkpoint(root / "step-4").state["v"] == 1.0


def test_truncated_checkpoint_is_named_and_nothing_overwritten(tmp_path):
    trainer, _ = make(tmp_path, max_steps=8)
    trainer.fit()
    newest = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    f = newest / "optimizer.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="optimizer.safetensors: truncated"):
        verify_checkpoint(newest)
    again, _ = make(tmp_path, max_steps=12)
    with pytest.raises(CheckpointError, match=r"optimizer.safetensors: truncated.*Older checkpoints: .*step-4"):
        again.fit()
    assert f.read_bytes() == data[: len(data) // 2]  # left as found for inspection
    assert (newest.parent / "step-4").is_dir()


def test_resume_never_refuses_to_overwrite(tmp_path):
    make(tmp_path, max_steps=4)[0].fit()
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        make(tmp_path, max_steps=8, resume="never")[0].fit()


def test_sigterm_saves_and_stops(tmp_path):
    trainer, task = make(tmp_path, max_steps=50, save_every=0)
    orig = task.after_optimizer_step
    task.after_optimizer_step = lambda step: os.kill(os.getpid(), signal.SIGTERM) if step == 3 else orig(step)
    result = trainer.fit()
    assert result.interrupted and result.step == 3 and result.signal == signal.SIGTERM
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-3"]
    assert not task.exported
    assert signal.getsignal(signal.SIGTERM) is not trainer._on_signal  # handlers restored


def test_nan_loss_stops_without_saving(tmp_path):
    trainer, task = make(tmp_path, max_steps=10, save_every=2)
    orig = task.loss_sum
    task.loss_sum = lambda b: orig(b) * (float("nan") if task.loader.cursor > 5 else 1.0)
    with pytest.raises(TrainingError, match="loss is nan at step 6"):
        trainer.fit()
    names = [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert names == ["step-2", "step-4"]


def test_metrics_and_eval_records(tmp_path):
    trainer, _ = make(tmp_path, max_steps=6, eval_every=3, peak_tflops=1.0)
    result = trainer.fit()
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in train)
    assert result.exports["toy"].read_text() == "ok"


def test_validation_samples_go_to_tensorboard_and_the_progress_line(tmp_path, capsys):
    """A task's `samples` hook (imagegen's sample grid): every image it renders becomes a TensorBoard image at its step
    and a `samples step N/M: PATH` line, which flows/launch.py turns into a Prefect artifact."""
    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    from atelier_studio.flows.launch import parse_samples_line
    from atelier_studio.pipeline.task import Samples

    class SamplingTask(ToyTask):
        def samples(self, step: int) -> Samples | None:
            if step % 3:
                return None
            path = tmp_path / "run" / "samples" / f"step-{step}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((6, 10, 3), 20 * step, dtype=np.uint8)).save(path)
            return Samples(path, 2, "EMA")

    seed_everything(0)
    cfg = TrainConfig(max_steps=6, micro_batch=1, lr=1e-2, warmup_steps=0, save_every=0)
    Trainer(SamplingTask(0), cfg, OutputConfig(dir=str(tmp_path / "run"), tensorboard=True), torch.device("cpu")).fit()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("samples ")]
    assert lines == [f"samples step {s}/6: {tmp_path / 'run' / 'samples' / f'step-{s}.png'} (2 prompts, EMA weights)"
                     for s in (3, 6)]
    assert parse_samples_line(lines[1]) == {"step": 6, "total": 6, "path": str(tmp_path / "run" / "samples" /
                                                                                 "step-6.png"), "prompts": 2,
                                            "weights": "EMA"}
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={IMAGES: 0}).Reload()
    images = events.Images("samples")
    assert [im.step for im in images] == [3, 6] and (images[0].width, images[0].height) == (10, 6)
