"""JetStream KV's names and reads at a stream's leader, for any JetStream client.

A KV bucket is a stream (``KV_<bucket>``) storing each key on ``$KV.<bucket>.<key>``; a
delete or purge leaves a marker (its ``KV-Operation`` header) that reads as absent. The reads
here go to the stream's leader (``STREAM.MSG.GET``, ``STREAM.INFO``), not a replica that may
lag behind a write: what a compare-and-set is decided by.
"""

from __future__ import annotations

import json
from typing import Final

from nats.js import JetStreamContext
from nats.js.api import ClusterInfo
from nats.js.errors import NotFoundError

from reach_mesh._retry import no_message
from reach_mesh.errors import MeshUnavailableError

__all__ = [
    "entry_at_leader",
    "entry_at_quorate_leader",
    "kv_marker",
    "kv_stream",
    "kv_subject",
    "kv_unregistered",
    "kv_unregistered_marker",
    "not_caught_up",
]

#: What a KV delete or purge leaves behind (the key reads as absent).
_KV_OPERATION: Final = "KV-Operation"


def kv_subject(bucket: str, key: str) -> str:
    """The subject a KV bucket stores ``key`` under."""
    return f"$KV.{bucket}.{key}"


def kv_stream(bucket: str) -> str:
    """The stream a KV bucket is."""
    return f"KV_{bucket}"


def kv_unregistered_marker(
    bucket: str, key: str, session: str
) -> tuple[str, bytes, dict[str, str]]:
    """The subject, body and headers of a delete marker of ``key`` that names the registration
    ``session`` it ends (``{"unregistered": session}``; a KV reader takes it as any delete)."""
    body = json.dumps({"unregistered": session}, separators=(",", ":")).encode()
    return kv_subject(bucket, key), body, {_KV_OPERATION: "DEL"}


def kv_unregistered(body: bytes) -> str | None:
    """The session a delete marker's ``body`` says it ended (:func:`kv_unregistered_marker`),
    or None."""
    try:
        said = json.loads(body) if body else None
    except ValueError:
        return None
    session = said.get("unregistered") if isinstance(said, dict) else None
    return session if isinstance(session, str) else None


def kv_marker(headers: dict[str, str] | None) -> bool:
    """Whether a KV message with ``headers`` is a delete or purge marker (the key reads as
    absent)."""
    return (headers or {}).get(_KV_OPERATION) in ("DEL", "PURGE")


async def entry_at_leader(
    js: JetStreamContext, bucket: str, key: str
) -> tuple[bytes, int, bool] | None:
    """``JsClient.kv_entry_at_leader`` (``reach_mesh._jspub``), on any JetStream context:
    ``STREAM.MSG.GET`` of the last message on ``key``'s subject, which only the stream's
    leader answers."""
    try:
        raw = await js.get_last_msg(kv_stream(bucket), kv_subject(bucket, key))
    except NotFoundError as err:
        if not no_message(err):
            raise
        return None
    marker = kv_marker(raw.headers)
    if not raw.data and not marker:
        return None
    return raw.data or b"", int(raw.seq or 0), marker


async def entry_at_quorate_leader(
    js: JetStreamContext, bucket: str, key: str, *, heard_within: float
) -> tuple[bytes, int, bool] | None:
    """What :func:`entry_at_leader` reads, once the stream's leader (its ``STREAM.INFO``) says
    it heard from a quorum of its replicas within ``heard_within`` s — not one cut off from
    them, which keeps leading, and answering, for some ten seconds while the others may elect
    another and write past it. A replica behind is no matter: the leader answers. Raises
    ``MeshUnavailableError`` (or what JetStream raised) otherwise."""
    stream = kv_stream(bucket)
    info = await js.stream_info(stream)
    cluster = info.cluster
    unheard = _not_quorate(cluster, heard_within) if cluster is not None else None
    if unheard is not None:
        raise MeshUnavailableError(f"{stream}: {unheard}")
    return await entry_at_leader(js, bucket, key)


def _not_quorate(cluster: ClusterInfo, heard_within: float) -> str | None:
    """Why the leader of ``cluster`` (its ``STREAM.INFO``) may not be the stream's leader for
    the others — none, or one that did not hear from a quorum of its replicas within
    ``heard_within`` s — or None."""
    if not cluster.leader:
        return "no leader"
    peers = cluster.replicas or []
    heard = [
        p
        for p in peers
        if p.current and not p.offline and p.active is not None and p.active / 1e9 <= heard_within
    ]
    if len(heard) < (len(peers) + 1) // 2:  # with the leader, a majority of the replicas
        return f"its leader {cluster.leader} did not hear from a quorum within {heard_within:g} s"
    return None


def not_caught_up(cluster: ClusterInfo, heard_within: float) -> str | None:
    """Why a direct get on the stream of ``cluster`` (its leader's ``STREAM.INFO``) may be
    answered by a replica behind its leader, or None (see ``JsClient.replicas_caught_up``).
    An offline replica answers nothing (a node down for good must not stop every read)."""
    unheard = _not_quorate(cluster, heard_within)
    if unheard is not None:
        return unheard
    peers = cluster.replicas or []
    # ("Current": its log holds every entry the leader applied; new ones may be in flight.)
    behind = [str(p.name) for p in peers if not p.offline and not p.current]
    if behind:
        return f"replica(s) {', '.join(behind)} behind its leader {cluster.leader}"
    return None
