"""Routing policies compared by the simulator.

* ``kv-aware``: kvstream's router scoring as the router ships it: ``KVIndex.score`` with
  the default :class:`~kvstream.routing.scoring.PrefixLoadPolicy` (the cached-prefix share of the
  prompt, minus a small load penalty).
* ``kv-cost``: the placement model, :class:`~kvstream.routing.scoring.CostPolicy`, as
  ``serve --scoring cost`` routes: the engine where the request costs the least work (its
  uncached prompt tokens plus a share of the prefill work already waiting there), new
  content balanced by the work each engine got lately (the driver keeps a
  :class:`~kvstream.routing.scoring.RecentPlacements`), near-equal engines drawn from a
  seeded generator.
* ``kv-load``: the same prefix score blended with a heavier load penalty (queue,
  running, KV usage weighted ~2.5x the defaults): trades hit rate for spread.
* ``prefix-only`` (not in the default list): the prefix share alone, load only breaking
  ties. It shows the failure mode of pure prefix routing: a prefix that every request
  shares (a system prompt) pulls all traffic onto the first engine that cached it.
* ``round-robin``: engines in turn.
* ``least-loaded``: fewest requests (waiting + running), ties to the lower engine index.
* ``random``: uniform, from a seeded generator (deterministic per seed).

A policy picks an engine index from the engines' loads and, for the KV-aware ones, the
router index's score of the prompt. Pure and synchronous; the driver owns the index.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

from kvstream.routing.scoring import CostPolicy, Load, PrefixLoadPolicy
from kvstream.sim.workload import WorkloadError

__all__ = ["POLICY_NAMES", "ALL_POLICY_NAMES", "RoutingPolicy", "make_policy"]

POLICY_NAMES: tuple[str, ...] = ("kv-aware", "kv-cost", "kv-load", "round-robin", "least-loaded", "random")
"""The policies compared by default, in the order tables list them."""

ALL_POLICY_NAMES: tuple[str, ...] = POLICY_NAMES + ("prefix-only",)
"""Every policy name :func:`make_policy` accepts."""

_SCORING = {
    "kv-aware": PrefixLoadPolicy(),
    "kv-load": PrefixLoadPolicy(queue_weight=0.25, running_weight=0.05, kv_weight=0.5),
    # Load enters only as the tie-breaker (kvstream.routing.scoring.rank).
    "prefix-only": PrefixLoadPolicy(queue_weight=0.0, running_weight=0.0, kv_weight=0.0),
}


class RoutingPolicy:
    """A routing policy: :meth:`choose` returns the engine index for one request.

    Attributes:
        name: one of :data:`ALL_POLICY_NAMES`.
        uses_index: True if the policy needs the router index's score (KV-aware ones).
        scoring: the :mod:`kvstream.routing.scoring` policy passed to ``KVIndex.score`` (or None).
    """

    __slots__ = ("name", "uses_index", "scoring", "_rng", "_next")

    def __init__(self, name: str, seed: int = 0, *, scoring: PrefixLoadPolicy | None = None) -> None:
        if name not in ALL_POLICY_NAMES:
            raise WorkloadError(f"unknown policy {name!r}; choose from {', '.join(ALL_POLICY_NAMES)}")
        if scoring is not None and name not in _SCORING and name != "kv-cost":
            raise WorkloadError(f"policy {name!r} uses no prefix scoring, so it takes no scoring weights")
        self.name = name
        self.scoring: Any = scoring if scoring is not None else _SCORING.get(name)
        if name == "kv-cost" and scoring is None:
            # The simulator knows every engine's pending prefill exactly, so a waiting request
            # needs no stand-in size (queue_tokens 0). Stateful (its spread generator): one per run.
            self.scoring = CostPolicy(queue_tokens=0.0, seed=seed)
        self.uses_index = self.scoring is not None
        self._rng = random.Random(f"kvstream-sim-{seed}")
        self._next = 0

    def choose(
        self,
        loads: Sequence[Load],
        score: Callable[[Any], str | None] | None = None,
        names: dict[str, int] | None = None,
    ) -> int:
        """The engine index for a request.

        Args:
            loads: per engine, its current :class:`~kvstream.routing.scoring.Load`.
            score: for KV-aware policies, a callable taking :attr:`scoring` and returning
                the best source name (the index's ranking head), or None without sources.
            names: source name -> engine index.
        """
        n = len(loads)
        name = self.name
        if name == "round-robin":
            i = self._next
            self._next = (i + 1) % n
            return i
        if name == "least-loaded":
            best = 0
            best_load = loads[0].queue + loads[0].running
            for i in range(1, n):
                ld = loads[i].queue + loads[i].running
                if ld < best_load:
                    best, best_load = i, ld
            return best
        if name == "random":
            return self._rng.randrange(n)
        assert score is not None and names is not None, "KV-aware policies need the index's score"
        src = score(self.scoring)
        if src is None or src not in names:
            return 0
        return names[src]


def make_policy(name: str, seed: int = 0, *, scoring: PrefixLoadPolicy | None = None) -> RoutingPolicy:
    """The policy called ``name`` (see :data:`POLICY_NAMES`), seeded with ``seed``;
    ``scoring`` replaces a KV-aware policy's default weights."""
    return RoutingPolicy(name, seed, scoring=scoring)
