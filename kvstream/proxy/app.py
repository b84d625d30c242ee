"""The KV-aware OpenAI-compatible proxy: a Starlette app over a :class:`~kvstream.router.Router`.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are tokenized locally
(:mod:`kvstream.proxy.tokenize`; ``prompt`` token ids need no tokenizer), scored against
every engine's cached prefixes and the requests in flight, and forwarded with ``httpx`` to
the best engine. Streaming responses are passed through event by event as they arrive;
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
from typing import Any, AsyncIterator, Sequence

import anyio
import msgspec

from kvstream.routing.index import KVIndex
from kvstream.proxy.core import ProxyCore, Upstream
from kvstream.proxy.openai import OpenAIError, error_body, parse_json_body, prompt_token_ids
from kvstream.proxy.tokenize import PromptTokenizer
from kvstream.routing.router import Router
from kvstream.routing.scoring import PrefixLoadPolicy
from kvstream.transport.subscriber import SourceSpec

__all__ = ["KVProxy", "POLICIES", "ENGINE_HEADER"]

ENGINE_HEADER = "x-kvstream-engine"
"""Response header naming the engine that served a proxied request."""

POLICIES = ("kv-aware", "round-robin")
"""Routing policies: by cached prefix and load, or the round-robin baseline."""

MAX_BODY_BYTES = 16 << 20
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "date", "server"}


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import Response

    return Response(_enc.encode(body), status_code=status, media_type="application/json", headers=headers)


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
    """

    def __init__(self, upstreams: Sequence[Upstream], *, tokenizer: PromptTokenizer | None = None,
                 block_size: int = 16, policy: str = "kv-aware", speculate_s: float | None = None,
                 max_attempts: int = 3, backoff_s: float = 1.0, connect_timeout_s: float = 2.0,
                 subscriber_options: dict[str, Any] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.core = ProxyCore(upstreams, backoff_s=backoff_s, max_attempts=max_attempts)
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.policy = policy
        specs = [SourceSpec(u.events, u.replay, name=u.name) for u in upstreams if u.events]
        self.router = Router(specs, index=KVIndex(router_block_size=block_size),
                             policy=PrefixLoadPolicy(), speculative_ttl_s=speculate_s,
                             **(subscriber_options or {}))
        for u in upstreams:  # engines without a stream still get routed (by load)
            self.router.index.add_source(u.name)
        self._connect_timeout_s = connect_timeout_s
        self._client: Any = None
        self._metrics = _Metrics()
        self.app = self._build_app()

    async def __aenter__(self) -> "KVProxy":
        import httpx

        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self._connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        try:
            await self.router.__aenter__()
        except BaseException:
            await self._client.aclose()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.router.__aexit__(*exc)
        finally:
            await self._client.aclose()

    # -- routes ---------------------------------------------------------------------------

    def _build_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=self.routes())

    def routes(self) -> list[Any]:
        """The proxy's Starlette routes (to mount them in another app)."""
        from starlette.routing import Route

        return [
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/engines", self._engines, methods=["GET"]),
            Route("/metrics", self._prom, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
        ]

    async def _health(self, request: Any) -> Any:
        now = time.monotonic()
        up = [n for n in self.core.engines if not self.core.is_down(n, now)]
        return _json(200 if up else 503, {"status": "ok" if up else "no engine is up", "engines_up": len(up)})

    async def _engines(self, request: Any) -> Any:
        streams = self.router.health()
        index = self.router.index
        view: dict[str, Any] = {}
        for n in self.core.engines:
            info = index.source_info(n)
            h = streams.get(n)
            view[n] = {"state": h.state if h is not None else "not followed", "stale": info.stale,
                       "blocks": info.blocks, "applied_seq": self.router.applied_seq(n),
                       "restarts": h.counters.get("restarts", 0) if h is not None else 0}
        return _json(200, self.core.view(time.monotonic(), view))

    async def _prom(self, request: Any) -> Any:
        from starlette.responses import Response

        return Response(self._metrics.render(self.core), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _models(self, request: Any) -> Any:
        import httpx
        from starlette.responses import Response

        for name in self.core.candidates(list(self.core.engines), time.monotonic()):
            url = self.core.engines[name].upstream.base_url + "/v1/models"
            try:
                r = await self._client.get(url)
            except httpx.TransportError as exc:
                self._failed(name, exc)
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json",
                            headers={ENGINE_HEADER: name})
        return _json(503, error_body(503, "no engine is reachable"))

    async def _completions(self, request: Any) -> Any:
        return await self._proxy(request, "/v1/completions", "completions")

    async def _chat(self, request: Any) -> Any:
        return await self._proxy(request, "/v1/chat/completions", "chat")

    # -- proxying -------------------------------------------------------------------------

    def _failed(self, name: str, exc: BaseException) -> None:
        self.core.failed(name, f"{type(exc).__name__}: {exc}"[:300], time.monotonic())
        self.router.index.mark_stale(name, True)

    def _route(self, body: dict[str, Any], kind: str) -> tuple[list[str], dict[str, int]]:
        """Candidates best first, and per engine the predicted cached prompt tokens."""
        tokens: list[int] | None
        try:
            tokens = prompt_token_ids(body, kind, self.tokenizer)
        except OpenAIError:
            if self.tokenizer is not None:
                raise
            tokens = None  # a text prompt without a tokenizer: route by load only
        loads = self.core.loads()
        predicted: dict[str, int] = {}
        if tokens:
            res = self.router.route(tokens, loads) if self.policy == "kv-aware" else \
                self.router.index.score(tokens, loads=loads)
            # The engine never reuses the prompt's last token: its hit is capped below it.
            cap = (len(tokens) - 1) // self.block_size * self.block_size
            predicted = {n: min(m.tokens, cap) for n, m in res.matches.items()}
            ranking = res.ranking
        else:
            ranking = sorted(self.core.engines, key=lambda n: loads[n].running)
        if self.policy == "round-robin":
            ranking = self.core.round_robin()
        else:
            ranking = ranking + [n for n in self.core.engines if n not in ranking]
        return self.core.candidates(ranking, time.monotonic()), predicted

    async def _proxy(self, request: Any, path: str, kind: str) -> Any:
        import httpx
        from starlette.responses import Response, StreamingResponse

        try:
            body = parse_json_body(await request.body(), MAX_BODY_BYTES)
            candidates, predicted = self._route(body, kind)
        except OpenAIError as exc:
            return _json(exc.status, exc.body())
        stream = bool(body.get("stream"))
        strip_usage = False
        if stream:
            opts = body.get("stream_options")
            if not (isinstance(opts, dict) and opts.get("include_usage")):
                body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                strip_usage = True
        payload = _enc.encode(body)
        headers = {"content-type": "application/json"}
        auth = request.headers.get("authorization")
        if auth:
            headers["authorization"] = auth
        errors: list[str] = []
        for attempt, name in enumerate(candidates):
            up = self.core.engines[name].upstream
            self.core.started(name)
            sent = False
            try:
                req = self._client.build_request("POST", up.base_url + path, content=payload, headers=headers)
                resp = await self._client.send(req, stream=True)
                sent = True
            except httpx.TransportError as exc:
                self._failed(name, exc)
                errors.append(f"{name}: {type(exc).__name__}")
                if attempt + 1 < len(candidates):
                    self.core.failovers += 1
                continue
            finally:
                if not sent:
                    self.core.finished(name)
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            out_headers[ENGINE_HEADER] = name
            self._metrics.requests.setdefault((name, resp.status_code), 0)
            self._metrics.requests[(name, resp.status_code)] += 1
            if not stream or resp.status_code != 200:
                try:
                    content = await resp.aread()
                except httpx.TransportError as exc:
                    self._failed(name, exc)
                    self.core.finished(name)
                    await resp.aclose()
                    return _json(502, error_body(502, f"engine {name} dropped the connection while answering"),
                                 {ENGINE_HEADER: name})
                await resp.aclose()
                self.core.finished(name)
                realized = None
                if resp.status_code == 200:
                    try:
                        realized = _cached_tokens(_dec.decode(content).get("usage"))
                    except (msgspec.DecodeError, AttributeError):
                        realized = None
                self._answered(name, predicted.get(name), realized)
                return Response(content, status_code=resp.status_code, headers=out_headers)
            return StreamingResponse(self._pass_through(name, resp, predicted.get(name), strip_usage),
                                     status_code=resp.status_code, headers=out_headers)
        self.core.unroutable += 1
        return _json(503, error_body(503, "no engine could take the request (" + "; ".join(errors) + ")"))

    def _answered(self, name: str, predicted: int | None, realized: int | None) -> None:
        self.core.answered(name, predicted, realized)
        if predicted is not None and realized is not None:
            self._metrics.observe(name, predicted, realized)

    async def _pass_through(self, name: str, resp: Any, predicted: int | None, strip_usage: bool
                            ) -> AsyncIterator[bytes]:
        import httpx

        buf = b""
        realized: int | None = None
        try:
            async for chunk in resp.aiter_raw():
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
                        except msgspec.DecodeError:
                            obj = None
                        if isinstance(obj, dict):
                            r = _cached_tokens(obj.get("usage"))
                            if r is not None:
                                realized = r
                            if strip_usage and not obj.get("choices"):
                                continue
                    out.append(event)
                if out:
                    yield b"".join(out)
            if buf:
                yield buf
        except httpx.TransportError as exc:
            self._failed(name, exc)
            return
        finally:
            await resp.aclose()
            self.core.finished(name)
        self._answered(name, predicted, realized)


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
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port") from None
    sock.listen(2048)
    sock.setblocking(False)
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
