"""A final workflow record's bytes made with its result's JSON encoded once
(``_step_state.record_bytes``, used by ``WorkflowEngine._store``, which sends the same JSON on
``.done``) are ``protocol.encode(record)``'s, byte for byte."""

from __future__ import annotations

import pytest

from reach_mesh import TaskState, protocol
from reach_mesh.hub._step_state import record_bytes
from reach_mesh.models import ErrorBody
from reach_mesh.workflow import StepResult, WorkflowRecord, WorkflowResult


def _result(state: TaskState, *, error: ErrorBody | None = None) -> WorkflowResult:
    steps = [
        StepResult(
            index=i,
            task_id=f"wf1-{i}",
            state=state,
            agent_id=None if i == 2 else f"demo.echo.a{i}",
            attempts=i,
            decided_by=None if i == 2 else 1,
            result=None if i == 2 else {"i": i, "nested": [None, "é", 1.5]},
            error=error if i == 2 else None,
            started_at=1.25,
        )
        for i in range(3)
    ]
    return WorkflowResult(
        workflow_id="wf1",
        kind="fanout",
        state=state,
        steps=steps,
        result=[{"i": 0}, None, {"i": 1}],
        error=error,
        trace_id="0af7651916cd43dd8448eb211c80319c",
        submitted_at=1.0,
        finished_at=2.5,
        duration_ms=1500.0,
    )


@pytest.mark.parametrize(
    "record",
    [
        WorkflowRecord(
            spec_digest="d" * 32,
            state=TaskState.SUCCEEDED,
            owner="hub-1",
            trace_id="0af7651916cd43dd8448eb211c80319c",
            submitted_at=1.0,
            result=_result(TaskState.SUCCEEDED),
        ),
        WorkflowRecord(
            state=TaskState.FAILED,
            owner="hub-2",
            cancel=ErrorBody(code="REACH_CANCELLED", message="cancelled by its caller"),
            first_agents=["demo.echo.a0", None],
            result=_result(
                TaskState.FAILED,
                error=ErrorBody(code="REACH_TIMEOUT", message="late", details={"x": None}),
            ),
        ),
        # Every other field None (left out): the result is the record's only field but state.
        WorkflowRecord(
            state=TaskState.TIMEOUT,
            result=WorkflowResult(workflow_id="w", kind="chain", state=TaskState.TIMEOUT),
        ),
    ],
)
def test_a_final_record_is_the_same_bytes_with_its_result_encoded_once(
    record: WorkflowRecord,
) -> None:
    assert record.result is not None
    result_json = protocol.encode(record.result)
    assert record_bytes(record, result_json) == protocol.encode(record)
