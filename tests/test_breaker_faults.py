"""The breaker counts the agent's faults only: a caller's bad payloads (proxy, direct, MCP), its
reports beyond a budget, and dry runs leave it closed; direct mode with a selector sends the
capability a multi-handler agent needs — for the Python SDK and for an agent written from
docs/protocol.md with nothing but nats-py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import nats
import pytest
from pydantic import BaseModel

from reach_mesh import Client, MeshSettings, NoMatchError, protocol
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.hub.breaker import (
    CAUSE_MAX,
    NOT_AGENT_FAULTS,
    PROBE_FAILED,
    BreakerState,
    CircuitBreaker,
    HealthScore,
    caller_report,
    is_agent_fault,
)
from reach_mesh.models import AgentState, FailureReport

from .helpers import eventually, mcp_session


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state(breaker: CircuitBreaker) -> BreakerState:
    return breaker.state  # through a function: mypy would narrow the property across asserts


# --------------------------------------------------------------------------- pure


def test_only_agent_faults_count() -> None:
    for code in ("REACH_TIMEOUT", "REACH_HANDLER_FAILED", "REACH_INTERNAL", "REACH_UNAVAILABLE"):
        assert is_agent_fault(code), code
    assert is_agent_fault(None)  # a failure that names no code is the agent's
    assert is_agent_fault("APP_DATABASE_DOWN")  # a handler's own infrastructure error
    for code in (
        "REACH_BAD_REQUEST",
        "REACH_BAD_SELECTOR",
        "REACH_PAYLOAD_TOO_LARGE",
        "REACH_NO_HANDLER",
        "REACH_AGENT_BUSY",
        "REACH_CANCELLED",
        "REACH_STALE_ATTEMPT",
        "REACH_BAD_SOMETHING_NEW",
    ):
        assert not is_agent_fault(code), code
    assert "REACH_BAD_WORKFLOW" in NOT_AGENT_FAULTS


def test_reports_are_bounded_per_reporter_and_never_open_alone() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(min_requests=5, report_budget=3, clock=clock)
    counted = [breaker.report(False, "caller-1") for _ in range(10)]
    assert counted == [True] * 3 + [False] * 7
    for reporter in ("caller-2", "caller-3", "caller-4"):
        for _ in range(3):
            breaker.report(False, reporter)
    assert breaker.counts() == (0, 12)
    assert _state(breaker) is BreakerState.CLOSED  # 12 reported failures, none witnessed
    breaker.record(False)
    assert _state(breaker) is BreakerState.OPEN  # one the hub saw itself
    # The budget renews with the window.
    clock.now += 60.0
    assert breaker.report(False, "caller-1")


def test_reported_failure_is_no_probe_verdict_but_reported_success_is() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(min_requests=1, open_timeout=5.0, clock=clock)
    breaker.trip()
    clock.now += 5.0
    assert _state(breaker) is BreakerState.HALF_OPEN and breaker.allow()
    breaker.report(False, "caller-1")
    assert _state(breaker) is BreakerState.HALF_OPEN  # a caller's word cannot re-open it
    breaker.report(True, "caller-1")
    assert _state(breaker) is BreakerState.CLOSED  # direct mode: the caller ran the probe


def test_a_reported_no_responders_is_no_fault() -> None:
    """``REACH_UNKNOWN_AGENT`` (nobody on the agent's subject: it may be reconnecting) spends
    the reporter's budget and changes neither breaker nor health; ``REACH_UNAVAILABLE`` (what
    SDKs before this version sent for it, and a handler's infrastructure error) counts."""
    breaker, health = CircuitBreaker(clock=FakeClock()), HealthScore()

    def report(code: str) -> bool:
        return caller_report(
            breaker, health, FailureReport(agent_id="t.a.b", success=False, code=code)
        )

    assert report("REACH_UNKNOWN_AGENT")
    assert breaker.counts() == (0, 0) and health.value == 100
    assert report("REACH_UNAVAILABLE")
    assert breaker.counts() == (0, 1) and health.value == 90


def test_reports_alone_never_make_an_agent_unhealthy() -> None:
    """Callers of a namespace share one identity and name their ``reporter`` themselves: 20
    made-up names reporting timeouts and busy refusals once drove a healthy agent's score to
    0, out of rotation while any healthy agent matched. Reports alone now stop at the
    threshold; with a failure the hub saw itself in the window they count in full."""
    clock = FakeClock()
    # (min_requests: the witnessed failure below must not open the breaker, which starts a
    # new window.)
    breaker, health = CircuitBreaker(min_requests=1000, clock=clock), HealthScore()
    for i in range(20):
        for code in ("REACH_TIMEOUT", "REACH_AGENT_BUSY", "REACH_HANDLER_FAILED"):
            caller_report(
                breaker,
                health,
                FailureReport(agent_id="t.a.b", success=False, code=code, reporter=f"r{i}"),
            )
    assert health.value == health.threshold and health.healthy
    assert _state(breaker) is BreakerState.CLOSED
    breaker.record(False)  # a failure the hub witnessed
    caller_report(
        breaker,
        health,
        FailureReport(agent_id="t.a.b", success=False, code="REACH_TIMEOUT", reporter="r99"),
    )
    assert health.value == health.threshold - health.accept_timeout_penalty
    assert not health.healthy
    # A report never raises a score already below the threshold either.
    clock.now += 120.0  # the witnessed failure leaves the window
    caller_report(
        breaker,
        health,
        FailureReport(agent_id="t.a.b", success=False, code="REACH_TIMEOUT", reporter="r98"),
    )
    assert health.value == health.threshold - health.accept_timeout_penalty


def test_reporters_past_the_bound_share_one_budget() -> None:
    breaker = CircuitBreaker(report_budget=1, clock=FakeClock())
    names = [uuid.uuid4().hex for _ in range(1100)]
    counted = sum(breaker.report(True, name) for name in names)
    assert counted == 1024 + 1  # 1024 told apart, the rest one more between them
    assert len(breaker._reporters) == 1025


# --------------------------------------------------------------------------- against a hub


class Invoice(BaseModel):
    customer: str
    amount: float


def invoicer(agent_id: str, settings: MeshSettings) -> Agent:
    agent = Agent(agent_id, settings=settings)

    @agent.handler("invoice:create:v1", tool="create_invoice")
    async def create(task: Task[Invoice]) -> dict[str, Any]:
        return {"total": task.payload.amount}

    return agent


@pytest.fixture
async def http_hub(settings: MeshSettings) -> AsyncIterator[Hub]:
    async with Hub(settings=settings.model_copy(update={"http_port": 0})) as hub:
        yield hub


async def _sentinel(nats_url: str, agent_id: str) -> None:
    """A counted success report: once the hub shows it, every report sent before it was read."""
    nc = await nats.connect(nats_url)
    try:
        report = FailureReport(agent_id=agent_id, success=True, reporter="sentinel")
        await nc.publish(
            protocol.hub_subject(protocol.namespace_of(agent_id), "report"),
            protocol.encode(report),
        )
        await nc.flush()
    finally:
        await nc.close()


async def test_bad_payload_storms_leave_the_breaker_closed(
    http_hub: Hub, settings: MeshSettings, namespace: str, nats_url: str
) -> None:
    agent = invoicer(f"{namespace}.billing.b1", settings)
    async with agent, Client(settings=settings) as c:
        view = http_hub.registry.agents[agent.agent_id]
        for mode in ("proxy", "direct"):
            for i in range(20):
                res = await c.request(
                    capability="invoice:create:v1", payload={"customer": i}, mode=mode
                )
                assert res.error is not None and res.error.code == "REACH_BAD_REQUEST"
        # MCP tools/call with arguments that fail the tool's schema, as in the issue.
        assert http_hub.http_url is not None
        async with mcp_session(http_hub.http_url) as mcp:
            for _ in range(10):
                result = await mcp.call_tool("create_invoice", {"amount": "lots"})
                assert result.is_error is True
        await _sentinel(nats_url, agent.agent_id)
        await eventually(lambda: view.breaker.counts()[0] >= 1)
        assert view.breaker.counts()[1] == 0  # not one failure counted against the agent
        assert view.breaker.state is BreakerState.CLOSED
        assert view.state is AgentState.ONLINE
        # The tool stays on the menu, and a good call still works.
        assert [t["name"] for t in http_hub.http.tool_menu(namespace)] == ["create_invoice"]
        good = await c.request(
            capability="invoice:create:v1", payload={"customer": "c", "amount": 2.5}
        )
        assert good.result == {"total": 2.5}


async def test_dry_runs_never_take_the_half_open_probe(
    settings: MeshSettings, namespace: str
) -> None:
    s = settings.model_copy(update={"breaker_open_timeout": 0.3})
    async with Hub(settings=s) as hub, invoicer(f"{namespace}.billing.b1", s) as agent:
        view = hub.registry.agents[agent.agent_id]
        async with Client(settings=s) as c:
            await c.admin("quarantine", agent.agent_id)
            assert view.breaker.state is BreakerState.OPEN
            await eventually(lambda: view.breaker.state is BreakerState.HALF_OPEN)
            await eventually(lambda: view.state is AgentState.ONLINE)
            for _ in range(5):  # what `reach --dry-run` and `Client.route` send
                decision = await c.route(capability="invoice:create:v1")
                assert decision.chosen == agent.agent_id
                assert view.breaker.probe_available
            res = await c.request(
                capability="invoice:create:v1", payload={"customer": "c", "amount": 1}
            )
            assert res.ok  # the probe went to the real request, and closed the breaker
            # cast: mypy keeps the narrowing from before the awaits above
            assert cast(BreakerState, view.breaker.state) is BreakerState.CLOSED


async def test_the_explanation_says_why_a_breaker_is_open(
    settings: MeshSettings, namespace: str
) -> None:
    """`reach --dry-run` (a route's explanation) and the NO_MATCH of a capability whose every
    agent is quarantined say why each breaker opened, as `agents`/`inspect` do: it said
    `state QUARANTINED` alone, in the one place an operator asks why an agent gets no work."""
    async with (
        Hub(settings=settings) as hub,
        invoicer(f"{namespace}.billing.b1", settings) as bad,
        invoicer(f"{namespace}.billing.b2", settings) as good,
    ):
        async with Client(settings=settings) as c:
            await c.admin("quarantine", bad.agent_id)
            decision = await c.route(capability="invoice:create:v1")
            assert decision.chosen == good.agent_id
            reasons = {f.agent_id: f.reason for f in decision.filtered}
            assert reasons[bad.agent_id] == (
                "state QUARANTINED (breaker open: operator quarantine)"
            ), reasons
            await c.admin("quarantine", good.agent_id)
            with pytest.raises(NoMatchError) as no:
                await c.route(capability="invoice:create:v1")
            assert f"{good.agent_id}: state QUARANTINED (breaker open: " in str(no.value), no
        assert hub.registry.agents[bad.agent_id].state is AgentState.QUARANTINED


async def test_a_failed_probe_keeps_why_the_breaker_opened(
    settings: MeshSettings, namespace: str
) -> None:
    """A breaker that opens again on its failed half-open probe says so, and keeps why it
    opened: "its half-open probe failed" alone replaced "5 of its last 5 requests failed" in
    `inspect`, `agents` and every explanation from the first failed probe on (the SRE
    walkthrough), and an operator no longer saw why the agent was taken out. Probes failing
    again do not pile up."""
    s = settings.model_copy(update={"breaker_open_timeout": 0.3})
    agent = Agent(f"{namespace}.billing.b1", settings=s)

    @agent.handler("invoice:create:v1")
    async def down(task: Task[Any]) -> None:
        raise RuntimeError("database down")

    async with Hub(settings=s) as hub, agent, Client(settings=s) as c:
        view = hub.registry.agents[agent.agent_id]
        for _ in range(5):
            res = await c.request(agent_id=agent.agent_id, payload={})
            assert res.error is not None
        opened = "5 of its last 5 requests failed"
        assert (await c.inspect(agent.agent_id)).breaker_reason == opened
        for _ in range(2):  # two probes, each failing: the first reason stays, once
            await eventually(lambda: view.breaker.state is BreakerState.HALF_OPEN)
            await eventually(lambda: view.state is AgentState.ONLINE)
            res = await c.request(agent_id=agent.agent_id, payload={})
            assert res.error is not None and view.breaker.state is BreakerState.OPEN
            why = f"its half-open probe failed (opened: {opened})"
            assert (await c.inspect(agent.agent_id)).breaker_reason == why
            listed = {i.agent_id: i.breaker_reason for i in await c.agents()}
            assert listed[agent.agent_id] == why
            with pytest.raises(NoMatchError) as no:
                await c.route(capability="invoice:create:v1")
            assert f"breaker open: {why})" in str(no.value), no


def test_a_failed_probes_reason_is_bounded() -> None:
    """What a failed probe keeps of why the breaker opened is at most ``CAUSE_MAX``
    characters (an operator's words, say), and a probe failing again adds nothing."""
    clock = FakeClock()
    breaker = CircuitBreaker(open_timeout=30, clock=clock)
    breaker.trip("x" * 500)
    for _ in range(3):
        clock.now += 31
        assert breaker.allow()
        breaker.record(False)
        assert _state(breaker) is BreakerState.OPEN
        assert breaker.why == f"{PROBE_FAILED} (opened: {'x' * (CAUSE_MAX - 1)}…)"
    breaker.reset()
    assert breaker.why == breaker.cause == ""


# --------------------------------------------------------------------------- direct + selector


def calculator(agent_id: str, settings: MeshSettings) -> Agent:
    agent = Agent(agent_id, settings=settings, labels={"impl": "py"})

    @agent.handler("math:double:v1")
    async def double(task: Task[int]) -> int:
        return task.payload * 2

    @agent.handler("math:negate:v1")
    async def negate(task: Task[int]) -> int:
        return -task.payload

    return agent


@contextlib.asynccontextmanager
async def raw_agent(nats_url: str, agent_id: str) -> AsyncIterator[list[dict[str, Any]]]:
    """A two-handler agent written from docs/protocol.md with plain nats-py and JSON: subscribe
    to its task and ctl subjects, register, heartbeat, answer TaskEnvelopes. Yields the
    envelopes it received."""
    ns = agent_id.split(".")[0]
    session = uuid.uuid4().hex
    seen: list[dict[str, Any]] = []
    handlers = {"math:double:v1": lambda x: x * 2, "math:negate:v1": lambda x: -x}
    nc = await nats.connect(nats_url)

    async def on_task(msg: Any) -> None:
        env = json.loads(msg.data)
        seen.append(env)
        handler = handlers.get(env.get("capability"))
        if handler is None:  # "capability: null" means the only handler: there are two
            body: dict[str, Any] = {
                "error": {"code": "REACH_NO_HANDLER", "message": f"no handler for {env}"}
            }
        else:
            body = {
                "task_id": env["task_id"],
                "attempt": env["attempt"],
                "agent_id": agent_id,
                "state": "SUCCEEDED",
                "result": handler(env["payload"]),
            }
        await msg.respond(json.dumps(body).encode())

    async def on_ctl(msg: Any) -> None:
        await msg.respond(json.dumps({"agent_id": agent_id, "session": session}).encode())

    me = agent_id.split(".", 1)[1]  # <service>.<instance>: the agent's own verbs name it

    async def beat() -> None:
        hb = {"agent_id": agent_id, "session": session, "inflight": 0}
        while True:
            await asyncio.sleep(0.5)
            await nc.request(f"reach.hub.{ns}.heartbeat.{me}", json.dumps(hb).encode(), timeout=2)

    await nc.subscribe(f"reach.agent.{agent_id}.task", queue="reach-agent", cb=on_task)
    await nc.subscribe(f"reach.agent.{agent_id}.ctl", cb=on_ctl)
    card = {"agent_id": agent_id, "capabilities": sorted(handlers), "labels": {"impl": "raw"}}
    register = {"card": card, "session": session, "heartbeat_interval": 0.5, "lease_timeout": 1.5}
    reply = await nc.request(
        f"reach.hub.{ns}.register.{me}", json.dumps(register).encode(), timeout=5
    )
    assert json.loads(reply.data)["state"] == "ONLINE", reply.data
    beating = asyncio.create_task(beat())
    try:
        yield seen
    finally:
        beating.cancel()
        with contextlib.suppress(BaseException):
            await beating
        unregister = {"agent_id": agent_id, "session": session}
        with contextlib.suppress(Exception):
            await nc.request(f"reach.hub.{ns}.unregister.{me}", json.dumps(unregister).encode())
        await nc.close()


async def test_direct_mode_with_a_selector_reaches_the_right_handler(
    hub: Hub, settings: MeshSettings, namespace: str, nats_url: str
) -> None:
    py = calculator(f"{namespace}.calc.py", settings)
    async with py, raw_agent(nats_url, f"{namespace}.calc.raw") as raw_seen:
        async with Client(settings=settings) as c:
            for agent_id, impl in ((py.agent_id, "py"), (f"{namespace}.calc.raw", "raw")):
                for mode in ("direct", "proxy"):
                    for cap, want in (("math:double:v1", 14), ("math:negate:v1", -7)):
                        # The label pins the agent; the selector alone names the handler.
                        selector = f"cap={cap} AND impl={impl}"
                        res = await c.request(selector=selector, payload=7, mode=mode)
                        assert (res.agent_id, res.result) == (agent_id, want), (mode, impl)
        # Both modes put the selector's capability in the envelope the raw agent received.
        caps = [env["capability"] for env in raw_seen]
        assert caps == ["math:double:v1", "math:negate:v1"] * 2
        for agent_id in (py.agent_id, f"{namespace}.calc.raw"):
            view = hub.registry.agents[agent_id]
            assert view.breaker.counts()[1] == 0
            assert view.state is AgentState.ONLINE
