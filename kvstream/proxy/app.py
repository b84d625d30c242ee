"""The KV-aware OpenAI-compatible proxy: a Starlette app over a :class:`~kvstream.router.Router`.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are tokenized locally
(:mod:`kvstream.proxy.tokenize`; ``prompt`` token ids need no tokenizer), scored against
every engine's cached prefixes and the requests in flight, and forwarded to the best
engine over kept-alive connections (:mod:`kvstream.proxy.upstream`). Streaming
responses are passed through event by event as they arrive; other responses whole (held
within ``max_held_bytes`` across all requests); the engine's status code and error body
come back unchanged. Every proxied response carries ``x-kvstream-engine: NAME`` and
``x-request-id`` (the client's, or a new one; the engine gets it too).

If an engine refuses or drops the connection before answering, the request goes to the
next-best engine (at most ``max_attempts`` engines) and the failed engine is marked down
for an exponential backoff. Its index is left alone: an HTTP failure says whether an
engine answers, never which blocks it holds (only its KV event stream says that).

Routing accuracy: for each answered request, the router's predicted cached tokens on the
chosen engine against the engine's ``usage.prompt_tokens_details.cached_tokens``
(histograms on ``/metrics``, per engine on ``/v1/engines``; an answer without
``prompt_tokens_details`` counts as 0 cached, as vLLM leaves them out then). For a streaming request that did
not ask for usage, the proxy asks the engine for it (``stream_options.include_usage``)
and drops that extra usage chunk from what the client sees.

Other routes: ``GET /v1/models`` (forwarded to an engine that is up), ``GET /v1/engines``,
``GET /metrics``, ``GET /health``. :class:`KVProxy` is an ``async with`` resource; its
``app`` can be mounted in another Starlette app (``kvstream serve --proxy`` does).
"""

from __future__ import annotations

import asyncio
import logging
import time
import itertools
import os
from typing import Any, AsyncGenerator, Callable, Container, Coroutine, Mapping, Sequence
from urllib.parse import urlsplit

import msgspec

from kvstream.routing.index import KVIndex
from kvstream.proxy.backends import RouterBackend, RoutingBackend, ServiceBackend
from kvstream.proxy.core import ByteBudget, ProxyCore, Upstream
from kvstream.proxy.openai import OpenAIError, completion_prompts, error_body, parse_json_body, prompt_token_ids
from kvstream.proxy.tokenize import ByteTokenizer, PromptTokenizer
from kvstream.proxy.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from kvstream.routing.router import Router
from kvstream.service.guard import DISCONNECT_EXTENSION, DisconnectHook
from kvstream.routing.scoring import PrefixLoadPolicy, rank
from kvstream.transport.subscriber import SourceSpec

__all__ = ["KVProxy", "POLICIES", "ENGINE_HEADER", "REQUEST_ID_HEADER"]

log = logging.getLogger("kvstream.proxy")

ENGINE_HEADER = "x-kvstream-engine"
"""Response header naming the engine that served a proxied request."""
REQUEST_ID_HEADER = "x-request-id"
"""Request and response header with the request's id (the client's, else a new one)."""

POLICIES = ("kv-aware", "round-robin")
"""Routing policies: by cached prefix and load, or the round-robin baseline."""

MAX_BODY_BYTES = 16 << 20
"""Largest request body the standalone proxy takes (bytes; ``serve --proxy``: ``--max-body-bytes``)."""
MAX_ANSWER_BYTES = 64 << 20
"""Largest non-streamed engine answer the proxy holds to pass on (bytes; a 502 beyond)."""
MAX_HELD_BYTES = 128 << 20
"""Most bytes of non-streamed answers the proxy holds at once, all requests together (an
answer that does not fit is a 503 with ``Retry-After``)."""
_MAX_EVENT_BYTES = 1 << 20  # the most one SSE event may buffer before it is passed on as is
_FREE_EVENT_BYTES = 64 << 10  # an unfinished SSE event up to this is not counted in the held bytes
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
_HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"date", b"server",
        b"x-request-id"}


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import Response

    return Response(_enc.encode(body), status_code=status, media_type="application/json", headers=headers)


def _check_url(name: str, url: str) -> Any:
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"engine {name}: base URL {url!r} must be http://HOST:PORT[/PATH]")
    return u


def _cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``; 0 when the usage has no details
    (vLLM leaves them out when nothing was cached, or without
    ``--enable-prompt-tokens-details``); None without a usage object."""
    if not isinstance(usage, dict) or type(usage.get("prompt_tokens")) is not int:
        return None
    details = usage.get("prompt_tokens_details")
    if details is None:
        return 0
    if isinstance(details, dict):
        cached = details.get("cached_tokens")
        if cached is None:
            return 0
        if type(cached) is int:
            return int(cached)
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
        max_answer_bytes: largest non-streamed answer passed on (bytes; 502 beyond).
        max_held_bytes: most bytes of non-streamed answers held at once, across all
            requests (bytes; an answer that does not fit is a 503).
        access_log: called once per proxied request with its access-log record (a dict
            of JSON values: ``time``, ``method``, ``path``, ``status``, ``engine``,
            ``predicted_cached_tokens``, ``realized_cached_tokens``, ``ttfb_s``,
            ``duration_s``, ``request_id``); None: no access log.
    """

    def __init__(self, upstreams: Sequence[Upstream], *, tokenizer: PromptTokenizer | None = None,
                 block_size: int = 16, policy: str = "kv-aware", speculate_s: float | None = None,
                 max_attempts: int = 3, backoff_s: float = 1.0, connect_timeout_s: float = 2.0,
                 subscriber_options: dict[str, Any] | None = None,
                 backend: RoutingBackend | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 max_answer_bytes: int = MAX_ANSWER_BYTES, max_held_bytes: int = MAX_HELD_BYTES,
                 access_log: Callable[[dict[str, Any]], None] | None = None) -> None:
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
        self.max_answer_bytes = max_answer_bytes
        self.held = ByteBudget(max_held_bytes)
        self.access_log = access_log
        self._pools: dict[str, tuple[str, UpstreamPool, str]] = {}
        self._retired: list[UpstreamPool] = []  # pools of engines whose URL changed: closed at the end
        self._synced: Mapping[str, str] | None = None  # the backend's engine map last known to self.core
        self._metrics = _Metrics()
        # Without a tokenizer, the engines are asked once how they tokenize (see
        # _learn_tokenizer); until one answered, text prompts are routed by load.
        self._tokenizer_probe_at = 0.0 if tokenizer is None else None
        self.app = self._build_app()

    @classmethod
    def for_service(cls, core: Any, *, tokenizer: PromptTokenizer | None = None, policy: str = "kv-aware",
                    speculate: bool = False, max_attempts: int = 3, backoff_s: float = 1.0,
                    connect_timeout_s: float = 2.0, max_held_bytes: int = MAX_HELD_BYTES,
                    access_log: Callable[[dict[str, Any]], None] | None = None) -> "KVProxy":
        """The proxy mode of ``kvstream serve``: route with the service's core (its default
        index, weights and load board) and forward to its engines' ``http=`` URLs. The
        service runs the subscriber; mount :meth:`openai_routes` in its app, add
        :meth:`engine_view` to its ``/v1/engines`` and :meth:`metrics_text` to its
        ``/metrics``, and hold ``async with proxy`` while serving (it closes the pools).
        Request bodies are bounded by the service's ``--max-body-bytes``."""
        proxy = cls([], tokenizer=tokenizer, block_size=core.config.router_block_size, policy=policy,
                    speculate_s=core.config.speculate_ttl if speculate else None, max_attempts=max_attempts,
                    backoff_s=backoff_s, connect_timeout_s=connect_timeout_s, backend=ServiceBackend(core),
                    max_body_bytes=core.config.max_body_bytes, max_held_bytes=max_held_bytes,
                    access_log=access_log)
        return proxy

    async def __aenter__(self) -> "KVProxy":
        await self.backend.__aenter__()
        if self.tokenizer is None:
            log.warning("no --tokenizer: token-id prompts are routed by cached prefix; text prompts and chat are too "
                        "if the engines tokenize UTF-8 bytes (kvstream engine; asked at the first text request), "
                        "else by load only (give --tokenizer MODEL_DIR)")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.backend.__aexit__(*exc)
        finally:
            for pool in [p for _, p, _ in self._pools.values()] + self._retired:
                await pool.aclose()

    @property
    def router(self) -> Any:
        """The standalone proxy's :class:`Router` (None in the service's proxy mode)."""
        return getattr(self.backend, "router", None)

    def _sync_upstreams(self) -> Mapping[str, str]:
        urls = self.backend.upstreams()
        if urls is not self._synced:  # a backend hands out a new map when its engines change
            for name, url in urls.items():
                self.core.ensure(name, url)
            self._synced = urls
        return urls

    def _pool(self, name: str) -> tuple[UpstreamPool, str]:
        url = self.core.engines[name].upstream.base_url
        hit = self._pools.get(name)
        if hit is None or hit[0] != url:
            if hit is not None:
                self._retired.append(hit[1])
            u = _check_url(name, url)
            pool = UpstreamPool(u.hostname or "", u.port or 80, connect_timeout_s=self._connect_timeout_s)
            hit = (url, pool, u.path.rstrip("/"))
            self._pools[name] = hit
        return hit[1], hit[2]

    def engine_view(self, name: str) -> dict[str, Any]:
        """The proxy's part of ``name``'s ``/v1/engines`` entry (in flight, failures,
        mark-down, routing accuracy): ``{"proxy": {...}}`` for every engine the proxy may
        send to (proxied to yet or not), ``{}`` for the others."""
        if name not in self.core.engines:
            url = self.backend.upstreams().get(name)
            if url is None:
                return {}
            self.core.ensure(name, url)
        return {"proxy": self.core.engine_view(name, time.monotonic())}

    def metrics_text(self) -> bytes:
        """The proxy's Prometheus metrics (accuracy, duration and time-to-first-token
        histograms, in flight, requests, failovers, bytes held)."""
        self._sync_upstreams()
        return self._metrics.render(self.core, self.held, self._pools)

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
        """``name`` refused or dropped a request another front end sent: marked down for
        the backoff, as on a failed connection of the proxy's own (its index follows its
        event stream alone: an HTTP failure says nothing about the blocks it holds)."""
        self._down(name, reason)

    # -- routes ---------------------------------------------------------------------------

    def _build_app(self) -> Any:
        from starlette.applications import Starlette

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
        """Every route of the proxy on its own: :meth:`openai_routes` plus ``/v1/engines``,
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
                    content = await r.read(self.max_answer_bytes)
                finally:
                    await r.aclose()
            except UpstreamError as exc:
                self._failed(name, exc)
                continue
            return Response(content, status_code=r.status_code, media_type="application/json",
                            headers={ENGINE_HEADER: name})
        return _json(503, error_body(503, "no engine is reachable"))

    def forwarded(self) -> dict[bytes, Any]:
        """The OpenAI POST paths (bytes) -> each one's raw ASGI app, for a server that
        frames those requests itself (``kvstream serve``'s fast path,
        :mod:`kvstream.service.fastpath`); their body limit is :attr:`max_body_bytes`."""
        return {p.encode("latin-1"): _Endpoint(self, p, k) for p, k in _HOT.items()}

    def asgi(self, app: Any) -> Any:
        """``app`` with the proxy's POST routes (``/v1/completions``, ``/v1/chat/completions``)
        answered in front of it in raw ASGI (no Request object, router or middleware per
        call); every other scope goes to ``app``."""
        return _ProxyRoutes(self, app)

    # -- proxying -------------------------------------------------------------------------

    def _failed(self, name: str, exc: BaseException) -> None:
        self._down(name, f"{type(exc).__name__}: {exc}")

    def _down(self, name: str, reason: str) -> None:
        reason = reason[:300]
        if self.core.failed(name, reason, time.monotonic()):
            log.warning("engine %s is down: %s", name, reason, extra={"engine": name, "state": "down"})

    def _started(self, name: str) -> None:
        self.core.started(name)
        self.backend.started(name)

    def _finished(self, name: str) -> None:
        self.core.finished(name)
        self.backend.finished(name)

    def _route(self, body: dict[str, Any], kind: str | None,
               allowed: Container[str] | None = None) -> tuple[list[str], dict[str, int]]:
        """Candidates best first, and per engine the predicted cached prompt tokens (of the
        one prompt; of a batch's last, which is what vLLM reports cached for a batch);
        ``kind`` None: by load only; ``allowed``: only these engines."""
        candidates, predicted, _ = self._route_tokens(body, kind, allowed)
        return candidates, predicted

    async def _learn_tokenizer(self) -> None:
        """Without ``--tokenizer``: ask an engine's ``/tokenize`` how it tokenizes. An engine
        that answers a probe text with its UTF-8 bytes (``kvstream engine`` without a
        tokenizer) is tokenized locally the same way from then on, so text prompts and chat
        are routed by prefix; any other answer (a real model's tokenizer) leaves text
        routed by load, said once in the log with the fix. Asked again at most every 5 s
        while no engine answers."""
        now = time.monotonic()
        if self._tokenizer_probe_at is None or now < self._tokenizer_probe_at:
            return
        self._tokenizer_probe_at = now + 5.0
        probe = "kvstream: which tokens? \u00e9"
        for name in list(self._sync_upstreams()):
            pool, prefix = self._pool(name)
            try:
                resp = await pool.request("POST", prefix + "/tokenize", _enc.encode({"prompt": probe}),
                                          [(b"content-type", b"application/json")])
                try:
                    raw = await resp.read(65536)
                finally:
                    await resp.aclose()
            except UpstreamError:
                continue
            self._tokenizer_probe_at = None  # an engine answered: decided for good
            try:
                tokens = _dec.decode(raw).get("tokens") if resp.status_code == 200 else None
            except (msgspec.DecodeError, AttributeError, RecursionError):
                tokens = None
            if tokens == list(probe.encode("utf-8")):
                self.tokenizer = ByteTokenizer()
                log.info("the engines tokenize text as UTF-8 bytes (kvstream engine): text prompts and chat are "
                         "routed by cached prefix with the same tokenization")
            else:
                log.warning("no --tokenizer, and engine %s does not tokenize text as UTF-8 bytes: text prompts and "
                            "chat are routed by load only; start serve with --tokenizer MODEL_DIR (the engines' "
                            "tokenizer.json) to route them by cached prefix", name)
            return

    def _prefill_begin(self, rec: "_Record", name: str, predicted: dict[str, int]) -> None:
        """Count the prompt tokens ``name`` will have to compute for this request in its
        load (:attr:`~kvstream.routing.scoring.Load.prefill_tokens`) until its first
        answer byte."""
        n = max(0, rec.prompt_tokens - predicted.get(name, 0))
        if n:
            rec.prefill_at, rec.prefill = name, n
            self.core.prefill(name, n)
            self.backend.prefill(name, n)

    def _prefill_end(self, rec: "_Record") -> None:
        """The engine answered (or the request ended): its prefill is no longer waiting."""
        name = rec.prefill_at
        if name is not None:
            rec.prefill_at = None
            if name in self.core.engines:
                self.core.prefill(name, -rec.prefill)
            self.backend.prefill(name, -rec.prefill)

    def _route_tokens(self, body: dict[str, Any], kind: str | None,
                      allowed: Container[str] | None = None) -> tuple[list[str], dict[str, int], int]:
        """:meth:`_route`, and the prompt's length in tokens (all of a batch's; 0 when the
        prompt could not be tokenized)."""
        prompts: list[list[int]] | None = None
        try:
            if kind == "chat":
                prompts = [prompt_token_ids(body, kind, self.tokenizer)]
            elif kind is not None:
                prompts = completion_prompts(body, self.tokenizer)
        except OpenAIError:
            if self.tokenizer is not None:
                raise
            prompts = None  # a text prompt without a tokenizer: route by load only
        urls = self._sync_upstreams()
        if allowed is not None:
            urls = {n: u for n, u in urls.items() if n in allowed}
        loads = self.backend.loads() or self.core.loads()
        predicted: dict[str, int] = {}
        ranking: list[str]
        if prompts:
            if len(prompts) == 1:
                res = self.backend.score(prompts[0], loads, self.policy == "kv-aware" and self.speculate)
                ranking = [n for n in res.ranking if n in urls]
            else:
                # A batch goes to one engine (vLLM answers it in one response): the one with
                # the best value summed over the prompts.
                total: dict[str, float] = {}
                for p in prompts:
                    res = self.backend.score(p, loads, False)
                    for n, v in res.values.items():
                        total[n] = total.get(n, 0.0) + v
                ranking = [n for n in rank([(v, n) for n, v in total.items()], loads) if n in urls]
            # The engine never reuses the prompt's last token: its hit is capped below it.
            cap = (len(prompts[-1]) - 1) // self.block_size * self.block_size
            predicted = {n: min(m.tokens, cap) for n, m in res.matches.items()}
        else:
            ranking = sorted(urls, key=lambda n: loads[n].running if n in loads else 0)
        if self.policy == "round-robin":
            ranking = self.core.round_robin()
        else:
            ranking = ranking + [n for n in urls if n not in ranking]
        n_tokens = sum(len(p) for p in prompts) if prompts else 0
        return self.core.candidates(ranking, time.monotonic()), predicted, n_tokens

    async def _proxy(self, scope: Any, receive: Any, send: Any, path: str, kind: str) -> None:
        """Answer one OpenAI POST in raw ASGI: the engine's status and headers go out as soon
        as they arrive, then its body (streamed event by event, or whole)."""
        rec = _Record(time.perf_counter(), path)
        rid = b""
        auth = b""
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                if 0 < len(v) <= 200 and all(32 < c < 127 for c in v):  # visible ASCII; else a new one
                    rid = v
            elif k == b"authorization":
                auth = v
        if not rid:
            rid = b"%s%016x" % (_RID_PREFIX, next(_rid_numbers))
        rec.request_id = rid.decode("ascii")
        rid_header = (_REQUEST_ID_B, rid)
        try:
            try:
                raw = await _asgi_body(scope, receive, self.max_body_bytes)
                if raw is None:
                    rec.status = 499  # the client went away
                    return
                body = parse_json_body(raw, self.max_body_bytes)
                if self._tokenizer_probe_at is not None:
                    await self._learn_tokenizer()
                candidates, predicted, rec.prompt_tokens = self._route_tokens(body, kind)
            except OpenAIError as exc:
                rec.status = exc.status
                await _send_json(send, exc.status, exc.body(), [rid_header])
                return
            stream = bool(body.get("stream"))
            batch = kind == "completions" and _is_batch(body.get("prompt"))
            if batch and stream:
                predicted = {}  # vLLM's usage then names no one prompt's cached tokens
            strip_usage = False
            payload = raw  # the client's bytes as they came, unless the proxy must add to them
            if stream:
                opts = body.get("stream_options")
                if not (isinstance(opts, dict) and opts.get("include_usage")):
                    body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                    strip_usage = True
                    payload = _enc.encode(body)
            headers = [(b"content-type", b"application/json"), rid_header]
            if auth:
                headers.append((b"authorization", auth))
            # The client may go away at any point (while the engine thinks, or mid-stream):
            # then everything below is cancelled, the engine's connection closed (vLLM aborts
            # the request) and its in-flight count goes back down.
            rec.status = 499
            await _until_disconnect(scope, receive, self._forward(send, path, candidates, predicted, payload,
                                                                  headers, stream, strip_usage, rec))
        finally:
            self._prefill_end(rec)
            self._done(rec)

    def _done(self, rec: "_Record") -> None:
        duration = time.perf_counter() - rec.t0
        if rec.engine is not None:
            self._metrics.of(rec.engine)[3].observe(duration)
        if self.access_log is not None:
            self.access_log({
                "time": round(time.time() - duration, 6), "method": "POST", "path": rec.path, "status": rec.status,
                "engine": rec.engine, "predicted_cached_tokens": rec.predicted,
                "realized_cached_tokens": rec.realized,
                "ttfb_s": None if rec.ttfb is None else round(rec.ttfb, 6), "duration_s": round(duration, 6),
                "request_id": rec.request_id})

    async def _forward(self, send: Any, path: str, candidates: list[str], predicted: dict[str, int], payload: bytes,
                       headers: list[tuple[bytes, bytes]], stream: bool, strip_usage: bool, rec: "_Record") -> None:
        errors: list[str] = []
        rid_header = headers[1]
        for attempt, name in enumerate(candidates):
            pool, prefix = self._pool(name)
            self._started(name)
            self._prefill_begin(rec, name, predicted)
            sent = False
            try:
                resp = await pool.request("POST", prefix + path, payload, headers)
                sent = True
            except UpstreamError as exc:
                self._failed(name, exc)
                errors.append(f"{name}: {exc}")
                if attempt + 1 < len(candidates):
                    self.core.failovers += 1
                continue
            finally:
                if not sent:
                    self._prefill_end(rec)
                    self._finished(name)
            rec.engine = name
            rec.predicted = predicted.get(name)
            engine = name.encode("latin-1")
            out_headers = [(k.lower(), v) for k, v in resp.headers if k.lower() not in _HOP]
            out_headers.append((_ENGINE_HEADER_B, engine))
            out_headers.append(rid_header)
            self._metrics.requests.setdefault((name, resp.status_code), 0)
            self._metrics.requests[(name, resp.status_code)] += 1
            if not stream or resp.status_code != 200:
                await self._whole(send, name, resp, out_headers, rec)
                return
            rec.status = resp.status_code
            await self._stream(send, resp.status_code, out_headers,
                               self._pass_through(name, resp, predicted.get(name), strip_usage, rec))
            return
        self.core.unroutable += 1
        rec.status = 503
        await _send_json(send, 503, error_body(503, "no engine could take the request (" + "; ".join(errors) + ")"),
                         [rid_header])

    async def _whole(self, send: Any, name: str, resp: UpstreamResponse, out_headers: list[tuple[bytes, bytes]],
                     rec: "_Record") -> None:
        """Read a non-streamed answer whole (its usage is the accuracy's realized side; a
        cut answer becomes a clean 502), within :attr:`held`, then pass it on."""
        engine_header = (_ENGINE_HEADER_B, name.encode("latin-1"))
        failed: str | None = None
        busy = False
        buf = bytearray()
        taken = 0
        try:
            try:
                length = resp.content_length
                if length is not None and length > self.max_answer_bytes:
                    failed = f"its answer of {length} bytes is over {self.max_answer_bytes} bytes"
                elif length is not None and not self.held.take(length):
                    busy = True
                else:
                    taken = length or 0
                    async for chunk in resp.aiter_bytes():
                        n = len(buf) + len(chunk)
                        if n > self.max_answer_bytes:
                            failed = f"its answer is over {self.max_answer_bytes} bytes"
                            break
                        if n > taken:  # no Content-Length (or a wrong one): take as it grows
                            if not self.held.take(n - taken):
                                busy = True
                                break
                            taken = n
                        buf += chunk
            except UpstreamError as exc:
                failed = str(exc)
                self._failed(name, exc)
            finally:
                self._prefill_end(rec)
                self._finished(name)  # first: the close below may be cancelled part way
                await resp.aclose()
            if busy:
                rec.status = 503
                await _send_json(send, 503, error_body(503, "the proxy holds too many answers right now; retry"),
                                 [engine_header, (b"retry-after", b"1"), out_headers[-1]])
                return
            if failed is not None:
                rec.status = 502
                await _send_json(send, 502, error_body(502, f"engine {name} failed while answering: {failed}"),
                                 [engine_header, out_headers[-1]])
                return
            realized = None
            if resp.status_code == 200:
                try:
                    obj = _dec.decode(buf)
                    realized = _cached_tokens(obj.get("usage")) if isinstance(obj, dict) else None
                except (msgspec.DecodeError, RecursionError):
                    realized = None  # not JSON we can read: passed on as it is
            self._answered(name, rec.predicted, realized)
            rec.realized = realized
            rec.status = resp.status_code
            out_headers.append((b"content-length", str(len(buf)).encode()))
            await send({"type": "http.response.start", "status": resp.status_code, "headers": out_headers})
            rec.ttfb = time.perf_counter() - rec.t0
            await send({"type": "http.response.body", "body": bytes(buf) if len(buf) < 65536 else buf})
        finally:
            del buf
            self.held.give(taken)

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
        if self.core.answered(name, predicted, realized):
            log.warning("engine %s is up again", name, extra={"engine": name, "state": "up"})
        if predicted is not None and realized is not None:
            self._metrics.observe(name, predicted, realized)

    async def _pass_through(self, name: str, resp: UpstreamResponse, predicted: int | None, strip_usage: bool,
                            rec: "_Record") -> AsyncGenerator[bytes, None]:
        buf = b""
        realized: int | None = None
        first = True
        charged = 0  # bytes of an unfinished event counted in self.held (past _FREE_EVENT_BYTES)
        held = self.held
        try:
            async for chunk in resp.aiter_bytes():
                buf += chunk
                out = []
                at = 0  # events are cut at offsets, not by copying the rest after each one
                while True:
                    cut = buf.find(b"\n\n", at)
                    if cut < 0:
                        break
                    event, at = buf[at: cut + 2], cut + 2
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
                if at:
                    buf = buf[at:]
                need = max(0, len(buf) - _FREE_EVENT_BYTES)
                if need > charged:
                    if len(buf) <= _MAX_EVENT_BYTES and held.take(need - charged):
                        charged = need
                    else:  # not SSE framing we know, or more than may be held now: pass it on unparsed
                        out.append(buf)
                        buf = b""
                        held.give(charged)
                        charged = 0
                elif need < charged:
                    held.give(charged - need)
                    charged = need
                if out:
                    if first:
                        first = False
                        self._prefill_end(rec)
                        rec.ttfb = t = time.perf_counter() - rec.t0
                        self._metrics.of(name)[4].observe(t)
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
            held.give(charged)
            self._prefill_end(rec)
            self._finished(name)  # first: the close below may be cancelled part way
            await resp.aclose()
        rec.realized = realized
        self._answered(name, predicted, realized)


class _Record:
    """What the access log and the duration histogram learn of one proxied request."""

    __slots__ = ("t0", "path", "status", "engine", "predicted", "realized", "ttfb", "request_id", "prompt_tokens",
                 "prefill_at", "prefill")

    def __init__(self, t0: float, path: str) -> None:
        self.t0 = t0
        self.path = path
        self.status = 0
        self.engine: str | None = None
        self.predicted: int | None = None
        self.realized: int | None = None
        self.ttfb: float | None = None
        self.request_id = ""
        self.prompt_tokens = 0  # the prompt(s) in tokens; 0 when not tokenized (a text prompt, no tokenizer)
        self.prefill_at: str | None = None  # the engine counting this request's prefill tokens
        self.prefill = 0


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and len(prompt) > 1 and not all(type(t) is int for t in prompt)


# A new request id: this process's random 64 bits, then a count (32 hex digits, as unique as
# a uuid4 and without a getrandom() call per request).
_RID_PREFIX = os.urandom(8).hex().encode()
_rid_numbers = itertools.count()


def _new_rid_prefix() -> None:  # a forked worker (serve --processes) draws its own
    global _RID_PREFIX
    _RID_PREFIX = os.urandom(8).hex().encode()


os.register_at_fork(after_in_child=_new_rid_prefix)
_ENGINE_HEADER_B = ENGINE_HEADER.encode()
_REQUEST_ID_B = REQUEST_ID_HEADER.encode()
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


async def _until_disconnect(scope: Any, receive: Any, work: Coroutine[Any, Any, None]) -> None:
    """Run ``work``, cancelled if the client disconnects first (the request body is already
    read; what ``receive`` gives next is the disconnect).

    Under ``kvstream serve`` the server says so itself: the scope's
    :class:`~kvstream.service.guard.DisconnectHook` calls back when the connection is lost,
    and that cancels this task, with no task of its own. Under another ASGI server one
    asyncio task owned here waits on ``receive`` and cancels this task on a disconnect; it
    is cancelled and awaited before this returns. Not an anyio task group: one per request
    cost about 0.2 ms of CPU (anyio 4.16's ``cancel()`` formats the task's repr), 5x a
    plain task, and the hook about a fifth of a plain task (``bench/bench_proxy.py --watchers``,
    uvloop: 6-8 against 32-34 us per request, loaded machine)."""
    host = asyncio.current_task()
    assert host is not None
    gone = done = False
    ext = scope.get("extensions")
    hook = ext.get(DISCONNECT_EXTENSION) if ext else None

    def lost() -> None:
        nonlocal gone
        if not done:
            gone = True
            host.cancel()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        lost()  # uvicorn also says disconnect once the answer is complete: lost() then does nothing

    watcher = None
    if isinstance(hook, DisconnectHook):
        hook.set(lost)
    else:
        watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await work
    except asyncio.CancelledError:
        # Ours alone (the client went away): the request ends here. Any other
        # cancellation (the server shutting down) goes on.
        uncancel = getattr(host, "uncancel", None)  # Python 3.11+
        if gone and (uncancel is None or uncancel() == 0):
            return
        raise
    finally:
        done = True
        if watcher is None:
            if isinstance(hook, DisconnectHook):
                hook.clear()
        else:
            if not watcher.done():
                watcher.cancel()
            await asyncio.wait((watcher,))
            if not watcher.cancelled() and watcher.exception() is not None:
                raise watcher.exception()  # type: ignore[misc]


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
        # vLLM's own latency buckets (vllm:e2e_request_latency_seconds and
        # vllm:time_to_first_token_seconds), so the two sides compare bucket by bucket.
        e2e = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
        ttft = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
        self.duration = Histogram("kvstream_proxy_request_duration_seconds",
                                  "Seconds from a proxied request's arrival to the end of its answer, per engine.",
                                  ["engine"], buckets=e2e, registry=self.registry)
        self.ttft = Histogram("kvstream_proxy_time_to_first_token_seconds",
                              "Seconds from a streamed request's arrival to its first event passed on (vLLM "
                              "sends the first event with the first token), per engine.",
                              ["engine"], buckets=ttft, registry=self.registry)
        self.requests: dict[tuple[str, int], int] = {}
        # Per engine, its histograms' children: labels() takes a lock and builds its key
        # each call, four times per request otherwise.
        self._children: dict[str, tuple[Any, Any, Any, Any, Any]] = {}

    def of(self, engine: str) -> tuple[Any, Any, Any, Any, Any]:
        """``engine``'s (predicted, realized, error, duration, ttft) histograms."""
        c = self._children.get(engine)
        if c is None:
            c = self._children[engine] = (self.predicted.labels(engine), self.realized.labels(engine),
                                          self.error.labels(engine), self.duration.labels(engine),
                                          self.ttft.labels(engine))
        return c

    def observe(self, engine: str, predicted: int, realized: int) -> None:
        p, r, e, _, _ = self.of(engine)
        p.observe(predicted)
        r.observe(realized)
        e.observe(predicted - realized)

    def render(self, core: ProxyCore, held: ByteBudget, pools: Mapping[str, tuple[str, UpstreamPool, str]]) -> bytes:
        from prometheus_client import generate_latest

        now = time.monotonic()
        lines = ["# HELP kvstream_proxy_engine_up Whether the proxy sends to the engine (0: marked down after "
                 "a failure, for its backoff).", "# TYPE kvstream_proxy_engine_up gauge"]
        lines += [f'kvstream_proxy_engine_up{{engine="{n}"}} {0 if core.is_down(n, now) else 1}' for n in core.engines]
        lines += ["# HELP kvstream_proxy_held_bytes Bytes of non-streamed answers held now (all requests).",
                  "# TYPE kvstream_proxy_held_bytes gauge", f"kvstream_proxy_held_bytes {held.held}",
                  "# HELP kvstream_proxy_held_bytes_peak The most kvstream_proxy_held_bytes has been.",
                  "# TYPE kvstream_proxy_held_bytes_peak gauge", f"kvstream_proxy_held_bytes_peak {held.peak}",
                  "# HELP kvstream_proxy_held_bytes_limit The bound on kvstream_proxy_held_bytes.",
                  "# TYPE kvstream_proxy_held_bytes_limit gauge", f"kvstream_proxy_held_bytes_limit {held.total}",
                  "# HELP kvstream_proxy_held_bytes_refused_total Answers refused (503) because they did not "
                  "fit under the bound.", "# TYPE kvstream_proxy_held_bytes_refused_total counter",
                  f"kvstream_proxy_held_bytes_refused_total {held.refused}",
                  "# HELP kvstream_proxy_fresh_connection_retries_total Requests sent again on a new connection "
                  "after the engine closed a kept-alive one before answering.",
                  "# TYPE kvstream_proxy_fresh_connection_retries_total counter"]
        lines += [f'kvstream_proxy_fresh_connection_retries_total{{engine="{n}"}} {p.fresh_retries}'
                  for n, (_, p, _) in sorted(pools.items())]
        lines += ["# HELP kvstream_proxy_in_flight Requests in flight per engine.",
                 "# TYPE kvstream_proxy_in_flight gauge"]
        lines += [f'kvstream_proxy_in_flight{{engine="{n}"}} {s.in_flight}' for n, s in core.engines.items()]
        lines += ["# HELP kvstream_proxy_requests_total Proxied requests by engine and status.",
                  "# TYPE kvstream_proxy_requests_total counter"]
        lines += [f'kvstream_proxy_requests_total{{engine="{n}",status="{c}"}} {v}'
                  for (n, c), v in sorted(self.requests.items())]
        lines += ["# HELP kvstream_proxy_failovers_total Requests sent on to another engine after a failure.",
                  "# TYPE kvstream_proxy_failovers_total counter", f"kvstream_proxy_failovers_total {core.failovers}"]
        return generate_latest(self.registry) + ("\n".join(lines) + "\n").encode()
