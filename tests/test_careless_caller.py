"""A careless caller, on a real nats-server: the mistakes a busy developer makes with the
``Client`` end in a typed error before anything is sent, or at once — never in work done twice,
a wait long past its timeout, an answer thrown away, or a client wedged for good.

(Found by an audit that used only the README and the ``Client`` docstrings.)
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from typing import Any

import pytest

from reach_mesh import (
    BadRequestError,
    Client,
    MeshSettings,
    MeshTimeoutError,
    MeshUnavailableError,
    Step,
    TaskState,
    WorkflowSpecError,
)
from reach_mesh.hub import Hub

from .helpers import Fleet, echo_agent, held_handler, relayed

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("timeout", [None, "30", True, float("nan")])
async def test_a_waited_workflow_without_seconds_is_refused_before_it_is_sent(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, timeout: Any
) -> None:
    """``fanout``/``chain`` wait for the result, so their timeout must be seconds. ``None``
    (which ``submit_*`` take) and ``"30"`` passed the spec's checks: the workflow was submitted,
    then the wait's arithmetic raised a ``TypeError`` naming no workflow, and a caller that
    retried ran the work twice."""
    await echo_agent(fleet, "careless.a1", "wf:charge:v1").start()
    steps = [Step(capability="wf:charge:v1", payload={"order": 1}, task_id="charge-1")]
    async with Client(settings=wf_settings) as mesh:
        for call in (mesh.fanout, mesh.chain):
            with pytest.raises(WorkflowSpecError, match="invalid timeout") as err:
                await call(steps, timeout=timeout)
            assert err.value.details["field"] == "timeout"
        listed = await mesh.list_workflows()
        assert listed.workflows == [] and fleet.runs["charge-1"] == 0
        # The same steps with seconds run once.
        res = await mesh.fanout(steps, timeout=10)
        assert res.state is TaskState.SUCCEEDED and fleet.runs["charge-1"] == 1


async def test_step_retries_are_checked_with_the_step(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """``Step(retries=...)`` is checked as the rest of the step is: before anything is sent,
    naming the step (it went in unchecked: ``-1`` or ``1000`` came back as a FAILED workflow
    refused by the hub, ``"2"`` with a pydantic serializer warning)."""
    await echo_agent(fleet, "careless.a2", "wf:retries:v1").start()
    async with Client(settings=wf_settings) as mesh:
        for retries in (-1, 1000):
            with pytest.raises(WorkflowSpecError) as err:
                await mesh.fanout([Step(capability="wf:retries:v1", retries=retries)])
            assert err.value.details["field"] == "steps.0.retry.retries"
        with pytest.raises(WorkflowSpecError) as bad:
            await mesh.chain(
                [Step(capability="wf:retries:v1"), Step(capability="x:y:v1", timeout=0)]
            )
        assert bad.value.details["field"] == "steps.1.timeout"
        assert (await mesh.list_workflows()).workflows == []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a serializer warning fails the test
            res = await mesh.fanout([Step(capability="wf:retries:v1", retries="2")])  # type: ignore[arg-type]
        assert res.state is TaskState.SUCCEEDED


async def test_a_payload_that_is_no_json_is_bad_input(hub: Hub, settings: MeshSettings) -> None:
    """A payload JSON cannot hold (an object, bytes that are no UTF-8): ``BadRequestError``
    (a ``WorkflowSpecError`` in a step) naming the payload, not pydantic's own error."""
    async with Client(settings=settings) as mesh:
        for payload in (object(), b"\xff"):
            with pytest.raises(BadRequestError, match="cannot be written as JSON") as err:
                await mesh.request(capability="any:thing:v1", payload=payload)
            assert err.value.details["field"] == "payload"
        with pytest.raises(WorkflowSpecError, match="cannot be written as JSON"):
            await mesh.submit_fanout([Step(capability="any:thing:v1", payload=object())])


async def test_closing_the_client_ends_its_requests_at_once(
    hub: Hub, fleet: Fleet, settings: MeshSettings
) -> None:
    """A request in flight when its client closes ends at once (``MeshUnavailableError``), as
    a workflow wait did: it waited its whole timeout and then blamed the hub
    (``MeshTimeoutError``). A closed client's calls fail at once, typed (a request raised
    nats-py's ``ConnectionClosedError``; ``submit_fanout`` retried for 15 s and blamed the
    cluster)."""
    agent = fleet.agent("careless.held")
    held = held_handler(agent, "work:held:v1", answer=1)
    await agent.start()
    mesh = await Client(settings=settings).connect()
    asked = asyncio.create_task(mesh.request(capability="work:held:v1", timeout=20))
    await asyncio.wait_for(held.started.wait(), 5)
    began = time.monotonic()
    await mesh.close()
    with pytest.raises(MeshUnavailableError, match="client was closed"):
        await asyncio.wait_for(asked, 5)
    assert time.monotonic() - began < 2
    held.release.set()
    began = time.monotonic()
    for call in (
        mesh.request(capability="work:held:v1"),
        mesh.submit_fanout([Step(capability="work:held:v1")]),
        mesh.workflow("careless-1"),
        mesh.list_workflows(),
    ):
        with pytest.raises(MeshUnavailableError, match="client is closed"):
            await call
    assert time.monotonic() - began < 1


async def test_a_client_called_from_another_event_loop_says_so_and_serves_on(
    hub: Hub, fleet: Fleet, settings: MeshSettings
) -> None:
    """A thread's ``asyncio.run(mesh.request(...))`` on a client of the main loop: a
    ``RuntimeError`` that says so, at once — it waited its timeout, and every request on the
    client's own loop timed out after it, for good."""
    await echo_agent(fleet, "careless.echo", "work:echo:v1").start()
    async with Client(settings=settings) as mesh:
        outcome: list[BaseException | None] = []

        def other_loop() -> None:
            try:
                asyncio.run(mesh.request(capability="work:echo:v1", payload=1, timeout=3))
                outcome.append(None)
            except BaseException as err:  # what the thread got, for the test
                outcome.append(err)

        thread = threading.Thread(target=other_loop)
        began = time.monotonic()
        thread.start()
        await asyncio.to_thread(thread.join, 10)
        assert time.monotonic() - began < 2
        assert isinstance(outcome[0], RuntimeError) and "another event loop" in str(outcome[0])
        for i in range(3):
            res = await mesh.request(capability="work:echo:v1", payload=i, timeout=5)
            assert res.result == {"by": f"{settings.namespace}.careless.echo", "in": i}


async def test_workflow_waits_keep_their_timeout_with_nats_unreachable(
    wf_hub: Hub, nats_url: str, wf_settings: MeshSettings
) -> None:
    """With the caller cut off from NATS, ``workflow(id, timeout=t)`` and ``fanout(timeout=t)``
    end near ``t`` (each record read within what is left, a last look within 0.5 s): a
    JetStream read waited its own 5 s, twice — ``timeout=0.1`` took 10 s."""
    relay, through = await relayed(nats_url, wf_settings)
    async with Client(settings=through) as mesh:
        wf_id = await mesh.submit_fanout([Step(capability="wf:nobody:v1")], timeout=30)
        await relay.cut()
        for timeout in (0.1, 1.0):
            began = time.monotonic()
            with pytest.raises(MeshTimeoutError):
                await mesh.workflow(wf_id, timeout=timeout)
            assert time.monotonic() - began < timeout + 1.0
        began = time.monotonic()
        with pytest.raises(MeshUnavailableError):
            await mesh.fanout([Step(capability="wf:nobody:v1")], timeout=1)
        assert time.monotonic() - began < 2.0
