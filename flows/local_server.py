"""Where this checkout's Prefect server is, and whether it answers: the endpoint (API URL and home), the
environment every Prefect process started here gets, and the health check that the flows' command lines run
first (`require_server`). flows/serve.py starts and stops the server; the flows only need to find it.

The API URL and the home come from Prefect's own settings (environment, profile, a prefect.toml in the working
directory): the checkout's prefect.toml says http://127.0.0.1:4200/api, and the Makefile sets
PREFECT_HOME=<checkout>/.prefect; elsewhere the home is Prefect's default (~/.prefect). Nothing here depends on the
working directory being the checkout.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout (the demo's root); never used for an installed package
LOCAL_HOSTS = ("127.0.0.1", "localhost")


class ServerNotRunning(RuntimeError):
    """No Prefect API answers at the configured URL; the message says which command starts it."""


@dataclass(frozen=True)
class Endpoint:
    """Where Prefect lives for this checkout: the API URL and the home directory (database, logs, pids)."""

    api_url: str
    home: Path

    @property
    def local(self) -> bool:
        return urllib.parse.urlparse(self.api_url).hostname in LOCAL_HOSTS

    @property
    def host(self) -> str:
        return urllib.parse.urlparse(self.api_url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return urllib.parse.urlparse(self.api_url).port or 4200

    @property
    def ui_url(self) -> str:
        return self.api_url.removesuffix("/").removesuffix("/api")

    def path(self, name: str) -> Path:
        return self.home / name


def endpoint() -> Endpoint:
    """The API URL and home from Prefect's settings (env beats prefect.toml), home made absolute (against the cwd,
    as Prefect itself reads a relative PREFECT_HOME)."""
    from prefect.settings import get_current_settings

    s = get_current_settings()
    url = str(s.api.url or "http://127.0.0.1:4200/api")
    return Endpoint(url, Path(s.home).expanduser().absolute())


def child_env(ep: Endpoint) -> dict[str, str]:
    """Environment of every Prefect process started here: pinned to this endpoint, no telemetry."""
    env = dict(os.environ)
    env.update({"PREFECT_API_URL": ep.api_url, "PREFECT_HOME": str(ep.home),
                "PREFECT_SERVER_EPHEMERAL_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
    return env


# ----------------------------------------------------------------------------- health


def healthy(ep: Endpoint, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{ep.api_url.rstrip('/')}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def require_server(command: str, ep: Endpoint | None = None) -> Endpoint:
    """Raise ServerNotRunning, naming `make serve`, unless the API answers."""
    ep = ep or endpoint()
    if not healthy(ep):
        how = ("start it with `make serve` (or `python -m atelier_studio.flows.serve start`)" if ep.local else
               "that is PREFECT_API_URL: start that server, or unset PREFECT_API_URL to use the local one "
               "(`make serve`)")
        raise ServerNotRunning(f"{command}: no Prefect server answers at {ep.api_url}; {how}")
    return ep
