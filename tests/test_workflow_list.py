"""``reach.hub.<ns>.workflows``: a namespace's recent workflows, for an operator
(``Client.list_workflows``, ``reach-mesh workflows``), on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import nats
import nats.js.errors
import pytest

from reach_mesh import (
    BadRequestError,
    Client,
    MeshSettings,
    MeshUnavailableError,
    Step,
    TaskState,
    WorkflowList,
    protocol,
)
from reach_mesh._nats import flushed
from reach_mesh.agent import Task, TaskFailed
from reach_mesh.hub import Hub, _wf_list

from .helpers import Fleet, clean_env, echo_agent, eventually, fetch, held_handler, run_cli

pytestmark = pytest.mark.timeout(60)


def _ids(listed: WorkflowList) -> list[str]:
    return [w.workflow_id for w in listed.workflows]


async def test_recent_workflows_newest_first_by_state(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """Finished and running workflows of the namespace, each as its newest record has it,
    newest write first; a state filter, a limit, another namespace, a deleted record."""
    ns = wf_settings.namespace
    await echo_agent(fleet, "ok.a1", "wf:ok:v1").start()
    bad = fleet.agent("bad.a1")

    @bad.handler("wf:bad:v1")
    async def fails(task: Task[Any]) -> Any:
        raise TaskFailed("no", retryable=False)

    await bad.start()
    slow = fleet.agent("slow.a1")
    held = held_handler(slow, "wf:held:v1", "done")
    await slow.start()
    async with Client(settings=wf_settings) as mesh:
        first = await mesh.fanout([Step(capability="wf:ok:v1", payload=i) for i in range(2)])
        failed = await mesh.fanout(
            [Step(capability="wf:ok:v1", payload=1), Step(capability="wf:bad:v1", payload=2)]
        )
        last = await mesh.chain([Step(capability="wf:ok:v1", payload=3)])
        running = await mesh.submit_chain([Step(capability="wf:held:v1", payload=4)], timeout=30)
        await asyncio.wait_for(held.started.wait(), 10)
        assert first.ok and last.ok and failed.state is TaskState.FAILED

        listed = await mesh.list_workflows()
        assert _ids(listed) == [running, last.workflow_id, failed.workflow_id, first.workflow_id]
        assert listed.matched == 4 and not listed.truncated and listed.hub_id == wf_hub.hub_id
        by_id = {w.workflow_id: w for w in listed.workflows}
        now = by_id[running]
        assert (now.state, now.kind, now.steps, now.owner, now.timeout) == (
            TaskState.RUNNING,
            "chain",
            1,
            wf_hub.hub_id,
            30.0,
        )
        lost = by_id[failed.workflow_id]
        assert (lost.state, lost.kind, lost.steps, lost.failed_steps) == (
            TaskState.FAILED,
            "fanout",
            2,
            1,
        )
        assert lost.error is not None and lost.error.code == "REACH_HANDLER_FAILED"
        assert lost.finished_at is not None and lost.duration_ms is not None
        assert lost.trace_id == failed.trace_id
        assert by_id[first.workflow_id].failed_steps == 0

        # Filtered by state (names in any case, one or several), and limited.
        only_failed = await mesh.list_workflows(state="failed")
        assert _ids(only_failed) == [failed.workflow_id] and only_failed.matched == 1
        done = await mesh.list_workflows(state=[TaskState.SUCCEEDED, TaskState.FAILED], limit=2)
        assert _ids(done) == [last.workflow_id, failed.workflow_id] and done.matched == 3
        assert _ids(await mesh.list_workflows(state="RUNNING")) == [running]
        assert wf_settings.nats_url is not None
        shown = await run_cli(
            wf_settings.nats_url, "workflows", "--namespace", ns, "--state", "running"
        )
        assert shown.returncode == 0, shown.stderr
        (row,) = [ln for ln in shown.stdout.splitlines() if ln.startswith(running)]
        assert row.split()[1:3] == ["chain", "RUNNING"] and " s so far" in row, row
        assert "past its timeout" not in row
        # Records are keyed by namespace: another one lists none of them.
        assert (await mesh.list_workflows(namespace=f"{ns}x")).workflows == []

        # Finished: its final record is its newest write; a deleted record is gone.
        held.release.set()
        await mesh.workflow(running, timeout=10)
        assert (await mesh.list_workflows(state="RUNNING")).workflows == []
        kv = await mesh.nc.jetstream().key_value(protocol.KV_WORKFLOWS)
        await kv.delete(protocol.workflow_key(ns, first.workflow_id))
        after = await mesh.list_workflows()
        assert _ids(after) == [running, last.workflow_id, failed.workflow_id]
        assert after.workflows[0].state is TaskState.SUCCEEDED


async def test_unfinished_workflows_older_than_the_window_are_listed(
    fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workflow running for longer than the window asked for (its record was written when
    it started) and ones that no hub has taken yet (no record: PENDING, as of their
    submission, in the default window too; one whose ``Nats-Msg-Id`` names another id than its
    body, under the header's id, which its refusal will be stored under) are listed, newest
    first: their submissions still wait in the stream. Not another
    namespace's (but in the operators' list), not one that ended before the window. More
    than a list reads, no time left, or ``REACH_WF`` unreadable: what was read, and it says
    so; a list of final states only does not look."""
    ns = wf_settings.namespace
    # The held workflow's record must be its start's. With the suite's 1 s ack wait, a loop
    # stalled for two thirds of it (a loaded CI box; the hub also resumes other tests'
    # leftovers at its start) misses a +WPI: the submission comes back to this hub's pull
    # before it stops, the hub takes the workflow over from itself, and that record write,
    # landing after the next submissions, makes it one of the two newest in the list.
    settings = wf_settings.model_copy(update={"workflow_ack_wait": 5.0})
    wf_hub = Hub(settings=settings)
    other = Hub(settings=settings)
    slow = fleet.agent("slow.a1")
    held = held_handler(slow, "wf:held:v1", "done")
    elsewhere = wf_settings.model_copy(update={"namespace": f"{ns}x"})
    fleet2 = Fleet(elsewhere)
    try:
        await wf_hub.start()
        engine = wf_hub.workflows
        assert engine is not None and engine._pull is not None
        await echo_agent(fleet, "ok.a1", "wf:ok:v1").start()
        await slow.start()
        await echo_agent(fleet2, "ok.a1", "wf:ok:v1").start()
        async with Client(settings=wf_settings) as mesh, Client(settings=elsewhere) as mesh2:
            ended = await mesh.fanout([Step(capability="wf:ok:v1", payload=0)], timeout=10)
            running = await mesh.submit_chain([Step(capability="wf:held:v1")], timeout=30)
            await asyncio.wait_for(held.started.wait(), 10)
            await engine._pull.stop()  # this hub takes no more submissions
            await flushed(wf_hub.nc)  # the server has the unsubscribe: it drops the open pulls
            waiting = await mesh.submit_chain([Step(capability="wf:ok:v1")], timeout=30)
            spec = mesh._workflow_spec("chain", [Step(capability="wf:ok:v1")], "all", 30, None)
            await mesh.nc.jetstream().publish(
                protocol.wf_submit(ns),
                protocol.encode(spec),
                headers={protocol.HDR_MSG_ID: protocol.submit_msg_id(ns, "decoy", "n")},
            )
            bare = "decoy"  # its Nats-Msg-Id names another id: refused under the header's
            theirs = await mesh2.submit_chain([Step(capability="wf:ok:v1")], timeout=30)
            await asyncio.sleep(1.2)
            recent = await mesh.list_workflows(since=1.0)
            ids = _ids(recent)  # newest first (the two submitted within a ms may tie)
            # Newest first by their newest write. The running one's record is its start's,
            # unless the hub took it over from itself (see above: a loaded CI box still did,
            # once, with the 5 s ack wait) and wrote it again after the later submissions.
            assert set(ids[:3]) == {bare, waiting, running} and recent.matched == 3, ids
            stamps = [w.updated_at for w in recent.workflows]
            assert stamps == sorted(stamps, reverse=True), stamps
            assert not recent.truncated
            by_id = {w.workflow_id: w for w in recent.workflows}
            now = by_id[running]
            assert (now.namespace, now.state, now.kind, now.owner) == (
                ns,
                TaskState.RUNNING,
                "chain",
                wf_hub.hub_id,
            )
            assert now.updated_at < recent.since
            later = by_id[waiting]
            assert (later.state, later.owner, later.kind) == (TaskState.PENDING, None, None)
            assert later.submitted_at is not None and later.submitted_at < recent.since
            assert ended.workflow_id not in _ids(await mesh.list_workflows(since=1.0))
            assert _ids(await mesh.list_workflows(since=1.0, state="RUNNING")) == [running]
            # Taken by no hub, whenever submitted: in the default window too.
            pending = await mesh.list_workflows(state="PENDING")
            assert set(_ids(pending)) == {bare, waiting}
            assert spec.workflow_id not in _ids(recent)
            every = await mesh.list_workflows(since=1.0, all_namespaces=True, limit=500)
            assert {running, waiting, bare, theirs} <= set(_ids(every))
            assert _ids(await mesh2.list_workflows(since=1.0)) == [theirs]
            with monkeypatch.context() as m:
                m.setattr(_wf_list, "UNFINISHED_MAX", 1)
                cut = await mesh.list_workflows(since=1.0)
                assert _ids(cut) == [running] and cut.truncated  # the oldest is read first
                failed = await mesh.list_workflows(since=1.0, state=["FAILED", "TIMEOUT"])
                assert not failed.truncated  # (nothing to look for before the window)
            with monkeypatch.context() as m:
                m.setattr(_wf_list, "UNFINISHED_WITHIN", 0.0)
                hurried = await mesh.list_workflows(since=1.0)
            assert _ids(hurried) == [] and hurried.truncated  # answered, and says so
            loop = asyncio.get_running_loop()
            late = await _wf_list._unfinished(wf_hub.nc.jetstream(), ns, (), loop.time())
            assert late == ([], True)  # no time left by the list's own deadline

            async def no_leader(*args: Any, **kw: Any) -> Any:
                raise nats.js.errors.ServiceUnavailableError

            with monkeypatch.context() as m:
                m.setattr(nats.js.JetStreamContext, "get_msg", no_leader)
                blind = await mesh.list_workflows(since=1.0)
            assert _ids(blind) == [] and blind.truncated
            # Another hub takes the waiting ones; the held one ends: all leave the list.
            await other.start()
            assert (await mesh2.workflow(theirs, timeout=10)).ok
            assert (await mesh.workflow(waiting, timeout=10)).ok
            refused = await mesh.workflow(bare, timeout=10)
            assert refused.error is not None and refused.error.code == "REACH_BAD_WORKFLOW"
            held.release.set()
            assert (await mesh.workflow(running, timeout=10)).ok
            await asyncio.sleep(1.1)
            assert _ids(await mesh.list_workflows(since=1.0)) == []
    finally:
        held.release.set()
        await fleet2.close()
        await other.close()
        await wf_hub.close()


async def test_a_list_reads_the_newest_writes_and_says_when_it_stopped(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More records in the window than one list reads: those among the bucket's last writes
    are read (the newest workflows), and the answer says the window was not read to its
    start, and from when it read."""
    await echo_agent(fleet, "ok.a1", "wf:ok:v1").start()
    async with Client(settings=wf_settings) as mesh:
        done = [
            await mesh.fanout([Step(capability="wf:ok:v1", payload=i)], timeout=10)
            for i in range(4)
        ]
        whole = await mesh.list_workflows()  # the bucket keeps each one's newest write
        assert not whole.truncated and whole.scanned == 4 and whole.matched == 4
        monkeypatch.setattr(_wf_list, "SCAN_MAX", 3)
        part = await mesh.list_workflows()
    newest_first = [r.workflow_id for r in reversed(done)]
    assert part.truncated and 0 < part.scanned < 4 and part.matched == part.scanned
    assert _ids(part) == newest_first[: part.scanned]  # the oldest one was not read
    assert whole.oldest_read_at is not None and part.oldest_read_at is not None
    assert part.oldest_read_at > whole.oldest_read_at


async def test_a_list_reads_the_newest_records_that_fit_its_bytes(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records hold results: an audit's forty 6 MB records made every list of their namespace
    (and the operator's of every namespace) ``REACH_UNAVAILABLE`` for a day, their parsing
    past the list's deadline. A list now weighs the records from their headers first and
    reads the newest that fit ``BYTES_MAX`` (here about two of four), saying it stopped."""
    await echo_agent(fleet, "big.a1", "wf:big:v1").start()
    async with Client(settings=wf_settings) as mesh:
        done = [
            await mesh.fanout([Step(capability="wf:big:v1", payload="x" * 20_000)], timeout=10)
            for _ in range(4)
        ]
        whole = await mesh.list_workflows()
        assert not whole.truncated and whole.matched == 4
        monkeypatch.setattr(_wf_list, "BYTES_MAX", 110_000)  # (each record: about 41 KB)
        part = await mesh.list_workflows()
    newest_first = [r.workflow_id for r in reversed(done)]
    assert part.truncated and part.matched == part.scanned == 2, part
    assert _ids(part) == newest_first[:2]


async def test_bad_list_questions_get_typed_errors(wf_hub: Hub, wf_settings: MeshSettings) -> None:
    async with Client(settings=wf_settings) as mesh:
        bad: list[tuple[dict[str, Any], str]] = [
            ({"state": "BOGUS"}, "state"),
            ({"state": [1]}, "state"),
            ({"limit": 0}, "limit"),
            ({"limit": 501}, "limit"),
            ({"since": 0}, "since_s"),
            ({"since": 8 * 86_400.0}, "since_s"),
        ]
        for kw, field in bad:
            with pytest.raises(BadRequestError) as refused:
                await mesh.list_workflows(**kw)
            assert refused.value.details.get("field") == field, (kw, refused.value)
        # Not a JSON object, or a wrong type: typed errors too, and the hub answers on.
        for body in (b"[1]", b'{"limit": "ten"}', b'{"since_s": true}', b"{nope"):
            reply = await mesh.nc.request(
                protocol.hub_subject(wf_settings.namespace, "workflows"), body, timeout=5
            )
            assert b'"REACH_BAD_REQUEST"' in reply.data, (body, reply.data)
        assert (await mesh.list_workflows()).workflows == []


async def test_the_cli_lists_the_failed_ones(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    ns = wf_settings.namespace
    await echo_agent(fleet, "ok.a1", "wf:ok:v1").start()
    async with Client(settings=wf_settings) as mesh:
        ok = await mesh.fanout([Step(capability="wf:ok:v1", payload=1)], timeout=10)
        gone = await mesh.fanout([Step(capability="wf:none:v1", payload=1)], timeout=1.5)
    assert ok.ok and gone.state is not TaskState.SUCCEEDED
    url = wf_settings.nats_url
    assert url is not None
    argv = ["workflows", "--namespace", ns, "--state", "FAILED", "--state", "TIMEOUT"]
    table, as_json = await asyncio.gather(run_cli(url, *argv), run_cli(url, *argv, "--json"))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["WORKFLOW", "KIND", "STATE"], lines
    assert lines[1].split()[:3] == [gone.workflow_id, "fanout", gone.state.value], lines
    assert "0/1 ok" in lines[1] and ok.workflow_id not in table.stdout
    assert f"1 workflow(s) of namespace {ns}" in lines[-1]
    assert "unfinished" not in lines[-1]  # final states only: no unfinished one is listed
    assert as_json.returncode == 0, as_json.stderr
    assert _ids(WorkflowList.model_validate_json(as_json.stdout)) == [gone.workflow_id]
    # A bad state: usage error, exit code 2, the code on stderr.
    bogus = await run_cli(url, *argv[:-4], "--state", "NOPE")
    assert bogus.returncode == 2 and "REACH_BAD_REQUEST" in bogus.stderr, bogus


async def test_an_operator_lists_every_namespace(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """The question before any namespace is known ("what failed in the last hour?"): every
    namespace's workflows, each naming its own, over NATS and in the CLI (``-A``)."""
    ns = wf_settings.namespace
    other = wf_settings.model_copy(update={"namespace": f"{ns}y"})
    await echo_agent(fleet, "ok.a1", "wf:ok:v1").start()
    async with Client(settings=wf_settings) as mesh, Client(settings=other) as there:
        ok = await mesh.fanout([Step(capability="wf:ok:v1", payload=1)], timeout=10)
        gone = await there.fanout([Step(capability="wf:none:v1", payload=1)], timeout=1.5)
        assert ok.ok and gone.state is TaskState.TIMEOUT
        # (Other tests' workflows share this server: only these two namespaces are looked at.)
        every = await mesh.list_workflows(all_namespaces=True, limit=500)
        assert every.namespace is None
        ours = [
            (w.namespace, w.workflow_id, w.state)
            for w in every.workflows
            if w.namespace in (ns, other.namespace)
        ]
        assert ours == [
            (other.namespace, gone.workflow_id, TaskState.TIMEOUT),
            (ns, ok.workflow_id, TaskState.SUCCEEDED),
        ]
        failed = await mesh.list_workflows(all_namespaces=True, state="TIMEOUT", limit=500)
        assert gone.workflow_id in _ids(failed) and ok.workflow_id not in _ids(failed)
        # A namespace's own list names it too.
        assert [w.namespace for w in (await mesh.list_workflows()).workflows] == [ns]
    url = wf_settings.nats_url
    assert url is not None
    shown = await run_cli(url, "workflows", "-A", "--state", "TIMEOUT", "--limit", "500")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAMESPACE", "WORKFLOW", "KIND"], lines
    (row,) = [ln for ln in lines if gone.workflow_id in ln]
    assert row.split()[:4] == [other.namespace, gone.workflow_id, "fanout", "TIMEOUT"], row
    assert "workflow(s) of every namespace" in lines[-1]
    both = await run_cli(url, "workflows", "--all-namespaces", "--namespace", ns)
    assert both.returncode == 2 and "REACH_BAD_REQUEST" in both.stderr, both


async def test_the_list_of_every_namespace_is_no_tenants_to_pay_for(
    wf_hub: Hub, wf_settings: MeshSettings
) -> None:
    """A namespace's lists are charged to its workflow-view budget; an operator's list of
    every namespace, asked on any namespace's admin subject, is charged to none: a tenant that
    spent its budget does not turn the operators' list away, and the list does not spend it."""
    assert wf_settings.nats_url is not None
    nc = await nats.connect(wf_settings.nats_url)
    try:
        own = protocol.hub_subject(wf_settings.namespace, "workflows")
        codes = []
        for _ in range(6):  # 10 views each, of a bucket of 40
            reply = await nc.request(own, b"{}", timeout=5)
            codes.append(json.loads(reply.data).get("error", {}).get("code"))
        assert codes[:4] == [None] * 4 and "REACH_THROTTLED" in codes[4:], codes
        admin = protocol.hub_subject(wf_settings.namespace, "admin")
        for _ in range(6):
            reply = await nc.request(admin, b'{"op": "workflows", "limit": 1}', timeout=5)
            assert "error" not in json.loads(reply.data), reply.data
    finally:
        await nc.close()


async def test_the_rest_api_serves_the_same_list(fleet: Fleet, wf_settings: MeshSettings) -> None:
    ns = wf_settings.namespace
    async with Hub(settings=wf_settings.model_copy(update={"http_port": 0})) as hub:
        base = hub.http_url
        await echo_agent(fleet, "ok.a1", "wf:ok:v1").start()
        async with Client(settings=wf_settings) as mesh:
            ok = await mesh.fanout([Step(capability="wf:ok:v1", payload=1)], timeout=10)
            gone = await mesh.fanout([Step(capability="wf:none:v1", payload=1)], timeout=1.5)
            over_nats = await mesh.list_workflows()
        status, body = await fetch(f"{base}/api/workflows?namespace={ns}")
        assert status == 200, body
        listed = WorkflowList.model_validate_json(body)
        assert listed.workflows == over_nats.workflows
        assert _ids(listed) == [gone.workflow_id, ok.workflow_id]
        status, body = await fetch(
            f"{base}/api/workflows?namespace={ns}&state=SUCCEEDED&state=RUNNING&limit=5"
        )
        assert status == 200 and _ids(WorkflowList.model_validate_json(body)) == [ok.workflow_id]
        # Every namespace's: the operators' list (the token is an operator's).
        status, body = await fetch(f"{base}/api/workflows?all_namespaces=true&limit=500")
        assert status == 200, body
        every = WorkflowList.model_validate_json(body)
        assert every.namespace is None
        assert [w.workflow_id for w in every.workflows if w.namespace == ns] == _ids(listed)
        for bad in (
            "state=NOPE",
            "limit=0",
            "limit=501",
            "since_s=-1",
            "namespace=a.b",
            f"all_namespaces=true&namespace={ns}",
        ):
            status, body = await fetch(f"{base}/api/workflows?{bad}")
            assert status == 400, (bad, status, body)
            assert json.loads(body)["error"]["code"].startswith("REACH_BAD"), body
        status, body = await fetch(f"{base}/openapi.json")
        assert "/api/workflows" in json.loads(body)["paths"]


async def test_a_list_is_brief_leaves_no_consumer_and_is_never_silently_partial(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """An error's message is cut and its details left out (a list of 500 stays far below
    NATS' max_payload, and a hub's memory holds brief records); each list deletes its
    consumer; a list that cannot be read in time is REACH_UNAVAILABLE, not a list missing
    its newest records."""
    ns = wf_settings.namespace
    bad = fleet.agent("bad.a1")

    @bad.handler("wf:bad:v1")
    async def fails(task: Task[Any]) -> Any:
        raise TaskFailed("m" * 3000, retryable=False, trace="d" * 7000)

    await bad.start()
    js = wf_hub._js
    assert js is not None
    stream = f"KV_{protocol.KV_WORKFLOWS}"
    async with Client(settings=wf_settings) as mesh:
        res = await mesh.fanout([Step(capability="wf:bad:v1", payload=1)], timeout=10)
        assert res.error is not None and len(res.error.message) > _wf_list.MESSAGE_MAX
        assert res.error.details
        before = (await js.stream_info(stream)).state.consumer_count
        for _ in range(3):
            (summary,) = (await mesh.list_workflows()).workflows
        assert summary.error is not None and summary.error.code == res.error.code
        assert len(summary.error.message) == _wf_list.MESSAGE_MAX
        assert summary.error.message.endswith("…") and summary.error.details == {}
        assert (await js.stream_info(stream)).state.consumer_count == before
    made: list[str] = []
    closed: list[str] = []
    name, close = _wf_list._name, _wf_list._close

    def named() -> str:
        made.append(name())
        return made[-1]

    async def closing(js: Any, sub: Any, consumer: str) -> None:
        await close(js, sub, consumer)
        closed.append(consumer)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_wf_list, "_name", named)
        patch.setattr(_wf_list, "_close", closing)
        with pytest.raises(MeshUnavailableError, match="could not be read within"):
            await _wf_list.list_workflows(js, ns, hub_id=wf_hub.hub_id, within=0.0)
        # Cut short while its consumer was being made: deleted once made.
        await eventually(lambda: closed == made)
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.consumer_info(stream, made[0])
    assert (await js.stream_info(stream)).state.consumer_count == before


async def test_the_cli_says_which_bound_a_bad_argument_misses(wf_settings: MeshSettings) -> None:
    """``--since`` and ``--limit`` out of range: a usage error naming the option and its
    bounds (exit code 2), before anything is asked of a hub."""
    url = wf_settings.nats_url
    assert url is not None
    for args, said in [
        (["--since", "0"], "argument --since: 0 is not in (0, 604800]"),
        (["--since", "abc"], "argument --since: invalid float value: 'abc'"),
        (["--limit", "501"], "argument --limit: 501 is not in [1, 500]"),
    ]:
        run = await run_cli(url, "workflows", *args)
        assert run.returncode == 2 and said in run.stderr, (args, run.stderr)


async def test_an_empty_list_asked_without_a_namespace_says_where_else_to_look(
    wf_hub: Hub, fleet: Fleet, wf_settings: MeshSettings
) -> None:
    """`reach-mesh workflows` without --namespace lists $REACH_NAMESPACE's (else default's):
    a new user whose workflows ran in their own namespace saw only '0 workflow(s) of
    namespace default'. Empty, it names --namespace and -A; asked of a namespace, it does not."""
    await echo_agent(fleet, "ok.a1", "wf:ok:v1").start()
    async with Client(settings=wf_settings) as mesh:
        assert (await mesh.fanout([Step(capability="wf:ok:v1", payload=1)], timeout=10)).ok
    url = wf_settings.nats_url
    assert url is not None
    hint = "another namespace: --namespace NS, or -A for every namespace"

    def listed(namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "reach_mesh.cli", "--nats", url, "workflows", *args]
        env = {**clean_env(), "REACH_NAMESPACE": namespace}
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    empty, named, found = await asyncio.gather(
        asyncio.to_thread(listed, f"{wf_settings.namespace}-nobody"),
        asyncio.to_thread(listed, "x", "--namespace", f"{wf_settings.namespace}-nobody"),
        asyncio.to_thread(listed, wf_settings.namespace),
    )
    for run in (empty, named, found):
        assert run.returncode == 0, run.stderr
    assert empty.stdout.splitlines()[-1].strip() == hint, empty.stdout
    assert empty.stdout.startswith(f"0 workflow(s) of namespace {wf_settings.namespace}-nobody")
    assert hint not in named.stdout and named.stdout.startswith("0 workflow(s)"), named.stdout
    assert hint not in found.stdout and "1 workflow(s) of namespace" in found.stdout, found.stdout
