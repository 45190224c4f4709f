"""flows/demo.py against a real Prefect server: a re-run of `make demo` follows a deployment run that an earlier one
left going instead of starting a second run on the same output folder."""

from __future__ import annotations

import asyncio

import pytest

from atelier_studio.flows.demo import live_run

pytestmark = pytest.mark.usefixtures("prefect_harness")


def test_live_run_finds_the_run_that_has_not_ended_and_only_for_its_deployment():
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Completed, Running

    @flow(name="demo-probe")
    def probe() -> None:
        pass

    async def setup() -> tuple:
        async with get_client() as client:
            flow_id = await client.create_flow(probe)
            dep_id = await client.create_deployment(flow_id=flow_id, name="default")
            other_id = await client.create_deployment(flow_id=flow_id, name="other")
            run = await client.create_flow_run_from_deployment(dep_id)
            await client.create_flow_run_from_deployment(other_id, state=Completed())
            return client, run

    async def set_state(run_id, state) -> None:
        async with get_client() as client:
            await client.set_flow_run_state(run_id, state, force=True)

    _, run = asyncio.run(setup())
    url = PREFECT_API_URL.value()
    assert live_run("demo-probe/default", url) == (str(run.id), run.name)  # scheduled: it will run
    asyncio.run(set_state(run.id, Running()))
    assert live_run("demo-probe/default", url) == (str(run.id), run.name)
    assert live_run("demo-probe/other", url) is None  # its one run has ended
    asyncio.run(set_state(run.id, Completed()))
    assert live_run("demo-probe/default", url) is None
