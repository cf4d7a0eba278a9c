"""The reach-mesh error tree.

Every error carries a stable wire ``code`` so that clients in any language can act on it::

    ReachError                      REACH_ERROR
    ├── BadRequestError             REACH_BAD_REQUEST      malformed JSON, wrong types
    │   ├── InvalidAgentIdError     REACH_BAD_AGENT_ID
    │   ├── InvalidCapabilityError  REACH_BAD_CAPABILITY
    │   ├── SelectorError           REACH_BAD_SELECTOR     (names the position)
    │   ├── BadLeaseError           REACH_BAD_LEASE
    │   ├── PayloadTooLargeError    REACH_PAYLOAD_TOO_LARGE
    │   ├── IdentityMismatchError   REACH_IDENTITY_MISMATCH (subject and body name different ids)
    │   ├── WorkflowSpecError       REACH_BAD_WORKFLOW
    │   └── UnsupportedMediaTypeError REACH_UNSUPPORTED_MEDIA_TYPE  (HTTP 415)
    ├── UnknownAgentError           REACH_UNKNOWN_AGENT    (heartbeat: re-register)
    ├── UnknownWorkflowError        REACH_UNKNOWN_WORKFLOW (no record: never taken, or expired)
    ├── NoMatchError                REACH_NO_MATCH         (with the nearest things that exist)
    │   └── UnknownNamespaceError   REACH_UNKNOWN_NAMESPACE (no agent, not configured)
    ├── ThrottledError              REACH_THROTTLED        (with retry_after_ms)
    ├── AgentBusyError              REACH_AGENT_BUSY       (not accepted: safe to retry)
    ├── AgentReplacedError          REACH_AGENT_REPLACED   (another process serves the id)
    ├── SessionEndedError           REACH_SESSION_ENDED    (register: the session unregistered)
    ├── NoHandlerError              REACH_NO_HANDLER       (agent lacks the capability)
    ├── HandlerError                REACH_HANDLER_FAILED   (the user's handler raised)
    ├── StaleAttemptError           REACH_STALE_ATTEMPT    (fenced)
    ├── WorkflowConflictError       REACH_WORKFLOW_CONFLICT (workflow id taken by another spec)
    ├── TaskIdConflictError         REACH_TASK_ID_CONFLICT (a step's task id is another workflow's)
    ├── MeshTimeoutError            REACH_TIMEOUT          (also a ``TimeoutError``)
    ├── MeshUnavailableError        REACH_UNAVAILABLE      (no hub / NATS not reachable)
    ├── InternalError               REACH_INTERNAL
    ├── UnauthorizedError           REACH_UNAUTHORIZED     (HTTP 401: bearer token)
    ├── ForbiddenOriginError        REACH_FORBIDDEN_ORIGIN (HTTP 403: cross-origin request)
    └── ForbiddenHostError          REACH_FORBIDDEN_HOST   (HTTP 403: Host not allowed)

Errors cross the wire as ``{"error": {"code": ..., "message": ..., "details": {...}}}``;
:func:`error_from_wire` turns such a body back into the matching class.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

__all__ = [
    "AgentBusyError",
    "AgentReplacedError",
    "BadLeaseError",
    "BadRequestError",
    "ForbiddenHostError",
    "ForbiddenOriginError",
    "HandlerError",
    "IdentityMismatchError",
    "InternalError",
    "InvalidAgentIdError",
    "InvalidCapabilityError",
    "MeshTimeoutError",
    "MeshUnavailableError",
    "NoHandlerError",
    "NoMatchError",
    "NotPermittedError",
    "PayloadTooLargeError",
    "ReachError",
    "SelectorError",
    "SessionEndedError",
    "StaleAttemptError",
    "TaskCancelledError",
    "TaskIdConflictError",
    "ThrottledError",
    "UnauthorizedError",
    "UnknownAgentError",
    "UnknownNamespaceError",
    "UnknownWorkflowError",
    "UnsupportedMediaTypeError",
    "WorkflowCancelledError",
    "WorkflowConflictError",
    "WorkflowSpecError",
    "error_from_wire",
]


class ReachError(Exception):
    """Base of every reach-mesh error. ``code`` is stable on the wire."""

    code: ClassVar[str] = "REACH_ERROR"
    #: Whether retrying the same request (possibly on another agent) is safe and may succeed.
    retryable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if len(cls.code) > 64:  # readers cut a longer one (models.ERROR_CODE_MAX)
            raise TypeError(f"{cls.__name__}.code is over 64 characters: {cls.code!r}")

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def to_wire(self) -> dict[str, Any]:
        """The JSON-able body sent for this error."""
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return {"error": body}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code}: {self.message!r})"


class BadRequestError(ReachError):
    """The request could not be parsed or failed validation."""

    code = "REACH_BAD_REQUEST"


class InvalidAgentIdError(BadRequestError):
    code = "REACH_BAD_AGENT_ID"


class InvalidCapabilityError(BadRequestError):
    code = "REACH_BAD_CAPABILITY"


class SelectorError(BadRequestError):
    """A selector did not parse; ``details`` has ``position`` and ``expected``."""

    code = "REACH_BAD_SELECTOR"


class BadLeaseError(BadRequestError):
    code = "REACH_BAD_LEASE"


class PayloadTooLargeError(BadRequestError):
    code = "REACH_PAYLOAD_TOO_LARGE"


class IdentityMismatchError(BadRequestError):
    """The agent id a message's subject names (the one NATS permissions bind to the sender) is
    not the one its body speaks for: refused, nothing changed (docs/security.md)."""

    code = "REACH_IDENTITY_MISMATCH"


class WorkflowSpecError(BadRequestError):
    code = "REACH_BAD_WORKFLOW"


class UnsupportedMediaTypeError(BadRequestError):
    """A POST to the hub's HTTP API without ``Content-Type: application/json`` (HTTP 415)."""

    code = "REACH_UNSUPPORTED_MEDIA_TYPE"


class UnknownAgentError(ReachError):
    """The agent id is not registered (a heartbeat reply means: register again)."""

    code = "REACH_UNKNOWN_AGENT"


#: Why a registered agent takes no tasks when nobody listens on its task subject and it was not
#: heard from since: said by a hub's route (proxy mode) and by a direct-mode ``Client`` alike.
NOBODY_TAKES_ITS_TASKS = (
    "no process takes its tasks: its process is gone — crashed or killed —, or reconnecting "
    "and not back within the request's timeout"
)


class UnknownWorkflowError(ReachError):
    """No record of this workflow id in its namespace: never submitted, not taken by a hub
    yet, or finished longer ago than ``workflow_retention``."""

    code = "REACH_UNKNOWN_WORKFLOW"


class TaskCancelledError(ReachError):
    """A task's handler was stopped before it finished: its agent shut down while it ran, or
    the hub cancelled the attempt."""

    code = "REACH_CANCELLED"


class WorkflowCancelledError(ReachError):
    """A workflow stopped on request (``reach.hub.<ns>.cancel``): the ``error`` of its final,
    FAILED result, whose unfinished steps are ``cancelled``."""

    code = "REACH_WORKFLOW_CANCELLED"


class NoMatchError(ReachError):
    """No routable agent matches; ``details`` may carry ``nearest`` suggestions."""

    code = "REACH_NO_MATCH"


class UnknownNamespaceError(NoMatchError):
    """A route to a namespace this hub knows nothing of: no agent is registered in it and the
    settings do not name it. Nothing is counted or audited for it (bounded cardinality)."""

    code = "REACH_UNKNOWN_NAMESPACE"


class ThrottledError(ReachError):
    """The namespace is over its rate; ``details['retry_after_ms']`` says when to retry."""

    code = "REACH_THROTTLED"
    retryable = True

    @property
    def retry_after(self) -> float:
        return float(self.details.get("retry_after_ms", 100)) / 1000.0


class AgentBusyError(ReachError):
    """The agent refused the task before accepting it (full, draining). Safe to retry."""

    code = "REACH_AGENT_BUSY"
    retryable = True


class NoHandlerError(ReachError):
    code = "REACH_NO_HANDLER"
    retryable = True


class HandlerError(ReachError):
    """The agent's handler raised; ``details`` has the handler's error type."""

    code = "REACH_HANDLER_FAILED"


class StaleAttemptError(ReachError):
    code = "REACH_STALE_ATTEMPT"


class WorkflowConflictError(ReachError):
    """A workflow id was submitted again with a different spec: the first spec stands, the
    second is refused (the same id with the same spec is a no-op)."""

    code = "REACH_WORKFLOW_CONFLICT"


class TaskIdConflictError(ReachError):
    """A step names a task id (``Step(task_id=...)``) that a step of another workflow of the
    namespace holds: the step is not run and fails with this error (``details``: the other
    ``workflow_id``). A task id names one step of one workflow while its record is kept."""

    code = "REACH_TASK_ID_CONFLICT"


class MeshTimeoutError(ReachError, TimeoutError):
    code = "REACH_TIMEOUT"


class MeshUnavailableError(ReachError):
    code = "REACH_UNAVAILABLE"
    retryable = True


class InternalError(ReachError):
    code = "REACH_INTERNAL"


class AgentReplacedError(ReachError):
    """Another process serves this agent id: it started while this one was silent to the hubs
    for longer than they wait before declaring an agent lost (paused, its event loop blocked,
    or cut off), and this one stopped rather than share the id's subjects with it (every task
    would reach both). Raised in the agent that stood down; never on the wire."""

    code = "REACH_AGENT_REPLACED"


class SessionEndedError(ReachError):
    """A registration of a session its agent already unregistered: a try of it handled late
    (a hub paused or wedged while the agent, answered by another, went on, unregistered and
    left). Registered, it would bring a gone agent back into every hub's index until its lease
    ran out. A process registers under a fresh session."""

    code = "REACH_SESSION_ENDED"


class NotPermittedError(ReachError):
    """The NATS server refused this identity a subject it published or subscribed to
    (permissions, secure mode), or refused its credentials when it connected. Raised in the
    client that was refused; never on the wire."""

    code = "REACH_NOT_PERMITTED"


class UnauthorizedError(ReachError):
    """The hub's HTTP API wants ``Authorization: Bearer <http_token>`` (HTTP 401)."""

    code = "REACH_UNAUTHORIZED"


class ForbiddenOriginError(ReachError):
    """A browser request from another origin to a state-changing HTTP endpoint (HTTP 403)."""

    code = "REACH_FORBIDDEN_ORIGIN"


class ForbiddenHostError(ReachError):
    """An HTTP request whose ``Host`` is not this hub's (DNS rebinding defence, HTTP 403)."""

    code = "REACH_FORBIDDEN_HOST"


_BY_CODE: Final[dict[str, type[ReachError]]] = {}


def _collect(cls: type[ReachError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _collect(sub)


_collect(ReachError)


def error_from_wire(body: dict[str, Any]) -> ReachError:
    """Build the error instance for a wire ``{"code", "message", "details"}`` object."""
    code = str(body.get("code", ReachError.code))
    cls = _BY_CODE.get(code, ReachError)
    details = body.get("details") or {}
    err = cls(str(body.get("message", code)), **(details if isinstance(details, dict) else {}))
    if cls is ReachError and code != ReachError.code:
        err.details.setdefault("code", code)
    return err
