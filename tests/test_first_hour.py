"""What a new user writes first: handlers in any reasonable shape, labels as Python values,
requests and workflows in the wrong namespace — each either works or says exactly why."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from reach_mesh import Client, MeshSettings, RetryPolicy, Step, TaskState
from reach_mesh.agent import Agent
from reach_mesh.errors import BadRequestError, NoMatchError
from reach_mesh.hub import Hub

pytestmark = pytest.mark.timeout(60)


class Pair(BaseModel):
    a: int
    b: int


# --------------------------------------------------------------------------- handlers


async def test_handlers_in_every_reasonable_shape(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    # ``Task`` is imported here only: with ``from __future__ import annotations`` the
    # annotations are strings, resolved where the handler is defined.
    from reach_mesh.agent import Task as LocalTask

    agent = Agent(f"{namespace}.shapes.a1", settings=settings)

    @agent.handler("shape:raw:v1")
    async def raw(task):
        return {"payload": task.payload, "task_id": bool(task.task_id)}

    @agent.handler("shape:local:v1")
    async def local(task: LocalTask[Pair]) -> int:
        return task.payload.a + task.payload.b

    @agent.handler("shape:bare:v1")
    async def bare(payload: dict[str, Any]) -> list[str]:
        return sorted(payload)

    @agent.handler("shape:model:v1")
    async def model(pair: Pair) -> int:
        return pair.a * pair.b

    for i in range(2):  # the closure-in-a-loop idiom

        @agent.handler(f"shape:loop{i}:v1")
        async def loop(task: LocalTask[int], _i: int = i) -> int:
            return task.payload + _i

    async with agent, Client(settings=settings) as mesh:
        got = await mesh.request(capability="shape:raw:v1", payload=[1, "x"])
        assert got.result == {"payload": [1, "x"], "task_id": True}
        assert (
            await mesh.request(capability="shape:local:v1", payload={"a": 2, "b": 3})
        ).result == 5
        bad = await mesh.request(capability="shape:local:v1", payload={"a": 2})
        assert bad.state is TaskState.FAILED and bad.error is not None
        assert bad.error.code == "REACH_BAD_REQUEST"
        got = await mesh.request(capability="shape:bare:v1", payload={"y": 1, "x": 2})
        assert got.result == ["x", "y"]
        assert (
            await mesh.request(capability="shape:model:v1", payload={"a": 4, "b": 5})
        ).result == 20
        assert (await mesh.request(capability="shape:loop0:v1", payload=10)).result == 10
        assert (await mesh.request(capability="shape:loop1:v1", payload=10)).result == 11


def test_handlers_that_cannot_work_are_refused_with_the_reason(settings: MeshSettings) -> None:
    agent = Agent("refuse.h.a1", settings=settings)
    with pytest.raises(TypeError, match="need defaults"):

        @agent.handler("refuse:two:v1")
        async def two(task, other):
            return None

    with pytest.raises(TypeError, match="cannot resolve an annotation"):

        @agent.handler("refuse:unknown:v1")
        async def unknown(task: NoSuchType) -> None:  # noqa: F821
            return None

    with pytest.raises(TypeError, match="async def"):

        @agent.handler("refuse:sync:v1")
        def sync(task):
            return None


# --------------------------------------------------------------------------- labels


async def test_label_numbers_and_booleans_become_selector_strings(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = Agent(
        f"{namespace}.labels.a1",
        labels={"mem_gb": 16, "gpu": True, "ratio": 0.5, "tier": "gold"},
        settings=settings,
    )

    @agent.handler("labels:echo:v1")
    async def echo(task):
        return task.payload

    assert agent.card().labels == {"mem_gb": "16", "gpu": "true", "ratio": "0.5", "tier": "gold"}
    async with agent, Client(settings=settings) as mesh:
        res = await mesh.request(
            selector="cap=labels:echo:v1 AND gpu=true AND mem_gb=16 AND ratio=0.5", payload=1
        )
        assert res.ok and res.agent_id == agent.agent_id


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ({"mem": [16]}, "label 'mem' is a list"),
        ({"mem": None}, "label 'mem' is a NoneType"),
        ({"bad key": "x"}, "invalid label key 'bad key'"),
        ({"empty": ""}, "label 'empty' must be 1 to 256 characters"),
    ],
)
def test_bad_labels_are_refused_when_the_agent_is_built(
    labels: dict[str, Any], message: str
) -> None:
    with pytest.raises(BadRequestError, match=message):
        Agent("refuse.labels.a1", labels=labels, settings=MeshSettings())


# --------------------------------------------------------------------------- namespaces


async def test_no_match_names_the_namespace_that_has_the_agents(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = Agent(f"{namespace}.elsewhere.a1", settings=settings)
    cap = f"{namespace}x:where:v1"

    @agent.handler(cap)
    async def where(task):
        return "here"

    async with agent, Client(settings=settings, namespace=f"{namespace}other") as mesh:
        with pytest.raises(NoMatchError) as err:
            await mesh.request(capability=cap, payload=None)
        assert f"no agent in namespace '{namespace}other'" in err.value.message
        assert f"1 match in '{namespace}'" in err.value.message
        assert err.value.details["other_namespaces"] == {namespace: 1}
        # A typo gets a "did you mean" in the headline.
        with pytest.raises(NoMatchError, match=rf"did you mean {cap[:-3]}:v1\?"):
            await mesh.request(capability=cap.replace("where", "wher"), payload=None)
        # By id, the id's namespace is used: no trap.
        assert (await mesh.request(agent_id=agent.agent_id, payload=None)).result == "here"


async def test_a_workflow_in_a_namespace_nobody_serves_says_why(
    wf_hub: Hub, wf_settings: MeshSettings, namespace: str
) -> None:
    agent = Agent(f"{namespace}.wfwhere.a1", settings=wf_settings)
    cap = f"{namespace}x:wfwhere:v1"

    @agent.handler(cap)
    async def where(task):
        return "here"

    async with agent, Client(settings=wf_settings, namespace=f"{namespace}other") as mesh:
        out = await mesh.chain(
            [Step(capability=cap, payload=1, retry=RetryPolicy(ttl=0.6))], timeout=10
        )
    assert out.state is TaskState.TIMEOUT
    assert out.steps[0].error is not None
    assert f"no agent in namespace '{namespace}other' matches" in out.steps[0].error.message
    assert f"1 match in '{namespace}'" in out.steps[0].error.message


async def test_show_decision_says_why_not_the_agents_the_selector_removed(
    hub: Hub, settings: MeshSettings, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from reach_mesh.cli import print_decision

    agents = [
        Agent(f"{namespace}.why.{region}", labels={"region": region}, settings=settings)
        for region in ("us-east", "eu-west")
    ]
    for agent in agents:

        @agent.handler("why:echo:v1")
        async def echo(task):
            return task.payload

    async with agents[0], agents[1], Client(settings=settings) as mesh:
        decision = await mesh.route(selector="cap=why:echo:v1 AND region=eu-west")
        assert decision.chosen == f"{namespace}.why.eu-west"
        reasons = {f.agent_id: f.reason for f in decision.filtered}
        assert reasons == {f"{namespace}.why.us-east": "selector: region=eu-west not met"}
        print_decision(decision)
        out = capsys.readouterr().out
        assert f"{namespace}.why.us-east  filtered  selector: region=eu-west not met" in out
        with pytest.raises(NoMatchError) as err:
            await mesh.route(selector="cap=why:echo:v1 AND region=ap-south")
        filtered = err.value.details["decision"]["filtered"]
        assert {f["agent_id"] for f in filtered} == {a.agent_id for a in agents}
