"""The pinned NATS image of docker/, started through testcontainers: a routed request, a fanout
and a scrape against it.

Skipped, saying why, where no Docker engine is reachable (the development machines and CI have
none). Where one is: ``pip install -e '.[dev,docker]'`` and
``pytest tests/test_containers.py -v`` (docker/README.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from reach_mesh import Client, MeshSettings, Step
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub

from .helpers import fetch
from .test_deploy import DOCKER


def _nats_image() -> str:
    """The image docker-compose.yml runs: the container test and the stack agree."""
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    image: str = compose["services"]["nats-1"]["image"]
    return image


def _docker_unreachable() -> str | None:
    """Why no container can be started here, or None when a Docker engine answers."""
    try:
        import docker
    except ImportError:
        return "testcontainers is not installed: pip install -e '.[dev,docker]'"
    try:
        # mypy resolves ``docker`` to the repository's docker/ directory, not the package.
        docker.from_env(timeout=3).ping()  # type: ignore[attr-defined]
    except Exception as err:
        return f"no Docker engine reachable ({type(err).__name__}: {err})"
    return None


@pytest.fixture(scope="module")
def container_nats_url() -> Iterator[str]:
    reason = _docker_unreachable()
    if reason is not None:
        pytest.skip(reason)
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    container = DockerContainer(_nats_image()).with_command("-js").with_exposed_ports(4222)
    with container:
        wait_for_logs(container, "Server is ready", timeout=60)
        host = container.get_container_host_ip()
        yield f"nats://{host}:{container.get_exposed_port(4222)}"


async def test_routed_request_fanout_and_scrape_on_the_nats_image(
    container_nats_url: str,
) -> None:
    await exercise(container_nats_url)


async def exercise(nats_url: str) -> None:
    """A hub, an agent and a caller on ``nats_url``: a routed request, a fanout, a scrape."""
    settings = MeshSettings(nats_url=nats_url, namespace="containers")
    agent = Agent("containers.echo.e1", settings=settings)

    @agent.handler("echo:say:v1")
    async def say(task: Task[dict[str, Any]]) -> dict[str, Any]:
        return {"said": task.payload}

    hub_settings = settings.model_copy(update={"http_port": 0})
    async with Hub(settings=hub_settings) as hub, agent, Client(settings=settings) as mesh:
        for _ in range(50):  # registration reaches the hub's watch
            if (await mesh.agents()) != []:
                break
            await asyncio.sleep(0.1)
        routed = await mesh.request(capability="echo:say:v1", payload={"n": 1})
        assert routed.ok and routed.result == {"said": {"n": 1}}
        fanned = await mesh.fanout(
            [Step(capability="echo:say:v1", payload={"n": i}) for i in range(3)], timeout=20
        )
        assert fanned.ok, fanned
        assert hub.http_url is not None
        status, body = await fetch(f"{hub.http_url}/metrics")
    assert status == 200
    counts = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    routed_key = (("mode", "proxy"), ("namespace", "containers"), ("state", "SUCCEEDED"))
    assert counts[("reach_task_total", routed_key)] == 1
    done = (("kind", "fanout"), ("namespace", "containers"), ("state", "SUCCEEDED"))
    assert counts[("reach_workflow_total", done)] == 1
