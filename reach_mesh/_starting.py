"""A process's JetStream setup at start, retried through an election or a brief outage.

A hub makes its streams, buckets and consumers (or reads them) as it starts. Asked while the
cluster elects a leader, while its server is cut off from the others, or as other hubs create
the same streams, a JetStream request may time out or be answered 503: six chaos runs
(seeds 163, 166, 168, 174-176) lost a hub that way — it exited at start with a bare
``nats: timeout``. Within :func:`starting`, each such step (:func:`set_up`) is repeated with
backoff until ``start_timeout``, saying what it waits for; then it fails naming that step.
What no repeat can mend fails at once: a subject the server refuses this identity
(:class:`~reach_mesh.errors.NotPermittedError`), JetStream not enabled for the account, a
request JetStream refuses (a stream or consumer that exists with other settings, a stream
made by hand in the way of the mesh's own): :class:`~reach_mesh.errors.BadRequestError`. A
create refused for want of peers up to hold it is an outage (:func:`not_made`).

The scope is a context variable, not an argument: the steps are the parts' own ``ensure``
functions, which also run after start (``hub/_resources.py`` creates again what was deleted),
where a failure is logged and tried again later rather than waited on. Tasks created during
the start inherit the scope; it ends for them too when the start is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Final, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from reach_mesh._nats_refusals import refusals_of, unless
from reach_mesh._retry import (
    SHAPE_ERR_CODES,
    RetriesExhausted,
    describe,
    retrying,
    storage_full,
    transient,
)
from reach_mesh.errors import BadRequestError, MeshUnavailableError, NotPermittedError

__all__ = ["Starting", "not_made", "set_up", "starting", "time_to_start"]

log = logging.getLogger("reach_mesh.start")

T = TypeVar("T")

#: JetStream error codes that say JetStream is not enabled (10039: for the account, 10076: on
#: the server) — 503s, which :func:`~reach_mesh._retry.transient` takes for an outage, but
#: which no wait mends.
_NOT_ENABLED: Final = frozenset({10039, 10076})
#: The JetStream API's subjects, as the server names a refused one (lower-cased).
_JS_API: Final = "$js.api."
#: JetStream's answer to a create whose subjects another stream takes ("subjects overlap with
#: an existing stream").
_SUBJECTS_OVERLAP: Final = 10065


class Starting:
    """One start in progress: its deadline (event-loop time) and who starts, for messages;
    :meth:`watch` a connection to fail at once when the server refuses it the JetStream API."""

    def __init__(self, who: str, patience: float, setting: str) -> None:
        self.who, self.patience, self.setting = who, patience, setting
        self.deadline = asyncio.get_running_loop().time() + patience
        #: Set when the start is over (done or failed): tasks it created no longer wait.
        self.over = False
        self._nc: NATS | None = None

    def watch(self, nc: NATS) -> None:
        """The connection the setup's JetStream requests go on."""
        self._nc = nc

    async def attempt(self, op: Callable[[], Awaitable[T]]) -> T:
        """``op()``, or :class:`NotPermittedError` as soon as the server refuses this
        connection a JetStream API subject (a refused publish is only an ``-ERR``: the
        request would time out, and be asked again until the deadline)."""
        refusals = None if self._nc is None else refusals_of(self._nc)
        if refusals is None:
            return await op()
        refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def heard(subject: str) -> None:
            # (Not one that a check on this connection waits for as its answer.)
            mine = subject.startswith(_JS_API) and not refusals.expects(subject)
            if mine and not refused.done():
                refused.set_result(subject)

        refusals.listeners.append(heard)
        try:
            done = await unless(op(), refused)
        finally:
            refusals.listeners.remove(heard)
        if done is None:
            subject = refused.result()
            raise NotPermittedError(
                f"{self.who} cannot start: NATS refused this identity the subject {subject!r} "
                "(permissions violation): its permissions must allow the JetStream API of the "
                "mesh's streams (docs/security.md)",
                subject=subject,
            )
        return done.result()


_STARTING: ContextVar[Starting | None] = ContextVar("reach_mesh_starting", default=None)


@contextlib.contextmanager
def starting(who: str, patience: float, setting: str = "start_timeout") -> Iterator[Starting]:
    """The JetStream setup of ``who`` within this block (:func:`set_up`) is retried through
    transient errors for up to ``patience`` seconds in all (``setting`` names where that is
    set, for the error message)."""
    start = Starting(who, patience, setting)
    token = _STARTING.set(start)
    try:
        yield start
    finally:
        start.over = True
        _STARTING.reset(token)


def _current() -> Starting | None:
    start = _STARTING.get()
    return None if start is None or start.over else start


def time_to_start(default: float) -> float:
    """How long a step of the start in progress may wait for JetStream: what is left of its
    ``start_timeout``, and at least ``default`` (also the answer outside a start)."""
    start = _current()
    if start is None:
        return default
    return max(default, start.deadline - asyncio.get_running_loop().time())


async def set_up(what: str, op: Callable[[], Awaitable[T]]) -> T:
    """``await op()`` — a step of JetStream setup whose repeat is harmless (create a stream
    unless it exists, bind a bucket): within :func:`starting`, again after each transient
    error, with jittered backoff (50 ms doubling to 2 s), until the start's deadline. ``what``
    names it (``stream REACH_WF``) in the WARNING said at its first failure and in the error
    it ends with. Outside a start, once."""
    start = _current()
    if start is None:
        return await op()
    loop = asyncio.get_running_loop()
    began = loop.time()
    tries = 0

    def failed(err: BaseException) -> None:
        nonlocal tries
        tries += 1
        if tries == 1:
            log.warning(
                "%s starting: %s not set up yet: %s; retrying for up to %.0fs more (%s)",
                start.who,
                what,
                _said(err),
                max(0.0, start.deadline - loop.time()),
                start.setting,
            )

    async def attempt() -> T:
        try:
            return await start.attempt(op)
        except nats.errors.Error as err:
            if _not_enabled(err) or not transient(err) or storage_full(err):
                raise _refused(start, what, err) from err
            raise

    try:
        got = await retrying(
            f"{start.who} starting: {what}", attempt, start.deadline, on_retry=failed, jitter=True
        )
    except RetriesExhausted as err:
        cause = err.__cause__ if err.__cause__ is not None else err
        raise MeshUnavailableError(
            f"{start.who} could not set up {what} within {start.patience:g}s "
            f"({start.setting}): {_said(cause)} — is the NATS cluster up, with a JetStream "
            "quorum? (`reach-mesh doctor` says)",
            what=what,
            waited_s=round(loop.time() - began, 1),
        ) from cause
    if tries:
        log.info(
            "%s starting: %s set up after %d retries (%.1fs)",
            start.who,
            what,
            tries,
            loop.time() - began,
        )
    return got


async def not_made(
    js: JetStreamContext, err: nats.js.errors.BadRequestError, subject: str
) -> nats.js.errors.APIError:
    """Why a create was refused (``err``) of what is still not there after it, for
    :func:`set_up` to judge: too few peers up to hold it is an outage, waited out (ci180: a
    meta leader whose peers went away); a stream that takes its subjects (``subject``, one of
    them) is in the way, and named, and the start fails at once."""
    if err.err_code != _SUBJECTS_OVERLAP:
        return err
    try:
        other = await js.find_stream_name_by_subject(subject)
    except nats.errors.Error:
        return err
    return nats.js.errors.BadRequestError(
        code=err.code,
        err_code=err.err_code,
        description=f"stream {other} takes its subjects ({subject})",
    )


def _not_enabled(err: BaseException) -> bool:
    return (
        isinstance(err, nats.js.errors.APIError) and getattr(err, "err_code", None) in _NOT_ENABLED
    )


def _said(err: BaseException) -> str:
    """``err`` for a message: a JetStream request nobody answered, or no JetStream at all
    (nats-py's ServiceUnavailableError without words: "no responders"), said so."""
    if isinstance(err, nats.errors.TimeoutError | asyncio.TimeoutError):
        return "JetStream did not answer in time"
    if isinstance(err, nats.js.errors.ServiceUnavailableError) and not getattr(
        err, "description", None
    ):
        return "no JetStream answered (no responders: not enabled, or not up yet)"
    return describe(err)


def _refused(start: Starting, what: str, err: nats.errors.Error) -> BadRequestError:
    """The error for a step JetStream refused (not retried: asked again, it says the same)."""
    if _not_enabled(err):
        why = "JetStream is not enabled for this account on the NATS servers"
    elif storage_full(err):
        why = "no room in JetStream's storage (raise max_file_store, or make room)"
    elif getattr(err, "err_code", None) in SHAPE_ERR_CODES:
        why = "set kv_replicas to 1 for a single nats-server, or run a cluster"
    elif isinstance(err, nats.js.errors.BadBucketError) or (
        getattr(err, "err_code", None) == _SUBJECTS_OVERLAP
    ):
        why = "a stream made by hand or by another tool is in the way: remove it"
    else:
        why = "a stream or consumer of that name may exist with other settings"
    return BadRequestError(
        f"{start.who} cannot start: JetStream refused to set up {what}: {describe(err)} "
        f"({why}; not retried)",
        what=what,
    )
