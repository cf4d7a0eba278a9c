"""An expired proxy attempt ordered against the marker its hub sends itself
(``hub/_lateness.py``): a reply read before the marker is credited, one after it charged, and
a reply the hub may have lost (a slow-consumer drop, a reconnection) neither.

Deterministic: the hub's reply subscription is held (its callback waits on an event) while
the test places messages in its queue, in the server's order, then let go."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, TaskState, protocol
from reach_mesh._nats import slow_drops
from reach_mesh.errors import MeshTimeoutError, ReachError
from reach_mesh.hub import Hub, _lateness
from reach_mesh.hub._lateness import EXPIRY_PENDING_PER_NAMESPACE
from reach_mesh.hub._reply_boxes import ReplyBox
from reach_mesh.models import AgentCard, TaskEnvelope, TaskReply
from reach_mesh.tracing.metrics import EXPIRY_OUTCOMES, HubMetrics

from .helpers import eventually, register_by_hand
from .test_flights import CAP, raw_agent
from .test_reply_flood import OUTCOMES, _checks

pytestmark = pytest.mark.timeout(60)


def test_every_outcome_has_its_series_from_the_start() -> None:
    assert OUTCOMES == EXPIRY_OUTCOMES
    get = HubMetrics().registry.get_sample_value
    assert all(get("reach_expiry_checks_total", {"outcome": o}) == 0 for o in OUTCOMES)


async def replies_of(hub: Hub, ns: str) -> ReplyBox:
    """``hub``'s reply subjects for namespace ``ns``, their subscription made."""
    box = hub._replies.of(ns)
    await hub._replies.ready(box)
    assert box.sub is not None
    return box


async def _held(hub: Hub, ns: str) -> tuple[asyncio.Event, Callable[[], int]]:
    """Hold ``hub``'s reply subscription of namespace ``ns``: its callback waits for the
    event returned (nats-py queues what comes meanwhile, in order); and how many messages it
    holds so far."""
    go = asyncio.Event()
    sub = (await replies_of(hub, ns)).sub
    assert sub is not None
    read: Callable[[Msg], Awaitable[None]] = sub._cb  # type: ignore[assignment]
    taken: list[Msg] = []

    async def held(msg: Msg) -> None:
        if not go.is_set():
            taken.append(msg)  # (nats-py's queue no longer counts it)
        await go.wait()
        await read(msg)

    sub._cb = held
    return go, lambda: len(taken) + sub.pending_msgs


@pytest.fixture
def patient_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply read before the marker is credited however late the sweep that expired its
    attempt ran (``_SWEEP_SLACK`` as long as a marker is waited for): for the tests whose
    replies are all sent before their deadlines. With the real 0.05 s, a loaded box's sweep
    pass late by more made some of them ``behind`` (24 of 50 in one run of the batch test);
    the slack's own rule is the lagged-loop test's, which keeps it."""
    monkeypatch.setattr(_lateness, "_SWEEP_SLACK", _lateness.MARKER_WAIT)


@asynccontextmanager
async def _routed(
    hub: Hub, settings: MeshSettings, agent_id: str, timeout: float = 0.5
) -> AsyncIterator[tuple[list[Msg], asyncio.Task[object], NATS]]:
    """A hand-made agent that takes its task and does not answer, a route to it (``timeout``)
    under way, and a plain connection for the test to publish with."""
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    try:
        async with (
            raw_agent(settings, agent_id, listen=True) as received,
            Client(settings=settings) as c,
        ):
            route = asyncio.ensure_future(
                c.request(agent_id=agent_id, payload={"n": 1}, timeout=timeout)
            )
            await eventually(lambda: len(received) == 1)
            yield received, route, nc
            route.cancel()
    finally:
        await nc.close()


def _reply_to(task: Msg, agent_id: str) -> bytes:
    env = TaskEnvelope.model_validate_json(task.data)
    return protocol.encode(
        TaskReply(
            task_id=env.task_id, attempt=env.attempt, agent_id=agent_id, state=TaskState.SUCCEEDED
        )
    )


def _decided(hub: Hub, before: dict[str, float], outcome: str, agent_id: str) -> tuple[int, int]:
    """Assert that one expiry of ``hub`` ended ``outcome`` since ``before`` (and no other);
    the breaker's ``(successes, failures)`` of ``agent_id`` then."""
    checks = _checks(hub)
    assert checks == {o: before[o] + (o == outcome) for o in OUTCOMES}, checks
    return hub.registry.agents[agent_id].breaker.counts()


def _health(hub: Hub, agent_id: str) -> float:
    return hub.registry.agents[agent_id].health.value


async def _timed_out(route: asyncio.Task[object]) -> None:
    with pytest.raises(MeshTimeoutError):
        await route


@pytest.mark.usefixtures("patient_sweep")
async def test_a_reply_sent_in_time_read_after_the_expiry_but_before_the_marker_is_credited(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """The agent answers in time; the hub reads it only after the deadline passed (its
    caller answered REACH_TIMEOUT) — but before its marker, which the server delivered
    behind the reply: a success on its breaker, its health whole."""
    agent_id = f"{namespace}.prompt.a1"
    go, held = await _held(hub, namespace)
    async with _routed(hub, settings, agent_id) as (received, route, nc):
        await nc.publish(received[0].reply, _reply_to(received[0], agent_id))
        await nc.flush()
        await _timed_out(route)
        await eventually(lambda: held() >= 2)  # the reply, the marker
        assert hub._markers
        before = _checks(hub)
        go.set()
        await eventually(lambda: not hub._markers)
        assert _decided(hub, before, "answered", agent_id) == (1, 0)
        assert _health(hub, agent_id) == 100


async def test_a_reply_sent_after_the_marker_is_charged(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """The agent answers once the hub's marker is at the server: behind it in the queue,
    the reply is late — an accept timeout and a breaker failure, the reply counted late."""
    agent_id = f"{namespace}.tardy.a1"
    go, held = await _held(hub, namespace)
    async with _routed(hub, settings, agent_id) as (received, route, nc):
        await _timed_out(route)
        await eventually(lambda: held() >= 1)  # the marker
        await nc.publish(received[0].reply, _reply_to(received[0], agent_id))
        await nc.flush()
        await eventually(lambda: held() >= 2)
        before = _checks(hub)
        late = hub.metrics.late_reply_total._value.get()
        go.set()
        await eventually(lambda: hub.metrics.late_reply_total._value.get() == late + 1)
        assert _decided(hub, before, "charged", agent_id) == (0, 1)
        assert _health(hub, agent_id) < 100


async def test_a_reply_dropped_as_a_slow_consumer_before_the_expiry_charges_nothing(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """The agent's reply, sent in time, is dropped by nats-py (the reply subscription's
    pending bytes full): the hub cannot tell it from silence — ``behind``, nothing charged,
    though its marker comes back with nothing before it."""
    agent_id = f"{namespace}.dropped.a1"
    go, _ = await _held(hub, namespace)
    replies = await replies_of(hub, namespace)
    sub = replies.sub
    assert sub is not None
    sub._pending_bytes_limit = 4096
    async with _routed(hub, settings, agent_id) as (received, route, nc):
        await nc.publish(replies.prefix + "junk", b"x" * 4000)  # queued: 96 bytes left
        await nc.publish(received[0].reply, _reply_to(received[0], agent_id))  # dropped
        await nc.flush()
        await eventually(lambda: slow_drops(replies.nc, sub._id) == 1)
        before = _checks(hub)
        go.set()
        await _timed_out(route)
        await eventually(lambda: sum(_checks(hub).values()) > sum(before.values()))
        await eventually(lambda: not hub._markers)
        assert _decided(hub, before, "behind", agent_id) == (0, 0)
        assert _health(hub, agent_id) == 100


async def test_a_drop_between_the_marker_and_its_reading_charges_nothing(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """A message of the reply subscription dropped after the marker was sent but before it
    was read: what was dropped may have been a reply — ``behind``, nothing charged."""
    agent_id = f"{namespace}.dropafter.a1"
    go, held = await _held(hub, namespace)
    replies = await replies_of(hub, namespace)
    sub = replies.sub
    assert sub is not None
    async with _routed(hub, settings, agent_id) as (_, route, nc):
        await _timed_out(route)
        await eventually(lambda: held() >= 1)  # the marker
        assert hub._markers
        sub._pending_bytes_limit = 4096
        await nc.publish(replies.prefix + "junk", b"x" * 5000)  # dropped
        await nc.flush()
        await eventually(lambda: slow_drops(replies.nc, sub._id) == 1)
        before = _checks(hub)
        go.set()
        await eventually(lambda: not hub._markers)
        assert _decided(hub, before, "behind", agent_id) == (0, 0)
        assert _health(hub, agent_id) == 100


async def test_a_reconnection_while_an_attempt_is_out_charges_nothing(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """The hub's connection the namespace's replies come on is cut (its socket aborted, as
    nats-server cuts a slow consumer) and comes back while an attempt is out: its reply may
    have been lost with the connection — ``behind``, nothing charged, though the marker comes
    back."""
    agent_id = f"{namespace}.cut.a1"
    nc_agents = (await replies_of(hub, namespace)).nc
    async with _routed(hub, settings, agent_id) as (_, route, _nc):
        before = _checks(hub)
        reconnects = nc_agents.stats["reconnects"]
        nc_agents._transport._io_writer.transport.abort()  # type: ignore[union-attr]
        await eventually(lambda: nc_agents.stats["reconnects"] > reconnects)
        await _timed_out(route)
        await eventually(lambda: sum(_checks(hub).values()) > sum(before.values()))
        # Nothing left pending (a marker, had one been sent, back): no later outcome to come.
        await eventually(lambda: not hub._markers and not hub._late)
        assert _decided(hub, before, "behind", agent_id) == (0, 0)
        assert _health(hub, agent_id) == 100


async def test_a_reply_that_came_while_the_hubs_loop_was_behind_is_not_credited(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """The hub's event loop is held past an attempt's deadline while the agent answers (from
    a thread, 0.1 s after the deadline): the late sweep's marker leaves behind the reply, but
    the reply may have come after the deadline — ``behind``, neither credited nor charged.
    (Credited, an agent answering late while its hub was busy counted as answering in
    time.)

    The hold is a timer of the loop at 0.3 s before the hub's own deadline of the attempt: it
    runs before any pass of the sweep that could expire it. (Held once the test saw the task
    — the deadline 0.5 s after the route — a loaded box that brought the task, or the test,
    0.5 s late let the sweep expire it on time first: its marker then went before the reply,
    ``charged``.) The 2 s timeout is room for that: the hold is as short whatever it is."""
    agent_id = f"{namespace}.lagged.a1"
    go, held = await _held(hub, namespace)
    box = await replies_of(hub, namespace)
    async with _routed(hub, settings, agent_id, timeout=2.0) as (received, route, _):
        reply_to, body = received[0].reply, _reply_to(received[0], agent_id)
        flight = hub._flights.get(reply_to[box.prefix_len :])
        assert flight is not None, "the task came after its deadline"
        deadline = flight.deadline  # (the hub's perf_counter)
        published = threading.Event()

        def answer() -> None:
            async def publish() -> None:
                assert settings.nats_url is not None
                nc = await nats.connect(settings.nats_url)
                await asyncio.sleep(deadline + 0.1 - time.perf_counter())
                await nc.publish(reply_to, body)
                await nc.flush()
                await nc.close()

            asyncio.run(publish())
            published.set()

        in_flight_when_held: list[bool] = []

        def hold() -> None:  # (holds this loop, the hub's, past the deadline)
            in_flight_when_held.append(flight.token in hub._flights)
            published.wait(10)

        thread = threading.Thread(target=answer)
        thread.start()
        asyncio.get_running_loop().call_later(deadline - 0.3 - time.perf_counter(), hold)
        await _timed_out(route)
        thread.join()
        assert published.is_set()
        assert in_flight_when_held == [True]  # (held before the sweep expired it)
        await eventually(lambda: held() >= 2)  # the reply, the marker
        before = _checks(hub)
        go.set()
        await eventually(lambda: not hub._markers)
        assert _decided(hub, before, "behind", agent_id) == (0, 0)
        assert _health(hub, agent_id) == 100


async def _many_routed_and_held(
    hub: Hub, c: Client, agent_id: str, n: int, timeout: float = 0.5
) -> asyncio.Event:
    """``n`` routes to ``agent_id`` at once, the hub's reply subscription held meanwhile: all
    time out (whatever came for them waits unread). The hold (set it to let go)."""
    go, _ = await _held(hub, protocol.namespace_of(agent_id))
    routes = await asyncio.gather(
        *(c.request(agent_id=agent_id, payload={"n": i}, timeout=timeout) for i in range(n)),
        return_exceptions=True,
    )
    assert all(isinstance(r, MeshTimeoutError) for r in routes), routes
    return go


@pytest.mark.usefixtures("patient_sweep")
async def test_batches_of_replies_read_before_the_marker_are_credited(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """A batch agent answers in time — a batch of replies to each batch of attempts, a reply
    to each single one — on the subjects the hub gave it; the hub reads them only after the
    deadlines, but before its marker: every expiry ``answered``, a success each, none
    charged. (The same subscription reads both: the server's order holds for batches.)"""
    agent_id = f"{namespace}.batchlate.a1"
    n = 50  # (at once: some are decided in one pass, a batch — test_flights)
    async with (
        raw_agent(settings, agent_id, listen=True, batch=True) as received,
        Client(settings=settings) as c,
    ):
        assert settings.nats_url is not None
        nc = await nats.connect(settings.nats_url)
        replied: set[int] = set()

        async def answer_all() -> None:  # in time: as each task or batch comes
            while True:
                for k, msg in enumerate(list(received)):
                    if k in replied:
                        continue
                    replied.add(k)
                    if msg.subject == protocol.agent_batch(agent_id):
                        lines = []
                        for line in msg.data.split(b"\n"):
                            subject, _, body = line.split(b" ", 2)
                            env = TaskEnvelope.model_validate_json(body)
                            reply = TaskReply(
                                task_id=env.task_id,
                                attempt=env.attempt,
                                agent_id=agent_id,
                                state=TaskState.SUCCEEDED,
                            )
                            lines.append(subject + b" " + protocol.encode(reply))
                        await nc.publish(msg.reply, b"\n".join(lines))
                    else:
                        await nc.publish(msg.reply, _reply_to(msg, agent_id))
                await nc.flush()
                await asyncio.sleep(0.005)

        answering = asyncio.ensure_future(answer_all())
        try:
            before = _checks(hub)
            go = await _many_routed_and_held(hub, c, agent_id, n)
            batches = [m for m in received if m.subject == protocol.agent_batch(agent_id)]
            assert batches, "attempts decided in one pass go to a batch agent as one message"
            await eventually(lambda: bool(hub._markers))
            go.set()
            await eventually(lambda: not hub._markers and not hub._late)
            checks = _checks(hub)
            assert checks["answered"] - before["answered"] == n, checks
            assert checks["charged"] == before["charged"], checks
            assert hub.registry.agents[agent_id].breaker.counts() == (n, 0)
            assert _health(hub, agent_id) == 100
        finally:
            answering.cancel()
            await nc.close()


@pytest.mark.usefixtures("patient_sweep")
async def test_no_responders_read_before_the_marker_charge_nothing(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """A batch agent that listens to nothing: NATS answers "no responders" (status 503) to
    each batch of attempts and each single one at once, but the hub reads them only after
    the deadlines — before its marker: nothing charged (``answered``, counted as what they
    say: nobody listened), the breaker untouched. Charged, each would be an accept timeout on
    an agent that was never sent its task."""
    agent_id = f"{namespace}.nobody.a1"
    n = 50  # (at once: some are decided in one pass, a batch — test_flights)
    async with (
        raw_agent(settings, agent_id, listen=False, batch=True),
        Client(settings=settings) as c,
    ):
        before = _checks(hub)
        batch_503s: list[str] = []
        replies = await replies_of(hub, namespace)
        sub = replies.sub
        assert sub is not None
        read: Callable[[Msg], Awaitable[None]] = sub._cb  # type: ignore[assignment]

        async def seen(msg: Msg) -> None:
            if "." not in msg.subject[replies.prefix_len :] and msg.headers:
                batch_503s.append(msg.subject)
            await read(msg)

        sub._cb = seen
        go = await _many_routed_and_held(hub, c, agent_id, n)
        await eventually(lambda: bool(hub._markers))
        go.set()
        await eventually(lambda: not hub._markers and not hub._late)
        assert batch_503s, "a no-responders status for a whole batch"
        checks = _checks(hub)
        assert checks["answered"] - before["answered"] == n, checks
        assert checks["charged"] == before["charged"], checks
        assert hub.registry.agents[agent_id].breaker.counts() == (0, 0)
        assert _health(hub, agent_id) == 100


@pytest.mark.usefixtures("patient_sweep")
async def test_an_agents_empty_message_on_its_batch_subject_is_no_marker(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """An agent may publish on the reply subjects it was given: an empty message on a batch
    token's subject (where a marker would be) before its late reply does not end the wait —
    the reply, behind it but before the hub's own marker, is still credited; and the hub's
    marker, sent again after it came back, decides nothing (consumed once)."""
    agent_id = f"{namespace}.fakemark.a1"
    go, held = await _held(hub, namespace)
    async with _routed(hub, settings, agent_id) as (received, route, nc):
        reply_to = received[0].reply
        batch_subject = reply_to.rpartition(".")[0]  # <prefix><batch token>
        await nc.publish(batch_subject, b"")
        await nc.publish(reply_to, _reply_to(received[0], agent_id))
        await nc.flush()
        await _timed_out(route)
        await eventually(lambda: held() >= 3)  # the empty message, the reply, the marker
        (marker,) = hub._markers
        before = _checks(hub)
        go.set()
        await eventually(lambda: not hub._markers)
        assert _decided(hub, before, "answered", agent_id) == (1, 0)
        await nc.publish(
            (await replies_of(hub, namespace)).prefix + marker, b""
        )  # the marker again: nothing
        await nc.flush()
        await asyncio.sleep(0.1)
        assert _checks(hub) == {o: before[o] + (o == "answered") for o in OUTCOMES}


async def test_a_namespace_holds_at_most_its_share_of_pending_expiries(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """A caller whose routes all time out (its agent never answers), its hub's markers held
    up: at most ``EXPIRY_PENDING_PER_NAMESPACE`` of its expiries wait for one, the rest are
    ``skipped`` (not charged) — and another namespace's expiry still waits for its marker,
    and is decided by it, its share untouched."""
    hostile, other = f"{namespace}x", f"{namespace}y"
    s_hostile = settings.model_copy(update={"namespace": hostile})
    s_other = settings.model_copy(update={"namespace": other})
    n = EXPIRY_PENDING_PER_NAMESPACE + 12
    async with (
        raw_agent(s_hostile, f"{hostile}.sink.a1", listen=True),
        raw_agent(s_other, f"{other}.sink.a1", listen=True),
        Client(settings=s_hostile) as c_hostile,
        Client(settings=s_other) as c_other,
    ):
        before = _checks(hub)
        go = await _many_routed_and_held(hub, c_hostile, f"{hostile}.sink.a1", n, timeout=0.3)
        await eventually(
            lambda: _checks(hub)["skipped"] - before["skipped"] == n - EXPIRY_PENDING_PER_NAMESPACE
        )
        go_other, _ = await _held(hub, other)
        with pytest.raises(MeshTimeoutError):
            await c_other.request(agent_id=f"{other}.sink.a1", payload={}, timeout=0.3)
        assert hub._late_by_ns == {hostile: EXPIRY_PENDING_PER_NAMESPACE, other: 1}
        go.set()
        go_other.set()
        await eventually(lambda: not hub._late and not hub._markers)
        checks = _checks(hub)
        assert checks["skipped"] - before["skipped"] == n - EXPIRY_PENDING_PER_NAMESPACE
        decided = sum(checks[o] - before[o] for o in ("charged", "behind"))
        assert decided == EXPIRY_PENDING_PER_NAMESPACE + 1, checks
        assert hub._late_by_ns == {}


async def test_an_agent_registering_again_before_the_marker_is_charged_all_the_same(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """An agent that never answers registers again, under a new session, while its attempt
    is out: its new registration keeps its breaker and health (``_registry_watch``), and the
    expiry, its marker back with no reply before it, is charged to them — as it was when
    charged at once. (Charged only if the registration was still the one the attempt went
    to, a never-answering agent escaped every charge by registering again within each
    route's timeout: its breaker never opened.)"""
    agent_id = f"{namespace}.again.a1"
    go, held = await _held(hub, namespace)
    async with _routed(hub, settings, agent_id) as (_, route, nc):
        old = hub.registry.agents[agent_id]
        await register_by_hand(nc, AgentCard(agent_id=agent_id, capabilities=[CAP]))
        await eventually(lambda: hub.registry.agents[agent_id] is not old)
        new = hub.registry.agents[agent_id]
        assert new.breaker is old.breaker and new.health is old.health
        await _timed_out(route)
        await eventually(lambda: held() >= 1)  # the marker
        before = _checks(hub)
        go.set()
        await eventually(lambda: not hub._markers)
        assert _decided(hub, before, "charged", agent_id) == (0, 1)
        assert _health(hub, agent_id) < 100


async def test_a_breaker_opened_by_unanswered_routes_says_so(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """An agent that takes its routes and never answers: its charged expiries open its breaker,
    and what an operator reads of it (inspect, agents, the dashboard, a NO_MATCH) says the
    failures were routes it did not answer — its own metrics and logs show none of them."""
    agent_id = f"{namespace}.silent.a1"
    async with (
        raw_agent(settings, agent_id, listen=True),
        Client(settings=settings) as c,
    ):
        for n in range(5):
            with pytest.raises(MeshTimeoutError):
                await c.request(agent_id=agent_id, payload={"n": n}, timeout=0.3)
        await eventually(lambda: hub.registry.agents[agent_id].breaker.openings == 1)
        assert _checks(hub)["charged"] == 5
        why = "5 of its last 5 requests failed (5 not answered within their timeout)"
        assert (await c.inspect(agent_id)).breaker_reason == why
        with pytest.raises(ReachError, match=re.escape(f"breaker open: {why}")):
            await c.request(agent_id=agent_id, payload={}, timeout=0.3)


async def test_an_expiry_after_a_reconnection_of_before_is_charged(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """The hub's reply connections were cut and came back before a namespace's first route:
    that namespace's reply subscription, made after it on one of them, lost nothing, and its
    first unanswered attempt is charged once its marker is back. (Each namespace's losses
    counted from 0, the reconnection of before looked new to the first expiry of every
    namespace whose subscription came after it: ``behind``, never charged.)"""
    ncs = [nc for nc in hub._reply_ncs if nc is not None]
    reconnects = [nc.stats["reconnects"] for nc in ncs]
    for nc in ncs:
        nc._transport._io_writer.transport.abort()  # type: ignore[union-attr]
    await eventually(
        lambda: all(
            nc.stats["reconnects"] > was and nc.is_connected
            for nc, was in zip(ncs, reconnects, strict=True)
        )
    )
    agent_id = f"{namespace}.mute.a1"
    async with _routed(hub, settings, agent_id) as (_, route, _nc):
        before = _checks(hub)
        await _timed_out(route)
        await eventually(lambda: sum(_checks(hub).values()) > sum(before.values()))
        await eventually(lambda: not hub._markers and not hub._late)
        assert _decided(hub, before, "charged", agent_id) == (0, 1)
        assert _health(hub, agent_id) < 100
