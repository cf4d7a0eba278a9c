"""Small helpers shared by tests (not fixtures)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError

from reach_mesh import Client, MeshSettings, Step, UnknownWorkflowError, protocol
from reach_mesh._nats import flushed
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import MeshUnavailableError
from reach_mesh.models import (
    AgentCard,
    AgentRecord,
    AgentState,
    ErrorBody,
    RegisterReply,
    RegisterRequest,
    TaskState,
)
from reach_mesh.server import EmbeddedNats
from reach_mesh.workflow import (
    AttemptRecord,
    TaskRecord,
    TaskStatusEvent,
    WorkflowRecord,
    spec_digest,
)

if TYPE_CHECKING:
    from mcp.client.session import ClientSession

    from reach_mesh.hub import Hub
    from reach_mesh.hub.registry import Registry


#: Ports handed out by ``free_port`` in this process: never twice.
_GIVEN: set[int] = set()


_T = TypeVar("_T")


#: Short liveness intervals (the ``settings`` fixture's): lease expiry within a second.
FAST: dict[str, Any] = {
    "heartbeat_interval": 0.2,
    "lease_timeout": 0.6,
    "suspect_timeout": 0.6,
    "liveness_interval": 0.05,
    "request_timeout": 5.0,
}

#: Short workflow intervals (the ``wf_settings`` fixture's): a step with no taker gives up
#: within a second or two, and a hub's workflows are taken over one second after it dies.
WF_FAST: dict[str, Any] = {
    "workflow_ack_wait": 1.0,
    "work_ack_wait": 1.0,
    "step_deliver_timeout": 1.0,
    "step_running_interval": 0.2,
    "step_silence_timeout": 0.8,
    "retry_base": 0.02,
    "retry_cap": 0.1,
    "pending_interval": 0.2,
}


def free_port() -> int:
    """A TCP port free on loopback right now, for a server that must keep its port (a cluster
    node restarting as itself). Picked below the kernel's ephemeral range (32768+ on Linux),
    so no outgoing connection — a route dialling a node not up yet — can take it as its source
    port between the pick and the server's bind, and never the same one twice."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 32000)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free port in 20000-31999")


class _RelayedNode(EmbeddedNats):
    """A cluster node that advertises a route URL nothing listens on: the other nodes reach it
    only through the routes they were given (relays), never by the URL gossip would tell them
    (which a partition's cut would not cover)."""

    def __init__(self, *args: Any, route_advertise: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.route_advertise = route_advertise

    def _config(self) -> str:
        return (
            super()
            ._config()
            .replace("  routes: [", f"  advertise: {self.route_advertise}\n  routes: [", 1)
        )


def cluster_nodes(
    base: Path,
    n: int = 3,
    name: str = "mesh",
    *,
    http: bool = False,
    no_advertise: bool = False,
    route_relays: dict[tuple[int, int], Relay] | None = None,
    auth_config: Path | None = None,
) -> list[EmbeddedNats]:
    """``n`` nats-servers (not started) forming one JetStream cluster on loopback; their store
    dirs are ``base/n<i>`` and their ports fixed, so a killed node restarts as itself. With
    ``http``, each serves its monitoring endpoints (``/routez``...) on ``http_port``; with
    ``no_advertise``, clients keep to the URLs they were given (relays in front of the nodes
    would otherwise be bypassed on a reconnection). With ``route_relays`` (an empty dict,
    filled here), node ``i`` reaches node ``j`` through relay ``(i, j)`` (not started: the
    caller starts them, before the nodes or soon after) and only through it: cutting every
    relay of a node cuts it off from the others (a partition) while its clients stay. With
    ``auth_config`` (``reach-mesh auth``'s auth.conf), each node includes it, as
    docs/operations.md has a secure cluster do."""
    cports = [free_port() for _ in range(n)]
    routes = [[f"nats://127.0.0.1:{p}" for p in cports] for _ in range(n)]
    if route_relays is not None:
        for i in range(n):
            for j in range(n):
                if i != j:
                    route_relays[i, j] = Relay(cports[j])
            routes[i] = [f"nats://127.0.0.1:{route_relays[i, j].port}" for j in range(n) if j != i]
    nodes: list[EmbeddedNats] = []
    for i in range(n):
        kw: dict[str, Any] = {
            "port": free_port(),
            "server_name": f"n{i}",
            "cluster_name": name,
            "cluster_port": cports[i],
            "routes": routes[i],
            "http_port": free_port() if http else None,
            "no_advertise": no_advertise,
            "auth_config": auth_config,
        }
        if route_relays is None:
            nodes.append(EmbeddedNats(base / f"n{i}", **kw))
        else:
            dead = f"127.0.0.1:{free_port()}"  # nothing listens there
            nodes.append(_RelayedNode(base / f"n{i}", route_advertise=dead, **kw))
    return nodes


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped (``T``); true where there is no ``/proc`` to read."""
    tasks = Path(f"/proc/{pid}/task")
    for stat in tasks.glob("*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # a thread gone meanwhile
        if state not in ("T", "t"):
            return False
    return True


async def freeze(pid: int, *, group: bool = False) -> None:
    """SIGSTOP ``pid`` (its process group with ``group``) and return once every thread of it is
    stopped. ``kill`` returns when the signal is pending, not delivered: the thread that takes it
    stops the others, and on a loaded machine it may wait for a CPU while another thread of the
    process reads a request and answers it (CI: a nats-server answered a ``consumer_info`` sent
    right after its SIGSTOP)."""
    if group:
        os.killpg(pid, signal.SIGSTOP)
    else:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5.0
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped 5 s after its SIGSTOP")
        await asyncio.sleep(0.001)


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0, interval: float = 0.02
) -> None:
    """Wait until ``predicate()`` (awaited when it returns an awaitable) is true; fail the
    test with a clear message otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ok = predicate()
        if await ok if inspect.isawaitable(ok) else ok:
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


async def fetch(
    url: str,
    method: str = "GET",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One HTTP request (in a thread, stdlib only): status and body, also for 4xx/5xx.

    A POST says ``Content-Type: application/json`` unless ``headers`` name a content type."""
    sent = dict(headers or {})
    if method == "POST" and not any(k.lower() == "content-type" for k in sent):
        sent["Content-Type"] = "application/json"

    def call() -> tuple[int, bytes]:
        req = urllib.request.Request(url, data=body, method=method, headers=sent)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    return await asyncio.to_thread(call)


class Fleet:
    """Agents started for one test, closed at its end."""

    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        self.agents: list[Agent] = []
        self.runs: Counter[str] = Counter()  # task_id -> handler runs

    def agent(self, name: str, **kw: Any) -> Agent:
        agent = Agent(f"{self.settings.namespace}.{name}", settings=self.settings, **kw)
        self.agents.append(agent)
        return agent

    async def close(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(agent.close(), timeout=5)


class Relay:
    """A TCP relay in front of nats-server that a test cuts and restores: one party's side of
    a network failure, while the others stay connected."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        #: Bumped by each :meth:`cut`: a connection accepted before a cut whose upstream
        #: connection is made after it is closed, not relayed past the cut.
        self._cuts = 0
        #: Clear while what the server sends is held back (:meth:`hold`).
        self._flowing = asyncio.Event()
        self._flowing.set()
        #: What the server sends that, once relayed, holds back what follows (:meth:`hold_after`).
        self._hold_after: bytes | None = None

    async def start(self) -> None:
        self._flowing.set()
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cuts = self._cuts
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # the server is down: so is the connection through the relay
            writer.close()
            return
        if cuts != self._cuts:  # cut meanwhile
            writer.close()
            up_writer.close()
            return
        self._writers += [writer, up_writer]

        async def pipe(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, flowing: asyncio.Event | None
        ) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if flowing is not None:
                        await flowing.wait()
                        if dst.is_closing():
                            break  # cut while held: what it held is lost
                    dst.write(data)
                    await dst.drain()
                    marker = self._hold_after
                    if flowing is not None and marker is not None and marker in data:
                        self._hold_after = None
                        flowing.clear()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, None), pipe(up_reader, writer, self._flowing))

    def hold(self) -> None:
        """Hold back what the server sends until the relay is cut (then it is lost): answers
        sent to the party behind it are lost with the connection, however fast they come."""
        self._flowing.clear()

    def hold_after(self, marker: bytes) -> None:
        """:meth:`hold` as soon as what the server sends has carried ``marker`` through: the
        party behind the relay reads that answer, and nothing after it."""
        self._hold_after = marker

    @property
    def holding(self) -> bool:
        """Whether what the server sends is held back now."""
        return not self._flowing.is_set()

    def release(self) -> None:
        """Let what :meth:`hold` held back through, late (a slow link, not a broken one)."""
        self._flowing.set()

    async def cut(self) -> None:
        """Close every connection through the relay, both ways, and refuse new ones until
        :meth:`start`."""
        assert self._server is not None
        self._cuts += 1
        self._server.close()
        await self._server.wait_closed()
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        self._flowing.set()  # the held pipes see their connections closed, and end


async def relayed(
    nats_url: str, settings: MeshSettings, **update: Any
) -> tuple[Relay, MeshSettings]:
    """A started :class:`Relay` in front of the nats-server at ``nats_url``, and ``settings``
    that connect through it (with ``update``): the party the test cuts off."""
    relay = Relay(int(nats_url.rsplit(":", 1)[1]))
    await relay.start()
    through = f"nats://127.0.0.1:{relay.port}"
    return relay, settings.model_copy(update={"nats_url": through, **update})


async def partition(agent: Agent) -> None:
    """Cut ``agent`` off from the hubs while its handlers keep running: no heartbeats, and
    nobody answers on its ctl subject (what a network partition looks like from the hubs)."""
    assert agent._hb_task is not None
    agent._hb_task.cancel()
    ctl = protocol.agent_ctl(agent.agent_id)
    for sub in [s for s in agent._subs if s.subject == ctl]:
        await sub.unsubscribe()
        agent._subs.remove(sub)


async def deafen(agent: Agent) -> None:
    """Nothing reaches ``agent`` any more, while its heartbeats go on."""
    assert agent.work is not None and agent._hb_task is not None
    await agent.work.stop()
    for sub in list(agent._subs):
        await sub.unsubscribe()
        agent._subs.remove(sub)
    await agent.nc.flush()  # the server dropped its interest before any hub asks


async def heal(agent: Agent, *, beat: bool = True) -> None:
    """Undo :func:`partition`: answer on the ctl subject and (``beat``) heartbeat again."""
    agent._subs.append(
        await agent.nc.subscribe(protocol.agent_ctl(agent.agent_id), cb=agent._on_ctl)
    )
    await flushed(agent.nc)  # subscribed before a hub's next ctl request
    if beat:
        agent._hb_task = asyncio.create_task(agent._heartbeat_loop())


def two_holding(
    settings: MeshSettings, name: str, capability: str
) -> tuple[Fleet, dict[str, list[str]], asyncio.Event]:
    """Two agents ``<name>.a1`` and ``<name>.a2`` (not started) serving ``capability``,
    whose handlers note the agent each task ran on (``ran``: task id -> agents) and hold it
    until ``release`` is set."""
    ran: dict[str, list[str]] = {}
    release = asyncio.Event()
    fleet = Fleet(settings)
    for agent_name in (f"{name}.a1", f"{name}.a2"):
        agent = fleet.agent(agent_name)

        @agent.handler(capability)
        async def run(task: Task[Any], agent_id: str = agent.agent_id) -> str:
            ran.setdefault(task.task_id, []).append(agent_id)
            await release.wait()
            return agent_id

    return fleet, ran, release


def recording_agent(
    agent_id: str, settings: MeshSettings, cap: str, delay: float = 0.0
) -> tuple[Agent, list[Any]]:
    """An agent whose one handler returns its payload after ``delay`` seconds, and the
    payloads its handler ran for (in start order)."""
    agent = Agent(agent_id, settings=settings)
    runs: list[Any] = []

    @agent.handler(cap)
    async def echo(task: Task[Any]) -> Any:
        runs.append(task.payload)
        await asyncio.sleep(delay)
        return task.payload

    return agent, runs


async def away_for_a_second(relay: Relay, connected: Callable[[], bool]) -> float:
    """Cut ``relay``, wait until the party behind it has noticed (``connected`` false), let
    a second pass, restore it; the monotonic time it was restored."""
    await relay.cut()
    await eventually(lambda: not connected(), timeout=5)
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    await relay.start()
    return t0


def echo_agent(fleet: Fleet, name: str, cap: str = "wf:echo:v1", **kw: Any) -> Agent:
    agent = fleet.agent(name, **kw)

    @agent.handler(cap)
    async def echo(task: Task[Any]) -> Any:
        fleet.runs[task.task_id] += 1
        return {"by": task.agent_id, "in": task.payload}

    return agent


def payload_echo(agent_id: str, cap: str, settings: MeshSettings) -> Agent:
    """An agent of its own (no ``Fleet``) whose ``cap`` handler answers each task with its
    payload."""
    agent = Agent(agent_id, settings=settings)

    @agent.handler(cap)
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    return agent


@contextlib.asynccontextmanager
async def mcp_session(
    base_url: str, headers: dict[str, str] | None = None, namespace: str | None = None
) -> AsyncIterator[ClientSession]:
    """An initialized session of the official MCP client (streamable HTTP) on ``base_url/mcp``."""
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async with (
        create_mcp_http_client(headers=headers) as http,
        streamable_http_client(
            f"{base_url}/mcp" + (f"?namespace={namespace}" if namespace else ""), http_client=http
        ) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def handled(agent: Agent, capability: str, state: str) -> float:
    """``reach_agent_handled_total{capability, state}`` as the agent's registry exports it
    (0 when the series does not exist yet)."""
    value = agent.metrics.registry.get_sample_value(
        "reach_agent_handled_total", {"capability": capability, "state": state}
    )
    return value or 0.0


def abandoned(agent: Agent, kind: str) -> float:
    """``reach_agent_handlers_abandoned_total{kind=...}`` as the agent's registry exports it."""
    value = agent.metrics.registry.get_sample_value(
        "reach_agent_handlers_abandoned_total", {"kind": kind}
    )
    assert value is not None, "the series exists from the start"
    return value


def cancelled_step(ns: str, wf_id: str, step: int, agent_id: str, **fields: Any) -> TaskRecord:
    """Step ``step``'s record as a hub fences it for a cancel or a policy: its attempt 1, sent to
    ``agent_id`` (``{wf_id}-{step}``: the default task id), cancelled; ``fields`` set too."""
    return TaskRecord(
        task_id=f"{wf_id}-{step}",
        workflow_id=wf_id,
        step=step,
        namespace=ns,
        attempt=1,
        agent_id=agent_id,
        history=[AttemptRecord(attempt=1, agent_id=agent_id, state=TaskState.PENDING)],
        cancelled=True,
        **fields,
    )


async def task_record(nc: Any, ns: str, task_id: str) -> TaskRecord | None:
    """A step's record in ``reach_tasks`` as the hub stored it; None when it has none (a step
    whose fence never changed, see ``TaskRecord``)."""
    kv = await nc.jetstream().key_value(protocol.KV_TASKS)
    try:
        entry = await kv.get(protocol.task_key(ns, task_id))
    except KeyNotFoundError:
        return None
    return TaskRecord.model_validate_json(entry.value) if entry.value else None


async def status_events(client: Any, ns: str, task_id: str) -> list[TaskStatusEvent]:
    """Every status event the REACH_STATUS stream holds for a task."""
    js = client.nc.jetstream()
    sub = await js.subscribe(
        protocol.task_status(f"{ns}.*.*", task_id),
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
    )
    out: list[TaskStatusEvent] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.3)
            except Exception:
                break
            out.append(TaskStatusEvent.model_validate_json(msg.data))
    finally:
        await sub.unsubscribe()
    return out


@dataclass
class HeldHandler:
    """A handler that runs until ``release`` is set: when it started, whether it was
    cancelled."""

    started: asyncio.Event
    release: asyncio.Event
    cancelled: asyncio.Event


def held_handler(agent: Agent, cap: str, answer: Any = None) -> HeldHandler:
    """Give ``agent`` a handler of ``cap`` that returns ``answer`` once released."""
    held = HeldHandler(asyncio.Event(), asyncio.Event(), asyncio.Event())

    @agent.handler(cap)
    async def run(task: Task[Any]) -> Any:
        held.started.set()
        try:
            await held.release.wait()
        except asyncio.CancelledError:
            held.cancelled.set()
            raise
        return answer

    return held


@dataclass
class GatedEcho:
    """An echo handler that records each payload it runs and holds the payload ``hold``
    until ``gate`` is set (``started`` set when it begins)."""

    started: asyncio.Event
    gate: asyncio.Event
    runs: list[Any]


def gated_echo(agent: Agent, cap: str, hold: Any) -> GatedEcho:
    """Give ``agent`` a handler of ``cap`` that returns its payload, holding ``hold``."""
    echo = GatedEcho(asyncio.Event(), asyncio.Event(), [])

    @agent.handler(cap)
    async def run(task: Task[Any]) -> Any:
        echo.runs.append(task.payload)
        if task.payload == hold:
            echo.started.set()
            await echo.gate.wait()
        return task.payload

    return echo


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without its ``REACH_``/``OTEL_`` variables (a child
    configured by the test alone), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "OTEL_"))}
    return env | extra


async def run_cli(nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``reach-mesh --nats URL ARGS`` in a process of its own (no ``REACH_``/``OTEL_``
    variables of this one), in a thread: its exit code and output."""
    env = clean_env()
    argv = [sys.executable, "-m", "reach_mesh.cli", "--nats", nats_url, *args]
    return await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True)


class LoopThread:
    """An event loop running in a thread of its own, which the test can stall."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="side-loop", daemon=True)
        self._thread.start()

    async def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on this loop; its result (or error) on the caller's."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def call(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` called on this loop (reads of the hub's state made between its steps)."""

        async def call() -> _T:
            return fn()

        return await self.run(call())

    def stall(self, until: threading.Event, at_least: float, limit: float) -> threading.Event:
        """Block this loop (a blocking call in one of its callbacks, as in a stalled process)
        for ``at_least`` seconds, and then until ``until`` is set (``limit`` seconds at most
        in all). Returns an event set once the stall has begun."""
        begun = threading.Event()

        def block() -> None:
            begun.set()
            t0 = time.monotonic()
            time.sleep(at_least)
            until.wait(max(0.0, limit - (time.monotonic() - t0)))

        self.loop.call_soon_threadsafe(block)
        return begun

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


async def register_by_hand(
    nc: Any,
    card: AgentCard,
    *,
    session: str | None = None,
    heartbeat_interval: float = 20,
    lease_timeout: float = 60,
) -> RegisterReply:
    """Register ``card`` over ``nc`` as an agent speaking the wire protocol by hand would
    (by default with a new session, and a lease long enough that no heartbeat is needed
    during a test): the hub's reply."""
    req = RegisterRequest(
        card=card,
        session=session or uuid.uuid4().hex,
        heartbeat_interval=heartbeat_interval,
        lease_timeout=lease_timeout,
    )
    reply = await nc.request(
        protocol.hub_agent_subject(card.agent_id, "register"), protocol.encode(req), timeout=5
    )
    return protocol.parse_reply(reply.data, RegisterReply)


def refusing_registrations(hub: Hub) -> tuple[list[float], asyncio.Event]:
    """While the event returned is set, ``hub`` (not started yet) answers every registration
    ``REACH_UNAVAILABLE``, as when its KV put fails (JetStream taking no writes); the list
    notes when each refused one came (``time.monotonic``)."""
    register = hub._on_register
    refused: list[float] = []
    refusing = asyncio.Event()

    async def on_register(msg: Any, ns: str) -> bytes:
        if refusing.is_set():
            refused.append(time.monotonic())
            raise MeshUnavailableError("JetStream unavailable, retry: NoStreamResponseError")
        return await register(msg, ns)

    hub._on_register = on_register  # type: ignore[method-assign]
    return refused, refusing


def states_of(hub: Hub, agent_id: str) -> list[AgentState]:
    """The states ``hub``'s registry grades the agent into from now on, in order."""
    seen: list[AgentState] = []

    def record(view: Any, old: AgentState, new: AgentState) -> None:
        if view.agent_id == agent_id:
            seen.append(new)

    hub.registry.on_state_change(record)
    return seen


def a_server_of_its_own() -> Iterator[str]:
    """For a module's own ``nats_url`` fixture: a nats-server of its own (the URL), for tests
    that read what every namespace has on the server (the dashboard's agent counts, the
    unscoped tool menu). The others share their worker's server, where another test's agent
    may still hold its lease."""
    with EmbeddedNats() as server:
        yield server.url


async def register_cards(
    url: str, cards: list[AgentCard], *, heartbeat_interval: float, lease_timeout: float
) -> None:
    """Register ``cards`` by the wire protocol (docs/protocol.md, "Registration"), all at once,
    from one plain nats-py connection: many agents, cheaply, whose leases outlive a test when
    ``lease_timeout`` does (nothing heartbeats for them)."""
    import nats

    nc = await nats.connect(url)
    try:

        async def one(i: int, card: AgentCard) -> None:
            req = RegisterRequest(
                card=card,
                session=f"s{i}",
                heartbeat_interval=heartbeat_interval,
                lease_timeout=lease_timeout,
            )
            subject = protocol.hub_agent_subject(card.agent_id, "register")
            msg = await nc.request(subject, protocol.encode(req), timeout=10)
            assert b'"error"' not in msg.data, msg.data

        await asyncio.gather(*(one(i, card) for i, card in enumerate(cards)))
    finally:
        await nc.close()


class LoseFirstFinal:
    """A ``WorkflowEngine.status_filter`` that drops the first final status the hub would hear
    (lost on its way: the hub's statuses connection cut as it came); ``dropped`` holds it."""

    def __init__(self) -> None:
        self.dropped: list[TaskStatusEvent] = []

    def __call__(self, ev: TaskStatusEvent) -> bool:
        if ev.state.final and not self.dropped:
            self.dropped.append(ev)
            return False
        return True


class Held:
    """A started agent whose ``wf:slow:v1`` handler runs until released, and says whether a
    run of it was cancelled (the hub's cancel reached the agent)."""

    def __init__(self, fleet: Fleet, name: str = "slow.a1") -> None:
        self.release = asyncio.Event()
        self.started = 0
        self.cancelled = asyncio.Event()
        self.finished = 0
        self.agent: Agent = fleet.agent(name)

        @self.agent.handler("wf:slow:v1")
        async def wait(task: Task[Any]) -> str:
            self.started += 1
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            self.finished += 1
            return "done"

    async def start(self) -> Held:
        await self.agent.start()
        return self


async def running(
    mesh: Client, wf_id: str, step: int = 0, state: TaskState = TaskState.RUNNING
) -> None:
    """Until step ``step`` of the workflow is in ``state`` (RUNNING: on its agent)."""

    async def check() -> bool:
        try:
            view = await mesh.inspect_workflow(wf_id)
        except UnknownWorkflowError:
            return False
        return len(view.steps) > step and view.steps[step].state is state

    await eventually(check, timeout=10)


async def seed_owner(
    mesh: Client,
    kind: str,
    steps: list[Step],
    wf_id: str,
    owner: str,
    first_agents: list[str | None],
    cancel: ErrorBody | None = None,
) -> None:
    """A workflow record as ``owner`` left it (``first_agents``' attempts 1 sent at the
    start), for a hub to take over when the submission comes back."""
    spec = mesh._workflow_spec(kind, steps, "all", 30, wf_id)  # type: ignore[arg-type]
    record = WorkflowRecord(
        spec=spec,
        spec_digest=spec_digest(spec),
        owner=owner,
        submitted_at=time.time(),
        first_agents=first_agents,
        cancel=cancel,
    )
    kv = await mesh.nc.jetstream().key_value(protocol.KV_WORKFLOWS)
    await kv.put(protocol.workflow_key(mesh.namespace, wf_id), protocol.encode(record))


def fed_agent(
    registry: Registry,
    agent_id: str,
    capabilities: list[str],
    *,
    cordoned: bool = False,
    **card: Any,
) -> None:
    """Register ``agent_id`` with ``capabilities`` (and ``card``'s other fields) in a registry
    fed in memory (no KV), as its watch would."""
    record = AgentRecord(
        card=AgentCard(agent_id=agent_id, capabilities=capabilities, **card),
        session="s",
        heartbeat_interval=5.0,
        lease_timeout=15.0,
        task_subject=f"reach.agent.{agent_id}.task",
        registered_at=0.0,
        cordoned=cordoned,
    )
    registry.apply_record(record, 1, seen_at=registry.now)
