"""A lease is at least ``MIN_LEASE_TIMEOUT`` renewed at least every ``MIN_HEARTBEAT_INTERVAL``:
hubs write an agent's unchanged beats to the registry at most every 50 ms, and the other hubs
renew its lease by those writes only. A registration of a 30 ms lease (the model took any
positive one) had every other hub grade the agent SUSPECT and ONLINE again between two writes
— 11 changes in 2 s on one of two hubs — and is refused now, ``REACH_BAD_LEASE``, nothing
registered."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from reach_mesh import BadLeaseError, MeshSettings, protocol
from reach_mesh.hub import Hub
from reach_mesh.models import MIN_HEARTBEAT_INTERVAL, MIN_LEASE_TIMEOUT

from .helpers import eventually, states_of


def _register(agent_id: str, heartbeat_interval: float, lease_timeout: float) -> bytes:
    body = {
        "card": {"agent_id": agent_id, "capabilities": ["lm:echo:v1"]},
        "session": "s1",
        "heartbeat_interval": heartbeat_interval,
        "lease_timeout": lease_timeout,
    }
    return json.dumps(body).encode()


async def _ask(nc: NATS, subject: str, body: bytes) -> dict[str, Any]:
    msg = await nc.request(subject, body, timeout=5)
    out: dict[str, Any] = json.loads(msg.data)
    return out


@pytest.mark.parametrize(
    ("interval", "lease", "field"),
    [
        (0.01, 0.03, "heartbeat_interval"),  # 3 x the interval: the old rule took it
        (0.0001, 3.0, "heartbeat_interval"),
        (MIN_HEARTBEAT_INTERVAL, 0.3, "lease_timeout"),
        (MIN_HEARTBEAT_INTERVAL, MIN_LEASE_TIMEOUT - 0.01, "lease_timeout"),
    ],
)
async def test_a_lease_shorter_than_the_registry_writes_is_refused(
    hub: Hub, nc: NATS, namespace: str, interval: float, lease: float, field: str
) -> None:
    agent_id = f"{namespace}.svc.short"
    subject = protocol.hub_agent_subject(agent_id, "register")
    out = await _ask(nc, subject, _register(agent_id, interval, lease))
    err = out.get("error")
    assert err is not None, out
    assert err["code"] == "REACH_BAD_LEASE", err
    assert err["details"]["field"] == field, err
    assert "below the minimum" in err["message"], err
    assert agent_id not in hub.registry.agents
    reads = hub.registry._reads
    assert reads is not None
    assert await reads.kv_get_stored(protocol.KV_AGENTS, agent_id) is None


async def test_an_agent_at_the_minimum_lease_stays_online_on_every_hub(
    settings: MeshSettings, nc: NATS, namespace: str
) -> None:
    """At the minimums, beating every interval, the agent's lease never lapses on either hub,
    the one that takes a beat or the other one that reads its write."""
    agent_id = f"{namespace}.svc.least"
    register = _register(agent_id, MIN_HEARTBEAT_INTERVAL, MIN_LEASE_TIMEOUT)
    async with Hub(settings=settings) as a, Hub(settings=settings) as b:
        out = await _ask(nc, protocol.hub_agent_subject(agent_id, "register"), register)
        assert out.get("state") == "ONLINE", out
        await eventually(lambda: all(agent_id in h.registry.agents for h in (a, b)))
        changes = {hub.hub_id: states_of(hub, agent_id) for hub in (a, b)}
        beat = json.dumps({"agent_id": agent_id, "session": "s1"}).encode()
        subject = protocol.hub_agent_subject(agent_id, "heartbeat")
        for _ in range(15):
            answer = await _ask(nc, subject, beat)
            assert answer.get("state") == "ONLINE", answer
            await asyncio.sleep(MIN_HEARTBEAT_INTERVAL)
        assert all(not seen for seen in changes.values()), changes
        bye = json.dumps({"agent_id": agent_id, "session": "s1"}).encode()
        await nc.request(protocol.hub_agent_subject(agent_id, "unregister"), bye, timeout=5)


def test_settings_below_the_minimum_are_refused() -> None:
    """An agent's settings a hub would refuse fail when built, not at every registration."""
    with pytest.raises(BadLeaseError, match=r"heartbeat_interval .* below the minimum"):
        MeshSettings(heartbeat_interval=0.01, lease_timeout=0.03)
    with pytest.raises(BadLeaseError, match=r"lease_timeout .* below the minimum"):
        MeshSettings(heartbeat_interval=0.1, lease_timeout=0.3)
    least = MeshSettings(heartbeat_interval=MIN_HEARTBEAT_INTERVAL, lease_timeout=MIN_LEASE_TIMEOUT)
    assert least.lease_timeout == MIN_LEASE_TIMEOUT
