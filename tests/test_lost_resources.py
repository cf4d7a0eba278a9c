"""A stream or a consumer of the mesh deleted under it (``nats stream rm`` by mistake, a
bucket removed, a consumer idle past its ``inactive_threshold``): created again by whoever
uses it, said in a log line, and the work goes on.

Before, an agent whose work consumer was gone pulled from it thousands of times a second (each
pull answered 503 at once, and pulled again at once) and never took another workflow step,
while its heartbeats said it was fine; and hubs retried writes into a deleted stream, and
pulls from a deleted consumer, in silence until restarted.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from reach_mesh import Client, MeshSettings, Step, protocol
from reach_mesh._consume import PullConsumer
from reach_mesh._nats import ensure_kv
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import MeshUnavailableError
from reach_mesh.hub import Hub
from reach_mesh.hub._steps import Workflow
from reach_mesh.models import AgentState, TaskState
from reach_mesh.server import EmbeddedNats
from reach_mesh.workflow import WorkflowSpec

from .helpers import FAST, WF_FAST, eventually, freeze, gated_echo


@pytest.fixture
async def server() -> AsyncIterator[EmbeddedNats]:
    """A server of the test's own: its streams are deleted."""
    async with EmbeddedNats() as s:
        yield s


def _settings(url: str) -> MeshSettings:
    return MeshSettings(nats_url=url, namespace="lost", audit_enabled=False, **FAST, **WF_FAST)


def _echo(settings: MeshSettings) -> Agent:
    agent = Agent("lost.echo.a1", settings=settings)

    @agent.handler("test:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    return agent


async def _exists(url: str, stream: str, consumer: str | None = None) -> bool:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await (js.stream_info(stream) if consumer is None else js.consumer_info(stream, consumer))
        return True
    except NotFoundError:
        return False
    finally:
        await nc.close()


async def _delete(url: str, stream: str, consumer: str | None = None) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await (
            js.delete_stream(stream) if consumer is None else js.delete_consumer(stream, consumer)
        )
    finally:
        await nc.close()


async def _fanout_ok(mesh: Client, payload: Any) -> None:
    result = await mesh.fanout([Step(capability="test:echo:v1", payload=payload)], timeout=20)
    assert result.state is TaskState.SUCCEEDED and result.steps[0].result == payload, result


async def test_pulls_from_a_consumer_nobody_serves_go_at_the_watchdogs_pace(
    server: EmbeddedNats,
) -> None:
    """A consumer that is not there (and stays so): each pull is answered 503 at once. The
    next goes on the watchdog's tick (half a second), not at once; the owner is asked to
    check after three, then after 1, 2, 4 … s while they go on.

    Measured against the time that passed, not a fixed sleep's worth of ticks: a loaded box's
    loop ticks less often (fewer pulls, a later check), never more often."""
    nc = await nats.connect(server.url)
    loop = asyncio.get_running_loop()
    #: Each check: when (the loop's clock), and the pulls sent and answered 503 by then.
    checks: list[tuple[float, int, int]] = []
    sent = nc.stats["out_msgs"]

    def gone() -> Awaitable[None]:
        # Noted when the check is asked for (not when its task first runs: later, by as much
        # as the loop lags), a moment after the consumer read the clock to space the checks.
        checks.append((loop.time(), nc.stats["out_msgs"] - sent, pull._refused))
        return asyncio.sleep(0)

    pull = PullConsumer(
        nc, protocol.STREAM_WORK, "nobody", lambda msg: None, 16, expires=5.0, on_gone=gone
    )
    try:
        start = loop.time()
        await pull.start()
        await eventually(lambda: len(checks) >= 3, timeout=30)
        elapsed = loop.time() - start
        pulls = nc.stats["out_msgs"] - sent
        # At most one pull per tick (0.5 s) and the first: at once, it was thousands a second.
        assert 3 <= pulls <= elapsed / 0.5 + 2, (pulls, elapsed)
        (t1, _, refused1), (t2, _, _), (t3, _, _) = checks[:3]
        assert refused1 == 3, checks  # the first check: after the third 503
        # Then 1 s, then 2 s later at the earliest (more on a loaded box: the next 503 after).
        assert t2 - t1 >= 1.0 - 0.01 and t3 - t2 >= 2.0 - 0.01, checks
        assert len(checks) == 3, checks  # the next: 4 s later
    finally:
        await pull.stop()
        await nc.close()


async def test_an_agent_whose_work_consumer_is_deleted_creates_it_again(
    server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """Its pulls, answered 503, go on at the watchdog's pace (not thousands a second); a few
    such answers in, it finds its consumer gone, creates it again and says so; steps reach it
    again."""
    caplog.set_level(logging.WARNING, logger="reach_mesh.agent.work")
    settings = _settings(server.url)
    agent = _echo(settings)
    durable = protocol.work_consumer(agent.agent_id)
    async with Hub(settings=settings), agent, Client(settings=settings) as mesh:
        await _fanout_ok(mesh, 1)
        await _delete(server.url, protocol.STREAM_WORK, durable)
        sent = agent.nc.stats["out_msgs"]
        await asyncio.sleep(2.0)
        # Heartbeats (5 a second here) and pulls every half second; the old loop: thousands.
        assert agent.nc.stats["out_msgs"] - sent < 60, agent.nc.stats["out_msgs"] - sent
        await eventually(lambda: _exists(server.url, protocol.STREAM_WORK, durable), timeout=10)
        said = [r.getMessage() for r in caplog.records]
        assert any("work consumer of lost.echo.a1 was gone" in m for m in said), said
        await _fanout_ok(mesh, 2)


async def test_an_agent_that_cannot_ask_about_its_work_consumer_pulls_on(
    server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """The check behind pulls answered 503 (``_consumer_gone``) that gets no answer itself —
    a cluster electing the stream's leader, here the server frozen past the check's 5 s — is
    no error: the consumer may well be there, the pulls go on and the next check asks again.
    It raised, and each agent logged an ERROR with a traceback per election (the chaos
    suite's node_kill: 28 in two runs)."""
    caplog.set_level(logging.INFO, logger="reach_mesh")
    settings = _settings(server.url)
    agent = _echo(settings)
    async with Hub(settings=settings), agent, Client(settings=settings) as mesh:
        await _fanout_ok(mesh, 1)
        assert agent.work is not None and server.proc is not None
        await freeze(server.proc.pid)
        try:
            await agent.work._consumer_gone()  # no answer within its 5 s: no exception
        finally:
            server.proc.send_signal(signal.SIGCONT)
        said = [r.getMessage() for r in caplog.records]
        assert any("cannot tell now whether the work consumer" in m for m in said), said
        await _fanout_ok(mesh, 2)


async def test_a_hub_creates_again_the_workflow_streams_deleted_under_it(
    server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """The submissions stream (its pulls answered 503), then the record bucket (its first
    write retried): each created again by the hub, with an ERROR naming it, and workflows run
    again."""
    caplog.set_level(logging.ERROR, logger="reach_mesh.hub.workflows")
    settings = _settings(server.url)
    async with (
        Hub(settings=settings) as hub,
        _echo(settings),
        Client(settings=settings) as mesh,
    ):
        await _fanout_ok(mesh, 1)
        await _delete(server.url, protocol.STREAM_WF)
        await eventually(lambda: _exists(server.url, protocol.STREAM_WF), timeout=10)
        await eventually(
            lambda: _exists(server.url, protocol.STREAM_WF, protocol.CONSUMER_HUBS), timeout=10
        )
        await _fanout_ok(mesh, 2)
        bucket = f"KV_{protocol.KV_WORKFLOWS}"
        await _delete(server.url, bucket)
        await _fanout_ok(mesh, 3)  # its record's first write finds no stream: a check
        assert await _exists(server.url, bucket)
        assert hub.resources is not None and hub.resources.recreated_total == 2
        # What alert ReachStreamRecreated reads.
        assert hub.metrics.registry.get_sample_value("reach_jetstream_recreated_total") == 2
        said = " ".join(r.getMessage() for r in caplog.records)
        assert f"{protocol.STREAM_WF} gone (deleted?): created again" in said, said
        assert f"{bucket} gone (deleted?): created again" in said, said


async def test_a_hub_creates_again_the_heartbeat_bucket_deleted_under_it(
    server: EmbeddedNats,
) -> None:
    """The registry's buckets are watched the same way: the first heartbeat write that finds
    no stream prompts the check. The hub, blind while it could not write, sees again; the
    agent stays ONLINE."""
    settings = _settings(server.url)
    async with Hub(settings=settings) as hub, _echo(settings) as agent:
        bucket = f"KV_{protocol.KV_HEARTBEATS}"
        await _delete(server.url, bucket)
        await eventually(lambda: _exists(server.url, bucket), timeout=10)
        # Counted once the registry's other buckets are ensured too: moments after this one.
        resources = hub.resources
        assert resources is not None
        await eventually(lambda: resources.recreated_total == 1, timeout=5)
        await eventually(lambda: not hub.registry.blind(), timeout=5)
        assert hub.registry.agents[agent.agent_id].state is AgentState.ONLINE


async def test_a_running_workflow_keeps_its_result_when_its_record_bucket_is_deleted(
    server: EmbeddedNats,
) -> None:
    """The record bucket deleted while a step runs: the bucket comes back empty, and the
    owner's final write, which finds no record (not a takeover: that writes one naming its
    hub), writes it again. The workflow ends with its results, each step run once. Before, the
    owner took the missing record for a takeover and stopped, and nobody took the workflow
    again before its deadline (``workflow_ack_wait``, 30 s, past its 10 s): TIMEOUT, its step's
    result dropped."""
    settings = _settings(server.url).model_copy(update={"workflow_ack_wait": 30.0})
    agent = Agent("lost.gate.a1", settings=settings)
    echo = gated_echo(agent, "test:gate:v1", hold="held")

    async with Hub(settings=settings), agent, Client(settings=settings) as mesh:
        steps = [Step(capability="test:gate:v1", payload=p) for p in ("held", "quick")]
        wf_id = await mesh.submit_fanout(steps, timeout=10)
        await asyncio.wait_for(echo.started.wait(), 5)
        await _delete(server.url, f"KV_{protocol.KV_WORKFLOWS}")
        await asyncio.sleep(0.5)
        echo.gate.set()
        result = await mesh.workflow(wf_id, timeout=15)
        assert result.state is TaskState.SUCCEEDED, result
        assert [(s.result, s.attempts) for s in result.steps] == [("held", 1), ("quick", 1)]
        assert sorted(echo.runs) == ["held", "quick"], echo.runs


async def test_a_cancel_writes_the_record_again_when_its_bucket_was_deleted(
    server: EmbeddedNats,
) -> None:
    """The record bucket deleted while a step runs, then the workflow cancelled: the cancel's
    final record is written again as a create (no record is not a takeover), and the cancel
    answers final and true; the workflow's result is the cancel's."""
    settings = _settings(server.url).model_copy(update={"workflow_ack_wait": 30.0})
    agent = Agent("lost.cancel.a1", settings=settings)
    echo = gated_echo(agent, "test:gate:v1", hold="held")

    async with Hub(settings=settings), agent, Client(settings=settings) as mesh:
        wf_id = await mesh.submit_fanout(
            [Step(capability="test:gate:v1", payload="held")], timeout=20
        )
        await asyncio.wait_for(echo.started.wait(), 5)
        await _delete(server.url, f"KV_{protocol.KV_WORKFLOWS}")
        await asyncio.sleep(0.5)
        cancel = await mesh.cancel_workflow(wf_id, reason="bucket gone")
        assert cancel.final and cancel.cancelled, cancel
        assert cancel.result is not None and cancel.result.error is not None
        assert cancel.result.error.code == "REACH_WORKFLOW_CANCELLED"
        result = await mesh.workflow(wf_id, timeout=5)
        assert result.state is TaskState.FAILED, result
        assert result.error is not None and result.error.code == "REACH_WORKFLOW_CANCELLED"
        echo.gate.set()


async def test_a_cancel_before_the_run_here_wrote_its_record_is_asked_again(
    server: EmbeddedNats,
) -> None:
    """The other side of the rule above: a run here that has not written its record yet (it
    has just taken the submission) does not take a cancel into its memory only, which it
    would lose if it handed the workflow back; the caller is told to ask again, as before."""
    settings = _settings(server.url)
    async with Hub(settings=settings) as hub:
        engine = hub.workflows
        assert engine is not None
        spec = WorkflowSpec(workflow_id="starting", kind="fanout", steps=[], namespace="lost")
        wf = Workflow(spec, 0, 0.0, 0.0, {}, None, "digest")  # rev 0: no record written yet
        waiting = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(waiting)
        engine._owning[("lost", "starting")] = (wf, task)
        try:
            with pytest.raises(MeshUnavailableError, match="between owners: it may have been"):
                await engine.cancel("lost", "starting", "test", within=2.0)
            assert wf.stop is None  # nothing held in the run's memory
        finally:
            del engine._owning[("lost", "starting")]
            task.cancel()


async def test_a_bucket_made_without_direct_gets_has_them_turned_on(
    nc: NATS, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket that exists with direct gets off (made by hand, by another tool, with nats-py's
    defaults: ci177, a test made the workflow record bucket so) answered every reach-mesh read
    of it "no responders" — every workflow view and caller wait ``REACH_UNAVAILABLE``; the
    hub that binds it turns them on, and says so."""
    js = nc.jetstream()
    bucket = f"direct-{namespace}"
    await js.create_key_value(bucket=bucket)  # nats-py's defaults: no direct gets
    try:
        assert not (await js.stream_info(f"KV_{bucket}")).config.allow_direct
        with caplog.at_level(logging.WARNING, logger="reach_mesh.nats"):
            kv = await ensure_kv(js, bucket)
        assert (await js.stream_info(f"KV_{bucket}")).config.allow_direct
        await kv.put("k", b"v")
        entry = await kv.get("k")  # a direct get now: answered
        assert entry.value == b"v"
        assert any("had direct gets off" in r.getMessage() for r in caplog.records)
    finally:
        await js.delete_key_value(bucket)
