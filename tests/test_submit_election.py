"""Workflow submissions through the election that follows the death of the workflow stream's
leader, on a real 3-node cluster: each is stored as soon as the stream has a leader again.

While the dead leader is not yet replaced (4-9 s), a submission is answered "no responders"
(503) at once, and a question about the stream (``stream_info``) is answered by nobody. The
submission asked that question after each 503, waiting the JetStream client's 5 s for it:
each try of a submission took 5 s, a submission sent during the election was stored up to 5 s
after it, and one sent during two elections in a row (secure chaos seed 202, node_kill: 14
submissions) failed after its 15 s with three tries made."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import StorageType, StreamConfig

from reach_mesh import Client, MeshSettings, Step, protocol
from reach_mesh.server import EmbeddedNats

from .helpers import cluster_nodes, eventually
from .test_cluster import _js_ready, _settled_leader

pytestmark = pytest.mark.xdist_group("clusters")

_STEPS = [Step(capability="sub:echo:v1", payload={})]
#: The workflow stream, as the hubs make it where it matters here (R3, deduplicating).
_WF_STREAM = StreamConfig(
    name=protocol.STREAM_WF,
    subjects=[protocol.wf_submit("*")],
    num_replicas=3,
    storage=StorageType.FILE,
    duplicate_window=120,
)


@pytest.mark.timeout(120)
async def test_submissions_are_stored_as_soon_as_a_dead_leaders_stream_has_a_new_one(
    tmp_path: Path,
) -> None:
    nodes = cluster_nodes(tmp_path, name="subel")
    try:
        nc = await _started(nodes)
        try:

            async def make(js: Any) -> str:
                await js.add_stream(_WF_STREAM)
                return protocol.STREAM_WF

            leader = await _settled_leader(nc.jetstream(timeout=10.0), make, nodes)
        finally:
            await nc.close()
        url = next(n.url for n in nodes if n is not leader)
        settings = MeshSettings(nats_url=url, namespace="subel")
        probe = await nats.connect(servers=[url], dont_randomize=True)
        # ``stored``: a client that had a submission stored before the election; ``fresh``:
        # one that had none (it asks once per submission whether the stream exists at all).
        async with Client(settings=settings) as stored, Client(settings=settings) as fresh:
            await stored.submit_fanout(_STEPS)
            leader.kill()
            t0 = time.monotonic()
            back: list[float] = []

            async def first_stored() -> None:
                """When the stream takes a publish again (tried every 50 ms)."""
                js = probe.jetstream(timeout=0.5)
                for i in range(1000):
                    with contextlib.suppress(nats.errors.Error):
                        await js.publish("reach.wf.probe.submit", headers={"Nats-Msg-Id": f"p{i}"})
                        back.append(time.monotonic())
                        return
                    await asyncio.sleep(0.05)

            async def submit(client: Client, after: float) -> tuple[float, float]:
                await asyncio.sleep(after)
                sent = time.monotonic()
                await client.submit_fanout(_STEPS)
                return sent, time.monotonic()

            watch = asyncio.ensure_future(first_stored())
            waits = [submit(c, 0.3 + 0.25 * k) for k in range(36) for c in (stored, fresh)]
            done = await asyncio.gather(*waits)
            await watch
        await probe.close()
        (at,) = back
        assert at - t0 > 2.0, "no election: the stream took publishes at once"
        late = {
            name: [round(end - max(sent, at), 2) for sent, end in done[i::2]]
            for i, name in enumerate(("stored", "fresh"))
        }
        # After the election: the next try within ``_SUBMIT_PAUSE_MAX`` (0.5 s); a fresh
        # client's first 503 of a submission waits up to ``_STREAM_CHECK`` (1 s) more.
        assert max(late["stored"]) < 1.0, late
        assert max(late["fresh"]) < 2.0, late
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.timeout(120)
async def test_a_caller_on_a_server_cut_off_from_its_cluster_moves_and_is_served(
    tmp_path: Path,
) -> None:
    """A partition: the caller's server loses its routes to the other two, which keep the
    workflow stream (its leader is there). nats-py stays on its server (the connection is
    fine) and every submission was answered 503 for the whole cut (chaos seed 202: 9 s), or,
    when that server led the stream, taken and never committed. The server's INFO then lists
    no other server: the caller leaves it, and its submissions are stored on the other side."""
    relays: dict[tuple[int, int], Any] = {}
    nodes = cluster_nodes(tmp_path, name="cutcaller", route_relays=relays)
    for relay in relays.values():
        await relay.start()
    cut = nodes[1]
    try:
        nc = await _started(nodes)
        try:
            js = nc.jetstream(timeout=5.0)
            await js.add_stream(_WF_STREAM)
            preferred = json.dumps({"placement": {"preferred": "n0"}}).encode()

            async def led_by_n0() -> bool:
                with contextlib.suppress(nats.errors.Error):
                    info = await js.stream_info(protocol.STREAM_WF)
                    replicas = [] if info.cluster is None else info.cluster.replicas or []
                    if info.cluster is not None and info.cluster.leader == "n0":
                        return len(replicas) == 2 and all(r.current for r in replicas)
                    await nc.request(
                        f"$JS.API.STREAM.LEADER.STEPDOWN.{protocol.STREAM_WF}", preferred
                    )
                return False

            await eventually(led_by_n0, timeout=30, interval=0.5)
        finally:
            await nc.close()
        # Given the cut-off server's URL alone: the others are those its INFO told of.
        settings = MeshSettings(nats_url=cut.url, namespace="cutcaller")
        async with Client(settings=settings) as client:
            await client.submit_fanout(_STEPS)
            assert client.nc.connected_url is not None
            assert client.nc.connected_url.netloc == cut.url.split("//")[1]
            for (i, j), relay in relays.items():
                if 1 in (i, j):
                    await relay.cut()
            try:
                t0 = time.monotonic()
                await client.submit_fanout(_STEPS)
                took = time.monotonic() - t0
                assert client.nc.connected_url is not None
                moved_to = client.nc.connected_url.netloc
            finally:
                for (i, j), relay in relays.items():
                    if 1 in (i, j):
                        await relay.start()
        assert moved_to != cut.url.split("//")[1]
        assert took < 4.0, took
    finally:
        for node in nodes:
            node.stop()
        for relay in relays.values():
            with contextlib.suppress(Exception):
                await relay.cut()


async def _started(nodes: list[EmbeddedNats]) -> NATS:
    """Start ``nodes``; a connection to the first once the cluster has a JetStream meta
    leader (to make the stream with)."""
    for node in nodes:
        node.start()
    await _js_ready(nodes[0].url)
    return await nats.connect(servers=[nodes[0].url], dont_randomize=True)


@pytest.mark.parametrize(
    ("listed", "cut"),
    [
        ([3, 1], True),  # cut off from both others of three
        ([5, 2], True),  # on the minority's side of five
        ([6, 2], True),  # three servers with two addresses each, one cut off
        ([3, 2, 1], True),  # one peer gone, then the other: a majority lost
        ([2, 1], False),  # one peer of two restarting: no majority to lose
        ([4, 2], False),  # the same with two addresses each
        ([5, 3], False),  # the majority's side of five
        ([3, 2], False),  # lame duck's INFO (its own URL left out), or one peer restarting
        ([3, 0], False),  # no URL advertised: nothing said of its routes
    ],
)
async def test_a_server_is_cut_off_when_it_lists_fewer_than_half_the_urls_it_listed(
    nats_url: str, listed: list[int], cut: bool
) -> None:
    """The rule ``_Connection._process_info`` applies to each INFO a caller's server sends: a
    cut is most of the cluster's URLs lost, not any route (the server's INFOs are given as a
    cluster's server would send them; the caller's own connection is real)."""
    from reach_mesh._nats import connect

    nc = await connect(nats_url, name="cut-rule", leave_cut_off=True)
    seen: list[int] = []
    try:
        nc.on_cut_off = lambda: seen.append(1)  # type: ignore[attr-defined]
        first, *then = listed
        urls = [f"192.0.2.{i}:4222" for i in range(1, max(listed) + 1)]
        await nc._process_info({"connect_urls": urls[:first]}, initial_connection=True)
        for n in then:
            await nc._process_info({"connect_urls": urls[:n]})
        assert bool(seen) is cut
    finally:
        await nc.close()
