"""A flood of a hub's proxy-reply subjects: an agent may publish only on its own namespace's
(``hub/_reply_boxes.py``), read on a subscription of that namespace's own, so another
namespace's routes through the hub answer in time all through it; the flood's own namespace's
answers wait unread behind it past their deadlines, and each such expiry is charged to its
agent only once a marker the hub sends itself comes back with no reply of that attempt before
it (``hub/_lateness.py``; docs/security.md, "Shared JetStream and bus").

Against a real nats-server, in secure mode: the flooder is an agent with nothing but its own
permissions (it may publish into every hub's inbox under its namespace's reply subjects: it
answers there)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._auth import AuthDir
from reach_mesh._nats import slow_drops
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import MeshTimeoutError
from reach_mesh.hub import Hub, _reply_boxes
from reach_mesh.hub._reply_boxes import REPLY_PENDING_MOST
from reach_mesh.hub.breaker import BreakerState
from reach_mesh.models import AgentCard, AgentState, TaskEnvelope, TaskReply, TaskState
from reach_mesh.server import EmbeddedNats

from .helpers import eventually, register_by_hand
from .test_flights import CAP, raw_agent

#: ``reach_expiry_checks_total``'s outcomes (``tracing.metrics.EXPIRY_OUTCOMES``).
OUTCOMES = ("charged", "answered", "behind", "skipped")
VICTIM = "vic.echo.a1"
#: An agent of the victim's namespace (the flood of its replies is its own namespace's), and
#: one of another namespace.
NEIGHBOUR = "vic.flood.a1"
FLOODER = "atk.flood.a1"


async def _echo(task: Task[int]) -> int:
    return task.payload


def _checks(hub: Hub) -> dict[str, float]:
    """``reach_expiry_checks_total`` of ``hub`` by outcome (0 where there is no series)."""
    get = hub.metrics.registry.get_sample_value
    return {o: get("reach_expiry_checks_total", {"outcome": o}) or 0.0 for o in OUTCOMES}


Settings = Callable[[str, str], MeshSettings]


@asynccontextmanager
async def _secure(tmp_path: Path, *identities: tuple[str, str]) -> AsyncIterator[Settings]:
    """A server in secure mode whose identities are a hub ``main``, a caller of ``vic`` and
    ``identities`` (role, name): the settings of each (heartbeats every 0.5 s)."""
    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace="vic")
    for role, name in identities:
        auth.add(role, name)
    async with EmbeddedNats(tmp_path / "store", auth_config=auth.auth_conf) as server:

        def settings(role: str, name: str) -> MeshSettings:
            return auth.settings(role, name, nats_url=server.url, heartbeat_interval=0.5)

        yield settings


def _echo_agent(settings: Settings) -> Agent:
    agent = Agent(VICTIM, settings=settings("agent", VICTIM))
    agent.handler("work:echo:v1")(_echo)
    return agent


@contextmanager
def _flooding(s: MeshSettings, subject: str, rate: float | None = None) -> Iterator[None]:
    """100-byte messages on ``subject`` as fast as ``s``'s identity can send them, 10,000 at a
    time (or ``rate`` a second, evenly: a hundredth of a second's worth at a time), from a
    thread of their own (its own event loop), until the block ends."""
    stop = threading.Event()

    def flood() -> None:
        async def publish() -> None:
            nc = await nats.connect(
                s.nats_url or "",
                nkeys_seed=s.nats_nkey_seed,
                inbox_prefix=s.nats_inbox_prefix or "_INBOX",
                pending_size=64 << 20,
            )
            body = b"x" * 100
            # (At a rate, not 10,000 at once: a burst of them reaches the hub at the speed of
            # the socket, faster than it reads, and waits there ahead of every namespace's
            # answers while it is read: docs/security.md, "Not fixed".)
            chunk = 10_000 if rate is None else max(1, round(rate / 100))
            sent, t0 = 0, time.perf_counter()
            while not stop.is_set():
                for start in range(0, chunk, 1000):
                    for _ in range(min(1000, chunk - start)):
                        await nc.publish(subject, body)
                    await asyncio.sleep(0)
                await nc.flush()  # (its buffer bounded: the server takes what it sends)
                sent += chunk
                if rate is not None:
                    await asyncio.sleep(max(0.0, t0 + sent / rate - time.perf_counter()))
            await nc.close()

        asyncio.run(publish())

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


async def test_a_flood_of_a_hubs_proxy_replies_gets_no_other_agent_charged(
    tmp_path: Path,
) -> None:
    """Another agent of namespace ``vic`` floods the hub's proxy-reply subjects of ``vic``
    with 100-byte messages: ``vic.echo.a1`` answers six routes at once, its answers wait
    unread behind the flood past their deadlines (the routes time out), and read before the
    hub's marker (or the marker not back in time, or the flood's messages dropped unread)
    they are not charged: its breaker stays closed and its health whole.
    Charged at once, as before, the expiries quarantined it (at least five failures to one
    or two successes; the audit: QUARANTINED in 18 of 22 samples of a 10 s flood)."""
    identities = ("agent", VICTIM), ("agent", NEIGHBOUR)
    async with (
        _secure(tmp_path, *identities) as settings,
        Hub(settings=settings("hub", "main")) as hub,
        _echo_agent(settings),
        Client(settings=settings("caller", "vic")) as mesh,
    ):
        assert (await mesh.request(capability="work:echo:v1", payload=0)).result == 0
        view = hub.registry.agents[VICTIM]
        box = hub._replies.of("vic")
        replies = box.sub
        assert replies is not None
        with _flooding(settings("agent", NEIGHBOUR), box.prefix + "junk"):
            # Enough unread for the answers below to wait behind it past half a second
            # (its queue holds at most ``REPLY_PENDING_MOST``: then it drops).
            await eventually(lambda: replies.pending_msgs > 50_000, timeout=30)
            routes = await asyncio.gather(
                *(
                    mesh.request(capability="work:echo:v1", payload=i, timeout=0.5)
                    for i in range(1, 7)
                ),
                return_exceptions=True,
            )
            expired = sum(isinstance(r, MeshTimeoutError) for r in routes)
            # (Five are enough to quarantine it when charged at once: 5 of 6 or 7 failed.)
            assert expired >= 5, routes

            def settled() -> bool:
                assert view.breaker.state is BreakerState.CLOSED, view.breaker.why
                return sum(_checks(hub).values()) >= expired

            await eventually(settled, timeout=15)
        checks = _checks(hub)
        # Its answers read before the marker, or — the marker held up too, or the flood's
        # messages dropped unread — the hub cannot tell, which is no charge.
        assert checks["answered"] + checks["behind"] == expired, checks
        assert checks["charged"] == checks["skipped"] == 0, checks
        assert view.state is AgentState.ONLINE and view.health.value == 100
        assert view.breaker.counts()[1] == 0  # (its answers count as read in time)


def _echoed(msg: Msg, agent_id: str) -> bytes:
    """``agent_id``'s answer to the task ``msg``: SUCCEEDED, its payload as the result."""
    env = TaskEnvelope.model_validate_json(msg.data)
    reply = TaskReply(
        task_id=env.task_id,
        attempt=env.attempt,
        agent_id=agent_id,
        state=TaskState.SUCCEEDED,
        result=env.payload,
    )
    return protocol.encode(reply)


@asynccontextmanager
async def _by_hand(s: MeshSettings, agent_id: str) -> AsyncIterator[list[str]]:
    """Agent ``agent_id`` (identity ``s``) speaking the wire protocol by hand: it registers,
    answers each task with its payload, and yields the reply subjects it was given."""
    assert s.nats_url is not None
    nc = await nats.connect(
        s.nats_url, nkeys_seed=s.nats_nkey_seed, inbox_prefix=s.nats_inbox_prefix or "_INBOX"
    )
    seen: list[str] = []

    async def take(msg: Msg) -> None:
        seen.append(msg.reply)
        await nc.publish(msg.reply, _echoed(msg, agent_id))

    try:
        await nc.subscribe(protocol.agent_task(agent_id), cb=take)
        await register_by_hand(nc, AgentCard(agent_id=agent_id, capabilities=[CAP]))
        yield seen
    finally:
        await nc.close()


def _prefix_of(reply: str) -> str:
    """The hub's reply prefix of a single attempt's reply subject (``<prefix><batch>.<i>``)."""
    return reply.rsplit(".", 2)[0] + "."


async def _served(mesh: Client, agent_id: str, seen: list[str]) -> str:
    """Route one request to ``agent_id`` (answered by hand): the hub's reply prefix it saw."""
    assert (await mesh.request(agent_id=agent_id, payload=7)).result == 7
    return _prefix_of(seen[-1])


async def test_an_agent_may_not_publish_on_another_namespaces_reply_subjects(
    tmp_path: Path,
) -> None:
    """The hub gives the agents of each namespace reply subjects of that namespace's own, and
    the server refuses an agent of ``atk`` a publish on ``vic``'s (seen by ``vic``'s agent in
    its tasks) — while it may publish on its own. (With one prefix for every namespace, both
    agents saw the same, and any agent could flood every tenant's answers.)"""
    identities = ("caller", "atk"), ("agent", VICTIM), ("agent", FLOODER)
    async with (
        _secure(tmp_path, *identities) as settings,
        Hub(settings=settings("hub", "main")) as hub,
        _by_hand(settings("agent", VICTIM), VICTIM) as vic_seen,
        _by_hand(settings("agent", FLOODER), FLOODER) as atk_seen,
        Client(settings=settings("caller", "vic")) as c_vic,
        Client(settings=settings("caller", "atk")) as c_atk,
    ):
        await eventually(lambda: {VICTIM, FLOODER} <= set(hub.registry.agents))
        vic_prefix = await _served(c_vic, VICTIM, vic_seen)
        atk_prefix = await _served(c_atk, FLOODER, atk_seen)
        assert vic_prefix != atk_prefix
        said: list[str] = []

        async def on_error(err: Exception) -> None:
            said.append(str(err))

        s = settings("agent", FLOODER)
        nc = await nats.connect(
            s.nats_url or "",
            nkeys_seed=s.nats_nkey_seed,
            inbox_prefix=s.nats_inbox_prefix or "_INBOX",
            error_cb=on_error,
        )
        try:
            await nc.publish(vic_prefix + "junk", b"x")
            await nc.publish(atk_prefix + "junk", b"x")
            await nc.flush()  # (the server's -ERR for a publish comes before its PONG)
            await eventually(lambda: bool(said))
        finally:
            await nc.close()
        # (nats-py says it in lower case.)
        refused = [m for m in said if "permissions violation" in m.lower()]
        assert [m for m in refused if vic_prefix.lower() in m.lower()], said
        assert not [m for m in said if atk_prefix.lower() in m.lower()], said


@asynccontextmanager
async def _vic_and_atk(
    tmp_path: Path,
) -> AsyncIterator[tuple[Settings, Hub, Client, str]]:
    """A hub, ``vic``'s echo agent and a caller of ``vic`` that routed to it, and ``atk``'s
    agent by hand, served once: the settings, the hub, ``vic``'s caller, and the hub's reply
    prefix ``atk``'s agent saw."""
    identities = ("caller", "atk"), ("agent", VICTIM), ("agent", FLOODER)
    async with (
        _secure(tmp_path, *identities) as settings,
        Hub(settings=settings("hub", "main")) as hub,
        _echo_agent(settings),
        _by_hand(settings("agent", FLOODER), FLOODER) as atk_seen,
        Client(settings=settings("caller", "vic")) as mesh,
        Client(settings=settings("caller", "atk")) as c_atk,
    ):
        assert (await mesh.request(capability="work:echo:v1", payload=0)).result == 0
        await eventually(lambda: FLOODER in hub.registry.agents)
        yield settings, hub, mesh, await _served(c_atk, FLOODER, atk_seen)


def _whole(hub: Hub, agent_id: str) -> None:
    """``agent_id`` is charged nothing on ``hub``: its breaker closed, its health whole."""
    view = hub.registry.agents[agent_id]
    assert view.breaker.state is BreakerState.CLOSED
    assert view.health.value == 100


async def _vic_routed(
    mesh: Client, apart: float = 0.0, enough: Callable[[], bool] = lambda: True
) -> list[float]:
    """Rounds of six routes of ``vic`` at once (``apart`` seconds between rounds), each with a
    timeout of 0.5 s, every one answered: how long each round took. Three rounds at least,
    and on until ``enough`` (3 s at most): the flood test's until the hub has read 1,000 of
    the flood meanwhile (three quick rounds once read 3 of it: it came 10,000 at a time then,
    every 0.5 s, and the rounds fell between two)."""
    took: list[float] = []
    until = time.perf_counter() + 3.0
    for round_ in itertools.count():
        if round_ >= 3 and (enough() or time.perf_counter() > until):
            break
        t0 = time.perf_counter()
        payloads = range(6 * round_, 6 * round_ + 6)
        routes = await asyncio.gather(
            *(mesh.request(capability="work:echo:v1", payload=i, timeout=0.5) for i in payloads),
            return_exceptions=True,
        )
        took.append(time.perf_counter() - t0)
        assert [getattr(r, "result", r) for r in routes] == list(payloads), routes
        await asyncio.sleep(apart)
    return took


async def test_a_flood_of_one_namespaces_replies_leaves_another_namespaces_routes_answered(
    tmp_path: Path,
) -> None:
    """An agent of ``atk`` floods the hub's reply subjects it learned from its own tasks with
    100-byte messages, faster than the hub reads them (modelled: the subscription they land on
    is held, as a callback slower than the flood is — measured unheld, a flood of 60,000 a
    second from another process did the same here). The flood fills that subscription's
    queue and is dropped past its bound; ``vic``'s routes through the hub, all through the
    flood, are answered, every one, within half a second: their replies are read on ``vic``'s
    own subscription. (With one reply subscription for every namespace, ``vic``'s answers
    waited unread behind the flood and every route timed out.) The flood comes evenly, 200
    every 10 ms: sent 10,000 at a time when every namespace's replies came on one connection,
    each burst waited in the hub's socket, ahead of ``vic``'s answers, for as long as the hub
    took to read it (docs/security.md) — up to 0.24 s on a load of 3-4, every route of a round
    past 0.5 s once under more."""
    async with _vic_and_atk(tmp_path) as (settings, hub, mesh, atk_prefix):
        flooded_nc = hub._replies.of("atk").nc
        # The subscription the flood lands on (whatever the hub's layout), held.
        (flooded,) = [
            sub
            for sub in flooded_nc._subs.values()
            if sub.subject.endswith(">") and atk_prefix.startswith(sub.subject[:-1])
        ]
        go = asyncio.Event()
        read: Callable[[Msg], Awaitable[None]] = flooded._cb  # type: ignore[assignment]

        async def held(msg: Msg) -> None:
            await go.wait()
            await read(msg)

        flooded._cb = held
        try:
            flood = _flooding(settings("agent", FLOODER), atk_prefix + "junk", rate=20_000)
            with flood:
                # A full queue of the flood, unread, and more of it coming.
                await eventually(
                    lambda: (
                        flooded.pending_msgs + slow_drops(flooded_nc, flooded._id)
                        > REPLY_PENDING_MOST
                    ),
                    timeout=30,
                )
                before = int(flooded_nc.stats["in_msgs"])

                def flooding() -> bool:
                    return int(flooded_nc.stats["in_msgs"]) - before > 1_000

                took = await _vic_routed(mesh, enough=flooding)
                flooded_meanwhile = int(flooded_nc.stats["in_msgs"]) - before
            # The flood went on all through the routes (the hub read it meanwhile), past
            # its subscription's bound: dropped there, counted for that one alone.
            assert flooded_meanwhile > 1_000, flooded_meanwhile
            assert slow_drops(flooded_nc, flooded._id) > 0
            assert max(took) < 0.5, took
        finally:
            go.set()
        _whole(hub, VICTIM)
        vic = hub._replies.of("vic")
        assert vic.sub is not None and slow_drops(vic.nc, vic.sub._id) == 0


async def test_a_flood_its_connection_cannot_read_backs_up_that_connection_alone(
    tmp_path: Path,
) -> None:
    """An agent of ``atk`` floods the hub's reply subjects it learned, and the hub's connection
    that reads them reads nothing (its socket's reading paused: modelled, a flood faster than
    the hub reads — unmodelled, 100,000 a second from another process here — waits in that
    socket and in the server's buffer for it, ahead of whatever else the connection carries).
    ``vic``'s routes through the hub, all through the flood, are answered within half a second:
    ``vic``'s replies come on another of the hub's reply connections (``hub/_reply_boxes.py``),
    and its agent stays whole.
    (With every namespace's replies on one connection, ``vic``'s waited behind the flood: every
    route timed out.)"""
    async with _vic_and_atk(tmp_path) as (settings, hub, mesh, atk_prefix):
        flooded_nc = hub._replies.of("atk").nc
        socket = flooded_nc._transport._io_writer.transport  # type: ignore[union-attr]
        socket.pause_reading()
        try:
            with _flooding(settings("agent", FLOODER), atk_prefix + "junk", rate=20_000):
                await asyncio.sleep(0.5)  # (the flood backs up)
                read = int(flooded_nc.stats["in_msgs"])
                took = await _vic_routed(mesh, apart=0.3)
                assert int(flooded_nc.stats["in_msgs"]) == read  # (it read nothing meanwhile)
            assert max(took) < 0.5, took
        finally:
            socket.resume_reading()
        _whole(hub, VICTIM)


async def test_an_agent_that_never_answers_but_says_it_did_on_ctl_has_its_breaker_opened(
    tmp_path: Path,
) -> None:
    """An agent (secure mode: its own identity) takes its routes and never answers them, but
    answers every ctl ``task_state`` with a made-up SUCCEEDED reply of that very attempt,
    made within the route's timeout by its own figures. Its expiries are charged all the
    same — the hub's marker came back, its reply not before it — and its breaker opens.
    (When the hub charged by the agent's ``task_state`` answer, each expiry counted as a
    success read late: the breaker never opened, every route to it timed out.)"""
    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace="liar")
    liar = "liar.work.a1"
    auth.add("agent", liar)
    async with EmbeddedNats(tmp_path / "store", auth_config=auth.auth_conf) as server:

        def settings(role: str, name: str) -> MeshSettings:
            return auth.settings(role, name, nats_url=server.url, heartbeat_interval=0.5)

        s = settings("agent", liar)
        nc = await nats.connect(
            server.url, nkeys_seed=s.nats_nkey_seed, inbox_prefix=s.nats_inbox_prefix or "_INBOX"
        )
        taken: list[int] = []

        async def take(msg: Msg) -> None:  # in hand, never answered
            taken.append(TaskEnvelope.model_validate_json(msg.data).attempt)

        async def ctl(msg: Msg) -> None:  # "finished, in time" for any task asked about
            ask = json.loads(msg.data)
            made_up = TaskReply(
                task_id=ask.get("task_id", ""),
                attempt=max(taken, default=1),
                agent_id=liar,
                state=TaskState.SUCCEEDED,
                result=0,
                queued_ms=1.0,
                duration_ms=1.0,
            )
            await nc.publish(msg.reply, protocol.encode(made_up))

        try:
            await nc.subscribe(protocol.agent_task(liar), cb=take)
            await nc.subscribe(protocol.agent_ctl(liar), cb=ctl)
            async with (
                Hub(settings=settings("hub", "main")) as hub,
                Client(settings=settings("caller", "liar")) as mesh,
            ):
                await register_by_hand(nc, AgentCard(agent_id=liar, capabilities=[CAP]))
                await eventually(lambda: liar in hub.registry.agents)
                view = hub.registry.agents[liar]
                before = _checks(hub)
                # Five at once: the breaker's least (``breaker_min_requests``), all failures.
                routes = await asyncio.gather(
                    *(mesh.request(agent_id=liar, payload=i, timeout=0.3) for i in range(5)),
                    return_exceptions=True,
                )
                assert all(isinstance(r, MeshTimeoutError) for r in routes), routes
                await eventually(lambda: view.breaker.state is BreakerState.OPEN, timeout=10)
                checks = _checks(hub)
                assert checks["charged"] == before["charged"] + 5, checks
                assert checks["answered"] == before["answered"], checks
                assert view.health.value < 100  # (its accept timeouts)
        finally:
            await nc.close()


async def test_namespaces_past_the_bound_share_one_overflow_subscription(
    hub: Hub, settings: MeshSettings, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``REPLY_NAMESPACES_MOST`` namespaces (here: no more than the hub has), each next
    one gets reply subjects naming it under one shared overflow subscription
    (``<inbox>.r.*.<nonce>.>``): its routes are answered as before, and a ctl ask of it too."""
    monkeypatch.setattr(_reply_boxes, "REPLY_NAMESPACES_MOST", len(hub._replies.boxes()))
    names = [f"{namespace}p", f"{namespace}q"]
    async with contextlib.AsyncExitStack() as stack:
        for ns in names:
            s = settings.model_copy(update={"namespace": ns})
            agent_id = f"{ns}.echo.a1"
            await stack.enter_async_context(raw_agent(s, agent_id, listen=True, answer=True))
            c = await stack.enter_async_context(Client(settings=s))
            assert (await c.request(agent_id=agent_id, payload={"n": 1})).result == {"n": 1}
        p, q = (hub._replies.of(ns) for ns in names)
        assert p.sub is not None and p.sub is q.sub  # one subscription for both
        assert p.sub.subject.endswith(".r.*." + p.prefix.split(".")[-2] + ".>"), p.sub.subject
        assert p.prefix != q.prefix and f".r.{names[0]}." in p.prefix
        with pytest.raises(nats.errors.NoRespondersError):  # asked, answered by NATS: nobody
            await hub.registry.ask_agent(f"{names[1]}.nobody.a1", b"{}", timeout=2)


async def test_a_namespace_whose_subscription_failed_is_subscribed_again(
    hub: Hub, settings: MeshSettings, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subscribing a namespace's reply subjects fails (as on a connection closing): the
    attempts waiting for it end ``REACH_UNAVAILABLE``, and the namespace's next attempt (the
    client's, asking again) subscribes again and is answered — its slot among the namespaces
    with a subscription of their own not lost. (Kept, the failed subscription failed every
    route of that namespace for the hub's life.)"""
    replies = hub._replies
    subscribe = replies._subscribe
    subjects: list[str] = []

    async def failing_once(
        nc: NATS, subject: str, cb: Callable[[Msg], Awaitable[None]]
    ) -> Subscription:
        subjects.append(subject)
        if len(subjects) == 1:
            raise nats.errors.ConnectionClosedError
        return await subscribe(nc, subject, cb)

    monkeypatch.setattr(replies, "_subscribe", failing_once)
    s = settings.model_copy(update={"namespace": f"{namespace}s"})
    agent_id = f"{namespace}s.echo.a1"
    async with (
        raw_agent(s, agent_id, listen=True, answer=True),
        Client(settings=s) as c,
    ):
        # (Its first attempt ends REACH_UNAVAILABLE; the client asks again, as it does then.)
        assert (await c.request(agent_id=agent_id, payload=1)).result == 1
        assert (await c.request(agent_id=agent_id, payload=2)).result == 2
    assert len(subjects) == 2, subjects
    own = [b for b in replies.boxes() if not b.shared]
    assert sum(replies._held) == len(own)


def _box_of(hub: Hub, ns: str) -> _reply_boxes.ReplyBox | None:
    return next((b for b in hub._replies.boxes() if b.ns == ns), None)


@asynccontextmanager
async def _routed(
    hub: Hub, settings: MeshSettings, ns: str
) -> AsyncIterator[_reply_boxes.ReplyBox]:
    """An agent of ``ns`` registers and is routed to once through ``hub``: its box; it
    unregisters as the block ends."""
    s = settings.model_copy(update={"namespace": ns})
    agent_id = f"{ns}.echo.a1"
    async with raw_agent(s, agent_id, listen=True, answer=True), Client(settings=s) as c:
        assert (await c.request(agent_id=agent_id, payload=ns)).result == ns
        box = _box_of(hub, ns)
        assert box is not None and box.sub is not None
        yield box
    await eventually(lambda: agent_id not in hub.registry.agents)


async def test_a_namespace_gone_gives_its_reply_subscription_back(
    hub: Hub, settings: MeshSettings, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A namespace whose agents are all gone, with nothing of it in flight, gives back its
    reply subscription and its slot among the ``REPLY_NAMESPACES_MOST`` with one of their
    own, when a new namespace needs one — one whose agent is still registered keeps its own:
    kept, every namespace seen once held its slot for the hub's life, and past that many
    every new one shared the overflow subscription (its answers behind a neighbour's flood),
    its ``ReplyBox`` kept too however many came and went. A namespace gone through the
    overflow is let go likewise."""
    replies = hub._replies
    monkeypatch.setattr(_reply_boxes, "REPLY_NAMESPACES_MOST", len(replies.boxes()) + 2)

    def box_of(ns: str) -> _reply_boxes.ReplyBox | None:
        return _box_of(hub, ns)

    def routed(ns: str) -> contextlib.AbstractAsyncContextManager[_reply_boxes.ReplyBox]:
        return _routed(hub, settings, ns)

    async def visit(ns: str) -> _reply_boxes.ReplyBox:
        async with routed(ns) as box:
            return box

    async with routed(f"{namespace}live") as live:
        first = await visit(f"{namespace}a")
        assert not live.shared and not first.shared
        first_sid = first.sub._id if first.sub is not None else -1
        subs = first.nc._subs  # (its connection's)
        assert first_sid in subs
        second = await visit(f"{namespace}b")
        assert not second.shared, "the slot of a namespace gone was not given back"
        assert box_of(f"{namespace}a") is None
        await eventually(lambda: first_sid not in subs)
        assert box_of(f"{namespace}live") is live and live.sub is not None
        # Namespaces through the overflow come and go: their boxes do not pile up.
        monkeypatch.setattr(_reply_boxes, "REPLY_NAMESPACES_MOST", 0)
        for i in range(3):
            assert (await visit(f"{namespace}o{i}")).shared
        assert [b.ns for b in replies.boxes()] == [f"{namespace}live", f"{namespace}o2"]
        assert live.sub._id in live.nc._subs
        # The namespace still registered is still answered on its own subscription.
        s = settings.model_copy(update={"namespace": f"{namespace}live"})
        async with Client(settings=s) as c:
            got = await c.request(agent_id=f"{namespace}live.echo.a1", payload=2)
            assert got.result == 2


async def test_a_namespace_let_go_leaves_no_count_of_its_drops(
    hub: Hub, settings: MeshSettings, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slow-consumer drops counted for a namespace's reply subscription
    (``_nats.slow_drops``, on the reply connection it is on: here not the first, another
    namespace kept on that one) go with it when the namespace gives it back: kept, each
    subscription of a namespace come and gone that ever dropped a message left its count in
    the connection's table for the hub's life."""
    replies = hub._replies
    monkeypatch.setattr(_reply_boxes, "REPLY_NAMESPACES_MOST", len(replies.boxes()) + 2)
    monkeypatch.setattr(_reply_boxes, "REPLY_PENDING_MOST", 1)
    gone = f"{namespace}d"
    s = settings.model_copy(update={"namespace": gone})
    agent_id = f"{gone}.echo.a1"
    async with _routed(hub, settings, f"{namespace}k") as kept:
        async with raw_agent(s, agent_id, listen=True, answer=True), Client(settings=s) as c:
            assert (await c.request(agent_id=agent_id, payload=1)).result == 1
            box = next(b for b in replies.boxes() if b.ns == gone)
            assert box.sub is not None and box.nc is not kept.nc
            nc, sid = box.nc, box.sub._id
            flooder = await nats.connect(settings.nats_url or "")
            try:
                for _ in range(200):  # past its one pending message: dropped
                    await flooder.publish(box.prefix + "x.0", b"x" * 100)
                await flooder.flush()
                await eventually(lambda: slow_drops(nc, sid) > 0)
            finally:
                await flooder.close()
        await eventually(lambda: agent_id not in hub.registry.agents)
        other = settings.model_copy(update={"namespace": f"{namespace}e"})
        async with (
            raw_agent(other, f"{namespace}e.echo.a1", listen=True, answer=True),
            Client(settings=other) as c,
        ):
            assert (await c.request(agent_id=f"{namespace}e.echo.a1", payload=2)).result == 2
        assert _box_of(hub, gone) is None  # (let go)
        await eventually(lambda: sid not in nc.slow_drops)  # type: ignore[attr-defined]


async def test_a_new_namespace_takes_the_reply_connection_holding_the_fewest(
    hub: Hub, settings: MeshSettings, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new namespace's reply subscription goes on the reply connection holding the fewest
    namespaces' own, after one was let go too: ``l1`` and ``l2`` stay registered, ``g`` came
    between them and went, and ``n``, past the bound, has ``g`` let go and takes a connection
    none of the others is on — not ``l2``'s, as in turn by count (its slots in use modulo the
    connections) it did: two namespaces on one connection, another connection with none."""
    replies = hub._replies
    assert not replies.boxes() and _reply_boxes.REPLY_CONNECTIONS >= 4
    monkeypatch.setattr(_reply_boxes, "REPLY_NAMESPACES_MOST", 3)
    async with _routed(hub, settings, f"{namespace}l1") as l1:
        async with _routed(hub, settings, f"{namespace}g") as g:
            pass
        async with (
            _routed(hub, settings, f"{namespace}l2") as l2,
            _routed(hub, settings, f"{namespace}n") as n,
        ):
            assert _box_of(hub, g.ns) is None  # (let go)
            assert not n.shared
            on = [b.nc for b in (l1, l2, n)]
            assert len({id(nc) for nc in on}) == 3, "two namespaces on one reply connection"
            held = [sum(b.nc is nc for b in replies.boxes()) for nc in replies._ncs]
            assert max(held) - min(held) <= 1, held


async def test_a_reply_connection_back_sends_its_own_namespaces_attempts_again(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """Two namespaces answer on two of the hub's reply connections, each with a route out to
    an agent that took its task and has not answered. The first's reply connection is cut (its
    socket aborted, as nats-server cuts a slow consumer) and comes back: an answer sent
    meanwhile is lost, so its attempt is sent again to its agent (the same task id and
    attempt), whose answer then ends the route; the other's, on a connection that stayed up,
    is not sent again."""
    ns_a, ns_b = f"{namespace}ra", f"{namespace}rb"
    id_a, id_b = f"{ns_a}.held.a1", f"{ns_b}.held.a1"
    assert settings.nats_url is not None
    answerer = await nats.connect(settings.nats_url)
    async with (
        raw_agent(settings, id_a, listen=True) as got_a,
        raw_agent(settings, id_b, listen=True) as got_b,
        Client(settings=settings.model_copy(update={"namespace": ns_a})) as c_a,
        Client(settings=settings.model_copy(update={"namespace": ns_b})) as c_b,
    ):
        await eventually(lambda: {id_a, id_b} <= set(hub.registry.agents))
        route_a = asyncio.create_task(c_a.request(agent_id=id_a, payload=1, timeout=10))
        route_b = asyncio.create_task(c_b.request(agent_id=id_b, payload=2, timeout=10))
        try:
            await eventually(lambda: len(got_a) == 1 and len(got_b) == 1)
            box_a, box_b = hub._replies.of(ns_a), hub._replies.of(ns_b)
            cut = box_a.nc
            assert cut is not box_b.nc
            reconnects = cut.stats["reconnects"]
            losses = hub._replies.losses(box_a), hub._replies.losses(box_b)
            cut._transport._io_writer.transport.abort()  # type: ignore[union-attr]
            await eventually(lambda: cut.stats["reconnects"] > reconnects)
            # A possible loss for the namespace on the connection cut, not for the other's.
            assert hub._replies.losses(box_a) == losses[0] + 1
            assert hub._replies.losses(box_b) == losses[1]
            await eventually(lambda: len(got_a) == 2)
            first, again = (TaskEnvelope.model_validate_json(m.data) for m in got_a)
            assert (again.task_id, again.attempt) == (first.task_id, first.attempt)
            await answerer.publish(got_a[1].reply, _echoed(got_a[1], id_a))
            assert (await route_a).result == 1
            assert len(got_b) == 1
        finally:
            route_a.cancel()
            route_b.cancel()
            await answerer.close()
