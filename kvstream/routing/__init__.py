"""The router side: one residency index built from many engines' event streams, and scoring.

``index`` (:class:`KVIndex`: residency, copies, media, TTL, eviction, snapshots, written
once), ``keying`` (how blocks and prompts are keyed: :class:`TokenKeys`, router keys from
tokens via ``keys``, or :class:`EngineHashes`, the engines' own hashes;
:class:`EngineKeyIndex` in ``engine_index`` is the latter's named configuration),
``table`` (the block table's storage interface, :class:`BlockTable`, and the default
:class:`NativeBlockTable`, the native core's residency table; ``KVIndex(table=...)`` takes
any ``BlockTable``), ``_core`` (sources, the prefix walk, speculation),
``snapshot`` (the ``dump``/``load`` format), ``scoring`` (policies) and ``router`` (the async
:class:`Router` and :func:`apply_item`). The index and scoring are sans-IO and imported
here; the async ``Router`` (which opens sockets) is loaded only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstream.routing._core import IndexUsageError, SourceInfo
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.routing.keying import EngineHashes, TokenKeys
from kvstream.routing.scoring import Load, Policy, PrefixLoadPolicy, ScoreResult, SourceMatch
from kvstream.routing.snapshot import SnapshotError, SnapshotInfo, read_snapshot
from kvstream.routing.table import BlockTable, NativeBlockTable

if TYPE_CHECKING:
    from kvstream.routing.router import Router, apply_item

__all__ = [
    "BlockTable",
    "EngineHashes",
    "EngineKeyIndex",
    "IndexUsageError",
    "KVIndex",
    "Load",
    "NativeBlockTable",
    "Policy",
    "PrefixLoadPolicy",
    "Router",
    "ScoreResult",
    "SnapshotError",
    "SnapshotInfo",
    "SourceInfo",
    "SourceMatch",
    "TokenKeys",
    "apply_item",
    "read_snapshot",
]


def __getattr__(name: str) -> Any:
    if name in ("Router", "apply_item"):
        from kvstream.routing import router

        return getattr(router, name)
    raise AttributeError(f"module 'kvstream.routing' has no attribute {name!r}")
