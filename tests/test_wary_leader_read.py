"""A wary agent whose replica check fails reads its step's record at the stream's leader
through a hub (agent verb ``record``), on real nats-servers.

Chaos secure seed 184, ``node_stop``: a node thawed after a SIGSTOP, and its replica of
``KV_reach_tasks`` stayed not current for some 80 s while the leader had its quorum. Every
wary agent's steps waited for it (``WorkConsumer._replicas_checked`` failed): some 120 s with
almost no step started, 24,581 attempts given up as undelivered. Now the hubs read the record
at the leader for them (``hub/_record_read.py``, ``agent/_leader_read.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from reach_mesh import protocol
from reach_mesh._auth import AuthDir
from reach_mesh.agent import Agent, Task
from reach_mesh.config import MeshSettings
from reach_mesh.errors import MeshUnavailableError
from reach_mesh.hub import Hub
from reach_mesh.models import TaskEnvelope
from reach_mesh.workflow import TaskRecord

from .helpers import cluster_nodes, eventually, freeze
from .test_agent_sdk import parse
from .test_wary_fences import _CAP, _NS, _TASKS, _record, _send_step


@pytest.mark.xdist_group("clusters")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("secure", [False, True], ids=["open", "secure"])
async def test_a_wary_agent_runs_a_step_while_a_follower_of_the_records_is_frozen(
    tmp_path: Path, secure: bool
) -> None:
    """One follower of ``KV_reach_tasks`` frozen (SIGSTOP), the leader with its quorum: a wary
    agent's step runs within seconds, its record read at the leader by a hub; a step whose
    record moved on is still dropped. Without the hub read it waited out the whole freeze.

    ``secure``: every process with its own identity and NATS permissions (``reach-mesh
    auth``), as in chaos secure runs: the agent asks on its own subject, the hub answers into
    its inbox (the test's own connection is a hub's, which may write records and work)."""
    agent_id = f"{_NS}.wlr.a1"
    auth = AuthDir(tmp_path / "auth")
    if secure:
        auth.init(namespace=_NS)
        auth.add("agent", agent_id)
    nodes = cluster_nodes(tmp_path, name="wlr", auth_config=auth.auth_conf if secure else None)
    for node in nodes:
        node.start()
    pid = None
    try:
        fields: dict[str, Any] = {
            "nats_url": nodes[0].url,
            "namespace": _NS,
            "kv_replicas": 3,
            "heartbeat_interval": 0.5,
            "lease_timeout": 1.5,
            "suspect_timeout": 1.0,
            "work_ack_wait": 2.0,
            "audit_enabled": False,
        }
        hub_settings = MeshSettings(**fields)
        agent_settings = hub_settings
        if secure:
            hub_settings = auth.settings("hub", "main", **fields)
            agent_settings = auth.settings("agent", agent_id, **fields)
        other = await _js_ready_as(hub_settings)
        js = other.jetstream(timeout=5.0)
        runs: list[str] = []
        async with Hub(settings=hub_settings, hub_id="hub-wlr") as hub:
            agent = Agent(agent_id, settings=agent_settings)

            @agent.handler(_CAP)
            async def step(task: Task[Any]) -> str:
                runs.append(task.task_id)
                return "ran"

            await agent.start()
            work = agent.work
            assert work is not None
            await eventually(lambda: work._pull is not None)
            kv = await js.key_value(protocol.KV_TASKS)
            await _send_step(js, kv, "wlr-before", agent.agent_id)
            await eventually(lambda: runs == ["wlr-before"], timeout=10)
            info = await js.stream_info(_TASKS)
            assert info.cluster is not None
            leader = info.cluster.leader
            frozen = next(i for i in range(3) if f"n{i}" != leader and i != 0)
            # What the step's delivery needs besides its record, led off the frozen node (else
            # it waits for an election there, whatever the record read does).
            work_stream, consumer = protocol.STREAM_WORK, protocol.work_consumer(agent.agent_id)
            away = json.dumps({"placement": {"preferred": leader}}).encode()

            async def led_elsewhere() -> bool:
                s_info = await js.stream_info(work_stream)
                c_info = await js.consumer_info(work_stream, consumer)
                ok = True
                if s_info.cluster is not None and s_info.cluster.leader == f"n{frozen}":
                    await other.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{work_stream}", away)
                    ok = False
                if c_info.cluster is not None and c_info.cluster.leader == f"n{frozen}":
                    subject = f"$JS.API.CONSUMER.LEADER.STEPDOWN.{work_stream}.{consumer}"
                    await other.request(subject, away)
                    ok = False
                return ok

            await eventually(led_elsewhere, timeout=20, interval=0.5)
            proc = nodes[frozen].proc
            assert proc is not None
            pid = proc.pid
            await freeze(pid)
            agent._be_wary(3.0)  # back from a 3 s silence, as every chaos agent was
            assert agent.wary()
            # A write the frozen replica does not have: it cannot be current from now on.
            key = protocol.task_key(_NS, "wlr-gone")
            await kv.put(key, _record("wlr-gone", 2, f"{_NS}.wlr.a2"))
            sent = time.monotonic()
            await _send_step(js, kv, "wlr-step", agent.agent_id)
            await eventually(lambda: "wlr-step" in runs, timeout=8, interval=0.05)
            took = time.monotonic() - sent
            # Attempt 1 of a step the record says moved on to attempt 2: dropped, read at the
            # leader too (the frozen replica never had attempt 2).
            fenced = work.fenced
            await _send_step(js, None, "wlr-gone", agent.agent_id)
            await eventually(lambda: work.fenced > fenced, timeout=8)
            assert "wlr-gone" not in runs
            assert work.leader_reads.answered >= 2
            assert _leader_reads(agent, "answered") == work.leader_reads.answered
            assert agent.wary()  # a hub's read says nothing of the replicas: still wary
            found = hub.metrics.record_reads_total.labels("found")._value.get()
            assert found >= 2
            print(f"ran {took:.2f} s after it was sent, frozen n{frozen}, leader {leader}")
            os.kill(pid, signal.SIGCONT)
            pid = None
            await agent.close()
        await other.close()
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        for node in nodes:
            node.stop()


async def _js_ready_as(settings: MeshSettings, timeout: float = 20.0) -> NATS:
    """A connection with ``settings``' identity (none in open mode), once the cluster has a
    JetStream meta leader (``test_cluster._js_ready``, which connects with none)."""
    assert settings.nats_url is not None
    nc = await nats.connect(
        settings.nats_url,
        nkeys_seed=settings.nats_nkey_seed,
        inbox_prefix=settings.nats_inbox_prefix or "_INBOX",
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            await nc.jetstream().account_info()
            return nc
        except Exception:
            if time.monotonic() > deadline:
                await nc.close()
                raise
            await asyncio.sleep(0.2)


def _leader_reads(agent: Agent, outcome: str) -> float:
    """``reach_agent_leader_reads_total{outcome}`` as the agent exports it."""
    samples = parse(agent.metrics.render())
    return samples[("reach_agent_leader_reads_total", (("outcome", outcome),))]


async def _ask(nc: NATS, subject: str, body: bytes) -> dict[str, Any]:
    msg = await nc.request(subject, body, timeout=5)
    out: dict[str, Any] = json.loads(msg.data)
    return out


async def test_a_hub_reads_a_record_of_the_askers_namespace_only(
    nc: NATS, hub: Hub, namespace: str
) -> None:
    """Answers of the ``record`` verb, sent raw as an agent in another language would: the
    record and its revision; absent (never written, or deleted); typed errors for bad input.
    The key is the subject's namespace and a task id, which has no dots: no body reads
    another namespace's record."""
    js = nc.jetstream()
    kv = await js.key_value(protocol.KV_TASKS)
    mine = f"{namespace}.svc.i1"
    subject = protocol.hub_agent_subject(mine, "record")
    rec = {"task_id": "t1", "workflow_id": "wf1", "step": 0, "attempt": 3, "namespace": namespace}
    rev = await kv.put(protocol.task_key(namespace, "t1"), json.dumps(rec).encode())
    other_ns = f"{namespace}x"
    await kv.put(protocol.task_key(other_ns, "t1"), json.dumps({**rec, "attempt": 9}).encode())

    out = await _ask(nc, subject, b'{"task_id": "t1"}')
    assert out == {"task_id": "t1", "revision": rev, "record": rec}
    # The same id on the other namespace's subject reads that namespace's record: the key is
    # the subject's namespace, never the body's.
    theirs = protocol.hub_agent_subject(f"{other_ns}.svc.i1", "record")
    assert (await _ask(nc, theirs, b'{"task_id": "t1"}'))["record"]["attempt"] == 9
    assert (await _ask(nc, subject, b'{"task_id": "t1"}'))["record"]["attempt"] == 3

    out = await _ask(nc, subject, b'{"task_id": "never"}')
    assert out == {"task_id": "never", "revision": 0}  # (null fields are left out)
    await kv.delete(protocol.task_key(namespace, "t1"))
    out = await _ask(nc, subject, b'{"task_id": "t1"}')
    assert "record" not in out and out["revision"] > rev

    bad = [
        (b"{not json", "REACH_BAD_REQUEST", "malformed JSON"),
        (b"[1]", "REACH_BAD_REQUEST", "RecordRequest"),
        (b"{}", "REACH_BAD_REQUEST", "task_id"),
        # What would name another namespace's key, or a wildcard: not a task id.
        (json.dumps({"task_id": f"{other_ns}.t1"}).encode(), "REACH_BAD_REQUEST", other_ns),
        (b'{"task_id": "a.*"}', "REACH_BAD_REQUEST", "a.*"),
        (b'{"task_id": ">"}', "REACH_BAD_REQUEST", ">"),
        (json.dumps({"task_id": "x" * 2000}).encode(), "REACH_PAYLOAD_TOO_LARGE", "1024"),
    ]
    for body, code, needle in bad:
        out = await _ask(nc, subject, body)
        assert out["error"]["code"] == code, (body, out)
        assert needle in json.dumps(out["error"]), (body, out)
    refused = hub.metrics.record_reads_total.labels("refused")._value.get()
    assert refused >= len(bad)
    assert hub.metrics.record_reads_total.labels("absent")._value.get() >= 2
    # The hub serves on.
    assert "record" not in await _ask(nc, subject, b'{"task_id": "never"}')


async def test_a_wary_agent_reads_through_a_hub_only_when_its_replica_check_fails(
    hub: Hub, settings: MeshSettings, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path is as it was: a passed check, then a direct get, no hub asked. A failed
    check: the hub's leader read decides (the agent stays wary); no hub answering: the read
    fails (the step waits)."""
    agent = Agent(f"{namespace}.lr.a1", settings=settings)

    @agent.handler(_CAP)
    async def step(task: Task[Any]) -> str:
        return "ran"

    async with agent:
        work = agent.work
        assert work is not None and work._jsc is not None
        await eventually(lambda: work._tasks_kv is not None)
        js = agent.nc.jetstream()
        kv = await js.key_value(protocol.KV_TASKS)
        rec = TaskRecord(task_id="s1", workflow_id="wf", step=0, namespace=namespace, attempt=2)
        await kv.put(protocol.task_key(namespace, "s1"), protocol.encode(rec))
        env = TaskEnvelope(
            task_id="s1", capability=_CAP, namespace=namespace, workflow_id="wf", step=0
        )
        agent._be_wary(10.0)
        got = await work._record(env)
        assert got is not None and got.attempt == 2
        assert work.leader_reads.answered == 0 and not agent.wary()
        # Both outcomes exported from the start, at 0.
        assert _leader_reads(agent, "answered") == _leader_reads(agent, "unanswered") == 0

        async def behind(bucket: str, *, heard_within: float) -> None:
            raise MeshUnavailableError("KV_reach_tasks: replica(s) n1 behind its leader n0")

        monkeypatch.setattr(work._jsc, "replicas_caught_up", behind)
        agent._be_wary(10.0)
        got = await work._record(env)
        assert got is not None and got.attempt == 2
        assert work.leader_reads.answered == 1 and agent.wary()
        assert _leader_reads(agent, "answered") == 1
        await hub.close()  # no hub answers: the read fails, the step would wait
        with pytest.raises(MeshUnavailableError, match="behind its leader"):
            await work._record(env)
        assert work.leader_reads.unanswered == 1
        assert _leader_reads(agent, "unanswered") == 1 and _leader_reads(agent, "answered") == 1


async def test_one_namespace_cannot_take_every_leader_read_of_a_hub(
    nc: NATS, hub: Hub, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub makes ``RECORD_READS_AT_ONCE`` leader reads at once, each held up to 1.5 s when
    the leader is slow (when wary reads happen). One namespace's agents — one compromised
    agent asking on its own subject, 64 requests at once — took them all, and every other
    tenant's wary agents were ``REACH_THROTTLED``: their steps waited. A namespace holds at
    most ``RECORD_READS_PER_NAMESPACE`` of them; another namespace's read is made."""
    from reach_mesh.hub import _record_read

    release = asyncio.Event()

    async def slow_leader(*args: Any, **kwargs: Any) -> None:
        await release.wait()

    monkeypatch.setattr(_record_read, "entry_at_quorate_leader", slow_leader)
    rogue = protocol.hub_agent_subject(f"{namespace}.rogue.a1", "record")
    flood = [
        asyncio.ensure_future(_ask(nc, rogue, b'{"task_id": "t%d"}' % i))
        for i in range(_record_read.RECORD_READS_AT_ONCE)
    ]
    try:
        throttled: list[dict[str, Any]] = []

        async def answered() -> bool:
            throttled[:] = [f.result() for f in flood if f.done()]
            return len(throttled) >= len(flood) - _record_read.RECORD_READS_PER_NAMESPACE

        await eventually(answered, timeout=5)
        assert all(a["error"]["code"] == "REACH_THROTTLED" for a in throttled), throttled
        other = protocol.hub_agent_subject(f"{namespace}x.calm.a1", "record")
        asked = asyncio.ensure_future(_ask(nc, other, b'{"task_id": "t1"}'))
        await eventually(lambda: hub._record_reads_by_ns.get(f"{namespace}x") == 1, timeout=5)
        release.set()
        assert "error" not in await asked
        assert all("error" not in a for a in await asyncio.gather(*flood) if a not in throttled)
    finally:
        release.set()
        await asyncio.gather(*flood, return_exceptions=True)
