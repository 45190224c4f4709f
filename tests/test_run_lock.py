"""Two training processes on one output.dir, through the CLI: the second stops at once naming the first; after a
kill -9 of the first a new run takes the folder, resumes, and every checkpoint stays intact (pipeline/run_lock.py).

Here rather than in tests/designer (the designer's trainer is only the vehicle): the portable-numerics pass, which
reruns tests/designer, has nothing to check in it. The lock itself: tests/pipeline/test_run_lock.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from atelier_studio.flows.cli import main
from atelier_studio.pipeline.checkpoint_files import list_checkpoints, verify_checkpoint
from atelier_studio.pipeline.run_lock import LOCK_NAME, acquire_run_lock

from tests.designer.conftest import world  # noqa: F401  (the fixture: a tokenizer and a tiny random Qwen3)
from tests.designer.test_train import ROOT, _spawn, train_args, train_losses


def test_a_second_run_on_a_live_runs_folder_stops_and_a_kill_9_frees_it(world, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--set", "lora.rank=4", "--set", "train.max_steps=16", "--set", "train.save_every=2",
              "--set", "train.keep_checkpoints=0", "--set", "train.eval_every=0"]
    first = _spawn(train_args(world, out, *common))
    try:
        deadline = time.time() + 120  # a bound on the wait for the first run's checkpoint, never a pause
        while not (out / "checkpoints" / "step-4").is_dir():
            assert first.poll() is None, first.stdout.read()
            assert time.time() < deadline, "the first run wrote no step-4 checkpoint in 120 s"
            time.sleep(0.005)
        config_before = (out / "config.toml").read_bytes()

        # the second run: refused before it reads or writes anything in the folder
        assert main(train_args(world, out, *common)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("atelier: error: output.dir ") and "Traceback" not in err
        assert f"in use by another run: pid {first.pid} on host {socket.gethostname()}" in err
        assert "use another output.dir, or wait for that run to end" in err
        assert first.poll() is None, "the first run ended before the second one started: nothing was tested"
        assert (out / "config.toml").read_bytes() == config_before
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        first.stdout.close()
    killed_at = max(s for s, _ in train_losses(out))
    assert killed_at < 16, "the first run finished before it could be killed"
    saved = list_checkpoints(out / "checkpoints")
    for ckpt in saved:
        verify_checkpoint(ckpt)  # every checkpoint the killed run completed is intact
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == first.pid  # its lock file, but not its lock

    assert main(train_args(world, out, *common)) == 0  # the folder is free: the next run takes it and resumes
    assert f"resumed from {saved[-1]}" in capsys.readouterr().out
    assert [s for s, _ in train_losses(out)][-1] == 16
    final = list_checkpoints(out / "checkpoints")
    assert saved == final[:len(saved)] and final[-1].name == "step-16"
    for ckpt in final:
        verify_checkpoint(ckpt)
    assert not (out / LOCK_NAME).exists()


@pytest.mark.multigpu
def test_under_torchrun_every_rank_stops_when_the_folder_is_taken(world, tmp_path):
    """`--nproc 2` on a locked folder: rank 0 cannot lock it, and both ranks stop with the one-line error."""
    out = tmp_path / "run"
    out.mkdir()
    held = acquire_run_lock(out)  # this test process plays the live run
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("WORLD_SIZE", None)
        proc = subprocess.run([sys.executable, "-m", "atelier_studio.flows.cli",
                               *train_args(world, out, "--set", "lora.rank=4", "--set", "train.device=cpu",
                                           "--set", "train.micro_batch=1"), "--nproc", "2"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=300)
    finally:
        held.release()
    assert proc.returncode == 2, proc.stdout[-3000:]  # the workers' status, not the launcher's 1
    errors = [line for line in proc.stdout.splitlines() if line.startswith("atelier: error: ")]
    assert len(errors) == 2, proc.stdout[-3000:]  # one per rank, the same line
    assert errors[0] == errors[1] and f"in use by another run: pid {os.getpid()} on host" in errors[0]
    assert "Traceback" not in proc.stdout and "ChildFailedError" not in proc.stdout, proc.stdout[-3000:]
    assert list(out.iterdir()) == [], "the refused launch wrote into the folder"
