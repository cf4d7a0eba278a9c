"""One valid identity, forging nothing, must not degrade the others: floods and oversized
lists of what an agent or a caller may send are absorbed by the hub (docs/security.md,
"Availability"). Against a real nats-server; the identities themselves are checked by
``test_security_nats.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._consume import PullConsumer
from reach_mesh._jspub import Ack
from reach_mesh._nats import refused_messages
from reach_mesh._nats_asking import reconnects_of
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import UnknownAgentError
from reach_mesh.hub import Hub
from reach_mesh.models import MIN_HEARTBEAT_INTERVAL, AgentState, Heartbeat
from reach_mesh.server import EmbeddedNats

from .helpers import eventually, free_port


async def _ask(nc: Any, subject: str, body: bytes) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads((await nc.request(subject, body, timeout=5)).data)
    return answer


def _register(
    agent_id: str, caps: list[str], session: str = "s1", heartbeat_interval: float = 1.0
) -> bytes:
    body = {
        "card": {"agent_id": agent_id, "capabilities": caps},
        "session": session,
        "heartbeat_interval": heartbeat_interval,
        "lease_timeout": 3.0,
    }
    return json.dumps(body).encode()


async def _goodbye(nc: Any, *agent_ids: str) -> None:
    """Unregister what a test registered by hand: later tests' hubs load the registry's KV."""
    for agent_id in agent_ids:
        bye = json.dumps({"agent_id": agent_id}).encode()
        await nc.request(protocol.hub_agent_subject(agent_id, "unregister"), bye, timeout=5)


async def _registered(nc: Any, agent_id: str, caps: list[str], interval: float = 1.0) -> None:
    body = _register(agent_id, caps, heartbeat_interval=interval)
    out = await _ask(nc, protocol.hub_agent_subject(agent_id, "register"), body)
    assert out["agent_id"] == agent_id, out


async def test_a_heartbeat_flood_is_not_a_kv_write_flood(
    hub: Hub, nats_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beats that come faster than a quarter of the agent's interval and say nothing new
    renew the lease on the hub that took them, without a KV write each."""
    agent_id = f"{namespace}.flood.a1"
    nc = await nats.connect(nats_url)
    try:
        await _registered(nc, agent_id, ["x:y:v1"])
        view = hub.registry.agents[agent_id]
        jsc = hub.registry._reads  # (a beat's KV write is an acked publish of this client)
        assert jsc is not None
        writes: list[str] = []
        publish = jsc.publish
        # This agent's beats only: agents of earlier tests on the same server may still beat.
        hb_subject = f"$KV.{protocol.KV_HEARTBEATS}.{agent_id}"

        async def counted(subject: str, body: bytes, *args: Any, **kw: Any) -> Ack:
            if subject == hb_subject:  # the real write, counted
                writes.append(subject)
            return await publish(subject, body, *args, **kw)

        monkeypatch.setattr(jsc, "publish", counted)
        beat = protocol.encode(Heartbeat(agent_id=agent_id, session="s1"))
        subject = protocol.hub_agent_subject(agent_id, "heartbeat")
        answers = await asyncio.gather(*(_ask(nc, subject, beat) for _ in range(200)))
        assert all(a.get("state") == "ONLINE" for a in answers), answers[:3]
        assert len(writes) <= 2  # 200 beats in well under 0.25 s: one write, maybe two
        # What changes routing is written at once (at most one such write per 50 ms).
        draining = protocol.encode(Heartbeat(agent_id=agent_id, session="s1", draining=True))
        await asyncio.sleep(0.06)
        before = len(writes)
        await _ask(nc, subject, draining)
        assert len(writes) == before + 1 and view.draining
        # A change right after (within 50 ms) is not dropped: it is written once the gap ends.
        await _ask(nc, subject, beat)
        assert len(writes) == before + 1 and not view.draining
        await eventually(lambda: len(writes) == before + 2, timeout=2)
        assert view.hb_written_state is not None and view.hb_written_state[0] is False
    finally:
        await _goodbye(nc, agent_id)
        await nc.close()


async def test_an_agent_choosing_a_tiny_heartbeat_interval_still_floods_no_kv_writes(
    hub: Hub, nats_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interval is the agent's to choose: one of 0.1 ms once made a quarter of it the gap
    between unchanged beats' KV writes, so a flood of its beats was a flood of writes again
    (each read by every hub's watch). Such an interval is refused now
    (``tests/test_lease_minimum.py``), and at the least one taken (0.1 s, a quarter of it
    25 ms) unchanged beats are still written at most every 50 ms."""
    agent_id = f"{namespace}.flood.a2"
    nc = await nats.connect(nats_url)
    try:
        await _registered(nc, agent_id, ["x:y:v1"], interval=MIN_HEARTBEAT_INTERVAL)
        jsc = hub.registry._reads
        assert jsc is not None
        writes: list[str] = []
        publish = jsc.publish
        hb_subject = f"$KV.{protocol.KV_HEARTBEATS}.{agent_id}"

        async def counted(subject: str, body: bytes, *args: Any, **kw: Any) -> Ack:
            if subject == hb_subject:
                writes.append(subject)
            return await publish(subject, body, *args, **kw)

        monkeypatch.setattr(jsc, "publish", counted)
        beat = protocol.encode(Heartbeat(agent_id=agent_id, session="s1"))
        subject = protocol.hub_agent_subject(agent_id, "heartbeat")
        started = time.monotonic()
        while time.monotonic() - started < 0.6:  # a flood that outlasts many quarter intervals
            answers = await asyncio.gather(*(_ask(nc, subject, beat) for _ in range(50)))
            assert all(a.get("state") == "ONLINE" for a in answers), answers[:3]
        elapsed = time.monotonic() - started
        assert len(writes) <= 2 + elapsed / 0.05, (len(writes), elapsed)
    finally:
        await _goodbye(nc, agent_id)
        await nc.close()


async def test_an_agent_registering_in_a_loop_is_throttled_alone(
    hub: Hub, settings: MeshSettings, nats_url: str, namespace: str
) -> None:
    loop_id, other_id = f"{namespace}.loop.a1", f"{namespace}.calm.a1"
    nc = await nats.connect(nats_url)
    try:
        subject = protocol.hub_agent_subject(loop_id, "register")
        codes = []
        for i in range(15):
            out = await _ask(nc, subject, _register(loop_id, ["x:y:v1"], session=f"s{i}"))
            codes.append(out["error"]["code"] if "error" in out else "OK")
        assert codes[:10] == ["OK"] * 10 and "REACH_THROTTLED" in codes[10:]
        await _registered(nc, other_id, ["x:y:v1"])  # the namespace's others are not held up
    finally:
        await _goodbye(nc, loop_id, other_id)
        await nc.close()


async def test_registrations_cannot_flood_the_audit_or_carry_huge_capabilities(
    hub: Hub, settings: MeshSettings, nats_url: str, namespace: str
) -> None:
    agent_id = f"{namespace}.wide.a1"
    nc = await nats.connect(nats_url)
    try:
        subject = protocol.hub_agent_subject(agent_id, "register")
        huge = "x:" + "a" * 5000 + ":v1"
        out = await _ask(nc, subject, _register(agent_id, [huge]))
        assert out["error"]["code"] == "REACH_BAD_CAPABILITY", out
        caps = [f"wide:c{i}:v1" for i in range(40)]
        out = await _ask(nc, subject, _register(agent_id, caps))
        assert out["agent_id"] == agent_id, out
        await hub.audit.flush()
        await hub.nc.flush()
        async with Client(settings=settings) as c:
            events = await c.audit(agent_id=agent_id, namespace=namespace)
        (event,) = [e for e in events if e["kind"] == "register"]
        assert event["capability_count"] == 40 and len(event["capabilities"]) == 16
    finally:
        await _goodbye(nc, agent_id)
        await nc.close()


async def test_reports_on_other_namespaces_agents_are_dropped(
    hub: Hub, nats_url: str, namespace: str
) -> None:
    """The open-mode half of the secure-mode test: a report published on namespace A's
    subject about an agent of namespace B changes nothing of B's agent."""
    victim = f"{namespace}v.svc.b1"
    nc = await nats.connect(nats_url)
    try:
        await _registered(nc, victim, ["b:svc:v1"])
        view = hub.registry.agents[victim]
        rejected = hub.metrics.identity_rejected_total.labels("report")
        count = rejected._value.get()
        report = {"agent_id": victim, "success": False, "code": "REACH_AGENT_BUSY"}
        for i in range(20):
            body = json.dumps({**report, "reporter": f"r{i}"}).encode()
            await nc.publish(protocol.hub_subject(namespace, "report"), body)
        await nc.flush()
        await eventually(lambda: rejected._value.get() >= count + 20)
        assert view.health.value == 100 and view.breaker.counts() == (0, 0)
    finally:
        await _goodbye(nc, victim)
        await nc.close()


def _duration_series(hub: Hub) -> dict[str, float]:
    """``reach_task_duration_seconds``'s series on ``hub``: capability -> observations."""
    return {
        s.labels["capability"]: s.value
        for m in hub.metrics.task_duration_seconds.collect()
        for s in m.samples
        if s.name.endswith("_count")
    }


async def test_capabilities_minted_past_a_bound_share_one_series(settings: MeshSettings) -> None:
    """``reach_task_duration_seconds`` gets a series per capability only up to a bound
    (``metrics_capability_series``, 64 by default; 2 here): a tenant minting capabilities
    cannot grow the hub's /metrics without end."""
    assert settings.metrics_capability_series == 64
    hub_settings = settings.model_copy(update={"metrics_capability_series": 2})
    async with Hub(settings=hub_settings) as own:
        agent = Agent(f"{settings.namespace}.mint.a1", settings=settings)
        for i in range(5):
            agent.handler(f"mint:c{i}:v1")(_echo)
        async with agent, Client(settings=settings) as c:
            await eventually(lambda: agent.agent_id in own.registry.agents)
            for i in range(5):
                assert (await c.request(capability=f"mint:c{i}:v1", payload=i)).ok
            series = _duration_series(own)
    assert series == {"mint:c0:v1": 1, "mint:c1:v1": 1, "other": 3}


async def test_a_tenant_minting_capabilities_leaves_others_their_series(
    settings: MeshSettings, namespace: str
) -> None:
    """The bound on capability series is no first-come prize: a tenant that routed to as many
    capabilities as the bound (3 here) once took every series for the hub's life, and every
    other tenant's capability was counted under ``other``. A namespace that made fewer series
    than the one that made the most takes that one's oldest now, whose observations go to
    ``other`` (the histogram's sum over series, which the dashboard reads, unchanged)."""
    hub_settings = settings.model_copy(update={"metrics_capability_series": 3})
    tenant = settings.model_copy(update={"namespace": f"{namespace}b"})
    async with Hub(settings=hub_settings) as own:
        minter = Agent(f"{namespace}.mint.a1", settings=settings)
        for i in range(5):
            minter.handler(f"mint:c{i}:v1")(_echo)
        other = Agent(f"{tenant.namespace}.work.a1", settings=tenant)
        other.handler("work:own:v1")(_echo)
        async with minter, other:
            await eventually(lambda: {minter.agent_id, other.agent_id} <= set(own.registry.agents))
            async with Client(settings=settings) as c:
                for i in range(5):
                    assert (await c.request(capability=f"mint:c{i}:v1", payload=i)).ok
            assert set(_duration_series(own)) == {"mint:c0:v1", "mint:c1:v1", "mint:c2:v1", "other"}
            async with Client(settings=tenant) as c:
                for i in range(2):
                    assert (await c.request(capability="work:own:v1", payload=i)).ok
            series = _duration_series(own)
    assert series == {"mint:c1:v1": 1, "mint:c2:v1": 1, "work:own:v1": 2, "other": 3}


async def _echo(task: Task[Any]) -> Any:
    return task.payload


async def test_an_agent_cannot_lift_an_operators_cordon_or_quarantine(
    hub: Hub, settings: MeshSettings, nats_url: str, namespace: str
) -> None:
    """With only its own subjects (all NATS lets it publish in secure mode), an agent tries to
    shed an operator's hold: it says goodbye and registers again, or registers under a new
    session. The cordon stays — on this hub and on one that starts later —, and so does the
    quarantine (its breaker is the id's, not the session's). An operator lifts a cordon
    whether the agent is registered or not; nobody cordons an id never registered."""
    agent_id = f"{namespace}.held.a1"
    register = protocol.hub_agent_subject(agent_id, "register")
    nc = await nats.connect(nats_url)
    try:
        await _registered(nc, agent_id, ["held:run:v1"])
        async with Client(settings=settings) as c:
            assert (await c.admin("cordon", agent_id, reason="disk swap"))["state"] == "CORDONED"
            bye = json.dumps({"agent_id": agent_id, "session": "s1"}).encode()
            out = await _ask(nc, protocol.hub_agent_subject(agent_id, "unregister"), bye)
            assert out["removed"] is True and agent_id not in hub.registry.agents
            for session in ("s2", "s3"):  # after the goodbye, then under a new session
                out = await _ask(nc, register, _register(agent_id, ["held:run:v1"], session))
                assert out["state"] == "CORDONED" and out["cordoned"] is True, out
            # The hubs' word to the agent on its cordon (it refuses new task ids meanwhile).
            beat = protocol.encode(Heartbeat(agent_id=agent_id, session="s3"))
            heartbeat = protocol.hub_agent_subject(agent_id, "heartbeat")
            out = await _ask(nc, heartbeat, beat)
            assert out["state"] == "CORDONED" and out["cordoned"] is True, out
            # A record written without the flag (by a hub that had not seen the cordon yet,
            # or of an earlier version): graded by the cordon all the same.
            kv = await nc.jetstream().key_value(protocol.KV_AGENTS)
            record = hub.registry.agents[agent_id].record.model_copy(update={"cordoned": False})
            revision = await kv.put(agent_id, protocol.encode(record))

            def applied() -> bool:
                return hub.registry.agents[agent_id].revision >= revision

            await eventually(applied, timeout=5)
            assert hub.registry.agents[agent_id].state is AgentState.CORDONED
            later = Hub(settings=settings)  # a hub that did not see the cordon made
            await later.start()
            try:
                assert later.registry.agents[agent_id].state is AgentState.CORDONED
            finally:
                await later.close()

            await _goodbye(nc, agent_id)
            lifted = await c.admin("uncordon", agent_id)  # not registered: lifted all the same
            assert lifted["state"] == "LOST" and agent_id not in hub.registry.cordons
            out = await _ask(nc, register, _register(agent_id, ["held:run:v1"], "s4"))
            assert out["state"] == "ONLINE" and out["cordoned"] is False, out
            beat = protocol.encode(Heartbeat(agent_id=agent_id, session="s4"))
            assert (await _ask(nc, heartbeat, beat))["cordoned"] is False
            with pytest.raises(UnknownAgentError):
                await c.admin("cordon", f"{namespace}.never.a1")

            await c.admin("quarantine", agent_id, reason="bad answers")
            view = hub.registry.agents[agent_id]
            assert view.state is AgentState.QUARANTINED
            out = await _ask(nc, register, _register(agent_id, ["held:run:v1"], "s5"))
            assert out["state"] == "QUARANTINED", out
            await _goodbye(nc, agent_id)
            out = await _ask(nc, register, _register(agent_id, ["held:run:v1"], "s6"))
            assert out["state"] == "QUARANTINED", out
            assert hub.registry.agents[agent_id].quarantines == view.quarantines  # still one
            await c.admin("release", agent_id)
            assert hub.registry.agents[agent_id].state is AgentState.ONLINE
    finally:
        await _goodbye(nc, agent_id)
        await nc.close()


async def test_an_agent_flooding_its_register_subject_spends_its_own_budget(
    settings: MeshSettings, tmp_path: Path, namespace: str
) -> None:
    """Garbage on one agent's own register subject, 40 times its namespace's registration
    rate (5 a second here), does not hold up a neighbour's registrations meanwhile: the
    sender's budget (a few in a row, then one a second) is charged first, by the identity its
    subject names, so the flood takes at most that from its namespace's."""
    server = EmbeddedNats(tmp_path, port=free_port())
    await server.astart()
    s = settings.model_copy(
        update={"nats_url": server.url, "register_rate": 5.0, "register_burst": 5.0}
    )
    flooder, neighbour = f"{namespace}.flood.a1", f"{namespace}.calm.a1"
    codes: list[str] = []
    try:
        async with Hub(settings=s):
            nc = await nats.connect(server.url)

            async def flood() -> None:
                subject = protocol.hub_agent_subject(flooder, "register")
                while True:
                    out = await _ask(nc, subject, b"not json")
                    codes.append(out["error"]["code"])
                    await asyncio.sleep(0.005)

            flooding = asyncio.create_task(flood())
            try:
                await asyncio.sleep(1.5)  # its burst spent, the namespace's refilled
                for i in range(4):
                    out = await _ask(
                        nc,
                        protocol.hub_agent_subject(neighbour, "register"),
                        _register(neighbour, ["calm:run:v1"], session=f"n{i}"),
                    )
                    assert out.get("agent_id") == neighbour, out
                    await asyncio.sleep(0.3)
            finally:
                flooding.cancel()
                await nc.close()
    finally:
        server.stop()
    assert len(codes) > 200 and set(codes) == {"REACH_BAD_REQUEST", "REACH_THROTTLED"}
    assert codes.count("REACH_BAD_REQUEST") <= 10 + 3  # its burst, then one a second


@contextlib.asynccontextmanager
async def _tight_mesh(
    tmp_path: Path, ns: str
) -> AsyncIterator[tuple[EmbeddedNats, Hub, Agent, Client]]:
    """A server holding at most 4 MiB for a connection (and messages of 1 MiB), a hub, an echo
    agent ``<ns>.echo.a1`` that answered once, and a client: where a flood the hub cannot read
    as fast gets a connection cut as a slow consumer within seconds."""
    async with EmbeddedNats(str(tmp_path), max_pending=4 << 20, max_payload=1 << 20) as server:
        settings = MeshSettings(nats_url=server.url, namespace=ns, heartbeat_interval=0.5)
        agent = Agent(f"{ns}.echo.a1", settings=settings)
        agent.handler("work:echo:v1")(_echo)
        async with Hub(settings=settings) as hub, agent, Client(settings=settings) as mesh:
            assert (await mesh.request(capability="work:echo:v1", payload=1)).result == 1
            yield server, hub, agent, mesh


async def test_a_route_flood_cut_off_as_a_slow_consumer_leaves_the_hubs_other_connection(
    tmp_path: Path,
) -> None:
    """A caller's route flood that a hub cannot read as fast: nats-server cuts the connection
    the routes come on (a slow consumer), not the one that carries heartbeats, statuses and KV
    writes — the audit of secure mode saw a hub's only connection cut twice by one caller,
    and the agents of every namespace go SUSPECT. The hub's event loop is stalled here (as a
    flood it cannot keep up with stalls it) while another thread floods; the server holds at
    most 4 MiB for a connection."""
    async with _tight_mesh(tmp_path, "flood") as (server, hub, _, mesh):
        route_nc = hub._route_nc
        assert route_nc is not None
        main, routes = reconnects_of(hub.nc), reconnects_of(route_nc)
        assert main is not None and routes is not None
        line = b"_INBOX.flood x " + json.dumps({"selector": "x" * 4000}).encode()
        batch = b"\n".join([line] * 16)  # about 64 KiB a message
        subject = protocol.hub_subject("flood", "route_batch")
        # 1,000 of them: 64 MiB, far past what the sockets hold
        flooding = _flood_from_a_thread(server.url, subject, batch, 1_000)
        time.sleep(3.0)  # noqa: ASYNC251 - the hub's loop stalled on purpose: it reads nothing
        await asyncio.to_thread(flooding.join, 60)
        await eventually(lambda: routes.count >= 1 and route_nc.is_connected, timeout=30)
        assert main.count == 0, "the flood cut the hub's main connection"
        view = hub.registry.agents["flood.echo.a1"]
        await eventually(lambda: view.state is AgentState.ONLINE, timeout=10)
        res = await mesh.request(capability="work:echo:v1", payload=2, timeout=10)
        assert res.result == 2


def _flood_from_a_thread(url: str, subject: str, body: bytes, count: int) -> threading.Thread:
    """Publish ``count`` times ``body`` on ``subject`` from a thread of its own (its own event
    loop: the test's is stalled on purpose)."""

    def flood() -> None:
        async def publish() -> None:
            nc = await nats.connect(url)
            for _ in range(count):
                await nc.publish(subject, body)
            await nc.flush(timeout=30)
            await nc.close()

        asyncio.run(publish())

    flooding = threading.Thread(target=flood)
    flooding.start()
    return flooding


async def test_a_status_flood_cut_off_as_a_slow_consumer_leaves_the_hubs_main_connection(
    tmp_path: Path,
) -> None:
    """An agent flooding its own status subject with large statuses (what a compromised
    agent may publish: the audit sent 250 of 6 MiB in 8 s and had a hub's main connection cut
    six times, and another namespace's agent went SUSPECT) outruns a hub whose loop is
    stalled: nats-server cuts the connection the statuses come on (``<hub_id>-statuses``), not
    the one that carries heartbeats and KV writes; the agent stays ONLINE."""
    async with _tight_mesh(tmp_path, "sflood") as (server, hub, agent, mesh):
        main, statuses = reconnects_of(hub.nc), reconnects_of(hub.status_nc)
        assert main is not None and statuses is not None
        event = {
            "task_id": "t1",
            "attempt": 1,
            "agent_id": agent.agent_id,
            "state": "RUNNING",
            "progress": "x" * (512 << 10),
        }
        subject = protocol.task_status(agent.agent_id, "t1")
        flooding = _flood_from_a_thread(server.url, subject, json.dumps(event).encode(), 80)
        time.sleep(3.0)  # noqa: ASYNC251 - the hub's loop stalled on purpose: it reads nothing
        await asyncio.to_thread(flooding.join, 60)
        await eventually(lambda: statuses.count + main.count >= 1, timeout=30)
        assert main.count == 0, "the status flood cut the hub's main connection"
        status_nc = hub.status_nc
        await eventually(lambda: statuses.count >= 1 and status_nc.is_connected, timeout=30)
        view = hub.registry.agents[agent.agent_id]
        await eventually(lambda: view.state is AgentState.ONLINE, timeout=10)
        assert (await mesh.request(capability="work:echo:v1", payload=2)).result == 2
        await eventually(lambda: hub.nats_connected, timeout=10)


async def test_big_submissions_are_pulled_a_few_at_a_time_not_all_at_once(
    tmp_path: Path,
) -> None:
    """Submissions of nearly the server's ``max_payload`` each (the audit's: 60 of 4 MiB,
    refused, had the hub's main connection cut as a slow consumer five times) stored while
    the hub's loop is stalled: each pull of the hub carries ``max_bytes``, so no more than
    that is on its way to it, and the hub goes on pulling past the pulls the bound ends
    (409), refusing each; its main connection is never cut and its agent stays ONLINE."""
    async with _tight_mesh(tmp_path, "bigsub") as (server, hub, agent, mesh):
        main = reconnects_of(hub.nc)
        assert main is not None and hub.workflows is not None
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        subject = protocol.wf_submit("bigsub")
        body = json.dumps({"workflow_id": "big", "steps": "x" * (900 << 10)}).encode()

        def stored() -> None:
            async def publish() -> None:
                snc = await nats.connect(server.url)
                sjs = snc.jetstream()
                for i in range(24):  # about 21 MiB, five times what the server holds
                    await sjs.publish(subject, body, headers={"Nats-Msg-Id": f"big-{i}"})
                await snc.close()

            asyncio.run(publish())

        storing = threading.Thread(target=stored)
        storing.start()
        await asyncio.to_thread(storing.join, 30)  # the pull outstanding gets them now
        time.sleep(2.0)  # noqa: ASYNC251 - the hub's loop stalled on purpose: it reads nothing

        async def left() -> int:
            messages: int = (await js.stream_info(protocol.STREAM_WF)).state.messages
            return messages

        for _ in range(100):
            if await left() == 0:
                break
            await asyncio.sleep(0.1)
        assert main.count == 0, "the submissions cut the hub's main connection"
        assert await left() == 0, "the submissions were not all pulled"
        await nc.close()
        view = hub.registry.agents[agent.agent_id]
        await eventually(lambda: view.state is AgentState.ONLINE, timeout=10)
        assert (await mesh.request(capability="work:echo:v1", payload=2)).result == 2


async def test_a_pull_carries_max_bytes_and_goes_on_past_a_delivery_it_cut_short(
    nats_url: str,
) -> None:
    """Each pull request says ``max_bytes``; when the next message does not fit in what is left
    of it, nats-server ends the pull (409 "Message Size Exceeds MaxBytes") and the consumer
    pulls again at once: every message arrives, none is held back."""
    from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

    nc, watcher = await nats.connect(nats_url), await nats.connect(nats_url)
    js = nc.jetstream()
    name = f"PULLB_{time.monotonic_ns()}"
    got: list[Any] = []
    pull = PullConsumer(nc, name, "c", got.append, 16)
    asked: list[dict[str, Any]] = []

    async def seen(msg: Any) -> None:  # the pull requests, as the server gets them
        asked.append(json.loads(msg.data))

    await watcher.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{name}.c", cb=seen)
    await watcher.flush()
    try:
        await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))
        await js.add_consumer(name, ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT))
        # Each a little over half of max_bytes: one per pull.
        big = b"x" * (nc.max_payload // 2 + 100)
        for _ in range(5):
            await js.publish(f"{name.lower()}.a", big)
        await pull.start()
        await eventually(lambda: len(got) == 5, timeout=5)
        assert asked and all(a["max_bytes"] == nc.max_payload + (16 << 10) for a in asked)
        assert len(asked) >= 3  # at most one such message a pull (two fit in none)
    finally:
        await pull.stop()
        await js.delete_stream(name)
        await nc.close()
        await watcher.close()


async def test_a_status_larger_than_any_agent_sends_is_refused_unparsed(
    hub: Hub, settings: MeshSettings, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status event over what an agent sends (a result or progress of at most
    ``max_payload``, and room for its other fields) is dropped on its length alone: counted
    as refused (``reach_messages_refused_total``), never parsed; one at the bound is read."""
    assert hub.workflows is not None
    tracker = hub.workflows._tracker
    limit = protocol.status_max(settings.max_payload, hub.nc.max_payload)
    assert tracker.max_status == limit == settings.max_payload + protocol.MESSAGE_ROOM
    parsed: list[int] = []
    parse = tracker._parse_status

    def counted(data: bytes, subject: str) -> Any:
        parsed.append(len(data))
        return parse(data, subject)

    monkeypatch.setattr(tracker, "_parse_status", counted)
    # A step this hub tracks: its statuses are parsed (a stand-in track, as the engine keeps).
    agent_id = f"{settings.namespace}.giant.a1"
    key = protocol.task_key(settings.namespace, "t-giant")
    monkeypatch.setitem(tracker._decided, key, 1)
    before = refused_messages(hub.status_nc)
    subject = protocol.task_status(agent_id, "t-giant")
    head = {"task_id": "t-giant", "attempt": 2, "agent_id": agent_id, "state": "SUCCEEDED"}
    fits = json.dumps({**head, "result": "x" * (limit - 200)}).encode()
    giant = json.dumps({**head, "result": "x" * (limit + 1)}).encode()
    assert len(fits) <= limit < len(giant)
    nc = await nats.connect(nats_url)
    try:
        for _ in range(3):
            await nc.publish(subject, giant)
        await nc.publish(subject, fits)
        await nc.flush()
        await eventually(lambda: parsed == [len(fits)], timeout=5)
    finally:
        await nc.close()
    assert refused_messages(hub.status_nc) == before + 3
    metrics = hub.metrics.render().decode()
    own = sum(refused_messages(c) for c in hub._connections.values() if c is not None)
    assert f"reach_messages_refused_total {float(own)}" in metrics
