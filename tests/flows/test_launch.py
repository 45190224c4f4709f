"""flows/launch.py: step-line parsing, streaming, failures with the output tail, process-group kill on cancel."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from atelier_studio.flows.launch import (
    TrainerFailed,
    kill_recorded_trainers,
    parse_step_line,
    pid_dir,
    run_command,
    trainer_command,
)
from atelier_studio.pipeline.progress import format_step_line

ROOT = Path(__file__).parents[2]


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a container's init may never reap orphans)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("unit,label", [("tokens", "tok/s"), ("images", "img/s")])
def test_parse_step_line_reads_the_trainers_own_format(unit, label):
    record = {"loss": 2.34567, "lr": 1.234e-4, f"{unit}_per_s": 1234.56, "mfu": 0.1234}
    line = format_step_line(12, 100, record, unit, eta=90.0)
    rec = parse_step_line(line)
    assert rec == {"step": 12, "total": 100, "loss": 2.3457, "lr": 1.23e-4, "unit": label, "rate": 1234.6,
                   "mfu": pytest.approx(0.123), "eta": "0:01:30"}
    # minimal line: no lr, rate, mfu or eta (a CPU run has no MFU)
    assert parse_step_line(format_step_line(3, 7, {"loss": 0.5}, unit, None)) == {"step": 3, "total": 7, "loss": 0.5}
    assert parse_step_line("saved runs/d1/checkpoints/step-100") is None
    assert parse_step_line("eval step 3: loss 5.9990 ppl 403.0398") is None


def test_trainer_command():
    assert trainer_command(["designer", "train"])[1:] == ["-m", "atelier_studio.flows.cli", "designer", "train"]
    cmd = trainer_command(["imagegen", "train"], nproc=4)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=4" in cmd
    assert cmd[-4:] == ["-m", "atelier_studio.flows.cli", "imagegen", "train"]
    with pytest.raises(ValueError, match="nproc"):
        trainer_command([], nproc=0)


def test_lines_are_streamed_while_the_process_runs(tmp_path):
    """The child waits for a file that the log callback creates on the first line: only streaming gets it there."""
    flag = tmp_path / "seen"
    child = textwrap.dedent(f"""
        import os, time
        print("step 1/2 loss 1.5000", flush=True)
        deadline = time.time() + 20
        while not os.path.exists({str(flag)!r}):
            if time.time() > deadline:
                raise SystemExit("line was not streamed")
            time.sleep(0.02)
        print("step 2/2 loss 1.2500", flush=True)
    """)
    got = []

    def log(line: str) -> None:
        got.append(line)
        flag.touch()

    rc, summary = run_command([sys.executable, "-c", child], log=log)
    assert rc == 0 and got == ["step 1/2 loss 1.5000", "step 2/2 loss 1.2500"]
    assert summary["last_step"] == {"step": 2, "total": 2, "loss": 1.25} and summary["lines"] == 2


def test_nonzero_exit_raises_with_the_tail_of_the_output():
    child = "import sys\nfor i in range(100): print(f'line {i}')\nsys.stderr.write('boom: bad thing\\n'); sys.exit(3)"
    with pytest.raises(TrainerFailed) as e:
        run_command([sys.executable, "-c", child], log=lambda s: None)
    assert e.value.returncode == 3
    msg = str(e.value)
    assert "exited with code 3" in msg and "boom: bad thing" in msg and "line 99" in msg
    assert "line 0\n" not in msg  # only the tail
    rc, summary = run_command([sys.executable, "-c", child], log=lambda s: None, check=False)
    assert rc == 3 and summary["tail"][-1] == "boom: bad thing"


def test_trainer_runs_the_cli(tmp_path):
    with pytest.raises(TrainerFailed, match="no-such-command|invalid choice"):
        from atelier_studio.flows.launch import run_trainer

        run_trainer(["no-such-command"], log=lambda s: None, cwd=ROOT)


# A "trainer" that ignores SIGTERM (so only SIGKILL ends it) and has a grandchild, as torchrun's workers are.
TRAINER = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(f"pids {__import__('os').getpid()} {grandchild.pid}", flush=True)
    time.sleep(300)
""")

# The flow-run process: Prefect's engine turns SIGTERM into TerminationSignal; SIGINT is KeyboardInterrupt. The
# wrapper sets SIGINT's handler itself: a process inherits an ignored SIGINT from its parent (an ignored signal
# survives exec), and Python then installs no KeyboardInterrupt handler. A non-interactive shell ignores SIGINT in
# every command it starts with `&` (POSIX, when job control is off), so `make test &` in a script runs pytest, and
# every process it starts, with SIGINT ignored; without its own handler the wrapper would never hear it.
WRAPPER = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from prefect.exceptions import TerminationSignal
    from atelier_studio.flows.launch import run_command

    def on_term(signum, frame):
        raise TerminationSignal(signal=signum)

    signal.signal(signal.SIGTERM, on_term)
    run_command([sys.executable, "-c", sys.argv[1]], log=lambda s: print(s, flush=True), kill_grace_s=1.0)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cancel_kills_the_whole_process_group(sig):
    wrapper = subprocess.Popen([sys.executable, "-c", WRAPPER, TRAINER], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        line = wrapper.stdout.readline()
        while line and not line.startswith("pids "):
            line = wrapper.stdout.readline()
        assert line.startswith("pids "), f"the trainer never started: {line!r}"
        child, grandchild = map(int, line.split()[1:])
        assert alive(child) and alive(grandchild)
        wrapper.send_signal(sig)
        # What this test claims: the trainer and its grandchild die (within the 1 s grace, then SIGKILL); the
        # wrapper's own exit comes after, with its own wait, and its output is shown if it never exits.
        deadline = time.time() + 30
        while (alive(child) or alive(grandchild)) and time.time() < deadline:
            time.sleep(0.05)
        assert not alive(child) and not alive(grandchild), (
            f"the trainer group outlived {signal.Signals(sig).name} (this process's SIGINT disposition: "
            f"{signal.getsignal(signal.SIGINT)})")
        try:
            wrapper.wait(timeout=90)
        except subprocess.TimeoutExpired:
            wrapper.kill()
            pytest.fail(f"the flow-run process killed its trainer but did not exit; its output:\n"
                        f"{wrapper.communicate(timeout=10)[0][-3000:]}")
    finally:
        if wrapper.poll() is None:
            wrapper.kill()


def test_cancellation_hook_kills_recorded_trainers():
    """The serving process runs the hook after the flow-run process is gone: the pid file is all it has."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    run_id = "00000000-test-hook"
    f = pid_dir() / f"{run_id}-{proc.pid}.pgid"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(str(proc.pid))
    try:
        assert kill_recorded_trainers(run_id, grace_s=2.0) == [proc.pid]
        assert proc.wait(timeout=5) == -signal.SIGTERM
        assert not f.exists()
        assert kill_recorded_trainers(run_id) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        f.unlink(missing_ok=True)
