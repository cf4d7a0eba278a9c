"""Hubs as NATS micro services: ``$SRV.PING`` / ``$SRV.INFO`` / ``$SRV.STATS`` list them with
their endpoints, and the ``agents`` endpoint answers with the fleet."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats

from reach_mesh import MeshSettings, protocol
from reach_mesh.hub import Hub

from .test_surfaces import fleet_agent


async def _gather(nc: Any, subject: str, wait: float = 0.5) -> list[dict[str, Any]]:
    """Every answer to one request within ``wait`` (micro discovery is scatter-gather)."""
    inbox = nc.new_inbox()
    answers: list[dict[str, Any]] = []
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, b"", reply=inbox)
    try:
        while True:
            msg = await sub.next_msg(timeout=wait)
            if msg.data:  # not the server's "no responders" status
                answers.append(json.loads(msg.data))
    except (TimeoutError, nats.errors.TimeoutError):
        pass
    finally:
        await sub.unsubscribe()
    return answers


async def test_hubs_answer_srv_ping_info_stats(settings: MeshSettings, namespace: str) -> None:
    assert settings.nats_url is not None
    async with (
        Hub(settings=settings, hub_id=f"micro-{namespace}-1") as h1,
        Hub(settings=settings, hub_id=f"micro-{namespace}-2") as h2,
        fleet_agent(f"{namespace}.w.a1", settings) as agent,
    ):
        nc = await nats.connect(settings.nats_url)
        try:
            ping = await _gather(nc, f"$SRV.PING.{protocol.MICRO_HUB_SERVICE}")
            assert len(ping) >= 2
            assert all(p["name"] == protocol.MICRO_HUB_SERVICE for p in ping)
            info = await _gather(nc, f"$SRV.INFO.{protocol.MICRO_HUB_SERVICE}")
            by_hub = {i["metadata"]["hub_id"]: i for i in info}
            assert {h1.hub_id, h2.hub_id} <= set(by_hub)
            endpoints = by_hub[h1.hub_id]["endpoints"]
            assert [e["name"] for e in endpoints] == ["agents"]
            assert endpoints[0]["subject"] == protocol.micro_subject(h1.hub_id, "agents")
            assert by_hub[h1.hub_id]["type"] == "io.nats.micro.v1.info_response"
            # The endpoint answers with this hub's view of the fleet.
            reply = await nc.request(protocol.micro_subject(h2.hub_id, "agents"), b"", timeout=5)
            fleet = json.loads(reply.data)
            assert fleet["hub_id"] == h2.hub_id
            assert agent.agent_id in [a["agent_id"] for a in fleet["agents"]]
            stats = await _gather(nc, f"$SRV.STATS.{protocol.MICRO_HUB_SERVICE}")
            counted = {
                s["metadata"]["hub_id"]: s["endpoints"][0]["num_requests"]
                for s in stats
                if s.get("metadata")
            }
            assert counted.get(h2.hub_id) == 1
        finally:
            await nc.close()
    # Closed hubs withdraw.
    nc = await nats.connect(settings.nats_url)
    try:
        await asyncio.sleep(0.1)
        info = await _gather(nc, f"$SRV.INFO.{protocol.MICRO_HUB_SERVICE}", wait=0.3)
        assert not {h1.hub_id, h2.hub_id} & {i["metadata"]["hub_id"] for i in info}
    finally:
        await nc.close()


async def test_cli_agents_via_micro(settings: MeshSettings, namespace: str) -> None:
    import os
    import subprocess
    import sys

    assert settings.nats_url is not None
    async with (
        Hub(settings=settings, hub_id=f"cli-{namespace}") as hub,
        fleet_agent(f"{namespace}.w.a1", settings) as agent,
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "OTEL_"))}
        argv = [sys.executable, "-m", "reach_mesh.cli", "agents", "--via-micro"]
        argv += ["--nats", settings.nats_url, "--namespace", namespace]
        run = await asyncio.to_thread(
            subprocess.run, argv, env=env, capture_output=True, text=True, timeout=60
        )
        # `hubs`: the live hubs alone, a dead one simply no longer answers.
        argv = [sys.executable, "-m", "reach_mesh.cli", "hubs", "--nats", settings.nats_url]
        hubs = await asyncio.to_thread(
            subprocess.run, argv, env=env, capture_output=True, text=True, timeout=60
        )
    assert run.returncode == 0, run.stderr
    assert hub.hub_id in run.stdout and agent.agent_id in run.stdout, run.stdout
    assert hubs.returncode == 0, hubs.stderr
    header, *rows = hubs.stdout.splitlines()
    assert header.split() == ["HUB", "VERSION", "HTTP", "AGENTS"]
    assert any(row.split()[0] == hub.hub_id for row in rows), hubs.stdout
