"""The KV-aware OpenAI-compatible proxy: a Starlette app over a :class:`~kvstream.router.Router`.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are tokenized locally
(:mod:`kvstream.proxy.tokenize`; ``prompt`` token ids need no tokenizer), scored against
every engine's cached prefixes and the requests in flight, and forwarded to the best
engine over kept-alive HTTP/1.1 connections (:mod:`kvstream.proxy.upstream`). Streaming responses are passed through event by event as they arrive;
other responses as they are; the engine's status code and error body come back unchanged.
Every proxied response carries ``x-kvstream-engine: NAME``.

If an engine refuses or drops the connection before answering, the request goes to the
next-best engine (at most ``max_attempts`` engines), the failed engine is marked down for
an exponential backoff and its source is marked stale in the index (its cache is unknown
until its stream resets it).

Routing accuracy: for each answered request, the router's predicted cached tokens on the
chosen engine against the engine's ``usage.prompt_tokens_details.cached_tokens``
(histograms on ``/metrics``, totals on ``/v1/engines``). For a streaming request that did
not ask for usage, the proxy asks the engine for it (``stream_options.include_usage``)
and drops that extra usage chunk from what the client sees.

Other routes: ``GET /v1/models`` (forwarded to an engine that is up), ``GET /v1/engines``,
``GET /metrics``, ``GET /health``. :class:`KVProxy` is an ``async with`` resource; its
``app`` can be served alone (``python -m kvstream.proxy``) or mounted in another Starlette app.
"""

from __future__ import annotations

import time
from typing import Any, AsyncGenerator, Container, Mapping, Sequence
from urllib.parse import urlsplit

import anyio
import msgspec

from kvstream.routing.index import KVIndex
from kvstream.proxy.backends import RouterBackend, RoutingBackend, ServiceBackend
from kvstream.proxy.core import ProxyCore, Upstream
from kvstream.proxy.openai import OpenAIError, error_body, parse_json_body, prompt_token_ids
from kvstream.proxy.tokenize import PromptTokenizer
from kvstream.proxy.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from kvstream.routing.router import Router
from kvstream.routing.scoring import PrefixLoadPolicy
from kvstream.transport.subscriber import SourceSpec

__all__ = ["KVProxy", "POLICIES", "ENGINE_HEADER"]

ENGINE_HEADER = "x-kvstream-engine"
"""Response header naming the engine that served a proxied request."""

POLICIES = ("kv-aware", "round-robin")
"""Routing policies: by cached prefix and load, or the round-robin baseline."""

MAX_BODY_BYTES = 16 << 20
"""Largest request body the standalone proxy takes (bytes; ``serve --proxy``: ``--max-body-bytes``)."""
MAX_ANSWER_BYTES = 64 << 20
"""Largest non-streamed engine answer the proxy holds to pass on (bytes; a 502 beyond)."""
_MAX_EVENT_BYTES = 1 << 20  # the most one SSE event may buffer before it is passed on as is
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "date", "server"}


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import Response

    return Response(_enc.encode(body), status_code=status, media_type="application/json", headers=headers)


def _check_url(name: str, url: str) -> Any:
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"engine {name}: base URL {url!r} must be http://HOST:PORT[/PATH]")
    return u


def _cached_tokens(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and type(details.get("cached_tokens")) is int:
        return int(details["cached_tokens"])
    return None


class KVProxy:
    """The proxy. ``async with KVProxy(...) as proxy:`` then serve ``proxy.app``.

    Args:
        upstreams: the engines (HTTP base URL and KV event endpoints).
        tokenizer: for text prompts and chat templates; None routes text prompts by load
            only (token-id prompts are always routed by prefix).
        block_size: the engines' KV block size (tokens); the router index uses it.
        policy: ``"kv-aware"`` (default) or ``"round-robin"``.
        speculate_s: if set, the chosen engine is assumed to hold the routed prompt for
            this many seconds, until its real ``BlockStored`` events arrive.
        max_attempts: engines tried per request on connection failures.
        backoff_s: first mark-down of a failed engine (seconds; doubles per failure).
        connect_timeout_s: seconds to open a connection to an engine.
        max_body_bytes: largest request body (bytes; 413 beyond).
    """

    def __init__(self, upstreams: Sequence[Upstream], *, tokenizer: PromptTokenizer | None = None,
                 block_size: int = 16, policy: str = "kv-aware", speculate_s: float | None = None,
                 max_attempts: int = 3, backoff_s: float = 1.0, connect_timeout_s: float = 2.0,
                 subscriber_options: dict[str, Any] | None = None,
                 backend: RoutingBackend | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.core = ProxyCore(upstreams, backoff_s=backoff_s, max_attempts=max_attempts)
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.policy = policy
        self.speculate = speculate_s is not None
        for u in upstreams:
            _check_url(u.name, u.base_url)
        if backend is None:
            specs = [SourceSpec(u.events, u.replay, name=u.name) for u in upstreams if u.events]
            scoring = PrefixLoadPolicy()
            router = Router(specs, index=KVIndex(router_block_size=block_size), policy=scoring,
                            speculative_ttl_s=speculate_s, **(subscriber_options or {}))
            for u in upstreams:  # engines without a stream still get routed (by load)
                router.index.add_source(u.name)
            backend = RouterBackend(router, {u.name: u.base_url for u in upstreams}, scoring)
        self.backend = backend
        self._connect_timeout_s = connect_timeout_s
        self.max_body_bytes = max_body_bytes
        self._pools: dict[str, tuple[str, UpstreamPool, str]] = {}
        self._metrics = _Metrics()
        self.app = self._build_app()

    @classmethod
    def for_service(cls, core: Any, *, tokenizer: PromptTokenizer | None = None, policy: str = "kv-aware",
                    speculate: bool = False, max_attempts: int = 3, backoff_s: float = 1.0,
                    connect_timeout_s: float = 2.0) -> "KVProxy":
        """The proxy mode of ``kvstream serve``: route with the service's core (its default
        index, weights and load board) and forward to its engines' ``http=`` URLs. The
        service runs the subscriber; mount :meth:`openai_routes` in its app, add
        :meth:`engine_view` to its ``/v1/engines`` and :meth:`metrics_text` to its
        ``/metrics``, and hold ``async with proxy`` while serving (it closes the pools).
        Request bodies are bounded by the service's ``--max-body-bytes``."""
        proxy = cls([], tokenizer=tokenizer, block_size=core.config.router_block_size, policy=policy,
                    speculate_s=core.config.speculate_ttl if speculate else None, max_attempts=max_attempts,
                    backoff_s=backoff_s, connect_timeout_s=connect_timeout_s, backend=ServiceBackend(core),
                    max_body_bytes=core.config.max_body_bytes)
        return proxy

    async def __aenter__(self) -> "KVProxy":
        await self.backend.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.backend.__aexit__(*exc)
        finally:
            for _, pool, _ in self._pools.values():
                await pool.aclose()

    @property
    def router(self) -> Any:
        """The standalone proxy's :class:`Router` (None in the service's proxy mode)."""
        return getattr(self.backend, "router", None)

    def _sync_upstreams(self) -> Mapping[str, str]:
        urls = self.backend.upstreams()
        for name, url in urls.items():
            self.core.ensure(name, url)
        return urls

    def _pool(self, name: str) -> tuple[UpstreamPool, str]:
        url = self.core.engines[name].upstream.base_url
        hit = self._pools.get(name)
        if hit is None or hit[0] != url:
            u = _check_url(name, url)
            pool = UpstreamPool(u.hostname or "", u.port or 80, connect_timeout_s=self._connect_timeout_s)
            hit = (url, pool, u.path.rstrip("/"))
            self._pools[name] = hit
        return hit[1], hit[2]

    def engine_view(self, name: str) -> dict[str, Any]:
        """The proxy's part of ``name``'s ``/v1/engines`` entry (in flight, failures,
        mark-down, routing accuracy): ``{"proxy": {...}}``, or ``{}`` if never proxied to."""
        v = self.core.engine_view(name, time.monotonic())
        return {"proxy": v} if v else {}

    def metrics_text(self) -> bytes:
        """The proxy's Prometheus metrics (accuracy histograms, in flight, requests, failovers)."""
        return self._metrics.render(self.core)

    # -- for a front end of another kind (kvstream.gateway's ext_proc endpoint picker) -----

    def pick(self, body: dict[str, Any], kind: str | None,
             allowed: Container[str] | None = None) -> tuple[list[str], dict[str, int]]:
        """Engines to try for an OpenAI request ``body`` (``kind``: ``"completions"`` or
        ``"chat"``; None: by load only), best first and at most ``max_attempts``, with the
        cached prompt tokens predicted per engine; ``allowed``: only these engines.
        Raises :class:`OpenAIError` (400) for a body that is no such request."""
        candidates, predicted = self._route(body, kind, allowed)
        if allowed is not None:  # the round-robin baseline ranks every engine
            candidates = [n for n in candidates if n in allowed]
        return candidates, predicted

    def upstream_urls(self) -> Mapping[str, str]:
        """Engines requests may go to: name -> HTTP base URL."""
        return self._sync_upstreams()

    def request_started(self, name: str) -> None:
        """A request another front end sent went to ``name`` (counted in flight)."""
        self._started(name)

    def request_ended(self, name: str, status: int | None, predicted: int | None, realized: int | None) -> None:
        """That request ended: ``status`` None if no answer was seen (counted as neither
        answered nor failed); else counted with its routing accuracy like a proxied one."""
        self._finished(name)
        if status is None:
            return
        self._metrics.requests[(name, status)] = self._metrics.requests.get((name, status), 0) + 1
        self._answered(name, predicted, realized)

    def request_failed(self, name: str, reason: str) -> None:
        """``name`` refused or dropped a request another front end sent: marked down and
        its index stale, as on a failed connection of the proxy's own."""
        self.core.failed(name, reason[:300], time.monotonic())
        self.backend.mark_failed(name)

    # -- routes ---------------------------------------------------------------------------

    def _build_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        return self.asgi(Starlette(routes=self.routes()))

    def openai_routes(self) -> list[Any]:
        """The OpenAI-compatible routes alone (``/v1/completions``, ``/v1/chat/completions``,
        ``/v1/models``): what another service adds to its own app to proxy requests."""
        from starlette.routing import Route

        return [
            Route("/v1/completions", _Endpoint(self, "/v1/completions", "completions"), methods=["POST"]),
            Route("/v1/chat/completions", _Endpoint(self, "/v1/chat/completions", "chat"), methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ]

    def routes(self) -> list[Any]:
        """Every route of the standalone proxy: :meth:`openai_routes` plus ``/v1/engines``,
        ``/metrics`` and ``/health``."""
        from starlette.routing import Route

        return self.openai_routes() + [
            Route("/v1/engines", self._engines, methods=["GET"]),
            Route("/metrics", self._prom, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
        ]

    async def _health(self, request: Any) -> Any:
        now = time.monotonic()
        up = [n for n in self.core.engines if not self.core.is_down(n, now)]
        return _json(200 if up else 503, {"status": "ok" if up else "no engine is up", "engines_up": len(up)})

    async def _engines(self, request: Any) -> Any:
        self._sync_upstreams()
        view = {n: self.backend.stream_view(n) for n in self.core.engines}
        return _json(200, self.core.view(time.monotonic(), view))

    async def _prom(self, request: Any) -> Any:
        from starlette.responses import Response

        return Response(self.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _models(self, request: Any) -> Any:
        from starlette.responses import Response

        for name in self.core.candidates(list(self._sync_upstreams()), time.monotonic()):
            pool, prefix = self._pool(name)
            try:
                r = await pool.request("GET", prefix + "/v1/models", b"", [])
                try:
                    content = await r.read()
                finally:
                    await r.aclose()
            except UpstreamError as exc:
                self._failed(name, exc)
                continue
            return Response(content, status_code=r.status_code, media_type="application/json",
                            headers={ENGINE_HEADER: name})
        return _json(503, error_body(503, "no engine is reachable"))

    def asgi(self, app: Any) -> Any:
        """``app`` with the proxy's POST routes (``/v1/completions``, ``/v1/chat/completions``)
        answered in front of it in raw ASGI (no Request object, router or middleware per
        call); every other scope goes to ``app``."""
        return _ProxyRoutes(self, app)

    # -- proxying -------------------------------------------------------------------------

    def _failed(self, name: str, exc: BaseException) -> None:
        self.core.failed(name, f"{type(exc).__name__}: {exc}"[:300], time.monotonic())
        self.backend.mark_failed(name)

    def _started(self, name: str) -> None:
        self.core.started(name)
        self.backend.started(name)

    def _finished(self, name: str) -> None:
        self.core.finished(name)
        self.backend.finished(name)

    def _route(self, body: dict[str, Any], kind: str | None,
               allowed: Container[str] | None = None) -> tuple[list[str], dict[str, int]]:
        """Candidates best first, and per engine the predicted cached prompt tokens
        (``kind`` None: by load only; ``allowed``: only these engines)."""
        tokens: list[int] | None = None
        try:
            if kind is not None:
                tokens = prompt_token_ids(body, kind, self.tokenizer)
        except OpenAIError:
            if self.tokenizer is not None:
                raise
            tokens = None  # a text prompt without a tokenizer: route by load only
        urls = self._sync_upstreams()
        if allowed is not None:
            urls = {n: u for n, u in urls.items() if n in allowed}
        loads = self.backend.loads() or self.core.loads()
        predicted: dict[str, int] = {}
        ranking: list[str]
        if tokens:
            res = self.backend.score(tokens, loads, self.policy == "kv-aware" and self.speculate)
            # The engine never reuses the prompt's last token: its hit is capped below it.
            cap = (len(tokens) - 1) // self.block_size * self.block_size
            predicted = {n: min(m.tokens, cap) for n, m in res.matches.items()}
            ranking = [n for n in res.ranking if n in urls]
        else:
            ranking = sorted(urls, key=lambda n: loads[n].running if n in loads else 0)
        if self.policy == "round-robin":
            ranking = self.core.round_robin()
        else:
            ranking = ranking + [n for n in urls if n not in ranking]
        return self.core.candidates(ranking, time.monotonic()), predicted

    async def _proxy(self, scope: Any, receive: Any, send: Any, path: str, kind: str) -> None:
        """Answer one OpenAI POST in raw ASGI: the engine's status and headers go out as soon
        as they arrive, then its body (streamed event by event, or whole)."""
        try:
            raw = await _asgi_body(scope, receive, self.max_body_bytes)
            if raw is None:
                return  # the client went away
            body = parse_json_body(raw, self.max_body_bytes)
            candidates, predicted = self._route(body, kind)
        except OpenAIError as exc:
            await _send_json(send, exc.status, exc.body())
            return
        stream = bool(body.get("stream"))
        strip_usage = False
        if stream:
            opts = body.get("stream_options")
            if not (isinstance(opts, dict) and opts.get("include_usage")):
                body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                strip_usage = True
        payload = _enc.encode(body)
        headers = [(b"content-type", b"application/json")]
        for k, v in scope["headers"]:
            if k == b"authorization":
                if v:
                    headers.append((b"authorization", v))
                break
        # The client may go away at any point (while the engine thinks, or mid-stream):
        # then everything below is cancelled, the engine's connection closed (vLLM aborts
        # the request) and its in-flight count goes back down.
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
            await self._forward(send, path, candidates, predicted, payload, headers, stream, strip_usage)
            tg.cancel_scope.cancel()

    async def _forward(self, send: Any, path: str, candidates: list[str], predicted: dict[str, int], payload: bytes,
                       headers: list[tuple[bytes, bytes]], stream: bool, strip_usage: bool) -> None:
        errors: list[str] = []
        for attempt, name in enumerate(candidates):
            pool, prefix = self._pool(name)
            self._started(name)
            sent = False
            try:
                resp = await pool.request("POST", prefix + path, payload, headers)
                sent = True
            except UpstreamError as exc:
                self._failed(name, exc)
                errors.append(f"{name}: {type(exc).__name__}")
                if attempt + 1 < len(candidates):
                    self.core.failovers += 1
                continue
            finally:
                if not sent:
                    self._finished(name)
            engine = name.encode("latin-1")
            out_headers = [(k.lower(), v) for k, v in resp.headers if k.lower().decode("latin-1") not in _HOP]
            out_headers.append((_ENGINE_HEADER_B, engine))
            self._metrics.requests.setdefault((name, resp.status_code), 0)
            self._metrics.requests[(name, resp.status_code)] += 1
            if not stream or resp.status_code != 200:
                failed: UpstreamError | None = None
                try:
                    content = await resp.read(MAX_ANSWER_BYTES)
                except UpstreamError as exc:
                    failed = exc
                finally:
                    self._finished(name)  # first: the close below may be cancelled part way
                    await resp.aclose()
                if failed is not None:
                    self._failed(name, failed)
                    await _send_json(send, 502, error_body(502, f"engine {name} failed while answering: {failed}"),
                                     [(_ENGINE_HEADER_B, engine)])
                    return
                realized = None
                if resp.status_code == 200:
                    try:
                        realized = _cached_tokens(_dec.decode(content).get("usage"))
                    except (msgspec.DecodeError, AttributeError, RecursionError):
                        realized = None  # not JSON we can read: passed on as it is
                self._answered(name, predicted.get(name), realized)
                out_headers.append((b"content-length", str(len(content)).encode()))
                await send({"type": "http.response.start", "status": resp.status_code, "headers": out_headers})
                await send({"type": "http.response.body", "body": content})
                return
            await self._stream(send, resp.status_code, out_headers,
                               self._pass_through(name, resp, predicted.get(name), strip_usage))
            return
        self.core.unroutable += 1
        await _send_json(send, 503, error_body(503, "no engine could take the request (" + "; ".join(errors) + ")"))

    @staticmethod
    async def _stream(send: Any, status: int, headers: list[tuple[bytes, bytes]],
                      chunks: AsyncGenerator[bytes, None]) -> None:
        """Send ``chunks`` as one chunked response (a client that disconnects cancels the
        caller's scope, and so closes the engine's stream)."""
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client is gone
        finally:
            await chunks.aclose()

    def _answered(self, name: str, predicted: int | None, realized: int | None) -> None:
        self.core.answered(name, predicted, realized)
        if predicted is not None and realized is not None:
            self._metrics.observe(name, predicted, realized)

    async def _pass_through(self, name: str, resp: UpstreamResponse, predicted: int | None, strip_usage: bool
                            ) -> AsyncGenerator[bytes, None]:
        buf = b""
        realized: int | None = None
        try:
            async for chunk in resp.aiter_bytes():
                buf += chunk
                out = []
                while True:
                    cut = buf.find(b"\n\n")
                    if cut < 0:
                        break
                    event, buf = buf[: cut + 2], buf[cut + 2:]
                    if b'"usage"' in event and event.startswith(b"data: {"):
                        try:
                            obj = _dec.decode(event[6:].strip())
                        except (msgspec.DecodeError, RecursionError):
                            obj = None  # not JSON we can read: passed on as it is
                        if isinstance(obj, dict):
                            r = _cached_tokens(obj.get("usage"))
                            if r is not None:
                                realized = r
                            if strip_usage and not obj.get("choices"):
                                continue
                    out.append(event)
                if len(buf) > _MAX_EVENT_BYTES:  # not SSE framing we know: pass it on unparsed
                    out.append(buf)
                    buf = b""
                if out:
                    yield b"".join(out)
            if buf:
                yield buf
        except UpstreamError as exc:
            self._failed(name, exc)
            # The engine's stream was cut: say so in the stream (vLLM's error event shape,
            # which OpenAI clients raise on) rather than end it as if it were complete. An
            # unfinished event is dropped.
            yield b"data: " + _enc.encode(error_body(502, f"engine {name} dropped the stream: {exc}")) + b"\n\n"
            return
        finally:
            self._finished(name)  # first: the close below may be cancelled part way
            await resp.aclose()
        self._answered(name, predicted, realized)


_ENGINE_HEADER_B = ENGINE_HEADER.encode()
_HOT = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class _Endpoint:
    """One OpenAI POST route as a raw ASGI app (Starlette mounts it as is)."""

    __slots__ = ("proxy", "path", "kind")

    def __init__(self, proxy: KVProxy, path: str, kind: str) -> None:
        self.proxy = proxy
        self.path = path
        self.kind = kind

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.proxy._proxy(scope, receive, send, self.path, self.kind)


class _ProxyRoutes:
    """:meth:`KVProxy.asgi`: the OpenAI POST routes in front of another ASGI app."""

    __slots__ = ("proxy", "app")

    def __init__(self, proxy: KVProxy, app: Any) -> None:
        self.proxy = proxy
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            kind = _HOT.get(path)
            if kind is not None:
                await self.proxy._proxy(scope, receive, send, path, kind)
                return
        await self.app(scope, receive, send)


async def _asgi_body(scope: Any, receive: Any, limit: int) -> bytes | None:
    """The request body (None if the client went away); :class:`OpenAIError` 413 as soon as
    it passes ``limit`` bytes."""
    msg = await receive()
    if msg["type"] != "http.request":
        return None
    body: bytes = msg.get("body", b"")
    if not msg.get("more_body", False):
        if len(body) > limit:
            raise OpenAIError(413, f"request body is over the limit of {limit} bytes")
        return body
    parts = [body]
    size = len(body)
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise OpenAIError(413, f"request body is over the limit of {limit} bytes")
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)


async def _cancel_on_disconnect(receive: Any, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` once the client disconnects (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _send_json(send: Any, status: int, body: Any, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    out = _enc.encode(body)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(out)).encode()), (b"content-type", b"application/json"),
                            *headers]})
    await send({"type": "http.response.body", "body": out})


class _Metrics:
    """The proxy's Prometheus metrics (own registry)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry()
        buckets = (0, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, float("inf"))
        self.predicted = Histogram("kvstream_proxy_predicted_cached_tokens",
                                   "Prompt tokens the router predicted the chosen engine holds, per request.",
                                   ["engine"], buckets=buckets, registry=self.registry)
        self.realized = Histogram("kvstream_proxy_realized_cached_tokens",
                                  "Prompt tokens the engine reported as cached (usage.prompt_tokens_details).",
                                  ["engine"], buckets=buckets, registry=self.registry)
        diff = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096, float("inf"))
        self.error = Histogram("kvstream_proxy_cached_tokens_error",
                               "Predicted minus realized cached prompt tokens, per request.",
                               ["engine"], buckets=diff, registry=self.registry)
        self.requests: dict[tuple[str, int], int] = {}

    def observe(self, engine: str, predicted: int, realized: int) -> None:
        self.predicted.labels(engine).observe(predicted)
        self.realized.labels(engine).observe(realized)
        self.error.labels(engine).observe(predicted - realized)

    def render(self, core: ProxyCore) -> bytes:
        from prometheus_client import generate_latest

        lines = ["# HELP kvstream_proxy_in_flight Requests in flight per engine.",
                 "# TYPE kvstream_proxy_in_flight gauge"]
        lines += [f'kvstream_proxy_in_flight{{engine="{n}"}} {s.in_flight}' for n, s in core.engines.items()]
        lines += ["# HELP kvstream_proxy_requests_total Proxied requests by engine and status.",
                  "# TYPE kvstream_proxy_requests_total counter"]
        lines += [f'kvstream_proxy_requests_total{{engine="{n}",status="{c}"}} {v}'
                  for (n, c), v in sorted(self.requests.items())]
        lines += ["# HELP kvstream_proxy_failovers_total Requests sent on to another engine after a failure.",
                  "# TYPE kvstream_proxy_failovers_total counter", f"kvstream_proxy_failovers_total {core.failovers}"]
        return generate_latest(self.registry) + ("\n".join(lines) + "\n").encode()


async def serve_proxy(proxy: KVProxy, host: str, port: int, on_ready: Any = None, log_level: str = "warning") -> None:
    """Serve ``proxy.app`` on ``host:port`` (0: any free port) until SIGINT/SIGTERM;
    ``on_ready(url)`` once it accepts connections."""
    import uvicorn

    from kvstream.service.listen import listen_tcp

    sock = listen_tcp(host, port)
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(proxy.app, log_level=log_level, access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=1))
    try:
        async with proxy, anyio.create_task_group() as tg:
            async def announce() -> None:
                while not server.started:
                    await anyio.sleep(0.005)
                if on_ready is not None:
                    on_ready(f"http://{host}:{bound}")

            tg.start_soon(announce)
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()
    finally:
        sock.close()
