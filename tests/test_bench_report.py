"""The benchmark report: a quick run leaves the committed report alone, the report states the
machine's load as measured, and the workflow costs are counted from the server's statistics."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from bench import report, routed
from bench.__main__ import DOC, RESULTS, outputs
from bench._jsstats import free_port
from bench._system import PROC_COUNTS
from bench.report_gateway import gateway_table
from bench.report_workflows import workflow_section
from bench.workflow_bench import measure_cost
from reach_mesh import Client, MeshSettings, Step, protocol
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats

from .helpers import Fleet, echo_agent


def test_a_quick_run_writes_elsewhere() -> None:
    quick_json, quick_doc = outputs(True)
    assert quick_json != RESULTS / "latest.json" and quick_doc != DOC
    assert quick_json.parent == RESULTS and quick_doc.parent == RESULTS
    assert outputs(False) == (RESULTS / "latest.json", DOC)


def test_the_load_is_stated_as_measured() -> None:
    busy = {"cores": 2, "load_avg_at_start": [3.5, 2.0, 1.0], "load_avg_at_end": [4.1, 2.5, 1.2]}
    text = report.machine_load(busy)
    assert "[3.5, 2.0, 1.0] at start, [4.1, 2.5, 1.2] at end" in text
    assert "competed for the CPU" in text
    idle = {"cores": 2, "load_avg_at_start": [0.3, 0.5, 0.7]}
    text = report.machine_load(idle)
    assert "[0.3, 0.5, 0.7] at start." in text and "competed" not in text


def test_the_committed_report_matches_its_results() -> None:
    results = json.loads((RESULTS / "latest.json").read_text())
    page = report.render(results)
    assert "engineers" not in page
    assert page == DOC.read_text()  # regenerated from latest.json, not edited by hand


async def test_the_cost_of_a_workflow_is_counted_by_the_server(wf_settings: MeshSettings) -> None:
    """A few real fanout(3)s, counted by bench/_jsstats.py from the server's statistics (a
    server of its own, with the monitoring endpoint the bench reads /connz from)."""
    port = free_port()
    async with EmbeddedNats(http_port=port) as server:
        settings = wf_settings.model_copy(update={"nats_url": server.url})
        fleet = Fleet(settings)
        steps = [Step(capability="bench:echo:v1", payload={"i": i}) for i in range(3)]
        try:
            async with Hub(settings=settings), Client(settings=settings) as mesh:
                for i in range(3):
                    await echo_agent(fleet, f"bench.e{i}", "bench:echo:v1").start()

                async def phase() -> dict[str, Any]:
                    for _ in range(5):
                        assert (await mesh.fanout(steps, timeout=20)).ok
                    return {"completed": 5}

                out, cost = await measure_cost(
                    server.url, {"this_process": os.getpid()}, phase, f"http://127.0.0.1:{port}"
                )
        finally:
            await fleet.close()
    assert out == {"completed": 5} and cost["units"] == 5
    # Every operation is a message from a client; reads make it more than the stored ones.
    assert cost["client_msgs"] > cost["js_stored"]
    by_stream = cost["js_stored_by_stream"]
    assert by_stream[protocol.STREAM_WF] == 1.0  # one submission per workflow
    assert by_stream[protocol.STREAM_WORK] == 3.0  # one step message per branch
    assert by_stream[f"KV_{protocol.KV_WORKFLOWS}"] >= 1.0
    assert cost["js_ops"] == pytest.approx(cost["js_api_requests"] + cost["js_stored"])
    assert cost["js_stored"] == pytest.approx(sum(by_stream.values()), abs=0.05)
    assert cost["js_bytes_kept"] > 1000  # records and events stay for workflow_retention
    assert cost["cpu_us"]["this_process"] > 0
    # What else the process did per workflow: it waited for every answer (a voluntary context
    # switch each time the loop slept), and the counters kept are the ones the bench names.
    counted = cost["proc_counts"]["this_process"]
    assert set(counted) == set(PROC_COUNTS)
    assert counted["ctxsw_vol"] >= 1 and counted["rchar"] >= 0
    # The report shows them next to the workflow row, and the peer's ratios first.
    result = {
        "fanout3": {
            "p50_ms": 3.0,
            "p99_ms": 5.0,
            "sustained": {"per_s": 600.0},
            "cost": cost,
            "open_loop": {
                "100": {"offered_rps": 100.0, "p50_ms": 2.5, "p99_ms": 4.0, "errors": {}},
                "half_sustained": {
                    "offered_rps": 300.0,
                    "p50_ms": 3.5,
                    "p99_ms": 9.0,
                    "errors": {"TimeoutError": 2},
                    "unfinished": 1,
                },
            },
        },
        "peers": {
            "taskiq": {
                "available": True,
                "setup": "taskiq",
                "fanout3": {
                    "p50_ms": 4.0,
                    "p99_ms": 10.0,
                    "sustained": {"per_s": 300.0},
                    "cost": {**cost, "cpu_us": {"worker": 10.0}},
                },
            }
        },
    }
    page = workflow_section({"workflows": {"available": True, "result": result}})
    assert page.index("**Against the peer") < page.index("| workflow |")
    assert "fanout(3): **2.00x the peer's throughput**, p99 0.50x" in page
    assert "client → server messages 1.00x the peer's" in page
    row = next(line for line in page.splitlines() if line.startswith("| fanout(3) |"))
    assert f"| {cost['js_ops']:.1f} (" in row and "| peer: taskiq fanout(3) |" in page
    assert f"`{protocol.STREAM_WF}` | 1.0 / " in page
    assert "| fanout(3) | 2.50 / 4.00 | 300/s: 3.50 / 9.00 ⚠ 3 failed or unfinished |" in page


async def test_the_taskiq_peer_runs_on_the_same_server(nats_url: str) -> None:
    """The smallest real run of the peer: a worker process, a few workflows of each kind."""
    pytest.importorskip("taskiq_nats", reason="the bench extra: pip install -e '.[bench]'")
    from bench.peer_taskiq import run_taskiq_peer

    out = await run_taskiq_peer(nats_url, True, n_seq=3, duration=0.5)
    assert out["available"], out
    for kind in ("fanout3", "chain3"):
        assert out[kind]["n"] == 3 and out[kind]["sustained"]["completed"] > 0
        assert out[kind]["sustained"]["errors"] == 0
        cost = out[kind]["cost"]
        assert cost["js_stored_by_stream"]["BENCH_TASKIQ"] == 3.0  # one message per task
        assert cost["cpu_us"]["worker"] > 0
        assert out[kind]["open_loop"]["100"]["ok"] > 0
        assert "cpu_us" in out[kind]["open_loop"]["100"]  # measured as the engine's are


def _system(p50: float, p99: float, peak: float, hub_us: float) -> dict[str, Any]:
    def spread(x: float) -> dict[str, float]:
        return {"median": x, "min": x, "max": x}

    point = {"p50_ms": spread(p50), "p99_ms": spread(p99), "errors": 0}
    return {
        "open_loop": {"1000": point},
        "peak": {
            "throughput_rps": spread(peak),
            "p50_ms": spread(p50 * 10),
            "p99_ms": spread(p99 * 10),
            "cpu_us_per_req": {
                p: spread(hub_us) for p in ("hub", "responders", "nats_server", "load_generator")
            },
        },
    }


def test_the_gateway_is_reported_next_to_the_nats_client_as_ratios() -> None:
    plan = routed.Plan(quick=True)
    plan.loads = (1000,)  # type: ignore[assignment]  # Plan infers a 3-tuple of loads
    systems = {"proxy": _system(1.0, 2.0, 10_000, 30), "http": _system(1.5, 5.0, 6_000, 45)}
    for sys_out in systems.values():
        sys_out["ratio_to_proxy"] = routed._ratios(sys_out, systems["proxy"], plan)
    gateway = {"plan": plan.as_dict(), "routed": {"available": True, "systems": systems}}
    table = gateway_table(gateway)
    assert "| p50 ms @ 1,000/s | 1.00 | 1.50 | 1.50x |" in table
    assert "| p99 ms @ 1,000/s | 2.00 | 5.00 | 2.50x |" in table
    assert "| peak req/s | 10,000 | 6,000 | 60 % |" in table
    assert "| hub CPU µs per request at peak | 30.00 | 45.00 | 1.50x |" in table
    target = next(t for t in report.targets({"gateway": gateway}) if t["source"] == "#12")
    assert target["status"] == "MISSED" and "p99 2.50x; peak 60 %" in target["value"]


async def test_the_bare_exchanges_run_and_are_reported_next_to_the_engine() -> None:
    """bench/workflow_floor.py on a server of its own: a fanout(3)'s and a chain(3)'s exchanges
    with no engine store what the engine's do (10 and 12 messages), counted by the server; the
    report puts them beside the engine's rows, as ratios, and beside the #15 targets."""
    from bench.workflow_floor import run_floor

    port = free_port()
    async with EmbeddedNats(http_port=port) as server:
        bare = await run_floor(
            server.url,
            True,
            monitor_url=f"http://127.0.0.1:{port}",
            n_seq=3,
            duration=0.5,
            rates={"fanout3": 40.0},
        )
    stored = {"fanout3": [1.0, 2.0, 3.0, 3.0], "chain3": [1.0, 2.0, 2.0, 3.0, 3.0]}
    for kind, by_stream in stored.items():
        b = bare[kind]
        assert b["n"] == 3 and b["sustained"]["completed"] > 0 and b["sustained"]["errors"] == 0
        cost = b["cost"]
        assert cost["js_stored"] == sum(by_stream) and cost["js_api_requests"] == 0.0
        assert sorted(cost["js_stored_by_stream"].values()) == by_stream
        assert cost["cpu_us"]["hub"] > 0 and cost["cpu_us"]["agents"] > 0
        assert b["open_loop"]["100"]["ok"] > 0 and b["open_loop"]["100"]["cpu_us"] > 0
    # The engine's half rate, where given: the same load as the engine's point.
    half = bare["fanout3"]["open_loop"]["engine_half"]
    assert half["offered_rps"] == 40.0 and half["ok"] > 0 and half["cpu_us"] > 0
    assert "engine_half" not in bare["chain3"]["open_loop"]
    result = {
        "fanout3": {
            "p50_ms": 3.0,
            "p99_ms": 5.0,
            "sustained": {"per_s": 1000.0},
            "open_loop": {
                "100": {"p50_ms": 3.5},
                "half_sustained": {"offered_rps": 500.0, "p50_ms": 20.0, "p99_ms": 80.0},
            },
        },
        "bare": {
            "available": True,
            "fanout3": {
                "p50_ms": 1.5,
                "p99_ms": 3.0,
                "sustained": {"per_s": 4000.0},
                "cost": bare["fanout3"]["cost"],
                "open_loop": {
                    "100": {"p50_ms": 2.5, "p99_ms": 3.0, "cpu_us": 4000},
                    "engine_half": {
                        "offered_rps": 500.0,
                        "p50_ms": 2.6,
                        "p99_ms": 9.0,
                        "cpu_us": 2500,
                    },
                },
            },
        },
    }
    page = workflow_section({"workflows": {"available": True, "result": result}})
    assert "fanout(3) sustains 0.25x their rate; sequential p50 2.00x theirs (1.50 ms)" in page
    assert "at 100/s p50 1.40x theirs (2.50 ms)" in page
    assert "| bare exchanges of a fanout(3), no engine | 1.50 / 3.00 | 4,000 | 9.0 (" in page
    shown = {
        t["name"]: t["value"]
        for t in report.targets({"workflows": {"available": True, "result": result}})
    }
    assert shown["fanout(3) ≥ 2,000 workflows/s sustained"] == "1,000 /s (bare exchanges: 4,000 /s)"
    assert shown["fanout(3) p50 ≤ 2 ms at 100 workflows/s"] == "3.50 ms (bare exchanges: 2.50 ms)"
    half_p99 = shown["fanout(3) p99 ≤ 50 ms at half the rate it sustained"]
    assert half_p99 == "80.00 ms (bare exchanges: 9.00 ms)"
    # The open-loop table: the bare exchanges at the engine's rates, with CPU per workflow.
    assert "| 2.50 / 3.00 · 4,000 µs CPU | 500/s: 2.60 / 9.00 · 2,500 µs CPU |" in page


def test_the_ab_table_alternates_two_commits_and_compares_medians() -> None:
    from bench.ab import median_row, row_of, table

    def run(fan: float, chain: float, hub: float, bare: bool = True) -> dict[str, Any]:
        return {
            "fanout3": {
                "sustained": {"per_s": fan},
                "p50_ms": 4.0,
                "cost": {"cpu_us": {"hub": hub, "agents": 400.0}},
            },
            "chain3": {"sustained": {"per_s": chain}, "cost": {"cpu_us": {"caller": 200.0}}},
            "bare": {"available": bare, "fanout3": {"sustained": {"per_s": 2000.0}}},
        }

    rows = [("a#1", row_of(run(700, 560, 1000))), ("b#1", row_of(run(770, 590, 950)))]
    rows += [("a#2", row_of(run(690, 550, 1050, bare=False))), ("b#2", row_of(run(790, 600, 930)))]
    assert rows[2][1]["bare_fanout_per_s"] is None  # a run without its bare exchanges
    assert median_row([r for n, r in rows if n.startswith("a#")])["fanout_per_s"] == 695.0
    text = table(rows)
    assert "| **median a** | 695 | 555 | 2000 | 4 | 1025 | 400 | - | - | - | 200 |" in text, text
    assert "| **b / a** | 1.122 | 1.072 | 1 | 1 | 0.917 |" in text, text
    # The open-loop points, where a run has them (issue 15's latency goals).
    latency = run(700, 560, 1000)
    latency["fanout3"]["open_loop"] = {
        "100": {"p50_ms": 3.5},
        "half_sustained": {"p50_ms": 9.0, "p99_ms": 60.0},
    }
    got = row_of(latency)
    assert (got["fanout_100_p50_ms"], got["fanout_half_p99_ms"]) == (3.5, 60.0)
    assert got["chain_100_p50_ms"] is None
    # nats-server's CPU and every process's summed (what two shared cores bound), and the load.
    assert (got["nats_us_per_fanout"], got["all_us_per_fanout"]) == (None, 1400.0)
    loaded = run(700, 560, 1000)
    loaded["fanout3"]["cost"]["cpu_us"]["nats_server"] = 250.0
    loaded["load1"] = 3.5
    got = row_of(loaded)
    assert (got["nats_us_per_fanout"], got["all_us_per_fanout"]) == (250.0, 1650.0)
    assert (got["all_us_per_chain"], got["load1"]) == (200.0, 3.5)
    assert row_of({**loaded, "chain3": {"sustained": {"per_s": 1.0}}})["all_us_per_chain"] is None
