"""The benchmark report: a quick run leaves the committed report alone, and the report states
the machine's load as measured."""

from __future__ import annotations

import json

from bench import report
from bench.__main__ import DOC, RESULTS, outputs


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
