"""Counters that count each event once — on a real mesh (an SRE review of the hub's metrics)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from reach_mesh import Client, MeshSettings, Step, protocol
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub, _wf_keepalive
from reach_mesh.logs import QUARANTINE
from reach_mesh.server import EmbeddedNats

from .helpers import Fleet, eventually, free_port, heal, held_handler, partition, relayed


def _state(hub: Hub, agent_id: str) -> str:
    view = hub.registry.agents.get(agent_id)
    return "" if view is None else view.state.value


async def test_one_quarantine_is_counted_once_whatever_the_state_does_meanwhile(
    hub: Hub, settings: MeshSettings, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``reach_quarantine_total`` counts breaker openings: a quarantined agent whose beats
    run late (SUSPECT, then QUARANTINED again on its next beat) or that is cordoned and
    uncordoned meanwhile is still quarantined once. Each return to the state was counted
    (and logged ``REACH-QUARANTINE``) as another quarantine."""
    caplog.set_level("INFO", logger="reach_mesh.hub")
    agent = Agent(f"{namespace}.w.q1", settings=settings)

    @agent.handler("work:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    quarantines = hub.metrics.quarantine_total._value.get
    before = quarantines()
    async with agent, Client(settings=settings) as c:
        await eventually(lambda: _state(hub, agent.agent_id) == "ONLINE")
        await c.admin("quarantine", agent.agent_id)
        await eventually(lambda: _state(hub, agent.agent_id) == "QUARANTINED")
        # The hub that took the request trips its breaker, and again on its own broadcast.
        await hub.nc.flush()
        assert quarantines() == before + 1
        # Heartbeats stop a while: the liveness pass makes it SUSPECT; its next beat brings
        # it back to QUARANTINED (its breaker stayed open all along).
        await partition(agent)
        await eventually(lambda: _state(hub, agent.agent_id) == "SUSPECT", timeout=5)
        await heal(agent)
        await eventually(lambda: _state(hub, agent.agent_id) == "QUARANTINED", timeout=5)
        await c.admin("cordon", agent.agent_id)
        await eventually(lambda: _state(hub, agent.agent_id) == "CORDONED")
        await c.admin("uncordon", agent.agent_id)
        await eventually(lambda: _state(hub, agent.agent_id) == "QUARANTINED")
        assert quarantines() == before + 1
        # A new opening is a new quarantine: released, then quarantined again.
        await c.admin("release", agent.agent_id)
        await eventually(lambda: _state(hub, agent.agent_id) == "ONLINE")
        await c.admin("quarantine", agent.agent_id)
        await eventually(lambda: _state(hub, agent.agent_id) == "QUARANTINED")
        await hub.nc.flush()
        assert quarantines() == before + 2
    lines = [
        r
        for r in caplog.records
        if getattr(r, "event", None) == QUARANTINE and r.__dict__["agent_id"] == agent.agent_id
    ]
    assert len(lines) == 2


def _refused(registry: Any) -> float:
    """``reach_messages_refused_total`` as a scrape of ``registry`` reads it."""
    return _sample(registry, "reach_messages_refused_total")


async def test_each_hub_and_agent_exports_only_its_own_refusals(
    settings: MeshSettings, namespace: str
) -> None:
    """Two hubs and an agent in one process (``reach-mesh up --hubs 2 --demo``): a message one
    of them drops unread is counted on that one's ``/metrics`` only. Every hub exported the
    process's count: a sum over the hubs counted each refusal once per hub, and an agent in
    a process of its own exported its refusals nowhere."""
    import nats

    from reach_mesh import protocol

    agent = Agent(f"{namespace}.w.r1", settings=settings, metrics_port=0)

    @agent.handler("work:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    async with Hub(settings=settings) as one, Hub(settings=settings) as two, agent:
        hubs = (one, two)
        before = [_refused(h.metrics.registry) for h in hubs]
        agent_before = _refused(agent.metrics.registry)
        assert settings.nats_url is not None
        nc = await nats.connect(settings.nats_url)
        try:
            # Answers asked on a KV subject: dropped unread by whichever hub of the queue
            # group takes the request, and by the agent.
            await nc.publish(protocol.hub_subject(namespace, "agents"), b"{}", reply="$KV.x.y")
            await nc.publish(agent._task_subject, b"{}", reply="$KV.x.z")
            await nc.flush()
            await eventually(lambda: _refused(agent.metrics.registry) > agent_before)
            await eventually(lambda: sum(_refused(h.metrics.registry) for h in hubs) > sum(before))
            await asyncio.sleep(0.1)  # nothing more comes
        finally:
            await nc.close()
        after = [_refused(h.metrics.registry) for h in hubs]
        assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0.0, 1.0]
        assert _refused(agent.metrics.registry) == agent_before + 1


async def test_a_cached_reply_is_no_second_run_in_the_histograms(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """A route of a task the agent already ran (the same ``task_id`` again: a caller's
    retry) is answered from the agent's cache with that run's ``duration_ms`` and
    ``queued_ms``: counted as a duplicate delivery, not observed again as another run in
    ``reach_task_duration_seconds`` and ``reach_delivered_to_accepted_seconds``."""
    agent = Agent(f"{namespace}.w.c1", settings=settings)

    @agent.handler("work:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    def observed() -> tuple[int, int]:
        m = hub.metrics
        runs = sum(sum(c.counts) for c in m.task_duration_seconds._children.values())
        waits = sum(sum(c.counts) for c in m.delivered_to_accepted_seconds._children.values())
        return runs, waits

    async with agent, Client(settings=settings) as c:
        await eventually(lambda: _state(hub, agent.agent_id) == "ONLINE")
        before = observed()
        task_id = f"{namespace}-once"
        first = await c.request(capability="work:echo:v1", payload=1, task_id=task_id)
        again = await c.request(capability="work:echo:v1", payload=1, task_id=task_id)
    assert not first.cached and again.cached
    assert observed() == (before[0] + 1, before[1] + 1)
    assert hub.metrics.duplicate_delivery_total._value.get() == 1


async def test_workflows_running_and_submissions_not_done_with(
    wf_settings: MeshSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reach_workflows_running`` is what this hub runs now; ``reach_workflow_submissions``
    counts the submissions no hub has been handed yet (``waiting``: what piles up when no
    hub takes them) and those a hub has (``taken``), from the shared consumer. On a server
    of its own: the shared consumer counts every namespace's submissions."""
    monkeypatch.setattr(_wf_keepalive, "SUBMISSIONS_EVERY", 0.05)
    server = EmbeddedNats(tmp_path, port=free_port())
    await server.astart()
    s = wf_settings.model_copy(update={"nats_url": server.url})
    hub, other = Hub(settings=s), Hub(settings=s)
    fleet = Fleet(s)
    slow = fleet.agent("slow.a1")
    held = held_handler(slow, "wf:held:v1", "done")
    try:
        await hub.start()
        await slow.start()
        registry = hub.metrics.registry

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, labels)

        engine = hub.workflows
        assert engine is not None and engine._pull is not None
        async with Client(settings=s) as mesh:
            assert value("reach_workflows_running") == 0
            running = await mesh.submit_chain([Step(capability="wf:held:v1")], timeout=30)
            await asyncio.wait_for(held.started.wait(), 10)
            assert value("reach_workflows_running") == 1
            await engine._pull.stop()  # this hub takes no more: the next two wait
            await hub.nc.flush()
            js = hub.nc.jetstream()

            async def no_pull_waits() -> bool:
                # A pull request it sent before it stopped may still wait at the server (until
                # it expires, or the server sees nobody listens on its inbox): a submission
                # handed to it would count as taken. (ci173: "waiting" stayed short of 2 for
                # 5 s on a loaded machine.)
                info = await js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS)
                return not info.num_waiting

            await eventually(no_pull_waits, timeout=10)
            waiting = [
                await mesh.submit_chain([Step(capability="wf:held:v1")], timeout=30)
                for _ in range(2)
            ]
            try:
                await eventually(
                    lambda: value("reach_workflow_submissions", stage="waiting") == 2, timeout=10
                )
            except AssertionError:
                info = await js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS)
                raise AssertionError(
                    f"waiting={value('reach_workflow_submissions', stage='waiting')} "
                    f"taken={value('reach_workflow_submissions', stage='taken')}; the consumer: "
                    f"pending={info.num_pending} ack_pending={info.num_ack_pending} "
                    f"waiting pulls={info.num_waiting}"
                ) from None
            assert value("reach_workflow_submissions", stage="taken") == 1
            await other.start()  # takes the two waiting ones
            await eventually(
                lambda: value("reach_workflow_submissions", stage="waiting") == 0, timeout=5
            )
            await eventually(
                lambda: value("reach_workflow_submissions", stage="taken") == 3, timeout=5
            )
            held.release.set()
            for wf_id in (running, *waiting):
                assert (await mesh.workflow(wf_id, timeout=10)).ok
            await eventually(lambda: value("reach_workflows_running") == 0, timeout=5)
            await eventually(
                lambda: value("reach_workflow_submissions", stage="taken") == 0, timeout=5
            )
    finally:
        held.release.set()
        await fleet.close()
        await other.close()
        await hub.close()
        server.stop()


def _stalls(registry: Any) -> float:
    """Samples of ``reach_event_loop_lag_seconds`` over 1 s (the alert's stalls)."""
    count = registry.get_sample_value("reach_event_loop_lag_seconds_count")
    within = registry.get_sample_value("reach_event_loop_lag_seconds_bucket", {"le": "1.0"})
    assert count is not None and within is not None
    return float(count - within)


async def test_an_event_loop_stall_shows_in_the_lag_of_the_hub_and_the_agent(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """A blocking call on the event loop (as a handler that blocks, or CPU starvation) is one
    sample of ``reach_event_loop_lag_seconds`` as long as the stall, in the hub's metrics and
    in the agent's; a loop that keeps up samples a few milliseconds."""
    agent = Agent(f"{namespace}.lag.a1", settings=settings)

    @agent.handler("lag:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    await agent.start()
    try:
        registries = (hub.metrics.registry, agent.metrics.registry)
        await asyncio.sleep(0.6)  # a few samples of a loop that keeps up
        assert [_stalls(r) for r in registries] == [0.0, 0.0]
        time.sleep(1.3)  # noqa: ASYNC251  (the test's loop is theirs: both stall)
        await eventually(lambda: all(_stalls(r) == 1.0 for r in registries), timeout=2)
        for r in registries:
            total = r.get_sample_value("reach_event_loop_lag_seconds_sum")
            assert total is not None and 1.0 < total < 3.0, total
    finally:
        await agent.close()


def _sample(registry: Any, name: str, **labels: str) -> float:
    """The one sample ``name`` (with ``labels``) of a scrape of ``registry``."""
    (value,) = [
        s.value
        for f in registry.collect()
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    return float(value)


async def test_a_reconnection_is_counted_by_the_process_it_happened_to(
    settings: MeshSettings, nats_url: str, namespace: str
) -> None:
    """An agent's connection to NATS is cut for a second: its ``reach_nats_connected`` reads
    0 meanwhile, and once it is back 1, with ``reach_nats_reconnects_total`` 1; the hub,
    whose three connections held, counts none, each by its name."""
    relay, through = await relayed(nats_url, settings)
    agent = Agent(f"{namespace}.w.r1", settings=through)

    @agent.handler("work:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    async with Hub(settings=settings) as hub, agent:
        ours, its = agent.metrics.registry, hub.metrics.registry
        assert _sample(ours, "reach_nats_connected") == 1
        assert _sample(ours, "reach_nats_reconnects_total") == 0
        await relay.cut()
        await eventually(lambda: _sample(ours, "reach_nats_connected") == 0, timeout=5)
        await asyncio.sleep(1.0)
        await relay.start()
        # (the connection is up a moment before nats-py calls back to count it)
        await eventually(
            lambda: (
                _sample(ours, "reach_nats_connected") == 1
                and _sample(ours, "reach_nats_reconnects_total") == 1
            ),
            timeout=5,
        )
        assert _sample(ours, "reach_nats_connected", connection="main") == 1
        for connection in ("main", "routes", "statuses", "agents"):
            assert _sample(its, "reach_nats_reconnects_total", connection=connection) == 0
            assert _sample(its, "reach_nats_connected", connection=connection) == 1
