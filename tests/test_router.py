"""Router.decide against a registry snapshot fed in memory (no NATS): fallback tiers, sampling
of large candidate sets, the explain output's bounds, direct-mode alternates."""

from __future__ import annotations

import functools
import operator
import random
from typing import Any

import pytest

from reach_mesh import MeshSettings, NoMatchError
from reach_mesh.hub.breaker import DEAF, BreakerState
from reach_mesh.hub.registry import Registry
from reach_mesh.hub.router import EXPLAIN_CANDIDATES, SAMPLE_SIZE, Router
from reach_mesh.models import AgentState, RouteRequest
from tests.helpers import fed_agent

CAP = "work:echo:v1"


def add_agent(registry: Registry, agent_id: str, *, cordoned: bool = False, **card: Any) -> None:
    fed_agent(registry, agent_id, [CAP], cordoned=cordoned, **card)


def fleet(n: int, **card: Any) -> tuple[Registry, Router]:
    settings = MeshSettings(namespace="ns")
    registry = Registry(None, None, settings)  # type: ignore[arg-type]  # no KV: fed in memory
    for i in range(n):
        add_agent(registry, f"ns.w.a{i:05d}", **card)
    return registry, Router(registry, settings, "hub-test", rng=random.Random(7))


def test_saturated_agents_are_a_fallback_not_a_miss() -> None:
    registry, router = fleet(3, max_concurrency=2)
    views = sorted(registry.agents.values(), key=lambda v: v.agent_id)
    views[0].outstanding, views[1].outstanding, views[2].outstanding = 2, 3, 2
    views[0].inflight = 2
    req = RouteRequest(capability=CAP, explain=True)
    choice = router.decide(req, "ns", "r1")
    assert choice.decision is not None and choice.decision.fallback == "saturated"
    assert choice.view.agent_id in (views[0].agent_id, views[2].agent_id)  # least loaded
    assert {f.reason.split(" (")[0] for f in choice.decision.filtered} == {"at capacity"}
    # One unsaturated agent wins over every saturated one.
    views[2].outstanding = 1
    choice = router.decide(RouteRequest(capability=CAP), "ns", "r2")
    assert choice.view is views[2] and choice.decision is None  # no decision unless explained


def test_an_unreached_agent_is_a_fallback_but_keeps_its_exclusions() -> None:
    """Not heard from since a task found nobody on its subject: routed to only when nobody
    else can take the task — and never for a capability it reports unavailable."""
    registry, router = fleet(2)
    gone, other = sorted(registry.agents.values(), key=lambda v: v.agent_id)
    gone.unreached_at = gone.spoke_at + 1.0
    choice = router.decide(RouteRequest(capability=CAP, explain=True), "ns", "r1")
    assert choice.view is other
    other.unavailable = frozenset({CAP})
    choice = router.decide(RouteRequest(capability=CAP, explain=True), "ns", "r2")
    assert choice.view is gone and choice.decision is not None
    assert choice.decision.fallback == "suspect"
    gone.unavailable = frozenset({CAP})
    with pytest.raises(NoMatchError):
        router.decide(RouteRequest(capability=CAP), "ns", "r3")


def test_no_match_still_explains_without_explain() -> None:
    registry, router = fleet(2)
    for view in registry.agents.values():
        view.record.cordoned = True
        registry.regrade(view)
    with pytest.raises(NoMatchError) as info:
        router.decide(RouteRequest(capability=CAP), "ns", "r1")
    filtered = info.value.details["decision"]["filtered"]
    assert [f["reason"] for f in filtered] == ["state CORDONED"] * 2


def test_large_candidate_sets_are_sampled_and_explain_is_capped() -> None:
    _, router = fleet(SAMPLE_SIZE * 4)
    choice = router.decide(RouteRequest(capability=CAP, explain=True), "ns", "r1")
    decision = choice.decision
    assert decision is not None and decision.sampled == SAMPLE_SIZE
    assert len(decision.scores) == SAMPLE_SIZE
    assert decision.candidate_count == SAMPLE_SIZE * 4
    assert len(decision.candidates) == EXPLAIN_CANDIDATES
    # round_robin needs the whole set: no sampling.
    rr = router.decide(
        RouteRequest(capability=CAP, strategy="round_robin", explain=True), "ns", "r"
    )
    assert rr.decision is not None and rr.decision.sampled is None
    assert len(rr.decision.scores) == SAMPLE_SIZE * 4


def test_an_unlucky_sample_falls_back_to_the_full_scan() -> None:
    registry, router = fleet(SAMPLE_SIZE * 20)
    keep = "ns.w.a00007"
    for view in registry.agents.values():
        if view.agent_id != keep:
            view.record.cordoned = True
            registry.regrade(view)
    for i in range(5):
        assert router.decide(RouteRequest(capability=CAP), "ns", f"r{i}").view.agent_id == keep


def test_sticky_agent_survives_sampling() -> None:
    _, router = fleet(SAMPLE_SIZE * 10)
    sticky = "ns.w.a00123"
    for i in range(20):
        choice = router.decide(RouteRequest(capability=CAP), "ns", f"r{i}", sticky_agent=sticky)
        assert choice.view.agent_id == sticky


def test_alternates_are_distinct_and_ranked() -> None:
    registry, router = fleet(5)
    views = sorted(registry.agents.values(), key=lambda v: v.agent_id)
    for load, view in enumerate(views):
        view.outstanding = load
    choice = router.decide(RouteRequest(capability=CAP, mode="direct"), "ns", "r", alternates=3)
    assert choice.view is views[0]
    assert [v.agent_id for v in choice.alternates] == [v.agent_id for v in views[1:4]]


def test_a_route_never_looks_at_another_namespaces_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    """5,000 agents of namespace "ns" serve CAP; a request in namespace "tiny" (one agent,
    cordoned) is decided on tiny's agents alone: its candidates, its explanation and the
    agents the router examines never include ns's."""
    registry, router = fleet(5_000)
    add_agent(registry, "tiny.w.a1", cordoned=True)
    examined: list[str] = []
    real = router._filter

    def spy(view: Any, *args: Any) -> str | None:
        examined.append(view.agent_id)
        return real(view, *args)

    monkeypatch.setattr(router, "_filter", spy)
    for req in (
        RouteRequest(capability=CAP, explain=True),
        RouteRequest(selector=f"cap={CAP}", explain=True),
    ):
        with pytest.raises(NoMatchError) as info:
            router.decide(req, "tiny", "r1")
        decision = info.value.details["decision"]
        assert decision["candidates"] == ["tiny.w.a1"]
        assert [f["agent_id"] for f in decision["filtered"]] == ["tiny.w.a1"]
    assert set(examined) == {"tiny.w.a1"}


def test_a_namespaces_listing_is_its_own_agents_only() -> None:
    registry, _ = fleet(300)
    add_agent(registry, "tiny.w.a1")
    assert [v.agent_id for v in registry.views("tiny")] == ["tiny.w.a1"]
    assert len(registry.views("ns")) == 300 and len(registry.views()) == 301
    assert registry.views("none") == []


def test_the_holder_of_a_task_is_routed_to_whatever_its_breaker_says_unless_deaf() -> None:
    """``only`` (the agent that may hold the task): a retry of a task it holds is no new
    work, so this hub's breaker — open, or half-open with its probe out — does not send it
    to another agent, which would run it again (secure chaos run ``node_kill``, seed 158);
    the holder is given no probe. A holder found deaf stays out: it cannot answer."""
    registry, router = fleet(2)
    holder, other = sorted(registry.agents.values(), key=lambda v: v.agent_id)
    req = RouteRequest(capability=CAP, task_id="t1")
    holder.breaker.trip()
    registry.regrade(holder)
    assert holder.state is AgentState.QUARANTINED
    assert router.decide(req, "ns", "r1").view is other  # new work: not to it
    assert router.decide(req, "ns", "r2", only=holder.agent_id).view is holder
    holder.breaker._opened_at -= holder.breaker.open_timeout  # half-open
    registry.regrade(holder)
    assert holder.breaker.allow()  # its probe out
    assert router.decide(req, "ns", "r3", only=holder.agent_id).view is holder
    holder.breaker._probe_at = None  # the probe back: the holder's route does not take it
    assert router.decide(req, "ns", "r4", only=holder.agent_id).view is holder
    assert holder.breaker.state is BreakerState.HALF_OPEN and holder.breaker.probe_available
    holder.breaker.trip(DEAF)
    registry.regrade(holder)
    with pytest.raises(NoMatchError):
        router.decide(req, "ns", "r5", only=holder.agent_id)


def test_a_named_agent_a_task_timed_out_on_is_routed_to_whatever_its_breaker_says() -> None:
    """``agent_id`` with ``after_attempt`` (the ``Client``'s retry of a task that timed out
    there): that agent may hold the task, so its breaker does not turn the retry away, which
    the caller then routed as new to another agent (secure chaos run ``partition``, seed
    168). Named without ``after_attempt``, a quarantined agent is still no match; found
    deaf, not even with it."""
    registry, router = fleet(2)
    holder, _ = sorted(registry.agents.values(), key=lambda v: v.agent_id)
    holder.breaker.trip()
    registry.regrade(holder)
    assert holder.state is AgentState.QUARANTINED
    retry = RouteRequest(agent_id=holder.agent_id, task_id="t1", after_attempt=1)
    assert router.decide(retry, "ns", "r1").view is holder
    with pytest.raises(NoMatchError):
        router.decide(RouteRequest(agent_id=holder.agent_id, task_id="t1"), "ns", "r2")
    holder.breaker.trip(DEAF)
    registry.regrade(holder)
    with pytest.raises(NoMatchError):
        router.decide(retry, "ns", "r3")


def test_least_loaded_choices_are_the_strategys_over_randomized_fleets() -> None:
    """The engine's path (no explanation: ``Router._least_loaded``, no ``Candidate`` per agent)
    chooses what ``LeastLoaded.choose`` over the candidates does (the explained path), decision
    after decision over random fleets, each choice's load counted before the next (as
    ``StepPlacing._choose`` does): the same scores, ties and draws from the router's rng."""
    settings = MeshSettings(namespace="ns")
    for seed in range(60):
        rng = random.Random(seed)
        clock = [100.0]
        read = functools.partial(operator.getitem, clock, 0)
        registry = Registry(None, None, settings, clock=read)  # type: ignore[arg-type]
        for i in range(rng.choice((2, 3, 5, 30))):
            add_agent(registry, f"ns.w.a{i:03d}", max_concurrency=rng.choice((1, 2, 4, 16)))
        views = list(registry.agents.values())
        explained = Router(registry, settings, "hub-test", rng=random.Random(seed))
        engine = Router(registry, settings, "hub-test", rng=random.Random(seed))
        for _ in range(40):
            clock[0] += rng.random()
            for view in rng.sample(views, k=min(3, len(views))):
                view.inflight = rng.randrange(5)
                view.queue_depth = rng.choice((0, 0, 1, 3))
                view.pressure = rng.choice((0.0, 0.0, 0.3, 1.5))
                view.recent, view.recent_at = rng.choice(((0.0, 0.0), (1.2, clock[0] - 0.4)))
                view.state = rng.choice((AgentState.ONLINE,) * 4 + (AgentState.SUSPECT,))
                if rng.random() < 0.1:
                    view.health.overloaded()
                    view.health.overloaded()
            if rng.random() < 0.3:
                view.outstanding = 0  # a step ended
            exclude = frozenset(v.agent_id for v in views if rng.random() < 0.1)
            try:
                want = explained.decide(
                    RouteRequest(capability=CAP, explain=True), "ns", "r", exclude=exclude
                )
            except NoMatchError:
                with pytest.raises(NoMatchError):
                    engine.decide(RouteRequest(capability=CAP), "ns", "r", exclude=exclude)
                continue
            got = engine.decide(RouteRequest(capability=CAP), "ns", "r", exclude=exclude)
            assert got.view is want.view
            assert got.decision is None and want.decision is not None
            assert want.decision.chosen == got.view.agent_id
            got.view.outstanding += 1  # counted at once, as a step's
