"""The chaos suite's fault injection: :class:`Faults` injects one kind of fault (``FAULTS`` in
:mod:`.harness`) into a run's mesh every ``fault_every`` seconds and logs
each for the history checker (``faults.jsonl``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from typing import TYPE_CHECKING, Any

from reach_mesh import Client
from reach_mesh.server import EmbeddedNats

from ..helpers import fetch

if TYPE_CHECKING:
    from .harness import ChaosConfig, Mesh, Proc

__all__ = ["BLIP_MAX", "LEADER_TARGETS", "NODE_STOP", "Faults"]

#: How long a blip cuts a process's connections to NATS, at most (at least a tenth of it).
BLIP_MAX = 2.0
#: How long a node_stop keeps its node frozen: past its clients' and its routes' PING
#: deadlines (``nats_ping_interval`` and ``ROUTE_PING_INTERVAL`` x 4) and a raft election.
NODE_STOP = 8.0
#: How long a partition cuts a node off from the other two, at least and at most: past its
#: routes' loss (at once: the cut closes them) and a raft election on each side.
PARTITION_MIN, PARTITION_MAX = 3.0, 10.0
#: Streams whose leader a node kill aims at, in turn (the KV buckets are streams too).
LEADER_TARGETS = (
    "KV_reach_tasks",
    "REACH_WF",
    "KV_reach_workflows",
    "REACH_WF_EVENTS",
    "REACH_WORK",
    "REACH_STATUS",
)


class Faults:
    """Injects ``cfg.fault`` every ``cfg.fault_every`` seconds until stopped; logs each fault
    (kind, target, start, end) as a JSON line for the checker."""

    def __init__(self, cfg: ChaosConfig, mesh: Mesh, client: Client) -> None:
        self.cfg, self.mesh, self.client = cfg, mesh, client
        self.path = mesh.dir / "faults.jsonl"
        self.rng = random.Random(cfg.seed + 1000)
        self.stop = asyncio.Event()
        self.count = 0

    def _log(self, kind: str, target: str, at: float, **extra: Any) -> None:
        line = {"kind": kind, "target": target, "at": at, "until": time.time(), **extra}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    async def run(self) -> None:
        if self.cfg.fault in ("none", "slow"):
            return
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.cfg.fault_every)
                return
            await getattr(self, self.cfg.fault)()
            self.count += 1

    async def _kill_restart(self, kind: str, proc: Proc) -> None:
        at = time.time()
        pid = proc.pid
        proc.kill()
        await asyncio.sleep(self.cfg.down)
        proc.start()
        self._log(kind, proc.name, at, pid=pid)

    async def agent_kill(self) -> None:
        await self._kill_restart("agent_kill", self.rng.choice(self.mesh.agents))

    async def hub_kill(self) -> None:
        await self._kill_restart("hub_kill", self.rng.choice(self.mesh.hubs))

    async def agent_stop(self) -> None:
        """SIGSTOP longer than lease + suspect grace (the hubs declare it LOST), then SIGCONT."""
        proc = self.rng.choice(self.mesh.agents)
        at = time.time()
        proc.signal(signal.SIGSTOP)
        t = self.cfg.timings
        await asyncio.sleep(t["lease_timeout"] + t["suspect_timeout"] + 2.0)
        proc.signal(signal.SIGCONT)
        self._log("agent_stop", proc.name, at, pid=proc.pid)

    async def hub_stop(self) -> None:
        """SIGSTOP a hub past ``workflow_ack_wait`` (the other hubs take its workflows over),
        then SIGCONT: it wakes with stale state, every timer due at once (a long GC pause, a
        stalled VM)."""
        proc = self.rng.choice(self.mesh.hubs)
        at = time.time()
        proc.signal(signal.SIGSTOP)
        await asyncio.sleep(self.cfg.timings["workflow_ack_wait"] + 3.0)
        proc.signal(signal.SIGCONT)
        self._log("hub_stop", proc.name, at, pid=proc.pid)

    async def deaf(self) -> None:
        """SIGUSR1 a random agent: it goes deaf (``agent_proc.deafen``: its work consumer
        stopped, its task, batch and ctl subscriptions gone, its heartbeats going on) for
        2 x (``step_deliver_timeout`` + ``step_silence_timeout``): every hub that sent it an
        attempt meanwhile finds it deaf (two probes), gives the attempt up and quarantines it.
        Then it is restarted as an operator would: SIGTERM (SIGKILL after 3 s) and a fresh
        process with the same agent id, whose consumer finds the attempts sent meanwhile (each
        given up and fenced, or still current)."""
        proc = self.rng.choice(self.mesh.agents)
        at = time.time()
        pid = proc.pid
        proc.signal(signal.SIGUSR1)
        t = self.cfg.timings
        await asyncio.sleep(2 * (t["step_deliver_timeout"] + t["step_silence_timeout"]))
        restarted = time.time()
        await asyncio.to_thread(proc.stop)
        # -9: it did not end within 3 s of SIGTERM (a handler still running was killed).
        code = None if proc.popen is None else proc.popen.returncode
        proc.start()
        self._log("deaf", proc.name, at, pid=pid, restarted=restarted, exit=code)

    async def leader_of(self, stream: str) -> str | None:
        try:
            info = await asyncio.wait_for(self.client.nc.jetstream().stream_info(stream), 2)
        except Exception:
            return None
        return None if info.cluster is None else info.cluster.leader

    async def _next_leader(self) -> tuple[EmbeddedNats, str | None]:
        """The node leading the next stream of ``LEADER_TARGETS`` and that stream (a random
        node and None when the leader cannot be read)."""
        stream = LEADER_TARGETS[self.count % len(LEADER_TARGETS)]
        leader = await self.leader_of(stream)
        names = [n.server_name for n in self.mesh.nodes]
        if leader in names:
            return self.mesh.nodes[names.index(leader)], stream
        return self.rng.choice(self.mesh.nodes), None

    async def node_kill(self) -> None:
        """SIGKILL the node leading the next stream of ``LEADER_TARGETS`` (a random node when
        the leader cannot be read), restart it after ``down`` (at least 3 s)."""
        node, stream = await self._next_leader()
        at = time.time()
        await asyncio.to_thread(node.kill)
        await asyncio.sleep(max(self.cfg.down, 3.0))
        await asyncio.to_thread(node.start)
        self._log("node_kill", str(node.server_name), at, leader_of=stream)

    async def node_stop(self) -> None:
        """SIGSTOP the node leading the next stream of ``LEADER_TARGETS`` for ``NODE_STOP``
        seconds, then SIGCONT: a stalled VM, or a partition that drops packets instead of
        resetting connections (its sockets stay open; only missing PONGs tell)."""
        node, stream = await self._next_leader()
        assert node.proc is not None
        pgid = node.proc.pid
        at = time.time()
        os.killpg(pgid, signal.SIGSTOP)
        try:
            await asyncio.sleep(NODE_STOP)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)
        self._log("node_stop", str(node.server_name), at, leader_of=stream)

    async def blip(self) -> None:
        """Cut one process's connections to NATS (a hub's, an agent's or the caller's) for
        0.2-2 s, then let it reconnect: its host's network dropping for a moment. The answers
        sent to it meanwhile are lost; nothing else is."""
        target = self.rng.choice(sorted(self.mesh.relays))
        relays = self.mesh.relays[target]
        at = time.time()
        for relay in relays:
            await relay.cut()
        await asyncio.sleep(self.rng.uniform(BLIP_MAX / 10, BLIP_MAX))
        for relay in relays:
            await relay.start()
        self._log("blip", target, at)

    async def partition(self) -> None:
        """Cut the node leading the next stream of ``LEADER_TARGETS`` off from the other two
        for ``PARTITION_MIN``-``PARTITION_MAX`` s, then heal: every route relay to or from it
        cut (its routes closed both ways, new ones refused), while it and the hubs and agents
        connected to it stay up and connected — they hear nothing wrong, but their JetStream
        requests find no quorum and their messages reach only the clients of their side (the
        caller leaves it at once: its INFO lists fewer than half the servers it did). Logs the
        node's clients (their connection names, before the cut and at its end) as ``cut_off``."""
        node, stream = await self._next_leader()
        i = self.mesh.nodes.index(node)
        relays = [r for (a, b), r in self.mesh.route_relays.items() if i in (a, b)]
        before = await self._clients(node)
        at = time.time()
        for relay in relays:
            await relay.cut()
        await asyncio.sleep(self.rng.uniform(PARTITION_MIN, PARTITION_MAX))
        during = await self._clients(node)
        for relay in relays:
            await relay.start()
        cut_off = sorted(set(before) | set(during))
        self._log("partition", str(node.server_name), at, leader_of=stream, cut_off=cut_off)

    @staticmethod
    async def _clients(node: EmbeddedNats) -> list[str]:
        """The names of the client connections of ``node`` (its ``/connz``)."""
        try:
            status, body = await fetch(f"http://127.0.0.1:{node.http_port}/connz?limit=4096")
        except OSError:
            return []
        if status != 200:
            return []
        conns = json.loads(body).get("connections") or []
        return [str(c.get("name") or c.get("cid")) for c in conns]
