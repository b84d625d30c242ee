"""The block table: the index's ``engine hash -> router key(s)`` store, and its interface.

:class:`BlockTable` is the storage seam of :class:`kvstream.routing.index.KVIndex`: what the
index needs from wherever its block table lives (``get``, ``in``, item assignment, ``pop``,
iteration in insertion order, ``items``, ``len``, ``nbytes``, ``shrink``) plus the two bulk
operations snapshots use (:meth:`BlockTable.export_u64`, :meth:`BlockTable.load_u64`). A
new backend (Valkey, a JetStream KV bucket) is one class implementing this protocol, given
to the index as ``KVIndex(table=instance)``; the index drives it through these methods
only (its generic ingest path). Two implementations live here, in memory:

* :class:`DictBlockTable` (``table="dict"``, the default): a plain ``dict`` (~150 bytes per
  (block, source) entry of the whole index at 10**6 entries, every operation at C speed).
* :class:`ArrayBlockTable` (``table="compact"``): compact arrays (~100 bytes per entry),
  for memory-bound deployments, at a measured speed cost once more blocks are live than
  its nursery holds (``docs/router.md``).

For these two the index runs ingest loops written against their layout (picked once, at
construction, by the table's exact type); any other class gets the generic path.

:class:`ArrayBlockTable` keeps keys in ``[1, 2**64)`` and values in ``[0, 2**64)`` in two
``array('Q')`` columns (16 bytes per entry) and a power-of-two ``array('i')``
open-addressing index over them (4 bytes per slot, load <= 3/4, linear probing, deletion
by moving the rest of the cluster back, so there are no tombstones), the layout of
CPython's own dict but without per-entry objects: ~25 bytes per entry at 10**6, where a dict
spends ~42 bytes of entry plus a 32-40 byte int object per 64-bit key. A column position
freed by a deletion is reused by the next insert, so churn never forces a rebuild;
iteration follows the columns (insertion order, except for reused positions). Anything
else (key 0, bytes keys, tuple values) goes to a plain dict beside it, so the table accepts
whatever a dict would.

New entries first go to a *nursery*, a plain dict of at most ``nursery`` entries (default
:data:`NURSERY`); when it is full its oldest 256 entries move into the arrays (in bulk: home
slots in one comprehension, columns extended in one call). A block that is removed while in
the nursery (most blocks of a pool smaller than the nursery) never touches the arrays, so it
costs what a dict costs; the nursery adds ~50 bytes per entry it holds (~0.5 bytes per entry
of a 10**6-entry table). Once the arrays hold more than twice the nursery's entries, most
blocks outlive it, and new entries go straight to the arrays instead (:meth:`ArrayBlockTable.tune`):
the probe that finds a hash absent ends at the slot it is then stored in.

The price of the arrays is Python-level probing: a method call costs ~0.2-0.4 us instead of ~0.05 us
for a dict, so the index's compact ingest loop probes the columns inline (the layout is part of
this module's contract: ``idx``, ``ks``, ``vs``, ``mask``, ``shift``, ``n``, and the
``free``, ``used`` and the ``_EMPTY`` marker; :meth:`ArrayBlockTable.room` before an inline
insert, :meth:`ArrayBlockTable._kill` to delete). This module imports nothing of kvstream's.
"""

from __future__ import annotations

import sys
from array import array
from itertools import compress, islice
from typing import Any, Final, Iterable, Iterator, Protocol

_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of key*MIX mod 2**64 pick the slot
_MAX_PROBE = 24
"""An insert that would land further than this from its home slot goes to the fallback
dict instead: keys are engine hashes mixed by a multiply (sequential or crafted hashes
still spread), and a peer that sends hashes crafted to collide only fills a dict."""
_M64 = (1 << 64) - 1
_EMPTY = -1
_DUMMY = -2  # never written now (deletion shifts the cluster back); probes still skip it
_MISSING: Any = object()
NURSERY: Final = 8192
"""Entries an :class:`ArrayBlockTable` keeps in its dict nursery before moving them to the
arrays (see the module docstring)."""


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
    def items(self) -> Iterator[tuple[Any, Any]]: ...
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


class ArrayBlockTable:
    """The in-memory :class:`BlockTable` over arrays; see the module docstring."""

    __slots__ = ("idx", "ks", "vs", "shift", "mask", "n", "used", "free", "other", "young", "cap", "direct")

    def __init__(self, nursery: int = NURSERY) -> None:
        self.other: dict[Any, Any] = {}
        self.young: dict[Any, Any] = {}  # the nursery: newest entries, oldest first
        self.cap = nursery
        self.direct = False  # new entries skip the nursery (see :meth:`tune`)
        self.n = 0  # live array entries
        self._build(array("Q"), array("Q"), 3)

    def tune(self) -> None:
        """Choose where new entries go. The nursery pays off while entries die young; once
        the arrays hold more than twice the nursery's entries, most entries outlive it (a
        pool of more blocks than the nursery holds evicts a block only after that many
        newer stores), so new entries go straight to the arrays (:attr:`direct`), saving
        the nursery's dict round trip; back to the nursery when fewer than ``cap`` entries
        are left in the arrays. Switching to direct settles the nursery (the arrays then
        stay in insertion order). Cheap: callers run it once per batch."""
        if self.direct:
            if self.n < self.cap:
                self.direct = False
        elif self.cap and self.n > 2 * self.cap:
            self.direct = True
            self.settle(len(self.young))
            self.young.clear()  # empty now, but a dict keeps its table until cleared

    def _build(self, ks: array, vs: array, bits: int, check: bool = False) -> None:
        """Index ``ks`` (all live, in order) in a table of ``2**bits`` slots; ``check``:
        raise ``ValueError`` on a duplicate key (bulk loads of untrusted columns)."""
        idx = array("i", [_EMPTY]) * (1 << bits)
        sh = 64 - bits
        m = (1 << bits) - 1
        # Home slots in one comprehension (C-speed iteration), then the probing loop.
        MIX, M64 = _MIX, _M64
        homes = [((key * MIX) & M64) >> sh for key in ks]
        if check:
            for j, h in enumerate(homes):
                e = idx[h]
                while e != _EMPTY:
                    if ks[e] == ks[j]:
                        raise ValueError(f"duplicate key {ks[j]}")
                    h = (h + 1) & m
                    e = idx[h]
                idx[h] = j
        else:
            for j, h in enumerate(homes):
                while idx[h] != _EMPTY:
                    h = (h + 1) & m
                idx[h] = j
        self.idx = idx
        self.shift = sh
        self.mask = m
        self.ks = ks
        self.vs = vs
        self.used = len(ks)  # index slots that are not EMPTY (live + DUMMY)
        self.free: list[int] = []  # dead dense positions, reused by inserts

    def _grow(self, extra: int = 0) -> None:
        """The index is 3/4 used (live + deleted slots): drop dead entries and re-index
        in a table of at least twice the live entries (with room for ``extra`` more)."""
        ks, vs = self.ks, self.vs
        if self.n != len(ks):
            ks, vs = array("Q", compress(ks, ks)), array("Q", compress(vs, ks))
        bits = 3
        while (1 << bits) < 2 * max(self.n, 3) or 3 * (1 << bits) // 4 - self.n < extra:
            bits += 1
        self._build(ks, vs, bits)

    def reserve(self, k: int) -> None:
        """Make room for ``k`` inserts without a rebuild (an inline prober reloads the
        columns after this)."""
        if self.room() < k:
            self._grow(k)

    def room(self) -> int:
        """Inserts possible before the index must be rebuilt (:meth:`_grow`)."""
        return (3 * len(self.idx)) // 4 - self.used

    def grow_if_full(self) -> bool:
        """Make room for one more entry; True when the table was rebuilt (an inline
        prober must reload ``idx``, ``ks``, ``vs``, ``mask``, ``shift``)."""
        if self.room() <= 0:
            self._grow()
            return True
        return False

    def compact(self) -> None:
        """Drop dead entries and shrink the index to fit the live ones (after eviction)."""
        self._grow()

    def shrink(self) -> None:
        """:meth:`compact` when at most half the columns or an eighth of the index is live."""
        if 2 * self.n < len(self.ks) or 8 * self.n < len(self.idx):
            self.compact()

    def nbytes(self) -> int:
        """Heap bytes held: the columns, the index, the free list, the fallback dict and
        its objects (estimated at 136 bytes per fallback entry beyond the dict itself: a
        bytes hash of up to 64 bytes and an int value)."""
        return (sys.getsizeof(self.idx) + sys.getsizeof(self.ks) + sys.getsizeof(self.vs)
                + sys.getsizeof(self.free) + 28 * len(self.free)
                + sys.getsizeof(self.other) + 136 * len(self.other)
                + sys.getsizeof(self.young) + 40 * len(self.young))

    def _put(self, h: int, key: int, value: int, was_empty: bool) -> None:
        """Store a new entry at index slot ``h`` (EMPTY or DUMMY), reusing a dead dense
        position when there is one."""
        free = self.free
        if free:
            j = free.pop()
            self.ks[j] = key
            self.vs[j] = value
        else:
            j = len(self.ks)
            self.ks.append(key)
            self.vs.append(value)
        self.idx[h] = j
        self.n += 1
        if was_empty:
            self.used += 1

    def _slot(self, key: int) -> tuple[int, int]:
        """(slot, dense index) of ``key``, or (first free slot, -1 if EMPTY, -2 if DUMMY,
        -3 if that slot is more than ``_MAX_PROBE`` from home)."""
        idx, ks, m = self.idx, self.ks, self.mask
        h = ((key * _MIX) & _M64) >> self.shift
        free = -1
        d = 0
        while True:
            j = idx[h]
            if j >= 0:
                if ks[j] == key:
                    return h, j
            elif j == _EMPTY:
                if free >= 0:
                    return free, -2
                return h, (-1 if d <= _MAX_PROBE else -3)
            elif free < 0 and d <= _MAX_PROBE:
                free = h
            h = (h + 1) & m
            d += 1

    def get(self, key: Any, default: Any = None) -> Any:
        young = self.young
        if young:
            v = young.get(key, _MISSING)
            if v is not _MISSING:
                return v
        if type(key) is int and 0 < key <= _M64:
            idx, ks = self.idx, self.ks
            m = self.mask
            h = ((key * _MIX) & _M64) >> self.shift
            while True:
                j = idx[h]
                if j >= 0:
                    if ks[j] == key:
                        return self.vs[j]
                elif j == _EMPTY:
                    break
                h = (h + 1) & m
        other = self.other
        return other.get(key, default) if other else default

    def __contains__(self, key: Any) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    def __getitem__(self, key: Any) -> Any:
        v = self.get(key, _MISSING)
        if v is _MISSING:
            raise KeyError(key)
        return v

    def __setitem__(self, key: Any, value: Any) -> None:
        young = self.young
        if key in young:
            young[key] = value
            return
        if (self.cap and not self.direct and type(key) is int and type(value) is int
                and self.get(key, _MISSING) is _MISSING):
            young[key] = value
            if len(young) > self.cap:
                self.settle(len(young) - self.cap + 256)  # in small steps: short pauses
            return
        self._set_old(key, value)

    def settle(self, k: int) -> None:
        """Move the ``k`` oldest nursery entries into the arrays (a nursery key is in
        neither the arrays nor the fallback dict, so each only needs a free slot)."""
        young = self.young
        keys = list(islice(young, k))
        if not keys:
            return
        values = list(map(young.pop, keys))
        try:
            ka, va = array("Q", keys), array("Q", values)
            bulk = 0 not in ka
        except (OverflowError, TypeError):
            bulk = False
        if not bulk:
            self._settle_each(keys, values)
        else:
            self._settle_bulk(keys, values, ka, va)
        self.tune()

    def _settle_bulk(self, keys: list[int], values: list[int], ka: array, va: array) -> None:
        """:meth:`settle` of entries that all fit the columns: home slots in one
        comprehension, new column positions appended in bulk, one short probing loop."""
        k = len(keys)
        self.reserve(k)
        idx, ks, vs, m, sh, free = self.idx, self.ks, self.vs, self.mask, self.shift, self.free
        MIX, M64, MAXP = _MIX, _M64, _MAX_PROBE
        homes = [((x * MIX) & M64) >> sh for x in keys]
        take = min(len(free), k)
        js = free[len(free) - take:]
        del free[len(free) - take:]
        for j, x, v in zip(js, keys, values):  # dead positions first (no rebuild under churn)
            ks[j] = x
            vs[j] = v
        if take < k:
            base = len(ks)
            ks.extend(ka[take:])
            vs.extend(va[take:])
            js.extend(range(base, base + k - take))
        crowded = []
        for j, h in zip(js, homes):
            if idx[h] >= 0:
                h0 = h
                h = (h + 1) & m
                while idx[h] >= 0:
                    h = (h + 1) & m
                if (h - h0) & m > MAXP:
                    crowded.append(j)  # a crowded slot (crafted hashes): the dict beside
                    continue
            idx[h] = j
        for j in crowded:
            self.other[ks[j]] = vs[j]
            ks[j] = 0
            free.append(j)
        placed = k - len(crowded)
        self.n += placed
        self.used += placed

    def _settle_each(self, keys: list[Any], values: list[Any]) -> None:
        """:meth:`settle`, entry by entry (some key or value does not fit the columns)."""
        self.reserve(len(keys))
        idx, ks, vs, m, sh, free = self.idx, self.ks, self.vs, self.mask, self.shift, self.free
        other = self.other
        MIX, M64, MAXP = _MIX, _M64, _MAX_PROBE
        placed = 0
        for key, value in zip(keys, values):
            if type(key) is not int or not 0 < key <= M64 or type(value) is not int or not 0 <= value <= M64:
                other[key] = value
                continue
            h = h0 = ((key * MIX) & M64) >> sh
            while idx[h] >= 0:
                h = (h + 1) & m
            if (h - h0) & m > MAXP:
                other[key] = value  # a crowded slot (crafted hashes): the dict beside
                continue
            if free:
                j = free.pop()
                ks[j] = key
                vs[j] = value
            else:
                j = len(ks)
                ks.append(key)
                vs.append(value)
            idx[h] = j
            placed += 1
        self.n += placed
        self.used += placed

    def _set_old(self, key: Any, value: Any) -> None:
        """``self[key] = value`` in the arrays (or the fallback dict), never the nursery."""
        if type(key) is int and 0 < key <= _M64:
            h, j = self._slot(key)
            if type(value) is int and 0 <= value <= _M64:
                if j >= 0:
                    self.vs[j] = value
                    return
                if j == -1 and self.room() <= 0:
                    self._grow()
                    h, j = self._slot(key)
                if j != -3:
                    if self.other:
                        self.other.pop(key, None)
                    self._put(h, key, value, j == -1)
                    return
            elif j >= 0:
                self._kill(h, j)
        self.other[key] = value

    def _kill(self, h: int, j: int) -> None:
        """Delete the entry at index slot ``h`` (dense position ``j``). Linear probing
        without tombstones: later entries of the cluster that may not sit beyond the hole
        move back into it (Knuth's algorithm R), so deletions never fill the index and
        churn never forces a rebuild."""
        self.ks[j] = 0
        self.free.append(j)
        self.n -= 1
        self.used -= 1
        self._close(h)
        if self.direct and self.n < self.cap:
            self.direct = False

    def _close(self, h: int) -> None:
        """Empty index slot ``h`` (its entry is gone), moving later entries of its cluster
        back (the second half of :meth:`_kill`, for inline deleters)."""
        ks = self.ks
        idx, m, sh = self.idx, self.mask, self.shift
        MIX, M64 = _MIX, _M64
        i = h
        k = h
        while True:
            k = (k + 1) & m
            e = idx[k]
            if e < 0:
                break
            home = ((ks[e] * MIX) & M64) >> sh
            # The entry at k may move to the hole i unless its home lies cyclically in (i, k].
            if (home <= i or home > k) if i <= k else (home <= i and home > k):
                idx[i] = e
                i = k
        idx[i] = _EMPTY

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        young = self.young
        if young:
            v = young.pop(key, _MISSING)
            if v is not _MISSING:
                return v
        if type(key) is int and 0 < key <= _M64:
            idx, ks = self.idx, self.ks
            m = self.mask
            h = ((key * _MIX) & _M64) >> self.shift
            while True:
                j = idx[h]
                if j >= 0:
                    if ks[j] == key:
                        v = self.vs[j]
                        self._kill(h, j)
                        return v
                elif j == _EMPTY:
                    break
                h = (h + 1) & m
        if default is _MISSING:
            return self.other.pop(key)
        return self.other.pop(key, default)

    def insert_new(self, key: Any, value: Any) -> None:
        """``self[key] = value`` for a ``key`` the caller knows is absent."""
        self[key] = value

    def set_bit(self, key: Any, bit: int) -> None:
        """``self[key] = self.get(key, 0) | bit``."""
        self[key] = self.get(key, 0) | bit

    def clear_bit(self, key: Any, bit: int) -> bool:
        """Clear ``bit`` of ``self[key]`` (deleting the key when nothing is left); False
        (and no change) when the bit was not set."""
        v = self.get(key, 0)
        if not v & bit:
            return False
        v ^= bit
        if v:
            self[key] = v
        else:
            del self[key]
        return True

    def __delitem__(self, key: Any) -> None:
        self.pop(key)

    def __len__(self) -> int:
        return self.n + len(self.other) + len(self.young)

    def __bool__(self) -> bool:
        return bool(self.n or self.other or self.young)

    def __iter__(self) -> Iterator[Any]:
        yield from compress(self.ks, self.ks)
        yield from self.other
        yield from self.young

    def keys(self) -> Iterator[Any]:
        return iter(self)

    def items(self) -> Iterator[tuple[Any, Any]]:
        ks = self.ks
        yield from compress(zip(ks, self.vs), ks)
        yield from self.other.items()
        yield from self.young.items()

    def export_u64(self) -> tuple[array, array, dict[Any, Any]]:
        ks = self.ks
        if self.n == len(ks):
            k, v = array("Q", ks), array("Q", self.vs)
        else:
            k, v = array("Q", compress(ks, ks)), array("Q", compress(self.vs, ks))
        other = dict(self.other)
        young = self.young
        if young:
            try:
                k.extend(young)
                v.extend(young.values())
            except (OverflowError, TypeError):
                del k[len(k) - len(young):]
                del v[len(v) - len(young):]
                for key, value in young.items():
                    if 0 < key <= _M64 and 0 <= value <= _M64:
                        k.append(key)
                        v.append(value)
                    else:
                        other[key] = value
        return k, v, other

    def load_u64(self, keys: array, values: array, other: Iterable[tuple[Any, Any]] = ()) -> None:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if len(keys):
            self.settle(len(self.young))
            ks0, vs0 = self.export_u64()[:2]
            ks = ks0 + array("Q", keys)
            vs = vs0 + array("Q", values)
            if not all(keys):
                raise ValueError("key 0 in the u64 columns")
            bits = 3
            while (1 << bits) < 2 * max(len(ks), 3):
                bits += 1
            saved = (self.idx, self.ks, self.vs, self.shift, self.mask, self.used, self.free, self.n)
            try:
                self._build(ks, vs, bits, check=True)
            except ValueError:
                self.idx, self.ks, self.vs, self.shift, self.mask, self.used, self.free, self.n = saved
                raise
            self.n = len(ks)
        for k, v in other:
            if k in self:
                raise ValueError(f"duplicate key {k!r:.40}")
            self[k] = v
        self.tune()

    def walk(self, keys: Any, active: int) -> list[int]:
        """Values of ``keys`` (0 if absent) in order, stopping after the first whose
        bitwise and with ``active`` (and all before it) is 0: the scoring walk's lookups
        in one call, so it probes without a method call per block."""
        idx, ks, vs, m, sh = self.idx, self.ks, self.vs, self.mask, self.shift
        other = self.other
        if self.young:
            other = {**other, **self.young}
        out: list[int] = []
        append = out.append
        for key in keys:
            h = ((key * _MIX) & _M64) >> sh
            while True:
                j = idx[h]
                if j >= 0:
                    if ks[j] == key:
                        v = vs[j]
                        break
                elif j == _EMPTY:
                    v = other.get(key, 0) if other else 0
                    break
                h = (h + 1) & m
            append(v)
            active &= v
            if not active:
                break
        return out


class DictBlockTable(dict):
    """The default in-memory :class:`BlockTable`: a plain ``dict`` (``engine hash -> key``,
    or keys as a tuple), so every operation runs at C speed and the index's ingest loop
    uses it directly. Accepts any hashable key and any value, like a dict."""

    __slots__ = ()

    def nbytes(self) -> int:
        """Heap bytes held: the dict as allocated plus one 64-bit int object (36 bytes)
        per key (the engine hash; bytes hashes are counted by the index)."""
        return sys.getsizeof(self) + 36 * len(self)

    def shrink(self) -> None:
        """Rebuild the dict at its live size when it is more than twice that (CPython
        dicts do not shrink on delete)."""
        if sys.getsizeof(self) > 2 * dict_floor(len(self)):
            items = list(self.items())
            self.clear()
            self.update(items)

    def export_u64(self) -> tuple[array, array, dict[Any, Any]]:
        if 0 not in self:
            try:
                return array("Q", self.keys()), array("Q", self.values()), {}
            except (OverflowError, TypeError):
                pass
        ks, vs = array("Q"), array("Q")
        other: dict[Any, Any] = {}
        for key, value in self.items():
            if type(key) is int and 0 < key <= _M64 and type(value) is int and 0 <= value <= _M64:
                ks.append(key)
                vs.append(value)
            else:
                other[key] = value
        return ks, vs, other

    def load_u64(self, keys: array, values: array, other: Iterable[tuple[Any, Any]] = ()) -> None:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if len(keys):
            if not all(keys):
                raise ValueError("key 0 in the u64 columns")
            if not self:
                self.update(zip(keys, values))
                if len(self) != len(keys):
                    self.clear()
                    raise ValueError("a duplicate key in the u64 columns")
            else:
                new = dict(zip(keys, values))
                if len(new) != len(keys) or not new.keys().isdisjoint(self):
                    raise ValueError("a duplicate key in the u64 columns")
                self.update(new)
        for k, v in other:
            if k in self:
                raise ValueError(f"duplicate key {k!r:.40}")
            self[k] = v


TABLES: Final = {"dict": DictBlockTable, "compact": ArrayBlockTable}
"""Constructor names of the in-memory tables (``KVIndex(table=name)``)."""


def dict_floor(n: int) -> int:
    """About ``sys.getsizeof`` of a dict sized for ``n`` entries (CPython's layout: a
    power-of-two index of 1-8 byte slots, 2/3 of it usable 24-byte entries), in bytes."""
    size = 8
    while size * 2 // 3 < n:
        size *= 2
    ib = 1 if size <= 128 else 2 if size <= 1 << 15 else 4 if size <= 1 << 31 else 8
    return 80 + size * ib + (size * 2 // 3) * 24


U64Map = ArrayBlockTable
"""The former name of :class:`ArrayBlockTable`."""
