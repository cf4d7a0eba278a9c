"""The processes of tests/test_traces_e2e.py's multi-process trace: two agents and a caller.

``python -m tests.trace_processes alpha|beta|caller``, NATS at ``$REACH_NATS_URL``. None of them
calls ``configure_tracing``: the SDK objects themselves must honour ``OTEL_TRACES_EXPORTER``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from typing import Any

from reach_mesh import Client, MeshSettings, NoMatchError, Step
from reach_mesh.agent import Agent, Task, TaskFailed

NAMESPACE = "traced"


def alpha(namespace: str = NAMESPACE, settings: MeshSettings | None = None) -> Agent:
    """Service ``alpha``: the first step."""
    agent = Agent(f"{namespace}.alpha.a1", settings=settings)

    @agent.handler("trace:first:v1")
    async def first(task: Task[dict[str, Any]]) -> dict[str, Any]:
        return {"first": True, **task.payload}

    return agent


def beta(namespace: str = NAMESPACE, settings: MeshSettings | None = None) -> Agent:
    """Service ``beta``: the second step, and a handler that fails (a payload ``{"n": int}``
    that does not validate fails too)."""
    agent = Agent(f"{namespace}.beta.b1", settings=settings)

    @agent.handler("trace:second:v1")
    async def second(task: Task[dict[str, Any]]) -> dict[str, Any]:
        return {"second": True, **task.payload}

    @agent.handler("trace:fail:v1")
    async def fail(task: Task[dict[str, int]]) -> None:
        raise TaskFailed("refused on purpose")

    return agent


async def serve(agent: Agent) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with agent:  # not reach_mesh.agent.run(): the Agent alone must set tracing up
        print("ready", flush=True)
        await stop.wait()


async def call() -> None:
    async with Client(namespace=NAMESPACE, name="trace-caller") as mesh:
        deadline = time.monotonic() + 20
        while True:  # both agents registered?
            try:
                await mesh.request(capability="trace:second:v1", payload={}, timeout=2)
                await mesh.request(capability="trace:first:v1", payload={}, timeout=2)
                break
            except NoMatchError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        routed = await mesh.request(capability="trace:first:v1", payload={"n": 1})
        chain = await mesh.chain(
            [
                Step(capability="trace:first:v1", payload={"n": 2}),
                Step(capability="trace:second:v1"),
            ],
            timeout=20,
        )
        failed = await mesh.request(capability="trace:fail:v1", payload={})
    print(
        json.dumps(
            {
                "routed": [routed.trace_id, routed.state],
                "chain": [chain.trace_id, chain.state],
                "failed": [failed.trace_id, failed.state],
            }
        ),
        flush=True,
    )


def main() -> None:
    role = sys.argv[1]
    if role == "caller":
        asyncio.run(call())
    else:
        asyncio.run(serve(alpha() if role == "alpha" else beta()))


if __name__ == "__main__":
    main()
