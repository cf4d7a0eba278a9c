"""An agent back from a silence of a lease or more reads its steps' fences only once the task
records' stream leader says every replica has caught up with it, on a real 3-node nats-server
cluster.

Chaos secure seed 174, ``partition``: agent a1 and node n2 were cut off from the rest for 8.7 s.
Meanwhile the hub on the other side declared a1 LOST, gave attempt 1 of ``chaos-174-00474-n0``
up (its record at attempt 2, a fence marker stored) and sent attempt 2 elsewhere. After the heal
a hub that had been cut off with a1, its registry behind the delete, answered a1's heartbeats
— so a1 was "in touch" again — and a1 read the step's record by a direct get, answered by
n2's replica, still at attempt 1: the records' stream had no leader (4.5 s), n2 could not catch
up. Attempt 1 ran, 2.4 s after attempt 2 had.

Here the agent is connected to n2 only; what answers its registration and heartbeats is on
n2's side too (a hub whose view lags). The step's work message reaches the agent while it is out
of touch; the heartbeat it sends before reading the fence is held until n2 is cut off and the
record is at attempt 2 on the other side, then answered. Read at n2's replica, the record says
attempt 1, and the step ran. Now the agent is wary: it reads the record only once the stream's
leader, having heard from its replicas lately, says they all caught up with it — no leader
answers on its side — so the step waits unrun, and is dropped once the cluster heals, while a
current step still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.api import ClusterInfo, PeerInfo

from reach_mesh import MeshSettings, protocol
from reach_mesh._kv import not_caught_up
from reach_mesh.agent import Agent, Task
from reach_mesh.models import (
    AgentState,
    Heartbeat,
    HeartbeatReply,
    RegisterReply,
    RegisterRequest,
    TaskEnvelope,
)
from reach_mesh.server import EmbeddedNats
from reach_mesh.workflow import TaskRecord

from .helpers import Relay, cluster_nodes, eventually
from .test_cluster import _js_ready

# Clusters of nats-servers: one at a time, on one of `make test`'s workers.
pytestmark = [pytest.mark.xdist_group("clusters"), pytest.mark.timeout(90)]

_NS = "wy"
_CAP = "wy:step:v1"
_TASKS = f"KV_{protocol.KV_TASKS}"


class _SideHub:
    """What answers an agent's registration and heartbeats on its side of a partition, as a hub
    whose registry has not seen the agent declared LOST does: ONLINE. Heartbeats are held
    unanswered while ``answering`` is clear (``held``)."""

    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        self.answering = True
        self.held: list[Msg] = []

    async def on_register(self, msg: Msg) -> None:
        req = RegisterRequest.model_validate_json(msg.data)
        s = self.settings
        reply = RegisterReply(
            agent_id=req.card.agent_id,
            session=req.session,
            state=AgentState.ONLINE,
            heartbeat_interval=s.heartbeat_interval,
            lease_timeout=s.lease_timeout,
            suspect_timeout=s.suspect_timeout,
            hub_id="side-hub",
        )
        await msg.respond(protocol.encode(reply))

    async def on_beat(self, msg: Msg) -> None:
        Heartbeat.model_validate_json(msg.data)
        if self.answering:
            await self.answer(msg)
        else:
            self.held.append(msg)

    async def answer(self, msg: Msg) -> None:
        reply = HeartbeatReply(state=AgentState.ONLINE, lease_timeout=self.settings.lease_timeout)
        await msg.respond(protocol.encode(reply))


def _record(task_id: str, attempt: int, agent_id: str) -> bytes:
    return protocol.encode(
        TaskRecord(
            task_id=task_id,
            workflow_id=f"{task_id}-wf",
            step=0,
            namespace=_NS,
            attempt=attempt,
            agent_id=agent_id,
        )
    )


async def _send_step(js: Any, kv: Any, task_id: str, agent_id: str) -> None:
    """Attempt 1 of a step for ``agent_id``: its record (left as it is with ``kv`` None),
    then its work message."""
    if kv is not None:
        await kv.put(protocol.task_key(_NS, task_id), _record(task_id, 1, agent_id))
    env = TaskEnvelope(
        task_id=task_id,
        capability=_CAP,
        namespace=_NS,
        workflow_id=f"{task_id}-wf",
        step=0,
    )
    await js.publish(
        protocol.work_subject(_NS, agent_id),
        protocol.encode(env),
        headers={protocol.HDR_MSG_ID: protocol.attempt_msg_id(_NS, task_id, 1)},
    )


async def test_an_agent_back_from_a_long_silence_reads_no_fence_a_replica_behind_answers(
    tmp_path: Path,
) -> None:
    relays: dict[tuple[int, int], Relay] = {}
    # The agent knows n2 alone (nothing advertised): cut off, it has no other server to go to
    # and stays (one that knows another leaves: tests/test_cut_off_nodes.py).
    nodes: list[EmbeddedNats] = cluster_nodes(
        tmp_path, name="wary", route_relays=relays, no_advertise=True
    )
    for relay in relays.values():
        await relay.start()
    cut_off = [r for (i, j), r in relays.items() if 2 in (i, j)]
    try:
        for node in nodes:
            node.start()
        await _js_ready(nodes[0].url)
        settings = MeshSettings(
            nats_url=nodes[2].url,
            namespace=_NS,
            kv_replicas=3,
            heartbeat_interval=1.0,
            lease_timeout=3.0,
            # (Not silent long enough to ask whether another process took the id over.)
            suspect_timeout=10.0,
            work_ack_wait=2.0,
            audit_enabled=False,
        )
        side = _SideHub(settings)
        side_nc = await nats.connect(nodes[2].url)
        await side_nc.subscribe(
            protocol.hub_agent_subject("*.*.*", "register"), cb=side.on_register
        )
        await side_nc.subscribe(protocol.hub_agent_subject("*.*.*", "heartbeat"), cb=side.on_beat)
        await side_nc.flush()
        other = await nats.connect(nodes[0].url)  # the hubs' side of the coming partition
        js = other.jetstream(timeout=5.0)
        runs: list[str] = []
        agent = Agent(f"{_NS}.wary.a1", settings=settings)

        @agent.handler(_CAP)
        async def step(task: Task[Any]) -> str:
            runs.append(task.task_id)
            return "ran"

        try:
            await agent.start()
            assert agent.work is not None
            await eventually(lambda: agent.work is not None and agent.work._pull is not None)
            kv = await js.key_value(protocol.KV_TASKS)
            preferred = json.dumps({"placement": {"preferred": "n0"}}).encode()

            async def led_off_n2_all_current() -> bool:
                """The records' stream led from n0 or n1, both followers current (so n2's
                replica has what was written before the cut)."""
                with contextlib.suppress(Exception):
                    info = await js.stream_info(_TASKS)
                    cluster = info.cluster
                    if cluster is not None and cluster.leader in ("n0", "n1"):
                        peers = cluster.replicas or []
                        return len(peers) == 2 and all(p.current for p in peers)
                    await other.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{_TASKS}", preferred)
                return False

            def touching() -> bool:
                """The step in hand waits for the heartbeat that brings the agent back in
                touch (``Agent.back_in_touch``)."""
                t = agent._touching
                return t is not None and not t.done()

            # A step sent before the silence runs (and warms up the read path).
            await _send_step(js, kv, "wy-before", agent.agent_id)
            await eventually(lambda: runs == ["wy-before"], timeout=10)
            # Attempt 1 of the step, recorded on every replica.
            key = protocol.task_key(_NS, "wy-step")
            await kv.put(key, _record("wy-step", 1, agent.agent_id))
            await eventually(led_off_n2_all_current, timeout=20, interval=0.3)

            # Silent for longer than its lease: nobody answers its heartbeats.
            side.answering = False
            await eventually(
                lambda: time.monotonic() - agent._answered_at > settings.lease_timeout + 0.3,
                timeout=10,
            )
            assert not agent.in_touch()
            await _send_step(js, kv, "wy-step", agent.agent_id)
            # Out of touch, it heartbeats before it reads the step's record: held.
            await eventually(touching, timeout=5)
            # n2 is cut off from the others, who give attempt 1 up meanwhile.
            for relay in cut_off:
                await relay.cut()
            await kv.put(key, _record("wy-step", 2, "wy.wary.a2"))
            # A hub on n2's side, its registry behind, answers: the agent is in touch again.
            side.answering = True
            for msg in side.held:
                await side.answer(msg)
            side.held.clear()
            await asyncio.sleep(3.0)
            assert runs == ["wy-before"], "attempt 1 ran after it was given up"
            assert agent.wary()
        finally:
            for relay in cut_off:
                with contextlib.suppress(Exception):
                    await relay.start()
        # Healed: the record, read as far as the leader, says attempt 2. A current step runs.
        assert agent.work is not None
        fenced = agent.work.fenced
        await eventually(lambda: agent.work is not None and agent.work.fenced > fenced, timeout=20)
        await _send_step(js, kv, "wy-after", agent.agent_id)
        await eventually(lambda: "wy-after" in runs, timeout=20)
        assert runs == ["wy-before", "wy-after"]
        await agent.close()
        await side_nc.close()
        await other.close()
    finally:
        for node in nodes:
            node.stop()


def test_an_agent_is_wary_after_a_silence_of_a_lease_or_more_until_its_replicas_caught_up() -> None:
    """Answers a heartbeat interval apart leave the agent as it was; an answer a lease or more
    after the last one makes it wary, until a fence read asked after that finds the replicas
    caught up (or ten silences, at least lease + grace each, went by)."""
    settings = MeshSettings(heartbeat_interval=1.0, lease_timeout=3.0, suspect_timeout=2.0)
    agent = Agent(f"{_NS}.unit.a1", settings=settings)
    now = time.monotonic()
    agent._answered(now - 40.0)  # the registration: nothing before it
    agent._answered(now - 39.0)
    assert not agent.wary()
    agent._answered(now - 36.5)  # 2.5 s: less than a lease
    assert not agent.wary()
    agent._answered(now - 0.5)  # 36 s of silence
    assert agent.wary()
    assert 360.0 <= agent._wary_until - now < 360.5  # (from when the answer came)
    agent.caught_up(now - 1.0)  # asked before the answer: says nothing of what came since
    assert agent.wary()
    agent.caught_up(time.monotonic())
    assert not agent.wary()
    agent._answered(time.monotonic() - 0.1)
    agent._answered(time.monotonic())
    assert not agent.wary()
    agent._be_wary(float("inf"))  # (told it is unknown, never answered: lease + grace)
    assert 49.0 < agent._wary_until - time.monotonic() <= 50.0


def _peer(
    name: str, *, current: bool = True, offline: bool = False, active: float = 0.3, lag: int = 0
) -> PeerInfo:
    return PeerInfo(name=name, current=current, offline=offline, active=int(active * 1e9), lag=lag)


@pytest.mark.parametrize(
    ("leader", "peers", "ok"),
    [
        ("n0", [_peer("n1"), _peer("n2")], True),
        ("n0", [_peer("n1"), _peer("n2", offline=True, current=False)], True),  # a node down
        ("n0", [_peer("n1"), _peer("n2", current=False, lag=40)], False),  # n2 catching up
        # Entries in flight, or none to send lately: what the leader applied, n2 has.
        ("n0", [_peer("n1"), _peer("n2", lag=3)], True),
        ("n0", [_peer("n1"), _peer("n2", active=6.0)], True),
        ("n0", [_peer("n1", active=6.0), _peer("n2", active=6.0)], False),  # no quorum heard
        # A leader cut off from both (it sees them offline, or silent): not the leader's word.
        ("n2", [_peer("n0", offline=True), _peer("n1", offline=True)], False),
        ("n2", [_peer("n0", active=8.0), _peer("n1", active=8.0)], False),
        ("", [_peer("n1"), _peer("n2")], False),  # no leader
        ("n0", [], True),  # one replica
    ],
)
def test_a_replica_behind_its_leader_is_told_from_its_stream_info(
    leader: str, peers: list[PeerInfo], ok: bool
) -> None:
    cluster = ClusterInfo(leader=leader, replicas=peers)
    assert (not_caught_up(cluster, 2.0) is None) is ok


async def test_wary_reads_at_once_share_one_check_of_the_replicas(
    wf_hub: Any, fleet: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back from a partition, every step waiting reads its fence at once (and each again at
    every redelivery until a check passes): one ``STREAM.INFO`` answers all those in flight,
    not one each — a load on the JetStream API while the cluster recovers. A check asked
    before a later silence answers for none after it."""
    a: Agent = fleet.agent("share.a")

    @a.handler(_CAP)
    async def step(task: Task[Any]) -> str:
        return "ran"

    await a.start()
    work = a.work
    assert work is not None and work._jsc is not None
    real = work._jsc.replicas_caught_up
    checks: list[str] = []

    async def counted(bucket: str, *, heard_within: float) -> None:
        checks.append(bucket)
        await real(bucket, heard_within=heard_within)  # the server's own answer

    monkeypatch.setattr(work._jsc, "replicas_caught_up", counted)
    ns = fleet.settings.namespace
    envs = [
        TaskEnvelope(
            task_id=f"share-{i}",
            capability=_CAP,
            payload=None,
            namespace=ns,
            workflow_id="share-wf",
            step=i,
        )
        for i in range(20)
    ]
    a._be_wary(10.0)
    assert a.wary()
    assert await asyncio.gather(*(work._record(e) for e in envs)) == [None] * 20
    assert checks == [protocol.KV_TASKS]
    assert not a.wary()  # (one node: nothing to catch up with)
    a._be_wary(10.0)  # silent again: the check before says nothing of it
    assert await work._record(envs[0]) is None
    assert len(checks) == 2
