"""The workflow section of the benchmark report: reach-mesh fanout(3)/chain(3) with their cost
per workflow, the taskiq peer, ratios first."""

from __future__ import annotations

from typing import Any

from bench._fmt import _f, _get, _x

__all__ = ["WF_KINDS", "bare_ratio", "ratio", "workflow_ratios", "workflow_section"]


WF_KINDS = (("fanout3", "fanout(3)"), ("chain3", "chain(3)"))


def _int(x: Any) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _cost_cells(cost: Any, main_cpu: str) -> str:
    """JetStream ops (API + stored), client messages, bytes kept, the main process's CPU, the
    others' CPU."""
    if not isinstance(cost, dict):
        return "- | - | - | - | -"
    cpu = cost.get("cpu_us") or {}
    others = " · ".join(f"{k.replace('_', '-')} {_int(v)}" for k, v in cpu.items() if k != main_cpu)
    return (
        f"{_f(cost.get('js_ops'), 1)} ({_f(cost.get('js_api_requests'), 1)} + "
        f"{_f(cost.get('js_stored'), 1)}) | {_f(cost.get('client_msgs'), 1)} | "
        f"{_int(cost.get('js_bytes_kept'))} | "
        f"{_int(cpu.get(main_cpu))} | {others or '-'}"
    )


def workflow_ratios(r: dict[str, Any]) -> list[str]:
    """reach-mesh against the taskiq peer, same run: throughput, sequential p99, JS ops."""
    peer = _get(r, "peers", "taskiq")
    if not isinstance(peer, dict) or not peer.get("available"):
        return []
    out = []
    for kind, name in WF_KINDS:
        ours, theirs = r.get(kind), peer.get(kind)
        if not isinstance(ours, dict) or not isinstance(theirs, dict):
            continue
        tp = _get(ours, "sustained", "per_s"), _get(theirs, "sustained", "per_s")
        p99 = ours.get("p99_ms"), theirs.get("p99_ms")
        ops = _get(ours, "cost", "js_ops"), _get(theirs, "cost", "js_ops")
        msgs = _get(ours, "cost", "client_msgs"), _get(theirs, "cost", "client_msgs")
        out.append(
            f"{name}: **{_x(ratio(*tp))} the peer's throughput**, p99 {_x(ratio(*p99))} "
            f"the peer's, JetStream ops {_x(ratio(*ops))} and client → server messages "
            f"{_x(ratio(*msgs))} the peer's"
        )
    return out


def bare_ratio(r: dict[str, Any]) -> str:
    """reach-mesh's fanout(3) and chain(3) against their bare exchanges
    (``bench/workflow_floor.py``)."""
    bare = r.get("bare")
    if not isinstance(bare, dict) or not bare.get("available"):
        return ""
    parts = []
    for kind, name in WF_KINDS:
        ours, theirs = r.get(kind), bare.get(kind)
        if not isinstance(ours, dict) or not isinstance(theirs, dict):
            continue
        tp = ratio(_get(ours, "sustained", "per_s"), _get(theirs, "sustained", "per_s"))
        p50 = ratio(ours.get("p50_ms"), theirs.get("p50_ms"))
        low = (_get(ours, "open_loop", "100", "p50_ms"), _get(theirs, "open_loop", "100", "p50_ms"))
        parts.append(
            f"{name} sustains {_x(tp)} their rate; sequential p50 {_x(p50)} theirs "
            f"({_f(theirs.get('p50_ms'))} ms), at 100/s p50 {_x(ratio(*low))} theirs "
            f"({_f(low[1])} ms)"
        )
    if not parts:
        return ""
    return (
        "**Against its bare exchanges, same run** (each workflow's NATS messages between the "
        "same processes with no engine in between, `bench/workflow_floor.py`): "
        + "; ".join(parts)
        + "."
    )


def ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return None
    return float(a) / float(b)


def _pt(pt: Any, rate: bool) -> str:
    """p50 / p99 of one open-loop point (and its offered rate), with errors or stragglers and
    the CPU one workflow took there (all processes)."""
    if not isinstance(pt, dict):
        return "-"
    head = f"{_f(pt.get('offered_rps'), 0)}/s: " if rate else ""
    bad = sum((pt.get("errors") or {}).values()) + int(pt.get("unfinished") or 0)
    warn = f" ⚠ {bad} failed or unfinished" if bad else ""
    cpu = f" · {_int(pt['cpu_us'])} µs CPU" if isinstance(pt.get("cpu_us"), int | float) else ""
    return f"{head}{_f(pt.get('p50_ms'))} / {_f(pt.get('p99_ms'))}{cpu}{warn}"


def _open_loop_table(r: dict[str, Any]) -> str:
    rows = []
    systems = [("", r), ("peer: taskiq ", _get(r, "peers", "taskiq") or {})]
    for prefix, data in systems:
        for kind, name in WF_KINDS:
            pts = _get(data, kind, "open_loop")
            if isinstance(pts, dict):
                rows.append(
                    f"| {prefix}{name} | {_pt(pts.get('100'), False)} "
                    f"| {_pt(pts.get('half_sustained'), True)} |"
                )
    for kind, name in WF_KINDS:
        bare = _get(r, "bare", kind, "open_loop")
        if isinstance(bare, dict):
            rows.append(
                f"| bare exchanges of a {name}, at the engine's {name} rates "
                f"| {_pt(bare.get('100'), False)} | {_pt(bare.get('engine_half'), True)} |"
            )
    if not rows:
        return ""
    return (
        "\nLatency at a fixed offered load, p50 / p99 ms, and where measured the CPU one "
        "workflow took there, all processes summed (open loop: each workflow is timed "
        "from its due time, so a stall counts against every workflow due meanwhile):\n\n"
        "| workflow | at 100 workflows/s | at half the rate it sustained |\n|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )


def _stream_table(r: dict[str, Any]) -> str:
    cols: list[tuple[str, dict[str, Any]]] = []
    for kind, name in WF_KINDS:
        cost = _get(r, kind, "cost")
        if isinstance(cost, dict):
            cols.append((f"{name}", cost))
    for kind, name in WF_KINDS:
        cost = _get(r, "peers", "taskiq", kind, "cost")
        if isinstance(cost, dict):
            cols.append((f"taskiq {name}", cost))
    streams = sorted({s for _, c in cols for s in c.get("js_stored_by_stream", {})})
    if not streams:
        return ""
    out = (
        "\nMessages stored / bytes kept per workflow, by stream (`STREAM.INFO`: `last_seq` and "
        "`bytes` deltas):\n\n| stream | " + " | ".join(n for n, _ in cols) + " |\n"
    )
    out += "|---" * (len(cols) + 1) + "|\n"
    for stream in streams:
        cells = []
        for _, c in cols:
            stored = c.get("js_stored_by_stream", {}).get(stream)
            kept = c.get("js_bytes_by_stream", {}).get(stream)
            cells.append("-" if stored is None else f"{_f(stored, 1)} / {_int(kept)}")
        out += f"| `{stream}` | " + " | ".join(cells) + " |\n"
    return out


def _rows(data: dict[str, Any], label: str, main_cpu: str) -> list[str]:
    """One table row per workflow kind in ``data``: latency, throughput, cost. ``label``
    formats the kind's name ("{}" alone: the name as is)."""
    rows = []
    for kind, name in WF_KINDS:
        b = data.get(kind)
        if isinstance(b, dict):
            rows.append(
                f"| {(label or '{}').format(name)} | {_f(b.get('p50_ms'))} / "
                f"{_f(b.get('p99_ms'))} | {_f(_get(b, 'sustained', 'per_s'), 0)} | "
                f"{_cost_cells(b.get('cost'), main_cpu)} |"
            )
    return rows


def workflow_section(res: dict[str, Any]) -> str:
    wf = res.get("workflows", {})
    if not wf.get("available"):
        return f"**Not available** in this run: {wf.get('reason')}\n"
    import json

    r = wf.get("result") or {}
    retention = r.get("retention_s")
    kept_for = f"{retention / 3600:g} h" if isinstance(retention, int | float) else "its age"
    out = (
        "Measured by `bench/workflow_bench.py` (setup: "
        f"{r.get('setup', '?')}). Latency is sequential (one workflow at a time), throughput "
        "with 64 in flight. The cost columns are per completed workflow over the throughput "
        "phase, from the server's own statistics: JetStream operations = `$JS.API` requests "
        "(account info `api.total`) + messages stored into streams (`last_seq` deltas; "
        "direct gets, pull requests and acks are not in either count); client → server "
        "messages = what every client connection sent the server (`/connz` `in_msgs`: "
        "publishes, KV writes, direct-get and pull requests, acks — reads included); bytes "
        "kept = the "
        f"streams' `bytes` delta, kept for `workflow_retention` ({kept_for}); CPU from "
        "`/proc/<pid>/stat`.\n\n"
    )
    ratios = workflow_ratios(r)
    if ratios:
        out += "**Against the peer, same run:** " + "; ".join(ratios) + ".\n\n"
    bare_line = bare_ratio(r)
    if bare_line:
        out += bare_line + "\n\n"
    rows = _rows(r, "", "hub")
    peer = _get(r, "peers", "taskiq")
    if isinstance(peer, dict) and peer.get("available"):
        rows += _rows(peer, "peer: taskiq {}", "worker")
    bare = r.get("bare")
    if isinstance(bare, dict) and bare.get("available"):
        rows += _rows(bare, "bare exchanges of a {}, no engine", "hub")
    floor = r.get("floor")
    if isinstance(floor, dict):
        pub = floor.get("js_publish_ack", {})
        rows.append(
            f"| floor: JetStream publish with ack | {_f(pub.get('p50_ms'))} / "
            f"{_f(pub.get('p99_ms'))} | {_f(pub.get('per_s'), 0)} | - | - | - | - | - |"
        )
        for k, v in floor.items():
            if k != "js_publish_ack" and isinstance(v, dict) and "per_s" in v:
                rows.append(f"| floor: {k} | - | {_f(v['per_s'], 0)} | - | - | - | - | - |")
    if rows:
        out += (
            "| workflow | p50 / p99 ms | per s | JetStream ops / wf (API + stored) "
            "| client → server msgs / wf | bytes kept / wf | hub (peer: worker) CPU µs / wf "
            "| other CPU µs / wf |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
        )
    out += _open_loop_table(r)
    out += _stream_table(r)
    if isinstance(peer, dict):
        if peer.get("available"):
            out += f"\n*Peer:* {peer.get('setup')}.\n"
        else:
            out += f"\n*Peer taskiq* not measured: {peer.get('reason')}\n"
    if r.get("ratios"):
        out += "\nRatios: " + ", ".join(f"{k} = {v}" for k, v in r["ratios"].items()) + "\n"
    if not rows:
        out += "```json\n" + json.dumps(r, indent=2, default=str)[:6000] + "\n```\n"
    return out
