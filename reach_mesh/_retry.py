"""Retrying operations on NATS/JetStream through infrastructure errors.

A NATS node dying, a raft election, a reconnect — for a few seconds JetStream answers
``NoStreamResponseError``, 503 or nothing at all. :func:`transient` tells such errors from
answers (a wrong revision, a missing key, a refused request), and :func:`retrying` repeats an
operation through them with backoff until a deadline. Only repeat operations whose repeat is
harmless (a publish with a ``Nats-Msg-Id``, a read, a compare-and-set that is read back).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import nats.errors
import nats.js.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

__all__ = ["RetriesExhausted", "describe", "no_message", "retrying", "storage_full", "transient"]

log = logging.getLogger("reach_mesh.retry")

T = TypeVar("T")

_FIRST_DELAY: Final = 0.05
_MAX_DELAY: Final = 2.0
#: JetStream API error codes that mean "the cluster cannot answer right now".
_UNAVAILABLE_CODES: Final = frozenset({408, 429, 500, 503})
#: JetStream error codes (``err_code``) that mean "not yet": 10158, "duplicate message id is
#: in process" — a publish with the same ``Nats-Msg-Id`` is still being stored (its leader
#: froze or changed while proposing it); asked again, it is stored or answered as a duplicate.
_NOT_YET_ERR_CODES: Final = frozenset({10158})
#: What JetStream answers a create it cannot place: 10005, "no suitable peers for placement".
#: With the reason "peer offline" (too few of the servers that would hold it are up, or heard
#: from since the meta leader was elected), an outage: a meta leader whose peers went away
#: answers so until they are back (ci180). Its other reasons (too few servers at all, tags
#: that no server has) are the cluster's shape, and no wait mends them.
_NO_PEERS_ERR_CODE: Final = 10005
#: JetStream error codes that come with a 500 but are the cluster's shape, not an outage:
#: 10074, "replicas > 1 not supported in non-clustered mode" (``kv_replicas`` above 1 against
#: one nats-server). Asked again, it says the same.
SHAPE_ERR_CODES: Final = frozenset({10074})
#: What a "not found" of a message read says when the stream has no such message: 10037 ("no
#: message found"), or nothing (nats-py's own 404 of a direct get). A stream that is not there
#: (10059: being recovered, or gone) answers 404 too, and knows nothing.
_NO_MESSAGE_ERR_CODES: Final = frozenset({None, 10037})
#: What JetStream answers a write it has no room for: 10023 ("insufficient resources": a store
#: past the server's storage, ``max_file_store``); 10002 ("resource limits exceeded for
#: account": past the account's own ``jetstream`` limits); 10047 / 10028 ("insufficient
#: storage / memory resources available": a stream whose ``max_bytes`` cannot be reserved).
_FULL_ERR_CODES: Final = frozenset({10002, 10023, 10028, 10047})

_TRANSIENT: Final = (
    nats.errors.TimeoutError,  # also FlushTimeoutError, nats.js FetchTimeoutError
    asyncio.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.ServerError,
    ConnectionError,
)


class RetriesExhausted(Exception):
    """An infrastructure error outlived the deadline of the operation; ``__cause__`` is it."""


def transient(err: BaseException) -> bool:
    """True for errors of the infrastructure (retry), False for answers (act on them)."""
    if isinstance(err, KeyWrongLastSequenceError | KeyNotFoundError):
        return False
    if getattr(err, "err_code", None) in SHAPE_ERR_CODES:
        return False
    if isinstance(err, _TRANSIENT):
        return True
    # ``getattr``: nats-py's Key* errors do not set the API error's fields.
    return isinstance(err, nats.js.errors.APIError) and (
        getattr(err, "code", None) in _UNAVAILABLE_CODES
        or getattr(err, "err_code", None) in _NOT_YET_ERR_CODES
        or storage_full(err)  # (an account's limit is a 400: room comes back, as for a 503)
        or _peers_offline(err)
    )


def _peers_offline(err: BaseException) -> bool:
    """Whether JetStream refused to place a stream or consumer because too few of its peers are
    up (:data:`_NO_PEERS_ERR_CODE`): they come back, or a meta leader is elected that hears
    from them."""
    return (
        isinstance(err, nats.js.errors.APIError)
        and getattr(err, "err_code", None) == _NO_PEERS_ERR_CODE
        and "offline" in (getattr(err, "description", None) or "")
    )


def storage_full(err: BaseException) -> bool:
    """Whether JetStream refused a write for want of room (its storage is full). Transient for
    the engine, which waits for room rather than turn a full disk into an outcome; a caller is
    told at once (``Client.submit_*``): room comes back when an operator makes it."""
    return (
        isinstance(err, nats.js.errors.APIError)
        and getattr(err, "err_code", None) in _FULL_ERR_CODES
    )


def describe(err: BaseException) -> str:
    """``err`` for a log line or an error message: a JetStream API error with the server's own
    words and code (nats-py's repr of one is empty: ``ServiceUnavailableError()``), and what a
    full store means; anything else its repr."""
    description = getattr(err, "description", None)
    if not isinstance(err, nats.js.errors.APIError) or not description:
        return repr(err)
    code = getattr(err, "err_code", None)
    said = f"{type(err).__name__}: {description}" + (f" (err_code {code})" if code else "")
    return f"JetStream storage is full: {said}" if storage_full(err) else said


def no_message(err: nats.js.errors.NotFoundError) -> bool:
    """Whether a ``NotFoundError`` of a message read means the stream has no such message (not
    that the stream itself could not be found)."""
    return err.err_code in _NO_MESSAGE_ERR_CODES


async def retrying(
    what: str,
    op: Callable[[], Awaitable[T]],
    deadline: float,
    *,
    on_retry: Callable[[BaseException], None] | None = None,
    jitter: bool = False,
    max_delay: float = _MAX_DELAY,
) -> T:
    """``await op()``, again after each transient error (backoff 50 ms doubling to
    ``max_delay``, 2 s) until ``deadline`` (event-loop time); then :class:`RetriesExhausted`.
    Other errors propagate. ``jitter``: each pause is 50-100 % of its step, so that processes
    that failed together (hubs started at once, during one election) do not ask again all at
    once."""
    failed: Exception
    try:
        return await op()  # mostly answered: nothing below is made for the first try
    except Exception as err:
        if not transient(err):
            raise
        failed = err
    # (Asked only now: on 3.11 each ``get_running_loop`` is a getpid syscall.)
    loop = asyncio.get_running_loop()
    delay = _FIRST_DELAY
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise RetriesExhausted(f"{what}: {describe(failed)}") from failed
        if on_retry is not None:
            on_retry(failed)
        log.info("%s: %s; retrying", what, describe(failed))
        pause = delay * random.uniform(0.5, 1.0) if jitter else delay
        await asyncio.sleep(min(pause, left))
        delay = min(delay * 2, max_delay)
        try:
            return await op()
        except Exception as err:
            if not transient(err):
                raise
            failed = err
