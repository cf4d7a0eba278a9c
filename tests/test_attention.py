"""Which agents need an operator's look, and why (``AgentInfo.attention``; the fleet query's
``attention`` filter and ``attention_total`` count; ``GET /api/agents?attention=true``; the
dashboard's "need attention" card; ``reach-mesh agents --attention``). Each concern made for
real against a real hub: heartbeats by the wire protocol that say what the agent reports, an
operator's quarantine, a lease left to lapse, a task sent to an agent nobody serves."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._cli_doctor import diagnose
from reach_mesh.errors import ReachError
from reach_mesh.hub import Hub
from reach_mesh.hub._agent_view import ATTENTION
from reach_mesh.models import AgentCard, AgentState, Heartbeat

from .chromium import Chromium, needs_chromium
from .helpers import a_server_of_its_own, eventually, fetch, register_cards, run_cli

CAP = "kb:search:v1"
#: The agent ids of the dashboard's fleet table, as drawn.
ROWS = "[...document.querySelectorAll('#agents tr[data-agent]')].map(r => r.dataset.agent)"


@dataclass
class Fleet:
    hub: Hub
    settings: MeshSettings
    ns: str
    #: The session each agent registered with (its heartbeats name it).
    sessions: dict[str, str]

    def id(self, name: str) -> str:
        return f"{self.ns}.svc.{name}"

    async def http(self, path: str, **query: object) -> tuple[int, dict[str, object]]:
        assert self.hub.http_url is not None
        status, body = await fetch(f"{self.hub.http_url}{path}?{urlencode(query, doseq=True)}")
        return status, json.loads(body)


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A server of this module's own: its agents hold leases of 120 s, which tests sharing
    their worker's server (and its hub, which sees every namespace) must not find there."""
    yield from a_server_of_its_own()


def _card(ns: str, name: str) -> AgentCard:
    return AgentCard(agent_id=f"{ns}.svc.{name}", capabilities=[CAP], max_concurrency=4)


async def _beat(url: str, beat: Heartbeat) -> None:
    nc = await nats.connect(url)
    try:
        subject = protocol.hub_agent_subject(beat.agent_id, "heartbeat")
        reply = await nc.request(subject, protocol.encode(beat), timeout=5)
        assert b'"error"' not in reply.data, reply.data
    finally:
        await nc.close()


#: The concerns the fixture makes, by agent: the one listed is what ``attention`` must say.
EXPECTED = {
    "down": ["unavailable"],
    "full": ["saturated"],
    "queued": ["saturated"],
    "quarantined": ["breaker_open"],
    "late": ["suspect"],
    # Cordoned by an operator, then its beats stopped: CORDONED, but late all the same.
    "cordoned_late": ["suspect"],
    "unreached": ["unreached"],
}
#: Registered with a short lease that lapses during the fixture (the others beat every 20 s).
LATE = ("late", "cordoned_late")


@pytest.fixture
async def fleet(nats_url: str, namespace: str) -> AsyncIterator[Fleet]:
    # A long suspect_timeout: the lapsed lease stays SUSPECT for the test (never LOST).
    settings = MeshSettings(
        nats_url=nats_url, namespace=namespace, http_port=0, suspect_timeout=120
    )
    async with Hub(settings=settings) as hub:
        steady = [_card(namespace, n) for n in ("fine", *EXPECTED) if n not in LATE]
        await register_cards(nats_url, steady, heartbeat_interval=20, lease_timeout=120)
        # (``register_cards`` names the sessions by their place in the list)
        f = Fleet(hub, settings, namespace, {c.agent_id: f"s{i}" for i, c in enumerate(steady)})
        await register_cards(
            nats_url,
            [_card(namespace, n) for n in LATE],
            heartbeat_interval=0.3,
            lease_timeout=1.0,
        )
        # What the agents report: a capability down, every slot busy, work waiting.
        reports: dict[str, dict[str, Any]] = {
            "down": {"unavailable": [CAP]},
            "full": {"inflight": 4},
            "queued": {"inflight": 1, "queue_depth": 3},
        }
        for name, report in reports.items():
            aid = f.id(name)
            beat = Heartbeat.model_validate(dict(report, agent_id=aid, session=f.sessions[aid]))
            await _beat(nats_url, beat)
        assert hub.http_url is not None
        status, body = await fetch(
            f"{hub.http_url}/api/agents/{f.id('quarantined')}/quarantine", "POST", b"{}"
        )
        assert status == 200, body
        status, body = await fetch(
            f"{hub.http_url}/api/agents/{f.id('cordoned_late')}/cordon", "POST", b"{}"
        )
        assert status == 200, body
        # Nobody serves the agent's task subject (registered by the wire, no process): a task
        # sent to it finds nobody there.
        async with Client(settings=settings) as c:
            with pytest.raises(ReachError):
                await c.request(agent_id=f.id("unreached"), payload={}, timeout=3)

        def suspect() -> bool:
            late = hub.registry.require(f.id("cordoned_late"))
            return (
                hub.registry.require(f.id("late")).state is AgentState.SUSPECT
                and late.state is AgentState.CORDONED
                and late.late
            )

        await eventually(suspect, timeout=10)
        yield f


async def test_the_agents_that_need_a_look_are_listed_with_why(fleet: Fleet) -> None:
    async with Client(settings=fleet.settings) as c:
        every = await c.agents()
        asked = await c.agents(attention=True)
        # Filters combine: the SUSPECT ones among those that need a look.
        late = await c.agents(attention=True, state="SUSPECT")
        # Anything but true or false, sent as it is: a typed refusal naming the field.
        subject = protocol.hub_subject(fleet.ns, "agents")
        refused = await c.nc.request(subject, b'{"attention": "yes"}', timeout=5)
    why = {i.agent_id: i.attention for i in every}
    assert why == {fleet.id("fine"): []} | {fleet.id(n): w for n, w in EXPECTED.items()}
    assert [i.agent_id for i in asked] == sorted(fleet.id(n) for n in EXPECTED)
    # Counted whatever the filters, as ``by_state`` is.
    assert every.attention_total == asked.attention_total == late.attention_total == len(EXPECTED)
    assert (asked.matched, asked.total) == (len(EXPECTED), len(EXPECTED) + 1)
    assert [i.agent_id for i in late] == [fleet.id("late")]
    err = json.loads(refused.data)["error"]
    assert err["code"] == "REACH_BAD_REQUEST" and err["details"]["field"] == "attention", err


async def test_http_and_the_dashboard_pick_the_same_agents(fleet: Fleet) -> None:
    want = sorted(fleet.id(n) for n in EXPECTED)
    status, listed = await fleet.http("/api/agents", namespace=fleet.ns, attention="true")
    assert status == 200 and listed["attention_total"] == len(EXPECTED), listed
    agents = listed["agents"]
    assert isinstance(agents, list) and [a["agent_id"] for a in agents] == want
    status, page = await fleet.http("/api/dashboard/fleet", namespace=fleet.ns, attention="true")
    assert (
        status == 200 and page["attention"] is True and page["attention_total"] == len(EXPECTED)
    ), page
    rows = page["agents"]
    assert isinstance(rows, list)
    assert {a["agent_id"]: a["attention"] for a in rows} == {
        fleet.id(n): w for n, w in EXPECTED.items()
    }
    status, everyone = await fleet.http("/api/dashboard/fleet", namespace=fleet.ns)
    assert status == 200 and everyone["matched"] == len(EXPECTED) + 1
    status, refused = await fleet.http("/api/agents", namespace=fleet.ns, attention="maybe")
    err = refused["error"]
    assert status == 400 and isinstance(err, dict) and err["code"] == "REACH_BAD_REQUEST", err


async def test_the_cli_says_how_many_need_a_look_and_lists_them(
    fleet: Fleet, nats_url: str
) -> None:
    plain = await run_cli(nats_url, "agents", "--namespace", fleet.ns)
    assert plain.returncode == 0, plain.stderr
    assert f"{len(EXPECTED)} of {len(EXPECTED) + 1} agents need attention" in plain.stdout
    only = await run_cli(nats_url, "agents", "--namespace", fleet.ns, "--attention")
    assert only.returncode == 0, only.stderr
    lines = only.stdout.splitlines()
    assert "ATTENTION" in lines[0]
    for name, concerns in EXPECTED.items():
        (row,) = [line for line in lines if f"{fleet.id(name)} " in line]
        assert ",".join(concerns) in row
    assert fleet.id("fine") not in only.stdout
    assert "need attention" not in only.stdout  # (the hint is for the unfiltered listing)


async def test_a_lapsed_lease_is_said_so_not_shown_negative(fleet: Fleet, nats_url: str) -> None:
    """``reach-mesh agents`` showed a SUSPECT agent's LEASE as ``-6.2s`` (the SRE
    walkthrough: time to go, or a bug?): a lapsed lease reads ``lapsed 6.2s ago`` — for a
    cordoned agent that stopped beating too, whose state does not show it. ``--json`` keeps
    the number (negative: seconds since it lapsed)."""
    plain = await run_cli(nats_url, "agents", "--namespace", fleet.ns)
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    column = lines[0].index("LEASE")
    for name in ("fine", *EXPECTED):
        (row,) = [line for line in lines if f"{fleet.id(name)} " in line]
        lease = row[column:].split("  ")[0]
        if name in LATE:
            assert re.fullmatch(r"lapsed \d+\.\ds ago", lease), row
        else:
            assert re.fullmatch(r"\d+\.\ds", lease), row
    listed = await run_cli(nats_url, "agents", "--namespace", fleet.ns, "--json")
    assert listed.returncode == 0, listed.stderr
    left = {a["agent_id"]: a["lease_left"] for a in json.loads(listed.stdout)}
    assert all(left[fleet.id(n)] < 0 for n in LATE), left
    assert left[fleet.id("fine")] > 100, left


async def test_an_agent_put_right_leaves_the_list(fleet: Fleet, nats_url: str) -> None:
    """Concerns are read as the agent stands: its next heartbeat clears what it reported."""
    aid = fleet.id("down")
    async with Client(settings=fleet.settings) as c:
        before = await c.agents(attention=True)
        assert aid in {i.agent_id for i in before}
        await _beat(nats_url, Heartbeat(agent_id=aid, session=fleet.sessions[aid]))
        after = await c.agents(attention=True)
    assert aid not in {i.agent_id for i in after}
    assert after.attention_total == before.attention_total - 1


@needs_chromium
async def test_the_dashboard_card_filters_the_fleet_to_them(fleet: Fleet) -> None:
    base = fleet.hub.http_url
    assert base is not None

    def operate() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        with Chromium() as browser:
            browser.watch_console()
            browser.open(f"{base}/?namespace={fleet.ns}")
            card = "document.querySelector('.card[data-filter=\"@attention\"]')"
            seen["card"] = browser.once(f"{card} && {card}.querySelector('b').textContent")
            seen["all"] = browser.once(f"(r => r.length === {len(EXPECTED) + 1} && r)({ROWS})")
            seen["lease"] = browser.evaluate(
                "Object.fromEntries([...document.querySelectorAll('#agents tr[data-agent]')]"
                ".map(r => [r.dataset.agent, r.cells[4].textContent.trim()]))"
            )
            browser.evaluate(f"{card}.click()")
            seen["picked"] = browser.once(f"(r => r.length === {len(EXPECTED)} && r)({ROWS})")
            seen["address"] = browser.evaluate("location.search")
            seen["box"] = browser.evaluate("document.getElementById('f-attn').checked")
            seen["why"] = browser.evaluate(
                "Object.fromEntries([...document.querySelectorAll('#agents tr[data-agent]')]"
                ".map(r => [r.dataset.agent, r.cells[7].textContent.trim()]))"
            )
            # The box unticked: every agent again.
            browser.evaluate(
                """(() => { const b = document.getElementById('f-attn'); b.checked = false;
                   b.dispatchEvent(new Event('change')); })()"""
            )
            seen["again"] = browser.once(f"(r => r.length === {len(EXPECTED) + 1} && r)({ROWS})")
            seen["errors"] = browser.console_errors()
        return seen

    seen = await asyncio.to_thread(operate)
    assert seen["errors"] == [], seen["errors"]
    assert seen["card"] == str(len(EXPECTED))
    # A lapsed lease is said so (it read "0.0 s", as if the lease were just running out).
    for agent_id, lease in seen["lease"].items():
        lapsed = agent_id in {fleet.id(n) for n in LATE}
        pattern = r"lapsed \d+\.\d s ago" if lapsed else r"\d+\.\d s"
        assert re.fullmatch(pattern, lease), seen["lease"]
    assert seen["picked"] == sorted(fleet.id(n) for n in EXPECTED)
    assert "attention=true" in seen["address"] and seen["box"] is True
    assert seen["why"] == {fleet.id(n): "".join(w) for n, w in EXPECTED.items()}
    assert fleet.id("fine") in seen["again"]


async def test_metrics_count_them_by_reason(fleet: Fleet) -> None:
    assert fleet.hub.http_url is not None
    status, body = await fetch(f"{fleet.hub.http_url}/metrics")
    assert status == 200
    counted = {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name == "reach_agents_attention" and s.labels["namespace"] == fleet.ns
    }
    want = {why: 0.0 for why in ATTENTION}  # every reason written, 0 when none
    for concerns in EXPECTED.values():
        for why in concerns:
            want[why] += 1
    assert counted == want


async def test_doctor_names_them_with_why(fleet: Fleet) -> None:
    """``reach-mesh doctor`` warns with how many need attention, the first five with why, and
    how many more (the module's earlier tests' agents on this server may be among them)."""
    found = {f.check: f for f in await diagnose(fleet.settings)}
    async with Client(settings=fleet.settings) as c:
        every = await c.agents(all_namespaces=True, limit=0)
    agents = found["agents"]
    count = every.attention_total
    assert agents.status == "warn" and count >= len(EXPECTED), agents
    assert f"; {count} need attention: " in agents.detail, agents
    named = dict(re.findall(r"([\w-]+\.[\w-]+\.[\w-]+) \(([^)]*)\)", agents.detail))
    assert len(named) == min(count, 5), agents
    for agent_id, why in named.items():
        mine = agent_id.removeprefix(f"{fleet.ns}.svc.")
        assert why == ", ".join(EXPECTED[mine]) if mine in EXPECTED else why, agents
    assert (f"and {count - 5} more" in agents.detail) == (count > 5), agents
    assert "reach-mesh agents --attention" in agents.detail
