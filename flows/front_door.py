"""`atelier deploy`, `atelier run`, `atelier runs`: the deployments through Prefect's own API.

    atelier deploy [--pool atelier-gpu] [--gpus N] [--prefect-file FILE]
        the process work pool (created when missing), the global concurrency limit `gpu` with N slots (one per GPU a
        worker of the pool drives; a training run holds `nproc` of them), then `prefect deploy --all` on
        prefect.yaml (the cwd's, else the one shipped in the package)
    atelier run DEPLOYMENT [--config X] [--set k=v ...] [--timeout S]
        a flow run of DEPLOYMENT (`train-designer`, or `flow/deployment`), its logs followed to the end; the exit
        code is the final state's: 0 Completed, 1 anything else. For the trainers --config is a TOML file or a
        shipped name and each --set a typed config key (`train.lr=3e-4`, sent as the typed `params`, so the server
        checks it against the parameter schema); for the other flows --set names a flow parameter (`out_dir=...`)
    atelier runs [--limit N]
        recent flow runs: state, start, output folder, MFU (read from the runs' artifacts)

Bad input (an unknown deployment, a bad --set, a config that is neither a file nor a shipped name, a value the
parameter schema refuses, no server) is one line, exit 2, before any run is created.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from atelier_studio.pipeline.errors import AtelierError, UsageError

DEFAULT_POOL = "atelier-gpu"
TRAINERS = {"train-designer": "designer", "train-imagegen": "imagegen"}
WAITING_HINT_S = 30.0  # a run still scheduled after this long: say which pool needs a worker
# a final run's log lines still arriving: the worker's log handler sends a batch every 2 s (Prefect's default
# logging.to_api.batch_interval) and its last when the flow's process ends; this long with none means all are in
LOG_SETTLE_S = 6.0


class FrontDoorError(AtelierError):
    """No server, or the server refused a request; the message says which and what to do."""


def _server(command: str):
    from atelier_studio.flows.local_server import ServerNotRunning, require_server

    try:
        return require_server(command)
    except ServerNotRunning as e:
        raise FrontDoorError(str(e).replace("`make serve`", "`atelier serve`")) from None


# ----------------------------------------------------------------------------- deploy


def ensure_pool_and_gpu_limit(client, pool: str, gpus: int) -> list[str]:
    """The process work pool `pool` (created with the process worker's job template when missing) and the global
    concurrency limit `gpu` with `gpus` slots (created, or its limit set); returns what was done, one line each."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    from atelier_studio.flows.training import GPU_LIMIT

    done = []
    try:
        found = client.read_work_pool(pool)
        done.append(f"work pool {pool} ({found.type}) exists")
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                               base_job_template=ProcessWorker.get_default_base_job_template()))
        done.append(f"work pool {pool} (process) created")
    client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, gpus)
    done.append(f"global concurrency limit {GPU_LIMIT}: {gpus} slot(s)")
    return done


def deploy(pool: str = DEFAULT_POOL, gpus: int = 1, prefect_file: str | None = None) -> int:
    from prefect.client.orchestration import get_client

    from atelier_studio.flows.local_server import child_env
    from atelier_studio.flows.shipped import prefect_yaml

    if gpus < 1:
        raise UsageError(f"--gpus {gpus}: must be >= 1 (one slot per GPU a worker of the pool drives)")
    path = Path(prefect_file) if prefect_file else Path("prefect.yaml")
    if not path.is_file():
        if prefect_file:
            raise UsageError(f"--prefect-file {prefect_file}: no such file")
        path = prefect_yaml()
    ep = _server("atelier deploy")
    with get_client(sync_client=True) as client:
        for line in ensure_pool_and_gpu_limit(client, pool, gpus):
            print(line)
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(path)]
    if pool != DEFAULT_POOL:
        cmd += ["--pool", pool]
    print(f"$ prefect deploy --all --prefect-file {path}" + (f" --pool {pool}" if pool != DEFAULT_POOL else ""),
          flush=True)
    code = subprocess.call(cmd, env=child_env(ep))
    if code == 0:
        print(f"start a worker on each GPU machine: prefect worker start --pool {pool}")
    return code


# ----------------------------------------------------------------------------- run


def deployment_name(name: str) -> str:
    """`train-designer` → `train-designer/default`; `flow/deployment` as it is."""
    return name if "/" in name else f"{name}/default"


def run_parameters(flow_name: str, schema: dict, config: str | None, sets: Sequence[str]) -> dict[str, Any]:
    """The flow run's parameters from --config and --set, checked here (each problem a UsageError or ConfigError)."""
    kind = TRAINERS.get(flow_name)
    if kind is not None:
        from atelier_studio.flows.params import params_from_sets
        from atelier_studio.flows.shipped import resolve_config
        from atelier_studio.flows.training import config_class

        params: dict[str, Any] = {}
        if config is not None:
            path = resolve_config(config, kind)  # a file here (sent absolute) or a shipped name (sent as it is)
            params["config"] = str(path.resolve()) if Path(config).is_file() else config
        model = _params_model(kind)
        values = params_from_sets(model, config_class(kind), list(sets))
        if values:
            params["params"] = values
        return params
    if config is not None:
        raise UsageError(f"--config: {flow_name} takes no trainer config (its parameters: "
                         f"{', '.join(schema.get('properties', {}))}); use --set NAME=VALUE")
    known = schema.get("properties", {})
    params = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: expected NAME=VALUE, e.g. --set out_dir=runs/eval")
        if key.strip() not in known:
            raise UsageError(f"--set {item}: {flow_name} has no parameter {key.strip()!r}; its parameters: "
                             f"{', '.join(known)}")
        try:
            params[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            params[key.strip()] = raw  # a plain word is a string
    return params


def _params_model(kind: str):
    if kind == "designer":
        from atelier_studio.flows.train_designer import DesignerParams

        return DesignerParams
    from atelier_studio.flows.train_imagegen import ImagegenParams

    return ImagegenParams


def _refused(e: Exception) -> str:
    """The server's reason for refusing a request (a 409 on parameters that do not fit the schema, ...)."""
    response = getattr(e, "response", None) or getattr(getattr(e, "http_exc", None), "response", None)
    try:
        detail = response.json().get("detail") if response is not None else None
    except ValueError:
        detail = None
    return str(detail or e)


def run(name: str, config: str | None = None, sets: Sequence[str] = (), timeout: float = 0.0,
        poll_s: float = 1.0) -> int:
    """Create a flow run of deployment `name` and follow its logs to its final state; 0 when Completed."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

    _server("atelier run")
    full = deployment_name(name)
    with get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(full)
        except ObjectNotFound:
            known = sorted(f"{f.name}/{d.name}" for d, f in _deployments(client))
            raise UsageError(f"no deployment {full}; deployed: {', '.join(known) or 'none'} "
                             f"(`atelier deploy`, or `atelier serve` for the local serve process)") from None
        flow_name = full.split("/")[0]
        params = run_parameters(flow_name, dep.parameter_openapi_schema or {}, config, sets)
        try:
            fr = client.create_flow_run_from_deployment(dep.id, parameters=params)
        except PrefectHTTPStatusError as e:  # the server refused: 409 for values the schema does not allow
            raise FrontDoorError(f"{full}: the server refused the run's parameters: {_refused(e)}") from None
        print(f"flow run {fr.name} ({fr.id}) of {full}, parameters {json.dumps(params)}", flush=True)
        return follow(client, fr.id, dep.work_pool_name, timeout, poll_s)


def _deployments(client) -> list[tuple[Any, Any]]:
    deps = client.read_deployments()
    flows = {f.id: f for f in client.read_flows()}
    return [(d, flows[d.flow_id]) for d in deps if d.flow_id in flows]


def follow(client, flow_run_id, pool: str | None, timeout: float, poll_s: float) -> int:
    """Print the run's log lines and state changes until its state is final; the exit code is 0 for Completed."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    start, seen, last_state, hinted, settled = time.monotonic(), 0, None, False, None
    while True:
        fr = client.read_flow_run(flow_run_id)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                offset=seen, sort=LogSort.TIMESTAMP_ASC)
        for entry in logs:
            print(f"{entry.timestamp:%H:%M:%S} {entry.message}", flush=True)
        seen += len(logs)
        state = fr.state
        if state is not None and state.name != last_state:
            print(f"state: {state.name}", flush=True)
            last_state = state.name
        if state is not None and state.is_final():
            # the worker ships its log lines in batches and the last ones when its process ends, after the state
            # is final: wait for them until none has come for LOG_SETTLE_S (on a busy machine seconds late)
            if logs:
                settled = time.monotonic()
                continue
            if settled is None:
                settled = time.monotonic()
            if time.monotonic() - settled < LOG_SETTLE_S:
                time.sleep(poll_s)
                continue
            return 0 if state.is_completed() else 1
        waited = time.monotonic() - start
        if not hinted and waited > WAITING_HINT_S and state is not None and state.is_scheduled():
            print(f"still {state.name} after {waited:.0f} s: is a worker polling pool {pool}? "
                  f"(prefect worker start --pool {pool})", flush=True)
            hinted = True
        if timeout and waited > timeout:
            print(f"atelier run: gave up following after {timeout:.0f} s (the run goes on: {flow_run_id})",
                  file=sys.stderr)
            return 1
        time.sleep(poll_s)


# ----------------------------------------------------------------------------- runs

_MFU = re.compile(r"\|\s*MFU\s*\|\s*([^|]+?)\s*\|")


def recent_runs(client, limit: int = 20) -> list[dict[str, Any]]:
    """The newest flow runs: flow, name, state, start, output folder and MFU (from their artifacts), newest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    from atelier_studio.flows.training import OUTPUT_LINE

    runs = client.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=limit)
    if not runs:
        return []
    flows = {f.id: f.name for f in client.read_flows()}
    arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in runs])))
    out = []
    for r in runs:
        mine = [a for a in arts if a.flow_run_id == r.id and isinstance(a.data, str)]
        output = next((a.data.split("\n")[0].removeprefix(OUTPUT_LINE) for a in mine
                       if a.data.startswith(OUTPUT_LINE)), None)
        output = output or r.parameters.get("out_dir")
        mfu = next((m.group(1) for a in mine if (a.key or "").endswith("-summary") and (m := _MFU.search(a.data))),
                   None)
        out.append({"flow": flows.get(r.flow_id, "?"), "name": r.name, "state": r.state.name if r.state else "?",
                    "start": f"{r.start_time:%Y-%m-%d %H:%M}" if r.start_time else "-", "output": output or "-",
                    "mfu": mfu or "-", "id": str(r.id)})
    return out


def runs(limit: int = 20) -> int:
    from prefect.client.orchestration import get_client

    _server("atelier runs")
    with get_client(sync_client=True) as client:
        rows = recent_runs(client, limit)
    if not rows:
        print("no flow runs yet (`atelier run train-designer`)")
        return 0
    cols = ("flow", "name", "state", "start", "mfu", "output")
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols[:-1]}
    print("  ".join(c.upper().ljust(widths.get(c, 0)) for c in cols))
    for r in rows:
        print("  ".join(r[c].ljust(widths.get(c, 0)) for c in cols))
    return 0
