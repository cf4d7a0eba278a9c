"""The chaos suite's workload: what a run submits and routes (:func:`plan`, :func:`plan_routes`:
workflows and requests with known expected outcomes) and the caller that drives them through
the faults (:func:`drive`), counting what it saw (:class:`DriverStats`)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import nats

from reach_mesh import Client, RetryPolicy, Step
from reach_mesh.errors import MeshTimeoutError, ReachError

from .agent_proc import CAPABILITY
from .explained import ROUTE_TIMEOUT
from .history import Expected, ExpectedRoute
from .policies import POLICIES, expected_state

if TYPE_CHECKING:
    from .harness import ChaosConfig

__all__ = ["DriverStats", "Planned", "PlannedRoute", "drive", "plan", "plan_routes"]


@dataclass
class Planned:
    workflow_id: str
    kind: str
    steps: list[Step]
    expected: Expected
    #: Seconds after its submission its caller cancels it (None: never).
    cancel_after: float | None = None
    #: A fanout's completion policy (tests/chaos/policies.py).
    policy: str = "all"


#: Handler times (ms) of a policy fanout's steps by speed rank: the policy decides on the
#: fast ones, before the slowest ends (it is stopped as unneeded).
SPEEDS = ((20, 150), (300, 600), (1800, 3000))


def plan(cfg: ChaosConfig) -> list[Planned]:
    """Fanouts and chains of 3 steps; a share has a step that fails non-retryably or one that
    is slower than its timeout, and a share is cancelled by its caller (one of its steps fails
    once, retryably, and has ``retries=1``: that second run is the only planned one, logged
    after a ``flaky`` run). Every other step has ``retries=0``: a second handler run of it is
    never a planned retry.

    Half the fanouts (two in every eight workflows) have a policy that decides before every
    step ended — ``any`` and ``quorum(2)`` in turn (tests/chaos/policies.py) — their steps of
    three speeds (``SPEEDS``); a share of them (``cfg.lose_share``) cannot meet it: ``any``
    with every step failing (or every one slower than its timeout), ``quorum(2)`` with two
    (the third, the slowest, stopped as unneeded)."""
    rng = random.Random(cfg.seed)
    out: list[Planned] = []
    for i in range(cfg.workflows):
        kind = "fanout" if i % 2 == 0 else "chain"
        policy = POLICIES[(i % 8 - 4) // 2] if i % 8 in (4, 6) else "all"
        r = rng.random()
        variant = (
            "fail"
            if r < cfg.fail_share
            else "slow"
            if r < cfg.fail_share + cfg.slow_share
            else "cancel"
            if r < cfg.fail_share + cfg.slow_share + cfg.cancel_share
            else ""
        )
        odd = rng.randrange(3) if variant else -1
        x0 = rng.randrange(1000)
        wf_id = f"{cfg.namespace}-{cfg.seed}-{i:05d}"
        # A quarter of them (a chain and a fanout in every eight) name their steps' task ids:
        # such steps are claimed (their record created) before they are sent; and every
        # other ``any`` fanout (its unneeded steps fenced with claimed records).
        named = i % 8 in (1, 2) or i % 16 == 4
        speed: list[int] = []
        losing: set[int] = set()
        if policy != "all":
            speed = rng.sample(range(3), 3)  # step -> speed rank
            lose = rng.random()
            if variant in ("", "fail", "slow") and lose < cfg.lose_share:
                variant = "fail" if lose < cfg.lose_share / 2 else "slow"
                # Out of reach: every step fails (any), or the two fastest (quorum(2)).
                losing = {k for k in range(3) if policy == "any" or speed[k] < 2}
        steps = []
        modes = []
        for k in range(3):
            mode = variant if (k == odd or k in losing) and variant != "cancel" else "ok"
            if mode == "slow" and i % 4 >= 2:
                mode = "stubborn"  # as slow, and it ignores its cancellation
            if variant == "cancel":
                # Long enough to be cancelled while it runs; one step fails once and is
                # retried (a failure handled by the hub must not become the step's outcome).
                mode = "flaky" if k == odd else "ok"
                ms = rng.randint(200, 1500)
            elif mode in ("slow", "stubborn"):
                ms = 2500
            elif speed:
                ms = rng.randint(*SPEEDS[speed[k]])
            else:
                ms = rng.randint(20, 300)
            modes.append(mode)
            payload: dict[str, Any] = {"mode": mode, "ms": ms}
            if kind == "fanout" or k == 0:
                payload["x"] = x0 + k if kind == "fanout" else x0
            steps.append(
                Step(
                    capability=CAPABILITY,
                    payload=payload,
                    timeout=1.0 if mode in ("slow", "stubborn") else 10.0,
                    retry=RetryPolicy(retries=1 if mode == "flaky" else 0),
                    task_id=f"{wf_id}-n{k}" if named else None,
                )
            )
        cancel_after = rng.uniform(0.0, 1.2) if variant == "cancel" else None
        if policy != "all":
            values = tuple({"x": x0 + k + 1} for k in range(3))
            exp = Expected(kind, expected_state(policy, modes), policy=policy, values=values)
        elif variant == "fail":
            exp = Expected(kind, "FAILED")
        elif variant == "slow":
            exp = Expected(kind, "TIMEOUT")
        elif kind == "fanout":
            exp = Expected(kind, "SUCCEEDED", [{"x": x0 + k + 1} for k in range(3)])
        else:
            exp = Expected(kind, "SUCCEEDED", {"x": x0 + 3})
        if cancel_after is not None:
            exp = replace(exp, cancellable=True)
        out.append(Planned(wf_id, kind, steps, exp, cancel_after, policy))
    return out


@dataclass
class PlannedRoute:
    task_id: str
    mode: str  # proxy or direct
    payload: dict[str, Any]
    expected: ExpectedRoute


def plan_routes(cfg: ChaosConfig) -> list[PlannedRoute]:
    """Routed requests to the chaos capability, each with a task id of its own (its caller asks
    again with it after an error); ``fail_share`` of them fail non-retryably. Planned with a
    generator of their own: the workflows' plan is the same with or without them."""
    rng = random.Random(cfg.seed * 1_000_003 + 7)
    out: list[PlannedRoute] = []
    for i in range(cfg.route_count):
        mode = "proxy" if i % 2 == 0 else "direct"
        x = rng.randrange(1000)
        fail = rng.random() < cfg.fail_share
        payload = {"mode": "fail" if fail else "ok", "ms": rng.randint(20, 300), "x": x}
        exp = (
            ExpectedRoute("FAILED", None, mode)
            if fail
            else ExpectedRoute("SUCCEEDED", {"x": x + 1}, mode)
        )
        out.append(PlannedRoute(f"{cfg.namespace}-{cfg.seed}-r{i:05d}", mode, payload, exp))
    return out


@dataclass
class DriverStats:
    submit_errors: Counter[str] = field(default_factory=Counter)
    wait_errors: Counter[str] = field(default_factory=Counter)
    submit_gave_up: int = 0
    cancel_errors: Counter[str] = field(default_factory=Counter)
    #: workflow id -> the cancel's last answer (with ``t``, when it came) or an error string.
    cancels: dict[str, dict[str, Any] | str] = field(default_factory=dict)
    #: workflow id -> how long (s) after its result's ``finished_at`` the caller had it: the
    #: hub sets it before it stores the result, so this includes the store (a record bucket
    #: electing a leader holds it for seconds), not only what the answer took once stored
    #: (``after_write``).
    answer_lag: dict[str, float] = field(default_factory=dict)
    #: When (wall clock) each caller had its answer.
    answered_at: dict[str, float] = field(default_factory=dict)
    #: For answers over 1 s after ``finished_at``: how long after the final record was written
    #: (the stream's own timestamp) — what the announcement, not the store, took.
    after_write: dict[str, float] = field(default_factory=dict)
    #: workflow id -> when (wall clock) each of its caller's waits ran out (``MeshTimeoutError``).
    timed_out: dict[str, list[float]] = field(default_factory=dict)
    #: For each wait that ran out after its record's final write: how long after it (s). The
    #: write's time is the stream's timestamp, when its leader took it: a write committed only
    #: by the next leader (its leader deposed first) was not readable yet (``_after_write``).
    ran_out_stored: list[float] = field(default_factory=list)
    #: For each wait that ran out after its result's first ``.done``: how long after it (s).
    #: The hub announces only once its write is acknowledged: a stored result its caller did
    #: not have when its wait ended.
    ran_out_announced: list[float] = field(default_factory=list)
    #: workflow id -> when its final record was written (the stream's timestamp), and when its
    #: first ``.done`` was captured: for the workflows measured (``_after_write``).
    written: dict[str, float] = field(default_factory=dict)
    announced: dict[str, float] = field(default_factory=dict)
    #: Errors of routed requests (each asked again with its task id), by type.
    route_errors: Counter[str] = field(default_factory=Counter)
    #: task id -> its caller's answer (the fields the checker reads) or its last error.
    routes: dict[str, dict[str, Any] | str] = field(default_factory=dict)


async def drive(
    cfg: ChaosConfig, client: Client, work: list[Planned], stats: DriverStats
) -> tuple[dict[str, Expected], dict[str, dict[str, Any] | str]]:
    """Submit at ``cfg.rate``/s; each caller then waits with ``Client.workflow()`` (asking again
    after errors, as a caller would) until ``cfg.drain`` after the last submission."""
    expected: dict[str, Expected] = {}
    callers: dict[str, dict[str, Any] | str] = {}
    deadline = time.monotonic() + cfg.workflows / cfg.rate + cfg.drain

    async def one(p: Planned) -> None:
        while True:
            try:
                if p.kind == "fanout":
                    await client.submit_fanout(p.steps, policy=p.policy, workflow_id=p.workflow_id)
                else:
                    await client.submit_chain(p.steps, workflow_id=p.workflow_id)
                break
            except (ReachError, nats.errors.Error, TimeoutError) as err:
                text = str(err).replace(p.workflow_id, "<id>")
                stats.submit_errors[f"{type(err).__name__}: {text[:70]}"] += 1
                if time.monotonic() > deadline - cfg.drain / 2:
                    stats.submit_gave_up += 1
                    return
                await asyncio.sleep(0.25)
        expected[p.workflow_id] = p.expected
        if p.cancel_after is not None:
            cancellers.append(asyncio.create_task(cancel(p, p.cancel_after)))
        while True:
            left = deadline - time.monotonic()
            try:
                res = await client.workflow(p.workflow_id, timeout=max(1.0, min(left, 15.0)))
                callers[p.workflow_id] = res.model_dump(mode="json")
                if res.finished_at is not None:
                    stats.answered_at[p.workflow_id] = now = time.time()
                    stats.answer_lag[p.workflow_id] = now - res.finished_at
                return
            except (ReachError, nats.errors.Error, TimeoutError) as err:
                stats.wait_errors[type(err).__name__] += 1
                if isinstance(err, MeshTimeoutError):
                    stats.timed_out.setdefault(p.workflow_id, []).append(time.time())
                if time.monotonic() >= deadline:
                    callers[p.workflow_id] = f"{type(err).__name__}: {err}"
                    return
                await asyncio.sleep(0.25)

    async def cancel(p: Planned, after: float) -> None:
        """As a caller would: ask until the answer is final (or the drain ends). A third of
        them ask with ``before_start`` (recorded even before a hub took the submission)."""
        await asyncio.sleep(after)
        asked = time.time()
        early = int(p.workflow_id[-5:]) % 3 == 0
        while True:
            left = deadline - time.monotonic()
            try:
                answer = await client.cancel_workflow(
                    p.workflow_id,
                    reason="chaos",
                    timeout=max(1.0, min(left, 15.0)),
                    before_start=early,
                )
                stats.cancels[p.workflow_id] = {
                    **answer.model_dump(mode="json"),
                    "t": time.time(),
                    "asked": asked,
                }
                if answer.final:
                    return
            except (ReachError, nats.errors.Error, TimeoutError) as err:
                stats.cancel_errors[type(err).__name__] += 1
                stats.cancels.setdefault(p.workflow_id, f"{type(err).__name__}: {err}")
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.25)

    async def route(r: PlannedRoute) -> None:
        """As a caller would: ask, and after an error ask again with the same task id."""
        while True:
            left = deadline - time.monotonic()
            try:
                res = await client.request(
                    capability=CAPABILITY,
                    payload=r.payload,
                    task_id=r.task_id,
                    timeout=max(1.0, min(left, ROUTE_TIMEOUT)),
                    mode="direct" if r.mode == "direct" else "proxy",
                )
                stats.routes[r.task_id] = {
                    "state": res.state.value,
                    "result": res.result,
                    "error": None if res.error is None else res.error.code,
                    "agent_id": res.agent_id,
                    "attempt": res.attempt,
                }
                return
            except (ReachError, nats.errors.Error, TimeoutError) as err:
                stats.route_errors[type(err).__name__] += 1
                stats.routes[r.task_id] = f"{type(err).__name__}: {err}"
                if time.monotonic() >= deadline:
                    return
                await asyncio.sleep(0.25)

    async def routes() -> list[None]:
        planned = plan_routes(cfg)
        sent = []
        for r in planned:
            sent.append(asyncio.create_task(route(r)))
            await asyncio.sleep(cfg.workflows / cfg.rate / max(1, len(planned)))
        return await asyncio.gather(*sent)

    tasks = []
    cancellers: list[asyncio.Task[None]] = []
    routing = asyncio.create_task(routes())
    for p in work:
        tasks.append(asyncio.create_task(one(p)))
        await asyncio.sleep(1 / cfg.rate)
    await asyncio.gather(*tasks)
    await asyncio.gather(*cancellers)
    await routing
    return expected, callers
