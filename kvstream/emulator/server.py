"""The emulated engine's async shell: an OpenAI-compatible HTTP server (Starlette on
uvicorn) over :class:`~kvstream.emulator.core.EmulatedEngine`, its KV events on a real
:class:`~kvstream.transport.publisher.Publisher`, vLLM's metric names on ``/metrics``.

Routes (vLLM's): ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as
server-sent events or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, and the
tokenizer's own routes that routers call to learn a prompt's token ids: ``POST /tokenize``,
``POST /detokenize``, ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``
(vLLM's request and answer shapes).

One task runs the engine: it sleeps until the engine's next step is due (or a request
arrives), runs the step, publishes its events as one batch and wakes the handlers whose
requests changed. Handlers never touch the engine between steps except to submit or abort.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import anyio
import msgspec

from kvstream.emulator.core import EmulatedEngine, EmulatorConfig, Generation
from kvstream.emulator.metrics import LatencyMetrics
from kvstream.wire.events import KVEventBatch
from kvstream.proxy.openai import (OpenAIError, completion_prompts, error_body, parse_json_body, prompt_token_ids,
                                    read_body, requested_model)
from kvstream.proxy.tokenize import PromptTokenizer
from kvstream.transport.config import KVEventsConfig
from kvstream.transport.publisher import Publisher

__all__ = ["EngineReady", "EngineServer", "MAX_BODY_BYTES", "MAX_TOKEN_ID", "check_sampling",
           "check_token_ids"]

MAX_BODY_BYTES = 16 << 20
"""Largest request body accepted (bytes); larger ones get a 413 JSON error."""

MAX_TOKEN_ID = (1 << 32) - 1
"""Largest prompt token id accepted: more than any model's vocabulary; larger ids are
refused with vLLM's 400 "Token id X is out of vocabulary" (they were a 500)."""

_enc = msgspec.json.Encoder()


def check_token_ids(prompt: list[int], vocab_size: int) -> None:
    """Refuse a prompt with a token id at or above ``vocab_size`` as vLLM does (400,
    "Token id X is out of vocabulary")."""
    top = max(prompt, default=0)
    if top >= vocab_size:
        raise OpenAIError(400, f"Token id {top} is out of vocabulary", "prompt")


def _number(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise OpenAIError(400, f"{name} must be a finite number, got {v!r}", name)
    return float(v)


def _integer(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise OpenAIError(400, f"{name} must be an integer, got {v!r}", name)
    return v


def check_sampling(body: dict[str, Any]) -> None:
    """The sampling fields vLLM validates, with its ranges and messages (its
    ``SamplingParams._verify_args`` and the request models' validators): a request vLLM
    refuses with 400 is refused here too, though the emulator samples nothing."""
    if body.get("stream_options") and not body.get("stream"):
        raise OpenAIError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    t = _number(body, "temperature")
    if t is not None and t < 0:
        raise OpenAIError(400, f"temperature must be non-negative, got {t}.", "temperature")
    p = _number(body, "top_p")
    if p is not None and not 0 < p <= 1:
        raise OpenAIError(400, f"top_p must be in (0, 1], got {p}.", "top_p")
    k = _integer(body, "top_k")
    if k is not None and k < -1:
        raise OpenAIError(400, f"top_k must be 0 (disable), or at least 1, got {k}.", "top_k")
    m = _number(body, "min_p")
    if m is not None and not 0 <= m <= 1:
        raise OpenAIError(400, f"min_p must be in [0, 1], got {m}.", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name)
        if v is not None and not -2 <= v <= 2:
            raise OpenAIError(400, f"{name} must be in [-2, 2], got {v}.", name)
    r = _number(body, "repetition_penalty")
    if r is not None and r <= 0:
        raise OpenAIError(400, f"repetition_penalty must be greater than zero, got {r}.", "repetition_penalty")
    seed = _integer(body, "seed")
    if seed is not None and not -(1 << 63) <= seed < (1 << 63):
        raise OpenAIError(400, f"seed must be a 64-bit integer, got {seed}", "seed")
    mn = _integer(body, "min_tokens")
    if mn is not None:
        mx = body.get("max_tokens", body.get("max_completion_tokens"))
        if mn < 0:
            raise OpenAIError(400, f"min_tokens must be greater than or equal to 0, got {mn}.", "min_tokens")
        if isinstance(mx, int) and not isinstance(mx, bool) and mn > mx:
            raise OpenAIError(400, f"min_tokens must be less than or equal to max_tokens={mx}, got {mn}.",
                              "min_tokens")


async def _http_error(request: Any, exc: Any) -> Any:
    """An unknown path (404) or method (405) in vLLM's error shape, as its HTTPException
    handler answers: ``{"error": {"message": "Not Found", "type": "Not Found", ...}}``."""
    from http import HTTPStatus

    from starlette.responses import Response

    phrase = HTTPStatus(exc.status_code).phrase
    body = {"error": {"message": str(exc.detail or phrase), "type": phrase, "param": None, "code": exc.status_code}}
    return Response(_enc.encode(body), status_code=exc.status_code, media_type="application/json",
                    headers=getattr(exc, "headers", None))


@dataclass(frozen=True)
class EngineReady:
    """Where a started engine listens (what its ready line prints)."""

    http: str
    events: str | None
    replay: str | None
    events_binds: bool = True
    """True if the PUB socket binds ``events``, False if it connects to it (an endpoint
    without ``*``: vLLM's rule)."""


class EngineServer:
    """One emulated engine: HTTP + KV events. ``async with`` it, then :meth:`serve`.

    Args:
        config: the engine's :class:`EmulatorConfig`.
        tokenizer: for text prompts, chat templates and output text (see
            :mod:`kvstream.proxy.tokenize`).
        events: the KV event publisher's config (vLLM's ``--kv-events-config``), or None
            for no events.
        clock: monotonic seconds for the engine's timing model.
    """

    def __init__(self, config: EmulatorConfig, tokenizer: PromptTokenizer,
                 events: KVEventsConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # Prompt token ids must be below this (vLLM: "Token id X is out of vocabulary"). Not the
        # tokenizer's own vocabulary: token-id prompts from a bigger model's tokenizer stay
        # usable with a small one (the emulator never decodes prompt ids).
        self._vocab_size = MAX_TOKEN_ID + 1
        self.engine = EmulatedEngine(config)
        self.events_config = events if events is not None and events.publisher == "zmq" else None
        self.publisher: Publisher | None = None
        self._clock = clock
        self._kick = anyio.Event()
        self._created = int(time.time())
        self.batches_published = 0
        self.latency = LatencyMetrics(config.model)
        self.app = self._build_app()

    # -- the engine task ------------------------------------------------------------------

    async def run_engine(self) -> None:
        """Step the engine forever (cancel to stop)."""
        eng = self.engine
        while True:
            due = eng.wakeup
            now = self._clock()
            if due > now:
                delay = None if due == math.inf else due - now
                with anyio.move_on_after(math.inf if delay is None else delay):
                    await self._kick.wait()
                if self._kick.is_set():
                    self._kick = anyio.Event()
                if eng.wakeup > self._clock():
                    continue
            events, touched = eng.step(self._clock())
            self._publish(events)
            for gen in touched:
                if gen.finished:
                    self.latency.finished(gen)
                ev = gen.waker
                if ev is not None:
                    gen.waker = None
                    ev.set()
            await anyio.lowlevel.checkpoint()

    def _submit(self, prompt: list[int], max_tokens: Any) -> Generation:
        gen = self.engine.submit(prompt, max_tokens, self._clock())
        self._kick.set()
        return gen

    async def _changed(self, *gens: Generation) -> None:
        """Until the engine touches any of ``gens``."""
        ev = anyio.Event()
        for gen in gens:
            gen.waker = ev
        await ev.wait()

    # -- HTTP -----------------------------------------------------------------------------

    def _build_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        return Starlette(exception_handlers={HTTPException: _http_error}, routes=[
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/reset_prefix_cache", self._reset, methods=["POST"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/detokenize", self._detokenize, methods=["POST"]),
            Route("/v1/completions/render", self._render_completions, methods=["POST"]),
            Route("/v1/chat/completions/render", self._render_chat, methods=["POST"]),
        ])

    async def _reset(self, request: Any) -> Any:
        from starlette.responses import Response

        # vLLM's dev endpoint: refuses (and changes nothing) while requests hold blocks.
        if not self.engine.model.manager.reset_prefix_cache():
            body = error_body(400, "the prefix cache cannot be reset while requests are running; retry when idle")
            return Response(_enc.encode(body), status_code=400, media_type="application/json")
        self._publish(self.engine.model.manager.take_events())
        return Response(status_code=200)

    def _publish(self, events: list[Any]) -> None:
        if events and self.publisher is not None:
            self.publisher.publish(KVEventBatch(time.time(), events, 0))
            self.batches_published += 1

    async def _health(self, request: Any) -> Any:
        from starlette.responses import Response

        return Response(status_code=200)

    async def _models(self, request: Any) -> Any:
        from starlette.responses import Response

        cfg = self.config
        # vLLM's ModelCard: owned_by "vllm" (clients tell vLLM backends apart by it) and one
        # default ModelPermission.
        body = {"object": "list", "data": [{
            "id": cfg.model, "object": "model", "created": self._created, "owned_by": "vllm",
            "root": cfg.model, "parent": None, "max_model_len": cfg.max_model_len,
            "permission": [{"id": f"modelperm-{cfg.model}", "object": "model_permission", "created": self._created,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}]}
        return Response(_enc.encode(body), media_type="application/json")

    async def _metrics(self, request: Any) -> Any:
        from starlette.responses import Response

        return Response(self.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def metrics_text(self) -> bytes:
        """The Prometheus text exposition, with vLLM's metric names (``vllm:...``)."""
        eng = self.engine
        labels = f'{{engine="0",model_name="{self.config.model}"}}'
        c = eng.counters
        lines = [
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", eng.num_running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", eng.num_waiting),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", eng.kv_usage),
            ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage (pre-0.10 name). 1 means 100 percent usage.",
             eng.kv_usage),
            ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
             eng.prefix_queries),
            ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
             eng.prefix_hits),
            ("vllm:num_preemptions", "counter", "Cumulative number of preemptions from the engine.", eng.preemptions),
            ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", c["prompt_tokens"]),
            ("vllm:generation_tokens", "counter", "Number of generation tokens processed.", c["generation_tokens"]),
        ]
        pub = self.publisher
        lines.append(("kvstream:kv_event_batches_published", "counter",
                      "KV event batches published (the last seq is this minus 1).",
                      pub.next_seq if pub is not None else 0))
        out = []
        for name, kind, help_, value in lines:
            # prometheus_client (vLLM's exporter) names a counter's family with its _total suffix.
            full = f"{name}_total" if kind == "counter" else name
            out.append(f"# HELP {full} {help_}\n# TYPE {full} {kind}\n")
            out.append(f"{full}{labels} {float(value)!r}\n")
        # vLLM (v1 metrics): one series per finish reason, each present from the start. The
        # emulator never stops early, so every finished request ends on "length".
        out.append("# HELP vllm:request_success_total Count of successfully processed requests.\n"
                   "# TYPE vllm:request_success_total counter\n")
        for reason, n in (("stop", 0), ("length", c["finished"]), ("abort", c["aborted"])):
            out.append(f'vllm:request_success_total{labels[:-1]},finished_reason="{reason}"}} {float(n)!r}\n')
        return "".join(out).encode() + self.latency.render()

    async def _tokenizer_call(self, request: Any, answer: Callable[[dict[str, Any]], Any]) -> Any:
        """One of the tokenizer routes: parse the body, check the model, answer JSON (an
        :class:`OpenAIError` as vLLM's error shape)."""
        from starlette.responses import Response

        try:
            body = parse_json_body(await read_body(request, MAX_BODY_BYTES), MAX_BODY_BYTES)
            if body.get("model") is not None and body.get("model") != self.config.model:
                raise OpenAIError(404, f"The model `{body.get('model')}` does not exist.", "model")
            out = answer(body)
        except OpenAIError as exc:
            return Response(_enc.encode(exc.body()), status_code=exc.status, media_type="application/json")
        return Response(_enc.encode(out), media_type="application/json")

    def _prompts(self, body: dict[str, Any]) -> list[list[int]]:
        """A completions body's prompts as token ids: one text or id list, or a list of them."""
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            return [prompt_token_ids({**body, "prompt": x}, "completions", self.tokenizer) for x in p]
        return [prompt_token_ids(body, "completions", self.tokenizer)]

    async def _tokenize(self, request: Any) -> Any:
        def answer(body: dict[str, Any]) -> Any:
            kind = "chat" if "messages" in body else "completions"
            if kind == "completions" and not isinstance(body.get("prompt"), str):
                raise OpenAIError(400, "'prompt' must be a string", "prompt")
            ids = prompt_token_ids(body, kind, self.tokenizer)
            return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": None}
        return await self._tokenizer_call(request, answer)

    async def _detokenize(self, request: Any) -> Any:
        def answer(body: dict[str, Any]) -> Any:
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
                raise OpenAIError(400, "'tokens' must be a list of token ids", "tokens")
            check_token_ids(ids, self._vocab_size)
            return {"prompt": self.tokenizer.decode(ids)}
        return await self._tokenizer_call(request, answer)

    async def _render_completions(self, request: Any) -> Any:
        def answer(body: dict[str, Any]) -> Any:
            return [{"prompt_token_ids": ids, "prompt": self.tokenizer.decode(ids)} for ids in self._prompts(body)]
        return await self._tokenizer_call(request, answer)

    async def _render_chat(self, request: Any) -> Any:
        def answer(body: dict[str, Any]) -> Any:
            ids = prompt_token_ids(body, "chat", self.tokenizer)
            return [body["messages"], [{"prompt_token_ids": ids, "prompt": self.tokenizer.decode(ids)}]]
        return await self._tokenizer_call(request, answer)

    async def _completions(self, request: Any) -> Any:
        return await self._generate(request, "completions")

    async def _chat(self, request: Any) -> Any:
        return await self._generate(request, "chat")

    async def _generate(self, request: Any, kind: str) -> Any:
        from starlette.responses import Response, StreamingResponse

        gens: list[Generation] = []
        try:
            body = parse_json_body(await read_body(request, MAX_BODY_BYTES), MAX_BODY_BYTES)
            model = requested_model(body, self.config.model)
            # A completion's prompt may be a batch (vLLM: one choice per prompt, in order).
            prompts = [prompt_token_ids(body, kind, self.tokenizer)] if kind == "chat" else \
                completion_prompts(body, self.tokenizer)
            for prompt in prompts:
                check_token_ids(prompt, self._vocab_size)
            check_sampling(body)
            if body.get("n", 1) != 1:
                raise OpenAIError(400, "the emulated engine generates one choice per prompt (n must be 1)", "n")
            max_tokens = body.get("max_tokens")
            if max_tokens is None:
                max_tokens = body.get("max_completion_tokens")
            for prompt in prompts:
                gens.append(self._submit(prompt, max_tokens))
        except OpenAIError as exc:
            for gen in gens:  # a later prompt of the batch was refused: none of it runs
                self.engine.abort(gen, self._clock())
            return Response(_enc.encode(exc.body()), status_code=exc.status, media_type="application/json")
        want_ids = bool(body.get("return_token_ids"))
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
            # vLLM: usage on every chunk only with include_usage and continuous_usage_stats both set.
            continuous = usage and bool(opts.get("continuous_usage_stats"))
            return StreamingResponse(self._stream(gens, kind, model, usage, want_ids, prompts, continuous),
                                     media_type="text/event-stream")
        try:
            while not all(g.finished for g in gens):
                await self._changed(*(g for g in gens if not g.finished))
        finally:
            for gen in gens:
                if not gen.finished:
                    self.engine.abort(gen, self._clock())
        choices: list[dict[str, Any]] = []
        for i, gen in enumerate(gens):
            text = self.tokenizer.decode(gen.output)
            choice: dict[str, Any]
            if kind == "chat":
                choice = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                          "finish_reason": "length", "stop_reason": None}
            else:
                choice = {"index": i, "text": text, "logprobs": None, "finish_reason": "length",
                          "stop_reason": None}
            if want_ids:
                choice["token_ids"] = gen.output
                if len(gens) > 1:
                    choice["prompt_token_ids"] = prompts[i]
            choices.append(choice)
        obj, rid = ("chat.completion", f"chatcmpl-{gens[0].request_id}") if kind == "chat" else \
            ("text_completion", f"cmpl-{gens[0].request_id}")
        out: dict[str, Any] = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
                               "choices": choices, "usage": self._usage(gens)}
        if want_ids and len(gens) == 1:
            out["prompt_token_ids"] = prompts[0]
        return Response(_enc.encode(out), media_type="application/json")

    @staticmethod
    def _usage(gens: list[Generation]) -> dict[str, Any]:
        # vLLM's: token counts summed over the batch; prompt_tokens_details only when
        # something was cached, and then the last prompt's count (what vLLM reports).
        n_in = sum(g.prompt_tokens for g in gens)
        n_out = sum(g.delivered for g in gens)
        usage: dict[str, Any] = {"prompt_tokens": n_in, "total_tokens": n_in + n_out, "completion_tokens": n_out}
        cached = gens[-1].cached_tokens or 0
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def _stream(self, gens: list[Generation], kind: str, model: str, include_usage: bool, want_ids: bool,
                      prompts: list[list[int]], continuous_usage: bool = False) -> AsyncIterator[bytes]:
        created = int(time.time())
        chat = kind == "chat"
        rid = f"chatcmpl-{gens[0].request_id}" if chat else f"cmpl-{gens[0].request_id}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = [0] * len(gens)
        texts = [""] * len(gens)

        def chunk(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
            body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                                    "choices": [] if choice is None else [choice]}
            if usage is None and continuous_usage and choice is not None:
                # stream_options.continuous_usage_stats: the counts so far on every chunk, as vLLM sends them.
                i = choice["index"]
                n_out = sent[i] if "delta" not in choice or choice["delta"].get("role") is None else 0
                usage = {"prompt_tokens": gens[i].prompt_tokens, "completion_tokens": n_out,
                         "total_tokens": gens[i].prompt_tokens + n_out}
            if usage is not None:
                body["usage"] = usage
            return b"data: " + _enc.encode(body) + b"\n\n"

        role_sent = not chat
        try:
            while True:
                ready = [i for i, g in enumerate(gens) if g.delivered > sent[i]]
                if not ready:
                    if all(g.finished for g in gens):
                        break  # finished and everything sent
                    await self._changed(*(g for g in gens if not g.finished))
                    continue
                if not role_sent:  # vLLM sends the role chunk with the first output
                    role_sent = True
                    yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})
                for i in ready:
                    gen = gens[i]
                    new_ids = gen.output[sent[i]:gen.delivered]
                    full = self.tokenizer.decode(gen.output[:gen.delivered])
                    delta, texts[i] = full[len(texts[i]):], full
                    last = gen.finished and gen.delivered == len(gen.output)
                    reason = "length" if last else None
                    choice: dict[str, Any]
                    if chat:
                        choice = {"index": i, "delta": {"content": delta}, "logprobs": None, "finish_reason": reason}
                    else:
                        choice = {"index": i, "text": delta, "logprobs": None, "finish_reason": reason,
                                  "stop_reason": None}
                    if want_ids:
                        choice["token_ids"] = new_ids
                        if sent[i] == 0:
                            choice["prompt_token_ids"] = prompts[i]
                    sent[i] = gen.delivered
                    yield chunk(choice)
            if include_usage:
                yield chunk(None, self._usage(gens))
            yield b"data: [DONE]\n\n"
        finally:
            for gen in gens:
                if not gen.finished:
                    self.engine.abort(gen, self._clock())

    # -- running --------------------------------------------------------------------------

    async def serve(self, host: str = "127.0.0.1", port: int = 0,
                    on_ready: Callable[[EngineReady], None] | None = None,
                    log_level: str = "warning", timeout_keep_alive: int = 5) -> None:
        """Bind HTTP on ``host:port`` (0: any free port) and the publisher's sockets, call
        ``on_ready`` once both accept, and serve until SIGINT/SIGTERM (then return).
        ``timeout_keep_alive``: seconds before an idle kept-alive connection is closed
        (vLLM's server: 5)."""
        import uvicorn

        from kvstream.service.listen import listen_tcp

        sock = listen_tcp(host, port)
        bound_port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, timeout_keep_alive=timeout_keep_alive)
        server = uvicorn.Server(config)
        try:
            async with _maybe_publisher(self.events_config, self.engine) as pub, \
                    anyio.create_task_group() as tg:
                self.publisher = pub
                tg.start_soon(self.run_engine)

                async def announce() -> None:
                    while not server.started:
                        await anyio.sleep(0.005)
                    if on_ready is not None:
                        shown = f"[{host}]" if ":" in host else host
                        on_ready(EngineReady(f"http://{shown}:{bound_port}",
                                             pub.endpoint if pub is not None else None,
                                             pub.replay_endpoint if pub is not None else None,
                                             pub.binds if pub is not None else True))

                tg.start_soon(announce)
                await server.serve(sockets=[sock])
                tg.cancel_scope.cancel()
        finally:
            self.publisher = None
            sock.close()


class _maybe_publisher:
    """``async with`` a :class:`Publisher` (with the engine's pool as snapshot provider),
    or None when events are off."""

    def __init__(self, cfg: KVEventsConfig | None, engine: EmulatedEngine) -> None:
        self._pub = None if cfg is None else Publisher(
            cfg, snapshot_provider=engine.model.manager.pool.snapshot_events)

    async def __aenter__(self) -> Publisher | None:
        if self._pub is None:
            return None
        return await self._pub.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        if self._pub is not None:
            await self._pub.__aexit__(*exc)
