"""The chaos table's answer lines: what a caller's answer took is measured from its result's
``finished_at`` (before the hub's store, which a record bucket's election holds for seconds),
and apart from it from the record's write; and the waits that ran out with the result already
stored are counted — the question a ``partition`` run's 9-1,004 timed-out waits raised, which
the table could not answer (every one of them was a wait for a workflow not final yet)."""

from __future__ import annotations

import json
import time

from nats.aio.client import Client as NATS

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._consume import ensure_workflow_resources

from .harness import _after_write, _ran_out, ran_out_after_write
from .workload import DriverStats


def test_only_the_waits_that_ran_out_after_the_write_are_counted() -> None:
    written = {"a": 100.0, "b": 200.0}
    timed_out = {"a": [85.0, 100.5, 116.0], "b": [190.0], "c": [50.0]}  # c: never final
    gaps = ran_out_after_write(timed_out, written)
    assert gaps == [0.5, 16.0]
    assert _ran_out(gaps, timed_out) == "2 of 5 (max 16.000 s after the write)"
    assert _ran_out([], {"b": [190.0]}) == "0 of 1"


async def test_the_write_is_read_from_the_stored_final_record(
    nats_url: str, namespace: str, nc: NATS
) -> None:
    js = nc.jetstream()
    # The bucket as a hub makes it (direct gets allowed...): one made here with nats-py's
    # defaults, when this test is the first on its server, answered every later direct get
    # of it "no responders" — every workflow read of the tests after it (ci177).
    await ensure_workflow_resources(js, MeshSettings(nats_url=nats_url))
    kv = await js.key_value(protocol.KV_WORKFLOWS)
    before = time.time()
    await kv.put(
        protocol.workflow_key(namespace, "done"),
        json.dumps({"state": "SUCCEEDED", "result": {"workflow_id": "done"}}).encode(),
    )
    await kv.put(
        protocol.workflow_key(namespace, "running"),
        json.dumps({"state": "RUNNING", "result": None}).encode(),
    )
    after = time.time()
    stats = DriverStats()
    stats.timed_out = {"done": [before - 15.0, after + 2.0], "running": [after + 2.0]}
    stats.answer_lag = {"done": 20.0}
    stats.answered_at = {"done": after + 3.0}
    async with Client(settings=MeshSettings(nats_url=nats_url, namespace=namespace)) as client:
        await _after_write(client, namespace, stats)
    # The final record's write, not the time of the wait: one wait ran out after it; the
    # running workflow's record has no write to measure from.
    ((gap,),) = [stats.ran_out_stored]
    assert 2.0 - 0.5 <= gap <= after + 2.0 - before + 0.5
    assert 3.0 - 0.5 <= stats.after_write["done"] <= after + 3.0 - before + 0.5
    assert "running" not in stats.after_write
