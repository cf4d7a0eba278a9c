"""One process per agent id, on a real mesh: a second process of an id waits for the first to
stop; a process paused, cut off or blocked for longer than the hubs wait is replaced, and back,
stops instead of serving the id too — before it takes a task, beats or registers again, and
only on an answer that proves nobody else serves it; two live processes settle on one."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh import (
    AgentReplacedError,
    Client,
    MeshSettings,
    MeshTimeoutError,
    Step,
    protocol,
)
from reach_mesh.agent import Agent, Task
from reach_mesh.agent import _agent as agent_module
from reach_mesh.agent._run import serve
from reach_mesh.hub import Hub
from reach_mesh.logs import AGENT_ID_IN_USE
from reach_mesh.models import TaskEnvelope, TaskReply

from .helpers import FAST, LoopThread, eventually, refusing_registrations, relayed

pytestmark = pytest.mark.timeout(60)


def _said_in_use(caplog: pytest.LogCaptureFixture) -> bool:
    return any(getattr(r, "event", None) == AGENT_ID_IN_USE for r in caplog.records)


def _counting_agent(agent_id: str, settings: MeshSettings, ran: list[str], label: str) -> Agent:
    agent = Agent(agent_id, settings=settings)

    @agent.handler("wf:twice:v1")
    async def run(task: Task[Any]) -> str:
        ran.append(label)
        return label

    return agent


async def test_a_second_process_of_an_agent_id_waits_for_the_first_to_stop(
    hub: Hub, settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A deploy that starts an agent's new process before its old one stops: the new one
    subscribes to nothing while the old one serves — no request, no workflow step reaches it,
    so no step the old one holds is redelivered to it and run again — and says why
    (``REACH-AGENT-ID-IN-USE``). Once the old one has stopped, it starts and serves."""
    agent_id = f"{settings.namespace}.twice.a"
    ran: list[str] = []
    old = _counting_agent(agent_id, settings, ran, "old")
    new = _counting_agent(agent_id, settings, ran, "new")
    await old.start()
    starting = asyncio.ensure_future(new.start())
    try:
        await eventually(lambda: _said_in_use(caplog), timeout=5)
        async with Client(settings=settings) as mesh:
            for n in range(6):
                res = await mesh.request(capability="wf:twice:v1", payload=n, timeout=5)
                assert res.result == "old"
            wf = await mesh.fanout([Step(capability="wf:twice:v1")] * 3, timeout=10)
            assert wf.ok and [s.result for s in wf.steps] == ["old"] * 3
            assert not starting.done()
            await old.close()
            await asyncio.wait_for(starting, 5)
            res = await mesh.request(capability="wf:twice:v1", payload=0, timeout=5)
            assert res.result == "new" and ran == ["old"] * 9 + ["new"]
    finally:
        starting.cancel()
        await old.close()
        await new.close()


_PAUSED_AGENT = """
import json, sys
from reach_mesh import MeshSettings
from reach_mesh.agent import Agent, Task, run

cfg = json.loads(sys.argv[1])
agent = Agent(cfg["agent_id"], settings=MeshSettings(**cfg["settings"]))


@agent.handler("dup:once:v1")
async def once(task: Task) -> str:
    with open(cfg["runs"], "a") as f:
        f.write(f"old {task.task_id}\\n")
    return "old"


run(agent)
"""


async def _old_and_new(
    agent_id: str, settings: MeshSettings, tmp_path: Path
) -> tuple[asyncio.subprocess.Process, Path, Agent, list[str]]:
    """The id's old process (``_PAUSED_AGENT``, started) and the file where it notes each
    task it runs; its new process (an :class:`Agent`, not started) and the tasks it runs."""
    runs = tmp_path / "runs.txt"
    script = tmp_path / "old_agent.py"
    script.write_text(_PAUSED_AGENT)
    cfg = {
        "agent_id": agent_id,
        "runs": str(runs),
        "settings": settings.model_dump(include={"nats_url", "namespace", *FAST}),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "OTEL_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        json.dumps(cfg),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    ran: list[str] = []
    new = Agent(agent_id, settings=settings)

    @new.handler("dup:once:v1")
    async def once(task: Task[Any]) -> str:
        ran.append(task.task_id)
        return "new"

    return proc, runs, new, ran


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """``proc`` killed, should it still run (paused or not)."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        await proc.wait()


async def test_a_paused_process_replaced_meanwhile_stops_when_it_resumes(
    settings: MeshSettings, tmp_path: Path
) -> None:
    """An agent process paused (SIGSTOP, a stalled VM) for longer than the hubs wait before
    they declare it lost; a new process of its id starts meanwhile, as it then may. When the
    old one resumes, the tasks that reached it during the pause — the new one ran them — are
    not run again, and it stops (``REACH_AGENT_REPLACED``), the new one serving alone. Before,
    both ran on: the old process ran those tasks a second time, and the two took turns
    registering the id, each told by the hubs that the other's registration had replaced its
    own (the careless-agent audit: 6 of 7 retries run again, a step run twice)."""
    agent_id = f"{settings.namespace}.paused.a"
    proc, runs, new, ran = await _old_and_new(agent_id, settings, tmp_path)
    # (The tasks the paused process takes time out: no breaker may quarantine the id meanwhile.)
    hub = Hub(settings=settings.model_copy(update={"breaker_min_requests": 1000}))
    await hub.start()
    try:
        await eventually(lambda: agent_id in hub.registry.agents, timeout=20)
        proc.send_signal(signal.SIGSTOP)
        await asyncio.wait_for(new.start(), 10)  # once the old one was silent long enough
        async with Client(settings=settings) as mesh:
            # The id's task subject is a queue group: a task may go to the paused process,
            # and is then asked again (with its task id) until the new one has it.
            ids = [f"once-{i}" for i in range(6)]
            for task_id in ids:
                for _ in range(20):
                    try:
                        res = await mesh.request(
                            capability="dup:once:v1", task_id=task_id, timeout=0.5
                        )
                    except MeshTimeoutError:
                        continue
                    assert res.result == "new", res
                    break
            proc.send_signal(signal.SIGCONT)
            await asyncio.wait_for(proc.wait(), 15)
            _, err = await proc.communicate()
            assert proc.returncode != 0 and b"AgentReplacedError" in err, err[-2000:]
            assert b"is served by another process" in err, err[-2000:]
            assert not runs.exists(), runs.read_text()  # none run again by the old process
            assert ran == ids
            assert hub.registry.agents[agent_id].record.session == new.session
            res = await mesh.request(capability="dup:once:v1", task_id="once-9", timeout=5)
            assert res.result == "new" and ran == [*ids, "once-9"]
    finally:
        await _kill(proc)
        await new.close()
        await hub.close()


async def test_a_process_paused_while_it_retries_its_registration_leaves_the_id_to_the_new(
    settings: MeshSettings, nc: NATS, tmp_path: Path
) -> None:
    """The pause above, begun while the old process still retried its registration (no hub
    answering yet: starting with the mesh, a JetStream election, a hub restart). A new process
    of the id started meanwhile and registered. On resume, the old one's next try registered
    again, over the new one's registration: both served the id (or the old one kept it, the
    new one stopping). Now a try after such a silence first asks who serves the id, and the
    old process stops (``start()`` raises :class:`AgentReplacedError`) without registering."""
    agent_id = f"{settings.namespace}.paused.g"
    sent: list[str] = []  # the session of each registration of the id sent to the hubs

    async def seen(msg: Msg) -> None:
        sent.append(json.loads(msg.data)["session"])

    proc, runs, new, ran = await _old_and_new(agent_id, settings, tmp_path)
    assert proc.stderr is not None
    hub: Hub | None = None
    exited = asyncio.ensure_future(proc.wait())
    try:
        # No hub yet: the old process retries its registration (and says so, once).
        while b"no hub answered the registration" not in await asyncio.wait_for(
            proc.stderr.readline(), 20
        ):
            pass
        proc.send_signal(signal.SIGSTOP)
        # (Listening from now on only: a listener is a responder, the old one's tries would
        # have waited for an answer instead of failing at once.)
        await nc.subscribe(protocol.hub_agent_subject(agent_id, "register"), cb=seen)
        await nc.flush()
        hub = Hub(settings=settings)
        await hub.start()
        await asyncio.wait_for(new.start(), 10)  # once the old one was silent long enough
        assert hub.registry.agents[agent_id].record.session == new.session
        proc.send_signal(signal.SIGCONT)
        await eventually(lambda: exited.done() or set(sent) != {new.session}, timeout=15)
        assert set(sent) == {new.session}, "the old process registered again"
        _, err = await proc.communicate()
        assert proc.returncode != 0 and b"AgentReplacedError" in err, err[-2000:]
        assert b"is served by another process" in err, err[-2000:]
        assert new.fault is None and hub.registry.agents[agent_id].record.session == new.session
        async with Client(settings=settings) as mesh:
            for n in range(4):
                res = await mesh.request(capability="dup:once:v1", task_id=f"g-{n}", timeout=5)
                assert res.result == "new"
        assert ran == [f"g-{n}" for n in range(4)] and not runs.exists()
        assert set(sent) == {new.session}
    finally:
        await _kill(proc)
        await new.close()
        if hub is not None:
            await hub.close()


async def test_a_process_paused_before_it_read_its_registration_answer_runs_no_task(
    hub: Hub, settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pause above, begun after a hub registered the old process but before the process
    read the answer (a SIGSTOP right after it registered). A task that reached it meanwhile,
    read on resume ahead of that answer, was run: the silence ``may_be_replaced`` measures
    began at the registration's answer only, nothing counted before it (the test above failed
    so, once, in CI under load: ``old once-2``). It begins at the start check now."""
    agent_id = f"{settings.namespace}.paused.r"
    ran: list[str] = []
    old = _counting_agent(agent_id, settings, ran, "old")
    registering = asyncio.Event()

    async def unanswered() -> None:  # sent, answered, the answer not read: the pause
        registering.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(old, "_register", unanswered)
    starting = asyncio.create_task(old.start())
    new = _counting_agent(agent_id, settings, ran, "new")
    try:
        await asyncio.wait_for(registering.wait(), 10)
        await asyncio.sleep(settings.lease_timeout + settings.suspect_timeout + 0.2)

        async def no_check(*args: Any) -> None:
            return None

        # (The old one, paused, would not have answered the new one's ping.)
        monkeypatch.setattr(agent_module, "wait_for_other_process", no_check)
        await new.start()
        # A task that reached the old process during its pause, read on resume.
        env = protocol.encode(TaskEnvelope(task_id="once-r", capability="wf:twice:v1"))
        await old._on_task(Msg(_client=old.nc, subject=old._task_subject, reply="", data=env))
        await eventually(lambda: old.fault is not None or bool(ran), timeout=10)
        assert ran == [] and isinstance(old.fault, AgentReplacedError), (ran, old.fault)
        assert "is served by another process" in old.fault.message
    finally:
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await old.close()
        await new.close()


async def test_a_task_read_after_a_pause_waits_while_nobody_can_be_asked(
    hub: Hub, settings: MeshSettings, nats_url: str, nc: NATS
) -> None:
    """A process whose event loop was blocked past ``may_be_replaced`` reads, on resume, a
    task sent to it meanwhile — and is cut off from NATS by then, so it cannot ask whether
    another process serves the id now. The task was run all the same: the ping, buffered by
    nats-py while it reconnects, found nobody to answer it, which was taken for "nobody else"
    (and had the ask failed, ``_take_when_confirmed`` took the task anyway). It is left
    unanswered now, and once back the caller's second ask runs it, once."""
    relay, through = await relayed(nats_url, settings)
    side = LoopThread()
    ran: list[str] = []
    agent = _counting_agent(f"{settings.namespace}.paused.n", through, ran, "a")
    env = protocol.encode(TaskEnvelope(task_id="cut-1", capability="wf:twice:v1"))
    answers = await nc.subscribe(inbox := nc.new_inbox())
    try:
        await side.run(agent.start())
        until = threading.Event()
        begun = side.stall(until, settings.lease_timeout + settings.suspect_timeout + 0.3, 10)
        assert await asyncio.to_thread(begun.wait, 5)
        await nc.publish(agent._task_subject, env, reply=inbox)
        await nc.flush()
        await asyncio.sleep(0.3)  # relayed into the stalled agent's socket, unread
        await relay.cut()
        until.set()
        await asyncio.sleep(2.0)  # read on resume; confirmed (or not) in 0.5 s
        assert ran == [] and await side.call(agent.may_be_replaced)
        await relay.start()

        async def back() -> bool:
            return not await side.call(agent.may_be_replaced)

        await eventually(back, timeout=10)
        reply = await nc.request(agent._task_subject, env, timeout=5)
        assert TaskReply.model_validate_json(reply.data).result == "a" and ran == ["a"]
        with pytest.raises(nats.errors.TimeoutError):
            await answers.next_msg(timeout=0.1)  # the copy read while cut off: unanswered
        assert agent.fault is None
    finally:
        await side.run(agent.close())
        side.close()
        with contextlib.suppress(Exception):
            await relay.cut()


async def test_a_task_read_after_a_pause_waits_while_answers_cannot_reach_the_process(
    hub: Hub, settings: MeshSettings, nats_url: str, nc: NATS
) -> None:
    """The pause above, and on resume a link that delivers nothing to the process (a one-way
    partition, a stalled link nats-py has not noticed yet: no reconnect, still "connected").
    A new process of the id started and registered during the pause; the old one's ping
    reached it, its answer did not come back — and no answer within the wait was taken for
    "nobody else": the task read on resume ran a second time, next to the new process. No
    answer proves nothing unless the connection is shown to carry answers (a PONG behind
    them): the task is left, and once the link is back the old process stops."""
    relay, through = await relayed(nats_url, settings)
    side = LoopThread()
    ran: list[str] = []
    agent_id = f"{settings.namespace}.paused.h"
    old = _counting_agent(agent_id, through, ran, "old")
    new = _counting_agent(agent_id, settings, ran, "new")
    env = protocol.encode(TaskEnvelope(task_id="held-1", capability="wf:twice:v1"))
    try:
        await side.run(old.start())
        until = threading.Event()
        begun = side.stall(until, settings.lease_timeout + settings.suspect_timeout + 0.3, 20)
        assert await asyncio.to_thread(begun.wait, 5)
        await nc.publish(old._task_subject, env, reply=nc.new_inbox())
        await nc.flush()
        await asyncio.sleep(0.3)  # relayed into the stalled process's socket, unread
        await asyncio.wait_for(new.start(), 15)  # the old one, stalled, does not answer
        assert hub.registry.agents[agent_id].record.session == new.session
        relay.hold()  # nothing reaches the old process from now on
        until.set()
        await asyncio.sleep(2.5)  # read on resume; asked (0.5 s), the answer held back
        assert ran == [], "the old process ran the task next to the new one"
        await relay.cut()
        await relay.start()
        await eventually(lambda: old.fault is not None, timeout=15)
        assert isinstance(old.fault, AgentReplacedError), old.fault
        assert ran == [] and new.fault is None
    finally:
        with contextlib.suppress(Exception):
            await side.run(old.close())
        side.close()
        await new.close()
        with contextlib.suppress(Exception):
            await relay.cut()


async def test_an_agent_forgotten_by_the_hub_registers_again_only_once_it_could_ask(
    hub: Hub, settings: MeshSettings, nats_url: str
) -> None:
    """A heartbeat answered "unknown agent" (removed, declared lost — or another live process
    of the id registered) asks whether another process serves the id before it registers
    again. When that ask cannot be made — here the link delivers nothing after the answer, so
    no PONG shows the silence means "nobody else" — it does not register again blind, which
    could replace the other process's registration for good: the next beat asks again, and
    once the link is back the agent registers again."""
    relay, through = await relayed(nats_url, settings)
    agent = _counting_agent(f"{settings.namespace}.forgotten.f", through, [], "f")
    try:
        await agent.start()
        first = hub.registry.agents[agent.agent_id].record.session
        relay.hold_after(b"REACH_UNKNOWN_AGENT")  # the answer arrives, nothing after it
        assert await hub.registry.unregister(agent.agent_id, None)
        await asyncio.sleep(3.0)  # many beats: the answer read, the ask cut short
        assert relay.holding, "no heartbeat was answered 'unknown agent'"
        assert agent.agent_id not in hub.registry.agents, "registered again without asking"
        relay.release()
        await eventually(lambda: agent.agent_id in hub.registry.agents, timeout=10)
        assert hub.registry.agents[agent.agent_id].record.session == first
        assert agent.fault is None
    finally:
        await agent.close()
        await relay.cut()


async def test_tries_to_register_again_stay_spread_within_a_heartbeat_interval(
    settings: MeshSettings,
) -> None:
    """An agent registered before, whose registration a hub refuses again and again
    (``REACH_UNAVAILABLE``: JetStream takes no writes), tries again at least once per
    ``heartbeat_interval`` — at a jittered time within it. The backoff's draw was cut at the
    interval: once the backoff passed it, every try came exactly one interval after the last
    answer, so a fleet refused at one instant (a hub answering its queue at once after a
    stall) tried again at one instant, interval after interval, for as long as it lasted."""
    hub = Hub(settings=settings)
    tries, refusing = refusing_registrations(hub)
    agent = _counting_agent(f"{settings.namespace}.again.j", settings, [], "a")
    async with hub:
        try:
            await agent.start()
            refusing.set()
            again = asyncio.create_task(agent._register())  # (as after "unknown agent")
            await eventually(lambda: len(tries) >= 20, timeout=30, interval=0.01)
            again.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await again
        finally:
            await agent.close()
    interval = settings.heartbeat_interval
    gaps = [b - a for a, b in itertools.pairwise(tries)][5:]  # (the backoff past the interval)
    assert max(gaps) < interval + 0.1, gaps  # at least once per interval
    assert max(gaps) - min(gaps) > interval / 4, gaps  # spread, not in step


async def test_two_live_processes_of_an_agent_id_settle_on_one(
    hub: Hub, settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes of one id that both got past the start check (started at the same
    moment, each asking before the other subscribed): each registration replaced the other's,
    and each heartbeat, told so, registered again — for good, the id's tasks split between
    them. Now a process told its registration is gone asks who else serves the id, and of two
    live ones the one with the smaller session keeps it; the other stops."""
    agent_id = f"{settings.namespace}.twice.c"
    ran: list[str] = []
    first = _counting_agent(agent_id, settings, ran, "first")
    second = _counting_agent(agent_id, settings, ran, "second")
    await first.start()

    async def no_check(*args: Any) -> None:
        return None

    monkeypatch.setattr(agent_module, "wait_for_other_process", no_check)
    await second.start()  # (as if it had asked before the first one subscribed)
    try:
        await eventually(lambda: (first.fault is None) != (second.fault is None), timeout=10)
        kept, gone = (first, second) if first.fault is None else (second, first)
        assert isinstance(gone.fault, AgentReplacedError), gone.fault
        assert "started at once" in gone.fault.message and kept.session < gone.session
        await eventually(lambda: hub.registry.agents[agent_id].record.session == kept.session)
        await asyncio.sleep(4 * settings.heartbeat_interval)  # settled: no registering in turn
        assert kept.fault is None and hub.registry.agents[agent_id].record.session == kept.session
        label = "first" if kept is first else "second"
        async with Client(settings=settings) as mesh:
            for n in range(4):
                res = await mesh.request(agent_id=agent_id, payload=n, timeout=5)
                assert res.result == label
    finally:
        await first.close()
        await second.close()


async def test_a_signal_stops_an_agent_process_that_waits_to_start(
    hub: Hub, settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """``reach-mesh agent`` (``serve``) waiting for its id's old process to stop takes a
    SIGTERM at once: before, it went on waiting (a supervisor's SIGTERM then had to become a
    SIGKILL), and with no hub answering it took the SIGTERM only at the registration's 30 s."""
    agent_id = f"{settings.namespace}.twice.s"
    old = _counting_agent(agent_id, settings, [], "old")
    new = _counting_agent(agent_id, settings, [], "new")
    await old.start()
    try:
        serving = asyncio.ensure_future(serve(new))
        # (said once ``serve`` has its signal handlers: the SIGTERM below is its, not pytest's)
        await eventually(lambda: _said_in_use(caplog), timeout=5)
        t0 = time.monotonic()
        signal.raise_signal(signal.SIGTERM)
        await asyncio.wait_for(serving, 5)
        assert time.monotonic() - t0 < 1.0
        assert new.nc is None or not new.nc.is_connected
        assert hub.registry.agents[agent_id].record.session == old.session  # the old one serves
    finally:
        await old.close()
        await new.close()


async def test_an_agent_id_held_by_a_process_that_does_not_answer_is_taken_after_its_lease(
    hub: Hub, settings: MeshSettings, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """A process subscribed to the id's ctl subject that never answers (paused, its loop
    blocked, cut off before NATS noticed) holds a starting agent back only as long as the hubs
    wait before they declare an agent lost (``lease_timeout + suspect_timeout``); a process
    that is gone holds nothing."""
    agent_id = f"{settings.namespace}.twice.b"
    mute = await nc.subscribe(protocol.agent_ctl(agent_id))
    await nc.flush()
    agent = _counting_agent(agent_id, settings, [], "b")
    started = time.monotonic()
    try:
        await asyncio.wait_for(agent.start(), 10)
        waited = time.monotonic() - started
        assert settings.lease_timeout + settings.suspect_timeout <= waited < 5
        assert _said_in_use(caplog) and "does not answer" in caplog.text
    finally:
        await agent.close()
        await mute.unsubscribe()
    again = _counting_agent(agent_id, settings, [], "b")
    started = time.monotonic()
    try:
        await again.start()
        assert time.monotonic() - started < 1
    finally:
        await again.close()
