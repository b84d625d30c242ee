"""The router side: residency indexes built from many engines' event streams, and scoring.

``keys`` (engine-independent router keys), ``index`` (:class:`KVIndex`, keyed by router
keys), ``engine_index`` (:class:`EngineKeyIndex`, keyed by the engines' own hashes), their
shared core (``_core``), ``snapshot`` (the ``dump``/``load`` format), ``scoring``
(policies) and ``router`` (the async :class:`Router` and
:func:`apply_item`). The indexes and scoring are sans-IO and imported here; the async
``Router`` (which opens sockets) is loaded only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstream.routing._core import IndexUsageError, SourceInfo
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.routing.scoring import Load, Policy, PrefixLoadPolicy, ScoreResult, SourceMatch
from kvstream.routing.snapshot import SnapshotError, SnapshotInfo, read_snapshot

if TYPE_CHECKING:
    from kvstream.routing.router import Router, apply_item

__all__ = [
    "EngineKeyIndex",
    "IndexUsageError",
    "KVIndex",
    "Load",
    "Policy",
    "PrefixLoadPolicy",
    "Router",
    "ScoreResult",
    "SnapshotError",
    "SnapshotInfo",
    "SourceInfo",
    "SourceMatch",
    "apply_item",
    "read_snapshot",
]


def __getattr__(name: str) -> Any:
    if name in ("Router", "apply_item"):
        from kvstream.routing import router

        return getattr(router, name)
    raise AttributeError(f"module 'kvstream.routing' has no attribute {name!r}")
