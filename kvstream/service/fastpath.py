"""A lean HTTP/1.1 front for the routing calls, in front of uvicorn.

``POST /query``, ``/v1/route`` and ``/query_by_hash`` are most of what a gateway sends, and
their handlers are synchronous (bytes in, bytes out). Through uvicorn each one costs an
ASGI scope, a task, two ``send`` messages and a receive queue; measured on this 2-core
machine with a trivial handler and 4,096-token bodies, uvicorn (httptools, uvloop)
answered 28 k requests/s where a plain ``asyncio.Protocol`` answered 66 k/s (~20 us less per
request). So each connection starts on :class:`FastPathProtocol`: well-formed POSTs to the
hot paths are answered right in ``data_received``; the first request it does not take
(any other path or method, chunked bodies, ``Expect``, HTTP/1.0, anything unusual or
malformed, a body over the limit) hands the connection, with every byte not yet answered,
to uvicorn's own protocol for the rest of its life. So every other route, every error
page, streaming, lifespan and shutdown stay uvicorn's, and the fast path only ever sees
requests it fully understands. A connection that holds a partial request (head or body)
for more than ``request_timeout`` seconds is answered 408 ``request_timeout`` and closed,
as uvicorn's guarded protocol does.

Paths in ``forward`` (``serve --proxy``'s ``/v1/completions`` and ``/v1/chat/completions``)
are asynchronous: such a request runs as one task calling its ASGI app with a minimal
scope (method, path, headers and the :class:`~kvstream.service.guard.DisconnectHook`
extension), and its answer is written straight to the transport: one write for a whole
answer with its ``Content-Length``, chunked framing for a stream, each write waiting while
the client does not read. The connection takes no other request until that answer is
complete (pipelined bytes wait in a buffer of at most :data:`HELD_WHILE_ANSWERING` bytes,
then TCP holds the client back). Measured through the proxy (``bench/bench_routers.py
--overhead``), uvicorn's protocol, scope, task and ``send`` messages cost about a fifth of
the proxy's CPU per request.

:func:`frame_request` is the sans-IO part: it finds one complete request in a buffer.
"""

from __future__ import annotations

import asyncio
import logging
import re
from http import HTTPStatus
from typing import Any, Callable, Container, Iterable, Mapping

from kvstream.service.guard import DISCONNECT_EXTENSION, DisconnectHook, error_response, request_timeout_message

__all__ = ["HANDOFF", "MAX_HEAD_BYTES", "HELD_WHILE_ANSWERING", "frame_request", "fast_protocol",
           "FastPathProtocol"]

MAX_HEAD_BYTES = 16 * 1024
"""Request line and headers larger than this go to uvicorn (whose guarded protocol,
:mod:`kvstream.service.guard`, refuses heads over its own bound)."""

HELD_WHILE_ANSWERING = 64 * 1024
"""Bytes of pipelined requests read while a forwarded request is answered; past that the
socket is not read until the answer is complete."""

HANDOFF: Any = object()
"""What :func:`frame_request` returns for a request the fast path does not take."""

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Control characters other than HTAB, CR and LF (CR and LF are checked as line ends). HTTP
# forbids them in a head (RFC 9110 5.5); uvicorn's parsers refuse them with a 400, so a head
# holding one goes to uvicorn, which answers the service's JSON ``bad_http``. One scan of
# the head (about 150 bytes from a gateway), deleting them and comparing lengths, costs
# ~0.16 us (a regex search cost ~0.3 us).
_CTL = bytes([*range(0x09), 0x0b, 0x0c, *range(0x0e, 0x20), 0x7f])
_REASON = {s.value: s.phrase.encode() for s in HTTPStatus}
_log = logging.getLogger("kvstream.service")


def frame_request(buf: bytes | bytearray, hot: Container[bytes] | Mapping[bytes, int],
                  limit: int) -> tuple[bytes, bytes, int, bool] | None | Any:
    """One request at the start of ``buf``: ``(path, body, bytes used, keep-alive)`` for a
    well-formed ``POST`` to a path in ``hot`` with a ``Content-Length`` of at most ``limit``
    bytes (``hot`` a mapping: at most that path's own limit); None if more bytes are needed
    to tell; :data:`HANDOFF` for anything else."""
    end = buf.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES)
    if end < 0:
        if len(buf) >= MAX_HEAD_BYTES or buf.find(b"\n\n", 0, MAX_HEAD_BYTES) >= 0:
            return HANDOFF  # too long, or a head ended by bare LFs: not ours to wait on
        return None
    head = bytes(buf[:end])
    crlf = head.count(b"\r\n")
    if head.count(b"\n") != crlf or head.count(b"\r") != crlf:
        return HANDOFF  # a bare CR or LF: not for the fast path to interpret
    if len(head.translate(None, _CTL)) != len(head):
        return HANDOFF  # a NUL or other control character: uvicorn refuses it (400 bad_http)
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1" or parts[1] not in hot:
        return HANDOFF
    length = -1
    keep = True
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):
            return HANDOFF
        name = name.lower()
        value = value.strip(b" \t")
        if name == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > 18:
                return HANDOFF
            length = int(value)
        elif name in (b"transfer-encoding", b"expect", b"upgrade"):
            return HANDOFF
        elif name == b"connection":
            opts = {v.strip(b" \t") for v in value.lower().split(b",")}
            if b"upgrade" in opts:
                return HANDOFF
            if b"close" in opts:
                keep = False
    if isinstance(hot, dict):
        limit = hot[parts[1]]
    if length < 0 or length > limit:
        return HANDOFF  # no length (uvicorn answers), or a 413 HotRoutes words (before reading the body)
    used = end + 4 + length
    if len(buf) < used:
        return None
    return parts[1], bytes(buf[end + 4:used]), used, keep


class FastPathProtocol(asyncio.Protocol):
    """One connection: hot POSTs answered here, everything else handed to ``fallback``
    (uvicorn's HTTP protocol class). Made per server by :func:`fast_protocol`; uvicorn
    creates one per connection (``Config(http=...)``) with its own arguments, which the
    fallback gets unchanged. Registered in uvicorn's connection set, so a shutdown
    closes it (a hot answer is written whole before ``data_received`` returns, so an
    idle connection is never mid-request)."""

    answer: Callable[[bytes, bytes], tuple[int, bytes]]
    hot: Container[bytes] | Mapping[bytes, int]
    limit: int
    fallback: Any
    request_timeout: float = 0.0
    balancer: Any = None
    """Set by ``kvstream serve --processes N`` (a :class:`~kvstream.service.siblings.Sibling`):
    a connection accepted while this worker holds more than a sibling is passed to it."""
    on_reject: Callable[[int, str], None] = staticmethod(lambda status, code: None)
    forward: Mapping[bytes, Any] = {}
    """Paths answered by an ASGI app in a task (see the module docstring): path -> app."""

    def __init__(self, config: Any, server_state: Any, app_state: Any, _loop: Any = None) -> None:
        self._args = (config, server_state, app_state, _loop)
        self._connections = server_state.connections
        self._tasks = server_state.tasks  # uvicorn's shutdown waits for these, then cancels them
        self._reply: _Reply | None = None  # the forwarded request being answered
        self._read_paused = False  # by a pipeline held while answering
        self._closing = False
        self._idle_s = float(config.timeout_keep_alive)
        self._loop = _loop or asyncio.get_event_loop()
        self._buf = bytearray()
        self._transport: Any = None
        self._idle: Any = None
        self._idle_at = 0.0  # loop time after which an idle connection is closed
        self._write_paused = False
        self._begun: float | None = None  # loop time the partial request in _buf was first seen
        self._deadline: Any = None
        self.adopted = False  # passed by a sibling worker: served here, never passed on
        self._counted = False  # counted in the balancer's table of held connections

    def connection_made(self, transport: Any) -> None:
        b = self.balancer
        if b is not None:
            if not self.adopted and b.offload(transport.get_extra_info("socket")):
                transport.abort()  # the sibling holds the connection now; nothing was read
                return
            b.opened()
            self._counted = True
        self._transport = transport
        self._connections.add(self)
        self._arm_idle()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.balancer.closed()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._reply is not None:  # answering: the next request waits its turn
            if len(self._buf) > HELD_WHILE_ANSWERING and not self._read_paused:
                self._read_paused = True
                self._transport.pause_reading()
            return
        self._serve()

    def _serve(self) -> None:
        buf = self._buf
        t = self._transport
        while buf and not self._write_paused and self._reply is None:
            r = frame_request(buf, self.hot, self.limit)
            if r is None:
                if self._begun is None:  # a partial request: it has request_timeout to finish
                    self._begun = self._loop.time()
                    if self._deadline is None and self.request_timeout > 0:
                        self._deadline = self._loop.call_later(self.request_timeout, self._check_deadline)
                return
            if r is HANDOFF:
                self._handoff()
                return
            path, body, used, keep = r
            app = self.forward.get(path) if self.forward else None
            if app is not None:
                head = bytes(buf[:used - len(body) - 4])
                del buf[:used]
                self._begun = None
                self._start(app, path, head, body, keep)
                return
            del buf[:used]
            self._begun = None
            status, out = self.answer(path, body)
            t.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
                    % (status, _REASON.get(status, b""), len(out), b"" if keep else b"connection: close\r\n", out))
            if not keep:
                t.close()
                return
        if not buf:
            self._arm_idle()

    def _start(self, app: Any, path: bytes, head: bytes, body: bytes, keep: bool) -> None:
        reply = self._reply = _Reply(self, path, body, keep)
        headers = []
        for line in head.split(b"\r\n")[1:]:  # framed: each is a token, a colon and a value
            name, _, value = line.partition(b":")
            headers.append((name.lower(), value.strip(b" \t")))
        p = path.decode("latin-1")
        scope = {"type": "http", "asgi": _ASGI, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": p, "raw_path": path, "query_string": b"", "root_path": "", "headers": headers,
                 "client": None, "server": None, "extensions": {DISCONNECT_EXTENSION: reply.hook}}
        task = self._loop.create_task(app(scope, reply.receive, reply.send))
        self._tasks.add(task)
        task.add_done_callback(self._answered)

    def _answered(self, task: "asyncio.Task[None]") -> None:
        self._tasks.discard(task)
        reply, self._reply = self._reply, None
        failed = None if task.cancelled() else task.exception()
        if failed is not None:
            _log.error("internal error on POST %s", reply.path.decode("latin-1") if reply else "?", exc_info=failed)
        t = self._transport
        if t is None or t.is_closing() or reply is None:
            return
        if not reply.finished:  # cancelled, failed, or ended without a whole answer
            if not reply.started:
                t.write(error_response(503, "shutting_down", "the service is shutting down; retry")
                        if self._closing and failed is None else error_response(500, "internal", "internal error"))
            t.close()
            return
        if not reply.keep or self._closing:
            t.close()
            return
        if self._read_paused:
            self._read_paused = False
            if not self._write_paused:
                t.resume_reading()
        self._serve()

    def _handoff(self) -> None:
        if self._idle is not None:  # the connection's idle time is uvicorn's from here
            self._idle.cancel()
            self._idle = None
        self._cancel_deadline()  # and its request deadline
        self._uncount()  # uvicorn's from here: not one the balancer moves
        proto = self.fallback(*self._args)
        self._connections.discard(self)
        data, self._buf = bytes(self._buf), bytearray()
        t = self._transport
        t.set_protocol(proto)
        proto.connection_made(t)
        if data:
            proto.data_received(data)

    def _arm_idle(self) -> None:
        # One timer per connection, moved lazily: each request only notes the time (a
        # timer made and cancelled per request cost more than the note).
        if self._idle_s > 0 and self._transport is not None:
            self._idle_at = self._loop.time() + self._idle_s
            if self._idle is None:
                self._idle = self._loop.call_later(self._idle_s, self._idle_check)

    def _idle_check(self) -> None:
        self._idle = None
        if self._buf or self._transport is None or self._reply is not None:
            return  # mid-request (re-armed once it is answered) or gone
        left = self._idle_at - self._loop.time()
        if left > 0:
            self._idle = self._loop.call_later(left, self._idle_check)
        else:
            self._close()

    def _check_deadline(self) -> None:
        self._deadline = None
        t = self._transport
        if self._begun is None or not self._buf or t is None or t.is_closing():
            return
        left = self._begun + self.request_timeout - self._loop.time()
        if left > 0 or self._write_paused:  # not yet, or the wait is ours (the client is not reading)
            self._deadline = self._loop.call_later(max(left, 0.05), self._check_deadline)
            return
        self.on_reject(408, "request_timeout")
        t.write(error_response(408, "request_timeout", request_timeout_message(self.request_timeout)))
        t.close()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close(self) -> None:
        self._idle = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._reply is not None:
            self._reply.lost()
        self._uncount()
        self._connections.discard(self)
        self._cancel_deadline()
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close, once a forwarded answer in progress is
        complete (a hot answer is never in progress here)."""
        if self._reply is not None:
            self._closing = True
        else:
            self._close()

    def pause_writing(self) -> None:
        # The client is not reading its answers: stop reading its requests until it does.
        self._write_paused = True
        self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if not self._read_paused:
            self._transport.resume_reading()
        if self._reply is not None:
            self._reply.wake()
        self._serve()


_ASGI = {"version": "3.0", "spec_version": "2.3"}


class _Reply:
    """A forwarded request's ``receive`` and ``send`` over its connection."""

    __slots__ = ("proto", "path", "body", "keep", "hook", "started", "finished", "chunked", "head", "waiter", "gone")

    def __init__(self, proto: FastPathProtocol, path: bytes, body: bytes, keep: bool) -> None:
        self.proto = proto
        self.path = path
        self.body: bytes | None = body
        self.keep = keep
        self.hook = DisconnectHook()
        self.started = self.finished = self.chunked = self.gone = False
        self.head = b""
        self.waiter: asyncio.Future[None] | None = None

    async def receive(self) -> dict[str, Any]:
        body, self.body = self.body, None
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        while not self.gone and not self.finished:  # then only the disconnect
            await self._wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Mapping[str, Any]) -> None:
        t = self.proto._transport
        if self.gone or self.finished or t is None or t.is_closing():
            return  # the client is gone (its hook cancels the work) or the answer is complete
        kind = message["type"]
        if kind == "http.response.start" and not self.started:
            status = int(message["status"])
            lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASON.get(status, b""))]
            length = False
            for k, v in message.get("headers", ()):
                if k.lower() == b"content-length":
                    length = True
                lines += (k, b": ", v, b"\r\n")
            if not length:
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
            if not self.keep:
                lines.append(b"connection: close\r\n")
            lines.append(b"\r\n")
            self.started = True
            if self.chunked:  # a stream's status and headers go out at once
                t.write(b"".join(lines))
            else:  # a whole answer's go out with its body, in one write
                self.head = b"".join(lines)
        elif kind == "http.response.body" and self.started:
            body = message.get("body", b"")
            more = bool(message.get("more_body", False))
            if self.chunked:
                out = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
                if not more:
                    out += b"0\r\n\r\n"
            else:
                out = body
            if self.head:
                out, self.head = self.head + out, b""
            if not more:
                self.finished = True
                self.hook.clear()
            if out:
                t.write(out)
            while self.proto._write_paused and not self.gone:  # the client is not reading: wait
                await self._wait()

    async def _wait(self) -> None:
        self.waiter = w = asyncio.get_running_loop().create_future()
        try:
            await w
        finally:
            self.waiter = None

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def lost(self) -> None:
        self.gone = True
        if not self.finished:
            self.hook.fire()
        self.wake()


def fast_protocol(answer: Callable[[bytes, bytes], tuple[int, bytes]], hot: Iterable[bytes] | Mapping[bytes, int],
                  limit: int, fallback: Any = None, *, request_timeout: float = 0.0,
                  on_reject: Callable[[int, str], None] | None = None, balancer: Any = None,
                  forward: Mapping[bytes, Any] | None = None) -> type[FastPathProtocol]:
    """A :class:`FastPathProtocol` class for ``uvicorn.Config(http=...)``: ``answer(path,
    body) -> (status, body)`` for the paths in ``hot`` (bytes), bodies up to ``limit``
    bytes (``hot`` a mapping path -> bytes: each path's own limit); ``fallback``: uvicorn's
    protocol class for everything else (default: uvicorn's
    choice, httptools when installed, bounded by :func:`kvstream.service.guard.guarded_protocol`);
    ``request_timeout``: seconds a partial request may be held (0: no limit); ``on_reject(status,
    code)``: called for each such refusal; ``balancer``: see :attr:`FastPathProtocol.balancer`;
    ``forward``: path (bytes) -> ASGI app, for paths also in ``hot`` whose answers are
    asynchronous (see the module docstring)."""
    if fallback is None:
        from kvstream.service.guard import guarded_protocol

        fallback = guarded_protocol()
    return type("BoundFastPathProtocol", (FastPathProtocol,),
                {"answer": staticmethod(answer), "hot": dict(hot) if isinstance(hot, Mapping) else frozenset(hot),
                 "limit": limit, "fallback": fallback,
                 "request_timeout": float(request_timeout), "balancer": balancer, "forward": dict(forward or {}),
                 **({"on_reject": staticmethod(on_reject)} if on_reject is not None else {})})
