"""The chaos table's answer lines: what a caller's answer took is measured from its result's
``finished_at`` (before the hub's store, which a record bucket's election holds for seconds),
and apart from it from the record's write; and the waits that ran out with the result already
stored are counted — the question a ``partition`` run's 9-1,004 timed-out waits raised, which
the table could not answer (every one of them was a wait for a workflow not final yet). The
write's stream timestamp is when its leader took it: seed 210's three waits that ran out "after
the write" ran out before it was committed (its leader deposed 11 ms after taking it, the next
elected 5.3 s later), so the waits that ran out after the result's ``.done`` too — sent once
the write is acknowledged: a stored result missed — are counted apart."""

from __future__ import annotations

import json
import time

from nats.aio.client import Client as NATS
from nats.js.api import StorageType, StreamConfig

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._consume import ensure_workflow_resources

from .harness import DONE_CAPTURE, _after_write, _ran_out, ran_out_after_write
from .workload import DriverStats


def test_only_the_waits_that_ran_out_after_the_write_are_counted() -> None:
    written = {"a": 100.0, "b": 200.0}
    timed_out = {"a": [85.0, 100.5, 116.0], "b": [190.0], "c": [50.0]}  # c: never final
    gaps = ran_out_after_write(timed_out, written)
    assert gaps == [0.5, 16.0]
    # a's .done came 5 s after its write (the write committed by the next leader): its wait
    # 0.5 s after the write ran out before the result was stored, the one at 116 after.
    announced = ran_out_after_write(timed_out, {"a": 105.0, "b": 201.0})
    assert announced == [11.0]
    assert _ran_out(gaps, timed_out, announced) == (
        "2 of 5 (max 16.000 s after the write); after its first .done: 1 (max 11.000 s after it)"
    )
    assert _ran_out([], {"b": [190.0]}, []) == "0 of 1; after its first .done: 0"


async def test_the_write_is_read_from_the_stored_final_record(
    nats_url: str, namespace: str, nc: NATS
) -> None:
    js = nc.jetstream()
    # The bucket as a hub makes it (direct gets allowed...): one made here with nats-py's
    # defaults, when this test is the first on its server, answered every later direct get
    # of it "no responders" — every workflow read of the tests after it (ci177).
    await ensure_workflow_resources(js, MeshSettings(nats_url=nats_url))
    kv = await js.key_value(protocol.KV_WORKFLOWS)
    # The run's capture of every .done (the mesh announces on core NATS), as the harness
    # makes it; the tests' server is shared: it goes at the end.
    await js.add_stream(
        StreamConfig(
            name=DONE_CAPTURE,
            subjects=[protocol.wf_done(namespace, "*")],
            storage=StorageType.MEMORY,
        )
    )
    try:
        before = time.time()
        for wf in ("done", "stored"):
            await kv.put(
                protocol.workflow_key(namespace, wf),
                json.dumps({"state": "SUCCEEDED", "result": {"workflow_id": wf}}).encode(),
            )
        await kv.put(
            protocol.workflow_key(namespace, "running"),
            json.dumps({"state": "RUNNING", "result": None}).encode(),
        )
        after = time.time()
        # "stored" announced twice (a hub that took it over announces again): the first counts.
        for wf in ("stored", "stored"):
            await js.publish(protocol.wf_done(namespace, wf), b"{}")
        announced = time.time()
        stats = DriverStats()
        stats.timed_out = {
            "done": [before - 15.0, after + 2.0],  # its .done never came (lost, say)
            "stored": [announced + 1.0],
            "running": [after + 2.0],
        }
        stats.answer_lag = {"done": 20.0}
        stats.answered_at = {"done": after + 3.0}
        async with Client(settings=MeshSettings(nats_url=nats_url, namespace=namespace)) as client:
            await _after_write(client, namespace, stats)
    finally:
        await js.delete_stream(DONE_CAPTURE)
    # The final record's write, not the time of the wait: two waits ran out after it; the
    # running workflow's record has no write to measure from.
    gap_stored, gap = stats.ran_out_stored  # (sorted)
    assert 2.0 - 0.5 <= gap <= after + 2.0 - before + 0.5
    assert 1.0 <= gap_stored <= announced + 1.0 - before + 0.5
    assert 3.0 - 0.5 <= stats.after_write["done"] <= after + 3.0 - before + 0.5
    assert "running" not in stats.after_write
    # Only "stored"'s wait ran out after its .done (its first capture, the only kept).
    ((gap_announced,),) = [stats.ran_out_announced]
    assert 1.0 - 0.5 <= gap_announced <= 1.0 + 0.5
    assert set(stats.written) == {"done", "stored"}
    assert set(stats.announced) == {"stored"}
