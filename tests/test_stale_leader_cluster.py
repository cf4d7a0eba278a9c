"""The step-down a hub asks of the submissions consumer's leader (``hub/_stale_leader.py``), on
a real 3-node cluster in secure mode: the hub identity may send it, and it moves the leader.

A replica that diverged and never catches up cannot be made on purpose here (chaos: nats-server
2.15.1 after a partition); the decision is tested apart (``tests/test_stale_leader.py``), and
here a watch that finds the leader stale at its first look stands in for it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from nats.js.api import ConsumerInfo, StreamInfo

from reach_mesh import protocol
from reach_mesh._auth import AuthDir
from reach_mesh.config import MeshSettings
from reach_mesh.hub import Hub, _wf_keepalive
from reach_mesh.hub._stale_leader import StaleLeaderWatch, Verdict, step_down

from .helpers import cluster_nodes, eventually
from .test_wary_leader_read import _js_ready_as

_NS = "sl"


@pytest.mark.xdist_group("clusters")
@pytest.mark.timeout(180)
async def test_a_hub_moves_the_submissions_consumers_leader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace=_NS)
    nodes = cluster_nodes(tmp_path, name="sl", auth_config=auth.auth_conf)
    for node in nodes:
        node.start()
    asked: list[Verdict] = []

    class Stale(StaleLeaderWatch):
        """Finds the consumer's leader stale at its first look with one (once)."""

        def observe(self, stream: StreamInfo, consumer: ConsumerInfo, now: float) -> Verdict | None:
            leader = consumer.cluster.leader if consumer.cluster is not None else None
            if asked or not leader:
                return None
            other = next(f"n{i}" for i in range(3) if f"n{i}" != leader)
            asked.append(Verdict(leader, other, "made stale by the test"))
            return asked[-1]

    monkeypatch.setattr(_wf_keepalive, "SUBMISSIONS_EVERY", 0.2)
    monkeypatch.setattr(_wf_keepalive, "StaleLeaderWatch", Stale)
    try:
        fields = dict(
            nats_url=nodes[0].url,
            namespace=_NS,
            kv_replicas=3,
            heartbeat_interval=0.5,
            audit_enabled=False,
        )
        settings: MeshSettings = auth.settings("hub", "main", **fields)
        nc = await _js_ready_as(settings)
        js = nc.jetstream(timeout=5.0)

        async def leader() -> str | None:
            try:
                info = await js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS)
            except Exception:
                return None
            return info.cluster.leader if info.cluster is not None else None

        try:
            with caplog.at_level(logging.WARNING, logger="reach_mesh.hub.workflows"):
                async with Hub(settings=settings, hub_id="hub-sl"):
                    await eventually(lambda: bool(asked), timeout=30, interval=0.2)
                    verdict = asked[0]
                    # The hub's own step-down, as the hub identity, moved it off the stale
                    # server. Where it lands is the server's election: the preferred server is
                    # asked to campaign at once, but on a loaded machine another can win, so
                    # only "off the stale one" is the promise.
                    seen: list[str | None] = []

                    async def moved() -> bool:
                        seen.append(await leader())
                        return seen[-1] is not None and seen[-1] != verdict.server

                    await eventually(moved, timeout=40, interval=0.2)
                    await eventually(
                        lambda: any(
                            "asked it to step down, done" in r.getMessage() for r in caplog.records
                        ),
                        timeout=5,
                    )
                    line = next(r for r in caplog.records if "step down" in r.getMessage())
                    assert line.levelno == logging.WARNING
                    assert verdict.server in line.getMessage()
                    # A second hub that saw the same stale leader asks after the move (its
                    # verdict names the stale server and prefers the new leader): not asked,
                    # and the healthy leader stays.
                    now = seen[-1]
                    said = await step_down(
                        nc, protocol.STREAM_WF, protocol.CONSUMER_HUBS, now, of=verdict.server
                    )
                    assert said == f"not asked: {now} leads it now", said
                    await asyncio.sleep(1.0)
                    assert await leader() == now
                    # Asked again by the helper, with no preference: it moves off that one.
                    said = await step_down(nc, protocol.STREAM_WF, protocol.CONSUMER_HUBS, None)
                    assert said == "done", said

                    async def off() -> bool:
                        got = await leader()
                        return got is not None and got != now

                    await eventually(off, timeout=40, interval=0.2)
                    # A preference for the leader itself is refused by the server; the helper
                    # asks again with none, which it takes.
                    here = await leader()
                    said = await step_down(nc, protocol.STREAM_WF, protocol.CONSUMER_HUBS, here)
                    assert said == "done", said
        finally:
            await nc.close()
    finally:
        for node in nodes:
            node.stop()
