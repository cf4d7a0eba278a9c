"""The hub's view of the fleet: JetStream KV buckets mirrored into an in-memory index.

Writes (register, heartbeat, unregister, lease cleanup) go to KV; every hub instance watches the
buckets and applies each change to its own :class:`AgentView` map and :class:`AgentIndex`, so all
hubs converge on one registry and any of them can answer any request.

Time is the hub's: a heartbeat's arrival is stamped with this hub's monotonic clock when the watch
delivers it (entries loaded at start-up are aged by the JetStream server's timestamp). Nothing a
client sends is used as a time.

Its bases: :class:`~reach_mesh.hub._registry_watch.RegistryWatch` (the watches and the entries
they apply) and, under that, :class:`~reach_mesh.hub._liveness.Liveness` (lease grading and
blindness).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from pydantic import ValidationError

from reach_mesh import protocol
from reach_mesh._jspub import EXPECTED_LAST_SUBJECT_SEQUENCE, JsClient
from reach_mesh._kv import kv_subject, kv_unregistered, kv_unregistered_marker
from reach_mesh._nats import ensure_kv
from reach_mesh._retry import describe
from reach_mesh._starting import time_to_start
from reach_mesh.config import MeshSettings
from reach_mesh.errors import MeshUnavailableError, SessionEndedError, UnknownAgentError
from reach_mesh.hub._agent_view import AgentView, StateListener
from reach_mesh.hub._liveness import _HB_STREAM, LOST_KEPT_S, LostEntry, Undeleted
from reach_mesh.hub._registry_watch import RegistryWatch
from reach_mesh.hub._reply_boxes import ReplyBoxes
from reach_mesh.hub._resources import Resources
from reach_mesh.hub._server_clock import ServerClock, ask_server_time
from reach_mesh.hub.breaker import CircuitBreaker, HealthScore
from reach_mesh.hub.index import AgentIndex
from reach_mesh.models import (
    BEAT_WRITE_GAP,
    AgentRecord,
    AgentState,
    CordonRecord,
    Heartbeat,
    HeartbeatRecord,
    RegisterRequest,
)

__all__ = ["AgentView", "Registry"]

log = logging.getLogger("reach_mesh.hub.registry")

_ROUTABLE: Final = frozenset({AgentState.ONLINE, AgentState.SUSPECT})
#: The least time between two KV writes of one agent's heartbeat that changes its state
#: (draining, unavailable, pressure); unchanged beats are written every quarter interval, and
#: never more often than this either.
_CHANGE_GAP: Final = BEAT_WRITE_GAP
#: How long a heartbeat's KV write waits for JetStream's ack (as the hub's JetStream context,
#: which ``KeyValue.put`` used).
_WRITE_TIMEOUT: Final = 10.0
#: How long ``start`` waits for the first load of the agents and their heartbeats, at least.
_LOAD_TIMEOUT: Final = 30.0
#: A registration's record written over the entry its session check read (compare-and-set):
#: at most this many tries when other writes of the key came between (``Registry.register``).
_RECORD_TRIES: Final = 3
#: An unknown agent id's "did you mean": the registered ids of its namespace looked at, at most
#: (difflib is quadratic in the id's length, linear in their number), and how close they must
#: be (demo.calc.c9 → demo.calc.c1 is 0.92, as is a misspelled service: demo.calk.c1).
_SIMILAR_SCAN: Final = 2_000
_SIMILAR_ID_CUTOFF: Final = 0.85


def stored_beat(hb: Heartbeat) -> bytes:
    """The ``HeartbeatRecord`` a validated beat is stored as, encoded: the beat's fields but its
    agent id (the key), each of which the beat validated as strictly as the record would. Not
    a record built, validated again and dumped, on every beat."""
    return hb.model_dump_json(exclude={"agent_id"}, exclude_none=True).encode()


def _session_of(record: bytes) -> str | None:
    """The ``session`` of a stored ``AgentRecord`` (None: unreadable)."""
    try:
        return AgentRecord.model_validate_json(record).session
    except ValidationError:
        return None


class Registry(RegistryWatch):
    """Registry state of one hub: KV buckets + watchers + index + lease grading."""

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        settings: MeshSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        resources: Resources | None = None,
        asks_nc: NATS | None = None,
        agent_asks: ReplyBoxes | None = None,
    ) -> None:
        self._nc = nc
        #: Where this hub asks agents (``asks``): the connection their answers come back on.
        self._asks_nc = asks_nc
        #: Where this hub asks agents, answered on their namespace's reply subjects.
        self._agent_asks = agent_asks
        self._js = js
        self._settings = settings
        self._clock = clock
        #: The NATS server's wall clock: what the stored entries' timestamps are read against.
        self.server_clock = ServerClock()
        #: The hub's JetStream resources: told when a watch or a write finds no stream.
        self._resources = resources
        self.agents: dict[str, AgentView] = {}
        # Agents per namespace: which namespaces exist (metrics and audit are kept for those).
        self._namespaces: dict[str, int] = {}
        #: Agents this hub declared LOST lately (lease and grace ran out), by id: they leave
        #: every listing, so ``recently_lost`` tells where they went. Bounded in age and count.
        self._lost: dict[str, OrderedDict[str, LostEntry]] = {}
        #: (session, revision) of the heartbeat the watch delivered before the agent's record
        #: of that session, by agent id.
        self._early_beats: dict[str, tuple[str, int]] = {}
        #: The views this hub declared LOST whose record's delete its watch has not delivered
        #: (it may not have landed: JetStream could not write then), by id, the newest
        #: 10,000: that record, read back (``fetch``, a watch's replay), is not this agent
        #: alive again — only a newer beat of its session, or a newer record, is.
        self._lost_views: OrderedDict[str, AgentView] = OrderedDict()
        #: Those whose record's delete failed, retried until it lands or is settled.
        self._undeleted = Undeleted()
        self.index = AgentIndex()
        self._deadlines = []
        self._tiebreak = itertools.count()
        self._unsteady = {}
        self._agents_kv: KeyValue | None = None
        self._hb_kv: KeyValue | None = None
        #: One-off reads (``fetch``): direct gets asked again when a replica does not answer
        #: soon (a frozen node's), not nats-py's, which wait out their whole timeout.
        self._reads: JsClient | None = None
        self._asks: JsClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list[StateListener] = []
        self._ready = asyncio.Event()
        #: When this hub last failed to read or write the registry buckets (its clock). A hub
        #: that could not see heartbeats lately does not declare anybody LOST: absence of
        #: evidence during a JetStream election is not evidence of death.
        self._blind_at = float("-inf")
        #: What made this hub blind last (``describe`` of the error): told while it is blind.
        self._blind_why = ""
        self._hb_unable_at = float("-inf")
        self._hb_look = None
        #: Heartbeat writes waiting for their gap to pass (``_trailing``).
        self._trailers: set[asyncio.Task[None]] = set()
        self._cordons_kv: KeyValue | None = None
        #: Operators' cordons (``reach_cordons``): the KV revision of each cordoned agent id's
        #: key, registered or not. A cordon belongs to the id, not to one registration.
        self.cordons: dict[str, int] = {}
        #: Cordons this hub lifted whose delete its watch has not delivered yet: the revision
        #: of the put it lifted (a put of that revision or older, delivered late, is not a
        #: cordon again).
        self._lifted: dict[str, int] = {}
        #: What this hub learned of dropped agents' behaviour (breaker, health, quarantines
        #: counted) and its session, by id, while there is something to remember (a breaker
        #: not closed, a health below its threshold): an agent that unregisters and registers
        #: again — or registers under a new session — finds them as it left them
        #: (``apply_record``; a "deaf" verdict on the process aside).
        self._kept: OrderedDict[str, tuple[CircuitBreaker, HealthScore, int, str]] = OrderedDict()
        #: Agents that said goodbye (or whose record another hub deleted as not overdue), by
        #: id: when (wall clock), the newest ``_KEPT_MAX``. A request naming one is told it
        #: left, and that a restart registers it again, not only "not registered".
        self._left: OrderedDict[str, float] = OrderedDict()

    # ------------------------------------------------------------------ lifecycle

    async def ensure_buckets(self) -> None:
        """Create the registry's buckets that do not exist (at start, and when found gone:
        ``Resources``)."""
        s = self._settings
        self._agents_kv = await ensure_kv(
            self._js, protocol.KV_AGENTS, replicas=s.kv_replicas, description="reach-mesh agents"
        )
        self._hb_kv = await ensure_kv(
            self._js,
            protocol.KV_HEARTBEATS,
            replicas=s.kv_replicas,
            description="reach-mesh agent heartbeats (load reports)",
        )
        self._cordons_kv = await ensure_kv(
            self._js,
            protocol.KV_CORDONS,
            replicas=s.kv_replicas,
            description="reach-mesh operators' cordons (kept across an agent's registrations)",
        )

    @property
    def asks(self) -> JsClient:
        """This hub's requests whose reply subjects carry 64 random bits (``JsClient.ask``),
        for asks whose answer must come from the party asked (other hubs': ``pin_of``; agents
        are asked with :meth:`ask_agent`, on their namespace's reply subjects, where alone
        they may answer). On a connection of their own when the hub gave one (``asks_nc``),
        not the registry's JetStream's. Once started."""
        assert self._asks is not None, "registry not started"
        return self._asks

    async def ask_agent(self, agent_id: str, body: bytes, *, timeout: float) -> Msg:
        """Ask ``agent_id`` on its ctl subject (``task_state``, a ping) with a reply subject of
        its own namespace carrying 64 random bits (``hub/_reply_boxes.py``): an agent sees the
        reply subjects of what it is asked and may publish on its namespace's, so it must not
        be able to guess the next one, as it could nats-py's (``hub/_holders.py``), and an
        agent of another namespace may not publish there at all. ``NoRespondersError`` when
        nobody listens on its ctl subject; ``nats.errors.TimeoutError`` without an answer."""
        if self._agent_asks is None:  # (a registry without a hub's agents connection)
            return await self.asks.ask(protocol.agent_ctl(agent_id), body, timeout=timeout)
        return await self._agent_asks.ask(agent_id, body, timeout=timeout)

    async def start(self) -> None:
        await self.ensure_buckets()
        # The server's clock before the entries loaded below are aged by it.
        await ask_server_time(self._nc, _HB_STREAM, self.server_clock)
        assert self._cordons_kv is not None
        if self._resources is not None:
            buckets = (protocol.KV_AGENTS, protocol.KV_HEARTBEATS, protocol.KV_CORDONS)
            self._resources.add([f"KV_{b}" for b in buckets], self.ensure_buckets)
        self._reads = JsClient(self._nc)
        await self._reads.start()
        if self._asks_nc is None or self._asks_nc is self._nc:
            self._asks = self._reads
        else:
            self._asks = JsClient(self._asks_nc)
            await self._asks.start()
        cordons_loaded = asyncio.Event()
        agents_loaded = asyncio.Event()
        hbs_loaded = asyncio.Event()
        self._tasks = [
            asyncio.create_task(
                self._watch(
                    protocol.KV_CORDONS, self._cordons_kv, self._apply_cordon, cordons_loaded
                ),
                name="reach-watch-cordons",
            ),
            asyncio.create_task(
                self._watch_agents(agents_loaded, cordons_loaded), name="reach-watch-agents"
            ),
            asyncio.create_task(
                self._watch_heartbeats(hbs_loaded, agents_loaded), name="reach-watch-heartbeats"
            ),
            asyncio.create_task(self._grade_loop(), name="reach-liveness"),
        ]
        # The watches retry by themselves; while the hub starts, for what is left of its
        # start_timeout (``_starting``).
        wait = time_to_start(_LOAD_TIMEOUT)
        try:
            async with asyncio.timeout(wait):
                await asyncio.gather(agents_loaded.wait(), hbs_loaded.wait())
        except TimeoutError as err:
            raise MeshUnavailableError(
                f"the registry ({protocol.KV_AGENTS}, {protocol.KV_HEARTBEATS}) was not loaded "
                f"from JetStream within {wait:.0f}s: {self._blind_why or 'no answer'}"
            ) from err
        self._ready.set()

    async def stop(self) -> None:
        # A heartbeat-stream look still out (``lapse_seen``) too: it must not outlive the hub.
        pending: list[asyncio.Future[Any]] = [*self._tasks, *self._trailers]
        if self._hb_look is not None:
            pending.append(self._hb_look[1])
            self._hb_look = None
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    def on_state_change(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    @property
    def loaded(self) -> bool:
        """Whether the registry's initial load from KV is done. Until then its states are
        catching up (a record loaded before its heartbeat grades SUSPECT, then ONLINE):
        no transition the agent went through."""
        return self._ready.is_set()

    @property
    def now(self) -> float:
        return self._clock()

    # ------------------------------------------------------------------ writes

    async def register(self, req: RegisterRequest, task_subject: str) -> AgentView:
        assert self._agents_kv is not None and self._hb_kv is not None
        record = AgentRecord(
            card=req.card,
            session=req.session,
            heartbeat_interval=req.heartbeat_interval,
            lease_timeout=req.lease_timeout,
            task_subject=task_subject,
            registered_at=time.time(),
        )
        agent_id = req.card.agent_id
        last = await self._refuse_ended(agent_id, req.session)
        existing = self.agents.get(agent_id)
        if self.cordoned(agent_id, None if existing is None else existing.record):
            record.cordoned = True  # an operator's cordon outlives the agent's registrations
        hb = HeartbeatRecord(session=req.session)
        # Heartbeat first: watchers that see the record find a matching load report.
        hb_rev = await self._hb_kv.put(agent_id, protocol.encode(hb))
        try:
            rev = await self._write_record(agent_id, record, last)
        except SessionEndedError:
            # Unregistered between the check and the write: its beat written just now goes.
            with contextlib.suppress(Exception):
                await self._hb_kv.delete(agent_id, last=hb_rev)
            raise
        view = self.apply_record(record, rev, seen_at=self._clock())
        if view.record.session == req.session:
            # Written by the registration, not a beat (see ``_apply_heartbeat``).
            view.hb_revision = max(view.hb_revision, hb_rev)
        return view

    async def _refuse_ended(
        self, agent_id: str, session: str, *, at_leader: bool = False
    ) -> int | None:
        """Raise ``SessionEndedError`` when ``agent_id``'s record was deleted by an unregister
        of ``session`` (its delete marker names the session: :meth:`unregister`). The agent
        sends a registration again after 1 s without an answer, and a hub that was paused or
        wedged meanwhile handles the earlier try when it wakes, maybe after the agent, answered
        by another hub, unregistered and left: registered, a gone agent would be routed to
        until its lease ran out. Returns the revision read (0: no entry), which the record is
        written over (:meth:`_write_record`: an unregister that comes between the check and
        the write is not undone); None when the read failed, which lets the registration
        through (its write is what decides, and fails alike)."""
        assert self._reads is not None
        try:
            if at_leader:
                got = await self._reads.kv_entry_at_leader(protocol.KV_AGENTS, agent_id)
            else:
                got = await self._reads.kv_entry(protocol.KV_AGENTS, agent_id)
        except Exception as err:
            log.debug("registration of %s: its record could not be read: %r", agent_id, err)
            return None
        if got is not None and got[2] and kv_unregistered(got[0]) == session:
            raise SessionEndedError(
                f"agent {agent_id!r} unregistered session {session!r}: a process registers "
                "under a fresh session",
                agent_id=agent_id,
            )
        return 0 if got is None else got[1]

    async def _write_record(self, agent_id: str, record: AgentRecord, last: int | None) -> int:
        """Write a registration's ``record`` over revision ``last`` of the key (what the
        session check read; None: unread, written as it is). Another write between them (an
        unregister of this session, a hedged try of the same registration, a cordon) fails
        the compare-and-set: the key is read again at the stream's leader and checked again
        (``SessionEndedError``), ``_RECORD_TRIES`` times at most."""
        assert self._agents_kv is not None
        value = protocol.encode(record)
        for _ in range(_RECORD_TRIES):
            if last is None:
                return await self._agents_kv.put(agent_id, value)
            try:
                return await self._agents_kv.update(agent_id, value, last=last)
            except KeyWrongLastSequenceError:
                last = await self._refuse_ended(agent_id, record.session, at_leader=True)
        raise MeshUnavailableError(
            f"the record of {agent_id} was written by others meanwhile, {_RECORD_TRIES} times: "
            "register again"
        )

    async def heartbeat(self, hb: Heartbeat) -> AgentView:
        view = self.agents.get(hb.agent_id)
        if view is None or view.record.session != hb.session:
            raise UnknownAgentError(
                f"agent {hb.agent_id!r} is not registered"
                + ("" if view is None else " under this session")
                + ": register again",
                agent_id=hb.agent_id,
            )
        assert self._hb_kv is not None
        # This hub counts the beat at once; the KV write tells the other hubs. If JetStream is
        # briefly unavailable (leader election) the beat still renews the lease here and the
        # error goes back to the agent, whose next beat writes again.
        now = self._clock()
        self.apply_heartbeat(view, hb, seen_at=now)
        # A beat soon after the last one written renews the lease here only, unless it
        # changes what the agent takes: a flood of beats must not become a flood of KV writes
        # (and of state events), and the others' leases last far longer than the gap.
        changed = view.beat_state != view.hb_written_state
        # The interval is the agent's choice: never less than the change gap (one of 0.1 ms
        # once made every beat of a flood a write again).
        gap = _CHANGE_GAP if changed else max(_CHANGE_GAP, view.record.heartbeat_interval / 4)
        wait = view.hb_written_at + gap - now
        if wait > 0:
            view.hb_unwritten = hb
            if changed and not view.hb_trailing:  # the change is written when the gap ends
                view.hb_trailing = True
                task = asyncio.get_running_loop().create_task(self._trailing(view, wait))
                self._trailers.add(task)
                task.add_done_callback(self._trailers.discard)
            return view
        await self._write_beat(view, hb, now)
        return view

    async def _trailing(self, view: AgentView, wait: float) -> None:
        """Write the agent's newest state, once the gap since the last write has passed."""
        await asyncio.sleep(wait)
        view.hb_trailing = False
        if self.agents.get(view.agent_id) is not view:
            return  # gone, or registered again since
        record = view.hb_unwritten
        if record is None or view.beat_state == view.hb_written_state:
            return  # a later beat wrote it
        with contextlib.suppress(Exception):  # the agent's next beat writes again
            await self._write_beat(view, record, self._clock())

    async def _write_beat(self, view: AgentView, hb: Heartbeat, now: float) -> None:
        assert self._hb_kv is not None
        view.hb_written_at = now
        view.hb_written_state = view.beat_state
        view.hb_unwritten = None
        assert self._reads is not None
        try:
            # Not ``KeyValue.put``: nats-py's request machinery (a NUID inbox, ``wait_for``, a
            # ``PubAck`` built by introspection) cost more than the rest of the beat.
            ack = await self._reads.publish(
                self._hb_subject(view.agent_id), stored_beat(hb), timeout=_WRITE_TIMEOUT
            )
        except Exception as err:
            # The other hubs will not see this beat, and we may be missing theirs: trust no
            # silence for a while (the agent's next beat writes again).
            self._went_blind(f"cannot write a heartbeat: {describe(err)}", err)
            view.hb_written_at = -math.inf
            raise
        view.hb_own_revision = ack.seq
        view.hb_revision = max(view.hb_revision, ack.seq)

    @staticmethod
    def _hb_subject(agent_id: str) -> str:
        return kv_subject(protocol.KV_HEARTBEATS, agent_id)

    async def unregister(self, agent_id: str, session: str | None) -> bool:
        """End the agent's registration: its record deleted (and its heartbeat). With
        ``session``, only a registration of that session, and the delete marker names it
        (:meth:`_end_session`); True when the session's registration is ended — by this call,
        or by an earlier try of it —, False when the id's record is of another session, or
        there is none. Raises (``MeshUnavailableError``, JetStream's errors: the agent asks
        again) when the record could not be read or deleted: an unregister answered is one
        whose registration is gone."""
        assert self._agents_kv is not None and self._hb_kv is not None
        view = self.agents.get(agent_id)
        if session is None:
            if view is None:
                return False
            self._drop(agent_id, lost=False)
            with contextlib.suppress(KeyNotFoundError):
                await self._agents_kv.delete(agent_id)
        else:
            known = view is not None and view.record.session == session
            last = view.revision if known and view is not None else None
            if not await self._end_session(agent_id, session, last):
                return False
            if known and self.agents.get(agent_id) is view:
                self._drop(agent_id, lost=False)
        with contextlib.suppress(KeyNotFoundError):
            await self._hb_kv.delete(agent_id)
        return True

    async def _end_session(self, agent_id: str, session: str, last: int | None) -> bool:
        """Write the delete marker that ends ``session``'s registration of ``agent_id``
        (``{"unregistered": session}``: a try of that registration handled late is refused,
        ``_refuse_ended``), over revision ``last`` of the key (compare-and-set: no newer
        registration is deleted). ``last`` None — this hub has no view of that registration:
        its watch has not delivered it yet, or it is of another session here — or a
        compare-and-set that lost: the key is read at the stream's leader, and the marker
        written over what it holds if that is a record of ``session`` (or a delete that names
        no session: a LOST verdict's, which a late try would not be refused by). Whether
        ``session``'s registration is ended (False: the key holds another session's record
        or its marker, or nothing). Up to ``_RECORD_TRIES`` tries when other writes of the
        key come between."""
        assert self._reads is not None
        subject, body, headers = kv_unregistered_marker(protocol.KV_AGENTS, agent_id, session)
        for _ in range(_RECORD_TRIES):
            if last is None:
                got = await self._reads.kv_entry_at_leader(protocol.KV_AGENTS, agent_id)
                if got is None:
                    return False  # never registered (or purged)
                value, revision, marker = got
                if marker:
                    said = kv_unregistered(value)
                    if said is not None:
                        return said == session  # ended already (a try of this unregister)
                elif _session_of(value) != session:
                    return False  # another session's registration owns the id
                last = revision
            try:
                await self._reads.publish(
                    subject, body, {**headers, EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)}
                )
                return True
            except KeyWrongLastSequenceError:
                last = None  # written meanwhile: read again
        raise MeshUnavailableError(
            f"the record of {agent_id} was written by others meanwhile, {_RECORD_TRIES} times: "
            "unregister again"
        )

    async def set_cordon(self, agent_id: str, cordon: CordonRecord | None) -> AgentView | None:
        """Cordon the agent (``cordon``), or lift its cordon (None). The cordon is kept under
        the agent id in ``reach_cordons`` — from there it outlives the registration, and every
        hub grades by it — and written into the agent's record too (hubs of earlier versions
        read it there). A cordon needs a registered agent; a cordon is lifted whether the
        agent is registered or not. Returns the agent's view, None when it is not registered
        (its cordon lifted)."""
        assert self._agents_kv is not None and self._cordons_kv is not None
        view = self.agents.get(agent_id)
        if view is None and (cordon is not None or agent_id not in self.cordons):
            self.require(agent_id)  # raises: unknown (or lately lost)
        if cordon is not None:
            rev = await self._cordons_kv.put(agent_id, protocol.encode(cordon))
            self.cordons[agent_id] = max(rev, self.cordons.get(agent_id, 0))
            self._lifted.pop(agent_id, None)
        else:
            with contextlib.suppress(KeyNotFoundError):
                await self._cordons_kv.delete(agent_id)
            self._lifted[agent_id] = self.cordons.pop(agent_id, 0)
        if view is None:
            return None
        record = view.record.model_copy(update={"cordoned": cordon is not None})
        rev = await self._agents_kv.update(agent_id, protocol.encode(record), last=view.revision)
        return self.apply_record(record, rev, seen_at=view.last_seen)

    def cordoned(self, agent_id: str, record: AgentRecord | None) -> bool:
        """Whether an operator cordoned the agent: by its id's key in ``reach_cordons``, or by
        the flag in its ``record`` (all a hub of an earlier version writes)."""
        return agent_id in self.cordons or (record is not None and record.cordoned)

    def _apply_cordon(self, entry: KeyValue.Entry, *, initial: bool) -> None:
        """A cordon written or lifted (by any hub): the agent, if registered, is graded
        again."""
        agent_id = entry.key
        revision = entry.revision or 0
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            self._lifted.pop(agent_id, None)
            if self.cordons.get(agent_id, 0) < revision:
                self.cordons.pop(agent_id, None)
        elif revision > self._lifted.get(agent_id, 0) and revision >= self.cordons.get(agent_id, 0):
            self.cordons[agent_id] = revision
        view = self.agents.get(agent_id)
        if view is not None:
            self.regrade(view)

    async def fetch(self, agent_id: str) -> AgentView | None:
        """Read one agent from KV (for a registration this hub's watch has not delivered yet).
        Its lease renewed now; the agent spoke (``spoke_at``) when the server stored the
        record, as for one the watch delivers (:meth:`_stored_at`)."""
        assert self._reads is not None
        try:
            got = await self._reads.kv_get_stored(protocol.KV_AGENTS, agent_id)
        except Exception:
            return None  # unreadable now: as unknown, which the caller retries or reports
        if got is None:
            return None
        try:
            record = AgentRecord.model_validate_json(got[0])
        except ValidationError:
            return None
        if self._judged_lost(agent_id, record, got[1]):
            return None  # declared LOST here, its delete not landed: not heard from since
        return self.apply_record(
            record, got[1], seen_at=self._clock(), heard_at=self._server_time_here(got[2])
        )

    # ------------------------------------------------------------------ reads

    def has_namespace(self, namespace: str) -> bool:
        """Whether any agent of ``namespace`` is registered (in any state)."""
        return namespace in self._namespaces

    def require(self, agent_id: str) -> AgentView:
        view = self.agents.get(agent_id)
        if view is None:
            raise self.not_registered(agent_id)
        return view

    def not_registered(self, agent_id: str) -> UnknownAgentError:
        """The error for ``agent_id``, not registered here: declared LOST lately, gone with a
        goodbye lately (stopped — or restarting, and back once it registers), or unknown."""
        now = time.time()
        in_ns = self._lost.get(protocol.namespace_of(agent_id))
        lost = None if in_ns is None else in_ns.get(agent_id)
        if lost is not None and now - lost[0] < LOST_KEPT_S:
            return UnknownAgentError(
                f"agent {agent_id!r} was declared LOST {now - lost[0]:.0f}s ago (no "
                f"heartbeat for its lease and suspect_timeout): restart it; its history: "
                f"reach-mesh audit --agent {agent_id}",
                agent_id=agent_id,
                lost_at=lost[0],
            )
        left = self._left.get(agent_id)
        if left is not None and now - left < LOST_KEPT_S:
            return UnknownAgentError(
                f"agent {agent_id!r} is not registered: it unregistered {now - left:.0f}s ago "
                "(stopped, or restarting: a restart registers it again; ask again with the "
                "same task_id then, or route by capability)",
                agent_id=agent_id,
                left_at=left,
            )
        close = self._similar_ids(agent_id)
        if close:
            return UnknownAgentError(
                f"agent {agent_id!r} is not registered; did you mean {' or '.join(close)}?",
                agent_id=agent_id,
                similar_agents=close,
            )
        return UnknownAgentError(f"agent {agent_id!r} is not registered", agent_id=agent_id)

    def _similar_ids(self, agent_id: str) -> list[str]:
        """Registered ids of ``agent_id``'s namespace that are close to it (a typo: ``c9`` for
        ``c1``); the first ``_SIMILAR_SCAN`` of the namespace only, an error path's work."""
        members = self.index.members(protocol.namespace_of(agent_id))
        ids = list(itertools.islice(members, _SIMILAR_SCAN))
        return difflib.get_close_matches(agent_id, ids, n=3, cutoff=_SIMILAR_ID_CUTOFF)

    def recently_lost(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Agents declared LOST in the last 15 minutes (and not back), newest first: id, when
        (this hub's wall clock), capabilities."""
        horizon = time.time() - LOST_KEPT_S
        out: list[dict[str, Any]] = []
        for ns in [namespace] if namespace is not None else list(self._lost):
            lost = self._lost.get(ns)
            if lost is None:
                continue
            while lost and next(iter(lost.values()))[0] < horizon:
                lost.popitem(last=False)
            if not lost:
                del self._lost[ns]
                continue
            out += [
                {"agent_id": agent_id, "lost_at": round(at, 3), "capabilities": list(caps)}
                for agent_id, (at, caps, _) in lost.items()
                if agent_id not in self.agents
            ]
        return sorted(out, key=lambda e: -e["lost_at"])

    def lost_matching(
        self,
        namespace: str,
        match: Callable[[Collection[str], Mapping[str, str]], bool],
        most: int,
    ) -> list[str]:
        """Ids of ``namespace``'s agents declared LOST in the last 15 minutes and not
        registered again, newest first, whose card when lost ``match`` accepts (capabilities,
        labels as a selector sees them): ``most`` at most. Reads at most the namespace's
        ``recently_lost`` (200 entries)."""
        lost = self._lost.get(namespace)
        if not lost:
            return []
        horizon = time.time() - LOST_KEPT_S
        out: list[str] = []
        for agent_id, (at, caps, labels) in reversed(lost.items()):
            if at < horizon or len(out) >= most:
                break
            if agent_id not in self.agents and match(caps, labels):
                out.append(agent_id)
        return out

    def routable(self, view: AgentView) -> bool:
        return view.state in _ROUTABLE

    def __iter__(self) -> Iterator[AgentView]:
        return iter(self.agents.values())

    def __len__(self) -> int:
        return len(self.agents)

    def views(self, namespace: str | None = None) -> list[AgentView]:
        """The agents of ``namespace`` (None: of every namespace), in ``agent_id`` order."""
        if namespace is None:
            views: Iterable[AgentView] = self.agents.values()
        else:  # the namespace's agents only: one tenant's query never walks the others'
            agents = self.agents
            views = [v for a in self.index.members(namespace) if (v := agents.get(a)) is not None]
        return sorted(views, key=lambda v: v.agent_id)
