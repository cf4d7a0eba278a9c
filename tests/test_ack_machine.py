"""The six-state ACK machine: only legal transitions, never backwards, finals absorb."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reach_mesh.hub.acks import LEGAL, AckMachine, IllegalTransitionError, is_legal
from reach_mesh.models import TaskState

S = TaskState
_RANK = {S.PENDING: 0, S.DELIVERED: 1, S.ACCEPTED: 2, S.RUNNING: 3}
FINALS = {S.SUCCEEDED, S.FAILED, S.TIMEOUT}


def rank(state: TaskState) -> int:
    return _RANK.get(state, 4)


def test_happy_path() -> None:
    m = AckMachine()
    for s in (S.DELIVERED, S.ACCEPTED, S.RUNNING, S.RUNNING, S.SUCCEEDED):
        m.advance(s)
    assert m.final
    assert m.history == [S.PENDING, S.DELIVERED, S.ACCEPTED, S.RUNNING, S.RUNNING, S.SUCCEEDED]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (S.PENDING, S.ACCEPTED),
        (S.PENDING, S.RUNNING),
        (S.PENDING, S.SUCCEEDED),
        (S.DELIVERED, S.PENDING),
        (S.ACCEPTED, S.DELIVERED),
        (S.RUNNING, S.ACCEPTED),
        (S.SUCCEEDED, S.FAILED),
        (S.TIMEOUT, S.SUCCEEDED),
        (S.FAILED, S.RUNNING),
        (S.DELIVERED, S.DELIVERED),
    ],
)
def test_illegal_steps_raise(old: TaskState, new: TaskState) -> None:
    m = AckMachine(old)
    with pytest.raises(IllegalTransitionError):
        m.advance(new)
    assert m.state is old


def test_legal_shortcuts() -> None:
    assert is_legal(S.PENDING, S.TIMEOUT)
    assert is_legal(S.DELIVERED, S.SUCCEEDED)  # answered from the result cache
    assert is_legal(S.DELIVERED, S.FAILED)  # payload did not validate
    assert is_legal(S.ACCEPTED, S.TIMEOUT)


@given(st.lists(st.sampled_from(list(TaskState)), max_size=12))
def test_no_illegal_sequence_is_accepted(seq: list[TaskState]) -> None:
    m = AckMachine()
    applied = [S.PENDING]
    for new in seq:
        before = m.state
        try:
            m.advance(new)
        except IllegalTransitionError:
            assert new not in LEGAL[before]
            assert m.state is before
            continue
        assert new in LEGAL[before]
        applied.append(new)
    # What was applied is exactly the history, every pair is legal, nothing moves backwards,
    # and nothing follows a final state.
    assert m.history == applied
    for a, b in itertools.pairwise(applied):
        assert is_legal(a, b)
        assert rank(b) >= rank(a)
        assert a not in FINALS


@given(st.lists(st.sampled_from(list(TaskState)), max_size=12))
def test_catch_up_only_produces_legal_histories(seq: list[TaskState]) -> None:
    m = AckMachine()
    for new in seq:
        before = m.state
        moved = m.catch_up(new)
        if moved:
            assert m.state is new
            assert rank(new) >= rank(before)
        else:
            assert m.state is before
    for a, b in zip(m.history, m.history[1:], strict=False):
        assert is_legal(a, b)


def test_transition_callback() -> None:
    seen: list[tuple[TaskState, TaskState]] = []
    m = AckMachine(on_transition=lambda a, b: seen.append((a, b)))
    assert m.catch_up(S.RUNNING)
    assert seen == [(S.PENDING, S.DELIVERED), (S.DELIVERED, S.ACCEPTED), (S.ACCEPTED, S.RUNNING)]
    assert not m.catch_up(S.ACCEPTED)
