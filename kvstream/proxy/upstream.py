"""A small HTTP/1.1 client for the proxy's upstream calls: keep-alive pools with O(1) checkout.

The proxy sends every request to one of a few engines and streams the answer back. A
general-purpose client's connection pool scans all its connections on every request and
response (measured: the largest cost in the proxy at 64 open streams), so the proxy keeps
one pool per engine: a stack of idle keep-alive connections, each an anyio byte stream with
a small purpose-built response reader (:mod:`kvstream.proxy._http1`; a general-purpose
parser cost more per passed-through event than the rest of the proxy). A connection the engine closed while idle is detected on reuse
(no response byte arrives) and the request is sent again on a fresh connection, which is
safe because the engine never saw it.

:class:`UpstreamError` means the engine could not be reached or dropped the connection;
``before_response`` says whether any of its answer had arrived (only then is a retry on
another engine safe).
"""

from __future__ import annotations

import socket
from collections import deque
from typing import AsyncIterator

import anyio
import anyio.abc

from kvstream.proxy._http1 import HTTPParseError, ResponseReader, request_bytes

__all__ = ["UpstreamError", "UpstreamPool", "UpstreamResponse"]

_READ = 65536


class UpstreamError(Exception):
    """The engine refused, timed out or dropped the connection."""

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class _Conn:
    __slots__ = ("stream", "reader", "reused")

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.reader = ResponseReader()
        self.reused = False


class UpstreamResponse:
    """A response whose status and headers have arrived; read the body with
    :meth:`aiter_bytes` or :meth:`read`, then :meth:`aclose` (always)."""

    __slots__ = ("status_code", "headers", "_pool", "_conn", "_done")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], pool: "UpstreamPool", conn: _Conn) -> None:
        self.status_code = status
        self.headers = headers
        self._pool = pool
        self._conn: _Conn | None = conn
        self._done = False

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunk boundaries as the engine sent them)."""
        conn = self._conn
        if conn is None:
            return
        reader = conn.reader
        pool = self._pool
        while True:
            try:
                data = reader.body()
            except HTTPParseError as exc:
                raise UpstreamError(f"bad HTTP from {pool.host}:{pool.port}: {exc}", before_response=False) from None
            if data is None:
                await pool._receive(conn, before_response=False)
                continue
            if data:
                yield data
            if reader.done:
                self._done = True
                return

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; :class:`UpstreamError` once it passes ``limit`` bytes (None: no
        limit), so an engine's endless answer is never held whole."""
        parts = []
        size = 0
        async for chunk in self.aiter_bytes():
            size += len(chunk)
            if limit is not None and size > limit:
                raise UpstreamError(f"the answer of {self._pool.host}:{self._pool.port} is over {limit} bytes",
                                    before_response=False)
            parts.append(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        """Return the connection to the pool if the exchange completed, else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and conn.reader.keep_alive and not conn.reader.pending:
            conn.reader.reset()
            if not self._pool._release(conn):
                await self._pool._discard(conn)
        else:
            await self._pool._discard(conn)


class UpstreamPool:
    """Keep-alive connections to one ``host:port`` (at most ``max_idle`` kept idle).

    ``connect_timeout_s``: seconds to open a connection.
    """

    def __init__(self, host: str, port: int, *, connect_timeout_s: float = 2.0, max_idle: int = 512) -> None:
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: deque[_Conn] = deque()
        self._host_header = f"{host}:{port}".encode()

    async def aclose(self) -> None:
        """Close every idle connection."""
        while self._idle:
            await self._discard(self._idle.pop())

    def _release(self, conn: _Conn) -> bool:
        """Keep ``conn`` for reuse; False (not kept) when ``max_idle`` are idle already."""
        if len(self._idle) >= self.max_idle:
            return False
        conn.reused = True
        self._idle.append(conn)
        return True

    async def _discard(self, conn: _Conn) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await conn.stream.aclose()
            except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    async def _connect(self) -> _Conn:
        try:
            with anyio.fail_after(self.connect_timeout_s):
                stream = await anyio.connect_tcp(self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {exc}", before_response=True) from None
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        if sock is not None:  # small writes (one SSE event) must not wait for an ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Conn(stream)

    async def _receive(self, conn: _Conn, *, before_response: bool) -> None:
        """Feed the next bytes from the engine (``b""``: it closed) to ``conn``'s reader."""
        try:
            data = await conn.stream.receive(_READ)
        except anyio.EndOfStream:
            data = b""
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise UpstreamError(f"{self.host}:{self.port} dropped the connection: {exc}",
                                before_response=before_response) from None
        if not data and before_response:
            raise UpstreamError(f"{self.host}:{self.port} closed the connection before answering",
                                before_response=True)
        conn.reader.feed(data)

    async def request(self, method: str, target: str, body: bytes, headers: list[tuple[bytes, bytes]]
                      ) -> UpstreamResponse:
        """Send one request; returns once the status line and headers arrived. Raises
        :class:`UpstreamError` (``before_response=True``) if that did not happen."""
        hdrs = [(b"host", self._host_header), (b"content-length", str(len(body)).encode()), *headers]
        for attempt in range(2):
            conn = self._idle.pop() if self._idle else await self._connect()
            try:
                conn.reader.no_body = method == "HEAD"
                try:
                    await conn.stream.send(request_bytes(method, target, hdrs, body))
                except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                    raise UpstreamError(f"cannot send to {self.host}:{self.port}: {exc}",
                                        before_response=True) from None
                reader = conn.reader
                while True:
                    try:
                        if reader.head():
                            break
                    except HTTPParseError as exc:
                        raise UpstreamError(f"bad HTTP from {self.host}:{self.port}: {exc}",
                                            before_response=True) from None
                    await self._receive(conn, before_response=True)
                return UpstreamResponse(reader.status, reader.headers, self, conn)
            except UpstreamError:
                stale = conn.reused
                await self._discard(conn)
                if stale and attempt == 0:
                    continue  # an idle connection the engine had closed: try a fresh one
                raise
            except BaseException:
                await self._discard(conn)
                raise
        raise AssertionError("unreachable")  # pragma: no cover
