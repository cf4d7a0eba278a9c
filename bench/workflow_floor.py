"""The workflow floor: a fanout(3)'s and a chain(3)'s NATS exchanges with no engine in between.

Issue 15 asks how fast a fanout(3) and a chain(3) can go. Part of the answer is what the
messages alone cost: this runs the same JetStream exchanges they make in reach-mesh, over the
same transport
(``reach_mesh._jspub.JsClient`` for acked publishes, ``reach_mesh._consume``'s
pull consumer), between the same processes (a "hub", a process of three "agents", the caller),
and nothing else: no validation, routing, task tracking, tracing, events or retries.

Per fanout(3), as the engine does it (docs/workflows.md, "Performance"):

* caller: stores the submission (acked publish) and waits for ``.done`` (a core subscription);
* hub: pulls the submission, creates the workflow record (KV compare-and-set), stores three work
  messages (acked, ``Nats-Msg-Id``), waits for the three final statuses (a core subscription),
  writes the final record (compare-and-set on its revision), announces it on ``.done`` (core
  NATS, not stored), acks the submission (riding along with the next request, as the hub's
  ``ack_later`` does);
* each agent: pulls its work message, stores its final status (acked), acks the work message
  (riding along). (A fresh step needs no read of its task record: docs/workflows.md, "Agent
  side: idempotency".)

That is 9 stored messages, as in the engine. A chain(3) runs the steps one
after the other, and before sending the second and the third it creates their task records (a KV
compare-and-set each), as the engine does for a step chosen when it starts: 11 stored messages.
Streams are R1 file storage, as the bench's engine runs them. What the engine costs above this
floor is its own Python.

With ``--work-batch N`` (``run_floor(work_batch=N)``) the hub puts all the work it decides for
one agent in one pass of its event loop into one work message (at most ``N`` steps, one line
each, sent in the pass after), and an agent stores each step's final status (one message per
step, as before) and acks the work message once all of them are stored: the ceiling of batched
step delivery (issue 15). Under load a fanout(3) then stores 6 messages plus its share of the
batches; alone, still 9.

``python bench/workflow_floor.py --quick`` prints one JSON object; the bench harness imports
:func:`run_floor`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from bench._jsstats import free_port
from bench._procs import stdin_closed
from reach_mesh import _runner
from reach_mesh._consume import PullConsumer
from reach_mesh._jspub import JsClient
from reach_mesh._nats import ensure_kv
from reach_mesh.server import EmbeddedNats

__all__ = ["run_floor"]

AGENTS = 3
#: Work and status bodies about the size of the engine's (envelope, final status).
_WORK = json.dumps({"task_id": "x" * 40, "attempt": 1, "payload": {"i": 0}, "pad": "p" * 200})
_STATUS = json.dumps({"state": "SUCCEEDED", "result": {"i": 0}, "pad": "p" * 200})


class _Names:
    """Subjects, streams and buckets of one run (``tag`` keeps runs apart)."""

    def __init__(self, tag: str, work_batch: int = 0) -> None:
        self.tag = tag
        #: At most this many steps in one work message (0: one step per message, no batching).
        self.work_batch = work_batch
        self.submit_stream = f"FLOOR_SUBMIT_{tag}"
        self.work_stream = f"FLOOR_WORK_{tag}"
        self.status_stream = f"FLOOR_STATUS_{tag}"
        self.wf_bucket = f"floor_wf_{tag}"
        self.tasks_bucket = f"floor_tasks_{tag}"

    def submit(self, kind: str, wf_id: str) -> str:
        return f"floor.{self.tag}.submit.{kind}.{wf_id}"

    def work(self, agent: int) -> str:
        return f"floor.{self.tag}.work.a{agent}"

    def status(self, task_id: str) -> str:
        return f"floor.{self.tag}.status.{task_id}"

    def done(self, wf_id: str) -> str:
        return f"floor.{self.tag}.done.{wf_id}"


async def _setup(nc: NATS, n: _Names) -> None:
    js = nc.jetstream(timeout=10.0)
    file = StorageType.FILE
    await js.add_stream(
        StreamConfig(
            name=n.submit_stream,
            subjects=[n.submit("*", "*")],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=file,
        )
    )
    await js.add_stream(
        StreamConfig(
            name=n.work_stream,
            subjects=[f"floor.{n.tag}.work.*"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=file,
        )
    )
    await js.add_stream(StreamConfig(name=n.status_stream, subjects=[n.status("*")], storage=file))
    for bucket in (n.wf_bucket, n.tasks_bucket):
        await ensure_kv(js, bucket)  # as the engine's buckets are made
    await js.add_consumer(n.submit_stream, durable_name="hub", ack_policy="explicit")
    for i in range(AGENTS):
        await js.add_consumer(
            n.work_stream, durable_name=f"a{i}", filter_subject=n.work(i), ack_policy="explicit"
        )


async def _teardown(nc: NATS, n: _Names) -> None:
    js = nc.jetstream(timeout=10.0)
    for name in (
        n.submit_stream,
        n.work_stream,
        n.status_stream,
        f"KV_{n.wf_bucket}",
        f"KV_{n.tasks_bucket}",
    ):
        with contextlib.suppress(Exception):
            await js.delete_stream(name)


async def _serve(
    nc: NATS,
    jsc: JsClient,
    stream: str,
    durable: str,
    capacity: int,
    handle: Callable[[Msg], Awaitable[None]],
    stop: asyncio.Future[None],
) -> None:
    """Pull ``durable`` and run ``handle`` on each message in a task of its own, until
    ``stop``."""
    tasks: set[asyncio.Task[None]] = set()

    async def run(msg: Msg) -> None:
        try:
            await handle(msg)
            jsc.ack_later(msg)
        finally:
            pull.release()

    def on_msg(msg: Msg) -> None:
        task = asyncio.ensure_future(run(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await jsc.start()
    pull = PullConsumer(nc, stream, durable, on_msg, capacity)
    await pull.start()
    await stop
    await pull.stop()
    await jsc.stop()


async def _hub(nc: NATS, n: _Names, stop: asyncio.Future[None]) -> None:
    jsc = JsClient(nc)
    waiting: dict[str, asyncio.Future[None]] = {}
    loop = asyncio.get_running_loop()

    async def on_status(msg: Msg) -> None:
        fut = waiting.pop(msg.subject.rsplit(".", 1)[1], None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    #: Per agent, the steps decided in this pass and not sent yet (``work_batch``): their
    #: lines, and the futures of the steps waiting for them to be stored.
    lines: dict[int, list[bytes]] = {}
    stored: dict[int, asyncio.Future[None]] = {}
    sending: set[asyncio.Task[None]] = set()

    async def send_batch(agent: int, batch: list[bytes], done: asyncio.Future[None]) -> None:
        first = batch[0].split(b" ", 1)[0].decode()
        try:
            await jsc.publish(
                n.work(agent), b"\n".join(batch), {"Nats-Msg-Id": f"{first}#1+{len(batch)}"}
            )
            done.set_result(None)
        except Exception as err:  # the bench's callers count it as an error
            done.set_exception(err)

    def flush(agent: int) -> None:
        batch = lines.pop(agent, None)
        done = stored.pop(agent, None)
        if batch and done is not None:
            task = asyncio.ensure_future(send_batch(agent, batch, done))
            sending.add(task)
            task.add_done_callback(sending.discard)

    async def send(task_id: str, agent: int) -> asyncio.Future[None]:
        fut = waiting[task_id] = loop.create_future()
        if not n.work_batch:
            await jsc.publish(n.work(agent), _WORK.encode(), {"Nats-Msg-Id": f"{task_id}#1"})
            return fut
        batch = lines.get(agent)
        if batch is None:  # the first step for this agent in this pass: sent in the next one
            batch = lines[agent] = []
            stored[agent] = loop.create_future()
            loop.call_soon(flush, agent)
        done = stored[agent]
        batch.append(f"{task_id} {_WORK}".encode())
        if len(batch) >= n.work_batch:
            flush(agent)
        await asyncio.shield(done)
        return fut

    async def workflow(msg: Msg) -> None:
        _, kind, wf_id = msg.subject.rsplit(".", 2)
        rev = await jsc.kv_write(n.wf_bucket, wf_id, msg.data, 0)
        if kind == "fanout":
            sent = await asyncio.gather(*(send(f"{wf_id}-{i}", i) for i in range(AGENTS)))
            await asyncio.gather(*sent)
        else:
            for i in range(AGENTS):
                task_id = f"{wf_id}-{i}"
                if i:  # a step chosen when it starts: its task record first
                    await jsc.kv_write(n.tasks_bucket, task_id, _WORK.encode(), 0)
                await (await send(task_id, i))
        await jsc.kv_write(n.wf_bucket, wf_id, msg.data, rev)
        await jsc.send(n.done(wf_id), msg.data)

    await nc.subscribe(n.status("*"), cb=on_status, pending_msgs_limit=-1)
    await _serve(nc, jsc, n.submit_stream, "hub", 512, workflow, stop)


async def _agent(nc: NATS, n: _Names, index: int, stop: asyncio.Future[None]) -> None:
    jsc = JsClient(nc)

    async def one(task_id: str) -> None:
        await jsc.publish(n.status(task_id), _STATUS.encode(), {"Nats-Msg-Id": task_id})

    async def step(msg: Msg) -> None:
        if not n.work_batch:
            await one((msg.headers or {}).get("Nats-Msg-Id", "").split("#", 1)[0])
            return
        steps = [line.split(b" ", 1) for line in msg.data.split(b"\n")]
        # Each line as the engine would read it (a JSON object), then every status stored
        # before the work message is acked (``_serve`` acks it when this returns).
        ids = [task_id.decode() for task_id, body in steps if json.loads(body)]
        await asyncio.gather(*(one(task_id) for task_id in ids))

    await _serve(nc, jsc, n.work_stream, f"a{index}", 256, step, stop)


async def _child(role: str, nats_url: str, tag: str, work_batch: int) -> None:
    """``--role hub|agents``: serve until stdin closes."""
    names = _Names(tag, work_batch)
    stop = stdin_closed()
    conns = [await nats.connect(nats_url) for _ in range(1 if role == "hub" else AGENTS)]
    if role == "hub":
        serving = [_hub(conns[0], names, stop)]
    else:
        serving = [_agent(nc, names, i, stop) for i, nc in enumerate(conns)]
    runs = asyncio.gather(*serving)
    await asyncio.sleep(0.2)  # pulls outstanding
    print("READY", flush=True)
    _runner.settle()
    await runs
    for nc in conns:
        await nc.drain()


async def run_floor(
    nats_url: str,
    quick: bool,
    *,
    server_pid: int | None = None,
    monitor_url: str | None = None,
    concurrency: int = 64,
    n_seq: int | None = None,
    duration: float | None = None,
    rates: dict[str, float] | None = None,
    work_batch: int = 0,
) -> dict[str, Any]:
    """Per kind (``fanout3``, ``chain3``): the bare exchanges' sequential latency (``n_seq``
    workflows), sustained rate (``concurrency`` in flight for ``duration`` s) with what a
    workflow costs there (``cost``, as ``bench.workflow_bench.measure_cost`` counts the
    engine's), and latency with CPU µs per workflow at fixed offered loads (``open_loop``):
    100/s and ``rates[kind]`` (the engine's half rate, to compare at the same load).
    ``work_batch``: at most this many steps per work message (0: one each, as the engine)."""
    # Imported here: bench.workflow_bench imports this module to run it after the engine.
    from bench.workflow_bench import (
        LOW_RATE,
        _lat,
        _sequential,
        _sustained,
        at_rates,
        child_processes,
        measure_cost,
    )

    tag = uuid.uuid4().hex[:8]
    names = _Names(tag, work_batch)
    nc = await nats.connect(nats_url)
    await _setup(nc, names)
    jsc = JsClient(nc)
    await jsc.start()
    waiting: dict[str, asyncio.Future[None]] = {}

    async def on_done(msg: Msg) -> None:
        fut = waiting.pop(msg.subject.rsplit(".", 1)[1], None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    await nc.subscribe(names.done("*"), cb=on_done, pending_msgs_limit=-1)
    loop = asyncio.get_running_loop()
    n_seq = n_seq or (200 if quick else 1000)
    duration = duration or (3.0 if quick else 10.0)
    out: dict[str, Any] = {}
    try:
        async with child_processes(
            __file__, nats_url, ["--tag", tag, "--work-batch", str(work_batch)]
        ) as pids:
            procs: dict[str, int | None] = {
                **pids,
                "caller": os.getpid(),
                "nats_server": server_pid,
            }
            costing = functools.partial(measure_cost, nats_url, procs, monitor_url=monitor_url)
            for key, kind in (("fanout3", "fanout"), ("chain3", "chain")):
                body = json.dumps({"kind": kind, "steps": [{"i": i} for i in range(AGENTS)]})

                async def one(kind: str = kind, body: bytes = body.encode()) -> None:
                    wf_id = uuid.uuid4().hex
                    fut = waiting[wf_id] = loop.create_future()
                    await jsc.publish(names.submit(kind, wf_id), body, {"Nats-Msg-Id": wf_id})
                    await asyncio.wait_for(fut, 30)

                await _sequential(one, 20)
                seq = await _sequential(one, n_seq)
                sustained, cost = await costing(lambda: _sustained(one, concurrency, duration))
                half = (rates or {}).get(key)
                points = await at_rates(
                    one,
                    {"100": LOW_RATE, **({"engine_half": half} if half else {})},
                    min(duration, 2.0 if quick else 5.0),
                    costing,
                )
                out[key] = {**_lat(seq), "sustained": sustained, "cost": cost, "open_loop": points}
    finally:
        await jsc.stop()
        await _teardown(nc, names)
        await nc.close()
    return out


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    if args.nats:
        return await run_floor(args.nats, args.quick, work_batch=args.work_batch)
    port = free_port()
    async with EmbeddedNats(http_port=port) as server:
        pid = server.proc.pid if server.proc is not None else None
        return await run_floor(
            server.url,
            args.quick,
            server_pid=pid,
            monitor_url=f"http://127.0.0.1:{port}",
            work_batch=args.work_batch,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (~15 s)")
    parser.add_argument("--nats", default=None, help="use this NATS URL instead of embedding")
    parser.add_argument("--role", choices=["hub", "agents"], help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument(
        "--work-batch",
        type=int,
        default=0,
        metavar="N",
        help="at most N steps per work message, decided in one loop pass (0: one each)",
    )
    args = parser.parse_args()
    if args.role:
        _runner.run(_child(args.role, args.nats, args.tag, args.work_batch))
        return
    print(json.dumps(_runner.run(_main(args)), indent=2))


if __name__ == "__main__":
    main()
