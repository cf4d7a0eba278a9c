"""The dashboard's fleet view at fleet scale: one page of hundreds of agents (picked as the
fleet query picks it, ``hub/_fleet.py``), the counts of all of them, a body bounded by the page
whatever the fleet, typed 400s for what it cannot read, and the page in headless Chromium
paging and filtering it. Agents are registered by the wire protocol (docs/protocol.md,
"Registration"), as tests/test_fleet_payload.py does: no agent process each."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlencode

import pytest

from reach_mesh import MeshSettings
from reach_mesh.hub import Hub
from reach_mesh.hub._dashboard import FLEET_PAGE, FLEET_PAGE_MAX
from reach_mesh.models import AgentCard

from .chromium import Chromium, needs_chromium
from .helpers import a_server_of_its_own, fetch, register_cards

AGENTS = 500
RARE = 20  # a000..a019 serve kb:rare:v1 instead of kb:search:v1
CORDONED = (7, 250, 444)
#: A label value (free text to 256 characters) that is markup: shown as text, never run.
MARKUP = '<img src=x onerror="window.__pwned=1">'
TO = "\N{EN DASH}"  # of the page's "showing 1-200 of 500"


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """The view counts every namespace's agents: a server of this module's own."""
    yield from a_server_of_its_own()


def _card(ns: str, i: int) -> AgentCard:
    return AgentCard(
        agent_id=f"{ns}.svc.a{i:03d}",
        capabilities=["kb:rare:v1" if i < RARE else "kb:search:v1"],
        labels={"zone": f"z{i % 4}", "team": "search", "note": MARKUP if i == 1 else "ok"},
        max_concurrency=8,
    )


class Fleet:
    def __init__(self, hub: Hub, ns: str) -> None:
        self.hub = hub
        self.ns = ns
        self.ids = [_card(ns, i).agent_id for i in range(AGENTS)]

    @property
    def base(self) -> str:
        url = self.hub.http_url
        assert url is not None
        return url

    async def get(self, path: str, **query: Any) -> tuple[int, bytes]:
        return await fetch(f"{self.base}{path}?{urlencode(query, doseq=True)}")

    async def fleet(self, **query: Any) -> tuple[int, Any]:
        status, body = await self.get("/api/dashboard/fleet", namespace=self.ns, **query)
        return status, json.loads(body)


@pytest.fixture(scope="module")
async def fleet(nats_url: str) -> AsyncIterator[Fleet]:
    """One hub, ``AGENTS`` agents with leases that outlive the module, three of them cordoned."""
    ns = "dashfleet"
    settings = MeshSettings(nats_url=nats_url, namespace=ns, http_port=0)
    async with Hub(settings=settings) as hub:
        cards = [_card(ns, i) for i in range(AGENTS)]
        await register_cards(nats_url, cards, heartbeat_interval=20, lease_timeout=120)
        f = Fleet(hub, ns)
        for i in CORDONED:
            status, body = await fetch(f"{f.base}/api/agents/{f.ids[i]}/cordon", "POST", b"{}")
            assert status == 200, body
        yield f


async def test_the_fleet_view_is_one_page_with_the_counts_of_all(fleet: Fleet) -> None:
    ids = fleet.ids
    status, first = await fleet.fleet()
    assert status == 200, first
    assert (first["total"], first["matched"], first["offset"]) == (AGENTS, AGENTS, 0)
    assert first["limit"] == FLEET_PAGE and first["namespace"] == fleet.ns
    assert [a["agent_id"] for a in first["agents"]] == ids[:FLEET_PAGE]
    assert first["truncated"] and first["next_offset"] == FLEET_PAGE
    # Every state counted (LOST: declared in the last 15 minutes), whatever the page holds.
    assert first["by_state"]["ONLINE"] == AGENTS - 3 and first["by_state"]["CORDONED"] == 3
    assert first["by_state"]["LOST"] == 0 and first["recently_lost_total"] == 0
    assert "blind" in first and first["hub_id"] == fleet.hub.hub_id
    # Paged: every agent once, in agent id order.
    seen, page = [], first
    while True:
        seen += [a["agent_id"] for a in page["agents"]]
        if page["next_offset"] is None:
            break
        _, page = await fleet.fleet(offset=page["next_offset"])
    assert seen == ids and not page["truncated"]
    # The rows the page draws, as before: running of max, queued apart, actions by state.
    row = first["agents"][0]
    assert row["inflight"] == 0 and row["max_concurrency"] == 8 and row["queued"] == 0
    assert row["actions"] == ["cordon", "quarantine", "simulate-lost", "remove"]
    assert first["agents"][CORDONED[0]]["actions"] == ["uncordon", "quarantine", "remove"]
    # Filters: a state (any case, repeatable), a capability, both.
    _, cordoned = await fleet.fleet(state="cordoned")
    assert [a["agent_id"] for a in cordoned["agents"]] == [ids[i] for i in CORDONED]
    assert (cordoned["matched"], cordoned["total"], cordoned["truncated"]) == (3, AGENTS, False)
    _, attention = await fleet.fleet(state=["SUSPECT", "CORDONED", "QUARANTINED"])
    assert attention["matched"] == 3
    _, rare = await fleet.fleet(capability="kb:rare:v1")
    assert [a["agent_id"] for a in rare["agents"]] == ids[:RARE]
    _, both = await fleet.fleet(capability="kb:rare:v1", state="CORDONED")
    assert [a["agent_id"] for a in both["agents"]] == [ids[7]]
    # Counts only, and a page past the end.
    _, counts = await fleet.fleet(limit=0)
    assert counts["agents"] == [] and counts["next_offset"] == 0 and counts["matched"] == AGENTS
    _, past = await fleet.fleet(offset=AGENTS + 5)
    assert past["agents"] == [] and past["next_offset"] is None and past["matched"] == AGENTS
    # One mechanism: /api/agents picks the same agents for the same ask.
    status, raw = await fleet.get(
        "/api/agents", namespace=fleet.ns, state="ONLINE", capability="kb:search:v1", offset=190
    )
    _, mine = await fleet.fleet(state="ONLINE", capability="kb:search:v1", offset=190)
    listed = json.loads(raw)
    assert status == 200 and (listed["matched"], listed["total"]) == (mine["matched"], AGENTS)
    assert [a["agent_id"] for a in listed["agents"]][:FLEET_PAGE] == [
        a["agent_id"] for a in mine["agents"]
    ]


async def test_the_body_is_bounded_by_the_page_not_the_fleet(fleet: Fleet) -> None:
    """At 3,000 agents the whole fleet was one 1.07 MB body every 2 s per tab: now a page."""
    _, first = await fleet.get("/api/dashboard/fleet", namespace=fleet.ns)
    _, whole = await fleet.get("/api/dashboard/fleet", namespace=fleet.ns, limit=AGENTS)
    _, counts = await fleet.get("/api/dashboard/fleet", namespace=fleet.ns, limit=0)
    per_agent = (len(whole) - len(counts)) / AGENTS
    assert len(json.loads(whole)["agents"]) == AGENTS
    # The default page: FLEET_PAGE agents' rows and the counts, not the fleet's.
    assert len(first) <= len(counts) + FLEET_PAGE * per_agent * 1.1
    assert len(first) < 0.5 * len(whole)
    assert len(counts) < 2_000
    # Every namespace's (the page's default) is bounded the same way.
    status, every = await fetch(f"{fleet.base}/api/dashboard/fleet")
    assert status == 200 and len(json.loads(every)["agents"]) == FLEET_PAGE
    assert len(every) < 0.5 * len(whole)


@pytest.mark.parametrize(
    ("query", "code", "field"),
    [
        ({"limit": FLEET_PAGE_MAX + 1}, "REACH_BAD_REQUEST", "query.limit"),
        ({"limit": -1}, "REACH_BAD_REQUEST", "query.limit"),
        ({"limit": "all"}, "REACH_BAD_REQUEST", "query.limit"),
        ({"offset": -1}, "REACH_BAD_REQUEST", "query.offset"),
        ({"offset": "1.5"}, "REACH_BAD_REQUEST", "query.offset"),
        ({"state": "ASLEEP"}, "REACH_BAD_REQUEST", "state"),
        ({"capability": "search"}, "REACH_BAD_CAPABILITY", None),
        ({"namespace": "Not A Token"}, "REACH_BAD_REQUEST", "query.namespace"),
    ],
)
async def test_what_the_view_cannot_read_is_a_typed_400(
    fleet: Fleet, query: dict[str, Any], code: str, field: str | None
) -> None:
    status, body = await fleet.get("/api/dashboard/fleet", **query)
    err = json.loads(body)["error"]
    assert status == 400 and err["code"] == code, err
    if field is not None:  # the message says which parameter, and why
        assert err["details"]["field"] == field and field.split(".")[-1] in err["message"], err
    else:
        assert "invalid capability 'search'" in err["message"], err


@needs_chromium
async def test_the_page_counts_pages_and_filters_the_fleet(fleet: Fleet) -> None:
    ids = fleet.ids

    def operate() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        with Chromium() as browser:
            browser.watch_console()
            browser.open(f"{fleet.base}/?namespace={fleet.ns}")
            after = browser.once

            rows = (
                "[...document.querySelectorAll('#agents tr[data-agent]')].map(r => r.dataset.agent)"
            )
            showing = "document.getElementById('f-showing').textContent"
            seen["first"] = after(f"{showing}.startsWith('showing 1{TO}') && {rows}")
            seen["showing"] = browser.evaluate(showing)
            seen["cards"] = browser.evaluate(
                "Object.fromEntries([...document.querySelectorAll('.card')].map(c => "
                "[c.querySelector('span').textContent, c.querySelector('b').textContent]))"
            )
            seen["label"] = browser.evaluate(
                f"document.querySelector('tr[data-agent=\"{ids[1]}\"]').cells[9].textContent"
            )
            seen["prev_disabled"] = browser.evaluate("document.getElementById('f-prev').disabled")
            browser.evaluate("document.getElementById('f-next').click()")
            seen["second"] = after(f"{showing}.startsWith('showing 201{TO}') && {rows}")
            seen["address"] = browser.evaluate("location.search")
            browser.evaluate("document.getElementById('f-next').click()")
            seen["third"] = after(f"{showing}.startsWith('showing 401{TO}') && {rows}")
            seen["next_disabled"] = browser.evaluate("document.getElementById('f-next').disabled")
            # A state's count filters the view to it, from the first page.
            browser.evaluate("document.querySelector('.card[data-filter=\"CORDONED\"]').click()")
            seen["cordoned"] = after(f"{showing}.includes('of 3 matched') && {rows}")
            seen["cordoned_showing"] = browser.evaluate(showing)
            seen["cordoned_address"] = browser.evaluate("location.search")
            # A capability, any state.
            browser.evaluate(
                """(() => { const s = document.getElementById('f-state'); s.value = '';
                   s.dispatchEvent(new Event('change'));
                   document.getElementById('f-cap').value = 'kb:rare:v1';
                   document.getElementById('f-cap').form.requestSubmit(); })()"""
            )
            seen["rare"] = after(f"{showing}.includes('of {RARE} matched') && {rows}")
            # One the hub refuses: said in the fleet view; the counts stay.
            browser.evaluate(
                """(() => { document.getElementById('f-cap').value = 'not-a-capability';
                   document.getElementById('f-cap').form.requestSubmit(); })()"""
            )
            seen["refused"] = after(
                "(t => t.includes('refused') && t)(document.getElementById('agents').textContent)"
            )
            seen["cards_after"] = browser.evaluate("document.querySelectorAll('.card').length")
            seen["pwned"] = browser.evaluate(
                "window.__pwned === undefined && !document.querySelector('#agents img')"
            )
            # The refused filter is the browser's log entry (a 400), not a page error.
            seen["errors"] = [e for e in browser.console_errors() if "400" not in e]
        return seen

    seen = await asyncio.to_thread(operate)
    assert seen["errors"] == [], seen["errors"]
    assert seen["first"] == ids[:FLEET_PAGE]
    assert seen["showing"] == f"showing 1{TO}{FLEET_PAGE} of {AGENTS} in {fleet.ns}"
    cards = seen["cards"]
    assert cards["agents"] == str(AGENTS) and cards["ONLINE"] == str(AGENTS - 3)
    assert cards["CORDONED"] == "3"
    assert seen["label"].replace(" ", "").find("note=" + MARKUP.replace(" ", "")) >= 0
    assert seen["prev_disabled"] is True
    assert seen["second"] == ids[FLEET_PAGE : 2 * FLEET_PAGE]
    assert "offset=200" in seen["address"] and f"namespace={fleet.ns}" in seen["address"]
    assert seen["third"] == ids[2 * FLEET_PAGE :] and seen["next_disabled"] is True
    assert seen["cordoned"] == [ids[i] for i in CORDONED]
    assert (
        seen["cordoned_showing"] == f"showing 1{TO}3 of 3 matched ({AGENTS} in all) in {fleet.ns}"
    )
    assert "state=CORDONED" in seen["cordoned_address"]
    assert "offset" not in seen["cordoned_address"]
    assert seen["rare"] == ids[:RARE]
    assert "REACH_BAD_CAPABILITY" in seen["refused"]
    assert seen["cards_after"] > 3 and seen["pwned"] is True
