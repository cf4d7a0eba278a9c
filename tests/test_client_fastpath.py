"""The caller's request path writes and reads the wire without building the pydantic models.

These tests hold it to the models: the same JSON out, the same typed errors for bad arguments
(before anything is sent), and typed errors, never a crash, for malformed replies.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._client_fields import (
    _PROXY_REPLY,
    _TASK_REPLY,
    _envelope,
    _parse,
    _route_fields,
)
from reach_mesh.errors import (
    BadRequestError,
    InvalidAgentIdError,
    InvalidCapabilityError,
    PayloadTooLargeError,
    ReachError,
)
from reach_mesh.models import RouteRequest, TaskEnvelope

_DEFAULTS: dict[str, Any] = {
    "agent_id": None,
    "capability": None,
    "selector": None,
    "payload": None,
    "task_id": None,
    "timeout": 30.0,
    "mode": "proxy",
    "strategy": None,
    "session_id": None,
    "hash_key": None,
    "region": None,
    "zone": None,
    "explain": False,
}


def _client() -> Client:
    return Client(settings=MeshSettings(nats_url="nats://127.0.0.1:1"), namespace="t")


def _both(**args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the fast path's body, the model's body) for the same arguments, as parsed JSON."""
    fields = _route_fields(**{**_DEFAULTS, **args})
    fast = json.loads(_client()._encode(fields))
    model = RouteRequest(**{**_DEFAULTS, **args, "task_id": fields["task_id"]})
    return fast, json.loads(protocol.encode(model))


@pytest.mark.parametrize(
    "args",
    [
        {"capability": "data:query:v1", "payload": {"q": 1}},
        {"agent_id": "t.svc.i1", "payload": [1, None, "x"]},
        {"agent_id": "t.svc.i1", "capability": "data:query:v1"},
        {"selector": "cap=data:query:v1 AND region=eu-west", "payload": 'é\u2028"\\\n'},
        {"capability": "a:b:v1", "payload": {"nan": math.nan, "inf": -math.inf}},
        {"capability": "a:b:v1", "timeout": 5, "mode": "direct", "task_id": "my-task_1"},
        {
            "capability": "a:b:v1",
            "strategy": "round_robin",
            "session_id": "conv-42",
            "hash_key": "k",
            "region": "eu-west",
            "zone": "eu-west-1a",
            "explain": True,
        },
    ],
)
def test_route_body_is_what_the_model_sends(args: dict[str, Any]) -> None:
    fast, model = _both(**args)
    assert fast == model


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(payload=_JSON)
def test_any_payload_is_written_as_the_model_writes_it(payload: Any) -> None:
    fields = _route_fields(**{**_DEFAULTS, "capability": "a:b:v1", "payload": payload})
    model = RouteRequest(capability="a:b:v1", payload=payload, task_id=fields["task_id"])
    # Same JSON; the keys come in another order.
    assert json.loads(_client()._encode(fields)) == json.loads(protocol.encode(model))
    env = _envelope(fields, 2, "t", 1.5)
    expected = TaskEnvelope(
        task_id=fields["task_id"],
        attempt=2,
        capability="a:b:v1",
        payload=payload,
        namespace="t",
        timeout=1.5,
    )
    assert _client()._encode(env) == protocol.encode(expected)


def test_default_task_ids_are_uuid4_shaped_and_unique() -> None:
    ids = {_route_fields(**{**_DEFAULTS, "capability": "a:b:v1"})["task_id"] for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 32 and protocol.TASK_ID_RE.match(i) for i in ids)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"agent_id": "Bad.x.y"}, InvalidAgentIdError),
        ({"agent_id": "a.b"}, InvalidAgentIdError),
        ({"agent_id": 7}, InvalidAgentIdError),
        ({"capability": "email:send"}, InvalidCapabilityError),
        ({"capability": 7}, InvalidCapabilityError),
        ({"agent_id": "t.svc.i1", "capability": "nope"}, InvalidCapabilityError),
        ({"capability": "a:b:v1", "task_id": "has space"}, BadRequestError),
        ({"capability": "a:b:v1", "task_id": "x" * 65}, BadRequestError),
        ({}, BadRequestError),
        ({"selector": ""}, BadRequestError),
        ({"capability": "a:b:v1", "selector": "cap=a:b:v1"}, BadRequestError),
        ({"agent_id": "t.svc.i1", "selector": "cap=a:b:v1"}, BadRequestError),
        ({"selector": "x" * 4097}, BadRequestError),
        ({"capability": "a:b:v1", "timeout": -1}, BadRequestError),
        ({"capability": "a:b:v1", "timeout": math.nan}, BadRequestError),
        ({"capability": "a:b:v1", "timeout": 86401}, BadRequestError),
        ({"capability": "a:b:v1", "mode": "broadcast"}, BadRequestError),
        ({"capability": "a:b:v1", "strategy": "s" * 33}, BadRequestError),
        ({"capability": "a:b:v1", "session_id": ""}, BadRequestError),
        ({"capability": "a:b:v1", "hash_key": 5}, BadRequestError),
        ({"capability": "a:b:v1", "region": "r" * 65}, BadRequestError),
        ({"capability": "a:b:v1", "zone": "z" * 65}, BadRequestError),
    ],
)
def test_bad_arguments_raise_what_the_model_raises(
    args: dict[str, Any], error: type[BadRequestError]
) -> None:
    with pytest.raises(error) as fast:
        _route_fields(**{**_DEFAULTS, **args})
    assert type(fast.value) is error
    # The model refuses the same arguments (with a pydantic error where it has no typed one).
    with pytest.raises((ReachError, ValidationError)) as model:
        RouteRequest(**{**_DEFAULTS, **args})
    if isinstance(model.value, ReachError):
        assert type(model.value) is error


async def test_bad_arguments_raise_before_anything_is_sent() -> None:
    client = _client()  # never connected: any I/O would raise RuntimeError
    with pytest.raises(InvalidCapabilityError):
        await client.request(capability="Email:send:v1")
    with pytest.raises(BadRequestError, match="exactly one of"):
        await client.request(payload=1, mode="direct")
    with pytest.raises(PayloadTooLargeError):
        await client.request(capability="a:b:v1", payload="x" * ((1 << 20) + 32 * 1024))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[]",
        b'{"request_id": "r1"}',
        b'{"request_id": "r1", "task": null}',
        b'{"request_id": "r1", "task": {"task_id": "t", "attempt": 1, "agent_id": "a.b.c"}}',
        b'{"request_id": "r1", "task": {"task_id": "t", "attempt": 1, "agent_id": "a.b.c",'
        b' "state": "EXPLODED"}}',
        b'{"request_id": "r1", "task": {"task_id": "t", "attempt": 1, "agent_id": "a.b.c",'
        b' "state": "FAILED", "error": {"code": 5}}}',
    ],
)
def test_malformed_replies_raise_typed_errors(data: bytes) -> None:
    with pytest.raises(BadRequestError):
        _parse(_PROXY_REPLY, data, "RouteReply")


def test_replies_parse_with_optional_fields_left_out() -> None:
    task = _parse(
        _TASK_REPLY,
        b'{"task_id": "t", "attempt": 1, "agent_id": "a.b.c", "state": "SUCCEEDED", "x": 1}',
        "TaskReply",
    )
    result = _client()._result(task, "r1", None, None, 0.0)
    assert result.ok and result.result is None and not result.cached and result.handler_ms == 0.0
    failed = _parse(
        _TASK_REPLY,
        b'{"task_id": "t", "attempt": 2, "agent_id": "a.b.c", "state": "FAILED",'
        b' "error": {"code": "REACH_HANDLER_FAILED", "message": "boom"}, "duration_ms": 3.5}',
        "TaskReply",
    )
    result = _client()._result(failed, None, None, None, 0.0)
    assert result.error is not None and result.error.code == "REACH_HANDLER_FAILED"
    assert result.attempt == 2 and result.handler_ms == 3.5


async def test_clients_sharing_a_connection_leave_no_refusal_listener_behind(
    nats_url: str, settings: MeshSettings
) -> None:
    """A client on a shared connection (an agent's, a hub's) listens for the subjects NATS
    refuses its identity while its routes are batched; once closed — or when it lost the race
    to start its batcher — it listens no more (each listener kept a batcher alive)."""
    from reach_mesh._nats import connect, refusals_of

    nc = await connect(nats_url, name="shared", settings=settings)
    try:
        refusals = refusals_of(nc)
        assert refusals is not None
        for _ in range(5):
            async with Client(settings=settings, nc=nc) as c:
                await asyncio.gather(*(c._start_batcher() for _ in range(3)))
                assert len(refusals.listeners) == 1
        assert refusals.listeners == []
    finally:
        await nc.close()
