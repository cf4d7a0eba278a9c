"""Workflow results from the caller's side: :class:`ResultWaits`, the base of
:class:`~reach_mesh._client_workflows.WorkflowsMixin` that reads workflow records and waits for
a workflow's ``.done`` announcement (re-reading the record where the announcement may have been
missed: a reconnect, a lost message, a wait that ran out)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any, Final

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from reach_mesh import protocol
from reach_mesh._cancels import uncancelled
from reach_mesh._client_base import HubAsks
from reach_mesh._guard import refuse
from reach_mesh._jspub import JsClient, first_done
from reach_mesh._retry import retrying
from reach_mesh.errors import MeshTimeoutError, MeshUnavailableError
from reach_mesh.workflow import WorkflowRecord, WorkflowResult, stored_record

__all__ = ["ResultWaits"]

#: How long a record read after a reconnect rides out JetStream being unavailable (a leader
#: election takes 4-9 s), as a submission does.
_REREAD_FOR: Final = 15.0
#: How often a wait for a result also reads the record (s): ``.done`` is announced once, on
#: core NATS, and one lost on the way (a NATS node dying as it passed) ends the wait then.
_RESULT_RECHECK: Final = 5.0
#: The longest a wait that ran out reads the record for a result it may hold (a read bounded
#: by the caller's timeout otherwise: with NATS unreachable a read takes the JetStream
#: client's 5 s, which a ``workflow(id, timeout=1)`` must not wait).
_LAST_LOOK: Final = 0.5

#: A wait for a workflow's ``.done``: its message, or the stored result a re-check read.
_Done = asyncio.Future[Msg | WorkflowResult]


class ResultWaits(HubAsks):
    """Record reads and ``.done`` waits of ``Client`` (which sets every attribute below)."""

    #: Submissions and record reads (started with the first workflow call).
    _jsc: JsClient | None
    #: ``.done`` waits in progress (``_done_subscription``) → their workflow ids; re-checked
    #: on a reconnect (``_recheck_done_waits``), ended by ``_end_done_waits``.
    _done_waits: dict[_Done, tuple[str, asyncio.Future[Msg]]]
    #: Those re-checks running.
    _rechecks: set[asyncio.Task[None]]
    #: The event loop the client was connected on (``nc`` checks that it is the running one).
    _loop: asyncio.AbstractEventLoop | None

    async def _workflow_record(self, workflow_id: str) -> WorkflowRecord | None:
        """The stored record of a workflow of this namespace; None when there is none (or it
        cannot be read right now)."""
        try:
            return await self._read_record(workflow_id)
        except (nats.errors.Error, TimeoutError):
            return None  # no bucket (no hub ever ran), or JetStream unavailable right now

    async def _read_record(self, workflow_id: str) -> WorkflowRecord | None:
        """:meth:`_workflow_record`, raising when the record cannot be read right now."""
        key = protocol.workflow_key(self.namespace, workflow_id)
        got = await (await self._js_client()).kv_get(protocol.KV_WORKFLOWS, key)
        return stored_record(WorkflowRecord, got)

    async def _js_client(self) -> JsClient:
        if self._jsc is None:
            # nats-py's JetStream default timeout
            jsc = JsClient(self.nc, timeout=5.0, reconnects=self._reconnects)
            await jsc.start()
            if self._jsc is None:
                self._jsc = jsc
            else:  # another call started one meanwhile
                await jsc.stop()
        return self._jsc

    async def _stored_result(
        self, workflow_id: str, *, within: float | None = None
    ) -> WorkflowResult | None:
        """The workflow's result, if its record holds one; None also when the record cannot
        be read (``within`` seconds, if given)."""
        read = self._workflow_record(workflow_id)
        if within is None:
            return _final_result(await read)
        try:
            async with asyncio.timeout(within):
                # (``uncancelled``: the caller's own connection may be nats-py's.)
                return _final_result(await uncancelled(read))
        except TimeoutError:
            return None

    async def _done_subscription(self, workflow_id: str) -> tuple[Subscription, _Done]:
        """A subscription to the workflow's ``.done`` for one message, and the wait it ends.

        nats-py resolves the future a subscription is given (``future=``: no message queue,
        iterator or task per workflow, as ``next_msg`` has) without asking whether it is done
        already: a second resolution raises in its reader, which then stops. So nats-py gets a
        future of its own, which only it resolves; the wait returned follows it, and a re-check
        after a reconnect (``_recheck_done_waits``) or a closing client resolves the wait and
        cancels nats-py's future instead, which nats-py then leaves alone."""
        nc = self.nc  # raises from another event loop than the client's: ``_loop`` is this one
        loop = self._loop or asyncio.get_running_loop()
        inner: asyncio.Future[Msg] = loop.create_future()
        done: _Done = loop.create_future()
        inner.add_done_callback(functools.partial(_follow, done))
        sub = await nc.subscribe(
            protocol.wf_done(self.namespace, workflow_id), future=inner, max_msgs=1
        )
        # nats-py's ``max_msgs`` only stops reading here; ``UNSUB <sid> 1`` (sent with the SUB)
        # has the server drop the interest after that message too, or every workflow waited
        # for would leave one behind for the life of the connection.
        await sub.unsubscribe(limit=1)
        self._done_waits[done] = (workflow_id, inner)
        done.add_done_callback(self._forget_done)
        return sub, done

    def _forget_done(self, done: _Done) -> None:
        wait = self._done_waits.pop(done, None)
        if wait is not None:
            wait[1].cancel()  # a message still to come is dropped by nats-py

    def _drop_done(self, done: _Done) -> None:
        """A ``.done`` wait is over: forget it (cancelled unless it has its message, or the
        error a closing client gave it, which is then taken as seen)."""
        if not done.cancel() and not done.cancelled():
            done.exception()
        self._forget_done(done)

    def _recheck_done_waits(self) -> None:
        """The connection is back (``reconnected_cb``): a ``.done`` published while this client
        was away never arrives, so read the record of every workflow still waited on. The
        subscriptions are in place again before nats-py calls this: a ``.done`` published
        after the read arrives as usual."""
        for done, (workflow_id, _) in list(self._done_waits.items()):
            if not done.done():
                task = asyncio.ensure_future(self._recheck(done, workflow_id))
                self._rechecks.add(task)
                task.add_done_callback(self._rechecks.discard)

    async def _recheck(self, done: _Done, workflow_id: str) -> None:
        """Resolve ``done`` with the stored result if the workflow is final. JetStream may be
        electing a leader right after a reconnect: the read is retried for ``_REREAD_FOR``."""
        deadline = asyncio.get_running_loop().time() + _REREAD_FOR
        try:
            record = await retrying(
                f"read the record of {workflow_id}",
                lambda: self._read_record(workflow_id),
                deadline,
            )
        except Exception:
            return  # still unreadable: the wait's own timeout reads the record once more
        result = _final_result(record)
        if result is not None and not done.done():
            done.set_result(result)  # its .done, if it still comes, is dropped (_forget_done)
        # Not final: its .done is still to come, and will arrive.

    def _end_done_waits(self) -> None:
        """The client closes: every wait for a ``.done`` ends now (the workflows go on)."""
        for task in list(self._rechecks):
            task.cancel()
        for done in list(self._done_waits):
            if not done.done():
                done.set_exception(
                    MeshUnavailableError(
                        "the client was closed while waiting for a workflow result; the "
                        "workflow goes on (`await mesh.workflow(id)` from another client)"
                    )
                )

    async def _await_done(
        self, done: _Done, workflow_id: str, timeout: float, *, spent: float = 0.0
    ) -> tuple[WorkflowResult, bool]:
        """The result and whether a message ended ``done``'s subscription (it is over then).
        ``done``: from :meth:`_done_subscription`. The record is also read every
        ``_RESULT_RECHECK`` seconds (an announcement lost on the way ends the wait then).

        A message that is not the workflow's own announcement — a JetStream push consumer can
        deliver anything stored to any subject (``reach_mesh/_guard.py``) — is dropped: the
        wait goes on on a subscription of its own, after a look at the record (which only hubs
        write). ``spent``: of ``timeout``, what the caller spent before.

        Its waits are :func:`~reach_mesh._jspub.first_done`, not ``asyncio.wait`` and
        ``wait_for``: every workflow call waits here, and those two cost a set, a task wrapper
        or a second future and a pass of the event loop each."""
        loop = self._loop or asyncio.get_running_loop()  # ``done``'s: checked as it was made
        deadline = loop.time() + timeout - spent
        spent = False  # the caller's subscription had its one message
        own: tuple[Subscription, _Done] | None = None  # ours, while it has had none
        try:
            while True:
                left = deadline - loop.time()
                if left > _RESULT_RECHECK:
                    await first_done(loop, (done,), _RESULT_RECHECK)
                    if not done.done():
                        # The read races the announcement (it may wait out an election).
                        read = asyncio.ensure_future(self._stored_result(workflow_id))
                        either: set[asyncio.Future[Any]] = {done, read}
                        await asyncio.wait(
                            either,
                            timeout=max(0.0, deadline - loop.time()),
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                        if not read.done():
                            read.cancel()
                        elif (found := read.result()) is not None:
                            return found, spent
                        continue
                try:
                    if not done.done():
                        if left > 0:
                            await first_done(loop, (done,), left)
                        if not done.done():
                            done.cancel()  # (as ``wait_for`` did): a late .done is dropped
                            raise TimeoutError
                    got = done.result()
                except TimeoutError as err:
                    # The record is the source of truth: the result may be stored while its
                    # .done announcement is still on the way (a hub died between the two).
                    found = await self._stored_result(workflow_id, within=min(timeout, _LAST_LOOK))
                    if found is not None:
                        return found, spent
                    raise MeshTimeoutError(
                        f"no result for workflow {workflow_id} within {timeout:g}s "
                        "(it keeps running; `await mesh.workflow(id)` later)",
                        workflow_id=workflow_id,
                    ) from err
                if isinstance(got, WorkflowResult):
                    # Read from the record after a reconnect (its .done was missed).
                    return got, spent
                if own is None:
                    spent = True
                else:
                    own = None  # it had its one message: the server dropped the interest
                result = self._announcement(got, workflow_id)
                if result is not None:
                    return result, spent
                own = await self._done_subscription(workflow_id)
                done = own[1]
                found = await self._stored_result(
                    workflow_id, within=max(_LAST_LOOK, deadline - loop.time())
                )
                if found is not None:
                    return found, spent
        finally:
            if own is not None:
                self._drop_done(own[1])
                with contextlib.suppress(Exception):
                    await own[0].unsubscribe()

    def _announcement(self, msg: Msg, workflow_id: str) -> WorkflowResult | None:
        """The result ``msg`` announces, if it is the ``.done`` of ``workflow_id`` (its own
        subject, a result of that workflow); None, counted and logged, otherwise."""
        why = ""
        if msg.subject != protocol.wf_done(self.namespace, workflow_id):
            why = "not stored as this workflow's .done (a JetStream push delivery)"
        elif not msg.data:
            why = "an empty message (a JetStream push consumer's status)"
        else:
            try:
                result = WorkflowResult.model_validate_json(msg.data)
            except ValidationError:
                why = "not a WorkflowResult"
            else:
                if result.workflow_id == workflow_id:
                    return result
                why = f"the result of another workflow ({result.workflow_id})"
        refuse(msg, why)
        return None


def _follow(done: _Done, inner: asyncio.Future[Msg]) -> None:
    """nats-py's future for a ``.done`` resolved: the wait it belongs to ends with it."""
    if done.done() or inner.cancelled():
        return
    err = inner.exception()  # nats-py only sets results; an error ends the wait all the same
    if err is not None:
        done.set_exception(err)
    else:
        done.set_result(inner.result())


def _final_result(record: WorkflowRecord | None) -> WorkflowResult | None:
    """The result a record holds once it is final; None before (or without a record)."""
    return record.result if record is not None and record.state.final else None
