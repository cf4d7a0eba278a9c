"""Cross-language conformance: an agent and a caller in JavaScript (``conformance/js/``), written
from docs/protocol.md and docs/protocol-workflows.md alone, against a real nats-server, a hub
and Python agents. They keep the promise that the protocol docs are enough to write a client or
an agent in another language: when the hub's behaviour drifts from the docs, these fail.

The short checks run in the normal suite. The long ones (heartbeats past the lease, retries,
timeouts, cancel, a restart, kill -9 mid-step, secure mode) carry the ``conformance`` marker and
run with ``make conformance``. Without ``node`` or ``conformance/js/node_modules`` the tests
skip, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest

from reach_mesh import (
    Client,
    MeshSettings,
    NoHandlerError,
    RetryPolicy,
    Step,
    UnknownWorkflowError,
    protocol,
)
from reach_mesh._auth import AuthDir, inbox_prefix
from reach_mesh._nats import refused_messages
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats

from .helpers import WF_FAST, clean_env, eventually, status_events

JS_DIR = Path(__file__).resolve().parents[1] / "conformance" / "js"
NODE = shutil.which("node")


def _why_skip() -> str | None:
    if NODE is None:
        return (
            "node is absent: install Node.js >= 18, then run `make conformance-deps` "
            "(or `npm ci --prefix conformance/js`) to run the JavaScript conformance tests"
        )
    if not (JS_DIR / "node_modules" / "nats").is_dir():
        return (
            "conformance/js/node_modules is missing: run `make conformance-deps` "
            "(or `npm ci --prefix conformance/js`)"
        )
    return None


_SKIP = _why_skip()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

#: Every handler of agent.js, as its card lists them.
JS_CAPS = ["math:fail:v1", "test:sleep:v1", "text:upper:v1", "wf:double:v1", "wf:flaky:v1"]
#: The JS agent's timing in these tests: short, and within the hub's step deadlines of
#: ``wf_settings`` (first status within 1 s, then one at least every 0.8 s).
JS_AGENT_ENV = {
    "REACH_HEARTBEAT_INTERVAL": "0.5",
    "REACH_LEASE_TIMEOUT": "2",
    "REACH_WORK_ACK_WAIT": "3",
    "REACH_RUNNING_INTERVAL": "0.25",
}


def _identity(auth: AuthDir | None, role: str, name: str) -> dict[str, str]:
    """The environment that gives a JS process ``role``'s identity ``name`` in secure mode
    (its nkey seed, its inbox prefix); none in plain mode."""
    if auth is None:
        return {}
    return {
        "REACH_NKEY_SEED_FILE": str(auth.seed_file(role, name)),
        "REACH_INBOX_PREFIX": inbox_prefix(role, name),
    }


@dataclass
class JsAgent:
    """A running ``node agent.js``; its log (stderr) in ``log``."""

    agent_id: str
    proc: asyncio.subprocess.Process
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        return await asyncio.wait_for(self.proc.wait(), timeout)


@dataclass
class JsAgents:
    """Starts JS agents for one test; kills any still running at its end."""

    nats_url: str
    logs: Path
    auth: AuthDir | None = None
    started: list[JsAgent] = field(default_factory=list)
    _n: Iterator[int] = field(default_factory=lambda: iter(range(1, 1000)))

    async def start(
        self, agent_id: str, *, caps: str | None = None, nulls: bool = False
    ) -> JsAgent:
        env = clean_env(
            REACH_NATS_URL=self.nats_url,
            REACH_AGENT_ID=agent_id,
            **JS_AGENT_ENV,
            **_identity(self.auth, "agent", agent_id),
        )
        if caps:
            env["REACH_AGENT_CAPS"] = caps
        if nulls:
            env["REACH_AGENT_NULLS"] = "1"
        log = self.logs / f"{agent_id}.{next(self._n)}.log"
        with log.open("wb") as err:
            assert NODE is not None
            proc = await asyncio.create_subprocess_exec(
                NODE,
                str(JS_DIR / "agent.js"),
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )
        agent = JsAgent(agent_id, proc, log)
        self.started.append(agent)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.startswith(f"serving {agent_id} ".encode()), agent.text()
        return agent

    async def close(self) -> None:
        for agent in self.started:
            if agent.proc.returncode is None:
                agent.proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(agent.proc.wait(), 5)


@pytest.fixture
async def js_agents(nats_url: str, tmp_path: Path) -> AsyncIterator[JsAgents]:
    agents = JsAgents(nats_url, tmp_path)
    yield agents
    await agents.close()


async def run_caller(
    nats_url: str, namespace: str, *parts: str, auth: AuthDir | None = None, timeout: float = 90
) -> tuple[int, str]:
    """``node caller-test.js PARTS`` against the mesh: its exit code and output."""
    env = clean_env(
        REACH_NATS_URL=nats_url,
        REACH_NAMESPACE=namespace,
        **_identity(auth, "caller", namespace),
    )
    assert NODE is not None
    proc = await asyncio.create_subprocess_exec(
        NODE,
        str(JS_DIR / "caller-test.js"),
        *parts,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


# ------------------------------------------------------------------ the Python agents the
# JS caller talks to (caller-test.js names them by id, in the namespace it is given)


def caller_agents(settings_of: Any) -> tuple[list[Agent], Counter[tuple[str, str]]]:
    """``<ns>.worker.w1..w3`` (echo, count, slow, inc; labels for selectors),
    ``<ns>.single.s1`` (one handler: routes by id alone) and ``<ns>.failer.f1`` (handlers that
    fail, on an agent of their own: failures count against its breaker). ``settings_of(id)``
    gives each agent's settings. The counter: handler runs per (agent id, task id)."""
    runs: Counter[tuple[str, str]] = Counter()

    def counting(agent: Agent) -> None:
        @agent.handler("cf:count:v1")
        async def count(task: Task[Any]) -> Any:
            ids = (task.payload or {}).get("task_ids", [])
            return {"agent": agent.agent_id, "runs": {t: runs[(agent.agent_id, t)] for t in ids}}

    def worker(agent_id: str, labels: dict[str, str]) -> Agent:
        a = Agent(agent_id, settings=settings_of(agent_id), labels=labels, max_concurrency=4)
        counting(a)

        @a.handler("cf:echo:v1")
        async def echo(task: Task[Any]) -> Any:
            runs[(agent_id, task.task_id)] += 1
            return {
                "echo": task.payload,
                "agent": agent_id,
                "task_id": task.task_id,
                "runs": runs[(agent_id, task.task_id)],
                "trace_id": task.trace_id,
            }

        @a.handler("cf:slow:v1")
        async def slow(task: Task[Any]) -> Any:
            runs[(agent_id, task.task_id)] += 1
            secs = float((task.payload or {}).get("sleep", 5))
            await asyncio.sleep(secs)
            return {"slept": secs, "agent": agent_id}

        @a.handler("cf:inc:v1")
        async def inc(task: Task[Any]) -> Any:
            runs[(agent_id, task.task_id)] += 1
            n = int((task.payload or {}).get("n", 0))
            return {"n": n + 1, "by": agent_id, "trace_id": task.trace_id}

        return a

    def single(agent_id: str) -> Agent:
        a = Agent(agent_id, settings=settings_of(agent_id), labels={"kind": "single"})

        @a.handler("cf:only:v1")
        async def only(task: Task[Any]) -> Any:
            runs[(agent_id, task.task_id)] += 1
            return {"only": True, "runs": runs[(agent_id, task.task_id)], "trace_id": task.trace_id}

        return a

    def failer(agent_id: str) -> Agent:
        a = Agent(agent_id, settings=settings_of(agent_id), labels={"kind": "failer"})
        counting(a)

        @a.handler("cf:fail:v1")
        async def fail(task: Task[Any]) -> Any:
            runs[(agent_id, task.task_id)] += 1
            raise TaskFailed("deliberate failure", retryable=False)

        @a.handler("cf:boom:v1")
        async def boom(task: Task[Any]) -> Any:
            runs[(agent_id, task.task_id)] += 1
            raise RuntimeError("kaboom")

        return a

    ns = settings_of(None).namespace
    agents = [
        worker(f"{ns}.worker.w1", {"region": "eu-west", "tier": "gold", "mem_gb": "16"}),
        worker(f"{ns}.worker.w2", {"region": "eu-west", "tier": "gold", "mem_gb": "8"}),
        worker(f"{ns}.worker.w3", {"region": "us-east", "tier": "free", "mem_gb": "32"}),
        single(f"{ns}.single.s1"),
        failer(f"{ns}.failer.f1"),
    ]
    return agents, runs


@contextlib.asynccontextmanager
async def started(agents: list[Agent]) -> AsyncIterator[None]:
    try:
        await asyncio.gather(*(a.start() for a in agents))
        yield
    finally:
        for a in agents:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(a.close(), 5)


# ------------------------------------------------------------------ the JS agent


async def online(mesh: Client, *agent_ids: str) -> dict[str, Any]:
    """Wait until every one of ``agent_ids`` is ONLINE; the registry's view of them."""
    seen: dict[str, Any] = {}

    async def all_online() -> bool:
        seen.clear()
        seen.update({a.agent_id: a for a in await mesh.agents()})
        return all(i in seen and seen[i].state.value == "ONLINE" for i in agent_ids)

    await eventually(all_online, timeout=10, interval=0.1)
    return seen


async def js_agent_serves(
    mesh: Client, js: JsAgents, ns: str, observer: Client | None = None
) -> JsAgent:
    """The short checks of the JS agent: registration, routed requests, a fanout and a chain.
    ``observer`` reads REACH_STATUS (secure mode: a caller may not; default ``mesh``).
    Returns the multi-handler agent, still running."""
    observer = observer or mesh
    a1_id, u1_id = f"{ns}.jsagent.a1", f"{ns}.jsupper.u1"
    a1, _ = await asyncio.gather(js.start(a1_id), js.start(u1_id, caps="text:upper:v1"))
    fleet = await online(mesh, a1_id, u1_id)
    assert fleet[a1_id].capabilities == JS_CAPS
    assert fleet[a1_id].labels["lang"] == "javascript"
    assert fleet[u1_id].capabilities == ["text:upper:v1"]

    # routed requests: by capability, by id and capability, by id alone (one handler)
    r = await mesh.request(capability="text:upper:v1", payload={"text": "hi"})
    assert (r.state.value, r.result["text"], r.result["lang"]) == ("SUCCEEDED", "HI", "js")
    r = await mesh.request(agent_id=a1_id, capability="text:upper:v1", payload={"text": "id"})
    assert (r.state.value, r.agent_id, r.result["by"]) == ("SUCCEEDED", a1_id, a1_id)
    r = await mesh.request(agent_id=u1_id, payload={"text": "only"})
    assert (r.state.value, r.result["text"]) == ("SUCCEEDED", "ONLY")
    r = await mesh.request(capability="text:upper:v1", payload={"text": "x"}, mode="direct")
    assert (r.state.value, r.result["text"]) == ("SUCCEEDED", "X")
    # a handler error: FAILED, typed
    r = await mesh.request(capability="math:fail:v1", payload={"x": 1})
    assert r.state.value == "FAILED" and r.error is not None
    assert r.error.code == "REACH_HANDLER_FAILED" and r.error.details["retryable"] is False
    # by id alone to an agent of several handlers: REACH_NO_HANDLER from the agent
    with pytest.raises(NoHandlerError):
        await mesh.request(agent_id=a1_id, payload={"text": "?"})
    # the same task id twice: one run, the second answer cached
    first = await mesh.request(agent_id=a1_id, capability="text:upper:v1", payload={"text": "a"})
    again = await mesh.request(
        agent_id=a1_id, capability="text:upper:v1", payload={"text": "a"}, task_id=first.task_id
    )
    assert (again.result, again.cached, first.cached) == (first.result, True, False)

    # workflow steps taken from the work consumer: fanout(3), chain(2)
    fan = await mesh.fanout(
        [Step(capability="wf:double:v1", payload={"n": n}) for n in (1, 2, 3)], timeout=20
    )
    assert fan.state.value == "SUCCEEDED", fan.error
    assert [x["n"] for x in fan.result] == [2, 4, 6]
    assert {s.agent_id for s in fan.steps} == {a1_id}
    chain = await mesh.chain(
        [Step(capability="wf:double:v1", payload={"n": 5}), Step(capability="wf:double:v1")],
        timeout=20,
    )
    assert chain.state.value == "SUCCEEDED", chain.error
    assert chain.result["n"] == 20
    # a step's statuses as the docs order them; the final one stored with its Nats-Msg-Id
    tid = fan.steps[0].task_id
    states = [e.state.value for e in await status_events(observer, ns, tid)]
    assert states[:3] == ["DELIVERED", "ACCEPTED", "RUNNING"] and states[-1] == "SUCCEEDED"
    last = await observer.nc.jetstream().get_last_msg("REACH_STATUS", f"reach.status.{a1_id}.{tid}")
    msg_id = (last.headers or {}).get("Nats-Msg-Id", "")
    assert re.fullmatch(rf"{ns}\.{tid}#1\.final\.[0-9a-f]{{32}}", msg_id), msg_id
    return a1


async def first_step_in(mesh: Client, workflow_id: str, *states: str) -> bool:
    """Whether the workflow's first step is in one of ``states`` (False: no hub has it yet)."""
    try:
        view = await mesh.inspect_workflow(workflow_id)
    except UnknownWorkflowError:
        return False
    return view.steps[0].state.value in states


async def unregisters_on_sigterm(mesh: Client, agent: JsAgent) -> None:
    assert await agent.stop(signal.SIGTERM) == 0, agent.text()
    assert '"removed":true' in agent.text()
    assert agent.agent_id not in {a.agent_id for a in await mesh.agents()}


async def test_js_agent_registers_serves_and_unregisters(
    wf_hub: Hub, wf_settings: MeshSettings, js_agents: JsAgents, namespace: str
) -> None:
    async with Client(settings=wf_settings) as mesh:
        a1 = await js_agent_serves(mesh, js_agents, namespace)
        await unregisters_on_sigterm(mesh, a1)


async def test_js_agent_writing_nulls_keeps_its_results(
    wf_hub: Hub, wf_settings: MeshSettings, js_agents: JsAgents, namespace: str
) -> None:
    """A JS agent whose encoder writes ``null`` into ``duration_ms``, ``queued_ms`` and
    ``cached`` of its replies and status events (fields that are not nullable): its route
    replies and its steps' final statuses are its results all the same — nothing refused."""
    agent_id = f"{namespace}.jsnulls.n1"
    async with Client(settings=wf_settings) as mesh:
        await js_agents.start(agent_id, nulls=True)
        await online(mesh, agent_id)
        before = refused_messages(wf_hub.nc)
        r = await mesh.request(agent_id=agent_id, capability="text:upper:v1", payload={"text": "n"})
        assert (r.state.value, r.result["text"]) == ("SUCCEEDED", "N")
        fan = await mesh.fanout([Step(capability="wf:double:v1", payload={"n": 2})], timeout=20)
        assert fan.state.value == "SUCCEEDED", fan.error
        assert fan.result[0]["n"] == 4 and fan.steps[0].agent_id == agent_id
        assert refused_messages(wf_hub.nc) == before


async def test_js_agent_refuses_new_task_ids_while_cordoned(
    hub: Hub, settings: MeshSettings, js_agents: JsAgents, nats_url: str, namespace: str
) -> None:
    """An agent written from protocol.md alone keeps an operator's cordon as its heartbeat
    replies say it: a new task id sent straight to it is refused (``REACH_AGENT_BUSY``,
    ``details.cordoned``), a task id it ran before is answered from its table, and after the
    ``uncordon`` a new task id runs again."""
    agent_id = f"{namespace}.jsupper.u1"
    agent = await js_agents.start(agent_id, caps="text:upper:v1")
    nc = await nats.connect(nats_url)

    async def send(task_id: str, text: str) -> dict[str, Any]:
        env = {"task_id": task_id, "capability": "text:upper:v1", "payload": {"text": text}}
        msg = await nc.request(f"reach.agent.{agent_id}.task", json.dumps(env).encode(), 5)
        out: dict[str, Any] = json.loads(msg.data)
        return out

    try:
        async with Client(settings=settings) as mesh:
            await online(mesh, agent_id)
            assert (await send("js-before", "a"))["state"] == "SUCCEEDED"
            await mesh.admin("cordon", agent_id)
            await eventually(lambda: "cordoned: refusing" in agent.text(), timeout=5)
            refused = await send("js-new", "b")
            assert refused["error"]["code"] == "REACH_AGENT_BUSY", refused
            assert refused["error"]["details"]["cordoned"] is True, refused
            kept = await send("js-before", "a")
            assert kept["state"] == "SUCCEEDED" and kept["cached"] is True, kept
            await mesh.admin("uncordon", agent_id)
            await eventually(lambda: "uncordoned" in agent.text(), timeout=5)
            assert (await send("js-after", "c"))["result"]["text"] == "C"
    finally:
        await nc.close()


async def test_js_caller_routes_retries_and_runs_workflows(
    wf_hub: Hub, wf_settings: MeshSettings, nats_url: str, namespace: str
) -> None:
    agents, runs = caller_agents(lambda _id: wf_settings)
    async with started(agents):
        rc, out = await run_caller(nats_url, namespace)
    assert rc == 0, out
    assert " 0 failed" in out, out
    # no task of the caller's ran twice on any agent (the JS side checks its own; this is all)
    assert max(runs.values()) == 1, runs


# ------------------------------------------------------------------ long checks


@pytest.mark.conformance
async def test_js_agent_keeps_its_lease_retries_times_out_and_cancels(
    wf_hub: Hub, wf_settings: MeshSettings, js_agents: JsAgents, namespace: str
) -> None:
    a1_id = f"{namespace}.jsagent.a1"
    async with Client(settings=wf_settings) as mesh:
        a1 = await js_agents.start(a1_id)
        await online(mesh, a1_id)
        await asyncio.sleep(3)  # past its lease (2 s): its heartbeats keep it
        info = (await online(mesh, a1_id))[a1_id]
        assert info.lease_left > 0.5, info
        # a retryable failure, then attempt 2 succeeds
        flaky = await mesh.chain([Step(capability="wf:flaky:v1", payload={})], timeout=20)
        assert flaky.state.value == "SUCCEEDED", flaky.error
        assert (flaky.steps[0].attempts, flaky.steps[0].decided_by) == (2, 2)
        # a non-retryable failure ends the workflow after one attempt
        bad = await mesh.fanout([Step(capability="math:fail:v1", payload={})], timeout=20)
        assert bad.state.value == "FAILED" and bad.error is not None
        assert (bad.error.code, bad.steps[0].attempts) == ("REACH_HANDLER_FAILED", 1)
        # a step over its timeout
        slow = Step(
            capability="test:sleep:v1",
            payload={"ms": 3000},
            timeout=1.0,
            retry=RetryPolicy(retries=0),
        )
        timed_out = await mesh.fanout([slow], timeout=20)
        assert timed_out.state.value == "TIMEOUT", timed_out
        # cancel a running step: the agent honours the ctl cancel
        wf = await mesh.submit_chain(
            [
                Step(capability="test:sleep:v1", payload={"ms": 8000}),
                Step(capability="wf:double:v1"),
            ],
            timeout=30,
        )

        await eventually(lambda: first_step_in(mesh, wf, "ACCEPTED", "RUNNING"), timeout=5)
        step_tid = (await mesh.inspect_workflow(wf)).steps[0].task_id
        cancel = await mesh.cancel_workflow(wf, reason="conformance")
        assert cancel.final and cancel.cancelled and cancel.result is not None
        assert cancel.result.error is not None
        assert cancel.result.error.code == "REACH_WORKFLOW_CANCELLED"
        # the handler was stopped by the ctl cancel, not left to finish its 8 s
        await eventually(lambda: f"cancelled {step_tid} # 1" in a1.text(), timeout=5)
        # a ``next`` that is not an attempt after ``fence``: refused, naming the field
        ask = {"op": "task_state", "task_id": "js-next-1", "fence": 2, "next": 2}
        answer = await mesh.nc.request(protocol.agent_ctl(a1_id), protocol.dumps(ask), timeout=5)
        error = json.loads(answer.data)["error"]
        assert (error["code"], error["details"]["field"]) == ("REACH_BAD_REQUEST", "next"), error
        await unregisters_on_sigterm(mesh, a1)


@pytest.mark.conformance
async def test_js_agent_restarts_idempotent_and_survives_kill_9(
    wf_hub: Hub, wf_settings: MeshSettings, js_agents: JsAgents, namespace: str, nats_url: str
) -> None:
    a1_id = f"{namespace}.jsagent.a1"
    async with Client(settings=wf_settings) as mesh:
        a1 = await js_agents.start(a1_id)
        await online(mesh, a1_id)
        fan = await mesh.fanout([Step(capability="wf:double:v1", payload={"n": 7})], timeout=20)
        assert fan.state.value == "SUCCEEDED", fan.error
        tid = fan.steps[0].task_id
        assert await a1.stop(signal.SIGTERM) == 0, a1.text()

        # a new process rebuilds its idempotency table from REACH_STATUS ...
        a1 = await js_agents.start(a1_id)
        rebuilt = re.search(r"rebuilt (\d+) final statuses", a1.text())
        assert rebuilt is not None and int(rebuilt.group(1)) >= 1, a1.text()
        # ... so a duplicate delivery of the finished step is answered from it, not run again
        nc = await nats.connect(nats_url)
        try:
            got: list[dict[str, Any]] = []

            async def on_status(msg: Any) -> None:
                got.append(json.loads(msg.data))

            sub = await nc.subscribe(f"reach.status.{a1_id}.{tid}", cb=on_status)
            envelope = {
                "task_id": tid,
                "attempt": 1,
                "capability": "wf:double:v1",
                "payload": {"n": 7},
                "namespace": namespace,
                "timeout": 30.0,
                "workflow_id": fan.workflow_id,
                "step": 0,
                "track": True,
            }
            await nc.jetstream().publish(
                f"reach.work.{namespace}.{a1_id}",
                json.dumps(envelope).encode(),
                headers={"Nats-Msg-Id": f"{namespace}.{tid}#1.dup-test"},
            )
            await eventually(lambda: len(got) >= 1, timeout=5)
            await asyncio.sleep(0.3)
            await sub.unsubscribe()
        finally:
            await nc.close()
        assert [(e["state"], e["cached"], e["result"]["n"]) for e in got] == [
            ("SUCCEEDED", True, 14)
        ]
        assert f"{tid} # 1 -> SUCCEEDED" not in a1.text()  # the handler did not run

        # kill -9 mid-step, back at once as a new session: the step runs again as attempt 2
        wf = await mesh.submit_chain(
            [Step(capability="test:sleep:v1", payload={"ms": 2000})], timeout=60
        )

        await eventually(lambda: first_step_in(mesh, wf, "RUNNING"), timeout=5)
        await a1.stop(signal.SIGKILL)
        a1 = await js_agents.start(a1_id)
        result = await mesh.workflow(wf, timeout=50)
        assert result.state.value == "SUCCEEDED", (result, a1.text())
        assert result.steps[0].decided_by == 2, result.steps[0]
        # JetStream redelivers attempt 1 after the dead process's ack_wait: dropped, not run
        step_tid = result.steps[0].task_id
        dropped = re.compile(rf"(promised away|fenced) {step_tid}")
        await eventually(lambda: dropped.search(a1.text()) is not None, timeout=15, interval=0.2)
        await unregisters_on_sigterm(mesh, a1)


# ------------------------------------------------------------------ secure mode

SECURE_NS = "cfsec"
#: Hub settings of the secure mesh: the workflow intervals of ``wf_settings``.
SECURE_FAST = {
    "heartbeat_interval": 0.5,
    "lease_timeout": 2.0,
    "request_timeout": 5.0,
    **WF_FAST,
}
SECURE_AGENTS = [
    f"{SECURE_NS}.{name}"
    for name in ("worker.w1", "worker.w2", "worker.w3", "single.s1", "failer.f1")
]
SECURE_JS = [f"{SECURE_NS}.jsagent.a1", f"{SECURE_NS}.jsupper.u1"]


@dataclass
class SecureMesh:
    auth: AuthDir
    server: EmbeddedNats
    hub: Hub

    def settings(self, role: str, name: str) -> MeshSettings:
        return self.auth.settings(role, name, nats_url=self.server.url, **SECURE_FAST)


@pytest.fixture
async def secure_mesh(tmp_path: Path) -> AsyncIterator[SecureMesh]:
    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace=SECURE_NS)
    for agent_id in SECURE_AGENTS + SECURE_JS:
        auth.add("agent", agent_id)
    with EmbeddedNats(tmp_path / "store", auth_config=auth.auth_conf) as server:
        hub = Hub(settings=auth.settings("hub", "main", nats_url=server.url, **SECURE_FAST))
        await hub.start()
        try:
            yield SecureMesh(auth, server, hub)
        finally:
            await hub.close()


@pytest.mark.conformance
async def test_secure_js_agent_and_js_caller(secure_mesh: SecureMesh, tmp_path: Path) -> None:
    """Secure mode: each side with its own identity (nkey, inbox prefix, permissions)."""
    m = secure_mesh
    js = JsAgents(m.server.url, tmp_path, auth=m.auth)
    try:
        async with (
            Client(settings=m.settings("caller", SECURE_NS)) as mesh,
            Client(settings=m.settings("hub", "main"), namespace=SECURE_NS) as hub_side,
        ):
            a1 = await js_agent_serves(mesh, js, SECURE_NS, observer=hub_side)
            # a restart rebuilds the idempotency table: the status consumer a secure agent may
            # read (a push consumer into its own inbox)
            assert await a1.stop(signal.SIGTERM) == 0, a1.text()
            a1 = await js.start(a1.agent_id)
            rebuilt = re.search(r"rebuilt (\d+) final statuses", a1.text())
            assert rebuilt is not None and int(rebuilt.group(1)) >= 1, a1.text()
            await unregisters_on_sigterm(mesh, a1)
    finally:
        await js.close()

    def settings_of(agent_id: str | None) -> MeshSettings:
        if agent_id is None:
            return m.settings("caller", SECURE_NS)
        return m.settings("agent", agent_id)

    agents, runs = caller_agents(settings_of)
    async with started(agents):
        rc, out = await run_caller(m.server.url, SECURE_NS, auth=m.auth)
    assert rc == 0, out
    assert max(runs.values()) == 1, runs
