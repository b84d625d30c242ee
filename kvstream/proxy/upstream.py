"""The proxy's HTTP client to its engines: kept-alive HTTP/1.1 connections, one pool per engine.

Each connection is an ``asyncio.Protocol`` whose responses httptools parses (llhttp, the
parser uvicorn serves with), so a proxied request costs one write of the whole request,
the parser's callbacks and one wake-up of the waiting task, and nothing per header or
per chunk in Python beyond that. aiohttp's client, used before, cost 145 us of CPU per
non-streamed request on this machine (``bench/bench_proxy_clients.py --non-streamed``);
that is most of what a Rust router spends on its whole hop, which is why this module is
not a library's.

An :class:`UpstreamPool` keeps idle connections for at most ``keepalive_s`` seconds, below
the idle timeout engines close them after (vLLM and ``kvstream engine`` serve with
uvicorn's 5 s), so a connection is not reused when the engine is about to close it. An idle
connection's socket stays read, so one the engine closed anyway leaves the pool as soon as
its FIN arrives.

What remains is the race where the engine closes an idle connection just as the proxy
sends on it: the request fails with no byte of an answer. The engine never took that
request, so it is sent once more on a *new* connection (never another pooled one, which the
engine may have closed too). Only if that fails as well is it an :class:`UpstreamError`; an
engine that refuses the connection (nothing listens) is one at once.

Bounds: a response head over :data:`MAX_HEAD_BYTES`, or one httptools cannot parse, is an
:class:`UpstreamError`; a body is held at most :data:`READ_AHEAD_BYTES` ahead of its reader
(past that the socket is not read until the reader catches up, so a slow client holds its
engine back by TCP, not in memory). A request cancelled before its answer is complete
closes its connection: vLLM aborts a request when its connection closes.

:class:`UpstreamError` means the engine could not be reached, dropped the connection or
answered what is not HTTP; ``before_response`` says whether any of its answer had arrived
(only then is a retry on another engine safe).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, AsyncIterator

import httptools

__all__ = ["UpstreamError", "UpstreamPool", "UpstreamResponse", "KEEPALIVE_S", "MAX_HEAD_BYTES",
           "READ_AHEAD_BYTES"]

KEEPALIVE_S = 4.0
"""Longest an idle connection to an engine is kept (seconds): under the 5 s after which
vLLM's server (uvicorn's ``timeout_keep_alive``) closes it."""

MAX_HEAD_BYTES = 64 * 1024
"""Bytes of an engine's status line and headers past which its answer is refused."""

READ_AHEAD_BYTES = 256 * 1024
"""Bytes of a body held ahead of its reader before the socket is no longer read."""


class UpstreamError(Exception):
    """The engine refused, timed out or dropped the connection, or did not answer HTTP."""

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class _Conn(asyncio.Protocol):
    """One connection to an engine; at most one request at a time."""

    def __init__(self, pool: "UpstreamPool") -> None:
        self.pool = pool
        self.transport: Any = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.once = False  # a retry's connection: closed after its request, never pooled
        # the response in progress
        self.busy = False
        self.got_any = False  # a byte of this request's answer arrived
        self.head_bytes = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.length: int | None = None
        self.status = 0
        self.head_done = False
        self.until_close = False  # a body ended by the connection's close (no length, not chunked)
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.complete = False
        self.over = False  # more than one answer arrived for the request
        self.keep = False
        self.error: str | None = None
        self.waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:  # nothing was asked: not HTTP we can use, and not kept
            self.keep = False
            self._close()
            return
        self.got_any = True
        if not self.head_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("it answered with a protocol upgrade")
        except httptools.HttpParserError as exc:
            self._fail(f"its answer is not HTTP/1.1 ({exc})")
        else:
            if self.over:
                self._close()
            elif not self.head_done and self.head_bytes > MAX_HEAD_BYTES:
                self._fail(f"its response head is over {MAX_HEAD_BYTES} bytes")

    def eof_received(self) -> bool | None:
        return None  # close the transport: the engine is done with this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._lost(self)
        if self.busy and not self.complete and self.error is None:
            if self.until_close and self.head_done:
                self.complete = True
            else:
                self.error = "closed the connection" + (f" ({exc})" if exc else "")
        self._wake()

    def pause_writing(self) -> None:  # a request is one write: the transport buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: ignored, and the connection not kept
            self.over = True
            self.keep = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.over:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.over:
            return
        self.status = self.parser.get_status_code()
        if self.status < 200:  # an interim answer (100 Continue, 103): the real one follows
            self.headers = []
            return
        self.head_done = True
        chunked = False
        for k, v in self.headers:
            lk = k.lower()
            if lk == b"content-length":
                try:
                    self.length = int(v)
                except ValueError:
                    pass
            elif lk == b"transfer-encoding":
                chunked = True
        self.until_close = self.length is None and not chunked and self.status not in (204, 304)
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.over:
            return
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > READ_AHEAD_BYTES and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.head_done or self.over:
            return  # the end of an interim answer, or of one not asked for
        self.complete = True
        self.keep = self.parser.should_keep_alive()
        self._wake()

    # the caller's side
    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    async def wait(self) -> None:
        self.waiter = w = asyncio.get_running_loop().create_future()
        try:
            await w
        finally:
            self.waiter = None

    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        self._close()
        self._wake()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def send(self, data: bytes) -> None:
        self.busy = True
        self.got_any = False
        self.head_bytes = 0
        self.headers = []
        self.length = None
        self.status = 0
        self.head_done = self.until_close = self.complete = self.keep = self.over = False
        self.body.clear()
        self.buffered = 0
        self.error = None
        self.transport.write(data)

    def take(self) -> bytes:
        """The body bytes received so far (and read on again if that was paused)."""
        data = self.body.popleft() if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data


class UpstreamResponse:
    """A response whose status and headers have arrived; read the body with
    :meth:`aiter_bytes` or :meth:`read`, then :meth:`aclose` (always).

    ``headers``: the engine's header lines as ``(name, value)`` bytes pairs, as sent.
    """

    __slots__ = ("status_code", "headers", "content_length", "_conn", "_where")

    def __init__(self, conn: _Conn, where: str) -> None:
        self.status_code = conn.status
        self.headers: tuple[tuple[bytes, bytes], ...] = tuple(conn.headers)
        self.content_length: int | None = conn.length
        """The engine's ``Content-Length`` (bytes), None if it did not send one."""
        self._conn: _Conn | None = conn
        self._where = where

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives (whatever the socket delivered since the last read)."""
        conn = self._conn
        if conn is None:
            return
        while True:
            if conn.body:
                yield conn.take()
            elif conn.complete:
                break
            elif conn.error is not None:
                raise UpstreamError(f"{self._where} dropped the connection: {conn.error}", before_response=False)
            else:
                await conn.wait()

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; :class:`UpstreamError` once it passes ``limit`` bytes (None: no
        limit), so an engine's endless answer is never held whole."""
        buf = bytearray()
        async for chunk in self.aiter_bytes():
            if limit is not None and len(buf) + len(chunk) > limit:
                raise UpstreamError(f"the answer of {self._where} is over {limit} bytes", before_response=False)
            buf += chunk
        return bytes(buf)

    async def aclose(self) -> None:
        """Return the connection to the pool if the whole body arrived (and the engine keeps
        it alive), else close it (an engine closing a streamed request aborts it, as vLLM
        does)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.pool._release(conn, reuse=conn.complete and conn.keep)


class UpstreamPool:
    """Keep-alive connections to one engine at ``host:port``.

    Args:
        host, port: the engine's HTTP address.
        connect_timeout_s: seconds to open a connection.
        keepalive_s: seconds an idle connection is kept (see :data:`KEEPALIVE_S`).
    """

    def __init__(self, host: str, port: int, *, connect_timeout_s: float = 2.0,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in brackets
        self._host_line = b"host: " + self._where.encode("idna") + b"\r\n"
        self._idle: list[_Conn] = []  # newest last
        self._open: set[_Conn] = set()
        self._closed = False
        self.fresh_retries = 0
        """Requests sent again on a new connection after the engine closed a pooled one."""

    @property
    def connections(self) -> int:
        """Connections open now (idle and in use)."""
        return len(self._open)

    async def aclose(self) -> None:
        """Close every connection (in use ones too: their readers get an :class:`UpstreamError`)."""
        self._closed = True
        for c in list(self._open):
            c._fail("the proxy closed its connections")
        self._idle.clear()
        self._open.clear()

    def _lost(self, conn: _Conn) -> None:
        self._open.discard(conn)
        if not conn.busy:
            try:
                self._idle.remove(conn)
            except ValueError:
                pass

    def _release(self, conn: _Conn, *, reuse: bool) -> None:
        conn.busy = False
        conn.waiter = None
        if reuse and not conn.closed and not self._closed and not conn.once:
            conn.idle_since = time.monotonic()
            conn.body.clear()
            self._idle.append(conn)
        else:
            conn._close()
            self._open.discard(conn)

    def _pooled(self) -> _Conn | None:
        idle = self._idle
        oldest = time.monotonic() - self.keepalive_s
        while idle:
            c = idle.pop()
            if not c.closed and c.idle_since > oldest:
                return c
            c._close()
            self._open.discard(c)
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise UpstreamError(f"the pool to {self._where} is closed", before_response=True)
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Conn(self), self.host, self.port),
                                             self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamError(f"cannot connect to {self._where}: no answer within {self.connect_timeout_s:g} s",
                                before_response=True) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {self._where}: {exc.strerror or exc}",
                                before_response=True) from None
        self._open.add(conn)
        return conn

    async def _exchange(self, conn: _Conn, data: bytes) -> bool:
        """Send ``data`` on ``conn`` and wait for its status and headers: True once they
        arrived, False if the connection failed first (an error said in ``conn.error``)."""
        try:
            conn.send(data)
            while not conn.head_done:
                if conn.error is not None or conn.closed:
                    return False
                await conn.wait()
        except BaseException:
            self._release(conn, reuse=False)  # cancelled: closing it tells the engine
            raise
        return True

    async def request(self, method: str, target: str, body: bytes, headers: list[tuple[bytes, bytes]]
                      ) -> UpstreamResponse:
        """Send one request; returns once the status line and headers arrived. Raises
        :class:`UpstreamError` (``before_response=True``) if that did not happen."""
        parts = [method.encode("ascii"), b" ", target.encode("latin-1"), b" HTTP/1.1\r\n", self._host_line]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        if body or method not in ("GET", "HEAD"):
            parts.append(b"content-length: %d\r\n\r\n" % len(body))
            parts.append(body)
        else:
            parts.append(b"\r\n")
        data = b"".join(parts)
        conn = self._pooled()
        got_any, error = False, None
        for attempt in range(2):
            if conn is None:
                conn = await self._connect()
                conn.once = attempt > 0
            if await self._exchange(conn, data):
                return UpstreamResponse(conn, self._where)
            got_any, error = conn.got_any, conn.error
            self._release(conn, reuse=False)
            conn = None
            if got_any or self._closed:
                break
            # The engine closed the connection before any byte of an answer: it never took
            # the request (a pooled connection met the engine's idle close, or a new one
            # its accept racing a close). Send it once more, on a new connection.
            if attempt == 0:
                self.fresh_retries += 1
        what = "failed answering" if got_any else "closed the connection before answering"
        raise UpstreamError(f"{self._where} {what}: {error}", before_response=True)
