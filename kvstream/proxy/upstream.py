"""The proxy's HTTP client to its engines: aiohttp's connection pool, one per engine.

Each engine gets an :class:`UpstreamPool`: an ``aiohttp.ClientSession`` whose connector
keeps idle keep-alive connections for at most ``keepalive_s`` seconds, below the idle
timeout engines close them after (vLLM and ``kvstream engine`` serve with uvicorn's
5 s), so a connection is not reused when the engine is about to close it. aiohttp reads
every idle connection, so one the engine closed anyway is dropped from the pool as soon as
its FIN arrives.

What remains is the race where the engine closes an idle connection just as the proxy
sends on it: the request fails with no byte of an answer (aiohttp's
``ServerDisconnectedError``, or a reset). The engine never took that request, so it is sent
once more on a *new* connection (never another pooled one, which the engine may have
closed too). Only if that fails as well is it an :class:`UpstreamError`; an engine that
refuses the connection (nothing listens) is one at once.

:class:`UpstreamError` means the engine could not be reached or dropped the connection;
``before_response`` says whether any of its answer had arrived (only then is a retry on
another engine safe).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import aiohttp
from yarl import URL

__all__ = ["UpstreamError", "UpstreamPool", "UpstreamResponse", "KEEPALIVE_S"]

KEEPALIVE_S = 4.0
"""Longest an idle connection to an engine is kept (seconds): under the 5 s after which
vLLM's server (uvicorn's ``timeout_keep_alive``) closes it."""

_READ_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


class UpstreamError(Exception):
    """The engine refused, timed out or dropped the connection."""

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class UpstreamResponse:
    """A response whose status and headers have arrived; read the body with
    :meth:`aiter_bytes` or :meth:`read`, then :meth:`aclose` (always).

    ``headers``: the engine's header lines as ``(name, value)`` bytes pairs, as sent.
    """

    __slots__ = ("status_code", "headers", "_resp", "_where", "_done")

    def __init__(self, resp: aiohttp.ClientResponse, where: str) -> None:
        self.status_code = resp.status
        self.headers: tuple[tuple[bytes, bytes], ...] = resp.raw_headers
        self._resp = resp
        self._where = where
        self._done = False

    @property
    def content_length(self) -> int | None:
        """The engine's ``Content-Length`` (bytes), None if it did not send one."""
        return self._resp.content_length

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives (whatever the socket delivered since the last read)."""
        content = self._resp.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    break
                yield data
        except _READ_ERRORS as exc:
            raise UpstreamError(f"{self._where} dropped the connection: {exc or type(exc).__name__}",
                                before_response=False) from None
        self._done = True

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
        """Return the connection to the pool if the whole body was read, else close it
        (an engine closing a streamed request aborts it, as vLLM does)."""
        if self._done:
            self._resp.release()
        else:
            self._resp.close()


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
        self._where = f"{host}:{port}"
        self._base = f"http://{host}:{port}"
        self._urls: dict[str, URL] = {}
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self.fresh_retries = 0
        """Requests sent again on a new connection after the engine closed a pooled one."""

    def _new_session(self, *, force_close: bool) -> aiohttp.ClientSession:
        # No connection limit (the proxy's own bounds hold requests back); small writes
        # (one SSE event) go out at once (aiohttp sets TCP_NODELAY); no cookies, no
        # decompression (bodies pass through as the engine sent them).
        if force_close:
            conn = aiohttp.TCPConnector(limit=0, force_close=True, use_dns_cache=False)
        else:
            conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s, use_dns_cache=False)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s, sock_read=None)
        return aiohttp.ClientSession(connector=conn, timeout=timeout, auto_decompress=False,
                                     cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent",),
                                     raise_for_status=False)

    async def aclose(self) -> None:
        """Close every connection."""
        for s in (self._session, self._fresh):
            if s is not None:
                await s.close()
        self._session = self._fresh = None

    async def request(self, method: str, target: str, body: bytes, headers: list[tuple[bytes, bytes]]
                      ) -> UpstreamResponse:
        """Send one request; returns once the status line and headers arrived. Raises
        :class:`UpstreamError` (``before_response=True``) if that did not happen."""
        session = self._session
        if session is None or session.closed:
            session = self._session = self._new_session(force_close=False)
        url = self._urls.get(target)
        if url is None:  # parsed once per path (a handful), not per request
            if len(self._urls) > 64:
                self._urls.clear()
            url = self._urls[target] = URL(self._base + target)
        hdrs = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        try:
            resp = await session.request(method, url, data=body or None, headers=hdrs, allow_redirects=False)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):  # nothing listens: a real failure
                raise UpstreamError(f"cannot connect to {self._where}: {exc}", before_response=True) from None
            # The engine closed the connection before any byte of an answer: it never took
            # the request. Send it once more on a new connection.
            self.fresh_retries += 1
            fresh = self._fresh
            if fresh is None or fresh.closed:
                fresh = self._fresh = self._new_session(force_close=True)
            try:
                resp = await fresh.request(method, url, data=body or None, headers=hdrs, allow_redirects=False)
            except _READ_ERRORS as exc2:
                raise UpstreamError(f"{self._where} closed the connection before answering: "
                                    f"{exc2 or type(exc2).__name__}", before_response=True) from None
        except _READ_ERRORS as exc:
            raise UpstreamError(f"cannot reach {self._where}: {exc or type(exc).__name__}",
                                before_response=True) from None
        return UpstreamResponse(resp, self._where)
