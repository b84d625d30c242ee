"""The router index: which source holds which prefix blocks, built from KV event batches.

A sans-IO object. Feed it decoded batches (:meth:`KVIndex.apply_batch`) from any number of
sources (an engine, or one data-parallel rank of one); ask it where a prompt's prefix is
cached (:meth:`KVIndex.match`, :meth:`KVIndex.score`). No sockets, no clock reads: time
comes in as arguments.

Model
-----
* **Residency** is kept per (source, medium, KV cache group, engine block hash) as a count
  of physical copies: vLLM stores the same hash twice and removes it once while a copy
  remains, and stores one hash in several groups and media.
* **Router keys** (:mod:`kvstream.routing.keys`) are computed from each ``BlockStored``'s
  tokens and its parent's key, and remembered per engine hash (``engine hash -> key``), so
  a raw token prompt can be scored without knowing any engine's hash algorithm or seed.
  Engine blocks are split into router blocks of ``router_block_size`` tokens (default 16);
  an engine block size that is not a multiple of it cannot be keyed (its blocks are still
  tracked and matchable by engine hash, and counted in ``stats.unkeyable_blocks``).
* The scoring structure is, per medium, ``router key -> bitmask of sources``. Scoring a
  prompt walks its keys once and stops when no source remains; there is no per-source loop
  per block.
* A ``BlockStored`` whose parent was never seen is kept as an *unlinked* block and linked
  (keyed) when the parent shows up, never dropped. A ``BlockRemoved`` of an unknown block is
  counted (``stats.unknown_removed``), not an error. ``AllBlocksCleared`` clears that
  source's GPU tier only. Tier-only events (CPU offload ``BlockStored`` with no tokens)
  update the location of known blocks.
* One engine-hash family per block size: sources that use the same block size must use the
  same hash algorithm and seed (the normal case: replicas of one model). Violations are
  detected and counted (``stats.family_conflicts``). Sources with different block sizes
  may share the index.

Memory bound and eviction order: see :class:`KVIndex` and ``docs/router.md``.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any, Iterable, Sequence

import xxhash

from ._compactmap import U64Map
from ._core import (
    IndexUsageError,
    SourceInfo,
    _bits,
    _hash_sort_key,
    _IndexCore,
    _sort_key,
    _Source,
)
from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstream.routing.keys import (
    KEY_MASK,
    RouterKeyError,
    chain_keys,
    event_block_extras,
    event_namespace,
    pack_tokens,
    prompt_keys,
)

__all__ = ["KVIndex", "IndexStats", "SourceInfo", "IndexUsageError", "BYTES_PER_BLOCK", "BYTES_PER_BLOCK_COMPACT"]

_log = logging.getLogger("kvstream.routing.index")

BYTES_PER_BLOCK = 152
"""Measured heap cost (bytes) of one distinct block held by one source, keys included
(``bench/bench_index.py``; tracemalloc at 10**6 blocks). Every further source holding the
same block adds about 8 bytes / 64 sources of mask plus ~80 bytes per block for the
holder count. Used by :meth:`KVIndex.estimated_bytes` for the memory bound."""
BYTES_PER_BLOCK_COMPACT = 50
"""The same cost with ``KVIndex(compact=True)`` (array-backed maps, no per-entry objects)."""
_BYTES_PER_UNLINKED = 400
_BYTES_PER_COPY_RECORD = 300


@dataclass(slots=True)
class IndexStats:
    """Counters of everything the index did (cumulative since construction)."""

    batches: int = 0
    stored_blocks: int = 0
    """Block copies added by ``BlockStored`` (router-visible copies, re-announcements excluded)."""
    removed_blocks: int = 0
    """Block copies removed by ``BlockRemoved``."""
    unknown_removed: int = 0
    """``BlockRemoved`` hashes the source did not hold (e.g. stored before we subscribed)."""
    reannounced_blocks: int = 0
    """Blocks of report-mode re-announcements, which add no copy (see :class:`KVIndex`)."""
    rejected_events: int = 0
    """Malformed events skipped (bad token counts, unreadable extra keys)."""
    unkeyable_blocks: int = 0
    """Blocks whose engine block size is not a multiple of the router block size."""
    unlinked_blocks: int = 0
    """Blocks stored with a parent the index had not seen (kept, linked later)."""
    linked_blocks: int = 0
    """Unlinked blocks that got their key when their parent arrived."""
    family_conflicts: int = 0
    """New engine hash for a key already held by a same-block-size source (mixed seeds)."""
    key_conflicts: int = 0
    """An engine hash re-stored with different tokens than before (kept the first key)."""
    clears: int = 0
    """``AllBlocksCleared`` events applied."""
    evicted_blocks: int = 0
    """Blocks dropped by the memory bound."""
    expired_blocks: int = 0
    """Blocks dropped by the TTL."""


class _Unlinked:
    """A block whose router key is not known yet (parent unseen, or no tokens seen)."""

    __slots__ = ("parent", "raw", "extras", "per", "holds", "gen")

    def __init__(self, parent: Any, raw: bytes | None, extras: list[bytes | None] | None,
                 per: int, gen: int) -> None:
        self.parent = parent
        self.raw = raw
        self.extras = extras
        self.per = per
        self.holds: dict[tuple[int, int], dict[int, int]] = {}  # (slot, tier) -> {group: n}
        self.gen = gen


class KVIndex(_IndexCore):
    """Prefix-aware residency index over many sources' KV event streams (sans-IO).

    Args:
        block_size_hint: alias of ``router_block_size`` (the interface name).
        router_block_size: tokens per router block (default 16). It must divide every
            engine's block size for that engine's blocks to be keyed by tokens; pick the
            gcd of your engines' block sizes.
        max_bytes: optional memory bound (bytes, estimated with measured per-entry costs,
            see :meth:`estimated_bytes`). When a batch leaves the index above it, entries
            are dropped until it is under 90 % of the bound, in this order: unlinked blocks
            (oldest first), then keyed blocks least recently stored first (the TTL's older
            generation first). A dropped block disappears from every source and tier.
        ttl_s: optional time to live (seconds) of a block after its last ``BlockStored``
            from any source; a block is dropped between ``ttl_s`` and ``2 * ttl_s`` after
            it (two generations). Time is the ``now`` given to :meth:`apply_batch`
            (default: the batch's ``ts``).
        reannounce: ``"detect"`` (default) treats a ``BlockStored`` run that starts at
            block 0 (parent None) and whose blocks the source *all* already holds in that
            medium and group as a report-mode re-announcement (vLLM's
            ``kv_cache_report_mode="full"``): it adds no copy. ``"count"`` counts every
            stored block as a new copy. (The one real duplicate that looks the same is a
            fully cached one-block prompt recomputed by the engine; "detect" then
            under-counts by one copy, which can only make the router miss, never
            route to a block that is gone.)
        hasher: optional :class:`kvstream.hashing.BlockHasher` with the engines' algorithm,
            seed and block size, for :meth:`engine_hashes` (matching by engine hashes).
        compact: keep both maps (engine hash -> key, key -> source mask) in array-backed
            tables (:class:`kvstream.routing._compactmap.U64Map`) instead of dicts. A distinct
            block on one source then costs ~50 bytes instead of ~152
            (:data:`BYTES_PER_BLOCK_COMPACT`), but ingest and scoring probe in Python and
            are slower (numbers in ``docs/router.md``). Behaviour and :meth:`state` are
            identical.
    """

    __slots__ = (
        "_R", "_slot_of", "_src", "_free_slots", "_live", "_media", "_tier_of", "_held",
        "_young", "_old", "_href", "_sub_n", "_copies", "_unl", "_waiting", "_spec", "_spec_n",
        "_spec_q", "_per_mask", "_max_bytes", "_ttl", "_gen", "_gen_start", "_reannounce",
        "_hasher", "_compact", "_bpb", "stats",
    )

    def __init__(
        self,
        block_size_hint: int | None = None,
        *,
        router_block_size: int | None = None,
        max_bytes: int | None = None,
        ttl_s: float | None = None,
        reannounce: str = "detect",
        hasher: Any = None,
        compact: bool = False,
    ) -> None:
        if block_size_hint is not None and router_block_size is not None and block_size_hint != router_block_size:
            raise IndexUsageError(
                f"block_size_hint={block_size_hint} and router_block_size={router_block_size} "
                "disagree; they are the same setting, give one"
            )
        R = router_block_size if router_block_size is not None else block_size_hint
        if R is None:
            R = 16
        if type(R) is not int or R <= 0:
            raise IndexUsageError(f"router_block_size must be a positive int (tokens), got {R!r}")
        if max_bytes is not None and max_bytes <= 0:
            raise IndexUsageError(f"max_bytes must be positive (bytes) or None, got {max_bytes!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise IndexUsageError(f"ttl_s must be positive (seconds) or None, got {ttl_s!r}")
        if reannounce not in ("detect", "count"):
            raise IndexUsageError(f"reannounce must be 'detect' or 'count', got {reannounce!r}")
        self._R = R
        self._compact = bool(compact)
        self._bpb = BYTES_PER_BLOCK_COMPACT if compact else BYTES_PER_BLOCK
        self._slot_of: dict[str, int] = {}
        self._src: list[_Source | None] = []
        self._free_slots: list[int] = []
        self._live = 0  # mask of sources that score (not stale)
        self._media: list[str] = []
        self._tier_of: dict[str, int] = {}
        # Per tier: router key -> source mask; a dict[int, int], or a U64Map when compact.
        self._held: list[Any] = []
        for m in ("GPU", "CPU"):
            self._new_tier(m)
        self._young: Any = self._map()  # engine hash -> key (int) or keys (tuple)
        self._old: Any = self._map()  # the TTL's older generation (empty without TTL)
        self._sub_n: dict[tuple[int, int, int], int] = {}  # leading sub-key holdings
        self._href: dict[Any, int] = {}  # engine hash -> (source, tier) holdings, when > 1
        self._copies: dict[tuple[Any, int, int], dict[int, int]] = {}  # not exactly {group 0: 1}
        self._unl: dict[Any, _Unlinked] = {}
        self._waiting: dict[Any, list[Any]] = {}  # parent hash -> unlinked children
        self._spec: dict[int, int] = {}  # router key -> speculative source mask
        self._spec_n: dict[tuple[int, int], int] = {}
        self._spec_q: deque[tuple[float, int, list[int]]] = deque()
        self._per_mask: dict[int, int] = {}
        self._max_bytes = max_bytes
        self._ttl = ttl_s
        self._gen = 0
        self._gen_start: float | None = None
        self._reannounce = reannounce == "detect"
        self._hasher = hasher
        self.stats = IndexStats()
        """Cumulative counters (:class:`IndexStats`)."""

    # -- sources ---------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """Estimated heap bytes of one distinct block held by one source in this index's
        layout (:data:`BYTES_PER_BLOCK` or :data:`BYTES_PER_BLOCK_COMPACT`)."""
        return self._bpb

    def _map(self) -> Any:
        """A new engine-hash or router-key map: a dict, or a compact table."""
        return U64Map() if self._compact else {}

    def remove_source(self, source: str) -> None:
        """Forget ``source`` entirely (its blocks, stats and name). Unknown names are ignored."""
        slot = self._slot_of.get(source)
        if slot is None:
            return
        s = self._src[slot]
        assert s is not None
        self._drop_source(s, range(len(self._media)))
        for per, m in list(self._per_mask.items()):
            m &= ~s.bit
            if m:
                self._per_mask[per] = m
            else:
                del self._per_mask[per]
        self._live &= ~s.bit
        del self._slot_of[source]
        self._src[slot] = None
        self._free_slots.append(slot)

    # -- ingest ----------------------------------------------------------------------

    def apply_batch(self, source: str, batch: KVEventBatch, now: float | None = None) -> None:
        """Apply one decoded batch from ``source`` (events in order).

        Malformed events are skipped and counted (``stats.rejected_events``, logged at
        debug level); nothing a remote engine sends raises. ``now`` (seconds) drives the
        TTL; it defaults to ``batch.ts``.
        """
        s = self._source(source)
        self.stats.batches += 1
        if self._ttl is not None:
            self._tick(batch.ts if now is None else now)
        young = self._young
        gpu = self._held[0]
        href = self._href
        bit = s.bit
        fast_removed = 0
        compact = self._compact
        copies = self._copies  # never rebound, only mutated
        slot = s.slot
        for ev in batch.events:
            cls = type(ev)
            if cls is BlockRemoved:
                # Inline the GPU pool's common case: one hash, group 0, one copy.
                # type() is, not isinstance: mypy does not narrow on it (hence the ignores).
                hs = ev.block_hashes  # type: ignore[union-attr]
                if (len(hs) == 1 and not ev.group_idx and (ev.medium == "GPU" or ev.medium is None)  # type: ignore[union-attr]
                        and not (copies and (hs[0], slot, 0) in copies)):
                    eh = hs[0]
                    rk = young.get(eh)
                    if not compact:
                        if type(rk) is int:
                            m = gpu.get(rk, 0)
                            if m & bit:
                                m ^= bit
                                if m:
                                    gpu[rk] = m
                                else:
                                    del gpu[rk]
                                fast_removed += 1
                                if href and eh in href:
                                    n = href.pop(eh) - 1
                                    if n > 1:
                                        href[eh] = n
                                else:
                                    del young[eh]
                                continue
                    elif type(rk) is int:
                        if gpu.clear_bit(rk, bit):
                            fast_removed += 1
                            if href and eh in href:
                                n = href.pop(eh) - 1
                                if n > 1:
                                    href[eh] = n
                            else:
                                young.pop(eh)
                            continue
            try:
                if cls is BlockStored:
                    self._stored(s, ev)  # type: ignore[arg-type]
                    young = self._young
                elif cls is BlockRemoved:
                    self._removed(s, ev)  # type: ignore[arg-type]
                elif cls is AllBlocksCleared:
                    self.stats.clears += 1
                    self._drop_source(s, (0,))
                else:
                    self.stats.rejected_events += 1
            except RouterKeyError as exc:
                self.stats.rejected_events += 1
                _log.debug("source %s: skipped a malformed event: %s", s.name, exc)
        if fast_removed:
            s.count[0] -= fast_removed
            self.stats.removed_blocks += fast_removed
        if self._max_bytes is not None and self.estimated_bytes() > self._max_bytes:
            self._evict(int(self._max_bytes * 0.9))

    def _stored(self, s: _Source, ev: BlockStored) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if n == 0:
            return
        t = self._tier(ev.medium)
        g = ev.group_idx or 0
        toks = ev.token_ids
        if not toks:
            # A tier-only event (CPU offload placeholder): locate known blocks.
            for eh in hashes:
                self._add_copy(s, eh, None, t, g)
            return
        B = ev.block_size
        R = self._R
        if B <= 0 or len(toks) != B * n:
            raise RouterKeyError(
                f"BlockStored has {len(toks)} token ids for {n} blocks of block_size {B}"
            )
        if B % R:
            self.stats.unkeyable_blocks += n
            for eh in hashes:
                self._add_copy(s, eh, None, t, g, keyable=False)
            return
        per = B // R
        if s.per != per:
            if s.per is not None:
                self._per_mask[s.per] &= ~s.bit
            s.per = per
            s.block_size = B
            self._per_mask[per] = self._per_mask.get(per, 0) | s.bit
        parent = ev.parent_block_hash
        extra = ev.extra_keys
        if extra:
            salt, extras = event_block_extras(extra, ev.lora_name, n, per, R, parent is None)
        else:
            salt, extras = None, None
        young = self._young
        if parent is None:
            seed = event_namespace(ev.lora_name, ev.lora_id, salt)
            if self._reannounce and (hashes[0] in young or hashes[0] in self._old) and self._holds_all(s, hashes, t, g):
                self.stats.reannounced_blocks += n
                return
        else:
            pv = young.get(parent)
            if pv is None:
                pv = self._old.get(parent)
            if pv is None:
                self._store_unlinked_run(s, ev, pack_tokens(toks), per, extras, t, g)
                return
            seed = pv if type(pv) is int else pv[-1]
        raw = pack_tokens(toks)
        keys = chain_keys(raw, n * per, R, seed, extras)
        held = self._held[t]
        bit = s.bit
        fam = self._per_mask[per]
        others = [h for i, h in enumerate(self._held) if i != t and h]
        old = self._old if self._old else None
        compact = self._compact
        unl = self._unl
        waiting = self._waiting
        fast = per == 1 and g == 0
        added = 0
        step = 4 * R * per
        start = 0
        v: int | tuple[int, ...]  # a block's router key, or its keys when per > 1
        if fast and not others and not old and not unl and not waiting and not compact:
            # The common case (one key per block, one tier, nothing unlinked or aging):
            # new blocks whose keys no other hash of the family holds are installed here;
            # the general loop below takes over at the first block that is anything else.
            for eh, v in zip(hashes, keys):
                if eh in young:
                    break
                m = held.get(v, 0)
                if m & fam:
                    break
                young[eh] = v
                held[v] = m | bit
                start += 1
            added = start
        for i in range(start, n):
            eh = hashes[i]
            k0 = i * per
            v = keys[k0] if per == 1 else tuple(keys[k0 : k0 + per])
            cur = young.get(eh)
            if cur is None and old:
                cur = old.get(eh)
            if cur is None:
                m = held.get(keys[k0 + per - 1], 0)
                anym = m
                for h in others:
                    anym |= h.get(keys[k0 + per - 1], 0)
                if anym & fam:
                    # Another hash of this block-size family already has this key: mixed
                    # seeds, or extra keys the wire does not carry (0.11 salts). Give this
                    # hash its own, unreachable key so the two are never conflated.
                    self.stats.family_conflicts += 1
                    v = _perturb(v, eh)
                    m = 0
                elif fast and not (unl and eh in unl):
                    if compact:
                        young.insert_new(eh, v)
                        held.set_bit(v, bit)
                    else:
                        young[eh] = v
                        held[v] = m | bit
                    added += 1
                    if waiting and eh in waiting:
                        self._link(eh)
                    continue
                self._add_copy(s, eh, v, t, g)
                cur = v
            else:
                self._add_copy(s, eh, None, t, g)
            if cur != v and i + 1 < n:
                # The chain continues from the key this hash really has.
                last = cur if type(cur) is int else cur[-1]
                keys[k0 + per :] = chain_keys(
                    raw[(i + 1) * step :], (n - i - 1) * per, R, last,
                    extras[k0 + per :] if extras is not None else None,
                )
        if added:
            s.count[t] += added
            self.stats.stored_blocks += added

    def _holds_all(self, s: _Source, hashes: Sequence[Any], t: int, g: int) -> bool:
        held = self._held[t]
        bit = s.bit
        copies = self._copies
        for eh in hashes:
            v = self._young.get(eh)
            if v is None:
                v = self._old.get(eh)
                if v is None:
                    return False
            if not held.get(v if type(v) is int else v[-1], 0) & bit:
                return False
            cp = copies.get((eh, s.slot, t)) if copies else None
            if cp is None:
                if g != 0:
                    return False
            elif not cp.get(g):
                return False
        return True

    def _store_unlinked_run(self, s: _Source, ev: BlockStored, raw: bytes, per: int,
                            extras: list[bytes | None] | None, t: int, g: int) -> None:
        """A run whose parent is unknown: keep each block unlinked until its parent links."""
        parent = ev.parent_block_hash
        step = 4 * self._R * per
        hashes = ev.block_hashes
        for i, eh in enumerate(hashes):
            if eh in self._young or eh in self._old:
                # Known already (another source linked it): the rest of the run chains from it.
                self._add_copy(s, eh, None, t, g)
            else:
                u = self._unl.get(eh)
                if u is None or u.raw is None:
                    ex = extras[i * per : (i + 1) * per] if extras is not None else None
                    if u is None:
                        u = _Unlinked(parent, raw[i * step : (i + 1) * step], ex, per, self._gen)
                        self._unl[eh] = u
                        self.stats.unlinked_blocks += 1
                    else:
                        u.parent, u.raw, u.extras, u.per = parent, raw[i * step : (i + 1) * step], ex, per
                    self._waiting.setdefault(parent, []).append(eh)
                self._hold_unlinked(s, u, t, g)
                if parent in self._young or parent in self._old:
                    self._link(parent)
            parent = eh

    def _hold_unlinked(self, s: _Source, u: _Unlinked, t: int, g: int) -> None:
        key = (s.slot, t)
        h = u.holds.get(key)
        if h is None:
            u.holds[key] = {g: 1}
            s.count[t] += 1
            self.stats.stored_blocks += 1
            return
        h[g] = h.get(g, 0) + 1
        self.stats.stored_blocks += 1

    def _add_copy(self, s: _Source, eh: Any, v: Any, t: int, g: int, keyable: bool = True) -> None:
        """Add one physical copy of ``eh`` in (source, tier, group). ``v``: its key(s) if
        computed from tokens, None if the event carried no (usable) tokens."""
        young = self._young
        cur = young.get(eh)
        if cur is None:
            cur = self._old.pop(eh, None)
            if cur is not None:
                young[eh] = cur  # a store refreshes the TTL
        if cur is None:
            u = self._unl.get(eh)
            if v is None or not keyable:
                if u is None:
                    u = _Unlinked(None, None, None, 0, self._gen)
                    self._unl[eh] = u
                    self.stats.unlinked_blocks += 1
                self._hold_unlinked(s, u, t, g)
                return
            young[eh] = v
            n = 0
            if u is not None:
                self._unlink_drop(eh, u)
                n = self._install(eh, v, u.holds)
                self.stats.linked_blocks += 1
            self._hold(s, eh, v, t, g, fresh=n == 0)
            if self._waiting and eh in self._waiting:
                self._link(eh)
            return
        if v is not None and v != cur:
            self.stats.key_conflicts += 1
        self._hold(s, eh, cur, t, g, fresh=False)

    def _hold(self, s: _Source, eh: Any, v: Any, t: int, g: int, fresh: bool) -> None:
        held = self._held[t]
        bit = s.bit
        rk0 = v if type(v) is int else v[-1]
        m = held.get(rk0, 0)
        self.stats.stored_blocks += 1
        if (m & bit or g) and not self._add_copy_record((eh, s.slot, t), g, bool(m & bit)):
            return
        if type(v) is int:
            held[rk0] = m | bit
        else:
            self._sub_add(held, v, s.slot, t, bit)
        s.count[t] += 1
        if not fresh:
            self._href[eh] = self._href.get(eh, 1) + 1

    def _sub_add(self, held: dict[int, int], rks: Sequence[int], slot: int, t: int, bit: int) -> None:
        """Set ``bit`` on every key of a multi-router-block engine block. Leading sub-keys
        are counted per (key, source, tier): engine blocks that differ only in a later
        router block share them."""
        sub = self._sub_n
        last = len(rks) - 1
        for j, rk in enumerate(rks):
            if j < last:
                k = (rk, slot, t)
                sub[k] = sub.get(k, 0) + 1
            held[rk] = held.get(rk, 0) | bit

    def _install(self, eh: Any, v: Any, holds: dict[tuple[int, int], dict[int, int]]) -> int:
        """Put an unlinked block's holdings (``holds``) under its new key(s) ``v``; ``eh``
        is already in the young generation. Returns the holdings installed (the
        per-source counts already include them)."""
        n = 0
        rks = (v,) if type(v) is int else v
        for (slot, t), groups in holds.items():
            s = self._src[slot]
            if s is None:
                continue
            held = self._held[t]
            if len(rks) == 1:
                held[rks[0]] = held.get(rks[0], 0) | s.bit
            else:
                self._sub_add(held, rks, slot, t, s.bit)
            if groups != {0: 1}:
                self._copies[(eh, slot, t)] = dict(groups)
            n += 1
        if n > 1:
            self._href[eh] = n
        return n

    def _link(self, parent: Any) -> None:
        """``parent`` just got a key: key and install every unlinked descendant."""
        R = self._R
        stack = [parent]
        while stack:
            p = stack.pop()
            kids = self._waiting.pop(p, None)
            if not kids:
                continue
            pv = self._young.get(p)
            if pv is None:
                pv = self._old.get(p)
            if pv is None:
                continue
            seed = pv if type(pv) is int else pv[-1]
            for c in kids:
                u = self._unl.get(c)
                if u is None or u.parent != p or u.raw is None:
                    continue
                keys = chain_keys(u.raw, u.per, R, seed, u.extras)
                v = keys[0] if u.per == 1 else tuple(keys)
                anym = 0
                for h in self._held:
                    anym |= h.get(keys[-1], 0)
                if anym & self._per_mask.get(u.per, 0):
                    self.stats.family_conflicts += 1
                    v = _perturb(v, c)
                del self._unl[c]
                if c in self._young or c in self._old:
                    continue
                self._young[c] = v
                if not self._install(c, v, u.holds):
                    del self._young[c]
                self.stats.linked_blocks += 1
                stack.append(c)

    def _unlink_drop(self, eh: Any, u: _Unlinked) -> None:
        del self._unl[eh]
        if u.raw is not None:
            kids = self._waiting.get(u.parent)
            if kids is not None:
                try:
                    kids.remove(eh)
                except ValueError:
                    pass
                if not kids:
                    del self._waiting[u.parent]

    def _removed(self, s: _Source, ev: BlockRemoved) -> None:
        t = self._tier(ev.medium)
        g = ev.group_idx or 0
        young = self._young
        held = self._held[t]
        bit = s.bit
        href = self._href
        copies = self._copies
        slot = s.slot
        removed = 0
        for eh in ev.block_hashes:
            rk = young.get(eh)
            if type(rk) is int and g == 0 and not (copies and (eh, slot, t) in copies):
                m = held.get(rk, 0)
                if m & bit:
                    m ^= bit
                    if m:
                        held[rk] = m
                    else:
                        del held[rk]
                    removed += 1
                    if href:
                        n = href.pop(eh, 1) - 1
                        if n == 0:
                            del young[eh]
                        elif n > 1:
                            href[eh] = n
                    else:
                        del young[eh]
                    continue
            if self._remove_copy(s, eh, t, g):
                self.stats.removed_blocks += 1
            else:
                self.stats.unknown_removed += 1
        s.count[t] -= removed
        self.stats.removed_blocks += removed

    def _remove_copy(self, s: _Source, eh: Any, t: int, g: int) -> bool:
        d = self._young
        v = d.get(eh)
        if v is None:
            d = self._old
            v = d.get(eh)
        if v is None:
            u = self._unl.get(eh)
            if u is None:
                return False
            key = (s.slot, t)
            h = u.holds.get(key)
            if h is None or not h.get(g):
                return False
            h[g] -= 1
            if not h[g]:
                del h[g]
                if not h:
                    del u.holds[key]
                    s.count[t] -= 1
                    if not u.holds:
                        self._unlink_drop(eh, u)
            return True
        held = self._held[t]
        bit = s.bit
        rks = (v,) if type(v) is int else v
        if not held.get(rks[-1], 0) & bit:
            return False
        left = self._take_copy((eh, s.slot, t), g)
        if left != 2:
            return left == 1
        self._release(s, eh, rks, t, d)
        return True

    def _release(self, s: _Source, eh: Any, rks: Sequence[int], t: int, d: dict[Any, Any]) -> None:
        """Drop the (source, tier) holding of ``eh`` (all its copies are gone)."""
        held = self._held[t]
        nb = ~s.bit
        sub = self._sub_n
        for j, rk in enumerate(rks):
            if j < len(rks) - 1:
                # A leading sub-key may be shared by several of this source's engine blocks.
                k = (rk, s.slot, t)
                c = sub.get(k, 1) - 1
                if c > 0:
                    sub[k] = c
                    continue
                sub.pop(k, None)
            m = held.get(rk, 0) & nb
            if m:
                held[rk] = m
            else:
                held.pop(rk, None)
        s.count[t] -= 1
        n = self._href.pop(eh, 1) - 1
        if n <= 0:
            del d[eh]
        elif n > 1:
            self._href[eh] = n

    def _drop_source(self, s: _Source, tiers: Iterable[int]) -> None:
        """Drop every holding of ``s`` in ``tiers``. O(index size): only on clears/restarts."""
        tiers = tuple(tiers)
        bit = s.bit
        slot = s.slot
        per = s.per
        for d in (self._young, self._old):
            for eh, v in list(d.items()):
                rks = (v,) if type(v) is int else v
                if per is not None and len(rks) != per:
                    continue  # another block-size family's hash for the same key
                for t in tiers:
                    if self._held[t].get(rks[-1], 0) & bit:
                        self._copies.pop((eh, slot, t), None)
                        self._release(s, eh, rks, t, d)
                        if eh not in d:
                            break
        for eh, u in list(self._unl.items()):
            for t in tiers:
                if u.holds.pop((slot, t), None) is not None:
                    s.count[t] -= 1
            if not u.holds:
                self._unlink_drop(eh, u)
        if self._spec_n:
            self._drop_spec(lambda sl, rk: sl == slot)

    # -- TTL and memory bound ----------------------------------------------------------

    def _tick(self, now: float) -> None:
        if not self._generation_ended(now):
            return
        # Rotate: blocks not re-stored for a whole generation expire.
        expired = list(self._old)
        for eh in expired:
            self._forget(eh)
        self.stats.expired_blocks += len(expired)
        for eh, u in list(self._unl.items()):
            if u.gen < self._gen:
                self._forget_unlinked(eh, u)
                self.stats.expired_blocks += 1
        self._old = self._young
        self._young = self._map()
        self._gen += 1
        self._gen_start = now

    def estimated_bytes(self) -> int:
        """Estimated heap bytes held by the index (measured per-entry costs x entries)."""
        return (
            self._bpb * (len(self._young) + len(self._old))
            + 80 * len(self._href)
            + _BYTES_PER_COPY_RECORD * len(self._copies)
            + _BYTES_PER_UNLINKED * len(self._unl)
        )

    def _evict(self, target: int) -> None:
        """Drop entries until :meth:`estimated_bytes` <= ``target`` (order: see class doc)."""
        while self._unl and self.estimated_bytes() > target:
            for eh in list(islice(self._unl, 1024)):
                u = self._unl.get(eh)
                if u is not None:
                    self._forget_unlinked(eh, u)
                    self.stats.evicted_blocks += 1
        for d in (self._old, self._young):
            while d and self.estimated_bytes() > target:
                over = self.estimated_bytes() - target
                k = max(1, min(65536, over // self._bpb + 1))
                for eh in list(islice(d, k)):
                    if eh in d:
                        self._forget(eh)
                        self.stats.evicted_blocks += 1

    def _forget_unlinked(self, eh: Any, u: _Unlinked) -> None:
        for (slot, t) in u.holds:
            s = self._src[slot]
            if s is not None:
                s.count[t] -= 1
        self._unlink_drop(eh, u)
        self._waiting.pop(eh, None)

    def _forget(self, eh: Any) -> None:
        """Drop ``eh`` from every source and tier."""
        d = self._young if eh in self._young else self._old
        v = d[eh]
        rks = (v,) if type(v) is int else v
        for t, held in enumerate(self._held):
            m = held.get(rks[-1], 0)
            for slot in _bits(m):
                s = self._src[slot]
                if s is None or (s.per is not None and s.per != len(rks)):
                    continue
                self._copies.pop((eh, slot, t), None)
                self._release(s, eh, rks, t, d)
                if eh not in d:
                    return
        d.pop(eh, None)
        self._href.pop(eh, None)

    def keys(
        self,
        prompt_tokens: Sequence[int],
        lora: str | int | None = None,
        salt: str | None = None,
        mm_items: Sequence[Any] | None = None,
    ) -> list[int]:
        """The router keys of a prompt's full router blocks (see :mod:`kvstream.routing.keys`)."""
        return prompt_keys(prompt_tokens, self._R, lora, salt, mm_items)

    # -- engine-hash matching ----------------------------------------------------------

    def engine_hashes(
        self,
        prompt_tokens: Sequence[int],
        lora: Any = None,
        salt: str | None = None,
        mm_items: Sequence[Any] = (),
    ) -> list[Any]:
        """The engines' own external block hashes of a prompt, computed with the ``hasher``
        given at construction (same algorithm, seed and block size as the engines).
        ``lora``: a :class:`kvstream.hashing.LoRA`."""
        if self._hasher is None:
            raise IndexUsageError(
                "engine_hashes() needs KVIndex(hasher=BlockHasher(algorithm, block_size, seed=...)) "
                "configured like the engines"
            )
        from kvstream.hashing import RequestBlockHasher, to_external_list

        rh = RequestBlockHasher(self._hasher, lora=lora, mm_items=mm_items, cache_salt=salt)
        rh.extend(prompt_tokens)
        return to_external_list(rh.block_hashes)

    def match_engine_hashes(self, hashes: Sequence[Any]) -> dict[str, int]:
        """Per source, the longest prefix of ``hashes`` (engine block hashes of one prompt,
        in order) it holds in any medium, in *engine* blocks. Works for unlinked blocks
        too (no tokens or parents needed), so it is exact right after a restart of the
        router; only sources whose engines hash like ``hashes`` can match."""
        active = self._live
        res: dict[int, int] = {}
        i = 0
        for i, eh in enumerate(hashes):
            v = self._young.get(eh)
            if v is None:
                v = self._old.get(eh)
            m = 0
            if v is not None:
                rks = (v,) if type(v) is int else v
                for held in self._held:
                    mm = -1
                    for rk in rks:
                        mm &= held.get(rk, 0)
                    m |= mm
            else:
                u = self._unl.get(eh)
                if u is not None:
                    for (slot, _t) in u.holds:
                        m |= 1 << slot
            na = active & m
            if na != active:
                for slot in _bits(active ^ na):
                    res[slot] = i
                active = na
                if not active:
                    break
        else:
            i = len(hashes)
        for slot in _bits(active):
            res[slot] = len(hashes)
        return {s.name: res.get(s.slot, 0) for s in self._src if s is not None}

    # -- canonical state ---------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything the index holds, in a canonical form comparable with ``==``.

        ``{"router_block_size": R, "sources": {name: {"stale": bool, "blocks": ((medium,
        group, engine_hash, copies), ...) sorted}}, "unlinked": (engine hashes sorted)}``.
        Speculative entries and counters are not part of the state.
        """
        per_src: dict[int, list[tuple[str, int, Any, int]]] = {
            s.slot: [] for s in self._src if s is not None
        }
        media = self._media
        for d in (self._young, self._old):
            for eh, v in d.items():
                rks = (v,) if type(v) is int else v
                for t, held in enumerate(self._held):
                    m = held.get(rks[-1], 0)
                    for slot in _bits(m):
                        s = self._src[slot]
                        if s is None or (s.per is not None and s.per != len(rks)):
                            continue
                        cp = self._copies.get((eh, slot, t))
                        for g, c in (cp.items() if cp is not None else ((0, 1),)):
                            per_src[slot].append((media[t], g, eh, c))
        for eh, u in self._unl.items():
            for (slot, t), groups in u.holds.items():
                for g, c in groups.items():
                    per_src[slot].append((media[t], g, eh, c))
        return {
            "router_block_size": self._R,
            "sources": {
                s.name: {"stale": s.stale, "blocks": tuple(sorted(per_src[s.slot], key=_sort_key))}
                for s in self._src
                if s is not None
            },
            "unlinked": tuple(sorted(self._unl, key=_hash_sort_key)),
        }


def _perturb(v: Any, eh: Any) -> Any:
    """A key (or keys) no token prompt can produce, derived from ``v`` and engine hash ``eh``."""
    tag = eh.to_bytes(8, "little") if type(eh) is int else bytes(eh)
    if type(v) is int:
        return _xxh3_64(v.to_bytes(8, "little") + b"\xffkvstream-alias" + tag) & KEY_MASK
    return tuple(_xxh3_64(k.to_bytes(8, "little") + b"\xffkvstream-alias" + tag) & KEY_MASK for k in v)


_xxh3_64 = xxhash.xxh3_64_intdigest
