"""The hub's proxy routes end to end: deadlines on the hub's clock, late replies, agents that
are registered but not listening, and a hub closing with routes in flight."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh import Client, MeshSettings, TaskState, protocol
from reach_mesh import client as client_module
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import (
    BadRequestError,
    MeshTimeoutError,
    MeshUnavailableError,
    UnknownAgentError,
)
from reach_mesh.hub import Hub, HubState
from reach_mesh.models import (
    AgentCard,
    RouteReply,
    RouteRequest,
    TaskEnvelope,
    TaskReply,
    UnregisterRequest,
)

from .helpers import eventually, register_by_hand

CAP = "work:do:v1"


@asynccontextmanager
async def raw_agent(
    settings: MeshSettings,
    agent_id: str,
    *,
    listen: bool,
    batch: bool = False,
    answer: bool = False,
) -> AsyncIterator[list[Msg]]:
    """An agent that speaks the wire protocol by hand: it registers (long lease, so no heartbeat
    is needed during the test) and, if ``listen``, takes task messages (and, with ``batch``,
    batches) — answering them only if ``answer``: a batch with one batch of replies.
    Yields the messages it received."""
    assert settings.nats_url is not None
    nc: NATS = await nats.connect(settings.nats_url)
    received: list[Msg] = []

    def answer_for(env: TaskEnvelope) -> bytes:
        return protocol.encode(
            TaskReply(
                task_id=env.task_id,
                attempt=env.attempt,
                agent_id=agent_id,
                state=TaskState.SUCCEEDED,
                result=env.payload,
            )
        )

    async def take(msg: Msg) -> None:
        received.append(msg)
        if answer:
            await nc.publish(msg.reply, answer_for(TaskEnvelope.model_validate_json(msg.data)))

    async def take_batch(msg: Msg) -> None:
        received.append(msg)
        if answer:
            lines = []
            for line in msg.data.split(b"\n"):
                subject, traceparent, body = line.split(b" ", 2)
                assert traceparent.startswith(b"00-")
                lines.append(subject + b" " + answer_for(TaskEnvelope.model_validate_json(body)))
            await nc.publish(msg.reply, b"\n".join(lines))

    try:
        if listen:
            await nc.subscribe(protocol.agent_task(agent_id), cb=take)
            if batch:
                await nc.subscribe(protocol.agent_batch(agent_id), cb=take_batch)
        card = AgentCard(agent_id=agent_id, capabilities=[CAP], batch=batch)
        registered = await register_by_hand(nc, card)
        yield received
        bye = UnregisterRequest(agent_id=agent_id, session=registered.session)
        await nc.request(
            protocol.hub_agent_subject(agent_id, "unregister"), protocol.encode(bye), timeout=5
        )
    finally:
        await nc.close()


def echo_agent(agent_id: str, settings: MeshSettings, delay: float = 0.0) -> Agent:
    agent = Agent(agent_id, settings=settings)

    @agent.handler(CAP)
    async def work(task: Task[dict[str, int]]) -> dict[str, int]:
        await asyncio.sleep(delay)
        return task.payload

    return agent


async def test_hung_agent_times_out_on_the_hub_and_its_late_reply_is_dropped(
    hub: Hub, settings: MeshSettings, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent_id = f"{namespace}.hung.a1"
    # The caller waits 2 s past the timeout for the hub's answer (0.2 s at this timeout): a
    # hub late by more than 0.2 s on a loaded box is not the caller's own timeout then.
    monkeypatch.setattr(client_module, "_reply_slack", lambda timeout: 2.0)
    async with (
        raw_agent(settings, agent_id, listen=True) as received,
        Client(settings=settings) as c,
    ):
        t0 = time.monotonic()
        with pytest.raises(MeshTimeoutError) as info:
            await c.request(agent_id=agent_id, payload={"n": 1}, timeout=0.3)
        elapsed = time.monotonic() - t0
        # The hub answers at its deadline (swept every few ms), not the caller's own timeout
        # (2.3 s here): a second to spare for a loaded box.
        assert 0.3 <= elapsed < 0.3 + 1.0
        assert info.value.details.get("agent_id") == agent_id
        view = hub.registry.agents[agent_id]
        # An accept timeout, once the hub's marker came back before any reply (hub/_lateness.py).
        await eventually(lambda: view.health.value < 100)
        assert view.outstanding == 0

        # The agent answers after all: nobody is waiting for it any more.
        assert len(received) == 1
        env = TaskEnvelope.model_validate_json(received[0].data)
        late = TaskReply(
            task_id=env.task_id, attempt=env.attempt, agent_id=agent_id, state=TaskState.SUCCEEDED
        )
        assert settings.nats_url is not None
        nc = await nats.connect(settings.nats_url)
        try:
            await nc.publish(received[0].reply, protocol.encode(late))
            await nc.flush()
        finally:
            await nc.close()
        await eventually(lambda: hub.metrics.late_reply_total._value.get() == 1)


async def test_registered_agent_without_subscriber_is_skipped(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    dead = f"{namespace}.work.dead"
    live = f"{namespace}.work.live"
    async with (
        raw_agent(settings, dead, listen=False),
        echo_agent(live, settings),
        Client(settings=settings) as c,
    ):
        retries = hub.metrics.retry_total._value.get()
        for i in range(6):
            # round_robin reaches the dead agent once: NATS answers "no responders" and the
            # hub tries the live agent in the same request. Not heard from since, the dead
            # one is then set aside with the SUSPECT ones (it may be reconnecting).
            res = await c.request(capability=CAP, payload={"n": i}, strategy="round_robin")
            assert res.state is TaskState.SUCCEEDED and res.agent_id == live
            assert res.result == {"n": i}
        assert hub.metrics.retry_total._value.get() == retries + 1
        decision = await c.route(capability=CAP)
        assert {f.agent_id: f.reason for f in decision.filtered}[dead].startswith("unreachable")
        # Unreached, not failing: no penalty while it may be reconnecting.
        assert hub.registry.agents[dead].health.value == 100
        # Named by id there is nobody else to try: the route waits for it within its timeout,
        # then the caller is told who is missing.
        t0 = time.monotonic()
        with pytest.raises(UnknownAgentError):
            await c.request(agent_id=dead, payload={}, timeout=1.0)
        assert time.monotonic() - t0 > 0.8


async def test_hub_closing_finishes_routes_in_flight(
    settings: MeshSettings, namespace: str
) -> None:
    async with (
        Hub(settings=settings) as hub,
        echo_agent(f"{namespace}.work.slow", settings, delay=0.3),
        Client(settings=settings) as c,
    ):
        pending = asyncio.create_task(c.request(capability=CAP, payload={"n": 7}))
        await eventually(lambda: hub.routing == 1)
        await hub.close()
        res = await pending
        assert res.state is TaskState.SUCCEEDED and res.result == {"n": 7}


async def test_hub_closing_tells_routes_still_with_their_agent_to_ask_again(
    settings: MeshSettings, namespace: str
) -> None:
    """A route whose agent outlasts the hub's 5 s of grace was dropped: no answer (the caller
    waited out its timeout), no count, no audit, its spans never ended. It ends unavailable —
    the SDK asks another hub with the same task id, and the agent's run in hand answers."""
    async with (
        Hub(settings=settings) as hub,
        echo_agent(f"{namespace}.work.slower", settings, delay=8.0),  # (outlasts the grace)
    ):
        nc = await nats.connect(settings.nats_url or "")
        try:
            body = json.dumps({"capability": CAP, "payload": {"n": 1}, "timeout": 20})
            asked = asyncio.ensure_future(
                nc.request(protocol.hub_subject(namespace, "route"), body.encode(), 15)
            )
            await eventually(lambda: hub.routing == 1)
            t0 = time.monotonic()
            await hub.close()
            answer = json.loads((await asked).data)
            answered_in = time.monotonic() - t0
        finally:
            await nc.close()
    assert answer["error"]["code"] == "REACH_UNAVAILABLE", answer
    assert "retry with the same task_id" in answer["error"]["message"]
    assert answered_in < 6.5  # the 5 s of grace, not the agent's 8 s
    unavailable = hub.metrics.task_total.labels(namespace, "proxy", "UNAVAILABLE")
    assert unavailable._value.get() == 1


async def test_many_routes_in_flight_at_once(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    async with (
        echo_agent(f"{namespace}.work.a1", settings, delay=0.05),
        echo_agent(f"{namespace}.work.a2", settings, delay=0.05),
        Client(settings=settings) as c,
    ):
        results = await asyncio.gather(
            *(c.request(capability=CAP, payload={"n": i}) for i in range(300))
        )
        assert [r.result for r in results] == [{"n": i} for i in range(300)]
        assert {r.agent_id for r in results} == {f"{namespace}.work.a1", f"{namespace}.work.a2"}
        await eventually(lambda: not hub._flights and hub.routing == 0)


async def test_attempts_decided_together_go_to_a_batch_agent_as_one_message(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent_id = f"{namespace}.batch.a1"
    async with raw_agent(settings, agent_id, listen=True, batch=True, answer=True) as received:
        async with Client(settings=settings) as c:
            results = await asyncio.gather(
                *(c.request(capability=CAP, payload={"n": i}) for i in range(50))
            )
        assert [r.result for r in results] == [{"n": i} for i in range(50)]
        assert all(r.agent_id == agent_id and r.attempt == 1 for r in results)
        batches = [m for m in received if m.subject == protocol.agent_batch(agent_id)]
        singles = [m for m in received if m.subject == protocol.agent_task(agent_id)]
        assert batches, "50 requests at once: some attempts are decided in the same pass"
        lines = sum(len(m.data.split(b"\n")) for m in batches)
        assert lines + len(singles) == 50
        assert max(len(m.data.split(b"\n")) for m in batches) > 1


async def test_a_batch_nobody_listens_to_is_retried_elsewhere(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    dead = f"{namespace}.batch.dead"
    live = f"{namespace}.batch.live"
    async with (
        raw_agent(settings, dead, listen=False, batch=True),
        echo_agent(live, settings),
        Client(settings=settings) as c,
    ):
        results = await asyncio.gather(
            *(
                c.request(capability=CAP, payload={"n": i}, strategy="round_robin")
                for i in range(40)
            )
        )
        assert all(r.ok and r.agent_id == live for r in results)
        assert [r.result for r in results] == [{"n": i} for i in range(40)]
        assert any(r.attempt == 2 for r in results)


async def test_malformed_batch_lines_are_logged_at_a_rate(
    hub: Hub, settings: MeshSettings, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone in a namespace may send route batches; each one with a malformed line logged a
    WARNING: a loop of them filled the log. One line per subject per 10 s, the rest counted."""
    caplog.set_level(logging.WARNING, logger="reach_mesh.hub")
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    try:
        subject = protocol.hub_subject(namespace, "route_batch")
        for _ in range(20):
            await nc.publish(subject, b"no reply subject here\nnor here")
        await nc.flush()
        await asyncio.sleep(0.3)
    finally:
        await nc.close()
    said = [r for r in caplog.records if "malformed line(s) dropped" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert "2 malformed line(s)" in said[0].getMessage()
    assert hub.state is HubState.RUNNING


async def test_route_requests_in_one_batch_are_answered_in_one_batch(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    traceparent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with echo_agent(f"{namespace}.work.a1", settings):
        assert settings.nats_url is not None
        nc = await nats.connect(settings.nats_url)
        try:
            inbox = nc.new_inbox()
            answers: asyncio.Queue[Msg] = asyncio.Queue()

            async def collect(msg: Msg) -> None:
                await answers.put(msg)

            await nc.subscribe(inbox + ".>", cb=collect)
            good = [
                protocol.encode(RouteRequest(capability=CAP, payload={"n": i})) for i in range(3)
            ]
            bad = b'{"capability": "NOT A CAPABILITY"}'
            lines = [
                b"%s.%d %s %s" % (inbox.encode(), i, traceparent, g) for i, g in enumerate(good)
            ]
            lines.append(b"%s.bad %s %s" % (inbox.encode(), traceparent, bad))
            # Not a traceparent (not even UTF-8): the request starts a trace of its own.
            lines.append(b"%s.utf %s %s" % (inbox.encode(), b"\xff\xfe", good[1]))
            lines.append(b"no-fields-here")  # nobody to answer: dropped (and logged)
            lines.append(b"bad*subject " + traceparent + b" " + good[0])  # never published to
            await nc.publish(
                protocol.hub_subject(namespace, "route_batch"),
                b"\n".join(lines),
                reply=inbox + ".batch",
            )
            got: dict[str, bytes] = {}
            while len(got) < 5:
                msg = await asyncio.wait_for(answers.get(), 5)
                if msg.subject == inbox + ".batch":
                    for line in msg.data.split(b"\n"):
                        subject, _, body = line.partition(b" ")
                        got[subject.decode()] = body
                else:
                    got[msg.subject] = msg.data
            for i in range(3):
                reply = RouteReply.model_validate_json(got[f"{inbox}.{i}"])
                assert reply.task is not None and reply.task.result == {"n": i}
                # The traceparent of the line is the trace the agent ran in.
                assert reply.task.state is TaskState.SUCCEEDED
            with pytest.raises(BadRequestError):
                protocol.raise_for_error(got[f"{inbox}.bad"])
            odd = RouteReply.model_validate_json(got[f"{inbox}.utf"])
            assert odd.task is not None and odd.task.result == {"n": 1}
            await asyncio.sleep(0.1)
            assert answers.empty()
            assert hub.state is HubState.RUNNING
        finally:
            await nc.close()


async def test_client_sends_concurrent_routes_as_batches(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    seen: list[int] = []

    async def watch(msg: Msg) -> None:
        seen.append(len(msg.data.split(b"\n")))

    try:
        # Not in the hubs' queue group: sees a copy of every batch.
        await nc.subscribe(protocol.hub_subject(namespace, "route_batch"), cb=watch)
        await nc.flush()
        async with echo_agent(f"{namespace}.work.a1", settings), Client(settings=settings) as c:
            results = await asyncio.gather(
                *(c.request(capability=CAP, payload={"n": i}) for i in range(100))
            )
            assert [r.result for r in results] == [{"n": i} for i in range(100)]
            alone = await c.request(capability=CAP, payload={"n": -1})
            assert alone.result == {"n": -1}
        # Retries (a throttled request tries again) ride in later batches.
        assert seen and max(seen) > 1 and sum(seen) >= 100
    finally:
        await nc.close()


async def test_client_batch_with_no_hub_is_unavailable(settings: MeshSettings) -> None:
    async with Client(settings=settings) as c:
        with pytest.raises(MeshUnavailableError):
            await asyncio.gather(
                *(c.request(capability=CAP, payload={}, timeout=0.3) for _ in range(5))
            )
        # Until it is tried again, requests to that namespace go plain.
        assert c._batcher is not None
        assert list(c._batcher._plain_until) == [
            protocol.hub_subject(settings.namespace, "route_batch")
        ]


async def test_sdk_agent_takes_batches_and_answers_them_together(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent_id = f"{namespace}.work.a1"
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    batches: list[int] = []
    answers: list[int] = []

    async def watch_batches(msg: Msg) -> None:
        batches.append(len(msg.data.split(b"\n")))

    async def watch_answers(msg: Msg) -> None:
        answers.append(len(msg.data.split(b"\n")))

    try:
        async with echo_agent(agent_id, settings) as agent, Client(settings=settings) as c:
            assert agent.card().batch
            # Copies of what goes to the agent's batch subject and to the hub's batch reply
            # subjects (one token after the hub's prefix; single replies have two).
            await nc.subscribe(protocol.agent_batch(agent_id), cb=watch_batches)
            replies = hub._replies.of(namespace)
            await hub._replies.ready(replies)
            await nc.subscribe(replies.prefix + "*", cb=watch_answers)
            await nc.flush()
            results = await asyncio.gather(
                *(c.request(capability=CAP, payload={"n": i}) for i in range(12))
            )
            assert [r.result for r in results] == [{"n": i} for i in range(12)]
            assert all(r.agent_id == agent_id for r in results)
        assert batches and max(batches) > 1
        assert answers and max(answers) > 1
    finally:
        await nc.close()


async def test_sdk_agent_answers_bad_batch_lines_and_keeps_serving(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent_id = f"{namespace}.work.a1"
    traceparent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with echo_agent(agent_id, settings), Client(settings=settings) as c:
        assert settings.nats_url is not None
        nc = await nats.connect(settings.nats_url)
        try:
            inbox = nc.new_inbox()
            got: asyncio.Queue[Msg] = asyncio.Queue()

            async def collect(msg: Msg) -> None:
                await got.put(msg)

            await nc.subscribe(inbox + ".>", cb=collect)
            good = protocol.encode(TaskEnvelope(task_id="t" * 32, capability=CAP, payload={}))
            lines = [
                b"garbage",
                b"%s.1 %s {not json" % (inbox.encode(), traceparent),
                b"%s.2 %s %s" % (inbox.encode(), traceparent, good),
                b"%s.3 \xff\xfe %s" % (inbox.encode(), good.replace(b"t" * 32, b"u" * 32)),
                b"bad*reply %s %s" % (traceparent, good),
            ]
            await nc.publish(protocol.agent_batch(agent_id), b"\n".join(lines), reply=inbox + ".b")
            answers: dict[str, bytes] = {}
            while len(answers) < 3:
                msg = await asyncio.wait_for(got.get(), 5)
                for line in msg.data.split(b"\n") if msg.subject == inbox + ".b" else []:
                    subject, _, body = line.partition(b" ")
                    answers[subject.decode()] = body
                if msg.subject != inbox + ".b":
                    answers[msg.subject] = msg.data
            with pytest.raises(BadRequestError):
                protocol.raise_for_error(answers[inbox + ".1"])
            assert TaskReply.model_validate_json(answers[inbox + ".2"]).state is TaskState.SUCCEEDED
            assert TaskReply.model_validate_json(answers[inbox + ".3"]).state is TaskState.SUCCEEDED
        finally:
            await nc.close()
        res = await c.request(agent_id=agent_id, payload={"n": 1})
        assert res.result == {"n": 1}


async def test_direct_mode_calls_a_batch_agent_in_batches(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent_id = f"{namespace}.work.a1"
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url)
    batches: list[int] = []

    async def watch(msg: Msg) -> None:
        batches.append(len(msg.data.split(b"\n")))

    try:
        await nc.subscribe(protocol.agent_batch(agent_id), cb=watch)
        await nc.flush()
        async with echo_agent(agent_id, settings), Client(settings=settings) as c:
            first = await c.request(capability=CAP, payload={"n": -1}, mode="direct")
            assert first.result == {"n": -1}  # the decision is cached from here on
            results = await asyncio.gather(
                *(c.request(capability=CAP, payload={"n": i}, mode="direct") for i in range(12))
            )
            assert [r.result for r in results] == [{"n": i} for i in range(12)]
        assert batches and max(batches) > 1
    finally:
        await nc.close()
