"""Routing policy: turn per-source prefix matches and reported load into a ranked choice.

The index (:mod:`kvstream.routing.index`) measures, for one prompt, how long a prefix every source
holds and in which tier (:class:`SourceMatch`). A *policy* turns those matches plus the
load the caller reports (:class:`Load`) into a ranking. A policy is any callable::

    policy(matches: Sequence[SourceMatch], loads: Mapping[str, Load], n_blocks: int)
        -> list[tuple[float, str]]          # (value, source), any order

and :func:`rank` sorts its output deterministically: higher value first, then lower load,
then source name. :class:`PrefixLoadPolicy` is the index's default: the cached share of the
prompt minus a load penalty. :class:`CostPolicy` is the placement model: the work a request
would really cost on each engine (its uncached prompt tokens plus the prefill work already
queued there), with a seeded spread among near-equal engines.

This module imports nothing of kvstream's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "Load",
    "SourceMatch",
    "ScoreResult",
    "Policy",
    "PrefixLoadPolicy",
    "CostPolicy",
    "rank",
]

DEFAULT_TIER_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.8}
"""Value of one cached block by the medium that holds it (a block held by several
media counts with the best one). Media not listed weigh :attr:`PrefixLoadPolicy.other_tier_weight`."""


@dataclass(frozen=True, slots=True)
class Load:
    """What a caller knows about an engine's load right now.

    Attributes:
        queue: requests waiting (count).
        running: requests running (count).
        kv_usage: fraction of the KV cache in use, 0.0 to 1.0.
        prefill_tokens: prompt tokens the engine still has to compute for requests already
            sent to it (uncached tokens of requests that have not produced their first token
            yet), where the caller knows them (a proxy does); 0 when unknown.
    """

    queue: int = 0
    running: int = 0
    kv_usage: float = 0.0
    prefill_tokens: int = 0


_NO_LOAD = Load()


@dataclass(slots=True)
class SourceMatch:
    """One source's cached prefix of one prompt.

    Attributes:
        source: the source name.
        blocks: length of the longest consecutive prefix held in any tier (router blocks).
        tokens: the same in tokens (``blocks * router_block_size``).
        tier_blocks: per medium, the longest consecutive prefix held in that medium alone
            (router blocks); media with 0 are omitted.
        served: per medium, how many of the ``blocks`` prefix blocks that medium would serve
            (each block counts once, with its best-weighted medium).
        stale: the source is marked stale; its blocks do not count (``blocks`` is 0).
        speculative_blocks: prefix blocks that exist only as speculative entries.
    """

    source: str
    blocks: int = 0
    tokens: int = 0
    tier_blocks: dict[str, int] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    stale: bool = False
    speculative_blocks: int = 0

    def weighted(self, weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS, other: float = 0.5) -> float:
        """The prefix in router blocks, each block weighted by the medium serving it."""
        return sum(n * weights.get(m, other) for m, n in self.served.items())


Policy = Callable[[Sequence[SourceMatch], Mapping[str, Load], int], "list[tuple[float, str]]"]
"""``policy(matches, loads, n_blocks) -> [(value, source), ...]``; higher value wins."""


@dataclass(frozen=True, slots=True)
class PrefixLoadPolicy:
    """Longest prefix weighted by tier, minus a load penalty.

    ``value = prefix_weight * weighted_prefix_blocks / n_blocks
              - queue_weight * queue - running_weight * running - kv_weight * kv_usage``

    With ``n_blocks == 0`` the prefix term is 0 (pure load balancing).

    Attributes:
        tier_weights: value of a block per medium (default GPU 1.0, CPU 0.8).
        other_tier_weight: value of a block in a medium not in ``tier_weights``.
        prefix_weight: weight of a full-prompt hit (a prefix of all blocks scores this much).
        queue_weight, running_weight, kv_weight: penalty per waiting request, per running
            request and per unit of KV usage.
    """

    tier_weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    other_tier_weight: float = 0.5
    prefix_weight: float = 1.0
    queue_weight: float = 0.1
    running_weight: float = 0.02
    kv_weight: float = 0.2

    def __call__(
        self, matches: Sequence[SourceMatch], loads: Mapping[str, Load], n_blocks: int
    ) -> list[tuple[float, str]]:
        out = []
        tw = self.tier_weights
        ow = self.other_tier_weight
        for m in matches:
            # m.weighted(tw, ow) inlined (same sum, same order: one call less per source).
            w: float = 0
            for med, c in m.served.items():
                w += c * tw.get(med, ow)
            prefix = w / n_blocks if n_blocks else 0.0
            ld = loads.get(m.source, _NO_LOAD)
            v = (
                self.prefix_weight * prefix
                - self.queue_weight * ld.queue
                - self.running_weight * ld.running
                - self.kv_weight * ld.kv_usage
            )
            out.append((v, m.source))
        return out


    def best_gpu_prefix(
        self, prefixes: Iterable[tuple[str, int]], loads: Mapping[str, Load], n_blocks: int
    ) -> str | None:
        """The source :func:`rank` would put first when every prefix block is in GPU
        memory: ``prefixes`` are (source, prefix blocks). The same arithmetic as
        :meth:`__call__` in the same order, so values and ties are bit-identical, without
        building :class:`SourceMatch` objects (the router's fast path)."""
        wg = self.tier_weights.get("GPU", self.other_tier_weight)
        pw, qw, rw, kw = self.prefix_weight, self.queue_weight, self.running_weight, self.kv_weight
        top: tuple[float, tuple[float, float, float], str] | None = None
        for name, b in prefixes:
            prefix = b * wg / n_blocks if b else 0.0
            ld = loads.get(name, _NO_LOAD)
            q, r, kv = ld.queue, ld.running, ld.kv_usage
            # rank() orders by (-value, (queue, running, kv_usage), name).
            cand = (-(pw * prefix - qw * q - rw * r - kw * kv), (q, r, kv), name)
            if top is None or cand < top:
                top = cand
        return None if top is None else top[2]


class CostPolicy:
    """The placement model: send a request where it costs the least work.

    For each engine, in prompt tokens::

        cost = (prompt_tokens - cached_tokens)         # what this request computes there
             + prefill_weight * prefill_tokens          # prefill already queued there
             + queue_tokens * queue + running_tokens * running + kv_tokens * kv_usage

    where ``prompt_tokens`` is the prompt's full router blocks times ``block_size`` and
    ``cached_tokens`` its cached prefix, each block weighted by the medium that holds it
    (``tier_weights``: a CPU block costs a transfer). The value is ``-cost / prompt_tokens``
    (higher is better). An engine's prefill work delays every request sent there, so a
    cached prefix is worth taking only while the engine holding it is not busier by more
    than the prefix saves: the trade a fixed load penalty cannot make.

    ``queue_tokens`` stands in for the unknown size of a waiting request when the caller
    only knows counts (loads scraped from engines' ``/metrics``); with ``prefill_tokens``
    known (a proxy's own bookkeeping) keep it small. ``running_tokens`` is what one running
    request costs the others (a decode batch slows with every sequence in it); the default
    256 was tuned on ``bench/bench_routers.py``'s chat workload: 16 left the busiest engine
    with 1.67x the mean of requests, 256 brought it to 1.08x at about the same hit rate, 1,024
    lost a sixth of the hits.

    **Spread.** Engines whose cost is within ``spread_tokens + spread_share * prompt_tokens``
    of the cheapest are near-equal: one of them is drawn from a generator seeded with
    ``seed``, so equal engines share the traffic (rather than the lowest name taking all of
    it) and a run with the same seed and inputs makes the same choices.

    Stateful (the generator): one instance per router.
    """

    __slots__ = ("block_size", "tier_weights", "other_tier_weight", "prefill_weight", "queue_tokens", "running_tokens",
                 "kv_tokens", "spread_tokens", "spread_share", "seed", "_rng")

    def __init__(self, *, block_size: int = 16, tier_weights: Mapping[str, float] | None = None,
                 other_tier_weight: float = 0.5, prefill_weight: float = 1.0, queue_tokens: float = 512.0, running_tokens: float = 256.0,
                 kv_tokens: float = 0.0, spread_tokens: float = 32.0, spread_share: float = 0.02,
                 seed: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        for name, v in (("prefill_weight", prefill_weight), ("queue_tokens", queue_tokens), ("running_tokens", running_tokens),
                        ("kv_tokens", kv_tokens), ("spread_tokens", spread_tokens),
                        ("spread_share", spread_share)):
            if not v >= 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        self.block_size = block_size
        self.tier_weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        self.other_tier_weight = other_tier_weight
        self.prefill_weight = prefill_weight
        self.queue_tokens = queue_tokens
        self.running_tokens = running_tokens
        self.kv_tokens = kv_tokens
        self.spread_tokens = spread_tokens
        self.spread_share = spread_share
        self.seed = seed
        self._rng = random.Random(f"kvstream-cost-{seed}")

    def __repr__(self) -> str:
        return (f"CostPolicy(block_size={self.block_size}, prefill_weight={self.prefill_weight}, queue_tokens={self.queue_tokens}, "
                f"running_tokens={self.running_tokens}, kv_tokens={self.kv_tokens}, "
                f"spread_tokens={self.spread_tokens}, spread_share={self.spread_share}, seed={self.seed})")

    def costs(self, matches: Sequence[SourceMatch], loads: Mapping[str, Load], n_blocks: int) -> dict[str, float]:
        """Per source, the cost in tokens (see the class docstring); no spread."""
        bs = self.block_size
        tw = self.tier_weights
        ow = self.other_tier_weight
        prompt = n_blocks * bs
        out = {}
        for m in matches:
            cached = 0.0
            for med, c in m.served.items():
                cached += c * tw.get(med, ow)
            ld = loads.get(m.source, _NO_LOAD)
            out[m.source] = (prompt - cached * bs + self.prefill_weight * ld.prefill_tokens + self.queue_tokens * ld.queue
                             + self.running_tokens * ld.running + self.kv_tokens * ld.kv_usage)
        return out

    def __call__(
        self, matches: Sequence[SourceMatch], loads: Mapping[str, Load], n_blocks: int
    ) -> list[tuple[float, str]]:
        costs = self.costs(matches, loads, n_blocks)
        if not costs:
            return []
        prompt = max(1, n_blocks * self.block_size)
        best = min(costs.values())
        near = sorted(s for s, c in costs.items() if c <= best + self.spread_tokens + self.spread_share * prompt)
        pick = near[self._rng.randrange(len(near))] if len(near) > 1 else near[0]
        # Near-equal engines all get the best value; the drawn one a hair more, so rank()
        # puts it first and the rest follow in their usual order (the failover candidates).
        out = []
        for s, c in costs.items():
            v = -best / prompt if s in near else -c / prompt
            out.append((v + 1e-9 if s == pick else v, s))
        return out


def _load_key(ld: Load) -> tuple[float, float, float]:
    return (ld.queue, ld.running, ld.kv_usage)


def rank(values: Sequence[tuple[float, str]], loads: Mapping[str, Load]) -> list[str]:
    """Sources ordered best first: higher value, then lower (queue, running, kv_usage),
    then source name. Deterministic for equal inputs."""
    return [
        s
        for _, _, s in sorted(
            ((-v, _load_key(loads.get(s, _NO_LOAD)), s) for v, s in values),
        )
    ]


@dataclass(slots=True)
class ScoreResult:
    """The answer to "where should this prompt go?".

    Attributes:
        n_blocks: full router blocks in the prompt.
        router_block_size: tokens per router block.
        matches: per source, its :class:`SourceMatch` (every source the index knows, plus
            any source named in the loads), keyed by name.
        ranking: source names, best first (empty when there is no source at all).
        values: the policy's value per source.
    """

    n_blocks: int
    router_block_size: int
    matches: dict[str, SourceMatch]
    ranking: list[str]
    values: dict[str, float]

    @property
    def best(self) -> str | None:
        """The chosen source (first of :attr:`ranking`), or None without sources."""
        return self.ranking[0] if self.ranking else None
