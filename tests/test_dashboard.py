"""The operators' dashboard: its JSON endpoints against a real hub with agents, traffic and
workflows, and the page itself in headless Chromium (agents, live rates, a workflow's steps, an
action that changes the registry, the token flow, no console errors, a screenshot)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._cli_fleet import _inflight
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.errors import ReachError
from reach_mesh.hub import Hub
from reach_mesh.hub._dashboard import UNCONFIRMED, _between, _Histogram, _Sample
from reach_mesh.models import AgentInfo, AgentState
from reach_mesh.workflow import Step, WorkflowRecord, WorkflowResult

from .chromium import Chromium, needs_chromium
from .helpers import a_server_of_its_own, eventually, fetch

TOKEN = "dashboard-token-of-the-hub"
#: Where the browser test leaves its screenshot (ignored by git).
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
TRACE_URL = "http://traces.example/trace/{trace_id}"


class Mesh:
    """A hub with HTTP, an echo agent and an agent whose handler fails, and some traffic."""

    def __init__(self, hub: Hub, settings: MeshSettings, agents: list[Agent]) -> None:
        self.hub = hub
        self.settings = settings
        self.agents = agents
        self.workflow: WorkflowResult | None = None

    @property
    def base(self) -> str:
        url = self.hub.http_url
        assert url is not None
        return url

    async def get(self, part: str, token: str | None = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        status, body = await fetch(f"{self.base}/api/dashboard/{part}", headers=headers)
        return status, json.loads(body)

    async def traffic(self) -> None:
        ns = self.settings.namespace
        async with Client(settings=self.settings) as mesh:
            for i in range(6):
                await mesh.request(capability="work:echo:v1", payload={"i": i})
            for _ in range(2):
                with contextlib.suppress(ReachError):
                    await mesh.request(capability="work:fail:v1", payload={})
            with contextlib.suppress(ReachError):
                await mesh.request(capability="work:nobody:v1", payload={})
            self.workflow = await mesh.fanout(
                [
                    Step(agent_id=f"{ns}.echo.a1", payload={"step": 0}),
                    Step(capability="work:echo:v1", payload={"step": 1}),
                    Step(capability="work:fail:v1", payload={}),
                ],
                timeout=20,
            )


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """The page lists and counts every namespace's agents: a server of this module's own."""
    yield from a_server_of_its_own()


def _agents(settings: MeshSettings) -> list[Agent]:
    ns = settings.namespace
    echo = Agent(f"{ns}.echo.a1", settings=settings, max_concurrency=4)
    flaky = Agent(f"{ns}.flaky.b1", settings=settings)

    @echo.handler("work:echo:v1")
    async def run_echo(task: Task[Any]) -> Any:
        await asyncio.sleep(0.02)
        return task.payload

    @flaky.handler("work:fail:v1")
    async def run_fail(task: Task[Any]) -> Any:
        raise TaskFailed("the model refused", retryable=False)

    return [echo, flaky]


@contextlib.asynccontextmanager
async def running_mesh(wf_settings: MeshSettings, **hub: Any) -> AsyncIterator[Mesh]:
    hub_settings = wf_settings.model_copy(update={"http_port": 0, **hub})
    async with Hub(settings=hub_settings) as h:
        agents = _agents(wf_settings)
        async with contextlib.AsyncExitStack() as stack:
            for agent in agents:
                await stack.enter_async_context(agent)
            yield Mesh(h, wf_settings, agents)


@pytest.fixture
async def mesh(wf_settings: MeshSettings) -> AsyncIterator[Mesh]:
    async with running_mesh(wf_settings, trace_url_template=TRACE_URL) as m:
        await m.traffic()
        yield m


# --------------------------------------------------------------------------- pure parts


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    # 10 observations <= 1 ms, 80 in (1, 10] ms, 10 in (10, 100] ms: cumulative counts.
    h = _Histogram([0.001, 0.01, 0.1], [10, 90, 100, 100])
    assert h.quantile(0.05) == pytest.approx(0.0005)
    assert h.quantile(0.5) == pytest.approx(0.001 + 0.009 * 40 / 80)
    assert h.quantile(0.99) == pytest.approx(0.01 + 0.09 * 9 / 10)
    assert _Histogram([0.001], [0, 0]).quantile(0.5) is None  # nothing observed
    assert _Histogram([0.001], [0, 5]).quantile(0.5) == 0.001  # all past the last bound
    older = _Histogram([0.001, 0.01, 0.1], [10, 50, 60, 60])
    assert h.minus(older).counts == [0, 40, 40, 40]


def test_trace_url_template_must_be_an_http_link_with_the_trace_id() -> None:
    ok = MeshSettings(trace_url_template=TRACE_URL)
    assert ok.trace_url_template == TRACE_URL
    for bad in ("javascript:alert(1)//{trace_id}", "http://jaeger/trace/", "ftp://x/{trace_id}"):
        with pytest.raises(ValueError):
            MeshSettings(trace_url_template=bad)


# --------------------------------------------------------------------------- the endpoints


async def test_fleet_separates_running_from_queued_and_offers_actions_by_state(
    mesh: Mesh,
) -> None:
    ns = mesh.settings.namespace
    status, fleet = await mesh.get("fleet")
    assert status == 200, fleet
    assert fleet["blind"] is False  # (a blind hub: tests/test_liveness_blind.py)
    status, health = await fetch(f"{mesh.base}/healthz")
    assert status == 200 and json.loads(health) == {
        "hub_id": mesh.hub.hub_id,
        "nats_connected": True,
        "agents": len(mesh.hub.registry),
        "registry_blind": False,
        "registry_blind_reason": None,
        "nats_servers": mesh.hub.together.servers(),
        "nats_split": False,
    }
    # This module's agents (the hub sees every namespace's: earlier test files may leave some).
    mine = [a for a in fleet["agents"] if a["agent_id"].startswith(f"{ns}.")]
    assert len(mine) == 2 and {a["state"] for a in mine} == {"ONLINE"}, mine
    echo = next(a for a in fleet["agents"] if a["agent_id"] == f"{ns}.echo.a1")
    assert echo["max_concurrency"] == 4 and 0 <= echo["inflight"] <= 4 and echo["queued"] >= 0
    assert 0.0 <= echo["load"] <= 1.0
    assert echo["breaker"] == "closed" and echo["capabilities"] == ["work:echo:v1"]
    assert "cordon" in echo["actions"] and "uncordon" not in echo["actions"]
    assert "release" not in echo["actions"]
    # Cordoned: uncordon instead of cordon. Quarantined: release, nothing that needs a breaker.
    status, _ = await fetch(f"{mesh.base}/api/agents/{ns}.echo.a1/cordon", "POST", b"{}")
    assert status == 200
    status, _ = await fetch(f"{mesh.base}/api/agents/{ns}.flaky.b1/quarantine", "POST", b"{}")
    assert status == 200
    await eventually(
        lambda: mesh.hub.registry.agents[f"{ns}.flaky.b1"].state.value == "QUARANTINED"
    )
    _, fleet = await mesh.get("fleet")
    actions = {a["agent_id"]: a["actions"] for a in fleet["agents"]}
    assert actions[f"{ns}.echo.a1"] == ["uncordon", "quarantine", "remove"]
    assert actions[f"{ns}.flaky.b1"] == ["release", "remove"]
    states = sorted(a["state"] for a in fleet["agents"] if a["agent_id"].startswith(f"{ns}."))
    assert states == ["CORDONED", "QUARANTINED"], states


async def test_traffic_counts_rates_successes_and_latency(mesh: Mesh) -> None:
    status, traffic = await mesh.get("traffic")
    assert status == 200, traffic
    now = traffic["now"]
    # 6 echoes, 2 failures, 1 with no taker (and the fanout's steps, which are not routes).
    assert now["requests"] == 9, now
    # Among the tasks that ran and ended, as the success-rate alert: no match is an error.
    assert now["success_rate"] == pytest.approx(6 / 8, abs=1e-3)
    assert now["errors"] == {"FAILED": 2, "NO_MATCH": 1}
    assert now["rate"] > 0
    assert now["p50_ms"] is not None and 1.0 <= now["p50_ms"] <= now["p99_ms"] < 1000
    assert now["route_p50_us"] is not None and now["route_p50_us"] > 0
    assert traffic["totals"]["SUCCEEDED"] == 6
    # The sampler keeps a bounded ring; the series ends with the live point.
    dash = mesh.hub.dashboard
    assert dash is not None and dash.samples.maxlen == 72
    assert traffic["series"] and traffic["series"][-1]["requests"] == 9


async def test_recent_decisions_carry_the_explanation(mesh: Mesh) -> None:
    ns = mesh.settings.namespace
    status, body = await mesh.get("decisions?n=5")
    assert status == 200, body
    decisions = body["decisions"]
    assert len(decisions) == 5
    newest = decisions[0]
    assert newest["target"] == "work:nobody:v1" and newest["error"] == "REACH_NO_MATCH"
    # A no-match carries the router's explanation of why nobody could take it.
    assert "work:nobody:v1" in newest["reason"]
    assert newest["decision"]["target"] == "cap=work:nobody:v1"
    assert newest["decision"]["candidates"] == []
    routed = next(d for d in decisions if d.get("state") == "FAILED")
    assert routed["agent_id"] == f"{ns}.flaky.b1" and routed["attempts"] == 1 and routed["ts"] > 0
    assert routed["decision"] == {
        "strategy": "least_loaded",
        "chosen": f"{ns}.flaky.b1",
        "refused": [],
        "explained": False,
    }
    # A request that asks for the explanation leaves it, scores and all.
    async with Client(settings=mesh.settings) as c:
        await c.request(capability="work:echo:v1", payload={}, explain=True)
    _, body = await mesh.get("decisions?n=1")
    full = body["decisions"][0]["decision"]
    assert full["chosen"] == f"{ns}.echo.a1" and full["candidates"] == [f"{ns}.echo.a1"]
    assert full["strategy"] == "least_loaded" and full["elapsed_us"] > 0
    for bad in ("0", "201", "x", "-1"):
        status, body = await mesh.get(f"decisions?n={bad}")
        assert status == 400 and body["error"]["code"] == "REACH_BAD_REQUEST", bad


async def test_workflows_show_each_steps_state_and_attempts(mesh: Mesh) -> None:
    ns = mesh.settings.namespace
    wf = mesh.workflow
    assert wf is not None and wf.state.value == "FAILED"

    async def shown() -> dict[str, Any]:
        _, body = await mesh.get("workflows")
        return next((w for w in body["workflows"] if w["workflow_id"] == wf.workflow_id), {})

    for _ in range(100):  # the final record is read once the last step's event is in
        item = await shown()
        if item.get("state") == "FAILED":
            break
        await asyncio.sleep(0.05)
    assert item["kind"] == "fanout" and item["state"] == "FAILED"
    assert item["owner"] == mesh.hub.hub_id and item["trace_id"] == wf.trace_id
    steps = item["steps"]
    assert [s["state"] for s in steps] == ["SUCCEEDED", "SUCCEEDED", "FAILED"]
    assert [s["attempts"] for s in steps] == [1, 1, 1]
    assert steps[0]["agent_id"] == f"{ns}.echo.a1"
    assert steps[2]["agent_id"] == f"{ns}.flaky.b1" and "the model refused" in steps[2]["error"]
    status, pending = await mesh.get("pending")
    assert status == 200
    # Only this mesh's work: an unfinished workflow of an earlier test may be handed to this
    # hub (all hubs of one nats-server share the submissions' consumer).
    assert pending["routes_in_flight"] == 0
    assert [s for s in pending["pending_steps"] if s["workflow_id"] == wf.workflow_id] == []
    _, cfg = await mesh.get("settings")
    assert cfg["trace_url_template"] == TRACE_URL and cfg["interval"] > 0


async def test_a_status_with_a_malformed_attempt_is_no_row_and_no_error(
    wf_settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent publishing on its own status subject with an ``attempt`` that is no attempt
    number: once an ERROR with a traceback per message (the parse was outside the ``try``);
    now no row, nothing logged."""
    async with running_mesh(wf_settings) as m, Client(settings=wf_settings) as mesh:
        keeper = m.hub.dashboard
        assert keeper is not None
        agent_id = f"{wf_settings.namespace}.echo.a1"
        subject = protocol.task_status(agent_id, "dash-bad")
        base = {"task_id": "dash-bad", "agent_id": agent_id, "state": "RUNNING", "step": 0}
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            for attempt in ('"x"', "[1]", "1e999", "true", "0", "null"):
                body = json.dumps({**base, "workflow_id": f"dash-bad-{len(attempt)}"})
                await mesh.nc.publish(
                    subject, body[:-1].encode() + b',"attempt":' + attempt.encode() + b"}"
                )
            # A workflow with a record (the dashboard lists no workflow that has none).
            await _running_record(mesh, "dash-good")
            await mesh.nc.publish(
                subject, json.dumps({**base, "workflow_id": "dash-good", "attempt": 1}).encode()
            )
            await eventually(lambda: (wf_settings.namespace, "dash-good") in keeper.workflows)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not [k for k in keeper.workflows if k[1].startswith("dash-bad")]


async def _running_record(mesh: Client, workflow_id: str) -> None:
    """A running workflow's record, as its owner writes it."""
    kv = await mesh.nc.jetstream().key_value(protocol.KV_WORKFLOWS)
    record = WorkflowRecord(owner="hub-elsewhere")
    await kv.put(protocol.workflow_key(mesh.namespace, workflow_id), protocol.encode(record))


async def test_an_agent_cannot_rewrite_a_finished_workflow_or_list_a_made_up_one(
    mesh: Mesh,
) -> None:
    """Any agent may publish a status event on its own subject, naming any workflow of its
    namespace: the dashboard shows a finished workflow's steps from its final record, not a
    later event (attempt 99, FAILED, by another agent), and lists no workflow without one."""
    ns = mesh.settings.namespace
    wf = mesh.workflow
    assert wf is not None
    keeper = mesh.hub.dashboard
    assert keeper is not None
    key = (ns, wf.workflow_id)
    await eventually(lambda: key in keeper.workflows and keeper.workflows[key].settled)
    forger = f"{ns}.flaky.b1"
    async with Client(settings=mesh.settings) as c:
        await _running_record(c, "dash-control")
        events = [
            (wf.workflow_id, wf.steps[0].task_id, 99, "FAILED"),
            ("dash-ghost", "dash-ghost-0", 1, "RUNNING"),
            ("dash-control", "dash-control-0", 1, "RUNNING"),  # after the two above
        ]
        for wf_id, task_id, attempt, state in events:
            body = {
                "task_id": task_id,
                "workflow_id": wf_id,
                "step": 0,
                "attempt": attempt,
                "state": state,
                "agent_id": forger,
            }
            await c.nc.publish(protocol.task_status(forger, task_id), json.dumps(body).encode())
        await eventually(lambda: (ns, "dash-control") in keeper.workflows)
        await eventually(lambda: (ns, "dash-ghost") not in keeper.workflows)
    step = keeper.workflows[key].steps[0]
    assert (step.state, step.attempt, step.agent_id) == ("SUCCEEDED", 1, f"{ns}.echo.a1")


async def test_made_up_workflows_cannot_push_real_ones_off_the_panel(mesh: Mesh) -> None:
    """An agent publishing RUNNING events for 60 made-up workflow ids of its namespace: the
    panel keeps every workflow whose record it has read (they emptied it: it kept the newest
    50 of any kind), and at most ``UNCONFIRMED`` of those it knows only from events."""
    ns = mesh.settings.namespace
    wf = mesh.workflow
    keeper = mesh.hub.dashboard
    assert wf is not None and keeper is not None
    key = (ns, wf.workflow_id)
    await eventually(lambda: key in keeper.workflows and keeper.workflows[key].known)
    forger = f"{ns}.flaky.b1"
    async with Client(settings=mesh.settings) as c:
        for i in range(60):
            task_id = f"dash-flood-{i}-0"
            body = {
                "task_id": task_id,
                "workflow_id": f"dash-flood-{i}",
                "step": 0,
                "attempt": 1,
                "state": "RUNNING",
                "agent_id": forger,
            }
            await c.nc.publish(protocol.task_status(forger, task_id), json.dumps(body).encode())
        await c.nc.flush()
        await eventually(lambda: (ns, "dash-flood-59") in keeper.workflows)
    _, body = await mesh.get("workflows")
    listed = {w["workflow_id"] for w in body["workflows"]}
    assert wf.workflow_id in listed
    assert len([w for w in listed if w.startswith("dash-flood-")]) <= UNCONFIRMED


async def test_pending_lists_a_step_no_agent_can_take(
    wf_settings: MeshSettings, namespace: str
) -> None:
    # Short workflow timeouts: a workflow left unfinished here would be handed to the next
    # test's hub (all hubs of this nats-server share the submissions' consumer).
    async with running_mesh(wf_settings) as m, Client(settings=wf_settings) as client:
        mine: set[str] = set()

        async def waiting(count: int) -> list[tuple[str, int, str, str | None]]:
            for _ in range(100):
                _, body = await m.get("pending")
                steps = [
                    (s["workflow_id"], s["index"], s["state"], s["agent_id"])
                    for s in body["pending_steps"]
                    if s["workflow_id"] in mine
                ]
                if len(steps) >= count:
                    break
                await asyncio.sleep(0.05)
            return sorted(steps)

        wf_id = await client.submit_fanout(
            [
                Step(capability="work:echo:v1", payload={}),
                Step(capability="work:nobody:v1", payload={}),
            ],
            timeout=4,
        )
        mine.add(wf_id)
        assert await waiting(1) == [(wf_id, 1, "PENDING", None)]
        _, body = await m.get("pending")
        assert body["workflows_running"] >= 1 and body["steps_pending"] >= 1
        (step,) = [s for s in body["pending_steps"] if s["workflow_id"] == wf_id]
        assert "work:nobody:v1" in step["why"] and step["retry_in_s"] > 0  # what it waits for
        # A workflow none of whose steps reached an agent sends no status event: the views
        # adopt it from the workflows this hub runs.
        lonely = await client.submit_fanout(
            [Step(capability="work:nobody:v1", payload={})], timeout=4
        )
        mine.add(lonely)
        engine = m.hub.workflows
        assert engine is not None
        await eventually(lambda: {lonely, wf_id} <= {w for _, w in engine.owned})
        assert await waiting(2) == sorted(
            [(wf_id, 1, "PENDING", None), (lonely, 0, "PENDING", None)]
        )
        for _ in range(100):  # the step's own record is read right after the workflow's
            _, body = await m.get("workflows")
            shown = {w["workflow_id"]: w for w in body["workflows"]}
            steps = shown[lonely]["steps"]  # filled once the records are read
            if steps and steps[0]["task_id"]:
                break
            await asyncio.sleep(0.05)
        assert shown[lonely]["kind"] == "fanout" and shown[lonely]["state"] == "RUNNING"
        assert shown[lonely]["namespace"] == namespace
        # Read back from reach_tasks: the step's own task id.
        assert shown[lonely]["steps"][0]["task_id"] == f"{lonely}-0"


async def test_a_step_its_agent_never_took_names_the_agent(
    wf_settings: MeshSettings, namespace: str
) -> None:
    """A fanout's step sent to an agent that never takes it (hung; here its work consumer
    stopped, its heartbeats going on) sends no status event, and a first attempt has no task
    record: the panel names the agent and attempt 1 from the workflow record (it showed the
    step PENDING, attempt 0, no agent — while ``reach-mesh workflow`` named the agent)."""
    s = wf_settings.model_copy(update={"step_deliver_timeout": 30.0})
    agent = Agent(f"{namespace}.stuck.a1", settings=s)

    @agent.handler("work:stuck:v1")
    async def run(task: Task[Any]) -> Any:
        return task.payload

    async with Hub(settings=s.model_copy(update={"http_port": 0})) as hub, agent:
        assert agent.work is not None
        await agent.work.stop()  # it takes no step any more; it still beats
        m = Mesh(hub, s, [agent])
        async with Client(settings=s) as client:
            wf_id = await client.submit_fanout(
                [Step(capability="work:stuck:v1", payload={})], timeout=4
            )
            shown: dict[str, Any] = {}

            async def named() -> bool:
                _, body = await m.get("workflows")
                shown.update({w["workflow_id"]: w for w in body["workflows"]})
                return wf_id in shown and shown[wf_id]["kind"] == "fanout"

            await eventually(named, timeout=10)
            (step,) = shown[wf_id]["steps"]
            assert step["state"] == "PENDING" and step["attempts"] == 1, step
            assert step["agent_id"] == agent.agent_id and step["task_id"] == f"{wf_id}-0", step
            await client.cancel_workflow(wf_id, reason="test over")


async def test_dashboard_api_wants_the_token_and_the_favicon_is_served(
    wf_settings: MeshSettings,
) -> None:
    async with running_mesh(wf_settings, http_token=TOKEN) as m:
        for part in ("fleet", "traffic", "decisions", "workflows", "pending", "settings"):
            status, body = await m.get(part)
            assert status == 401 and body["error"]["code"] == "REACH_UNAUTHORIZED", part
            status, body = await m.get(part, token=TOKEN)
            assert status == 200, (part, body)
        status, icon = await fetch(f"{m.base}/favicon.ico")
        assert status == 200 and icon.startswith(b"<svg")
        _, doc = await fetch(f"{m.base}/openapi.json")
        paths = json.loads(doc)["paths"]
        assert {p for p in paths if p.startswith("/api/dashboard/")} == {
            f"/api/dashboard/{p}"
            for p in ("fleet", "traffic", "decisions", "workflows", "pending", "settings")
        }


# --------------------------------------------------------------------------- the page


@needs_chromium
async def test_page_shows_fleet_rates_workflow_and_acts_on_the_registry(mesh: Mesh) -> None:
    ns = mesh.settings.namespace
    echo_id = f"{ns}.echo.a1"
    view = mesh.hub.registry.agents[echo_id]
    assert mesh.workflow is not None
    wf_id = mesh.workflow.workflow_id
    shot = ARTIFACTS / "dashboard.png"

    def operate() -> dict[str, Any]:
        with Chromium() as browser:
            browser.watch_console()
            browser.open(f"{mesh.base}/")
            seen: dict[str, Any] = {}
            wait_for = f"""new Promise(ok => {{ const t = setInterval(() => {{
              const steps = document.querySelectorAll('[data-workflow="{wf_id}"] .step');
              const done = [...steps].every(s => s.dataset.state !== "PENDING");
              const failed = document.querySelector('#failed tr[data-failed="{wf_id}"]');
              if (document.querySelector('tr[data-agent]') && steps.length === 3 && done
                  && failed)
                {{ clearInterval(t); ok(true); }} }}, 50); }})"""
            browser.evaluate(wait_for)
            seen["agents"] = browser.evaluate(
                "[...document.querySelectorAll('#agents tr[data-agent]')].map(r => "
                "[r.dataset.agent, r.dataset.state, "
                "[...r.querySelectorAll('button')].map(b => b.dataset.op)])"
            )
            seen["cards"] = browser.evaluate(
                "Object.fromEntries([...document.querySelectorAll('.card')].map(c => "
                "[c.querySelector('span').textContent, c.querySelector('b').textContent]))"
            )
            seen["steps"] = browser.evaluate(
                f"[...document.querySelectorAll('[data-workflow=\"{wf_id}\"] .step')]"
                ".map(s => s.dataset.state + ' ' + s.textContent.replace(/\\s+/g, ' ').trim())"
            )
            seen["failed"] = browser.evaluate(
                f"(r => [r.dataset.ns, [...r.cells].map(c => c.textContent.trim())])"
                f"(document.querySelector('#failed tr[data-failed=\"{wf_id}\"]'))"
            )
            seen["trace_link"] = browser.evaluate(
                f"document.querySelector('[data-workflow=\"{wf_id}\"] a').href"
            )
            # A decision's explanation opens on click.
            seen["explained"] = browser.evaluate(
                """(() => { const row = [...document.querySelectorAll('#decisions tr.clickable')]
                     .find(r => r.textContent.includes('SUCCEEDED'));
                   row.click();
                   return document.querySelector('#decisions tr.explain').textContent; })()"""
            )
            # Cordon from its button, confirmed by the operator with a reason.
            seen["asked"] = browser.evaluate(
                f"""new Promise(ok => {{
                  const asked = [];
                  window.prompt = text => {{ asked.push(text); return " disk swap "; }};
                  document.querySelector('button[data-agent="{echo_id}"][data-op="cordon"]')
                    .click();
                  const t = setInterval(() => {{
                    const row = document.querySelector('tr[data-agent="{echo_id}"]');
                    if (row && row.dataset.state === "CORDONED") {{ clearInterval(t); ok(asked); }}
                  }}, 50); }})"""
            )
            seen["after"] = browser.evaluate(
                f"[...document.querySelectorAll('tr[data-agent=\"{echo_id}\"] button')]"
                ".map(b => b.dataset.op)"
            )
            # A declined confirmation does nothing.
            seen["declined"] = browser.evaluate(
                f"""(async () => {{ window.prompt = () => null;
                     return await act("{echo_id}", "uncordon"); }})()"""
            )
            browser.screenshot(shot)
            seen["errors"] = browser.console_errors()
            return seen

    seen = await asyncio.to_thread(operate)
    assert seen["errors"] == [], seen["errors"]
    agents = {a[0]: a for a in seen["agents"]}
    assert agents[echo_id][1] == "ONLINE"
    assert agents[echo_id][2] == ["cordon", "quarantine", "simulate-lost", "remove"]
    cards = seen["cards"]
    assert cards["agents"] == "2" and cards["ONLINE"] == "2"
    assert float(cards["routes/s"]) > 0 and cards["success"] == "75.0%"  # NO_MATCH aside
    assert "busy refusals/s" not in cards  # shown while agents refuse tries as full
    assert cards["p50 handler"].endswith(" ms") and cards["p99 handler"].endswith(" ms")
    assert [s.split(" ")[0] for s in seen["steps"]] == ["SUCCEEDED", "SUCCEEDED", "FAILED"]
    assert "attempt 1" in seen["steps"][0] and echo_id in seen["steps"][0]
    # Every namespace's failed workflows of the last hour, from the records (any hub's).
    failed_ns, cells = seen["failed"]
    assert failed_ns == ns and cells[1] == ns and cells[3] == "2/3", cells
    assert cells[4].startswith("REACH_HANDLER_FAILED"), cells
    assert seen["trace_link"] == TRACE_URL.replace("{trace_id}", mesh.workflow.trace_id or "")
    assert seen["explained"].startswith(f"strategy least_loaded · chosen {echo_id}")
    assert seen["asked"] == [
        f"Cordon {echo_id}? It keeps its work but gets no new tasks. Why (kept in the audit)?"
    ]
    assert seen["after"] == ["uncordon", "quarantine", "remove"]
    assert seen["declined"] is False
    assert view.state is AgentState.CORDONED and view.record.cordoned
    async with Client(settings=mesh.settings) as c:
        assert (await c.inspect(echo_id)).state is AgentState.CORDONED
    events = await _audit_admin(mesh)
    # Who asked: the hub's HTTP API (whoever holds its token), and why: the operator's answer.
    assert [(e["agent_id"], e["op"], e.get("requester"), e.get("reason")) for e in events] == [
        (echo_id, "cordon", "http", "disk swap")
    ]
    assert shot.stat().st_size > 10_000


async def _audit_admin(mesh: Mesh) -> list[dict[str, Any]]:
    await mesh.hub.audit.flush()
    async with Client(settings=mesh.settings) as c:
        for _ in range(50):
            events = [
                e
                for e in await c.audit(namespace=mesh.settings.namespace, limit=500)
                if e.get("kind") == "admin"
            ]
            if events:
                return events
            await asyncio.sleep(0.05)
    return []


@needs_chromium
async def test_token_added_to_an_open_page_is_taken(wf_settings: MeshSettings) -> None:
    async with running_mesh(wf_settings, http_token=TOKEN) as m:

        def operate() -> list[Any]:
            with Chromium() as browser:
                browser.watch_console()
                browser.open(f"{m.base}/")
                asked = browser.evaluate(
                    """new Promise(ok => { const t = setInterval(() => {
                         const msg = document.getElementById("msg").textContent;
                         if (msg) { clearInterval(t); ok(msg); } }, 50); })"""
                )
                # The operator adds the token to the address of the page already open.
                browser.evaluate(f"location.hash = 'token={TOKEN}'")
                # The page lists every namespace's agents: others' tests' may still be there.
                rows = browser.evaluate(
                    """new Promise(ok => { const t = setInterval(() => {
                         const rows = [...document.querySelectorAll('#agents tr[data-agent]')]
                           .map(r => r.dataset.agent);
                         if (rows.length) { clearInterval(t); ok(rows); } }, 50); })"""
                )
                left = browser.evaluate(
                    "[location.hash, document.getElementById('msg').textContent]"
                )
                # 401s of the first load are the browser's log entries, not page errors.
                errors = [e for e in browser.console_errors() if "401" not in e]
                return [asked, rows, left, errors]

        asked, rows, left, errors = await asyncio.to_thread(operate)
        assert "#token=" in asked
        ns = wf_settings.namespace
        assert sorted(r for r in rows if r.startswith(f"{ns}.")) == [
            f"{ns}.echo.a1",
            f"{ns}.flaky.b1",
        ]
        assert left == ["", ""]  # the token left the address bar; no message left
        assert errors == []


@needs_chromium
async def test_a_running_workflow_is_cancelled_from_the_page(wf_settings: MeshSettings) -> None:
    """A workflow not final has a cancel button; the operator clicks it and gives a reason;
    the workflow's one result is the cancel's, with that reason, the page says so, and the
    button is gone."""
    release = asyncio.Event()
    async with running_mesh(wf_settings) as m, Client(settings=wf_settings) as c:
        slow = Agent(f"{wf_settings.namespace}.slow.a1", settings=wf_settings)

        @slow.handler("wf:slow:v1")
        async def hold(task: Task[Any]) -> str:
            await release.wait()
            return "late"

        try:
            async with slow:
                wf_id = await c.submit_fanout([Step(capability="wf:slow:v1")], timeout=30)
                button = f'button[data-cancel="{wf_id}"]'

                def operate() -> list[Any]:
                    with Chromium() as browser:
                        browser.watch_console()
                        browser.open(f"{m.base}/")
                        ns = browser.evaluate(
                            f"""new Promise(ok => {{ const t = setInterval(() => {{
                              const b = document.querySelector('{button}');
                              if (b) {{ clearInterval(t); ok(b.dataset.ns); }} }}, 50); }})"""
                        )
                        browser.evaluate("window.prompt = () => 'from the dashboard'")
                        browser.evaluate(f"document.querySelector('{button}').click()")
                        said = browser.evaluate(
                            """new Promise(ok => { const t = setInterval(() => {
                                 const msg = document.getElementById("msg").textContent;
                                 if (msg) { clearInterval(t); ok(msg); } }, 50); })"""
                        )
                        gone = browser.evaluate(
                            f"""new Promise(ok => {{ const t = setInterval(() => {{
                              if (!document.querySelector('{button}'))
                                {{ clearInterval(t); ok(true); }} }}, 50); }})"""
                        )
                        return [ns, said, gone, browser.console_errors()]

                ns, said, gone, errors = await asyncio.to_thread(operate)
                res = await c.workflow(wf_id, timeout=10)
        finally:
            release.set()
    assert ns == wf_settings.namespace and errors == []
    assert said == f"workflow {wf_id} cancelled" and gone is True
    assert res.error is not None and res.error.code == "REACH_WORKFLOW_CANCELLED"
    assert res.error.message == "cancelled on request: from the dashboard"
    assert res.steps[0].cancelled


def test_the_success_rate_is_taken_among_tasks_that_ran_as_the_alert_takes_it() -> None:
    """Busy refusals (tried again by the SDK, each counted), no match and throttling are
    errors of the window, not failures of a task: a saturated agent's retries made the page
    read 8 % success (the SRE audit), where the success-rate alert reads 100 %."""
    old = _Sample(0.0, {}, _Histogram(), _Histogram())
    new = _Sample(
        60.0,
        {"SUCCEEDED": 45, "ROUTED": 5, "FAILED": 2, "TIMEOUT": 3, "AGENT_BUSY": 540, "NO_MATCH": 5},
        _Histogram(),
        _Histogram(),
    )
    window = _between(new, old)
    assert window["requests"] == 600 and window["rate"] == 10.0
    assert window["success_rate"] == pytest.approx(50 / 55, abs=1e-4)
    assert window["errors"] == {"AGENT_BUSY": 540, "FAILED": 2, "NO_MATCH": 5, "TIMEOUT": 3}
    only_refused = _Sample(60.0, {"AGENT_BUSY": 10}, _Histogram(), _Histogram())
    assert _between(only_refused, old)["success_rate"] is None  # nothing ran: no rate


def test_the_cli_shows_tasks_past_the_slots_apart_as_the_dashboard_does() -> None:
    """``reach-mesh agents`` showed ``14/2`` for a saturated agent where the dashboard shows 2
    of 2 running and the rest queued (the SRE audit): now ``2/2 +12``."""
    info = AgentInfo(
        agent_id="n.s.i",
        state=AgentState.ONLINE,
        capabilities=["a:b:v1"],
        labels={},
        inflight=14,
        max_concurrency=2,
        load=7.0,
        lease_left=1.0,
        last_heartbeat_age=0.1,
        health=1.0,
        breaker="closed",
        session="s",
    )
    assert _inflight(info) == "2/2 +12"
    assert _inflight(info.model_copy(update={"inflight": 1})) == "1/2"
    assert _inflight(info.model_copy(update={"inflight": 2})) == "2/2"


@needs_chromium
async def test_busy_refusals_show_in_red_and_do_not_count_against_success(
    wf_settings: MeshSettings,
) -> None:
    """An agent refusing tries as full: the page shows "busy refusals/s" in red, and its
    success rate is the tasks that ran (the SRE audit: 8 %, and no sign of why)."""
    async with running_mesh(wf_settings) as m:
        ns = wf_settings.namespace
        full = Agent(f"{ns}.full.c1", settings=wf_settings, max_concurrency=1, max_queue=0)

        @full.handler("work:full:v1")
        async def slow(task: Task[Any]) -> str:
            await asyncio.sleep(0.3)
            return "done"

        async with full, Client(settings=wf_settings) as mesh:
            # Six at once for one slot: refused (AGENT_BUSY, through the hub: proxy mode) and
            # asked again by the SDK until each gets its turn, well within its timeout.
            calls = [mesh.request(capability="work:full:v1", timeout=5.0) for _ in range(6)]
            got = await asyncio.gather(*calls)
        assert [g.result for g in got] == ["done"] * 6

        def operate() -> dict[str, str]:
            with Chromium() as browser:
                browser.watch_console()
                browser.open(f"{m.base}/")
                cards: dict[str, str] = browser.evaluate(
                    """new Promise(ok => { const t = setInterval(() => {
                         const cards = Object.fromEntries(
                           [...document.querySelectorAll('.card')].map(c => [
                             c.querySelector('span').textContent,
                             c.querySelector('b').textContent
                               + (c.classList.contains('bad') ? ' bad' : '')]));
                         if (cards['busy refusals/s']) { clearInterval(t); ok(cards); }
                       }, 50); })"""
                )
                assert browser.console_errors() == []
                return cards

        cards = await asyncio.to_thread(operate)
        assert (
            cards["busy refusals/s"].endswith(" bad")
            and float(cards["busy refusals/s"].split()[0]) > 0
        )
        assert cards["success"].startswith("100.0%"), cards  # the refusals are not failures
