"""How a hub's registry follows the KV buckets: :class:`RegistryWatch`, the base of
:class:`~reach_mesh.hub.registry.Registry` (which sets every attribute below).

The watches of the agents' records and of their heartbeats, started again when they end, and
each entry they deliver applied to the hub's :class:`AgentView` map and its index: a record
installed (or replaced) and graded, a beat renewing its agent's lease, a delete dropping the
agent (LOST, or gone with a goodbye). Applying is idempotent and guarded by KV revisions, so a
watch's replay, or this hub's own write coming back, changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from pydantic import ValidationError

from reach_mesh import protocol
from reach_mesh._retry import describe
from reach_mesh.hub._agent_view import AgentView
from reach_mesh.hub._liveness import Liveness, not_deaf
from reach_mesh.hub._server_clock import ServerClock
from reach_mesh.hub.breaker import BreakerState, CircuitBreaker, HealthScore
from reach_mesh.hub.index import AgentIndex
from reach_mesh.models import AgentRecord, AgentState, Heartbeat, HeartbeatRecord

__all__ = ["RegistryWatch"]

log = logging.getLogger("reach_mesh.hub.registry")

#: Heartbeats of agents not known yet that are remembered (``Registry._early_beats``).
_EARLY_BEATS_MAX: Final = 16_384
#: Dropped agents whose breaker and health are remembered (``Registry._kept``), at most.
_KEPT_MAX: Final = 10_000
_NONE: Final[frozenset[str]] = frozenset()


class RegistryWatch(Liveness):
    """The registry's watches and the entries they apply (the base of ``Registry``)."""

    #: The NATS server's wall clock: what the stored entries' timestamps are read against.
    server_clock: ServerClock
    #: Agents per namespace: which namespaces exist (metrics and audit are kept for those).
    _namespaces: dict[str, int]
    #: (session, revision) of the heartbeat the watch delivered before the agent's record of
    #: that session, by agent id.
    _early_beats: dict[str, tuple[str, int]]
    index: AgentIndex
    #: What this hub learned of dropped agents' behaviour (breaker, health, quarantines
    #: counted) and its session, by id (``apply_record``).
    _kept: OrderedDict[str, tuple[CircuitBreaker, HealthScore, int, str]]
    #: Agents that said goodbye (or whose record another hub deleted as not overdue), by id:
    #: when (wall clock), the newest ``_KEPT_MAX``.
    _left: OrderedDict[str, float]

    def _breaker(self) -> CircuitBreaker:
        s = self._settings
        return CircuitBreaker(
            window=s.breaker_window,
            failure_ratio=s.breaker_failure_ratio,
            min_requests=s.breaker_min_requests,
            open_timeout=s.breaker_open_timeout,
            report_budget=s.breaker_report_budget,
            clock=self._clock,
        )

    # ------------------------------------------------------------------ watchers

    async def _watch_agents(self, loaded: asyncio.Event, cordons_loaded: asyncio.Event) -> None:
        assert self._agents_kv is not None
        await cordons_loaded.wait()  # an agent is graded knowing whether it is cordoned
        await self._watch(protocol.KV_AGENTS, self._agents_kv, self._apply_agent, loaded)

    async def _watch_heartbeats(self, loaded: asyncio.Event, agents_loaded: asyncio.Event) -> None:
        assert self._hb_kv is not None
        await agents_loaded.wait()  # a heartbeat is only applied to a known agent
        await self._watch(protocol.KV_HEARTBEATS, self._hb_kv, self._apply_heartbeat, loaded)

    async def _watch(
        self,
        name: str,
        kv: KeyValue,
        apply: Callable[..., None],
        loaded: asyncio.Event,
    ) -> None:
        """Apply every change of ``kv`` for as long as the hub runs.

        ``loaded`` is set once the initial values have been applied. If the watch ends or
        fails (e.g. its consumer was lost while the server restarted) it is started again:
        the initial values are replayed, which is harmless because applying is idempotent and
        guarded by KV revisions.
        """
        delay = 0.1
        failures = 0
        while True:
            try:
                watcher = await kv.watchall()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self._went_blind(f"cannot watch {name}: {describe(err)}", err)
                failures += 1
                if failures % 12 == 1:  # first failure, then about once a minute
                    log.warning("%s; retrying", self._blind_why)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.1
            failures = 0
            replaying = True
            try:
                async for entry in watcher:
                    if entry is None:
                        replaying = False
                        loaded.set()
                        continue
                    try:
                        apply(entry, initial=replaying and not loaded.is_set())
                    except Exception:  # a bad record must never stop the watcher
                        log.exception("cannot apply %s entry %s", name, entry.key)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self._went_blind(f"the watch of {name} failed: {describe(err)}", err)
                log.warning("%s; restarting it", self._blind_why)
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay)

    def _seen_at(self, entry: KeyValue.Entry, initial: bool) -> float:
        """When ``entry`` counts as seen for the agent's lease (``last_seen``): on arrival,
        the hub's clock (docs/architecture.md, "Leases on the hub's clock"); an entry loaded at
        start-up is aged by the server's timestamp (:meth:`_stored_at`)."""
        return self._stored_at(entry) if initial else self._clock()

    def _stored_at(self, entry: KeyValue.Entry) -> float:
        """When the server stored ``entry``, on this hub's clock: now less its age by the
        server's clock (``server_clock``); now for an entry without a timestamp. When the
        agent spoke (``spoke_at``, the deaf rule): a beat stored before its agent was cut off
        and delivered late — a watch catching up once the stream has a leader again, a read
        from the leader of one the watch missed — is not the agent heard after its ctl subject
        had nobody (chaos secure seed 198, ``partition``)."""
        created: Any = entry.created
        return self._server_time_here(None if created is None else float(created.timestamp()))

    def _server_time_here(self, stored: float | None) -> float:
        """``stored`` (the server's wall clock, epoch seconds) on this hub's clock: now less
        its age by the server's clock (``server_clock``); now when None."""
        now = self._clock()
        if stored is None:
            return now
        return now - max(0.0, self.server_clock.now() - stored)

    def _apply_agent(self, entry: KeyValue.Entry, *, initial: bool) -> None:
        agent_id = entry.key
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            self._lost_views.pop(agent_id, None)  # nothing left to read back
            view = self.agents.get(agent_id)
            # Deleted by another hub that declared it LOST (an agent that says goodbye is not
            # overdue): listed as recently LOST here too, as on that hub.
            lost = view is not None and self._overdue(view)
            self._drop(agent_id, lost=lost)
            if view is not None and lost:
                self._remember_lost(view)
            return
        try:
            record = AgentRecord.model_validate_json(entry.value)
        except ValidationError:
            log.warning("ignoring malformed agent record %s", agent_id)
            return
        revision = entry.revision or 0
        if self._judged_lost(agent_id, record, revision):
            return  # (a watch restarted: its replay delivers the record again)
        self.apply_record(
            record,
            revision,
            seen_at=self._seen_at(entry, initial),
            heard_at=self._stored_at(entry),
        )

    def _judged_lost(self, agent_id: str, record: AgentRecord, revision: int) -> bool:
        """Whether ``record`` is the registration this hub declared LOST (its revision, or an
        older one: a replica behind), undeleted, with no beat of the agent's stored since the
        verdict: installed again it would be heard "now" — ONLINE, routable — while the agent
        may be cut off or dead. KV revisions only (the server's order), no clock. A dict
        lookup unless the agent was declared LOST lately."""
        if agent_id in self.agents:
            return False
        gone = self._lost_views.get(agent_id)
        if gone is None or revision > gone.revision:
            return False
        early = self._early_beats.get(agent_id)
        return early is None or early[0] != record.session or early[1] <= gone.hb_revision

    def apply_record(
        self,
        record: AgentRecord,
        revision: int,
        *,
        seen_at: float,
        heard_at: float | None = None,
    ) -> AgentView:
        """Install (or replace) an agent record in memory and in the index. ``seen_at``
        renews the lease; ``heard_at`` (default ``seen_at``) is when the agent spoke, for a
        new registration (``spoke_at``: a record read from KV, when it was stored)."""
        agent_id = record.card.agent_id
        view = view_was = self.agents.get(agent_id)
        if view is not None and view.revision >= revision:
            # An older write arriving late (we applied a newer one locally), or this one again
            # (our own registration's echo from the watch, a watch's replay): nothing new, and
            # no sign of the agent — it must not renew a lease that lapsed since.
            return view
        if view is None or view.record.session != record.session:
            # A new registration of the id: what this hub learned of its behaviour stays (an
            # agent does not clear its breaker, its health or an operator's quarantine by
            # registering again, under a new session or after an unregister).
            kept = (
                (view.breaker, view.health, view.quarantines, view.record.session)
                if view is not None
                else self._kept.pop(agent_id, None)
            )
            breaker, health, quarantines, was = kept or (self._breaker(), HealthScore(), 0, "")
            if was and was != record.session:
                # Except a verdict on a process: "deaf" (nobody on its ctl subject) was said
                # of the one registered under ``was`` (a registration under any other session
                # clears it, so a trip is always of the last session). A new session is a new
                # process, which subscribed to its ctl subject before it registered
                # (``Agent.start``): it listens, and is routable at once, not after its
                # breaker's open timeout. An operator's quarantine, a failure rate: kept.
                not_deaf(breaker, agent_id, "registered under a new session")
            view = AgentView(
                agent_id=agent_id,
                record=record,
                revision=revision,
                last_seen=seen_at,
                spoke_at=seen_at if heard_at is None else min(seen_at, heard_at),
                breaker=breaker,
                health=health,
                quarantines=quarantines,
            )
            early = self._early_beats.pop(agent_id, None)
            if early is not None and early[0] == record.session:
                view.hb_revision = early[1]
            gone = self._lost_views.pop(agent_id, None) if view_was is None else None
            if gone is not None and gone.record.session == record.session:
                # The registration this hub declared LOST, back (a beat since, or its record
                # written again): the beats it had applied are not new ones (the leader read
                # before LOST would take its last beat for a fresh one).
                view.hb_revision = max(view.hb_revision, gone.hb_revision)
                view.hb_own_revision = gone.hb_own_revision
            old_state = AgentState.LOST
            if agent_id not in self.agents:
                ns = record.card.namespace
                self._namespaces[ns] = self._namespaces.get(ns, 0) + 1
            self.agents[agent_id] = view
        else:
            old_state = view.state
            view.record = record
            view.revision = revision
            view.last_seen = max(view.last_seen, seen_at)
        # Replace the index entry wholesale: no ghost capabilities from an earlier card.
        self.index.upsert(agent_id, record.card.capabilities, record.card.all_labels())
        self._grade(view, self._clock())
        if view.state != old_state:
            self._notify(view, old_state)
        self._track(view)
        return view

    def _apply_heartbeat(
        self, entry: KeyValue.Entry, *, initial: bool, read_back: bool = False
    ) -> None:
        if not initial and not read_back:  # live: stored a moment ago, by the server's clock
            self.server_clock.sample(entry.created)
        view = self.agents.get(entry.key)
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            self._early_beats.pop(entry.key, None)
            return
        revision = entry.revision or 0
        if view is not None and revision == view.hb_own_revision:
            return  # this hub's own write of the view's beat, coming back: applied already
        try:
            hb = HeartbeatRecord.model_validate_json(entry.value)
        except ValidationError:
            return
        if view is None or hb.session != view.record.session:
            # Before its record — a new agent's, or a restarted one's new session (the
            # registration writes its heartbeat first, and the two buckets are watched
            # apart) — or an older incarnation's. Remembered, so that read back by
            # ``_confirm_overdue`` it is not taken for a beat after the registration: it would
            # renew the lease of an agent that died before its first beat (ONLINE again while
            # dead, LOST a whole lease later).
            if len(self._early_beats) >= _EARLY_BEATS_MAX:
                self._early_beats.clear()
            self._early_beats[entry.key] = (hb.session, revision)
            gone = self._lost_views.get(entry.key) if view is None else None
            if (
                gone is not None
                and gone.record.session == hb.session
                and revision > gone.hb_revision
            ):
                # A beat stored after this hub declared the agent LOST (another hub's write:
                # through this one, a beat of an agent not registered is refused, and the
                # agent registers again), its record undeleted: it is back.
                back = self.apply_record(gone.record, gone.revision, seen_at=self._clock())
                self.apply_heartbeat(
                    back, hb, seen_at=self._seen_at(entry, initial), heard_at=self._stored_at(entry)
                )
            return
        if revision <= view.hb_revision:
            return  # our own write coming back (already applied), or an older one
        view.hb_revision = revision
        self.apply_heartbeat(
            view, hb, seen_at=self._seen_at(entry, initial), heard_at=self._stored_at(entry)
        )

    def apply_heartbeat(
        self,
        view: AgentView,
        hb: HeartbeatRecord | Heartbeat,
        *,
        seen_at: float,
        heard_at: float | None = None,
    ) -> None:
        """Apply a beat of ``view``'s agent: ``seen_at`` renews its lease (this hub's clock,
        on arrival), ``heard_at`` (default ``seen_at``; never later) is when the agent spoke —
        for a beat read from KV, when the server stored it (:meth:`_stored_at`)."""
        view.last_seen = max(view.last_seen, seen_at)
        view.spoke_at = max(view.spoke_at, seen_at if heard_at is None else min(seen_at, heard_at))
        view.inflight = hb.inflight
        view.queue_depth = hb.queue_depth
        view.pressure = hb.pressure
        view.unavailable = frozenset(hb.unavailable) if hb.unavailable else _NONE
        view.draining = hb.draining
        # A live heartbeat slowly restores health (+1 per beat): an agent demoted by past
        # failures is not left in the fallback tier forever once it behaves.
        view.health.success()
        old = view.state
        self._grade(view, self._clock())
        if view.state != old:
            self._notify(view, old)

    def _drop(self, agent_id: str, *, lost: bool) -> None:
        """Remove the agent; its listeners are told it is LOST (gone), and ``lost=False``
        (a goodbye, a delete this hub cannot call a loss) marks it ``left``."""
        view = self.agents.pop(agent_id, None)
        self._unsteady.pop(agent_id, None)
        self.index.remove(agent_id)
        if view is not None:
            if view.breaker.state is not BreakerState.CLOSED or not view.health.healthy:
                self._kept[agent_id] = (
                    view.breaker,
                    view.health,
                    view.quarantines,
                    view.record.session,
                )
                self._kept.move_to_end(agent_id)
                if len(self._kept) > _KEPT_MAX:
                    self._kept.popitem(last=False)
            ns = view.record.card.namespace
            left = self._namespaces.get(ns, 1) - 1
            if left > 0:
                self._namespaces[ns] = left
            else:
                self._namespaces.pop(ns, None)
            old = view.state
            view.state = AgentState.LOST
            view.left = not lost
            if not lost:
                self._left[agent_id] = time.time()
                self._left.move_to_end(agent_id)
                if len(self._left) > _KEPT_MAX:
                    self._left.popitem(last=False)
            if old is not AgentState.LOST:  # (graded LOST already: its listeners were told)
                self._notify(view, old)
