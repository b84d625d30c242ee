"""Engine load, as the router weighs it: from the request, from each engine's Prometheus
endpoint, and from requests in flight through a proxy.

Sans-IO: :func:`parse_vllm_metrics` turns exposition text into a :class:`Scrape`;
:class:`LoadBoard` keeps the last scrape and the in-flight count per engine and merges them
with what a request reports. The HTTP fetching lives in :mod:`kvstream.service.runtime`.

Precedence, per engine: a load given in the request wins outright; otherwise the last
scrape (``waiting`` -> ``queue``, ``running``, KV usage), with ``running`` raised to the
requests in flight when those are more (a proxy knows about requests the engine has not
reported yet). A scrape older than ``3 * load_interval`` is *stale*: still used (the last
thing known), and shown as stale in ``/v1/engines``.

Availability: a scrape that cannot reach the engine (connection refused, reset or timed
out) marks it *unreachable* until a scrape answers again; the router then ranks it after
every reachable engine (:meth:`LoadBoard.reachable_first`), so a dead engine is not named
best while its event stream has not noticed yet. An engine that answers ``/metrics`` with an
error or text that does not parse is reachable (it answers); only its load is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families

from kvstream.routing.scoring import Load, RecentPlacements

__all__ = ["Scrape", "LoadBoard", "parse_vllm_metrics", "RUNNING", "WAITING", "KV_USAGE"]

RUNNING = ("vllm:num_requests_running",)
"""Gauges of requests running (summed over an engine's series)."""
WAITING = ("vllm:num_requests_waiting",)
"""Gauges of requests waiting (summed)."""
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
"""Gauges of KV cache usage as a fraction 0..1 (vLLM >= 0.10 name first; the highest series
counts)."""
_WANTED = RUNNING + WAITING + KV_USAGE


@dataclass(frozen=True, slots=True)
class Scrape:
    """One engine's load from one scrape: ``running`` and ``waiting`` requests (counts),
    ``kv_usage`` (0..1), ``at`` (seconds, the service's monotonic clock); ``found``: how
    many of the three gauges the exposition had."""

    running: int
    waiting: int
    kv_usage: float
    at: float
    found: int


def parse_vllm_metrics(text: str, at: float) -> Scrape:
    """Parse a vLLM ``/metrics`` exposition (Prometheus text format) with
    prometheus-client's parser. Lines of other metrics are dropped before parsing (vLLM
    exports hundreds of histogram buckets). Raises ``ValueError`` for text the parser
    rejects or when none of the load gauges is present."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2] in _WANTED:
                keep.append(line)
        elif line.startswith("vllm:") and line.split("{", 1)[0].split(" ", 1)[0] in _WANTED:
            keep.append(line)
    running = waiting = 0.0
    kv = 0.0
    found = set()
    for fam in text_string_to_metric_families("\n".join(keep) + "\n"):
        for s in fam.samples:
            if s.name in RUNNING:
                running += s.value
            elif s.name in WAITING:
                waiting += s.value
            elif s.name in KV_USAGE:
                kv = max(kv, s.value)
            else:
                continue
            found.add(s.name)
    if not found:
        raise ValueError(f"none of {', '.join(_WANTED)} in the exposition ({len(text)} bytes)")
    return Scrape(int(running), int(waiting), float(min(max(kv, 0.0), 1.0)), at, len(found))


class LoadBoard:
    """Per engine: the last scrape, the last scrape error and the requests in flight.

    ``stale_after_s``: a scrape older than this (seconds) is stale (default 3 intervals).
    """

    __slots__ = ("stale_after_s", "_scrape", "_error", "_inflight", "_prefill", "_placed", "_cache", "_down")

    def __init__(self, stale_after_s: float = 6.0) -> None:
        self.stale_after_s = stale_after_s
        self._scrape: dict[str, Scrape] = {}
        self._error: dict[str, str] = {}
        self._inflight: dict[str, int] = {}
        self._prefill: dict[str, int] = {}
        self._placed = RecentPlacements()
        self._cache: dict[str, Load] | None = None
        self._down: dict[str, float] = {}

    # -- feeding ---------------------------------------------------------------------

    def scraped(self, engine: str, scrape: Scrape) -> bool:
        """Record a successful scrape of ``engine``. True if it was unreachable until now."""
        self._scrape[engine] = scrape
        self._error.pop(engine, None)
        self._cache = None
        return self._down.pop(engine, None) is not None

    def scrape_failed(self, engine: str, reason: str, *, unreachable: bool | None = False, at: float = 0.0) -> bool:
        """Record a failed scrape (the previous one, if any, is kept and ages);
        ``unreachable``: the engine could not be reached at all (marked so from ``at``,
        seconds), False: it answered wrongly (it is reachable), None: it proves neither
        (one slow answer), its reachability stays as it was. True if its reachability
        changed."""
        self._error[engine] = reason
        if unreachable is None:
            return False
        if unreachable:
            if engine in self._down:
                return False
            self._down[engine] = at
            return True
        return self._down.pop(engine, None) is not None

    def reachable(self, engine: str) -> bool:
        """False while the last scrape could not reach ``engine``."""
        return engine not in self._down

    def reachable_first(self, ranking: list[str]) -> list[str]:
        """``ranking`` with the unreachable engines moved after the others (each group in
        its order)."""
        down = self._down
        if not down or not any(n in down for n in ranking):
            return ranking
        return [n for n in ranking if n not in down] + [n for n in ranking if n in down]

    def started(self, engine: str, n: int = 1) -> None:
        """``n`` requests were sent to ``engine`` (the proxy's in-flight seam)."""
        self._inflight[engine] = self._inflight.get(engine, 0) + n
        self._cache = None

    def prefill(self, engine: str, tokens: int) -> None:
        """``tokens`` more (or, negative, fewer) prompt tokens ``engine`` has to compute for
        requests sent to it and not answered yet: the proxy adds a request's uncached
        tokens when it sends it and takes them back at its first answer byte. A send is
        also a placement (:attr:`~kvstream.routing.scoring.Load.placed_tokens`)."""
        if tokens > 0:
            self._placed.placed(engine, tokens)
        v = self._prefill.get(engine, 0) + tokens
        if v > 0:
            self._prefill[engine] = v
        else:
            self._prefill.pop(engine, None)
        self._cache = None

    def finished(self, engine: str, n: int = 1) -> None:
        """``n`` requests sent to ``engine`` finished (never below zero)."""
        v = self._inflight.get(engine, 0) - n
        if v > 0:
            self._inflight[engine] = v
        else:
            self._inflight.pop(engine, None)
        self._cache = None

    def forget(self, engine: str) -> None:
        """Drop everything known about ``engine`` (it was removed)."""
        self._scrape.pop(engine, None)
        self._error.pop(engine, None)
        self._inflight.pop(engine, None)
        self._prefill.pop(engine, None)
        self._placed.forget(engine)
        self._down.pop(engine, None)
        self._cache = None

    # -- reading ---------------------------------------------------------------------

    def in_flight(self, engine: str) -> int:
        """Requests in flight to ``engine`` (as reported through :meth:`started`)."""
        return self._inflight.get(engine, 0)

    def known(self) -> Mapping[str, Load]:
        """The load of every engine with a scrape or requests in flight (cached until the
        next change)."""
        c = self._cache
        if c is None:
            c = {}
            pf = self._prefill
            placed = self._placed.get
            for name, s in self._scrape.items():
                c[name] = Load(queue=s.waiting, running=max(s.running, self._inflight.get(name, 0)),
                               kv_usage=s.kv_usage, prefill_tokens=pf.get(name, 0), placed_tokens=placed(name))
            for name, n in self._inflight.items():
                if name not in c:
                    c[name] = Load(running=n, prefill_tokens=pf.get(name, 0), placed_tokens=placed(name))
            self._cache = c
        return c

    def effective(self, requested: Mapping[str, Load] | None) -> Mapping[str, Load]:
        """The loads to route with: ``requested`` (from the request) over :meth:`known`."""
        known = self.known()
        if not requested:
            return known
        out = dict(known)
        out.update(requested)
        return out

    def view(self, engine: str, now: float) -> dict[str, object]:
        """``/v1/engines``' ``load`` object for ``engine``: the load routed with, where it
        came from, the scrape's age (seconds) and whether it is stale, the last error."""
        s = self._scrape.get(engine)
        ld = self.known().get(engine, Load())
        out: dict[str, object] = {
            "queue": ld.queue, "running": ld.running, "kv_usage": ld.kv_usage, "prefill_tokens": ld.prefill_tokens,
            "in_flight": self._inflight.get(engine, 0),
            "scraped": s is not None,
            "age_s": None if s is None else round(now - s.at, 3),
            "stale": (now - s.at > self.stale_after_s) if s is not None else engine in self._error,
            "error": self._error.get(engine),
            "reachable": engine not in self._down,
            "unreachable_for_s": round(now - self._down[engine], 3) if engine in self._down else None,
        }
        return out
