"""How a hub grades its agents' leases: ONLINE, SUSPECT, LOST — and when it must not.

The base of :class:`~reach_mesh.hub.registry.Registry` (which sets every attribute below).
A hub that failed to read or write the registry lately, or was cut off from NATS, is *blind*
(``reach_registry_blind``): it cannot tell a dead agent from a heartbeat it could not see, so
it declares nobody LOST meanwhile; and before it declares an overdue agent LOST it reads that
agent's heartbeat from the stream's leader — once it knows that leader heard from a quorum
of its replicas since the agent's lease lapsed (it could store a beat meanwhile): a node cut
off from the others (a partition between NATS servers, which its clients do not notice) stays
the leader of the streams it led for seconds and answers reads from what it had, so a hub on
its side, hearing no beat of the agents on the other side (which could store none meanwhile),
took every one of them for LOST and gave their steps up. A stream found able again after a
look that found it unable keeps the hub blind a lease more (``_could_store``).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, cast

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KV_OP, KeyValue

from reach_mesh import protocol
from reach_mesh._retry import describe, no_message
from reach_mesh.config import MeshSettings
from reach_mesh.hub._agent_view import AgentView, StateListener
from reach_mesh.hub._resources import Resources
from reach_mesh.hub.breaker import DEAF, BreakerState, CircuitBreaker
from reach_mesh.logs import LEASE_EXPIRED, log_event
from reach_mesh.models import AgentRecord, AgentState

__all__ = ["Liveness", "LostEntry", "Undeleted", "heartbeat_entry", "not_deaf"]

log = logging.getLogger("reach_mesh.hub.registry")

#: An agent declared LOST lately: when (wall clock), its capabilities and its labels (with
#: ``region``/``zone``, as a selector sees them) when it was lost.
LostEntry = tuple[float, tuple[str, ...], dict[str, str]]
#: How long, and how many per namespace, agents declared LOST stay in ``recently_lost``.
LOST_KEPT_S: Final = 900.0
_LOST_KEPT_MAX: Final = 200
#: Views declared LOST kept until their record's delete is delivered (``_lost_views``).
_LOST_VIEWS_MAX: Final = 10_000
#: The heartbeat bucket's stream.
_HB_STREAM: Final = f"KV_{protocol.KV_HEARTBEATS}"
#: How long the leader read of an overdue agent's heartbeat may take: the grading loop waits
#: on it, and a stream without a leader (the case it guards against) does not answer at all.
_CONFIRM_TIMEOUT: Final = 2.0
#: Steps probing agents whose leases lapsed share one look at the heartbeat stream made
#: within this many seconds (``Liveness.lapse_seen``): one agent's death is many steps'.
_LOOK_SHARED: Final = 0.5
#: How long the delete of a LOST agent's record may take: the grading loop waits on the
#: verdict's, and a stream without a quorum does not answer (nats-py would wait 10 s).
_DELETE_TIMEOUT: Final = 2.0
#: Undeleted records retried in one pass, at most; the wait before the next pass after a
#: failed delete, doubled from the first to the last (s).
_RETRIES_PER_PASS: Final = 32
_RETRY_WAIT: Final = (0.5, 5.0)
#: JetStream's "wrong last sequence": the record was written (or deleted) since the verdict.
_WRONG_LAST_SEQUENCE: Final = 10071


@dataclass
class Undeleted:
    """The views this hub declared LOST whose record's delete did not land (no quorum, a
    timeout), by id, oldest first, the newest ``_LOST_VIEWS_MAX``: their delete is retried on
    the grading loop's passes until it lands, or is settled otherwise — the record written
    since (the CAS fails), its delete or a newer record delivered (out of ``_lost_views``),
    the agent registered again or back (in ``agents``)."""

    views: OrderedDict[str, AgentView] = field(default_factory=OrderedDict)
    #: When the next retry may be made (the hub's clock), and the wait after a failure.
    at: float = float("-inf")
    wait: float = _RETRY_WAIT[0]
    #: A pass's retries, while they run (the grading loop does not wait on them).
    task: asyncio.Task[None] | None = None


class Liveness:
    """Lease grading and blindness (the base of ``Registry``)."""

    _nc: NATS
    _js: JetStreamContext
    _settings: MeshSettings
    _clock: Callable[[], float]
    _resources: Resources | None
    _agents_kv: KeyValue | None
    _hb_kv: KeyValue | None
    agents: dict[str, AgentView]
    #: Set once the registry's first load from KV is done (agents, then their heartbeats).
    _ready: asyncio.Event
    #: When this hub was last blind (its clock), and why.
    _blind_at: float
    _blind_why: str
    #: When (this hub's clock) the last look at the heartbeat stream found it unable to store
    #: a beat (no answer, or a leader that did not hear from a quorum), -inf once a look
    #: found it able since: the first that does keeps this hub blind a lease longer, if the
    #: unable one was recent enough to have refused the agent's beats (``_could_store``).
    _hb_unable_at: float
    #: The last look at the heartbeat stream made for ``lapse_seen`` (when, its answer).
    _hb_look: tuple[float, asyncio.Future[float | None]] | None
    #: Agents declared LOST lately, per namespace: (when, capabilities, labels as the
    #: selector sees them) by id, oldest first.
    _lost: dict[str, OrderedDict[str, LostEntry]]
    #: The views this hub declared LOST, until their record's delete is delivered.
    _lost_views: OrderedDict[str, AgentView]
    #: Those whose record's delete failed: retried (``_retry_deletes``).
    _undeleted: Undeleted
    _listeners: list[StateListener]
    #: When each agent's lease runs out (``last_seen + lease_timeout``) if it beats no more,
    #: a heap of (deadline, tiebreak, view): the grading loop looks at an agent when its
    #: deadline has passed, not at the whole fleet every pass. An entry is not updated by a
    #: beat (the beat moves ``last_seen`` only): one whose view beat since is pushed again with
    #: its new deadline when it comes up; one of a view no longer registered is dropped then.
    _deadlines: list[tuple[float, int, AgentView]]
    _tiebreak: itertools.count[int]
    #: The agents the grading loop grades every pass, by id: overdue (their deadline passed),
    #: or in a state time can end (SUSPECT, QUARANTINED — its breaker half-opens —, DRAINING,
    #: CORDONED, LOST). An ONLINE agent within its lease is not: nothing but an event (a beat,
    #: a record, a cordon, a breaker's verdict: each grades it at once) changes its state
    #: before its deadline.
    _unsteady: dict[str, AgentView]

    def cordoned(self, agent_id: str, record: AgentRecord | None) -> bool:
        raise NotImplementedError

    def _apply_heartbeat(
        self, entry: KeyValue.Entry, *, initial: bool, read_back: bool = False
    ) -> None:
        raise NotImplementedError

    def _drop(self, agent_id: str, *, lost: bool) -> None:
        raise NotImplementedError

    def _grade(self, view: AgentView, now: float) -> None:
        """Derive the agent's state from its lease, flags and breaker."""
        age = now - view.last_seen
        rec = view.record
        view.late = age > rec.lease_timeout
        if age > rec.lease_timeout + self._settings.suspect_timeout and not self._blind(
            now, rec.lease_timeout
        ):
            view.state = AgentState.LOST
        elif self.cordoned(view.agent_id, rec):
            view.state = AgentState.CORDONED
        elif view.draining:
            view.state = AgentState.DRAINING
        elif age > rec.lease_timeout:
            view.state = AgentState.SUSPECT  # (also: overdue, but this hub was blind lately)
        elif view.breaker.state is BreakerState.OPEN:
            view.state = AgentState.QUARANTINED
        else:
            view.state = AgentState.ONLINE

    def blind(self) -> bool:
        """Whether this hub is blind now, for the default lease (``reach_registry_blind``):
        it failed to read or write the registry, or was cut off from NATS, that recently."""
        return self._blind(self._clock(), self._settings.lease_timeout)

    def blind_reason(self) -> str | None:
        """Why this hub is blind (its last such failure, e.g. ``JetStream storage is full:
        …``); None when it is not."""
        return self._blind_why if self.blind() else None

    def _went_blind(self, why: str, err: BaseException | None = None) -> None:
        self._blind_at = self._clock()
        self._blind_why = why
        if err is not None and self._resources is not None:
            self._resources.check_soon(err)  # a bucket may have been deleted

    def _blind(self, now: float, lease: float) -> bool:
        """True while this hub cannot trust that it saw every heartbeat of the last lease."""
        return now - self._blind_at < lease

    async def _confirm_overdue(self, view: AgentView) -> None:
        """Before an agent is declared LOST, read its heartbeat from the stream's leader: a
        beat this hub missed (a watch that lagged) renews the lease from now, as the watch
        would have (no wall clocks compared: at worst a dead agent's last beat, missed, keeps
        it one lease longer). Not a direct get, which any replica answers: one that is behind
        would miss the very beat this read looks for. Only "no message" means there is
        no beat; any other failure (no leader, the stream being recovered) makes the hub
        blind, and nobody is declared LOST on what it could not read."""
        try:
            async with asyncio.timeout(_CONFIRM_TIMEOUT):
                raw = await self._js.get_msg(
                    _HB_STREAM, subject=f"$KV.{protocol.KV_HEARTBEATS}.{view.agent_id}"
                )
        except NotFoundError as err:
            if no_message(err):
                return
            self._cannot_confirm(view, err)
            return
        except Exception as err:
            self._cannot_confirm(view, err)
            return
        with contextlib.suppress(Exception):
            self._apply_heartbeat(
                heartbeat_entry(view.agent_id, raw), initial=False, read_back=True
            )

    async def _quorum_heard(self) -> float | None:
        """How long ago (s) the heartbeat stream's leader, which answers ``_confirm_overdue``'s
        reads, last heard from a quorum of its replicas (``cluster.replicas[].active``: a
        follower answers every append — each beat is one — and nats-server's raft heartbeat,
        every second); 0 for a stream of one replica. None when it cannot be read: the hub is
        blind then."""
        try:
            async with asyncio.timeout(_CONFIRM_TIMEOUT):
                info = await self._js.stream_info(_HB_STREAM)
        except Exception as err:
            self._hb_unable_at = self._clock()
            self._went_blind(f"cannot read the heartbeat stream's state: {describe(err)}")
            log.info("%s: not declaring anyone LOST", self._blind_why)
            return None
        cluster = info.cluster
        peers = (cluster.replicas or []) if cluster is not None else []
        heard = sorted(
            p.active / 1e9 for p in peers if p.current and not p.offline and p.active is not None
        )
        need = (len(peers) + 1) // 2  # with the leader, a majority of the replicas
        if need == 0:
            return 0.0
        return heard[need - 1] if len(heard) >= need else float("inf")

    def _could_store(self, view: AgentView, heard: float, now: float) -> bool:
        """Whether the heartbeat stream could have stored a beat of ``view``'s agent during
        the grace its lease lapsed into: its leader heard from a quorum since the lease lapsed.
        Else no beat could be stored meanwhile (a NATS server cut off from the others keeps
        leading the streams it led, and answering reads, for some ten seconds; the other side
        elects a new leader only seconds later): the agent's silence says nothing, the hub is
        blind.

        The leader's last contact with a quorum says nothing of the span before it: a leader
        back in touch a moment ago could store no beat while it was cut off, and the agents
        that beat to it then (not cut off themselves: no leader on their side yet) had every
        beat refused. So the first look that finds the stream able again after one that found
        it unable keeps the hub blind for a lease: the agents' beats land meanwhile (chaos
        secure seed 184, ``partition``: a hub cut off with the heartbeat stream's leader for
        5 s, blind meanwhile, declared an agent of the other side LOST 0.29 s after the heal,
        its beats refused throughout the cut, and a route it had run was run again)."""
        if _heard_since_lapse(view, heard, now):
            unable_at, self._hb_unable_at = self._hb_unable_at, float("-inf")
            if unable_at >= view.last_seen:  # (unable since the agent's last beat was heard)
                self._went_blind(
                    "the heartbeat stream's leader hears from a quorum again: a lease for the "
                    "beats it could not store meanwhile to land"
                )
                log.info("%s: not declaring %s LOST", self._blind_why, view.agent_id)
                return False
            return True
        self._hb_unable_at = now
        self._went_blind(
            f"the heartbeat stream's leader last heard from a quorum of its replicas {heard:.3g}s "
            f"ago, before the lease of {view.agent_id} lapsed: no beat could be stored since (a "
            "NATS server cut off from the others?)"
        )
        log.info("%s: not declaring it LOST", self._blind_why)
        return False

    async def lapse_seen(self, view: AgentView) -> bool:
        """Whether ``view``'s lapsed lease (SUSPECT, this hub not blind) says its agent went
        silent, for a step given up on it: the heartbeat stream's leader, looked at now, has
        heard from a quorum since the lease lapsed, and no look since the agent's last beat
        found the stream unable to store one. Else its beats may have been refused (this hub
        cut off with a stream's leader, or from it, before anything told it so: chaos secure
        seed 193, ``partition`` — all three hubs cut off with a node, not yet blind, gave up
        five attempts of agents on the other side whose leases they had seen lapse; the
        attempts had finished, their results were stored 5 s later, and the steps ran again).
        A look that cannot be made makes the hub blind (``_quorum_heard``); one that finds no
        quorum heard since does not (a lease that lapsed a moment ago is younger than the
        leader's last contact): the step asks again at its next probe. Looks made within
        ``_LOOK_SHARED`` of each other are one (``stream_info``)."""
        now = self._clock()
        look = self._hb_look
        if look is None or now - look[0] > _LOOK_SHARED:
            look = self._hb_look = (now, asyncio.ensure_future(self._quorum_heard()))
        heard = await asyncio.shield(look[1])
        if heard is None:
            return False
        now = self._clock()
        heard += now - look[0]  # (as of now)
        # ``_could_store``'s rule, without its verdicts (blindness) of a look made for one step.
        return _heard_since_lapse(view, heard, now) and self._hb_unable_at < view.last_seen

    def _cannot_confirm(self, view: AgentView, err: Exception) -> None:
        self._hb_unable_at = self._clock()
        self._went_blind(f"cannot read the heartbeat of {view.agent_id}: {describe(err)}")
        log.info("%s: not declaring it LOST", self._blind_why)

    def answered_on_ctl(self, view: AgentView) -> None:
        """``view``'s agent answered on its ctl subject (any answer: ``task_state``, a ping).
        Found deaf means nobody listens there, so the verdict was wrong or is over — a cut-off
        agent taken for deaf, or a deaf one restarted: its breaker, open (or half-open) for
        that verdict alone, closes, and a route may go to it again (a task it holds, first:
        ``Router.decide``'s ``only``). A breaker opened for anything else stays as it was.
        Only the agent's own identity may subscribe to its ctl subject (secure mode,
        ``_auth.py``), and the hubs ask with reply subjects nobody can guess
        (``Registry.asks``): an answer is the agent's."""
        if not_deaf(view.breaker, view.agent_id, "answers on its ctl subject"):
            self.regrade(view)

    def regrade(self, view: AgentView) -> None:
        old = view.state
        now = self._clock()
        self._grade(view, now)
        if view.state != old:
            self._notify(view, old)
        if (
            now - view.last_seen > view.record.lease_timeout
            and self.agents.get(view.agent_id) is view
        ):
            self._unsteady[view.agent_id] = view  # its last_seen may have moved back (a drill)

    def _track(self, view: AgentView) -> None:
        """Have the grading loop look at ``view`` when its lease runs out (and at every pass
        while it is not ONLINE). Called for every record installed (a new view, or a lease
        that changed); a beat only moves the deadline later, which the heap finds out when
        the old one comes up."""
        heapq.heappush(
            self._deadlines,
            (view.last_seen + view.record.lease_timeout, next(self._tiebreak), view),
        )
        if view.state is not AgentState.ONLINE:
            self._unsteady[view.agent_id] = view
        if len(self._deadlines) > 2 * len(self.agents) + 1024:
            # Entries of views gone (registered again, dropped) wait for their deadline, up
            # to a day's lease: rebuilt from the registered views when they outnumber them.
            self._deadlines = [
                (v.last_seen + v.record.lease_timeout, next(self._tiebreak), v)
                for v in self.agents.values()
            ]
            heapq.heapify(self._deadlines)

    def _due(self, now: float) -> None:
        """Move the views whose lease ran out by ``now`` from the heap to ``_unsteady``;
        push those that beat since again, with their new deadline."""
        heap, agents, unsteady = self._deadlines, self.agents, self._unsteady
        while heap and heap[0][0] <= now:
            view = heapq.heappop(heap)[2]
            agent_id = view.agent_id
            if agents.get(agent_id) is not view or unsteady.get(agent_id) is view:
                continue  # gone, or graded every pass already
            due = view.last_seen + view.record.lease_timeout
            if due > now:
                heapq.heappush(heap, (due, next(self._tiebreak), view))
            else:
                unsteady[agent_id] = view

    async def _grade_loop(self) -> None:
        try:
            await self._grade_passes()
        finally:
            task = self._undeleted.task
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _grade_passes(self) -> None:
        interval = self._settings.liveness_interval
        while True:
            await asyncio.sleep(interval)
            if not self._ready.is_set():
                # Still loading: a record is graded by its registration until its heartbeat
                # is read, so a long load (a busy node) would declare LOST — and delete for
                # every hub — agents that beat all along (a restart once did so to 1,617).
                continue
            now = self._clock()
            if not self._nc.is_connected:
                # Cut off from NATS: no beat reaches this hub (its watches may not notice).
                # Blind until a lease after it is back, as after a failed watch.
                self._went_blind("cut off from NATS")
            self._due(now)
            grace = self._settings.suspect_timeout
            # Every overdue view, LOST ones included: a view graded LOST when its record was
            # installed (by an old beat) is confirmed like any other before it is expired —
            # read from a leader that could store its beats since its lease lapsed (asked
            # once per pass), or not at all. (Every overdue view is in ``_unsteady``.)
            heard: float | None = None
            for view in list(self._unsteady.values()):
                lease = view.record.lease_timeout
                if now - view.last_seen > lease + grace and not self._blind(now, lease):
                    if heard is None:
                        heard = await self._quorum_heard()
                    if heard is not None and self._could_store(view, heard, now):
                        await self._confirm_overdue(view)
            now = self._clock()
            self._due(now)  # (and those whose lease ran out while the reads above waited)
            lost: list[AgentView] = []
            agents, unsteady = self.agents, self._unsteady
            for agent_id, view in list(unsteady.items()):
                if agents.get(agent_id) is not view:
                    if unsteady.get(agent_id) is view:
                        del unsteady[agent_id]  # gone, or registered again (a view of its own)
                    continue
                old = view.state
                self._grade(view, now)
                if view.state != old:
                    self._notify(view, old)
                if view.state is AgentState.LOST:
                    lost.append(view)
                elif (
                    view.state is AgentState.ONLINE
                    and now - view.last_seen <= view.record.lease_timeout
                    and unsteady.get(agent_id) is view
                ):
                    del unsteady[agent_id]  # steady again: looked at when its lease runs out
                    heapq.heappush(
                        self._deadlines,
                        (view.last_seen + view.record.lease_timeout, next(self._tiebreak), view),
                    )
            for view in lost:
                await self._expire(view)
            self._retry_soon()

    async def _expire(self, view: AgentView) -> None:
        """Remove a LOST agent from memory, and from KV unless it re-registered meanwhile."""
        agent_id = view.agent_id
        if self.agents.get(agent_id) is view:
            if view.state is not AgentState.LOST:
                # Back since its pass graded it: a beat applied while the pass awaited (the
                # deletes of the agents before it, up to ``_DELETE_TIMEOUT`` each).
                return
            self._drop(agent_id, lost=True)
            self._declared_lost(view)
            # Until its delete is delivered, its record read back is not the agent alive.
            self._lost_views[agent_id] = view
            self._lost_views.move_to_end(agent_id)
            if len(self._lost_views) > _LOST_VIEWS_MAX:
                self._lost_views.popitem(last=False)
        undeleted = self._undeleted
        undeleted.views.pop(agent_id, None)  # an earlier verdict's: settled by this one
        if self._clock() < undeleted.at:
            # A delete failed lately (the bucket is likely unavailable still): not waited on
            # here, for every agent of the pass; retried with the others.
            self._keep_undeleted(view, "a delete failed lately")
            return
        await self._delete_lost(view)

    async def _delete_lost(self, view: AgentView) -> bool:
        """Delete the record of an agent this hub declared LOST, then its heartbeat: a CAS on
        the revision it graded — every hub may try, one wins, and a fresh registration (a new
        revision) is never deleted by a stale verdict. False if it failed (it is retried)."""
        assert self._agents_kv is not None and self._hb_kv is not None
        agent_id, undeleted = view.agent_id, self._undeleted
        try:
            async with asyncio.timeout(_DELETE_TIMEOUT):
                await self._agents_kv.delete(agent_id, last=view.revision)
        except Exception as err:
            if _written_since(err):
                undeleted.views.pop(agent_id, None)  # by another hub, or registered again
                return True
            if undeleted.views.get(agent_id) is view:
                undeleted.views.move_to_end(agent_id)  # (the others first, next time)
            else:
                self._keep_undeleted(view, describe(err))
            undeleted.at = self._clock() + undeleted.wait
            undeleted.wait = min(2 * undeleted.wait, _RETRY_WAIT[1])
            return False
        undeleted.wait = _RETRY_WAIT[0]
        if undeleted.views.pop(agent_id, None) is not None:
            log.info("deleted the record of %s, declared LOST, on a retry", agent_id)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_DELETE_TIMEOUT):
                await self._hb_kv.delete(agent_id)
        return True

    def _keep_undeleted(self, view: AgentView, why: str) -> None:
        if self._lost_views.get(view.agent_id) is not view:
            return  # registered again before the verdict's delete: its record is not ours
        log.warning(
            "cannot delete the record of %s, declared LOST: %s; retrying", view.agent_id, why
        )
        views = self._undeleted.views
        views[view.agent_id] = view
        if len(views) > _LOST_VIEWS_MAX:
            views.popitem(last=False)

    def _retry_soon(self) -> None:
        """Retry the deletes that did not land, in a task of their own (one pass's at a time),
        once the wait after the last failure is over. Not while this hub is blind: it may have
        missed a beat of the agent's session, stored since the verdict, that brought it back —
        and its record, undeleted, is the agent's again (the verdict would not be made now)."""
        undeleted = self._undeleted
        if (
            undeleted.views
            and (undeleted.task is None or undeleted.task.done())
            and self._clock() >= undeleted.at
            and not self.blind()
        ):
            undeleted.task = asyncio.create_task(self._retry_deletes(), name="reach-lost-deletes")

    async def _retry_deletes(self) -> None:
        """Retry the oldest undeleted records, ``_RETRIES_PER_PASS`` at most, until a delete
        fails: the bucket is unavailable still, the others would fail too (one try per pass,
        after a wait that doubles)."""
        views = self._undeleted.views
        for agent_id, view in list(itertools.islice(views.items(), _RETRIES_PER_PASS)):
            if views.get(agent_id) is not view:
                continue
            if self._lost_views.get(agent_id) is not view or agent_id in self.agents:
                del views[agent_id]  # delivered deleted or newer, registered again, or back
                continue
            if not await self._delete_lost(view):
                return

    def _overdue(self, view: AgentView) -> bool:
        """Whether this hub has seen no beat of the agent for its lease, while it could have."""
        now, lease = self._clock(), view.record.lease_timeout
        return now - view.last_seen > lease and not self._blind(now, lease)

    def _remember_lost(self, view: AgentView) -> None:
        """Keep a LOST agent in ``recently_lost`` (it leaves every other listing)."""
        ns = view.record.card.namespace
        lost = self._lost.setdefault(ns, OrderedDict())
        lost.pop(view.agent_id, None)
        card = view.record.card
        lost[view.agent_id] = (time.time(), tuple(card.capabilities), card.all_labels())
        while len(lost) > _LOST_KEPT_MAX:  # per namespace: no tenant evicts another's
            lost.popitem(last=False)

    def _declared_lost(self, view: AgentView) -> None:
        """This hub let the agent's lease run out (from any state: draining, cordoned,
        suspect): it leaves every listing now, so log it and keep it in ``recently_lost``."""
        self._remember_lost(view)
        log_event(
            log,
            LEASE_EXPIRED,
            "agent LOST: no heartbeat for its lease and suspect_timeout; removed from the "
            "registry (its history: reach-mesh audit --agent)",
            agent_id=view.agent_id,
            state="LOST",
        )

    def _notify(self, view: AgentView, old: AgentState) -> None:
        if view.state is not AgentState.ONLINE and self.agents.get(view.agent_id) is view:
            self._unsteady[view.agent_id] = view
        if view.state is AgentState.SUSPECT and old is AgentState.ONLINE:
            log_event(
                log,
                LEASE_EXPIRED,
                "lease expired, agent is SUSPECT",
                agent_id=view.agent_id,
                state="SUSPECT",
                lease_timeout=view.record.lease_timeout,
            )
        elif old is AgentState.LOST and view.state is not AgentState.LOST:
            # Back (registered again): no longer "recently lost".
            was = self._lost.get(view.record.card.namespace)
            if was is not None:
                was.pop(view.agent_id, None)
        for listener in self._listeners:
            try:
                listener(view, old, view.state)
            except Exception:
                log.exception("state listener failed")


def _written_since(err: Exception) -> bool:
    """Whether a CAS delete failed because the key was written (or deleted) since the revision
    it names: nats-py's ``delete`` raises JetStream's error as it is."""
    return isinstance(err, KeyWrongLastSequenceError | KeyNotFoundError) or (
        isinstance(err, APIError) and err.err_code == _WRONG_LAST_SEQUENCE
    )


def not_deaf(breaker: CircuitBreaker, agent_id: str, because: str) -> bool:
    """Clear a "deaf" verdict of ``agent_id`` (``because``: what disproves it): its breaker,
    open or half-open for that verdict alone, closes, and its ``why`` is cleared. False (and
    nothing changed) when the breaker is closed or tripped for anything else (an operator's
    quarantine, a failure rate, a failed probe)."""
    if breaker.why != DEAF:
        return False
    breaker.why = ""
    if breaker.state is not BreakerState.CLOSED:
        breaker.reset()
        log.warning("%s %s: not deaf, its breaker closes", agent_id, because)
    return True


def heartbeat_entry(agent_id: str, raw: RawStreamMsg) -> KeyValue.Entry:
    """``agent_id``'s heartbeat as read from its stream (``raw``), as a watch delivers it, with
    the time the server stored it: a beat from before the lease lapsed renews the lease (this
    hub missed it) but is no sign the agent spoke since (``spoke_at``)."""
    return KeyValue.Entry(
        bucket=protocol.KV_HEARTBEATS,
        key=agent_id,
        value=raw.data,
        revision=raw.seq,
        delta=None,
        created=cast(Any, raw.time),
        operation=(raw.headers or {}).get(KV_OP),
    )


def _heard_since_lapse(view: AgentView, heard: float, now: float) -> bool:
    """Whether the heartbeat stream's leader, which last heard from a quorum ``heard``
    seconds before ``now``, did so after ``view``'s lease lapsed."""
    return heard < now - view.last_seen - view.record.lease_timeout
