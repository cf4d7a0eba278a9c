"""``workflow_retention``: the streams and KV buckets of workflows carry it as their max age, a
hub applies a changed value to the ones that exist, and a retention shorter than a step may stay
unfinished is refused. Each test has its own nats-server: retention is server-wide state."""

from __future__ import annotations

import nats
import pytest

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
