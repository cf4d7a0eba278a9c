"""The hub: registry in JetStream KV, routing, workflows, metrics. Run with ``reach-mesh hub``."""

from __future__ import annotations

from reach_mesh.hub._hub import Hub, HubState

__all__ = ["Hub", "HubState"]
