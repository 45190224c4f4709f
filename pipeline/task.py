"""The contract between the one training loop (`pipeline/trainer.py`) and a model family.

A task (the designer's, the imagegen's) builds its model and data and knows how to compute the loss
of one micro-batch. The trainer owns everything else: accumulation, clipping, schedule, evaluation,
logging, checkpoint cadence, signals, resume.

Loss convention: `loss_sum(batch)` returns the SUM of per-unit losses in fp32 (units: loss tokens for
the designer, images for imagegen) and `batch_weight(batch)` the number of units as a host-side int.
The trainer divides by the summed weight of all micro-batches of the optimizer step, so a step's loss
is the mean over every unit of the accumulated batch — not a mean of per-micro-batch means, which
over-weights short micro-batches (a known bug class of fused cross-entropy under accumulation).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class Samples:
    """Validation images a task rendered during training (imagegen's fixed prompt grid): one image file."""

    path: Path  # the PNG (written by rank 0)
    count: int  # how many prompts it shows
    weights: str  # which weights rendered it, e.g. "EMA"


@dataclass(frozen=True)
class SampleTable:
    """Samples a task made at an evaluation, as a table (the designer's greedy captions of fixed held-out briefs):
    logged to every tracker, written to `<output.dir>/samples/<name>-step-N.jsonl`; `scores` (e.g. the shapes-world
    judge's caption score) go to the eval record of the same step."""

    name: str  # e.g. "captions"
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    scores: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Skipped:
    """Training samples the data skipped so far (unreadable, or missing from a tar cut short), over every rank:
    by source (a shard or a data file, named as the user gave it) and reason. A sample skipped on each of several
    passes counts each time. Reported on the progress line, in metrics.jsonl, TensorBoard and the run summary."""

    by_source: dict[str, dict[str, int]]  # source -> reason -> samples

    @property
    def total(self) -> int:
        return sum(n for reasons in self.by_source.values() for n in reasons.values())

    def by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for reasons in self.by_source.values():
            for reason, n in reasons.items():
                out[reason] = out.get(reason, 0) + n
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "by_reason": self.by_reason(),
                "by_source": {s: dict(r) for s, r in sorted(self.by_source.items())}}

    def describe(self) -> str:
        """One line: the total, then each source's counts by reason."""
        per = "; ".join(f"{s}: " + ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
                        for s, reasons in sorted(self.by_source.items()))
        return f"{self.total} sample{'s' if self.total != 1 else ''} skipped so far" + (f" ({per})" if per else "")


class Task(ABC):
    """What a model family supplies to the loop. Subclasses implement the abstract methods; the hooks below them
    have defaults that suit a task without the feature, so the trainer calls every one of them unconditionally."""

    #: the module whose trainable parameters the optimizer updates
    model: nn.Module
    #: the throughput unit: "tokens" or "images"
    unit: str
    #: parameter-name prefixes of the model's input embeddings and output head: Muon leaves them (2-D, but not
    #: hidden layers) to AdamW (pipeline/optimizers.py)
    outer_layers: tuple[str, ...] = ()

    @abstractmethod
    def train_batches(self) -> Iterator[Any]:
        """An endless iterator of micro-batches (or of their pieces, see `pieces_per_micro_batch`), positioned by
        `load_state`."""

    @abstractmethod
    def batch_weight(self, batch: Any) -> int:
        """Number of loss units (tokens or images) in the micro-batch; a host int, no device sync."""

    @abstractmethod
    def batch_units(self, batch: Any) -> int:
        """Throughput units processed (non-padding tokens, or images); a host int."""

    @abstractmethod
    def batch_flops(self, batch: Any) -> int:
        """Useful model FLOPs of forward + backward for this micro-batch (from the model's own count)."""

    @abstractmethod
    def loss_sum(self, batch: Any) -> torch.Tensor:
        """Sum of per-unit losses of the micro-batch, an fp32 scalar tensor with grad."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Metrics on the held-out set (may be empty when there is none)."""

    @abstractmethod
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors to checkpoint beyond the trainable weights (EMA weights, ...)."""

    @abstractmethod
    def state_meta(self) -> dict[str, Any]:
        """JSON-serialisable state to checkpoint (data cursor, ...)."""

    @abstractmethod
    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore what `state_tensors` and `state_meta` saved."""

    @abstractmethod
    def export(self, out_dir: Path) -> dict[str, Path]:
        """Write the final artefacts (adapter / model / transformer / ema); returns name → path."""

    # ---- hooks with defaults

    @property
    def pieces_per_micro_batch(self) -> int:
        """Items `train_batches` yields per micro-batch: a task may split one into several (each its own forward and
        backward, like gradient accumulation); the trainer draws grad_accum x this many items per step."""
        return 1

    def after_optimizer_step(self, step: int) -> None:
        """Called after each optimizer step (an EMA update)."""

    def samples(self, step: int) -> Samples | None:
        """Called after every optimizer step: the validation images when they are due (imagegen's sample.every),
        which the trainer logs to every tracker and names on the progress line; None when none are due."""
        return None

    def sample_table(self, step: int) -> SampleTable | None:
        """Called at each evaluation (on every rank, in eval mode, without gradients): a table of samples (the
        designer's captions of held-out briefs), which the trainer logs to every tracker; None when there are none."""
        return None

    def samples_due(self, step: int) -> bool:
        """Whether `samples(step)` renders: the trainer then puts the weights to evaluate in the model first (the
        averaged ones of schedule-free AdamW)."""
        return False

    def step_metrics(self) -> dict[str, float]:
        """Called at each logged step (on every rank, after the loss's host sync): the task's own numbers for the step
        just taken (the designer's DPO rewards), added to the train record that metrics.jsonl and every tracker get;
        {} when it has none. A task may gather its ranks' values in it."""
        return {}

    def skipped(self) -> Skipped | None:
        """What the training data skipped so far, which the trainer reports (progress line, metrics.jsonl,
        TensorBoard, the run summary); None when this run's data cannot skip anything. Called on every rank at each
        logged step and at the end, so a task may gather its ranks' counts in it."""
        return None

    @property
    def export_reads_frozen(self) -> bool:
        """False when `export` writes the trainable weights alone (a LoRA adapter): under FSDP2 the trainer then
        gathers only those to rank 0, never the frozen base."""
        return True
