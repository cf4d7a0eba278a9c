"""What a connection refuses to read: messages nats-py would choke on, or answer for a forger.

nats-server passes a publisher's subject, reply subject and header block on as they came, and
nats-py acts on some messages by itself in its read loop. :class:`MessageGuard` (the base of
every connection reach-mesh makes) drops, counts (``reach_messages_refused_total``) and logs
(``REACH-MESSAGE-REFUSED``) a message nats-py cannot read — which would end its read loop —
a JetStream control message nats-py would answer anywhere but under ``$JS.FC.``, and a
stored message it would take for one (nats-py neither delivers nor counts it). A pulled
delivery it cannot read is ended on its stream (:func:`on_unreadable`); a dropped delivery of
an ordered consumer still counts as delivered. docs/security.md's threat table lists the
attacks.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Final

import nats
from nats.aio.client import Client as NATS
from nats.js.api import Header

from reach_mesh._nats_headers import HeaderCodec

__all__ = ["MessageGuard", "on_unreadable"]

log = logging.getLogger("reach_mesh.nats")


class MessageGuard(HeaderCodec):
    """nats-py's client (with the lean header codec), refusing what its read loop must not
    meet (see the module)."""

    #: Messages its subscribers dropped unread (``_guard.refuse``): what the hub or agent
    #: owning the connection exports as ``reach_messages_refused_total``, theirs alone when
    #: several share a process.
    messages_refused: int = 0
    #: Pull consumers' inboxes (by subscription id), and what each does with a JetStream
    #: delivery there that cannot be read: given its ack subject (``on_unreadable``).
    unreadable: dict[int, Callable[[str], None]] | None = None

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        # nats-server passes a publisher's subject, reply subject and header block on as they
        # came: bytes that are not UTF-8, a header block shorter than "NATS/1.0", a status
        # line that does not decode. nats-py raises on them in its read loop, which then ends
        # (logged, not reconnected): the connection stays up but reads nothing more until its
        # PINGs go unanswered. One such message from any identity that may publish where a
        # hub listens (a caller's report reaches every hub) made the hub's main connection
        # deaf for seconds each time. Dropped here instead, counted and logged as refused.
        try:
            # (An empty body with headers: what nats-py alone may take for a control message.)
            if not data and headers:
                control, target = await self._control_of(sid, reply, headers)
                why = None
                if control is not None and reply.startswith(_ACK_B):
                    # A stored message (the server's own control messages have no reply or a
                    # $JS.FC. one): nats-py neither delivers nor counts it, and an ordered
                    # consumer reset from before it forever, answered or not.
                    why = f"stored message read as a JetStream control message ({control!r:.40})"
                elif target is not None and (
                    not target.startswith(_FC) or _NOT_IN_SUBJECT.search(target) is not None
                ):
                    why = f"JetStream control message answered at {target!r:.80}, not {_FC}"
                if why is not None:
                    from reach_mesh._guard import refuse_body  # (it imports this module)

                    refuse_body(self, subject.decode("utf-8", "replace"), why)
                    self._passed(sid, reply)
                    return
            await super()._process_msg(sid, subject, reply, data, headers)
        except (ValueError, IndexError, nats.errors.Error) as err:
            # (UnicodeDecodeError is a ValueError. nats-py's own errors: on a push
            # subscription, a forged delivery whose reply subject is no ``$JS.ACK.`` one —
            # NotJSMessageError, at once on an ordered consumer, at the next idle heartbeat on
            # another —, a control message's answer to no subject — BadSubjectError.)
            if isinstance(err, nats.errors.Error) and not isinstance(err, _FORGED):
                # The connection's own state (an answer to the server's flow control while it
                # closes, drains or reconnects): nothing of the message's; the loop reads on.
                log.debug("message on %r not handled: %r", subject, err)
                return
            from reach_mesh._guard import refuse_body  # (it imports this module)

            refuse_body(
                self,
                subject.decode("utf-8", "replace"),
                f"malformed message (subject, reply subject or headers): {err!r:.120}",
            )
            self._passed(sid, reply)
            if isinstance(err, nats.errors.Error):
                return  # (no reading error: not one to end on its stream)
            # A stored one, pulled, would come back after every ack wait: its pull consumer
            # ends it. Only on a pull inbox (64 random bits: JetStream's deliveries only), so
            # that no one has this connection end a message of its choosing.
            unread = self.unreadable.get(sid) if self.unreadable else None
            if unread is not None and reply.startswith(_ACK_B):
                unread(reply.decode("ascii", "replace"))

    def _passed(self, sid: int, reply: bytes) -> None:
        """A delivery of an ordered consumer dropped unread still counts as delivered: else
        nats-py, which never saw its consumer sequence, takes the next delivery for a gap and
        resets the consumer from the last one it saw — which delivers the dropped one again,
        dropped again, and nothing after it ever (a stored message: anyone's who may publish
        on the stream's subjects). As nats-py's own check of a delivery does (same tokens)."""
        sub = self._subs.get(sid)
        jsi = None if sub is None else sub._jsi
        if jsi is None or not jsi._ordered or not reply.startswith(_ACK_B):
            return
        tokens = reply.split(b".")
        try:
            sseq, dseq = int(tokens[5]), int(tokens[6])
        except (ValueError, IndexError):
            return
        if dseq == jsi._dseq:
            jsi._dseq = dseq + 1
            jsi._sseq = sseq

    async def _control_of(
        self, sid: int, reply: bytes, headers: bytes
    ) -> tuple[str | None, str | None]:
        """Whether nats-py takes this message for a JetStream control message (its
        description; None: not one), and where its ``_process_msg`` publishes an empty answer
        to it, read as it reads it (None: nowhere): on a JetStream push subscription, to a
        status-100 "Idle
        Heartbeat"'s ``Nats-Consumer-Stalled`` header, to a "FlowControl ..."'s reply subject.
        The server's are under ``$JS.FC.``; anyone who may publish on the deliver subject
        could name any subject this connection may publish to (a hub's
        ``$JS.API.STREAM.DELETE.<stream>`` takes an empty body). Status 100 is the server's
        status line (``NATS/1.0 100 ...``) or any publisher's ``Status: 100`` header alike."""
        sub = self._subs.get(sid)
        if sub is None or sub._jsi is None:
            return None, None
        hdr = await self._process_headers(headers)
        control = self._is_control_message(b"", hdr) if hdr else None
        if not control or hdr is None:
            return None, None
        if control.startswith("Idle"):
            return control, hdr.get(_STALLED) or None
        if control.startswith("Flow") and reply:
            return control, reply.decode()
        return control, None


#: nats-py's errors a forged message raises in its read loop (``_process_msg``): a push
#: delivery whose reply subject is no ``$JS.ACK.`` one, a control message answered to no
#: subject. Its other errors there are the connection's own (closing, draining).
_FORGED: Final = (nats.errors.NotJSMessageError, nats.errors.BadSubjectError)
_ACK_B: Final = b"$JS.ACK."
#: Where a JetStream server's flow control and stalled-consumer subjects are.
_FC: Final = "$JS.FC."
_STALLED: Final = Header.CONSUMER_STALLED
#: What no subject holds (nats-py's publish raises ``BadSubjectError`` on it, which in the read
#: loop ends it): a header value under ``$JS.FC.`` may hold it — only the server's is a subject.
_NOT_IN_SUBJECT: Final = re.compile(r"[ \t\r\n]")


def on_unreadable(nc: NATS, sid: int, then: Callable[[str], None] | None) -> None:
    """Have ``then`` called with the ack subject of a JetStream delivery on subscription
    ``sid`` (a pull consumer's inbox) that cannot be read (``MessageGuard._process_msg``);
    ``None``: no longer. Nothing on a connection not made by ``_nats.connect``."""
    if not isinstance(nc, MessageGuard):
        return
    if then is None:
        if nc.unreadable:
            nc.unreadable.pop(sid, None)
        return
    if nc.unreadable is None:
        nc.unreadable = {}
    nc.unreadable[sid] = then
