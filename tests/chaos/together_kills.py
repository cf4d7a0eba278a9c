"""Kill the node a hub's three connections are on, again and again, on a real 3-node cluster,
and report where each connection lands, the moves made, and whether they end together. On a
tree without ``Hub.together`` (main before the change) it reports where each is 0.5 s after
each kill.

    .venv/bin/python -m tests.chaos.together_kills [rounds]
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path

from reach_mesh import MeshSettings
from reach_mesh.hub import Hub
from tests.helpers import cluster_nodes
from tests.test_cluster import _js_ready


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{time.monotonic():.3f} {record.getMessage()}")


async def main(rounds: int) -> int:
    lines = Lines()
    logging.getLogger("reach_mesh.nats").addHandler(lines)
    logging.getLogger("reach_mesh.nats").setLevel(logging.INFO)
    base = Path(tempfile.mkdtemp(prefix="together-"))
    nodes = cluster_nodes(base, name="kills")
    for n in nodes:
        n.start()
    bad = 0
    try:
        urls = [n.url for n in nodes]
        await _js_ready(urls[0])
        s = MeshSettings(nats_url=",".join(urls), namespace="tk", audit_enabled=False)
        async with Hub(settings=s, hub_id="hub-k") as hub:
            conns = hub._connections

            def ports() -> dict[str, int | None]:
                return {
                    k: (c.connected_url.port if c and c.connected_url else None)
                    for k, c in conns.items()
                }

            for r in range(rounds):
                port = ports()["main"]
                (node,) = [n for n in nodes if n.url.endswith(f":{port}")]
                together_ = getattr(hub, "together", None)  # (None: main without the change)
                before = dict(together_.moves) if together_ else {}
                recon = {k: c.stats["reconnects"] for k, c in conns.items()}  # type: ignore[union-attr]
                t0 = time.monotonic()
                node.kill()
                deadline = t0 + (10 if together_ else 0.5)
                while time.monotonic() < deadline:
                    at = set(ports().values())
                    if len(at) == 1 and None not in at and ports()["main"] != port:
                        break
                    await asyncio.sleep(0.005)
                took = time.monotonic() - t0
                await asyncio.sleep(0.5)
                after = dict(together_.moves) if together_ else {}
                recon2 = {k: c.stats["reconnects"] for k, c in conns.items()}  # type: ignore[union-attr]
                together = len(set(ports().values())) == 1
                moved = {k: after[k] - before[k] for k in after}
                if together_ is None:
                    print(
                        f"round {r}: killed :{port}, after 0.5 s: {ports()}, together: {together}"
                    )
                    bad += not together
                    await asyncio.to_thread(node.start)
                    await asyncio.sleep(1.0)
                    continue
                extra = {k: recon2[k] - recon[k] for k in recon}
                ok = together and all(extra[k] == 1 + moved.get(k, 0) for k in extra)
                bad += not ok
                print(
                    f"round {r}: killed :{port}, together after {took:.3f}s: {together}, "
                    f"moves {moved}, reconnections {extra}{'' if ok else '  <-- MISMATCH'}"
                )
                await asyncio.to_thread(node.start)
                await asyncio.sleep(1.0)
            print("rounds apart:", bad)
            if getattr(hub, "together", None) is None:
                return bad
            print("moving lines:", sum("moving to server" in x for x in lines.lines))
            print("moves counted:", hub.together.moves)
            for x in lines.lines:
                if "moving" in x or "is on server" in x:
                    print("  ", x)
    finally:
        for n in nodes:
            n.stop()
    return bad


if __name__ == "__main__":
    sys.exit(asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)))
