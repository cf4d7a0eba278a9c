"""Bad input gets a typed error with a stable code naming the bad value; the hub keeps serving
and nothing registered is lost. Requests are sent raw, as a client in another language would."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from reach_mesh import Client, MeshSettings, PayloadTooLargeError, protocol
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import ReachError
from reach_mesh.hub import Hub


@pytest.fixture
async def agent(hub: Hub, settings: MeshSettings, namespace: str) -> AsyncIterator[Agent]:
    a = Agent(f"{namespace}.echo.a1", settings=settings)

    @a.handler("text:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    async with a:
        yield a


async def ask(nc: NATS, subject: str, body: bytes | dict[str, Any]) -> dict[str, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg = await nc.request(subject, data, timeout=5)
    out: dict[str, Any] = json.loads(msg.data)
    return out


def register_body(ns: str, **card: Any) -> dict[str, Any]:
    base = {"agent_id": f"{ns}.svc.i1", "capabilities": ["text:echo:v1"]}
    base.update(card)
    return {"card": base, "session": "s1"}


def subject_for(namespace: str, verb: str, body: bytes | dict[str, Any]) -> str:
    """The subject a request goes to: an agent's own verbs name the agent (its body's id)."""
    if verb not in protocol.AGENT_VERBS:
        return protocol.hub_subject(namespace, verb)
    agent_id: Any = None
    if isinstance(body, dict):
        agent_id = body.get("card", body).get("agent_id")
    if not isinstance(agent_id, str) or not protocol.AGENT_ID_RE.match(agent_id):
        agent_id = f"{namespace}.svc.i1"
    return protocol.hub_agent_subject(agent_id, verb)


CASES = [
    ("register", b"{not json", "REACH_BAD_REQUEST", "malformed JSON"),
    ("register", b"[1,2]", "REACH_BAD_REQUEST", "RegisterRequest"),
    ("register", {"card": {"agent_id": "x.y.z"}}, None, "capabilities"),  # ns mismatch or missing
    (
        "register",
        {"card": {"agent_id": "Bad Id", "capabilities": ["a:b:v1"]}, "session": "s"},
        "REACH_BAD_AGENT_ID",
        "Bad Id",
    ),
    (
        "register",
        {"card": {"agent_id": "{ns}.svc.i1", "capabilities": ["nope"]}, "session": "s"},
        "REACH_BAD_CAPABILITY",
        "nope",
    ),
    (
        "register",
        {"card": {"agent_id": "{ns}.svc.i1", "capabilities": []}, "session": "s"},
        "REACH_BAD_CAPABILITY",
        "at least 1",
    ),
    (
        "register",
        {
            "card": {
                "agent_id": "{ns}.svc.i1",
                "capabilities": ["a:b:v1"],
                "max_concurrency": "lots",
            },
            "session": "s",
        },
        "REACH_BAD_REQUEST",
        "max_concurrency",
    ),
    (
        "register",
        {
            "card": {"agent_id": "{ns}.svc.i1", "capabilities": ["a:b:v1"]},
            "session": "s",
            "heartbeat_interval": 5,
            "lease_timeout": 10,
        },
        "REACH_BAD_LEASE",
        "3 x heartbeat_interval",
    ),
    # A tool's capability is what A2A and MCP route its calls to; its schema is what MCP
    # clients are given (one they refuse failed tools/list for everybody).
    (
        "register",
        register_body("{ns}", tools=[{"name": "t", "capability": "NOT A CAP"}]),
        "REACH_BAD_CAPABILITY",
        "card.tools.0.capability",
    ),
    (
        "register",
        register_body("{ns}", tools=[{"name": "t", "parameters": {"properties": 5}}]),
        "REACH_BAD_REQUEST",
        "properties must be an object of schemas",
    ),
    (
        "register",
        register_body("{ns}", tools=[{"name": "t", "parameters": {"type": 3, "required": ["a"]}}]),
        "REACH_BAD_REQUEST",
        "type must be a string",
    ),
    (
        "register",
        register_body("{ns}", tools=[{"name": "t", "parameters": {"required": "a"}}]),
        "REACH_BAD_REQUEST",
        "card.tools.0.parameters",
    ),
    ("heartbeat", {"agent_id": "{ns}.ghost.i1", "session": "s"}, "REACH_UNKNOWN_AGENT", "ghost"),
    (
        "heartbeat",
        {"agent_id": "{ns}.svc.i1", "session": "s", "inflight": -3},
        "REACH_BAD_REQUEST",
        "inflight",
    ),
    ("route", {"agent_id": "{ns}.nobody.i1", "payload": 1}, "REACH_NO_MATCH", "nobody"),
    ("route", {"payload": 1}, "REACH_BAD_REQUEST", "exactly one of"),
    ("route", {"capability": "text:echo", "payload": 1}, "REACH_BAD_CAPABILITY", "text:echo"),
    (
        "route",
        {"selector": "cap=text:echo:v1 AND region=x OR gpu exists"},
        "REACH_BAD_SELECTOR",
        "position",
    ),
    ("route", {"capability": "text:echo:v1", "timeout": "soon"}, "REACH_BAD_REQUEST", "timeout"),
    # Strict types: refused, not converted (a 1 s timeout, a 5 s one, an explanation).
    ("route", {"capability": "text:echo:v1", "timeout": True}, "REACH_BAD_REQUEST", "timeout"),
    ("route", {"capability": "text:echo:v1", "timeout": "5"}, "REACH_BAD_REQUEST", "timeout"),
    ("route", {"capability": "text:echo:v1", "explain": "yes"}, "REACH_BAD_REQUEST", "explain"),
    ("route", {"capability": "text:echo:v1", "strategy": "magic"}, "REACH_BAD_REQUEST", "magic"),
    # after_attempt: a count, of a named task id.
    (
        "route",
        {"capability": "text:echo:v1", "task_id": "t1", "after_attempt": -1},
        "REACH_BAD_REQUEST",
        "after_attempt",
    ),
    (
        "route",
        {"capability": "text:echo:v1", "task_id": "t1", "after_attempt": "2"},
        "REACH_BAD_REQUEST",
        "after_attempt",
    ),
    (
        "route",
        {"capability": "text:echo:v1", "task_id": "t1", "after_attempt": 1_000_001},
        "REACH_BAD_REQUEST",
        "after_attempt",
    ),
    ("route", {"capability": "text:echo:v1", "after_attempt": 2}, "REACH_BAD_REQUEST", "task_id"),
    ("agents", b"{oops", "REACH_BAD_REQUEST", "malformed JSON"),
    # A lone surrogate: no JSON writer of the mesh could write it again.
    ("agents", b'{"namespace": "caf\\udce9"}', "REACH_BAD_REQUEST", "lone leading surrogate"),
    ("admin", {"op": "explode", "agent_id": "{ns}.echo.a1"}, "REACH_BAD_REQUEST", "explode"),
]


@pytest.mark.parametrize(("verb", "body", "code", "needle"), CASES)
async def test_bad_input_typed_error(
    nc: NATS,
    agent: Agent,
    hub: Hub,
    namespace: str,
    verb: str,
    body: bytes | dict[str, Any],
    code: str | None,
    needle: str,
) -> None:
    if isinstance(body, dict):
        body = json.loads(json.dumps(body).replace("{ns}", namespace))
    out = await ask(nc, subject_for(namespace, verb, body), body)
    assert "error" in out, out
    err = out["error"]
    if code is not None:
        assert err["code"] == code, err
    else:
        assert err["code"].startswith("REACH_"), err
    assert needle in err["message"] or needle in json.dumps(err), err
    # The hub keeps serving and the registered agent is untouched.
    ok = await ask(
        nc,
        protocol.hub_subject(namespace, "route"),
        {"agent_id": agent.agent_id, "payload": "still here"},
    )
    assert ok["task"]["result"] == "still here"
    assert agent.agent_id in hub.registry.agents


async def test_invalid_namespace_subject(nc: NATS, hub: Hub) -> None:
    out = await ask(nc, "reach.hub.BAD_NS.route", {"capability": "a:b:v1"})
    assert out["error"]["code"] == "REACH_BAD_REQUEST"
    assert "BAD_NS" in out["error"]["message"]


async def test_register_for_another_identity(nc: NATS, hub: Hub, namespace: str) -> None:
    subject = protocol.hub_agent_subject(f"{namespace}.svc.i1", "register")
    out = await ask(nc, subject, register_body("othertenant"))
    assert out["error"]["code"] == "REACH_IDENTITY_MISMATCH"
    assert "othertenant" in out["error"]["message"]
    assert "othertenant.svc.i1" not in hub.registry.agents


async def test_oversized_payload(
    nc: NATS, agent: Agent, settings: MeshSettings, namespace: str
) -> None:
    big = "x" * (settings.max_payload + 32 * 1024)
    out = await ask(
        nc, protocol.hub_subject(namespace, "route"), {"agent_id": agent.agent_id, "payload": big}
    )
    assert out["error"]["code"] == "REACH_PAYLOAD_TOO_LARGE"
    async with Client(settings=settings) as c:
        with pytest.raises(PayloadTooLargeError):
            await c.request(agent_id=agent.agent_id, payload=big)
        res = await c.request(agent_id=agent.agent_id, payload="small")
        assert res.result == "small"


def padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` with a ``pad`` field that makes it exactly ``size`` bytes of JSON."""
    bare = len(json.dumps({**body, "pad": ""}).encode())
    return json.dumps({**body, "pad": "x" * (size - bare)}).encode()


@pytest.mark.parametrize(
    ("verb", "body"),
    [
        ("agents", {}),
        ("workflow", {"workflow_id": "wf-none"}),
        ("workflows", {}),
        ("cancel", {"workflow_id": "wf-none"}),
        ("admin", {"op": "agents"}),
    ],
)
async def test_a_query_over_its_limit_is_refused_before_it_is_parsed(
    nc: NATS, hub: Hub, namespace: str, verb: str, body: dict[str, Any]
) -> None:
    """Queries and operator requests name an id or two: one over ``protocol.QUERY_MAX`` is
    ``REACH_PAYLOAD_TOO_LARGE`` (a caller's 8 MiB body held a hub's event loop 0.5 s in the
    parse, for every namespace); one at the limit is read as usual."""
    subject = protocol.hub_subject(namespace, verb)
    out = await ask(nc, subject, padded(body, protocol.QUERY_MAX + 1))
    assert out["error"]["code"] == "REACH_PAYLOAD_TOO_LARGE", out
    assert out["error"]["details"]["max_size"] == protocol.QUERY_MAX
    at_limit = await ask(nc, subject, padded(body, protocol.QUERY_MAX))
    assert (at_limit.get("error") or {}).get("code") != "REACH_PAYLOAD_TOO_LARGE", at_limit
    if verb in ("workflow", "cancel"):
        assert at_limit["error"]["code"] == "REACH_UNKNOWN_WORKFLOW"


async def test_bad_payload_type_fails_task_not_agent(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    a = Agent(f"{namespace}.typed.a1", settings=settings)

    @a.handler("math:double:v1")
    async def double(task: Task[int]) -> int:
        return task.payload * 2

    async with a, Client(settings=settings) as c:
        res = await c.request(capability="math:double:v1", payload="not a number")
        assert res.state.value == "FAILED"
        assert res.error is not None and res.error.code == "REACH_BAD_REQUEST"
        assert (await c.request(capability="math:double:v1", payload=21)).result == 42


async def test_agent_task_subject_rejects_garbage(nc: NATS, agent: Agent) -> None:
    out = await ask(nc, protocol.agent_task(agent.agent_id), b"\x00\xff garbage")
    assert out["error"]["code"] == "REACH_BAD_REQUEST"
    out = await ask(nc, protocol.agent_ctl(agent.agent_id), {"op": "nope"})
    assert out["error"]["code"] == "REACH_BAD_REQUEST"
    out = await ask(nc, protocol.agent_ctl(agent.agent_id), {"op": "ping"})
    assert out["agent_id"] == agent.agent_id


def test_sdk_validates_early() -> None:
    from reach_mesh.errors import InvalidAgentIdError, InvalidCapabilityError

    with pytest.raises(InvalidAgentIdError):
        Agent("no-dots")
    a = Agent("ns.svc.i1")
    with pytest.raises(InvalidCapabilityError):
        a.handler("bad")
    with pytest.raises(TypeError, match="async def"):

        @a.handler("a:b:v1")  # type: ignore[type-var]
        def sync_handler(task: Task[int]) -> int:
            return 1

    with pytest.raises(TypeError, match="need defaults"):

        @a.handler("a:b:v1")
        async def two(task: Task[int], other: int) -> int:
            return 1


@pytest.mark.parametrize(
    "check",
    [
        protocol.validate_namespace,
        protocol.validate_agent_id,
        protocol.validate_capability,
        protocol.validate_task_id,
        protocol.validate_workflow_id,
    ],
)
def test_an_id_ending_in_a_newline_is_refused(check: Any) -> None:
    """Python's ``$`` also matches before a final newline: such ids passed, and made subjects
    (and KV keys) nats-py refused later (a submission came back every second until it
    expired, see ``test_hub_survives_malformed_submissions``)."""
    good = {
        protocol.validate_namespace: "ns",
        protocol.validate_agent_id: "ns.svc.i1",
        protocol.validate_capability: "a:b:v1",
        protocol.validate_task_id: "t1",
        protocol.validate_workflow_id: "wf1",
    }[check]
    assert check(good) == good
    for bad in (good + "\n", good + "\r\n", "\n" + good):
        with pytest.raises(ReachError):
            check(bad)


@pytest.mark.parametrize(
    ("model", "body"),
    [
        ("TaskEnvelope", '{"task_id": "t1", "timeout": Infinity}'),
        ("TaskEnvelope", '{"task_id": "t1", "timeout": NaN}'),
        ("RetryPolicy", '{"ttl": Infinity}'),
        ("RetryPolicy", '{"silence_timeout": 1e999}'),
        ("WorkflowSpec", '{"workflow_id": "w", "kind": "fanout", "timeout": Infinity}'),
    ],
)
def test_an_infinite_timeout_is_refused(model: str, body: str) -> None:
    """JSON may say ``Infinity`` (or a number too large for a float): ``gt=0`` took it, and a
    direct-mode caller could run a handler with no deadline. Every timeout and interval on
    the wire is at most a day."""
    from pydantic import ValidationError

    from reach_mesh import models, workflow

    cls = getattr(models, model, None) or getattr(workflow, model)
    with pytest.raises(ValidationError):
        cls.model_validate_json(body)


@pytest.mark.parametrize("key", ["zoné", "\u0663", "stra\u00dfe", "gpu\u200b"])
def test_a_label_key_outside_ascii_is_refused(key: str) -> None:
    """``str.isalnum`` takes letters and digits of every script; a selector's keys are
    ASCII (``selector.KEY_RE``), so such a label could be registered but never selected."""
    from pydantic import ValidationError

    from reach_mesh.models import AgentCard

    with pytest.raises(ValidationError, match="invalid label key"):
        AgentCard(agent_id="ns.svc.i1", capabilities=["a:b:v1"], labels={key: "x"})
    assert AgentCard(
        agent_id="ns.svc.i1", capabilities=["a:b:v1"], labels={"Zone-1": "x"}
    ).labels == {"zone-1": "x"}


@pytest.mark.parametrize("policy", ["quorum(\u0661)", "quorum(\uff12)", "quorum(\u20031)"])
def test_a_quorum_outside_ascii_is_refused(policy: str) -> None:
    """``\\d`` and ``\\s`` match other scripts' digits and spaces, and ``int`` reads them:
    ``quorum(\\u0661)`` (an Arabic-Indic one) was a quorum of 1."""
    from reach_mesh.errors import WorkflowSpecError
    from reach_mesh.workflow import parse_policy

    assert parse_policy("quorum( 1 )", 2) == 1
    with pytest.raises(WorkflowSpecError, match="unknown policy"):
        parse_policy(policy, 2)


async def test_a_traceparent_with_a_space_is_a_fresh_trace_not_a_broken_batch(
    nc: NATS, agent: Agent, namespace: str
) -> None:
    """A version-01 traceparent whose added field held a space was taken as valid, kept, and
    put on the task batch line to the agent, whose fields are separated by spaces: every
    request of that batch failed. It is invalid now — a fresh trace, as other bad values."""
    odd = "01-" + "a" * 32 + "-" + "b" * 16 + "-01-x y"
    subject = protocol.hub_subject(namespace, "route")

    async def one(i: int) -> dict[str, Any]:
        body = json.dumps({"agent_id": agent.agent_id, "payload": i}).encode()
        msg = await nc.request(subject, body, timeout=5, headers={"traceparent": odd})
        out: dict[str, Any] = json.loads(msg.data)
        return out

    answers = await asyncio.gather(*(one(i) for i in range(10)))
    assert [a.get("task", a).get("result") for a in answers] == list(range(10)), answers
    assert all(a["task"]["state"] == "SUCCEEDED" for a in answers)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("queue_depth", int("1" + "0" * 400)),
        ("inflight", int("1" + "0" * 400)),
        ("queue_depth", -1),
        ("pressure", float("nan")),
        ("pressure", float("inf")),
        ("pressure", -0.5),
    ],
)
async def test_a_heartbeat_number_too_large_for_a_float_breaks_no_route(
    nc: NATS, agent: Agent, settings: MeshSettings, namespace: str, field: str, value: Any
) -> None:
    """A heartbeat's load is the agent's word, bounded: an ``inflight`` or ``queue_depth`` no
    float holds (JSON sets no bound) once made every route among the agent's peers
    ``REACH_INTERNAL`` (``load_score``'s ``OverflowError``); negative, NaN or infinite load
    would rank the agent first. Such a beat is refused, typed, and routing goes on."""
    rogue = f"{namespace}.rogue.r1"
    out = await ask(
        nc,
        protocol.hub_agent_subject(rogue, "register"),
        register_body(namespace) | {"card": {"agent_id": rogue, "capabilities": ["text:echo:v1"]}},
    )
    assert "error" not in out, out
    beat = {"agent_id": rogue, "session": "s1", field: value}
    out = await ask(nc, protocol.hub_agent_subject(rogue, "heartbeat"), beat)
    assert out["error"]["code"] == "REACH_BAD_REQUEST", out
    assert field in out["error"]["message"]
    async with Client(settings=settings) as c:
        for _ in range(10):
            res = await asyncio.wait_for(c.request(capability="text:echo:v1", payload="hi"), 5)
            assert (res.result, res.agent_id) == ("hi", agent.agent_id)
