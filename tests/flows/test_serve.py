"""The zero-setup path: `atelier serve` (server + serve process), `prefect deployment run ... --watch`,
`atelier serve --stop`.

One test, about 2-3 minutes on 2 cores: a fresh SQLite server takes 30-60 s to become healthy. It runs on a free
port with its own PREFECT_HOME, so a developer's own `make serve` on 4200 is left alone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from atelier_studio.flows.local_server import Endpoint, ServerNotRunning, require_server
from atelier_studio.flows.serve import DEPLOYMENTS

from tests.flows.conftest import designer_config

ROOT = Path(__file__).parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_not_running_names_make_serve():
    ep = Endpoint(f"http://127.0.0.1:{free_port()}/api", Path("/nonexistent"))
    with pytest.raises(ServerNotRunning, match=r"no Prefect server answers at .*make serve"):
        require_server("prefect deployment run", ep)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_serve_start_deployment_run_watch_and_stop(designer_world, tmp_path):
    home = tmp_path / "prefect-home"
    api = f"http://127.0.0.1:{free_port()}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "DO_NOT_TRACK": "1"}
    # `atelier serve` (start), `--status`, `--stop`: the user's spelling of flows/serve.py's commands
    flag = {"start": [], "status": ["--status"], "stop": ["--stop"]}
    serve = lambda cmd: subprocess.run([sys.executable, "-m", "atelier_studio.flows.cli", "serve", *flag[cmd]],  # noqa: E731
                                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = tmp_path / "run"
    cfg = designer_config(designer_world, out, max_steps=4, save_every=2)
    try:
        started = serve("start")
        assert started.returncode == 0, started.stdout + started.stderr
        assert "serving train-designer/default" in started.stdout
        status = json.loads(serve("status").stdout)
        assert status["healthy"] and status["deployments"] == list(DEPLOYMENTS)  # render-briefs/default among them
        pids = [status["server_pid"], status["serve_pid"]]
        run = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "train-designer/default",
                              "--params", json.dumps({"config": str(cfg)}), "--watch", "--watch-timeout", "300"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "Completed" in run.stdout
        assert json.loads((out / "summary.json").read_text())["step"] == 4
        req = urllib.request.Request(f"{api}/artifacts/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        keys = {a["key"] for a in json.load(urllib.request.urlopen(req, timeout=10))}
        assert {"train-designer-summary", "train-designer-metrics", "designer-progress"} <= keys
        assert (home / "logs" / "server.log").is_file() and (home / "logs" / "serve.log").is_file()
    finally:
        stopped = serve("stop")
    assert stopped.returncode == 0 and "serve, server" in stopped.stdout
    assert not any(alive(p) for p in pids)
    with pytest.raises(ServerNotRunning):
        require_server("test", Endpoint(api, home))
