"""The hub process: registry requests, routing, proxy delivery, admin queries.

Every hub instance joins one queue group on ``reach.hub.*.<verb>``, so any number of hubs share the
load and any of them can answer any request (they converge through the KV registry).
Message callbacks never block the subscription. A route is a *flight* finished by the callback that
gets the agent's reply (``_route_end.py``); every other request runs in its own task. Both
are bounded per hub by ``hub_concurrency``: when full, the other requests' subscription stops
reading and NATS buffers; routes are then taken only from namespaces below their fair share of
the hub (``hub/shares.py``; the others are answered ``REACH_THROTTLED``), and nothing more past
four times the bound.

This module holds the hub's state, lifecycle and dispatch; ``Hub`` takes its routing from
:class:`~reach_mesh.hub._routing.RoutingMixin` (and its base ``RouteEndMixin``; wire bytes
from ``_wire.py``) and its registry verbs, reports and admin ops from
:class:`~reach_mesh.hub._control.ControlMixin`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from types import TracebackType
from typing import Any, Final

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from reach_mesh import protocol
from reach_mesh._batch import AnswerBatcher
from reach_mesh._consume import apply_replicas, apply_workflow_retention
from reach_mesh._guard import guarded
from reach_mesh._nats import beside, connect, connection_counts, flushed, shown
from reach_mesh._nats_together import Together
from reach_mesh._retry import describe, storage_full
from reach_mesh._shutdown import within
from reach_mesh._starting import Starting, set_up, starting, time_to_start
from reach_mesh.config import MeshSettings, load_settings
from reach_mesh.errors import (
    BadRequestError,
    InternalError,
    MeshUnavailableError,
    PayloadTooLargeError,
    ReachError,
)
from reach_mesh.hub._control import VIEW_RATE, ControlMixin, ViewSlots
from reach_mesh.hub._dashboard import Dashboard
from reach_mesh.hub._pins import TaskPins
from reach_mesh.hub._push_sweep import sweep_forever
from reach_mesh.hub._record_read import RecordReadMixin
from reach_mesh.hub._reply_boxes import REPLY_CONNECTIONS, ReplyBoxes
from reach_mesh.hub._resources import Resources
from reach_mesh.hub._routing import RoutingMixin
from reach_mesh.hub.audit import AuditLog, Repeats
from reach_mesh.hub.registry import Registry
from reach_mesh.hub.router import Router
from reach_mesh.hub.sessions import SessionStore
from reach_mesh.hub.shares import Shares
from reach_mesh.hub.throttle import Throttle
from reach_mesh.hub.workflows import WorkflowEngine
from reach_mesh.logs import LineBudget
from reach_mesh.tracing import tracing_from_env
from reach_mesh.tracing.metrics import (
    UNKNOWN_NAMESPACE,
    HubMetrics,
    connection_metrics,
    together_metrics,
    watch_event_loop,
)

__all__ = ["Hub", "HubState"]

log = logging.getLogger("reach_mesh.hub")

#: ``service.name`` of a hub's spans unless ``OTEL_SERVICE_NAME`` says otherwise (the CLI's
#: ``reach-mesh hub`` uses the same).
HUB_SERVICE_NAME: Final = "reach-mesh-hub"
#: Seconds a namespace's metric series outlive its last agent on a hub (when it is not
#: configured): longer than any alert rule's window (15 min), so the last increments are
#: scraped and read.
NAMESPACE_SERIES_KEPT: Final = 1800.0


class HubState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


Handler = Callable[[Msg, str], Awaitable[bytes | None]]


class Hub(RoutingMixin, ControlMixin, RecordReadMixin):
    """One hub instance. ``async with Hub(url) as hub:`` serves until the block exits."""

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        settings: MeshSettings | None = None,
        hub_id: str | None = None,
    ) -> None:
        self.settings = settings or load_settings(nats_url=nats_url)
        self.nats_url = nats_url or self.settings.nats_url
        self.hub_id = hub_id or f"hub-{uuid.uuid4().hex[:8]}"
        if not protocol.HUB_ID_RE.fullmatch(self.hub_id):  # a token of subjects
            raise BadRequestError(
                f"invalid hub_id {self.hub_id!r}: expected 1-64 characters of [A-Za-z0-9_-]",
                field="hub_id",
            )
        self.state = HubState.NEW
        self._nc: NATS | None = None
        #: Route requests come in on a connection of their own, and so do status events (see
        #: ``start``).
        self._route_nc: NATS | None = None
        self._status_nc: NATS | None = None
        #: And agents' own verbs.
        self._agents_nc: NATS | None = None
        #: And the agents' answers to the requests this hub sends them, each namespace's on
        #: one of these (``hub/_reply_boxes.py``); the requests leave on it too.
        self._reply_ncs: list[NATS | None] = [None] * REPLY_CONNECTIONS
        #: Keeps them all on the main one's server after reconnections (``_nats_together``).
        self.together = Together(self.hub_id)
        self._js: JetStreamContext | None = None
        self._subs: list[Subscription] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self._sem = asyncio.Semaphore(self.settings.hub_concurrency)
        # Proxy attempts awaiting their agent's reply, by reply token; their deadlines in a
        # heap (entries of answered attempts are dropped lazily); routes not yet answered.
        self._flights = {}
        self._held = {}
        self._deadlines: list[tuple[float, str]] = []
        self._sweep_wake = asyncio.Event()
        # Attempts decided in this pass of the event loop, per agent, and batches already full;
        # one task sends them all when the pass ends.
        self._outboxes = {}
        # The agent each task id was routed to, this hub's and its peers' (``hub/_pins.py``).
        self._pins = TaskPins()
        self._pins_replayed_at = -1e9
        # Resent tasks whose holder this hub is asking for (``hub/_holders.py``).
        self._seeking = 0
        self._seeking_by_ns: dict[str, int] = {}
        self._pin_waits: dict[tuple[str, str], list[asyncio.Future[str]]] = {}
        self._back_waits: dict[str, list[asyncio.Future[None]]] = {}
        # Expired attempts awaiting this hub's marker before they are charged (``_lateness.py``).
        self._late = {}
        self._late_by_ns = {}
        self._late_swept = []
        self._markers = {}
        self._full = []
        # Answers to route requests that came in batches (made once connected).
        self._answers: AnswerBatcher
        self._sender: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        #: Deletes the consumers that push outside every inbox (``_push_sweep.py``).
        self._push_sweep: asyncio.Task[None] | None = None
        self._loop_watch: asyncio.Task[None] | None = None
        # Routes asked in this process (``route``) awaiting their answer, by reply token.
        self._local = {}
        self._local_ids = itertools.count()
        s = self.settings
        self._route_throttle = Throttle(s.route_rate, s.route_burst)
        self._ns_flights = Shares(s.hub_concurrency)
        self._no_match_lines = LineBudget(10.0)
        self._timeout_lines = LineBudget(10.0)
        self._unreached_lines = LineBudget(10.0)
        self._slow_lines = LineBudget(10.0)
        self._rejected_lines = LineBudget(30.0)
        self._register_throttle = Throttle(s.register_rate, s.register_burst)
        self._agent_register_throttle = Throttle(1.0, 10.0)
        self._workflow_view_throttle = Throttle(VIEW_RATE, 2 * VIEW_RATE)
        self._views_running = {False: ViewSlots(), True: ViewSlots()}
        self._cancels_running = {False: ViewSlots(), True: ViewSlots()}
        self._record_reads = 0
        self._record_reads_by_ns: dict[str, int] = {}
        self._cancel_repeats = Repeats()
        self._unregister_repeats = Repeats()
        self._owner_lines = LineBudget(60.0)
        self._pinging: set[str] = set()
        #: A JetStream outage fails every control message (each heartbeat writes KV): one
        #: line per verb per 10 s, with the count held back.
        self._outage_lines = LineBudget(10.0)
        #: Answers that could not be sent (too large, or NATS refused the publish): one line
        #: per verb and reason per 10 s.
        self._answer_lines = LineBudget(10.0)
        #: Malformed lines of route batches (anyone in a namespace may send them): one line
        #: per subject per 10 s.
        self._malformed_lines = LineBudget(10.0)
        self.metrics = HubMetrics()
        connection_metrics(self.metrics.registry, lambda: connection_counts(self._connections))
        together_metrics(
            self.metrics.registry,
            lambda: (self.together.servers(), self.together.apart(), self.together.moves),
        )
        # Labelled metric children by label values: Counter.labels() costs a lock and a dict
        # build per call, on every request.
        self._task_counters: dict[tuple[str, str, str], Any] = {}
        self._duration_children: dict[str, Any] = {}
        self._series_made: dict[str, list[str]] = {}
        self._capability_series = self.settings.metrics_capability_series
        self._route_seconds = self.metrics.route_duration_seconds
        self._accepted_seconds = self.metrics.delivered_to_accepted_seconds
        # Namespaces already validated (bounded: cleared when it grows past any real fleet).
        self._namespaces: dict[str, str] = {}
        #: Namespaces with metric series but no agent here (and not configured): since when
        #: (monotonic), until their series are forgotten (``forget_gone_namespaces``).
        self._series_orphaned: dict[str, float] = {}
        # Namespaces that exist without an agent: metrics and audit are kept only for these and
        # the registry's (bounded cardinality: what exists, not what callers type).
        self._configured = frozenset((s.namespace, *s.namespaces))
        self.registry: Registry
        self.router: Router
        self.sessions: SessionStore
        self.audit: AuditLog
        self.http: Any = None  # reach_mesh.hub.http.HubHttp when settings.http_port is set
        self.micro: Any = None  # the nats.micro Service ($SRV.PING/INFO/STATS), once started
        self.workflows: WorkflowEngine | None = None
        #: The JetStream streams, buckets and consumers of its parts, created again when gone.
        self.resources: Resources | None = None
        #: The dashboard's bounded state (samples, recent decisions, workflows): with HTTP only.
        self.dashboard: Dashboard | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("hub is not started")
        return self._nc

    async def start(self) -> None:
        if self.state is not HubState.NEW:
            raise RuntimeError(f"hub cannot start from state {self.state.value}")
        self.state = HubState.RUNNING
        tracing_from_env(HUB_SERVICE_NAME)  # OTEL_TRACES_EXPORTER, if the process set none up
        # What the start imports late, imported before the hub joins anything: the HTTP app
        # (FastAPI, MCP, A2A) takes 1-3 s of CPU to import, which blocked the loop of a hub
        # already taking heartbeats, registrations and workflows — and, seen by the lag
        # watch below, fired ReachEventLoopStalls after every hub start.
        if self.settings.http_port is not None:
            importlib.import_module("reach_mesh.hub.http")
        importlib.import_module("reach_mesh.hub._micro")
        self._loop_watch = asyncio.create_task(
            watch_event_loop(self.metrics.event_loop_lag_seconds), name="reach-loop-lag"
        )
        # Its JetStream setup is asked again through an election or an outage, for up to
        # start_timeout: six chaos runs lost a hub that exited at start on one unanswered
        # request (``_starting``).
        with starting(f"hub {self.hub_id}", self.settings.start_timeout) as setup:
            await self._start(setup)
        log.info("hub %s serving on %s", self.hub_id, shown(self.nats_url))

    async def _start(self, setup: Starting) -> None:
        try:
            # A server whose port answers but that is slow to take the connection (busy,
            # frozen for a moment) is waited on for the rest of start_timeout, as an agent's.
            self._nc = await connect(
                self.nats_url,
                name=self.hub_id,
                settings=self.settings,
                patience=time_to_start(0.0),
                on_reconnect=self._back_on_nats,
                **self.together.options("main"),
            )
            self.together.add("main", self._nc)
            setup.watch(self._nc)  # (its JetStream requests: refused ones end the start)
            # Every namespace's route requests on a connection of their own: a flood of them
            # that this hub cannot read as fast has nats-server cut that connection (a slow
            # consumer: 64 MiB waiting), not the one that carries the agents' heartbeats and
            # the KV writes — a caller's flood once cut that one, and every tenant's agents
            # went SUSPECT. Answers leave on the main connection.
            # Both on the main connection's server: a hub on one side of a partition between
            # servers, not on both (``beside``); and there again after reconnections
            # (``together``).
            self._route_nc = await connect(
                self.nats_url,
                name=f"{self.hub_id}-routes",
                settings=self.settings,
                patience=time_to_start(0.0),
                **beside(self._nc, self.nats_url),
                **self.together.options("routes"),
            )
            self.together.add("routes", self._route_nc)
            # And every agent's status events (workflow steps) on a third: an agent may publish
            # on its own status subject as much as it likes (once 250 statuses of 6 MiB in 8 s
            # had this hub's main connection cut six times). Missed while it is cut, a step's
            # statuses are read from REACH_STATUS once it is back (``StatusTracker.after_gap``),
            # and before the hub decides a TIMEOUT itself (``missed_final``).
            self._status_nc = await connect(
                self.nats_url,
                name=f"{self.hub_id}-statuses",
                settings=self.settings,
                patience=time_to_start(0.0),
                **beside(self._nc, self.nats_url),
                **self.together.options("statuses"),
            )
            self.together.add("statuses", self._status_nc)
            # And a fourth for the verbs agents send a hub on subjects of their own (register,
            # heartbeat, unregister, record); their answers to proxied tasks and to this hub's
            # asks come on the reply connections below. A flood of tiny messages on any of
            # them once cut the main connection, and with it every tenant's KV watches and
            # pulls. The routes' connection likewise takes every subject a caller or an
            # operator may send to (``_subscribe``).
            self._agents_nc = await connect(
                self.nats_url,
                name=f"{self.hub_id}-agents",
                settings=self.settings,
                patience=time_to_start(0.0),
                **beside(self._nc, self.nats_url),
                **self.together.options("agents"),
            )
            self.together.add("agents", self._agents_nc)
            self._js = self._nc.jetstream(timeout=10.0)
            s = self.settings
            self.audit = AuditLog(
                self._nc,
                self._js,
                self.hub_id,
                max_age=s.audit_max_age,
                max_bytes=s.audit_max_bytes,
                replicas=s.kv_replicas,
                enabled=s.audit_enabled,
            )
            await self.audit.start()
            self.resources = Resources(self._js, counted=self.metrics.recreated_total.inc)
            # Agents answer on their namespace's own reply subjects, read on one of
            # REPLY_CONNECTIONS connections of their own, which the attempts and asks of that
            # namespace leave on (``hub/_reply_boxes.py``): a namespace flooding its reply
            # subjects faster than this hub reads them backs up in that connection's socket
            # alone — not ahead of the heartbeats, nor of the other connections' namespaces.
            for i in range(REPLY_CONNECTIONS):
                name = f"replies-{i}"
                reply_nc = await connect(
                    self.nats_url,
                    name=f"{self.hub_id}-{name}",
                    settings=self.settings,
                    patience=time_to_start(0.0),
                    on_reconnect=partial(self._back_on_replies, i),
                    **beside(self._nc, self.nats_url),
                    **self.together.options(name),
                )
                self._reply_ncs[i] = reply_nc
                self.together.add(name, reply_nc)
            self._replies = ReplyBoxes(
                [nc for nc in self._reply_ncs if nc is not None],
                self._on_agent_reply,
                self._reply_namespaces_in_use,
            )
            self.registry = Registry(
                self._nc,
                self._js,
                self.settings,
                resources=self.resources,
                asks_nc=self._agents_nc,
                agent_asks=self._replies,
            )
            self.registry.on_state_change(self._on_state_change)
            self.registry.on_state_change(self._holder_state)
            await self.registry.start()
            self.sessions = SessionStore(
                self._nc, self._js, ttl=s.sticky_ttl, replicas=s.kv_replicas
            )
            await self.sessions.start()
            self.resources.add([f"KV_{protocol.KV_SESSIONS}"], self.sessions.ensure_bucket)
            self.router = Router(self.registry, self.settings, self.hub_id)
            await self._subscribe()
            # Durable workflows: after the registry and router, which the engine routes with.
            self.workflows = WorkflowEngine(
                self._nc,
                self._js,
                self.registry,
                self.router,
                s,
                self.hub_id,
                metrics=self.metrics,
                known_namespace=self.known_namespace,
                resources=self.resources,
                status_nc=self._status_nc,
            )
            await self.workflows.start()
            self.resources.start()
            js = self._js
            # The streams and buckets may predate this hub's workflow_retention.
            await set_up(
                "the streams' max age (workflow_retention)",
                lambda: apply_workflow_retention(js, s),
            )
            # And they may predate its kv_replicas (a mesh begun on one server).
            await set_up("the streams' replicas (kv_replicas)", lambda: apply_replicas(js, s))
            if s.http_port is not None:
                self.dashboard = Dashboard(self)
                await self.dashboard.start()
                from reach_mesh.hub.http import HubHttp

                self.http = HubHttp(self)
                await self.http.start(s.http_host, s.http_port)
            from reach_mesh.hub._micro import start_micro

            self.micro = await start_micro(self)
            # Every subscription above (the micro service's last) is the server's before this
            # hub says it serves: not promised by nc.flush() alone, whose PING nats-py sends
            # ahead of SUBs still queued (``flushed``).
            for nc in self._connections.values():
                assert nc is not None
                await flushed(nc)
            # Listening for pins now: ask for those made before this hub started.
            await self._ask_pins()
            self.together.start()
        except BaseException:
            await self.close()
            raise

    async def _subscribe(self) -> None:
        q = protocol.HUB_QUEUE
        assert self._route_nc is not None and self._agents_nc is not None
        agents_nc, route_nc = self._agents_nc, self._route_nc
        # Who may publish on a subject decides the connection it is read on: agents (their own
        # verbs), callers and operators (the routes'), hubs only (their peer subjects: the
        # main one) — a flood cuts the connection of its kind, never the main one (``_start``).
        table: list[tuple[str, Handler, NATS]] = [
            # An agent's own verbs, on subjects naming it (NATS permissions bind them to it).
            (protocol.hub_agent_subject("*.*.*", "register"), self._on_register, agents_nc),
            (protocol.hub_agent_subject("*.*.*", "heartbeat"), self._on_heartbeat, agents_nc),
            (protocol.hub_agent_subject("*.*.*", "unregister"), self._on_unregister, agents_nc),
            (protocol.hub_agent_subject("*.*.*", "record"), self._on_record, agents_nc),
            (protocol.hub_subject("*", "agents"), self._on_agents, route_nc),
            (protocol.hub_subject("*", "admin"), self._on_admin, route_nc),
            (protocol.hub_subject("*", "workflow"), self._on_workflow, route_nc),
            (protocol.hub_subject("*", "workflows"), self._on_workflows, route_nc),
            # Asked by another hub, about a workflow this one owns (a subject of its own).
            (protocol.hub_peer("*", "workflow", self.hub_id), self._on_peer_workflow, self.nc),
            (protocol.hub_subject("*", "cancel"), self._on_cancel, route_nc),
            (protocol.hub_peer("*", "cancel", self.hub_id), self._on_peer_cancel, self.nc),
        ]
        for subject, handler, nc in table:
            cb = guarded(subject, self._dispatcher(handler))
            sub = await nc.subscribe(subject, queue=q, cb=cb, pending_msgs_limit=-1)
            self._subs.append(sub)
        self._answers = AnswerBatcher(self.nc)
        self._sweeper = asyncio.create_task(self._sweep_deadlines())
        self._push_sweep = asyncio.create_task(sweep_forever(self.nc.jetstream()))
        for verb, on_route in (
            ("route", self._on_route_msg),
            ("route_batch", self._on_route_batch),
        ):
            subject = protocol.hub_subject("*", verb)
            cb = guarded(subject, on_route)
            self._subs.append(
                await self._route_nc.subscribe(subject, queue=q, cb=cb, pending_msgs_limit=-1)
            )
        # Failure reports go to every hub (no queue group): each keeps its own breakers. Callers
        # send them (the routes' connection). An operator's quarantine / release, and the pins
        # of the tasks a hub routed, come from a hub, on subjects only hubs publish to.
        subject = protocol.hub_subject("*", "report")
        cb = guarded(subject, self._on_report, answers=False)  # nothing answers these
        self._subs.append(await route_nc.subscribe(subject, cb=cb))
        for subject, on_msg in (
            (protocol.hub_broadcast("*", "breaker"), self._on_breaker),
            (protocol.hub_broadcast("*", "pins"), self._on_pins),
            (protocol.hub_broadcast("*", "pins_ask"), self._on_pins_ask),
        ):
            cb = guarded(subject, on_msg, answers=False)  # nothing answers these
            self._subs.append(await self.nc.subscribe(subject, cb=cb))
        # Which agent a resent task went to, asked by a hub that has no pin for it.
        subject = protocol.hub_broadcast("*", "pin_of")
        self._subs.append(await self.nc.subscribe(subject, cb=guarded(subject, self._on_pin_of)))

    def _back_on_nats(self) -> None:
        """The main connection is back: send again the attempts still waiting for their
        agents' answers (lost meanwhile), and ask the other hubs again for their pins — those
        they made while this hub was away never reached it, and a retry of one of those tasks
        that reaches it now must go to the agent that has it (``hub/_pins.py``)."""
        self._spawn(self._ask_agents_again())
        self._spawn(self._ask_pins())

    def _back_on_replies(self, i: int) -> None:
        """Reply connection ``i`` is back: the answers to the attempts sent on it may have
        been lost meanwhile (``_ask_agents_again``)."""
        self._spawn(self._ask_agents_again(self._reply_ncs[i]))

    def _reply_namespaces_in_use(self) -> set[str]:
        """The namespaces whose reply subjects this hub still needs (``ReplyBoxes``): those
        with a registered agent, and those an attempt waits on (sent, or about to be), an
        expired attempt awaits its marker on, or a marker is out on."""
        used = {protocol.namespace_of(agent_id) for agent_id in self.registry.agents}
        for flight in self._flights.values():
            if flight.replies is not None:
                used.add(flight.replies.ns)
        used.update(p.flight.replies.ns for p in self._late.values() if p.flight.replies)
        used.update(m.replies.ns for m in self._markers.values())
        used.update(r.ns for r in self._late_swept)
        used.update(box.replies.ns for box in self._outboxes.values())
        used.update(box.replies.ns for box in self._full)
        return used

    @property
    def _connections(self) -> dict[str, NATS | None]:
        """The hub's NATS connections by the name its metrics give them: the main one,
        routes', statuses', agents', and the agents' replies' (``start``)."""
        return {
            "main": self._nc,
            "routes": self._route_nc,
            "statuses": self._status_nc,
            "agents": self._agents_nc,
            **{f"replies-{i}": nc for i, nc in enumerate(self._reply_ncs)},
        }

    @property
    def route_nc(self) -> NATS:
        """The connection callers' and operators' requests come in on (``_subscribe``)."""
        if self._route_nc is None:
            raise RuntimeError("hub is not started")
        return self._route_nc

    @property
    def status_nc(self) -> NATS:
        """The connection status events come in on."""
        if self._status_nc is None:
            raise RuntimeError("hub is not started")
        return self._status_nc

    @property
    def nats_connected(self) -> bool:
        """Whether all of the hub's NATS connections are up (callers' requests, status
        events and what else agents send come on ones of their own: ``start``)."""
        return all(nc is not None and nc.is_connected for nc in self._connections.values())

    @property
    def routing(self) -> int:
        """Route requests taken and not answered yet."""
        return self._ns_flights.total

    @property
    def http_url(self) -> str | None:
        """Base URL of this hub's HTTP endpoints (metrics, REST, dashboard), if enabled."""
        return None if self.http is None else str(self.http.url)

    async def _end_held(self) -> None:
        """End the routes waiting for an agent that may be reconnecting: unavailable, so the
        SDK asks another hub with the same task id (nothing was sent to the agent)."""
        held, self._held = self._held, {}
        for flight, timer in held.values():
            timer.cancel()
            with contextlib.suppress(Exception):
                await self._finish(
                    flight,
                    error=MeshUnavailableError(
                        f"hub {self.hub_id} stopped while task {flight.task_id} waited for "
                        "its agent: retry with the same task_id"
                    ),
                )

    async def close(self) -> None:
        """Stop taking requests, finish in-flight ones, drain the connection. Idempotent."""
        if self.state in (HubState.CLOSING, HubState.CLOSED):
            return
        self.state = HubState.CLOSING
        self.together.stop()
        if self.micro is not None:
            await within("micro service stop", self.micro.stop(), 2.0, log)
        for sub in self._subs:
            await within("unsubscribe", sub.unsubscribe(), 2.0, log)
        self._subs = []
        if self.http is not None:
            await within("HTTP server close", self.http.close(), 5.0, log)
        if self.dashboard is not None:
            await within("dashboard close", self.dashboard.close(), 2.0, log)
        if self.resources is not None:
            self.resources.stop()
        if self.workflows is not None:
            # Hand running workflows back (nak) so another hub resumes them at once.
            await within("workflow engine stop", self.workflows.stop(), 10.0, log)
        # Routes in flight get their answers (or their deadline) for up to 5 s; those waiting
        # for an agent that may be reconnecting (nothing sent to it) end at once, as do those
        # that start waiting meanwhile.
        for _ in range(500):
            if self._held:
                await self._end_held()
            if not self._inflight and self._ns_flights.total <= 0:
                break
            await asyncio.sleep(0.01)
        for task in self._inflight:
            task.cancel()
        await self._end_held()  # (held again meanwhile)
        # Those still waiting for their agent end now, told so (counted, audited, their spans
        # ended): not left to their callers' timeouts once this hub's connection is gone.
        # Unavailable, so the SDK asks another hub with the same task id (the agent's
        # idempotency table joins the run in hand).
        for token in list(self._flights):
            flight = self._flights.pop(token, None)
            if flight is None or flight.finished:
                continue
            err = MeshUnavailableError(
                f"hub {self.hub_id} stopped while task {flight.task_id} was with its agent: "
                "retry with the same task_id"
            )
            self._end_deliver(flight, err)
            with contextlib.suppress(Exception):
                await self._finish(flight, error=err)
        if self._sweeper is not None:
            self._sweeper.cancel()
            await within("route sweeper", self._sweeper, 2.0, log)
        if self._push_sweep is not None:
            self._push_sweep.cancel()
            await within("push consumer sweep", self._push_sweep, 2.0, log)
        self._forget_late()
        if self._loop_watch is not None:
            self._loop_watch.cancel()
            await within("event loop watch", self._loop_watch, 2.0, log)
        if hasattr(self, "registry"):
            await within("registry stop", self.registry.stop(), 5.0, log)
        if hasattr(self, "audit"):
            # Buffered events go out before the drain.
            await within("audit flush", self.audit.close(), 5.0, log)
        if hasattr(self, "_answers"):
            await within("answer flush", self._answers.flush(), 5.0, log)
        for nc in (*self._reply_ncs, self._agents_nc, self._status_nc, self._route_nc, self._nc):
            if nc is not None:
                await within("NATS drain", nc.drain(), 5.0, log)
                await within("NATS close", nc.close(), 5.0, log)
        self.state = HubState.CLOSED

    async def __aenter__(self) -> Hub:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ dispatch

    async def route(
        self, data: bytes, namespace: str, headers: dict[str, str] | None = None
    ) -> bytes:
        """Route one ``RouteRequest`` (its JSON) as this hub routes one that came on
        ``reach.hub.<namespace>.route`` with trace ``headers``, and return the answer: a
        ``RouteReply`` or an error body, as bytes. For this hub's HTTP faces (REST, MCP, A2A):
        the hub that took the request routes it, with no NATS round trip to a hub and back."""
        if self.state is not HubState.RUNNING:
            raise MeshUnavailableError(f"hub {self.hub_id} is {self.state.value}")
        return await self._route_local(data, namespace, headers)

    def _dispatcher(self, handler: Handler) -> Callable[[Msg], Awaitable[None]]:
        async def on_msg(msg: Msg) -> None:
            await self._sem.acquire()  # full: stop reading, NATS buffers the rest
            task = asyncio.create_task(self._serve(msg, handler))
            self._inflight.add(task)
            task.add_done_callback(self._done)

        return on_msg

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._sem.release()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task the hub waits for when it closes."""
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    def _namespace(self, subject: str) -> str:
        """The namespace token of ``reach.hub.<ns>.<verb>``, validated (and remembered, if it
        exists: callers' made-up namespaces must not grow this hub's memory)."""
        ns = subject.split(".", 3)[2]
        kept = self._namespaces.get(ns)
        if kept is not None:
            # The one copy this hub keeps: what remembers it per task (pins: up to 100,000
            # each of its own and its peers') shares it instead of holding one per request.
            return kept
        protocol.validate_namespace(ns)
        if self.known_namespace(ns):
            if len(self._namespaces) > 10_000:
                self._namespaces.clear()
            self._namespaces[ns] = ns
        return ns

    def forget_gone_namespaces(self) -> None:
        """Forget the metric series of namespaces with no agent on this hub (and not
        configured) for ``NAMESPACE_SERIES_KEPT``: else every namespace that ever had an agent
        here keeps its series for the hub's life. Called at each scrape (``/metrics``). A
        namespace that comes back starts from 0, which ``rate()`` and ``increase()`` read as a
        counter reset."""
        now = asyncio.get_running_loop().time()
        orphaned = self._series_orphaned
        present = self.metrics.namespaces()
        for ns in list(orphaned):
            if ns not in present:
                del orphaned[ns]
        for ns in present:
            if ns == UNKNOWN_NAMESPACE or self.known_namespace(ns):
                orphaned.pop(ns, None)
            elif now - orphaned.setdefault(ns, now) >= NAMESPACE_SERIES_KEPT:
                del orphaned[ns]
                self.metrics.forget_namespace(ns)
                for key in [k for k in self._task_counters if k[0] == ns]:
                    del self._task_counters[key]  # (a child no longer exported)

    @property
    def configured_namespaces(self) -> frozenset[str]:
        """``namespace`` and ``namespaces`` of the settings: known with no agent too."""
        return self._configured

    def known_namespace(self, ns: str) -> bool:
        """Whether ``ns`` exists: configured (``namespace``, ``namespaces``) or holding a
        registered agent. Only these get metric series and audit subjects."""
        return ns in self._configured or self.registry.has_namespace(ns)

    def error_body(self, subject: str, err: Exception) -> bytes:
        """The answer to a request on ``subject`` that ended with ``err``: a typed error as it
        is; NATS / JetStream trouble ``REACH_UNAVAILABLE`` (briefly unavailable, e.g. a raft
        election after a node loss: retryable; logged one line per verb per 10 s; a full
        store says so); anything
        else ``REACH_INTERNAL``, logged with its traceback."""
        if isinstance(err, ReachError):
            return protocol.encode_error(err)
        if isinstance(err, nats.errors.Error):
            verb = subject.rsplit(".", 1)[-1]
            said = describe(err)
            self._outage_lines.warn(log, verb, "NATS/JetStream error on %s: %s", subject, said)
            if storage_full(err):
                return protocol.encode_error(MeshUnavailableError(f"{said}; retry once made room"))
            return protocol.encode_error(
                MeshUnavailableError(f"JetStream unavailable, retry: {type(err).__name__}")
            )
        log.error("internal error on %s", subject, exc_info=err)
        return protocol.encode_error(InternalError(f"internal error: {type(err).__name__}"))

    async def _serve(self, msg: Msg, handler: Handler) -> None:
        try:
            ns = self._namespace(msg.subject)
            body = await handler(msg, ns)
        except Exception as err:  # the hub never crashes on input
            body = self.error_body(msg.subject, err)
        if body is not None and msg.reply:
            await self.answer(msg.subject, msg.reply, body)

    async def answer(self, subject: str, reply: str, body: bytes) -> None:
        """Publish ``body``, the answer to a request on ``subject``, to ``reply``
        (:meth:`sendable`). A publish NATS refuses (connection closed, draining, reconnecting
        with its buffer full) is logged, one line per verb per 10 s — the asker times out and
        asks again; anything else is a bug, logged with its traceback."""
        try:
            await self.nc.publish(reply, self.sendable(subject, body))
        except nats.errors.Error as err:
            if self.state is HubState.RUNNING:
                verb = subject.rsplit(".", 1)[-1]
                self._answer_lines.warn(
                    log, ("lost", verb), "could not answer %s: %s", subject, describe(err)
                )
        except Exception:
            log.exception("could not answer %s", subject)

    def sendable(self, subject: str, body: bytes) -> bytes:
        """``body``, the answer to a request on ``subject``, if one NATS message carries it.
        One larger than the connection's ``max_payload`` (nats-server: 1 MiB by default)
        cannot be sent: the asker gets ``REACH_PAYLOAD_TOO_LARGE`` saying so instead of
        waiting out its timeout, and the hub logs a WARNING (one line per verb per 10 s)."""
        most = self.nc.max_payload
        if len(body) <= most:
            return body
        self._answer_lines.warn(
            log,
            ("large", subject.rsplit(".", 1)[-1]),
            "answer of %d bytes to %s exceeds NATS max_payload (%d bytes): answered "
            "REACH_PAYLOAD_TOO_LARGE instead",
            len(body),
            subject,
            most,
        )
        return protocol.encode_error(
            PayloadTooLargeError(
                f"the answer to {subject} is {len(body):,} bytes, over this NATS server's "
                f"max_payload of {most:,} bytes: ask for less (a fleet query: limit, offset, "
                "state, capability; a workflow list: limit, state, since_s), or raise "
                "max_payload in nats-server's configuration",
                size=len(body),
                max_size=most,
                subject=subject,
            )
        )
