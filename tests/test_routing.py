"""The routing engine against a real nats-server: selectors, strategies, sticky sessions,
graded liveness, circuit breaker, backpressure, explained decisions."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any, cast

import nats
import pytest

from reach_mesh import (
    AgentBusyError,
    Client,
    MeshSettings,
    MeshTimeoutError,
    MeshUnavailableError,
    NoMatchError,
    ThrottledError,
    UnknownAgentError,
    protocol,
)
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.hub.breaker import BreakerState
from reach_mesh.models import AgentState, FailureReport, Mode

from .helpers import eventually, held_handler, recording_agent, relayed


def echo_agent(
    agent_id: str, settings: MeshSettings, cap: str = "work:echo:v1", **kw: Any
) -> Agent:
    agent = Agent(agent_id, settings=settings, **kw)

    @agent.handler(cap)
    async def echo(task: Task[Any]) -> Any:
        return {"by": task.agent_id, "payload": task.payload}

    return agent


def held_agent(
    agent_id: str, settings: MeshSettings, release: asyncio.Event, cap: str = "work:echo:v1"
) -> Agent:
    """An agent whose handler answers "done" once ``release`` is set."""
    agent = Agent(agent_id, settings=settings)

    @agent.handler(cap)
    async def hold(task: Task[Any]) -> str:
        await release.wait()
        return "done"

    return agent


async def start_all(*agents: Agent) -> None:
    for a in agents:
        await a.start()


async def close_all(*agents: Agent) -> None:
    await asyncio.gather(*(a.close() for a in agents))


async def test_selector_routing_with_units_and_labels(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    small = echo_agent(
        f"{namespace}.w.small", settings, labels={"mem_gb": "4", "region": "cn-east"}
    )
    big = echo_agent(
        f"{namespace}.w.big", settings, labels={"mem_gb": "16", "region": "cn-east", "gpu": "true"}
    )
    far = echo_agent(f"{namespace}.w.far", settings, labels={"mem_gb": "64", "region": "us-west"})
    await start_all(small, big, far)
    try:
        async with Client(settings=settings) as c:
            sel = "cap=work:echo:v1 AND region=cn-east AND mem_gte=8GiB AND gpu exists"
            for _ in range(3):
                res = await c.request(selector=sel, payload=1)
                assert res.agent_id == big.agent_id
            res = await c.request(
                selector="cap=work:echo:v1 AND gpu !exists AND mem_lt=8GB", payload=1
            )
            assert res.agent_id == small.agent_id
            res = await c.request(selector="cap=work:echo:v1 AND region!=cn-east", payload=1)
            assert res.agent_id == far.agent_id
    finally:
        await close_all(small, big, far)


async def test_no_match_explains_nearest(hub: Hub, settings: MeshSettings, namespace: str) -> None:
    a = echo_agent(f"{namespace}.w.a1", settings, labels={"region": "cn-east"})
    async with a, Client(settings=settings) as c:
        with pytest.raises(NoMatchError) as info:
            await c.request(selector="cap=work:echo:v1 AND region=cn_east", payload=1)
        details = info.value.details
        assert details["similar_values"] == {"region": ["cn-east"]}
        assert details["partial"] == [{"agent_id": a.agent_id, "failed": "region=cn_east"}]
        assert info.value.message.endswith("did you mean region=cn-east?"), info.value.message
        with pytest.raises(NoMatchError) as info:
            await c.request(capability="work:echo:v2", payload=1)
        assert "work:echo:v1" in info.value.details["similar_capabilities"]
        # A misspelled label key: no agent has it, the message says which one they have.
        with pytest.raises(NoMatchError) as info:
            await c.request(selector="cap=work:echo:v1 AND regin=cn-east", payload=1)
        assert info.value.details["similar_keys"] == {"regin": ["region"]}
        assert info.value.message.endswith(
            "no agent has a label 'regin' (did you mean region=cn-east?)"
        ), info.value.message
        with pytest.raises(NoMatchError) as info:
            await c.request(selector="capability=work:echo:v1", payload=1)
        assert "did you mean cap=work:echo:v1?" in info.value.message, info.value.message
        # Terms joined Kubernetes' way: one label value "cn-east,cap=work:echo:v1" here.
        with pytest.raises(NoMatchError) as info:
            await c.request(selector="region=cn-east,cap=work:echo:v1", payload=1)
        assert info.value.message.endswith(
            "terms are joined with AND, not a comma: region=cn-east AND cap=work:echo:v1"
        ), info.value.message
        # An agent id with a typo: the registered ids of its namespace that are close.
        with pytest.raises(NoMatchError) as info:
            await c.request(agent_id=f"{namespace}.w.a9", payload=1)
        assert info.value.message.endswith(f"is not registered; did you mean {a.agent_id}?"), (
            info.value.message
        )
        with pytest.raises(UnknownAgentError) as unknown:
            await c.inspect(f"{namespace}.w.a9")
        assert unknown.value.message.endswith(f"did you mean {a.agent_id}?")
        assert unknown.value.details["similar_agents"] == [a.agent_id]


async def test_no_match_with_no_close_value_names_the_agents_one_term_away(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """`cap=work:echo:v1 AND tier=silver` where the agents are gold: no value is close enough
    for a "did you mean", and the message said no more than "no agent … matches". It names
    the agents of the namespace that fail that one term (an agent of another namespace that
    would too is not one of them)."""
    gold = echo_agent(f"{namespace}.w.g1", settings, labels={"tier": "gold", "zone": "a"})
    free = echo_agent(f"{namespace}.w.f1", settings, labels={"tier": "silver", "zone": "b"})
    other = settings.model_copy(update={"namespace": f"{namespace}x"})
    away = echo_agent(f"{namespace}x.w.g1", other, labels={"tier": "gold", "zone": "a"})
    await start_all(gold, free, away)
    try:
        async with Client(settings=settings) as c:
            with pytest.raises(NoMatchError) as info:
                await c.request(selector="cap=work:echo:v1 AND tier=bronze AND zone=a", payload=1)
            assert info.value.message == (
                f"no agent in namespace {namespace!r} matches cap=work:echo:v1 AND tier=bronze "
                f"AND zone=a; nearest: {gold.agent_id} fails only tier=bronze"
            )
            with pytest.raises(NoMatchError) as info:
                await c.request(selector="cap=work:echo:v1 AND tier=silver AND zone=a", payload=1)
            assert info.value.message.endswith(
                f"; nearest: {gold.agent_id} fails only tier=silver, {free.agent_id} fails "
                "only zone=a"
            ), info.value.message
            # A hint of its own (a close value) stays the only one.
            with pytest.raises(NoMatchError) as info:
                await c.request(selector="cap=work:echo:v1 AND tier=golf", payload=1)
            assert info.value.message.endswith("did you mean tier=gold?"), info.value.message
    finally:
        await close_all(gold, free, away)


async def test_explained_decision_lists_filters_and_scores(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    ok = echo_agent(f"{namespace}.w.ok", settings)
    cordoned = echo_agent(f"{namespace}.w.cordoned", settings)
    await start_all(ok, cordoned)
    try:
        async with Client(settings=settings) as c:
            await c.admin("cordon", cordoned.agent_id)
            await eventually(
                lambda: hub.registry.agents[cordoned.agent_id].state is AgentState.CORDONED
            )
            decision = await c.route(capability="work:echo:v1")
            assert decision.chosen == ok.agent_id
            assert sorted(decision.candidates) == sorted([ok.agent_id, cordoned.agent_id])
            assert [(f.agent_id, f.reason) for f in decision.filtered] == [
                (cordoned.agent_id, "state CORDONED")
            ]
            assert ok.agent_id in decision.scores
            await c.admin("uncordon", cordoned.agent_id)
            await eventually(
                lambda: hub.registry.agents[cordoned.agent_id].state is AgentState.ONLINE
            )
    finally:
        await close_all(ok, cordoned)


async def test_round_robin_and_consistent_hash(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agents = [echo_agent(f"{namespace}.w.a{i}", settings) for i in range(3)]
    await start_all(*agents)
    try:
        async with Client(settings=settings) as c:
            rr = [
                (
                    await c.request(capability="work:echo:v1", payload=i, strategy="round_robin")
                ).agent_id
                for i in range(6)
            ]
            assert Counter(rr) == Counter({a.agent_id: 2 for a in agents})
            # One full cycle over the three agents, then the same order again.
            assert len(set(rr[:3])) == 3 and rr[3:] == rr[:3]
            keyed = {
                (
                    await c.request(
                        capability="work:echo:v1",
                        payload=i,
                        strategy="consistent_hash",
                        hash_key="user-42",
                    )
                ).agent_id
                for i in range(5)
            }
            assert len(keyed) == 1
    finally:
        await close_all(*agents)


async def test_sticky_session_hit_and_fallback(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agents = [echo_agent(f"{namespace}.w.a{i}", settings) for i in range(3)]
    await start_all(*agents)
    try:
        async with Client(settings=settings) as c:
            first = await c.request(capability="work:echo:v1", payload=0, session_id="conv-1")
            for i in range(4):
                res = await c.request(
                    capability="work:echo:v1", payload=i, session_id="conv-1", explain=True
                )
                assert res.agent_id == first.agent_id
                assert res.decision is not None and res.decision.sticky == "hit"
            owner = next(a for a in agents if a.agent_id == first.agent_id)
            await owner.close()
            await eventually(lambda: owner.agent_id not in hub.registry.agents)
            res = await c.request(
                capability="work:echo:v1", payload=9, session_id="conv-1", explain=True
            )
            assert res.ok and res.agent_id != owner.agent_id
            assert res.decision is not None and res.decision.sticky == "miss"
            again = await c.request(capability="work:echo:v1", payload=9, session_id="conv-1")
            assert again.agent_id == res.agent_id  # the new owner sticks
    finally:
        await close_all(*agents)


async def test_breaker_open_half_open_closed(
    nats_url: str, settings: MeshSettings, namespace: str
) -> None:
    s = settings.model_copy(update={"breaker_min_requests": 3, "breaker_open_timeout": 0.4})
    flaky_ok = False
    async with Hub(settings=s) as hub:
        flaky = Agent(f"{namespace}.w.flaky", settings=s)
        steady = echo_agent(f"{namespace}.w.steady", s, cap="work:flaky:v1")

        @flaky.handler("work:flaky:v1")
        async def maybe(task: Task[Any]) -> str:
            if not flaky_ok:
                raise RuntimeError("dependency down")
            return "fine"

        async with flaky, steady, Client(settings=s) as c:
            for _ in range(3):
                await c.request(agent_id=flaky.agent_id, payload=0)
            view = hub.registry.agents[flaky.agent_id]
            assert view.state is AgentState.QUARANTINED
            assert hub.metrics.quarantine_total._value.get() >= 1
            # Quarantined: by capability every task goes to the steady agent.
            for _ in range(4):
                res = await c.request(capability="work:flaky:v1", payload=0)
                assert res.agent_id == steady.agent_id
            flaky_ok = True
            with pytest.raises(NoMatchError, match="QUARANTINED"):
                await c.request(agent_id=flaky.agent_id, payload=0)
            await eventually(lambda: view.breaker.state is BreakerState.HALF_OPEN)
            await eventually(lambda: view.state is AgentState.ONLINE)
            # Half-open: one probe goes through; its success closes the breaker.
            res = await c.request(agent_id=flaky.agent_id, payload=0)
            assert res.result == "fine"
            assert view.breaker.state is BreakerState.CLOSED
            # cast: mypy keeps the narrowing from before the awaits above
            assert cast(AgentState, view.state) is AgentState.ONLINE


async def test_caller_reports_feed_the_breaker_but_never_open_it_alone(
    hub: Hub, settings: MeshSettings, namespace: str, nats_url: str
) -> None:
    fail = False
    a = Agent(f"{namespace}.w.a1", settings=settings)

    @a.handler("work:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        if fail:
            raise RuntimeError("dependency down")
        return task.payload

    async with a, Client(settings=settings) as c:
        view = hub.registry.agents[a.agent_id]
        nc = await nats.connect(nats_url)
        try:
            subject = protocol.hub_subject(namespace, "report")
            # One reporter counts three times per window however often it reports; four
            # reporters make twelve failures, and still nothing the hub saw itself.
            for reporter in ("r1", "r1", "r2", "r3", "r4"):
                for _ in range(4):
                    report = FailureReport(
                        agent_id=a.agent_id, code="REACH_TIMEOUT", reporter=reporter
                    )
                    await nc.publish(subject, protocol.encode(report))
            await nc.publish(subject, b"garbage")
            await nc.flush()
        finally:
            await nc.close()
        await eventually(lambda: view.breaker.counts() == (0, 12))
        assert view.breaker.state is BreakerState.CLOSED
        assert view.state is AgentState.ONLINE
        # Nor do they take it out of rotation: twelve reported timeouts once left it at 40,
        # routed to only when no healthy agent matched.
        assert view.health.healthy
        decision = await c.route(capability="work:echo:v1")
        assert decision.chosen == a.agent_id and decision.fallback is None
        # One failure the hub witnessed, on top of the reported ones, opens it.
        fail = True
        res = await c.request(agent_id=a.agent_id, payload=1)
        assert res.error is not None and res.error.code == "REACH_HANDLER_FAILED"
        # cast: mypy keeps the narrowing from before the awaits above
        assert cast(AgentState, view.state) is AgentState.QUARANTINED


async def test_a_callers_word_that_nobody_serves_an_agent_is_checked(
    hub: Hub, settings: MeshSettings, namespace: str, nats_url: str
) -> None:
    """A report of no responders (``REACH_UNKNOWN_AGENT``) once set a live agent aside on the
    caller's word alone, until it was next heard from: a caller reporting it under a few
    made-up names each heartbeat kept a healthy agent out of rotation. The hub now asks the
    agent's ctl subject itself (the reconnect tests show a real absence still counts)."""
    a = echo_agent(f"{namespace}.w.a1", settings)
    b = echo_agent(f"{namespace}.w.b1", settings)
    await start_all(a, b)
    try:
        view = hub.registry.agents[a.agent_id]
        before = view.unreached_at
        nc = await nats.connect(nats_url)
        try:
            subject = protocol.hub_subject(namespace, "report")
            for i in range(6):
                report = FailureReport(
                    agent_id=a.agent_id, code="REACH_UNKNOWN_AGENT", reporter=f"made-up-{i}"
                )
                await nc.publish(subject, protocol.encode(report))
            await nc.flush()
        finally:
            await nc.close()
        await asyncio.sleep(0.3)
        await eventually(lambda: not hub._pinging)
        assert view.unreached_at == before  # (its heartbeats would hide it a moment later)
        async with Client(settings=settings) as c:
            decision = await c.route(capability="work:echo:v1")
        assert a.agent_id not in {f.agent_id for f in decision.filtered}, decision.filtered
        assert decision.fallback is None
    finally:
        await close_all(a, b)


async def test_unavailable_capability_is_filtered(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    a = echo_agent(f"{namespace}.w.a1", settings)
    b = echo_agent(f"{namespace}.w.b1", settings)
    await start_all(a, b)
    try:
        a.unavailable.add("work:echo:v1")
        await a.heartbeat_now()
        async with Client(settings=settings) as c:
            decision = await c.route(capability="work:echo:v1")
            assert decision.chosen == b.agent_id
            assert (a.agent_id, "reports work:echo:v1 unavailable") in [
                (f.agent_id, f.reason) for f in decision.filtered
            ]
    finally:
        await close_all(a, b)


async def test_draining_agent_gets_no_new_work(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    release = asyncio.Event()
    slow = held_agent(f"{namespace}.w.slow", settings, release)
    other = echo_agent(f"{namespace}.w.other", settings)
    await start_all(slow, other)
    async with Client(settings=settings) as c:
        held = asyncio.create_task(c.request(agent_id=slow.agent_id, payload=0))
        await eventually(lambda: slow.inflight == 1)
        closing = asyncio.create_task(slow.close())
        await eventually(lambda: hub.registry.agents[slow.agent_id].state is AgentState.DRAINING)
        res = await c.request(capability="work:echo:v1", payload=1)
        assert res.agent_id == other.agent_id
        release.set()
        assert (await held).result == "done"  # in-flight work finishes during the drain
        await closing
    await other.close()


async def test_route_throttling_and_client_backoff(
    nats_url: str, settings: MeshSettings, namespace: str
) -> None:
    s = settings.model_copy(update={"route_rate": 20.0, "route_burst": 3.0})
    async with Hub(settings=s) as hub, echo_agent(f"{namespace}.w.a1", s) as a:
        nc = await nats.connect(nats_url)
        try:
            bodies = []
            for _ in range(6):
                msg = await nc.request(
                    protocol.hub_subject(namespace, "route"),
                    json.dumps({"agent_id": a.agent_id}).encode(),
                    timeout=5,
                )
                bodies.append(json.loads(msg.data))
            codes = [b["error"]["code"] if "error" in b else "OK" for b in bodies]
            assert codes[:3] == ["OK"] * 3 and "REACH_THROTTLED" in codes
            throttled = next(b for b in bodies if "error" in b)
            assert throttled["error"]["details"]["retry_after_ms"] > 0
        finally:
            await nc.close()
        # The SDK honours retry_after with backoff and jitter: every request succeeds.
        async with Client(settings=s) as c:
            results = await asyncio.gather(
                *(c.request(agent_id=a.agent_id, payload=i) for i in range(10))
            )
        assert all(r.ok for r in results)
        assert hub.metrics.throttled_total.labels(namespace)._value.get() > 0


async def test_a_throttled_namespace_is_logged_naming_the_caller(
    settings: MeshSettings, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Throttling is said, not only counted: one ``REACH-THROTTLED`` WARNING per namespace per
    10 s, naming the reply inbox of the request it refused (the flooding caller's connection —
    its own ``nats_inbox_prefix`` here, as a secure-mode identity has) and how many more were
    held back. Before, a flood refused thousands of requests without a line in the hub's log,
    and nothing told which caller of the namespace sent them (incident drill e)."""
    caplog.set_level(logging.WARNING, logger="reach_mesh")
    s = settings.model_copy(update={"route_rate": 20.0, "route_burst": 3.0})
    flooder = s.model_copy(update={"nats_inbox_prefix": "_INBOX.flooder"})
    async with Hub(settings=s) as hub, echo_agent(f"{namespace}.w.a1", s) as a:
        async with Client(settings=flooder) as c:
            results = await asyncio.gather(
                *(c.request(agent_id=a.agent_id, payload=i, timeout=10) for i in range(30))
            )
        assert all(r.ok for r in results)  # the SDK retried them
        refused = hub.metrics.throttled_total.labels(namespace)._value.get()
        assert refused > 1
    told = [r for r in caplog.records if getattr(r, "event", None) == "REACH-THROTTLED"]
    assert len(told) == 1, told  # one line per namespace per 10 s, however many refused
    line = told[0]
    assert line.levelno == logging.WARNING
    assert line.namespace == namespace  # type: ignore[attr-defined]
    assert line.reason == "route_rate"  # type: ignore[attr-defined]
    # The flooding Client's own part of its reply subjects: its inbox prefix and its random
    # bits, the same for all its requests (not the batch and request tokens after them).
    caller = line.caller  # type: ignore[attr-defined]
    assert caller.startswith("_INBOX.flooder.") and caller.count(".") == 2, caller
    assert "route_rate (20/s, burst 3)" in line.getMessage()


async def test_throttled_error_surfaces_past_deadline(
    nats_url: str, settings: MeshSettings, namespace: str
) -> None:
    s = settings.model_copy(update={"route_rate": 0.5, "route_burst": 1.0})
    async with Hub(settings=s), echo_agent(f"{namespace}.w.a1", s) as a, Client(settings=s) as c:
        await c.request(agent_id=a.agent_id, payload=0)
        with pytest.raises(ThrottledError):
            await c.request(agent_id=a.agent_id, payload=1, timeout=0.2)


@pytest.mark.parametrize("hung_tenants", [1, 2, 4])
async def test_tenants_whose_agents_hang_cannot_take_a_hub(
    nats_url: str, settings: MeshSettings, namespace: str, hung_tenants: int
) -> None:
    """Tenants whose agents hang fill a hub (``hub_concurrency`` 4) between them. Then their
    further requests are THROTTLED — refused unread, so the hub keeps reading — while another
    tenant's request is taken past the bound, as its fair share, and answered at once. The
    throttled tenants' SDK retries until their flights end. (Before fair shares the full hub
    stopped reading, and the other tenant's request timed out.)"""
    s = settings.model_copy(update={"hub_concurrency": 4})
    release = asyncio.Event()
    hung = [namespace, *(f"{namespace}h{i}" for i in range(1, hung_tenants))]
    slow = [
        held_agent(f"{ns}.w.slow", s.model_copy(update={"namespace": ns}), release) for ns in hung
    ]
    other_ns = f"{namespace}x"
    other = echo_agent(f"{other_ns}.w.b1", s.model_copy(update={"namespace": other_ns}))
    async with Hub(settings=s) as hub, other:
        await start_all(*slow)
        nc = await nats.connect(nats_url)
        try:
            await eventually(lambda: all(a.agent_id in hub.registry.agents for a in slow))
            await eventually(lambda: other.agent_id in hub.registry.agents)

            def ask(agent: Agent, timeout: float) -> Any:
                body = json.dumps({"agent_id": agent.agent_id, "timeout": 10}).encode()
                subject = protocol.hub_subject(protocol.namespace_of(agent.agent_id), "route")
                return nc.request(subject, body, timeout=timeout)

            held = [
                asyncio.ensure_future(ask(a, 10)) for a in slow for _ in range(4 // hung_tenants)
            ]
            await eventually(lambda: hub.routing == 4)
            for a in slow:
                refused = json.loads((await ask(a, 2)).data)
                assert refused["error"]["code"] == "REACH_THROTTLED"
                assert refused["error"]["details"]["retry_after_ms"] > 0
                assert "fair share" in refused["error"]["message"]
            assert hub.metrics.throttled_total.labels(namespace)._value.get() == 1
            async with Client(settings=s) as c:
                res = await asyncio.wait_for(
                    c.request(agent_id=other.agent_id, payload="b", timeout=2), 1.5
                )
                assert res.ok and res.agent_id == other.agent_id
                late = asyncio.ensure_future(c.request(agent_id=slow[0].agent_id, timeout=10))
                await asyncio.sleep(0.3)
                assert not late.done()
                release.set()
                assert (await late).result == "done"
            for answer in await asyncio.gather(*held):
                assert json.loads(answer.data)["task"]["result"] == "done"
            assert hub.routing == 0 and not hub._ns_flights
        finally:
            await nc.close()
            await close_all(*slow)


async def test_hung_tenants_arriving_one_after_another_cannot_stop_a_hub(
    nats_url: str, settings: MeshSettings, namespace: str
) -> None:
    """Each hung tenant keeps what it took, so their fair shares add up past the capacity
    (2 here: 2 + 1 + 1 flights). The hub still reads and serves another tenant: before the
    ceiling it stopped reading at twice the capacity."""
    s = settings.model_copy(update={"hub_concurrency": 2})
    release = asyncio.Event()
    hung = [namespace, f"{namespace}h1", f"{namespace}h2"]
    slow = [
        held_agent(f"{ns}.w.slow", s.model_copy(update={"namespace": ns}), release) for ns in hung
    ]
    other = echo_agent(f"{namespace}x.w.b1", s.model_copy(update={"namespace": f"{namespace}x"}))
    async with Hub(settings=s) as hub, other:
        await start_all(*slow)
        try:
            await eventually(lambda: all(a.agent_id in hub.registry.agents for a in slow))
            await eventually(lambda: other.agent_id in hub.registry.agents)
            async with Client(settings=s) as c:
                held = []
                for agent, count in zip(slow, (2, 1, 1), strict=True):
                    held += [
                        asyncio.ensure_future(c.request(agent_id=agent.agent_id, timeout=10))
                        for _ in range(count)
                    ]
                    taken = len(held)
                    await eventually(lambda: hub.routing == taken)  # noqa: B023 - awaited here
                res = await asyncio.wait_for(
                    c.request(agent_id=other.agent_id, payload="b", timeout=2), 1.5
                )
                assert res.ok
                release.set()
                assert all(r.result == "done" for r in await asyncio.gather(*held))
        finally:
            await close_all(*slow)


async def test_one_tenant_alone_may_use_the_whole_hub(
    nats_url: str, settings: MeshSettings, namespace: str
) -> None:
    """Fair shares are work-conserving: a namespace alone on a hub has all of
    ``hub_concurrency`` before it is throttled."""
    s = settings.model_copy(update={"hub_concurrency": 4})
    release = asyncio.Event()
    slow = held_agent(f"{namespace}.w.slow", s, release)
    async with Hub(settings=s) as hub, slow, Client(settings=s) as c:
        calls = [
            asyncio.ensure_future(c.request(agent_id=slow.agent_id, payload=i, timeout=10))
            for i in range(4)
        ]
        await eventually(lambda: hub.routing == 4 and slow.inflight == 4)
        assert hub.metrics.throttled_total.labels(namespace)._value.get() == 0
        release.set()
        assert [r.result for r in await asyncio.gather(*calls)] == ["done"] * 4


async def test_registration_storm_is_absorbed(
    nats_url: str, settings: MeshSettings, namespace: str
) -> None:
    """Far more agents than the register rate allows at once: all register eventually and
    the hub keeps answering routes meanwhile."""
    s = settings.model_copy(
        update={
            "register_rate": 100.0,
            "register_burst": 10.0,
            "heartbeat_interval": 1.0,
            "lease_timeout": 5.0,
        }
    )
    async with Hub(settings=s) as hub:
        agents = [echo_agent(f"{namespace}.storm.a{i}", s) for i in range(60)]
        starts = asyncio.gather(*(a.start() for a in agents))
        async with Client(settings=s) as c:
            # Other tests' agents share the registry: wait for one of this storm's.
            await eventually(
                lambda: any(v.record.card.namespace == namespace for v in hub.registry)
            )
            res = await c.request(capability="work:echo:v1", payload="during the storm")
            assert res.ok
        await starts
        assert len([v for v in hub.registry if v.record.card.namespace == namespace]) == 60
        assert hub.metrics.throttled_total.labels(namespace)._value.get() > 0
        await close_all(*agents)


async def test_region_preference(hub: Hub, settings: MeshSettings, namespace: str) -> None:
    eu = echo_agent(f"{namespace}.w.eu", settings, region="eu-west")
    us = echo_agent(f"{namespace}.w.us", settings, region="us-east")
    await start_all(eu, us)
    try:
        async with Client(settings=settings) as c:
            for _ in range(4):
                res = await c.request(capability="work:echo:v1", payload=0, region="us-east")
                assert res.agent_id == us.agent_id
    finally:
        await close_all(eu, us)


async def test_direct_mode(hub: Hub, settings: MeshSettings, namespace: str) -> None:
    a = echo_agent(f"{namespace}.w.a1", settings)
    async with a, Client(settings=settings) as c:
        res = await c.request(capability="work:echo:v1", payload={"x": 1}, mode="direct")
        assert res.ok and res.result == {"by": a.agent_id, "payload": {"x": 1}}


async def test_a_direct_call_whose_decision_came_too_late_sends_nothing(
    hub: Hub, settings: MeshSettings, nats_url: str, namespace: str
) -> None:
    """The hub's decision reaches the caller after the request's deadline (a slow link here;
    a stalled loop or a hub slow to answer alike): the task is not sent. It was, with 1 ms
    to run, and its agent kept that TIMEOUT as the task id's answer to every retry (a chaos
    run's route was never answered); a retry with the same task id now runs it."""
    a, ran = recording_agent(f"{namespace}.w.a1", settings, "work:echo:v1")
    relay, through = await relayed(nats_url, settings)
    async with a, Client(settings=through) as c:  # (no decision cached yet)
        relay.hold()  # what the server sends the caller comes late
        call = asyncio.create_task(
            c.request(
                capability="work:echo:v1", payload=1, task_id="late-1", timeout=0.3, mode="direct"
            )
        )
        await asyncio.sleep(0.5)
        relay.release()
        with pytest.raises(MeshTimeoutError, match="nothing was sent"):
            await call
        assert ran == []
        res = await c.request(
            capability="work:echo:v1", payload=1, task_id="late-1", timeout=5, mode="direct"
        )
        assert res.result == 1 and ran == [1]
    await relay.cut()


@pytest.mark.parametrize("target", ["capability", "selector"])
@pytest.mark.parametrize("mode", ["direct", "proxy"])
async def test_a_retry_of_a_task_that_timed_out_on_its_agent_runs_it_again(
    hub: Hub, settings: MeshSettings, namespace: str, mode: Mode, target: str
) -> None:
    """The handler outlasted the call's timeout (its agent ended it: TIMEOUT). The retry with
    the same task id goes to that agent as its next attempt, which a TIMEOUT runs again; as
    attempt 1 again it got the stored TIMEOUT, every time (a chaos route whose decision came
    with 42 ms left was never answered; through a hub, every retry of a timed-out task). Direct
    mode numbers the attempt in the client, proxy mode in the hub (``after_attempt``). A retry
    that times out too is followed by one that counts on from it. By selector too (the
    README's first form), which names no agent to pin: its retries were attempt 1 for good."""
    a, ran = recording_agent(f"{namespace}.w.a1", settings, "work:echo:v1", delay=0.4)
    to: dict[str, Any] = (
        {"capability": "work:echo:v1"}
        if target == "capability"
        else {"selector": "cap=work:echo:v1"}
    )
    async with a, Client(settings=settings) as c:
        for attempt in (1, 2):
            with pytest.raises(MeshTimeoutError):  # (the caller's wait or the agent's answer)
                await c.request(**to, payload=1, task_id="slow-1", timeout=0.2, mode=mode)
            await asyncio.sleep(0.5)  # its agent has ended the handler: TIMEOUT, kept for the id
            assert ran == [1] * attempt
        res = await c.request(**to, payload=1, task_id="slow-1", timeout=5, mode=mode)
        assert res.result == 1 and res.attempt == 3 and ran == [1, 1, 1]


async def test_agent_at_capacity_queues_instead_of_no_match(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """3x more concurrent requests than one agent's max_concurrency + max_queue: the hub never
    answers NO_MATCH because the agent is saturated; the agent queues, refuses when really full
    (REACH_AGENT_BUSY, retryable) and the client retries until its deadline."""
    agent = Agent(f"{namespace}.w.slow", settings=settings, max_concurrency=2, max_queue=2)

    @agent.handler("work:slow:v1")
    async def slow(task: Task[Any]) -> Any:
        await asyncio.sleep(0.05)
        return task.payload

    async with agent, Client(settings=settings) as c:
        results = await asyncio.gather(
            *(c.request(capability="work:slow:v1", payload=i, timeout=10.0) for i in range(12)),
            return_exceptions=True,
        )
    for i, res in enumerate(results):
        assert not isinstance(res, NoMatchError), res
        if isinstance(res, BaseException):
            assert isinstance(res, AgentBusyError | MeshUnavailableError | ThrottledError), res
        else:
            assert res.ok and res.result == i


def _routed(hub: Hub, namespace: str) -> float:
    value: float = hub.metrics.task_total.labels(namespace, "direct", "ROUTED")._value.get()
    return value


async def test_direct_mode_caches_decisions_and_reports_failures_only(
    hub: Hub, settings: MeshSettings, namespace: str, nats_url: str
) -> None:
    agents = [echo_agent(f"{namespace}.w.a{i}", settings) for i in range(3)]
    await start_all(*agents)
    reports: list[FailureReport] = []
    nc = await nats.connect(nats_url)
    try:

        async def on_report(msg: Any) -> None:
            reports.append(FailureReport.model_validate_json(msg.data))

        await nc.subscribe(protocol.hub_subject(namespace, "report"), cb=on_report)
        await nc.flush()
        cached = settings.model_copy(update={"direct_cache_ttl": 30.0})
        async with Client(settings=cached) as c:
            for i in range(10):
                res = await c.request(capability="work:echo:v1", payload=i, mode="direct")
                assert res.ok and res.result["payload"] == i
            assert _routed(hub, namespace) == 1  # one hub decision, nine cache hits
            # Concurrent requests spread over the cached decision and its alternates.
            many = await asyncio.gather(
                *(c.request(capability="work:echo:v1", payload=i, mode="direct") for i in range(30))
            )
            assert len({r.agent_id for r in many}) > 1
            await nc.flush()
            assert reports == []  # successes of healthy agents are not reported
            # An agent that vanished: dropped from the cache, reported, the next one serves.
            gone = next(a for a in agents if a.agent_id == res.agent_id)  # the cache's first
            await gone.close()
            for i in range(6):
                res = await c.request(capability="work:echo:v1", payload=i, mode="direct")
                assert res.ok and res.agent_id != gone.agent_id
            await eventually(lambda: len(reports) >= 1)
            assert {r.agent_id for r in reports} == {gone.agent_id}
            assert all(not r.success for r in reports)
        async with Client(settings=settings.model_copy(update={"direct_cache_ttl": 0.0})) as c:
            before = _routed(hub, namespace)
            for i in range(3):
                await c.request(capability="work:echo:v1", payload=i, mode="direct")
            assert _routed(hub, namespace) == before + 3  # cache off: a hub trip each
    finally:
        await nc.close()
        await close_all(*agents)


async def test_direct_mode_session_requests_are_routed_each_time(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    a = echo_agent(f"{namespace}.w.a1", settings)
    async with a, Client(settings=settings) as c:
        for i in range(3):
            await c.request(capability="work:echo:v1", payload=i, mode="direct", session_id="s1")
        assert _routed(hub, namespace) == 3


async def test_a_request_naming_a_restarting_agent_is_told_so(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """An agent restarted gracefully (SIGTERM: it drains, says goodbye, a new process
    registers): a request naming it meanwhile is refused (``REACH_NO_MATCH``, as before) with
    what to do — an SRE audit's callers read "state DRAINING", then "not registered", for the
    whole drain, as for an id that never existed. Once the new process registers, it is
    served."""
    agent_id = f"{namespace}.w.restart"
    old = Agent(agent_id, settings=settings)
    held = held_handler(old, "work:echo:v1", answer=0)
    async with Client(settings=settings) as c:
        await old.start()
        running = asyncio.create_task(c.request(agent_id=agent_id, payload=0, timeout=20))
        await asyncio.wait_for(held.started.wait(), 5)
        closing = asyncio.create_task(old.close())  # drains: the held task keeps it DRAINING
        view = hub.registry.agents[agent_id]
        await eventually(lambda: view.state is AgentState.DRAINING)
        with pytest.raises(NoMatchError, match=r"DRAINING \(stopping, or restarting") as err:
            await c.request(agent_id=agent_id, payload=1, timeout=5)
        assert "ask again with the same task_id" in err.value.message
        held.release.set()
        assert (await running).result == 0
        await closing
        with pytest.raises(
            NoMatchError, match=r"it unregistered \d+s ago \(stopped, or restarting"
        ):
            await c.request(agent_id=agent_id, payload=2, timeout=5)
        with pytest.raises(NoMatchError, match=r"'.*never\.was' is not registered$"):
            await c.request(agent_id=f"{namespace}.never.was", payload=3, timeout=5)
        new, _ = recording_agent(agent_id, settings, "work:echo:v1")
        async with new:
            assert (await c.request(agent_id=agent_id, payload=4, timeout=5)).result == 4


@pytest.mark.parametrize("mode", ["direct", "proxy"])
async def test_a_retry_of_a_timed_out_task_goes_to_its_agent_whatever_the_breaker_says(
    hub: Hub, settings: MeshSettings, namespace: str, mode: Mode
) -> None:
    """The retry of a task that timed out on its agent names that agent (``agent_id`` and
    ``after_attempt``): it may hold the task, so this hub's breaker — opened by the timeouts —
    does not turn it away, as it does not a pinned retry. Turned away (``REACH_NO_MATCH``),
    the ``Client`` dropped its pin and the task ran on another agent too, as attempt 1 (secure
    chaos run ``partition``, seed 168, route r00445: the hub that took the retry had the agent
    quarantined for 30 s)."""
    a1, ran1 = recording_agent(f"{namespace}.w.a1", settings, "work:echo:v1", delay=0.4)
    a2, ran2 = recording_agent(f"{namespace}.w.a2", settings, "work:echo:v1")
    async with a1, a2, Client(settings=settings) as c:
        await eventually(lambda: len(hub.registry.agents) >= 2)
        with pytest.raises(MeshTimeoutError):
            await c.request(
                agent_id=a1.agent_id, payload=1, task_id="slow-q", timeout=0.2, mode=mode
            )
        await asyncio.sleep(0.5)  # its agent has ended the handler: TIMEOUT, kept for the id
        assert ran1 == [1]
        view = hub.registry.agents[a1.agent_id]
        view.breaker.trip()
        hub.registry.regrade(view)
        assert view.state is AgentState.QUARANTINED
        res = await c.request(
            capability="work:echo:v1", payload=1, task_id="slow-q", timeout=5, mode=mode
        )
        assert res.agent_id == a1.agent_id and res.attempt == 2
        assert ran1 == [1, 1] and ran2 == []
