"""Run a trainer as a subprocess in its own process group, stream its output into Prefect, kill it on cancel.

    run_trainer(["designer", "train", "--config", "configs/designer/demo.toml"], nproc=1)
      -> python -m atelier_studio.flows.cli designer train --config ...              (nproc == 1)
      -> torchrun --nproc-per-node N -m atelier_studio.flows.cli designer train ...  (nproc > 1)

Why a subprocess and a process group: Prefect schedules, it does not train. Cancelling a flow run signals
only the flow-run process, and `torchrun` workers are grandchildren of it, so the trainer is
started with `start_new_session=True` and the whole group is terminated here (SIGTERM, a grace period for
the trainer to write its checkpoint, then SIGKILL) on every way out: cancellation (Prefect raises
TerminationSignal in the flow-run process), a crash, KeyboardInterrupt. A pid file per flow run
(`.prefect/trainers/<flow-run-id>.pgid`) lets the flows' `on_cancellation` / `on_crashed` hooks, which the
serving process runs after it has killed the flow-run process, finish the job if the flow-run process
died before its own `finally` could.

The trainer resumes by itself from its newest checkpoint (train.resume = auto), so a task retry continues
where the failed attempt stopped; nothing here deletes a checkpoint.

Step lines (pipeline/progress.py `format_step_line`) are parsed into a dict and drive a Prefect progress
artifact, and each samples line (`format_samples_line`: validation images rendered during training) becomes a
Prefect image artifact (flows/report.py `publish_samples`; one version of one key per evaluation), and each table
line (`format_table_line`: the designer's captions of held-out briefs) a Prefect table artifact (`publish_table`):

    step 12/100 loss 2.3456 lr 1.00e-04 tok/s 1234.5 mfu 12.3% eta 0:01:30
    samples step 20/100: runs/i1/samples/step-20.png (8 prompts, EMA weights)
    table step 20/100: runs/d1/samples/captions-step-20.jsonl (8 rows)
"""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

TAIL_LINES = 40  # lines of output quoted in a failure message
KILL_GRACE_S = 20.0  # SIGTERM → SIGKILL: long enough for the trainer's on-signal checkpoint
PROGRESS_EVERY_S = 2.0  # progress-artifact updates are API calls: at most one per this many seconds

STEP_LINE = re.compile(
    r"^step (?P<step>\d+)/(?P<total>\d+) loss (?P<loss>[-+0-9.eE]+|nan|inf)"
    r"(?: lr (?P<lr>[-+0-9.eE]+))?"
    r"(?: (?P<unit>tok/s|img/s) (?P<rate>[0-9.eE+]+))?"
    r"(?: mfu (?P<mfu>[0-9.]+)%)?"
    r"(?: skipped (?P<skipped>\d+))?"
    r"(?: eta (?P<eta>[0-9:]+(?:\.\d+)?|\d+ days?, [0-9:]+))?\s*$"
)

SAMPLES_LINE = re.compile(r"^samples step (?P<step>\d+)/(?P<total>\d+): (?P<path>.+) \((?P<prompts>\d+) prompts, "
                          r"(?P<weights>\S+) weights\)\s*$")

TABLE_LINE = re.compile(r"^table step (?P<step>\d+)/(?P<total>\d+): (?P<path>.+) \((?P<rows>\d+) rows\)\s*$")


class TrainerFailed(RuntimeError):
    """The trainer exited non-zero; the message carries the command, the exit code and the last output lines."""

    def __init__(self, cmd: Sequence[str], returncode: int, tail: Sequence[str]):
        self.cmd, self.returncode, self.tail = list(cmd), returncode, list(tail)
        body = "\n".join(self.tail) if self.tail else "(no output)"
        super().__init__(f"trainer exited with code {returncode}: {' '.join(self.cmd)}\n"
                         f"--- last {len(self.tail)} lines ---\n{body}")


def parse_step_line(line: str) -> dict[str, Any] | None:
    """One trainer step line → {step, total, loss, lr, unit, rate, mfu (fraction), skipped, eta}; None for other
    lines."""
    m = STEP_LINE.match(line.strip())
    if m is None:
        return None
    out: dict[str, Any] = {"step": int(m["step"]), "total": int(m["total"]), "loss": float(m["loss"])}
    if m["lr"] is not None:
        out["lr"] = float(m["lr"])
    if m["unit"] is not None:
        out["unit"], out["rate"] = m["unit"], float(m["rate"])
    if m["mfu"] is not None:
        out["mfu"] = float(m["mfu"]) / 100.0
    if m["skipped"] is not None:
        out["skipped"] = int(m["skipped"])
    if m["eta"] is not None:
        out["eta"] = m["eta"]
    return out


def parse_samples_line(line: str) -> dict[str, Any] | None:
    """One samples line → {step, total, path, prompts, weights}; None for other lines."""
    m = SAMPLES_LINE.match(line.strip())
    if m is None:
        return None
    return {"step": int(m["step"]), "total": int(m["total"]), "path": m["path"], "prompts": int(m["prompts"]),
            "weights": m["weights"]}


def parse_table_line(line: str) -> dict[str, Any] | None:
    """One table line → {step, total, path, rows}; None for other lines."""
    m = TABLE_LINE.match(line.strip())
    if m is None:
        return None
    return {"step": int(m["step"]), "total": int(m["total"]), "path": m["path"], "rows": int(m["rows"])}


def trainer_command(argv: Sequence[str], nproc: int = 1) -> list[str]:
    """The command line that runs `atelier <argv>` on nproc local processes."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if nproc == 1:
        return [sys.executable, "-m", "atelier_studio.flows.cli", *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "atelier_studio.flows.cli", *argv]


# ----------------------------------------------------------------------------- process groups


def pid_dir() -> Path:
    """Where running trainers' process-group ids are recorded (under PREFECT_HOME, else .prefect/)."""
    try:
        from prefect.settings import PREFECT_HOME

        home = Path(PREFECT_HOME.value())
    except Exception:  # prefect settings unreadable: fall back to the repo default
        home = Path(".prefect")
    return home / "trainers"


def kill_process_group(pgid: int, grace_s: float = KILL_GRACE_S, proc: subprocess.Popen | None = None) -> bool:
    """SIGTERM the group, wait up to grace_s for it to empty, then SIGKILL. True if anything was signalled.

    proc: the group leader when it is our child; it is reaped while waiting (an unreaped zombie leader keeps
    the group "alive" for killpg). A second signal during the grace period (Prefect's runner escalating)
    still ends in SIGKILL: the group never outlives this call.
    """
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    try:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc is not None:
                proc.poll()
            if not _group_alive(pgid):
                return True
            time.sleep(0.05)
    finally:
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still exists
        return True
    return True


def kill_recorded_trainers(flow_run_id: str, grace_s: float = KILL_GRACE_S) -> list[int]:
    """Kill every trainer group recorded for a flow run (the cancellation/crash hook's job); returns the pgids."""
    killed = []
    for f in sorted(pid_dir().glob(f"{flow_run_id}*.pgid")):
        try:
            pgid = int(f.read_text().strip())
        except (OSError, ValueError):
            continue
        if kill_process_group(pgid, grace_s):
            killed.append(pgid)
        f.unlink(missing_ok=True)
    return killed


def kill_trainers_hook(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect `on_cancellation` / `on_crashed` hook: the flow-run process may be gone, its trainer may not."""
    killed = kill_recorded_trainers(str(flow_run.id))
    if killed:
        logging.getLogger("atelier.flows").warning("killed trainer process group(s) %s of flow run %s",
                                                   killed, flow_run.id)


# ----------------------------------------------------------------------------- Prefect glue


def _prefect_logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect.logging import get_run_logger

    return get_run_logger()


def _flow_run_id() -> str | None:
    from prefect.context import FlowRunContext, TaskRunContext

    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None:
        return str(ctx.flow_run.id)
    tctx = TaskRunContext.get()
    if tctx is not None and tctx.task_run.flow_run_id is not None:
        return str(tctx.task_run.flow_run_id)
    return None


class _Progress:
    """A Prefect progress artifact (percent of steps), created on the first step line, updated at most every few s."""

    def __init__(self, key: str | None, enabled: bool):
        self.key, self.enabled = key, enabled
        self.artifact_id = None
        self.last_update = 0.0

    def update(self, rec: dict[str, Any], force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and self.artifact_id is not None and now - self.last_update < PROGRESS_EVERY_S:
            return
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        pct = 100.0 * rec["step"] / max(rec["total"], 1)
        desc = describe_step(rec)
        try:
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(pct, key=self.key, description=desc)
            else:
                update_progress_artifact(self.artifact_id, pct, description=desc)
        except Exception as e:  # progress is cosmetic: never fail a training run over it
            logging.getLogger("atelier.flows").warning("progress artifact update failed: %s", e)
            self.enabled = False
        self.last_update = now


def describe_step(rec: dict[str, Any]) -> str:
    parts = [f"step {rec['step']}/{rec['total']}", f"loss {rec['loss']:.4f}"]
    if "rate" in rec:
        parts.append(f"{rec['rate']:.1f} {rec['unit']}")
    if "mfu" in rec:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    if rec.get("skipped"):
        parts.append(f"{rec['skipped']} samples skipped")
    if "eta" in rec:
        parts.append(f"eta {rec['eta']}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------- the runner


def _publish_samples(key: str | None, rec: dict[str, Any]) -> None:
    """A samples line's image as a Prefect artifact (inside a flow run); a failure is logged, never fatal."""
    from atelier_studio.flows.report import publish_samples

    try:
        publish_samples(Path(rec["path"]), key or "samples",
                        f"step {rec['step']}/{rec['total']}: {rec['prompts']} prompts, {rec['weights']} weights")
    except Exception as e:  # an artifact is a view of the run: never fail training over it
        logging.getLogger("atelier.flows").warning("samples artifact for %s failed: %s", rec["path"], e)


def _publish_table(key: str | None, rec: dict[str, Any]) -> None:
    """A table line's rows as a Prefect table artifact (inside a flow run); a failure is logged, never fatal."""
    from atelier_studio.flows.report import publish_table

    try:
        publish_table(Path(rec["path"]), f"{key or 'samples'}-table", f"step {rec['step']}/{rec['total']}")
    except Exception as e:  # an artifact is a view of the run: never fail training over it
        logging.getLogger("atelier.flows").warning("table artifact for %s failed: %s", rec["path"], e)


def run_command(cmd: Sequence[str], env: Mapping[str, str] | None = None, log: Callable[[str], Any] | None = None,
                progress_key: str | None = None, cwd: str | Path | None = None, check: bool = True,
                kill_grace_s: float = KILL_GRACE_S, samples_key: str | None = None) -> tuple[int, dict[str, Any]]:
    """Run cmd in a new session, stream each output line to `log`, kill the group on any way out but a normal exit.
    In a Prefect run, step lines update the progress artifact `progress_key` and samples lines add a version of the
    image artifact `samples_key`, table lines a version of the table artifact `<samples_key>-table`.

    Returns (returncode, summary); summary = {"last_step": the last parsed step line or None, "lines": count,
    "tail": the last TAIL_LINES lines}. check=True raises TrainerFailed on a non-zero exit.
    """
    in_prefect = _flow_run_id() is not None
    if log is None:
        log = _prefect_logger().info if in_prefect else (lambda s: print(s, flush=True))
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")  # lines arrive as they are printed, not at exit
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    progress = _Progress(progress_key, enabled=in_prefect)
    last_step: dict[str, Any] | None = None
    n_lines = 0
    # stderr into stdout: one ordered stream, and a failure's tail shows the traceback where it happened.
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                            start_new_session=True, text=True, bufsize=1, errors="replace")
    pgid = proc.pid  # a new session's leader: its pid is the group id
    pid_file = None
    run_id = _flow_run_id()
    if run_id is not None:
        pid_file = pid_dir() / f"{run_id}-{pgid}.pgid"
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(str(pgid))
    finished = False
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            n_lines += 1
            tail.append(line)
            log(line)
            rec = parse_step_line(line)
            if rec is not None:
                last_step = rec
                progress.update(rec, force=rec["step"] == rec["total"])
            samples = parse_samples_line(line) if in_prefect else None
            if samples is not None:
                _publish_samples(samples_key, samples)
            table = parse_table_line(line) if in_prefect else None
            if table is not None:
                _publish_table(samples_key, table)
        proc.wait()
        finished = True
    finally:
        try:
            if not finished:
                # Cancelled (TerminationSignal), interrupted or crashed mid-stream: the trainer must not outlive us.
                kill_process_group(pgid, kill_grace_s, proc)
                proc.wait()
            elif _group_alive(pgid):
                # The leader exited but left workers behind (a torchrun worker that ignored the exit): end them.
                kill_process_group(pgid, kill_grace_s)
        finally:
            if pid_file is not None:
                pid_file.unlink(missing_ok=True)
    summary = {"last_step": last_step, "lines": n_lines, "tail": list(tail)}
    if check and proc.returncode != 0:
        raise TrainerFailed(cmd, proc.returncode, list(tail))
    return proc.returncode, summary


def run_trainer(argv: Sequence[str], nproc: int = 1, env: Mapping[str, str] | None = None,
                log: Callable[[str], Any] | None = None, progress_key: str | None = None,
                cwd: str | Path | None = None, check: bool = True,
                samples_key: str | None = None) -> tuple[int, dict[str, Any]]:
    """`atelier <argv>` on nproc processes (torchrun when > 1), streamed and killed as `run_command` does."""
    return run_command(trainer_command(argv, nproc), env=env, log=log, progress_key=progress_key, cwd=cwd,
                       check=check, samples_key=samples_key)
