"""pipeline/run_lock.py with real processes: one holder per folder, released by the OS on kill -9, not kept by forks.

The whole-run tests (a second `atelier designer train` on a live run's folder, kill -9, resume) are in
tests/test_run_lock.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from atelier_studio.pipeline import distributed
from atelier_studio.pipeline.distributed import DistContext
from atelier_studio.pipeline.run_lock import LOCK_NAME, RunLockedError, acquire_run_lock, lock_output_dir

ROOT = Path(__file__).parents[2]

# a process that takes the lock, says so on stdout (with the pid of a forked child when asked), then waits for
# its stdin to close: the test never waits on wall time, only on the holder's own line
HOLDER = """
import os, sys
from pathlib import Path
from atelier_studio.pipeline.run_lock import acquire_run_lock
lock = acquire_run_lock(Path(sys.argv[1]))
ready_r, ready_w = os.pipe()
child = os.fork() if sys.argv[2] == "fork" else -1
if child == 0:  # the at-fork handlers have run once fork() returns here: say so, then wait
    os.write(ready_w, b"x")
    sys.stdin.read()
    os._exit(0)
if child > 0:
    os.read(ready_r, 1)  # the child has run its handlers (or a kill now would race them)
print(child, flush=True)
sys.stdin.read()
"""


def _holder(out: Path, fork: bool = False) -> tuple[subprocess.Popen, int]:
    """A process holding the lock on `out`; returns it once it holds the lock, and its forked child's pid."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), "fork" if fork else "-"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, f"the holder exited with {proc.wait()} before taking the lock"
    return proc, int(line)


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()


def test_a_second_process_is_refused_and_named_then_gets_the_lock_after_kill_9(tmp_path):
    out = tmp_path / "run"
    proc, _ = _holder(out)
    try:
        holder = json.loads((out / LOCK_NAME).read_text())
        assert holder["pid"] == proc.pid and holder["host"] == socket.gethostname()
        with pytest.raises(RunLockedError) as e:
            acquire_run_lock(out)
        message = str(e.value)
        assert f"output.dir {out} is in use by another run: pid {proc.pid} on host {socket.gethostname()}" in message
        assert "use another output.dir, or wait for that run to end" in message and "\n" not in message
    finally:
        proc.send_signal(signal.SIGKILL)
        _kill(proc)
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == proc.pid  # the file outlives the killed holder...
    lock = acquire_run_lock(out)  # ...but the OS released its lock
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    (out / "checkpoints").mkdir()
    lock.release()
    assert not (out / LOCK_NAME).exists() and (out / "checkpoints").is_dir()  # the run's files stay


def test_a_forked_child_does_not_keep_the_folder_locked(tmp_path):
    """A data-loader worker that outlives its killed run must not hold the lock (its copy is closed at fork)."""
    out = tmp_path / "run"
    proc, child = _holder(out, fork=True)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        os.kill(child, 0)  # the child is still alive...
        acquire_run_lock(out).release()  # ...and the folder is free
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill(proc)


def test_release_removes_only_the_folders_this_run_created_and_left_empty(tmp_path):
    out = tmp_path / "a" / "b" / "run"
    acquire_run_lock(out).release()  # a run refused for bad input before writing anything
    assert not (tmp_path / "a").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    acquire_run_lock(kept).release()
    assert kept.is_dir() and not any(kept.iterdir())


def test_lock_then_release_then_lock_again_in_one_process(tmp_path):
    """Several runs in one process (the distributed tests' worker) take the folder one after the other."""
    first = acquire_run_lock(tmp_path)
    with pytest.raises(RunLockedError):
        acquire_run_lock(tmp_path)  # a second descriptor in the same process is refused too
    first.release()
    acquire_run_lock(tmp_path).release()


def test_every_rank_stops_when_rank_0_cannot_lock(tmp_path, monkeypatch):
    """Under torchrun only rank 0 locks; its outcome is broadcast, and every rank raises the same error."""
    held = acquire_run_lock(tmp_path)
    sent = []

    def broadcast(ctx, obj):  # rank 0's object reaches every rank
        if ctx.is_main:
            sent.append(obj)
        return sent[-1]

    monkeypatch.setattr(distributed, "broadcast_object", broadcast)
    try:
        for rank in (0, 1):
            ctx = DistContext(rank=rank, world_size=2, is_main=rank == 0, enabled=True)
            with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
                lock_output_dir(tmp_path, ctx)
    finally:
        held.release()
    # the folder free: rank 0 holds the lock, rank 1 a lock that holds nothing (its release leaves rank 0's alone)
    rank0 = lock_output_dir(tmp_path, DistContext(rank=0, world_size=2, is_main=True, enabled=True))
    rank1 = lock_output_dir(tmp_path, DistContext(rank=1, world_size=2, is_main=False, enabled=True))
    assert rank0.fd is not None and rank1.fd is None
    rank1.release()
    with pytest.raises(RunLockedError):
        acquire_run_lock(tmp_path)
    rank0.release()
    assert not (tmp_path / LOCK_NAME).exists()
