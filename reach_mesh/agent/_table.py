"""What an agent remembers of the task ids it saw (idempotency and fencing): :class:`Results`,
bounded in entries and in bytes, and its :class:`_Entry` per task id."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Final

from pydantic_core import to_json

from reach_mesh.models import TaskReply, TaskState

__all__ = ["RESULT_BYTES", "RESULT_CACHE", "Results"]

#: Task ids remembered, and the bytes of their results at most: a finished one beyond either
#: is forgotten, oldest first (a copy of it would then run again). Results may be up to
#: ``max_payload`` each, so the count alone let 10,000 of them hold gigabytes.
RESULT_CACHE: Final = 10_000
RESULT_BYTES: Final = 256 * 1024 * 1024
#: What an entry costs besides its result (counted towards ``RESULT_BYTES``).
_ENTRY_BYTES: Final = 256


class _Entry:
    """What the agent remembers about one task id (idempotency and fencing).

    ``reply`` is None while the attempt runs. ``done`` is resolved with the reply when it ends;
    request-reply tasks create it only when a duplicate waits (most never see one). Their
    successes are kept as the reply bytes sent: the ``TaskReply`` is parsed from them only if a
    duplicate or a state query asks for it.
    """

    __slots__ = ("_raw", "_reply", "_table", "attempt", "done", "owner", "size", "state")

    def __init__(
        self,
        attempt: int,
        state: TaskState,
        reply: TaskReply | None = None,
        done: asyncio.Future[TaskReply] | None = None,
        owner: tuple[str, int | None] | None = None,
    ) -> None:
        self.attempt = attempt
        self.state = state
        self.done = done
        #: The workflow step the task id was seen for (``workflow_id``, ``step``); None for
        #: request-reply tasks.
        self.owner = owner
        self._reply = reply
        self._raw: bytes | None = None
        #: The table holding it (its bytes are counted there), and what it counts.
        self._table: Results | None = None
        self.size = _size_of(self)

    @property
    def running(self) -> bool:
        """No final reply yet (the attempt runs, or waits for a slot)."""
        return self._reply is None and self._raw is None

    @property
    def reply(self) -> TaskReply | None:
        """The final reply of the attempt, or None while it runs."""
        if self._reply is None and self._raw is not None:
            self._reply = TaskReply.model_validate_json(self._raw)
        return self._reply

    @reply.setter
    def reply(self, reply: TaskReply | None) -> None:
        self._reply = reply
        self._raw = None
        self._resized()

    def finish(self, state: TaskState, reply: TaskReply | None, raw: bytes) -> None:
        """The attempt ended with ``reply`` (or, when None, the reply JSON ``raw``)."""
        self.state = state
        self._reply = reply
        self._raw = None if reply is not None else raw
        self._resized()

    def _resized(self) -> None:
        size = _size_of(self)
        table = self._table
        if table is not None:
            table._resize(self, size)
        else:
            self.size = size


def _size_of(entry: _Entry) -> int:
    """The bytes ``entry`` is counted for: its reply's JSON (its result's and error's, for a
    reply kept as an object), and ``_ENTRY_BYTES``."""
    if entry._raw is not None:
        return _ENTRY_BYTES + len(entry._raw)
    reply = entry._reply
    if reply is None:
        return _ENTRY_BYTES
    size = _ENTRY_BYTES
    if reply.result is not None:
        # (A result that made it here was JSON; should it not serialise, the entry counts.)
        with contextlib.suppress(Exception):
            size += len(to_json(reply.result))
    if reply.error is not None:
        size += len(reply.error.message)
    return size


class Results:
    """Task id → :class:`_Entry`, oldest first, at most ``max_entries`` finished entries and
    ``max_bytes`` of them. An attempt still running is never forgotten to make room (a copy of
    it would run again, and a hub's probe hear PENDING and give it up): those are bounded by
    the agent's capacity, not here."""

    def __init__(self, max_entries: int = RESULT_CACHE, max_bytes: int = RESULT_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        #: The sum of the entries' ``size``.
        self.bytes = 0
        #: The entry of a task id, or None: the dict's own ``get`` (every task asks).
        self.get: Callable[[str], _Entry | None] = self._entries.get

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __getitem__(self, task_id: str) -> _Entry:
        return self._entries[task_id]

    def pop(self, task_id: str) -> _Entry | None:
        entry = self._entries.pop(task_id, None)
        if entry is not None:
            self._left(entry)
        return entry

    def remember(self, task_id: str, entry: _Entry) -> None:
        """Keep ``entry`` as ``task_id``'s, the newest; then forget the oldest finished ones
        past the bounds."""
        old = self._entries.pop(task_id, None)  # a retry: its new attempt is the newest entry
        if old is not None and old is not entry:
            self._left(old)
        entries = self._entries
        entries[task_id] = entry
        if entry._table is not self:
            entry._table = self
            self.bytes += entry.size
        if len(entries) > self.max_entries or self.bytes > self.max_bytes:
            self._trim()

    def _resize(self, entry: _Entry, size: int) -> None:
        self.bytes += size - entry.size
        entry.size = size
        if self.bytes > self.max_bytes:
            self._trim()

    def _left(self, entry: _Entry) -> None:
        if entry._table is self:
            entry._table = None
            self.bytes -= entry.size

    def _trim(self) -> None:
        entries = self._entries
        seen = 0
        while (len(entries) > self.max_entries or self.bytes > self.max_bytes) and seen < len(
            entries
        ):
            task_id, oldest = entries.popitem(last=False)
            if oldest.running:
                entries[task_id] = oldest  # to the newest end; looked at once per pass
                seen += 1
            else:
                self._left(oldest)
