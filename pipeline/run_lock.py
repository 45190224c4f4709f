"""One run per output folder: an OS file lock on `<output.dir>/.lock`, held for the run's whole life.

Two runs on one folder (a deployment started twice, a retried flow beside a live one) would each resume from
and write the same checkpoints, and the second's clean-up of killed writers' temporaries (pipeline/atomic.py)
would delete the first's checkpoint in progress. So a training run takes an exclusive `flock` on `.lock` in
its output folder before it reads or writes anything there, and a second run stops at once, naming the
first by pid and host (written into the file) and the fix.

The operating system holds the lock for the process: it is released when the run ends however it ends,
kill -9 and a crash included, so a stale `.lock` file never blocks the next run (its contents are only a
description of the holder, rewritten by each run that takes the lock). A run that ends removes the file;
a folder that holds nothing else afterwards, created by this run, is removed too (a run refused for bad
input leaves nothing behind).

Under torchrun rank 0 takes the lock (it is the one process every launch has) and tells every rank the
outcome, so all ranks stop together when the folder is taken. Forked children (data-loader workers) close
their copy of the descriptor, so a worker outliving a killed run does not keep the folder locked.

`flock` is local to a machine on most file systems; on NFS Linux emulates it with POSIX locks, which work
across machines when the server supports them. A file system that refuses locks is reported.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atelier_studio.pipeline.atomic import ensure_dir
from atelier_studio.pipeline.errors import AtelierError, WriteError, os_error_reason

if TYPE_CHECKING:  # torch is imported only by the runs that need it (a lock is taken before anything is loaded)
    from atelier_studio.pipeline.distributed import DistContext

LOCK_NAME = ".lock"
_ATTEMPTS = 5  # a lock file removed by the run that held it just as it was opened: open it again

_held_fds: set[int] = set()  # this process's lock descriptors, closed in forked children


def _close_in_child() -> None:
    for fd in _held_fds:
        try:
            os.close(fd)  # the parent's descriptor keeps the lock: flock is released only when every copy is closed
        except OSError:
            pass
    _held_fds.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunLockedError(AtelierError, RuntimeError):
    """The output folder is in use by another run; the message names it (pid, host) and the fix."""


class RunLock:
    """The lock on one output folder, held until `release()` (or until the process ends)."""

    def __init__(self, out_dir: Path, fd: int | None, created: list[Path]):
        self.out_dir, self.fd, self.created = out_dir, fd, created

    @property
    def path(self) -> Path:
        return self.out_dir / LOCK_NAME

    def release(self) -> None:
        """Remove the lock file (while still holding it), then unlock; and a created folder left empty."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            self.path.unlink(missing_ok=True)
        finally:
            _held_fds.discard(fd)
            os.close(fd)
        for d in reversed(self.created):  # innermost first; only folders this run made and left empty
            try:
                d.rmdir()
            except OSError:
                break


def acquire_run_lock(out_dir: Path, what: str = "output.dir") -> RunLock:
    """Create `out_dir` if needed and lock it for this process, or raise RunLockedError naming the holder."""
    out_dir = Path(out_dir)
    created = [p for p in (*reversed(out_dir.parents), out_dir) if not p.exists()]
    ensure_dir(out_dir, what)
    path = out_dir / LOCK_NAME
    for _ in range(_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise WriteError(f"{what} {out_dir}: cannot create the run lock {path}: {os_error_reason(e)}",
                             e.errno) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunLockedError(_locked_message(out_dir, what, holder)) from None
            raise WriteError(f"{what} {out_dir}: cannot lock {path} ({os_error_reason(e)}): the file system refuses "
                             f"file locks; use an output.dir on a local disk", e.errno) from None
        if _is_current(fd, path):
            _write_holder(fd)
            _held_fds.add(fd)
            return RunLock(out_dir, fd, created)
        os.close(fd)  # the holder removed this file as it ended: lock the one now at `path`
    raise RunLockedError(f"{what} {out_dir}: {path} keeps being replaced: is another run starting and ending there "
                         f"in a loop? Use another output.dir")


def lock_output_dir(out_dir: Path, dist: DistContext, what: str = "output.dir") -> RunLock:
    """`acquire_run_lock` on rank 0; every rank raises the same error when rank 0 could not lock the folder.

    A collective under torchrun: every rank calls it. Other ranks get a RunLock that holds nothing.
    """
    if not dist.enabled:
        return acquire_run_lock(out_dir, what)
    from atelier_studio.pipeline.distributed import broadcast_object

    lock: RunLock | None = None
    failure: Any = None
    if dist.is_main:
        try:
            lock = acquire_run_lock(out_dir, what)
        except AtelierError as e:
            failure = e
        except BaseException as e:  # never leave the other ranks waiting in the broadcast
            broadcast_object(dist, AtelierError(f"rank 0 could not lock {what} {out_dir}: {e}"))
            raise
    failure = broadcast_object(dist, failure)
    if failure is not None:
        raise failure
    return lock if lock is not None else RunLock(Path(out_dir), None, [])


# ----------------------------------------------------------------------------- helpers


def _is_current(fd: int, path: Path) -> bool:
    """True when `fd` is still the file at `path` (a run that ends removes its lock file)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _write_holder(fd: int) -> None:
    holder = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv)}
    data = (json.dumps(holder) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        holder = json.loads(os.pread(fd, 1 << 16, 0))
    except (OSError, ValueError):  # empty (the holder has not written it yet) or not ours
        return None
    return holder if isinstance(holder, dict) and "pid" in holder else None


def _locked_message(out_dir: Path, what: str, holder: dict[str, Any] | None) -> str:
    if holder is None:
        who, stop = "another run (it holds the lock but has not written its pid yet)", "stop it"
    else:
        pid, host = holder.get("pid"), holder.get("host", "?")
        started = f", started {holder['started']}" if holder.get("started") else ""
        who, stop = f"another run: pid {pid} on host {host}{started}", f"stop it: kill {pid} on {host}"
    return (f"{what} {out_dir} is in use by {who}. Two runs on one folder would write over each other's "
            f"checkpoints: use another output.dir, or wait for that run to end (or {stop}) and run again")


__all__ = ["LOCK_NAME", "RunLock", "RunLockedError", "acquire_run_lock", "lock_output_dir"]
