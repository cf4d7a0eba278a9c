"""The agent SDK: register, heartbeat under a lease, serve handlers with bounded concurrency,
keep recent results for idempotency, drain gracefully; count what it handled (``/metrics``).

This module holds the agent's state, handler registration and lifecycle (register, heartbeat,
drain). ``Agent`` takes its standing with the hubs (the replacement check after a silence,
whether its lease is surely held) from :class:`~reach_mesh.agent._identity.IdentityMixin`; its
serving path (tasks and batches, handler slots, idempotency, answers, the control subject) from
:class:`~reach_mesh.agent._serving.ServingMixin`; and the running of one handler attempt
(payload, deadline, result checks, failures, metrics) from its base
:class:`~reach_mesh.agent._attempts.AttemptsMixin`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import random
import sys
import time
import typing
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Final, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import TypeAdapter, ValidationError

from reach_mesh import protocol
from reach_mesh._asgi import AsgiServer
from reach_mesh._batch import AnswerBatcher, inbox_prefix
from reach_mesh._guard import guarded
from reach_mesh._nats import (
    connect,
    connection_counts,
    flushed,
    refusals_of,
    refused_first,
    refused_since,
    shown,
)
from reach_mesh._nats_asking import Reconnected, hedged_request, or_reconnected
from reach_mesh._shutdown import within
from reach_mesh.agent._attempts import _TRACEBACK_INTERVAL
from reach_mesh.agent._deadlines import _Deadlines
from reach_mesh.agent._goodbye import unregister
from reach_mesh.agent._identity import IdentityMixin
from reach_mesh.agent._one_process import wait_for_other_process
from reach_mesh.agent._results import _bare, _handler_signature, _labels, _tool_spec
from reach_mesh.agent._serving import AgentStatus, ServingMixin, _Handler
from reach_mesh.agent._table import Results
from reach_mesh.agent._task import Task
from reach_mesh.agent._work import WorkConsumer
from reach_mesh.config import MeshSettings, load_settings
from reach_mesh.errors import (
    BadRequestError,
    InvalidCapabilityError,
    MeshUnavailableError,
    NotPermittedError,
    ReachError,
    ThrottledError,
    UnknownAgentError,
)
from reach_mesh.logs import SUBSCRIPTION_REFUSED, LineBudget, log_event
from reach_mesh.models import (
    AgentCard,
    AgentState,
    Heartbeat,
    HeartbeatReply,
    RegisterReply,
    RegisterRequest,
    ToolSpec,
)
from reach_mesh.tracing import flush_tracing, tracing_from_env
from reach_mesh.tracing.metrics import (
    AgentMetrics,
    connection_metrics,
    serve_metrics,
    watch_event_loop,
)

__all__ = ["Agent", "AgentStatus"]

log = logging.getLogger("reach_mesh.agent")

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

_AGENT_QUEUE: Final = "reach-agent"
#: Tries of one heartbeat, each waiting ``heartbeat_interval / (2 * _BEAT_TRIES)`` for its
#: answer: the hubs' queue group may hand a beat to a hub that is paused (a long GC pause, a
#: stalled VM) or gone without a word, and that hub neither answers nor tells the others. Sent
#: again at once, the beat most likely reaches another hub, and a beat that found no hub in all
#: its tries still leaves the lease (at least 3 intervals) a whole interval to spare.
_BEAT_TRIES: Final = 3
#: A registration not answered within this long is sent again, to whichever hub the queue
#: group picks, while the earlier tries are still awaited (``_nats_asking.hedged_request``): a hub
#: registers an agent in a few milliseconds, or in seconds while JetStream elects a leader.
_REGISTER_HEDGE: Final = 1.0
#: At most this many tries of one registration request (``hedged_request``'s ``most``).
_REGISTER_TRIES: Final = 3
#: Seconds an agent starting keeps trying to connect to a NATS server whose port answers, and
#: to register with a hub, before ``start()`` gives up (``connect_timeout`` when longer).
_PATIENCE: Final = 30.0


def _not_later(msg: Msg) -> bool:
    """Whether a hub's answer to a registration ends its hedged tries: anything but "later"
    (throttled, JetStream unavailable), which another try still out may better."""
    try:
        protocol.raise_for_error(msg.data)
    except (ThrottledError, MeshUnavailableError):
        return False
    except Exception:
        return True
    return True


class _Unconfirmed(MeshUnavailableError):
    """A registration try not sent: after a silence, nobody could be asked whether another
    process serves the id (cut off from NATS)."""


class Agent(IdentityMixin, ServingMixin):
    """An agent on the mesh.

    ::

        agent = Agent("finance.query.a1", labels={"region": "cn-east"}, nats_url=url)

        @agent.handler("data:query:v1")
        async def query(task: Task[QueryIn]) -> QueryOut: ...

        async with agent:
            await agent.wait_closed()

    ``metrics_port`` serves the agent's own Prometheus ``GET /metrics`` (0 = any free port,
    see :attr:`metrics_url`); the counters in :attr:`metrics` are kept either way.
    ``durable_work=False`` skips the JetStream work consumer: the agent serves request-reply
    tasks only and hubs do not offer it workflow steps (one consumer and an idle pull every few
    seconds per agent add up in a large fleet that never runs workflows).
    """

    def __init__(
        self,
        agent_id: str,
        capabilities: Iterable[str] = (),
        labels: Mapping[str, str | int | float | bool] | None = None,
        *,
        nats_url: str | None = None,
        max_concurrency: int = 16,
        max_queue: int | None = None,
        weight: float = 1.0,
        region: str | None = None,
        zone: str | None = None,
        tools: Iterable[ToolSpec] = (),
        metadata: Mapping[str, Any] | None = None,
        version: str | None = None,
        settings: MeshSettings | None = None,
        drain_timeout: float = 30.0,
        durable_work: bool = True,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        protocol.validate_agent_id(agent_id)
        self.agent_id = agent_id
        self.namespace = protocol.namespace_of(agent_id)
        self._capabilities = {protocol.validate_capability(c) for c in capabilities}
        self._labels = _labels(agent_id, labels or {})
        self.settings = settings or load_settings(nats_url=nats_url)
        self.nats_url = nats_url or self.settings.nats_url
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int):
            raise BadRequestError(f"max_concurrency must be an integer, not {max_concurrency!r}")
        if max_concurrency < 1:
            raise BadRequestError("max_concurrency must be >= 1")
        if max_queue is not None and (
            isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0
        ):
            raise BadRequestError(f"max_queue must be an integer >= 0, not {max_queue!r}")
        self.max_concurrency = max_concurrency
        #: Tasks that may wait for a slot; beyond that the agent answers REACH_AGENT_BUSY.
        self.max_queue = max_concurrency if max_queue is None else max_queue
        self._weight = weight
        self._region = region
        self._zone = zone
        self._tools = list(tools)
        self._metadata = dict(metadata or {})
        self._version = version
        self.drain_timeout = drain_timeout
        #: Whether this agent takes durable workflow steps (a JetStream work consumer).
        self.durable_work = durable_work
        self._metrics_port = metrics_port
        self._metrics_host = metrics_host
        self._metrics_server: AsgiServer | None = None
        #: Always kept (a few counter increments per task); served only with ``metrics_port``.
        self.metrics = AgentMetrics(self.agent_id, self.namespace)
        # Read at scrape time: no bookkeeping on the hot path, and never out of step.
        self.metrics.inflight.set_function(lambda: self._running)
        self._handlers: dict[str, _Handler] = {}
        self.status = AgentStatus.NEW
        self.session = uuid.uuid4().hex
        self.unavailable: set[str] = set()
        self.pressure = 0.0
        self.state: AgentState | None = None
        #: Cordoned by an operator, by the word of the hub that last answered a registration
        #: or heartbeat (``HeartbeatReply.cordoned``): new task ids are refused meanwhile.
        self.cordoned = False
        self._nc: NATS | None = None
        # Its own connection's (a hub in the same process exports the hub's).
        connection_metrics(self.metrics.registry, lambda: connection_counts({"main": self._nc}))
        self._subs: list[Subscription] = []
        self._task_subject = protocol.agent_task(agent_id)
        self._max_envelope = self.settings.max_payload + 16 * 1024
        # Constant middle of every SUCCEEDED reply (agent_id is a validated token).
        self._succeeded = f',"agent_id":"{agent_id}","state":"SUCCEEDED"'.encode()
        # Labelled metric children by capability / (capability, state): labels() costs more
        # than the increment it is for (typed in AttemptsMixin).
        self._durations = {}
        self._succeeded_total = {}
        self._counters = {}
        self._abandoned = set()
        self._deadlines = _Deadlines(self.settings.handler_abandon_grace)
        self._tracebacks = LineBudget(_TRACEBACK_INTERVAL)
        self._malformed_lines = LineBudget(_TRACEBACK_INTERVAL)
        #: Handler slots taken (of ``max_concurrency``), and the tasks waiting for one.
        self._running = 0
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._waiting = 0
        self._copies = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._results = Results()
        # Answers to attempts that came in batches (made once connected).
        self._answers: AnswerBatcher
        self._hb_task: asyncio.Task[None] | None = None
        self._loop_watch: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._registered = asyncio.Event()
        #: Why the agent stopped on its own (None: it did not): NATS took away one of its own
        #: subscriptions while it ran (``_on_refused``). ``serve()`` ends with it.
        self.fault: ReachError | None = None
        self._faulted = asyncio.Event()
        self._stopping: asyncio.Task[None] | None = None
        #: When we sent the last registration or heartbeat a hub answered (monotonic; a
        #: pause counts): see ``in_touch``.
        self._answered_at = -math.inf
        #: When we last knew this process serves the id alone: the start check passed, a hub
        #: answered (as ``_answered_at``), or no other process answered our ctl ping
        #: (``confirm_identity``).
        self._heard_at = -math.inf
        #: Until when (monotonic) a step's fence is read only once the task records' leader
        #: says its replicas caught up: back from a silence the hubs may have given our
        #: attempts up in (``wary``), since when, until such a read (``caught_up``).
        self._wary_until = self._wary_since = -math.inf
        #: The heartbeat that brings us back in touch, one for all the steps waiting for it
        #: (``back_in_touch``).
        self._touching: asyncio.Future[bool] | None = None
        self._confirming: asyncio.Task[bool] | None = None
        #: Silence after which another process may serve the id (``may_be_replaced``).
        self._replaced_after = self.settings.lease_timeout + self.settings.suspect_timeout
        self.handled = 0
        #: Durable workflow steps over JetStream (``reach.work.<ns>.<agent_id>``).
        self.work: WorkConsumer | None = None

    # ------------------------------------------------------------------ handlers

    def handler(
        self, capability: str, *, tool: str | None = None, description: str | None = None
    ) -> Callable[[F], F]:
        """Register an ``async def handler(task: Task[Payload]) -> Result`` for a capability.

        Checked at decoration time: it must be ``async def`` with one parameter for the task
        (more are allowed if they have defaults, e.g. ``_x=x`` in a loop). The parameter's
        annotation says what the handler gets: ``Task[Payload]`` a :class:`Task` whose payload
        is validated with pydantic; ``Task`` or no annotation a :class:`Task` whose payload is
        the raw JSON value; any other type (``dict``, a model) the validated payload alone.
        Annotations are resolved where the handler is defined (module, enclosing function).

        ``tool="name"`` also publishes the handler as a tool (REST ``/api/tools``, MCP
        ``tools/list``): its parameters are the JSON Schema of the payload type, its
        description ``description`` or else the handler's docstring.
        """
        protocol.validate_capability(capability)
        if self.status is not AgentStatus.NEW:
            raise RuntimeError("add handlers before the agent starts")
        if tool is not None and any(t.name == tool for t in self._tools):
            raise ValueError(f"tool {tool!r} is declared twice")
        if capability in self._handlers:
            # The second replaced the first without a word (the careless-agent audit).
            raise ValueError(f"capability {capability} has a handler already")

        def decorate(fn: F) -> F:
            if not inspect.iscoroutinefunction(fn):
                raise TypeError(f"handler for {capability} must be an async def function")
            # Annotations are read where the handler was defined: its module, the enclosing
            # function's locals (a ``Task`` imported inside ``main()``), its closure.
            where = sys._getframe(1)
            bare, payload_type, ret = _handler_signature(fn, capability, where.f_locals)
            del where
            call: Callable[[Task[Any]], Awaitable[Any]] = fn
            if bare:
                call = _bare(fn)

            result_adapter = TypeAdapter(ret) if ret not in (None, Any, type(None)) else None
            payload_adapter: TypeAdapter[Any] = TypeAdapter(payload_type)
            if tool is not None:
                self._tools.append(
                    _tool_spec(tool, capability, payload_adapter, description or fn.__doc__)
                )
            self._handlers[capability] = _Handler(capability, call, payload_adapter, result_adapter)
            self._capabilities.add(capability)
            return typing.cast(F, fn)

        return decorate

    @property
    def capabilities(self) -> list[str]:
        """The capabilities this agent registers (listed ones plus those with a handler)."""
        return sorted(self._capabilities)

    @property
    def tools(self) -> list[ToolSpec]:
        """The tools this agent registers (given ones plus ``handler(..., tool=...)``)."""
        return list(self._tools)

    def serve_metrics(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve ``GET /metrics`` on ``host:port`` once started (0 = any free port): what
        ``metrics_port`` says, for an agent built elsewhere (``reach-mesh agent
        --metrics-port``). Before :meth:`start` only."""
        if self.status is not AgentStatus.NEW:
            raise RuntimeError(f"agent {self.agent_id} has started: set its metrics port before")
        self._metrics_port = port
        self._metrics_host = host

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` while the agent serves metrics, else None."""
        if self._metrics_server is None:
            return None
        return f"http://{self._metrics_host}:{self._metrics_server.port}/metrics"

    def card(self) -> AgentCard:
        """The :class:`AgentCard` this agent registers with."""
        return AgentCard(
            agent_id=self.agent_id,
            capabilities=self.capabilities,
            labels=self._labels,
            tools=self._tools,
            max_concurrency=self.max_concurrency,
            weight=self._weight,
            region=self._region,
            zone=self._zone,
            metadata=self._metadata,
            version=self._version,
            durable_work=self.durable_work,
            batch=True,
            work_batch=self.durable_work,
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def nc(self) -> NATS:
        """The agent's NATS connection (only while started)."""
        if self._nc is None:
            raise RuntimeError("agent is not started")
        return self._nc

    @property
    def inflight(self) -> int:
        """Handlers running now."""
        return self._running

    async def start(self) -> None:
        """Connect, wait while another live process serves this agent id
        (``agent/_one_process.py``), subscribe, register (retrying with backoff), start
        heartbeating."""
        if self.status is not AgentStatus.NEW:
            raise RuntimeError(f"agent cannot start from state {self.status.value}")
        if not self._capabilities:
            raise InvalidCapabilityError(
                f"agent {self.agent_id} has no capabilities: add a handler or list them"
            )
        try:
            self.card()  # over a limit (labels, tools, max_concurrency…): said before connecting
        except ValidationError as err:
            raise protocol.invalid(err, AgentCard) from err
        unserved = sorted(set(self._capabilities) - set(self._handlers))
        if unserved and self._handlers:
            # Routed to it, such a task is refused (REACH_NO_HANDLER) and goes elsewhere.
            log.warning(
                "agent %s lists capabilities it has no handler for: %s (its tasks are "
                "answered REACH_NO_HANDLER)",
                self.agent_id,
                ", ".join(unserved),
            )
        self.status = AgentStatus.RUNNING
        # OTEL_TRACES_EXPORTER honoured here too (not only by run() and the CLI); the service
        # is the agent id's middle token unless OTEL_SERVICE_NAME says otherwise.
        tracing_from_env(self.agent_id.split(".")[1])
        try:
            if self._metrics_port is not None:
                self._metrics_server = await serve_metrics(
                    self.metrics.render, self._metrics_host, self._metrics_port, self.health
                )
            # As patient as registering (``_register``): a fleet's processes all starting at
            # once on a busy node once had 1,222 of 5,000 agents fail here after 2 s.
            # A server cut off from most of its cluster is left for another (``leave_cut_off``):
            # staying, the agent's heartbeats reached no hub of the majority's side, which
            # declared it LOST and routed it nothing for the whole cut. Leaving is a
            # reconnection, as when its server dies: its subscriptions, work consumer and
            # statuses carry on, and a silence it makes counts as any other (``_identity``).
            self._nc = await connect(
                self.nats_url,
                name=self.agent_id,
                settings=self.settings,
                patience=max(self.settings.connect_timeout, _PATIENCE),
                leave_cut_off=True,
            )
            self._answers = AnswerBatcher(self._nc)
            # One process per agent id: a deploy's old process stops before this one serves.
            await wait_for_other_process(self._nc, self.agent_id, self.settings)
            # Serving the id alone from here: a silence before the registration's answer is
            # read (paused right after the hubs registered us) counts for ``may_be_replaced``.
            # (A ping refused by an older auth.conf is no refused subscription.)
            self._heard_at = subscribed_at = time.monotonic()
            # Each only for messages of its own subject that can be answered safely: a
            # JetStream push delivery of someone's stored message is dropped (_guard.py).
            for subject, on_msg, queue in (
                (self._task_subject, self._on_task, _AGENT_QUEUE),
                (protocol.agent_batch(self.agent_id), self._on_batch, _AGENT_QUEUE),
            ):
                cb = guarded(subject, on_msg)
                self._subs.append(
                    await self.nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=-1)
                )
            ctl = protocol.agent_ctl(self.agent_id)
            self._subs.append(await self.nc.subscribe(ctl, cb=guarded(ctl, self._on_ctl)))
            # The server refuses a subscription before it answers a PING sent after it:
            # ``flushed`` sends one behind these SUBs (nc.flush()'s can go ahead of them).
            await flushed(self.nc)
            refused = refused_since(self.nc, subscribed_at, f"reach.agent.{self.agent_id}.")
            if refused is not None:
                raise self._not_permitted(refused)
            refusals = refusals_of(self.nc)
            if refusals is not None:  # from now on, a refusal of our own subjects stops us
                refusals.listeners.append(self._on_refused)
            if self.durable_work:
                # Durable workflow steps (JetStream): consumer ready before hubs route to us.
                self.work = WorkConsumer(self)
                await self.work.start()
            await self._register()
            self._hb_task = asyncio.create_task(self._heartbeat_loop(), name="reach-heartbeat")
            self._loop_watch = asyncio.create_task(
                watch_event_loop(self.metrics.event_loop_lag_seconds), name="reach-loop-lag"
            )
        except BaseException:
            await self.close()
            raise

    async def _register(self) -> None:
        s = self.settings
        req = RegisterRequest(
            card=self.card(),
            session=self.session,
            heartbeat_interval=s.heartbeat_interval,
            lease_timeout=s.lease_timeout,
        )
        subject = protocol.hub_agent_subject(self.agent_id, "register")
        delay = 0.05
        # Long enough to ride out a JetStream leader election (seconds) or a hub restart.
        patience = max(s.connect_timeout, _PATIENCE)
        deadline = time.monotonic() + patience
        warned = False
        # Registered before (declared LOST or removed, registering again): tried again within
        # a heartbeat interval, as its beats would come, not after the start's backoff (up to
        # 7.5 s): a hub that found it holding a resent task waits for its registration, half
        # the route's time at most (hub/_holders.py), counting on its next beat once JetStream
        # takes writes again. A fleet starting at once still spreads out over the backoff, and
        # a hub's throttle (``ThrottledError``) is obeyed as it says.
        again = self._registered.is_set()
        while True:
            try:
                sent = time.monotonic()
                if self.may_be_replaced() and not await self.confirm_identity():
                    # Silent since the start check, or since the last answer, for as long as a
                    # new process of this id waits to start (paused between two tries): it may
                    # have registered meanwhile, and ours, sent now, would replace its
                    # registration — both would then serve the id. Stopped if it answers; not
                    # sent blind if nobody can be asked (the next try asks again).
                    if self.fault is not None:
                        raise self.fault
                    raise _Unconfirmed(
                        f"could not ask whether another process serves {self.agent_id}"
                    )
                # A subject this identity may not publish fails at once, not after `patience`;
                # an answer lost with a dropped connection is asked again once it is back (a
                # registration is safe to repeat), not at the timeout.
                # Asked of another hub after each ``_REGISTER_HEDGE`` without an answer (the
                # earlier tries still awaited): one hub paused or wedged is not waited on.
                # Three tries at most: hubs slow because JetStream is (an election) are not
                # sent a fleet's registrations five times over, two KV writes each.
                asked = hedged_request(
                    self.nc,
                    subject,
                    protocol.encode(req),
                    timeout=5.0,
                    every=_REGISTER_HEDGE,
                    final=_not_later,
                    most=_REGISTER_TRIES,
                )
                msg = await refused_first(self.nc, subject, or_reconnected(self.nc, asked))
                reply = protocol.parse_reply(msg.data, RegisterReply)
                self.state = reply.state
                self.cordoned = reply.cordoned or reply.state is AgentState.CORDONED
                self._answered(sent)
                self._heard_at = sent
                self._registered.set()
                log.info("agent %s registered with %s", self.agent_id, reply.hub_id)
                return
            except NotPermittedError as err:
                raise self._not_permitted(subject) from err
            except Reconnected:
                log.info("NATS reconnected before the registration's answer: asking again")
                continue
            except ThrottledError as err:
                wait, most = err.retry_after, math.inf  # the hub's word, not shortened
            except (NoRespondersError, NatsTimeoutError, TimeoutError, MeshUnavailableError) as err:
                if refused_since(self.nc, sent, subject) is not None:
                    raise self._not_permitted(subject) from err
                if isinstance(err, _Unconfirmed):
                    what = f"{self.agent_id} did not register: {err.message}"
                    hint = f"is NATS reachable on {shown(self.nats_url)}?"
                else:
                    what = f"no hub answered the registration of {self.agent_id}"
                    hint = (
                        "is a hub (`reach-mesh hub` or `reach-mesh up`) running on "
                        f"{shown(self.nats_url)}?"
                    )
                if time.monotonic() > deadline and not self._registered.is_set():
                    raise MeshUnavailableError(
                        f"{what} within {patience:.0f} s ({type(err).__name__.lstrip('_')}): {hint}"
                    ) from err
                if not warned:
                    warned = True
                    log.warning(
                        "%s (%s): %s Retrying for up to %.0f s",
                        what,
                        type(err).__name__.lstrip("_"),
                        hint,
                        max(0.0, deadline - time.monotonic()),
                    )
                wait, most = delay, s.heartbeat_interval if again else math.inf
            # Exponential backoff with full jitter: a storm of agents spreads out — within
            # `most` too: the draw (up to 1.5 x wait) is scaled into it, not cut at it (cut, every
            # try of a fleet refused at one instant came one interval later, in step, for good).
            wait = min(wait, most / 1.5)
            await asyncio.sleep(random.uniform(0, wait) + wait / 2)
            delay = min(delay * 2, 5.0)

    def _on_refused(self, subject: str) -> None:
        """NATS refused this connection ``subject`` (any refusal, as it happens). One of the
        agent's own subscriptions — its task, batch or ctl subject, or its inbox, where its
        work and its answers arrive — refused after it started is a permissions change
        reloaded into nats-server: that subscription is gone, while the heartbeats would go on
        (deaf). The agent stops: DRAINING (hubs route nothing more to it), running tasks
        finish, goodbye; and ``serve()``/``run()`` end with the error, so a supervisor
        restarts it and :meth:`start` says what is wrong until the permissions are mended."""
        if self.fault is not None or self.status is not AgentStatus.RUNNING:
            return
        refusals = refusals_of(self.nc)
        if refusals is not None and refusals.expects(subject):
            return  # a question whose refusal is its answer (``other_process``), not a loss
        own = (f"reach.agent.{self.agent_id}.", f"{inbox_prefix(self.nc)}.")
        if not subject.startswith(tuple(p.lower() for p in own)):
            return  # (a publish: refused on its own, where it is made)
        self.fault = self._not_permitted(subject)
        log_event(
            log,
            SUBSCRIPTION_REFUSED,
            f"NATS took away agent {self.agent_id}'s subscription to {subject!r} (a permissions "
            "change reloaded into nats-server?): nothing would reach it; it stops",
            agent_id=self.agent_id,
            subject=subject,
        )
        self._faulted.set()
        self._stopping = asyncio.create_task(self.close(), name="reach-agent-stop")

    def _not_permitted(self, subject: str) -> NotPermittedError:
        """NATS refused this connection one of this agent's own subjects: it runs with an
        identity that is not this agent's (a caller's, another agent's), which no retry mends."""
        me = self.agent_id
        return NotPermittedError(
            f"NATS refused this identity the subject {subject!r} (permissions violation): this "
            f"identity may not register agent id {me} (nor take its tasks). Run the agent "
            f"with the agent identity issued for it: `reach-mesh auth add-agent {me} --dir "
            f"<auth dir>` (then reload nats-server), and REACH_CONFIG=<auth dir>/agent.{me}.yaml "
            "(docs/security.md)",
            subject=subject,
            agent_id=self.agent_id,
        )

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval
        subject = protocol.hub_agent_subject(self.agent_id, "heartbeat")
        timeout = max(interval / (2 * _BEAT_TRIES), 0.05)
        while True:
            await asyncio.sleep(interval * random.uniform(0.9, 1.0))
            if self.may_be_replaced():
                await self.confirm_identity()
                if self.fault is not None:
                    return
            try:
                await self._beat_answered(subject, timeout)
            except UnknownAgentError:
                # (Declared LOST, likely: our attempts given up meanwhile. ``fence_stale``
                # below, and the steps after it, read the records once their replicas caught
                # up: ``wary``.)
                self._be_wary(time.monotonic() - self._answered_at)
                # Declared lost, removed by an operator — or registered since by another live
                # process of this id (two started at once): then one of them stops. Not
                # registered again blind when nobody could be asked: the next beat asks again.
                if not await self.confirm_identity(live=True):
                    if self.fault is not None:
                        return
                    continue
                log.warning("hub does not know %s: registering again", self.agent_id)
                if self.work is not None:
                    # Declared LOST: stay PRE_ONLINE until our superseded attempts are fenced.
                    self.state = AgentState.PRE_ONLINE
                    with contextlib.suppress(Exception):
                        await self.work.fence_stale()
                with contextlib.suppress(ReachError):
                    await self._register()
                if self.fault is not None:
                    return  # (replaced while registering again after a silence)
            except NoRespondersError:
                if self.nc.is_connected:  # else the connection says NATS is gone, once
                    log.warning(
                        "heartbeat of %s: no hub answered (none runs on this NATS, or each "
                        "is starting: `reach-mesh hubs`); the next beats ask again",
                        self.agent_id,
                    )
            except (NatsTimeoutError, TimeoutError, ReachError) as err:
                if self.nc.is_connected:
                    log.warning("heartbeat of %s failed: %r", self.agent_id, err)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("heartbeat of %s failed", self.agent_id)

    async def _beat_answered(self, subject: str, timeout: float) -> None:
        """One heartbeat, sent again at once while unanswered within ``timeout``, up to
        ``_BEAT_TRIES`` times (a repeat is harmless: the hub that gets it renews the lease
        again). Any other error ends it at once."""
        for left in range(_BEAT_TRIES - 1, -1, -1):
            try:
                await self._beat(subject, timeout)
                return
            except (NatsTimeoutError, TimeoutError):
                if left == 0:
                    raise

    async def _beat(self, subject: str, timeout: float) -> None:
        hb = Heartbeat(
            agent_id=self.agent_id,
            session=self.session,
            inflight=self._running,
            queue_depth=self._waiting,
            pressure=self.pressure,
            # Wedged (every slot held by a handler past its timeout): nothing can be served.
            unavailable=self.capabilities if self.wedged else sorted(self.unavailable),
            draining=self.status is AgentStatus.DRAINING,
        )
        sent = time.monotonic()
        msg = await self.nc.request(subject, protocol.encode(hb), timeout=timeout)
        reply = protocol.parse_reply(msg.data, HeartbeatReply)
        self.state = reply.state
        # (``state`` alone from a hub of an earlier version: CORDONED outranks the others.)
        self.cordoned = reply.cordoned or reply.state is AgentState.CORDONED
        self._answered(sent)  # the hub renewed the lease after this, not before
        self._heard_at = max(self._heard_at, sent)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Whether this agent is ready for work, and why (its metrics server's ``GET
        /healthz``: 200 when ready, else 503). Ready: running (not draining or closed), in
        touch with the hubs (:meth:`in_touch`: connected, its lease surely held) and not
        wedged. A readiness signal: when no hub answers, every agent says not ready."""
        in_touch = self.in_touch()
        ready = self.status is AgentStatus.RUNNING and in_touch and not self.wedged
        return ready, {
            "agent_id": self.agent_id,
            "ready": ready,
            "status": self.status.value,
            "state": None if self.state is None else self.state.value,
            "in_touch": in_touch,
            "wedged": self.wedged,
            "inflight": self.inflight,
        }

    async def heartbeat_now(self) -> None:
        """Send a heartbeat at once (e.g. after changing ``unavailable`` or ``pressure``)."""
        await self._beat(protocol.hub_agent_subject(self.agent_id, "heartbeat"), timeout=5.0)

    async def close(self) -> None:
        """Graceful stop: refuse new work, tell the hubs (DRAINING), finish in-flight tasks
        (up to ``drain_timeout``), unregister, drain the connection. Idempotent."""
        if self.status in (AgentStatus.DRAINING, AgentStatus.CLOSED):
            await self._closed.wait()
            return
        was_running = self.status is AgentStatus.RUNNING
        self.status = AgentStatus.DRAINING
        try:
            if was_running and self._nc is not None and self._registered.is_set():
                # Hubs stop routing to us at once.
                await within("DRAINING heartbeat", self.heartbeat_now(), 3.0, log)
            if self.work is not None:
                # No new workflow steps; in-flight ones finish below.
                await within("work consumer stop", self.work.stop(), 5.0, log)
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=self.drain_timeout)
            for what, task in (("heartbeat loop", self._hb_task), ("loop watch", self._loop_watch)):
                if task is not None:
                    task.cancel()
                    await within(what, task, 2.0, log)
            if self._nc is not None and self._registered.is_set():
                with contextlib.suppress(Exception):
                    await unregister(self.nc, self.agent_id, self.session, final=_not_later)
            late = list(self._tasks)
            for task in late:
                task.cancel()
            if late:  # they answer REACH_CANCELLED
                log.warning(
                    "agent %s stopping: %d task(s) still running after drain_timeout (%g s) "
                    "cancelled; their callers or workflows try them again (on another agent, "
                    "or on this id once it is back)",
                    self.agent_id,
                    len(late),
                    self.drain_timeout,
                )
                await asyncio.wait(late, timeout=1.0)
            if self.work is not None:
                await within("work keep-alives", self.work.stop_keepalives(), 2.0, log)
            if self._nc is not None:
                if self.work is not None:
                    await within("work ack flush", self.work.flush(), 5.0, log)
                await within("answer flush", self._answers.flush(), 5.0, log)
                await within("NATS drain", self._nc.drain(), 5.0, log)
                await within("NATS close", self._nc.close(), 5.0, log)
        finally:
            # Cut short (its caller's own timeout cancelled this stop, or a step failed):
            # nothing of the agent goes on behind it. A heartbeat loop left running kept a
            # closed agent's lease — registered, routed to — and its connection took tasks.
            me = asyncio.current_task()
            for task in (self._hb_task, self._loop_watch, *self._tasks):
                if task is not None and task is not me and not task.done():
                    task.cancel()
            if self._nc is not None and not self._nc.is_closed:
                await within("NATS close", self._nc.close(), 5.0, log)
            if self.work is not None:  # (stopped above unless the drain failed first)
                await within("work keep-alives", self.work.stop_keepalives(), 2.0, log)
            if self._metrics_server is not None:
                # Last: a scrape during the drain still sees the final counts.
                await within("metrics server close", self._metrics_server.close(), 5.0, log)
                self._metrics_server = None
            with contextlib.suppress(Exception):
                await flush_tracing()
            self.status = AgentStatus.CLOSED
            self._closed.set()

    async def wait_closed(self) -> None:
        """Wait until :meth:`close` has finished."""
        await self._closed.wait()

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
