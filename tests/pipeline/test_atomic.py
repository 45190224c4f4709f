"""pipeline/atomic.py: a failed write leaves the old file or directory and no temporary; a killed install is undone."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atelier_studio.pipeline import atomic
from atelier_studio.pipeline.atomic import (
    atomic_dir,
    atomic_file,
    atomic_write_text,
    check_dir_path,
    ensure_dir,
    is_temporary,
    remove_stale,
    restore_aside,
    save_safetensors,
    temp_path,
)
from atelier_studio.pipeline.errors import WriteError

ROOT = Path(__file__).parents[2]


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.rglob(".*") if is_temporary(p.name))


def test_temp_names_are_hidden_unique_and_recognised(tmp_path):
    a, b = temp_path(tmp_path / "x.json"), temp_path(tmp_path / "x.json")
    assert a != b and a.parent == b.parent == tmp_path
    assert a.name.startswith(".x.json.tmp-") and is_temporary(a.name)
    assert temp_path(tmp_path / "d", token="shared").name == ".d.tmp-shared"
    assert not is_temporary("x.json") and not is_temporary(".hidden")


def test_file_write_replaces_the_old_one(tmp_path):
    f = tmp_path / "sub" / "a.txt"
    atomic_write_text(f, "old")
    atomic_write_text(f, "new")
    assert f.read_text() == "new" and not leftovers(tmp_path)


def test_exception_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file(f) as fh:
            fh.write("half of the new")
            raise RuntimeError("boom")
    assert f.read_text() == "old" and not leftovers(tmp_path)


def test_full_disk_is_a_write_error_naming_the_file(tmp_path, monkeypatch):
    f = tmp_path / "a.txt"
    f.write_text("old")

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, "fsync", no_space)
    with pytest.raises(WriteError, match=rf"metrics {f}: cannot write it: the write failed for lack of space") as e:
        atomic_write_text(f, "new", what="metrics")
    assert e.value.errno == errno.ENOSPC
    assert f.read_text() == "old" and not leftovers(tmp_path)


def test_a_directory_where_a_file_goes_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(WriteError, match=r"config .*/d: is a directory"):
        atomic_write_text(tmp_path / "d", "x", what="config")


def test_directory_install_replaces_the_old_one(tmp_path):
    d = tmp_path / "ckpt"
    for version in ("old", "new"):
        with atomic_dir(d) as tmp:
            assert tmp.parent == tmp_path and is_temporary(tmp.name)
            (tmp / "v").write_text(version)
    assert (d / "v").read_text() == "new" and not leftovers(tmp_path)


def test_exception_mid_build_leaves_the_old_directory_and_no_temporary(tmp_path):
    d = tmp_path / "ckpt"
    with atomic_dir(d) as tmp:
        (tmp / "v").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(d) as tmp:
            (tmp / "v").write_text("new")
            raise KeyboardInterrupt  # a Ctrl-C mid-write cleans up like any exception
    assert (d / "v").read_text() == "old" and not leftovers(tmp_path)


def test_failed_rename_in_puts_the_old_directory_back(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    with atomic_dir(d) as tmp:
        (tmp / "v").write_text("old")
    real = os.replace
    calls = []

    def second_rename_fails(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the first moved the old version aside; the new one cannot be renamed in
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src))
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", second_rename_fails)
    with pytest.raises(WriteError, match="read-only file system"):
        with atomic_dir(d, what="checkpoint") as tmp:
            (tmp / "v").write_text("new")
    assert (d / "v").read_text() == "old" and not leftovers(tmp_path)


KILLED_MID_INSTALL = """
import os, sys
from pathlib import Path
from atelier_studio.pipeline import atomic
real = os.replace
def replace(src, dst):
    real(src, dst)
    if Path(dst).name.startswith(".ckpt.old-"):
        os._exit(9)  # killed right after the old version was moved aside, before the new one is renamed in
atomic.os.replace = replace
with atomic.atomic_dir(Path(sys.argv[1])) as tmp:
    (tmp / "v").write_text("new")
"""


def test_a_kill_between_the_two_renames_leaves_a_version_that_restore_puts_back(tmp_path):
    d = tmp_path / "ckpt"
    with atomic_dir(d) as tmp:
        (tmp / "v").write_text("old")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = subprocess.run([sys.executable, "-c", KILLED_MID_INSTALL, str(d)], env=env, timeout=120).returncode
    assert code == 9 and not d.exists()  # killed in the window: only the aside and the temporary exist
    assert len(leftovers(tmp_path)) == 2
    assert restore_aside(d) and (d / "v").read_text() == "old"
    remove_stale(d)
    assert not leftovers(tmp_path)


def test_remove_stale_keeps_the_final_path(tmp_path):
    d = tmp_path / "ckpt"
    with atomic_dir(d) as tmp:
        (tmp / "v").write_text("v1")
    stale = temp_path(d)
    stale.mkdir()
    (stale / "half").write_text("x")
    remove_stale(d)
    assert (d / "v").read_text() == "v1" and not leftovers(tmp_path)


def test_the_next_install_deletes_a_killed_writers_temporary(tmp_path):
    d = tmp_path / "shards"
    stale = temp_path(d, token="12345-deadbeef")  # as a writer killed mid-build leaves it
    stale.mkdir()
    (stale / "shard-000000.tar").write_bytes(b"x" * 100)
    with atomic_dir(d) as tmp:
        (tmp / "index.json").write_text("{}")
    assert (d / "index.json").is_file() and not leftovers(tmp_path)


def test_a_file_in_the_way_of_a_directory_is_named(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(WriteError, match=r"output.dir .*/f: exists and is a file, not a directory"):
        check_dir_path(tmp_path / "f", "output.dir")
    with pytest.raises(WriteError, match=r"output.dir .*/f/run: .*/f is a file, not a directory"):
        check_dir_path(tmp_path / "f" / "run", "output.dir")
    with pytest.raises(WriteError, match=r"shard set .*/f/run: .*/f is a file"):
        ensure_dir(tmp_path / "f" / "run", "shard set")
    with pytest.raises(WriteError, match="exists and is a file"):
        with atomic_dir(tmp_path / "f"):
            pass
    assert (tmp_path / "f").read_text() == "x"
    assert check_dir_path(tmp_path / "new" / "run") == tmp_path / "new" / "run"  # creates nothing
    assert not (tmp_path / "new").exists()


def test_save_safetensors_reports_an_io_failure_as_the_os_error(tmp_path, monkeypatch):
    import safetensors.torch
    import torch

    def fails(tensors, path, metadata=None):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", fails)
    with pytest.raises(OSError) as e:
        save_safetensors({"a": torch.zeros(2)}, tmp_path / "m.safetensors")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "m.safetensors")
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bad")))
    with pytest.raises(RuntimeError, match="bad"):  # anything else is passed through unchanged
        save_safetensors({"a": torch.zeros(2)}, tmp_path / "m.safetensors")
