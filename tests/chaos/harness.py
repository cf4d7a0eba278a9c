"""The chaos harness: a real 3-node NATS cluster (R3 streams and KV), hubs and agents as separate
processes, a workload driver with known expected outcomes (:mod:`.workload`), fault injection
(:mod:`.faults`), and the collection of everything the history checker (:mod:`.history`) needs.

``run_chaos(ChaosConfig(...), workdir)`` does one run and returns the checker's report; every
artefact (agent logs, hub logs, nats logs, faults, the collected history) stays in ``workdir``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.js.api import DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from reach_mesh import Client, MeshSettings, protocol
from reach_mesh._auth import AuthDir
from reach_mesh._retry import no_message
from reach_mesh.logs import LEASE_EXPIRED, QUARANTINE
from reach_mesh.workflow import step_task_id

from ..helpers import Relay, cluster_nodes
from .explained import OBSERVER
from .faults import Faults
from .history import (
    Expected,
    History,
    Report,
    check,
    read_faults,
    read_runs,
    read_unregistered,
    read_unstored,
)
from .workload import DriverStats, Planned, drive, plan, plan_routes

HERE = Path(__file__).parent
FAULTS = (
    "agent_kill",
    "hub_kill",
    "node_kill",
    "node_stop",
    "agent_stop",
    "hub_stop",
    "deaf",
    "slow",
    "blip",
    "partition",
)
#: The run's own stream of every ``.done`` announcement (core NATS in the mesh).
DONE_CAPTURE = "CHAOS_DONE"

#: Mesh intervals of every process: short, so faults play out in seconds.
TIMINGS: dict[str, Any] = {
    "kv_replicas": 3,
    "audit_enabled": False,
    "heartbeat_interval": 0.5,
    "lease_timeout": 1.5,
    "suspect_timeout": 1.0,
    "liveness_interval": 0.2,
    "request_timeout": 10.0,
    "workflow_ack_wait": 3.0,
    "work_ack_wait": 3.0,
    "step_deliver_timeout": 2.0,
    "step_running_interval": 0.5,
    "step_silence_timeout": 2.0,
    "retry_base": 0.2,
    "retry_cap": 2.0,
    "pending_interval": 1.0,
    "nats_ping_interval": 0.5,
    # A stubborn step (2.5 s against a 1 s timeout, ignoring its cancellation) is abandoned
    # by its agent 1 s past its deadline; the hub's own deadline is later still.
    "handler_abandon_grace": 1.0,
    "step_overdue_grace": 4.0,
}


@dataclass
class ChaosConfig:
    fault: str = "agent_kill"  # one of FAULTS, or "none"
    workflows: int = 60
    rate: float = 10.0  # submissions per second
    hubs: int = 3
    agents: int = 6
    fault_every: float = 3.0  # seconds between faults
    down: float = 1.0  # seconds a killed process stays down
    fail_share: float = 0.05  # workflows with a step that fails non-retryably
    slow_share: float = 0.05  # workflows with a step slower than its timeout
    #: Workflows of slower steps that their caller cancels 0-1.2 s after submitting them
    #: (cancelled, or ended first: either is right; the cancel's answer must be the truth).
    cancel_share: float = 0.05
    #: Policy fanouts (``any``, ``quorum(2)``) planned so that the policy cannot be met.
    lose_share: float = 0.15
    drain: float = 60.0  # seconds callers wait for results after the last submission
    #: Routed requests sent over the same time as the workflows (None: half as many), half
    #: in proxy mode, half direct; a share fails non-retryably.
    routes: int | None = None
    seed: int = 1
    namespace: str = "chaos"
    #: Secure mode (``CHAOS_SECURE=1``): the nodes enforce the identities of ``reach-mesh auth``
    #: and every process connects as its own (docs/security.md); the faults, the workload and
    #: the checks are the same.
    secure: bool = False
    #: Settings of every process: ``TIMINGS`` and these overrides (``CHAOS_SETTINGS`` JSON).
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def timings(self) -> dict[str, Any]:
        return {**TIMINGS, **self.overrides}

    @property
    def route_count(self) -> int:
        return self.workflows // 2 if self.routes is None else self.routes

    def __post_init__(self) -> None:
        if self.fault == "slow":
            self.slow_share = max(self.slow_share, 0.3)


# --------------------------------------------------------------------------- processes


class Proc:
    """A hub or agent process, in its own process group, output appended to ``log``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=5)

    def stop(self) -> None:
        """SIGCONT (it may be stopped), SIGTERM, then SIGKILL after 3 s."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.kill()


class Mesh:
    """The cluster, the hubs and the agents of one run."""

    def __init__(self, cfg: ChaosConfig, workdir: Path) -> None:
        self.cfg, self.dir = cfg, workdir
        bindir = Path(sys.executable).parent
        env = dict(os.environ)
        # The hubs and agents run the code of this tree (a worktree's, say), not whatever
        # checkout the virtualenv's editable install points at, which may change meanwhile.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HERE.parent.parent), env.get("PYTHONPATH", "")) if p
        )
        self.agent_ids = [f"{cfg.namespace}.work.a{i}" for i in range(cfg.agents)]
        #: Secure mode: the auth directory, issued with the CLI as docs/operations.md says
        #: (this tree's CLI: the permissions are this tree's).
        self.auth = (
            _issue(bindir, env, workdir / "auth", cfg, self.agent_ids) if cfg.secure else None
        )
        #: A partition run: node ``i`` reaches node ``j`` through route relay ``(i, j)`` only,
        #: which a partition cuts (``Faults.partition``); the nodes serve ``/connz`` (who is
        #: connected to the node cut off).
        self.route_relays: dict[tuple[int, int], Relay] = {}
        self.nodes = cluster_nodes(
            workdir,
            name="chaos",
            no_advertise=cfg.fault == "blip",
            http=cfg.fault == "partition",
            route_relays=self.route_relays if cfg.fault == "partition" else None,
            auth_config=None if self.auth is None else self.auth.auth_conf,
        )
        self.url = ",".join(n.url for n in self.nodes)
        env.update({f"REACH_{k.upper()}": str(v) for k, v in cfg.timings.items()})
        env.update(
            {
                "REACH_NATS_URL": self.url,
                "REACH_NAMESPACE": cfg.namespace,
                "REACH_LOG_LEVEL": "WARNING",
                "OTEL_TRACES_EXPORTER": "none",
            }
        )
        #: A blip run: each process (and the caller) reaches every node through relays of its
        #: own, which a blip cuts (``Faults.blip``).
        self.relays: dict[str, list[Relay]] = {}
        self.hubs = [
            Proc(
                f"hub{i}",
                [str(bindir / "reach-mesh"), "hub"],
                self._env(env, f"hub{i}", "hub.main"),
                workdir / f"hub{i}.log",
            )
            for i in range(cfg.hubs)
        ]
        #: Hubs that did not come up before the faults began, by name: what their log said
        #: last (a hub that exited at start — six runs once went on with two hubs of three
        #: unnoticed, each logged only ``error: nats: timeout`` — or one still starting).
        self.hubs_not_up: dict[str, str] = {}
        self.agent_logs = [workdir / f"{a}.jsonl" for a in self.agent_ids]
        self.agents = [
            Proc(
                aid,
                [sys.executable, str(HERE / "agent_proc.py"), aid, str(log)],
                self._env(env, aid, f"agent.{aid}"),
                workdir / f"{aid}.log",
            )
            for aid, log in zip(self.agent_ids, self.agent_logs, strict=True)
        ]
        if self.auth is None:
            self.settings = MeshSettings(
                nats_url=self._url("caller"), namespace=cfg.namespace, **cfg.timings
            )
        else:
            self.settings = self.auth.settings(
                "caller", cfg.namespace, nats_url=self._url("caller"), **cfg.timings
            )
        #: The run's own reads and writes (streams, leaders, ``DONE_CAPTURE``, the checker's
        #: records): the caller's connection, or in secure mode one of the hub identity's — no
        #: other may read them all — straight to the nodes (None: the caller's).
        self.observer = (
            None
            if self.auth is None
            else self.auth.settings("hub", "main", nats_url=self.url, **cfg.timings)
        )

    def _url(self, name: str) -> str:
        """The NATS URL list process ``name`` connects with: its own relays in a blip run."""
        if self.cfg.fault != "blip":
            return self.url
        relays = self.relays[name] = [Relay(int(n.url.rsplit(":", 1)[1])) for n in self.nodes]
        return ",".join(f"nats://127.0.0.1:{r.port}" for r in relays)

    def _env(self, env: dict[str, str], name: str, identity: str) -> dict[str, str]:
        """The environment of process ``name``; in secure mode with ``REACH_CONFIG`` naming
        the settings file of its identity (``<role>.<name>``)."""
        out = {**env, "REACH_NATS_URL": self._url(name)}
        if self.auth is not None:
            out["REACH_CONFIG"] = str(self.auth.path / f"{identity}.yaml")
        return out

    async def start_relays(self) -> None:
        for relay in (r for relays in self.relays.values() for r in relays):
            await relay.start()
        for relay in self.route_relays.values():
            await relay.start()

    def nodes_up(self) -> None:
        for node in self.nodes:
            node.start()

    def close(self) -> None:
        for p in [*self.agents, *self.hubs]:
            p.stop()
        for node in self.nodes:
            node.stop(kill=True)


def _issue(
    bindir: Path, env: dict[str, str], auth: Path, cfg: ChaosConfig, agent_ids: list[str]
) -> AuthDir:
    """``reach-mesh auth init`` (the hub, the operator, the caller of the namespace) and
    ``auth add-agent`` for each agent id, into ``auth``."""
    cli = str(bindir / "reach-mesh")
    cmds = [[cli, "auth", "init", str(auth), "--namespace", cfg.namespace]]
    cmds += [[cli, "auth", "add-agent", aid, "--dir", str(auth)] for aid in agent_ids]
    for argv in cmds:
        subprocess.run(argv, env=env, check=True, capture_output=True)
    return AuthDir(auth)


async def _until(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if await check():
                return
        except Exception as err:
            last = err
        await asyncio.sleep(0.25)
    raise TimeoutError(f"{what} not ready within {timeout:g}s (last error: {last!r})")


async def start_mesh(mesh: Mesh, client: Client, observer: Client) -> None:
    js = observer.nc.jetstream()
    await _until("JetStream cluster", js.account_info, 30)
    for hub in mesh.hubs:
        hub.start()

    async def buckets() -> bool:
        await js.stream_info("KV_reach_workflows")
        await js.stream_info("REACH_WF")
        return True

    await _until("hub streams", buckets, 60)
    # Every hub serving before the faults begin: the streams are the first hub's; one still
    # starting meets the first fault in its start.
    mesh.hubs_not_up.update(await hubs_serving(mesh.hubs, HUB_START_WAIT))
    # The mesh announces results on core NATS (the records are their durable copy); the
    # checker compares every announcement with the record, so the run keeps them all here.
    await js.add_stream(
        StreamConfig(
            name=DONE_CAPTURE,
            subjects=[protocol.wf_done(mesh.cfg.namespace, "*")],
            storage=StorageType.FILE,
            num_replicas=3,
        )
    )
    for agent in mesh.agents:
        agent.start()

    async def online() -> bool:
        infos = await client.agents()
        return sum(1 for a in infos if a.state.value == "ONLINE") >= len(mesh.agents)

    await _until("agents", online, 60)


#: How long ``start_mesh`` waits for every hub to say it serves: past a hub's own
#: ``start_timeout`` (60 s), so a hub that cannot start has exited by then.
HUB_START_WAIT = 75.0
#: The line ``reach-mesh hub`` prints (stdout, into its log) once it serves.
_SERVING = re.compile(r"^hub \S+ serving on ", re.MULTILINE)


async def hubs_serving(hubs: list[Proc], timeout: float) -> dict[str, str]:
    """Wait until each hub process said it serves, or exited. Those that exited (or had still
    not said it after ``timeout``), by name, with their log's last line: the run goes on
    with the others, and its table says so."""
    deadline = time.monotonic() + timeout
    waiting = list(hubs)
    not_up: dict[str, str] = {}
    while waiting:
        for proc in list(waiting):
            text = proc.log.read_text(errors="replace") if proc.log.exists() else ""
            if _SERVING.search(text):
                waiting.remove(proc)
            elif not proc.alive or time.monotonic() >= deadline:
                lines = text.strip().splitlines()
                said = lines[-1][:200] if lines else "(nothing)"
                state = "exited at start" if not proc.alive else f"not serving after {timeout:g}s"
                not_up[proc.name] = f"{state}: {said}"
                waiting.remove(proc)
        if waiting:
            await asyncio.sleep(0.25)
    return not_up


# --------------------------------------------------------------------------- collection


async def _bucket(js: Any, name: str) -> Any:
    """The KV bucket ``name``, asked again while the cluster settles after the last fault
    (its API request timed out once, right after a node stop: the checker's own read, not
    the mesh's)."""
    for _ in range(40):
        try:
            return await js.key_value(name)
        except Exception:
            await asyncio.sleep(0.5)
    raise RuntimeError(f"cannot open bucket {name}")


async def _get(js: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """A record as its stream's leader has it. Not ``KeyValue.get``: a direct get, which any
    replica answers — one that is behind (a node just resumed after the last fault) showed
    the checker a RUNNING record whose final result the caller had been told."""
    for _ in range(20):
        try:
            msg = await js.get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{key}")
        except NotFoundError as err:
            if no_message(err):  # no such key
                return None
            await asyncio.sleep(0.5)
            continue
        except Exception:
            await asyncio.sleep(0.5)
            continue
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            return None
        record: dict[str, Any] = json.loads(msg.data)
        return record
    raise RuntimeError(f"cannot read {key}")


async def collect_done(client: Client, ns: str) -> dict[str, list[dict[str, Any]]]:
    """Every ``.done`` message of the namespace (captured in ``DONE_CAPTURE``), in order."""
    js = client.nc.jetstream()
    out: dict[str, list[dict[str, Any]]] = {}
    sub = await js.subscribe(
        protocol.wf_done(ns, "*"),
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
        stream=DONE_CAPTURE,
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=3)
            except (TimeoutError, nats.errors.TimeoutError):
                return out
            body = json.loads(msg.data)
            out.setdefault(body["workflow_id"], []).append(body)
            if msg.metadata.num_pending == 0:
                return out
    finally:
        await sub.unsubscribe()


async def collect(
    client: Client,
    mesh: Mesh,
    work: list[Planned],
    expected: dict[str, Expected],
    callers: dict[str, dict[str, Any] | str],
) -> History:
    ns = mesh.cfg.namespace
    js = client.nc.jetstream()
    await _bucket(js, protocol.KV_WORKFLOWS)  # (both there: the cluster has settled)
    await _bucket(js, protocol.KV_TASKS)
    h = History(expected=expected, callers=callers)
    sem = asyncio.Semaphore(64)

    async def one(p: Planned) -> None:
        async with sem:
            rec = await _get(js, protocol.KV_WORKFLOWS, protocol.workflow_key(ns, p.workflow_id))
            if rec is not None:
                h.records[p.workflow_id] = rec
            for i in range(len(p.steps)):
                tid = step_task_id(p.workflow_id, i, p.steps[i])
                task = await _get(js, protocol.KV_TASKS, protocol.task_key(ns, tid))
                if task is not None:
                    h.tasks[tid] = task

    await asyncio.gather(*(one(p) for p in work if p.workflow_id in expected))
    h.done = await collect_done(client, ns)
    h.runs = read_runs(p for p in mesh.agent_logs if p.exists())
    h.unstored = read_unstored(p.with_suffix(".log") for p in mesh.agent_logs)
    h.unregistered = read_unregistered(p.with_suffix(".log") for p in mesh.agent_logs)
    h.faults = read_faults(mesh.dir / "faults.jsonl")
    return h


# --------------------------------------------------------------------------- one run


@dataclass
class ChaosRun:
    cfg: ChaosConfig
    report: Report
    history: History
    stats: DriverStats
    faults: int
    seconds: float
    #: Lease expiries (an agent made SUSPECT) the hubs logged: informational — expected after
    #: an agent fault, a sign of lost heartbeats after any other.
    lease_expiries: int = 0
    #: Task records the agents read before running a step (the last count each agent process
    #: logged with a handler start), and the starts: informational — a step is run without a
    #: read only by an agent in touch with the hubs (docs/workflows.md).
    fence_reads: int = 0
    starts: int = 0
    #: Agent processes that went deaf (their own ``deaf`` line), and the quarantines the hubs
    #: logged for deafness (``REACH-QUARANTINE``, reason ``deaf: ...``; one per hub that found
    #: it so): informational — after any other fault a deaf verdict would be a false one.
    deafened: int = 0
    deaf_quarantines: int = 0
    #: Hubs that were not serving when the faults began (``Mesh.hubs_not_up``): the run had
    #: fewer hubs than its config says.
    hubs_not_up: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        head = (
            f"fault={self.cfg.fault} workflows={self.cfg.workflows} rate={self.cfg.rate}/s "
            f"faults injected={self.faults} seconds={self.seconds:.0f}"
            + (" secure" if self.cfg.secure else "")
            + (
                f" ({len(self.hubs_not_up)} of {self.cfg.hubs} HUBS NOT UP)"
                if self.hubs_not_up
                else ""
            )
        )
        extra = [
            f"  submit errors (retried): {sum(self.stats.submit_errors.values())}"
            + (
                f" {dict(self.stats.submit_errors.most_common(3))}"
                if self.stats.submit_errors
                else ""
            ),
            f"  submit gave up: {self.stats.submit_gave_up}",
            f"  caller wait errors (retried): {dict(self.stats.wait_errors)}",
            f"  callers' answers after the result's finished_at (its store included): "
            f"{_lags(self.stats.answer_lag)}",
            f"    of those over 1 s, after the record was written: {_lags(self.stats.after_write)}",
            "  waits that ran out after the record was written: "
            + _ran_out(
                self.stats.ran_out_stored, self.stats.timed_out, self.stats.ran_out_announced
            ),
            f"  cancels sent: {len(self.stats.cancels)}, errors (asked again): "
            f"{dict(self.stats.cancel_errors)}",
            f"  route errors (asked again with the task id): {dict(self.stats.route_errors)}",
            f"  lease expiries logged by hubs: {self.lease_expiries}",
            f"  fence reads by agents: {self.fence_reads} (handler starts: {self.starts})",
            f"  agents made deaf: {self.deafened}, deaf quarantines logged by hubs: "
            f"{self.deaf_quarantines}",
            *(f"  hub {name} not up: {why}" for name, why in sorted(self.hubs_not_up.items())),
        ]
        return "\n".join([self.report.table(head), *extra])


async def _after_write(client: Client, ns: str, stats: DriverStats) -> None:
    """Fill ``stats.after_write``: for each answer over 1 s late, the time between the final
    record's write (its stream timestamp: the bucket keeps one message per key, and a final
    record is written once) and the caller's answer; ``stats.ran_out_stored``: the waits
    that ran out after that write; and ``stats.ran_out_announced``: those that ran out after
    the result's first ``.done`` too (captured in ``DONE_CAPTURE``).

    The write's timestamp is when the stream's leader took it, not when it was committed and
    could be read: a write that a leader took just before it was deposed (or while cut off)
    keeps that timestamp and is committed, readable and acknowledged to its hub only once the
    next leader is elected, seconds later (seed 210's ``partition``: three waits ran out
    0.45-3.35 s "after the write", all before that election). A wait counted there ran out
    with its result perhaps not stored yet; one that ran out after its ``.done`` — which the
    hub sends only once its write is acknowledged — had its result stored: the caller missed
    it. (A ``.done`` the capture lost counts no wait, and one it took late — held by a frozen
    node — fewer.)"""
    js = client.nc.jetstream()
    stream = f"KV_{protocol.KV_WORKFLOWS}"
    written: dict[str, float] = {}
    for wf in sorted(
        {wf for wf, lag in stats.answer_lag.items() if lag > 1.0} | set(stats.timed_out)
    ):
        subject = f"$KV.{protocol.KV_WORKFLOWS}.{protocol.workflow_key(ns, wf)}"
        try:
            raw = await js.get_last_msg(stream, subject)
        except Exception:
            continue
        if raw.time is not None and _final(raw.data):
            written[wf] = raw.time.timestamp()
    for wf, lag in stats.answer_lag.items():
        if lag > 1.0 and wf in written:
            stats.after_write[wf] = stats.answered_at[wf] - written[wf]
    stats.ran_out_stored = ran_out_after_write(stats.timed_out, written)
    announced: dict[str, float] = {}
    for wf in sorted(set(written) & set(stats.timed_out)):
        try:
            raw = await js.get_msg(DONE_CAPTURE, seq=1, subject=protocol.wf_done(ns, wf), next=True)
        except Exception:
            continue
        if raw.time is not None:
            announced[wf] = raw.time.timestamp()
    stats.ran_out_announced = ran_out_after_write(stats.timed_out, announced)
    stats.written, stats.announced = written, announced


def _final(data: bytes | None) -> bool:
    """Whether a workflow record holds its result (a record never final has no write to
    measure from)."""
    try:
        return bool(data) and json.loads(data or b"{}").get("result") is not None
    except ValueError:
        return False


def ran_out_after_write(
    timed_out: dict[str, list[float]], written: dict[str, float]
) -> list[float]:
    """For each wait that ran out (``timed_out``: workflow id -> when its waits did) after its
    workflow's final record was written (``written``: workflow id -> when), how long after."""
    return sorted(
        t - written[wf]
        for wf, ends in timed_out.items()
        if wf in written
        for t in ends
        if t > written[wf]
    )


def _ran_out(gaps: list[float], timed_out: dict[str, list[float]], announced: list[float]) -> str:
    """The waits that ran out after the record's write, of all that ran out; and of those,
    the ones that ran out after the result's ``.done`` (its store acknowledged)."""
    total = sum(len(ends) for ends in timed_out.values())
    return (
        f"{len(gaps)} of {total}"
        + (f" (max {gaps[-1]:.3f} s after the write)" if gaps else "")
        + f"; after its first .done: {len(announced)}"
        + (f" (max {announced[-1]:.3f} s after it)" if announced else "")
    )


def _lags(lags: dict[str, float]) -> str:
    """p50 / p99 / max of the callers' answer lags, and how many came over 5 s late."""
    if not lags:
        return "none"
    got = sorted(lags.values())
    p50, p99 = got[len(got) // 2], got[min(len(got) - 1, int(len(got) * 0.99))]
    late = sum(1 for lag in got if lag > 5.0)
    return f"{len(got)}: p50 {p50:.3f} s, p99 {p99:.3f} s, max {got[-1]:.3f} s; over 5 s: {late}"


def _deaf_quarantines(logs: Iterable[Path]) -> int:
    """``REACH-QUARANTINE`` lines whose reason is deafness, in the hubs' logs."""
    n = 0
    for path in logs:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if f'"event":"{QUARANTINE}"' in line and '"reason":"deaf:' in line:
                n += 1
    return n


def _deafened(logs: Iterable[Path]) -> int:
    """Agent processes that logged going deaf (``agent_proc.deafen``)."""
    n = 0
    for path in logs:
        if path.exists():
            n += path.read_text(errors="replace").count('"ev": "deaf"')
    return n


def _fence_reads(logs: Iterable[Path]) -> tuple[int, int]:
    """(fence reads, handler starts) from the agents' logs: each process's last count."""
    last: dict[int, int] = {}
    starts = 0
    for path in logs:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a line cut by SIGKILL
            if ev.get("ev") == "start":
                starts += 1
                last[ev["pid"]] = max(last.get(ev["pid"], 0), ev.get("fr", 0))
    return sum(last.values()), starts


async def run_chaos(cfg: ChaosConfig, workdir: Path) -> ChaosRun:
    # A fresh directory: agent logs and faults are appended, a previous run's would mix in.
    await asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True)
    await asyncio.to_thread(workdir.mkdir, parents=True)
    t0 = time.monotonic()
    mesh = Mesh(cfg, workdir)
    # The caller's own lines (its reconnections, the requests it asked again) beside the
    # processes' logs, with the time the agents' and the faults' lines have.
    caller_log = logging.FileHandler(workdir / "caller.log")
    caller_log.setFormatter(logging.Formatter("%(created).3f %(levelname)s %(name)s %(message)s"))
    reach_log = logging.getLogger("reach_mesh")
    level = reach_log.level
    reach_log.setLevel(logging.INFO)
    reach_log.addHandler(caller_log)
    try:
        await mesh.start_relays()  # the route relays before the nodes that dial them
        await asyncio.to_thread(mesh.nodes_up)  # inside: a node that fails stops the others
        async with contextlib.AsyncExitStack() as stack:
            client = await stack.enter_async_context(Client(settings=mesh.settings))
            observer = client
            if mesh.observer is not None:
                # A name of its own: a partition's ``cut_off`` (the node's connection names)
                # then names the caller only when the caller is there (``caller_side``).
                observer = await stack.enter_async_context(
                    Client(settings=mesh.observer, name=OBSERVER)
                )
            await start_mesh(mesh, client, observer)
            work = plan(cfg)
            stats = DriverStats()
            faults = Faults(cfg, mesh, observer)
            injector = asyncio.create_task(faults.run())
            driver = asyncio.create_task(drive(cfg, client, work, stats))
            await asyncio.sleep(cfg.workflows / cfg.rate)
            faults.stop.set()
            await injector  # the last fault ends (restarted, SIGCONT) before the drain
            expected, callers = await driver
            history = await collect(observer, mesh, work, expected, callers)
            await _after_write(observer, mesh.cfg.namespace, stats)
            history.cancels = stats.cancels
            history.route_expected = {r.task_id: r.expected for r in plan_routes(cfg)}
            history.routes = stats.routes
            history.observer = None if mesh.observer is None else OBSERVER
    finally:
        reach_log.removeHandler(caller_log)
        reach_log.setLevel(level)
        caller_log.close()
        await asyncio.to_thread(mesh.close)
    report = check(history)
    expiries = sum(
        proc.log.read_text(errors="replace").count(f'"event":"{LEASE_EXPIRED}"')
        for proc in mesh.hubs
        if proc.log.exists()
    )
    reads, starts = _fence_reads(mesh.agent_logs)
    result = ChaosRun(
        cfg,
        report,
        history,
        stats,
        faults.count,
        time.monotonic() - t0,
        expiries,
        reads,
        starts,
        _deafened(mesh.agent_logs),
        _deaf_quarantines(proc.log for proc in mesh.hubs),
        mesh.hubs_not_up,
    )
    (workdir / "table.txt").write_text(result.table() + "\n")
    # Per workflow, for a look at the tail: when its caller had it, how long after the result
    # was finished and (answers over 1 s late) after its record was written.
    (workdir / "lags.json").write_text(
        json.dumps(
            {
                wf: {
                    "answered_at": stats.answered_at[wf],
                    "lag": lag,
                    "after_write": stats.after_write.get(wf),
                    "timed_out": stats.timed_out.get(wf, []),
                    # Its final record's write (for an answer over 1 s late or a wait that
                    # ran out) and its first captured .done (for a wait that ran out).
                    "written": stats.written.get(wf),
                    "announced": stats.announced.get(wf),
                }
                for wf, lag in stats.answer_lag.items()
            }
        )
    )
    (workdir / "history.json").write_text(
        json.dumps(
            {
                "config": asdict(cfg),
                "records": history.records,
                "done": history.done,
                "callers": history.callers,
                "cancels": history.cancels,
                "tasks": history.tasks,
                "expected": {k: asdict(v) for k, v in history.expected.items()},
                "route_expected": {k: asdict(v) for k, v in history.route_expected.items()},
                "routes": history.routes,
                "observer": history.observer,
                "hubs_not_up": mesh.hubs_not_up,
            },
            default=str,
        )
    )
    return result
