"""The one training loop, shared by the designer and imagegen trainers.

Per optimizer step: draw `grad_accum` micro-batches, sum their loss weights on the host, backpropagate
each micro-batch's loss sum divided by that total (so the step's loss is the mean over every loss unit
of the accumulated batch), clip the global gradient norm, set the learning rate from the schedule,
step AdamW. Around it: logging (progress bar, metrics.jsonl, TensorBoard), evaluation, checkpoints on a
cadence and on SIGTERM/SIGINT, and exact resume (model, optimizer, schedule position, RNG, data cursor).

The step itself reads nothing back from the device; the host syncs only where a value is logged.

Under torchrun (a `DistContext` with `enabled`, pipeline/distributed.py) the same loop runs on every rank
over its own slice of each global micro-batch: the loss weights are summed over ranks (so the mean is over
the GLOBAL accumulated batch — one small all-reduce per step), FSDP2 reduce-scatters gradients only on the
last micro-batch of a step, the gradient norm is taken over the sharded (DTensor) gradients, checkpoints are
sharded (torch.distributed.checkpoint, optionally async), and logging, metrics and exports happen on rank 0
only, exports from the consolidated weights. A stop signal on any rank stops every rank after the same step.
"""

from __future__ import annotations

import math
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atelier_studio.pipeline.checkpoint import (
    Checkpoint,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    optimizer_state_from_tensors,
    optimizer_state_to_tensors,
    prune_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from atelier_studio.pipeline.checkpoint import PendingSave, is_sharded_checkpoint, load_sharded_checkpoint, save_sharded_checkpoint
from atelier_studio.pipeline.config import OutputConfig, TrainConfig
from atelier_studio.pipeline.distributed import (
    DistContext,
    all_reduce_sum,
    barrier,
    broadcast_object,
    consolidated,
    is_sharded,
    set_gradient_sync,
)
from atelier_studio.pipeline.atomic import ensure_dir
from atelier_studio.pipeline.errors import AtelierError
from atelier_studio.pipeline.mfu import ThroughputMeter, device_peak_flops
from atelier_studio.pipeline.policies import cpu_offload
from atelier_studio.pipeline.progress import MetricsLog, ProgressBar, TensorBoardLog, log
from atelier_studio.pipeline.task import Task


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


class _Silent:
    """Stands in for the progress bar and metric logs on ranks other than 0."""

    def write(self, record: dict[str, Any]) -> None: ...
    def update(self, step: int, record: dict[str, Any]) -> None: ...
    def message(self, text: str) -> None: ...
    def close(self) -> None: ...


class Trainer:
    def __init__(self, task: Task, train: TrainConfig, output: OutputConfig, device: torch.device,
                 dist: DistContext | None = None):
        self.task = task
        self.dist = dist if dist is not None else DistContext(device=device)
        self.cfg = train
        self.out = Path(output.dir)
        self.output_cfg = output
        self.device = device
        self.ckpt_dir = self.out / "checkpoints"
        self.named_params = [(n, p) for n, p in task.model.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise TrainingError("the model has no trainable parameters")
        self.param_names = {id(p): n for n, p in self.named_params}
        self.optimizer = self._build_optimizer()
        self.step = 0
        self._stop_signal: int | None = None
        self._pending: PendingSave | None = None

    # ------------------------------------------------------------------ setup

    def _build_optimizer(self) -> torch.optim.Optimizer:
        decay = [p for _, p in self.named_params if p.ndim >= 2]
        no_decay = [p for _, p in self.named_params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        fused = self.device.type == "cuda"
        return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=self.cfg.betas, eps=self.cfg.adam_eps, fused=fused)

    def _resume_path(self) -> Path | None:
        """The checkpoint to resume from; under torchrun rank 0 decides (and verifies) for every rank."""
        if not self.dist.enabled:
            return self._find_resume_path()
        try:
            found: Any = self._find_resume_path() if self.dist.is_main else None
        except TrainingError as e:
            found = e
        found = broadcast_object(self.dist, found)
        if isinstance(found, TrainingError):
            raise found
        return found

    def _find_resume_path(self) -> Path | None:
        resume = self.cfg.resume
        if resume == "never":
            if list_checkpoints(self.ckpt_dir):
                raise TrainingError(
                    f"{self.ckpt_dir} already holds checkpoints and train.resume = 'never': refusing to overwrite "
                    f"them. Use another output.dir, or train.resume=auto to continue."
                )
            return None
        if resume == "auto":
            found = list_checkpoints(self.ckpt_dir)
            if not found:
                return None
            newest = found[-1]
            try:
                verify_checkpoint(newest)
            except CheckpointError as e:
                older = ", ".join(str(p) for p in found[:-1]) or "none"
                raise TrainingError(
                    f"cannot resume from the newest checkpoint: {e}. Nothing was changed. Older checkpoints: {older}; "
                    f"pick one with --set train.resume=PATH."
                ) from None
            return newest
        return Path(resume)

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> Path:
        if self.dist.enabled:
            return self._save_sharded()
        opt_tensors, opt_meta = optimizer_state_to_tensors(self.optimizer, self.param_names)
        extra = {f"task.{k}": v for k, v in self.task.state_tensors().items()}
        extra["rng.torch"] = torch.get_rng_state()
        if self.device.type == "cuda":
            extra["rng.cuda"] = torch.cuda.get_rng_state(self.device)
        py_state = random.getstate()
        np_state = np.random.get_state()
        state = {
            "optimizer": opt_meta,
            "rng": {
                "python": [py_state[0], list(py_state[1]), py_state[2]],
                "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            },
            "task": self.task.state_meta(),
        }
        ckpt = Checkpoint(
            step=self.step,
            model={n: p.detach() for n, p in self.named_params},
            optimizer=opt_tensors,
            extra=extra,
            state=state,
        )
        path = save_checkpoint(self.ckpt_dir, ckpt)
        prune_checkpoints(self.ckpt_dir, self.cfg.keep_checkpoints)
        return path

    def load(self, path: Path) -> None:
        if is_sharded_checkpoint(path):
            return self._load_sharded(Path(path))
        if self.dist.enabled:
            raise CheckpointError(f"{path}: a single-process checkpoint cannot be resumed under torchrun; resume it "
                                  f"with one process, or start the multi-process run from its exported weights")
        ckpt = load_checkpoint(path)
        names = {n for n, _ in self.named_params}
        missing = sorted(names - set(ckpt.model))
        unexpected = sorted(set(ckpt.model) - names)
        if missing or unexpected:
            raise CheckpointError(
                f"{path}/model.safetensors does not match the model's trainable parameters "
                f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})"
            )
        with torch.no_grad():
            for n, p in self.named_params:
                src = ckpt.model[n]
                if src.shape != p.shape:
                    raise CheckpointError(f"{path}/model.safetensors: {n} has shape {tuple(src.shape)}, "
                                          f"the model expects {tuple(p.shape)}")
                p.copy_(src)
        optimizer_state_from_tensors(self.optimizer, self.param_names, ckpt.optimizer, ckpt.state["optimizer"])
        task_tensors = {k[len("task."):]: v for k, v in ckpt.extra.items() if k.startswith("task.")}
        self.task.load_state(task_tensors, ckpt.state["task"])
        torch.set_rng_state(ckpt.extra["rng.torch"])
        if self.device.type == "cuda" and "rng.cuda" in ckpt.extra:
            torch.cuda.set_rng_state(ckpt.extra["rng.cuda"], self.device)
        py = ckpt.state["rng"]["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        npy = ckpt.state["rng"]["numpy"]
        np.random.set_state((npy[0], np.asarray(npy[1], dtype=np.uint32), npy[2], npy[3], npy[4]))
        self.step = ckpt.step

    def _app_state(self) -> dict[str, Any]:
        """Trainable weights and optimizer state by parameter name (DTensors under FSDP), plus task tensors."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.task.model, self.optimizer,
                                            options=StateDictOptions(ignore_frozen_params=True))
        return {"model": model_sd, "optimizer": optim_sd, "task": dict(self.task.state_tensors())}

    def _rank_state(self) -> dict[str, Any]:
        py_state = random.getstate()
        np_state = np.random.get_state()
        out: dict[str, Any] = {
            "python": [py_state[0], list(py_state[1]), py_state[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "torch": torch.get_rng_state().tolist(),
        }
        if self.device.type == "cuda":
            out["cuda"] = torch.cuda.get_rng_state(self.device).tolist()
        return out

    def _set_rank_state(self, st: dict[str, Any]) -> None:
        py = st["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        npy = st["numpy"]
        np.random.set_state((npy[0], np.asarray(npy[1], dtype=np.uint32), npy[2], npy[3], npy[4]))
        torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
        if self.device.type == "cuda" and "cuda" in st:
            torch.cuda.set_rng_state(torch.tensor(st["cuda"], dtype=torch.uint8), self.device)

    def _save_sharded(self) -> Path:
        self.finish_pending_save()
        async_save = self.cfg.distributed.async_checkpoint
        self._pending = save_sharded_checkpoint(self.ckpt_dir, self.step, self._app_state(),
                                                {"task": self.task.state_meta()}, self._rank_state(), self.dist,
                                                async_save=async_save)
        if not async_save:
            self._after_save()
        return self._pending.final

    def finish_pending_save(self) -> None:
        """Finish (and rename into place) a checkpoint still being written in the background."""
        if self._pending is not None and self._pending.future is not None:
            self._pending.wait()
            self._after_save()
        self._pending = None

    def _after_save(self) -> None:
        if self.dist.is_main:
            prune_checkpoints(self.ckpt_dir, self.cfg.keep_checkpoints)
        barrier(self.dist)

    def _load_sharded(self, path: Path) -> None:
        """Resume from a sharded checkpoint written by any number of ranks (DCP re-shards on load)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        app = self._app_state()
        step, state, rank_state = load_sharded_checkpoint(path, app, self.dist.rank)
        try:
            set_state_dict(self.task.model, self.optimizer, model_state_dict=app["model"],
                           optim_state_dict=app["optimizer"],
                           # not strict: the frozen base is not in the checkpoint (DCP already raised on any
                           # trainable key missing from it)
                           options=StateDictOptions(ignore_frozen_params=True, strict=False))
        except Exception as e:
            raise CheckpointError(f"{path}: does not fit this model and optimizer: {e}") from e
        try:
            self.task.load_state(app["task"], state["task"])
        except ValueError as e:  # e.g. a data position saved with another global batch
            raise CheckpointError(f"{path}: {e}") from None
        if rank_state is not None:
            self._set_rank_state(rank_state)
        else:  # written by fewer ranks: a fresh, still deterministic stream for this rank
            seed_everything(self.cfg.seed + 1_000_003 * step + self.dist.rank)
        self.step = step

    # ------------------------------------------------------------------ signals

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._stop_signal is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum
        log(f"received {signal.Signals(signum).name}: finishing this step, then saving a checkpoint")

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainResult:
        cfg = self.cfg
        ensure_dir(self.out, "output.dir")
        resume = self._resume_path()
        if resume is not None:
            self.load(resume)
            log(f"resumed from {resume} at step {self.step}")
        main = self.dist.is_main
        metrics: Any = MetricsLog(self.out / "metrics.jsonl", resume_step=self.step) if main else _Silent()
        tb: Any = TensorBoardLog(self.out / "tensorboard", self.output_cfg.tensorboard) if main else _Silent()
        meter = ThroughputMeter(device_peak_flops(self.device, cfg.peak_tflops))
        bar: Any = ProgressBar(cfg.max_steps, self.step, self.task.unit) if main else _Silent()
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        model = self.task.model
        model.train()
        batches = self.task.train_batches()
        per_step = cfg.grad_accum * getattr(self.task, "pieces_per_micro_batch", 1)  # items drawn per step
        params = [p for _, p in self.named_params]
        last_loss: float | None = None
        saved_step = self.step if resume is not None else -1
        evaluated_step = -1
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            while self.step < cfg.max_steps and not self._should_stop():
                lr = cfg.lr * lr_factor(self.step, cfg)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                micro = [next(batches) for _ in range(per_step)]
                weight = sum(self.task.batch_weight(b) for b in micro)
                if self.dist.enabled:  # the mean is over the GLOBAL accumulated batch
                    weight = int(all_reduce_sum(self.dist, [weight])[0])
                loss_total = torch.zeros((), device=self.device, dtype=torch.float32)
                if weight > 0:
                    for i, b in enumerate(micro):
                        set_gradient_sync(model, i == len(micro) - 1)  # one reduce-scatter per step
                        with cpu_offload(enabled=cfg.distributed.cpu_offload):  # forward AND backward inside
                            loss = self.task.loss_sum(b) / weight
                            loss.backward()
                        loss_total += loss.detach()
                max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
                grad_norm = self._clip(params, max_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                self.task.after_optimizer_step(self.step)
                meter.add(sum(self.task.batch_units(b) for b in micro), sum(self.task.batch_flops(b) for b in micro))

                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                    if self.dist.enabled:  # each rank holds its share of the global mean
                        last_loss = all_reduce_sum(self.dist, [loss_total.item()])[0]
                    else:
                        last_loss = loss_total.item()  # the host sync of this step
                    if not math.isfinite(last_loss):
                        raise TrainingError(
                            f"loss is {last_loss} at step {self.step}; stopping without saving over the last good "
                            f"checkpoint (lower train.lr, check the data)"
                        )
                    rate = meter.measure()
                    record = {"kind": "train", "step": self.step, "loss": last_loss, "lr": lr,
                              "grad_norm": float(grad_norm), "loss_weight": weight}
                    if rate is not None:
                        record.update({f"{self.task.unit}_per_s": rate.units_per_s, "step_time": rate.step_time,
                                       "tflops": rate.flops_per_s / 1e12, "mfu": rate.mfu})
                    if self.device.type == "cuda":
                        record["peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                    metrics.write(record)
                    tb.write(record)
                    bar.update(self.step, record)

                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    self._evaluate(metrics, tb, bar)
                    evaluated_step = self.step
                    meter.restart_clock()
                if cfg.save_every and self.step % cfg.save_every == 0:
                    path = self.save()
                    saved_step = self.step
                    bar.message(f"saved {path}")
                    meter.restart_clock()

            interrupted = self._stop_signal is not None
            if saved_step != self.step:
                path = self.save()
                bar.message(f"saved {path}")
            self.finish_pending_save()
            exports: dict[str, Path] = {}
            if not interrupted:
                if evaluated_step != self.step:
                    self._evaluate(metrics, tb, bar)
                exports = self._export()
                for name, p in exports.items():
                    bar.message(f"exported {name}: {p}")
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            bar.close()
            metrics.close()
            tb.close()
        summary = meter.summary()
        if self.device.type == "cuda":
            summary["peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return TrainResult(step=self.step, interrupted=interrupted, final_loss=last_loss, exports=exports,
                           summary=summary, signal=self._stop_signal)

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
        """The task's export from rank 0, of the consolidated weights: equal to a one-process export."""
        exports: dict[str, Path] = {}
        with consolidated(self.task.model, self.dist):
            if self.dist.is_main:
                exports = self.task.export(self.out)
        barrier(self.dist)
        return exports

    def _evaluate(self, metrics: MetricsLog, tb: TensorBoardLog, bar: ProgressBar) -> None:
        model = self.task.model
        model.eval()
        with torch.no_grad():
            result = self.task.evaluate()
        model.train()
        if result:
            record = {"kind": "eval", "step": self.step, **result}
            metrics.write(record)
            tb.write(record)
            bar.message("eval step {}: {}".format(self.step, " ".join(f"{k} {v:.4f}" for k, v in result.items())))


def exit_code(result: TrainResult) -> int:
    """Shell status for a CLI run: 0 when finished, 128 + signal when stopped by one (after saving)."""
    return 0 if result.signal is None else 128 + result.signal


__all__ = ["Trainer", "TrainResult", "TrainingError", "seed_everything", "lr_factor", "exit_code"]
