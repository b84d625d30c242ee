"""The proxy's bookkeeping (sans-IO): engines, in-flight requests, mark-downs, routing accuracy.

:class:`ProxyCore` knows each upstream engine by name: its base URL, requests in flight
(the load signal the router's policy sees), when a connection failure marked it down and
until when (exponential backoff), and how well the router predicted its prefix cache:
for every answered request, the tokens the router expected the engine to find cached
(``predicted``) and what the engine reported (``usage.prompt_tokens_details.cached_tokens``,
``realized``). It takes times as arguments and does no I/O; the HTTP shell is
:mod:`kvstream.proxy.app`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from kvstream.routing.scoring import Load

__all__ = ["Accuracy", "ByteBudget", "ProxyCore", "Upstream", "UpstreamState"]


@dataclass(frozen=True)
class Upstream:
    """One engine behind the proxy: ``name``, HTTP ``base_url`` (``http://host:port``), and
    its KV event endpoints (``events``: PUB, ``replay``: ROUTER; None: not followed)."""

    name: str
    base_url: str
    events: str | None = None
    replay: str | None = None


@dataclass
class Accuracy:
    """Predicted vs realized cached prompt tokens over answered requests (tokens)."""

    requests: int = 0
    predicted_tokens: int = 0
    realized_tokens: int = 0
    exact: int = 0
    abs_error_tokens: int = 0

    def add(self, predicted: int, realized: int) -> None:
        """Count one request."""
        self.requests += 1
        self.predicted_tokens += predicted
        self.realized_tokens += realized
        self.exact += predicted == realized
        self.abs_error_tokens += abs(predicted - realized)

    def view(self) -> dict[str, Any]:
        """JSON form (``exact_rate``: share of requests predicted exactly)."""
        n = self.requests
        return {"requests": n, "predicted_tokens": self.predicted_tokens, "realized_tokens": self.realized_tokens,
                "exact": self.exact, "exact_rate": self.exact / n if n else None,
                "mean_abs_error_tokens": self.abs_error_tokens / n if n else None}


class ByteBudget:
    """Bytes the proxy may hold at once across all requests (non-streamed answers read
    whole before they are passed on): :meth:`take` before holding, :meth:`give` after.

    ``total``: the bound (bytes). ``held`` and ``peak`` (bytes) and ``refused`` (takes
    that did not fit) are for ``/metrics``.
    """

    __slots__ = ("total", "held", "peak", "refused")

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"the proxy's held-bytes bound must be at least 1 byte, got {total}")
        self.total = total
        self.held = 0
        self.peak = 0
        self.refused = 0

    def take(self, n: int) -> bool:
        """Hold ``n`` more bytes if they fit under :attr:`total` (False: they do not, and
        nothing is taken)."""
        if self.held + n > self.total:
            self.refused += 1
            return False
        self.held += n
        if self.held > self.peak:
            self.peak = self.held
        return True

    def give(self, n: int) -> None:
        """``n`` bytes taken earlier are no longer held."""
        self.held = max(0, self.held - n)


@dataclass
class UpstreamState:
    """What the proxy knows of one engine right now."""

    upstream: Upstream
    in_flight: int = 0
    prefill_tokens: int = 0
    served: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    down_until: float = 0.0
    last_error: str | None = None
    accuracy: Accuracy = field(default_factory=Accuracy)


class ProxyCore:
    """Engines and their state; choose candidates, count outcomes.

    Args:
        upstreams: the engines (names unique).
        backoff_s: first mark-down after a connection failure (seconds); doubles with each
            consecutive failure up to ``max_backoff_s``.
        max_attempts: engines tried per request (1 + retries).
    """

    def __init__(self, upstreams: Iterable[Upstream], *, backoff_s: float = 1.0, max_backoff_s: float = 15.0,
                 max_attempts: int = 3) -> None:
        self.engines: dict[str, UpstreamState] = {}
        for u in upstreams:
            if u.name in self.engines:
                raise ValueError(f"two engines are named {u.name!r}; give each a unique name")
            self.engines[u.name] = UpstreamState(u)
        if backoff_s <= 0 or max_backoff_s < backoff_s or max_attempts < 1:
            raise ValueError("need backoff_s > 0, max_backoff_s >= backoff_s and max_attempts >= 1")
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_attempts = max_attempts
        self.total = Accuracy()
        self.failovers = 0
        self.unroutable = 0
        self._rr = 0

    def ensure(self, name: str, base_url: str) -> UpstreamState:
        """Know ``name`` at ``base_url`` (engines may come and go while serving)."""
        s = self.engines.get(name)
        if s is None or s.upstream.base_url != base_url:
            old = s
            s = UpstreamState(Upstream(name, base_url))
            if old is not None:
                s.accuracy = old.accuracy
            self.engines[name] = s
        return s

    def loads(self) -> dict[str, Load]:
        """Per engine, its load as the policy sees it (requests in flight as ``running``)."""
        return {n: Load(running=s.in_flight, prefill_tokens=s.prefill_tokens) for n, s in self.engines.items()}

    def is_down(self, name: str, now: float) -> bool:
        """Marked down at ``now`` (seconds)?"""
        return self.engines[name].down_until > now

    def candidates(self, ranking: Sequence[str], now: float) -> list[str]:
        """Engines to try in order: ``ranking``'s engines that are up, then (if none is)
        the down ones by earliest recovery; at most ``max_attempts``."""
        known = [n for n in ranking if n in self.engines]
        up = [n for n in known if not self.is_down(n, now)]
        if not up:
            up = sorted(known, key=lambda n: self.engines[n].down_until)
        return up[: self.max_attempts]

    def round_robin(self) -> list[str]:
        """All engines, starting one further at each call (the round-robin baseline)."""
        names = list(self.engines)
        i = self._rr % len(names)
        self._rr += 1
        return names[i:] + names[:i]

    def started(self, name: str) -> None:
        """A request was sent to ``name``."""
        self.engines[name].in_flight += 1

    def prefill(self, name: str, tokens: int) -> None:
        """``tokens`` more (negative: fewer) uncached prompt tokens sent to ``name`` and not
        answered yet (see :attr:`kvstream.routing.scoring.Load.prefill_tokens`)."""
        s = self.engines[name]
        s.prefill_tokens = max(0, s.prefill_tokens + tokens)

    def finished(self, name: str) -> None:
        """A request to ``name`` ended (answered, failed or cancelled)."""
        s = self.engines[name]
        s.in_flight = max(0, s.in_flight - 1)

    def failed(self, name: str, reason: str, now: float) -> bool:
        """``name`` refused or dropped the connection: mark it down (for the backoff).
        True if it was up until now (a state change worth one log line)."""
        s = self.engines[name]
        was_up = s.down_until <= now
        s.failures += 1
        s.consecutive_failures += 1
        s.last_error = reason
        back = min(self.max_backoff_s, self.backoff_s * (2 ** (s.consecutive_failures - 1)))
        s.down_until = now + back
        return was_up

    def answered(self, name: str, predicted: int | None, realized: int | None) -> bool:
        """``name`` answered (any status): it is up; count the accuracy if both are known.
        True if it had failed before (it is back: a state change worth one log line)."""
        s = self.engines[name]
        back = s.consecutive_failures > 0
        s.served += 1
        s.consecutive_failures = 0
        s.down_until = 0.0
        if predicted is not None and realized is not None:
            s.accuracy.add(predicted, realized)
            self.total.add(predicted, realized)
        return back

    def engine_view(self, name: str, now: float) -> dict[str, Any]:
        """The proxy's part of one engine's ``/v1/engines`` entry (empty if unknown)."""
        s = self.engines.get(name)
        if s is None:
            return {}
        return {"state": "down" if self.is_down(name, now) else "up", "in_flight": s.in_flight,
                "served": s.served, "failures": s.failures, "down_for_s": max(0.0, s.down_until - now),
                "last_error": s.last_error, "routing_accuracy": s.accuracy.view()}

    def view(self, now: float, health: dict[str, Any]) -> dict[str, Any]:
        """The ``/v1/engines`` JSON body; ``health``: per engine what the router knows of
        its event stream and index (any JSON value)."""
        out = []
        for n, s in self.engines.items():
            h = health.get(n)
            out.append({
                "name": n, "url": s.upstream.base_url, "events": s.upstream.events,
                "state": "down" if self.is_down(n, now) else "up",
                "stream": h, "in_flight": s.in_flight, "served": s.served, "failures": s.failures,
                "down_for_s": max(0.0, s.down_until - now), "last_error": s.last_error,
                "routing_accuracy": s.accuracy.view(),
            })
        return {"engines": out, "routing_accuracy": self.total.view(), "failovers": self.failovers}
