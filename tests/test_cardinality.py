"""Bounded cardinality: what a hub keeps per namespace is bounded by the namespaces that exist
(registered agents, settings), not by what callers type."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path
from typing import Any

import nats
import pytest

from reach_mesh import Client, MeshSettings, UnknownNamespaceError, protocol
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.hub import _hub as hub_module

from .helpers import eventually, fetch

UNKNOWN = 10_000
WARMUP = 1_000


def rss_kib() -> int:
    """This process's resident set (the hub under test runs in it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


async def _route_unknown(nc: Any, prefix: str, count: int) -> set[str]:
    """``count`` route requests, each to a different well-formed namespace nobody registered,
    pipelined (one reply subscription): the set of error codes they got."""
    body = json.dumps({"capability": "work:echo:v1", "payload": 1}).encode()
    codes: set[str] = set()
    answered = asyncio.Event()
    inbox = nc.new_inbox()

    async def on_reply(msg: Any) -> None:
        codes.add(json.loads(msg.data)["error"]["code"])
        nonlocal count
        count -= 1
        if count == 0:
            answered.set()

    sub = await nc.subscribe(f"{inbox}.*", cb=on_reply)
    for i in range(count):
        subject = protocol.hub_subject(f"{prefix}{i}", "route")
        await nc.publish(subject, body, reply=f"{inbox}.{i}")
        if i % 500 == 499:
            await nc.flush()
    await nc.flush()
    await asyncio.wait_for(answered.wait(), timeout=25)
    await sub.unsubscribe()
    return codes


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def _sample(exposition: bytes, series: str) -> float:
    """The value of one series (its name and labels as ``/metrics`` writes them), 0 if absent."""
    for line in exposition.decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


async def test_routes_to_unknown_namespaces_leave_no_trace(
    settings: MeshSettings, namespace: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """... but one: they are counted together, as namespace ``(unknown)``, and logged at a
    rate (a caller with a misspelled namespace fails every request; an operator sees it)."""
    async with Hub(settings=settings.model_copy(update={"http_port": 0})) as hub:
        agent = Agent(f"{namespace}.w.a1", settings=settings)

        @agent.handler("work:echo:v1")
        async def echo(task: Task[Any]) -> Any:
            return task.payload

        audited: list[str] = []
        nc = await nats.connect(nats_url)

        async def on_audit(msg: Any) -> None:
            audited.append(msg.subject)

        await nc.subscribe("reach.audit.>", cb=on_audit)
        await nc.flush()  # the server has the subscription before the hub audits anything
        async with agent, Client(settings=settings) as c:
            assert (await c.request(capability="work:echo:v1", payload=1)).ok
            prefix = f"{namespace}x"  # namespaces no test registers
            # Warm up the hub's (and this process's) caches and allocator, then measure.
            assert await _route_unknown(nc, f"{prefix}w", WARMUP) == {"REACH_UNKNOWN_NAMESPACE"}
            await asyncio.sleep(0.2)  # audit batches flush every ~75 ms
            gc.collect()
            _, before = await fetch(f"{hub.http_url}/metrics")
            rss_before = rss_kib()
            codes = await _route_unknown(nc, prefix, UNKNOWN)
            assert codes == {"REACH_UNKNOWN_NAMESPACE"}
            await asyncio.sleep(0.2)
            gc.collect()
            _, after = await fetch(f"{hub.http_url}/metrics")
            rss_after = rss_kib()
            # A known namespace is still counted and audited (the audit feed works).
            await c.request(capability="work:echo:v1", payload=2)
            await eventually(lambda: any(f".{namespace}.route" in s for s in audited))
        await nc.close()
    growth_metrics = (len(after) - len(before)) / len(before)
    growth_rss = (rss_after - rss_before) / rss_before
    print(
        f"/metrics {len(before)} -> {len(after)} bytes ({growth_metrics:+.2%}), "
        f"RSS {rss_before} -> {rss_after} KiB ({growth_rss:+.2%}) after {UNKNOWN} namespaces"
    )
    assert abs(growth_metrics) < 0.05
    assert growth_rss < 0.05
    assert prefix.encode() not in after
    assert not [s for s in audited if s.split(".")[2].startswith(prefix)]
    counted = 'reach_task_total{mode="proxy",namespace="(unknown)",state="UNKNOWN_NAMESPACE"}'
    assert _sample(after, counted) - _sample(before, counted) == UNKNOWN
    told = [r for r in caplog.records if getattr(r, "unknown_namespace", False)]
    assert told and told[0].event == "REACH-SELECT-EMPTY", told  # type: ignore[attr-defined]
    assert len(told) <= 2  # one per 10 s for every unknown namespace together


async def test_unknown_namespace_is_a_typed_no_match(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    other = settings.model_copy(update={"namespace": f"{namespace}nobody"})
    async with Client(settings=other) as c:
        with pytest.raises(UnknownNamespaceError) as caught:
            await c.request(capability="work:echo:v1", payload=1)
        assert caught.value.details["namespace"] == f"{namespace}nobody"
    # Configured namespaces exist before any agent registers: a plain NO_MATCH there.
    configured = settings.model_copy(update={"namespaces": (f"{namespace}later",)})
    async with Hub(settings=configured) as hub2:
        assert hub2.known_namespace(f"{namespace}later")
        assert not hub2.known_namespace(f"{namespace}nobody")
        assert hub2.known_namespace(namespace)  # the hub's own `namespace` setting


async def test_what_a_hub_remembers_per_task_shares_one_copy_of_its_namespace(
    hub: Hub, settings: MeshSettings
) -> None:
    """Each route request's subject is a new string, and so was the namespace taken from it:
    a hub's pins (up to 100,000 of its own) held one copy each. They are kept by namespace
    now: one copy, the key of its pins."""
    agent = Agent(f"{settings.namespace}.shared.a1", settings=settings)

    @agent.handler("work:shared:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    async with agent, Client(settings=settings) as mesh:
        for n in range(3):
            assert (await mesh.request(capability="work:shared:v1", payload=n)).ok
    # Kept by namespace: the namespace is held once, as the key of its pins.
    kept = hub._pins._own._by_ns
    assert len(kept[settings.namespace]) == 3
    assert sum(1 for ns in kept if ns == settings.namespace) == 1


async def test_a_namespace_gone_from_the_hub_loses_its_series(
    settings: MeshSettings, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A namespace's series (``reach_task_total``, ``reach_lease_expired_total``…) stay while
    it has an agent here, and ``NAMESPACE_SERIES_KEPT`` after its last one left, then go —
    not kept for the hub's life. A configured namespace keeps them; one that comes back
    counts from 0 again (its cached counter child is not a ghost)."""
    monkeypatch.setattr(hub_module, "NAMESPACE_SERIES_KEPT", 0.5)
    configured = f"{namespace}c"
    s = settings.model_copy(update={"http_port": 0, "namespaces": [configured]})
    tenant = settings.model_copy(update={"namespace": f"{namespace}g"})
    gone = f'namespace="{tenant.namespace}"'.encode()
    kept = f'namespace="{configured}"'.encode()

    def echo_agent(name: str) -> Agent:
        agent = Agent(f"{tenant.namespace}.{name}", settings=tenant)

        @agent.handler("work:echo:v1")
        async def echo(task: Task[Any]) -> Any:
            return task.payload

        return agent

    async with Hub(settings=s) as hub:
        assert hub.http_url is not None
        metrics = f"{hub.http_url}/metrics"
        async with echo_agent("w.a1"), Client(settings=tenant) as c:
            assert (await c.request(capability="work:echo:v1", payload=1)).ok
            _, text = await fetch(metrics)
            assert _series(text, "reach_task_total", gone)
            assert _series(text, "reach_lease_expired_total", gone)
        assert not hub.registry.has_namespace(tenant.namespace)
        _, text = await fetch(metrics)  # gone for less than the time kept: still there
        assert gone in text and kept in text

        async def forgotten() -> bool:
            _, text = await fetch(metrics)
            return gone not in text

        await eventually(forgotten, timeout=5, interval=0.2)
        _, text = await fetch(metrics)
        assert kept in text  # configured: its series stay (all zeros, for the alerts)
        # Back: counted from 0 on a new series.
        async with echo_agent("w.a2"), Client(settings=tenant) as c:
            assert (await c.request(capability="work:echo:v1", payload=2)).ok
            _, text = await fetch(metrics)
        assert _series(text, "reach_task_total", gone) == [
            f'reach_task_total{{mode="proxy",{gone.decode()},state="SUCCEEDED"}} 1.0'
        ]


def _series(text: bytes, name: str, label: bytes) -> list[str]:
    """The lines of ``/metrics`` ``text`` of metric ``name`` with ``label``."""
    return [
        line
        for line in text.decode().splitlines()
        if line.startswith(name + "{") and label.decode() in line
    ]
