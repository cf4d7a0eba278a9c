"""The harness notices hubs that did not come up before its faults began."""

from __future__ import annotations

import os
from pathlib import Path

from .harness import Proc, hubs_serving


async def test_hubs_that_exited_or_still_start_are_named(tmp_path: Path) -> None:
    """Six runs went on with two hubs of three, the third exited at start: the run's table now
    names such a hub, with the last line it logged."""

    def hub(name: str, script: str) -> Proc:
        return Proc(name, ["sh", "-c", script], dict(os.environ), tmp_path / f"{name}.log")

    hubs = [
        hub("hub0", "echo 'hub hub-1 serving on nats://127.0.0.1:4222'; sleep 30"),
        hub("hub1", "echo 'error: nats: timeout (TimeoutError; --debug shows where)'; exit 1"),
        hub("hub2", "sleep 30"),
    ]
    for proc in hubs:
        proc.start()
    try:
        not_up = await hubs_serving(hubs, 1.0)
    finally:
        for proc in hubs:
            proc.stop()
    assert not_up == {
        "hub1": "exited at start: error: nats: timeout (TimeoutError; --debug shows where)",
        "hub2": "not serving after 1s: (nothing)",
    }
