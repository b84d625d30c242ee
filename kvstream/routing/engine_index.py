"""The router index keyed by the engines' own block hashes (router configured like the engines).

:class:`EngineKeyIndex` is :class:`kvstream.routing.index.KVIndex` with engine-hash keying
(``KVIndex(keying=EngineHashes(hasher, hash_form))``, :mod:`kvstream.routing.keying`), under
the name and constructor the service, simulator and tests use. It keys blocks by the
engine hash each event carries instead of the router's own token keys. It needs the engines' hash algorithm, seed and block size (a
:class:`kvstream.hashing.BlockHasher` configured like them), and in return:

* ingest computes nothing per block: a ``BlockStored`` sets one bit per block in
  ``engine hash -> source bitmask`` (per medium), a ``BlockRemoved`` clears it;
* memory is one entry of the native ``hash -> source mask`` map per distinct block and
  medium (:data:`BYTES_PER_ENGINE_BLOCK`): there is no block table;
* parents, tokens and linking are not needed: a block stored with an unknown parent, or a
  CPU-tier event for a block never seen on the GPU, is matchable at once;
* LoRA, cache salt, multimodal items and prompt-embedding digests are matched exactly as
  the engine hashed them, 0.11 salts included, because they are part of the engine hash.
  The scorer computes the prompt's engine hashes with the same extra keys.

What it cannot do: serve engines that hash differently. Every source must use the
hasher's algorithm, seed and block size. A ``BlockStored`` with another block size is
rejected (``stats.foreign_block_size``, logged once per source); a hash in the other
external form (bytes where ints are configured, or the reverse) is kept but counted
(``stats.foreign_hash_form``), since no prompt can match it. Engines with another
configuration need their own ``EngineKeyIndex``, or a :class:`~kvstream.routing.index.KVIndex`.

Residency rules are the index's, written once (``docs/router.md``): physical copies counted per (source,
medium, KV cache group, hash); report-mode re-announcements add no copy;
``BlockRemoved`` of an unknown block counted; ``AllBlocksCleared`` clears that source's
GPU tier only; stale, clear and remove per source; optional memory bound and TTL.
"""

from __future__ import annotations

from typing import Any

from kvstream.hashing import BlockHasher
from kvstream.routing.index import IndexStats, KVIndex
from kvstream.routing.keying import EngineHashes

__all__ = ["EngineKeyIndex", "EngineIndexStats", "BYTES_PER_ENGINE_BLOCK"]

BYTES_PER_ENGINE_BLOCK = 28
"""Measured heap cost (bytes) of one distinct block held by one source in one medium: one
entry of the native ``hash -> source mask`` map (16 bytes of columns and 5 bytes per index
bucket: 27.3 bytes at 10**6 entries, counted in Rust; ``bench/bench_index.py --layout
engine``). Further sources holding the same block only set bits of its 64-bit mask (masks
of more than 64 sources go to a side dict). :meth:`KVIndex.estimated_bytes` counts the
real allocation."""

EngineIndexStats = IndexStats
"""The counters (:class:`kvstream.routing.index.IndexStats`; ``foreign_block_size`` and
``foreign_hash_form`` are engine keying's)."""


class EngineKeyIndex(KVIndex):
    """:class:`~kvstream.routing.index.KVIndex` keyed by engine block hashes (sans-IO).

    Same API (``apply_batch``, ``clear_source``, ``mark_stale``, ``remove_source``,
    ``add_source``, ``keys``, ``match``, ``score``, ``best``, ``speculate``, ``expire``,
    ``state``, ``source_info``, ``dump``/``load``...), so it plugs into ``Router(index=...)``,
    :func:`kvstream.routing.router.apply_item` and event-log replay. Its scoring unit is the
    engine block: :attr:`router_block_size` is the hasher's block size.

    Args:
        hasher: a :class:`kvstream.hashing.BlockHasher` with the engines' algorithm, seed
            (root), block size and extra-key style.
        hash_form: ``"int"`` (vLLM's default) or ``"bytes"``: how the engines put hashes
            on the wire.
        max_bytes, ttl_s, reannounce: as :class:`~kvstream.routing.index.KVIndex`'s.
    """

    __slots__ = ()

    def __init__(
        self,
        hasher: BlockHasher,
        *,
        hash_form: str = "int",
        max_bytes: int | None = None,
        ttl_s: float | None = None,
        reannounce: str = "session",
    ) -> None:
        super().__init__(keying=EngineHashes(hasher, hash_form), max_bytes=max_bytes, ttl_s=ttl_s,
                         reannounce=reannounce)

    @property
    def hash_form(self) -> str:
        """``"int"`` or ``"bytes"``: the external hash form the engines send."""
        return self._keying.hash_form  # type: ignore[union-attr]

    @property
    def bytes_per_block(self) -> int:
        """Estimated heap bytes of one distinct block held by one source in one medium
        (:data:`BYTES_PER_ENGINE_BLOCK`)."""
        return BYTES_PER_ENGINE_BLOCK

    @classmethod
    def _configured(cls, keying: Any, hasher: Any, kw: dict[str, Any]) -> "EngineKeyIndex":
        if not isinstance(keying, EngineHashes):
            from kvstream.routing.snapshot import SnapshotError

            raise SnapshotError("a token-keyed snapshot cannot load into an EngineKeyIndex (use KVIndex.load)")
        return cls(keying.hasher, hash_form=keying.hash_form, **kw)
