"""The block table: the index's ``engine hash -> router key(s)`` store, and its interface.

:class:`BlockTable` is the storage seam of :class:`kvstream.routing.index.KVIndex`: what the
index needs from wherever its block table lives (``get``, ``in``, item assignment, ``pop``,
iteration in insertion order, ``items``, ``len``, ``nbytes``, ``shrink``) plus the two bulk
operations snapshots use (:meth:`BlockTable.export_u64`, :meth:`BlockTable.load_u64`). A
new backend (Valkey, a JetStream KV bucket) is one class implementing this protocol, given
to the index as ``KVIndex(table=instance)``; the index drives it through these methods
only (its generic ingest path).

The default is :class:`NativeBlockTable` (``kvstream._native.NativeMap``, the native
core's residency table): entries whose key is an int in ``[1, 2**64)`` and whose value an
int in ``[0, 2**64)`` live in a column of ``u64`` pairs indexed by a SwissTable while small and
by 4-byte slots kept 55-75 % full past 2**17 entries (~22 bytes per entry at 10**6, every
byte counted in Rust); anything else (bytes
hashes, tuples of router keys) in a plain dict beside them, so it accepts whatever a dict
would. The same map holds each medium's ``key -> source mask`` map of the index. For it
the index's common ingest cases and its prefix walk run in the native core in one call
per batch or prompt (``kvstream._native.apply_tokens``, ``walk_tokens``); any other
table gets the generic path. This module imports nothing of kvstream's but the native
core.
"""

from __future__ import annotations

from array import array
from typing import Any, Final, Iterable, Iterator, Protocol

from kvstream._native import NativeMap

__all__ = ["BlockTable", "NativeBlockTable", "TABLES"]


class BlockTable(Protocol):
    """What the index needs from its block table (``engine hash -> router key`` or keys).

    Keys are engine hashes (int or bytes); values a router key (int) or a tuple of them.
    Iteration is in insertion order (the eviction order of ``max_bytes``)."""

    def get(self, key: Any, default: Any = None) -> Any: ...
    def __contains__(self, key: Any) -> bool: ...
    def __setitem__(self, key: Any, value: Any) -> None: ...
    def __delitem__(self, key: Any) -> None: ...
    def pop(self, key: Any, default: Any = ...) -> Any: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Any]: ...
    def items(self) -> Iterable[tuple[Any, Any]]: ...
    def nbytes(self) -> int:
        """Heap bytes held (bytes)."""
        ...
    def shrink(self) -> None:
        """Release memory left by deletions (after eviction); may do nothing."""
        ...
    def export_u64(self) -> tuple[array, array, dict[Any, Any]]:
        """Every entry, in bulk: the entries whose key and value both fit 64 bits as two
        ``array('Q')`` columns (keys, values), and the rest as a dict."""
        ...
    def load_u64(self, keys: array, values: array, other: Iterable[tuple[Any, Any]] = ()) -> None:
        """Add entries in bulk (keys must be absent, distinct and non-zero); raises
        ``ValueError`` for a duplicate or zero key, with the table unchanged."""
        ...


NativeBlockTable = NativeMap
"""The in-memory :class:`BlockTable` of the native core (see the module docstring)."""

TABLES: Final = {"native": NativeMap, "dict": NativeMap, "compact": NativeMap}
"""Constructor names of the in-memory table (``KVIndex(table=name)``): ``"native"``; the
former names ``"dict"`` and ``"compact"`` (``kvstream serve --index-table``) name it too."""
