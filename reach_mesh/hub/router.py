"""Pick a live agent for one request and say why.

Stages (each recorded in the :class:`RouteDecision` when ``explain`` is asked for):
candidates (by id, or capability/selector through the inverted index) → filters (state, lease,
breaker, capability health, capacity, health score, tried already) → region/zone preference →
sticky session → strategy.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final

from reach_mesh.config import MeshSettings
from reach_mesh.errors import NoMatchError
from reach_mesh.hub.breaker import BreakerState
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.strategies import (
    Candidate,
    LoadWeights,
    Strategy,
    get_strategy,
    prefer_region,
)
from reach_mesh.models import AgentState, FilteredAgent, RouteDecision, RouteRequest
from reach_mesh.selector import Selector

__all__ = ["Choice", "Router"]

_HEALTH_MIN: Final = 60.0
_SELECTOR_CACHE: Final = 1024


@dataclass(slots=True)
class Choice:
    """The router's answer: the agent (or None), the capability to call, and the decision."""

    view: AgentView | None
    capability: str | None
    decision: RouteDecision
    filtered: list[FilteredAgent] = field(default_factory=list)


class Router:
    def __init__(
        self,
        registry: Registry,
        settings: MeshSettings,
        hub_id: str,
        *,
        weights: LoadWeights | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._registry = registry
        self._settings = settings
        self._hub_id = hub_id
        self._weights = weights or LoadWeights(
            inflight=settings.load_weight_inflight,
            queue=settings.load_weight_queue,
            pressure=settings.load_weight_pressure,
            saturation=settings.load_saturation,
        )
        self._rng = rng or random.Random()
        self._selectors: OrderedDict[str, Selector] = OrderedDict()
        # One instance per name: round_robin keeps its position across requests.
        self._strategies: dict[str, Strategy] = {}

    def parse_selector(self, text: str) -> Selector:
        """Parse with a small LRU cache: callers repeat the same few selectors."""
        sel = self._selectors.get(text)
        if sel is None:
            sel = Selector.parse(text)
            self._selectors[text] = sel
            if len(self._selectors) > _SELECTOR_CACHE:
                self._selectors.popitem(last=False)
        else:
            self._selectors.move_to_end(text)
        return sel

    def decide(
        self,
        req: RouteRequest,
        namespace: str,
        request_id: str,
        *,
        exclude: frozenset[str] = frozenset(),
        sticky_agent: str | None = None,
    ) -> Choice:
        """Choose an agent for ``req`` or raise ``NoMatchError`` carrying the decision."""
        t0 = time.perf_counter()
        reg = self._registry
        selector: Selector | None = None
        capability = req.capability
        forced = req.agent_id is not None
        if req.agent_id is not None:
            target = f"agent_id={req.agent_id}"
            ids: set[str] | frozenset[str] = {req.agent_id} if req.agent_id in reg.agents else set()
        elif req.capability is not None:
            target = f"cap={req.capability}"
            ids = reg.index.by_capability(req.capability)
        else:
            assert req.selector is not None
            selector = self.parse_selector(req.selector)
            target = str(selector)
            ids = reg.index.candidates(selector)
            caps = selector.capabilities
            capability = caps[0] if caps else None
        strategy_name = req.strategy or self._settings.default_strategy
        strategy = self._strategies.get(strategy_name)
        if strategy is None:
            strategy = self._strategies[strategy_name] = get_strategy(strategy_name)
        decision = RouteDecision(
            request_id=request_id, hub_id=self._hub_id, target=target, strategy=strategy_name
        )
        explain = req.explain or req.dry_run
        if explain:
            decision.candidates = sorted(ids)

        live: list[AgentView] = []
        suspects: list[AgentView] = []
        filtered: list[FilteredAgent] = []
        for agent_id in ids:
            view = reg.agents.get(agent_id)
            if view is None:
                continue
            reason = self._filter(view, namespace, capability, forced, exclude)
            if reason is None:
                live.append(view)
            elif reason == "suspect":
                suspects.append(view)
                filtered.append(FilteredAgent(agent_id=agent_id, reason="SUSPECT (lease lapsed)"))
            else:
                filtered.append(FilteredAgent(agent_id=agent_id, reason=reason))
        if not live and suspects:
            # Avoided, but better than nothing: used only when no ONLINE agent matches.
            live = suspects
            decision.fallback = "suspect"
        if explain:
            decision.filtered = filtered

        if not live:
            decision.elapsed_us = (time.perf_counter() - t0) * 1e6
            raise self._no_match(req, namespace, decision, filtered, selector)

        chosen: AgentView | None = None
        if sticky_agent is not None:
            chosen = next((v for v in live if v.agent_id == sticky_agent), None)
            decision.sticky = "hit" if chosen is not None else "miss"
        if chosen is None:
            now = reg.now
            cands = [self._candidate(v, now) for v in live]
            if req.region or req.zone:
                cands = list(prefer_region(cands, req.region, req.zone))
            pick, scores = strategy.choose(
                cands, req.hash_key or req.session_id, self._weights, self._rng
            )
            chosen = reg.agents[pick.agent_id]
            if explain:
                decision.scores = {k: round(v, 4) for k, v in scores.items()}
        if chosen.breaker.state is BreakerState.HALF_OPEN:
            chosen.breaker.allow()  # hand out the single probe
        decision.chosen = chosen.agent_id
        decision.elapsed_us = (time.perf_counter() - t0) * 1e6
        return Choice(view=chosen, capability=capability, decision=decision, filtered=filtered)

    def _filter(
        self,
        view: AgentView,
        namespace: str,
        capability: str | None,
        forced: bool,
        exclude: frozenset[str],
    ) -> str | None:
        """Why ``view`` cannot take this request, or None. ``"suspect"`` = fallback only."""
        if view.agent_id in exclude:
            return "already tried for this request"
        if view.record.card.namespace != namespace:
            return f"namespace {view.record.card.namespace} != {namespace}"
        state = view.state
        if state is AgentState.SUSPECT:
            return "suspect"
        if state is not AgentState.ONLINE:
            return f"state {state.value}"
        if view.breaker.state is BreakerState.HALF_OPEN and not view.breaker.probe_available:
            return "breaker half-open, probe in flight"
        if capability is not None and capability in view.unavailable:
            return f"reports {capability} unavailable"
        if forced:
            return None  # the caller chose this agent: capacity and health are its call
        card = view.record.card
        if view.busy >= card.max_concurrency:
            return f"at capacity ({view.busy}/{card.max_concurrency})"
        if view.health.value < _HEALTH_MIN:
            return f"health {view.health.value:g} < {_HEALTH_MIN:g}"
        return None

    @staticmethod
    def _candidate(view: AgentView, now: float) -> Candidate:
        card = view.record.card
        return Candidate(
            agent_id=view.agent_id,
            inflight=round(view.estimated_inflight(now)),
            max_concurrency=card.max_concurrency,
            queue_depth=view.queue_depth,
            pressure=view.pressure,
            weight=card.weight,
            region=card.region,
            zone=card.zone,
        )

    def _no_match(
        self,
        req: RouteRequest,
        namespace: str,
        decision: RouteDecision,
        filtered: list[FilteredAgent],
        selector: Selector | None,
    ) -> NoMatchError:
        reg = self._registry
        nearest: dict[str, object] = {}
        if selector is None and req.capability is not None:
            selector = Selector.parse(f"cap={req.capability}")
        if selector is not None:
            near = reg.index.nearest(selector)
            nearest = {
                "partial": [{"agent_id": a, "failed": t} for a, t in near.partial],
                "similar_capabilities": near.similar_capabilities,
                "similar_values": near.similar_values,
            }
        decision.filtered = filtered
        decision.nearest = nearest or None
        if req.agent_id is not None and not filtered:
            msg = f"agent {req.agent_id!r} is not registered"
        elif filtered:
            msg = f"no routable agent for {decision.target}: " + "; ".join(
                f"{f.agent_id}: {f.reason}" for f in filtered[:5]
            )
        else:
            msg = f"no agent in namespace {namespace!r} matches {decision.target}"
        return NoMatchError(msg, decision=decision.model_dump(exclude_none=True), **nearest)
