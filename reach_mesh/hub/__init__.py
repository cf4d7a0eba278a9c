"""The hub: registry in JetStream KV, routing, workflows, metrics. Run with ``reach-mesh hub``."""

from __future__ import annotations

import typing

if typing.TYPE_CHECKING:
    from reach_mesh.hub._hub import Hub, HubState

__all__ = ["Hub", "HubState"]

if not typing.TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        # Imported on first use: the CLI reads ``reach_mesh.hub.strategies`` (the names
        # ``reach --strategy`` accepts) without paying for the hub's own imports.
        if name in __all__:
            from reach_mesh.hub import _hub

            return getattr(_hub, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
