"""Atomic writes: a file or a directory appears complete at its final path, or not at all.

One temporary-name scheme for everything: `.<final name>.tmp-<token>`, in the same directory as the
final path (the same file system, so the last step is a rename; a hidden name, so listings skip it).
The token is the process id and a random suffix, so two writers never share a temporary; a writer
that several processes share (a sharded checkpoint) passes one token they all know.

A file is written under its temporary name, flushed and fsynced, then `os.replace`d over the final
path. A directory is built under its temporary name, every file in it fsynced, then installed:

    rename final -> .<name>.old-<token>     (only if final exists)
    rename temp  -> final
    delete the old one

so at every instant one complete version is on disk: a kill between the two renames leaves the old
version under its aside name, and `restore_aside` (called before the next write of that path, and by
whoever lists such directories, e.g. checkpoints) renames it back; the next write also deletes a
killed writer's temporary. On any exception the temporary is
deleted and the final path is left as it was (put back if it had been moved aside). Errors that mean
the write itself failed (no space, a read-only disk, no permission) come out as `WriteError` naming
the final path and the file being written; other exceptions pass through unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

from atelier_studio.pipeline.errors import NO_SPACE, WriteError, os_error_reason, write_error

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
# errno values of a failed write (as opposed to a missing input, which is the caller's to report)
_WRITE_FAILURES = NO_SPACE | {errno.EROFS, errno.EACCES, errno.EPERM}


def new_token() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def temp_path(final: str | os.PathLike, token: str | None = None) -> Path:
    """`.<name>.tmp-<token>` beside ``final``."""
    final = Path(final)
    return final.with_name(f".{final.name}{TMP_MARK}{token or new_token()}")


def aside_path(final: str | os.PathLike, token: str | None = None) -> Path:
    """`.<name>.old-<token>` beside ``final``: where the previous version waits while the new one is renamed in."""
    final = Path(final)
    return final.with_name(f".{final.name}{OLD_MARK}{token or new_token()}")


def is_temporary(name: str) -> bool:
    """True for a temporary or aside name of this scheme (what directory listings must ignore)."""
    return name.startswith(".") and (TMP_MARK in name or OLD_MARK in name)


def _siblings(final: Path, mark: str) -> list[Path]:
    prefix = f".{final.name}{mark}"
    if not final.parent.is_dir():
        return []
    return sorted(p for p in final.parent.iterdir() if p.name.startswith(prefix))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def restore_aside(final: str | os.PathLike) -> bool:
    """If ``final`` is missing but a previous version was left aside by a killed install, rename it back."""
    final = Path(final)
    if final.exists():
        return False
    olds = _siblings(final, OLD_MARK)
    if not olds:
        return False
    newest = max(olds, key=lambda p: p.stat().st_mtime)
    os.replace(newest, final)
    _fsync_dir(final.parent)
    return True


def remove_stale(final: str | os.PathLike) -> None:
    """Delete what killed writers of ``final`` left: temporaries, and old versions once ``final`` is back."""
    final = Path(final)
    restore_aside(final)
    for p in _siblings(final, TMP_MARK) + (_siblings(final, OLD_MARK) if final.exists() else []):
        _remove(p)


def check_dir_path(path: str | os.PathLike, what: str = "") -> Path:
    """Fail now, naming ``what``, if ``path`` cannot become a directory (it or a parent is a file); creates nothing."""
    path = Path(path)
    subject = f"{what} {path}" if what else str(path)
    for p in (path, *path.parents):
        if p.exists():
            if p.is_dir():
                return path
            where = "exists and is a file" if p == path else f"{p} is a file"
            raise WriteError(f"{subject}: {where}, not a directory", errno.EEXIST if p == path else errno.ENOTDIR)
    return path


def ensure_dir(path: str | os.PathLike, what: str = "") -> Path:
    """``mkdir -p``; a file in the way (or in a parent's place) is a WriteError naming ``what`` and the path."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        check_dir_path(path, what)  # names the file in the way
        raise write_error(path, e, what) from None
    except OSError as e:
        raise write_error(path, e, what) from None
    return path


@contextlib.contextmanager
def new_output_dir(path: str | os.PathLike, what: str = "") -> Iterator[Path]:
    """A command's output folder that is there in full or not at all: created by the block, removed if it fails.

    For commands whose files record their own absolute paths (an evaluation's index of images), so they cannot be
    built under a temporary name and renamed: each file is still written atomically, and a folder this block
    created is deleted whole when the block raises. A folder that existed before keeps what it had (files the
    command replaced are complete old or new ones). A file in the way is refused before anything runs.
    """
    final = Path(path)
    check_dir_path(final, what)
    created = not final.exists()
    try:
        yield ensure_dir(final, what)
    except BaseException:
        if created:
            _remove(final)
        raise


def _write_failure(final: Path, e: OSError, tmp: Path, what: str) -> WriteError:
    """The WriteError for an OSError raised while writing under ``tmp``; the file is named at its final place."""
    if e.filename:
        name = Path(e.filename)
        with contextlib.suppress(ValueError):
            name = final / name.relative_to(tmp) if name != tmp else final
        e = OSError(e.errno, e.strerror or os_error_reason(e), str(name))
    return write_error(final, e, what)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8", newline: str | None = None,
                what: str = "") -> Iterator[IO[Any]]:
    """Open ``path``'s temporary for writing; on a clean exit it replaces ``path``, on any exception it is deleted."""
    path = Path(path)
    if path.is_dir():
        subject = f"{what} {path}" if what else str(path)
        raise WriteError(f"{subject}: is a directory; a file was expected here", errno.EISDIR)
    ensure_dir(path.parent, what)
    tmp = temp_path(path)
    binary = "b" in mode
    try:
        with open(tmp, mode, encoding=None if binary else encoding, newline=None if binary else newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, OSError) and e.errno in _WRITE_FAILURES:
            raise _write_failure(path, e, tmp, what) from e
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str, what: str = "", encoding: str = "utf-8") -> Path:
    with atomic_file(path, "w", encoding=encoding, what=what) as f:
        f.write(text)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, what: str = "") -> Path:
    with atomic_file(path, "wb", what=what) as f:
        f.write(data)
    return Path(path)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, what: str = "", token: str | None = None) -> Iterator[Path]:
    """Build a directory under ``path``'s temporary name; a clean exit installs it at ``path`` (see the module doc).

    An existing ``path`` stays readable until the new one is in place; a file at ``path`` is refused. What a
    killed writer of ``path`` left (its temporary, an old version moved aside) is cleaned up first: one writer
    per directory is the rule (a temporary may be as large as the directory).
    """
    final = Path(path)
    if final.exists() and not final.is_dir():
        subject = f"{what} {final}" if what else str(final)
        raise WriteError(f"{subject}: exists and is a file, not a directory", errno.EEXIST)
    ensure_dir(final.parent, what)
    remove_stale(final)
    tmp = temp_path(final, token)
    _remove(tmp)
    tmp.mkdir()
    try:
        yield tmp
        install_dir(tmp, final, what)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, OSError) and e.errno in _WRITE_FAILURES:
            raise _write_failure(final, e, tmp, what) from e
        raise


def install_dir(tmp: Path, final: Path, what: str = "") -> None:
    """fsync every file under the complete directory ``tmp``, then move it to ``final`` (the old one aside first)."""
    tmp, final = Path(tmp), Path(final)
    for root, _, files in os.walk(tmp):
        for name in files:
            _fsync(Path(root) / name)
        _fsync_dir(Path(root))
    old = aside_path(final) if final.exists() else None
    if old is not None:
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None and not final.exists():
            os.replace(old, final)  # put the previous version back
        raise
    _fsync_dir(final.parent)
    if old is not None:
        _remove(old)


def save_safetensors(tensors: Mapping[str, Any], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file`, with an I/O failure raised as the OSError it is (safetensors hides the errno in a
    SafetensorError's text), so a full disk is reported as one."""
    from safetensors.torch import save_file

    try:
        save_file(dict(tensors), str(path), metadata=metadata)
    except Exception as e:
        m = re.search(r"os error (\d+)", str(e))
        if m is None or isinstance(e, OSError):
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:  # some file systems refuse fsync on directories
        pass


__all__ = ["atomic_file", "atomic_write_text", "atomic_write_bytes", "atomic_dir", "install_dir", "ensure_dir",
           "check_dir_path",
           "temp_path", "aside_path", "is_temporary", "restore_aside", "remove_stale", "save_safetensors", "new_token"]
