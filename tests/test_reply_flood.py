"""A flood of a hub's proxy-reply subjects holds every tenant's answers unread in the hub's
queue past their deadlines; each expiry is charged to its agent only once a marker the hub
sends itself comes back with no reply of that attempt before it (``hub/_lateness.py``;
docs/security.md, "Shared JetStream and bus").

Against a real nats-server, in secure mode for the flood: the flooder is an agent of another
namespace, with nothing but its own permissions (it may publish into every hub's inbox: it
answers there)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nats
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._auth import AuthDir
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import MeshTimeoutError
from reach_mesh.hub import Hub
from reach_mesh.hub.breaker import BreakerState
from reach_mesh.models import AgentCard, AgentState, TaskEnvelope, TaskReply, TaskState
from reach_mesh.server import EmbeddedNats

from .helpers import eventually, register_by_hand
from .test_flights import CAP

#: ``reach_expiry_checks_total``'s outcomes (``tracing.metrics.EXPIRY_OUTCOMES``).
OUTCOMES = ("charged", "answered", "behind", "skipped")
VICTIM = "vic.echo.a1"
FLOODER = "atk.flood.a1"


async def _echo(task: Task[int]) -> int:
    return task.payload


def _checks(hub: Hub) -> dict[str, float]:
    """``reach_expiry_checks_total`` of ``hub`` by outcome (0 where there is no series)."""
    get = hub.metrics.registry.get_sample_value
    return {o: get("reach_expiry_checks_total", {"outcome": o}) or 0.0 for o in OUTCOMES}


@contextmanager
def _flooding(url: str, s: MeshSettings, subject: str) -> Iterator[None]:
    """100-byte messages on ``subject`` as fast as ``s``'s identity can send them, from a
    thread of their own (its own event loop), until the block ends."""
    stop = threading.Event()

    def flood() -> None:
        async def publish() -> None:
            nc = await nats.connect(
                url,
                nkeys_seed=s.nats_nkey_seed,
                inbox_prefix=s.nats_inbox_prefix or "_INBOX",
                pending_size=64 << 20,
            )
            body = b"x" * 100
            while not stop.is_set():
                for _ in range(10):
                    for _ in range(1000):
                        await nc.publish(subject, body)
                    await asyncio.sleep(0)
                await nc.flush()  # (its buffer bounded: the server takes what it sends)
            await nc.close()

        asyncio.run(publish())

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


async def test_a_flood_of_a_hubs_proxy_replies_gets_no_other_tenants_agent_charged(
    tmp_path: Path,
) -> None:
    """An agent of namespace ``atk`` floods the hub's proxy-reply subjects with 100-byte
    messages: ``vic``'s agent answers six routes at once, its answers wait unread behind the
    flood past their deadlines (the routes time out), and read before the hub's marker (or
    the marker not back in time) they are not charged: its breaker stays closed and its
    health whole.
    Charged at once, as before, the expiries quarantined it (at least five failures to one
    or two successes; the audit: QUARANTINED in 18 of 22 samples of a 10 s flood)."""
    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace="vic")
    auth.add("agent", VICTIM)
    auth.add("agent", FLOODER)
    async with EmbeddedNats(tmp_path / "store", auth_config=auth.auth_conf) as server:

        def settings(role: str, name: str) -> MeshSettings:
            return auth.settings(role, name, nats_url=server.url, heartbeat_interval=0.5)

        agent = Agent(VICTIM, settings=settings("agent", VICTIM))
        agent.handler("work:echo:v1")(_echo)
        async with (
            Hub(settings=settings("hub", "main")) as hub,
            agent,
            Client(settings=settings("caller", "vic")) as mesh,
        ):
            assert (await mesh.request(capability="work:echo:v1", payload=0)).result == 0
            view = hub.registry.agents[VICTIM]
            replies = hub._reply_sub
            with _flooding(server.url, settings("agent", FLOODER), hub._reply_prefix + "junk"):
                # Enough unread for the answers below to wait behind it past half a second.
                await eventually(lambda: replies.pending_msgs > 100_000, timeout=30)
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
