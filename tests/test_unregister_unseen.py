"""An unregister answered is a registration ended, whichever hub answers it.

Before, a hub whose watch had not delivered the agent's record yet (it lagged behind the
registration another hub answered) answered ``removed: false`` and wrote nothing, and the
agent SDK asked once and went: its record stayed in ``reach_agents``, the gone agent ONLINE
and routed to on every hub until its lease and grace ran out, and a late try of its
registration was not refused. A hub with no view of the session reads the key at the stream's
leader and ends a registration of that session it finds there; the SDK asks again when a
try is unanswered (a paused hub took it) or refused "later"."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from reach_mesh import MeshSettings, protocol
from reach_mesh._kv import entry_at_leader, kv_unregistered
from reach_mesh.agent import Agent, Task
from reach_mesh.client import Client
from reach_mesh.errors import SessionEndedError, ThrottledError
from reach_mesh.hub import Hub
from reach_mesh.hub._registry_watch import RegistryWatch
from reach_mesh.hub.registry import Registry
from reach_mesh.models import AgentCard, AgentRecord, RegisterRequest, UnregisterRequest

from .helpers import eventually, register_by_hand
from .silent_hub import silent_hub


def _slow(settings: MeshSettings) -> MeshSettings:
    """No heartbeat during a test: a beat to a hub without a view would register again."""
    return settings.model_copy(
        update={"heartbeat_interval": 5.0, "lease_timeout": 15.0, "suspect_timeout": 15.0}
    )


def _agent(agent_id: str, settings: MeshSettings) -> Agent:
    agent = Agent(agent_id, settings=settings)

    @agent.handler("unseen:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    return agent


def _lagging(
    monkeypatch: pytest.MonkeyPatch, agent_id: str, up_to_date: set[int], keep: int = 0
) -> list[tuple[RegistryWatch, Any, bool]]:
    """The agents watch of every registry but those in ``up_to_date`` (ids) behind on
    ``agent_id``: the entries of that key it delivers after its first ``keep`` are held, not
    applied (a hub whose watch lags behind the others' writes). Returns the held entries."""
    apply = RegistryWatch._apply_agent
    held: list[tuple[RegistryWatch, Any, bool]] = []
    applied: dict[int, int] = {}

    def lagging(self: RegistryWatch, entry: Any, *, initial: bool) -> None:
        if entry.key == agent_id and id(self) not in up_to_date:
            applied[id(self)] = applied.get(id(self), 0) + 1
            if applied[id(self)] > keep:
                held.append((self, entry, initial))
                return
        apply(self, entry, initial=initial)

    monkeypatch.setattr(RegistryWatch, "_apply_agent", lagging)
    return held


async def _ended(nc: Any, agent_id: str) -> str | None:
    """The session the newest entry of ``agent_id``'s key (at the stream's leader) ended."""
    got = await entry_at_leader(nc.jetstream(), protocol.KV_AGENTS, agent_id)
    assert got is not None
    assert got[2], f"the record is still there: {got[0]!r}"
    return kv_unregistered(got[0])


async def test_an_unregister_answered_by_a_hub_that_has_not_seen_the_registration_ends_it(
    settings: MeshSettings, namespace: str, nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _slow(settings)
    agent_id = f"{namespace}.unseen.a1"
    agent = _agent(agent_id, s)
    async with Hub(settings=s) as first:
        await agent.start()
        await eventually(lambda: agent_id in first.registry.agents, timeout=5)
        held = _lagging(monkeypatch, agent_id, {id(first.registry)})
        behind = Hub(settings=s)
        await behind.start()
    try:
        assert held and agent_id not in behind.registry.agents
        # The only hub left, which has not seen the registration, answers the goodbye.
        await agent.close()
        assert await _ended(nc, agent_id) == agent.session
        # A try of the registration handled late (a paused hub's) is refused.
        req = RegisterRequest(
            card=agent.card(), session=agent.session, heartbeat_interval=5.0, lease_timeout=15.0
        )
        with pytest.raises(SessionEndedError):
            await behind.registry.register(req, protocol.agent_task(agent_id))
        monkeypatch.undo()
        for registry, entry, initial in held:  # the watch catches up
            registry._apply_agent(entry, initial=initial)
        assert agent_id not in behind.registry.agents
        async with Hub(settings=s) as fresh:
            assert agent_id not in fresh.registry.agents
    finally:
        await behind.close()


@pytest.mark.parametrize("view", ["none", "stale"])
async def test_a_late_unregister_of_an_old_session_leaves_the_new_one_registered(
    settings: MeshSettings,
    namespace: str,
    nc: Any,
    monkeypatch: pytest.MonkeyPatch,
    view: str,
) -> None:
    """A process's unregister answered by a hub behind — which has seen no registration of
    the id (``none``), or only that process's (``stale``) — after a new process of the id
    registered: the new registration stays (it was deleted when the hub's view was the old
    session's)."""
    s = _slow(settings)
    agent_id = f"{namespace}.unseen.b1"
    card = AgentCard(agent_id=agent_id, capabilities=["unseen:echo:v1"])
    old, new = uuid.uuid4().hex, uuid.uuid4().hex
    subject = protocol.agent_task(agent_id)

    def req(session: str) -> RegisterRequest:
        return RegisterRequest(card=card, session=session, heartbeat_interval=5, lease_timeout=15)

    async with Hub(settings=s) as first:
        keep = int(view == "stale")  # the old session's record applied, or none
        held = _lagging(monkeypatch, agent_id, {id(first.registry)}, keep=keep)
        async with Hub(settings=s) as behind:
            await first.registry.register(req(old), subject)
            if view == "stale":
                await eventually(lambda: agent_id in behind.registry.agents, timeout=5)
            await first.registry.register(req(new), subject)
            await eventually(lambda: len(held) == 2 - keep, timeout=5)  # the rest held
            seen = behind.registry.agents.get(agent_id)
            assert (seen and seen.record.session) == (old if view == "stale" else None)
            registry: Registry = behind.registry
            assert not await registry.unregister(agent_id, old)
            got = await entry_at_leader(nc.jetstream(), protocol.KV_AGENTS, agent_id)
            assert got is not None and not got[2]
            assert AgentRecord.model_validate_json(got[0]).session == new
            await asyncio.sleep(0.2)
            assert first.registry.agents[agent_id].record.session == new
            # Its own unregister ends it, from the hub behind too.
            assert await registry.unregister(agent_id, new)
            assert await _ended(nc, agent_id) == new


async def test_an_unregister_a_silent_hub_took_is_asked_of_another(
    settings: MeshSettings, namespace: str, nc: Any
) -> None:
    """The agent's goodbye given to a hub that never answers (paused, wedged) is asked again,
    and the hub that answers ends the registration (before: one try, and the agent went)."""
    s = _slow(settings)
    agent_id = f"{namespace}.unseen.c1"
    agent = _agent(agent_id, s)
    async with Hub(settings=s) as hub:
        await agent.start()
        await eventually(lambda: agent_id in hub.registry.agents, timeout=5)
    async with silent_hub(s, "unregister") as taken:  # the only hub left, for now
        closing = asyncio.create_task(agent.close())
        try:
            await eventually(lambda: bool(taken), timeout=10)
            async with Hub(settings=s) as answering:
                await asyncio.wait_for(asyncio.shield(closing), 15)
                assert await _ended(nc, agent_id) == agent.session
                await eventually(lambda: agent_id not in answering.registry.agents, timeout=5)
        finally:
            await closing
    assert taken[0] == protocol.hub_agent_subject(agent_id, "unregister")


async def test_a_repeated_unregister_is_audited_once(
    settings: MeshSettings, namespace: str, nc: Any
) -> None:
    """The agent asks its goodbye again until answered (a try answered, its answer lost, is
    asked again), and a repeat is answered ``removed`` as the first was: the audit says the
    agent left once (it said so for every repeat)."""
    s = _slow(settings)
    agent_id = f"{namespace}.unseen.d1"
    session = uuid.uuid4().hex
    card = AgentCard(agent_id=agent_id, capabilities=["unseen:echo:v1"])
    async with Hub(settings=s) as hub:
        await register_by_hand(nc, card, session=session, heartbeat_interval=5, lease_timeout=15)
        await eventually(lambda: agent_id in hub.registry.agents, timeout=5)
        bye = protocol.encode(UnregisterRequest(agent_id=agent_id, session=session))
        for _ in range(3):
            msg = await nc.request(protocol.hub_agent_subject(agent_id, "unregister"), bye, 5)
            assert protocol.loads(msg.data)["removed"] is True
        await hub.audit.flush()
        byes: list[dict[str, Any]] = []
        async with Client(settings=s) as c:

            async def stored() -> bool:
                audit = await c.audit(namespace=namespace, since=60)
                byes[:] = [
                    e for e in audit if e["kind"] == "unregister" and e["agent_id"] == agent_id
                ]
                return bool(byes)

            # Read until stored (the audit's publishes are not acked: a loaded server may
            # store one after a read right behind the flush); the repeats' events, had they
            # been audited, left in the same flush.
            await eventually(stored, timeout=10)
            await asyncio.sleep(0.3)  # (nothing more comes: one flush interval is 75 ms)
            await stored()
    assert len(byes) == 1, byes


async def test_a_throttled_unregister_is_asked_again_within_the_budget(
    settings: MeshSettings, namespace: str, nc: Any
) -> None:
    """A goodbye refused ``REACH_THROTTLED`` — "later", as the SDK's hedged tries take it —
    is asked again after its ``retry_after`` within the goodbye's 5 s (before: one try, the
    error swallowed, the agent registered until its lease ran out). No hub of this version
    throttles an unregister: this one answers its first as a hub that did would."""
    s = _slow(settings)
    agent_id = f"{namespace}.unseen.e1"
    agent = _agent(agent_id, s)
    hub = Hub(settings=s)
    tries: list[float] = []
    answer = hub._on_unregister

    async def throttling(msg: Any, ns: str) -> bytes:
        tries.append(asyncio.get_running_loop().time())
        if len(tries) == 1:
            raise ThrottledError("unregistering too fast", retry_after_ms=700)
        return await answer(msg, ns)

    hub._on_unregister = throttling  # type: ignore[method-assign]
    async with hub:
        await agent.start()
        await eventually(lambda: agent_id in hub.registry.agents, timeout=5)
        await asyncio.wait_for(agent.close(), 10)
        assert len(tries) == 2, tries
        assert tries[1] - tries[0] >= 0.7  # its retry_after, not the 0.5 s hedge
        assert await _ended(nc, agent_id) == agent.session
        await eventually(lambda: agent_id not in hub.registry.agents, timeout=5)
