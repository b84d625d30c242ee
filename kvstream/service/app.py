"""The HTTP layer of ``kvstream serve``: a Starlette app over a :class:`ServiceCore`.

Routes are plain functions that read the body (bounded in bytes), call one core handler
and wrap its bytes in a response; the lifespan owns the :class:`ServiceRuntime` (the
subscriber, the pump, the scraper). Every error a client can cause is a 4xx JSON document
``{"error": {"code", "message", "where"}}``, unknown paths and methods included.

Compose it: :func:`routes` returns the route list, so another app (a proxy, an emulated
engine) can mount the same endpoints beside its own; :func:`create_app` builds the
standalone app: the routing calls (``POST /v1/route``, ``/query``, ``/query_by_hash``)
answered by a lean raw-ASGI layer (:class:`HotRoutes`, no Request object, router or
middleware per call), everything else by Starlette behind it.

::

    core = ServiceCore(config)
    app = create_app(core)            # run with any ASGI server (uvicorn in `kvstream serve`)
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterator, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kvstream.observe.metrics import CONTENT_TYPE
from kvstream.service.core import ServiceCore
from kvstream.service.errors import ApiError
from kvstream.service.runtime import ServiceRuntime

__all__ = ["create_app", "routes", "read_body", "HotRoutes", "JSON"]

log = logging.getLogger("kvstream.service")

JSON = "application/json"


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 :class:`ApiError` past ``limit`` bytes (checked
    against Content-Length first, then while streaming)."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise ApiError(400, "bad_request", f"Content-Length is not a number: {cl[:40]!r}") from None
        if n > limit:
            raise ApiError(413, "too_large", f"the body is {n} bytes; the limit is {limit} (--max-body-bytes)")
    chunks = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise ApiError(413, "too_large", f"the body is over the limit of {limit} bytes (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _error(core: ServiceCore, exc: ApiError, api: str | None) -> Response:
    core.metrics.rejected(api, exc.status, exc.code)
    return Response(exc.body(), exc.status, media_type=JSON)


def _post(core: ServiceCore, handler: Callable[[bytes], bytes], api: str | None,
          check: Callable[[Request], None] | None = None) -> Callable[[Request], Any]:
    limit = core.config.max_body_bytes

    async def endpoint(request: Request) -> Response:
        try:
            if check is not None:
                check(request)
            body = await read_body(request, limit)
            return Response(handler(body), media_type=JSON)
        except ApiError as exc:
            return _error(core, exc, api)
        except ClientDisconnect:  # gone mid-body: nobody to answer, nothing went wrong here
            return Response(b"", 400)

    endpoint.__name__ = getattr(handler, "__name__", "endpoint")
    return endpoint


def routes(core: ServiceCore) -> list[BaseRoute]:
    """Every route of the service over ``core`` (kvstream's API, health, metrics, and the
    Mooncake indexer API)."""
    from kvstream.service.mooncake import MooncakeAPI

    mc = core.mooncake
    if mc is None:  # one registry of Mooncake groups per core, however many apps mount it
        mc = core.mooncake = MooncakeAPI(core)

    async def engines(request: Request) -> Response:
        return Response(core.engines_view(), media_type=JSON)

    async def healthz(request: Request) -> Response:
        status, body = core.healthz()
        return Response(body, status, media_type=JSON)

    async def readyz(request: Request) -> Response:
        status, body = core.readyz()
        return Response(body, status, media_type=JSON)

    async def metrics(request: Request) -> Response:
        text = core.metrics.render()
        for extra in core.metrics_extras:  # the proxy mode's metrics
            text += extra()
        return Response(text, media_type=CONTENT_TYPE)

    async def dump(request: Request) -> Response:
        return Response(core.dump(), media_type="application/msgpack")

    return [
        Route("/v1/route", _post(core, core.route, "route"), methods=["POST"]),
        Route("/v1/engines", engines, methods=["GET"]),
        Route("/v1/dump", dump, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/health", healthz, methods=["GET"]),  # vLLM's name for the same liveness check
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/register", _post(core, mc.register, None, mc.check_token), methods=["POST"]),
        Route("/unregister", _post(core, mc.unregister, None, mc.check_token), methods=["POST"]),
        Route("/query", _post(core, mc.query, "query"), methods=["POST"]),
        Route("/query_by_hash", _post(core, mc.query_by_hash, "query_by_hash"), methods=["POST"]),
    ]


class HotRoutes:
    """An ASGI app answering ``POST`` on a few paths itself and passing every other scope
    (other paths and methods, lifespan, websockets) to ``app``.

    A hot route reads the body (refused with a 413 past ``limit`` bytes, by Content-Length
    first, then while receiving), calls its handler (bytes in, bytes out) and sends the
    answer: the same documents, status codes and metrics as the Starlette routes, without
    the per-call Request, routing and middleware work (about 20 us less per call, measured
    by calling both ASGI apps in-process on a loaded 2-core machine).

    Args:
        app: the ASGI app for everything else.
        core: its counters count rejections.
        hot: path -> (handler, api name for the metrics).
        limit: bytes.
    """

    __slots__ = ("app", "core", "hot", "limit")

    def __init__(self, app: Any, core: ServiceCore, hot: dict[str, tuple[Callable[[bytes], bytes], str]],
                 limit: int) -> None:
        self.app = app
        self.core = core
        self.hot = hot
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.hot.get(scope["path"])
            if route is not None:
                await self._answer(route, scope, receive, send)
                return
        await self.app(scope, receive, send)

    def answer(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        """``(status, JSON body)`` of a ``POST`` to hot ``path`` with ``body`` (bytes, within
        the limit): what the ASGI call sends, for :mod:`kvstream.service.fastpath`."""
        route = self.hot[path.decode("latin-1")]
        try:
            return 200, route[0](body)
        except Exception as exc:  # noqa: BLE001 - ApiError: a 4xx; a bug: a 500, logged
            return self._failed(route, exc, path)

    def _failed(self, route: tuple[Callable[[bytes], bytes], str], exc: Exception, path: Any) -> tuple[int, bytes]:
        if isinstance(exc, ApiError):
            self.core.metrics.rejected(route[1], exc.status, exc.code)
            return exc.status, exc.body()
        p = path.decode("latin-1") if isinstance(path, bytes) else path
        log.error("internal error on POST %s", p, exc_info=exc)
        return 500, ApiError(500, "internal", f"internal error: {type(exc).__name__}").body()

    async def _answer(self, route: tuple[Callable[[bytes], bytes], str], scope: Any, receive: Any,
                      send: Any) -> None:
        handler = route[0]
        status = 200
        try:
            body = await self._body(scope, receive)
            if body is None:
                return  # the client went away
            out = handler(body)
        except Exception as exc:  # noqa: BLE001 - ApiError: a 4xx; a bug: a 500, logged
            status, out = self._failed(route, exc, scope["path"])
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    async def _body(self, scope: Any, receive: Any) -> bytes | None:
        limit = self.limit
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    raise ApiError(400, "bad_request",
                                   f"Content-Length is not a number: {v[:40].decode('latin-1')!r}") from None
                if n > limit:
                    raise ApiError(413, "too_large", f"the body is {n} bytes; the limit is {limit} (--max-body-bytes)")
                break
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        body: bytes = msg.get("body", b"")
        if not msg.get("more_body", False):  # the usual case: one message
            if len(body) > limit:
                raise ApiError(413, "too_large", f"the body is over the limit of {limit} bytes (--max-body-bytes)")
            return body
        chunks = [body]
        total = len(body)
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return None
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise ApiError(413, "too_large", f"the body is over the limit of {limit} bytes (--max-body-bytes)")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)


def create_app(core: ServiceCore, *, runtime: bool = True, extra_routes: Sequence[BaseRoute] = (),
               **subscriber_options: Any) -> HotRoutes:
    """The standalone app (:class:`HotRoutes` over Starlette). ``runtime``: the lifespan runs
    a :class:`ServiceRuntime` for ``core`` (False: the caller runs one, or none, e.g. a test
    of the HTTP layer alone). ``extra_routes``: more routes (the proxy mode's OpenAI API).
    ``subscriber_options`` go to the runtime's subscriber."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not runtime:
            yield
            return
        t0 = time.monotonic()
        try:
            async with ServiceRuntime(core, **subscriber_options):
                log.info("following %d engine(s)", len(core.engines),
                         extra={"engines": sorted(core.engines), "startup_s": round(time.monotonic() - t0, 3)})
                yield
        except Exception as exc:  # noqa: BLE001 - a task of the runtime failed: nothing follows the engines now
            log.critical("the event stream runtime stopped on an error; the index no longer follows the engines",
                         exc_info=exc)
            core.fail(f"the event stream runtime stopped: {type(exc).__name__}: {exc}"[:500])
            raise

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            msg += "; paths: /v1/route, /v1/engines, /v1/dump, /healthz (or /health), /readyz, /metrics, /register, " \
                   "/unregister, /query, /query_by_hash"
        return _error(core, ApiError(exc.status_code, code, msg), None)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return Response(ApiError(500, "internal", f"internal error: {type(exc).__name__}").body(), 500,
                        media_type=JSON)

    app = Starlette(routes=routes(core) + list(extra_routes), lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: internal_error})
    mc = core.mooncake
    return HotRoutes(app, core, {"/v1/route": (core.route, "route"), "/query": (mc.query, "query"),
                                 "/query_by_hash": (mc.query_by_hash, "query_by_hash")}, core.config.max_body_bytes)
