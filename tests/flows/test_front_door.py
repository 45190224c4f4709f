"""The production path with real parts, on the session's Prefect test server: `atelier deploy` (the process work pool,
the `gpu` limit, `prefect deploy --all` on prefect.yaml), the typed parameter schema read back from the API for both
trainers (a bad value refused by the server), `prefect worker start` as a subprocess in a directory that is not the
checkout, `atelier run train-designer` through it (artifacts read back, `atelier runs`), two runs on a one-slot `gpu`
limit that never overlap, and the front door's bad input (one line, exit 2).

About 100 s on 2 cores after the session's harness is up: `prefect deploy` and the worker each start a Python with
Prefect, and each flow run is a process importing Prefect and torch (3 runs of a 4-step tiny designer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from atelier_studio.flows.cli import main as atelier
from atelier_studio.flows.front_door import DEFAULT_POOL
from atelier_studio.flows.launch import kill_process_group
from atelier_studio.flows.training import GPU_LIMIT, OUTPUT_LINE

from tests.flows.conftest import designer_config

pytestmark = pytest.mark.usefixtures("prefect_harness")
ROOT = Path(__file__).parents[2]
DEPLOYMENTS = ["brief-to-image-eval/default", "brief-to-image/default", "render-briefs/default",
               "improve-designer/default", "train-designer/default", "train-imagegen/default"]


def client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


@pytest.fixture(scope="module")
def deployed(prefect_harness):
    """`atelier deploy --gpus 1` against the test server: pool, limit, and the six deployments of prefect.yaml."""
    assert atelier(["deploy", "--gpus", "1"]) == 0
    with client() as c:
        return {name: c.read_deployment_by_name(name) for name in DEPLOYMENTS}


def test_deploy_creates_the_pool_the_gpu_limit_and_every_deployment(deployed):
    with client() as c:
        assert c.read_work_pool(DEFAULT_POOL).type == "process"
        assert c.read_global_concurrency_limit_by_name(GPU_LIMIT).limit == 1
    for name, dep in deployed.items():
        assert dep.work_pool_name == DEFAULT_POOL, name
        assert dep.entrypoint.startswith("atelier_studio.flows."), name  # a module of the installed package
        assert dep.pull_steps in (None, []), name  # nothing to pull: the code is the package
        assert dep.global_concurrency_limit is not None and dep.global_concurrency_limit.limit >= 1, name


@pytest.mark.parametrize("name, section, key, type_, default", [
    ("train-designer/default", "train", "lr", "number", 1e-4),
    ("train-designer/default", "lora", "rank", "integer", None),
    ("train-imagegen/default", "flow", "loss_weighting", "string", "none"),
    ("train-imagegen/default", "train", "max_steps", "integer", 100),
])
def test_the_parameter_schema_shows_typed_config_fields(deployed, name, section, key, type_, default):
    schema = deployed[name].parameter_openapi_schema
    assert schema["properties"]["config"]["default"].endswith("/demo")
    model = schema["properties"]["params"]["anyOf"][0]["$ref"].split("/")[-1]
    defs = schema["definitions"]
    assert defs[model]["additionalProperties"] is False
    sec = defs[defs[model]["properties"][section]["$ref"].split("/")[-1]]
    field = sec["properties"][key]
    assert field.get("type") == type_ or type_ in json.dumps(field), field
    if default is not None:
        assert field["default"] == default
    assert sec["additionalProperties"] is False


def test_the_server_refuses_a_bad_value_before_any_worker(deployed, capsys):
    from prefect.exceptions import PrefectHTTPStatusError

    dep = deployed["train-designer/default"]
    with client() as c:
        for bad in ({"train": {"lr": "fast"}}, {"train": {"no_such_key": 1}}, {"lora": {"rank": 1.5}}):
            with pytest.raises(PrefectHTTPStatusError, match="409"):
                c.create_flow_run_from_deployment(dep.id, parameters={"params": bad})
        n = len(c.read_flow_runs())
    for argv, expected in ((["run", "train-designer", "--set", "train.lr=fast"], "train.lr: expected a number"),
                           (["run", "train-designer", "--set", "train.nope=1"], "train.nope: unknown key"),
                           (["run", "train-designer", "--set", "lr"], "expected KEY=VALUE"),
                           (["run", "train-designer", "--config", "missing.toml"], "missing.toml: no such file"),
                           (["run", "no-such-flow"], "no deployment no-such-flow/default; deployed: brief-to-image"),
                           (["run", "render-briefs", "--set", "nope=1"], "has no parameter 'nope'"),
                           (["run", "render-briefs", "--config", "designer/demo"], "takes no trainer config")):
        assert atelier(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("atelier: error: ") and err.count("\n") == 1 and expected in err, (argv, err)
    with client() as c:
        assert len(c.read_flow_runs()) == n  # none of them created a run


@pytest.fixture(scope="module")
def worker(deployed, tmp_path_factory):
    """`prefect worker start` on the pool, as a subprocess in a directory that is not the checkout."""
    from prefect.settings import get_current_settings

    cwd = tmp_path_factory.mktemp("worker-cwd")
    env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url), "PYTHONPATH": str(ROOT),
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1", "DO_NOT_TRACK": "1"}
    log = open(cwd / "worker.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", DEFAULT_POOL,
                             "--type", "process"], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    yield cwd
    kill_process_group(proc.pid, grace_s=10, proc=proc)
    log.close()


def artifacts(flow_run_id) -> dict[str, str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client() as c:
        found = c.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {a.key: a.data for a in found if a.key}


def test_atelier_run_through_a_worker(worker, designer_world, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = designer_config(designer_world, out, max_steps=4, save_every=2)
    code = atelier(["run", "train-designer", "--config", str(cfg), "--set", "train.max_steps=3", "--timeout", "240"])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:] + (worker / "worker.log").read_text()[-3000:]
    assert "state: Completed" in printed and "step 3/3 loss" in printed  # the trainer's lines, followed
    assert json.loads((out / "summary.json").read_text())["step"] == 3  # --set beat the TOML's max_steps = 4
    run_id = printed.split("(", 1)[1].split(")", 1)[0]
    arts = artifacts(run_id)
    # the run states its output folder, absolute, and its working directory: the worker's, not the checkout
    stated = arts["designer-output"]
    assert stated.startswith(f"{OUTPUT_LINE}{out}\n") and "working directory, /" in stated and str(ROOT) not in stated
    assert "MFU" in arts["train-designer-summary"]
    assert atelier(["runs", "--limit", "5"]) == 0
    listed = capsys.readouterr().out
    row = next(line for line in listed.splitlines() if line.startswith("train-designer"))
    assert "Completed" in row and str(out) in row


def test_a_relative_output_dir_in_the_workers_throwaway_directory_is_refused(designer_world, tmp_path, monkeypatch):
    import tempfile

    from atelier_studio.flows.training import FlowInputError, prepare_run

    cfg = designer_config(designer_world, tmp_path / "abs")
    with tempfile.TemporaryDirectory(suffix="prefect") as scratch:  # what a process worker without working_dir uses
        monkeypatch.chdir(scratch)
        with pytest.raises(FlowInputError, match=r"output.dir runs/x is relative.*working_dir job variable"):
            prepare_run("designer", str(cfg), None, ["output.dir=runs/x"])
        assert prepare_run("designer", str(cfg), None, [])[2].output.dir == str(tmp_path / "abs")  # absolute: fine
        monkeypatch.chdir(tmp_path)
    assert prepare_run("designer", str(cfg), None, ["output.dir=runs/x"])[2].output.dir == "runs/x"  # elsewhere: fine


def test_two_runs_on_one_gpu_slot_never_overlap(worker, designer_world, tmp_path):
    """The test holds the one `gpu` slot while both runs start, so both are running and waiting; once it lets go,
    the trainers run one after the other."""
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.concurrency.sync import concurrency

    with client() as c:
        dep = c.read_deployment_by_name("train-designer/default")
        c.update_deployment(dep.id, DeploymentUpdate(concurrency_limit=2))  # only the `gpu` limit is left to hold
        assert c.read_global_concurrency_limit_by_name(GPU_LIMIT).limit == 1
        deadline = time.monotonic() + 300
        with concurrency(GPU_LIMIT, occupy=1):
            runs = [c.create_flow_run_from_deployment(dep.id, parameters={
                "config": str(designer_config(designer_world, tmp_path / f"r{i}", max_steps=4, save_every=4))})
                for i in range(2)]
            while not all(c.read_flow_run(r.id).state.is_running() for r in runs):  # both started: now waiting
                assert time.monotonic() < deadline, [c.read_flow_run(r.id).state for r in runs]
                time.sleep(0.5)
            released = datetime.now().astimezone()
        while not all(c.read_flow_run(r.id).state.is_final() for r in runs):
            assert time.monotonic() < deadline, "the runs did not finish"
            time.sleep(1)
        finished = [c.read_flow_run(r.id) for r in runs]
        assert all(r.state.is_completed() for r in finished), [r.state for r in finished]
        steps = []  # each run's trainer: (first, last) time of its step lines, the span it held the slot in
        for r in runs:
            while True:  # a worker's last log lines reach the API after its run's final state (flows/front_door.py)
                logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id])), limit=200)
                times = [e.timestamp for e in logs if e.message.startswith("step ")]
                if len(times) >= 4:  # max_steps=4, log_every=1: a line a step
                    break
                assert time.monotonic() < deadline, f"{len(times)} step lines of 4 in the run's logs"
                time.sleep(1)
            steps.append((min(times), max(times)))
        c.update_deployment(dep.id, DeploymentUpdate(concurrency_limit=1))
    assert min(first for first, _ in steps) > released, f"a trainer ran while the slot was taken: {steps}, {released}"
    (_, a_last), (b_first, _) = sorted(steps)
    assert a_last < b_first, f"the trainers overlapped: {steps}"
