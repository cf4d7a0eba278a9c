"""``python -m bench [--quick] [--profile] [--gateway]`` — run every scenario, write the results.

A full run writes ``bench/results/latest.json`` and regenerates ``docs/benchmarks.md`` (both
committed). A quick run is a smoke test: it writes ``bench/results/quick.json`` and
``bench/results/quick.md`` (ignored by git) and leaves the committed report alone.

``--gateway`` runs only the HTTP gateway next to the NATS client and the floor (routed scenario,
systems ``raw``, ``proxy``, ``http``) and stores it as the results' ``gateway`` section, which
the report shows with its own date, command and load; the rest of the results stays as it was.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import peer_taskiq, registry_scale, report, report_gateway, routed
from bench._jsstats import free_port
from bench._system import machine_info
from reach_mesh.server import EmbeddedNats, find_nats_server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
QUICK_JSON = RESULTS / "quick.json"
QUICK_DOC = RESULTS / "quick.md"


def outputs(quick: bool) -> tuple[Path, Path]:
    """Where a run writes its results and its report: a quick run never overwrites the
    committed ``latest.json`` and ``docs/benchmarks.md``."""
    return (QUICK_JSON, QUICK_DOC) if quick else (RESULTS / "latest.json", DOC)


def log(line: str) -> None:
    print(line, flush=True)


async def _scenario(
    name: str, fn: Callable[[], Awaitable[dict[str, Any]]], timeout: float
) -> dict[str, Any]:
    """Run one scenario, bounded in time; a failure is recorded, never fatal to the run."""
    log(f"[{name}]")
    t0 = time.perf_counter()
    try:
        out = await asyncio.wait_for(fn(), timeout)
    except Exception as err:
        log(f"  FAILED: {err!r}")
        return {
            "available": False,
            "reason": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(limit=6),
        }
    out.setdefault("available", True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


async def _workflows(url: str, server_pid: int, monitor: str, quick: bool) -> dict[str, Any]:
    """``bench.workflow_bench.run_workflow_bench`` (hub, agents and caller in their own
    processes), then the taskiq peer on the same server (``bench.peer_taskiq``)."""
    try:
        module = importlib.import_module("bench.workflow_bench")
        fn = module.run_workflow_bench
    except (ImportError, AttributeError) as err:
        return {"available": False, "reason": f"bench/workflow_bench.py not usable: {err!r}"}
    result = await fn(url, quick, split=True, server_pid=server_pid, monitor_url=monitor)
    log("  taskiq peer")
    try:
        peer = await peer_taskiq.run_taskiq_peer(
            url, quick, server_pid=server_pid, monitor_url=monitor
        )
    except Exception as err:
        log(f"  taskiq peer FAILED: {err!r}")
        peer = {"available": False, "reason": f"{type(err).__name__}: {err}"}
    result["peers"] = {"taskiq": peer}
    return {"available": True, "result": result}


def _tracing_micro(quick: bool) -> dict[str, Any]:
    """bench/tracing_overhead.py (its own process: it installs a global tracer provider)."""
    number = "2000" if quick else "20000"
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tracing_overhead.py"), "--number", number],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    if out.returncode != 0:
        return {"available": False, "reason": out.stderr[-2000:]}
    data: dict[str, Any] = json.loads(out.stdout)
    return data


async def run(args: argparse.Namespace) -> dict[str, Any]:
    quick: bool = args.quick
    plan = routed.Plan(quick)
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "command": "make bench"
        + (" QUICK=1" if quick else "")
        + (" PROFILE=1" if args.profile else ""),
        "machine": machine_info(find_nats_server()),
        "plan": plan.as_dict(),
    }
    log(f"reach-mesh bench ({results['mode']}) on {results['machine']['cpu_model']}")
    # The monitoring endpoint (127.0.0.1 only) lets the workflow scenario read /connz.
    async with EmbeddedNats(http_port=free_port()) as server:
        assert server.proc is not None and server.http_port is not None
        url, spid = server.url, server.proc.pid
        monitor = f"http://127.0.0.1:{server.http_port}"
        results["routed"] = await _scenario(
            "routed request-reply and peers",
            lambda: routed.run_routed(url, spid, plan, log),
            900,
        )
        results["tracing"] = await _scenario(
            "tracing overhead", lambda: routed.run_tracing(url, spid, plan, log), 600
        )
        if args.profile:
            results["profile"] = await _scenario(
                "hub profile", lambda: routed.run_profile(url, plan, RESULTS, log), 300
            )
        results["workflows"] = await _scenario(
            "workflows", lambda: _workflows(url, spid, monitor, quick), 150 if quick else 600
        )
        results["registry_scale"] = await _scenario(
            "registry scale",
            lambda: registry_scale.run_registry_scale(url, spid, quick, log),
            900,
        )
    results["selector"] = await _scenario(
        "selector evaluation",
        lambda: asyncio.to_thread(registry_scale.run_selector_micro, quick),
        300,
    )
    results["tracing_micro"] = await _scenario(
        "tracing micro-benchmark",
        lambda: asyncio.to_thread(_tracing_micro, quick),
        300,
    )
    results["total_seconds"] = round(time.perf_counter() - t_start, 1)
    results["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


async def run_gateway(args: argparse.Namespace) -> dict[str, Any]:
    """The routed scenario for the HTTP gateway, the NATS client (proxy) and the floor only."""
    quick: bool = args.quick
    plan = routed.Plan(quick)
    t_start = time.perf_counter()
    machine = machine_info(find_nats_server())
    out: dict[str, Any] = {
        "command": "make bench-gateway" + (" QUICK=1" if quick else ""),
        "mode": "quick" if quick else "full",
        "date": machine["date"],
        "load_avg_at_start": machine["load_avg_at_start"],
        "cores": machine["cores"],
        "plan": plan.as_dict(),
    }
    log(f"reach-mesh bench --gateway ({out['mode']}) on {machine['cpu_model']}")
    async with EmbeddedNats() as server:
        assert server.proc is not None
        url, spid = server.url, server.proc.pid
        out["routed"] = await _scenario(
            "HTTP gateway next to the NATS client",
            lambda: routed.run_routed(url, spid, plan, log, routed.GATEWAY_SYSTEMS),
            900,
        )
    out["total_seconds"] = round(time.perf_counter() - t_start, 1)
    out["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def _main_gateway(args: argparse.Namespace, runner: Callable[[Any], Any]) -> int:
    """``--gateway``: measure, then store the ``gateway`` section in the results file (and
    regenerate the report from it, when that file holds a whole run)."""
    gateway: dict[str, Any] = runner(run_gateway(args))
    out_json, out_doc = outputs(args.quick)
    results: dict[str, Any] = {}
    if out_json.exists():
        results = json.loads(out_json.read_text())
    results["gateway"] = gateway
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(report_gateway.gateway_table(gateway))
    written = [out_json]
    if not args.no_doc and "machine" in results:
        out_doc.write_text(report.render(results))
        written.append(out_doc)
    log("wrote " + " and ".join(str(p.relative_to(ROOT)) for p in written))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short run (under a minute)")
    parser.add_argument("--profile", action="store_true", help="profile the hub (pyinstrument)")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument(
        "--gateway",
        action="store_true",
        help="only the HTTP gateway next to the NATS client (the results' gateway section)",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="only regenerate docs/benchmarks.md from bench/results/latest.json",
    )
    args = parser.parse_args(argv)
    if args.render_only:
        DOC.write_text(report.render(json.loads((RESULTS / "latest.json").read_text())))
        log(f"wrote {DOC.relative_to(ROOT)}")
        return 0
    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
        loop_name = "uvloop"
    except ImportError:
        runner = asyncio.run
        loop_name = "asyncio"
    if args.gateway:
        return _main_gateway(args, runner)
    results: dict[str, Any] = runner(run(args))
    results["machine"]["load_generator_loop"] = loop_name
    if args.profile is False:
        previous = RESULTS / "latest.json"
        if previous.exists():
            # Keep the last profile's hot spots on the page when this run did not profile.
            try:
                old = json.loads(previous.read_text())
                if old.get("profile", {}).get("available"):
                    results["profile"] = {
                        **old["profile"],
                        "from_earlier_run": old["machine"]["date"],
                    }
            except (ValueError, KeyError):
                pass
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_json, out_doc = outputs(args.quick)
    out_json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    table = report.summary_table(results)
    print(table)
    if not args.no_doc:
        out_doc.write_text(report.render(results))
    written = [out_json] + ([] if args.no_doc else [out_doc])
    log("wrote " + " and ".join(str(p.relative_to(ROOT)) for p in written))
    if args.quick:
        log("(a quick run: docs/benchmarks.md and bench/results/latest.json are left as they are)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
