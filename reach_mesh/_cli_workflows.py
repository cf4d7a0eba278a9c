"""The ``reach-mesh`` workflow commands: ``workflow`` (one, as it stands), ``workflows`` (the
recent ones of a namespace) and ``cancel`` — their arguments and what they print.
``reach_mesh.cli`` parses the command line and runs them.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator

from reach_mesh import protocol
from reach_mesh._cli_fleet import cell, print_table, settings_of
from reach_mesh.client import Client
from reach_mesh.errors import BadRequestError, NotPermittedError, UnknownWorkflowError
from reach_mesh.models import ErrorBody, TaskState
from reach_mesh.workflow import WorkflowView

__all__ = ["add_workflow_commands"]


def _within(
    kind: Callable[[str], float], low: float, high: float, *, low_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: ``kind(text)`` in [``low``, ``high``] (``(low, high]`` when
    ``low_open``), else a usage error that names the bounds (not the hub's field name)."""

    def parse(text: str) -> float:
        value = kind(text)
        if value < low or (low_open and value == low) or value > high:
            left = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"{text} is not in {left}{low:g}, {high:g}]")
        return value

    parse.__name__ = kind.__name__  # (argparse names it in "invalid <name> value")
    return parse


def add_workflow_commands(cmd: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """The workflow commands, added with ``cmd(name, help)`` (``cli.build_parser``)."""
    workflow = cmd(
        "workflow", "one workflow as it stands: owner, each step's state, attempts and errors"
    )
    workflow.add_argument(
        "workflow_id", help="as a caller got it (res.workflow_id, submit_*) or `workflows` lists"
    )
    workflow.add_argument("--namespace", help="its namespace (default: the configured one)")
    workflow.add_argument("--json", action="store_true", help="print JSON")
    workflow.set_defaults(func=cmd_workflow)
    workflows = cmd(
        "workflows",
        "recent workflows of a namespace, newest first: state, steps ok, owner, error",
    )
    workflows.add_argument("--namespace", help="the namespace (default: the configured one)")
    workflows.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="every namespace's (an operator query: in secure mode, an operator identity)",
    )
    workflows.add_argument(
        "--state",
        action="append",
        metavar="STATE",
        help="only this state (again for more): RUNNING, SUCCEEDED, FAILED, TIMEOUT, ...",
    )
    workflows.add_argument(
        "--since",
        type=_within(float, 0.0, protocol.WORKFLOW_LIST_SINCE_MAX, low_open=True),
        default=protocol.WORKFLOW_LIST_SINCE,
        help="seconds back (default 1 h, at most 7 days)",
    )
    workflows.add_argument(
        "--limit",
        type=_within(int, 1, protocol.WORKFLOW_LIST_MAX),
        default=protocol.WORKFLOW_LIST_LIMIT,
        help=f"most workflows shown (default {protocol.WORKFLOW_LIST_LIMIT}, at most "
        f"{protocol.WORKFLOW_LIST_MAX})",
    )
    workflows.add_argument("--json", action="store_true", help="print JSON")
    workflows.set_defaults(func=cmd_workflows)
    cancel = cmd(
        "cancel",
        "stop a running workflow: unfinished steps are cancelled, its result is FAILED "
        "(REACH_WORKFLOW_CANCELLED)",
    )
    cancel.add_argument(
        "workflow_id", help="as a caller got it (res.workflow_id, submit_*) or `workflows` lists"
    )
    cancel.add_argument("--namespace", help="its namespace (default: the configured one)")
    cancel.add_argument("--reason", help="why (kept in its result's error and the audit)")
    cancel.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for its final result (default 10)",
    )
    cancel.add_argument(
        "--before-start",
        action="store_true",
        help="if no hub has started it yet (its submission waits for a hub), record the cancel "
        "so that it never runs (an id never submitted keeps the cancel: check it)",
    )
    cancel.add_argument("--json", action="store_true", help="print JSON")
    cancel.set_defaults(func=cmd_cancel)


@contextlib.contextmanager
def _namespace_hint(args: argparse.Namespace, verb: str) -> Iterator[None]:
    """Workflow ids are per namespace: an unknown one asked without ``--namespace`` most
    likely lives in another, and the error says how to ``verb`` there."""
    try:
        yield
    except UnknownWorkflowError as err:
        if args.namespace is not None:
            raise
        raise UnknownWorkflowError(
            f"{err.message} (pass --namespace to {verb} in another)", **err.details
        ) from err


async def cmd_workflow(args: argparse.Namespace) -> int:
    async with Client(settings=settings_of(args)) as c:
        with _namespace_hint(args, "ask"):
            view = await c.inspect_workflow(args.workflow_id, namespace=args.namespace)
    if args.json:
        print(view.model_dump_json(indent=2))
    else:
        _print_workflow(view)
    return 0


async def cmd_workflows(args: argparse.Namespace) -> int:
    """The recent workflows of a namespace (or of every one), newest first: one row each."""
    every = args.all_namespaces
    if every and args.namespace is not None:
        raise BadRequestError("--all-namespaces lists every namespace: leave out --namespace")
    async with Client(settings=settings_of(args)) as c:
        listed = await c.list_workflows(
            state=args.state or (),
            limit=args.limit,
            since=args.since,
            namespace=args.namespace,
            all_namespaces=every,
        )
        owners = {w.owner for w in listed.workflows if w.state is TaskState.RUNNING and w.owner}
        silent = await _silent(c, owners) if owners and not args.json else set()
    if args.json:
        print(listed.model_dump_json(indent=2))
        return 0
    head = ("WORKFLOW", "KIND", "STATE", "STEPS", "SUBMITTED", "TOOK", "OWNER", "ERROR")
    rows: list[tuple[str, ...]] = [("NAMESPACE", *head) if every else head]
    for w in listed.workflows:
        final = w.state not in (TaskState.RUNNING, TaskState.PENDING)
        steps = f"{w.steps - w.failed_steps}/{w.steps} ok" if final else str(w.steps)
        took = "-" if w.duration_ms is None else f"{w.duration_ms:,.0f} ms"
        if w.state is TaskState.RUNNING and w.submitted_at is not None:
            ran = time.time() - w.submitted_at
            past = w.timeout is not None and ran > w.timeout
            took = f"{ran:,.0f} s so far" + (" (past its timeout)" if past else "")
        row = (
            w.workflow_id,
            w.kind or "?",
            w.state.value,
            steps,
            _when(w.submitted_at),
            took,
            (w.owner or "-") + (" (not answering)" if w.owner in silent else ""),
            _said(w.error),
        )
        rows.append((w.namespace or "?", *row) if every else row)
    if listed.workflows:
        print_table(rows)
    n = len(listed.workflows)
    more = f" (the newest {n} of {listed.matched}: --limit)" if listed.matched > n else ""
    whose = "every namespace" if listed.namespace is None else f"namespace {listed.namespace}"
    # Unfinished ones from before the window are listed too, unless only final states were
    # asked for.
    final_only = bool(args.state) and all(TaskState(s.upper()).final for s in args.state)
    unfinished = "" if final_only else ", and unfinished ones"
    print(f"{listed.matched} workflow(s) of {whose} since {_when(listed.since)}{unfinished}{more}")
    if not listed.matched and args.namespace is None and not every:
        # Workflows run in their caller's namespace: a first list without --namespace is
        # most likely asked of the wrong one.
        print("  another namespace: --namespace NS, or -A for every namespace")
    if silent:
        orphans = sum(
            1 for w in listed.workflows if w.state is TaskState.RUNNING and w.owner in silent
        )
        print(
            f"  {orphans} running workflow(s) owned by {', '.join(sorted(silent))}, which did "
            "not answer hub discovery (stopped, died, cut off or busy): another hub takes them "
            "over within workflow_ack_wait (30 s) of their owner's last renewal, resuming "
            "each from its records (reach-mesh hubs; docs/operations.md, 'A hub is lost')"
        )
    if listed.truncated:
        print(
            f"  partial: {listed.scanned:,} records read, back to "
            f"{_when(listed.oldest_read_at)}; older ones of the window, or unfinished ones "
            "from before it, were not read (narrow --since or --state)"
        )
    return 0


async def _silent(c: Client, owners: set[str]) -> set[str]:
    """The ``owners`` (hub ids) that do not answer NATS micro discovery within 0.5 s: dead,
    stopped or cut off hubs whose running workflows wait for a takeover. Nothing when
    discovery is not allowed (a caller identity in secure mode) or no hub answers at all
    (then the list itself was not answered either)."""
    from reach_mesh.hub._micro import discover_hubs

    try:
        hubs = await discover_hubs(c.nc, expected=True, fleet_ask=b'{"limit":0}')
    except NotPermittedError:
        return set()
    answering = {str((hub.get("metadata") or {}).get("hub_id")) for hub in hubs}
    return owners - answering if answering else set()


async def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a workflow; 0 once it has its final result (cancelled, or ended by itself
    first) or when it is cancelled before it started, 1 when its owner is still stopping it
    after ``--timeout``."""
    async with Client(settings=settings_of(args)) as c:
        with _namespace_hint(args, "cancel"):
            answer = await c.cancel_workflow(
                args.workflow_id,
                reason=args.reason,
                namespace=args.namespace,
                timeout=args.timeout,
                before_start=args.before_start,
            )
    if args.json:
        print(answer.model_dump_json(indent=2))
    elif answer.recorded_before_start:
        print(
            f"workflow {answer.workflow_id} (namespace {answer.namespace}): cancelled before it "
            "started — no hub has taken it yet; the one that takes it ends it FAILED "
            "(REACH_WORKFLOW_CANCELLED) without running a step. If it was never submitted "
            "there, check the id and --namespace: a later submission of it there ends "
            "cancelled."
        )
    elif not answer.final:
        print(
            f"workflow {answer.workflow_id} ({answer.namespace}): its owner "
            f"{answer.owner or '-'} is stopping it; not final yet (run this again, or "
            f"`reach-mesh workflow {answer.workflow_id}`)"
        )
    else:
        how = "cancelled" if answer.cancelled else "not cancelled: it had ended by itself"
        print(f"workflow {answer.workflow_id} ({answer.namespace}): {how}, {answer.state.value}")
        result = answer.result
        if result is not None and result.error is not None:
            print(f"  error {_said(result.error)}")
        if result is not None:
            for s in result.steps:
                state = _step_state(s.state, s.cancelled, s.attempts)
                print(f"  step {s.index}: {state}  {s.agent_id or '-'}  {_said(s.error)}")
    return 0 if answer.final or answer.recorded_before_start else 1


def _step_state(state: TaskState, cancelled: bool, attempts: int) -> str:
    """A step's state for people: a cancelled step's record says PENDING whatever its attempt
    had reached (records hold no running state), so say whether one was ever sent."""
    if not cancelled or state.final:
        return state.value + (" (cancelled)" if cancelled else "")
    if attempts <= 0:
        return "cancelled, never sent"
    return f"cancelled after attempt {attempts} was sent"


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _said(error: ErrorBody | None) -> str:
    """An error on one line (its message comes from a handler or a caller's reason: control
    characters are folded, as in every table cell)."""
    return "" if error is None else cell(f"{error.code}: {error.message}", 400)


def _print_workflow(v: WorkflowView) -> None:
    """A workflow, then one row per step; a step's earlier attempts indented below it."""
    print(
        f"workflow {v.workflow_id} ({v.namespace}): {v.kind or '?'}, policy {v.policy or '?'}, "
        f"{v.state.value}"
    )
    took = "" if v.duration_ms is None else f" ({v.duration_ms:,.0f} ms)"
    print(f"  submitted {_when(v.submitted_at)}, finished {_when(v.finished_at)}{took}")
    owner = f"{v.owner or '-'}" + (" (answered live by its owner)" if v.live else "")
    if v.owner_silent:
        owner += (
            " (did not answer: stopped, died, cut off or busy — reach-mesh hubs; a dead "
            "owner's workflows are taken over by another hub within workflow_ack_wait, 30 s "
            "by default)"
        )
    print(f"  owner {owner}; trace {v.trace_id or '-'}")
    if v.error is not None:
        print(f"  error {_said(v.error)}")
    if v.unreadable:
        print(f"  partial: could not read {', '.join(v.unreadable)}")
    rows = [("STEP", "STATE", "ATTEMPT", "AGENT", "TARGET", "ERROR / WAITING")]
    for s in v.steps:
        state = _step_state(s.state, s.cancelled, s.attempt)
        note = _said(s.error)
        if s.waiting is not None:
            again = "" if s.retry_in_s is None else f", tries again in {s.retry_in_s:g} s"
            note = f"waiting: {s.waiting}{again}"
        # A decided step shows the attempt that decided it (the first outcome of any attempt
        # wins: it may be an earlier one), the others below it.
        shown = s.attempt if s.decided_by is None else s.decided_by
        rows.append((str(s.index), state, str(shown), s.agent_id or "-", s.target or "-", note))
        for h in s.history:
            if h.attempt != shown:
                rows.append(
                    ("", f"  #{h.attempt} {h.state.value}", "", h.agent_id or "-", "", h.code or "")
                )
    print_table(rows, indent="  ")
