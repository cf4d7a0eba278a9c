"""A route request sent again (``Reach-Resend: 1``) reaching a hub that holds no pin for its
task id: the hub asks the other hubs and the agents who has it before it chooses, and the task
runs once (``hub/_holders.py``, docs/protocol.md "Resends").

The race it closes (the secure chaos run's ``node_kill``): a caller back on NATS asks again at
once, and its request reaches a hub whose own connection is coming back at the same moment,
before the other hubs answered its pins ask. Here that ask is held for as long as the test
needs (not a sleep that hopes to lose the race)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, Step, TaskState, protocol
from reach_mesh._guard import guarded
from reach_mesh._nats import flushed
from reach_mesh.agent import Agent, Task
from reach_mesh.agent._agent import _AGENT_QUEUE
from reach_mesh.errors import BadRequestError
from reach_mesh.hub import Hub
from reach_mesh.hub._holders import HOLDER_WAIT, resend_marked
from reach_mesh.hub.breaker import DEAF, BreakerState
from reach_mesh.models import AgentState, CordonRecord
from reach_mesh.tracing.metrics import RESEND_FOUND

from .helpers import (
    Fleet,
    echo_agent,
    eventually,
    relayed,
    two_holding,
)

pytestmark = pytest.mark.timeout(60)

CAP = "resend:slow:v1"


def _ours(hub: Hub, ns: str) -> int:
    return sum(1 for agent_id in hub.registry.agents if agent_id.startswith(f"{ns}."))


def _holding(hub: Hub, held: asyncio.Event) -> Callable[[Msg], Coroutine[Any, Any, None]]:
    """``hub``'s answer to the other hubs' pins asks, held until ``held`` is set."""
    answer = hub._on_pins_ask

    async def on_pins_ask(msg: Msg) -> None:
        await held.wait()
        await answer(msg)

    return on_pins_ask


def _routed(hub: Hub) -> set[str]:
    """The task ids of the routes ``hub`` has sent to an agent and waits on (a copy of a task
    sent again is a route of its own)."""
    return {flight.task_id for flight in hub._flights.values()}


def _seeks(hub: Hub, found: str) -> float:
    """``reach_resend_seek_total{found=...}`` of ``hub``."""
    value = hub.metrics.registry.get_sample_value("reach_resend_seek_total", {"found": found})
    assert value is not None
    return value


async def _stop_routing(hub: Hub) -> None:
    """``hub`` takes no more route requests (its flights go on): what the caller sends again
    reaches the other hub."""
    for sub in list(hub._subs):
        if sub.subject.endswith((".route", ".route_batch")):
            await sub.unsubscribe()
            hub._subs.remove(sub)
    for nc in (hub._route_nc, hub._nc):  # the server has the UNSUBs before the caller asks
        if nc is not None:
            await flushed(nc)


@pytest.mark.parametrize("pin_kept", [True, False], ids=["hub_knows", "hub_gone"])
async def test_a_resend_reaching_a_hub_without_its_pin_goes_to_the_agent_that_has_it(
    settings: MeshSettings, nats_url: str, pin_kept: bool
) -> None:
    """Four tasks routed by ``first`` to ``a1`` while ``away`` was cut off; ``a2`` joins (no
    load: the one a new route would go to). ``away`` comes back; ``first`` holds its answer to
    ``away``'s pins ask, and takes no more routes. The caller, cut off and back, asks again:
    its requests reach ``away``, which has no pin for them — it asks who has them (``first``
    answers ``pin_of``, or, ``first`` gone, ``a1`` answers ``task_state``) and sends each to
    ``a1``, whose idempotency table joins the run in hand: each ran once. Before, ``away``
    sent them to ``a2``, and they ran twice."""
    ns = settings.namespace
    asks_answered = asyncio.Event()
    fleet, ran, release = two_holding(settings, "rs", CAP)
    a1, a2 = fleet.agents
    hub_relay, hub_through = await relayed(nats_url, settings)
    caller_relay, caller_through = await relayed(nats_url, settings)
    first = Hub(settings=settings)
    first._on_pins_ask = _holding(first, asks_answered)  # type: ignore[method-assign,assignment]
    try:
        async with Hub(settings=hub_through) as away:
            await first.start()
            await a1.start()
            await eventually(lambda: _ours(first, ns) == 1 and _ours(away, ns) == 1)
            await hub_relay.cut()
            await eventually(lambda: not away.nats_connected)
            async with Client(settings=caller_through) as mesh:
                tries = [
                    asyncio.ensure_future(
                        mesh.request(capability=CAP, task_id=f"rs-{n}", timeout=20)
                    )
                    for n in range(4)
                ]
                await eventually(lambda: len(ran) == 4, timeout=10)
                await a2.start()
                await hub_relay.start()
                await eventually(lambda: away.nats_connected and _ours(away, ns) == 2, timeout=10)
                assert not any(away._pins.get(ns, f"rs-{n}") for n in range(4))  # ask held
                await _stop_routing(first)
                if not pin_kept:
                    # Its flights end REACH_UNAVAILABLE: the caller asks again (marked) too.
                    await first.close()
                await caller_relay.cut()
                await eventually(lambda: not mesh.nc.is_connected)
                await caller_relay.start()
                await eventually(lambda: mesh.nc.is_connected, timeout=10)
                # Every task asked again has been routed by ``away`` (to whichever agent), and
                # no copy is still sought: by task id, not flights — ``first`` gone, a task may
                # reach ``away`` twice (the caller's retry after REACH_UNAVAILABLE, out before
                # the cut, and the same request asked again after the reconnection).
                await eventually(
                    lambda: _routed(away) == {f"rs-{n}" for n in range(4)} and not away._seeking,
                    timeout=10,
                )
                await asyncio.sleep(0.2)  # a run on another agent would have started by now
                assert {task_id: len(agents) for task_id, agents in ran.items()} == {
                    f"rs-{n}": 1 for n in range(4)
                }
                release.set()
                results = await asyncio.gather(*tries)
            assert [r.state for r in results] == [TaskState.SUCCEEDED] * 4
            assert {r.agent_id for r in results} == {a1.agent_id}
            assert all(agents == [a1.agent_id] for agents in ran.values())
            # What each seek found, on /metrics: never nobody.
            seeks = {found: _seeks(away, found) for found in RESEND_FOUND}
            assert seeks["nobody"] == seeks["skipped"] == 0
            assert seeks["hub"] + seeks["agent"] + seeks["pin"] >= 4, seeks
            if not pin_kept:
                assert seeks["hub"] == 0
    finally:
        release.set()
        asks_answered.set()
        await first.close()
        await hub_relay.cut()
        await caller_relay.cut()
        await fleet.close()


async def test_a_resend_nobody_holds_is_routed_as_new_once_the_ask_is_over(
    hub: Hub, settings: MeshSettings, nats_url: str
) -> None:
    """A marked resend whose first send never reached an agent: nobody claims it, so the hub
    routes it as new once ``HOLDER_WAIT`` is over (not at once when the agents say no: another
    copy may be on its way through another hub); an unmarked request asks nobody, nor does a
    marked one whose pin the hub has."""
    fleet = Fleet(settings)
    agent = fleet.agent("rs.solo")
    asked: list[str] = []

    @agent.handler(CAP)
    async def run(task: Task[Any]) -> str:
        return task.task_id

    nc = await nats.connect(nats_url)
    try:
        await agent.start()
        await eventually(lambda: _ours(hub, settings.namespace) == 1)

        async def note(msg: Msg) -> None:
            asked.append(msg.subject)

        nobody = _seeks(hub, "nobody")
        await nc.subscribe(protocol.hub_broadcast(settings.namespace, "pin_of"), cb=note)
        body = protocol.dumps({"capability": CAP, "task_id": "rs-new", "timeout": 5})
        route = protocol.hub_subject(settings.namespace, "route")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reply = await nc.request(route, body, timeout=5, headers={protocol.HDR_RESEND: "1"})
        took = loop.time() - t0
        answer = protocol.loads_object(reply.data)
        assert answer["task"]["state"] == TaskState.SUCCEEDED
        assert answer["task"].get("cached", False) is False
        assert HOLDER_WAIT * 0.9 <= took < HOLDER_WAIT + 1.0
        await eventually(lambda: len(asked) == 1)
        assert _seeks(hub, "nobody") == nobody + 1
        # Unmarked: nobody is asked.
        body = protocol.dumps({"capability": CAP, "task_id": "rs-plain", "timeout": 5})
        reply = await nc.request(route, body, timeout=5)
        assert protocol.loads_object(reply.data)["task"]["state"] == TaskState.SUCCEEDED
        await asyncio.sleep(0.1)
        assert len(asked) == 1
        # Marked again, now that ``hub`` holds its pin: nobody is asked either, nor waited for.
        body = protocol.dumps({"capability": CAP, "task_id": "rs-new", "timeout": 5})
        t0 = loop.time()
        reply = await nc.request(route, body, timeout=5, headers={protocol.HDR_RESEND: "1"})
        assert loop.time() - t0 < HOLDER_WAIT
        assert protocol.loads_object(reply.data)["task"]["cached"] is True
        await asyncio.sleep(0.1)
        assert len(asked) == 1
        assert _seeks(hub, "nobody") == nobody + 1  # (no seek: counted nowhere)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
        await fleet.close()


async def test_a_resend_waits_for_the_copy_another_hub_routes_at_the_same_moment(
    settings: MeshSettings,
) -> None:
    """Two copies of one request at once: nats-py sends on reconnecting what it had buffered
    while its connection was already dead, and the ``Client`` asks again, marked. The marked
    copy reaches ``seeker`` first: nobody has the task yet, and both agents say so. Then the
    unmarked one reaches ``router``, which sends it to ``a2`` (``a1`` is quarantined in its
    view), and whose pins message tells ``seeker``: the marked copy goes to ``a2`` too, and
    the task runs once. Before, ``seeker`` routed it as soon as both agents said no — to
    ``a1``, the less loaded in its view — and it ran on both (the secure chaos run's
    ``node_kill``, seeds 202 and 203). ``router`` hears no pins here: ``seeker``'s would
    otherwise send its copy after the first."""
    ns = settings.namespace
    learned = asyncio.Event()
    states: list[str] = []
    fleet, ran, release = two_holding(settings, "rs", CAP)
    for agent in fleet.agents:
        answer = agent._task_state

        def noted(body: dict[str, Any], answer: Callable[..., bytes] = answer) -> bytes:
            states.append(str(body.get("task_id")))
            return answer(body)

        agent._task_state = noted  # type: ignore[method-assign]
    a1, a2 = fleet.agents
    router = Hub(settings=settings)
    router._on_pins = _holding(router, learned)  # type: ignore[method-assign,assignment]
    seeker = Hub(settings=settings)
    try:
        await router.start()
        await seeker.start()
        for agent in fleet.agents:
            await agent.start()
        await eventually(lambda: _ours(router, ns) == 2 and _ours(seeker, ns) == 2)
        # ``a2`` busier than ``a1`` in ``seeker``'s view; ``a1`` quarantined in ``router``'s.
        busy = asyncio.ensure_future(
            seeker.route(
                protocol.dumps({"agent_id": a2.agent_id, "capability": CAP, "task_id": "rs-busy"}),
                ns,
            )
        )
        await eventually(lambda: "rs-busy" in ran)
        quarantined = router.registry.agents[a1.agent_id]
        quarantined.breaker.trip()
        router.registry.regrade(quarantined)
        assert quarantined.state is AgentState.QUARANTINED
        body = protocol.dumps({"capability": CAP, "task_id": "rs-twice", "timeout": 10})
        marked = asyncio.ensure_future(seeker.route(body, ns, {protocol.HDR_RESEND: "1"}))
        # Both agents said they do not have it (or, before, it was routed at once).
        await eventually(lambda: states.count("rs-twice") == 2 or "rs-twice" in ran)
        plain = asyncio.ensure_future(router.route(body, ns, None))
        await eventually(lambda: getattr(seeker, "_seeking", 0) == 0, timeout=5)
        await eventually(lambda: len(seeker._flights) == 2)  # both routes out
        await asyncio.sleep(0.2)  # a second run would have started by now
        assert ran["rs-twice"] == [a2.agent_id]
        release.set()
        answers = [protocol.loads_object(a)["task"] for a in await asyncio.gather(marked, plain)]
        assert {a["agent_id"] for a in answers} == {a2.agent_id}
        assert sorted(a.get("cached", False) for a in answers) == [False, True]
        await busy
    finally:
        release.set()
        learned.set()
        await seeker.close()
        await router.close()
        await fleet.close()


@pytest.mark.parametrize("value", ["yes", "2", "", "1;1", "0"])
async def test_a_malformed_resend_header_is_a_bad_request(
    hub: Hub, settings: MeshSettings, nats_url: str, value: str
) -> None:
    """Anything but ``1`` in ``Reach-Resend`` is answered ``REACH_BAD_REQUEST`` naming the
    header; the hub goes on routing."""
    with pytest.raises(BadRequestError):
        resend_marked({protocol.HDR_RESEND: value})
    nc = await nats.connect(nats_url)
    try:
        body = protocol.dumps({"capability": CAP, "task_id": "rs-bad", "timeout": 1})
        route = protocol.hub_subject(settings.namespace, "route")
        reply = await nc.request(route, body, timeout=5, headers={protocol.HDR_RESEND: value})
        error = protocol.loads_object(reply.data)["error"]
        assert error["code"] == "REACH_BAD_REQUEST"
        assert protocol.HDR_RESEND in error["message"]
        assert error["details"]["field"] == protocol.HDR_RESEND
        assert hub.nats_connected
    finally:
        await nc.close()


async def test_a_hub_answers_pin_of_only_for_the_pins_it_has(
    hub: Hub, settings: MeshSettings, nats_url: str
) -> None:
    """``reach.hubs.<ns>.pin_of``: the agent a task id went to, from a hub that has its pin;
    silence from one that has none, and for a malformed task id."""
    ns = settings.namespace
    hub._pins.learn(ns, [("rs-known", f"{ns}.rs.a1")])
    nc = await nats.connect(nats_url)
    try:
        subject = protocol.hub_broadcast(ns, "pin_of")
        other = {"Reach-Hub": "another-hub"}
        reply = await nc.request(subject, b"rs-known", timeout=2, headers=other)
        assert reply.data == f"{ns}.rs.a1".encode()
        for asked in (b"rs-unknown", b"not a task id!"):
            with pytest.raises(nats.errors.TimeoutError):
                await nc.request(subject, asked, timeout=0.3, headers=other)
        with pytest.raises(nats.errors.TimeoutError):  # its own question: not answered
            await nc.request(subject, b"rs-known", timeout=0.3, headers={"Reach-Hub": hub.hub_id})
    finally:
        await nc.close()


async def test_an_agent_asked_for_a_resent_route_counts_request_reply_tasks_only(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, nats_url: str
) -> None:
    """ctl ``task_state`` with ``route: true`` (a hub seeking a resent route's holder): a
    request-reply task of the id is held; a workflow's step of the same id is not — a resend
    naming it must not be sent to that step's agent."""
    agent = echo_agent(fleet, "rs.wf", "wf:rs:v1")
    await agent.start()
    ctl = protocol.agent_ctl(agent.agent_id)
    async with Client(settings=wf_settings) as mesh:
        done = await mesh.fanout(
            [Step(capability="wf:rs:v1", payload="x", task_id="rs-step")], timeout=10
        )
        assert done.state is TaskState.SUCCEEDED
        await mesh.request(capability="wf:rs:v1", payload="y", task_id="rs-route")
    nc = await nats.connect(nats_url)
    try:

        async def state(task_id: str, **extra: Any) -> dict[str, Any]:
            body = protocol.dumps({"op": "task_state", "task_id": task_id, **extra})
            return protocol.loads_object((await nc.request(ctl, body, timeout=2)).data)

        assert (await state("rs-route", route=True))["state"] == TaskState.SUCCEEDED
        assert (await state("rs-step"))["state"] == TaskState.SUCCEEDED  # as before
        assert await state("rs-step", route=True) == {
            "task_id": "rs-step",
            "state": TaskState.PENDING,
        }
        assert (await state("rs-none", route=True))["state"] == TaskState.PENDING
    finally:
        await nc.close()


@pytest.mark.parametrize("restarted", [False, True], ids=["same-client", "restarted-caller"])
async def test_a_callers_own_retry_of_a_task_id_is_marked(
    settings: MeshSettings, nats_url: str, restarted: bool
) -> None:
    """The caller itself asks again with the same ``task_id`` (its first request's answer
    lost — here, the request cancelled — as the README tells it to) and the retry reaches a hub
    that never heard the pin of the first send (lost in a partition: here, its pins ask held
    and the pins messages ignored). The ``Client`` marks it (it asked that id before), so that
    hub asks who has it (``first`` answers ``pin_of``) and the task runs once. Before, unmarked,
    it went to the idle agent and ran twice (the secure chaos run, seed 151, ``partition``: a
    route asked again by its caller 13 s later ran on a second agent). A caller that
    restarted has a new ``Client``, which never asked the id: it says so (``resend=True``)."""
    ns = settings.namespace
    fleet, ran, release = two_holding(settings, "rs", CAP)
    a1, a2 = fleet.agents
    asks_answered = asyncio.Event()
    first = Hub(settings=settings)
    first._on_pins_ask = _holding(first, asks_answered)  # type: ignore[method-assign,assignment]
    second = Hub(settings=settings)

    async def deaf(msg: Msg) -> None:
        """(the pins messages of ``first`` lost)"""

    second._on_pins = deaf  # type: ignore[method-assign]
    try:
        await first.start()
        await a1.start()
        async with Client(settings=settings) as mesh, contextlib.AsyncExitStack() as stack:
            await eventually(lambda: _ours(first, ns) == 1)
            one = asyncio.ensure_future(mesh.request(capability=CAP, task_id="own-1", timeout=20))
            await eventually(lambda: ran.get("own-1") == [a1.agent_id], timeout=10)
            one.cancel()  # (its answer lost, for the caller)
            with contextlib.suppress(asyncio.CancelledError):
                await one
            await second.start()
            await a2.start()
            await eventually(lambda: _ours(second, ns) == 2 and _ours(first, ns) == 2)
            assert second._pins.get(ns, "own-1") is None
            # ``a1`` busy with it in ``second``'s view: a new route would go to ``a2``.
            await eventually(lambda: second.registry.agents[a1.agent_id].busy == 1, timeout=10)
            await _stop_routing(first)
            if restarted:
                later = await stack.enter_async_context(Client(settings=settings))
                retry = later.request(capability=CAP, task_id="own-1", timeout=20, resend=True)
            else:
                retry = mesh.request(capability=CAP, task_id="own-1", timeout=20)
            again = asyncio.ensure_future(retry)
            await eventually(lambda: len(second._flights) == 1, timeout=10)
            await asyncio.sleep(HOLDER_WAIT + 0.3)  # a run on a2 would have started by now
            assert ran == {"own-1": [a1.agent_id]}
            release.set()
            result = await again
        assert result.state is TaskState.SUCCEEDED and result.agent_id == a1.agent_id
    finally:
        release.set()
        asks_answered.set()
        await second.close()
        await first.close()
        await fleet.close()


async def test_a_resend_without_a_task_id_is_a_bad_request(
    settings: MeshSettings, nats_url: str
) -> None:
    """``resend=True`` says the task id was asked before: without one it means nothing, and
    is refused before anything is sent."""
    async with Client(settings=settings) as mesh:
        with pytest.raises(BadRequestError) as err:
            await mesh.request(capability=CAP, payload=1, resend=True)
    assert err.value.details == {"field": "resend"}


def _served_subjects(agent: Agent) -> tuple[str, ...]:
    """The subjects ``agent`` is sent tasks and ctl requests on."""
    aid = agent.agent_id
    return (protocol.agent_task(aid), protocol.agent_batch(aid), protocol.agent_ctl(aid))


async def _cut_off(agent: Agent) -> None:
    """``agent`` cut off (a partition): no heartbeats, nobody listening on its subjects."""
    assert agent._hb_task is not None
    agent._hb_task.cancel()
    served = _served_subjects(agent)
    for sub in [s for s in agent._subs if s.subject in served]:
        await sub.unsubscribe()
        agent._subs.remove(sub)
    await flushed(agent.nc)


async def _back(agent: Agent, *, beat: bool = True) -> None:
    """Undo :func:`_cut_off`: subscribed again, then (``beat``) heartbeating (registering
    again)."""
    task, batch, ctl = _served_subjects(agent)
    for subject, on_msg, queue in (
        (task, agent._on_task, _AGENT_QUEUE),
        (batch, agent._on_batch, _AGENT_QUEUE),
        (ctl, agent._on_ctl, None),
    ):
        cb = guarded(subject, on_msg)
        if queue is None:
            agent._subs.append(await agent.nc.subscribe(subject, cb=cb))
        else:
            agent._subs.append(
                await agent.nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=-1)
            )
    await flushed(agent.nc)
    if beat:
        agent._hb_task = asyncio.create_task(agent._heartbeat_loop())


@pytest.mark.parametrize(
    "breaker", ["open", "half_open", "draining", "cordoned", "deaf", "deaf_named"]
)
async def test_a_resend_goes_to_its_holder_quarantined_by_the_hub_it_reaches(
    settings: MeshSettings, breaker: str
) -> None:
    """The secure chaos run's ``node_kill``, seed 158: ``first`` routes a task to ``a1``,
    which runs it; the caller's answer is lost with its connection, and it asks again,
    marked. The resend reaches ``second``, which has the pin (``first``'s pins message) but
    whose breaker quarantined ``a1`` earlier (breakers are each hub's own), or is half-open
    with its probe out. The retry joins ``a1``'s run: a retry of a task the agent holds is no
    new work, its idempotency table answers. Before, the breaker kept ``a1`` out of the
    holder's route, and the task ran again on ``a2``. The same for a holder ``second`` sees
    draining, or that an operator cordoned: each keeps new work from it, not this retry.

    And a holder ``second`` found deaf (chaos secure seed 198, ``partition``: taken for deaf
    while it was cut off), which answers on its ctl subject now: it is not deaf, so the
    retry goes to it — marked by capability, or naming it with ``after_attempt`` (the
    ``Client``'s pin after ``REACH_TIMEOUT``; ``deaf_named``). Before, the deaf verdict kept
    it out of its own task's retry (``REACH_NO_MATCH`` for the named one), and the task ran
    again on another agent."""
    ns = settings.namespace
    fleet, ran, release = two_holding(settings, "qh", CAP)
    a1, a2 = fleet.agents
    first = Hub(settings=settings)
    second = Hub(settings=settings)
    try:
        await first.start()
        await second.start()
        await a1.start()
        await eventually(lambda: _ours(first, ns) == 1 and _ours(second, ns) == 1)
        body = protocol.dumps({"capability": CAP, "task_id": "qh-held", "timeout": 10})
        routed = asyncio.ensure_future(first.route(body, ns, None))
        await eventually(lambda: "qh-held" in ran)
        await a2.start()
        await eventually(lambda: _ours(first, ns) == 2 and _ours(second, ns) == 2)
        await eventually(lambda: second._pins.get(ns, "qh-held") == a1.agent_id)
        view = second.registry.agents[a1.agent_id]
        if breaker == "draining":
            view.draining = True  # (as its draining heartbeat says)
        elif breaker == "cordoned":
            cordon = CordonRecord(reason="test", cordoned_at=time.time())
            view = await second.registry.set_cordon(a1.agent_id, cordon) or view
        elif breaker.startswith("deaf"):
            view.breaker.trip(DEAF)
        else:
            view.breaker.trip()
        if breaker == "half_open":
            view.breaker._opened_at -= view.breaker.open_timeout
            assert view.breaker.allow()  # its probe out
        second.registry.regrade(view)
        assert (
            view.state
            is {
                "open": AgentState.QUARANTINED,
                "half_open": AgentState.ONLINE,
                "draining": AgentState.DRAINING,
                "cordoned": AgentState.CORDONED,
                "deaf": AgentState.QUARANTINED,
                "deaf_named": AgentState.QUARANTINED,
            }[breaker]
        )
        again = body
        if breaker == "deaf_named":
            again = protocol.dumps(
                {
                    "agent_id": a1.agent_id,
                    "capability": CAP,
                    "task_id": "qh-held",
                    "after_attempt": 1,
                    "timeout": 10,
                }
            )
        resent = asyncio.ensure_future(second.route(again, ns, {protocol.HDR_RESEND: "1"}))
        await eventually(lambda: len(second._flights) == 1)
        await asyncio.sleep(0.2)  # a run on a2 would have started by now
        assert ran == {"qh-held": [a1.agent_id]}
        release.set()
        answers = [protocol.loads_object(a)["task"] for a in await asyncio.gather(routed, resent)]
        assert [a["agent_id"] for a in answers] == [a1.agent_id, a1.agent_id]
        assert [a.get("cached", False) for a in answers] == [False, True]
        assert ran == {"qh-held": [a1.agent_id]}
        # The answer from its table is no probe's verdict: the breaker is as it was (found
        # deaf, closed: it answered on its ctl subject).
        assert view.breaker.state is {
            "open": BreakerState.OPEN,
            "half_open": BreakerState.HALF_OPEN,
        }.get(breaker, BreakerState.CLOSED)
    finally:
        release.set()
        await second.close()
        await first.close()
        await fleet.close()


async def test_one_namespace_marking_every_route_leaves_the_others_resends_their_seeks(
    hub: Hub, settings: MeshSettings, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub seeks the holders of ``HOLDER_SEEKS_MOST`` resends at once, each waiting up to
    ``HOLDER_WAIT`` when nobody claims the task; beyond, a resend is routed unmarked (it may
    run twice). A caller marking every route it sends (new task ids: no pins) held them all,
    and another tenant's resends after a reconnection were routed unmarked. One namespace
    holds ``HOLDER_SEEKS_PER_NAMESPACE`` of them; the other's resend is still sought."""
    from reach_mesh.hub._holders import HOLDER_SEEKS_MOST, HOLDER_SEEKS_PER_NAMESPACE

    release = asyncio.Event()
    sought: list[str] = []

    async def slow_seek(ns: str, task_id: str, *args: Any) -> tuple[None, None]:
        sought.append(ns)
        await release.wait()
        return None, None

    monkeypatch.setattr(hub, "_seek_holder", slow_seek)
    flooder, other = settings.namespace, f"{settings.namespace}x"
    # A namespace the hub knows (a route to one it does not is answered at once).
    idle = Agent(f"{other}.idle.a1", settings=settings, durable_work=False)
    idle.handler("idle:work:v1")(_idle)
    marked = {protocol.HDR_RESEND: "1"}
    nc = await nats.connect(nats_url)
    try:
        await idle.start()
        await eventually(lambda: _ours(hub, other) == 1)
        # Before the flood: read after it, the count may already hold the skipped ones.
        skipped = _seeks(hub, "skipped")
        for i in range(HOLDER_SEEKS_MOST):
            body = protocol.dumps({"capability": CAP, "task_id": f"flood-{i}", "timeout": 5})
            await nc.publish(protocol.hub_subject(flooder, "route"), body, headers=marked)
        await nc.flush()
        await eventually(lambda: _seeks(hub, "skipped") - skipped + len(sought) >= 200)
        body = protocol.dumps({"capability": CAP, "task_id": "mine", "timeout": 5})
        asked = asyncio.ensure_future(
            nc.request(protocol.hub_subject(other, "route"), body, timeout=5, headers=marked)
        )
        await eventually(lambda: other in sought, timeout=3)
        assert sought.count(flooder) == HOLDER_SEEKS_PER_NAMESPACE
        release.set()
        assert "error" in protocol.loads_object((await asked).data)  # (nobody serves CAP)
    finally:
        release.set()
        await nc.close()
        await idle.close()


async def _idle(task: Task[Any]) -> None:
    return None
