"""The demo fleet: a hub and three agents in one process, a few tasks, results printed.

``reach-mesh demo`` (and ``make demo``) runs it against an embedded nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from pydantic import BaseModel

from reach_mesh import protocol
from reach_mesh._cli_doctor import diagnose
from reach_mesh._cli_fleet import lease_cell
from reach_mesh._nats import connect, shown
from reach_mesh.agent import Agent, Task
from reach_mesh.client import Client
from reach_mesh.config import MeshSettings
from reach_mesh.errors import BadRequestError, NoMatchError, ReachError
from reach_mesh.hub import Hub
from reach_mesh.models import ToolSpec
from reach_mesh.workflow import Step

__all__ = ["demo_agents", "run_demo"]


class Text(BaseModel):
    text: str
    lang: str = "en"


class Numbers(BaseModel):
    values: list[float]


def demo_agents(settings: MeshSettings | None = None) -> list[Agent]:
    """Three small agents: a translator, a summarizer and a calculator, in namespace ``demo``.

    Without ``settings`` they read theirs from the environment (``REACH_NATS_URL`` …), so
    ``reach-mesh agent reach_mesh.demo:demo_agents`` runs them against a mesh."""
    translator = Agent(
        "demo.translator.t1",
        labels={"region": "eu-west", "gpu": "false"},
        settings=settings,
        tools=[
            ToolSpec(name="translate", description="Translate text", capability="text:translate:v1")
        ],
    )
    summarizer = Agent(
        "demo.summarizer.s1",
        labels={"region": "eu-west", "mem_gb": "16", "gpu": "true"},
        settings=settings,
    )
    calculator = Agent("demo.calc.c1", labels={"region": "us-east"}, settings=settings)

    @translator.handler("text:translate:v1")
    async def translate(task: Task[Text]) -> dict[str, str]:
        words = {"hello": "bonjour", "world": "monde", "agents": "agents", "mesh": "maillage"}
        out = " ".join(words.get(w.lower(), w) for w in task.payload.text.split())
        return {"text": out, "lang": "fr"}  # the only language it knows

    @summarizer.handler("text:summarize:v1")
    async def summarize(task: Task[Text]) -> dict[str, Any]:
        words = task.payload.text.split()
        return {
            "summary": " ".join(words[:6]) + (" ..." if len(words) > 6 else ""),
            "words": len(words),
        }

    @calculator.handler("math:stats:v1")
    async def stats(task: Task[Numbers]) -> dict[str, int | float]:  # n stays a count
        vals = task.payload.values
        return {"n": len(vals), "sum": sum(vals), "mean": sum(vals) / len(vals) if vals else 0.0}

    return [translator, summarizer, calculator]


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Only errors from ``logger`` meanwhile (the demo's deliberate mistakes)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


async def _served_already(settings: MeshSettings, agent_ids: list[str]) -> list[str]:
    """The ids among ``agent_ids`` that a live process serves on this NATS already (its ctl
    subject answers, or does not say "no responders"): a demo agent started beside one would
    wait for it to stop (one process per agent id), and the demo with it, for ever."""
    nc = await connect(settings.nats_url, name="reach-mesh demo", settings=settings)
    served: list[str] = []
    try:
        for agent_id in agent_ids:
            try:
                await nc.request(protocol.agent_ctl(agent_id), b'{"op":"ping"}', timeout=1.0)
            except NoRespondersError:
                continue
            except NatsError:
                pass  # subscribed but silent (paused): still in the way
            served.append(agent_id)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return served


@contextlib.asynccontextmanager
async def _fleet(settings: MeshSettings) -> AsyncIterator[list[Agent]]:
    agents = demo_agents(settings)
    served = await _served_already(settings, [a.agent_id for a in agents])
    if served:
        raise BadRequestError(
            f"the demo's agents already run on {shown(settings.nats_url)} ({', '.join(served)}: "
            "`reach-mesh up --demo`?), and the demo starts its own: run `reach-mesh demo` "
            "without --nats (it starts its own NATS), or stop those agents first"
        )
    async with Hub(settings=settings):
        try:
            for agent in agents:
                await agent.start()
            yield agents
        finally:
            await asyncio.gather(*(a.close() for a in agents), return_exceptions=True)


async def run_demo(settings: MeshSettings, out: Callable[[str], None] = print) -> int:
    """Run the demo against ``settings.nats_url``; returns the number of failed tasks."""
    failures = 0
    async with _fleet(settings) as agents, Client(settings=settings, namespace="demo") as mesh:
        out(f"mesh up: 1 hub, {len(agents)} agents: " + ", ".join(a.agent_id for a in agents))
        jobs: list[tuple[str, dict[str, Any]]] = [
            (
                "by id      demo.calc.c1",
                dict(agent_id="demo.calc.c1", payload={"values": [3, 4, 5]}),
            ),
            (
                "by cap     text:translate:v1",
                dict(capability="text:translate:v1", payload={"text": "hello world", "lang": "fr"}),
            ),
            (
                "selector   cap=text:summarize:v1 AND gpu=true AND mem_gte=8GiB",
                dict(
                    selector="cap=text:summarize:v1 AND gpu=true AND mem_gte=8GiB",
                    payload={
                        "text": "reach mesh makes a fleet of agents findable reachable "
                        "and accountable"
                    },
                ),
            ),
        ]
        for title, kwargs in jobs:
            res = await mesh.request(timeout=10, **kwargs)
            status = "ok " if res.ok else "ERR"
            if not res.ok:
                failures += 1
            out(
                f"[{status}] {title:<66} -> {res.agent_id} {res.state.value} "
                f"{json.dumps(res.result) if res.ok else res.error} ({res.duration * 1000:.1f} ms, "
                f"trace {res.trace_id})"
            )
        chain = await mesh.chain(
            [
                Step(
                    capability="text:translate:v1",
                    payload={"text": "hello agents of the mesh", "lang": "fr"},
                ),
                Step(capability="text:summarize:v1"),
            ],
            timeout=20,
        )
        if not chain.ok:
            failures += 1
        out(
            f"[{'ok ' if chain.ok else 'ERR'}] {'chain      translate -> summarize':<66} -> "
            f"{chain.state.value} {json.dumps(chain.result)} "
            f"({chain.duration_ms:.1f} ms, {len(chain.steps)} steps over JetStream)"
        )
        fan = await mesh.fanout(
            [
                Step(capability="text:translate:v1", payload={"text": "hello world"}),
                Step(
                    selector="cap=text:summarize:v1 AND gpu=true", payload={"text": "one two three"}
                ),
                Step(agent_id="demo.calc.c1", payload={"values": [1, 2, 3]}),
            ],
            policy="all",
            timeout=20,
        )
        if not fan.ok:
            failures += 1
        out(
            f"[{'ok ' if fan.ok else 'ERR'}] {'fanout     3 branches, policy all':<66} -> "
            f"{fan.state.value} by {', '.join(str(st.agent_id) for st in fan.steps)} "
            f"({fan.duration_ms:.1f} ms)"
        )
        # What an operator sees of it afterwards (`reach-mesh workflow <id>`).
        view = await mesh.inspect_workflow(fan.workflow_id)
        states = ", ".join(f"{s.state.value} at attempt {s.attempt}" for s in view.steps)
        out(
            f"[ok ] inspected: {view.kind} {view.workflow_id} owned by {view.owner}: {states} "
            f"(reach-mesh workflow {view.workflow_id} --namespace {view.namespace})"
        )
        # A chain whose second step no agent serves waits for one: stop it
        # (`reach-mesh cancel <id>`). Its first step keeps its result.
        with _quiet("reach_mesh.hub"):  # on purpose: not a fault worth the hub's WARNING
            waiting = await mesh.submit_chain(
                [
                    Step(capability="text:translate:v1", payload={"text": "hola"}),
                    Step(capability="text:ocr:v1"),
                ],
                timeout=30,
            )
            for _ in range(50):  # until step 0 is done and step 1 waits for an agent
                with contextlib.suppress(ReachError):  # not taken by the hub yet, throttled
                    seen = await mesh.inspect_workflow(waiting)
                    if seen.steps[0].state.final:
                        break
                await asyncio.sleep(0.1)
            stopped = await mesh.cancel_workflow(waiting, reason="demo: nobody serves text:ocr:v1")
        result = stopped.result
        kept = result is not None and result.steps[0].ok and result.steps[1].cancelled
        good = bool(stopped.final and stopped.cancelled and kept)
        if not good:
            failures += 1
        code = "-" if result is None or result.error is None else result.error.code
        steps = ", ".join(
            f"step {s.index} {'cancelled' if s.cancelled else s.state.value}"
            for s in (result.steps if result is not None else [])
        )
        out(
            f"[{'ok ' if good else 'ERR'}] cancelled: chain {waiting} -> {stopped.state.value} "
            f"{code} ({steps}) (reach-mesh cancel {waiting} --namespace {mesh.namespace})"
        )
        # The namespace's recent workflows, newest first (`reach-mesh workflows`).
        listed = await mesh.list_workflows(since=600, limit=500)
        by_state = Counter(w.state.value for w in listed.workflows)
        shown = ", ".join(f"{n} {state}" for state, n in sorted(by_state.items()))
        mine = {fan.workflow_id, waiting} <= {w.workflow_id for w in listed.workflows}
        if not mine:
            failures += 1
        out(
            f"[{'ok ' if mine else 'ERR'}] listed: {listed.matched} workflow(s) in the last 10 "
            f"minutes: {shown} (reach-mesh workflows --namespace {mesh.namespace} "
            "--state FAILED)"
        )
        try:
            with _quiet("reach_mesh.hub"):  # on purpose: not a fault worth the hub's WARNING
                await mesh.request(capability="text:translate:v2", payload={"text": "x"})
        except NoMatchError as err:
            out(f"[ok ] no match is typed: {err.code}: {err.message}")
        else:
            failures += 1
            out("[ERR] no match is typed: text:translate:v2 was served, by nobody that should")
        decision = await mesh.route(selector="cap=text:translate:v1 AND region=eu-west")
        out(
            f"[ok ] explained: {decision.target} -> {decision.chosen} "
            f"(strategy {decision.strategy}, {len(decision.candidates)} candidate(s))"
        )
        agents_info = await mesh.agents()
        online = sum(info.state.value == "ONLINE" for info in agents_info)
        out(
            f"[{'ok ' if online == len(agents) else 'ERR'}] fleet: {online} of "
            f"{len(agents_info)} agent(s) ONLINE (reach-mesh agents --namespace {mesh.namespace})"
        )
        if online != len(agents):
            failures += 1
        for info in agents_info:
            out(
                f"      {info.agent_id:<22} {info.state.value:<8} load {info.load:.2f} "
                f"lease {lease_cell(info.lease_left):>5}  {', '.join(info.capabilities)}"
            )
        # The whole mesh's health, as an operator checks it (`reach-mesh doctor`).
        found = await diagnose(settings)
        failed = [f"{f.check}: {f.detail}" for f in found if f.status == "fail"]
        warned = sum(f.status == "warn" for f in found)
        if failed:
            failures += 1
        out(
            f"[{'ERR' if failed else 'ok '}] doctor: {len(found) - len(failed) - warned} ok, "
            f"{warned} warning(s), {len(failed)} failed{': ' + '; '.join(failed) if failed else ''}"
            " (reach-mesh doctor)"
        )
    out("demo finished: " + ("all tasks succeeded" if failures == 0 else f"{failures} failed"))
    return failures
