"""The endpoint picker's bookkeeping (sans-IO): request bodies in, picks out, answers counted.

An Inference Gateway (Envoy with the ext_proc filter) asks for each request which engine
takes it. :class:`EndpointPicker` answers from a :class:`~kvstream.proxy.app.KVProxy`'s
routing (the same tokenizer, chat templates, index, weights, loads and metrics as
``kvstream serve --proxy``), and follows each picked request until its answer ends:

* :meth:`EndpointPicker.request`: the buffered request body (and its path, and the
  endpoint subset the gateway allows) -> a :class:`Pick` (the engines to try, best first,
  as ``IP:PORT`` endpoints) or a :class:`Refusal` (an HTTP status and vLLM's error body).
* :meth:`EndpointPicker.claim`: the response phase of that request (seen by the same
  ext_proc stream, or by an observing one that carries the pick's id in a request header)
  takes the pick's :class:`Exchange`; :meth:`Exchange.headers`, :meth:`Exchange.body`
  and :meth:`Exchange.end` count it: in flight, served, routing accuracy
  (predicted vs the answer's ``usage.prompt_tokens_details.cached_tokens``).

A pick that no response phase claims within ``unclaimed_s`` seconds is ended unanswered
(the gateway runs no observer, or the request died before it reached an engine). Times
are arguments; the gRPC shell is :mod:`kvstream.gateway.extproc`.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import urlsplit

import msgspec

from kvstream.proxy.openai import OpenAIError, error_body, parse_json_body

__all__ = ["EndpointPicker", "Exchange", "Pick", "Refusal", "UsageScanner", "endpoint_of", "KINDS"]

KINDS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
"""Request paths the picker reads as OpenAI requests (others get a pick by load)."""

_dec = msgspec.json.Decoder()
_MAX_EVENT_BYTES = 1 << 20  # the most one SSE event may buffer before the scan gives up on it
MAX_ANSWER_BYTES = 64 << 20
"""Largest non-streamed answer the picker reads for its usage (bytes; past it: not counted)."""


def endpoint_of(base_url: str) -> str | None:
    """``IP:PORT`` (``[IPv6]:PORT``) of an engine's ``http=`` base URL; None if it has no
    host. A host name stays a name (the gateway's cluster must then know it by that)."""
    try:
        u = urlsplit(base_url)
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return None
    host = u.hostname
    if not host:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _cached_tokens(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and type(details.get("cached_tokens")) is int:
        return int(details["cached_tokens"])
    return None


class UsageScanner:
    """Reads an engine's answer as it passes for ``usage.prompt_tokens_details.cached_tokens``:
    a JSON body (held up to :data:`MAX_ANSWER_BYTES`, read at the end) or an SSE stream
    (each ``data: {...}`` event that mentions ``"usage"``, at most 1 MiB per event held).
    ``realized``: the last value seen (None: none)."""

    __slots__ = ("sse", "_buf", "_over", "realized")

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self._buf = bytearray()
        self._over = False
        self.realized: int | None = None

    def feed(self, chunk: bytes) -> None:
        """The next bytes of the answer."""
        if self._over:
            return
        self._buf += chunk
        if not self.sse:
            if len(self._buf) > MAX_ANSWER_BYTES:
                self._over = True
                self._buf = bytearray()
            return
        buf = self._buf
        start = 0
        while True:
            cut = buf.find(b"\n\n", start)
            if cut < 0:
                break
            event = bytes(buf[start:cut])
            start = cut + 2
            if event.startswith(b"data: {") and b'"usage"' in event:
                self._event(event[6:])
        del buf[:start]
        if len(buf) > _MAX_EVENT_BYTES:  # not SSE framing we know: skip this event
            buf.clear()

    def _event(self, data: bytes) -> None:
        try:
            obj = _dec.decode(data.strip())
        except (msgspec.DecodeError, RecursionError):
            return
        if isinstance(obj, dict):
            r = _cached_tokens(obj.get("usage"))
            if r is not None:
                self.realized = r

    def close(self) -> int | None:
        """The answer is complete: the cached tokens it reported (None: none)."""
        if not self.sse and not self._over and self._buf:
            try:
                obj = _dec.decode(bytes(self._buf))
            except (msgspec.DecodeError, RecursionError):
                obj = None
            if isinstance(obj, dict):
                self.realized = _cached_tokens(obj.get("usage"))
        elif self.sse and self._buf.startswith(b"data: {"):
            self._event(bytes(self._buf[6:]))
        self._buf = bytearray()
        return self.realized


class Pick:
    """The picker's answer: ``engines`` to try best first (names) and their ``endpoints``
    (``IP:PORT``, same order); ``value``: the endpoints as the header and metadata carry
    them (``IP:PORT,IP:PORT,...``); ``id``: the pick's id (for the response phase)."""

    __slots__ = ("id", "engines", "endpoints", "value", "exchange")

    def __init__(self, id: str, engines: list[str], endpoints: list[str], exchange: "Exchange") -> None:
        self.id = id
        self.engines = engines
        self.endpoints = endpoints
        self.value = ",".join(endpoints)
        self.exchange = exchange

    @property
    def engine(self) -> str:
        """The engine picked first."""
        return self.engines[0]


class Refusal:
    """An answer the gateway sends itself: HTTP ``status`` and vLLM's JSON error ``body``."""

    __slots__ = ("status", "body")

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        self.status = status
        self.body = msgspec.json.encode(error_body(status, message, param))


class Exchange:
    """One picked request, from the pick to the end of its answer (or its abandonment)."""

    __slots__ = ("picker", "id", "engines", "endpoints", "predicted", "engine", "status", "scanner", "at",
                 "claimed", "done")

    def __init__(self, picker: "EndpointPicker", id: str, engines: list[str], endpoints: list[str],
                 predicted: dict[str, int], at: float) -> None:
        self.picker = picker
        self.id = id
        self.engines = engines
        self.endpoints = endpoints
        self.predicted = predicted
        self.engine = engines[0]  # the engine counting it in flight
        self.status: int | None = None
        self.scanner: UsageScanner | None = None
        self.at = at
        self.claimed = False
        self.done = False

    def headers(self, status: int | None, content_type: str, served: str | None) -> None:
        """The response's head: HTTP ``status``, its content type, and the ``IP:PORT`` of
        the engine that answered as the gateway says it (None: it does not say). If that
        is not the engine picked first, the first one refused the request (the gateway's
        retry took a fallback): it is marked down, and the answer counted for the one that
        gave it."""
        if self.done:
            return
        self.status = status
        self.scanner = UsageScanner(content_type.startswith("text/event-stream"))
        p = self.picker
        if served is None or served in ("", "-"):
            if status is not None and status >= 500 and status != 501:
                # No engine answered at all (the gateway's own 503: every try failed).
                p.proxy.request_failed(self.engine, f"the gateway got no answer from it (HTTP {status})")
            return
        name: str | None
        if served in self.endpoints:
            name = self.engines[self.endpoints.index(served)]
        else:
            name = p.engine_at(served)
        if name is None or name == self.engine:
            return
        # Every engine tried before the one that answered refused the request.
        tried = self.engines[: self.engines.index(name)] if name in self.engines else [self.engine]
        for n in tried:
            p.proxy.request_failed(n, f"refused a request the gateway then gave to {name}")
        p.fallbacks += 1
        p.proxy.request_ended(self.engine, None, None, None)  # in flight on the one that answers
        self.engine = name
        p.proxy.request_started(name)

    def body(self, chunk: bytes, end: bool) -> None:
        """The next bytes of the answer; ``end``: they were the last."""
        if self.done:
            return
        if self.scanner is not None:
            self.scanner.feed(chunk)
        if end:
            self.end()

    def end(self) -> None:
        """The answer is over (complete, or cut): count it once."""
        if self.done:
            return
        self.done = True
        self.picker._forget(self)
        realized = self.scanner.close() if self.scanner is not None else None
        predicted = self.predicted.get(self.engine)
        ok = self.status is not None and self.scanner is not None
        self.picker.proxy.request_ended(self.engine, self.status if ok else None, predicted,
                                        realized if self.status == 200 else None)


class EndpointPicker:
    """Picks engines for a gateway's requests with ``proxy``'s routing, and counts them.

    Args:
        proxy: a :class:`~kvstream.proxy.app.KVProxy` (``KVProxy.for_service(core)`` in
            ``kvstream serve``; the same one as proxy mode's when both run).
        clock: monotonic seconds.
        unclaimed_s: how long a pick waits for its response phase (seconds).
        max_pending: most picks waiting for theirs (the oldest is ended past it).
    """

    def __init__(self, proxy: Any, *, clock: Callable[[], float], unclaimed_s: float = 5.0,
                 max_pending: int = 65536) -> None:
        self.proxy = proxy
        self.clock = clock
        self.unclaimed_s = unclaimed_s
        self.max_pending = max_pending
        self.max_body_bytes: int = proxy.max_body_bytes
        self._pending: OrderedDict[str, Exchange] = OrderedDict()
        self._ids = itertools.count(1)
        self._prefix = os.urandom(4).hex()
        self.picks = 0
        self.refused = 0
        self.fallbacks = 0
        self.unclaimed = 0

    # -- request phase --------------------------------------------------------------------

    def request(self, path: str | None, body: bytes, subset: Sequence[str] | None = None) -> Pick | Refusal | None:
        """Pick for one request: ``path`` (None: unknown; then the body's fields say which
        OpenAI call it is), its whole ``body`` and the ``IP:PORT`` endpoints the gateway
        allows (None: any). A :class:`Refusal` for a body that is no OpenAI request on an
        OpenAI path (400) or a subset holding no engine (503); None when no engine is
        known (the gateway balances on its own)."""
        now = self.clock()
        self._sweep(now)
        urls = self.proxy.upstream_urls()
        allowed: set[str] | None = None
        if subset is not None:
            want = set(subset)
            allowed = {n for n, u in urls.items() if endpoint_of(u) in want}
            if not allowed:
                self.refused += 1
                return Refusal(503, "none of the endpoints the gateway allows for this request is a known engine")
        elif not urls:
            return None
        p = (path or "").split("?", 1)[0]
        kind = KINDS.get(p)
        parsed: dict[str, Any] = {}
        if kind is not None or path is None:
            try:
                parsed = parse_json_body(body, self.max_body_bytes)
            except OpenAIError as exc:
                if kind is None:  # no path and no JSON: not ours to judge
                    parsed = {}
                else:
                    self.refused += 1
                    return Refusal(exc.status, exc.message, exc.param)
            if kind is None:
                kind = "chat" if "messages" in parsed else "completions" if "prompt" in parsed else None
        try:
            engines, predicted = self.proxy.pick(parsed, kind, allowed)
        except OpenAIError as exc:
            self.refused += 1
            return Refusal(exc.status, exc.message, exc.param)
        endpoints = []
        names = []
        for n in engines:
            ep = endpoint_of(urls.get(n, "")) if n in urls else None
            if ep is not None:
                names.append(n)
                endpoints.append(ep)
        if not names:
            if allowed is not None:
                self.refused += 1
                return Refusal(503, "no engine of the allowed endpoints can take the request")
            return None
        pid = f"{self._prefix}-{next(self._ids)}"
        ex = Exchange(self, pid, names, endpoints, predicted, now)
        self.proxy.request_started(ex.engine)
        self._pending[pid] = ex
        while len(self._pending) > self.max_pending:
            self._abandon(next(iter(self._pending.values())))
        self.picks += 1
        return Pick(pid, names, endpoints, ex)

    # -- response phase -------------------------------------------------------------------

    def claim(self, pick_id: str) -> Exchange | None:
        """The exchange of pick ``pick_id`` for its response phase (None: unknown, already
        claimed, or given up)."""
        ex = self._pending.pop(pick_id, None)
        if ex is not None:
            ex.claimed = True
        return ex

    def engine_at(self, endpoint: str) -> str | None:
        """The engine whose ``http=`` address is ``endpoint`` (``IP:PORT``)."""
        for n, u in self.proxy.upstream_urls().items():
            if endpoint_of(u) == endpoint:
                return str(n)
        return None

    def sweep(self) -> None:
        """End picks whose response phase did not come within ``unclaimed_s``."""
        self._sweep(self.clock())

    def _sweep(self, now: float) -> None:
        limit = now - self.unclaimed_s
        while self._pending:
            ex = next(iter(self._pending.values()))
            if ex.at > limit:
                break
            self._abandon(ex)

    def _abandon(self, ex: Exchange) -> None:
        self.unclaimed += 1
        ex.end()

    def _forget(self, ex: Exchange) -> None:
        self._pending.pop(ex.id, None)

    def view(self) -> Mapping[str, int]:
        """Counters: picks, refusals, fallbacks taken by the gateway's retries, picks never
        claimed by a response phase, picks waiting for theirs."""
        return {"picks": self.picks, "refused": self.refused, "fallbacks": self.fallbacks,
                "unclaimed": self.unclaimed, "pending": len(self._pending)}
