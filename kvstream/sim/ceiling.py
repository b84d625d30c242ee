"""How much reuse a workload offers at best: the hit rate of an infinite shared cache.

A routing policy can only find in a prefix cache what an earlier request put there, and
only as much as the engines' memory keeps. :func:`reuse_ceiling` removes both limits: one
cache of unlimited size shared by every engine, every block of a request (prompt and
output) cached from the moment it arrives. Each request is looked up once, at arrival,
as vLLM would (whole blocks; the last prompt token is always computed). No policy, on
any number of engines of any size, gets a higher hit rate on the workload, so the ratio
of a policy's hit rate to this number says how close to the best possible it is.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from kvstream.sim.blocks import SegmentHasher
from kvstream.sim.engine import EngineConfig, Prepared
from kvstream.sim.workload import SimRequest

__all__ = ["ReuseCeiling", "reuse_ceiling"]


class ReuseCeiling(msgspec.Struct, frozen=True):
    """The best-case reuse of a workload (see the module docstring).

    ``hit_rate``: cached prompt tokens / prompt tokens with an infinite shared cache;
    ``prompt_tokens`` and ``hit_tokens`` in real tokens; ``distinct_blocks``: the
    workload's working set in engine blocks (prompt and output), to compare with the
    cache capacity a simulation gives the engines.
    """

    hit_rate: float
    prompt_tokens: int
    hit_tokens: int
    distinct_blocks: int


def reuse_ceiling(requests: Sequence[SimRequest], config: EngineConfig, *,
                  hasher: SegmentHasher | None = None,
                  prepared: dict[Any, Prepared] | None = None) -> ReuseCeiling:
    """The :class:`ReuseCeiling` of ``requests`` (in arrival order) on engines shaped by
    ``config`` (block size, token granularity, hash). ``hasher``/``prepared``: shared with
    the simulation runs of the same workload, so each request is hashed once."""
    hasher = hasher if hasher is not None else SegmentHasher(config.block_hasher())
    prepared = prepared if prepared is not None else {}
    bs = config.sim_block_size
    g = config.token_granularity
    seen: set[Any] = set()
    prompt = hit = 0
    for req in sorted(requests, key=lambda r: r.arrival):
        prep = prepared.get(req.request_id)
        if prep is None:
            prep = prepared[req.request_id] = Prepared(req, config, hasher)
        n = len(prep.prompt_tokens)
        hashes = prep.block_hashes
        lookable = max(0, (n - 1) // bs)
        k = 0
        while k < lookable and hashes[k] in seen:
            k += 1
        prompt += n
        hit += k * bs
        seen.update(hashes)
    return ReuseCeiling(hit / prompt if prompt else 0.0, prompt * g, hit * g, len(seen))
