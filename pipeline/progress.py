"""What a run shows and records: a rich progress bar, `metrics.jsonl` and the experiment trackers (TensorBoard, W&B,
MLflow: pipeline/trackers.py).

On a terminal the bar shows step, loss, throughput, MFU and ETA. Off a terminal (a Prefect flow reading
the trainer's stdout, CI logs) it prints one plain line per logged step instead, in a fixed format that
`flows/` parses:

    step 12/100 loss 2.3456 lr 1.00e-04 tok/s 1234.5 mfu 12.3% skipped 8 eta 0:01:30

(`skipped N`: samples the training data skipped so far, shown once there are any; a line of its own names their
shards and reasons whenever the counts change, `data step 12: 8 samples skipped so far (shard-000001.tar: 8
truncated tar)`, and they go to metrics.jsonl as `"kind": "skipped"` records.)

Validation images a task renders during training (imagegen's sample grid) get a line of their own, which the
flows turn into a Prefect image artifact (flows/launch.py), and go to every tracker as images:

    samples step 20/100: runs/i1/samples/step-20.png (8 prompts, EMA weights)

Sample tables (the designer's captions of held-out briefs) go to every tracker as tables, and to
`<output.dir>/samples/<name>-step-N.jsonl`, named by a line of their own that the flows turn into a Prefect table
artifact:

    table step 20/100: runs/d1/samples/captions-step-20.jsonl (8 rows)

Every logged record also goes to `metrics.jsonl` (one JSON object per line, `"kind": "train" | "eval" | "skipped"`)
and, as scalars `<kind>/<key>`, to every tracker.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from atelier_studio.pipeline.atomic import atomic_write_text, ensure_dir
from atelier_studio.pipeline.errors import write_error
from atelier_studio.pipeline.trackers import Trackers


class MetricsLog:
    """Append-only JSONL metrics, truncated to the resumed step so a resumed curve has no duplicates.

    The truncation rewrites the file atomically; a failed append (a full disk) is a WriteError naming the file.
    """

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = Path(path)
        ensure_dir(self.path.parent, "output.dir")
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= resume_step]
            atomic_write_text(self.path, "".join(line + "\n" for line in kept), what="metrics log")
        self._fh = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError as e:
            raise write_error(self.path, e, "metrics log") from e

    def close(self) -> None:
        try:
            self._fh.close()  # flushes: a full disk can surface here too
        except OSError as e:
            raise write_error(self.path, e, "metrics log") from e


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", float("inf"))
    except json.JSONDecodeError:
        return float("inf")  # a torn last line from a killed run: dropped


class ProgressBar:
    """The run's visible progress: a live bar on a terminal, plain lines elsewhere."""

    def __init__(self, total_steps: int, start_step: int, unit: str, enabled: bool = True):
        self.total = total_steps
        self.unit = unit
        self.console = Console(stderr=False)
        self.live = enabled and self.console.is_terminal
        self.start_time = time.perf_counter()
        self.start_step = start_step
        self.progress: Progress | None = None
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self.progress.start()

    def update(self, step: int, record: dict[str, Any]) -> None:
        line = format_step_line(step, self.total, record, self.unit, self._eta(step))
        if self.progress is not None:
            self.progress.update(self.task, completed=step, stats=line.split(" ", 2)[2])
        else:
            print(line, flush=True)

    def message(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()

    def _eta(self, step: int) -> float | None:
        done = step - self.start_step
        if done <= 0:
            return None
        return (time.perf_counter() - self.start_time) / done * (self.total - step)


def format_step_line(step: int, total: int, record: dict[str, Any], unit: str, eta: float | None) -> str:
    parts = [f"step {step}/{total}", f"loss {record['loss']:.4f}"]
    if "lr" in record:
        parts.append(f"lr {record['lr']:.2e}")
    rate_key = f"{unit}_per_s"
    if rate_key in record:
        parts.append(f"{_UNIT_LABEL.get(unit, unit)} {record[rate_key]:.1f}")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    if record.get("skipped"):  # samples the data skipped so far (RunLog.skipped says which)
        parts.append(f"skipped {record['skipped']}")
    if eta is not None:
        parts.append(f"eta {timedelta(seconds=int(eta))}")
    return " ".join(parts)


_UNIT_LABEL = {"tokens": "tok/s", "images": "img/s"}


def format_samples_line(step: int, total: int, samples: Any) -> str:
    """The line announcing validation images (a pipeline.task.Samples); flows/launch.py parses it."""
    return f"samples step {step}/{total}: {samples.path} ({samples.count} prompts, {samples.weights} weights)"


def format_table_line(step: int, total: int, path: Path, rows: int) -> str:
    """The line announcing a sample table's file; flows/launch.py parses it."""
    return f"table step {step}/{total}: {path} ({rows} rows)"


class RunLog:
    """Everything a training run reports, in one place: each record goes to metrics.jsonl, the trackers and the
    progress bar (train records) or a message line (eval records). Only rank 0 of a multi-process run reports
    (`main`); on the other ranks every call does nothing. The trackers are started by the caller (the trainer,
    pipeline/trackers.py's open_trackers) and finished by `close`."""

    def __init__(self, out_dir: Path, trackers: Trackers, total_steps: int, start_step: int, unit: str,
                 main: bool = True):
        self.main = main
        self.trackers = trackers
        self.out_dir = Path(out_dir)
        if not main:
            return
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", resume_step=start_step)
        self.bar = ProgressBar(total_steps, start_step, unit)

    def train(self, record: dict[str, Any]) -> None:
        """A logged training step: its record (step, loss, lr, throughput, ...) everywhere, the bar moved on."""
        if self.main:
            self.metrics.write(record)
            self.trackers.record(record)
            self.bar.update(record["step"], record)

    def eval(self, step: int, result: dict[str, float]) -> None:
        """An evaluation's results at `step`, with a line saying them."""
        if self.main and result:
            record = {"kind": "eval", "step": step, **result}
            self.metrics.write(record)
            self.trackers.record(record)
            self.bar.message("eval step {}: {}".format(step, " ".join(f"{k} {v:.4f}" for k, v in result.items())))

    def samples(self, step: int, total: int, samples: Any) -> None:
        """Validation images a task rendered at `step` (a pipeline.task.Samples): an image on every tracker and a
        line (format_samples_line) that flows/launch.py turns into a Prefect image artifact."""
        if self.main:
            self.trackers.image("samples", samples.path, step)
            self.bar.message(format_samples_line(step, total, samples))

    def table(self, step: int, total: int, table: Any) -> None:
        """A sample table a task made at `step` (a pipeline.task.SampleTable): a JSONL file under samples/, a table
        on every tracker, its scores as eval records, and a line (format_table_line) for the flows."""
        if not self.main:
            return
        path = self.out_dir / "samples" / f"{table.name}-step-{step}.jsonl"
        ensure_dir(path.parent, "output.dir")
        rows = [dict(zip(table.columns, row)) for row in table.rows]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows), what="sample table")
        self.trackers.table(table.name, table.columns, table.rows, step)
        if table.scores:
            self.eval(step, dict(table.scores))
        self.bar.message(format_table_line(step, total, path, len(rows)))

    def skipped(self, step: int, skipped: Any) -> None:
        """What the training data skipped so far (a pipeline.task.Skipped), when it changed: a `"kind": "skipped"`
        record (total, by reason, by source and reason), tracker scalars `skipped/total` and `skipped/<source>`, and a
        line naming each source."""
        if self.main:
            record = {"kind": "skipped", "step": step, **skipped.as_dict()}
            self.metrics.write(record)
            self.trackers.record({"kind": "skipped", "step": step, "total": skipped.total,
                                  **{source: sum(r.values()) for source, r in skipped.by_source.items()}})
            self.bar.message(f"data step {step}: {skipped.describe()}")

    def message(self, text: str) -> None:
        if self.main:
            self.bar.message(text)

    def close(self, summary: dict[str, Any] | None = None, interrupted: bool = False) -> None:
        """The bar and metrics.jsonl closed; each tracker given the run's summary and finished."""
        if self.main:
            self.bar.close()
            self.metrics.close()
            self.trackers.finish(summary or {}, interrupted)


def log(msg: str) -> None:
    """A plain status line (setup, checkpoints) on stdout, flushed so flows stream it at once."""
    print(msg, file=sys.stdout, flush=True)


# What a run does differently from what was asked or what a GPU would do (an emulated precision, reference kernels
# on a CPU): each logged once and listed in the run summary (summary.json "fallbacks"), never silent. One run per
# process: the CLI resets them when a run starts.
_FALLBACKS: dict[str, str] = {}


def announce_fallback(key: str, message: str) -> None:
    """Log `message` the first time `key` is announced in this run, and keep it for the summary."""
    if key not in _FALLBACKS:
        _FALLBACKS[key] = message
        log(message)


def fallbacks() -> dict[str, str]:
    """The fallbacks announced in this run, by key."""
    return dict(_FALLBACKS)


def reset_fallbacks() -> None:
    """Forget the announced fallbacks (a new run starts)."""
    _FALLBACKS.clear()
