"""Where the proxy's routing decisions come from: its own router, or ``kvstream serve``'s core.

The proxy (:mod:`kvstream.proxy.app`) needs, per request, the engines ranked for a prompt
with each engine's cached prefix, the engines' HTTP base URLs, and a place to report
requests in flight. It never touches an index: an engine that stops answering HTTP is
marked down by the proxy alone, while its index follows its KV event stream only.

* :class:`RouterBackend` owns a :class:`~kvstream.routing.router.Router` (the standalone
  proxy as a library); the load is the proxy's own in-flight count.
* :class:`ServiceBackend` reads ``kvstream serve``'s :class:`~kvstream.service.core.ServiceCore`
  (proxy mode of the service): its default index and scoring weights, its engines (those
  with an ``http=`` URL are proxied to), and its load board, which the proxy's in-flight
  requests feed (with the engines' scraped vLLM metrics).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

from kvstream.routing.scoring import Load, PrefixLoadPolicy, ScoreResult

__all__ = ["RouterBackend", "RoutingBackend", "ServiceBackend"]


class RoutingBackend(Protocol):
    """What the proxy asks of a router."""

    def upstreams(self) -> Mapping[str, str]:
        """Engines the proxy may send to: name -> HTTP base URL. Not changed in place: a
        change of engines is a new map (the proxy checks what it knows only then)."""
        ...

    def score(self, tokens: list[int], loads: Mapping[str, Load] | None, speculate: bool) -> ScoreResult:
        """Rank every engine for ``tokens``; ``loads`` None: the backend's own."""
        ...

    def loads(self) -> Mapping[str, Load] | None:
        """The loads to route with (None: the proxy's in-flight counts)."""
        ...

    def started(self, name: str) -> None:
        """A request was sent to ``name``."""
        ...

    def finished(self, name: str) -> None:
        """A request to ``name`` ended."""
        ...

    def prefill(self, name: str, tokens: int) -> None:
        """``tokens`` more (negative: fewer) uncached prompt tokens in flight to ``name``."""
        ...

    def stream_view(self, name: str) -> dict[str, Any]:
        """What the router knows of ``name``'s event stream and index (JSON)."""
        ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc: Any) -> None: ...


class RouterBackend:
    """A :class:`Router` of the proxy's own (started and stopped with the proxy).

    Args:
        router: the router (its index has a source per engine).
        urls: engine name -> HTTP base URL.
        policy: the scoring policy.
    """

    def __init__(self, router: Any, urls: Mapping[str, str], policy: PrefixLoadPolicy) -> None:
        self.router = router
        self._urls = dict(urls)
        self._policy = policy

    def upstreams(self) -> Mapping[str, str]:
        return self._urls

    def score(self, tokens: list[int], loads: Mapping[str, Load] | None, speculate: bool) -> ScoreResult:
        if speculate:
            res: ScoreResult = self.router.route(tokens, loads)
            return res
        return self.router.index.score(tokens, loads=loads, policy=self._policy)

    def loads(self) -> Mapping[str, Load] | None:
        return None

    def started(self, name: str) -> None:
        pass

    def finished(self, name: str) -> None:
        pass

    def prefill(self, name: str, tokens: int) -> None:
        pass  # the proxy's own core counts them (its loads are the backend's)

    def stream_view(self, name: str) -> dict[str, Any]:
        h = self.router.health().get(name)
        info = self.router.index.source_info(name)
        return {"state": h.state if h is not None else "not followed", "stale": info.stale,
                "blocks": info.blocks, "applied_seq": self.router.applied_seq(name),
                "restarts": h.counters.get("restarts", 0) if h is not None else 0}

    async def __aenter__(self) -> "RouterBackend":
        await self.router.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.router.__aexit__(*exc)


class ServiceBackend:
    """``kvstream serve``'s core as the proxy's router (the service runs its subscriber).

    Args:
        core: the service core.
        speculate_ttl_s: life of a speculative insert (seconds; the service's setting).
        clock: monotonic seconds (the core's).
    """

    def __init__(self, core: Any, *, clock: Callable[[], float] | None = None) -> None:
        self.core = core
        self._clock = clock or core.clock
        self._urls: Mapping[str, str] = {}
        self._urls_gen = -1  # the core's engines_gen the map was made at

    def _index(self, name: str | None = None) -> Any:
        from kvstream.service.core import DEFAULT_INDEX

        if name is not None and name in self.core.engines:
            return self.core.indexes[self.core.engines[name].index]
        return self.core.indexes[DEFAULT_INDEX]

    def upstreams(self) -> Mapping[str, str]:
        # Made again only when the engines change (not per request); the same object until then.
        core = self.core
        if self._urls_gen != core.engines_gen:
            from kvstream.service.core import DEFAULT_INDEX

            self._urls = {n: e.http for n, e in core.engines.items() if e.http and e.index == DEFAULT_INDEX}
            self._urls_gen = core.engines_gen
        return self._urls

    def score(self, tokens: list[int], loads: Mapping[str, Load] | None, speculate: bool) -> ScoreResult:
        ix = self._index()
        now = self._clock()
        ix.expire(now)
        # Keys only when speculating (the insert needs them): else the index chains and
        # walks the prompt natively in one call (KVIndex.score without keys).
        keys = ix.keys(tokens) if speculate else None
        res: ScoreResult = ix.score(tokens, loads=loads, policy=self.core.policy, keys=keys)
        res.ranking = self.core.loads.reachable_first(res.ranking)  # unreachable by scrape: last
        if keys is not None and res.best is not None:
            ix.speculate(res.best, tokens, now, self.core.config.speculate_ttl, keys=keys)
        return res

    def loads(self) -> Mapping[str, Load] | None:
        return self.core.loads.effective(None)

    def started(self, name: str) -> None:
        self.core.loads.started(name)

    def finished(self, name: str) -> None:
        self.core.loads.finished(name)

    def prefill(self, name: str, tokens: int) -> None:
        self.core.loads.prefill(name, tokens)

    def stream_view(self, name: str) -> dict[str, Any]:
        # The service's /v1/engines shows the stream already; the proxy adds its own part.
        return {}

    async def __aenter__(self) -> "ServiceBackend":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        pass
