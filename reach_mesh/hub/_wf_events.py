"""A workflow's events, held and released: the ``step``/``start`` notes a caller can watch.

:class:`WorkflowEvents` is a base of :class:`~reach_mesh.hub._steps.StepRunner` (and so of the
workflow engine): it makes the events a workflow's steps announce, holds them for
``workflow_event_hold`` and sends those still wanted with the hub's next JetStream write.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from opentelemetry.context import Context

from reach_mesh import protocol
from reach_mesh._jspub import JsClient
from reach_mesh.config import MeshSettings
from reach_mesh.hub._server_clock import ServerClock
from reach_mesh.hub._step_state import Workflow
from reach_mesh.models import ErrorBody, TaskState
from reach_mesh.tracing import current_context, inject
from reach_mesh.workflow import TaskRecord, WorkflowEvent

__all__ = ["WorkflowEvents"]


class WorkflowEvents:
    """Events of the workflows a hub owns (the engine sets every attribute below)."""

    _settings: MeshSettings
    _jsc: JsClient
    #: The NATS server's wall clock (records' times, deadlines, TTLs): not the host's.
    _server_clock: ServerClock
    #: Set when the hub stops: held events are dropped (the hub that takes over says them).
    _stopping: bool
    #: The engine's event loop (``start``): asked once, not per call — on Python 3.11
    #: ``asyncio.get_running_loop()``, ``current_task()`` and ``create_task()`` make a
    #: ``getpid`` system call each, about 45 per fanout(3) on this path before.
    _loop: asyncio.AbstractEventLoop

    def _step_event(
        self,
        wf: Workflow,
        index: int,
        rec: TaskRecord,
        state: TaskState,
        *,
        attempt: int | None,
        agent_id: str | None,
        error: ErrorBody | None = None,
    ) -> None:
        """A ``step`` event of ``wf`` about its step ``index``."""
        self._event(
            wf,
            functools.partial(
                WorkflowEvent,
                workflow_id=wf.id,
                kind="step",
                state=state,
                step=index,
                task_id=rec.task_id,
                attempt=attempt,
                agent_id=agent_id,
                error=error,
            ),
        )

    def _event(self, wf: Workflow, event: Callable[[], WorkflowEvent]) -> None:
        """Publish ``event`` (core NATS; ``REACH_WF_EVENTS`` captures it).

        Events are held for ``workflow_event_hold`` first (``Workflow.held``): when the workflow's
        result is stored within that time the held events are dropped (``_store``; the result
        says every step's outcome and agent), so a fast workflow stores no event.
        Released events leave with this hub's next JetStream write or a few milliseconds later
        (``JsClient.later``), in the order they were made. A hold of 0 releases each at once."""
        wf.held.append((event, current_context()))  # made only if released
        hold = self._settings.workflow_event_hold
        if hold <= 0:
            self._release_held(wf)
        elif wf.hold_timer is None:
            wf.hold_timer = self._loop.call_later(hold, self._release_held, wf)

    def _release_held(self, wf: Workflow) -> None:
        """Send ``wf``'s held events (``_event``); dropped once the hub is stopping (the hub
        that takes the workflow over says ``start`` again, and its ``.done`` every step's
        outcome)."""
        held = self._take_held(wf)
        if self._stopping:
            return
        subject = protocol.wf_event(wf.ns, wf.id)
        for event, context in held:
            headers = inject(dict(wf.headers), within=context)
            self._jsc.later(subject, protocol.encode(event()), headers)

    def _take_held(self, wf: Workflow) -> list[tuple[Callable[[], WorkflowEvent], Context]]:
        """``wf``'s held events, no longer held (dropped unless sent by the caller)."""
        if wf.hold_timer is not None:
            wf.hold_timer.cancel()
            wf.hold_timer = None
        held, wf.held = wf.held, []
        return held
