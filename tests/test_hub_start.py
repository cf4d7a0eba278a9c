"""A hub comes up through a JetStream outage at start, and fails fast on what no wait mends.

Six chaos runs (seeds 163, 166, 168, 174-176) lost a hub that exited at start with a bare
``nats: timeout``: one JetStream request of its setup went unanswered (the hubs were creating
the same streams at once, on a cluster just formed). A hub now asks again for up to
``start_timeout`` (``reach_mesh/_starting.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import StreamConfig
from nats.js.kv import KeyValue

from reach_mesh import Client, MeshSettings
from reach_mesh._auth import AuthDir
from reach_mesh._consume import ensure_stream
from reach_mesh._nats import ensure_kv
from reach_mesh._starting import starting
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import BadRequestError, MeshUnavailableError, NotPermittedError
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats

from .helpers import cluster_nodes, eventually, freeze

# Clusters of nats-servers: one at a time (with the other cluster tests).
pytestmark = pytest.mark.xdist_group("clusters")

NS = "hstart"
FAST: dict[str, Any] = {
    "heartbeat_interval": 0.5,
    "lease_timeout": 3.0,
    "suspect_timeout": 3.0,
    "request_timeout": 10.0,
}


@contextlib.asynccontextmanager
async def _without_quorum(base: Path, name: str) -> AsyncIterator[list[EmbeddedNats]]:
    """A 3-node cluster whose nodes 1 and 2 are frozen (SIGSTOP) once it has a JetStream meta
    leader, and whose node 0 has since answered a JetStream request "unavailable" (no quorum),
    as a hub starting on it is answered; :func:`thaw` them. All stopped at the end."""
    nodes = cluster_nodes(base, name=name)
    try:
        for node in nodes:
            await node.astart()
        nc = await nats.connect(nodes[0].url)
        try:
            js = nc.jetstream(timeout=1.0)
            await _until(js.account_info, lambda err: False, "no JetStream meta leader")
            for node in nodes[1:]:
                assert node.proc is not None
                await freeze(node.proc.pid, group=True)
            unavailable = nats.js.errors.ServiceUnavailableError
            # The lone node, if it led the meta group, leads on until it finds it lost its
            # quorum — some ten seconds, more on a loaded machine (CI: over 15 s).
            await _until(
                lambda: js.stream_info("NOT_THERE"),
                lambda err: isinstance(err, unavailable),
                "the lone node still answers JetStream",
                within=60.0,
            )
        finally:
            await nc.close()
        yield nodes
    finally:
        thaw(nodes)
        for node in nodes:
            node.stop()


def thaw(nodes: list[EmbeddedNats]) -> None:
    """SIGCONT every node (those not frozen too)."""
    for node in nodes:
        if node.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGCONT)


async def _until(
    ask: Callable[[], Awaitable[object]],
    awaited: Callable[[Exception], bool],
    why: str,
    *,
    within: float = 15.0,
) -> None:
    """Ask until ``ask`` succeeds or fails with an error ``awaited`` wants (``within`` s at
    most)."""
    deadline = time.monotonic() + within
    while True:
        try:
            await ask()
            return
        except (nats.errors.Error, TimeoutError) as err:
            if awaited(err):
                return
            assert time.monotonic() < deadline, why
            await asyncio.sleep(0.2)


async def test_a_hub_started_while_the_cluster_has_no_quorum_serves_once_it_has(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two of three nodes frozen (SIGSTOP): the lone node answers the hub's JetStream setup
    "temporarily unavailable" (or not at all), and the hub's start failed at once. It now
    says what it waits for, asks again, and serves routes once the nodes are back."""
    async with _without_quorum(tmp_path, "hstart") as nodes:
        settings = MeshSettings(
            nats_url=nodes[0].url, namespace=NS, kv_replicas=3, start_timeout=30.0, **FAST
        )
        hub = Hub(settings=settings, hub_id="hub-patient")
        caplog.set_level(logging.INFO, logger="reach_mesh.start")
        starting = asyncio.create_task(hub.start())
        await asyncio.sleep(2.0)
        assert not starting.done(), starting  # (without the retries: failed by now)
        waits = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert waits and "not set up yet" in waits[0].getMessage(), caplog.text
        thaw(nodes)
        await asyncio.wait_for(starting, timeout=20)
        try:
            agent = Agent(f"{NS}.echo.a1", settings=settings)

            @agent.handler("hstart:echo:v1")
            async def echo(task: Task[Any]) -> Any:
                return task.payload

            async with agent, Client(settings=settings) as c:
                reply = await c.request(capability="hstart:echo:v1", payload=7)
                assert reply.result == 7
        finally:
            await hub.close()


@contextlib.asynccontextmanager
async def _leader_alone(base: Path, name: str) -> AsyncIterator[list[EmbeddedNats]]:
    """A 3-node cluster whose JetStream meta leader (first in the list) saw its two peers shut
    down (SIGTERM: each says so as it goes): it leads on, and until they are back answers a
    replicated create "no suitable peers for placement, peer offline" (400, err_code 10005)
    and a bind "not found" — what a lone node answered a starting hub in ci180. All stopped at
    the end."""
    nodes = cluster_nodes(base, name=name, http=True)
    try:
        for node in nodes:
            await node.astart()
        leader = await _meta_leader(nodes[0])
        nodes.sort(key=lambda node: node.server_name != leader)
        for node in nodes[1:]:
            node.stop()
        nc = await nats.connect(nodes[0].url)
        try:
            js = nc.jetstream(timeout=2.0)
            for i in itertools.count():
                config = StreamConfig(name=f"PROBE{i}", subjects=[f"probe.{i}"], num_replicas=3)
                try:
                    await js.add_stream(config)
                except nats.js.errors.BadRequestError as err:
                    if err.err_code == 10005:
                        break
                assert i < 50, "the leader still places replicated streams with no peer up"
                await asyncio.sleep(0.2)
        finally:
            await nc.close()
        yield nodes
    finally:
        for node in nodes:
            node.stop()


async def _meta_leader(node: EmbeddedNats) -> str:
    """The name of the JetStream meta leader, as ``node``'s monitoring endpoint says, once
    there is one."""

    def ask() -> str | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/jsz", timeout=2) as got:
            leader: str | None = (json.load(got).get("meta_cluster") or {}).get("leader")
            return leader

    deadline = time.monotonic() + 15.0
    while (leader := await asyncio.to_thread(ask)) is None:
        assert time.monotonic() < deadline, "no JetStream meta leader"
        await asyncio.sleep(0.2)
    return leader


async def test_a_bucket_or_stream_no_peers_can_hold_yet_is_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ci180: a replicated bucket asked of a meta leader whose peers are away was answered
    "not found" (bind), "no suitable peers for placement, peer offline" (create, 400) and "not
    found" again (bind): taken for a refusal, the start failed at once (``BadRequestError``:
    "JetStream refused to set up bucket"). It is an outage: the start waits, saying why, and
    binds the bucket once the peers are back. So for a stream, which 9dc583b left failing at
    once ("stream not found")."""
    async with _leader_alone(tmp_path, "hplace") as nodes:
        nc = await nats.connect(nodes[0].url)
        try:
            js = nc.jetstream(timeout=2.0)
            caplog.set_level(logging.INFO, logger="reach_mesh.start")

            async def bucket() -> KeyValue:
                with starting("hub hub-placed", 60.0):
                    return await ensure_kv(js, "reach_agents", replicas=3)

            async def stream() -> None:
                with starting("hub hub-placed", 60.0):
                    config = StreamConfig(name="PLACED", subjects=["placed.>"], num_replicas=3)
                    await ensure_stream(js, config)

            def waits() -> list[str]:
                return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

            making = [asyncio.create_task(bucket()), asyncio.create_task(stream())]
            await eventually(lambda: any(t.done() for t in making) or len(waits()) == 2, timeout=30)
            assert not any(t.done() for t in making), making  # (refused: failed at once)
            for what in ("bucket reach_agents", "stream PLACED"):
                said = [w for w in waits() if f"{what} not set up yet" in w]
                assert said and "peer offline" in said[0], caplog.text
            for node in nodes[1:]:
                await node.astart()
            await asyncio.wait_for(asyncio.gather(*making), timeout=30)
            for name in ("KV_reach_agents", "PLACED"):
                assert (await js.stream_info(name)).config.num_replicas == 3
        finally:
            await nc.close()


async def test_a_hub_gives_up_naming_what_it_could_not_set_up(tmp_path: Path) -> None:
    """The same lone node, never healed: past ``start_timeout`` the start fails with
    ``REACH_UNAVAILABLE`` naming the stream or bucket, not a bare ``nats: timeout``."""
    async with _without_quorum(tmp_path, "hgive") as nodes:
        settings = MeshSettings(
            nats_url=nodes[0].url, namespace=NS, kv_replicas=3, start_timeout=1.5, **FAST
        )
        hub = Hub(settings=settings, hub_id="hub-gives-up")
        began = time.monotonic()
        with pytest.raises(MeshUnavailableError) as caught:
            await hub.start()
        assert time.monotonic() - began < 12.0  # (one request's 10 s timeout at most past it)
        said = caught.value.message
        assert "hub hub-gives-up could not set up" in said and "start_timeout" in said, said
        assert any(w in said for w in ("stream ", "bucket ")), said


async def test_a_hub_refused_the_jetstream_api_fails_at_once(tmp_path: Path) -> None:
    """An identity NATS refuses the JetStream API (a caller's, here) is not asked again until
    ``start_timeout``: the refusal ends the start at once, ``REACH_NOT_PERMITTED`` naming the
    subject (it was a request timing out, ``nats: timeout``, after 10 s)."""
    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace=NS)
    with EmbeddedNats(tmp_path / "store", auth_config=auth.auth_conf) as server:
        settings = auth.settings("caller", NS, nats_url=server.url, start_timeout=60.0)
        hub = Hub(settings=settings, hub_id="hub-refused")
        began = time.monotonic()
        with pytest.raises(NotPermittedError) as caught:
            await hub.start()
        assert time.monotonic() - began < 5.0
        assert "$js.api." in caught.value.message, caught.value.message


@pytest.mark.parametrize(
    ("stream", "said"),
    [
        (
            StreamConfig(name="KV_reach_agents", subjects=["by.hand.>"]),
            "stream KV_reach_agents is not a key-value bucket",
        ),
        (
            StreamConfig(name="BY_HAND", subjects=["$KV.reach_agents.>"]),
            "stream BY_HAND takes its subjects ($KV.reach_agents.>)",
        ),
    ],
    ids=["plain stream of its name", "stream taking its subjects"],
)
async def test_a_hub_whose_bucket_clashes_with_a_stream_fails_at_once_naming_it(
    tmp_path: Path, stream: StreamConfig, said: str
) -> None:
    """A stream made by hand where a bucket of the hub's goes — a plain stream of the bucket's
    stream's name, or one that takes the bucket's subjects — is no outage: the start fails at
    once (``REACH_BAD_REQUEST``) saying what is in the way, not at ``start_timeout``. (Taking
    the bucket's subjects, the create is refused and the bind finds nothing, as when no peers
    can hold it: 9dc583b waited that out to the deadline, saying "JetStream did not answer".)
    A plain stream of its name said only ``BadBucketError()``."""
    with EmbeddedNats(tmp_path / "store") as server:
        nc = await nats.connect(server.url)
        try:
            await nc.jetstream().add_stream(stream)
        finally:
            await nc.close()
        settings = MeshSettings(nats_url=server.url, namespace=NS, start_timeout=60.0, **FAST)
        hub = Hub(settings=settings, hub_id="hub-clash")
        with pytest.raises(BadRequestError) as caught:
            await asyncio.wait_for(hub.start(), timeout=20)
        message = caught.value.message
        assert "cannot start" in message and "bucket reach_agents" in message, message
        assert said in message, message


async def test_a_hub_asking_for_replicas_a_lone_server_cannot_hold_fails_at_once(
    tmp_path: Path,
) -> None:
    """``kv_replicas: 3`` against one nats-server (not clustered) is a setting to mend, not an
    outage: nats-server answers 500 "replicas > 1 not supported in non-clustered mode" (err_code
    10074), which was asked again until ``start_timeout``. The start fails at once
    (``REACH_BAD_REQUEST``) with the server's words."""
    with EmbeddedNats(tmp_path / "store") as server:
        settings = MeshSettings(
            nats_url=server.url, namespace=NS, kv_replicas=3, start_timeout=60.0, **FAST
        )
        hub = Hub(settings=settings, hub_id="hub-replicas")
        began = time.monotonic()
        with pytest.raises(BadRequestError) as caught:
            await asyncio.wait_for(hub.start(), timeout=20)
        assert time.monotonic() - began < 10.0
        message = caught.value.message
        assert "non-clustered" in message and "kv_replicas" in message, message


_FRESH_HUB = """
import asyncio, json, sys
from reach_mesh import MeshSettings
from reach_mesh.hub import Hub, _hub

joined = []  # for each connection the hub made: were the HTTP app's modules imported yet?
connect = _hub.connect


async def recording(*args, **kw):
    joined.append("reach_mesh.hub.http" in sys.modules)
    return await connect(*args, **kw)


_hub.connect = recording


async def main():
    s = MeshSettings(nats_url=sys.argv[1], namespace=sys.argv[2], http_port=0)
    async with Hub(settings=s) as hub:
        await asyncio.sleep(0.3)
        lag = hub.metrics.registry
        count = lag.get_sample_value("reach_event_loop_lag_seconds_count")
        within = lag.get_sample_value("reach_event_loop_lag_seconds_bucket", {"le": "1.0"})
    print(json.dumps({"joined": joined, "count": count, "within_1s": within}))


asyncio.run(main())
"""


async def test_a_hub_imports_its_http_app_before_it_joins_anything(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A hub with HTTP imports the HTTP app (FastAPI, MCP, A2A: 1-3 s of CPU here) before it
    connects, not after it subscribed to heartbeats, registrations and workflows: that import
    blocked the loop of a hub already serving, and its lag watch saw it — every hub start
    fired ``ReachEventLoopStalls`` (incident drill a, a killed hub restarted). In a fresh
    interpreter, as a restarted hub is (this process imported the app long ago)."""
    script = tmp_path / "fresh_hub.py"
    script.write_text(_FRESH_HUB)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        nats_url,
        namespace,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    said = json.loads(out.decode().strip().splitlines()[-1])
    assert said["joined"] and all(said["joined"]), said  # imported before the first connect
    # No lag sample over the alert's 1 s since the watch began (the import comes before it).
    assert said["count"] >= 1 and said["within_1s"] == said["count"], said
