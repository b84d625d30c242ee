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

The same channel balances connections. The kernel's SO_REUSEPORT choice is a hash of each
connection's addresses, so 32 connections from one gateway often land 19 on one worker and
13 on the other, and the busier worker's queue sets the tail latency of all of them. Each
worker writes how many connections it holds into a shared table (one slot per worker,
written only by its owner; and per pair of workers, descriptors sent and received, so one
in flight counts too); a worker that accepts a connection while it holds more than the
least loaded sibling passes the socket to that sibling (SCM_RIGHTS) before reading a byte
of it, and the sibling serves it as if it had accepted it.

::

    channels = SiblingChannels(workers)    # before fork
    ...                                    # in worker i, after fork:
    sib = channels.take(i)
    api.share = sib.send                   # each registration that succeeded over HTTP
    await sib.run(api.apply_shared)        # what the siblings send
"""

from __future__ import annotations

import array
import logging
import mmap
import socket
from typing import Any, Awaitable, Callable

import anyio

__all__ = ["SiblingChannels", "Sibling", "MAX_MESSAGE_BYTES"]

log = logging.getLogger("kvstream.service")

MAX_MESSAGE_BYTES = 64 * 1024
"""Largest registration message sent to siblings (bytes); a registration is under 4 kB."""


class Sibling:
    """One worker's end: its inbox and the other workers' inboxes to write to."""

    __slots__ = ("inbox", "outboxes", "sent", "lost", "received", "index", "peers", "_table", "_n",
                 "passed", "adopted")

    def __init__(self, inbox: socket.socket, outboxes: list[socket.socket], index: int = 0,
                 peers: list[int] | None = None, table: Any = None) -> None:
        self.inbox = inbox
        self.outboxes = outboxes
        self.sent = 0
        self.lost = 0
        """Messages a sibling's full inbox (or an oversized message) did not take."""
        self.received = 0
        self.index = index
        self.peers = peers if peers is not None else list(range(1, len(outboxes) + 1))
        """The worker index behind each of ``outboxes``."""
        n = len(self.peers) + 1
        self._n = n
        # The shared table (int64 slots): [0, n) connections held by each worker; then
        # n x n descriptors sent by worker i to worker j, then n x n received by j from i.
        self._table = table if table is not None else memoryview(bytearray(8 * (n + 2 * n * n))).cast("q")
        self.passed = 0
        """Connections this worker accepted and passed to a sibling."""
        self.adopted = 0
        """Connections a sibling passed to this worker."""

    # -- connection balance ---------------------------------------------------------------

    def _load(self, j: int) -> int:
        """Connections worker ``j`` holds or has been sent and not yet taken."""
        t, n = self._table, self._n
        return t[j] + sum(t[n + i * n + j] - t[n + n * n + i * n + j] for i in range(n))

    def opened(self) -> None:
        """This worker now holds one more connection."""
        self._table[self.index] += 1

    def closed(self) -> None:
        """This worker holds one connection fewer."""
        self._table[self.index] -= 1

    def offload(self, sock: Any) -> bool:
        """Pass the just-accepted ``sock`` (not read from yet) to the least loaded sibling if
        this worker holds more connections than it: True if passed (the caller then closes its
        own descriptor, the connection lives on in the sibling); False: keep it."""
        if not self.outboxes:
            return False
        mine = self._load(self.index)
        least, k = min((self._load(j), k) for k, j in enumerate(self.peers))
        if mine <= least:
            return False
        j = self.peers[k]
        try:
            socket.send_fds(self.outboxes[k], [b"C%d" % self.index], [sock.fileno()], socket.MSG_DONTWAIT)
        except OSError:
            return False  # its inbox is full (or it is gone): serve it here
        n = self._n
        self._table[n + self.index * n + j] += 1
        self.passed += 1
        return True

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

    async def run(self, apply: Callable[[bytes], None],
                  adopt: Callable[[socket.socket], Awaitable[None]] | None = None) -> None:
        """Apply each message the siblings send, until cancelled; ``adopt(sock)``: serve a
        connection a sibling passed (without ``adopt`` it is closed)."""
        inbox = self.inbox
        fd_space = socket.CMSG_SPACE(4)
        n = self._n
        while True:
            await anyio.wait_readable(inbox)
            while True:
                try:
                    msg, anc, _flags, _addr = inbox.recvmsg(MAX_MESSAGE_BYTES + 1, fd_space, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                fds = array.array("i")
                for level, kind, data in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
                if fds:
                    sender = int(msg[1:]) if msg[:1] == b"C" and msg[1:].isdigit() else -1
                    if 0 <= sender < n:
                        self._table[n + n * n + sender * n + self.index] += 1
                    for fd in fds:
                        sock = socket.socket(fileno=fd)
                        if adopt is None:
                            sock.close()
                            continue
                        self.adopted += 1
                        try:
                            await adopt(sock)
                        except Exception:  # noqa: BLE001 - one bad descriptor must not stop the worker
                            sock.close()
                            log.exception("could not serve a connection passed by another worker")
                    continue
                self.received += 1
                try:
                    apply(msg)
                except Exception:  # noqa: BLE001 - one bad message must not stop the worker
                    log.exception("could not apply a registration shared by another worker")

    def close(self) -> None:
        """Close this worker's sockets."""
        self._table.release()
        self.inbox.close()
        for out in self.outboxes:
            out.close()


class SiblingChannels:
    """The channels of ``n`` workers, made in the parent before it forks them."""

    def __init__(self, n: int) -> None:
        self._pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(n)]
        self._n = n
        # Shared by the forked workers (MAP_SHARED, anonymous): the balance table of Sibling.
        self._map = mmap.mmap(-1, 8 * (n + 2 * n * n))

    def take(self, i: int) -> Sibling:
        """Worker ``i``'s end (call once, in worker ``i`` after the fork): closes the ends
        worker ``i`` does not use."""
        inbox = None
        outboxes = []
        peers = []
        for j, (rx, tx) in enumerate(self._pairs):
            if j == i:
                inbox = rx
                tx.close()
            else:
                rx.close()
                outboxes.append(tx)
                peers.append(j)
        self._pairs = []
        assert inbox is not None
        return Sibling(inbox, outboxes, i, peers, memoryview(self._map).cast("q"))

    def close(self) -> None:
        """Close every end (the parent, once the workers are forked)."""
        for rx, tx in self._pairs:
            rx.close()
            tx.close()
        self._pairs = []
        self._map.close()
