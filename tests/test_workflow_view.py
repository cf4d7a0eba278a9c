"""``reach.hub.<ns>.workflow``: one workflow as it stands, for an operator
(``Client.inspect_workflow``, ``reach-mesh workflow <id>``), on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import nats
import pytest

from reach_mesh import (
    BadRequestError,
    Client,
    MeshSettings,
    RetryPolicy,
    Step,
    TaskState,
    UnknownWorkflowError,
    WorkflowView,
    protocol,
)
from reach_mesh._nats import flushed
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.hub import Hub
from reach_mesh.hub._control import (
    LIST_CHARGE,
    VIEW_RATE,
    VIEWS_AT_ONCE,
    VIEWS_KEPT_FREE,
    VIEWS_PER_NAMESPACE,
    ViewSlots,
)
from reach_mesh.hub._wf_view import VIEW_DEADLINE

from .helpers import Fleet, echo_agent, eventually, fetch, run_cli

pytestmark = pytest.mark.timeout(60)


async def held_agent(fleet: Fleet) -> tuple[Agent, asyncio.Event]:
    """A started agent whose ``wf:slow:v1`` handler runs until the event is set."""
    release = asyncio.Event()
    slow = fleet.agent("slow.a1")

    @slow.handler("wf:slow:v1")
    async def wait(task: Task[Any]) -> str:
        await release.wait()
        return "done"

    await slow.start()
    return slow, release


async def test_a_running_workflow_seen_by_its_owner_and_by_another_hub(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Its owner answers live (each attempt's state, why a step waits); another hub answers
    from the records and the status stream; once final, the view is the result's."""
    ns = wf_settings.namespace
    slow, release = await held_agent(fleet)
    async with Client(settings=wf_settings) as mesh:
        steps = [
            Step(capability="wf:slow:v1"),
            Step(capability="wf:nobody:v1", retry=RetryPolicy(pending_interval=0.5)),
        ]
        wf_id = await mesh.submit_fanout(steps, timeout=4)

        seen_live: list[WorkflowView] = []

        async def running() -> bool:
            try:
                view = await mesh.inspect_workflow(wf_id)
            except UnknownWorkflowError:
                return False  # no hub has taken it yet
            seen_live.append(view)
            return view.steps[0].state is TaskState.RUNNING and view.steps[1].waiting is not None

        await eventually(running, timeout=10)
        view = seen_live[-1]
        assert view.live and view.owner == wf_hub.hub_id == view.hub_id
        assert view.kind == "fanout" and view.policy == "all" and view.timeout == 4
        assert view.state is TaskState.RUNNING and view.trace_id and view.submitted_at
        first, second = view.steps
        assert first.agent_id == slow.agent_id and first.attempt == 1
        assert first.target == "capability=wf:slow:v1" and first.task_id == f"{wf_id}-0"
        assert second.agent_id is None and second.state is TaskState.PENDING
        assert second.attempt == 0 and second.history == []  # never sent anywhere
        assert second.target == "capability=wf:nobody:v1"
        assert "wf:nobody:v1" in (second.waiting or ""), second.waiting
        assert second.retry_in_s is not None and 0 <= second.retry_in_s <= 0.5

        # Another hub: from what is durable, and it says it is not the owner.
        async with Hub(settings=wf_settings) as other:
            assert other.workflows is not None
            seen = await other.workflows.view(ns, wf_id)
            # Over NATS the question may go to the other hub, which asks the owner: made sure
            # of by taking the owner out of the queue group.
            verb = protocol.hub_subject("*", "workflow")
            (sub,) = [sub for sub in wf_hub._subs if sub.subject == verb]
            await sub.unsubscribe()
            await flushed(wf_hub.nc)  # the server has it: no question goes to it after
            for _ in range(3):
                asked = await mesh.inspect_workflow(wf_id)
                assert asked.live and asked.hub_id == wf_hub.hub_id, asked
                assert asked.steps[1].waiting is not None, asked
            # An owner that does not answer (gone, cut off): the records stand in, at once.
            peer = protocol.hub_peer("*", "workflow", wf_hub.hub_id)
            (sub,) = [sub for sub in wf_hub._subs if sub.subject == peer]
            await sub.unsubscribe()
            await flushed(wf_hub.nc)  # the server has it: no question goes to it after
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            fallback = await mesh.inspect_workflow(wf_id)  # taken by the other hub
            assert not fallback.live and fallback.hub_id == other.hub_id
            assert fallback.steps[0].state is TaskState.RUNNING
            assert loop.time() - t0 < 1.0  # no responders: not waited for
        assert not seen.live and seen.owner == wf_hub.hub_id and seen.hub_id != wf_hub.hub_id
        assert seen.steps[0].state is TaskState.RUNNING  # its last status event, stored
        assert seen.steps[0].agent_id == slow.agent_id and seen.steps[0].attempt == 1
        assert seen.steps[1].waiting is None and seen.steps[1].agent_id is None
        assert not seen.unreadable

        release.set()
        res = await mesh.workflow(wf_id, timeout=15)
        assert res.state is not TaskState.SUCCEEDED  # the second step never found an agent
        assert wf_hub.workflows is not None
        final = await wf_hub.workflows.view(ns, wf_id)  # (its question subscription is gone)
    assert not final.live and final.state is res.state and final.finished_at is not None
    assert final.error is not None and res.error is not None
    assert final.error.code == res.error.code
    assert [s.state for s in final.steps] == [s.state for s in res.steps]
    assert final.steps[0].state is TaskState.SUCCEEDED and final.steps[0].agent_id == slow.agent_id
    assert final.duration_ms is not None and final.duration_ms > 0


async def test_retries_show_every_attempt_and_the_cli_prints_them(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    ns = wf_settings.namespace
    flaky = fleet.agent("flaky.a1")
    calls = 0

    @flaky.handler("wf:flaky:v1")
    async def once(task: Task[Any]) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise TaskFailed("first try fails")
        return "ok"

    ok = echo_agent(fleet, "ok.a1", "wf:ok:v1")
    await flaky.start()
    await ok.start()
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.chain([Step(capability="wf:ok:v1"), Step(capability="wf:flaky:v1")])
        assert res.ok, res
        view = await mesh.inspect_workflow(res.workflow_id)
    assert view.state is TaskState.SUCCEEDED and view.kind == "chain"
    step = view.steps[1]
    assert step.state is TaskState.SUCCEEDED and step.attempt == 2, step
    history = [(h.attempt, h.agent_id, h.state) for h in step.history]
    assert history == [
        (1, flaky.agent_id, TaskState.FAILED),
        (2, flaky.agent_id, TaskState.SUCCEEDED),  # recorded PENDING before it ran
    ], step
    assert step.history[0].code == "REACH_HANDLER_FAILED" and step.handler_failures == 1

    url = wf_settings.nats_url
    assert url is not None
    argv = ["workflow", res.workflow_id, "--namespace", ns]
    table, as_json = await asyncio.gather(run_cli(url, *argv), run_cli(url, *argv, "--json"))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert (
        lines[0].startswith(f"workflow {res.workflow_id} ({ns}): chain") and "SUCCEEDED" in lines[0]
    )
    assert any(ln.split()[:4] == ["1", "SUCCEEDED", "2", flaky.agent_id] for ln in lines), lines
    assert any(ln.split()[:2] == ["#1", "FAILED"] for ln in lines), lines  # the failed attempt
    assert as_json.returncode == 0, as_json.stderr
    assert WorkflowView.model_validate_json(as_json.stdout).steps[1].attempt == 2

    # Unknown: a typed error, exit code 4 (not found) and the code on stderr.
    argv[-3] = "no-such-workflow"
    missing = await run_cli(url, *argv)
    assert missing.returncode == 4 and "REACH_UNKNOWN_WORKFLOW" in missing.stderr, missing
    # Without --namespace the configured one is asked, and the error says how to ask another.
    elsewhere = await run_cli(url, *argv[:-2])
    assert "REACH_UNKNOWN_WORKFLOW" in elsewhere.stderr, elsewhere
    assert "'default'" in elsewhere.stderr and "--namespace" in elsewhere.stderr, elsewhere


async def test_bad_questions_get_typed_errors(wf_hub: Hub, wf_settings: MeshSettings) -> None:
    ns = wf_settings.namespace
    async with Client(settings=wf_settings) as mesh:
        with pytest.raises(UnknownWorkflowError):
            await mesh.inspect_workflow("never-submitted")
        with pytest.raises(BadRequestError):
            await mesh.inspect_workflow("../etc")
        with pytest.raises(BadRequestError):
            await mesh.inspect_workflow("x", namespace="a.b")
    assert wf_settings.nats_url is not None
    nc = await nats.connect(wf_settings.nats_url)
    try:
        subject = protocol.hub_subject(ns, "workflow")
        for body in (b"not json", b"[]", b'{"workflow_id": 5}', b'{"workflow_id": "a b"}', b"{}"):
            reply = await nc.request(subject, body, timeout=5)
            err = json.loads(reply.data)["error"]
            assert err["code"] == "REACH_BAD_REQUEST", (body, err)
        # A loop of views is throttled per namespace (each may read hundreds of messages).
        # The bucket holds 40 and refills 20 a second: what got through is bounded by that.
        codes: Counter[str] = Counter()
        t0 = time.monotonic()
        for _ in range(60):
            reply = await nc.request(subject, b'{"workflow_id": "w1"}', timeout=5)
            codes[json.loads(reply.data)["error"]["code"]] += 1
        allowed = 40 + 20 * (time.monotonic() - t0) + 1
        assert set(codes) == {"REACH_THROTTLED", "REACH_UNKNOWN_WORKFLOW"}, codes
        assert 35 <= codes["REACH_UNKNOWN_WORKFLOW"] <= allowed, (codes, allowed)  # 1 spent above
    finally:
        await nc.close()
    async with Client(settings=wf_settings) as mesh:  # the hub is still there; waits its turn
        with pytest.raises(UnknownWorkflowError):
            await mesh.inspect_workflow("still-never-submitted")


async def test_one_workflow_id_in_two_namespaces_stays_two_workflows(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Callers choose workflow ids: tenant A's view never shows B's workflow of the same id
    (once, A's step showed B's "no routable agent for <B's capability> in namespace B"). A
    chain's steps not started yet say what they wait for, on the owner and on another hub."""
    ns = wf_settings.namespace
    _, release = await held_agent(fleet)
    wf_id = "order-1"
    async with (
        Client(settings=wf_settings) as a,
        Client(settings=wf_settings, namespace="tenantb") as b,
    ):
        await a.submit_chain(
            [Step(capability="wf:slow:v1"), Step(capability="wf:slow:v1")],
            timeout=20,
            workflow_id=wf_id,
        )
        await b.submit_fanout([Step(capability="payroll:secret:v1")], timeout=6, workflow_id=wf_id)

        async def both_known() -> bool:
            if wf_hub.workflows is None:
                return False
            try:
                mine = await wf_hub.workflows.view(ns, wf_id)
                theirs = await wf_hub.workflows.view("tenantb", wf_id)
            except UnknownWorkflowError:
                return False  # not taken yet
            return mine.steps[0].state is TaskState.RUNNING and theirs.steps[0].waiting is not None

        await eventually(both_known, timeout=10)
        views = [await a.inspect_workflow(wf_id)]
        async with Hub(settings=wf_settings) as other:
            assert other.workflows is not None
            views.append(await other.workflows.view(ns, wf_id))
        theirs = await b.inspect_workflow(wf_id)
        release.set()
        assert (await a.workflow(wf_id, timeout=15)).ok
        # Finished before the test ends: a workflow left running would go to the next test's hub.
        assert not (await b.workflow(wf_id, timeout=15)).ok
    assert theirs.namespace == "tenantb" and "payroll:secret:v1" in (theirs.steps[0].waiting or "")
    for mine in views:
        assert mine.kind == "chain" and mine.namespace == ns, mine
        assert "payroll" not in mine.model_dump_json() and "tenantb" not in mine.model_dump_json()
        assert mine.steps[0].state is TaskState.RUNNING and mine.steps[0].waiting is None
        assert mine.steps[1].attempt == 0 and mine.steps[1].agent_id is None
        assert mine.steps[1].waiting == "not started: step 0 has not succeeded yet", mine
    assert views[0].live and not views[1].live


async def test_a_hub_reads_a_few_views_at_once_and_refuses_the_rest(
    wf_hub: Hub, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Views that hang (a JetStream election) hold at most ``VIEWS_AT_ONCE`` of the hub's
    request slots, ``VIEWS_PER_NAMESPACE`` of them for one namespace (more only while
    ``VIEWS_KEPT_FREE`` stay free); the next are refused at once, not queued behind them."""
    engine = wf_hub.workflows
    assert engine is not None
    stuck = asyncio.Event()
    real_view = engine.view

    async def slow_view(ns: str, workflow_id: str, **kw: Any) -> WorkflowView:
        await stuck.wait()
        return await real_view(ns, workflow_id, **kw)

    monkeypatch.setattr(engine, "view", slow_view)
    assert wf_settings.nats_url is not None
    nc = await nats.connect(wf_settings.nats_url)
    try:
        # Each namespace asks one more than its share; the hub's slots fill, then even a
        # namespace holding none is refused.
        spaces = [f"{wf_settings.namespace}n{i}" for i in range(VIEWS_AT_ONCE + 1)]
        asks = [
            asyncio.ensure_future(
                nc.request(protocol.hub_subject(ns, "workflow"), b'{"workflow_id": "w2"}', 10)
            )
            for ns in spaces
            for _ in range(VIEWS_PER_NAMESPACE + 1)
        ]
        held = VIEWS_AT_ONCE
        await eventually(lambda: sum(a.done() for a in asks) == len(asks) - held)
        refused = [json.loads(a.result().data)["error"] for a in asks if a.done()]
        assert {(e["code"], e["details"]["retry_after_ms"]) for e in refused} == {
            ("REACH_THROTTLED", 100)
        }, refused
        assert wf_hub._views_running[False].busy == VIEWS_AT_ONCE
        # Past its share a namespace holds more only while VIEWS_KEPT_FREE stay free (the
        # first askers, while the hub was idle): the slots are spread over three at least.
        held_by = wf_hub._views_running[False].by_ns
        assert max(held_by.values()) <= VIEWS_AT_ONCE - VIEWS_KEPT_FREE, held_by
        assert len(held_by) >= 3, held_by
        assert any("busy with other workflow views" in e["message"] for e in refused)
        assert any("holds its share" in e["message"] for e in refused)
        stuck.set()
        codes = {json.loads((await a).data)["error"]["code"] for a in asks}
        assert codes == {"REACH_THROTTLED", "REACH_UNKNOWN_WORKFLOW"}
    finally:
        await nc.close()


async def test_one_namespace_listing_in_a_loop_leaves_the_others_their_views(
    wf_hub: Hub, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list lasts up to 2.5 s and costs ``LIST_CHARGE`` of its namespace's budget (burst:
    four at once, then two a second): one tenant listing in a loop held five of a hub's
    ``VIEWS_AT_ONCE`` view slots, all of them while its lists were slow (a JetStream
    election), and every other tenant's views were ``REACH_THROTTLED``. It holds
    ``VIEWS_PER_NAMESPACE`` now; another namespace's views are read."""
    engine = wf_hub.workflows
    assert engine is not None
    stuck = asyncio.Event()
    real_list = engine.list

    async def slow_list(*args: Any, **kw: Any) -> Any:
        await stuck.wait()
        return await real_list(*args, **kw)

    monkeypatch.setattr(engine, "list", slow_list)
    assert wf_settings.nats_url is not None
    nc = await nats.connect(wf_settings.nats_url)
    flood: list[asyncio.Future[Any]] = []
    flooder = f"{wf_settings.namespace}flood"
    try:
        lists = protocol.hub_subject(flooder, "workflows")
        # As fast as its budget lets it list, for long enough to take every slot but for it.
        budget_lists = 2 * VIEW_RATE / LIST_CHARGE
        rate = VIEW_RATE / LIST_CHARGE
        until = time.monotonic() + (VIEWS_AT_ONCE - budget_lists) / rate + 0.5
        while time.monotonic() < until:
            flood.append(asyncio.ensure_future(nc.request(lists, b"{}", timeout=10)))
            await asyncio.sleep(0.05)
        # Another tenant: its views are read (the workflow is unknown — it was read).
        view = protocol.hub_subject(wf_settings.namespace, "workflow")
        for _ in range(3):
            got = await nc.request(view, b'{"workflow_id": "w1"}', timeout=5)
            assert json.loads(got.data)["error"]["code"] == "REACH_UNKNOWN_WORKFLOW", got.data
        slots = wf_hub._views_running[False]
        assert slots.by_ns == {flooder: VIEWS_AT_ONCE - VIEWS_KEPT_FREE}, slots.by_ns
        refused = [json.loads(f.result().data)["error"] for f in flood if f.done()]
        assert refused and all(e["code"] == "REACH_THROTTLED" for e in refused), refused
        assert any("holds its share" in e["message"] for e in refused), refused
    finally:
        stuck.set()
        await asyncio.gather(*flood, return_exceptions=True)
        await nc.close()


async def test_one_namespace_cannot_take_every_cancel_or_peer_view_slot(
    wf_hub: Hub, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancels, and the views and cancels other hubs ask a workflow's owner for, have slots
    of their own, shared alike: one namespace holds ``VIEWS_PER_NAMESPACE`` of each, and
    another namespace's are still worked on."""
    engine = wf_hub.workflows
    assert engine is not None
    stuck = asyncio.Event()
    real_view, real_cancel = engine.view, engine.cancel

    async def slow_view(ns: str, *args: Any, **kw: Any) -> Any:
        if ns.endswith("flood"):
            await stuck.wait()
        return await real_view(ns, *args, **kw)

    async def slow_cancel(ns: str, *args: Any, **kw: Any) -> Any:
        if ns.endswith("flood"):
            await stuck.wait()
        return await real_cancel(ns, *args, **kw)

    monkeypatch.setattr(engine, "view", slow_view)
    monkeypatch.setattr(engine, "cancel", slow_cancel)
    assert wf_settings.nats_url is not None
    nc = await nats.connect(wf_settings.nats_url)
    flood: list[asyncio.Future[Any]] = []
    flooder, calm = f"{wf_settings.namespace}flood", wf_settings.namespace
    # What each kind of question is asked on (a verb of the namespace's, or of the hub's
    # peers), and the hub's slots it takes.
    asked: dict[str, tuple[str, ViewSlots]] = {
        "cancel": ("cancel", wf_hub._cancels_running[False]),
        "peer view": ("workflow", wf_hub._views_running[True]),
        "peer cancel": ("cancel", wf_hub._cancels_running[True]),
    }

    def subject(kind: str, ns: str) -> str:
        verb = asked[kind][0]
        peer = kind.startswith("peer")
        return (
            protocol.hub_peer(ns, verb, wf_hub.hub_id) if peer else protocol.hub_subject(ns, verb)
        )

    body = b'{"workflow_id": "w1", "within_s": 2}'
    try:
        for kind, (_, slots) in asked.items():
            asks = [
                asyncio.ensure_future(nc.request(subject(kind, flooder), body, timeout=10))
                for _ in range(VIEWS_AT_ONCE)
            ]
            flood += asks

            def settled(
                asks: Sequence[asyncio.Future[Any]] = asks, slots: ViewSlots = slots
            ) -> bool:
                """Every ask answered (refused) or held."""
                return sum(f.done() for f in asks) + slots.by_ns.get(flooder, 0) == len(asks)

            await eventually(settled)
            got = await nc.request(subject(kind, calm), body, timeout=5)
            assert json.loads(got.data)["error"]["code"] == "REACH_UNKNOWN_WORKFLOW", (kind, got)
            assert slots.by_ns == {flooder: VIEWS_AT_ONCE - VIEWS_KEPT_FREE}, (kind, slots.by_ns)
    finally:
        stuck.set()
        await asyncio.gather(*flood, return_exceptions=True)
        await nc.close()


async def test_a_step_no_agent_takes_and_a_stream_that_does_not_answer(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain's second step that found no agent: its owner says why, another hub says to ask
    the owner (it has no record to read). A status read that never answers (a stream leader
    gone) costs the view at most its deadline and is named in ``unreadable``."""
    ns = wf_settings.namespace
    slow, release = await held_agent(fleet)
    ok = echo_agent(fleet, "ok.a1", "wf:ok:v1")
    await ok.start()
    async with Client(settings=wf_settings) as mesh:
        chain_id = await mesh.submit_chain(
            [Step(capability="wf:ok:v1"), Step(capability="wf:nobody:v1")], timeout=5
        )
        fan_id = await mesh.submit_fanout([Step(capability="wf:slow:v1")] * 3, timeout=20)

        async def waiting() -> bool:
            try:
                view = await mesh.inspect_workflow(chain_id)
            except UnknownWorkflowError:
                return False
            return view.steps[1].waiting is not None and "nobody" in view.steps[1].waiting

        await eventually(waiting, timeout=10)

        async def running() -> bool:
            try:
                view = await mesh.inspect_workflow(fan_id)
            except UnknownWorkflowError:
                return False
            return all(s.state is TaskState.RUNNING for s in view.steps)

        await eventually(running, timeout=10)
        async with Hub(settings=wf_settings) as other:
            engine = other.workflows
            assert engine is not None
            seen = await engine.view(ns, chain_id)
            assert seen.steps[0].state is TaskState.SUCCEEDED
            assert seen.steps[1].waiting == "no agent has it yet (ask its owner)", seen

            async def never(*args: Any, **kw: Any) -> None:
                await asyncio.Event().wait()

            monkeypatch.setattr(engine._tracker, "last_state", never)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            stuck = await engine.view(ns, fan_id)
            took = loop.time() - t0
        release.set()
        assert (await mesh.workflow(fan_id, timeout=15)).ok
        assert not (await mesh.workflow(chain_id, timeout=15)).ok  # its deadline
    assert VIEW_DEADLINE - 0.1 <= took <= VIEW_DEADLINE + 1.0, took
    assert stuck.unreadable == [f"step {i} (no answer in time)" for i in range(3)], stuck
    assert [s.agent_id for s in stuck.steps] == [slow.agent_id] * 3  # what is known stays


async def test_the_rest_api_serves_the_same_view(fleet: Fleet, wf_settings: MeshSettings) -> None:
    ns = wf_settings.namespace
    async with Hub(settings=wf_settings.model_copy(update={"http_port": 0})) as hub:
        base = hub.http_url
        agent = echo_agent(fleet, "ok.a1", "wf:ok:v1")
        await agent.start()
        async with Client(settings=wf_settings) as mesh:
            res = await mesh.fanout([Step(capability="wf:ok:v1", payload=1)], timeout=10)
            assert res.ok
            over_nats = await mesh.inspect_workflow(res.workflow_id)
        status, body = await fetch(f"{base}/api/workflows/{res.workflow_id}?namespace={ns}")
        assert status == 200, body
        view = WorkflowView.model_validate_json(body)
        assert view.steps == over_nats.steps and view.state is TaskState.SUCCEEDED
        status, body = await fetch(f"{base}/api/workflows/nothing-here?namespace={ns}")
        assert status == 404 and json.loads(body)["error"]["code"] == "REACH_UNKNOWN_WORKFLOW"
        for bad in (f"{'x' * 49}?namespace={ns}", "ok?namespace=a.b", "a%20b"):
            status, body = await fetch(f"{base}/api/workflows/{bad}")
            assert status == 400, (bad, status, body)
            assert json.loads(body)["error"]["code"].startswith("REACH_BAD"), body
        status, body = await fetch(f"{base}/openapi.json")
        assert "/api/workflows/{workflow_id}" in json.loads(body)["paths"]


def test_a_hub_id_is_a_subject_token(wf_settings: MeshSettings) -> None:
    """Other hubs ask a workflow's owner on a subject made of its id."""
    for bad in ("hub.a", "hub a", "hub>", "*", "h" * 65):
        with pytest.raises(BadRequestError, match="hub_id"):
            Hub(settings=wf_settings, hub_id=bad)
    assert Hub(settings=wf_settings, hub_id="Hub_A-1").hub_id == "Hub_A-1"


async def test_the_dashboard_keeps_one_id_in_two_namespaces_apart(
    wf_settings: MeshSettings,
) -> None:
    """The dashboard's recent workflows are keyed by namespace and id (once by id alone: two
    tenants' workflows of one id were one row)."""
    async with (
        Hub(settings=wf_settings.model_copy(update={"http_port": 0})) as hub,
        Client(settings=wf_settings) as a,
        Client(settings=wf_settings, namespace="tenantb") as b,
    ):
        for mesh in (a, b):
            await mesh.submit_fanout([Step(capability="wf:nobody:v1")], timeout=2, workflow_id="w1")

        async def both() -> bool:
            status, body = await fetch(f"{hub.http_url}/api/dashboard/workflows")
            rows = json.loads(body)["workflows"] if status == 200 else []
            return sorted(r["namespace"] for r in rows if r["workflow_id"] == "w1") == sorted(
                [wf_settings.namespace, "tenantb"]
            )

        await eventually(both, timeout=10)
        for mesh in (a, b):
            assert not (await mesh.workflow("w1", timeout=15)).ok  # ended before the test ends
