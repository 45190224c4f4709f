"""Errors a user can fix, and how an OS error becomes one.

Every error that bad input can cause (a config key, a data line, a path, a checkpoint, a full disk)
is an `AtelierError`: the CLI prints its message as one line, `atelier: error: <message>`, and exits
with status 2. The message names the file (and line), the config key or the path, and says what is
wrong. Each part of the code keeps its own subclass (ConfigError, DataError, CheckpointError, ...);
the ones shared by several packages live here.

OS errors are converted where the path is known (`write_error`, used by pipeline/atomic.py): a write
that fails for lack of space says so and names the file it was writing. `user_os_error` is the CLI's
last resort for the OS errors a user can fix that reach it unconverted (a missing file, a file where a
directory should be, no permission); any other exception is a bug and keeps its traceback. `decode_utf8` turns
a byte that is not UTF-8 into the caller's error naming `file:line` (config files here, data files in data/textfile.py).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

# errno values that mean "no room to write": the disk or the quota is full, or the file-size limit is hit
NO_SPACE = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


class AtelierError(Exception):
    """A problem the user can fix; the message names the file, line, key or path and what is wrong."""


class DataError(AtelierError, ValueError):
    """Bad input data; the message names ``path:line`` (or the example's source) and the problem."""


class ModelLoadError(AtelierError, ValueError):
    """A model or adapter directory that cannot be loaded (missing, truncated or mismatched files); names the file."""


class UsageError(AtelierError, ValueError):
    """A command-line argument that cannot be used (an unknown size, a count below 1); names the option."""


class WriteError(AtelierError):
    """A file or directory could not be written (disk full, a file in the way, no permission); names the path.

    ``errno`` is the OS error's number (None when the cause was not an OS error).
    """

    def __init__(self, message: str, errno_: int | None = None):
        super().__init__(message)
        self.errno = errno_


def os_error_reason(e: OSError) -> str:
    """What an OS error means for the user, without the path: "no space left ...", "permission denied", ..."""
    code = e.errno
    detail = os.strerror(code) if code is not None else str(e)
    if code in NO_SPACE:
        return f"the write failed for lack of space: disk full, quota or file-size limit reached ({detail})"
    if isinstance(e, FileNotFoundError):
        return "no such file or directory"
    if isinstance(e, FileExistsError):
        return "already exists and is not a directory (a file is in the way)"
    if isinstance(e, NotADirectoryError):
        return "a part of this path is a file, not a directory"
    if isinstance(e, IsADirectoryError):
        return "is a directory; a file was expected here"
    if isinstance(e, PermissionError):
        return "permission denied"
    if code == errno.EROFS:
        return "read-only file system"
    return detail


def write_error(path: str | os.PathLike, e: OSError, what: str = "") -> WriteError:
    """A WriteError for a failed write of ``path`` (``what`` says what was being written, e.g. "checkpoint")."""
    subject = f"{what} {path}" if what else str(path)
    culprit = f" (at {e.filename})" if e.filename and Path(e.filename) != Path(path) else ""
    return WriteError(f"{subject}: cannot write it{culprit}: {os_error_reason(e)}", e.errno)


_USER_OS_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


def user_os_error(e: OSError) -> str | None:
    """A one-line message for an OS error a user can fix, naming its path; None for any other (a bug)."""
    if not isinstance(e, _USER_OS_ERRORS) and e.errno not in NO_SPACE and e.errno != errno.EROFS:
        return None
    if e.filename is None:  # raised with a message of its own (which names the path) or by a bare write
        return str(e) if not e.errno else f"{os_error_reason(e)} ({e})"
    where = f"{e.filename} -> {e.filename2}" if e.filename2 else str(e.filename)
    return f"{where}: {os_error_reason(e)}"


def decode_utf8(data: bytes, path: str | os.PathLike, error: type[AtelierError] = DataError) -> str:
    """``data`` (the contents of ``path``) as text; a byte that is not UTF-8 is ``error`` naming path:line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x}); save the file as UTF-8") from None


def one_line(message: str) -> str:
    """The message on one line: the CLI prints exactly one line per error."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


__all__ = ["AtelierError", "DataError", "ModelLoadError", "UsageError", "WriteError", "NO_SPACE", "os_error_reason",
           "write_error", "user_os_error", "decode_utf8", "one_line"]
