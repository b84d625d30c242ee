"""Every metric ``kvstream serve`` exports, and its Prometheus exposition.

Two kinds:

* **Request metrics** are prometheus-client objects updated on the request path
  (:class:`ServiceMetrics` pre-binds their label children, so an update is one call).
* **State metrics** (per-engine stream counters, engine state, lag, blocks held, load,
  index size) already live in the subscriber and the index; a collector reads them when
  Prometheus scrapes, through a snapshot function the service passes in, so nothing is
  counted twice and the hot path pays nothing for them.

Each :class:`ServiceMetrics` has its own ``CollectorRegistry`` (several services in one
process, as in tests, do not collide). This module imports nothing of kvstream's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["ServiceMetrics", "EngineSnapshot", "IndexSnapshot", "CONTENT_TYPE", "ENGINE_STATES", "APIS"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition content type."""

ENGINE_STATES = ("connecting", "live", "recovering", "stale")
"""Every value of an engine's ``state`` (``kvstream_engine_state`` has one series each)."""

APIS = ("route", "query", "query_by_hash")
"""The routing APIs, the ``api`` label of the request metrics."""

# Engine stream counters exported as ``kvstream_engine_<name>_total``: (counter key, help).
_STREAM_COUNTERS = (
    ("events", "KV events received from the engine (live, replayed and snapshot)."),
    ("batches", "Event batches received from the engine."),
    ("gaps", "Sequence gaps detected on the engine's live stream."),
    ("replays", "Replay requests sent to the engine (retries included)."),
    ("snapshots", "Snapshot requests sent to the engine."),
    ("restarts", "Engine restarts detected (sequence went backwards)."),
    ("stale_marks", "Times the engine's state was marked stale (unrecoverable loss)."),
    ("decode_errors", "Payloads from the engine that could not be decoded (dropped)."),
    ("frame_errors", "Malformed messages from the engine (dropped)."),
    ("timeouts", "Replay or snapshot requests to the engine that got no answer in time."),
)


@dataclass(slots=True)
class EngineSnapshot:
    """One engine's state as the metrics see it (built by the service at scrape time).

    ``counters``: the stream counters by name (see ``_STREAM_COUNTERS``); ``lag_s``:
    seconds; ``blocks``: engine blocks held per medium; ``load``: ``queue``, ``running``,
    ``kv_usage`` and ``in_flight`` as the router sees them.
    """

    name: str
    state: str
    last_seq: int
    lag_s: float
    counters: Mapping[str, int] = field(default_factory=dict)
    blocks: Mapping[str, int] = field(default_factory=dict)
    load: Mapping[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class IndexSnapshot:
    """One router index: its name (``default`` or a Mooncake group), engine blocks held
    (all sources and media) and estimated heap bytes."""

    name: str
    entries: int
    estimated_bytes: int


class _StateCollector(Collector):
    def __init__(self, engines: Callable[[], Iterable[EngineSnapshot]],
                 indexes: Callable[[], Iterable[IndexSnapshot]]) -> None:
        self._engines = engines
        self._indexes = indexes

    def collect(self) -> Iterable[Any]:
        fams = {k: CounterMetricFamily(f"kvstream_engine_{k}", h, labels=["engine"]) for k, h in _STREAM_COUNTERS}
        state = GaugeMetricFamily("kvstream_engine_state", "1 for the engine's current state, 0 for the others.",
                                  labels=["engine", "state"])
        lag = GaugeMetricFamily("kvstream_engine_lag_seconds",
                                "Seconds between the engine's last live batch timestamp and its arrival.",
                                labels=["engine"])
        seq = GaugeMetricFamily("kvstream_engine_last_seq", "Last batch seq applied from the engine (-1: none).",
                                labels=["engine"])
        blocks = GaugeMetricFamily("kvstream_engine_blocks", "Engine blocks the index holds for the engine, per medium.",
                                   labels=["engine", "medium"])
        load = GaugeMetricFamily("kvstream_engine_load", "The engine's load as the router sees it "
                                 "(queue, running, kv_usage, in_flight).", labels=["engine", "kind"])
        for e in self._engines():
            for k, _h in _STREAM_COUNTERS:
                fams[k].add_metric([e.name], float(e.counters.get(k, 0)))
            for s in ENGINE_STATES:
                state.add_metric([e.name, s], 1.0 if e.state == s else 0.0)
            lag.add_metric([e.name], e.lag_s)
            seq.add_metric([e.name], float(e.last_seq))
            for m, n in e.blocks.items():
                blocks.add_metric([e.name, m], float(n))
            for k, v in e.load.items():
                load.add_metric([e.name, k], float(v))
        entries = GaugeMetricFamily("kvstream_index_entries", "Engine blocks held by a router index (all sources and media).",
                                    labels=["index"])
        nbytes = GaugeMetricFamily("kvstream_index_estimated_bytes", "Estimated heap bytes of a router index.",
                                   labels=["index"])
        for ix in self._indexes():
            entries.add_metric([ix.name], float(ix.entries))
            nbytes.add_metric([ix.name], float(ix.estimated_bytes))
        yield from fams.values()
        yield from (state, lag, seq, blocks, load, entries, nbytes)

    def describe(self) -> Iterable[Any]:
        return []  # collected on demand; nothing to check at registration


class ServiceMetrics:
    """The service's metrics in their own registry.

    Args:
        engines: returns every engine's :class:`EngineSnapshot` (called per scrape).
        indexes: returns every index's :class:`IndexSnapshot` (called per scrape).

    Request metrics (update them through the methods below):

    * ``kvstream_route_requests_total{api, outcome}``: routing requests (``outcome`` is
      ``ok`` or ``rejected``);
    * ``kvstream_route_latency_seconds{api}``: time to answer an accepted request
      (decode, hash, score, encode), seconds;
    * ``kvstream_route_matched_tokens{api}``: the best match per accepted request, tokens;
    * ``kvstream_route_chosen_total{engine}``: engines chosen by ``/v1/route``;
    * ``kvstream_http_rejections_total{status, code}``: 4xx answers by status and error code;
    * ``kvstream_load_scrapes_total{engine, outcome}``: load scrapes (``ok``, ``error``);
    * ``kvstream_registrations_total{action}``: Mooncake ``register``/``unregister`` calls
      that succeeded.
    * ``kvstream_build_info{version,python}``: always 1; which build answers.
    """

    def __init__(self, engines: Callable[[], Iterable[EngineSnapshot]] = tuple,
                 indexes: Callable[[], Iterable[IndexSnapshot]] = tuple) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self._requests = Counter("kvstream_route_requests", "Routing requests by API and outcome.",
                                 ["api", "outcome"], registry=r)
        self._latency = Histogram(
            "kvstream_route_latency_seconds", "Seconds to answer an accepted routing request.", ["api"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self._matched = Histogram(
            "kvstream_route_matched_tokens", "Tokens of the best cached prefix per accepted routing request.",
            ["api"], buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144), registry=r,
        )
        self._chosen = Counter("kvstream_route_chosen", "Engines chosen by /v1/route.", ["engine"], registry=r)
        self._rejections = Counter("kvstream_http_rejections", "4xx answers by status and error code.",
                                   ["status", "code"], registry=r)
        self._scrapes = Counter("kvstream_load_scrapes", "Scrapes of engines' Prometheus endpoints by outcome.",
                                ["engine", "outcome"], registry=r)
        self._registrations = Counter("kvstream_registrations", "Successful Mooncake register/unregister calls.",
                                      ["action"], registry=r)
        self._ok = {a: self._requests.labels(a, "ok") for a in APIS}
        self._rej = {a: self._requests.labels(a, "rejected") for a in APIS}
        self._lat = {a: self._latency.labels(a) for a in APIS}
        self._mt = {a: self._matched.labels(a) for a in APIS}
        self._chosen_by: dict[str, Any] = {}
        r.register(_StateCollector(engines, indexes))
        import platform
        from importlib import metadata

        from prometheus_client import Info

        try:
            version = metadata.version("kvstream")
        except metadata.PackageNotFoundError:  # run from a source tree
            version = "unknown"
        # kvstream_build_info{version, python}: 1 (which build answers, for dashboards).
        Info("kvstream_build", "The kvstream build serving.", registry=r).info(
            {"version": version, "python": platform.python_version()})

    def routed(self, api: str, seconds: float, matched_tokens: int, engine: str | None = None) -> None:
        """Count one accepted request of ``api`` that took ``seconds`` and whose best
        match was ``matched_tokens`` tokens; ``engine``: the choice (``/v1/route``)."""
        self._ok[api].inc()
        self._lat[api].observe(seconds)
        self._mt[api].observe(matched_tokens)
        if engine is not None:
            c = self._chosen_by.get(engine)
            if c is None:
                c = self._chosen_by[engine] = self._chosen.labels(engine)
            c.inc()

    def rejected(self, api: str | None, status: int, code: str) -> None:
        """Count one 4xx answer (``api``: the routing API it was for, if any)."""
        if api in self._rej:
            self._rej[api].inc()
        self._rejections.labels(str(status), code).inc()

    def scraped(self, engine: str, ok: bool) -> None:
        """Count one load scrape of ``engine``."""
        self._scrapes.labels(engine, "ok" if ok else "error").inc()

    def registration(self, action: str) -> None:
        """Count one successful ``register`` or ``unregister``."""
        self._registrations.labels(action).inc()

    def render(self) -> bytes:
        """The exposition text (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
