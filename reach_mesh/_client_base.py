"""What the client's mixins (:mod:`reach_mesh._client_workflows`,
:mod:`reach_mesh._client_fleet`) share of :class:`~reach_mesh.client.Client`: its connection,
its namespace and its requests to hubs."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NATS

from reach_mesh import protocol
from reach_mesh._nats_asking import Reconnects
from reach_mesh.tracing import inject

__all__ = ["HubAsks"]


class HubAsks:
    """A base of ``Client``'s mixins; ``Client`` sets ``namespace`` and has the rest."""

    namespace: str
    #: The connection's reconnections (its own, or a watch's on a connection of the caller's
    #: made elsewhere); None before ``connect``.
    _reconnects: Reconnects | None

    if TYPE_CHECKING:

        @property
        def nc(self) -> NATS: ...

        #: ``Client._call_hub``: a request to a hub, retried until its deadline.
        _call_hub: Callable[..., Awaitable[bytes]]

    async def _query(
        self, verb: str, body: dict[str, Any], ns: str | None = None, *, repeatable: bool = True
    ) -> bytes:
        deadline = time.monotonic() + 10.0
        return await self._call_hub(
            ns or self.namespace,
            verb,
            protocol.dumps(body),
            inject({}),
            deadline,
            5.0,
            repeatable=repeatable,
        )
