"""A resend whose holder was declared LOST (cut off past its lease): the hub asks the agents
lately LOST too, and waits — half the route's time at most — for the holder to register again
before it routes the task as new; a holder whose registration is refused a while retries often
enough to make that wait; an attempt refused on the way puts the task id's pin back on the
holder. Split from ``test_resends.py``."""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, TaskResult, TaskState, protocol
from reach_mesh._nats import flushed
from reach_mesh.agent import Agent
from reach_mesh.errors import MeshTimeoutError, ReachError
from reach_mesh.hub import Hub
from reach_mesh.hub._holders import HOLDER_WAIT, _stored_copy
from reach_mesh.hub._pins import decode_pins
from reach_mesh.models import AgentState

from .helpers import (
    Fleet,
    eventually,
    heal,
    partition,
    refusing_registrations,
    two_holding,
)
from .test_resends import CAP, _back, _cut_off, _holding, _ours, _seeks, _stop_routing

pytestmark = pytest.mark.timeout(60)


async def _held_lost(
    hub: Hub,
    mesh: Client,
    fleet: Fleet,
    ran: dict[str, list[str]],
    task_id: str,
    target: dict[str, Any],
) -> None:
    """``a1`` takes ``task_id`` (its handler held) and is cut off (``partition``) until
    ``hub`` declares it LOST; ``a2`` is registered and idle. The caller's first request is
    given up (its answer lost, for the caller). ``a1`` is then back on NATS — it answers its
    ctl subject — but not registered: its heartbeats (which would register it again) held."""
    ns = hub.settings.namespace
    a1, a2 = fleet.agents
    await a1.start()
    await eventually(lambda: _ours(hub, ns) == 1)
    first = asyncio.ensure_future(mesh.request(**target, task_id=task_id, timeout=30))
    await eventually(lambda: ran.get(task_id) == [a1.agent_id], timeout=10)
    await a2.start()
    await eventually(lambda: _ours(hub, ns) == 2, timeout=10)
    await partition(a1)
    await eventually(lambda: a1.agent_id not in hub.registry.agents, timeout=10)
    assert [e["agent_id"] for e in hub.registry.recently_lost(ns)] == [a1.agent_id]
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    await heal(a1, beat=False)


def _waits_for(hub: Hub, agent: Agent) -> bool:
    """Whether a route of ``hub`` waits for ``agent``, a LOST holder, to register again."""
    return bool(hub._back_waits.get(agent.agent_id))


async def _held_until_back(
    hub: Hub,
    a1: Agent,
    ran: dict[str, list[str]],
    task_id: str,
    again: asyncio.Future[TaskResult],
    release: asyncio.Event,
) -> None:
    """The caller's request ``again`` for ``task_id``, which ``a1`` holds (back on NATS, not
    registered), waits past the seek's ask without running anywhere; ``a1`` registers again
    with ``hub``, the handler is let go, and the answer is ``a1``'s: the task ran once."""
    # The seek's ask done, the route waits for a1 (not a fixed time: a loaded box asks later);
    # before, it went to a2 at once.
    await eventually(lambda: _waits_for(hub, a1) or len(ran[task_id]) > 1, timeout=10)
    assert ran == {task_id: [a1.agent_id]}
    assert not again.done()
    a1._hb_task = asyncio.create_task(a1._heartbeat_loop())  # registers again
    await eventually(lambda: a1.agent_id in hub.registry.agents, timeout=10)
    await eventually(lambda: not _waits_for(hub, a1), timeout=10)  # the route woken: on to a1
    assert ran == {task_id: [a1.agent_id]}
    release.set()
    result = await again
    assert result.state is TaskState.SUCCEEDED and result.agent_id == a1.agent_id
    assert ran == {task_id: [a1.agent_id]}


@pytest.mark.parametrize(
    "target",
    [{"capability": CAP}, {"selector": f"cap={CAP} AND tier!=gold"}],
    ids=["capability", "selector"],
)
async def test_a_resend_goes_to_its_holder_declared_lost_once_it_registers_again(
    settings: MeshSettings, target: dict[str, Any]
) -> None:
    """The chaos ``partition`` fault: ``a1`` runs a task and is cut off long enough to be
    declared LOST (out of the registry); back on NATS, it is not registered yet (JetStream
    not back, its next heartbeat not due). The caller asks again (marked: the same
    ``Client``). The hub's pin names ``a1``, which is not routable, and no registered agent
    has the task: it asks the agents it declared LOST lately too, ``a1`` says it holds it,
    and the route waits for ``a1`` to register again, then goes to it — its idempotency
    table joins the run in hand: the task runs once. Before, it went to ``a2`` at once and
    ran twice. Routed by capability or by selector (the registration the lost agent had is
    matched as the router matches a registered one's)."""
    ns = settings.namespace
    fleet, ran, release = two_holding(settings, "rs", CAP)
    a1, _ = fleet.agents
    try:
        async with Hub(settings=settings) as hub, Client(settings=settings) as mesh:
            await _held_lost(hub, mesh, fleet, ran, "lh-back", target)
            agent_found = _seeks(hub, "agent")
            again = asyncio.ensure_future(mesh.request(**target, task_id="lh-back", timeout=20))
            await _held_until_back(hub, a1, ran, "lh-back", again, release)
            await eventually(lambda: _ours(hub, ns) == 2)
        assert _seeks(hub, "agent") == agent_found + 1
    finally:
        release.set()
        await fleet.close()


async def test_a_resend_whose_lost_holder_never_registers_again_is_routed_as_new(
    settings: MeshSettings,
) -> None:
    """As above, but ``a1`` never registers again: the route waits for it half the time it
    has left at most, then goes to ``a2`` as a new route, within the request's timeout, and
    the seek is counted ``found="lost"`` (the task ran twice)."""
    fleet, ran, release = two_holding(settings, "rs", CAP)
    a1, a2 = fleet.agents
    try:
        async with Hub(settings=settings) as hub, Client(settings=settings) as mesh:
            await _held_lost(hub, mesh, fleet, ran, "lh-gone", {"capability": CAP})
            lost_found = _seeks(hub, "lost")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            timeout = 4.0
            again = asyncio.ensure_future(
                mesh.request(capability=CAP, task_id="lh-gone", timeout=timeout)
            )
            await eventually(lambda: len(ran["lh-gone"]) == 2, timeout=timeout)
            took = loop.time() - t0
            # The ask, then half of what is left (1.75 s): a2 has the other half to run it in.
            assert HOLDER_WAIT + 1.0 < took < HOLDER_WAIT + (timeout - HOLDER_WAIT) / 2 + 1.0
            release.set()
            result = await again
        assert result.state is TaskState.SUCCEEDED and result.agent_id == a2.agent_id
        assert ran == {"lh-gone": [a1.agent_id, a2.agent_id]}
        assert _seeks(hub, "lost") == lost_found + 1
    finally:
        release.set()
        await fleet.close()


async def test_a_lost_holder_whose_registration_was_refused_a_while_is_back_within_the_wait(
    settings: MeshSettings,
) -> None:
    """The secure chaos run's ``partition``, seed 165 (two routes): ``a1`` runs a task and is
    cut off until declared LOST; back on NATS, its registration is refused for seconds
    (JetStream took no writes: leaders unseated by the healed node's rejoin), so it tries again
    and again. The caller asks again: ``a1`` says it holds the task, and the hub waits for its
    registration (half the route's time left); JetStream takes writes again early in that
    wait. ``a1``, registered before, tries within a heartbeat interval and is back in time:
    the route joins its run, the task runs once. Before, its tries backed off as at its start
    (up to 7.5 s apart once the backoff reached its 5 s cap): the next one came after the wait,
    and the route ran on ``a2`` too (the seek counted ``found="lost"``)."""
    fleet, ran, release = two_holding(settings, "rs", CAP)
    a1, a2 = fleet.agents
    hub = Hub(settings=settings)
    # JetStream taking no writes: the hub answers REACH_UNAVAILABLE, as its KV put fails.
    refused, refusing = refusing_registrations(hub)
    try:
        async with hub, Client(settings=settings) as mesh:
            await _held_lost(hub, mesh, fleet, ran, "lh-late", {"capability": CAP})
            agent_found, lost_found = _seeks(hub, "agent"), _seeks(hub, "lost")
            refusing.set()
            a1._hb_task = asyncio.create_task(a1._heartbeat_loop())  # told unknown: registers
            # Its eighth try refused: at the start's backoff the next is 2.5-7.5 s away.
            await eventually(lambda: len(refused) >= 8, timeout=30, interval=0.005)
            timeout = 3.5
            again = asyncio.ensure_future(
                mesh.request(capability=CAP, task_id="lh-late", timeout=timeout)
            )
            await asyncio.sleep(0.3)
            refusing.clear()  # JetStream takes writes again, 1.45 s before the wait ends
            await eventually(
                lambda: a1.agent_id in hub.registry.agents or len(ran["lh-late"]) > 1,
                timeout=timeout,
            )
            await eventually(lambda: not _waits_for(hub, a1), timeout=timeout)  # woken: to a1
            assert ran == {"lh-late": [a1.agent_id]}
            release.set()
            result = await again
        assert result.state is TaskState.SUCCEEDED and result.agent_id == a1.agent_id
        assert ran == {"lh-late": [a1.agent_id]}
        assert _seeks(hub, "agent") == agent_found + 1 and _seeks(hub, "lost") == lost_found
        assert a2.agent_id not in ran["lh-late"]
    finally:
        release.set()
        await fleet.close()


@pytest.mark.parametrize("first_kept", [True, False], ids=["first_up", "first_gone"])
async def test_a_resend_reaching_another_hub_goes_to_its_holder_declared_lost(
    settings: MeshSettings, first_kept: bool
) -> None:
    """The seek of a hub with no pin, for a holder declared LOST: ``first`` routed the task to
    ``a1``, which was cut off until both hubs declared it LOST, and is back on NATS but not
    registered. ``second`` never learned the pin (``first`` holds its answer to ``second``'s
    pins ask). The caller asks again, and ``first`` takes no more routes (or is gone): the
    request reaches ``second``, which asks the other hubs (``first``'s pin names an agent
    that is not registered: not an answer) and the agents it declared LOST lately; ``a1``
    says it holds the task, and the route waits for it to register again, then goes to it:
    the task runs once."""
    ns = settings.namespace
    asks_answered = asyncio.Event()
    fleet, ran, release = two_holding(settings, "rs", CAP)
    a1, a2 = fleet.agents
    second = Hub(settings=settings)  # started once the task runs: it never learns the pin
    first = Hub(settings=settings)
    first._on_pins_ask = _holding(first, asks_answered)  # type: ignore[method-assign,assignment]
    try:
        await first.start()
        await a1.start()
        await eventually(lambda: _ours(first, ns) == 1)
        async with Client(settings=settings) as mesh:
            task = asyncio.ensure_future(
                mesh.request(capability=CAP, task_id="lh-other", timeout=30)
            )
            await eventually(lambda: ran.get("lh-other") == [a1.agent_id], timeout=10)
            await second.start()
            await a2.start()
            await eventually(lambda: _ours(first, ns) == 2 and _ours(second, ns) == 2, timeout=10)
            await partition(a1)
            await eventually(
                lambda: all(a1.agent_id not in h.registry.agents for h in (first, second)),
                timeout=10,
            )
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await heal(a1, beat=False)
            await _stop_routing(first)
            if not first_kept:
                await first.close()
            assert second._pins.get(ns, "lh-other") is None
            agent_found = _seeks(second, "agent")
            again = asyncio.ensure_future(
                mesh.request(capability=CAP, task_id="lh-other", timeout=20)
            )
            await _held_until_back(second, a1, ran, "lh-other", again, release)
        assert _seeks(second, "agent") == agent_found + 1
    finally:
        release.set()
        asks_answered.set()
        await second.close()
        await first.close()


async def test_an_attempt_refused_before_accepted_leaves_the_pin_on_the_holder(
    settings: MeshSettings, nats_url: str
) -> None:
    """The secure chaos run's ``partition``, seed 155: ``a1`` runs a task and is cut off until
    declared LOST; back on NATS, it is not registered yet. The caller asks again: ``a1`` says
    it holds the task but does not register within the wait, so the route goes on as new —
    to ``a2``, cut off in turn at that moment: nobody listens on its subjects, nothing ran
    there, and the pin goes back to ``a1``. ``a2`` comes back; the caller asks again: the pin
    names ``a1``, not registered, so ``a1`` is asked, says it holds the task, and the route
    waits for it to register again, then joins its run: the task ran once. Before, the
    refused attempt left the pin on ``a2``, and a pin naming a registered agent is taken as
    is: the next try ran on ``a2``, a second run."""
    ns = settings.namespace
    fleet, ran, release = two_holding(settings, "rs", CAP)
    a1, a2 = fleet.agents
    told: list[str] = []  # what the other hubs hear the task id is pinned to, in order

    async def note(msg: Msg) -> None:
        told.extend(
            agent_id for task_id, agent_id in decode_pins(msg.data) if task_id == "lh-refused"
        )

    nc = await nats.connect(nats_url)
    try:
        await nc.subscribe(protocol.hub_broadcast(ns, "pins"), cb=note)
        await flushed(nc)
        async with Hub(settings=settings) as hub, Client(settings=settings) as mesh:
            await _held_lost(hub, mesh, fleet, ran, "lh-refused", {"capability": CAP})
            holder_back = hub._holder_back
            cut: list[str] = []

            async def then_cut_a2(agent_id: str, wait: float) -> bool:
                came = await holder_back(agent_id, wait)
                if not cut:  # the first resend: a2 cut off as its route goes on as new
                    cut.append(a2.agent_id)
                    await _cut_off(a2)
                return came

            hub._holder_back = then_cut_a2  # type: ignore[method-assign]
            with pytest.raises(ReachError):
                await mesh.request(capability=CAP, task_id="lh-refused", timeout=3)
            assert cut == [a2.agent_id]
            assert ran == {"lh-refused": [a1.agent_id]}
            assert hub._pins.get(ns, "lh-refused") == a1.agent_id
            # And so at the other hubs: told a2, then a1 again.
            await eventually(lambda: a2.agent_id in told and told[-1] == a1.agent_id)
            await _back(a2)
            await eventually(
                lambda: (
                    (view := hub.registry.agents.get(a2.agent_id)) is not None
                    and view.state is AgentState.ONLINE
                ),
                timeout=10,
            )
            again = asyncio.ensure_future(
                mesh.request(capability=CAP, task_id="lh-refused", timeout=20)
            )
            await asyncio.sleep(HOLDER_WAIT + 0.5)  # a run on a2 would have started by now
            assert ran == {"lh-refused": [a1.agent_id]}
            assert not again.done()
            a1._hb_task = asyncio.create_task(a1._heartbeat_loop())  # registers again
            await eventually(lambda: a1.agent_id in hub.registry.agents, timeout=10)
            release.set()
            result = await again
        assert result.state is TaskState.SUCCEEDED and result.agent_id == a1.agent_id
        assert ran == {"lh-refused": [a1.agent_id]}
    finally:
        release.set()
        await nc.close()
        await fleet.close()


async def test_a_lost_holder_that_finished_the_task_answers_the_resend_with_its_stored_result(
    settings: MeshSettings, nats_url: str
) -> None:
    """The secure chaos run's ``partition``, seed 171: ``a1`` ran a task to the end
    (SUCCEEDED, its idempotency table holds the reply), but its answer was lost — the caller
    gave up — and a partition got ``a1`` declared LOST. Back on NATS, its registrations are
    refused (JetStream taking no writes) for longer than the route's wait. The caller asks
    again: ``a1`` says on its ctl subject that it finished the task, with the reply it stored,
    and the hub answers the caller with that copy (``cached``, ``a1``'s) at once, counted
    ``found="lost_copy"``: nothing runs again. Before, the route waited for ``a1``'s
    registration for half its time left, then ran the task again on ``a2`` (``found="lost"``).

    The copy is a result handed to a caller, so the asks' reply subjects must not be
    guessable by the agents asked (every agent may publish on hubs' reply subjects): each ends
    in 64 random bits, none under nats-py's request prefix (whose NUIDs an agent could follow
    from its own ask to the LOST holder's)."""
    ns = settings.namespace
    fleet, ran, release = two_holding(settings, "rs", CAP)
    a1, a2 = fleet.agents
    hub = Hub(settings=settings)
    refused, refusing = refusing_registrations(hub)
    asked: list[str] = []  # the reply subjects of the ctl asks about the task id

    async def note(msg: Msg) -> None:
        if b"lh-done" in msg.data:
            asked.append(msg.reply)

    nc = await nats.connect(nats_url)
    try:
        await nc.subscribe(protocol.agent_ctl(f"{ns}.rs.*"), cb=note)
        await flushed(nc)
        async with hub, Client(settings=settings) as mesh:
            await _held_lost(hub, mesh, fleet, ran, "lh-done", {"capability": CAP})
            release.set()  # a1 finishes the task: its reply to the hub reaches no caller
            await eventually(lambda: not (entry := a1._results.get("lh-done")) or not entry.running)
            entry = a1._results.get("lh-done")
            assert entry is not None and entry.state is TaskState.SUCCEEDED
            lost_found = _seeks(hub, "lost")
            refusing.set()  # and so for the whole test: a1 never registers again
            a1._hb_task = asyncio.create_task(a1._heartbeat_loop())  # told unknown: registers
            await eventually(lambda: len(refused) >= 2, timeout=10, interval=0.005)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            result = await mesh.request(capability=CAP, task_id="lh-done", timeout=4.0)
            took = loop.time() - t0
            assert a1.agent_id not in hub.registry.agents
        assert result.state is TaskState.SUCCEEDED and result.agent_id == a1.agent_id
        assert result.result == a1.agent_id and result.cached
        assert ran == {"lh-done": [a1.agent_id]}
        assert took < HOLDER_WAIT + 1.0  # no wait for the registration
        assert a2.agent_id not in ran["lh-done"]
        assert _seeks(hub, "lost") == lost_found and _seeks(hub, "lost_copy") == 1
        assert len(asked) == 2  # a2 (registered) and a1 (LOST)
        nuid_prefix = (hub.nc._resp_sub_prefix or b"").decode()
        for reply in asked:
            # Its namespace's reply subjects (hub/_reply_boxes.py): r.<ns>.<nonce>.<token>.
            assert re.fullmatch(
                rf"_INBOX\.r\.{re.escape(ns)}\.[0-9a-f]{{16}}\.[0-9a-f]{{16}}", reply
            ), reply
            assert not nuid_prefix or not reply.startswith(nuid_prefix)
        assert len(set(asked)) == 2
    finally:
        release.set()
        await nc.close()
        await fleet.close()


def _answer(**fields: Any) -> bytes:
    """An agent's ctl ``task_state`` answer: a stored ``TaskReply`` of ``rs.a1``."""
    reply = {"task_id": "t", "attempt": 1, "agent_id": "n.rs.a1", "state": "SUCCEEDED"}
    return protocol.dumps({**reply, "result": "r", **fields})


@pytest.mark.parametrize(
    ("answer", "attempt", "copied"),
    [
        (_answer(), 1, True),
        (_answer(), 3, True),  # a later attempt of a succeeded task is answered from it
        (_answer(state="TIMEOUT", attempt=2), 2, True),  # that attempt's own outcome
        (_answer(state="TIMEOUT"), 2, False),  # a later attempt runs again
        (_answer(state="FAILED", error={"code": "E", "message": "m"}), 2, False),
        (
            _answer(
                state="FAILED",
                error={"code": "E", "message": "m", "details": {"retryable": False}},
            ),
            2,
            True,  # failed for good: that failure is its outcome
        ),
        (_answer(state="RUNNING"), 1, False),
        (protocol.dumps({"task_id": "t", "attempt": 1, "state": "DELIVERED"}), 1, False),
        (_answer(agent_id="n.rs.a2"), 1, False),  # speaks for another agent
        (_answer(task_id="u"), 1, False),  # or another task
        (_answer(result="x" * 300), 1, False),  # over the size allowed: dropped unread
        (protocol.dumps({"error": {"code": "REACH_BAD_REQUEST", "message": "m"}}), 1, False),
        (b'{"task_id": "t", "attempt": "one"', 1, False),
        (b"\xff\xfe", 1, False),
    ],
)
def test_only_a_final_reply_of_the_holder_asked_that_a_copy_would_get_is_a_copy(
    answer: bytes, attempt: int, copied: bool
) -> None:
    """What a LOST holder's ``task_state`` answer must be for the hub to answer the resend
    with it: the final reply of that agent and task id that a copy of the route's attempt
    sent to it would be answered with (the agent's own rule: not run again); malformed,
    oversized, error and foreign answers are no copy (the route waits for the holder, as
    before), never an exception."""
    copy = _stored_copy(answer, "n.rs.a1", "t", attempt, 256)
    assert (copy is not None) is copied
    if copy is not None:
        assert copy.cached and copy.agent_id == "n.rs.a1" and copy.task_id == "t"


@pytest.mark.parametrize("cached", [False, True], ids=["decided", "cached_decision"])
async def test_a_direct_mode_retry_after_a_timeout_is_marked_and_answered_by_its_lost_holder(
    settings: MeshSettings, cached: bool
) -> None:
    """The secure chaos run's ``partition``, seed 184, in direct mode (the caller calls the
    agent itself): ``a1`` ran a task to the end, its answer lost in a cut, and the caller's
    request timed out (``MeshTimeoutError`` naming ``a1``). ``a1`` was cut off until declared
    LOST; back on NATS, it is not registered yet. The caller asks again: to ``a1`` first (the
    ``Client``'s pin of a task that timed out there), which the hub cannot route to (not
    registered), then by capability as asked — marked ``Reach-Resend`` like a proxy-mode
    retry, and sent to a hub even when the caller holds a decision for the capability
    (``cached_decision``: one naming ``a2``, made for another task meanwhile). The hub asks
    the agents it declared LOST lately, ``a1`` says it holds the task, and the route waits
    for ``a1`` to register again, then names it: ``a1``'s idempotency table answers from the
    reply it stored, and the task ran once. Before, the direct-mode retry went unmarked
    (or straight to the cached ``a2``) and ran again on ``a2``."""
    if cached:
        settings = settings.model_copy(update={"direct_cache_ttl": 60.0})
    fleet, ran, release = two_holding(settings, "dr", CAP)
    a1, a2 = fleet.agents
    ns = settings.namespace
    answer = a1._answer
    lost: list[bytes] = []

    async def in_the_cut(req: Any, body: bytes, headers: dict[str, str] | None) -> None:
        lost.append(body)  # (a1's answers never reach the caller)

    try:
        async with Hub(settings=settings) as hub, Client(settings=settings) as mesh:
            await a1.start()
            await eventually(lambda: _ours(hub, ns) == 1)
            first = asyncio.ensure_future(
                mesh.request(capability=CAP, task_id="dr-1", mode="direct", timeout=2.0)
            )
            await eventually(lambda: ran.get("dr-1") == [a1.agent_id], timeout=10)
            a1._answer = in_the_cut  # type: ignore[method-assign]
            release.set()  # a1 finishes the task: its answer is lost
            with pytest.raises(MeshTimeoutError) as timed_out:
                await first
            assert timed_out.value.details["agent_id"] == a1.agent_id
            assert lost
            entry = a1._results.get("dr-1")
            assert entry is not None and entry.state is TaskState.SUCCEEDED
            a1._answer = answer  # type: ignore[method-assign]
            await a2.start()
            await eventually(lambda: _ours(hub, ns) == 2, timeout=10)
            await _cut_off(a1)
            await eventually(lambda: a1.agent_id not in hub.registry.agents, timeout=10)
            if cached:
                # Another task of the caller's meanwhile: its decision (a2) is cached.
                other = await mesh.request(
                    capability=CAP, task_id="dr-other", mode="direct", timeout=5
                )
                assert other.agent_id == a2.agent_id
            await _back(a1, beat=False)  # on NATS again, not registered
            agent_found = _seeks(hub, "agent")
            again = asyncio.ensure_future(
                mesh.request(capability=CAP, task_id="dr-1", mode="direct", timeout=20)
            )
            await asyncio.sleep(HOLDER_WAIT + 0.5)  # a run on a2 would have started by now
            assert ran["dr-1"] == [a1.agent_id]
            assert not again.done()
            a1._hb_task = asyncio.create_task(a1._heartbeat_loop())  # registers again
            result = await again
        assert result.state is TaskState.SUCCEEDED and result.agent_id == a1.agent_id
        assert result.result == a1.agent_id and result.cached
        assert ran["dr-1"] == [a1.agent_id]
        assert _seeks(hub, "agent") == agent_found + 1
    finally:
        release.set()
        await fleet.close()
