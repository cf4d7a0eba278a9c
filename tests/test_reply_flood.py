"""A flood of a hub's proxy-reply subjects holds every tenant's answers unread in the hub's
queue past their deadlines; each expiry is charged to its agent only once the agent says it
did not answer in time (``hub/_lateness.py``; docs/security.md, "Shared JetStream and bus").

Against a real nats-server, in secure mode for the flood: the flooder is an agent of another
namespace, with nothing but its own permissions (it may publish into every hub's inbox: it
answers there)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nats
import pytest

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._auth import AuthDir
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import MeshTimeoutError
from reach_mesh.hub import Hub
from reach_mesh.hub.breaker import BreakerState
from reach_mesh.models import AgentState
from reach_mesh.server import EmbeddedNats

from .helpers import eventually
from .test_flights import raw_agent

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
    flood past their deadlines (the routes time out), and the hub asks it about each expiry
    before charging it: it answered, so its breaker stays closed and its health whole.
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
            # The agent's word that it answered, or — its answer to the ask held up too —
            # no word, which is no charge.
            assert checks["answered"] + checks["behind"] == expired, checks
            assert checks["charged"] == checks["skipped"] == 0, checks
            assert view.state is AgentState.ONLINE and view.health.value == 100
            assert view.breaker.counts()[1] == 0  # (its answers count as read in time)


async def test_an_agent_silent_on_its_ctl_subject_is_charged_its_expiry(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """The check keeps charging an agent that does not answer: one whose ctl subject is
    subscribed but never answers (a hung process) is charged once this hub shows it reads
    the asks' answers in time (nothing came back before a message it sent itself)."""
    agent_id = f"{namespace}.hung.a1"
    assert settings.nats_url is not None
    ctl = await nats.connect(settings.nats_url)
    try:
        await ctl.subscribe(protocol.agent_ctl(agent_id))  # asked, never answering
        await ctl.flush()
        async with raw_agent(settings, agent_id, listen=True), Client(settings=settings) as c:
            before = _checks(hub)
            with pytest.raises(MeshTimeoutError):
                await c.request(agent_id=agent_id, payload={"n": 1}, timeout=0.3)
            view = hub.registry.agents[agent_id]
            assert view.health.value == 100  # not yet: its agent is asked first
            await eventually(lambda: _checks(hub)["charged"] == before["charged"] + 1, timeout=5)
            assert view.health.value < 100 and view.breaker.counts() == (0, 1)
    finally:
        await ctl.close()


async def test_an_agent_that_answers_past_the_deadline_is_charged_its_expiry(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """An agent whose handler holds its event loop past the route's deadline answers the ask
    only once the handler returned: its stored reply, SUCCEEDED, was made late by its own
    clock (``queued_ms`` + ``duration_ms`` over the timeout) — charged as an expiry, not
    counted a success (which kept a slow agent out of its breaker, healthy, while every
    route to it timed out)."""
    agent_id = f"{namespace}.slow.a1"
    agent = Agent(agent_id, settings=settings)

    @agent.handler("work:slow:v1")
    async def slow(task: Task[int]) -> int:
        time.sleep(0.8)  # noqa: ASYNC251 (holds the event loop: the ask waits behind it)
        return task.payload

    async with agent, Client(settings=settings) as c:
        before = _checks(hub)
        with pytest.raises(MeshTimeoutError):
            await c.request(agent_id=agent_id, payload=1, timeout=0.3)
        view = hub.registry.agents[agent_id]

        def checked() -> bool:
            return sum(_checks(hub).values()) > sum(before.values())

        await eventually(checked, timeout=5)
        checks = _checks(hub)
        assert checks["charged"] == before["charged"] + 1, checks
        assert view.breaker.counts() == (0, 1) and view.health.value < 100
