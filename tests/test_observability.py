"""Metrics, HTTP surfaces, audit stream and one trace_id across every hop — on a real mesh."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.util._once import Once
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from reach_mesh import (
    BadRequestError,
    Client,
    MeshSettings,
    MeshTimeoutError,
    NoMatchError,
    TaskState,
    UnknownAgentError,
    protocol,
)
from reach_mesh.agent import Agent, Task
from reach_mesh.cli import main as cli_main
from reach_mesh.hub import Hub
from reach_mesh.hub import _dashboard as dash
from reach_mesh.models import ToolSpec

from .helpers import eventually, fetch, mcp_session, partition


def echo_agent(agent_id: str, settings: MeshSettings, **kw: Any) -> Agent:
    agent = Agent(agent_id, settings=settings, **kw)

    @agent.handler("work:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return {"payload": task.payload, "trace_id": task.trace_id}

    return agent


@pytest.fixture
async def http_hub(settings: MeshSettings) -> AsyncIterator[Hub]:
    async with Hub(settings=settings.model_copy(update={"http_port": 0})) as hub:
        yield hub


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


async def test_metrics_match_what_was_sent(
    http_hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = echo_agent(f"{namespace}.w.a1", settings)

    @agent.handler("work:typed:v1")
    async def typed(task: Task[int]) -> int:
        return task.payload

    minted = iter(range(1000))

    @agent.handler("work:mint:v1")
    async def mint(task: Task[Any]) -> Any:
        # A handler (anyone's) answering codes of its own making: one series, not one each.
        raise type("Minted", (BadRequestError,), {"code": f"REACH_BAD_X{next(minted)}"})("no")

    async with agent, Client(settings=settings) as c:
        for i in range(7):
            await c.request(capability="work:echo:v1", payload=i)
        with pytest.raises(NoMatchError):
            await c.request(capability="work:none:v1", payload=0)
        # A payload the handler's model refuses: the caller's fault, not the agent failing.
        refused = await c.request(capability="work:typed:v1", payload="seven")
        assert refused.state is TaskState.FAILED and refused.error is not None
        assert refused.error.code == "REACH_BAD_REQUEST"
        for _ in range(3):
            assert (await c.request(capability="work:mint:v1")).state is TaskState.FAILED
        await eventually(lambda: http_hub.metrics.heartbeat_total._value.get() >= 2)
        status, body = await fetch(f"{http_hub.http_url}/metrics")
    assert status == 200
    text = body.decode()
    tasks = samples(text, "reach_task_total")
    assert tasks[(("mode", "proxy"), ("namespace", namespace), ("state", "SUCCEEDED"))] == 7
    assert tasks[(("mode", "proxy"), ("namespace", namespace), ("state", "NO_MATCH"))] == 1
    assert tasks[(("mode", "proxy"), ("namespace", namespace), ("state", "BAD_REQUEST"))] == 4
    assert not [k for k in tasks if ("state", "BAD_X0") in k]
    assert (("mode", "proxy"), ("namespace", namespace), ("state", "FAILED")) not in tasks
    assert samples(text, "reach_route_duration_seconds_count")[()] == 11  # (routed: 7 + 4)
    agents = samples(text, "reach_agents")
    assert agents[(("namespace", namespace), ("state", "ONLINE"))] == 1
    # The scrape shows the heartbeats the hub counted before it (at least the two awaited).
    assert samples(text, "reach_heartbeat_total")[()] >= 2


async def test_series_the_alerts_read_exist_before_their_first_event(
    settings: MeshSettings, namespace: str
) -> None:
    """A configured namespace whose agents are all gone shows zeros, not no series (the
    rules read a missing series as 0 too); a namespace's lease expiries are counted from 0
    while it has agents — a counter born at its first increment hides that increment from
    ``increase()``, and ReachLeaseExpiries missed a namespace's first expiries."""
    configured = f"{namespace}cfg"
    hub_settings = settings.model_copy(update={"http_port": 0, "namespaces": [configured]})
    async with Hub(settings=hub_settings) as hub:
        agent = echo_agent(f"{namespace}.w.a1", settings)
        async with agent:
            _, body = await fetch(f"{hub.http_url}/metrics")
        text = body.decode()
    agents = samples(text, "reach_agents")
    assert agents[(("namespace", configured), ("state", "ONLINE"))] == 0
    assert agents[(("namespace", namespace), ("state", "ONLINE"))] == 1
    assert samples(text, "reach_lease_expired_total")[(("namespace", namespace),)] == 0


async def test_rest_gateway_dashboard_and_openapi(
    http_hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = echo_agent(
        f"{namespace}.w.a1",
        settings,
        tools=[
            ToolSpec(
                name="echo",
                description="Echo back",
                capability="work:echo:v1",
                parameters={"type": "object", "properties": {"x": {"type": "integer"}}},
            )
        ],
    )
    base = http_hub.http_url
    assert base is not None
    async with agent:
        status, body = await fetch(
            f"{base}/api/route?namespace={namespace}",
            "POST",
            json.dumps({"capability": "work:echo:v1", "payload": 5}).encode(),
        )
        assert status == 200, body
        assert json.loads(body)["task"]["result"]["payload"] == 5
        status, body = await fetch(f"{base}/api/route?namespace={namespace}", "POST", b"{bad")
        assert status == 400 and json.loads(body)["error"]["code"] == "REACH_BAD_REQUEST"
        status, body = await fetch(
            f"{base}/api/route?namespace={namespace}",
            "POST",
            json.dumps({"capability": "work:nope:v1"}).encode(),
        )
        assert status == 404 and json.loads(body)["error"]["code"] == "REACH_NO_MATCH"
        status, body = await fetch(f"{base}/api/agents?namespace={namespace}")
        assert [a["agent_id"] for a in json.loads(body)["agents"]] == [agent.agent_id]
        # Filters and pages, as the fleet query over NATS (thousands need not come whole).
        status, body = await fetch(f"{base}/api/agents?namespace={namespace}&limit=0")
        page = json.loads(body)
        assert (page["agents"], page["total"], page["matched"]) == ([], 1, 1)
        assert page["truncated"] and page["next_offset"] == 0 and page["by_state"]
        status, body = await fetch(
            f"{base}/api/agents?namespace={namespace}&state=LOST&capability=work:echo:v1"
        )
        assert (json.loads(body)["agents"], json.loads(body)["matched"]) == ([], 0)
        status, body = await fetch(f"{base}/api/agents?namespace={namespace}&state=BOGUS")
        assert status == 400 and json.loads(body)["error"]["code"] == "REACH_BAD_REQUEST"
        status, body = await fetch(f"{base}/api/agents?after={agent.agent_id}")
        assert status == 200 and agent.agent_id not in [
            a["agent_id"] for a in json.loads(body)["agents"]
        ]
        status, body = await fetch(f"{base}/api/agents?after=Bad..id")
        assert status == 400 and json.loads(body)["error"]["details"]["field"] == "after"
        status, body = await fetch(f"{base}/api/agents/{namespace}.ghost.x")
        assert status == 404
        status, body = await fetch(f"{base}/")
        assert status == 200 and b"reach-mesh" in body
        status, body = await fetch(f"{base}/openapi.json")
        assert json.loads(body)["openapi"].startswith("3.")
        # Operator drill from the dashboard: simulate a lost heartbeat, then cordon.
        status, body = await fetch(f"{base}/api/agents/{agent.agent_id}/simulate-lost", "POST")
        assert status == 200 and json.loads(body)["state"] == "SUSPECT"
        status, body = await fetch(f"{base}/api/agents/{agent.agent_id}/cordon", "POST")
        assert status == 200, body
        await eventually(lambda: http_hub.registry.agents[agent.agent_id].state.value == "CORDONED")
        status, body = await fetch(f"{base}/api/agents/{agent.agent_id}/explode", "POST")
        assert status == 400
        # MCP tool menu and a tool call routed to the live agent.
        await fetch(f"{base}/api/agents/{agent.agent_id}/uncordon", "POST")
        await eventually(lambda: http_hub.registry.agents[agent.agent_id].state.value == "ONLINE")
        # Its namespace's menu: another test's agent may still offer tools on the server.
        async with mcp_session(base, namespace=namespace) as mcp:
            tools = (await mcp.list_tools()).tools
            assert tools[0].name == "echo" and tools[0].input_schema
            result = await mcp.call_tool("echo", {"x": 3})
        assert result.is_error is False
        assert json.loads(result.content[0].text)["payload"] == {"x": 3}  # type: ignore[union-attr]


async def test_audit_stream_tells_the_story(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = echo_agent(f"{namespace}.w.a1", settings)
    async with agent, Client(settings=settings) as c:
        res = await c.request(capability="work:echo:v1", payload=1)
        await c.admin("cordon", agent.agent_id)
        await eventually(lambda: hub.registry.agents[agent.agent_id].state.value == "CORDONED")
        # Refused before any agent was chosen: its event has no agent_id, only the target.
        with pytest.raises(NoMatchError):
            await c.request(agent_id=agent.agent_id, payload=2)
        # Audit events are batched (up to ~75 ms); publish what is buffered now.
        await hub.audit.flush()
        await hub.nc.flush()
        events = await c.audit(request_id=res.request_id)
        assert len(events) == 1
        ev = events[0]
        assert ev["kind"] == "route" and ev["agent_id"] == agent.agent_id
        assert ev["trace_id"] == res.trace_id and ev["state"] == "SUCCEEDED"
        story = await c.audit(agent_id=agent.agent_id, namespace=namespace)
        kinds = [e["kind"] for e in story]
        assert kinds[0] == "register"
        assert "route" in kinds and "admin" in kinds and "state" in kinds
        refused = [e for e in story if e.get("error") == "REACH_NO_MATCH"]
        assert [e["target"] for e in refused] == [agent.agent_id]
        by_trace = await c.audit(trace_id=res.trace_id)
        assert [e["request_id"] for e in by_trace] == [res.request_id]


async def test_operator_actions_are_audited_with_why_and_who_asked(
    http_hub: Hub, settings: MeshSettings, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Open mode: an operator action keeps its reason; who asked is left out (no identity NATS
    vouches for: neither a reply subject under ``_INBOX.operator.admin`` nor a body's
    ``requester`` is taken). Through the hub's HTTP API it is ``http``, for a cancel too. A
    reason too long is refused (``REACH_BAD_REQUEST``) and nothing is done."""
    agent = echo_agent(f"{namespace}.w.a1", settings)
    assert settings.nats_url is not None
    agent_id, base, nats_flag = agent.agent_id, http_hub.http_url, ("--nats", settings.nats_url)
    too_long = "x" * (protocol.REASON_MAX + 1)
    since = time.time()

    async def cli(*argv: str) -> int:
        return await asyncio.to_thread(cli_main, list(argv))  # the CLI runs its own loop

    async with agent, Client(settings=settings) as c:
        assert await cli("cordon", agent_id, *nats_flag, "--reason", "disk swap") == 0
        assert await cli("cordon", agent_id, *nats_flag, "--reason", too_long) == 2
        nc = await nats.connect(settings.nats_url, inbox_prefix="_INBOX.operator.admin")
        try:
            claims = {"op": "uncordon", "agent_id": agent_id, "reason": "done", "requester": "x"}
            msg = await nc.request(
                protocol.hub_subject(namespace, "admin"), json.dumps(claims).encode(), timeout=5
            )
            assert json.loads(msg.data)["state"] == "ONLINE", msg.data
            bad = {"op": "quarantine", "agent_id": agent_id, "reason": too_long}
            msg = await nc.request(
                protocol.hub_subject(namespace, "admin"), json.dumps(bad).encode(), timeout=5
            )
            assert json.loads(msg.data)["error"]["code"] == "REACH_BAD_REQUEST", msg.data
        finally:
            await nc.close()
        with pytest.raises(BadRequestError, match="at most 200 characters"):
            await c.admin("quarantine", agent_id, reason=too_long)
        for reason in (too_long, "a tab\there"):
            status, body = await fetch(
                f"{base}/api/agents/{agent_id}/quarantine",
                "POST",
                json.dumps({"reason": reason}).encode(),
            )
            assert status == 400 and b"REACH_BAD_REQUEST" in body, body
        assert http_hub.registry.agents[agent_id].state.value == "ONLINE"  # nothing was done
        done: tuple[tuple[str, dict[str, str]], ...] = (
            ("quarantine", {"reason": "drill"}),
            ("release", {}),
            ("simulate-lost", {"reason": "drill"}),
        )
        for op, sent in done:
            status, body = await fetch(
                f"{base}/api/agents/{agent_id}/{op}", "POST", json.dumps(sent).encode()
            )
            assert status == 200, body
        status, body = await fetch(
            f"{base}/api/workflows/never-submitted/cancel?namespace={namespace}",
            "POST",
            json.dumps({"reason": "not needed"}).encode(),
        )
        assert status == 404 and b"REACH_UNKNOWN_WORKFLOW" in body, body
        await http_hub.audit.flush()
        events: list[dict[str, Any]] = []

        async def stored() -> bool:
            nonlocal events
            story = await c.audit(namespace=namespace, since=60)
            events = [e for e in story if e["kind"] in ("admin", "cancel") and e["ts"] >= since]
            return len(events) >= 6

        await eventually(stored, timeout=3.0)
        capsys.readouterr()
        assert await cli("audit", *nats_flag, "--namespace", namespace) == 0
    assert [(e["kind"], e.get("op"), e.get("requester"), e.get("reason")) for e in events] == [
        ("admin", "cordon", None, "disk swap"),
        ("admin", "uncordon", None, "done"),
        ("admin", "quarantine", "http", "drill"),
        ("admin", "release", "http", None),
        ("admin", "simulate-lost", "http", "drill"),
        ("cancel", None, "http", "not needed"),
    ]
    printed = capsys.readouterr().out
    assert f'agent_id={agent_id} op=cordon requester=anonymous reason="disk swap"\n' in printed
    assert f"agent_id={agent_id} op=release requester=http\n" in printed
    assert 'error=REACH_UNKNOWN_WORKFLOW requester=http reason="not needed"\n' in printed


async def test_audit_names_the_agent_of_a_failure_and_the_handlers_error(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """What an SRE asks of the audit after an incident: which agent a timeout was about (and
    ``--agent`` finds it), and why a handler failed."""
    agent = Agent(f"{namespace}.w.flaky", settings=settings)
    release = asyncio.Event()

    @agent.handler("work:hang:v1")
    async def hang(task: Task[Any]) -> str:
        await release.wait()
        return "late"

    @agent.handler("work:fail:v1")
    async def fail(task: Task[Any]) -> str:
        raise RuntimeError("the upstream said no")

    async with agent, Client(settings=settings) as c:
        with pytest.raises(MeshTimeoutError):
            await c.request(capability="work:hang:v1", timeout=0.3)
        failed = await c.request(capability="work:fail:v1")
        assert not failed.ok
        release.set()
        await hub.audit.flush()
        await hub.nc.flush()
        story = await c.audit(agent_id=agent.agent_id, namespace=namespace)
        routes = [e for e in story if e["kind"] == "route"]
        timeout = next(e for e in routes if e.get("error") == "REACH_TIMEOUT")
        assert timeout["agent_id"] == agent.agent_id and timeout["attempts"] == 1
        handled = next(e for e in routes if e.get("state") == "FAILED")
        assert handled["error"] == "REACH_HANDLER_FAILED"
        assert "the upstream said no" in handled["reason"]


async def test_an_agent_that_stops_answering_is_a_warning_at_once(
    hub: Hub,
    settings: MeshSettings,
    nats_url: str,
    namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hung agent (it takes tasks off NATS and never answers) shows in the hub's log at its
    first unanswered task, at WARNING, and in the audit under its id: not only when its lease
    runs out."""
    caplog.set_level("WARNING", logger="reach_mesh.hub")
    agent_id = f"{namespace}.w.hung"
    nc = await nats.connect(nats_url)
    try:
        card = {"agent_id": agent_id, "capabilities": ["work:hung:v1"]}
        body = json.dumps({"card": card, "session": "s1"}).encode()
        await nc.request(protocol.hub_agent_subject(agent_id, "register"), body, timeout=5)
        taken: list[Msg] = []

        async def take(msg: Msg) -> None:
            taken.append(msg)  # and no answer: what a SIGSTOPped agent looks like

        await nc.subscribe(protocol.agent_task(agent_id), cb=take)
        async with Client(settings=settings) as c:
            for _ in range(3):
                with pytest.raises(MeshTimeoutError):
                    await c.request(agent_id=agent_id, timeout=0.2)
    finally:
        # Gone for good: the next tests' hubs must not find it in the registry's KV.
        bye = json.dumps({"agent_id": agent_id, "session": "s1"}).encode()
        await nc.request(protocol.hub_agent_subject(agent_id, "unregister"), bye, timeout=5)
        await nc.close()
    assert len(taken) == 3
    lines = [r for r in caplog.records if getattr(r, "event", None) == "REACH-AGENT-TIMEOUT"]
    # One line per 10 s, not one per task.
    assert [r.__dict__["agent_id"] for r in lines] == [agent_id]


async def test_slow_routes_are_logged_once_per_agent_per_interval(
    hub: Hub, settings: MeshSettings, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A route over 250 ms logs ``REACH-ROUTE-LATENCY``, but an agent whose every route is
    slow (an overloaded hub, a slow handler) gets one line per 10 s, not one per request."""
    caplog.set_level("INFO", logger="reach_mesh.hub")
    agent = Agent(f"{namespace}.w.slow", settings=settings)

    @agent.handler("work:slow:v1")
    async def slow(task: Task[Any]) -> Any:
        await asyncio.sleep(0.3)
        return task.payload

    async with agent, Client(settings=settings) as c:
        answers = await asyncio.gather(
            *(c.request(capability="work:slow:v1", payload=i, timeout=5) for i in range(4))
        )
    assert [a.ok for a in answers] == [True] * 4
    lines = [r for r in caplog.records if getattr(r, "event", None) == "REACH-ROUTE-LATENCY"]
    assert [(r.__dict__["agent_id"], r.__dict__["suppressed"]) for r in lines] == [
        (agent.agent_id, 0)
    ]
    assert lines[0].__dict__["elapsed_ms"] > 250


async def test_warnings_tell_a_lost_agent_and_hold_back_repeated_no_matches(
    hub: Hub, settings: MeshSettings, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent that goes LOST leaves every listing, so the hub says so in its log; a caller
    that keeps asking for what nobody serves gets one line per 10 s, not one per request."""
    caplog.set_level("WARNING", logger="reach_mesh")
    agent = echo_agent(f"{namespace}.w.gone", settings)
    async with Client(settings=settings) as c:
        for _ in range(5):
            with pytest.raises(NoMatchError):
                await c.request(capability="work:nobody:v1", timeout=1)
        async with agent:
            await eventually(lambda: agent.agent_id in hub.registry.agents)
            await partition(agent)
            await eventually(lambda: agent.agent_id not in hub.registry.agents, timeout=5)
            # Gone from every listing, but not without a trace.
            (lost,) = [e for e in await c.recently_lost() if e["agent_id"] == agent.agent_id]
            assert lost["capabilities"] == ["work:echo:v1"] and lost["lost_at"] > 0

            # The query's filters keep those that match: asked for others, it is not there.
            def listed(fleet: dict[str, Any]) -> bool:
                return agent.agent_id in [e["agent_id"] for e in fleet["recently_lost"]]

            assert listed(await c.fleet(state="LOST"))
            assert listed(await c.fleet(capability="work:echo:v1"))
            assert not listed(await c.fleet(state="ONLINE"))
            assert not listed(await c.fleet(capability="work:other:v1"))
            with pytest.raises(UnknownAgentError, match="was declared LOST"):
                await c.inspect(agent.agent_id)
            fleet = dash.fleet(hub)  # the dashboard's LOST card counts it
            assert fleet["by_state"]["LOST"] >= 1
            assert agent.agent_id in [e["agent_id"] for e in fleet["recently_lost"]]
        # An agent that says goodbye is not lost; one that comes back no longer is.
        polite = echo_agent(f"{namespace}.w.polite", settings)
        async with polite:
            await eventually(lambda: polite.agent_id in hub.registry.agents)
        async with echo_agent(agent.agent_id, settings):
            await eventually(lambda: agent.agent_id in hub.registry.agents)
            back = [e["agent_id"] for e in await c.recently_lost()]
        assert agent.agent_id not in back
        gone = [e["agent_id"] for e in await c.recently_lost()]
        assert polite.agent_id not in gone and agent.agent_id not in gone

    def lines(event: str) -> list[Any]:
        return [r for r in caplog.records if getattr(r, "event", None) == event]

    empty = [r for r in lines("REACH-SELECT-EMPTY") if r.target == "work:nobody:v1"]
    assert len(empty) == 1 and empty[0].namespace == namespace
    states = [r.state for r in lines("REACH-LEASE-EXPIRED") if r.agent_id == agent.agent_id]
    # (A heartbeat already on its way may make it ONLINE, then SUSPECT, once more.)
    assert states[-1] == "LOST" and set(states[:-1]) == {"SUSPECT"}
    assert hub.metrics.lease_expired_total.labels(namespace)._value.get() == len(states) - 1


async def test_a_failing_handler_is_logged_with_its_task_and_one_traceback(
    hub: Hub, settings: MeshSettings, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="reach_mesh.agent")
    agent = Agent(f"{namespace}.w.buggy", settings=settings)

    @agent.handler("work:bug:v1")
    async def bug(task: Task[Any]) -> str:
        raise KeyError("sku")

    async with agent, Client(settings=settings) as c:
        results = [await c.request(capability="work:bug:v1", payload=i) for i in range(3)]
    lines = [r for r in caplog.records if getattr(r, "event", None) == "REACH-HANDLER-FAILED"]
    assert [r.levelname for r in lines] == ["WARNING"] * 3
    assert [r.__dict__["task_id"] for r in lines] == [res.task_id for res in results]
    assert [r.__dict__["trace_id"] for r in lines] == [res.trace_id for res in results]
    # The traceback once (per capability per minute), not on every failing task.
    assert [r.exc_info is not None for r in lines] == [True, False, False]


def test_cli_against_a_running_mesh(
    nats_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    agent_id = f"{namespace}.w.a1"
    nats = ("--nats", nats_url)
    ns = ("--namespace", namespace)

    async def scenario() -> None:
        settings = MeshSettings(nats_url=nats_url, namespace=namespace)
        async with Hub(settings=settings), echo_agent(agent_id, settings):

            async def cli(*argv: str) -> int:
                # The CLI runs its own event loop: call it from a worker thread.
                return await asyncio.to_thread(cli_main, list(argv))

            assert await cli("agents", *nats, *ns) == 0
            sel = ("--selector", "cap=work:echo:v1")
            assert (
                await cli("reach", *nats, *ns, *sel, "--payload", '{"a": 1}', "--show-decision")
                == 0
            )
            assert await cli("inspect", *nats, agent_id) == 0
            assert await cli("snapshot", *nats) == 0
            assert await cli("audit", *nats, "--agent", agent_id) == 0
            bad = ("--selector", "cap=work:echo:v1 AND")
            assert await cli("reach", *nats, *ns, *bad, "--payload", "1") == 2

    asyncio.run(scenario())
    out = capsys.readouterr()
    assert f"{namespace}.w.a1" in out.out and "ONLINE" in out.out
    assert "CHOSEN" in out.err  # the decision table (stdout is the JSON answer, decision in it)
    assert '"state": "SUCCEEDED"' in out.out and '"decision": {' in out.out
    assert "REACH_BAD_SELECTOR" in out.err


# ---------------------------------------------------------------------------- tracing


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """An SDK provider installed globally for this test, then the old global put back."""
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    span_exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    try:
        yield span_exporter
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


def _parent_span_id(s: ReadableSpan) -> int:
    assert s.parent is not None
    return s.parent.span_id


async def test_one_trace_id_across_caller_hub_agent(
    exporter: InMemorySpanExporter, hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = echo_agent(f"{namespace}.w.a1", settings)
    tracer = trace.get_tracer("test")
    async with agent, Client(settings=settings) as c:
        with tracer.start_as_current_span("caller") as root:
            res = await c.request(capability="work:echo:v1", payload=1)
    finished = exporter.get_finished_spans()
    (caller,) = [s for s in finished if s.name == "reach.route" and s.kind is SpanKind.CLIENT]
    spans = {s.name: s for s in finished if s is not caller}
    trace_id = format(root.get_span_context().trace_id, "032x")
    assert res.trace_id == trace_id
    assert res.result["trace_id"] == trace_id  # the handler sees it too
    for name in ("reach.route", "reach.deliver", "reach.handle"):
        assert format(spans[name].context.trace_id, "032x") == trace_id, name
    assert _parent_span_id(caller) == root.get_span_context().span_id
    assert _parent_span_id(spans["reach.route"]) == caller.context.span_id
    assert _parent_span_id(spans["reach.deliver"]) == spans["reach.route"].context.span_id
    assert _parent_span_id(spans["reach.handle"]) == spans["reach.deliver"].context.span_id
    attrs = spans["reach.route"].attributes
    assert attrs is not None
    assert attrs["messaging.system"] == "nats"
    assert attrs["reach.agent_id"] == agent.agent_id


async def test_batched_requests_keep_one_trace_each(
    exporter: InMemorySpanExporter, hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """Concurrent requests travel in batches on every hop; each keeps its own trace."""
    agent = echo_agent(f"{namespace}.w.a1", settings)
    tracer = trace.get_tracer("test")
    assert settings.nats_url is not None
    watcher = await nats.connect(settings.nats_url)
    lines: list[int] = []

    async def watch(msg: Msg) -> None:
        lines.append(len(msg.data.split(b"\n")))

    await watcher.subscribe(f"reach.hub.{namespace}.route_batch", cb=watch)
    await watcher.subscribe(f"reach.agent.{namespace}.w.a1.batch", cb=watch)
    await watcher.flush()
    async with agent, Client(settings=settings) as c:

        async def one(i: int) -> tuple[str, Any]:
            with tracer.start_as_current_span(f"caller-{i}") as root:
                res = await c.request(capability="work:echo:v1", payload=i)
            return format(root.get_span_context().trace_id, "032x"), res

        results = await asyncio.gather(*(one(i) for i in range(10)))
    await watcher.close()
    assert lines and max(lines) > 1  # they did travel in batches
    spans = exporter.get_finished_spans()
    for trace_id, res in results:
        assert res.trace_id == trace_id and res.result["trace_id"] == trace_id
        mine = {
            s.name: s
            for s in spans
            if format(s.context.trace_id, "032x") == trace_id
            and not (s.name == "reach.route" and s.kind is SpanKind.CLIENT)
        }
        assert set(mine) >= {"reach.route", "reach.deliver", "reach.handle"}
        assert _parent_span_id(mine["reach.deliver"]) == mine["reach.route"].context.span_id
        assert _parent_span_id(mine["reach.handle"]) == mine["reach.deliver"].context.span_id


async def test_trace_id_without_tracing_configured(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = echo_agent(f"{namespace}.w.a1", settings)
    async with agent, Client(settings=settings) as c:
        res = await c.request(capability="work:echo:v1", payload=1)
    assert res.trace_id and len(res.trace_id) == 32
    assert res.result["trace_id"] == res.trace_id


async def test_chain_spans_share_one_trace(
    exporter: InMemorySpanExporter, hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """caller → hub (workflow, steps) → agent 1 → agent 2: one trace, linked spans."""
    from reach_mesh import Step

    first = echo_agent(f"{namespace}.w.first", settings)
    second = Agent(f"{namespace}.w.second", settings=settings)

    @second.handler("work:upper:v1")
    async def upper(task: Task[Any]) -> Any:
        return {"trace_id": task.trace_id, "seen": task.payload}

    tracer = trace.get_tracer("test")
    async with first, second, Client(settings=settings) as c:
        with tracer.start_as_current_span("caller") as root:
            res = await c.chain(
                [
                    Step(capability="work:echo:v1", payload={"x": 1}),
                    Step(capability="work:upper:v1"),
                ],
                timeout=20,
            )
    assert res.ok, res
    trace_id = format(root.get_span_context().trace_id, "032x")
    assert res.trace_id == trace_id
    assert res.result["trace_id"] == trace_id
    spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    assert "reach.workflow" in names and names.count("reach.step") >= 2
    assert names.count("reach.handle") == 2
    ids = {s.context.span_id: s for s in spans}
    for s in spans:
        if s.name.startswith("reach."):
            assert format(s.context.trace_id, "032x") == trace_id, s.name
            assert s.parent is not None and s.parent.span_id in ids | {
                root.get_span_context().span_id: root
            }, s.name
    handles = [s for s in spans if s.name == "reach.handle"]
    assert all(ids[h.parent.span_id].name == "reach.step" for h in handles if h.parent)


async def test_cli_agent_command_serves_a_module(
    hub: Hub, settings: MeshSettings, namespace: str, nats_url: str, tmp_path: Path
) -> None:
    """`reach-mesh agent module:attr` runs a user's agent until SIGTERM, then drains."""
    (tmp_path / "myagents.py").write_text(
        "from typing import Any\n"
        "from reach_mesh.agent import Agent, Task\n"
        f"agent = Agent('{namespace}.cli.a1')\n"
        "@agent.handler('cli:echo:v1')\n"
        "async def echo(task: Task[Any]) -> Any:\n"
        "    return {'echo': task.payload}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach_mesh.cli",
        "agent",
        "myagents:agent",
        "--nats",
        nats_url,
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await eventually(lambda: f"{namespace}.cli.a1" in hub.registry.agents, timeout=15)
        async with Client(settings=settings) as c:
            res = await c.request(capability="cli:echo:v1", payload=5)
            assert res.result == {"echo": 5}
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=15) == 0
        await eventually(lambda: f"{namespace}.cli.a1" not in hub.registry.agents, timeout=5)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_http_token_guards_the_api_not_metrics_or_probes(
    settings: MeshSettings, namespace: str
) -> None:
    token = "s3cret-token-of-the-hub"
    hub_settings = settings.model_copy(update={"http_port": 0, "http_token": token})
    async with Hub(settings=hub_settings) as hub, echo_agent(f"{namespace}.w.a1", settings):
        base = hub.http_url
        assert base is not None
        good = {"Authorization": f"Bearer {token}"}
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            status, body = await fetch(f"{base}/api/agents?namespace={namespace}", headers=headers)
            assert status == 401
            assert json.loads(body)["error"]["code"] == "REACH_UNAUTHORIZED"
        rpc = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()
        for method, path, body_in in (
            ("POST", f"/api/agents/{namespace}.w.a1/cordon", None),
            ("POST", f"/api/route?namespace={namespace}", b"{}"),
            ("GET", "/api/tools", None),
            ("POST", "/mcp", rpc),
        ):
            status, _ = await fetch(base + path, method, body_in)
            assert status == 401, path
        # Nothing was done by the refused calls.
        assert hub.registry.agents[f"{namespace}.w.a1"].state.value == "ONLINE"
        status, body = await fetch(f"{base}/api/agents?namespace={namespace}", headers=good)
        assert status == 200
        assert [a["agent_id"] for a in json.loads(body)["agents"]] == [f"{namespace}.w.a1"]
        status, body = await fetch(
            f"{base}/api/route?namespace={namespace}",
            "POST",
            json.dumps({"capability": "work:echo:v1", "payload": 1}).encode(),
            headers=good,
        )
        assert status == 200, body
        for path in ("/metrics", "/healthz", "/", "/openapi.json"):
            status, _ = await fetch(base + path)
            assert status == 200, path


def test_http_token_must_not_be_guessable() -> None:
    with pytest.raises(ValidationError):
        MeshSettings(http_token="short")


async def test_audit_events_keep_a_bounded_selector(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """The audit stream is shared and ages out by size: a caller's long selectors are clipped in
    its events, so they cannot push every tenant's history out of it."""
    agent = echo_agent(f"{namespace}.w.a1", settings)
    selector = "cap=work:echo:v1 AND note=" + "y" * 3000
    async with agent, Client(settings=settings) as c:
        with pytest.raises(NoMatchError) as info:
            await c.request(selector=selector, payload=1)
        await hub.audit.flush()
        await hub.nc.flush()
        (event,) = await c.audit(request_id=info.value.details["decision"]["request_id"])
    assert len(event["target"]) <= 512 and len(event["reason"]) <= 512
    assert event["target"].startswith("cap=work:echo:v1 AND note=yyy")
