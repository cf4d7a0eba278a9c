"""What a handler receives: :class:`Task`, and the errors a handler may raise on purpose."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from reach_mesh.errors import HandlerError

__all__ = ["Task", "TaskFailed"]

P = TypeVar("P")


@dataclass(slots=True)
class Task(Generic[P]):
    """One attempt of one task, as the handler sees it.

    ``payload`` is already validated against the handler's annotation (``Task[MyModel]``).
    """

    payload: P
    task_id: str
    attempt: int
    capability: str
    agent_id: str
    #: The agent's namespace (its id's), never the envelope's word.
    namespace: str
    trace_id: str | None = None
    workflow_id: str | None = None
    step: int | None = None
    #: Seconds the caller allows for this attempt (measured on the agent's own clock).
    timeout: float = 30.0
    _progress: Callable[[Any], Awaitable[None]] | None = field(default=None, repr=False)

    async def progress(self, info: Any = None) -> None:
        """Report progress (a RUNNING status event with ``info``) when the task is tracked."""
        if self._progress is not None:
            await self._progress(info)


class TaskFailed(HandlerError):
    """Raise from a handler to fail a task with your own ``code``-stable message.

    ``retryable=False`` tells the workflow engine not to try again (e.g. invalid input).
    """

    def __init__(self, message: str, *, retryable: bool = True, **details: Any) -> None:
        super().__init__(message, retryable=retryable, **details)
