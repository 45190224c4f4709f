"""The one training loop, shared by the designer and imagegen trainers.

Per optimizer step (`train_step`): draw `grad_accum` micro-batches, sum their loss weights on the host,
backpropagate each micro-batch's loss sum divided by that total (so the step's loss is the mean over every loss
unit of the accumulated batch), clip the global gradient norm, set the learning rate from the schedule, step the
optimizer (`[train] optimizer`, pipeline/optimizers.py; schedule-free's averaged weights are swapped in around
evaluation, samples and the export).
Around it (`fit`): logging (`log_step`; pipeline/progress.py's RunLog: progress bar, metrics.jsonl and the trackers
of output.trackers, pipeline/trackers.py; with what the task's data skipped so far, pipeline/task.py's Skipped),
validation samples, evaluation (with the task's sample table, pipeline/task.py's SampleTable), checkpoints
on a cadence and on SIGTERM/SIGINT, and exact resume (model, optimizer, schedule position, RNG, data cursor;
pipeline/checkpointer.py's Checkpointer does the saving and restoring; each checkpoint also keeps the trackers'
run ids, so a resumed run continues the same W&B and MLflow runs).

The step itself reads nothing back from the device; the host syncs only where a value is logged (`log_step`).

Under torchrun (a `DistContext` with `enabled`, pipeline/distributed.py) the same loop runs on every rank
over its own slice of each global micro-batch: the loss weights are summed over ranks (so the mean is over
the GLOBAL accumulated batch — one small all-reduce per step), FSDP2 reduce-scatters gradients only on the
last micro-batch of a step, the gradient norm is taken over the sharded (DTensor) gradients, checkpoints are
sharded (torch.distributed.checkpoint, optionally async), and logging, metrics and exports happen on rank 0
only, exports from the consolidated weights. A stop signal on any rank stops every rank after the same step.
"""

from __future__ import annotations

import math
import signal
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from atelier_studio.pipeline.atomic import ensure_dir
from atelier_studio.pipeline.checkpointer import Checkpointer, seed_everything
from atelier_studio.pipeline.config import OutputConfig, TrainConfig, config_to_dict, flatten
from atelier_studio.pipeline.distributed import (
    DistContext,
    all_reduce_sum,
    barrier,
    consolidated,
    is_sharded,
    set_gradient_sync,
)
from atelier_studio.pipeline.errors import AtelierError
from atelier_studio.pipeline.mfu import ThroughputMeter, device_peak_flops
from atelier_studio.pipeline.optimizers import Optimizers, build_optimizers
from atelier_studio.pipeline.policies import cpu_offload
from atelier_studio.pipeline.progress import RunLog, announce_fallback, fallbacks, log
from atelier_studio.pipeline.task import Skipped, Task
from atelier_studio.pipeline.trackers import RunInfo, Trackers, git_commit, open_trackers, system_info


class TrainingError(AtelierError, RuntimeError):
    """The run cannot continue (non-finite loss, unusable checkpoint); nothing good is overwritten."""


@dataclass
class TrainResult:
    step: int
    interrupted: bool  # stopped by SIGTERM/SIGINT after saving a checkpoint
    final_loss: float | None
    exports: dict[str, Path] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    signal: int | None = None


@dataclass
class StepResult:
    """One optimizer step, as `log_step` reads it: the loss and gradient norm stay on the device until a logged
    step reads them."""

    lr: float
    weight: int  # loss units of the step's accumulated batch (over every rank)
    loss: torch.Tensor  # this rank's share of the step's mean loss (fp32 scalar)
    grad_norm: torch.Tensor
    units: int  # throughput units and model FLOPs of this rank's micro-batches
    flops: int


@dataclass
class _Run:
    """What one `fit` carries from step to step."""

    report: RunLog
    meter: ThroughputMeter
    saved_step: int = -1  # the step of the last checkpoint (the resumed one's, if any)
    evaluated_step: int = -1
    last_loss: float | None = None  # of the last logged step
    reported_skips: dict[str, dict[str, int]] = field(default_factory=dict)  # what report.skipped last wrote


@dataclass(frozen=True)
class _Sections:
    """The sections a Trainer is given, as the trackers' params when the caller passes none."""

    train: TrainConfig
    output: OutputConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based): linear warmup, then the decay."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(cfg.max_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    if cfg.schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


class Trainer:
    def __init__(self, task: Task, train: TrainConfig, output: OutputConfig, device: torch.device,
                 dist: DistContext | None = None, params: dict[str, Any] | None = None):
        """`params`: the run's resolved config, flat ("train.lr": ...), which the trackers record (the CLI passes the
        whole config; default: the train and output sections)."""
        self.task = task
        self.dist = dist if dist is not None else DistContext(device=device)
        self.cfg = train
        self.out = Path(output.dir)
        self.output_cfg = output
        self.device = device
        self.ckpt_dir = self.out / "checkpoints"
        self.params = params if params is not None else flatten(config_to_dict(_Sections(train, output)))
        self.named_params = [(n, p) for n, p in task.model.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise TrainingError("the model has no trainable parameters")
        self.optimizer = self._build_optimizer()
        self.checkpoints = Checkpointer(self.ckpt_dir, train, task, self.optimizer, self.named_params, self.dist,
                                        device)
        self.step = 0
        self._stop_signal: int | None = None
        self._resume_done = False  # resume() ran (it restores a checkpoint once)
        self._resumed_from: Path | None = None

    # ------------------------------------------------------------------ setup

    def _build_optimizer(self) -> Optimizers:
        return build_optimizers(self.named_params, self.cfg, self.device, self.task.outer_layers,
                                sharded=is_sharded(self.task.model))

    def _set_hyperparameters(self) -> None:
        """This run's hyper-parameters (weight decay, betas, eps, the optimizer's own) on the optimizer's groups: a
        checkpoint's load restores the saved ones, and a resume that changed them (with a warning,
        pipeline/config_diff.py) must train with the new."""
        self.optimizer.reapply_hyperparameters()

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> Path:
        return self.checkpoints.save(self.step)

    def load(self, path: Path) -> None:
        self.step = self.checkpoints.load(path)
        self._set_hyperparameters()

    def resume(self) -> Path | None:
        """Restore the checkpoint `train.resume` names, if any (once; fit() calls it when it has not been called):
        the CLI calls it first, to write the run's config only once the checkpoint has loaded. Returns its path."""
        if not self._resume_done:
            self._resumed_from = self.checkpoints.resume_path()
            if self._resumed_from is not None:
                self.load(self._resumed_from)
                log(f"resumed from {self._resumed_from} at step {self.step}")
            self._resume_done = True
        return self._resumed_from

    # ------------------------------------------------------------------ signals

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._stop_signal is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum
        log(f"received {signal.Signals(signum).name}: finishing this step, then saving a checkpoint")

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainResult:
        """Resume, then per optimizer step: `train_step`, `log_step` on the log cadence, the cadences (validation
        samples, evaluation, checkpoint); until max_steps or a stop signal. Then `_finish` (the last checkpoint, and
        unless stopped the final evaluation and the export) and the run's summary."""
        cfg = self.cfg
        ensure_dir(self.out, "output.dir")
        if self.device.type != "cuda":
            announce_fallback("kernels", f"kernels: no GPU ({self.device}): attention, the fused kernels and the delta "
                                         f"rule run their plain-PyTorch references (exact, slow: for tests and small "
                                         f"models)")
        resume = self.resume()
        trackers = self._open_trackers(resumed=resume is not None)
        run = _Run(RunLog(self.out, trackers, cfg.max_steps, self.step, self.task.unit, main=self.dist.is_main),
                   ThroughputMeter(device_peak_flops(self.device, cfg.peak_tflops)),
                   saved_step=self.step if resume is not None else -1)
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self.task.model.train()
        batches = self.task.train_batches()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        interrupted, summary = True, None
        try:
            while self.step < cfg.max_steps and not self._should_stop():
                result = self.train_step(batches)
                run.meter.add(result.units, result.flops)
                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                    self.log_step(result, run)
                self._samples_on_cadence(run)
                self._evaluate_on_cadence(run)
                self._save_on_cadence(run)
            interrupted = self._stop_signal is not None
            final_skips, exports = self._finish(run, interrupted)
            summary = self._summary(run, final_skips)
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            # the trackers' runs end as finished, or (stopped, or an error on the way out) as interrupted
            run.report.close({"step": self.step, "final_loss": run.last_loss, **(summary or {})}, interrupted)
        return TrainResult(step=self.step, interrupted=interrupted, final_loss=run.last_loss, exports=exports,
                           summary=summary, signal=self._stop_signal)

    def _open_trackers(self, resumed: bool) -> Trackers:
        """Rank 0 starts the trackers of output.trackers (a resumed run continues the runs its checkpoint names);
        every checkpoint from now on keeps their ids. Other ranks report nothing."""
        if not self.dist.is_main:
            return Trackers([])
        out = self.output_cfg
        info = RunInfo(out_dir=self.out, name=out.run_name or self.out.resolve().name, group=out.group,
                       project=out.project, params=self.params, git_commit=git_commit(),
                       system=system_info(self.dist.world_size), resume_step=self.step if resumed else 0)
        trackers = open_trackers(out.active_trackers(), info, self.checkpoints.loaded_trackers if resumed else {})
        self.checkpoints.tracker_state = trackers.state
        return trackers

    def train_step(self, batches: Iterator[Any]) -> StepResult:
        """One optimizer step: draw its micro-batches, backpropagate each one's loss sum over the step's total loss
        weight, clip, step the optimizer at the schedule's learning rate. Reads nothing back from the device."""
        cfg = self.cfg
        lr = cfg.lr * lr_factor(self.step, cfg)
        self.optimizer.set_lr(lr)
        micro = [next(batches) for _ in range(cfg.grad_accum * self.task.pieces_per_micro_batch)]
        weight = sum(self.task.batch_weight(b) for b in micro)
        if self.dist.enabled:  # the mean is over the GLOBAL accumulated batch
            weight = int(all_reduce_sum(self.dist, [weight])[0])
        loss_total = torch.zeros((), device=self.device, dtype=torch.float32)
        if weight > 0:
            for i, b in enumerate(micro):
                set_gradient_sync(self.task.model, i == len(micro) - 1)  # one reduce-scatter per step
                with cpu_offload(enabled=cfg.distributed.cpu_offload):  # forward AND backward inside
                    loss = self.task.loss_sum(b) / weight
                    loss.backward()
                loss_total += loss.detach()
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = self._clip([p for _, p in self.named_params], max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.task.after_optimizer_step(self.step)
        return StepResult(lr=lr, weight=weight, loss=loss_total, grad_norm=grad_norm,
                          units=sum(self.task.batch_units(b) for b in micro),
                          flops=sum(self.task.batch_flops(b) for b in micro))

    def log_step(self, result: StepResult, run: _Run) -> None:
        """The logged record of the step just taken: the step's one host sync (its loss, summed over ranks), which
        stops the run if it is not finite, then the rates, peak memory and what the data skipped so far."""
        if self.dist.enabled:  # each rank holds its share of the global mean
            run.last_loss = all_reduce_sum(self.dist, [result.loss.item()])[0]
        else:
            run.last_loss = result.loss.item()  # the host sync of this step
        if not math.isfinite(run.last_loss):
            raise TrainingError(
                f"loss is {run.last_loss} at step {self.step}; stopping without saving over the last good "
                f"checkpoint (lower train.lr, check the data)"
            )
        rate = run.meter.measure()
        record = {"kind": "train", "step": self.step, "loss": run.last_loss, "lr": result.lr,
                  "grad_norm": float(result.grad_norm), "loss_weight": result.weight}
        if rate is not None:
            record.update({f"{self.task.unit}_per_s": rate.units_per_s, "step_time": rate.step_time,
                           "tflops": rate.flops_per_s / 1e12, "mfu": rate.mfu})
        if self.device.type == "cuda":
            record["peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        record.update(self.task.step_metrics())
        skips = self.task.skipped()
        if skips is not None:
            record["skipped"] = skips.total
        run.report.train(record)
        if skips is not None and skips.by_source != run.reported_skips:  # which shards, when it changes
            run.report.skipped(self.step, skips)
            run.reported_skips = skips.by_source

    # ------------------------------------------------------------------ cadences (each restarts the throughput clock:
    # its time is not training time)

    def _samples_on_cadence(self, run: _Run) -> None:
        """Validation images, when the task renders some at this step: every tracker, and a line the flows pick up."""
        with self.optimizer.eval_weights() if self.task.samples_due(self.step) else nullcontext():
            rendered = self.task.samples(self.step)
        if rendered is not None:
            run.report.samples(self.step, self.cfg.max_steps, rendered)
            run.meter.restart_clock()

    def _evaluate_on_cadence(self, run: _Run) -> None:
        if self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
            self._evaluate(run)
            run.meter.restart_clock()

    def _save_on_cadence(self, run: _Run) -> None:
        if self.cfg.save_every and self.step % self.cfg.save_every == 0:
            self._save(run)
            run.meter.restart_clock()

    # ------------------------------------------------------------------ the finish

    def _finish(self, run: _Run, interrupted: bool) -> tuple[Skipped | None, dict[str, Path]]:
        """After the last step: a checkpoint of it (unless the cadence just saved one) and the wait for a background
        save; unless stopped by a signal, the final evaluation and the export. Returns what the data skipped and the
        exports."""
        final_skips = self.task.skipped()  # every rank: a task may gather its counts
        if run.saved_step != self.step:
            self._save(run)
        self.checkpoints.finish_pending()
        exports: dict[str, Path] = {}
        if not interrupted:
            if run.evaluated_step != self.step:
                self._evaluate(run)
            exports = self._export()
            for name, p in exports.items():
                run.report.message(f"exported {name}: {p}")
        return final_skips, exports

    def _summary(self, run: _Run, final_skips: Skipped | None) -> dict[str, Any]:
        summary = run.meter.summary()
        if final_skips is not None:
            summary["skipped"] = final_skips.as_dict()
        if self.device.type == "cuda":
            summary["peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if fallbacks():
            summary["fallbacks"] = fallbacks()
        return summary

    def _should_stop(self) -> bool:
        """A signal on any rank stops every rank after the same step (or ranks would wait on each other)."""
        if self.dist.enabled:
            stop = all_reduce_sum(self.dist, [1.0 if self._stop_signal is not None else 0.0])[0]
            if stop and self._stop_signal is None:
                self._stop_signal = signal.SIGTERM
        return self._stop_signal is not None

    def _clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        foreach = self.device.type == "cuda"
        if not is_sharded(self.task.model):
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=foreach)
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=foreach)
        if isinstance(norm, DTensor):  # partial norms of the shards → the global norm, on every rank
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=foreach)
        return norm

    def _export(self) -> dict[str, Path]:
        """The task's export from rank 0, of the consolidated weights: equal to a one-process export. A task whose
        export reads only its trainable weights (`export_reads_frozen` False: a LoRA adapter) gets only those."""
        exports: dict[str, Path] = {}
        trainable_only = not self.task.export_reads_frozen
        with self.optimizer.eval_weights(), consolidated(self.task.model, self.dist, trainable_only=trainable_only):
            if self.dist.is_main:
                exports = self.task.export(self.out)
        barrier(self.dist)
        return exports

    def _evaluate(self, run: _Run) -> None:
        model = self.task.model
        model.eval()
        with torch.no_grad(), self.optimizer.eval_weights():
            result = self.task.evaluate()
            table = self.task.sample_table(self.step)
        model.train()
        run.report.eval(self.step, result)
        if table is not None:
            run.report.table(self.step, self.cfg.max_steps, table)
        run.evaluated_step = self.step

    def _save(self, run: _Run) -> None:
        path = self.save()
        run.saved_step = self.step
        run.report.message(f"saved {path}")


def exit_code(result: TrainResult) -> int:
    """Shell status for a CLI run: 0 when finished, 128 + signal when stopped by one (after saving)."""
    return 0 if result.signal is None else 128 + result.signal


__all__ = ["Trainer", "TrainResult", "TrainingError", "seed_everything", "lr_factor", "exit_code"]
