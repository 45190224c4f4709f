"""The local Prefect server and the process serving Atelier's deployments: start, stop, status, run.

    atelier serve [--stop | --status | --foreground]    # the same commands, the spelling for users

Why a wrapper and not `prefect server start --background` / `prefect server stop`: those start and stop the server
only. This also (1) starts the process that serves the six deployments (Prefect's `serve()`, which runs in the
foreground and has no background mode) and waits until the API lists all of them, so the command returns when a
`prefect deployment run` would be picked up; (2) stops that process before the server, as a process group, so
the runs it started and their trainers (torchrun and its workers, flows/launch.py) end with it instead of
outliving the server; (3) reuses a server that already answers, and refuses a remote PREFECT_API_URL that does
not, naming it. The production path needs none of this: prefect.yaml, `prefect deploy --all` and workers
(docs/deploy.md).

    python -m atelier_studio.flows.serve start    # `make serve`: server (SQLite under PREFECT_HOME) + serve process,
                                                  # in the background
    python -m atelier_studio.flows.serve stop     # `make stop`: the serve process first (no new runs picked up), then
                                                  # the server
    python -m atelier_studio.flows.serve status
    python -m atelier_studio.flows.serve run      # foreground: serve the deployments (what `start` runs in the
                                                  # background)

Served deployments, all named `default`: train-designer/default, train-imagegen/default,
brief-to-image-eval/default, brief-to-image/default, render-briefs/default, improve-designer/default; start
one with `prefect deployment run train-designer/default --watch --watch-timeout 1800`.

The API URL and home come from Prefect's settings: the checkout's prefect.toml says http://127.0.0.1:4200/api,
the Makefile sets PREFECT_HOME to the checkout's .prefect (else Prefect's ~/.prefect). When PREFECT_API_URL names
anything else (a user's own server), `start` uses that server and starts only the serve process. Logs go to
<PREFECT_HOME>/logs/{server,serve}.log and pid files to <PREFECT_HOME>/{server,serve}.pid; each process leads its
own process group so `stop` ends its children (the serve process's flow runs and their trainers) too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Sequence

from atelier_studio.flows.launch import kill_process_group
from atelier_studio.flows.local_server import (
    Endpoint,
    ServerNotRunning,
    child_env,
    endpoint,
    healthy,
    require_server,
)

DEPLOYMENTS = ("train-designer/default", "train-imagegen/default", "brief-to-image-eval/default",
               "brief-to-image/default", "render-briefs/default", "improve-designer/default")
SERVER_START_TIMEOUT_S = 180.0  # a fresh SQLite server takes 30-60 s to become healthy on 2 cores
SERVE_START_TIMEOUT_S = 120.0


def served_deployments(ep: Endpoint) -> list[str]:
    """Which of DEPLOYMENTS the API knows (a served deployment is registered when its serve process starts)."""
    req = urllib.request.Request(f"{ep.api_url.rstrip('/')}/deployments/filter", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            deps = json.load(r)
        flows_req = urllib.request.Request(f"{ep.api_url.rstrip('/')}/flows/filter", data=b"{}", method="POST",
                                           headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(flows_req, timeout=5) as r:
            flow_names = {f["id"]: f["name"] for f in json.load(r)}
    except (urllib.error.URLError, OSError, ValueError):
        return []
    have = {f"{flow_names.get(d['flow_id'], '?')}/{d['name']}" for d in deps}
    return [d for d in DEPLOYMENTS if d in have]


# ----------------------------------------------------------------------------- pid files


def read_pid(ep: Endpoint, name: str) -> int | None:
    f = ep.path(f"{name}.pid")
    try:
        pid = int(f.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        f.unlink(missing_ok=True)  # stale: the process is gone
        return None
    except PermissionError:
        pass
    return pid


def _spawn(ep: Endpoint, name: str, cmd: Sequence[str]) -> int:
    logs = ep.path("logs")
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=Path.cwd(), env=child_env(ep), start_new_session=True)
    ep.path(f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def _log_tail(ep: Endpoint, name: str, n: int = 20) -> str:
    f = ep.path("logs") / f"{name}.log"
    if not f.is_file():
        return "(no log)"
    return "\n".join(f.read_text(errors="replace").splitlines()[-n:])


def _wait(what: str, ep: Endpoint, name: str, pid: int, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if read_pid(ep, name) is None or _exited(pid):
            raise RuntimeError(f"{what} exited during startup; see {ep.path('logs') / (name + '.log')}:\n"
                               f"{_log_tail(ep, name)}")
        time.sleep(1.0)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s; see {ep.path('logs') / (name + '.log')}:\n"
                       f"{_log_tail(ep, name)}")


def _exited(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap it if it is our child and has exited
        return done == pid
    except ChildProcessError:
        return False  # not our child (started by an earlier command): read_pid checks it


# ----------------------------------------------------------------------------- commands


def start(ep: Endpoint | None = None, server_timeout: float = SERVER_START_TIMEOUT_S,
          serve_timeout: float = SERVE_START_TIMEOUT_S) -> Endpoint:
    """Start the local server (unless one answers, or the URL is not local) and the serve process; idempotent."""
    ep = ep or endpoint()
    ep.home.mkdir(parents=True, exist_ok=True)
    if healthy(ep):
        print(f"Prefect server already answers at {ep.api_url}")
    elif not ep.local:
        raise ServerNotRunning(f"PREFECT_API_URL={ep.api_url} is not local and does not answer; start that server, "
                               f"or unset PREFECT_API_URL to use the local one")
    else:
        pid = _spawn(ep, "server", [sys.executable, "-m", "prefect", "server", "start", "--host", ep.host,
                                    "--port", str(ep.port)])
        print(f"starting the Prefect server (pid {pid}, database {ep.home / 'prefect.db'}); waiting for "
              f"{ep.api_url}/health (up to {server_timeout:.0f} s) ...", flush=True)
        _wait("the Prefect server", ep, "server", pid, lambda: healthy(ep), server_timeout)
    if read_pid(ep, "serve") is not None and len(served_deployments(ep)) == len(DEPLOYMENTS):
        print(f"already serving {', '.join(DEPLOYMENTS)}")
    else:
        pid = _spawn(ep, "serve", [sys.executable, "-m", "atelier_studio.flows.serve", "run"])
        print(f"starting the serve process (pid {pid}) ...", flush=True)
        _wait("the serve process", ep, "serve", pid, lambda: len(served_deployments(ep)) == len(DEPLOYMENTS),
              serve_timeout)
        print(f"serving {', '.join(DEPLOYMENTS)}")
    print(f"Prefect UI: {ep.ui_url}   logs: {ep.path('logs')}   stop with `make stop`")
    return ep


def stop(ep: Endpoint | None = None) -> list[str]:
    """Stop the serve process (and its flow runs) first, then the server; only processes started here."""
    ep = ep or endpoint()
    stopped = []
    for name in ("serve", "server"):
        pid = read_pid(ep, name)
        if pid is None:
            continue
        kill_process_group(pid, grace_s=15.0)
        _exited(pid)
        ep.path(f"{name}.pid").unlink(missing_ok=True)
        stopped.append(name)
    print(f"stopped: {', '.join(stopped)}" if stopped else "nothing to stop (no serve or server pid file)")
    return stopped


def status(ep: Endpoint | None = None) -> dict:
    ep = ep or endpoint()
    st = {"api_url": ep.api_url, "healthy": healthy(ep), "server_pid": read_pid(ep, "server"),
          "serve_pid": read_pid(ep, "serve"), "home": str(ep.home)}
    st["deployments"] = served_deployments(ep) if st["healthy"] else []
    return st


def run() -> None:
    """Serve the deployments (DEPLOYMENTS) in the foreground until interrupted."""
    from prefect import serve

    from atelier_studio.flows.chain import brief_to_image
    from atelier_studio.flows.evaluate import brief_to_image_eval
    from atelier_studio.flows.improve import improve_designer
    from atelier_studio.flows.render import render_briefs
    from atelier_studio.flows.train_designer import train_designer
    from atelier_studio.flows.train_imagegen import train_imagegen

    require_server("python -m atelier_studio.flows.serve run")
    serve(*(f.to_deployment(name="default") for f in (train_designer, train_imagegen, brief_to_image_eval,
                                                      brief_to_image, render_briefs, improve_designer)),
          pause_on_shutdown=False)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atelier_studio.flows.serve", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["start", "stop", "status", "run"])
    p.add_argument("--timeout", type=float, default=SERVER_START_TIMEOUT_S, help="seconds to wait for the server")
    args = p.parse_args(argv)
    try:
        if args.command == "start":
            start(server_timeout=args.timeout)
        elif args.command == "stop":
            stop()
        elif args.command == "status":
            print(json.dumps(status(), indent=1))
        else:
            run()
    except (ServerNotRunning, RuntimeError, TimeoutError) as e:
        print(f"flows.serve {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM from `stop` → KeyboardInterrupt → clean exit
    sys.exit(main())
