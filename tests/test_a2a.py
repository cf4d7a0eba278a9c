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

from reach_mesh import MeshSettings
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub

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
