"""``workflow_retention``: the streams and KV buckets of workflows carry it as their max age, a
hub applies a changed value to the ones that exist, and a retention shorter than a step may stay
unfinished is refused. Each test has its own nats-server: retention is server-wide state."""

from __future__ import annotations

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from reach_mesh import MeshSettings, protocol
from reach_mesh._consume import RETENTION_STREAMS
from reach_mesh.config import load_settings
from reach_mesh.errors import BadRequestError
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats


async def _ages(url: str) -> dict[str, tuple[float | None, float | None]]:
    """max_age and duplicate_window (seconds) of every retention stream, as the server has them."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        out = {}
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


async def _events_stream_of_an_earlier_version(js: JetStreamContext) -> None:
    """``REACH_WF_EVENTS`` as earlier versions made it: no direct gets, no republish."""
    await js.add_stream(
        StreamConfig(
            name=protocol.STREAM_WF_EVENTS,
            subjects=[protocol.wf_event("*", "*"), protocol.wf_done("*", "*")],
        )
    )


async def test_a_hub_upgrades_the_results_stream_of_an_earlier_version() -> None:
    """``REACH_WF_EVENTS`` as an earlier version made it (no direct gets, no republish): a hub
    gives it both at start, so a workflow's result reaches its caller on ``.result`` and reads
    back by subject."""
    from reach_mesh import Client, Step
    from reach_mesh.agent import Agent, Task

    async with EmbeddedNats() as server:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await _events_stream_of_an_earlier_version(js)
            s = MeshSettings(nats_url=server.url, namespace="up")
            agent = Agent("up.echo.a1", settings=s)

            @agent.handler("up:echo:v1")
            async def echo(task: Task[int]) -> int:
                return task.payload

            async with Hub(settings=s), agent, Client(settings=s) as mesh:
                cfg = (await js.stream_info(protocol.STREAM_WF_EVENTS)).config
                assert cfg.allow_direct and cfg.republish is not None
                assert (cfg.republish.src, cfg.republish.dest) == protocol.WF_RESULT_REPUBLISH
                result = await mesh.chain([Step(capability="up:echo:v1", payload=7)], timeout=10)
                assert result.ok and result.result == 7
                assert await mesh.workflow(result.workflow_id, timeout=1) == result
        finally:
            await nc.close()


async def test_a_result_an_earlier_version_stored_in_the_record_is_read() -> None:
    """Hubs of an earlier version wrote the result into the workflow record (and made
    ``REACH_WF_EVENTS`` without direct gets): ``workflow()`` reads it from there."""
    from reach_mesh import Client
    from reach_mesh._nats import ensure_kv
    from reach_mesh.models import TaskState
    from reach_mesh.workflow import WorkflowRecord, WorkflowResult

    async with EmbeddedNats() as server:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await _events_stream_of_an_earlier_version(js)
            kv = await ensure_kv(js, protocol.KV_WORKFLOWS)
            result = WorkflowResult(
                workflow_id="old-one", kind="chain", state=TaskState.SUCCEEDED, result=[1]
            )
            record = WorkflowRecord(state=TaskState.SUCCEEDED, result=result)
            await kv.put(protocol.workflow_key("old", "old-one"), protocol.encode(record))
            s = MeshSettings(nats_url=server.url, namespace="old")
            async with Client(settings=s) as mesh:
                assert await mesh.workflow("old-one", timeout=1) == result
        finally:
            await nc.close()
