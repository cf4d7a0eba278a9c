"""A fleet query answers what fits in one NATS message, and says what it left out; an answer
too large to send is a typed error, never a silent timeout. Against a real nats-server whose
``max_payload`` is 64 KiB (nats-server's default is 1 MiB: ~2,500 agents), so a few hundred
agents are more than one answer holds."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._client_fleet import AgentList
from reach_mesh.errors import BadRequestError, PayloadTooLargeError
from reach_mesh.hub import Hub
from reach_mesh.hub._micro import discover_hubs
from reach_mesh.models import AgentCard
from reach_mesh.server import EmbeddedNats

from .helpers import register_cards, run_cli

MAX_PAYLOAD = 64 << 10
AGENTS = 300
OTHER = 10  # of them serve kb:other:v1 instead


def _card(ns: str, i: int) -> AgentCard:
    return AgentCard(
        agent_id=f"{ns}.svc.a{i:03d}",
        capabilities=["kb:other:v1" if i < OTHER else "kb:search:v1"],
        labels={"zone": f"z{i % 4}", "team": "search", "pad": "x" * 120},
        max_concurrency=8,
    )


async def _register(url: str, ns: str) -> None:
    """``AGENTS`` agents registered by the wire protocol, with leases that outlive the test."""
    cards = [_card(ns, i) for i in range(AGENTS)]
    await register_cards(url, cards, heartbeat_interval=5, lease_timeout=60)


async def _paged(c: Client, first: AgentList, *, by_offset: bool) -> list[str]:
    """The agent ids of ``first`` and of every page after it, asked by ``offset`` or ``after``."""
    seen = [i.agent_id for i in first]
    page = first
    while (page.next_offset if by_offset else page.next_after) is not None:
        if by_offset:
            page = await c.agents(offset=page.next_offset or 0)
        else:
            page = await c.agents(after=page.next_after)
        seen += [i.agent_id for i in page]
    return seen


@pytest.fixture
async def small(tmp_path: Path, namespace: str) -> AsyncIterator[tuple[MeshSettings, Hub]]:
    async with EmbeddedNats(str(tmp_path), max_payload=MAX_PAYLOAD) as server:
        settings = MeshSettings(nats_url=server.url, namespace=namespace)
        async with Hub(settings=settings) as hub:
            await _register(server.url, namespace)
            yield settings, hub


async def test_fleet_query_is_cut_to_one_message_and_pages(
    small: tuple[MeshSettings, Hub], namespace: str
) -> None:
    settings, hub = small
    ids = [_card(namespace, i).agent_id for i in range(AGENTS)]
    async with Client(settings=settings) as c:
        first = await c.agents()
        # Cut to fit, in agent id order, saying so (nothing in the old answer but the list:
        # which could not be sent, and the caller timed out).
        assert first.truncated and 0 < len(first) < AGENTS
        assert (first.total, first.matched) == (AGENTS, AGENTS)
        assert [i.agent_id for i in first] == ids[: len(first)]
        assert first.next_offset == len(first)
        assert first.by_state == {"ONLINE": AGENTS}
        # Paged: every agent once.
        assert await _paged(c, first, by_offset=True) == ids
        # The operator's list of every namespace is cut the same way.
        every = await c.fleet(all_namespaces=True)
        assert every["truncated"] and every["total"] >= AGENTS
        assert len(protocol.dumps(every)) <= MAX_PAYLOAD
        # Filters and counts.
        other = await c.agents(capability="kb:other:v1")
        assert [i.agent_id for i in other] == ids[:OTHER] and not other.truncated
        assert (other.matched, other.total) == (OTHER, AGENTS)
        for agent_id in ids[-3:]:
            await c.admin("cordon", agent_id)
        cordoned = await c.agents(state=["cordoned"])
        assert [i.agent_id for i in cordoned] == ids[-3:]
        counted = await c.agents(limit=0)
        assert list(counted) == [] and counted.truncated and counted.next_offset == 0
        assert counted.by_state == {"CORDONED": 3, "ONLINE": AGENTS - 3}
        assert len(await c.agents(limit=7, offset=5)) == 7
        with pytest.raises(BadRequestError) as bad:
            await c.agents(limit=-1)
        assert bad.value.details.get("field") == "limit"
        # NATS micro discovery's view of the fleet: cut the same way, with its counts.
        hubs = await discover_hubs(c.nc)
        fleet = next(h["fleet"] for h in hubs if h["metadata"]["hub_id"] == hub.hub_id)
        assert fleet["truncated"] and fleet["total"] >= AGENTS and "blind" in fleet


async def test_cli_shows_the_cut_and_doctor_counts(
    small: tuple[MeshSettings, Hub], namespace: str, tmp_path: Path
) -> None:
    settings, _ = small
    url = str(settings.nats_url)
    out = await run_cli(url, "agents", "--namespace", namespace)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert f"of {AGENTS} agents" in last and "--after" in last and "--state" in last
    # The page it points to starts after the last agent shown.
    shown_last = out.stdout.strip().splitlines()[-2].split()[1]  # (NS, AGENT, ...)
    after = last.split("--after ")[1].split()[0]
    assert after == shown_last
    nxt = await run_cli(url, "agents", "--namespace", namespace, "--after", after, "--json")
    assert json.loads(nxt.stdout)[0]["agent_id"] > after
    js = await run_cli(url, "agents", "--namespace", namespace, "--json")
    assert js.returncode == 0, js.stderr
    listed = json.loads(js.stdout)
    assert 0 < len(listed) < AGENTS and f"of {AGENTS} agents" in js.stderr
    snap_file = tmp_path / "snap.json"
    snap = await run_cli(url, "snapshot", "-o", str(snap_file))
    assert snap.returncode == 0, snap.stderr
    snapped: dict[str, Any] = json.loads(snap_file.read_text())
    assert len(snapped["agents"]) == AGENTS and not snapped["truncated"]  # paged through
    doctor = await run_cli(url, "doctor", "--json")
    checks = {c["check"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["agents"]["status"] == "ok", checks["agents"]
    assert f"{AGENTS} in every namespace" in checks["agents"]["detail"]
    assert checks["hubs"]["status"] == "ok", checks["hubs"]


async def test_pages_asked_after_the_last_id_miss_nobody_when_agents_leave(
    small: tuple[MeshSettings, Hub], namespace: str
) -> None:
    """Paging by ``offset`` counts positions: agents leaving before the next page is asked
    shift the rest, and as many that stayed are never listed. Paging ``after`` the last agent
    id shown lists every agent that stayed, once (what ``snapshot`` does)."""
    settings, _ = small
    ids = [_card(namespace, i).agent_id for i in range(AGENTS)]
    async with Client(settings=settings) as c:
        first = await c.agents()
        assert first.truncated and first.next_after == first[-1].agent_id
        for info in first[:5]:
            await c.admin("remove", info.agent_id)
        assert first.next_offset is not None
        by_offset = await c.agents(offset=first.next_offset)
        assert by_offset[0].agent_id == ids[len(first) + 5]  # five that stayed, skipped
        assert await _paged(c, first, by_offset=False) == ids
        # ``after`` with the other filters; an id no agent has any more is a place in the order.
        assert (await c.agents(after=ids[0], limit=1))[0].agent_id == ids[5]
        tail = await c.agents(after=ids[-4], limit=2)
        assert [i.agent_id for i in tail] == ids[-3:-1] and tail.next_after == ids[-2]
        with pytest.raises(BadRequestError) as bad:
            await c.agents(after="Not An Id")
        assert bad.value.details.get("field") == "after"


async def test_an_answer_too_large_to_send_is_a_typed_error(
    small: tuple[MeshSettings, Hub], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """Whatever a hub answers: one over max_payload is REACH_PAYLOAD_TOO_LARGE at once (and a
    WARNING), not a publish error swallowed and a caller waiting out its timeout."""
    settings, hub = small
    huge = b'{"x":"' + b"y" * MAX_PAYLOAD + b'"}'
    monkeypatch.setattr(hub, "_fleet", lambda *_: huge)
    # (the micro endpoint's answer is cut to fit too: made too large here)
    monkeypatch.setattr("reach_mesh.hub._micro.fleet_answer", lambda *_: huge, raising=False)
    caplog.set_level(logging.WARNING, logger="reach_mesh.hub")
    async with Client(settings=settings) as c:
        began = time.monotonic()
        with pytest.raises(PayloadTooLargeError) as err:
            await c.agents()
        assert time.monotonic() - began < 2.0
        assert err.value.details["max_size"] == MAX_PAYLOAD
        assert "max_payload" in err.value.message
        answer = await c.nc.request(protocol.micro_subject(hub.hub_id, "agents"), b"", timeout=5)
        assert json.loads(answer.data)["error"]["code"] == "REACH_PAYLOAD_TOO_LARGE"
    assert any("exceeds NATS max_payload" in r.getMessage() for r in caplog.records)
