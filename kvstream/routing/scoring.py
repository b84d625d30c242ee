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
    "RecentPlacements",
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
    placed_tokens: float = 0.0


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

    def _gpu_values(self, names: Sequence[str], blocks: Sequence[int], loads: Mapping[str, Load],
                    n_blocks: int) -> list[float]:
        """:meth:`__call__`'s values, in ``names`` order, for sources whose ``blocks``
        prefix blocks are all served from GPU memory (``served == {"GPU": blocks}``, or
        empty for 0): one pass over two columns, no :class:`SourceMatch` needed. The same
        arithmetic in the same order, so the values are bit-identical
        (``tests/routing/test_score_fast_path.py``)."""
        wg = self.tier_weights.get("GPU", self.other_tier_weight)
        pw, qw, rw, kw = self.prefix_weight, self.queue_weight, self.running_weight, self.kv_weight
        get = loads.get
        lds = [get(s, _NO_LOAD) for s in names]
        if not n_blocks:
            return [pw * 0.0 - qw * ld.queue - rw * ld.running - kw * ld.kv_usage for ld in lds]
        # (b * wg + 0.0): __call__ sums the served blocks from an int 0.
        return [pw * ((b * wg + 0.0) / n_blocks if b else 0.0) - qw * ld.queue - rw * ld.running - kw * ld.kv_usage
                for b, ld in zip(blocks, lds)]

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
             + balance * placed_weight * placed_tokens  # new work the engine got lately

    where ``prompt_tokens`` is the prompt's full router blocks times ``block_size`` and
    ``cached_tokens`` its cached prefix, each block weighted by the medium that holds it
    (``tier_weights``: a CPU block costs a transfer). The value is ``-cost / prompt_tokens``
    (higher is better). An engine's prefill work delays every request sent there, so a
    cached prefix is worth taking only while the engine holding it is not much busier than
    the prefix saves: the trade a fixed load penalty cannot make.

    **A miss costs more than its tokens.** Computing a prefix that another engine holds
    delays this request and every request queued behind it on the new engine, and the copy
    pushes other prefixes out of that engine's cache. ``prefill_weight`` (default 0.25)
    prices queued prefill at a quarter of the tokens a request would compute itself, so a
    request leaves the engine holding its prefix only when that engine is far busier.

    **Balance by new work.** ``placed_tokens`` (:class:`RecentPlacements`, kept by the
    caller) is the uncached work each engine got over the last placements. It is what
    decides where *new* content goes: ``balance`` is 1 while the best cached share of the
    prompt on any engine is at most half of ``stick_share`` and falls linearly to 0 at
    ``stick_share`` (default 0.8). A new conversation (a shared system prompt at most) goes
    to the engine that got the least new work lately, the system prompt breaking near-ties;
    a conversation whose history is cached somewhere stays there, whatever the balance. A
    prompt shorter than one block adds no cache content and gets no balance term.
    ``placed_weight`` (default 1.0) prices that recent work token for token; with
    :class:`RecentPlacements`' per-request charge it keeps conversations (not just their
    tokens) even across engines, the load spread ``bench_routers.py`` measures.
    ``running`` alone cannot balance conversations: between two turns a conversation runs
    nowhere, yet its next turn will land where its history is.

    ``queue_tokens`` stands in for the unknown size of a waiting request when the caller
    only knows counts (loads scraped from engines' ``/metrics``); with ``prefill_tokens``
    known (a proxy's own bookkeeping) keep it small. ``running_tokens`` (default 32) is what
    one running request costs the others (a decode batch slows with every sequence in it).

    The defaults were tuned in the simulator (``kvstream.sim``, the same engines as
    ``bench/bench_routers.py``'s chat and Mooncake workloads) and checked on the real bench;
    see ``docs/performance.md``.

    **Spread.** Engines whose cost is within ``spread_tokens + spread_share * prompt_tokens``
    of the cheapest are near-equal: one of them is drawn from a generator seeded with
    ``seed``, so equal engines share the traffic (rather than the lowest name taking all of
    it) and a run with the same seed and inputs makes the same choices.

    Stateful (the generator): one instance per router.
    """

    __slots__ = ("block_size", "tier_weights", "other_tier_weight", "prefill_weight", "queue_tokens", "running_tokens",
                 "kv_tokens", "placed_weight", "stick_share", "spread_tokens", "spread_share", "seed", "_rng")

    def __init__(self, *, block_size: int = 16, tier_weights: Mapping[str, float] | None = None,
                 other_tier_weight: float = 0.5, prefill_weight: float = 0.25, queue_tokens: float = 512.0,
                 running_tokens: float = 32.0, kv_tokens: float = 0.0, placed_weight: float = 1.0,
                 stick_share: float = 0.8, spread_tokens: float = 32.0, spread_share: float = 0.02,
                 seed: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        for name, v in (("prefill_weight", prefill_weight), ("queue_tokens", queue_tokens), ("running_tokens", running_tokens),
                        ("kv_tokens", kv_tokens), ("placed_weight", placed_weight), ("spread_tokens", spread_tokens),
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
        self.placed_weight = placed_weight
        if not 0 < stick_share <= 1:
            raise ValueError(f"stick_share must be in (0, 1], got {stick_share}")
        self.stick_share = stick_share
        self.spread_tokens = spread_tokens
        self.spread_share = spread_share
        self.seed = seed
        self._rng = random.Random(f"kvstream-cost-{seed}")

    def __repr__(self) -> str:
        return (f"CostPolicy(block_size={self.block_size}, prefill_weight={self.prefill_weight}, queue_tokens={self.queue_tokens}, "
                f"running_tokens={self.running_tokens}, kv_tokens={self.kv_tokens}, placed_weight={self.placed_weight}, stick_share={self.stick_share}, "
                f"spread_tokens={self.spread_tokens}, spread_share={self.spread_share}, seed={self.seed})")

    def costs(self, matches: Sequence[SourceMatch], loads: Mapping[str, Load], n_blocks: int) -> dict[str, float]:
        """Per source, the cost in tokens (see the class docstring); no spread."""
        bs = self.block_size
        tw = self.tier_weights
        ow = self.other_tier_weight
        prompt = n_blocks * bs
        cached: dict[str, float] = {}
        for m in matches:
            c = 0.0
            for med, k in m.served.items():
                c += k * tw.get(med, ow)
            cached[m.source] = c * bs
        rw = 0.0
        if self.placed_weight and prompt:
            # The balance term fades as the best cached share of the prompt grows: a request
            # with its history cached somewhere stays there (its load terms still apply).
            # A prompt without a full block adds no cache content: no balance term.
            best = max(cached.values(), default=0.0) / prompt
            rw = self.placed_weight * min(1.0, max(0.0, 2.0 * (1.0 - best / self.stick_share)))
        out = {}
        for m in matches:
            ld = loads.get(m.source, _NO_LOAD)
            out[m.source] = (prompt - cached[m.source] + self.prefill_weight * ld.prefill_tokens
                             + self.queue_tokens * ld.queue + self.running_tokens * ld.running
                             + self.kv_tokens * ld.kv_usage + rw * ld.placed_tokens)
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


class RecentPlacements:
    """The new work a caller sent each engine lately: an exponentially decayed sum.

    Every :meth:`placed` call ages all sums by a factor ``1 - 1 / horizon`` and adds the
    request's uncached prompt tokens plus ``request_tokens`` to the engine chosen, so a sum
    is about the prefill work (and the new cache content) the engine got over the last
    ``horizon`` placements (requests, not seconds: no clock; the same calls give the same
    sums). A conversation placed on an engine keeps its turns there, so this shows the
    conversations an engine holds between their turns, when neither ``running`` nor the KV
    usage does; :attr:`Load.placed_tokens` carries it to :class:`CostPolicy`.

    ``request_tokens`` (default 256) is what one placement weighs on top of its tokens: a
    request occupies a scheduler slot and a decode stream whatever its uncached share, so
    engines that got equal tokens but more requests count as busier. With tokens alone,
    conversations of unequal size balance by size: one engine ends up holding one
    conversation more than the others (a spread of 7/6 with 24 conversations on 4 engines)
    where counts could be equal. The defaults (``horizon`` 256, ``request_tokens`` 256, with
    ``CostPolicy.placed_weight`` 1.0) were chosen in the simulator
    (``bench/sim_placement.py --grid``; docs/simulator.md).

    Args:
        horizon: placements a sum remembers, >= 1.
        request_tokens: tokens added per placement, >= 0.
    """

    __slots__ = ("horizon", "request_tokens", "_keep", "_n")

    def __init__(self, horizon: float = 256.0, request_tokens: float = 256.0) -> None:
        if not horizon >= 1:
            raise ValueError(f"horizon must be >= 1 placement, got {horizon}")
        if not request_tokens >= 0:
            raise ValueError(f"request_tokens must be >= 0, got {request_tokens}")
        self.horizon = horizon
        self.request_tokens = request_tokens
        self._keep = 1.0 - 1.0 / horizon
        self._n: dict[str, float] = {}

    def placed(self, source: str, tokens: float) -> None:
        """A request was sent to ``source`` with ``tokens`` prompt tokens to compute there
        (it adds ``tokens + request_tokens``)."""
        keep = self._keep
        n = self._n
        for s in n:
            n[s] *= keep
        n[source] = n.get(source, 0.0) + max(0.0, tokens) + self.request_tokens

    def forget(self, source: str) -> None:
        """Drop ``source`` (it was removed)."""
        self._n.pop(source, None)

    def get(self, source: str) -> float:
        """``source``'s decayed sum, in tokens (0.0 if it never got a request)."""
        return self._n.get(source, 0.0)


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


class ScoreResult:
    """The answer to "where should this prompt go?".

    Attributes:
        n_blocks: full router blocks in the prompt.
        router_block_size: tokens per router block.
        matches: per source, its :class:`SourceMatch` (every source the index knows, plus
            any source named in the loads), keyed by name.
        ranking: source names, best first (empty when there is no source at all).
        values: the policy's value per source.

    :meth:`KVIndex.score <kvstream.routing.index.KVIndex.score>`'s common case (the
    default policy, every prefix in GPU memory, nothing speculative) makes the answer from
    one column of prefix lengths and one list of values, and builds ``matches``,
    ``ranking`` and ``values`` on first access (from what it held at scoring time: later
    changes to the index or to the loads do not show); :attr:`best` alone builds none of
    them. Either way the attributes are the same values and can be assigned.
    """

    __slots__ = ("n_blocks", "router_block_size", "_matches", "_ranking", "_values", "_lazy")

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it was

    def __init__(self, n_blocks: int, router_block_size: int, matches: dict[str, SourceMatch],
                 ranking: list[str], values: dict[str, float]) -> None:
        self.n_blocks = n_blocks
        self.router_block_size = router_block_size
        self._matches: dict[str, SourceMatch] | None = matches
        self._ranking: list[str] | None = ranking
        self._values: dict[str, float] | None = values
        self._lazy: _GpuPrefixes | None = None

    @classmethod
    def _of_gpu_prefixes(cls, n_blocks: int, router_block_size: int, lazy: _GpuPrefixes) -> ScoreResult:
        r = cls.__new__(cls)
        r.n_blocks = n_blocks
        r.router_block_size = router_block_size
        r._matches = r._ranking = r._values = None
        r._lazy = lazy
        return r

    @property
    def matches(self) -> dict[str, SourceMatch]:
        m = self._matches
        if m is None:
            m = self._matches = self._lazy.matches(self.router_block_size)  # type: ignore[union-attr]
        return m

    @matches.setter
    def matches(self, value: dict[str, SourceMatch]) -> None:
        self._matches = value

    @property
    def ranking(self) -> list[str]:
        r = self._ranking
        if r is None:
            r = self._ranking = self._lazy.ranking()  # type: ignore[union-attr]
        return r

    @ranking.setter
    def ranking(self, value: list[str]) -> None:
        self._ranking = value

    @property
    def values(self) -> dict[str, float]:
        v = self._values
        if v is None:
            lz: _GpuPrefixes = self._lazy  # type: ignore[assignment]
            v = self._values = dict(zip(lz.names, lz.values))
        return v

    @values.setter
    def values(self, value: dict[str, float]) -> None:
        self._values = value

    @property
    def best(self) -> str | None:
        """The chosen source (first of :attr:`ranking`), or None without sources."""
        r = self._ranking
        if r is None:
            return self._lazy.best()  # type: ignore[union-attr]
        return r[0] if r else None

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        o: ScoreResult = other
        return (self.n_blocks, self.router_block_size, self.matches, self.ranking, self.values) == (
            o.n_blocks, o.router_block_size, o.matches, o.ranking, o.values)

    def __repr__(self) -> str:
        return (f"ScoreResult(n_blocks={self.n_blocks!r}, router_block_size={self.router_block_size!r}, "
                f"matches={self.matches!r}, ranking={self.ranking!r}, values={self.values!r})")


class _GpuPrefixes:
    """What a lazy :class:`ScoreResult` is built from: per source (index order, then the
    sources named only in the loads) its name, its prefix in router blocks (all in GPU
    memory), whether it is stale, and the policy's value; and the loads (a snapshot) that
    break ties."""

    __slots__ = ("names", "blocks", "stale", "values", "loads")

    def __init__(self, names: list[str], blocks: Sequence[int], stale: frozenset[str],
                 values: list[float], loads: Mapping[str, Load]) -> None:
        self.names = names
        self.blocks = blocks
        self.stale = stale
        self.values = values
        self.loads = loads

    def matches(self, R: int) -> dict[str, SourceMatch]:
        stale = self.stale
        return {
            name: SourceMatch(name, b, b * R, {"GPU": b}, {"GPU": b}, False) if b
            else SourceMatch(name, 0, 0, {}, {}, name in stale)
            for name, b in zip(self.names, self.blocks)
        }

    def ranking(self) -> list[str]:
        """:func:`rank`'s order. With every value distinct (and no NaN) the values alone
        decide it: one sort of positions by value in C, no key tuple per source."""
        vals = self.values
        total = sum(vals)
        if total == total and len(set(vals)) == len(vals):
            order = sorted(range(len(vals)), key=vals.__getitem__, reverse=True)
            return list(map(self.names.__getitem__, order))
        return rank(list(zip(vals, self.names)), self.loads)

    def best(self) -> str | None:
        """:func:`rank`'s first source without sorting them all."""
        vals = self.values
        if not vals:
            return None
        total = sum(vals)
        if total != total:  # a NaN (or inf - inf): the full sort decides, as it did
            return rank(list(zip(vals, self.names)), self.loads)[0]
        top = max(vals)
        i = vals.index(top)
        if vals.count(top) == 1:
            return self.names[i]
        loads = self.loads
        names = self.names
        return min((_load_key(loads.get(names[j], _NO_LOAD)), names[j])
                   for j in range(i, len(vals)) if vals[j] == top)[1]
