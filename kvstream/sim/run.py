"""The virtual-time simulation driver: engines, events through the real codec, the router.

:func:`simulate` replays a workload against ``engines`` :class:`~kvstream.sim.engine.EngineModel`
instances under one routing policy, as fast as possible, with no sockets and no clock
reads in the simulated part:

1. Arrivals and engine step ends are processed in time order (ties: engine steps before
   arrivals, then lower engine index).
2. Every engine transition's KV events become one :class:`~kvstream.wire.events.KVEventBatch`
   (``ts`` = simulated time) and are applied to a :class:`~kvstream.routing.index.KVIndex` under
   the engine's source name, ``router_lag_s`` simulated seconds later (0: before the next
   routing decision). By default the index gets the event objects the allocator made:
   they are the values a subscriber decodes from the wire (``tests/sim/test_simulate.py``
   checks that both give identical results). ``SimConfig(wire=True)`` (``--wire``)
   *encodes and decodes every batch with kvstream's wire codec* on the way, as the live
   demo and real engines always do.
3. Each arrival is routed by the policy from the index's score of its prompt and the
   engines' loads (waiting, running, KV usage), then queued on that engine.

:func:`compare` runs several policies (and engine counts) on the same workload.
Deterministic: the same inputs give the same :class:`PolicyResult` except for the fields
measuring wall time.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.wire.events import EventDecoder, EventEncoder, KVEventBatch
from kvstream.hashing import to_external_list
from kvstream.routing.index import KVIndex
from kvstream.routing.scoring import CostPolicy, Load, RecentPlacements
from kvstream.sim.blocks import SegmentHasher
from kvstream.sim.engine import EngineConfig, EngineModel, Prepared, SimRequestState
from kvstream.sim.metrics import PolicyResult, RunMetrics
from kvstream.sim.policies import make_policy
from kvstream.sim.workload import SimRequest, WorkloadError, paused_gc

__all__ = ["SimConfig", "SimRun", "simulate", "compare", "source_name"]


def source_name(engine: int) -> str:
    """The source name engine ``engine`` publishes under in virtual runs."""
    return f"engine-{engine}"


@dataclass(frozen=True)
class SimConfig:
    """Settings of one simulation (everything except the workload and the policy).

    Attributes:
        engines: number of engines.
        engine: each engine's :class:`EngineConfig`.
        router_block_size: the index's router block size in *simulated* tokens (None:
            the engines' simulated block size).
        router_lag_s: simulated seconds between an engine publishing a batch and the index
            applying it.
        seed: seed of the random policy (and anything else random).
        wire: round-trip every batch through the real encoder and decoder before the
            index (slower; results are identical, the codec is tested on its own against
            vLLM captures). False: the index gets the allocator's event objects.
        router_index: ``"engine"`` (default): the router matches by the engines' own block
            hashes (:class:`~kvstream.routing.engine_index.EngineKeyIndex`; it knows the engines'
            algorithm and seed, as every simulated engine shares them); ``"token"``: the
            router computes its own keys from the events' tokens
            (:class:`~kvstream.routing.index.KVIndex`, as for engines it knows nothing about).
            Routing decisions, and so results, are identical (tested); "engine" is faster.
    """

    engines: int = 4
    engine: EngineConfig = field(default_factory=EngineConfig)
    router_block_size: int | None = None
    router_lag_s: float = 0.0
    seed: int = 0
    wire: bool = False
    router_index: str = "engine"
    kv_scoring: Any = None
    """The ``kv-aware`` policy's :class:`~kvstream.routing.scoring.PrefixLoadPolicy`
    (weights of the prefix and of each load term); None: the router's defaults."""
    speculate_ttl_s: float | None = None
    """If set, a KV-aware router pretends the engine it chose holds the routed prompt for
    this many simulated seconds, or until that engine's events arrive (``serve --speculate``;
    :meth:`~kvstream.routing.index.KVIndex.speculate`). It matters where requests sharing a
    new prefix come faster than ``router_lag_s``."""

    def __post_init__(self) -> None:
        if self.router_index not in ("engine", "token"):
            raise WorkloadError(f"router_index must be 'engine' or 'token', got {self.router_index!r}")
        if (self.router_index == "engine" and self.router_block_size is not None
                and self.router_block_size != self.engine.sim_block_size):
            raise WorkloadError(
                f"router_block_size={self.router_block_size} differs from the engines' block "
                f"({self.engine.sim_block_size} simulated tokens): an engine-keyed router matches whole "
                "engine blocks; use router_index='token' for another router block size")
        if self.engines < 1:
            raise WorkloadError(f"engines must be >= 1, got {self.engines}")
        if self.router_lag_s < 0:
            raise WorkloadError(f"router_lag_s must be >= 0 seconds, got {self.router_lag_s}")
        if self.speculate_ttl_s is not None and not self.speculate_ttl_s > 0:
            raise WorkloadError(f"speculate_ttl_s must be > 0 seconds or None, got {self.speculate_ttl_s}")


class SimRun:
    """One policy over one workload: state of a run in progress (see :func:`simulate`).

    Exposed so the live demo and tests can drive and inspect a run; most callers want
    :func:`simulate`.
    """

    def __init__(
        self,
        requests: Sequence[SimRequest],
        policy: str,
        config: SimConfig,
        *,
        hasher: SegmentHasher | None = None,
        prepared: dict[int, Prepared] | None = None,
        on_batch: Callable[[str, int, bytes], None] | None = None,
    ) -> None:
        self.requests = requests
        self.config = config
        self.policy = make_policy(policy, config.seed,
                                  scoring=config.kv_scoring if policy == "kv-aware" else None)
        ec = config.engine
        self.hasher = hasher if hasher is not None else SegmentHasher(ec.block_hasher())
        # request_id -> Prepared; share one dict between runs of the same workload and
        # engine config to tokenize and hash each request once.
        self.prepared = prepared if prepared is not None else {}
        self.metrics = RunMetrics(config.engines)
        self.engines = [EngineModel(i, ec, self.hasher, self.metrics) for i in range(config.engines)]
        self._src = [source_name(i) for i in range(config.engines)]
        self.names = {name: i for i, name in enumerate(self._src)}
        self._R = config.router_block_size or ec.sim_block_size
        self._engine_keyed = config.router_index == "engine"
        self.index: KVIndex | EngineKeyIndex = (
            EngineKeyIndex(ec.block_hasher()) if self._engine_keyed else KVIndex(router_block_size=self._R))
        # Router keys can be memoized per engine block hash when a router block is an
        # engine block (the default).
        self._keys_memo = self._R == ec.sim_block_size
        # Where the router sent its recent requests (Load.recent), as a proxy counts them.
        self._recent: RecentPlacements | None = None
        if isinstance(self.policy.scoring, CostPolicy):
            self.policy.scoring.block_size = self._R  # costs in (simulated) tokens
            if self.policy.scoring.placed_weight:
                self._recent = RecentPlacements()
        self.encoder = EventEncoder()
        self.decoder = EventDecoder()
        self._wire = config.wire
        self.seq = [0] * config.engines
        self.on_batch = on_batch
        self.states: list[SimRequestState] = []
        # (apply at, order, engine, payload or batch)
        self._pending: list[tuple[float, int, int, Any]] = []
        self._order = 0
        # Loads as the router sees them, rebuilt only for engines that changed (stepped or
        # got a request) since the last routing decision.
        self._loads: list[Load] = [Load() for _ in self.engines]
        self._load_map: dict[str, Load] = dict(zip(self._src, self._loads))
        self._dirty: set[int] = set(range(config.engines))
        self.predicted_hit = 0  # simulated tokens the last route() expected cached on its choice

    # -- events ------------------------------------------------------------------------

    def _publish(self, engine: int, now: float, events: list[Any]) -> None:
        if not events:
            return
        batch = KVEventBatch(now, events)
        seq = self.seq[engine]
        self.seq[engine] = seq + 1
        item: Any = batch
        if self._wire or self.on_batch is not None:
            payload = self.encoder.encode(batch)
            if self.on_batch is not None:
                self.on_batch(self._src[engine], seq, payload)
            if self._wire:
                item = payload
        lag = self.config.router_lag_s
        if lag == 0:
            self._apply(engine, item, 0.0)
        else:
            self._order += 1
            heapq.heappush(self._pending, (now + lag, self._order, engine, item))

    def _apply(self, engine: int, item: Any, lag: float) -> None:
        # ``item``: the wire payload (wire=True) or the batch itself.
        batch = self.decoder.decode(item) if self._wire else item
        self.index.apply_batch(self._src[engine], batch)
        m = self.metrics
        m.event_batches += 1
        m.events += len(batch.events)
        m.lags.append(lag)

    def _apply_due(self, now: float) -> None:
        pending = self._pending
        lag = self.config.router_lag_s
        while pending and pending[0][0] <= now:
            _, _, engine, payload = heapq.heappop(pending)
            self._apply(engine, payload, lag)

    # -- routing -----------------------------------------------------------------------

    def loads(self) -> list[Load]:
        """Every engine's load as the router sees it (do not modify the list)."""
        dirty = self._dirty
        if dirty:
            loads = self._loads
            load_map = self._load_map
            src = self._src
            recent = self._recent
            for i in dirty:
                e = self.engines[i]
                ld = loads[i] = Load(len(e.waiting), len(e.running), e.usage, e.pending_prefill_tokens,
                                     recent.get(src[i]) if recent is not None else 0.0)
                load_map[src[i]] = ld
            dirty.clear()
        return self._loads

    def route(self, req: SimRequest, tokens: Sequence[int], prepared: Prepared | None = None) -> int:
        """The engine index the policy picks for ``req`` (now); ``tokens``: its prompt in
        simulated tokens; ``prepared``: its :class:`Prepared` form, if any (lets router
        keys be memoized per prefix)."""
        loads = self.loads()
        pol = self.policy
        if not pol.uses_index:
            return pol.choose(loads)
        index = self.index
        # The router sees the prompt's tokens and computes its keys from them: the same keys
        # as index.keys(tokens), memoized per request (engine hashes are computed once per
        # request anyway) or per prefix (router keys, when router and engine blocks agree).
        keys: list[Any] | None
        if self._engine_keyed:
            if prepared is None:
                keys = index.keys(tokens)
            else:
                keys = prepared.engine_keys
                if keys is None:
                    n = len(tokens) // self._R
                    keys = prepared.engine_keys = to_external_list(prepared.block_hashes[:n])
        elif prepared is not None and self._keys_memo:
            keys = prepared.router_keys
            if keys is None:
                keys = prepared.router_keys = self.hasher.router_keys(
                    prepared.block_hashes, len(tokens) // self._R, tokens)
        else:
            keys = index.keys(tokens)
        load_map = self._load_map
        ttl = self.config.speculate_ttl_s
        if ttl is not None:
            index.expire(req.arrival)

        def score(scoring: Any) -> str | None:
            return index.best(keys, load_map, scoring)

        target = pol.choose(loads, score, self.names)
        if isinstance(pol.scoring, CostPolicy):
            # What a proxy counts for the chosen engine: the prompt less the prefix the
            # router expects cached there (its prefill work, and its new work placed).
            m = index.match(tokens, keys=keys).get(self._src[target])
            self.predicted_hit = m.tokens if m is not None else 0
            if self._recent is not None:
                self._recent.placed(self._src[target], len(tokens) - self.predicted_hit)
                self._dirty.update(range(len(self._src)))  # every sum aged
        if ttl is not None:
            index.speculate(self._src[target], tokens, req.arrival, ttl, keys=keys)
        return target

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> PolicyResult:
        """Run the whole workload to completion; returns the policy's result.

        The cyclic garbage collector is paused meanwhile (see
        :func:`~kvstream.sim.workload.paused_gc`)."""
        with paused_gc():
            return self._run()

    def _run(self) -> PolicyResult:
        t0 = time.perf_counter()
        engines = self.engines
        heap: list[tuple[float, int]] = []  # (wakeup, engine); stale entries skipped
        push = heapq.heappush
        pop = heapq.heappop
        end = 0.0
        ec = self.config.engine
        prepared = self.prepared
        hasher = self.hasher
        dirty = self._dirty
        publish = self._publish
        pending = self._pending
        states = self.states
        routed = self.metrics.routed
        inf = math.inf

        def advance(until: float) -> float:
            last = 0.0
            while heap and heap[0][0] <= until:
                t, i = pop(heap)
                e = engines[i]
                if e.wakeup != t:
                    continue  # superseded (the run was cut short)
                if pending:
                    self._apply_due(t)
                events = e.step(t)
                if events:
                    publish(i, t, events)
                dirty.add(i)
                if e.wakeup != inf:
                    push(heap, (e.wakeup, i))
                last = t
            return last

        for req in self.requests:
            now = req.arrival
            if heap and heap[0][0] <= now:
                advance(now)
            if pending:
                self._apply_due(now)
            # The request as the router and the engine receive it (token ids).
            prep = prepared.get(req.request_id)
            if prep is None:
                prep = prepared[req.request_id] = Prepared(req, ec, hasher)
            target = self.route(req, prep.prompt_tokens, prep)
            e = engines[target]
            st = SimRequestState(req, target, now)
            st.predicted_hit = self.predicted_hit
            states.append(st)
            before = e.wakeup
            if e.submit(st, now, prep):
                routed[target] += 1
                dirty.add(target)
            if e.wakeup != before and e.wakeup != inf:
                push(heap, (e.wakeup, target))
            if now > end:
                end = now
        end = max(end, advance(inf))
        if pending:
            self._apply_due(inf)
        self.metrics.end_time = end
        wall = time.perf_counter() - t0
        return self.metrics.summary(self.policy.name, len(self.requests), wall_seconds=wall)


def simulate(
    requests: Sequence[SimRequest],
    policy: str,
    config: SimConfig | None = None,
    *,
    hasher: SegmentHasher | None = None,
    prepared: dict[int, Prepared] | None = None,
) -> PolicyResult:
    """Run ``requests`` under ``policy`` in virtual time; see the module docstring.

    ``hasher`` and ``prepared`` may be shared between runs with the same workload and
    engine config (tokens and block hashes are then computed once; results are the same).
    """
    return SimRun(requests, policy, config or SimConfig(), hasher=hasher, prepared=prepared).run()


def compare(
    requests: Sequence[SimRequest],
    policies: Sequence[str],
    config: SimConfig | None = None,
    *,
    engine_counts: Sequence[int] | None = None,
    progress: Callable[[PolicyResult], None] | None = None,
    hasher: SegmentHasher | None = None,
    prepared: dict[int, Prepared] | None = None,
) -> list[PolicyResult]:
    """Every policy (times every engine count) on the same workload, in order.

    ``hasher``/``prepared``: shared with other computations over the same workload and
    engine config (e.g. :func:`~kvstream.sim.ceiling.reuse_ceiling`), so each request is
    hashed once."""
    cfg = config or SimConfig()
    hasher = hasher if hasher is not None else SegmentHasher(cfg.engine.block_hasher())
    prepared = prepared if prepared is not None else {}
    out: list[PolicyResult] = []
    for n in engine_counts or (cfg.engines,):
        for p in policies:
            r = simulate(requests, p, replace(cfg, engines=n), hasher=hasher, prepared=prepared)
            out.append(r)
            if progress is not None:
                progress(r)
    return out
