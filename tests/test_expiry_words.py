"""What an agent's ctl ``task_state`` answer says of an attempt that expired unanswered on a
hub (``hub/_lateness.py``): pure, no NATS."""

from __future__ import annotations

import pytest

from reach_mesh import protocol
from reach_mesh.hub._lateness import _Word, agent_word
from reach_mesh.tracing.metrics import EXPIRY_OUTCOMES, HubMetrics

from .test_reply_flood import OUTCOMES


def _said(**fields: object) -> bytes:
    return protocol.dumps({"task_id": "t1", "agent_id": "ns.a.a1", **fields})


@pytest.mark.parametrize(
    ("answer", "word"),
    [
        (_said(attempt=2, state="SUCCEEDED", result=1), _Word.SUCCEEDED),
        (_said(attempt=3, state="SUCCEEDED"), _Word.SUCCEEDED),  # a later attempt
        (_said(attempt=2, state="TIMEOUT"), _Word.FAILED),
        (_said(attempt=2, state="FAILED", error={"code": "BOOM", "message": "x"}), _Word.FAILED),
        (_said(attempt=2, state="FAILED", error={"code": "REACH_BAD_REQUEST"}), _Word.NEUTRAL),
        (_said(attempt=2, state="DELIVERED"), _Word.LATE),  # in hand, unfinished
        (_said(state="PENDING"), _Word.LATE),  # never had it
        (_said(attempt=1, state="SUCCEEDED"), _Word.LATE),  # an earlier attempt's reply
        (_said(attempt=True, state="SUCCEEDED"), _Word.LATE),
        (_said(attempt=2, state="SUCCEEDED", agent_id="ns.b.b1"), _Word.LATE),
        (_said(attempt=2, state="SUCCEEDED", task_id="t2"), _Word.LATE),
        (_said(attempt=2, state="SUCCEEDED", result="x" * 300), _Word.LATE),  # oversized
        (protocol.dumps({"error": {"code": "REACH_BAD_REQUEST", "message": "x"}}), _Word.LATE),
        (b"not json", _Word.LATE),
        (b"[1]", _Word.LATE),
        (_said(attempt=2, state="DONE"), _Word.LATE),
    ],
)
def test_what_an_agents_task_state_answer_says_of_an_expiry(answer: bytes, word: _Word) -> None:
    assert agent_word(answer, "ns.a.a1", "t1", 2, max_size=256) is word


def test_every_outcome_has_its_series_from_the_start() -> None:
    assert OUTCOMES == EXPIRY_OUTCOMES
    get = HubMetrics().registry.get_sample_value
    assert all(get("reach_expiry_checks_total", {"outcome": o}) == 0 for o in OUTCOMES)


@pytest.mark.parametrize(
    ("answer", "word"),
    [
        (_said(attempt=2, state="SUCCEEDED", queued_ms=50.0, duration_ms=900.0), _Word.SUCCEEDED),
        # Made past the route's deadline by the agent's own clock: late, whatever it says.
        (_said(attempt=2, state="SUCCEEDED", queued_ms=50.0, duration_ms=990.0), _Word.LATE),
        (_said(attempt=2, state="SUCCEEDED", queued_ms=1200.0), _Word.LATE),
        (_said(attempt=2, state="TIMEOUT", duration_ms=1500.0), _Word.LATE),
        (_said(attempt=2, state="SUCCEEDED", duration_ms=True, queued_ms="x"), _Word.SUCCEEDED),
    ],
)
def test_a_reply_made_past_the_routes_timeout_is_no_answer_in_time(
    answer: bytes, word: _Word
) -> None:
    assert agent_word(answer, "ns.a.a1", "t1", 2, max_size=256, timeout=1.0) is word
