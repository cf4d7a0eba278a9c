"""A caller waiting for a workflow result while its NATS server is cut off from the rest of a
real 3-node cluster (the chaos ``partition`` fault: routes cut, the caller's connection fine).

The hub on the other side stores the result and announces it on core NATS: the announcement
cannot cross to the cut-off server, and a read of the record made there (a direct get) is
answered by the only replica it can reach, the server's own, with what it had before the cut:
not final. After the heal that replica still answers some reads so while it catches up (about
8 s in ``repro``: reads through the healed server alternated between the old value and the
new, the bucket without a leader for part of it). A caller that stayed had its answer at a
5 s re-check or its wait's timeout once a read reached a current replica (chaos secure seeds
198-203, ``partition``: answers 4-15 s after the record's write, on the re-check/timeout grid
of each wait; here the 15 s wait ran out, 6 s after the heal). A caller leaves such a server
at once (``connect``'s ``leave_cut_off``): its reconnection re-reads every record it waits
on, on the other side, and an announcement made after it arrives there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import nats
import pytest

from reach_mesh import Client, MeshSettings, MeshTimeoutError, Step, TaskState, protocol
from reach_mesh.hub import Hub
from reach_mesh.workflow import WorkflowResult

from .helpers import cluster_nodes, eventually, recording_agent
from .test_cluster import _started

pytestmark = pytest.mark.xdist_group("clusters")

CAP = "rwc:slow:v1"
#: How long the step runs: the cut comes first, the result is stored during it.
STEP = 2.0
#: How long the caller's server stays cut off: past the result's store and a 5 s re-check.
CUT = 9.0


@pytest.mark.timeout(120)
async def test_a_waiting_caller_whose_server_is_cut_off_has_the_stored_result_at_once(
    tmp_path: Path,
) -> None:
    relays: dict[tuple[int, int], Any] = {}
    nodes = cluster_nodes(tmp_path, name="rwcut", route_relays=relays)
    for relay in relays.values():
        await relay.start()
    try:
        urls = await _started(nodes)
        common: dict[str, Any] = dict(namespace="rwc", kv_replicas=3, audit_enabled=False)
        # The hub and the agent know node 0 only (they stay on the side that keeps a quorum);
        # the caller is given node 1, the one cut off.
        side = MeshSettings(nats_url=urls[0], **common)
        caller = MeshSettings(nats_url=urls[1], **common)
        agent, runs = recording_agent("rwc.slow.a1", side, CAP, delay=STEP)
        async with Hub(settings=side, hub_id="hub-a") as hub, agent:
            await eventually(lambda: agent.agent_id in hub.registry.agents, timeout=10)
            stream = f"KV_{protocol.KV_WORKFLOWS}"
            js = hub.nc.jetstream(timeout=5.0)
            preferred = json.dumps({"placement": {"preferred": "n0"}}).encode()

            async def led_by_n0() -> bool:
                """The record bucket led on the side that keeps a quorum, every replica
                current (the result is then stored during the cut, at once)."""
                with contextlib.suppress(nats.errors.Error):
                    info = await js.stream_info(stream)
                    cluster = info.cluster
                    if cluster is not None and cluster.leader == "n0":
                        replicas = cluster.replicas or []
                        return len(replicas) == 2 and all(r.current for r in replicas)
                    await hub.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", preferred)
                return False

            await eventually(led_by_n0, timeout=30, interval=0.5)
            async with Client(settings=caller) as client:
                assert client.nc.connected_url is not None
                assert client.nc.connected_url.port == nodes[1].port
                wf_id = await client.submit_fanout([Step(capability=CAP, payload=1)])
                answered: list[float] = []

                async def wait() -> WorkflowResult:
                    """As a caller does: after a wait that ran out, it asks again."""
                    while True:
                        with contextlib.suppress(MeshTimeoutError):
                            got = await client.workflow(wf_id, timeout=15)
                            answered.append(time.time())
                            return got

                waiting = asyncio.ensure_future(wait())
                await eventually(lambda: runs == [1], timeout=10)
                for (i, j), relay in relays.items():
                    if 1 in (i, j):
                        await relay.cut()
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(waiting), CUT)
                finally:
                    for (i, j), relay in relays.items():
                        if 1 in (i, j):
                            await relay.start()
                result = await asyncio.wait_for(waiting, 30)
                subject = f"$KV.{protocol.KV_WORKFLOWS}.{protocol.workflow_key('rwc', wf_id)}"
                written: list[float] = []

                async def write_time() -> bool:
                    """The record's write (its stream timestamp), once the bucket has a
                    leader again (the heal may depose it)."""
                    with contextlib.suppress(nats.errors.Error):
                        raw = await js.get_last_msg(stream, subject)
                        assert raw.time is not None
                        written.append(raw.time.timestamp())
                    return bool(written)

                await eventually(write_time, timeout=30, interval=0.5)
        assert result.state is TaskState.SUCCEEDED
        late = answered[0] - written[0]
        # Within moments of the store: not at the heal (``CUT`` s), a 5 s re-check or the
        # wait's 15 s timeout.
        assert late < 1.5, late
    finally:
        for node in nodes:
            node.stop()
        for relay in relays.values():
            with contextlib.suppress(Exception):
                await relay.cut()
