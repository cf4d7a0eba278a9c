"""``POST /api/route`` on its fast path (``reach_mesh/hub/_gateway.py``): routed by the hub that
took it (``Hub.route``), guarded like every route, the body validated once by the hub, and the
same endpoint whether the guard's short cut or FastAPI's route table reaches it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from reach_mesh import MeshSettings
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import MeshUnavailableError
from reach_mesh.hub import Hub

from .helpers import fetch

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
async def gw_hub(settings: MeshSettings) -> AsyncIterator[Hub]:
    update = {"http_port": 0, "max_payload": 4096}
    async with Hub(settings=settings.model_copy(update=update)) as hub:
        yield hub


def traced_agent(agent_id: str, settings: MeshSettings, calls: list[str]) -> Agent:
    """Answers with the trace id its task arrived with, and notes every call."""
    agent = Agent(agent_id, settings=settings)

    @agent.handler("work:trace:v1")
    async def trace(task: Task[Any]) -> Any:
        calls.append(task.task_id)
        return {"trace_id": task.trace_id, "payload": task.payload}

    return agent


def route_body(**fields: Any) -> bytes:
    return json.dumps({"capability": "work:trace:v1", **fields}).encode()


async def test_the_route_continues_the_callers_trace_and_finds_the_agents_namespace(
    gw_hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    calls: list[str] = []
    base = gw_hub.http_url
    async with traced_agent(f"{namespace}.w.a1", settings, calls) as agent:
        traceparent = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
        got, answer = await fetch(
            f"{base}/api/route?namespace={namespace}",
            "POST",
            route_body(payload={"n": 1}),
            {"traceparent": traceparent},
        )
        assert got == 200, answer
        reply = json.loads(answer)
        assert reply["agent_id"] == agent.agent_id
        assert reply["task"]["result"] == {"trace_id": TRACE_ID, "payload": {"n": 1}}
        # An agent id names its namespace, whatever ?namespace= says, in any JSON spelling.
        for key in ("agent_id", "agent\\u005fid"):
            body = f'{{"{key}": "{agent.agent_id}", "payload": 2}}'.encode()
            got, answer = await fetch(f"{base}/api/route?namespace=elsewhere", "POST", body)
            assert got == 200, (key, answer)
            assert json.loads(answer)["task"]["result"]["payload"] == 2
        # Without ?namespace= the request goes to ``default``, where nothing serves it.
        got, answer = await fetch(f"{base}/api/route", "POST", route_body())
        error = json.loads(answer)["error"]
        assert got == 404 and error["code"] == "REACH_UNKNOWN_NAMESPACE", answer
        assert error["details"]["namespace"] == "default"
        # A namespace in the body is not where a REST route's goes: refused, not ignored
        # (the task went to ``default``); the same one as the query's is harmless.
        got, answer = await fetch(f"{base}/api/route", "POST", route_body(namespace=namespace))
        error = json.loads(answer)["error"]
        assert got == 400 and error["details"]["field"] == "namespace", answer
        assert "?namespace=" in error["message"]
        got, answer = await fetch(
            f"{base}/api/route?namespace={namespace}", "POST", route_body(namespace=namespace)
        )
        assert got == 200, answer
    assert len(calls) == 4


async def test_the_fast_path_is_guarded_and_bounded(
    gw_hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    calls: list[str] = []
    base = gw_hub.http_url
    assert base is not None
    url = f"{base}/api/route?namespace={namespace}"
    async with traced_agent(f"{namespace}.w.a1", settings, calls):
        refusals: list[tuple[dict[str, str], int, str]] = [
            ({"Origin": "http://evil.example"}, 403, "REACH_FORBIDDEN_ORIGIN"),
            ({"Content-Type": "text/plain"}, 415, "REACH_UNSUPPORTED_MEDIA_TYPE"),
            ({"Host": f"rebind.example:{gw_hub.http.port}"}, 403, "REACH_FORBIDDEN_HOST"),
        ]
        for headers, status, code in refusals:
            got, answer = await fetch(url, "POST", route_body(), headers)
            assert (got, json.loads(answer)["error"]["code"]) == (status, code), headers
        # Over max_payload plus the request's own fields: refused before the hub decodes it.
        big = route_body(payload="x" * (4096 + 17 * 1024))
        got, answer = await fetch(url, "POST", big)
        assert got == 413 and json.loads(answer)["error"]["code"] == "REACH_PAYLOAD_TOO_LARGE"
        # The hub's decoder answers a bad body, with a typed 400 naming the field.
        got, answer = await fetch(url, "POST", route_body(timeout="soon"))
        assert got == 400, answer
        error = json.loads(answer)["error"]
        assert error["code"] == "REACH_BAD_REQUEST" and "timeout" in error["message"]
        got, answer = await fetch(f"{base}/api/route?namespace=Not..A..Token", "POST", b"{}")
        assert got == 400 and json.loads(answer)["error"]["code"] == "REACH_BAD_REQUEST"
        got, answer = await fetch(url)  # GET: the route table answers
        assert got == 405 and json.loads(answer)["error"]["code"] == "REACH_METHOD_NOT_ALLOWED"
    assert calls == []  # nothing refused reached the agent


async def test_fastapis_route_serves_the_same_endpoint(
    gw_hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """The route FastAPI documents is served by the same endpoint when reached through the
    framework's own route table (here: the app without the guard in front)."""
    calls: list[str] = []
    transport = httpx.ASGITransport(app=gw_hub.http.app)
    async with (
        traced_agent(f"{namespace}.w.a1", settings, calls),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client,
    ):
        response = await client.post(
            f"/api/route?namespace={namespace}",
            content=route_body(payload=3),
            headers={"Content-Type": "application/json"},
        )
        assert response.status_code == 200, response.text
        assert response.json()["task"]["result"]["payload"] == 3
        response = await client.post(
            f"/api/route?namespace={namespace}",
            content=b"[1,",
            headers={"Content-Type": "application/json"},
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "REACH_BAD_REQUEST"
    assert len(calls) == 1


async def test_hub_route_refuses_when_not_running(settings: MeshSettings) -> None:
    hub = Hub(settings=settings)
    with pytest.raises(MeshUnavailableError):
        await hub.route(route_body(), settings.namespace)
