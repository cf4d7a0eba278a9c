"""The agent SDK's own surfaces: its ``/metrics``, opting out of durable work, tools from
type hints — each on a real mesh."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from reach_mesh import (
    BadRequestError,
    Client,
    MeshSettings,
    NoHandlerError,
    Step,
    TaskState,
    __version__,
    protocol,
)
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.agent._work import WorkConsumer
from reach_mesh.hub import Hub
from reach_mesh.models import AgentCard, TaskEnvelope, TaskReply
from reach_mesh.workflow import TaskStatusEvent

from .helpers import eventually, fetch, mcp_session

pytestmark = pytest.mark.timeout(60)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
CAP = (("capability", "calc:double:v1"),)


def parse(text: bytes) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


@pytest.fixture
def wf_settings(wf_settings: MeshSettings) -> MeshSettings:
    """The shared short workflow intervals, plus the hub's HTTP (for /api/tools)."""
    return wf_settings.model_copy(update={"http_port": 0})


def counting_agent(agent_id: str, settings: MeshSettings, **kw: Any) -> Agent:
    agent = Agent(agent_id, settings=settings, **kw)

    @agent.handler("calc:double:v1")
    async def double(task: Task[dict[str, Any]]) -> dict[str, int]:
        if task.payload.get("fail"):
            raise TaskFailed("asked to fail", retryable=False)
        return {"out": 2 * int(task.payload["n"])}

    return agent


# --------------------------------------------------------------------------- /metrics


async def test_agent_metrics_count_tasks_and_steps(
    wf_hub: Hub, wf_settings: MeshSettings, namespace: str
) -> None:
    cap = CAP
    agent = counting_agent(f"{namespace}.calc.a1", wf_settings, metrics_port=0)
    assert agent.metrics_url is None  # not serving before start
    async with agent, Client(settings=wf_settings) as mesh:
        url = agent.metrics_url
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert url.endswith("/metrics")
        for n in range(4):
            res = await mesh.request(capability="calc:double:v1", payload={"n": n})
            assert res.state is TaskState.SUCCEEDED
        failed = await mesh.request(capability="calc:double:v1", payload={"fail": True})
        assert failed.state is TaskState.FAILED
        bad = await mesh.request(capability="calc:double:v1", payload=[1])  # not a dict
        assert bad.state is TaskState.FAILED
        # A durable workflow step goes through the same counters.
        wf = await mesh.chain([Step(capability="calc:double:v1", payload={"n": 5})], timeout=10)
        assert wf.state is TaskState.SUCCEEDED and wf.result == {"out": 10}

        status, body = await fetch(url)
        assert status == 200
        samples = parse(body)
        assert samples[("reach_agent_handled_total", (*cap, ("state", "SUCCEEDED")))] == 5
        assert samples[("reach_agent_handled_total", (*cap, ("state", "FAILED")))] == 2
        failures = samples[("reach_agent_failures_total", (*cap, ("code", "REACH_HANDLER_FAILED")))]
        assert failures == 1
        assert samples[("reach_agent_failures_total", (*cap, ("code", "REACH_BAD_REQUEST")))] == 1
        assert samples[("reach_agent_handler_duration_seconds_count", cap)] == 7
        assert samples[("reach_agent_inflight", ())] == 0
        # Which agent this target is (every other series names none): the alert rules join it
        # on ``instance`` to name the agent and its namespace.
        who = (("agent_id", agent.agent_id), ("namespace", namespace), ("version", __version__))
        assert samples[("reach_agent_info", who)] == 1
        # The durable-step counters, as the work consumer keeps them (nothing dropped).
        for reason in ("fenced", "duplicate", "cached"):
            assert samples[("reach_agent_steps_dropped_total", (("reason", reason),))] == 0
        assert agent.work is not None
        assert samples[("reach_agent_fence_reads_total", ())] == agent.work.fence_reads
        # The same numbers are kept without an HTTP port (``agent.metrics``).
        local = parse(agent.metrics.render())
        assert local[("reach_agent_handled_total", (*cap, ("state", "SUCCEEDED")))] == 5
    assert agent.metrics_url is None  # closed with the agent
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0]))


async def test_agent_healthz_is_ready_while_a_hub_holds_its_lease(
    settings: MeshSettings, namespace: str
) -> None:
    """``GET /healthz`` beside the agent's ``/metrics``: 200 and ``ready`` while a hub answers
    its heartbeats; 503 once none has for two heartbeat intervals (the hub stopped) — a
    readiness probe's answer; closed with the agent."""
    agent = counting_agent(f"{namespace}.health.a1", settings, metrics_port=0)
    hub = Hub(settings=settings)
    await hub.start()
    try:
        async with agent:
            assert agent.metrics_url is not None
            url = agent.metrics_url.removesuffix("/metrics") + "/healthz"
            status, body = await fetch(url)
            assert status == 200, body
            said = json.loads(body)
            assert said["ready"] is True and said["in_touch"] is True and not said["wedged"]
            assert said["agent_id"] == agent.agent_id and said["status"] == "running"
            assert said["state"] == "ONLINE"
            await hub.close()

            async def not_ready() -> bool:
                status, body = await fetch(url)
                return status == 503 and json.loads(body)["in_touch"] is False

            await eventually(not_ready, timeout=5)
    finally:
        await hub.close()


async def test_agent_inflight_gauge_reads_running_handlers(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    release = asyncio.Event()
    started = asyncio.Event()
    agent = Agent(f"{namespace}.slow.a1", settings=settings, durable_work=False)

    @agent.handler("slow:wait:v1")
    async def wait(task: Task[Any]) -> str:
        started.set()
        await release.wait()
        return "done"

    async with agent, Client(settings=settings) as mesh:
        call = asyncio.ensure_future(mesh.request(capability="slow:wait:v1", payload={}))
        await asyncio.wait_for(started.wait(), 5)
        assert parse(agent.metrics.render())[("reach_agent_inflight", ())] == 1
        release.set()
        assert (await call).state is TaskState.SUCCEEDED
        assert parse(agent.metrics.render())[("reach_agent_inflight", ())] == 0


async def test_a_stop_cut_short_by_its_callers_timeout_leaves_nothing_running(
    hub: Hub, settings: MeshSettings, namespace: str, nats_url: str
) -> None:
    """``close()`` cancelled by its caller's own timeout (a handler still running, a long
    ``drain_timeout``): the agent stops beating and its connection closes, instead of staying
    registered and routed to as a closed agent that keeps its lease."""
    started = asyncio.Event()
    agent = Agent(f"{namespace}.cut.a1", settings=settings, durable_work=False, drain_timeout=60)

    @agent.handler("slow:cut:v1")
    async def wait(task: Task[Any]) -> str:
        started.set()
        await asyncio.sleep(120)
        return "done"

    await agent.start()
    beats: list[bytes] = []

    async def beat(msg: Msg) -> None:
        beats.append(msg.data)

    nc = await nats.connect(nats_url)
    try:
        await nc.subscribe(protocol.hub_agent_subject(agent.agent_id, "heartbeat"), cb=beat)
        async with Client(settings=settings) as mesh:
            call = asyncio.ensure_future(mesh.request(capability="slow:cut:v1", payload={}))
            await asyncio.wait_for(started.wait(), 5)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(agent.close(), 0.5)
            call.cancel()
        assert agent.nc.is_closed
        beats.clear()
        await asyncio.sleep(3 * settings.heartbeat_interval)
        assert beats == []
        await eventually(lambda: agent.agent_id not in hub.registry.agents, timeout=30)
    finally:
        await nc.close()


# --------------------------------------------------------------------------- durable_work


async def test_agent_without_durable_work_has_no_consumer_and_gets_no_steps(
    wf_hub: Hub, wf_settings: MeshSettings, namespace: str
) -> None:
    light = counting_agent(f"{namespace}.calc.light", wf_settings, durable_work=False)
    async with light, Client(settings=wf_settings) as mesh:
        assert light.work is None
        assert light.card().durable_work is False
        assert wf_hub.registry.agents[light.agent_id].record.card.durable_work is False
        js = mesh.nc.jetstream()
        with pytest.raises(NotFoundError):
            await js.consumer_info(protocol.STREAM_WORK, protocol.work_consumer(light.agent_id))
        # Request-reply still works.
        res = await mesh.request(capability="calc:double:v1", payload={"n": 2})
        assert res.state is TaskState.SUCCEEDED and res.result == {"out": 4}
        # A step it could serve waits for an agent that takes steps, and says why it ended.
        wf = await mesh.chain([Step(capability="calc:double:v1", payload={"n": 1})], timeout=1.5)
        assert wf.state is TaskState.TIMEOUT
        error = wf.steps[0].error
        assert error is not None and "durable_work=false" in error.message
        assert light.agent_id in error.message
        # Named by id: same answer, the agent is never offered the step.
        wf = await mesh.fanout([Step(agent_id=light.agent_id, payload={"n": 1})], timeout=1.5)
        assert wf.state is TaskState.TIMEOUT
        assert wf.steps[0].agent_id is None and wf.steps[0].attempts == 0
        # A durable agent with the same capability joins: steps go to it, never to ``light``.
        heavy = counting_agent(f"{namespace}.calc.heavy", wf_settings)
        async with heavy:
            assert heavy.work is not None
            for n in range(3):
                wf = await mesh.chain(
                    [Step(capability="calc:double:v1", payload={"n": n})], timeout=10
                )
                assert wf.state is TaskState.SUCCEEDED
                assert wf.steps[0].agent_id == heavy.agent_id
    handled = parse(light.metrics.render())
    assert handled[("reach_agent_handled_total", (*CAP, ("state", "SUCCEEDED")))] == 1


async def test_agent_without_durable_work_registered_before_the_hub(
    wf_settings: MeshSettings, namespace: str
) -> None:
    """A hub that starts after the agent registered learns the flag from the KV record."""
    first = Hub(settings=wf_settings)
    await first.start()
    light = counting_agent(f"{namespace}.calc.light", wf_settings, durable_work=False)
    heavy = counting_agent(f"{namespace}.calc.heavy", wf_settings)
    try:
        await light.start()
        await heavy.start()
        await first.close()
        async with Hub(settings=wf_settings), Client(settings=wf_settings) as mesh:
            for n in range(4):
                wf = await mesh.chain(
                    [Step(capability="calc:double:v1", payload={"n": n})], timeout=10
                )
                assert wf.steps[0].agent_id == heavy.agent_id
    finally:
        await light.close()
        await heavy.close()
        await first.close()


# --------------------------------------------------------------------------- tools


class Invoice(BaseModel):
    """What ``create_invoice`` takes."""

    customer: str
    amount: float
    currency: str = "EUR"


async def test_handler_tool_from_type_hints(
    wf_hub: Hub, wf_settings: MeshSettings, namespace: str
) -> None:
    agent = Agent(f"{namespace}.billing.b1", settings=wf_settings, durable_work=False)

    @agent.handler("invoice:create:v1", tool="create_invoice")
    async def create(task: Task[Invoice]) -> dict[str, Any]:
        """Create an invoice for a customer.

        Returns the invoice number.
        """
        return {"number": 7, "total": task.payload.amount}

    (spec,) = agent.tools
    assert spec.name == "create_invoice" and spec.capability == "invoice:create:v1"
    assert spec.description == "Create an invoice for a customer.\n\nReturns the invoice number."
    assert spec.parameters["required"] == ["customer", "amount"]
    assert spec.parameters["properties"]["amount"]["type"] == "number"

    async with agent:
        status, body = await fetch(f"{wf_hub.http_url}/api/tools?namespace={namespace}")
        assert status == 200
        (tool,) = json.loads(body)["tools"]
        assert tool["name"] == "create_invoice"
        assert tool["inputSchema"] == spec.parameters
        assert tool["agents"] == [agent.agent_id]

        async with mcp_session(f"{wf_hub.http_url}", namespace=namespace) as mcp:
            (listed,) = (await mcp.list_tools()).tools
            assert (listed.name, listed.description) == ("create_invoice", spec.description)
            assert listed.input_schema == spec.parameters
            result = await mcp.call_tool("create_invoice", {"customer": "c1", "amount": 9.5})
        assert result.is_error is False
        assert json.loads(result.content[0].text) == {"number": 7, "total": 9.5}  # type: ignore[union-attr]


def test_handler_tool_is_checked_at_decoration(settings: MeshSettings) -> None:
    agent = Agent("t0.tools.a1", settings=settings)

    @agent.handler("any:thing:v1", tool="anything", description="Takes anything.")
    async def anything(task: Task[Any]) -> None:
        return None

    assert agent.tools[0].parameters == {"type": "object"}
    assert agent.tools[0].description == "Takes anything."

    with pytest.raises(TypeError, match="must be an object"):

        @agent.handler("num:thing:v1", tool="number")
        async def number(task: Task[int]) -> None:
            return None

    with pytest.raises(ValueError, match="declared twice"):

        @agent.handler("other:thing:v1", tool="anything")
        async def again(task: Task[Any]) -> None:
            return None

    # A second handler for a capability replaced the first without a word.
    with pytest.raises(ValueError, match="has a handler already"):

        @agent.handler("any:thing:v1")
        async def twice(task: Task[Any]) -> None:
            return None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_concurrency": True}, "max_concurrency must be an integer"),
        ({"max_concurrency": 2.5}, "max_concurrency must be an integer"),
        ({"max_concurrency": 0}, "max_concurrency must be >= 1"),
        ({"max_queue": -1}, "max_queue must be an integer >= 0"),
        ({"max_queue": 1.5}, "max_queue must be an integer >= 0"),
    ],
)
def test_slot_counts_are_checked_when_the_agent_is_built(
    settings: MeshSettings, kwargs: dict[str, Any], needle: str
) -> None:
    """``max_queue=-1`` and ``max_concurrency=True`` were taken (the careless-agent audit)."""
    with pytest.raises(BadRequestError, match=needle):
        Agent("t0.slots.a1", settings=settings, **kwargs)


# --------------------------------------------------------------------------- handler slots


async def test_handler_slots_go_in_line_and_past_cancelled_waiters(
    settings: MeshSettings,
) -> None:
    """``max_concurrency`` slots: a freed slot goes to the first task still waiting, skipping
    one cancelled while it waited; one cancelled just after being handed a slot passes it on."""
    agent = Agent("t0.slots.a1", settings=settings, max_concurrency=1)
    await agent._slot()  # free: taken at once
    got: list[int] = []

    async def wait(i: int) -> None:
        await agent._slot()
        got.append(i)

    waiting = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert agent.inflight == 1 and not got

    waiting[0].cancel()  # cancelled while it waits
    await asyncio.sleep(0)
    agent._release_slot()  # to waiting[1] ...
    waiting[1].cancel()  # ... cancelled before it runs: on to waiting[2]
    await asyncio.gather(*waiting, return_exceptions=True)
    assert waiting[0].cancelled() and waiting[1].cancelled()
    assert got == [2] and agent.inflight == 1

    agent._release_slot()
    assert agent.inflight == 0
    await agent._slot()
    assert agent.inflight == 1


async def test_a_task_that_names_no_capability_of_an_agent_with_several_is_told_so(
    hub: Hub, settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """By agent id alone, to an agent with two handlers: which to run is not said. The
    refusal says so (it read "no handler for None"); a capability listed without a handler
    is said when the agent starts."""
    agent = Agent(f"{settings.namespace}.two.a1", settings=settings, capabilities=["two:listed:v1"])

    @agent.handler("two:a:v1")
    async def a(task: Task[Any]) -> str:
        return "a"

    @agent.handler("two:b:v1")
    async def b(task: Task[Any]) -> str:
        return "b"

    async with agent, Client(settings=settings) as mesh:
        assert "lists capabilities it has no handler for: two:listed:v1" in caplog.text
        with pytest.raises(NoHandlerError, match="names no capability"):
            await mesh.request(agent_id=agent.agent_id, payload=1, timeout=5)
        ok = await mesh.request(agent_id=agent.agent_id, capability="two:b:v1", timeout=5)
        assert ok.result == "b"


async def test_a_handler_is_told_its_agents_namespace_whatever_the_envelope_says(
    hub: Hub, settings: MeshSettings, nats_url: str
) -> None:
    """A direct-mode caller writes the envelope itself, and NATS permissions let a caller reach
    only agents of its own namespace: an envelope naming another (``"namespace": "bank"``)
    told the handler ``task.namespace == "bank"`` — what a handler keying data by tenant
    would trust. The agent's namespace is its id's; the handler is told that one."""
    agent = Agent(f"{settings.namespace}.ns.a1", settings=settings, durable_work=False)
    seen: list[str] = []

    @agent.handler("ns:echo:v1")
    async def echo(task: Task[Any]) -> str:
        seen.append(task.namespace)
        return task.namespace

    async with agent:
        nc = await nats.connect(nats_url)
        try:
            env = TaskEnvelope(task_id="ns-1", payload=1, namespace="bank")
            msg = await nc.request(
                protocol.agent_task(agent.agent_id), env.model_dump_json().encode(), 5
            )
        finally:
            await nc.close()
    reply = TaskReply.model_validate_json(msg.data)
    assert reply.result == settings.namespace and seen == [settings.namespace]


def test_label_keys_that_differ_only_in_case_are_refused(settings: MeshSettings) -> None:
    """``{"Region": "eu", "region": "us"}`` became ``region=us`` without a word (the
    careless-agent audit); a registration from another language is refused as well."""
    with pytest.raises(BadRequestError, match="differ only in case"):
        Agent("t0.case.a1", settings=settings, labels={"Region": "eu", "region": "us"})
    with pytest.raises(ValidationError, match="differ only in case"):
        AgentCard(agent_id="t0.case.a1", capabilities=["a:b:v1"], labels={"A": "1", "a": "2"})
    assert AgentCard(
        agent_id="t0.case.a1", capabilities=["a:b:v1"], labels={"Zone": "z"}
    ).labels == {"zone": "z"}


# --------------------------------------------------------------------------- step statuses


@pytest.mark.parametrize(
    ("result", "workflow_id", "step"),
    [
        ({"a": None, "b": [1.0, 1e20, "é\u2028"], "c": {"d": True}}, "wf-1", 0),
        (None, "wf-1", 2),
        ("text", None, None),
        ([1, 2], 'w"f\\1', 7),
    ],
)
def test_a_succeeded_steps_status_is_what_its_model_writes(
    result: Any, workflow_id: str | None, step: int | None
) -> None:
    """A succeeded step's final status is written around its result's JSON
    (``HeldSteps._succeeded``), not by ``TaskStatusEvent``: the same fields in the same order,
    the same values, ``None`` ones left out, and the same reply read back from it."""
    agent = Agent("t0.status.a1", settings=MeshSettings(namespace="t0"))
    work = WorkConsumer(agent)
    env = TaskEnvelope(
        task_id="t-1", attempt=3, payload=1, workflow_id=workflow_id, step=step, namespace="t0"
    )
    body = work._succeeded(env, to_json(result), 12.3456, 0.5)
    event = TaskStatusEvent(
        task_id="t-1",
        attempt=3,
        agent_id=agent.agent_id,
        state=TaskState.SUCCEEDED,
        workflow_id=workflow_id,
        step=step,
        result=result,
        duration_ms=12.346,
        queued_ms=0.5,
    )
    expected = json.loads(protocol.encode(event))
    got = json.loads(body)
    assert got == expected
    assert list(got) == list(expected)
    assert TaskReply.model_validate_json(body) == TaskReply.model_validate(
        event.model_dump(include=set(TaskReply.model_fields))
    )
