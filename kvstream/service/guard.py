"""Bounds and JSON errors for uvicorn's HTTP/1.1 protocol, as ``kvstream serve`` runs it.

uvicorn's httptools protocol answers a request that is not HTTP with a ``text/plain``
"Invalid HTTP request received.", and bounds neither the request head nor pipelining:
measured on this machine, one connection streaming a header line without end grew the
process by 200 MB for 123 MB sent, one streaming chunked-body trailers by 500 MB, and 6 MB
of pipelined ``GET`` s that the client never read the answers of queued 150 k requests
(+270 MB). :func:`guarded_protocol` makes a subclass of uvicorn's protocol that

* answers malformed HTTP with the service's JSON error (``bad_http``, 400, naming the
  parser's reason) and closes the connection;
* refuses (431 ``too_large``) a connection that sends more than ``max_head_bytes`` without
  the parser getting anywhere (no head completed, no body byte, no request completed): an
  endless request line, header or trailer;
* feeds the parser at most ``max_pipeline`` requests ahead of the one being answered:
  past that it keeps the bytes already read (at most one socket read) and stops reading
  the socket until answers go out, so a client that pipelines without reading its answers
  is held back by TCP instead of queued in memory;
* answers (408 ``request_timeout``) and closes a connection that holds a partial request
  (a head or body begun, not finished) for more than ``request_timeout`` seconds: a client
  that opens a request and trickles it, or stops, does not hold the connection forever.

Each request's scope carries a :class:`DisconnectHook` under
``scope["extensions"]["kvstream.disconnect"]`` (:data:`DISCONNECT_EXTENSION`): the app may
register one callback there, called once if the connection is lost before the request's
answer is complete. The proxy cancels its request with it instead of keeping a task per
request waiting on ``receive()`` for the disconnect.

A write to a connection the client already reset is dropped instead of raising (uvloop)
in the middle of an answer. Each refusal is reported to ``on_reject(status, code)`` (the service counts it in
``kvstream_http_rejections_total``). uvicorn's h11 protocol (used when httptools is not
installed) already bounds heads (16 KiB) and pipelining; its subclass only answers in JSON.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import msgspec

__all__ = ["MAX_HEAD_BYTES", "MAX_PIPELINE", "REQUEST_TIMEOUT_S", "DISCONNECT_EXTENSION", "DisconnectHook",
           "guarded_protocol", "error_response", "request_timeout_message"]

MAX_HEAD_BYTES = 64 * 1024
"""Bytes a connection may send without the parser completing anything (a head, a trailer)."""

MAX_PIPELINE = 16
"""Requests parsed ahead of the one being answered on one connection."""

REQUEST_TIMEOUT_S = 60.0
"""Seconds a connection may hold a partial request (head or body) before a 408."""

DISCONNECT_EXTENSION = "kvstream.disconnect"
"""The scope extension (``scope["extensions"][...]``) holding a request's :class:`DisconnectHook`."""

_log = logging.getLogger("kvstream.service")
_SLICE = 4096  # bytes fed to the parser at a time while checking the pipeline bound
_ENC = msgspec.json.Encoder()
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            500: b"Internal Server Error", 503: b"Service Unavailable"}


def error_response(status: int, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 response carrying the service's JSON error, closing the connection."""
    body = _ENC.encode({"error": {"code": code, "message": message, "where": None}})
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS.get(status, b""), len(body), body))


def request_timeout_message(seconds: float) -> str:
    """The 408 ``request_timeout`` message for a request not received whole in time."""
    return f"the request was not received whole within {seconds:g} s (--request-timeout)"


def _no_report(status: int, code: str) -> None:
    return None


def guarded_protocol(base: Any = None, *, on_reject: Callable[[int, str], None] | None = None,
                     max_head_bytes: int = MAX_HEAD_BYTES, max_pipeline: int = MAX_PIPELINE,
                     request_timeout: float = REQUEST_TIMEOUT_S) -> Any:
    """A subclass of uvicorn's HTTP protocol class ``base`` (default: uvicorn's choice,
    httptools when installed, else h11) for ``uvicorn.Config(http=...)``, with the bounds
    and JSON errors of the module docstring. ``max_head_bytes``: bytes; ``max_pipeline``:
    requests; ``request_timeout``: seconds (httptools only; 0: none)."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    report = on_reject or _no_report
    tools: Any = None
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as tools
    except ImportError:  # pragma: no cover - httptools is not installed
        pass
    if tools is not None and issubclass(base, tools):
        missing = [m for m in _HTTPTOOLS_HOOKS if not callable(getattr(base, m, None))]
        if not missing:
            return type("GuardedHttpToolsProtocol", (_GuardedHttpTools, base),
                        {"_report": staticmethod(report), "_max_head": max_head_bytes, "_max_pipeline": max_pipeline,
                         "_request_timeout": float(request_timeout)})
        # Another uvicorn than the ones this was written against: serve unguarded rather
        # than break every connection, and say so.
        _log.warning("uvicorn %s's httptools protocol lacks %s: HTTP head, pipelining and request-time bounds "
                     "are off", _uvicorn_version(), ", ".join(missing))
    if not callable(getattr(base, "send_400_response", None)):
        _log.warning("uvicorn %s's protocol lacks send_400_response: malformed HTTP gets uvicorn's own answer",
                     _uvicorn_version())
        return base
    return type("GuardedHttpProtocol", (_JsonErrors, base), {"_report": staticmethod(report)})


_HTTPTOOLS_HOOKS = ("connection_made", "connection_lost", "data_received", "send_400_response", "on_message_begin",
                    "on_headers_complete", "on_body", "on_message_complete", "on_response_complete",
                    "_unset_keepalive_if_required")
"""The methods of uvicorn's ``HttpToolsProtocol`` that :class:`_GuardedHttpTools` overrides or
calls (checked when the protocol class is made)."""


def _uvicorn_version() -> str:
    try:
        import uvicorn

        return str(uvicorn.__version__)
    except (ImportError, AttributeError):  # pragma: no cover
        return "?"


class _ClosedSafe:
    """The connection's transport, for uvicorn's protocol and its request cycles: a write
    after the transport closed (the client reset the connection, and uvicorn has not yet
    been told) is dropped, as asyncio's own transports do; uvloop's raise RuntimeError,
    which uvicorn reported as an exception in the application."""

    __slots__ = ("_t",)

    def __init__(self, transport: Any) -> None:
        self._t = transport

    def write(self, data: bytes) -> None:
        if not self._t.is_closing():
            self._t.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


class DisconnectHook:
    """One request's disconnect notice: :meth:`set` a callback (called at once if the
    connection is already gone), :meth:`clear` it once the request is done; the server
    calls :meth:`fire` when the connection is lost before the answer is complete."""

    __slots__ = ("_callback", "gone")

    def __init__(self) -> None:
        self._callback: Callable[[], None] | None = None
        self.gone = False
        """Whether the connection was lost before the answer was complete."""

    def set(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when the connection is lost; now if it already is."""
        if self.gone:
            callback()
        else:
            self._callback = callback

    def clear(self) -> None:
        """No callback any more (the request is done)."""
        self._callback = None

    def fire(self) -> None:
        """The connection is lost (the server calls this)."""
        self.gone = True
        cb, self._callback = self._callback, None
        if cb is not None:
            cb()


class _JsonErrors:
    """uvicorn's 400 for a request it cannot parse, as the service's JSON error; writes
    after a reset dropped (:class:`_ClosedSafe`)."""

    transport: Any
    _report: Callable[[int, str], None]

    def connection_made(self, transport: Any) -> None:
        super().connection_made(_ClosedSafe(transport))  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "bad_http", f"not a valid HTTP/1.1 request: {msg}")

    def _refuse(self, status: int, code: str, message: str) -> None:
        self._report(status, code)
        if not self.transport.is_closing():
            self.transport.write(error_response(status, code, message))
            self.transport.close()


class _GuardedHttpTools(_JsonErrors):
    """Mixed in front of uvicorn's ``HttpToolsProtocol`` (see the module docstring)."""

    _max_head: int
    _max_pipeline: int
    _request_timeout: float
    parser: Any
    pipeline: Any
    flow: Any
    loop: Any
    cycle: Any
    scope: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stalled = 0  # bytes fed since the parser last completed something
        self._progress = False
        self._held = b""  # bytes read but not yet fed, while the pipeline is full
        self._begun: float | None = None  # loop time the request being parsed began
        self._deadline: Any = None  # one timer, moved lazily (see _check_deadline)
        self._hooks: list[DisconnectHook] = []  # of the requests begun and not yet answered, in order

    def on_message_begin(self) -> None:
        self._begun = self.loop.time()
        if self._deadline is None and self._request_timeout > 0:
            self._deadline = self.loop.call_later(self._request_timeout, self._check_deadline)
        super().on_message_begin()  # type: ignore[misc]
        hook = DisconnectHook()
        self._hooks.append(hook)
        self.scope["extensions"] = {DISCONNECT_EXTENSION: hook}

    def _check_deadline(self) -> None:
        self._deadline = None
        if self._begun is None or self.transport.is_closing():
            return
        left = self._begun + self._request_timeout - self.loop.time()
        if left > 0 or self._held or self.flow.read_paused:
            # Not yet, or the wait is ours (the pipeline is full, the app reads slowly).
            self._deadline = self.loop.call_later(max(left, 0.05), self._check_deadline)
        elif self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.close()  # this request's answer is already going out: no second head
        else:
            self._refuse(408, "request_timeout", request_timeout_message(self._request_timeout))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)  # type: ignore[misc]
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.fire()

    # The parser got somewhere: a head, body bytes, a whole request.
    def on_headers_complete(self) -> None:
        self._progress = True
        super().on_headers_complete()  # type: ignore[misc]

    def on_body(self, body: bytes) -> None:
        self._progress = True
        super().on_body(body)  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._progress = True
        self._begun = None
        super().on_message_complete()  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._held:  # still holding: keep this read too, and stop reading
            self._held += data
            self.transport.pause_reading()
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        import httptools

        self._unset_keepalive_if_required()  # type: ignore[attr-defined]
        n = len(data)
        at = 0
        while at < n:
            if len(self.pipeline) >= self._max_pipeline:
                self._held = data[at:]
                self.transport.pause_reading()
                return
            piece = data if n <= _SLICE else data[at:at + _SLICE]
            at += len(piece)
            self._progress = False
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():  # type: ignore[attr-defined]
                    self.handle_websocket_upgrade()  # type: ignore[attr-defined]
                else:
                    self._unsupported_upgrade_warning()  # type: ignore[attr-defined]
                return
            except httptools.HttpParserError as exc:
                self._refuse(400, "bad_http", f"not a valid HTTP/1.1 request: {exc}")
                return
            if self._progress:
                self._stalled = 0
            else:
                self._stalled += len(piece)
                if self._stalled > self._max_head:
                    self._refuse(431, "too_large", f"the request head or trailer is over {self._max_head} bytes")
                    return

    def on_response_complete(self) -> None:
        if self._hooks:  # answers complete in request order (HTTP/1.1)
            del self._hooks[0]
        super().on_response_complete()  # type: ignore[misc]
        if not self._held or self.transport.is_closing():
            return
        if len(self.pipeline) < self._max_pipeline:
            held, self._held = self._held, b""
            self._feed(held)
        if self._held:  # uvicorn's flow control may have resumed reading: hold it back
            self.transport.pause_reading()
        elif not self.flow.read_paused:
            self.transport.resume_reading()
