"""One handler attempt, run and shaped into its outcome: :class:`AttemptsMixin` (a base of
:class:`~reach_mesh.agent._serving.ServingMixin`, and so of :class:`~reach_mesh.agent.Agent`).

An attempt's payload is validated, its handler run under the attempt's deadline inside its
``reach.handle`` span, and its result checked (JSON, size, depth) before anything carries it;
whatever went wrong becomes a FAILED or TIMEOUT reply worded here, and every attempt is counted
in the agent's metrics. Request-reply tasks (``ServingMixin._run``) and durable workflow steps
(``HeldSteps._run``, through :meth:`AttemptsMixin._call`) run theirs here. A success stays the
result's JSON (``bytes``) for as long as it can: a request-reply answer is written around it
(:meth:`AttemptsMixin._success`) without a ``TaskReply`` model.
"""

from __future__ import annotations

import asyncio
import logging
import time
import typing
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, Final

from nats.aio.client import Client as NATS
from opentelemetry import context as otel_context
from opentelemetry import trace
from pydantic import ValidationError
from pydantic_core import from_json, to_json

from reach_mesh import protocol
from reach_mesh.agent._deadlines import _Deadlines
from reach_mesh.agent._results import (
    _ERROR_MESSAGE_MAX,
    _SUCCEEDED,
    _SUCCEEDED_NULL,
    _dump,
    _end_handle_span,
    _error_body,
    _json_string,
    _result_json,
    sendable,
)
from reach_mesh.agent._task import Task
from reach_mesh.config import MeshSettings
from reach_mesh.errors import (
    BadRequestError,
    HandlerError,
    InternalError,
    MeshTimeoutError,
    PayloadTooLargeError,
    ReachError,
)
from reach_mesh.logs import HANDLER_ABANDONED, HANDLER_FAILED, LineBudget, log_event
from reach_mesh.models import ErrorBody, TaskEnvelope, TaskReply, TaskState
from reach_mesh.tracing import (
    SPAN_HANDLE,
    SpanKind,
    carried_span,
    span,
    trace_id_from_headers,
    tracing_enabled,
)
from reach_mesh.tracing.metrics import AgentMetrics

if typing.TYPE_CHECKING:
    from prometheus_client import Counter

    from reach_mesh.agent._serving import _Handler
    from reach_mesh.tracing.metrics import HistogramChild

__all__ = ["AttemptsMixin"]

log = logging.getLogger("reach_mesh.agent")
#: A failing handler's traceback is logged at most once per this many seconds per capability.
_TRACEBACK_INTERVAL: Final = 60.0


class AttemptsMixin:
    """Running and counting handler attempts (``Agent`` sets every attribute below in its
    ``__init__`` and ``start``)."""

    agent_id: str
    metrics: AgentMetrics
    settings: MeshSettings
    _nc: NATS | None
    _deadlines: _Deadlines
    #: Handlers' tracebacks, one per capability per ``_TRACEBACK_INTERVAL``.
    _tracebacks: LineBudget
    _durations: dict[str, HistogramChild]
    _succeeded_total: dict[str, Counter]
    _counters: dict[tuple[str, TaskState], Counter]
    #: (task id, attempt) of attempts counted when their handler was abandoned: its return,
    #: should it come, is not counted again (``_counted_when_abandoned``).
    _abandoned: set[tuple[str, int]]
    _succeeded: bytes
    _task_subject: str

    # ------------------------------------------------------------------ running

    async def _call(
        self,
        env: TaskEnvelope,
        handler: _Handler,
        headers: dict[str, str],
        *,
        on_accept: Callable[[], None] | None = None,
        progress: Callable[[Any], Awaitable[None]] | None = None,
        on_abandon: Callable[[], None] | None = None,
    ) -> bytes | TaskReply:
        """Run one attempt (:meth:`_attempt`) and count it in :attr:`metrics`; the result's
        JSON when it succeeded, else the reply.

        Durable workflow steps come through here (request-reply tasks take the same steps in
        ``ServingMixin._run``), so the agent's metrics cover both; duplicates answered from the
        idempotency cache never do."""
        cap = handler.capability
        t0 = time.perf_counter()
        # Tracing off (the common case): the traceparent is parsed once, here, into the trace
        # context the handler runs in — what ``span()`` makes current, without its scope
        # object and a second parse (as ``ServingMixin._run`` does). Otherwise, or without a
        # valid one, ``span()`` decides.
        parent = None if tracing_enabled() else carried_span(headers)
        try:
            if parent is None:
                with self._handle_span(env, handler, headers) as sp:
                    out = await self._attempt(
                        env,
                        handler,
                        trace_id_from_headers(headers),
                        sp,
                        on_accept,
                        progress,
                        on_abandon,
                    )
                    _end_handle_span(sp, out)
            else:
                token = otel_context.attach(trace.set_span_in_context(parent))
                try:
                    out = await self._attempt(
                        env, handler, parent.trace_id, parent, on_accept, progress, on_abandon
                    )
                finally:
                    otel_context.detach(token)
        except asyncio.CancelledError:
            # Shutdown or fencing: the attempt ends here without a result.
            if not self._counted_when_abandoned(env):
                self._count_cancelled(cap, time.perf_counter() - t0)
            raise
        if not self._counted_when_abandoned(env):
            self._count(cap, out, time.perf_counter() - t0)
        return out

    def _count(self, capability: str, out: bytes | TaskReply, elapsed: float) -> None:
        """Count one finished attempt: duration, final state, failure code."""
        duration = self._durations.get(capability)
        if duration is None:
            duration = self._durations[capability] = self.metrics.handler_duration_seconds.labels(
                capability
            )
        duration.observe(elapsed)
        if type(out) is bytes:
            succeeded = self._succeeded_total.get(capability)
            if succeeded is None:
                succeeded = self._succeeded_total[capability] = self.metrics.handled_total.labels(
                    capability, TaskState.SUCCEEDED.value
                )
            succeeded.inc()
            return
        reply = typing.cast(TaskReply, out)
        key = (capability, reply.state)
        handled = self._counters.get(key)
        if handled is None:
            handled = self._counters[key] = self.metrics.handled_total.labels(
                capability, reply.state.value
            )
        handled.inc()
        if reply.error is not None:
            self.metrics.failures_total.labels(capability, reply.error.code).inc()

    def _counted_when_abandoned(self, env: TaskEnvelope) -> bool:
        """Whether ``env``'s attempt was counted when its handler was abandoned (answered
        TIMEOUT, or dropped for a cancel): then the outcome its handler returns at last, which
        nobody is told, is not counted (once: the attempt is forgotten here)."""
        if not self._abandoned:
            return False  # (the common case: no tuple made)
        key = (env.task_id, env.attempt)
        if key not in self._abandoned:
            return False
        self._abandoned.discard(key)
        return True

    def _count_cancelled(self, capability: str, elapsed: float) -> None:
        self._count_unanswered(capability, elapsed, TaskState.FAILED, "REACH_CANCELLED")

    def _count_unanswered(
        self, capability: str, elapsed: float, state: TaskState, code: str
    ) -> None:
        """Count an attempt that ended without its handler's answer: cancelled, or abandoned
        (answered ``TIMEOUT`` for it)."""
        m = self.metrics
        m.handler_duration_seconds.labels(capability).observe(elapsed)
        m.handled_total.labels(capability, state.value).inc()
        m.failures_total.labels(capability, code).inc()

    def _handle_span(
        self, env: TaskEnvelope, handler: _Handler, headers: dict[str, str]
    ) -> AbstractContextManager[trace.Span]:
        """The span a handler runs under. With tracing off it records nothing but still makes
        the request's trace context current: the handler's log lines and its own mesh calls
        carry the same trace id."""
        return span(
            SPAN_HANDLE,
            kind=SpanKind.CONSUMER,
            parent_headers=headers,
            destination=self._task_subject,
            attributes={"reach.task_id": env.task_id, "reach.capability": handler.capability},
        )

    async def _attempt(
        self,
        env: TaskEnvelope,
        handler: _Handler,
        trace_id: str | None,
        sp: trace.Span,
        on_accept: Callable[[], None] | None,
        progress: Callable[[Any], Awaitable[None]] | None,
        on_abandon: Callable[[], None] | None = None,
    ) -> bytes | TaskReply:
        """Validate the payload and run the handler under the attempt's timeout, inside its
        span ``sp`` (see :meth:`_handle_span`). ``on_abandon`` is called if the handler is
        still running ``handler_abandon_grace`` past its timeout (it ignored the cancellation).

        Returns the result's JSON when the handler succeeded, else the failed (or timed-out)
        reply. ``trace_id`` is the request's (the handler's ``task.trace_id``). ``on_accept``
        runs when the handler is about to start (ACCEPTED); ``progress`` backs
        ``task.progress()`` (both used by durable workflow steps, see ``_held.py``).

        A recording span gets the ACK machine as events (DELIVERED, ACCEPTED, RUNNING here;
        the final state from :func:`_end_handle_span`) and an ``exception`` event for what made
        the attempt fail."""
        recording = sp.is_recording()
        if recording:
            sp.add_event(TaskState.DELIVERED.value, {"reach.attempt": env.attempt})
        try:
            payload = handler.payload.validate_python(env.payload)
        except Exception as err:
            # A validator of the handler's model may raise something else than a
            # ValidationError (pydantic lets a TypeError, KeyError, ... through): still this
            # payload's fault, and the attempt ends here with an answer either way.
            if recording:
                sp.record_exception(err)
            if isinstance(err, ValidationError):
                first = err.errors(include_url=False)[0]
                where = ".".join(str(p) for p in first["loc"]) or "payload"
                why = f" at {where!r}: {first['msg']}"
            else:
                why = f": {_describe(err)}"
            text = f"invalid payload for {handler.capability}{why}"
            return self._failed(env, BadRequestError.code, text, {"retryable": False})
        task: Task[Any] = Task(
            payload=payload,
            task_id=env.task_id,
            attempt=env.attempt,
            capability=handler.capability,
            agent_id=self.agent_id,
            # The agent's own (its id's): a direct-mode caller writes the envelope, and may
            # name any namespace there; NATS lets it reach only agents of its own.
            namespace=protocol.namespace_of(self.agent_id),
            trace_id=trace_id,
            workflow_id=env.workflow_id,
            step=env.step,
            timeout=env.timeout,
            _progress=progress,
        )
        if recording:
            sp.add_event(TaskState.ACCEPTED.value)
        if on_accept is not None:
            on_accept()
        if recording:
            sp.add_event(TaskState.RUNNING.value)
        alarm = self._deadlines.arm(env.timeout, on_abandon)
        try:
            with alarm:
                result = await handler.fn(task)
        except TimeoutError as err:
            if recording:
                sp.record_exception(err)
            if not alarm.expired:
                # The handler's own (a dependency's client timing out): a handler failure,
                # not the attempt's deadline.
                return self._handler_failed(handler.capability, env, trace_id, err)
            return self._reply(
                env,
                TaskState.TIMEOUT,
                error=ErrorBody(
                    code=MeshTimeoutError.code,
                    message=f"handler did not finish within {env.timeout:.3g}s",
                ),
            )
        except ReachError as err:  # TaskFailed among them
            if recording:
                sp.record_exception(err)
            log_event(
                log,
                HANDLER_FAILED,
                f"handler {handler.capability} failed the task: {err.code}: "
                f"{err.message[:_ERROR_MESSAGE_MAX]}",
                task_id=env.task_id,
                attempt=env.attempt,
                trace_id=trace_id,
                capability=handler.capability,
            )
            return self._reply(env, TaskState.FAILED, error=_error_body(err))
        except Exception as err:
            if recording:
                sp.record_exception(err)
            return self._handler_failed(handler.capability, env, trace_id, err)
        except asyncio.CancelledError as err:
            current = asyncio.current_task()
            if current is None or current.cancelling():
                raise  # this attempt is cancelled (the agent stops, a ctl cancel): not an outcome
            # The handler's own — an inner task it awaited was cancelled — with nobody
            # cancelling the attempt: its failure, as any exception it raises. Taken for a
            # shutdown, the attempt was left unanswered and its step redelivered, run again
            # and again (a handler that raised it every time ran 14 times for one step).
            if recording:
                sp.record_exception(err)
            return self._handler_failed(handler.capability, env, trace_id, err)
        except BaseException as err:
            # Not an Exception: GeneratorExit, one of the handler's own, KeyboardInterrupt or
            # SystemExit raised in its code (the agent's own signals stop it through its
            # handlers, never inside a task). Its failure as well: escaping, it left the task
            # DELIVERED for good (every retry waited for it) or, SystemExit, took the whole
            # agent down without a drain.
            if recording:
                sp.record_exception(err)
            return self._handler_failed(handler.capability, env, trace_id, err)
        try:
            out = _result_json(handler, result)
        except Exception:
            pass  # below, the general path decides (and words the error as it always has)
        else:
            if len(out) > self._max_result:
                return self._too_large(env, handler, trace_id, len(out))
            if _too_deep(out):
                return self._failed(env, HandlerError.code, _TOO_DEEP, {"retryable": False})
            return out
        try:
            dumped = _dump(handler, result)
        except Exception as err:
            text = f"handler result is not JSON-serialisable: {_describe(err)}"
            return self._failed(env, HandlerError.code, text)
        try:
            encoded = to_json(dumped)
        except ValueError as err:  # a lone surrogate (Python's json writes its escape)
            # No JSON writer of the mesh takes one: the reply, the step's status and record
            # all failed to be written, and the step was redelivered until its deadline.
            text = f"{_NOT_UNICODE}: {_describe(err)}"
            return self._failed(env, HandlerError.code, text, {"retryable": False})
        if len(encoded) > self._max_result:
            return self._too_large(env, handler, trace_id, len(encoded))
        if _too_deep(encoded):
            return self._failed(env, HandlerError.code, _TOO_DEEP, {"retryable": False})
        return self._reply(env, TaskState.SUCCEEDED, result=dumped)

    # ------------------------------------------------------------------ outcomes

    def _told_abandoned(
        self,
        env: TaskEnvelope,
        capability: str | None,
        trace_id: str | None,
        *,
        kind: typing.Literal["step", "request"],
        cancelled: bool = False,
    ) -> None:
        """Say that the handler of ``env`` is let go (``REACH-HANDLER-ABANDONED``, counted in
        ``reach_agent_handlers_abandoned_total{kind}``): it ignored its timeout's cancellation
        for ``handler_abandon_grace`` (answered TIMEOUT), or, ``cancelled``, a hub's cancel of
        its step (dropped). Either way it keeps its slot until it returns."""
        self.metrics.handlers_abandoned_total.labels(kind).inc()
        # Counted as what it was answered (its duration: ``env.timeout`` and the grace, at
        # least), not as what the handler may return at last.
        elapsed = env.timeout + self.settings.handler_abandon_grace
        cap = capability or "-"
        self._abandoned.add((env.task_id, env.attempt))
        if cancelled:
            self._count_cancelled(cap, elapsed)
            what = "did not stop when its step was cancelled: abandoned"
        else:
            self._count_unanswered(cap, elapsed, TaskState.TIMEOUT, MeshTimeoutError.code)
            what = (
                f"ignored its {env.timeout:.3g}s timeout for "
                f"{self.settings.handler_abandon_grace:.3g}s more: abandoned, answered TIMEOUT"
            )
        fields: dict[str, Any] = {"workflow_id": env.workflow_id} if kind == "step" else {}
        log_event(
            log,
            HANDLER_ABANDONED,
            f"handler {capability} {what} (its slot stays taken until it returns)",
            task_id=env.task_id,
            attempt=env.attempt,
            trace_id=trace_id,
            capability=capability,
            **fields,
        )

    @property
    def _max_result(self) -> int:
        """The largest result an answer carries: ``max_payload``, and room for the answer's
        own fields and headers in what the NATS server takes."""
        if self._nc is None:
            return self.settings.max_payload
        return protocol.carried_max(self.settings.max_payload, self._nc.max_payload)

    def _too_large(
        self, env: TaskEnvelope, handler: _Handler, trace_id: str | None, size: int
    ) -> TaskReply:
        """The answer for a result too large to send: FAILED, not retried (the handler ran and
        would produce it again), instead of a message NATS refuses (a lost answer, or a
        connection the server closes) and an attempt that times out."""
        limit = self._max_result
        message = (
            f"handler result is {size} bytes of JSON, over the {limit} bytes an answer may "
            "carry (max_payload)"
        )
        log_event(
            log,
            HANDLER_FAILED,
            f"handler {handler.capability}: {message}",
            level=logging.WARNING,
            task_id=env.task_id,
            attempt=env.attempt,
            trace_id=trace_id,
            capability=handler.capability,
        )
        return self._reply(
            env,
            TaskState.FAILED,
            error=ErrorBody(
                code=PayloadTooLargeError.code,
                message=message,
                details={"retryable": False, "size": size, "max_size": limit},
            ),
        )

    def _handler_failed(
        self, capability: str, env: TaskEnvelope, trace_id: str | None, err: BaseException
    ) -> TaskReply:
        """A handler's bug, as a FAILED reply (``REACH_HANDLER_FAILED``): a WARNING per task,
        its traceback at most once a minute per capability (a handler failing every task must
        not fill the log with them)."""
        text = _describe(err)
        traced = self._tracebacks.take(capability) is not None
        log_event(
            log,
            HANDLER_FAILED,
            f"handler {capability} raised {text}",
            level=logging.WARNING,
            exc_info=err if traced else None,
            task_id=env.task_id,
            attempt=env.attempt,
            trace_id=trace_id,
            capability=capability,
        )
        return self._failed(env, HandlerError.code, text, {"type": type(err).__name__})

    def _failed(
        self, env: TaskEnvelope, code: str, text: str, details: dict[str, Any] | None = None
    ) -> TaskReply:
        """A FAILED reply with error ``code`` and ``text`` (cut to 2,000 characters)."""
        error = ErrorBody(code=code, message=text[:2000], details=details or {})
        return self._reply(env, TaskState.FAILED, error=error)

    def _failed_here(self, env: TaskEnvelope, err: Exception) -> TaskReply:
        """An attempt that failed in this SDK, not in its handler (a bug of ours): it still
        ends with an answer and an outcome (``REACH_INTERNAL``), never left DELIVERED — a
        duplicate would wait on it, and a probe keep it alive, for good."""
        log.error(
            "attempt %s of task %s failed in the agent", env.attempt, env.task_id, exc_info=err
        )
        return self._failed(
            env, InternalError.code, f"the agent failed the attempt: {_describe(err)}"
        )

    def _success(
        self, env: TaskEnvelope, result: bytes, duration_ms: float, queued_ms: float
    ) -> bytes:
        """A SUCCEEDED ``TaskReply`` as ``protocol.encode`` writes it (``None`` fields left out,
        times rounded to the µs), built from the result's JSON: several times cheaper than the
        model and its serialiser. ``task_id`` came from the wire unvalidated, so it is escaped;
        ``agent_id`` is ours."""
        task_id = _json_string(env.task_id).encode()
        if result == b"null":
            return _SUCCEEDED_NULL % (task_id, env.attempt, self._succeeded, duration_ms, queued_ms)
        return _SUCCEEDED % (task_id, env.attempt, self._succeeded, result, duration_ms, queued_ms)

    def _reply(
        self,
        env: TaskEnvelope,
        state: TaskState,
        *,
        error: ErrorBody | None = None,
        result: Any = None,
    ) -> TaskReply:
        """This agent's reply to ``env``'s attempt."""
        return TaskReply(
            task_id=env.task_id,
            attempt=env.attempt,
            agent_id=self.agent_id,
            state=state,
            result=result,
            error=error,
        )


#: Levels of JSON a result must leave to the messages that carry it (a status event, a batch
#: of replies): the mesh's JSON parsers (pydantic's) stop at about 200 levels.
_CARRIER_DEPTH: Final = 8
_CARRIER_OPEN: Final = b"[" * _CARRIER_DEPTH
_CARRIER_CLOSE: Final = b"]" * _CARRIER_DEPTH
_TOO_DEEP: Final = (
    "handler result nests too deeply: the mesh's JSON parsers read about 190 levels of a "
    "result (objects and lists within each other); return a flatter one"
)


_NOT_UNICODE: Final = (
    "handler result is not valid Unicode (a lone surrogate: a name decoded with "
    "errors='surrogateescape'?); return text that is, e.g. decoded with errors='replace'"
)


def _too_deep(out: bytes) -> bool:
    """Whether the result JSON ``out`` nests deeper than its receivers can parse. Such a
    result passed every other check, then no message carrying it could be read: a request's
    answer became ``malformed reply``, a step's final status could not be written and its
    step was redelivered until its deadline. Counting brackets first (in C) keeps the parse
    off nearly every result: one with fewer than ~190 of them cannot nest that deep."""
    if out.count(b"[") + out.count(b"{") < 190:
        return False
    try:
        from_json(_CARRIER_OPEN + out + _CARRIER_CLOSE)
    except ValueError:
        return True
    return False


def _describe(err: BaseException) -> str:
    """``Type: message`` of an exception whose ``__str__`` is anyone's code: one that raises
    must not turn an attempt's answer into an exception of our own."""
    try:
        text = sendable(str(err))
    except Exception:
        text = "<unprintable exception>"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
