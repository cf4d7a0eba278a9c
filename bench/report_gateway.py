"""The report's HTTP gateway parts: the gateway next to the NATS client (proxy mode) from the same
run, as a table of ratios, its reading and its target (issue 12). ``res`` is a whole run or a
``python -m bench --gateway`` section: both have ``routed`` and ``plan``."""

from __future__ import annotations

from typing import Any

from bench._fmt import _f, _get, _ms, _pct, _x

__all__ = ["gateway_reading", "gateway_results", "gateway_table", "gateway_target"]


def gateway_results(res: dict[str, Any]) -> dict[str, Any]:
    """Where the gateway was measured: the ``--gateway`` section if it holds a run, else the
    whole run (whose routed scenario has the gateway too)."""
    gateway = res.get("gateway")
    if isinstance(gateway, dict) and _get(gateway, "routed", "available"):
        return gateway
    return res


def gateway_table(res: dict[str, Any]) -> str:
    """Latency at each offered load and at peak, peak throughput and hub CPU: the NATS client,
    the gateway and their ratio."""
    systems = _get(res, "routed", "systems") or {}
    proxy, http = systems.get("proxy"), systems.get("http")
    if not (proxy and http):
        return ""
    ratio = http.get("ratio_to_proxy", {})
    out = "| same run | NATS `Client` (proxy) | HTTP gateway | gateway / `Client` |\n"
    out += "|---|---|---|---|\n"
    for rate in res["plan"]["loads_rps"]:
        for q in ("p50", "p99"):
            c = proxy["open_loop"][str(rate)][f"{q}_ms"]
            g = http["open_loop"][str(rate)][f"{q}_ms"]
            x = _get(ratio, str(rate), f"{q}_x")
            out += f"| {q} ms @ {rate:,}/s | {_ms(c)} | {_ms(g)} | {_x(x)} |\n"
    for q in ("p50", "p99"):
        c, g = proxy["peak"][f"{q}_ms"], http["peak"][f"{q}_ms"]
        x = ratio.get(f"peak_{q}_x")
        out += f"| {q} ms at peak ({res['plan']['peak_concurrency']} in flight) "
        out += f"| {_ms(c)} | {_ms(g)} | {_x(x)} |\n"
    c, g = proxy["peak"]["throughput_rps"], http["peak"]["throughput_rps"]
    out += f"| peak req/s | {_ms(c)} | {_ms(g)} | {_pct(ratio.get('peak_fraction'))} |\n"
    c = proxy["peak"]["cpu_us_per_req"]["hub"]
    g = http["peak"]["cpu_us_per_req"]["hub"]
    hub_x = _x(ratio.get("hub_cpu_x"))
    out += f"| hub CPU µs per request at peak | {_ms(c)} | {_ms(g)} | {hub_x} |\n"
    return out


def gateway_target(res: dict[str, Any]) -> tuple[str, str, Any, bool | None, str]:
    """Issue 12's "the gateway must not be the slow path", as (name, source, value, ok, shown):
    at the load the routed targets are set for, the gateway's p50 and p99 within twice the
    NATS client's measured in the same run; the peak fraction is shown beside them."""
    ratio = _get(gateway_results(res), "routed", "systems", "http", "ratio_to_proxy")
    p50, p99 = _get(ratio, "1000", "p50_x"), _get(ratio, "1000", "p99_x")
    measured = p50 is not None and p99 is not None
    return (
        "HTTP gateway not the slow path at 1,000 req/s: p50 and p99 ≤ 2x the NATS client's "
        "(same run)",
        "#12",
        p50 if measured else None,
        measured and p50 <= 2.0 and p99 <= 2.0,
        f"p50 {_x(p50)}, p99 {_x(p99)}; peak {_pct(_get(ratio, 'peak_fraction'))} of the client's"
        if measured
        else "not measured",
    )


def gateway_reading(res: dict[str, Any]) -> str:
    systems = _get(res, "routed", "systems") or {}
    proxy, http = systems.get("proxy"), systems.get("http")
    if not (proxy and http):
        return ""

    def c(s: dict[str, Any], p: str) -> str:
        return _f(s["peak"]["cpu_us_per_req"][p]["median"], 0)

    return (
        "`POST /api/route` is served by uvicorn (httptools) on the hub's own event loop. A "
        "request passes the guard (Host, Origin, content type, bearer token) and goes straight "
        "to its endpoint, which hands the body as it came to the hub that took it "
        "(`Hub.route`: the admission, throttle, decision and flight of a request on "
        "`reach.hub.<ns>.route`, without a NATS round trip to a hub and back): two NATS hops "
        "(hub → agent → hub) against the NATS client's four. The body is validated once, by "
        "the hub's `RouteRequest` decoder, and the hub's answer bytes are the response; "
        "FastAPI documents the route but its per-request dependency solving and body model, "
        "which cost more than routing the request, are not on the path. What the gateway pays "
        "that the NATS client does not is HTTP/1.1: one request per connection at a time, so "
        "nothing is batched — each request is a socket read, two socket writes (uvicorn sends "
        "the head and the body separately) and a task in uvicorn — where the requests a "
        "`Client` makes in one pass of its event loop reach the hub as one message. At peak a "
        f"gateway request costs {c(http, 'hub')} µs of hub CPU against {c(proxy, 'hub')} µs for "
        f"the NATS client's, and {c(http, 'load_generator')} µs in the HTTP caller (a minimal "
        f"keep-alive pool) against {c(proxy, 'load_generator')} µs in the `Client`.\n"
    )
