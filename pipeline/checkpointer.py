"""The Trainer's checkpoints: which one to resume from, and what goes into one and comes back out of it.

A checkpoint holds everything a resumed run needs to continue as if it had never stopped: the trainable weights,
the optimizer state, the task's own state (its data position), the step, and every random generator (Python,
NumPy, torch's CPU and CUDA generators). The formats and the atomic writes are pipeline/checkpoint_files.py's: one
process writes a safetensors checkpoint, several ranks a sharded one (torch.distributed.checkpoint, optionally in
the background) that resumes on any number of ranks. docs/checkpoints.md describes both.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from atelier_studio.pipeline.checkpoint_files import (
    Checkpoint,
    CheckpointError,
    PendingSave,
    is_sharded_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_sharded_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    save_sharded_checkpoint,
    verify_checkpoint,
)
from atelier_studio.pipeline.config import TrainConfig
from atelier_studio.pipeline.distributed import DistContext, barrier, broadcast_object
from atelier_studio.pipeline.optimizer_state import optimizer_state_from_tensors, optimizer_state_to_tensors
from atelier_studio.pipeline.optimizers import Optimizers
from atelier_studio.pipeline.task import Task


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def host_rng_state() -> dict[str, list]:
    """Python's and NumPy's generator states as JSON-able lists."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    return {"python": [py_state[0], list(py_state[1]), py_state[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}


def set_host_rng_state(state: dict[str, list]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npy = state["numpy"]
    np.random.set_state((npy[0], np.asarray(npy[1], dtype=np.uint32), npy[2], npy[3], npy[4]))


class Checkpointer:
    """Saves and restores one run's state under `<output.dir>/checkpoints` (module docstring)."""

    def __init__(self, ckpt_dir: Path, cfg: TrainConfig, task: Task, optimizer: Optimizers,
                 named_params: list[tuple[str, nn.Parameter]], dist: DistContext, device: torch.device):
        self.dir = ckpt_dir
        self.cfg = cfg
        self.task = task
        self.optimizer = optimizer
        self.named_params = named_params
        self.param_names = {id(p): n for n, p in named_params}
        self.dist = dist
        self.device = device
        self._pending: PendingSave | None = None
        # the trackers' run ids (pipeline/trackers.py): saved in each checkpoint's state, read back by `load`
        self.tracker_state: Callable[[], dict[str, Any]] = dict
        self.loaded_trackers: dict[str, Any] = {}

    # ------------------------------------------------------------------ which checkpoint

    def resume_path(self) -> Path | None:
        """The checkpoint to resume from (`train.resume`); under torchrun rank 0 decides (and verifies) for all."""
        if not self.dist.enabled:
            return self._find_resume_path()
        try:
            found: Any = self._find_resume_path() if self.dist.is_main else None
        except CheckpointError as e:
            found = e
        found = broadcast_object(self.dist, found)
        if isinstance(found, CheckpointError):
            raise found
        return found

    def _find_resume_path(self) -> Path | None:
        resume = self.cfg.resume
        if resume == "never":
            if list_checkpoints(self.dir):
                raise CheckpointError(
                    f"{self.dir} already holds checkpoints and train.resume = 'never': refusing to overwrite "
                    f"them. Use another output.dir, or train.resume=auto to continue."
                )
            return None
        if resume == "auto":
            found = list_checkpoints(self.dir)
            if not found:
                return None
            newest = found[-1]
            try:
                verify_checkpoint(newest)
            except CheckpointError as e:
                older = ", ".join(str(p) for p in found[:-1]) or "none"
                raise CheckpointError(
                    f"cannot resume from the newest checkpoint: {e}. Nothing was changed. Older checkpoints: {older}; "
                    f"pick one with --set train.resume=PATH."
                ) from None
            return newest
        return Path(resume)

    # ------------------------------------------------------------------ save

    def save(self, step: int) -> Path:
        """A checkpoint of step `step`; older ones beyond `train.keep_checkpoints` are pruned once it is in place.
        Under torchrun with async checkpoints the write goes on in the background (`finish_pending`)."""
        if self.dist.enabled:
            return self._save_sharded(step)
        opt_tensors, opt_meta = optimizer_state_to_tensors(self.optimizer.parts, self.param_names)
        extra = {f"task.{k}": v for k, v in self.task.state_tensors().items()}
        extra["rng.torch"] = torch.get_rng_state()
        if self.device.type == "cuda":
            extra["rng.cuda"] = torch.cuda.get_rng_state(self.device)
        state = {"optimizer": opt_meta, "rng": host_rng_state(), "task": self.task.state_meta(),
                 "trackers": self.tracker_state()}
        ckpt = Checkpoint(step=step, model={n: p.detach() for n, p in self.named_params}, optimizer=opt_tensors,
                          extra=extra, state=state)
        path = save_checkpoint(self.dir, ckpt)
        prune_checkpoints(self.dir, self.cfg.keep_checkpoints)
        return path

    def _save_sharded(self, step: int) -> Path:
        self.finish_pending()
        async_save = self.cfg.distributed.async_checkpoint
        rank_state: dict[str, Any] = {**host_rng_state(), "torch": torch.get_rng_state().tolist()}
        if self.device.type == "cuda":
            rank_state["cuda"] = torch.cuda.get_rng_state(self.device).tolist()
        self._pending = save_sharded_checkpoint(self.dir, step, self._app_state(), {"task": self.task.state_meta(),
                                                                       "trackers": self.tracker_state()},
                                                rank_state, self.dist, async_save=async_save)
        if not async_save:
            self._after_save()
        return self._pending.final

    def finish_pending(self) -> None:
        """Finish (and rename into place) a checkpoint still being written in the background."""
        if self._pending is not None and self._pending.future is not None:
            self._pending.wait()
            self._after_save()
        self._pending = None

    def _after_save(self) -> None:
        if self.dist.is_main:
            prune_checkpoints(self.dir, self.cfg.keep_checkpoints)
        barrier(self.dist)

    def _app_state(self) -> dict[str, Any]:
        """Trainable weights and optimizer state by parameter name (DTensors under FSDP), plus task tensors."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.task.model, self.optimizer.parts,
                                            options=StateDictOptions(ignore_frozen_params=True))
        for group in optim_sd.get("param_groups", []):  # torchao's lr tensor: a float in the JSON (set back on load)
            group.update({k: v.item() for k, v in group.items() if torch.is_tensor(v)})
        return {"model": model_sd, "optimizer": optim_sd, "task": dict(self.task.state_tensors())}

    # ------------------------------------------------------------------ load

    def load(self, path: Path) -> int:
        """Restore the state saved at `path` (either format); returns its step."""
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
        optimizer_state_from_tensors(self.optimizer.parts, self.param_names, ckpt.optimizer, ckpt.state["optimizer"])
        task_tensors = {k[len("task."):]: v for k, v in ckpt.extra.items() if k.startswith("task.")}
        self.task.load_state(task_tensors, ckpt.state["task"])
        torch.set_rng_state(ckpt.extra["rng.torch"])
        if self.device.type == "cuda" and "rng.cuda" in ckpt.extra:
            torch.cuda.set_rng_state(ckpt.extra["rng.cuda"], self.device)
        set_host_rng_state(ckpt.state["rng"])
        self.loaded_trackers = ckpt.state.get("trackers", {})  # absent from checkpoints older than the trackers
        return ckpt.step

    def _load_sharded(self, path: Path) -> int:
        """Resume from a sharded checkpoint written by any number of ranks (DCP re-shards on load)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        app = self._app_state()
        step, state, rank_state = load_sharded_checkpoint(path, app, self.dist.rank)
        try:
            set_state_dict(self.task.model, self.optimizer.parts, model_state_dict=app["model"],
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
        self.loaded_trackers = state.get("trackers", {})
        if rank_state is not None:
            set_host_rng_state(rank_state)
            torch.set_rng_state(torch.tensor(rank_state["torch"], dtype=torch.uint8))
            if self.device.type == "cuda" and "cuda" in rank_state:
                torch.cuda.set_rng_state(torch.tensor(rank_state["cuda"], dtype=torch.uint8), self.device)
        else:  # written by fewer ranks: a fresh, still deterministic stream for this rank
            seed_everything(self.cfg.seed + 1_000_003 * step + self.dist.rank)
        return step


__all__ = ["Checkpointer", "seed_everything", "host_rng_state", "set_host_rng_state"]
