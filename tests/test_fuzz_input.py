"""Mutated and garbage input on every subject a hub or an agent reads, on a real nats-server.

Each surface starts from a valid body; a seeded generator changes one to three things in it
(a value replaced by an odd one — null, a huge or negative number, a long or wildcard string, a
nested container —, a key removed or added) or replaces the whole message with garbage (not
JSON, a JSON scalar, 100,000 nested brackets). What must hold ("the hub never crashes on
input"):

- every request is answered, with a result or a typed error whose code is not
  ``REACH_INTERNAL``; over HTTP, no 500;
- nothing is logged at ERROR (an exception escaping a handler is logged there);
- afterwards the hub still routes to the agent and a workflow still runs on it;
- mutants of a running step's status events change its outcome only where one is a valid final
  status of the attempt sent, from its agent (the first such decides, as any first outcome).

``FUZZ_SEED`` and ``FUZZ_N`` (messages per surface, default 40) make a longer run:
``make fuzz`` runs 400 per surface.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import random
from typing import Any

import pytest

from reach_mesh import Client, MeshSettings, Step, TaskState, protocol
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.workflow import TaskStatusEvent

from .helpers import Fleet, echo_agent, eventually, fetch, mcp_session

pytestmark = pytest.mark.timeout(120)

SEED = int(os.environ.get("FUZZ_SEED", "1"))
N = int(os.environ.get("FUZZ_N", "40"))

_ODD: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    -(2**63),
    2**64,
    10**30,
    0.5,
    -0.0,
    1e308,
    -1e308,
    "",
    " ",
    "x",
    "ü\u0000",
    "a" * 3000,
    "*",
    ">",
    "a.b",
    "..",
    "$JS.API.STREAM.DELETE.REACH_WORK",
    "cap=wf:fuzz:v1 AND",
    [],
    [None],
    [[[]]],
    {},
    {"": None},
    {"a": {"b": {"c": []}}},
]

_GARBAGE: list[bytes] = [
    b"",
    b"{",
    b"{not json",
    b"null",
    b"[]",
    b'"a string"',
    b"1e999",
    b"NaN",
    b"\xff\xfe\x00",
    b'{"a": 1, "a": 2}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"x":' * 50_000 + b"1" + b"}" * 50_000,
]


def _odd(rng: random.Random, old: Any) -> Any:
    if rng.random() < 0.2:
        # The same value with another type.
        return rng.choice([str(old), [old], {"v": old}])
    return copy.deepcopy(rng.choice(_ODD))


def _mutate(rng: random.Random, value: Any, depth: int = 0) -> Any:
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        r = rng.random()
        if r < 0.2:
            del value[key]
        elif r < 0.3:
            value[key + rng.choice(["_", "X", ""])] = value.pop(key)
        elif r < 0.6 and depth < 4:
            value[key] = _mutate(rng, value[key], depth + 1)
        else:
            value[key] = _odd(rng, value[key])
        return value
    if isinstance(value, dict):
        value[rng.choice(["extra", "op", "agent_id", "attempt", ""])] = _odd(rng, None)
        return value
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = rng.randrange(len(value))
        value[i] = _mutate(rng, value[i], depth + 1) if depth < 4 else _odd(rng, value[i])
        return value
    return _odd(rng, value)


def _bodies(rng: random.Random, bases: list[Any], n: int) -> list[bytes]:
    out = []
    for _ in range(n):
        if rng.random() < 0.1:
            out.append(rng.choice(_GARBAGE))
            continue
        value = copy.deepcopy(rng.choice(bases))
        for _ in range(rng.randint(1, 3)):
            value = _mutate(rng, value)
        out.append(json.dumps(value).encode())
    return out


def _check_answer(surface: str, body: bytes, data: bytes) -> None:
    try:
        answer = json.loads(data)
    except ValueError:
        pytest.fail(f"{surface}: answer is not JSON: {data[:200]!r} (to {body[:200]!r})")
    if isinstance(answer, dict) and "error" in answer:
        code = answer["error"].get("code", "")
        assert code.startswith("REACH_"), (surface, body[:200], answer)
        assert code != "REACH_INTERNAL", (surface, body[:200], answer)


async def test_mutated_and_garbage_input_on_every_surface_is_refused_and_loses_nothing(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    ns = wf_settings.namespace
    agent = echo_agent(fleet, "fuzz.a1", "wf:fuzz:v1")
    await agent.start()
    me = agent.agent_id
    # State-changing bodies name agents that do not exist, so that valid mutants of them
    # leave the agent under test alone (its fate is checked at the end).
    ghost = f"{ns}.ghost.g1"
    card = {"agent_id": ghost, "capabilities": ["wf:ghost:v1"], "labels": {"zone": "a"}}
    env = {
        "task_id": "fz-1",
        "attempt": 1,
        "capability": "wf:fuzz:v1",
        "payload": {"a": 1},
        "namespace": ns,
        "timeout": 5,
        "workflow_id": "fzwf",
        "step": 0,
        "track": True,
    }
    status = {
        "task_id": "fz-1",
        "attempt": 1,
        "agent_id": me,
        "state": "SUCCEEDED",
        "workflow_id": "fzwf",
        "step": 0,
        "result": {"x": 1},
    }
    spec = {
        "workflow_id": "fzwf",
        "kind": "fanout",
        "steps": [{"capability": "wf:fuzz:v1", "payload": {"a": 1}, "timeout": 5}],
        "policy": "all",
        "timeout": 5,
        "namespace": ns,
    }
    route = {"capability": "wf:fuzz:v1", "payload": {"a": 1}, "timeout": 2}
    requests: dict[str, tuple[str, list[Any]]] = {
        "route": (protocol.hub_subject(ns, "route"), [route, {"agent_id": me, "payload": 1}]),
        "agents": (protocol.hub_subject(ns, "agents"), [{}, {"agent_id": me}]),
        "workflow": (protocol.hub_subject(ns, "workflow"), [{"workflow_id": "fzwf"}]),
        "workflows": (
            protocol.hub_subject(ns, "workflows"),
            [{}, {"state": ["FAILED"], "limit": 5, "since_s": 60}],
        ),
        "peer workflow": (
            protocol.hub_peer(ns, "workflow", wf_hub.hub_id),
            [{"workflow_id": "fzwf", "within_s": 1.0}],
        ),
        "cancel": (protocol.hub_subject(ns, "cancel"), [{"workflow_id": "fzwf", "reason": "fz"}]),
        "peer cancel": (
            protocol.hub_peer(ns, "cancel", wf_hub.hub_id),
            [{"workflow_id": "fzwf", "reason": None, "within_s": 1.0}],
        ),
        "admin": (
            protocol.hub_subject(ns, "admin"),
            [{"op": "cordon", "agent_id": ghost}, {"op": "agents", "all_namespaces": True}],
        ),
        "register": (
            protocol.hub_agent_subject(ghost, "register"),
            [{"card": card, "session": "s1", "heartbeat_interval": 5, "lease_timeout": 15}],
        ),
        "heartbeat": (
            protocol.hub_agent_subject(ghost, "heartbeat"),
            [{"agent_id": ghost, "session": "s1", "inflight": 1, "pressure": 0.5}],
        ),
        "unregister": (
            protocol.hub_agent_subject(ghost, "unregister"),
            [{"agent_id": ghost, "session": "s1"}],
        ),
        "agent ctl": (
            protocol.agent_ctl(me),
            [
                {"op": "ping"},
                {"op": "task_state", "task_id": "fz-ctl", "fence": 1},
                {"op": "cancel", "task_id": "fz-ctl", "attempt": 1},
            ],
        ),
        "agent task": (protocol.agent_task(me), [{**env, "workflow_id": None, "step": None}]),
    }
    publishes: dict[str, tuple[str, list[Any]]] = {
        "report": (
            protocol.hub_subject(ns, "report"),
            [{"agent_id": ghost, "success": False, "code": "REACH_TIMEOUT", "reporter": "r1"}],
        ),
        "status": (protocol.task_status(me, "fz-1"), [status]),
        "route_batch": (protocol.hub_subject(ns, "route_batch"), [route]),
        # A micro endpoint published to (no reply subject: nobody to answer).
        "micro agents": (protocol.micro_subject(wf_hub.hub_id, "agents"), [{}]),
    }
    stored: dict[str, tuple[str, list[Any], dict[str, str]]] = {
        "work": (protocol.work_subject(ns, me), [env], {}),
        "fence marker": (
            protocol.work_subject(ns, me),
            [{"task_id": "fz-1", "attempt": 1}],
            {protocol.HDR_FENCE: "1"},
        ),
        "submit": (protocol.wf_submit(ns), [spec], {}),
    }
    rng = random.Random(SEED)
    async with Client(settings=wf_settings) as mesh:
        nc = mesh.nc
        js = nc.jetstream()
        for surface, (subject, bases) in requests.items():
            for body in _bodies(rng, bases, N):
                try:
                    msg = await nc.request(subject, body, timeout=5)
                except Exception as err:  # pragma: no cover - the failure report
                    pytest.fail(f"{surface}: no answer to {body[:200]!r}: {err!r} (seed {SEED})")
                _check_answer(surface, body, msg.data)
        inbox = nc.new_inbox()
        for surface, (subject, bases) in publishes.items():
            for body in _bodies(rng, bases, N):
                if surface == "route_batch":
                    body = f"{inbox}.1 - ".encode() + body
                await nc.publish(subject, body, reply=inbox if surface == "route_batch" else "")
        for i, (subject, bases, headers) in enumerate(stored.values()):
            for j, body in enumerate(_bodies(rng, bases, N)):
                await js.publish(
                    subject, body, headers={**headers, protocol.HDR_MSG_ID: f"{ns}.fz{i}-{j}"}
                )
        await nc.flush()
        # Still serving: a route and a workflow on the agent under test.
        res = await mesh.request(capability="wf:fuzz:v1", payload={"after": 1}, timeout=10)
        assert res.agent_id == me and res.result == {"by": me, "in": {"after": 1}}
        done = await mesh.fanout([Step(agent_id=me, payload="after")], timeout=20)
        assert done.state is TaskState.SUCCEEDED, done
    assert wf_hub.registry.agents[me].state.value == "ONLINE"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [f"{r.name}: {r.getMessage()[:300]}" for r in errors]


async def test_mutated_and_garbage_input_on_every_http_surface_is_refused(
    settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """The hub's HTTP surfaces with the same generator: the REST route and operator actions,
    A2A ``SendMessage`` (raw JSON-RPC), MCP (raw bodies, and ``tools/call`` arguments through
    the official client). No answer is a 500, nothing is logged at ERROR, and a good call
    works afterwards on each."""
    caplog.set_level(logging.WARNING)
    ns = settings.namespace
    s = settings.model_copy(update={"http_port": 0})
    async with Hub(settings=s) as hub:
        agent = Agent(f"{ns}.fuzz.h1", settings=s)

        @agent.handler("fz:echo:v1", tool="echo")
        async def echo(task: Task[Any]) -> Any:
            return task.payload

        async with agent:
            await eventually(lambda: agent.agent_id in hub.registry.agents)
            base = hub.http_url
            assert base is not None
            ghost = f"{ns}.ghost.g1"
            route = {"capability": "fz:echo:v1", "payload": {"a": 1}, "timeout": 2}
            a2a = {
                "jsonrpc": "2.0",
                "id": "1",
                "method": "SendMessage",
                "params": {
                    "message": {
                        "messageId": "m-1",
                        "role": "ROLE_USER",
                        "parts": [{"data": {"n": 1}}],
                        "metadata": {"skill": "echo"},
                    },
                    "configuration": {},
                },
            }
            mcp = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/call",
                "params": {"name": "echo", "arguments": {"a": 1}},
            }
            posts: dict[str, tuple[str, list[Any]]] = {
                "REST route": (f"{base}/api/route?namespace={ns}", [route]),
                "A2A": (f"{base}/a2a/{ns}/", [a2a]),
                "MCP": (f"{base}/mcp?namespace={ns}", [mcp]),
                "operator action": (f"{base}/api/agents/{ghost}/cordon", [{}]),
            }
            rng = random.Random(SEED)
            mcp_headers = {"Accept": "application/json, text/event-stream"}
            for surface, (url, bases) in posts.items():
                for body in _bodies(rng, bases, N):
                    status, data = await fetch(
                        url, "POST", body, mcp_headers if surface == "MCP" else None
                    )
                    assert status < 500 or status in (502, 503, 504), (surface, body[:200], data)
            # A2A: a body over the payload limit is refused before anything buffers it; a
            # broken envelope is answered by the hub as JSON-RPC says.
            big = (
                b'{"jsonrpc":"2.0","id":1,"method":"SendMessage","params":{"x":"'
                + (b"a" * (s.max_payload + 70 * 1024))
                + b'"}}'
            )
            status, data = await fetch(f"{base}/a2a/{ns}/", "POST", big)
            assert status == 413 and json.loads(data)["error"]["code"] == -32600, data[:200]
            for body, code in ((b"[1]", -32600), (b"{x", -32700), (b"[" * 10**5, -32700)):
                status, data = await fetch(f"{base}/a2a/{ns}/", "POST", body)
                assert status == 200 and json.loads(data)["error"]["code"] == code, data[:200]
            for raw in ("x", "..", "a" * 300, "%00", ghost, f"{ns}.*.>"):
                status, data = await fetch(f"{base}/api/agents/{raw}")
                assert status < 500, (raw, status, data)
                status, data = await fetch(f"{base}/api/agents/{ghost}/{raw}", "POST", b"{}")
                assert status < 500, (raw, status, data)
            async with mcp_session(base, namespace=ns) as session:
                for body in _bodies(rng, [{"a": 1, "b": [1, "x"]}], N):
                    try:
                        arguments = json.loads(body)
                    except (ValueError, RecursionError):
                        continue
                    if isinstance(arguments, dict):
                        await session.call_tool("echo", arguments)
                good = await session.call_tool("echo", {"after": 1})
                assert good.is_error is not True, good
            status, data = await fetch(
                f"{base}/api/route?namespace={ns}",
                "POST",
                b'{"capability": "fz:echo:v1", "payload": 7}',
            )
            assert status == 200 and json.loads(data)["task"]["result"] == 7, data
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [f"{r.name}: {r.getMessage()[:300]}" for r in errors]


async def test_mutated_status_events_for_a_running_step_change_nothing_invalid(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """While a step runs, mutants of its agent's status events go out on that agent's own
    status subject (what a careless agent could send; in secure mode no one else can). The
    hub takes only a valid final status of the attempt it sent, from that agent — the first
    one decides the step —, and otherwise the handler's own result."""
    caplog.set_level(logging.WARNING)
    ns = wf_settings.namespace
    started, release = asyncio.Event(), asyncio.Event()
    agent = fleet.agent("fuzz.s1")

    @agent.handler("wf:hold:v1")
    async def hold(task: Task[Any]) -> Any:
        started.set()
        await release.wait()
        return {"true": 1}

    await agent.start()
    me, task_id = agent.agent_id, "fz-step"
    async with Client(settings=wf_settings) as mesh:
        wf_id = await mesh.submit_fanout([Step(agent_id=me, task_id=task_id)], timeout=30)
        await asyncio.wait_for(started.wait(), 10)
        event = {
            "task_id": task_id,
            "attempt": 1,
            "agent_id": me,
            "workflow_id": wf_id,
            "step": 0,
        }
        bases = [
            {**event, "state": "RUNNING", "progress": {"p": 1}},
            {**event, "attempt": 2, "state": "SUCCEEDED", "result": {"forged": 2}},
            {**event, "agent_id": f"{ns}.other.o1", "state": "SUCCEEDED", "result": {"f": 3}},
            {
                **event,
                "task_id": "fz-other",
                "state": "FAILED",
                "error": {"code": "X", "message": "x"},
            },
        ]
        first: TaskStatusEvent | None = None
        subject = protocol.task_status(me, task_id)
        for body in _bodies(random.Random(SEED), bases, N):
            with contextlib.suppress(ValueError):
                ev = TaskStatusEvent.model_validate_json(body)
                if (
                    first is None
                    and ev.state.final
                    and (ev.task_id, ev.attempt, ev.agent_id) == (task_id, 1, me)
                ):
                    first = ev
            await mesh.nc.publish(subject, body)
        await mesh.nc.flush()
        await asyncio.sleep(0.2)
        release.set()
        result = await mesh.workflow(wf_id, timeout=20)
    (step,) = result.steps
    if first is None:
        assert (result.state, step.state, step.result) == (
            TaskState.SUCCEEDED,
            TaskState.SUCCEEDED,
            {"true": 1},
        ), result
    else:
        assert step.state is first.state and step.result == first.result, (first, result)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [f"{r.name}: {r.getMessage()[:300]}" for r in errors]
