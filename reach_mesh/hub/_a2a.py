"""A2A (the official ``a2a-sdk``) on the hub: one agent card per tenant namespace, whose skills
are the live tools and capabilities of that namespace, and ``SendMessage`` routed as a task
through the mesh (proxy mode, routed by this hub as a request on ``reach.hub.<ns>.route``).
A body that is not one JSON-RPC request object is answered here, before the SDK reads it.

``/a2a/<ns>/.well-known/agent-card.json`` is the card, ``/a2a/<ns>/`` the JSON-RPC endpoint.
A message names its skill in ``metadata.skill`` (or a data part ``{"skill": …, "arguments":
…}``); its data part (or ``metadata.arguments``) is the payload. The six-state task machine maps
onto A2A task states (docs/protocol.md): the route answers with the final state, so an A2A
client sees SUBMITTED → WORKING → COMPLETED or FAILED.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Final

from a2a.helpers.proto_helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Message,
    Part,
    SendMessageRequest,
    Task,
)
from a2a.types import TaskState as A2aTaskState
from a2a.utils.constants import TransportProtocol
from a2a.utils.errors import InvalidParamsError
from google.protobuf.json_format import MessageToDict
from starlette.responses import JSONResponse
from starlette.routing import Router
from starlette.types import Receive, Scope, Send

from reach_mesh import __version__, protocol
from reach_mesh.errors import ReachError
from reach_mesh.hub._gateway import read_body, replay
from reach_mesh.models import RouteRequest, TaskState

if TYPE_CHECKING:
    from a2a.server.events import Event

    from reach_mesh.hub.http import HubHttp

__all__ = ["A2A_STATES", "HubA2a", "rpc_error"]

#: The six-state machine (and PENDING) as A2A task states.
A2A_STATES: Final = {
    TaskState.PENDING: "TASK_STATE_SUBMITTED",
    TaskState.DELIVERED: "TASK_STATE_SUBMITTED",
    TaskState.ACCEPTED: "TASK_STATE_WORKING",
    TaskState.RUNNING: "TASK_STATE_WORKING",
    TaskState.SUCCEEDED: "TASK_STATE_COMPLETED",
    TaskState.FAILED: "TASK_STATE_FAILED",
    TaskState.TIMEOUT: "TASK_STATE_FAILED",
}
#: Namespaces with a built endpoint at most (each is a small router and a task store).
_MAX_TENANTS: Final = 1024
#: Finished A2A tasks kept for ``GetTask``/``ListTasks``, across namespaces: at most this
#: many, holding at most this many bytes (each keeps its message and result, up to
#: ``max_payload`` each); the oldest are dropped. A task still running is not counted: routes
#: in flight are bounded already.
KEPT_TASKS: Final = 1024
KEPT_TASK_BYTES: Final = 64 << 20
_FINISHED: Final = frozenset(
    {
        A2aTaskState.TASK_STATE_COMPLETED,
        A2aTaskState.TASK_STATE_FAILED,
        A2aTaskState.TASK_STATE_CANCELED,
        A2aTaskState.TASK_STATE_REJECTED,
    }
)
#: Room for a message's JSON-RPC envelope around its payload (as MCP's request limit has).
_RPC_SLACK: Final = 64 * 1024
#: The members of a JSON-RPC 2.0 request object.
_RPC_MEMBERS: Final = frozenset({"jsonrpc", "method", "params", "id"})


class _MeshExecutor(AgentExecutor):
    def __init__(self, a2a: HubA2a, namespace: str) -> None:
        self.a2a = a2a
        self.namespace = namespace

    async def execute(self, context: RequestContext, event_queue: Any) -> None:
        skill, arguments = _message_skill(context.message)
        capability = self.a2a.capability(self.namespace, skill)
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        if context.current_task is None:
            await event_queue.enqueue_event(
                new_task(context.task_id, context.context_id, A2aTaskState.TASK_STATE_SUBMITTED)
            )
        await updater.start_work()
        try:
            # In the try: a capability the route refuses (a tool's, from an agent of another
            # version) fails this task, not the request with an internal error and a traceback.
            req = RouteRequest(capability=capability, payload=arguments)
            data = await self.a2a.http.route_task(protocol.encode(req), self.namespace)
        except ReachError as err:
            text = f"{err.code}: {err.message}"
            await updater.failed(updater.new_agent_message([Part(text=text)]))
            return
        task = json.loads(data).get("task") or {}
        state = TaskState(task.get("state", TaskState.FAILED.value))
        if A2A_STATES[state] == "TASK_STATE_COMPLETED":
            await updater.add_artifact([Part(text=json.dumps(task.get("result")))], name="result")
            await updater.complete()
        else:
            error = task.get("error") or {"code": f"REACH_{state.value}"}
            text = f"{error.get('code')}: {error.get('message', '')}"
            await updater.failed(updater.new_agent_message([Part(text=text)]))

    async def cancel(self, context: RequestContext, event_queue: Any) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def _message_skill(message: Message | None) -> tuple[str | None, Any]:
    """The skill a message names and its arguments (``metadata`` or a data part);
    ``InvalidParamsError`` for one that holds no JSON."""
    if message is None:
        return None, {}
    meta = (
        _as_json(message.metadata, "the message's metadata") if message.HasField("metadata") else {}
    )
    skill, arguments = meta.get("skill"), meta.get("arguments")
    for part in message.parts:
        if part.HasField("data"):
            data = _as_json(part.data, "a data part of the message")
            if isinstance(data, dict) and "skill" in data:
                skill = skill or data.get("skill")
                arguments = data.get("arguments", arguments)
            elif arguments is None:
                arguments = data
    return (str(skill) if skill is not None else None), ({} if arguments is None else arguments)


def _as_json(value: Any, where: str) -> Any:
    """``value`` (a protobuf ``Struct`` or ``Value``) as JSON. The SDK parses a body with
    ``NaN`` or ``Infinity`` in it (Python's ``json`` does), which no JSON can hold:
    ``MessageToDict`` refuses it with a ``ValueError``, which the SDK would answer as an
    internal error, with a traceback in the hub's log. It is the caller's: invalid params."""
    try:
        return MessageToDict(value)
    except ValueError as err:
        raise InvalidParamsError(
            f"{where} is not JSON ({err}): NaN and Infinity have no JSON form; "
            "send them as strings or null"
        ) from err


class _MeshRequestHandler(DefaultRequestHandler):
    """The SDK's handler, with the skill checked before a task starts: an unknown skill is the
    caller's mistake (a JSON-RPC ``InvalidParams`` answer), not an executor failure that the
    SDK would log with a traceback."""

    def __init__(self, a2a: HubA2a, namespace: str, **kw: Any) -> None:
        super().__init__(**kw)
        self._a2a = a2a
        self._namespace = namespace

    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Message | Task:
        self._a2a.capability(self._namespace, _message_skill(params.message)[0])
        result: Message | Task = await super().on_message_send(params, context)
        return result

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event, None]:
        self._a2a.capability(self._namespace, _message_skill(params.message)[0])
        async for event in super().on_message_send_stream(params, context):
            yield event


class _KeptTasks:
    """The finished tasks the namespaces' stores hold: past ``KEPT_TASKS`` or
    ``KEPT_TASK_BYTES``, the oldest of the namespace holding the most (bytes, or tasks when
    over the count) is dropped from its store — one tenant's large results push out its own,
    not the others' (a2a-sdk's in-memory store keeps every task for the life of the
    process)."""

    def __init__(self, count: int = KEPT_TASKS, size: int = KEPT_TASK_BYTES) -> None:
        self.count, self.size = count, size
        self.tasks = self.bytes = 0
        #: Stores holding finished tasks (each counts its own, oldest first).
        self._stores: dict[_TenantTasks, None] = {}

    def __len__(self) -> int:
        return self.tasks

    async def saved(self, store: _TenantTasks, task: Task, context: ServerCallContext) -> None:
        self.forgotten(store, task.id)
        if task.status.state not in _FINISHED:
            return
        size = task.ByteSize()
        # The owner is all a delete needs: the request's headers and state are not kept.
        store.finished[task.id] = (
            ServerCallContext(user=context.user, tenant=context.tenant),
            size,
        )
        store.bytes += size
        self.tasks += 1
        self.bytes += size
        self._stores[store] = None
        while self.tasks > 1 and (self.tasks > self.count or self.bytes > self.size):
            if self.bytes > self.size:
                victim = max(self._stores, key=lambda s: s.bytes)
            else:
                victim = max(self._stores, key=lambda s: len(s.finished))
            task_id, (ctx, _) = next(iter(victim.finished.items()))
            self.forgotten(victim, task_id)
            await victim.drop(task_id, ctx)

    def forgotten(self, store: _TenantTasks, task_id: str) -> None:
        old = store.finished.pop(task_id, None)
        if old is None:
            return
        store.bytes -= old[1]
        self.tasks -= 1
        self.bytes -= old[1]
        if not store.finished:
            self._stores.pop(store, None)


class _TenantTasks(InMemoryTaskStore):
    """One namespace's tasks, its finished ones counted in the hub's :class:`_KeptTasks`."""

    def __init__(self, kept: _KeptTasks) -> None:
        super().__init__()
        self._kept = kept
        #: Finished tasks, oldest first: the owner a delete needs, and the size.
        self.finished: OrderedDict[str, tuple[ServerCallContext, int]] = OrderedDict()
        self.bytes = 0

    async def save(self, task: Task, context: ServerCallContext) -> None:
        await super().save(task, context)
        await self._kept.saved(self, task, context)

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        await super().delete(task_id, context)
        self._kept.forgotten(self, task_id)

    async def drop(self, task_id: str, context: ServerCallContext) -> None:
        """Dropped as one of the oldest finished tasks."""
        await super().delete(task_id, context)


class HubA2a:
    """``asgi_app`` serves ``/a2a/<ns>/…``: a card and a JSON-RPC endpoint per namespace."""

    def __init__(self, http: HubHttp) -> None:
        self.http = http
        self._tenants: dict[str, Router] = {}
        self.kept = _KeptTasks()
        #: The largest JSON-RPC body taken: a payload of ``max_payload`` in its envelope.
        self._limit = http.hub.settings.max_payload + _RPC_SLACK

    def capability(self, namespace: str, skill: str | None) -> str:
        """The capability behind ``skill``; ``InvalidParamsError`` for an unknown one."""
        skills = self.skills(namespace)
        capability = skills.get(skill) if skill is not None else None
        if capability is None:
            raise InvalidParamsError(
                f"unknown skill {skill!r} in namespace {namespace!r}: "
                f"live skills are {sorted(skills)}"
            )
        return capability

    def skills(self, namespace: str) -> dict[str, str]:
        """Skill id → capability: the namespace's live tools, and its capabilities."""
        out: dict[str, str] = {}
        for tool in self.http.tool_menu(namespace):
            if tool["capability"]:
                out[tool["name"]] = tool["capability"]
        for view in self.http.hub.registry:
            card = view.record.card
            if card.namespace == namespace and self.http.hub.registry.routable(view):
                for cap in card.capabilities:
                    out.setdefault(cap, cap)
        return out

    def card(self, namespace: str, base_url: str) -> AgentCard:
        return AgentCard(
            name=f"reach-mesh {namespace}",
            description=f"The live agents of namespace {namespace!r}, routed by reach-mesh",
            version=__version__,
            supported_interfaces=[
                AgentInterface(
                    url=f"{base_url}/a2a/{namespace}/",
                    protocol_binding=TransportProtocol.JSONRPC.value,
                    protocol_version="1.0",
                )
            ],
            capabilities=AgentCapabilities(streaming=False, push_notifications=False),
            default_input_modes=["application/json", "text/plain"],
            default_output_modes=["application/json", "text/plain"],
            skills=[
                AgentSkill(id=skill, name=skill, description=f"capability {cap}", tags=[cap])
                for skill, cap in sorted(self.skills(namespace).items())
            ],
        )

    def _tenant(self, namespace: str) -> Router:
        router = self._tenants.get(namespace)
        if router is None:
            if len(self._tenants) >= _MAX_TENANTS:
                self._tenants.pop(next(iter(self._tenants)))
            base = self.http.url
            card = self.card(namespace, base)

            async def live(_: AgentCard) -> AgentCard:
                return self.card(namespace, self.http.url)

            handler = _MeshRequestHandler(
                self,
                namespace,
                agent_executor=_MeshExecutor(self, namespace),
                task_store=_TenantTasks(self.kept),
                agent_card=card,
            )
            router = Router(
                routes=[
                    *create_agent_card_routes(card, card_modifier=live),
                    *create_jsonrpc_routes(handler, rpc_url="/"),
                ]
            )
            self._tenants[namespace] = router
        return router

    async def asgi_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        namespace = scope.get("path_params", {}).get("namespace", "")
        try:
            protocol.validate_namespace(namespace)
        except ReachError as err:
            await JSONResponse(err.to_wire(), 400)(scope, receive, send)
            return
        if not self.http.hub.registry.has_namespace(namespace):
            message = (
                f"no agent has registered in namespace {namespace!r} (A2A serves each "
                "namespace at /a2a/<namespace>/): check the namespace, or start its agents"
            )
            body = {
                "error": {
                    "code": "REACH_UNKNOWN_NAMESPACE",
                    "message": message,
                    "details": {"namespace": namespace},
                }
            }
            await JSONResponse(body, 404)(scope, receive, send)
            return
        if scope["method"] == "POST" and _route_path(scope) in ("", "/"):
            # The JSON-RPC endpoint: read the body within the payload limit and answer a broken
            # envelope here, as JSON-RPC wants (the SDK would buffer any size, and log a
            # caller's malformed request as an error of its own, with a traceback).
            try:
                raw = await read_body(receive, self._limit, slack=_RPC_SLACK)
            except ReachError as err:
                await JSONResponse(rpc_error(None, -32600, err.message), 413)(scope, receive, send)
                return
            if raw is None:
                return  # the client went away
            refusal = _check_envelope(raw)
            if refusal is not None:
                await JSONResponse(refusal)(scope, receive, send)
                return
            receive = replay(raw, receive)
        await self._tenant(namespace)(scope, receive, send)


class _CallerMistakes(logging.Filter):
    """The SDK logs a request whose members or params do not parse at ERROR, with a traceback,
    and answers it -32600 / -32602; and at ERROR too a request for what the card says it
    does not do (``SendStreamingMessage``, push notifications: "Validation failure"), which
    it answers with an error of its own. For the hub each is a caller's mistake, as a bad
    route request is: one WARNING line naming it, so a careless or hostile client cannot fill
    the log with errors and tracebacks (the envelope check in ``HubA2a.asgi_app`` answers
    most malformed ones before)."""

    MESSAGES: Final = frozenset(
        {
            "Failed to validate base JSON-RPC request",
            "Failed to parse request params",
            "Validation failure: %s",
        }
    )

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            record.levelno >= logging.ERROR
            and isinstance(record.msg, str)
            and record.msg in self.MESSAGES
        ):
            err = record.exc_info[1] if record.exc_info else None
            said = record.getMessage()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            if err is None:
                record.msg, record.args = "A2A request refused: %s", (said,)
            else:
                record.msg, record.args = "A2A request refused (%s): %r", (said, err)
            record.exc_info = record.exc_text = None
            # The logger let it through as an ERROR: still wanted as a WARNING?
            return logging.getLogger(record.name).isEnabledFor(logging.WARNING)
        return True


for _name in (
    "a2a.server.routes.jsonrpc_dispatcher",
    "a2a.server.request_handlers.request_handler",
):
    logging.getLogger(_name).addFilter(_CallerMistakes())


def _route_path(scope: Scope) -> str:
    """The path below the mount (``/a2a/<ns>``): Starlette keeps the full ``path`` and adds the
    matched prefix to ``root_path``."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def rpc_error(rpc_id: Any, code: int, message: str) -> dict[str, Any]:
    """A JSON-RPC 2.0 error answer."""
    return {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message}}


def _check_envelope(raw: bytes) -> dict[str, Any] | None:
    """A JSON-RPC 2.0 error answer for a body that is not one request object (parse error
    -32700, invalid request -32600), or None: the SDK takes it from there (methods, params)."""
    try:
        body = protocol.loads(raw)
    except ReachError as err:
        return rpc_error(None, -32700, f"Parse error: {err.message}")
    if not isinstance(body, dict):
        return rpc_error(None, -32600, "Invalid Request: expected one JSON-RPC request object")
    rpc_id = body.get("id")
    if isinstance(rpc_id, bool) or not isinstance(rpc_id, str | int | None):
        return rpc_error(None, -32600, "Invalid Request: id must be a string or an integer")
    if body.get("jsonrpc") != "2.0":
        return rpc_error(rpc_id, -32600, 'Invalid Request: "jsonrpc" must be "2.0"')
    if not isinstance(body.get("method"), str):
        return rpc_error(rpc_id, -32600, "Invalid Request: method must be a string")
    if not isinstance(body.get("params", {}), dict | list):
        return rpc_error(rpc_id, -32600, "Invalid Request: params must be an object or array")
    extra = set(body) - _RPC_MEMBERS
    if extra:
        return rpc_error(rpc_id, -32600, f"Invalid Request: unknown members {sorted(extra)}")
    return None
