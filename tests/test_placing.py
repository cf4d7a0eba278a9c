"""Choosing the agents of a fanout's first attempts (``StepPlacing._first_choices``): the steps
of one route chosen in one router call (``Router.decide_many``) choose what one
``StepPlacing._choose`` per step chose, each step's load counted before the next."""

from __future__ import annotations

import asyncio
import random

from reach_mesh import MeshSettings
from reach_mesh.hub._placing import StepPlacing
from reach_mesh.hub._step_state import Unroutable, Workflow, step_route
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.router import SAMPLE_SIZE, Router
from reach_mesh.models import AgentState, RouteRequest
from reach_mesh.workflow import StepSpec, WorkflowSpec
from tests.helpers import fed_agent

CAP = "work:echo:v1"
OTHER = "work:other:v1"


class Placing(StepPlacing):
    """The placing half of the engine over a registry fed in memory."""

    def __init__(self, registry: Registry, router: Router) -> None:
        self._registry = registry
        self._router = router
        self._no_work = set()

    async def one_by_one(self, wf: Workflow) -> list[tuple[AgentView, str | None] | None]:
        """The choices as ``_first_choices`` made them before ``decide_many``: one
        ``_choose`` per step, in order."""
        first: list[tuple[AgentView, str | None] | None] = []
        for step in wf.spec.steps:
            if step.task_id is not None:
                first.append(None)
                continue
            try:
                view, capability = await self._choose(step_route(step), wf.ns, set())
            except Unroutable:
                view = None
            first.append(None if view is None else (view, capability))
        return first


class CountingRouter(Router):
    """A router that counts the ``decide_many`` calls (``asked``) and those that chose
    agents (``batched``)."""

    asked = 0
    batched = 0

    def decide_many(
        self,
        req: RouteRequest,
        namespace: str,
        count: int,
        *,
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[list[AgentView], str | None]:
        self.asked += 1
        chosen = super().decide_many(req, namespace, count, exclude=exclude)
        self.batched += bool(chosen[0])
        return chosen


def fleet(seed: int) -> tuple[Registry, CountingRouter]:
    """A random fleet (the same one for the same seed): agents of ``CAP`` (some of ``OTHER``
    too) with random load, capacity, state, health, breakers and work consumers."""
    rng = random.Random(seed)
    settings = MeshSettings(namespace="ns")
    now = 100.0  # the clock stands still: both fleets' loads decay alike
    registry = Registry(None, None, settings, clock=lambda: now)  # type: ignore[arg-type]
    for i in range(rng.choice((1, 2, 3, 3, 5, 8, SAMPLE_SIZE + 6))):
        agent_id = f"ns.w.a{i:03d}"
        fed_agent(
            registry,
            agent_id,
            [CAP, OTHER] if rng.random() < 0.3 else [CAP],
            max_concurrency=rng.choice((1, 2, 3, 16)),
            durable_work=rng.random() > 0.05,
        )
        view = registry.agents[agent_id]
        view.inflight = rng.randrange(4)
        view.outstanding = rng.choice((0, 0, 1, 2))
        view.queue_depth = rng.choice((0, 0, 1, 3))
        view.pressure = rng.choice((0.0, 0.0, 0.3, 1.5))
        view.recent, view.recent_at = rng.choice(((0.0, 0.0), (1.2, now - 0.4)))
        if rng.random() < 0.1:
            view.state = AgentState.SUSPECT
        if rng.random() < 0.1:
            view.health.overloaded()
            view.health.overloaded()
        if rng.random() < 0.1:
            view.breaker.trip()
            view.breaker._opened_at -= view.breaker.open_timeout  # half-open: one probe
            registry.regrade(view)
    return registry, CountingRouter(registry, settings, "hub-test", rng=random.Random(seed))


def steps(rng: random.Random) -> list[StepSpec]:
    """A fanout's steps: runs of one route, other routes, and caller-chosen task ids."""
    routes = [
        {"capability": CAP},
        {"capability": CAP},
        {"capability": OTHER},
        {"selector": f"cap={CAP}"},
        {"capability": "work:nobody:v1"},
    ]
    out = []
    for i in range(rng.choice((1, 2, 3, 3, 4, 6, 12))):
        route = rng.choice(routes)
        task_id = f"t{i}" if rng.random() < 0.1 else None
        out.append(StepSpec(payload={"i": i}, task_id=task_id, **route))
    return out


def test_first_choices_are_one_choose_per_step_over_randomized_fleets() -> None:
    """Twin fleets (the same seed): ``_first_choices`` (a route's steps in one
    ``decide_many``) and one ``_choose`` per step choose the same agents with the same
    capability, in the same order, and leave the same load counts, breaker probes and
    agents known to take no work — over random fleets and fanouts, saturation, SUSPECT and
    unhealthy agents, half-open breakers, agents without a work consumer, and fleets past
    the router's sample size (where the steps are chosen one by one)."""
    batched_calls = 0
    for seed in range(300):
        rng = random.Random(seed)
        spec = WorkflowSpec(
            workflow_id=f"wf{seed}", kind="fanout", steps=steps(rng), namespace="ns"
        )
        got_reg, got_router = fleet(seed)
        want_reg, want_router = fleet(seed)
        got, want = Placing(got_reg, got_router), Placing(want_reg, want_router)
        wf = Workflow(spec, len(spec.steps), 0.0, 0.0, {}, None, "digest")
        asyncio.run(got._first_choices(wf))
        expected = asyncio.run(want.one_by_one(wf))
        assert [None if c is None else (c[0].agent_id, c[1]) for c in wf.first] == [
            None if c is None else (c[0].agent_id, c[1]) for c in expected
        ], seed
        for agent_id, view in got_reg.agents.items():
            other = want_reg.agents[agent_id]
            assert view.outstanding == other.outstanding, (seed, agent_id)
            assert view.breaker.probe_available == other.breaker.probe_available, seed
        assert got._no_work == want._no_work, seed
        batched_calls += got_router.batched
    assert batched_calls > 40  # the one-call path ran, not only the fallback


def test_decide_many_leaves_a_route_it_does_not_serve_to_decide() -> None:
    """Routes ``decide_many`` does not choose for (another strategy, an explanation, an agent
    named, a bad selector) return no agents and count no load."""
    registry, router = fleet(3)
    before = {a: v.outstanding for a, v in registry.agents.items()}
    for req in (
        RouteRequest(capability=CAP, strategy="round_robin"),
        RouteRequest(capability=CAP, explain=True),
        RouteRequest(agent_id="ns.w.a000"),
        RouteRequest(selector="cap="),
    ):
        assert router.decide_many(req, "ns", 3) == ([], None)
    assert {a: v.outstanding for a, v in registry.agents.items()} == before


def test_a_run_of_steps_is_offered_to_decide_many_once() -> None:
    """The router is asked once per run of steps of one route, however many of them it chose
    ahead: the rest of the run is chosen one by one (a fanout of 256 steps whose route
    ``decide_many`` does not serve asked it once per step, each over the steps left)."""
    for strategy, max_concurrency, batched in (
        ("round_robin", 16, 0),  # not served: every step one by one
        ("least_loaded", 1, 1),  # three idle agents of one slot each, then the saturated tier
        ("least_loaded", 256, 1),  # all 60 in one call
    ):
        registry = Registry(None, None, MeshSettings(namespace="ns"))  # type: ignore[arg-type]
        for i in range(3):
            fed_agent(registry, f"ns.w.a{i}", [CAP], max_concurrency=max_concurrency)
        router = CountingRouter(registry, MeshSettings(namespace="ns"), "hub-test")
        steps = [StepSpec(capability=CAP, strategy=strategy) for _ in range(60)]
        spec = WorkflowSpec(workflow_id="wf", kind="fanout", steps=steps, namespace="ns")
        wf = Workflow(spec, len(steps), 0.0, 0.0, {}, None, "digest")
        asyncio.run(Placing(registry, router)._first_choices(wf))
        assert all(c is not None for c in wf.first)
        assert sum(v.outstanding for v in registry.agents.values()) == 60  # each counted once
        assert router.asked == 1, strategy
        assert router.batched == batched
