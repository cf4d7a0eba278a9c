"""Structured logging.

The library only creates loggers (under ``reach_mesh``) and emits records; it configures nothing.
Process entry points (the CLI, ``reach_mesh.agent.run``) call :func:`configure_logging`, which
writes one JSON object per line when stderr is not a terminal and a short human line when it is.

Decision and lifecycle lines go through :func:`log_event` with one of the keywords below, so an
operator can grep or alert on ``event=REACH-...`` whatever the message text says. Extra fields
(``trace_id``, ``agent_id``, ``request_id``, ...) become top-level JSON keys.
"""

from __future__ import annotations

import json as _json
import logging
import math
import sys
import time
from collections.abc import Hashable, Mapping
from typing import Any, Final, TextIO

from reach_mesh.tracing import current_trace_id

__all__ = [
    "AGENT_ID_IN_USE",
    "AGENT_TIMEOUT",
    "AGENT_UNREACHABLE",
    "HANDLER_ABANDONED",
    "HANDLER_FAILED",
    "IDENTITY_REJECTED",
    "LEASE_EXPIRED",
    "MESSAGE_REFUSED",
    "NAMESPACE_SHARE",
    "QUARANTINE",
    "ROUTE_LATENCY",
    "SELECT_EMPTY",
    "SUBSCRIPTION_REFUSED",
    "THROTTLED",
    "WORKFLOW_INTERRUPTED",
    "HumanFormatter",
    "JsonFormatter",
    "LineBudget",
    "configure_logging",
    "get_logger",
    "log_event",
]

AGENT_TIMEOUT: Final = "REACH-AGENT-TIMEOUT"
"""A hub delivered a task and its agent did not answer in time (at most one line per agent per
10 s): a hung agent shows here long before its lease runs out."""
AGENT_UNREACHABLE: Final = "REACH-AGENT-UNREACHABLE"
"""A task a hub sent found nobody subscribed to the agent's task subject (NATS' "no
responders") while the agent is registered (at most one line per agent per 10 s): reconnecting
(its host's network, a NATS server restarted or failed over), gone without a goodbye, or — when
``deaf`` — heard from since yet listening still to nothing. Routes wait for the one that may be
reconnecting within their timeouts and its lease."""
SELECT_EMPTY: Final = "REACH-SELECT-EMPTY"
"""A route request found no routable candidate (the line carries the explain summary)."""
LEASE_EXPIRED: Final = "REACH-LEASE-EXPIRED"
"""An agent's lease ran out: ONLINE → SUSPECT, and then (lease and grace gone) LOST."""
QUARANTINE: Final = "REACH-QUARANTINE"
"""An agent's breaker opened (QUARANTINED). Its closing is not logged (the audit has it)."""
ROUTE_LATENCY: Final = "REACH-ROUTE-LATENCY"
"""A routed request slower than 250 ms end to end (the handler's time included)."""
IDENTITY_REJECTED: Final = "REACH-IDENTITY-REJECTED"
"""A message spoke for another identity than its subject names, or used a hub-only code: refused
(docs/security.md)."""

HANDLER_FAILED: Final = "REACH-HANDLER-FAILED"
"""An agent's handler raised (WARNING, with the traceback at most once a minute per capability)
or failed the task on purpose with ``TaskFailed`` (INFO)."""
HANDLER_ABANDONED: Final = "REACH-HANDLER-ABANDONED"
"""An agent let go of a handler that did not stop when its attempt was cancelled (its timeout,
or a hub's cancel of a step) ``handler_abandon_grace`` earlier (WARNING): the attempt is
answered TIMEOUT (or dropped, when cancelled) and the handler keeps its slot until it returns.
At most one line per handler slot until such handlers return."""
NAMESPACE_SHARE: Final = "REACH-NAMESPACE-SHARE"
"""A hub is full of workflows and a namespace holds its fair share of them: its further
submissions wait in the stream while other namespaces' are taken (docs/workflows.md)."""
WORKFLOW_INTERRUPTED: Final = "REACH-WORKFLOW-INTERRUPTED"
"""A hub handed a workflow back to the stream before storing its result: JetStream stayed
unavailable past the retries (WARNING; another hub resumes it), or anything else (ERROR, with
the traceback at most once a minute per kind of error: it comes back and fails again until
the cause is fixed)."""
SUBSCRIPTION_REFUSED: Final = "REACH-SUBSCRIPTION-REFUSED"
"""NATS took away one of a running agent's own subscriptions (its task, batch or ctl subject,
or its inbox: a permissions change reloaded into nats-server), so it would heartbeat with
nothing reaching it (ERROR): the agent stops (``Agent.fault``), and ``serve()``/``run()`` end
with the error."""
AGENT_ID_IN_USE: Final = "REACH-AGENT-ID-IN-USE"
"""A starting agent found another live process serving its agent id (its ctl subject
answered): it waits for that one to stop before it subscribes to anything (WARNING, at most one
line per 30 s while it waits; ``agent/_one_process.py``)."""
THROTTLED: Final = "REACH-THROTTLED"
"""A hub refused route requests of a namespace with ``REACH_THROTTLED`` (WARNING, at most one
line per namespace per 10 s): over its ``route_rate``, or holding its fair share of a full hub.
Names the caller of the request refused then, by the part of its reply subject that is the same
for all its requests (in secure mode after its identity's ``_INBOX.caller.<name>``), so a flood
is told from its neighbours."""
MESSAGE_REFUSED: Final = "REACH-MESSAGE-REFUSED"
"""A message was dropped unread: it named a reply subject outside ``_INBOX.``, or it was not a
message of the subscription it came on (a JetStream push delivery; docs/security.md)."""

# Default level per keyword: the three that mean "something is not reachable" are warnings.
_EVENT_LEVELS: Final[Mapping[str, int]] = {
    SELECT_EMPTY: logging.WARNING,
    AGENT_TIMEOUT: logging.WARNING,
    AGENT_UNREACHABLE: logging.WARNING,
    LEASE_EXPIRED: logging.WARNING,
    QUARANTINE: logging.WARNING,
    ROUTE_LATENCY: logging.INFO,
    IDENTITY_REJECTED: logging.WARNING,
    HANDLER_ABANDONED: logging.WARNING,
    SUBSCRIPTION_REFUSED: logging.ERROR,
    MESSAGE_REFUSED: logging.WARNING,
    AGENT_ID_IN_USE: logging.WARNING,
    THROTTLED: logging.WARNING,
}

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is a field.
_RECORD_ATTRS: Final[frozenset[str]] = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__
) | {"message", "asctime", "taskName"}

_ROOT_LOGGER: Final = "reach_mesh"

# A library must not print "No handlers could be found" nor fall back to the last-resort handler.
logging.getLogger(_ROOT_LOGGER).addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """The logger for ``name`` (pass ``__name__``); names outside the package are nested under it.

    Keeping every logger under ``reach_mesh`` lets an application tune the whole library with one
    ``logging.getLogger("reach_mesh").setLevel(...)``.
    """
    if name != _ROOT_LOGGER and not name.startswith(_ROOT_LOGGER + "."):
        name = f"{_ROOT_LOGGER}.{name}"
    return logging.getLogger(name)


def log_event(
    logger: logging.Logger,
    keyword: str,
    msg: str,
    /,
    *,
    level: int | None = None,
    exc_info: BaseException | None = None,
    **fields: Any,
) -> None:
    """Emit one line with ``event=keyword`` and ``fields`` as structured extras (and
    ``exc_info``'s traceback, when given).

    ``level`` defaults per keyword (warning for SELECT_EMPTY, LEASE_EXPIRED, QUARANTINE; info
    otherwise). Nothing is built when the level is disabled. ``trace_id`` is filled from the
    current span when not given. Field names that clash with ``LogRecord`` attributes get a
    trailing underscore instead of making ``logging`` raise.
    """
    if level is None:
        level = _EVENT_LEVELS.get(keyword, logging.INFO)
    if not logger.isEnabledFor(level):
        return
    extra: dict[str, Any] = {"event": keyword}
    for key, value in fields.items():
        extra[f"{key}_" if key in _RECORD_ATTRS else key] = value
    if extra.get("trace_id") is None:
        trace_id = current_trace_id()
        if trace_id is not None:
            extra["trace_id"] = trace_id
    # stacklevel=2: the record names the caller's function and line, not this helper.
    logger.log(level, msg, extra=extra, stacklevel=2, exc_info=exc_info)


class LineBudget:
    """At most one log line per ``interval`` seconds per key, and ``max_lines`` per interval
    in all: what a message anyone may send (a refusal, a no-match, a takeover) logs, so that a
    flood of them — same key or a new key each — cannot fill a disk or stall the process
    writing lines. At most ``max_keys`` keys are remembered (then they start over: lenient,
    never silent for long)."""

    __slots__ = (
        "_due",
        "_held",
        "_held_unseen",
        "_lines",
        "_window",
        "interval",
        "max_keys",
        "max_lines",
    )

    def __init__(self, interval: float, max_keys: int = 1024, max_lines: int = 100) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self.max_lines = max_lines
        self._due: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}
        self._window = -math.inf  # when the current interval of ``max_lines`` ends
        self._lines = 0
        # Lines of keys never seen, held back by ``max_lines``: one count (the keys are not
        # kept), told with the next line that is due.
        self._held_unseen = 0

    def take(self, key: Hashable = None) -> int | None:
        """``None``: hold this line back (it is counted). Otherwise the line is due: the
        number of lines held back for ``key`` since the last one (and, the first time after,
        those of keys never seen that the overall cap held back)."""
        now = time.monotonic()
        due = self._due.get(key)
        if now >= self._window:
            self._window, self._lines = now + self.interval, 0
        if due is not None and now < due:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if self._lines >= self.max_lines:
            if due is None:
                self._held_unseen += 1
            else:
                self._held[key] = self._held.get(key, 0) + 1
            return None
        self._lines += 1
        if due is None and len(self._due) >= self.max_keys:
            self._due.clear()
            self._held.clear()
        self._due[key] = now + self.interval
        held, self._held_unseen = self._held.pop(key, 0) + self._held_unseen, 0
        return held

    def warn(self, logger: logging.Logger, key: Hashable, msg: str, *args: object) -> None:
        """``logger.warning(msg, *args)`` when a line of ``key`` is due (:meth:`take`), saying
        how many were held back since the last one when any were."""
        held = self.take(key)
        if held:
            logger.warning(msg + " (%d such lines held back)", *args, held)
        elif held is not None:  # (the first, or none held back since the last: no "(0 ...)")
            logger.warning(msg, *args)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, then the extra fields.

    ``ts`` is UTC ISO 8601 with milliseconds. Values JSON cannot encode are written with
    ``str()`` — a log line is never lost to an odd field. Exceptions go in ``exc``.
    """

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as one line of JSON."""
        seconds = time.gmtime(record.created)
        millis = int(record.created * 1000) % 1000
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", seconds) + f".{millis:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _fields(record).items():
            # The four fixed keys win; a clashing extra keeps its value under a suffixed key.
            entry[f"{key}_" if key in entry else key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = record.stack_info
        return _json.dumps(entry, default=str, ensure_ascii=False, separators=(",", ":"))


class HumanFormatter(logging.Formatter):
    """A concise line for a terminal: ``12:00:01.234 WARNING reach_mesh.hub [EVENT] msg k=v``."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as one human-readable line (plus a traceback, if any)."""
        fields = _fields(record)
        event = fields.pop("event", None)
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        millis = int(record.created * 1000) % 1000
        parts = [f"{clock}.{millis:03d}", f"{record.levelname:<7}", record.name]
        if event is not None:
            parts.append(f"[{event}]")
        parts.append(record.getMessage())
        parts.extend(f"{key}={value}" for key, value in fields.items())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + record.stack_info
        return line


class _ReachHandler(logging.StreamHandler[TextIO]):
    """Marks the handler :func:`configure_logging` installed, so a second call replaces it."""


def configure_logging(level: str | int = "INFO", json: bool | None = None) -> None:
    """Send log records to stderr: JSON lines, or human lines on a terminal.

    For process entry points only (the CLI). Idempotent: calling it again replaces the handler it
    installed before and leaves handlers installed by anyone else alone.

    Args:
        level: a level name (``"debug"``, ``"INFO"``, ...) or number, applied to the root logger.
        json: force JSON (``True``) or human (``False``); ``None`` chooses JSON unless stderr is
            a terminal.

    Raises:
        ValueError: an unknown level name.
    """
    if isinstance(level, str):
        numeric = logging.getLevelNamesMapping().get(level.strip().upper())
        if numeric is None:
            raise ValueError(f"unknown log level {level!r}")
        level = numeric
    if json is None:
        json = not _isatty(sys.stderr)
    root = logging.getLogger()
    for existing in list(root.handlers):
        if isinstance(existing, _ReachHandler):
            root.removeHandler(existing)
    handler = _ReachHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json else HumanFormatter())
    root.addHandler(handler)
    root.setLevel(level)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed stream
        return False
