"""One registered agent as a hub sees it (:class:`AgentView`): its record, its load as its
heartbeats and this hub's own deliveries tell it, its breaker and health. Made and graded by
:class:`~reach_mesh.hub.registry.Registry`; read on every route."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from reach_mesh.hub.breaker import BreakerState, CircuitBreaker, HealthScore
from reach_mesh.models import AgentInfo, AgentRecord, AgentState, Heartbeat

__all__ = ["ATTENTION", "AgentView", "StateListener"]

#: Why an agent needs an operator's look (``AgentView.concerns``), in the order they are
#: listed: its heartbeats are late (``suspect``); its breaker is open or lets one probe through
#: (its ``breaker_reason`` says why); its health score is under the threshold; it reports
#: capabilities it cannot serve now; every one of its slots is busy (``saturated``: more work
#: waits); a task found nobody on its subject since it last spoke (``unreached``).
ATTENTION: Final = (
    "suspect",
    "breaker_open",
    "breaker_half_open",
    "unhealthy",
    "unavailable",
    "saturated",
    "unreached",
)

_RECENT_TAU: Final = 1.0


@dataclass(slots=True, eq=False)
class AgentView:
    """One registered agent as this hub sees it. Mutated only on the event loop."""

    #: ``record.card.agent_id``, which never changes for a view (read on every route).
    agent_id: str
    record: AgentRecord
    revision: int
    #: This hub's monotonic time of the last heartbeat (or registration) it observed.
    last_seen: float
    state: AgentState = AgentState.ONLINE
    #: Its lease lapsed when last graded (``Liveness._grade``): SUSPECT, or CORDONED or
    #: DRAINING — states an operator or the agent chose, which the lapse does not show.
    late: bool = False
    inflight: int = 0
    queue_depth: int = 0
    pressure: float = 0.0
    unavailable: frozenset[str] = frozenset()
    draining: bool = False
    #: This hub's monotonic time of the last heartbeat or registration of the agent's own that
    #: it applied: unlike ``last_seen``, not moved by a record another hub rewrote (a cordon).
    #: The agent spoke then (``StatusTracker`` tells a deaf agent by it). For one read from
    #: KV, when the server stored it (``Registry._stored_at``), not when it arrived: a beat
    #: delivered late is not the agent heard since. -inf: not yet.
    spoke_at: float = -math.inf
    #: This hub's monotonic time when a task it sent found nobody subscribed to the agent's
    #: subject. Later than ``spoke_at``: not heard from since, maybe gone or reconnecting, so
    #: routed to only when nobody else can take the task (the router's last tier).
    unreached_at: float = -math.inf
    #: KV revision of the newest heartbeat applied (this hub's own writes are not re-applied
    #: when its watch delivers them back).
    hb_revision: int = 0
    #: KV revision of the newest heartbeat this hub wrote for the view: its watch delivering
    #: it back is known for one at once, without reading it.
    hb_own_revision: int = 0
    #: When this hub last wrote the agent's heartbeat to KV, and the state it wrote
    #: (draining, unavailable, pressure): beats in between that say nothing new are not
    #: written; a change that came too soon is written once the gap has passed.
    hb_written_at: float = -math.inf
    hb_written_state: tuple[bool, frozenset[str], float] | None = None
    #: The newest beat not written (and whether a write of it is scheduled).
    hb_unwritten: Heartbeat | None = None
    hb_trailing: bool = False
    #: Tasks this hub has delivered to the agent and not yet seen finish.
    outstanding: int = 0
    #: Decaying count of this hub's recent assignments (time constant ``_RECENT_TAU``) so a
    #: burst between heartbeats spreads out instead of piling on one "idle" agent.
    recent: float = 0.0
    recent_at: float = 0.0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    health: HealthScore = field(default_factory=HealthScore)
    #: The breaker's openings already counted as quarantines: the agent's state leaves
    #: QUARANTINED and comes back within one opening (a late heartbeat makes it SUSPECT a
    #: while, a cordon outranks it), which is still one quarantine.
    quarantines: int = 0
    #: Dropped from the registry without being lost: it said goodbye, or another hub deleted
    #: its record while this hub could not have seen its beats (blind). Listeners are told
    #: ``LOST`` (it is gone) and read this to not call it a loss.
    left: bool = False

    @property
    def beat_state(self) -> tuple[bool, frozenset[str], float]:
        """What the agent's heartbeats say that changes routing: draining, unavailable
        capabilities, pressure (a beat changing it is written to KV at once)."""
        return (self.draining, self.unavailable, self.pressure)

    @property
    def busy(self) -> int:
        """In-flight tasks known for sure: the agent's report or this hub's own deliveries."""
        return max(self.inflight, self.outstanding)

    def assigned(self, now: float) -> None:
        """Count one assignment by this hub (for load estimates between heartbeats)."""
        self.recent = self.recent * math.exp((self.recent_at - now) / _RECENT_TAU) + 1.0
        self.recent_at = now

    def estimated_inflight(self, now: float) -> float:
        """Best estimate of in-flight work: known work plus recent direct-mode assignments."""
        recent = self.recent * math.exp((self.recent_at - now) / _RECENT_TAU)
        return max(self.inflight + recent, float(self.outstanding))

    @property
    def load(self) -> float:
        return self.busy / self.record.card.max_concurrency

    def lease_left(self, now: float) -> float:
        return self.last_seen + self.record.lease_timeout - now

    def concerns(self) -> list[str]:
        """Why this agent needs an operator's look (:data:`ATTENTION`'s codes, in that order);
        empty when nothing does. A state an operator chose (draining, cordoned) is none, but
        its lapsed lease is (``suspect``: a cordoned agent that stopped beating, say). Read
        for every agent of every fleet listing and scrape: the common answer (none) is decided
        by one expression."""
        breaker = self.breaker.state
        full = max(self.inflight, self.outstanding) >= self.record.card.max_concurrency
        if (
            breaker is BreakerState.CLOSED
            and not self.late
            and not (self.unavailable or self.queue_depth or full)
            and self.unreached_at <= self.spoke_at
            and self.health.healthy
        ):
            return []
        out: list[str] = []
        if self.late:
            out.append("suspect")
        if breaker is BreakerState.OPEN:
            out.append("breaker_open")
        elif breaker is BreakerState.HALF_OPEN:
            out.append("breaker_half_open")
        if not self.health.healthy:
            out.append("unhealthy")
        if self.unavailable:
            out.append("unavailable")
        if full or self.queue_depth:
            out.append("saturated")
        if self.unreached_at > self.spoke_at:
            out.append("unreached")
        return out

    def info(self, now: float) -> AgentInfo:
        card = self.record.card
        return AgentInfo(
            agent_id=card.agent_id,
            state=self.state,
            capabilities=card.capabilities,
            labels=card.all_labels(),
            inflight=self.busy,
            max_concurrency=card.max_concurrency,
            load=round(self.load, 4),
            lease_left=round(self.lease_left(now), 3),
            last_heartbeat_age=round(now - self.last_seen, 3),
            health=self.health.value,
            breaker=self.breaker.state.value,
            breaker_reason=self.breaker.reason,
            session=self.record.session,
            unavailable=sorted(self.unavailable),
            tools=card.tools,
            region=card.region,
            zone=card.zone,
            weight=card.weight,
            metadata=card.metadata,
            durable_work=card.durable_work,
            attention=self.concerns(),
        )


StateListener = Callable[[AgentView, AgentState, AgentState], None]
