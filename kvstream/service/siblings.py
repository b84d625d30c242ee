"""Registrations shared between the workers of ``kvstream serve --workers N``.

Each worker is a full replica (its own subscriber and index), and the kernel hands a
connection to any one of them (SO_REUSEPORT), so a ``POST /register`` or ``/unregister``
reaches one worker. That worker applies it, answers, and sends it to every other worker
over a local datagram channel set up before the workers are forked (one UNIX datagram
socket pair per worker: its inbox, and the other end every sibling writes to). A sibling
applies it as if it came over HTTP; after that every worker follows the same engines.

Limits, by design: the channel is fire-and-forget between processes of one service (a
sibling whose inbox is full, 200 kB of waiting registrations, misses the message and logs
it); two conflicting registrations of one instance sent to two workers at the same moment
may be applied in different orders (each worker answers its own caller; send one
registration per instance at a time, as RFC #1403's conductor does).

::

    channels = SiblingChannels(workers)    # before fork
    ...                                    # in worker i, after fork:
    sib = channels.take(i)
    api.share = sib.send                   # each registration that succeeded over HTTP
    await sib.run(api.apply_shared)        # what the siblings send
"""

from __future__ import annotations

import logging
import socket
from typing import Callable

import anyio

__all__ = ["SiblingChannels", "Sibling", "MAX_MESSAGE_BYTES"]

log = logging.getLogger("kvstream.service")

MAX_MESSAGE_BYTES = 64 * 1024
"""Largest registration message sent to siblings (bytes); a registration is under 4 kB."""


class Sibling:
    """One worker's end: its inbox and the other workers' inboxes to write to."""

    __slots__ = ("inbox", "outboxes", "sent", "lost", "received")

    def __init__(self, inbox: socket.socket, outboxes: list[socket.socket]) -> None:
        self.inbox = inbox
        self.outboxes = outboxes
        self.sent = 0
        self.lost = 0
        """Messages a sibling's full inbox (or an oversized message) did not take."""
        self.received = 0

    def send(self, message: bytes) -> None:
        """Send ``message`` to every other worker, without blocking."""
        if len(message) > MAX_MESSAGE_BYTES:
            self.lost += len(self.outboxes)
            log.error("a registration of %d bytes is too large to share with the other workers", len(message))
            return
        for out in self.outboxes:
            try:
                out.send(message, socket.MSG_DONTWAIT)
                self.sent += 1
            except OSError as exc:
                self.lost += 1
                log.error("could not share a registration with another worker: %s", exc)

    async def run(self, apply: Callable[[bytes], None]) -> None:
        """Apply each message the siblings send, until cancelled."""
        inbox = self.inbox
        while True:
            await anyio.wait_readable(inbox)
            while True:
                try:
                    msg = inbox.recv(MAX_MESSAGE_BYTES + 1, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                self.received += 1
                try:
                    apply(msg)
                except Exception:  # noqa: BLE001 - one bad message must not stop the worker
                    log.exception("could not apply a registration shared by another worker")

    def close(self) -> None:
        """Close this worker's sockets."""
        self.inbox.close()
        for out in self.outboxes:
            out.close()


class SiblingChannels:
    """The channels of ``n`` workers, made in the parent before it forks them."""

    def __init__(self, n: int) -> None:
        self._pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(n)]

    def take(self, i: int) -> Sibling:
        """Worker ``i``'s end (call once, in worker ``i`` after the fork): closes the ends
        worker ``i`` does not use."""
        inbox = None
        outboxes = []
        for j, (rx, tx) in enumerate(self._pairs):
            if j == i:
                inbox = rx
                tx.close()
            else:
                rx.close()
                outboxes.append(tx)
        self._pairs = []
        assert inbox is not None
        return Sibling(inbox, outboxes)

    def close(self) -> None:
        """Close every end (the parent, once the workers are forked)."""
        for rx, tx in self._pairs:
            rx.close()
            tx.close()
        self._pairs = []
