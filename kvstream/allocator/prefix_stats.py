"""Prefix-cache hit statistics, with vLLM's ``PrefixCacheStats``/``PrefixCachingMetrics`` semantics.

A *query* is a prompt token looked up in the prefix cache; a *hit* is one found there.
:class:`PrefixCachingMetrics` keeps the hit rate over the most recent N requests (a
sliding window of observations, oldest dropped first while more than N requests are
aggregated, but never the newest one).
"""

from __future__ import annotations

from collections import deque

__all__ = ["PrefixCacheStats", "PrefixCachingMetrics"]


class PrefixCacheStats:
    """Counters over some span of requests.

    Attributes:
        requests: prefix-cache lookups (admission attempts).
        queries: tokens looked up (each request's prompt length).
        hits: tokens found cached.
        reset: True if the prefix cache was reset during the span.
    """

    __slots__ = ("requests", "queries", "hits", "reset")

    def __init__(self, requests: int = 0, queries: int = 0, hits: int = 0, reset: bool = False) -> None:
        self.requests = requests
        self.queries = queries
        self.hits = hits
        self.reset = reset

    def __repr__(self) -> str:
        return (f"PrefixCacheStats(requests={self.requests}, queries={self.queries}, "
                f"hits={self.hits}, reset={self.reset})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PrefixCacheStats):
            return NotImplemented
        return (self.requests, self.queries, self.hits, self.reset) == (
            other.requests, other.queries, other.hits, other.reset)


class PrefixCachingMetrics:
    """Hit rate over the most recent ``max_recent_requests`` requests.

    Feed it :class:`PrefixCacheStats` with :meth:`observe` (e.g. once per engine step).
    A stats object with ``reset`` set clears the window first.
    """

    __slots__ = ("max_recent_requests", "aggregated_requests", "aggregated_query_total",
                 "aggregated_query_hit", "_queue")

    def __init__(self, max_recent_requests: int = 1000) -> None:
        if max_recent_requests <= 0:
            raise ValueError(f"max_recent_requests must be positive, got {max_recent_requests}")
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self._queue: deque[tuple[int, int, int]] = deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        """Add one observation (stats with no requests only apply their ``reset``)."""
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return
        self.add(stats.requests, stats.queries, stats.hits)

    def add(self, requests: int, queries: int, hits: int) -> None:
        """Add one observation given as counts (the allocation-free form of :meth:`observe`)."""
        q = self._queue
        q.append((requests, queries, hits))
        # Sums in locals, stored once: this runs once per admission attempt.
        total = self.aggregated_requests + requests
        qt = self.aggregated_query_total + queries
        qh = self.aggregated_query_hit + hits
        limit = self.max_recent_requests
        while total > limit and len(q) > 1:
            r, qu, h = q.popleft()
            total -= r
            qt -= qu
            qh -= h
        self.aggregated_requests = total
        self.aggregated_query_total = qt
        self.aggregated_query_hit = qh

    def reset(self) -> None:
        """Forget every observation."""
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self._queue.clear()

    @property
    def hit_rate(self) -> float:
        """Hits / queries over the window (tokens / tokens); 0.0 with no queries."""
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total
