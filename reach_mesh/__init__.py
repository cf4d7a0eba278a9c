"""reach-mesh: the reachability layer for fleets of AI agents, on NATS JetStream.

Callers use :class:`Client`; agents use :class:`reach_mesh.agent.Agent`; hubs run with
``reach-mesh hub`` or :class:`reach_mesh.hub.Hub`.
"""

from __future__ import annotations

from reach_mesh.client import Client, TaskResult
from reach_mesh.config import MeshSettings, load_settings
from reach_mesh.errors import (
    AgentBusyError,
    BadLeaseError,
    BadRequestError,
    ForbiddenHostError,
    ForbiddenOriginError,
    HandlerError,
    IdentityMismatchError,
    InternalError,
    InvalidAgentIdError,
    InvalidCapabilityError,
    MeshTimeoutError,
    MeshUnavailableError,
    NoHandlerError,
    NoMatchError,
    NotPermittedError,
    PayloadTooLargeError,
    ReachError,
    SelectorError,
    StaleAttemptError,
    TaskCancelledError,
    TaskIdConflictError,
    ThrottledError,
    UnauthorizedError,
    UnknownAgentError,
    UnknownNamespaceError,
    UnknownWorkflowError,
    UnsupportedMediaTypeError,
    WorkflowCancelledError,
    WorkflowConflictError,
    WorkflowSpecError,
)
from reach_mesh.models import AgentInfo, AgentState, RouteDecision, TaskState, ToolSpec
from reach_mesh.selector import Selector
from reach_mesh.server import EmbeddedNats
from reach_mesh.workflow import (
    CancelResult,
    RetryPolicy,
    Step,
    StepResult,
    StepView,
    WorkflowEvent,
    WorkflowList,
    WorkflowResult,
    WorkflowSummary,
    WorkflowView,
)

__version__ = "0.1.0"

__all__ = [
    "AgentBusyError",
    "AgentInfo",
    "AgentState",
    "BadLeaseError",
    "BadRequestError",
    "CancelResult",
    "Client",
    "EmbeddedNats",
    "ForbiddenHostError",
    "ForbiddenOriginError",
    "HandlerError",
    "IdentityMismatchError",
    "InternalError",
    "InvalidAgentIdError",
    "InvalidCapabilityError",
    "MeshSettings",
    "MeshTimeoutError",
    "MeshUnavailableError",
    "NoHandlerError",
    "NoMatchError",
    "NotPermittedError",
    "PayloadTooLargeError",
    "ReachError",
    "RetryPolicy",
    "RouteDecision",
    "Selector",
    "SelectorError",
    "StaleAttemptError",
    "Step",
    "StepResult",
    "StepView",
    "TaskCancelledError",
    "TaskIdConflictError",
    "TaskResult",
    "TaskState",
    "ThrottledError",
    "ToolSpec",
    "UnauthorizedError",
    "UnknownAgentError",
    "UnknownNamespaceError",
    "UnknownWorkflowError",
    "UnsupportedMediaTypeError",
    "WorkflowCancelledError",
    "WorkflowConflictError",
    "WorkflowEvent",
    "WorkflowList",
    "WorkflowResult",
    "WorkflowSpecError",
    "WorkflowSummary",
    "WorkflowView",
    "__version__",
    "load_settings",
]
