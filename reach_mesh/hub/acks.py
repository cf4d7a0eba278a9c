"""The six-state ACK machine of one task attempt, with only legal transitions.

::

    PENDING ──► DELIVERED ──► ACCEPTED ──► RUNNING ──► SUCCEEDED | FAILED | TIMEOUT
       │            │             │           ▲ │
       │            │             │           └─┘ (progress / keep-alive)
       │            └─────────────┴──────────────► SUCCEEDED | FAILED | TIMEOUT
       └──► TIMEOUT | FAILED  (never delivered: TTL passed / failed before delivery)

Final states absorb: nothing leaves them. Nothing moves backwards. ``DELIVERED → SUCCEEDED`` is
the agent answering from its result cache, or a handler that ended within 50 ms (the agent does
not say ACCEPTED for it); ``DELIVERED → FAILED`` the same, or a payload that does not validate
(the handler never started).

Events can be missed (a hub that took a workflow over sees only the latest), so
:meth:`AckMachine.catch_up` applies the implied chain of legal steps up to a later state; it is
built from :meth:`AckMachine.advance` and can never produce an illegal sequence either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from reach_mesh.models import TaskState

__all__ = ["LEGAL", "AckMachine", "IllegalTransitionError", "is_legal"]

_P, _D, _A, _R = TaskState.PENDING, TaskState.DELIVERED, TaskState.ACCEPTED, TaskState.RUNNING
_S, _F, _T = TaskState.SUCCEEDED, TaskState.FAILED, TaskState.TIMEOUT
_FINALS: Final = frozenset({_S, _F, _T})

#: state -> the states it may move to.
LEGAL: Final[dict[TaskState, frozenset[TaskState]]] = {
    _P: frozenset({_D, _T, _F}),
    _D: frozenset({_A}) | _FINALS,
    _A: frozenset({_R}) | _FINALS,
    _R: frozenset({_R}) | _FINALS,
    _S: frozenset(),
    _F: frozenset(),
    _T: frozenset(),
}

#: The path from PENDING to each non-final state (used to catch up on missed events).
_PATH: Final[dict[TaskState, tuple[TaskState, ...]]] = {
    _P: (),
    _D: (_D,),
    _A: (_D, _A),
    _R: (_D, _A, _R),
}


class IllegalTransitionError(ValueError):
    """A transition the machine does not allow."""


def is_legal(old: TaskState, new: TaskState) -> bool:
    """Whether ``old → new`` is one legal step."""
    return new in LEGAL[old]


class AckMachine:
    """The state of one attempt. ``on_transition(old, new)`` is called for every applied step
    (the engine records them as span events)."""

    __slots__ = ("_on_transition", "history", "state")

    def __init__(
        self,
        state: TaskState = TaskState.PENDING,
        on_transition: Callable[[TaskState, TaskState], None] | None = None,
    ) -> None:
        self.state = state
        self.history: list[TaskState] = [state]
        self._on_transition = on_transition

    @property
    def final(self) -> bool:
        return self.state in _FINALS

    def can(self, new: TaskState) -> bool:
        return is_legal(self.state, new)

    def advance(self, new: TaskState) -> None:
        """Apply one transition or raise ``IllegalTransitionError`` (state unchanged)."""
        old = self.state
        if not is_legal(old, new):
            raise IllegalTransitionError(f"illegal transition {old.value} -> {new.value}")
        self.state = new
        self.history.append(new)
        if self._on_transition is not None:
            self._on_transition(old, new)

    def catch_up(self, new: TaskState) -> bool:
        """Move to ``new`` through the legal steps it implies (missed events); return False and
        change nothing when ``new`` is not ahead of the current state."""
        if self.can(new):
            self.advance(new)
            return True
        if self.final:
            return False
        steps: tuple[TaskState, ...]
        if new in _FINALS:
            # Only PENDING cannot end directly: the agent had it, so it was DELIVERED.
            steps = (_D, new)
        else:
            path = _PATH[new]
            if self.state is _P:
                steps = path
            elif self.state in path:
                steps = path[path.index(self.state) + 1 :]
            else:
                return False
        prev = self.state
        for step in steps:
            if not is_legal(prev, step):
                return False
            prev = step
        if not steps:
            return False
        for step in steps:
            self.advance(step)
        return True
