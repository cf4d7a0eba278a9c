"""``workflow_retention``: the streams and KV buckets of workflows carry it as their max age, a
hub applies a changed value to the ones that exist, and a retention shorter than a step may stay
unfinished is refused, and so is a workflow that would outlive its records. Each test has its own
nats-server: retention is server-wide state."""

from __future__ import annotations

from typing import Any

import nats
import pytest

from reach_mesh import Client, MeshSettings, Step, protocol
from reach_mesh._consume import RETENTION_STREAMS
from reach_mesh.agent import Agent, Task
from reach_mesh.config import load_settings
from reach_mesh.errors import BadRequestError
from reach_mesh.hub import Hub
from reach_mesh.models import TaskState
from reach_mesh.server import EmbeddedNats


async def _ages(url: str) -> dict[str, tuple[float | None, float | None]]:
    """max_age and duplicate_window (seconds) of every retention stream, as the server has them."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        out: dict[str, tuple[float | None, float | None]] = {}
        for name in RETENTION_STREAMS:
            cfg = (await js.stream_info(name)).config
            out[name] = (cfg.max_age, cfg.duplicate_window)
        return out
    finally:
        await nc.close()


async def test_streams_and_buckets_carry_the_configured_retention() -> None:
    async with EmbeddedNats() as server:
        first = MeshSettings(nats_url=server.url, workflow_retention=3600, task_ttl=600)
        async with Hub(settings=first):
            ages = await _ages(server.url)
        # Created by this hub: every stream and bucket has the configured age.
        assert {name: age for name, (age, _) in ages.items()} == dict.fromkeys(
            RETENTION_STREAMS, 3600.0
        )
        # A later hub with another retention changes the existing ones; duplicate windows stay
        # within the age (the server refuses a window longer than the age).
        later = first.model_copy(update={"workflow_retention": 900.0})
        async with Hub(settings=later) as hub:
            ages = await _ages(server.url)
            assert {name: age for name, (age, _) in ages.items()} == dict.fromkeys(
                RETENTION_STREAMS, 900.0
            )
            assert all(w is not None and w <= 900.0 for _, w in ages.values())
            assert ages[protocol.STREAM_WF][1] == min(later.dedup_window, 900.0)
            # The bucket still works after its TTL changed: the KV API reads the new TTL.
            js = hub.nc.jetstream()
            kv = await js.key_value(protocol.KV_WORKFLOWS)
            assert (await kv.status()).ttl == 900.0
            await kv.put("retention.check", b"1")
            assert (await kv.get("retention.check")).value == b"1"


def test_retention_from_the_environment_and_its_lower_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REACH_WORKFLOW_RETENTION", "3600")
    monkeypatch.setenv("REACH_TASK_TTL", "1800")
    assert load_settings().workflow_retention == 3600.0
    monkeypatch.setenv("REACH_WORKFLOW_RETENTION", "60")
    with pytest.raises(BadRequestError, match="workflow_retention 60s is shorter than task_ttl"):
        load_settings()
    # The default keeps finished workflows for 24 h.
    assert MeshSettings().workflow_retention == 86400.0


async def test_a_workflow_that_would_outlive_its_records_is_refused() -> None:
    """A record is written when a workflow starts and when it ends, and dropped
    ``workflow_retention`` after its write: a run longer than that lost it and ended TIMEOUT
    at that age, its steps' results dropped. Such a workflow is refused when submitted, saying
    why; one within ``longest_workflow`` runs."""
    async with EmbeddedNats() as server:
        settings = MeshSettings(
            nats_url=server.url, namespace="ret", workflow_retention=120, task_ttl=30
        )
        assert settings.longest_workflow == 60.0  # less a minute for the final write
        agent = Agent("ret.echo.a1", settings=settings)
        runs: list[Any] = []

        @agent.handler("test:echo:v1")
        async def echo(task: Task[Any]) -> Any:
            runs.append(task.payload)
            return task.payload

        async with Hub(settings=settings), agent, Client(settings=settings) as mesh:
            steps = [Step(capability="test:echo:v1", payload=1)]
            refused = await mesh.fanout(steps, timeout=61)
            assert refused.state is TaskState.FAILED and refused.error is not None, refused
            assert refused.error.code == "REACH_BAD_WORKFLOW", refused.error
            assert "longer than the hubs keep a running workflow's records (60s" in (
                refused.error.message
            ), refused.error
            assert runs == []  # nothing ran
            ran = await mesh.fanout(steps, timeout=60)
            assert ran.state is TaskState.SUCCEEDED, ran
            ran = await mesh.fanout(steps)  # no timeout: task_ttl (30 s) bounds it
            assert ran.state is TaskState.SUCCEEDED, ran
