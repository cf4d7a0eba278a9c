"""A2A with the official a2a-sdk client: a card per namespace whose skills are the live tools,
``message/send`` routed through the mesh, failures and unknown skills as A2A errors."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from a2a.client import ClientConfig, create_client
from a2a.client.card_resolver import A2ACardResolver
from a2a.types import GetTaskRequest, Message, Part, Role, SendMessageRequest, TaskState
from a2a.utils.errors import InvalidParamsError, TaskNotFoundError
from google.protobuf.json_format import ParseDict
from google.protobuf.struct_pb2 import Value

from reach_mesh import MeshSettings, protocol
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub

from .helpers import eventually

TOKEN = "token-of-the-a2a-hub"


def worker(agent_id: str, settings: MeshSettings) -> Agent:
    agent = Agent(agent_id, settings=settings)

    @agent.handler("work:echo:v1", tool="echo")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    @agent.handler("work:boom:v1", tool="boom")
    async def boom(task: Task[Any]) -> Any:
        raise RuntimeError("the handler broke")

    return agent


@pytest.fixture
async def a2a_hub(settings: MeshSettings) -> AsyncIterator[Hub]:
    update = {"http_port": 0, "http_token": TOKEN}
    async with Hub(settings=settings.model_copy(update=update)) as hub:
        yield hub


def message(skill: str, arguments: Any) -> SendMessageRequest:
    data = Value()
    ParseDict(arguments, data)
    return SendMessageRequest(
        message=Message(
            message_id=f"m-{skill}",
            role=Role.ROLE_USER,
            parts=[Part(data=data)],
            metadata={"skill": skill},
        )
    )


async def send(client: Any, request: SendMessageRequest) -> Any:
    last = None
    async for event in client.send_message(request):
        last = event
    return last


async def test_card_send_result_and_errors(
    a2a_hub: Hub, settings: MeshSettings, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    base = f"{a2a_hub.http_url}/a2a/{namespace}"
    async with worker(f"{namespace}.w.a1", settings), httpx.AsyncClient(headers=headers) as http:
        # Without the token: 401 before the SDK sees anything.
        assert (
            await httpx.AsyncClient().get(f"{base}/.well-known/agent-card.json")
        ).status_code == 401
        card = await A2ACardResolver(http, base).get_agent_card()
        assert card.name == f"reach-mesh {namespace}"
        skills = {s.id for s in card.skills}
        assert {"echo", "boom", "work:echo:v1"} <= skills
        client = await create_client(card, ClientConfig(httpx_client=http, streaming=False))
        answer = await send(client, message("echo", {"n": 1, "deep": {"x": [1, 2]}}))
        task = answer.task if answer.HasField("task") else answer
        assert task.status.state == TaskState.TASK_STATE_COMPLETED, task
        (artifact,) = task.artifacts
        assert json.loads(artifact.parts[0].text) == {"n": 1, "deep": {"x": [1, 2]}}
        # A failing handler: the A2A task FAILED, with the mesh's typed error.
        answer = await send(client, message("boom", {}))
        task = answer.task if answer.HasField("task") else answer
        assert task.status.state == TaskState.TASK_STATE_FAILED, task
        assert "REACH_HANDLER_FAILED" in task.status.message.parts[0].text
        # An unknown skill: an A2A (JSON-RPC) error, invalid params — the caller's mistake,
        # so no traceback in the hub's log.
        caplog.clear()
        with (
            caplog.at_level(logging.DEBUG),
            pytest.raises(InvalidParamsError, match="unknown skill"),
        ):
            await send(client, message("nope", {}))
        tracebacks = [r for r in caplog.records if r.exc_info]
        assert not tracebacks, [(r.name, r.getMessage()) for r in tracebacks]
        # A namespace with no agents has no card.
        got = await http.get(f"{a2a_hub.http_url}/a2a/nobody-here/.well-known/agent-card.json")
        assert got.status_code == 404
        error = got.json()["error"]
        assert error["code"] == "REACH_UNKNOWN_NAMESPACE", error
        assert error["details"] == {"namespace": "nobody-here"}
        assert "no agent has registered in namespace 'nobody-here'" in error["message"]


async def test_finished_tasks_kept_are_bounded(
    a2a_hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """a2a-sdk's in-memory store keeps every task for the life of the process (each with its
    message and result, up to ``max_payload`` each): the hub keeps the newest finished ones
    only, within a count and a byte budget, across namespaces. ``GetTask`` finds the newest;
    the oldest are gone."""
    assert a2a_hub.http is not None
    kept = a2a_hub.http.a2a.kept
    kept.count = 3
    headers = {"Authorization": f"Bearer {TOKEN}"}
    base = f"{a2a_hub.http_url}/a2a/{namespace}"
    async with worker(f"{namespace}.w.a1", settings), httpx.AsyncClient(headers=headers) as http:
        card = await A2ACardResolver(http, base).get_agent_card()
        client = await create_client(card, ClientConfig(httpx_client=http, streaming=False))
        ids = []
        for n in range(5):
            answer = await send(client, message("echo", {"n": n}))
            task = answer.task if answer.HasField("task") else answer
            assert task.status.state == TaskState.TASK_STATE_COMPLETED, task
            ids.append(task.id)
        assert len(kept) == 3
        newest = await client.get_task(GetTaskRequest(id=ids[-1]))
        assert newest.id == ids[-1] and newest.status.state == TaskState.TASK_STATE_COMPLETED
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id=ids[0]))
        # The byte budget: one more task, and only as many of the newest as fit are kept.
        kept.count, kept.size = 100, 2 * kept.bytes // 3
        answer = await send(client, message("echo", {"n": 5}))
        assert len(kept) < 3 and kept.bytes <= kept.size


async def test_one_namespace_pushes_out_its_own_tasks_not_anothers(
    a2a_hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """Over the byte budget, the namespace holding the most bytes loses its oldest task: a
    tenant sending large results cannot push another tenant's result out before it is read."""
    assert a2a_hub.http is not None
    kept = a2a_hub.http.a2a.kept
    other = f"{namespace}b"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        worker(f"{namespace}.w.a1", settings),
        worker(f"{other}.w.a1", settings),
        httpx.AsyncClient(headers=headers) as http,
    ):
        clients = {}
        for ns in (namespace, other):
            card = await A2ACardResolver(http, f"{a2a_hub.http_url}/a2a/{ns}").get_agent_card()
            clients[ns] = await create_client(
                card, ClientConfig(httpx_client=http, streaming=False)
            )

        async def send_in(ns: str, size: int) -> str:
            answer = await send(clients[ns], message("echo", {"pad": "x" * size}))
            task = answer.task if answer.HasField("task") else answer
            assert task.status.state == TaskState.TASK_STATE_COMPLETED, task
            return str(task.id)

        small = await send_in(other, 10)
        first = await send_in(namespace, 50_000)
        kept.size = kept.bytes + 150_000  # room for about two more large ones
        for _ in range(3):
            await send_in(namespace, 50_000)
        assert kept.bytes <= kept.size
        assert (await clients[other].get_task(GetTaskRequest(id=small))).id == small
        with pytest.raises(TaskNotFoundError):
            await clients[namespace].get_task(GetTaskRequest(id=first))


RAW_HEADERS = {
    "Authorization": f"Bearer {TOKEN}",
    "A2A-Version": "1.0",
    "Content-Type": "application/json",
}


def rpc(method: str, message: dict[str, Any]) -> bytes:
    """A raw JSON-RPC request, as a client in another language sends it (``NaN`` included:
    Python's ``json`` writes it, and the SDK's parser reads it)."""
    return json.dumps(
        {"jsonrpc": "2.0", "id": "1", "method": method, "params": {"message": message}}
    ).encode()


def errors_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the hub logged at ERROR, or with a traceback."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize(
    "message",
    [
        {"parts": [{"data": {"n": float("nan")}}], "metadata": {"skill": "echo"}},
        {"parts": [{"text": "hi"}], "metadata": {"skill": "echo", "arguments": float("inf")}},
    ],
    ids=["data-part", "metadata"],
)
async def test_a_message_holding_nan_is_invalid_params(
    a2a_hub: Hub,
    settings: MeshSettings,
    namespace: str,
    caplog: pytest.LogCaptureFixture,
    message: dict[str, Any],
) -> None:
    """NaN and Infinity have no JSON form: the SDK's ``MessageToDict`` refused them with a
    ``ValueError``, answered -32603 with a traceback at ERROR."""
    headers = RAW_HEADERS
    body = rpc("SendMessage", {"messageId": "m1", "role": "ROLE_USER", **message})
    async with worker(f"{namespace}.w.a1", settings) as agent, httpx.AsyncClient() as http:
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            got = await http.post(
                f"{a2a_hub.http_url}/a2a/{namespace}/", content=body, headers=headers
            )
        error = got.json()["error"]
        assert error["code"] == -32602, error
        assert "NaN and Infinity" in error["message"], error
        assert not errors_in(caplog)
        assert agent.handled == 0


async def test_a_tool_whose_capability_no_route_takes_fails_its_task(
    a2a_hub: Hub, settings: MeshSettings, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A card stored before registration checked tool capabilities may name one no route
    takes: a message to that skill failed with -32603 and ERROR tracebacks. Its A2A task
    fails now, with the typed error."""
    headers = RAW_HEADERS
    async with worker(f"{namespace}.w.a1", settings) as agent, httpx.AsyncClient() as http:
        stored = a2a_hub.registry.agents[agent.agent_id].record.model_dump(mode="json")
        stored["card"]["tools"].append({"name": "odd", "capability": "NOT A CAP"})
        kv = await agent.nc.jetstream().key_value(protocol.KV_AGENTS)
        await kv.put(agent.agent_id, json.dumps(stored).encode())
        await eventually(lambda: "odd" in a2a_hub.http.a2a.skills(namespace))
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            message = {"messageId": "m1", "role": "ROLE_USER", "parts": [{"data": {}}]}
            body = rpc("SendMessage", {**message, "metadata": {"skill": "odd"}})
            got = await http.post(
                f"{a2a_hub.http_url}/a2a/{namespace}/", content=body, headers=headers
            )
        task = got.json()["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_FAILED", task
        assert "REACH_BAD_CAPABILITY" in json.dumps(task["status"]), task
        assert not errors_in(caplog)


async def test_streaming_asked_of_a_card_without_it_is_no_error_in_the_log(
    a2a_hub: Hub, settings: MeshSettings, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The card says ``streaming: false``; the SDK refused each ``SendStreamingMessage``
    with an ERROR line of its own ("Validation failure"). A caller's mistake: one WARNING."""
    headers = RAW_HEADERS
    message = {"messageId": "m1", "role": "ROLE_USER", "parts": [{"data": {}}]}
    body = rpc("SendStreamingMessage", {**message, "metadata": {"skill": "echo"}})
    async with worker(f"{namespace}.w.a1", settings) as agent, httpx.AsyncClient() as http:
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            for _ in range(2):
                got = await http.post(
                    f"{a2a_hub.http_url}/a2a/{namespace}/", content=body, headers=headers
                )
                assert "Streaming is not supported" in got.text, got.text
        assert not errors_in(caplog)
        refused = [r for r in caplog.records if "A2A request refused" in r.getMessage()]
        assert len(refused) == 2 and refused[0].levelno == logging.WARNING
        assert "Streaming is not supported" in refused[0].getMessage()
        assert agent.handled == 0
