"""The router index: which source holds which prefix blocks, built from KV event batches.

A sans-IO object. Feed it decoded batches (:meth:`KVIndex.apply_batch`) from any number of
sources (an engine, or one data-parallel rank of one); ask it where a prompt's prefix is
cached (:meth:`KVIndex.match`, :meth:`KVIndex.score`). No sockets, no clock reads: time
comes in as arguments.

One index, two keyings (:mod:`kvstream.routing.keying`): blocks are keyed by router keys
computed from their tokens (:class:`~kvstream.routing.keying.TokenKeys`, the default) or by
the engines' own hashes (:class:`~kvstream.routing.keying.EngineHashes`;
:class:`kvstream.routing.engine_index.EngineKeyIndex` is that configuration). Everything
else is written once, here: residency, copies, media, removal, clears, stale sources, TTL,
the memory bound, estimated bytes and snapshots.

Model
-----
* **Residency** is kept per (source, medium, KV cache group, engine block hash) as a count
  of physical copies: vLLM stores the same hash twice and removes it once while a copy
  remains, and stores one hash in several groups and media.
* The scoring structure is, per medium, ``key -> bitmask of sources`` (``_held``, native
  maps: ``kvstream._native.NativeMap``). Scoring a prompt walks its keys once and stops
  when no source remains; there is no per-source loop per block.
* **The block table** (:mod:`kvstream.routing.table`, the storage seam, chosen with
  ``KVIndex(table=...)``: the native table by default, or any ``BlockTable``) maps
  each engine hash to its router key(s) under token keying. Under engine keying a hash is its own key
  and there is no table (:class:`_HeldKeys` reads the held maps instead).
* **Router keys** (:mod:`kvstream.routing.keys`) are computed from each ``BlockStored``'s
  tokens and its parent's key. Engine blocks are split into router blocks of
  ``router_block_size`` tokens (default 16); an engine block size that is not a multiple of
  it cannot be keyed (its blocks are still tracked and matchable by engine hash, and counted
  in ``stats.unkeyable_blocks``). A ``BlockStored`` whose parent was never seen is kept as an
  *unlinked* block and linked (keyed) when the parent shows up, never dropped.
* A ``BlockRemoved`` of an unknown block is counted (``stats.unknown_removed``), not an
  error. ``AllBlocksCleared`` clears that source's GPU tier only. Tier-only events (CPU
  offload ``BlockStored`` with no tokens) update the location of known blocks.
* Token keying: one engine-hash family per block size: sources that use the same block size
  must use the same hash algorithm and seed (the normal case: replicas of one model).
  Violations are detected and counted (``stats.family_conflicts``). An engine hash that
  arrives under a second block size (a 64-bit collision, or a misbehaving engine) is kept
  apart: the index holds it under an id of its own for that block size (``_size_id``,
  counted in ``stats.size_conflicts``) and translates that size's events and queries to
  it, so neither source takes the other's content. Engine keying: every
  source must hash like the hasher (other block sizes are rejected, other hash forms
  counted).

Memory bound and eviction order: see :class:`KVIndex` and ``docs/router.md``.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections import Counter, deque
from dataclasses import dataclass
from array import array
from itertools import chain, compress, islice
from operator import attrgetter
from typing import Any, Iterable, Iterator, Mapping, Sequence

import xxhash

from kvstream.routing import snapshot as sn
from kvstream.routing._core import (
    REANNOUNCE_RULES,
    IndexUsageError,
    _reannounce_code,
    SourceInfo,
    _bits,
    _hash_sort_key,
    _IndexCore,
    _sort_key,
    _Source,
)
from kvstream.routing.keying import EngineHashes, TokenKeys
from kvstream._native import (
    NativeMap,
    RawBatch,
    apply_engine as _apply_engine_native,
    apply_tokens as _apply_tokens,
    load_tier as _load_tier,
    read_payload as _read_payload,
)
from kvstream.routing.payloads import PayloadBatch
from kvstream.routing.table import TABLES, BlockTable
from kvstream.wire.events import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventDecoder,
    KVEventBatch,
)
from kvstream.routing.keys import (
    KEY_MASK,
    RouterKeyError,
    chain_keys,
    event_block_extras,
    event_namespace,
    namespace,
    pack_tokens,
)

__all__ = ["KVIndex", "IndexStats", "SourceInfo", "IndexUsageError", "EngineHashes", "TokenKeys"]

_log = logging.getLogger("kvstream.routing.index")
_events_of = attrgetter("events")

_BYTES_PER_UNLINKED = 640  # the record, its holds dict, one holder's group dict and key, the hash
_BYTES_PER_HOLDER = 320  # each further (source, medium) holding an unlinked block
_BYTES_PER_COPY_RECORD = 300
_BYTES_PER_SOURCE = 600  # a source's record, name, counts and table slots
_M64 = (1 << 64) - 1
_BASE_NS = namespace()  # the chain root of base-model, unsalted runs


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
    rejected_media: int = 0
    """Blocks stored in a medium beyond the index's media bounds (``MAX_MEDIA``,
    ``MAX_MEDIA_PER_SOURCE``), skipped."""
    unkeyable_blocks: int = 0
    """Token keying: blocks whose engine block size is not a multiple of the router block size."""
    foreign_block_size: int = 0
    """Engine keying: blocks rejected because their ``BlockStored.block_size`` is not the hasher's."""
    foreign_hash_form: int = 0
    """Engine keying: blocks whose hash is in the other external form (bytes vs int) than
    configured; kept (so removals stay exact) but no prompt can match them."""
    unlinked_blocks: int = 0
    """Blocks stored with a parent the index had not seen (kept, linked later)."""
    linked_blocks: int = 0
    """Unlinked blocks that got their key when their parent arrived."""
    family_conflicts: int = 0
    """New engine hash for a key already held by a same-block-size source (mixed seeds)."""
    key_conflicts: int = 0
    """An engine hash re-stored with different tokens than before (kept the first key)."""
    size_conflicts: int = 0
    """Engine hashes stored under a second block size (a 64-bit collision, or a misbehaving
    engine): each block size keeps its own copy of the hash, under an id of its own."""
    multi_size_sources: int = 0
    """Times a source began storing a second engine block size while it held blocks of
    its first (a hybrid model's groups of different block sizes, or an engine restarted
    with another block size and no clear): from then until it holds nothing, its
    holdings are kept as explicit records (exact, slower to ingest)."""
    clears: int = 0
    """``AllBlocksCleared`` events applied."""
    evicted_blocks: int = 0
    """Blocks dropped by the memory bound."""
    expired_blocks: int = 0
    """Blocks dropped by the TTL."""
    rejected_payloads: int = 0
    """Payloads given to :meth:`KVIndex.apply_payload` that did not decode (each raised
    :class:`~kvstream.wire.events.EventDecodeError`; nothing of them was applied)."""


class _Unlinked:
    """A block whose router key is not known yet (parent unseen, or no tokens seen)."""

    __slots__ = ("parent", "raw", "extras", "per", "holds", "gen", "cost")

    def __init__(self, parent: Any, raw: bytes | None, extras: list[bytes | None] | None,
                 per: int, gen: int) -> None:
        self.parent = parent
        self.raw = raw
        self.extras = extras
        self.per = per
        self.holds: dict[tuple[int, int], dict[int, int]] = {}  # (slot, tier) -> {group: n}
        self.gen = gen
        self.cost = 0  # estimated heap bytes, kept in KVIndex._unl_bytes

    def payload(self) -> int:
        """Estimated heap bytes of this record without extra holders (bytes)."""
        n = _BYTES_PER_UNLINKED + (33 + len(self.raw) if self.raw is not None else 0)
        if self.extras is not None:
            n += 56 + 8 * len(self.extras) + sum(33 + len(x) for x in self.extras if x)
        return n


class KVIndex(_IndexCore):
    """Prefix-aware residency index over many sources' KV event streams (sans-IO).

    Args:
        block_size_hint: alias of ``router_block_size`` (the interface name).
        router_block_size: token keying: tokens per router block (default 16). It must
            divide every engine's block size for that engine's blocks to be keyed by
            tokens; pick the gcd of your engines' block sizes.
        keying: how blocks and prompts are keyed (:mod:`kvstream.routing.keying`):
            ``"tokens"`` (default; router keys from token ids, or a
            :class:`~kvstream.routing.keying.TokenKeys`), ``"engine"`` (the engines' own
            hashes; needs ``hasher``) or an :class:`~kvstream.routing.keying.EngineHashes`.
            Under engine keying the scoring block is the hasher's block size.
        max_bytes: optional memory bound (bytes of heap, an upper bound measured as
            :meth:`estimated_bytes`). When a batch leaves the index above it, entries are
            dropped until it is under 90 % of the bound and the tables are shrunk, in this
            order: unlinked blocks (oldest first), blocks not stored in the TTL's current
            generation, then blocks in the block table's order (oldest first; the native
            table reuses positions freed by removals; engine keying: the GPU tier's order,
            then the others'). A dropped block disappears from every source and tier.
        ttl_s: optional time to live (seconds) of a block after its last ``BlockStored``
            from any source; a block is dropped between ``ttl_s`` and ``2 * ttl_s`` after
            it (two generations). Time is the ``now`` given to :meth:`apply_batch`
            (default: the batch's ``ts``). Costs one set entry (~36 bytes) per block stored
            within a generation.
        reannounce: which ``BlockStored`` runs are report-mode re-announcements (vLLM's
            ``kv_cache_report_mode="full"`` re-sends a request's cached prefix without
            changing the pool), which add no copy. A candidate starts at block 0 (parent
            None) and the source *already holds all* its blocks in that medium and group.
            ``"session"`` (default): only candidates that carry a ``session_id`` (vLLM sends
            it with report-mode events; 0.11 and requests without report mode never do),
            so every other store counts, exactly. ``"detect"``: every candidate.
            ``"count"``: none (every store is a copy; exact for engines that never
            re-announce). The one real store that looks like a re-announcement is a fully
            cached prompt of exactly one block, recomputed; under ``"session"`` it is
            misread only for report-mode requests, under ``"detect"`` for all, and then
            the index under-counts by one copy (the router may miss; it never routes to a
            block that is gone). :meth:`configure_source` sets the rule per source.
        hasher: a :class:`kvstream.hashing.BlockHasher` with the engines' algorithm, seed
            and block size: the hasher of ``keying="engine"``; under token keying optional,
            for :meth:`engine_hashes` (matching by engine hashes).
        table: token keying: where the block table (``engine hash -> router key``) lives
            (:mod:`kvstream.routing.table`): ``"native"`` (default; the native core's
            table, ~55 bytes per (block, source) entry at 10**6 entries with the GPU
            tier's mask map, its common ingest cases applied in Rust; ``"dict"`` and
            ``"compact"`` are its former names), or an empty
            :class:`~kvstream.routing.table.BlockTable` instance (any backend; driven
            through the protocol's methods only). Engine keying stores no block table
            and takes no ``table``.
    """

    __slots__ = (
        "_R", "_keying", "_by_engine", "_slot_of", "_src", "_slot_gen", "_free_slots", "_live", "_media",
        "_tier_of", "_held", "_table", "_touched", "_href", "_sub_n", "_copies", "_unl",
        "_waiting", "_spec", "_spec_n", "_spec_q", "_per_mask", "_max_bytes", "_ttl", "_gen",
        "_gen_start", "_reannounce", "_hasher", "_unl_bytes", "_warned", "_kind", "_wide", "stats",
        "_xbs", "_xrev", "_xsweep", "_multi", "_mend",
    )

    def __init__(
        self,
        block_size_hint: int | None = None,
        *,
        router_block_size: int | None = None,
        keying: str | TokenKeys | EngineHashes = "tokens",
        max_bytes: int | None = None,
        ttl_s: float | None = None,
        reannounce: str = "session",
        hasher: Any = None,
        table: str | BlockTable | None = None,
    ) -> None:
        if block_size_hint is not None and router_block_size is not None and block_size_hint != router_block_size:
            raise IndexUsageError(
                f"block_size_hint={block_size_hint} and router_block_size={router_block_size} "
                "disagree; they are the same setting, give one"
            )
        R = router_block_size if router_block_size is not None else block_size_hint
        if keying == "engine":
            keying = EngineHashes(hasher)
        if isinstance(keying, EngineHashes):
            if R is not None and R != keying.block_size:
                raise IndexUsageError(
                    f"router_block_size={R}, but engine-hash keying scores blocks of the hasher's "
                    f"{keying.block_size} tokens; leave it out")
            hasher = keying.hasher
        elif keying == "tokens" or isinstance(keying, TokenKeys):
            if isinstance(keying, TokenKeys):
                if R is not None and R != keying.block_size:
                    raise IndexUsageError(
                        f"router_block_size={R} and keying={keying!r} disagree; give one")
            else:
                keying = TokenKeys(16 if R is None else R)
        else:
            raise IndexUsageError(
                f"keying must be 'tokens', 'engine' (with hasher=...), TokenKeys(...) or "
                f"EngineHashes(...), got {keying!r:.80}")
        if max_bytes is not None and max_bytes <= 0:
            raise IndexUsageError(f"max_bytes must be positive (bytes) or None, got {max_bytes!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise IndexUsageError(f"ttl_s must be positive (seconds) or None, got {ttl_s!r}")
        self._keying: TokenKeys | EngineHashes = keying
        self._by_engine = isinstance(keying, EngineHashes)
        self._R = keying.block_size
        self._slot_of: dict[str, int] = {}
        self._src: list[_Source | None] = []
        self._slot_gen = 0  # bumped whenever a slot gets or loses its source (see slot_sources)
        self._free_slots: list[int] = []
        self._live = 0  # mask of sources that score (not stale)
        self._media: list[str] = []
        self._tier_of: dict[str, int] = {}
        # Per tier: key -> source mask (a lone holder's mask is its bit object).
        self._held: list[Any] = []
        for m in ("GPU", "CPU"):
            self._new_tier(m)
        # The block table (engine hash -> key, or keys as a tuple); none under engine keying.
        self._table: BlockTable = _HeldKeys(self._held) if self._by_engine else _new_table(table)
        if self._by_engine and table is not None:
            raise IndexUsageError(
                "engine keying stores no block table (a hash is its own key); leave table out")
        # The ingest, picked once: the native core's for the native table, the generic one
        # (protocol methods only) for any other backend.
        self._kind = _NATIVE if type(self._table) is NativeMap else _GENERIC
        self._wide = False  # a bytes engine hash was seen (estimated_bytes: larger keys)
        self._touched: set[Any] | None = set() if ttl_s is not None else None  # stored this TTL generation
        self._unl_bytes = 0  # token and extra bytes held by unlinked blocks
        # (key, source slot, tier) -> holdings covering the key: a source's leading
        # sub-keys; every key of a source that holds two block sizes (``_Source.multi``).
        self._sub_n: dict[tuple[int, int, int], int] = {}
        self._multi = 0  # bits of the sources that hold blocks of two block sizes
        # per -> {last router key -> holdings}: what those sources hold, by engine block
        # size and last key (their mask bits cannot say it), for the family check.
        self._mend: dict[int, dict[int, int]] = {}
        self._href: dict[Any, int] = {}  # engine hash -> (source, tier) holdings, when > 1 (token keying)
        self._copies: dict[tuple[Any, int, int], dict[int, int]] = {}  # not exactly {group 0: 1}
        self._unl: dict[Any, _Unlinked] = {}
        self._waiting: dict[Any, list[Any]] = {}  # parent hash -> unlinked children
        self._spec: dict[Any, int] = {}  # key -> speculative source mask
        self._spec_n: dict[tuple[int, Any], int] = {}
        self._spec_q: deque[tuple[float, int, list[Any]]] = deque()
        self._per_mask: dict[int, int] = {}
        # An engine hash held under two block sizes: raw hash -> {per: id of this size's
        # copy}, and id -> (raw hash, per). Empty unless ``stats.size_conflicts``.
        self._xbs: dict[Any, dict[int, Any]] = {}
        self._xrev: dict[Any, tuple[Any, int]] = {}
        self._xsweep = _SWEEP_MIN
        self._max_bytes = max_bytes
        self._ttl = ttl_s
        self._gen = 0
        self._gen_start: float | None = None
        self._reannounce = _reannounce_code(reannounce)
        self._hasher = hasher
        self._warned: set[tuple[str, str]] = set()
        self.stats = IndexStats()
        """Cumulative counters (:class:`IndexStats`)."""

    @property
    def keying(self) -> TokenKeys | EngineHashes:
        """The keying strategy (:mod:`kvstream.routing.keying`)."""
        return self._keying

    @property
    def hasher(self) -> Any:
        """The engines' :class:`kvstream.hashing.BlockHasher` (None when not configured)."""
        return self._hasher

    # -- sources ---------------------------------------------------------------------

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
        self._multi &= ~s.bit
        del self._slot_of[source]
        self._src[slot] = None
        self._slot_gen += 1
        self._free_slots.append(slot)

    # -- ingest ----------------------------------------------------------------------

    def apply_batch(self, source: str, batch: KVEventBatch, now: float | None = None, *,
                    payload: bytes | None = None) -> None:
        """Apply one decoded batch from ``source`` (events in order).

        Malformed events are skipped and counted (``stats.rejected_events``, logged at
        debug level); nothing a remote engine sends raises. ``now`` (seconds) drives the
        TTL; it defaults to ``batch.ts``. ``payload``: the bytes ``batch`` was decoded
        from, when the caller has them (a subscriber's ``SourceBatch.payload``): the native
        core then reads them again instead of walking the decoded events (the same
        result, see :meth:`apply_payload`; about 2x faster for batches of hundreds of
        blocks), keeping ``batch``'s events for whatever the native rules leave to
        Python. Payloads under 1 KiB (a few events, where the extra call costs what it
        saves) are applied from ``batch``.
        """
        if type(batch) is PayloadBatch and (self._by_engine or self._kind == _NATIVE):
            self._apply_raw(source, batch.raw, _PayloadFallback(batch), now)
            return
        if (payload is not None and type(payload) is bytes and len(payload) >= _RAW_MIN_BYTES
                and (self._by_engine or self._kind == _NATIVE)):
            raw = _read_payload(payload, _NO_LIMIT)
            if raw is not None and len(raw) == len(batch.events):
                self._apply_raw(source, raw, _Fallback(payload, _DECODER, batch.events), now)
                return
        slot = self._slot_of.get(source)
        s = self._source(source) if slot is None else self._src[slot]
        self.stats.batches += 1
        if self._ttl is not None:
            self._tick(batch.ts if now is None else now)
        if self._by_engine:
            self._apply_engine(s, batch.events)  # type: ignore[arg-type]
        elif self._kind == _NATIVE:
            self._apply_tokens_native(s, batch.events)  # type: ignore[arg-type]
        else:
            self._apply_events(s, batch.events)  # type: ignore[arg-type]
        if self._max_bytes is not None and self.estimated_bytes() > self._max_bytes:
            self._evict(int(self._max_bytes * 0.9))

    def apply_payload(self, source: str, payload: bytes | bytearray | memoryview,
                      now: float | None = None, *, decoder: EventDecoder | None = None) -> KVEventBatch | RawBatch:
        """Decode one raw KV event payload (vLLM's msgpack ``KVEventBatch``, any vintage)
        and apply it from ``source``: the same as ``apply_batch(source,
        decoder.decode(payload), now)``, but the payload is read by the native core (GIL
        released) and applied from its columns, with no Python object per event.

        A payload the native reader does not take (malformed, an unknown event type, an
        ext value, over the decoder's size limit) goes to ``decoder`` (default: an
        :class:`~kvstream.wire.events.EventDecoder` with its defaults), so the rules for
        what is accepted are exactly the decoder's: a malformed payload raises its
        :class:`~kvstream.wire.events.EventDecodeError`, is counted in
        ``stats.rejected_payloads`` and changes nothing. Returns the decoded batch (a
        :class:`~kvstream._native.RawBatch` with ``ts``, ``data_parallel_rank`` and
        ``len()``, or the decoder's :class:`~kvstream.wire.events.KVEventBatch`).
        """
        dec = _DECODER if decoder is None else decoder
        data = payload if type(payload) is bytes else bytes(payload)
        raw = _read_payload(data, getattr(dec, "_max", DEFAULT_MAX_PAYLOAD_BYTES))
        if raw is None or (self._kind != _NATIVE and not self._by_engine):
            try:
                batch = dec.decode(data)
            except EventDecodeError:
                self.stats.rejected_payloads += 1
                raise
            self.apply_batch(source, batch, now)
            return batch
        self._apply_raw(source, raw, _Fallback(data, dec), now)
        return raw

    def _apply_raw(self, source: str, raw: RawBatch, fallback: "_Fallback", now: float | None) -> None:
        """:meth:`apply_batch` of a payload the native reader decoded."""
        slot = self._slot_of.get(source)
        s = self._source(source) if slot is None else self._src[slot]
        self.stats.batches += 1
        if self._ttl is not None:
            self._tick(raw.ts if now is None else now)
        if self._by_engine:
            self._apply_engine(s, raw, fallback)  # type: ignore[arg-type]
        else:
            self._apply_tokens_native(s, raw, fallback)  # type: ignore[arg-type]
        if self._max_bytes is not None and self.estimated_bytes() > self._max_bytes:
            self._evict(int(self._max_bytes * 0.9))

    def apply_batches(self, source: str, batches: Sequence[KVEventBatch], now: float | None = None, *,
                      payloads: Sequence[bytes] | None = None) -> None:
        """Apply several decoded batches from ``source``, in order: the same as
        :meth:`apply_batch` on each, with the per-call work (source lookup, TTL tick,
        dispatch) done once for all of their events. A consumer that reads batches by the
        hundred (the JetStream consumer's router) spends less per batch this way. With a
        memory bound, or a TTL and no ``now``, it is :meth:`apply_batch` per batch (the
        bound is checked and the clock read after each batch). ``payloads``: the bytes
        each batch was decoded from (see :meth:`apply_batch`); the native core reads
        them, batch by batch, when they average 1 KiB or more (smaller ones: the decoded
        events in one call, which is faster for them)."""
        if (batches and type(batches[0]) is PayloadBatch and (self._by_engine or self._kind == _NATIVE)
                and list(map(type, batches)).count(PayloadBatch) == len(batches)):
            self._apply_payload_batches(source, batches, now)
            return
        if (payloads is not None and len(payloads) == len(batches) and (self._by_engine or self._kind == _NATIVE)
                and sum(map(len, payloads)) >= _RAW_MIN_BYTES * len(payloads)):
            for b, p in zip(batches, payloads):
                self.apply_batch(source, b, now, payload=p)
            return
        if self._max_bytes is not None or (now is None and self._ttl is not None) or len(batches) < 2:
            for b in batches:
                self.apply_batch(source, b, now)
            return
        slot = self._slot_of.get(source)
        s = self._source(source) if slot is None else self._src[slot]
        self.stats.batches += len(batches)
        if self._ttl is not None:
            self._tick(now)  # type: ignore[arg-type]
        events = list(chain.from_iterable(map(_events_of, batches)))
        if self._by_engine:
            self._apply_engine(s, events)  # type: ignore[arg-type]
        elif self._kind == _NATIVE:
            self._apply_tokens_native(s, events)  # type: ignore[arg-type]
        else:
            self._apply_events(s, events)  # type: ignore[arg-type]

    def _apply_payload_batches(self, source: str, batches: Sequence[PayloadBatch], now: float | None) -> None:
        """:meth:`apply_batches` of batches the native reader decoded
        (:class:`~kvstream.routing.payloads.PayloadBatch`, e.g. from the JetStream
        consumer): each applied from its columns, the source looked up once."""
        if self._max_bytes is not None or self._ttl is not None:
            for b in batches:
                self._apply_raw(source, b.raw, _PayloadFallback(b), now)
            return
        slot = self._slot_of.get(source)
        s = self._source(source) if slot is None else self._src[slot]
        self.stats.batches += len(batches)
        apply = self._apply_engine if self._by_engine else self._apply_tokens_native
        for b in batches:
            apply(s, b.raw, _PayloadFallback(b))  # type: ignore[arg-type]

    def _apply_events(self, s: _Source, events: Sequence[Any]) -> None:
        """Token keying's generic ingest loop: any :class:`BlockTable`, through its methods."""
        for ev in events:
            self._apply_event(s, ev)

    def _apply_event(self, s: _Source, ev: Any) -> None:
        """One event, token keying, no inline fast path (every table's slow path)."""
        cls = type(ev)
        try:
            if cls is BlockStored:
                self._stored(s, ev)
            elif cls is BlockRemoved:
                self._removed(s, ev)
            elif cls is AllBlocksCleared:
                self.stats.clears += 1
                self._drop_source(s, (0,))
            else:
                self.stats.rejected_events += 1
        except RouterKeyError as exc:
            self.stats.rejected_events += 1
            _log.debug("source %s: skipped a malformed event: %s", s.name, exc)

    def _apply_tokens_native(self, s: _Source, events: Sequence[Any] | RawBatch,
                             fallback: "_Fallback | None" = None) -> None:
        """Token keying's ingest over the native table: the native core applies every
        event its rules cover (``kvstream._native.apply_tokens``, a subset of the rules
        below, exactly) and stops at the first it does not; that one is applied here and
        the native core goes on from the next. ``events``: decoded events, or a payload
        the native reader decoded (``fallback`` gives its events as Python objects)."""
        if fallback is None and type(events) is not list:
            events = list(events)  # type: ignore[arg-type]
        n = len(events)
        slot = s.slot
        # Masks wider than 64 sources, two block sizes, or another source of two block
        # sizes holding blocks of one router block (the native core's family check reads
        # masks only): the rules below.
        if slot >= 64 or s.multi or 1 in self._mend:
            for ev in (events if fallback is None else fallback.events()):  # type: ignore[union-attr]
                self._apply_event(s, ev)
            return
        st = self.stats
        table = self._table
        assert isinstance(table, NativeMap)
        held = self._held
        per_mask = self._per_mask
        R = self._R
        i = 0
        while i < n:
            i, added, removed, aliased, copied = _apply_tokens(
                events, i, BlockStored, BlockRemoved, table, held, slot, per_mask.get(1, 0) & ~self._multi & _M64, R,  # type: ignore[arg-type]
                _BASE_NS, s.reannounce, s.per == 1, self._copies, self._href, self._unl, self._waiting,
                self._xbs, self._touched)
            if aliased:
                st.family_conflicts += aliased
            if added:
                s.count[0] += added
                st.stored_blocks += added
            if copied:
                st.stored_blocks += copied  # further copies: in the copy records, not the count
            if removed:
                s.count[0] -= removed
                st.removed_blocks += removed
            if i < n:
                self._apply_event(s, events[i] if fallback is None else fallback.event(events, i))  # type: ignore[arg-type, index]
                i += 1
                if self._multi & s.bit:  # it now holds two block sizes: the rest by the rules below
                    rest = events[i:] if fallback is None else fallback.events()[i:]  # type: ignore[index]
                    for ev in rest:
                        self._apply_event(s, ev)
                    return

    def _apply_engine(self, s: _Source, events: Sequence[Any] | RawBatch,
                      fallback: "_Fallback | None" = None) -> None:
        """Engine keying's ingest: the native core applies the common cases
        (``kvstream._native.apply_engine``, exactly the rules below for them) and stops at
        the first event it does not cover; that one goes through the rules below."""
        if fallback is None and type(events) is not list:
            events = list(events)  # type: ignore[arg-type]
        n = len(events)
        if s.slot >= 64:
            self._apply_engine_events(s, events if fallback is None else fallback.events())  # type: ignore[arg-type]
            return
        st = self.stats
        keying = self._keying
        assert isinstance(keying, EngineHashes)
        ints = keying.hash_type is int
        gpu = self._held[0]
        count = s.count
        i = 0
        while i < n:
            i, added, removed = _apply_engine_native(
                events, i, BlockStored, BlockRemoved, gpu, s.slot, self._R, s.reannounce,  # type: ignore[arg-type]
                ints and s.block_size is not None, self._copies, self._touched)
            if added:
                count[0] += added
                st.stored_blocks += added
            if removed:
                count[0] -= removed
                st.removed_blocks += removed
            if i < n:
                one = events[i:i + 1] if fallback is None else [fallback.event(events, i)]  # type: ignore[index, arg-type]
                self._apply_engine_events(s, one)
                i += 1

    def _apply_engine_events(self, s: _Source, events: Sequence[Any]) -> None:
        """Engine keying's rules, event by event: a block's key is its hash, nothing is computed."""
        st = self.stats
        touched = self._touched
        held = self._held
        gpu = held[0]
        copies = self._copies  # never rebound, only mutated
        bit = s.bit
        slot = s.slot
        count = s.count
        keying = self._keying
        assert isinstance(keying, EngineHashes)
        B = self._R
        etype = keying.hash_type
        for ev in events:
            cls = type(ev)
            if cls is BlockRemoved:
                medium = ev.medium
                if medium == "GPU" or medium is None:
                    t, h = 0, gpu
                else:
                    t = self._tier_of.get(medium, -1)
                    if t < 0:
                        st.unknown_removed += len(ev.block_hashes)
                        continue
                    h = held[t]
                g = ev.group_idx
                n = 0
                for eh in ev.block_hashes:
                    m = h.get(eh, 0)
                    # The common case: exactly one copy in group 0 (no copy record).
                    if m & bit and not g and not (copies and (eh, slot, t) in copies):
                        if m == bit:
                            del h[eh]
                        else:
                            h[eh] = m ^ bit
                        n += 1
                    elif self._remove_copy(s, eh, t, g or 0):
                        st.removed_blocks += 1
                    else:
                        st.unknown_removed += 1
                if n:
                    count[t] -= n
                    st.removed_blocks += n
            elif cls is BlockStored:
                hs = ev.block_hashes
                if not hs:
                    continue
                bsz = ev.block_size
                if bsz != B and (bsz or ev.token_ids):
                    # Tier-only events (CPU offload) carry block_size 0 and no tokens.
                    self._foreign(s, "block_size", len(hs),
                                  f"BlockStored with block_size {bsz}, but this index hashes "
                                  f"blocks of {B} tokens; its blocks are ignored")
                    continue
                if bsz and s.block_size is None:
                    s.block_size = bsz
                if type(hs[0]) is not int and any(type(x) is bytes and len(x) > MAX_HASH_BYTES for x in hs):
                    st.rejected_events += 1  # longer than any digest: malformed
                    continue
                if type(hs[0]) is not etype:
                    self._foreign(s, "hash_form", len(hs),
                                  f"block hashes are {type(hs[0]).__name__}, but hash_form={keying.hash_form!r}; "
                                  "no prompt can match them (set hash_form to what the engines send)")
                medium = ev.medium
                if medium == "GPU" or medium is None:
                    t, h = 0, gpu
                else:
                    t = self._store_tier(s, medium)
                    if t < 0:
                        st.rejected_media += len(hs)
                        continue
                    h = held[t]
                g = ev.group_idx or 0
                ra = s.reannounce
                if (ev.parent_block_hash is None and ra and (ra == 1 or ev.session_id is not None)
                        and h.get(hs[0], 0) & bit
                        and self._holds_all(s, hs, t, g)):
                    st.reannounced_blocks += len(hs)
                    if touched is not None:
                        touched.update(hs)  # no copy, but the engine says it holds them now
                    continue
                if touched is not None:
                    touched.update(hs)
                if g:
                    for eh in hs:
                        self._add_copy(s, eh, eh, t, g)
                    continue
                n = 0
                for eh in hs:
                    m = h.get(eh, 0)
                    if m & bit:
                        self._add_copy(s, eh, eh, t, 0)  # another physical copy
                    else:
                        # A lone source's mask is its own bit object (no new int per block).
                        h[eh] = m | bit if m else bit
                        n += 1
                count[t] += n
                st.stored_blocks += n
            elif cls is AllBlocksCleared:
                st.clears += 1
                self._drop_source(s, (0,))
            else:
                st.rejected_events += 1

    def _foreign(self, s: _Source, what: str, n: int, msg: str) -> None:
        st = self.stats
        if what == "block_size":
            st.foreign_block_size += n
        else:
            st.foreign_hash_form += n
        key = (s.name, what)
        if key not in self._warned and len(self._warned) < 1024:
            self._warned.add(key)
            _log.warning(
                "source %s: %s (hasher %r). Engines with another hash configuration need their own "
                "index, or token keying (router keys); counted in stats.foreign_%s, logged once.",
                s.name, msg, self._hasher, what,
            )

    def _stored(self, s: _Source, ev: BlockStored) -> None:
        hashes: Sequence[Any] = ev.block_hashes
        n = len(hashes)
        if n == 0:
            return
        if type(hashes[0]) is not int or type(ev.parent_block_hash) is bytes:
            _check_hash_sizes(hashes, ev.parent_block_hash)
            self._wide = True
        medium = ev.medium
        t = 0 if medium == "GPU" or medium is None else self._store_tier(s, medium)
        if t < 0:
            self.stats.rejected_media += n
            return
        g = ev.group_idx or 0
        toks = ev.token_ids
        if not toks:
            # A tier-only event (CPU offload placeholder): locate known blocks.
            if s.per is not None:
                hashes = self._size_ids(hashes, s.per)
            if self._touched is not None:
                self._touched.update(hashes)  # a store refreshes the TTL, in any tier
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
            if self._touched is not None:
                self._touched.update(hashes)
            for eh in hashes:
                self._add_copy(s, eh, None, t, g, keyable=False)
            return
        per = B // R
        if s.per != per:
            if s.per is not None and not s.multi and any(s.count):
                self._make_multi(s)  # it keeps what it holds of its former block size
            if s.per is not None:
                self._per_mask[s.per] &= ~s.bit
            s.per = per
            s.block_size = B
            self._per_mask[per] = self._per_mask.get(per, 0) | s.bit
        hashes = self._size_ids(hashes, per)
        parent = ev.parent_block_hash
        if parent is not None:
            parent = self._size_id(parent, per)
        extra = ev.extra_keys
        if extra and (len(extra) != n or extra.count(None) != n):  # vLLM sends [None] * n
            salt, extras = event_block_extras(extra, ev.lora_name, n, per, R, parent is None)
        else:
            salt, extras = None, None
        young: Any = self._table
        if parent is None:
            seed = event_namespace(ev.lora_name, ev.lora_id, salt)
            ra = s.reannounce
            if (ra and (ra == 1 or ev.session_id is not None) and hashes[0] in young
                    and self._holds_all(s, hashes, t, g)):
                self.stats.reannounced_blocks += n
                if self._touched is not None:
                    self._touched.update(hashes)  # no copy, but the engine says it holds them now
                return
        else:
            pv = young.get(parent)
            if pv is None:
                self._store_unlinked_run(s, hashes, parent, pack_tokens(toks), per, extras, t, g)
                return
            seed = pv if type(pv) is int else pv[-1]
        if self._touched is not None:
            self._touched.update(hashes)  # a store refreshes the TTL
        raw = pack_tokens(toks)
        keys = chain_keys(raw, n * per, R, seed, extras)
        hl = self._held
        held = hl[t]
        bit = s.bit
        fam = self._per_mask[per] & ~self._multi  # this block size's sources of one size
        mend = self._mend.get(per)  # and the holdings of this size of sources of two
        if t == 0 and len(hl) == 2:
            others = [hl[1]] if hl[1] else []
        else:
            others = [h for i, h in enumerate(hl) if i != t and h]
        unl = self._unl
        waiting = self._waiting
        fast = per == 1 and g == 0 and not s.multi
        added = 0
        step = 4 * R * per
        v: int | tuple[int, ...]  # a block's router key, or its keys when per > 1
        for i in range(n):
            eh = hashes[i]
            k0 = i * per
            v = keys[k0] if per == 1 else tuple(keys[k0 : k0 + per])
            cur = young.get(eh)
            if cur is None:
                m = held.get(keys[k0 + per - 1], 0)
                anym = m
                for h in others:
                    anym |= h.get(keys[k0 + per - 1], 0)
                if anym & fam or (mend and keys[k0 + per - 1] in mend):
                    # Another hash of this block-size family already has this key: mixed
                    # seeds, or extra keys the wire does not carry (0.11 salts). Give this
                    # hash its own, unreachable key so the two are never conflated.
                    self.stats.family_conflicts += 1
                    v = _perturb(v, eh)
                    m = 0
                elif fast and not (unl and eh in unl):
                    young[eh] = v
                    held[v] = m | bit if m else bit
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
        table = self._table
        per = None if s.multi else s.per
        for eh in hashes:
            v = table.get(eh)
            if v is None:
                return False
            if not held.get(v[-1] if type(v) is tuple else v, 0) & bit:
                return False
            if per is not None and (1 if type(v) is int else len(v)) != per:
                return False
            cp = copies.get((eh, s.slot, t)) if copies else None
            if cp is None:
                if g != 0 or s.multi:
                    return False
            elif not cp.get(g):
                return False
        return True

    def _store_unlinked_run(self, s: _Source, hashes: Sequence[Any], parent: Any, raw: bytes, per: int,
                            extras: list[bytes | None] | None, t: int, g: int) -> None:
        """A run whose parent is unknown: keep each block unlinked until its parent links."""
        step = 4 * self._R * per
        if self._touched is not None:
            self._touched.update(hashes)  # a store refreshes the TTL, whatever its parent
        for i, eh in enumerate(hashes):
            if eh in self._table:
                # Known already (another source linked it): the rest of the run chains from it.
                self._add_copy(s, eh, None, t, g)
            else:
                u = self._unl.get(eh)
                if u is None or u.raw is None:
                    ex = extras[i * per : (i + 1) * per] if extras is not None else None
                    if u is None:
                        u = _Unlinked(parent, raw[i * step : (i + 1) * step], ex, per, self._gen)
                        self._unl_put(eh, u)
                        self.stats.unlinked_blocks += 1
                    else:
                        self._unl_set(u, parent, raw[i * step : (i + 1) * step], ex, per)
                    self._waiting.setdefault(parent, []).append(eh)
                u.gen = self._gen  # a store refreshes the TTL, linked or not
                self._hold_unlinked(s, u, t, g)
                if parent in self._table:
                    self._link(parent)
            parent = eh

    def _size_ids(self, hashes: Sequence[Any], per: int, create: bool = True) -> Sequence[Any]:
        """``hashes`` (engine hashes of a source whose engine blocks are ``per`` router
        blocks) as this index holds them: :meth:`_size_id` of each; ``hashes`` itself (no
        copy) when none is another block size's. ``create=False`` (removals, queries): only
        the ids already made (a hash this size never stored is looked up as sent, as a
        source that changed its block size without a clear still removes its old blocks)."""
        xbs = self._xbs
        if not create:
            if not xbs:
                return hashes
            got: list[Any] | None = None
            for i, eh in enumerate(hashes):
                a = xbs.get(eh)
                if a is not None and per in a:
                    if got is None:
                        got = list(hashes)
                    got[i] = a[per]
            return hashes if got is None else got
        if not xbs and len(self._per_mask) < 2:
            return hashes  # one block size has ever stored here: nothing to tell apart
        if len(self._xrev) >= self._xsweep:
            self._sweep_sizes()
        table = self._table
        unl = self._unl
        out: list[Any] | None = None
        for i, eh in enumerate(hashes):
            if not xbs or eh not in xbs:
                cur = table.get(eh)
                if cur is None:
                    if not unl:
                        continue
                    u = unl.get(eh)
                    if u is None or not u.per or u.per == per:
                        continue
                elif (type(cur) is int) if per == 1 else (type(cur) is not int and len(cur) == per):
                    continue
            x = self._size_id(eh, per)
            if x is not eh:
                if out is None:
                    out = list(hashes)
                out[i] = x
        return hashes if out is None else out

    def _size_id(self, eh: Any, per: int) -> Any:
        """The id under which this index holds engine hash ``eh`` of a source whose engine
        blocks are ``per`` router blocks: ``eh`` itself, unless a source of another block
        size holds ``eh`` (its table entry has keys of another shape, or it is unlinked
        with another block size), or held it when this size's copy was first stored; then
        an id of its own for this size (remembered, and counted)."""
        if not self._xbs and len(self._per_mask) < 2:
            return eh
        a = self._xbs.get(eh)
        if a is not None:
            x = a.get(per)
            if x is not None:
                return x
        cur = self._table.get(eh)
        if cur is None:
            u = self._unl.get(eh)
            if u is None or not u.per or u.per == per:
                return eh
        elif (type(cur) is int) if per == 1 else (type(cur) is not int and len(cur) == per):
            return eh
        x = _size_alias(eh, per)
        if a is None:
            self._xbs[eh] = {per: x}
        else:
            a[per] = x
        self._xrev[x] = (eh, per)
        self.stats.size_conflicts += 1
        return x

    def _sweep_sizes(self) -> None:
        """Forget the block-size ids nothing holds or waits for any more (the maps stay
        within twice what is in use)."""
        table = self._table
        unl = self._unl
        waiting = self._waiting
        for x, (eh, per) in list(self._xrev.items()):
            if x in table or x in unl or x in waiting:
                continue
            del self._xrev[x]
            a = self._xbs[eh]
            del a[per]
            if not a:
                del self._xbs[eh]
        self._xsweep = max(_SWEEP_MIN, 2 * len(self._xrev))

    def _unl_put(self, eh: Any, u: _Unlinked) -> None:
        self._unl[eh] = u
        u.cost = u.payload() + _BYTES_PER_HOLDER * max(0, len(u.holds) - 1)
        self._unl_bytes += u.cost

    def _unl_set(self, u: _Unlinked, parent: Any, raw: bytes | None, extras: Any, per: int) -> None:
        self._unl_bytes -= u.cost
        u.parent, u.raw, u.extras, u.per = parent, raw, extras, per
        u.cost = u.payload() + _BYTES_PER_HOLDER * max(0, len(u.holds) - 1)
        self._unl_bytes += u.cost

    def _unl_unhold(self, u: _Unlinked, key: tuple[int, int]) -> bool:
        """Drop holding ``key`` of ``u``; True if it was there."""
        if u.holds.pop(key, None) is None:
            return False
        if u.holds:
            u.cost -= _BYTES_PER_HOLDER
            self._unl_bytes -= _BYTES_PER_HOLDER
        return True

    def _hold_unlinked(self, s: _Source, u: _Unlinked, t: int, g: int) -> None:
        key = (s.slot, t)
        h = u.holds.get(key)
        if h is None:
            u.holds[key] = {g: 1}
            if len(u.holds) > 1:
                u.cost += _BYTES_PER_HOLDER
                self._unl_bytes += _BYTES_PER_HOLDER
            s.count[t] += 1
            self.stats.stored_blocks += 1
            return
        h[g] = h.get(g, 0) + 1
        self.stats.stored_blocks += 1

    def _add_copy(self, s: _Source, eh: Any, v: Any, t: int, g: int, keyable: bool = True) -> None:
        """Add one physical copy of ``eh`` in (source, tier, group). ``v``: its key(s) if
        computed from tokens, None if the event carried no (usable) tokens."""
        young = self._table
        cur = young.get(eh)
        if cur is None:
            u = self._unl.get(eh)
            if v is None or not keyable:
                if u is None:
                    u = _Unlinked(None, None, None, 0, self._gen)
                    self._unl_put(eh, u)
                    self.stats.unlinked_blocks += 1
                u.gen = self._gen  # a store refreshes the TTL, linked or not
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

    def _hold(self, s: _Source, eh: Any, v: Any, t: int, g: int, fresh: bool, new: bool = False) -> None:
        """One more copy of ``eh`` (key(s) ``v``) for (``s``, tier ``t``, group ``g``).
        ``new``: the caller knows ``s`` does not hold ``eh`` in ``t`` yet (a snapshot's
        row), though its key's mask may have ``s``'s bit from another hash of ``s`` under
        the same last key (an engine block of two router blocks over two of one)."""
        held = self._held[t]
        bit = s.bit
        if s.multi:
            self._hold_multi(s, eh, v, t, g, fresh)
            return
        tup = type(v) is tuple
        rk0 = v[-1] if tup else v
        m = held.get(rk0, 0)
        self.stats.stored_blocks += 1
        had = bool(m & bit) and not new
        if (had or g) and not self._add_copy_record((eh, s.slot, t), g, had):
            return
        if tup:
            self._sub_add(held, v, s.slot, t, bit)
        else:
            held[rk0] = m | bit if m else bit
        s.count[t] += 1
        if not fresh and not self._by_engine:
            self._href[eh] = self._href.get(eh, 1) + 1

    def _hold_multi(self, s: _Source, eh: Any, v: Any, t: int, g: int, fresh: bool) -> None:
        """:meth:`_hold` for a source of two block sizes: its copy record says whether it
        holds ``eh`` already; a new holding counts every key it covers."""
        self.stats.stored_blocks += 1
        key = (eh, s.slot, t)
        cp = self._copies.get(key)
        if cp is not None:
            cp[g] = cp.get(g, 0) + 1
            return
        self._copies[key] = {g: 1}
        self._cover(self._held[t], v if type(v) is tuple else (v,), s.slot, t, s.bit)
        s.count[t] += 1
        if not fresh and not self._by_engine:
            self._href[eh] = self._href.get(eh, 1) + 1

    def _cover(self, held: Any, rks: Sequence[int], slot: int, t: int, bit: int) -> None:
        """One more holding of a source of two block sizes covers each of ``rks``."""
        sub = self._sub_n
        for rk in rks:
            k = (rk, slot, t)
            sub[k] = sub.get(k, 0) + 1
            held[rk] = held.get(rk, 0) | bit
        self._mend_add(rks)

    def _mend_add(self, rks: Sequence[int]) -> None:
        ends = self._mend.setdefault(len(rks), {})
        ends[rks[-1]] = ends.get(rks[-1], 0) + 1

    def _make_multi(self, s: _Source) -> None:
        """``s`` starts storing a second block size while it holds blocks of its first:
        from now on every holding of ``s`` is a copy record and every key it covers is
        counted, since its keys' mask bits no longer tell which hash it holds (the router
        keys of one prompt are the same whatever the engine block size)."""
        slot = s.slot
        found = self._single_holdings(s, range(len(self._media)))
        sub = self._sub_n
        for k in [k for k in sub if k[1] == slot]:
            del sub[k]
        copies = self._copies
        taken: set[tuple[int, Any]] = set()
        for eh, rks, t in found:
            if (t, rks[-1]) in taken:
                copies.pop((eh, slot, t), None)  # its key went with another hash
                continue
            taken.add((t, rks[-1]))
            copies.setdefault((eh, slot, t), {0: 1})
            for rk in rks:
                k = (rk, slot, t)
                sub[k] = sub.get(k, 0) + 1
            self._mend_add(rks)
        s.multi = True
        self._multi |= s.bit
        self.stats.multi_size_sources += 1
        self._roster_reset()

    def _roster_reset(self) -> None:
        try:
            del self._roster
        except AttributeError:
            pass

    def _single_holdings(self, s: _Source, tiers: Iterable[int]) -> list[tuple[Any, tuple[Any, ...], int]]:
        """The (hash, keys, tier) holdings of a source of one block size, read from the
        masks: the hashes of its block size whose last key has its bit, in a canonical
        order when several share a key (copy-recorded ones first: hashes the source
        stored itself, then by hash), so which one a caller takes never depends on the
        table's iteration order. Hashes only sources of two block sizes hold are not
        candidates (their bits on a shared key are theirs)."""
        tiers = tuple(t for t in tiers if s.count[t])
        if not tiers:
            return []
        bit = s.bit
        slot = s.slot
        per = s.per
        held = self._held
        copies = self._copies
        cands: list[tuple[Any, tuple[Any, ...], int]] = []
        last: set[tuple[int, Any]] = set()
        for eh, v in self._table.items():
            rks = v if type(v) is tuple else (v,)
            if per is not None and len(rks) != per:
                continue  # another block-size family's hash for the same key
            for t in tiers:
                if held[t].get(rks[-1], 0) & bit:
                    cands.append((eh, rks, t))
                    last.add((t, rks[-1]))
        if self._multi and cands:
            cands = [c for c in cands if self._held_by_one_size(c[0])]
        if len(last) != len(cands):
            cands.sort(key=lambda c: (c[2], (c[0], slot, c[2]) not in copies, *_hash_sort_key(c[0])))
        return cands

    def _held_by_one_size(self, eh: Any) -> bool:
        """Some source of one block size holds ``eh``: its holdings outnumber the copy
        records sources of two block sizes have of it."""
        n = self._href.get(eh, 1)
        copies = self._copies
        tiers = range(len(self._media))
        for slot in _bits(self._multi):
            for t in tiers:
                if (eh, slot, t) in copies:
                    n -= 1
        return n > 0

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
        rks = v if type(v) is tuple else (v,)
        for (slot, t), groups in holds.items():
            s = self._src[slot]
            if s is None:
                continue
            held = self._held[t]
            if s.multi:
                self._copies[(eh, slot, t)] = dict(groups)
                self._cover(held, rks, slot, t, s.bit)
                n += 1
                continue
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
            pv = self._table.get(p)
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
                mend = self._mend.get(u.per)
                if anym & self._per_mask.get(u.per, 0) & ~self._multi or (mend and keys[-1] in mend):
                    self.stats.family_conflicts += 1
                    v = _perturb(v, c)
                del self._unl[c]
                self._unl_bytes -= u.cost
                if c in self._table:
                    continue
                self._table[c] = v
                if not self._install(c, v, u.holds):
                    del self._table[c]
                elif self._touched is not None and u.gen == self._gen:
                    self._touched.add(c)  # stored in this generation while unlinked: keep its TTL
                self.stats.linked_blocks += 1
                stack.append(c)

    def _unlink_drop(self, eh: Any, u: _Unlinked) -> None:
        del self._unl[eh]
        self._unl_bytes -= u.cost
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
        t = self._tier_of.get(ev.medium or "GPU", -1)
        if t < 0:
            self.stats.unknown_removed += len(ev.block_hashes)
            return
        g = ev.group_idx or 0
        young = self._table
        held = self._held[t]
        bit = s.bit
        href = self._href
        copies = self._copies
        slot = s.slot
        removed = 0
        hashes: Sequence[Any] = ev.block_hashes
        if s.per is not None:
            hashes = self._size_ids(hashes, s.per, create=False)
        # A key's bit says which hash a source holds only for hashes of its own block
        # size (another size's hash may end on a key it holds), and not at all for a
        # source of two block sizes.
        fast = not s.multi and (s.per is None or s.per == 1)
        for eh in hashes:
            rk = young.get(eh)
            if fast and type(rk) is int and g == 0 and not (copies and (eh, slot, t) in copies):
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
        if not fast and s.multi and not any(s.count):
            self._one_size_again(s)

    def _remove_copy(self, s: _Source, eh: Any, t: int, g: int) -> bool:
        v = self._table.get(eh)
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
                    self._unl_unhold(u, key)
                    s.count[t] -= 1
                    if not u.holds:
                        self._unlink_drop(eh, u)
            return True
        held = self._held[t]
        bit = s.bit
        rks = v if type(v) is tuple else (v,)
        if not held.get(rks[-1], 0) & bit:
            return False
        if s.multi:
            if (eh, s.slot, t) not in self._copies:
                return False
        elif s.per is not None and len(rks) != s.per:
            return False  # another block size's hash: the bit is for one of its own
        left = self._take_copy((eh, s.slot, t), g, s.multi)
        if left != 2:
            return left == 1
        self._release(s, eh, rks, t)
        return True

    def _release(self, s: _Source, eh: Any, rks: Sequence[Any], t: int) -> None:
        """Drop the (source, tier) holding of ``eh`` (all its copies are gone)."""
        held = self._held[t]
        nb = ~s.bit
        sub = self._sub_n
        lead = len(rks) if s.multi else len(rks) - 1  # keys counted in ``_sub_n``
        if s.multi:
            ends = self._mend.get(len(rks))
            if ends is not None:
                c = ends.get(rks[-1], 1) - 1
                if c > 0:
                    ends[rks[-1]] = c
                else:
                    ends.pop(rks[-1], None)
                    if not ends:
                        del self._mend[len(rks)]
        for j, rk in enumerate(rks):
            if j < lead:
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
        if self._by_engine:
            return  # no block table
        n = self._href.pop(eh, 1) - 1
        if n <= 0:
            self._table.pop(eh, None)
        elif n > 1:
            self._href[eh] = n

    def _drop_source(self, s: _Source, tiers: Iterable[int]) -> None:
        """Drop every holding of ``s`` in ``tiers``. O(index size): only on clears/restarts."""
        tiers = tuple(t for t in tiers if s.count[t])
        bit = s.bit
        slot = s.slot
        table = self._table
        held = self._held
        copies = self._copies
        if tiers and s.multi:
            # Two block sizes: its copy records are its holdings.
            mine = [(eh, t) for (eh, sl, t) in copies if sl == slot and t in tiers]
            for eh, t in mine:
                del copies[(eh, slot, t)]
                v = table.get(eh)
                if v is not None:
                    self._release(s, eh, v if type(v) is tuple else (v,), t)
        elif tiers:
            # Several hashes may sit under one held key (the mask is per key): when two
            # candidates share a key the first in the canonical order is released, and
            # every copy record of the source under a dropped key goes.
            for eh, rks, t in self._single_holdings(s, tiers):
                if copies:
                    copies.pop((eh, slot, t), None)  # also when its key went with another hash
                if held[t].get(rks[-1], 0) & bit:
                    self._release(s, eh, rks, t)
        if s.multi and not any(s.count[t] for t in range(len(self._media)) if t not in tiers):
            self._one_size_again(s)
        for eh, u in list(self._unl.items()):
            for t in tiers:
                if self._unl_unhold(u, (slot, t)):
                    s.count[t] -= 1
            if not u.holds:
                self._unlink_drop(eh, u)
        if self._spec_n:
            self._drop_spec(lambda sl, rk: sl == slot)

    def _one_size_again(self, s: _Source) -> None:
        """``s`` of two block sizes holds nothing now (but unlinked blocks its caller is
        dropping): the masks tell its holdings again."""
        slot = s.slot
        sub = self._sub_n
        for k in [k for k in sub if k[1] == slot]:
            del sub[k]  # none should be left: all its holdings were released
        s.multi = False
        self._multi &= ~s.bit
        self._roster_reset()

    # -- TTL and memory bound ----------------------------------------------------------

    def _tick(self, now: float) -> None:
        if not self._generation_ended(now):
            return
        # Rotate: blocks not stored during the generation that ends expire.
        touched = self._touched
        assert touched is not None
        table = self._table
        expired = [eh for eh in table if eh not in touched]
        for eh in expired:
            self._forget(eh)
        self.stats.expired_blocks += len(expired)
        for eh, u in list(self._unl.items()):
            if u.gen < self._gen:
                self._forget_unlinked(eh, u)
                self.stats.expired_blocks += 1
        self._touched = set()
        self._gen += 1
        self._gen_start = now

    def native_bytes(self) -> int:
        """Bytes the native tables allocate (columns and indexes, counted in Rust; invisible
        to ``tracemalloc``), included in :meth:`estimated_bytes`."""
        n = sum(h.native_bytes() for h in self._held)
        table = self._table
        if isinstance(table, NativeMap):
            n += table.native_bytes()
        return n

    @property
    def table(self) -> BlockTable:
        """The block table (engine hash -> router key) this index stores into; under engine
        keying, a read-only view of the held blocks."""
        return self._table

    def estimated_bytes(self) -> int:
        """Heap bytes held by the index (an upper bound): the native tables (the block
        table and every medium's ``key -> mask`` map) as they really allocate, counted in
        Rust (:meth:`native_bytes`), their side dicts (bytes hashes, tuples of keys, masks
        of more than 64 sources) at measured sizes, and every Python table as allocated
        (``sys.getsizeof``, so a table that grew and emptied still counts) plus the objects
        its entries own: copy records, unlinked blocks with their tokens, the TTL's set of
        stored hashes. A generic :class:`~kvstream.routing.table.BlockTable` counts itself
        (``nbytes``). Costs O(sources x media); ``max_bytes`` calls it once per batch."""
        gs = sys.getsizeof
        table = self._table
        b = table.nbytes()
        for h in self._held:
            b += h.nbytes()
        max_per = 1
        multi = 0  # holdings of engine blocks of several router blocks
        for s in self._src:
            if s is not None:
                per = s.per or 1
                if per > max_per:
                    max_per = per
                if per > 1:
                    multi += sum(s.count)
        if max_per > 1:  # tuples of router keys (in the table's side dict), their key ints
            b += min(multi, len(table)) * (40 + 40 * max_per)
        if self._wide and not self._by_engine and type(table) is not NativeMap:
            b += 61 * len(table)  # a bytes hash of up to 64 bytes (97) instead of an int (36)
        b += gs(self._href) + 32 * len(self._href)
        b += gs(self._copies) + _BYTES_PER_COPY_RECORD * len(self._copies)
        b += gs(self._sub_n) + 96 * len(self._sub_n)
        b += sum(gs(d) + 64 * len(d) for d in self._mend.values())
        b += gs(self._unl) + self._unl_bytes
        b += gs(self._waiting) + 88 * len(self._waiting)
        if self._xrev:
            b += gs(self._xbs) + gs(self._xrev) + 400 * len(self._xrev)
        b += gs(self._spec) + gs(self._spec_n) + 96 * len(self._spec_n)
        if self._touched is not None:
            b += gs(self._touched) + 36 * len(self._touched)
        b += _BYTES_PER_SOURCE * len(self._src) + gs(self._warned) + 160 * len(self._warned)
        return b

    def _evict(self, target: int) -> None:
        """Drop entries until :meth:`estimated_bytes` <= ``target`` (order: see class doc),
        then shrink the tables to what is left (tables do not shrink by themselves)."""
        table = self._table
        while True:
            over = self.estimated_bytes() - target
            if over <= 0:
                return
            k = max(64, min(1 << 16, over // 64 + 1))
            dropped = 0
            for eh in list(islice(self._unl, k)):
                u = self._unl.get(eh)
                if u is not None:
                    self._forget_unlinked(eh, u)
                    dropped += 1
            touched = self._touched
            if dropped < k and touched:
                for eh in list(islice((x for x in table if x not in touched), k - dropped)):
                    if eh in table:
                        self._forget(eh)
                        dropped += 1
            if dropped < k:
                for eh in list(islice(table, k - dropped)):
                    if eh in table:
                        self._forget(eh)
                        dropped += 1
            self.stats.evicted_blocks += dropped
            self._shrink()
            if not dropped:
                return  # nothing left to drop: the rest is the empty index's own size

    def _shrink(self) -> None:
        self._table.shrink()
        for h in self._held:
            h.shrink()
        for name in ("_href", "_copies", "_sub_n", "_unl", "_waiting"):
            d = getattr(self, name)
            if gs_dict(d) > 2 * _dict_floor(len(d)):
                setattr(self, name, dict(d))

    def _forget_unlinked(self, eh: Any, u: _Unlinked) -> None:
        for (slot, t) in u.holds:
            s = self._src[slot]
            if s is not None:
                s.count[t] -= 1
        # Its own children keep waiting for it (``_waiting[eh]``): they link when it is
        # stored again, as children of a parent never seen do.
        self._unlink_drop(eh, u)

    def _forget(self, eh: Any) -> None:
        """Drop ``eh`` from every source and tier."""
        table = self._table
        v = table.get(eh)
        if v is not None:
            rks = v if type(v) is tuple else (v,)
            copies = self._copies
            multi = self._multi
            for t, held in enumerate(self._held):
                m = held.get(rks[-1], 0)
                if m & multi:  # sources of two block sizes: their records say
                    for slot in _bits(m & multi):
                        if copies.pop((eh, slot, t), None) is not None:
                            self._release(self._src[slot], eh, rks, t)  # type: ignore[arg-type]
                    if eh not in table:
                        break
                    m &= ~multi
                    if m and not self._held_by_one_size(eh):
                        continue
                for slot in _bits(m):
                    s = self._src[slot]
                    if s is None or (s.per is not None and s.per != len(rks)):
                        continue
                    copies.pop((eh, slot, t), None)
                    self._release(s, eh, rks, t)
                    if eh not in table:
                        break
                if eh not in table:
                    break
            if not self._by_engine:
                table.pop(eh, None)
        self._href.pop(eh, None)
        if self._touched:
            self._touched.discard(eh)

    def keys(
        self,
        prompt_tokens: Sequence[int],
        lora: Any = None,
        salt: str | None = None,
        mm_items: Sequence[Any] | None = None,
    ) -> list[Any]:
        """A prompt's keys, one per full scoring block: router keys under token keying
        (:mod:`kvstream.routing.keys`; ``lora`` a name or int id), the engines' external
        hashes under engine keying (``lora`` a :class:`kvstream.hashing.LoRA`, ``mm_items``
        ``MMItem`` s or ``(identifier, offset, length)`` triples)."""
        return self._keying.prompt_keys(prompt_tokens, lora, salt, mm_items)

    # -- engine-hash matching ----------------------------------------------------------

    def engine_hashes(
        self,
        prompt_tokens: Sequence[int],
        lora: Any = None,
        salt: str | None = None,
        mm_items: Sequence[Any] | None = None,
    ) -> list[Any]:
        """The engines' own external block hashes of a prompt, computed with the ``hasher``
        given at construction (same algorithm, seed and block size as the engines).
        ``lora``: a :class:`kvstream.hashing.LoRA`."""
        if self._by_engine:
            return self.keys(prompt_tokens, lora, salt, mm_items)
        if self._hasher is None:
            raise IndexUsageError(
                "engine_hashes() needs KVIndex(hasher=BlockHasher(algorithm, block_size, seed=...)) "
                "configured like the engines"
            )
        return EngineHashes(self._hasher).prompt_keys(prompt_tokens, lora, salt, mm_items)

    def match_engine_hashes(self, hashes: Sequence[Any]) -> dict[str, int]:
        """Per source, the longest prefix of ``hashes`` (engine block hashes of one prompt,
        in order) it holds in any medium, in *engine* blocks (stale sources: 0). Works for
        unlinked blocks too (no tokens or parents needed), so it is exact right after a
        restart of the router; only sources whose engines hash like ``hashes`` can match."""
        active = self._live
        res: dict[int, int] = {}
        table = self._table
        h = self._hasher
        if h is not None and not self._by_engine and h.block_size % self._R == 0:
            hashes = self._size_ids(hashes, h.block_size // self._R, create=False)
        for i, eh in enumerate(hashes):
            v = table.get(eh)
            m = 0
            if v is not None:
                rks = v if type(v) is tuple else (v,)
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
        for slot in _bits(active):
            res[slot] = len(hashes)
        return {s.name: res.get(s.slot, 0) for s in self._src if s is not None}

    # -- canonical state ---------------------------------------------------------------

    def _rows(self) -> dict[int, list[tuple[str, int, Any, int]]]:
        per_src: dict[int, list[tuple[str, int, Any, int]]] = {
            s.slot: [] for s in self._src if s is not None
        }
        media = self._media
        copies = self._copies
        multi = self._multi
        for eh, v in self._table.items():
            rks = v if type(v) is tuple else (v,)
            one = not multi or self._held_by_one_size(eh)
            for t, held in enumerate(self._held):
                m = held.get(rks[-1], 0) & ~multi
                if not m or not one:
                    continue
                for slot in _bits(m):
                    s = self._src[slot]
                    if s is None or (s.per is not None and s.per != len(rks)):
                        continue
                    cp = copies.get((eh, slot, t)) if copies else None
                    for g, c in (cp.items() if cp is not None else ((0, 1),)):
                        per_src[slot].append((media[t], g, eh, c))
        if multi:
            for (eh, slot, t), cp in copies.items():
                if multi >> slot & 1:
                    for g, c in cp.items():
                        per_src[slot].append((media[t], g, eh, c))
        for eh, u in self._unl.items():
            for (slot, t), groups in u.holds.items():
                for g, c in groups.items():
                    per_src[slot].append((media[t], g, eh, c))
        return per_src

    def state(self) -> dict[str, Any]:
        """Everything the index holds, in a canonical form comparable with ``==``.

        ``{"router_block_size": R, "sources": {name: {"stale": bool, "blocks": ((medium,
        group, engine_hash, copies), ...) sorted}}, "unlinked": (engine hashes sorted)}``
        (nothing is ever unlinked under engine keying). Speculative entries and counters
        are not part of the state.
        """
        per_src = self._rows()
        unlinked: Iterable[Any] = self._unl
        if self._xrev:  # a block size's own copy of a hash, under the hash the engine sent
            raw = self._xrev
            for rows in per_src.values():
                rows[:] = [(md, g, raw[eh][0], c) if eh in raw else (md, g, eh, c) for md, g, eh, c in rows]
            unlinked = [raw[eh][0] if eh in raw else eh for eh in self._unl]
        return {
            "router_block_size": self._R,
            "sources": {
                s.name: {"stale": s.stale, "blocks": tuple(sorted(per_src[s.slot], key=_sort_key))}
                for s in self._src
                if s is not None
            },
            "unlinked": tuple(sorted(unlinked, key=_hash_sort_key)),
        }

    # -- snapshots (format: kvstream.routing.snapshot) ---------------------------------

    def dump(self, source: str | None = None, *, cursors: Mapping[str, Any] | None = None) -> bytes:
        """The index (or one ``source`` of it) as snapshot bytes, for a router replica or a
        stream snapshot (format: :mod:`kvstream.routing.snapshot`, ``docs/router.md``).
        Bulk: about 0.2 s for 10**6 blocks (``bench/bench_index.py``).

        Args:
            source: dump only this source (its residency and the keys of the blocks it
                holds); None dumps every source.
            cursors: per source name, an opaque msgpack-able value stored with it (e.g. the
                seq of the last batch applied), given back by :meth:`load_source` and
                :func:`~kvstream.routing.snapshot.read_snapshot`.

        Counters, speculative entries and TTL ages are not dumped."""
        if source is not None:
            one = self._known(source)
            srcs = [one]
            keep: int | None = one.bit
        else:
            srcs = [s for s in self._src if s is not None]
            keep = None
        words = max(1, (len(self._src) + 63) // 64)
        table = self._table
        engine = self._by_engine
        if engine:
            cols_h: Any = None
            cols_k: Any = None
            others: list[tuple[Any, Any]] = []
        else:
            cols_h, cols_k, other = table.export_u64()
            others = list(other.items())
        # Sources of two block sizes are dumped from their records (rows below), not masks.
        multi = self._multi
        allow = {per: self._family_bits(per) & ~multi
                 for per in {1, *(len(v) for _, v in others if type(v) is tuple)}}
        everyone = self._all_bits()
        # Hashes only sources of two block sizes hold: a mask bit on their key is another
        # hash's.
        theirs = {eh for (eh, slot, _t) in self._copies
                  if multi >> slot & 1 and not self._held_by_one_size(eh)} if multi else set()
        tiers = []
        rows = []
        for t, held in enumerate(self._held):
            if not held:
                continue
            medium = self._media[t]
            if engine:
                hs_all = list(held)
                try:
                    cols_h = array("Q", hs_all)
                    ms = list(held.values())
                    others = []
                except (OverflowError, TypeError):
                    u64 = [sn.is_u64(h) for h in hs_all]
                    cols_h = array("Q", compress(hs_all, u64))
                    ms = list(compress(held.values(), u64))
                    others = [(h, h) for h, ok in zip(hs_all, u64) if not ok]
                cols_k = array("Q")
            else:
                ms = held.get_many(cols_k)  # None where not held in this medium
                a1 = allow[1]
                if a1 != everyone:
                    ms = [m & a1 if m else 0 for m in ms]
                if theirs:
                    ms = [0 if m and h in theirs else m for h, m in zip(cols_h, ms)]
            if keep is not None:
                ms = [m & keep if m else 0 for m in ms]
            hs_t = array("Q", compress(cols_h, ms))
            ks_t = array("Q", compress(cols_k, ms)) if not engine else array("Q")
            ms_t = list(compress(ms, ms))
            if len(hs_t):
                tiers.append(sn._Tier(medium, sn.pack_u64(hs_t), sn.pack_u64(ks_t), sn.pack_masks(ms_t, words)))
            for eh, v in others:
                rks = v if type(v) is tuple else (v,)
                m = held.get(rks[-1], 0) & allow.get(len(rks), everyone & ~multi)
                if keep is not None:
                    m &= keep
                if m and eh not in theirs:
                    rows.append(sn._Row(medium, eh, None if engine else list(rks), sn.mask_bytes(m)))
        for (eh, slot, t), _groups in self._copies.items() if multi else ():
            if multi >> slot & 1 and (keep is None or keep >> slot & 1):
                v = table.get(eh)
                if v is not None:
                    rows.append(sn._Row(self._media[t], eh, list(v) if type(v) is tuple else [v],
                                        sn.mask_bytes(1 << slot)))
        copies = [
            sn._Copies(slot, self._media[t], eh, sorted(groups.items()))
            for (eh, slot, t), groups in self._copies.items()
            if keep is None or keep >> slot & 1
        ]
        unlinked = []
        for eh, u in self._unl.items():
            holds = [(slot, self._media[t], g, c) for (slot, t), groups in u.holds.items()
                     if keep is None or keep >> slot & 1 for g, c in groups.items()]
            if holds:
                unlinked.append(sn._Unlinked(eh, u.parent, u.raw, u.extras, u.per, holds))
        sources = [
            sn._Source(s.name, s.stale, sn.cursor_of(cursors, s.name), s.block_size, s.per,
                       REANNOUNCE_RULES[s.reannounce], s.slot, s.multi)
            for s in srcs
        ]
        sizes = [sn._SizeId(eh, per, x) for x, (eh, per) in self._xrev.items()
                 if x in table or x in self._unl or x in self._waiting]
        return sn.encode(sn._Snapshot(
            sn.MAGIC, sn.FORMAT_VERSION, self._keying.name, self._R, self._options(), self._hasher_spec(),
            sources, tiers, rows, copies, unlinked, sizes,
        ))

    def _family_bits(self, per: int) -> int:
        """Sources whose engine blocks are ``per`` router blocks (or not known yet)."""
        out = 0
        for s in self._src:
            if s is not None and (s.per is None or s.per == per):
                out |= s.bit
        return out

    def _all_bits(self) -> int:
        out = 0
        for s in self._src:
            if s is not None:
                out |= s.bit
        return out

    @classmethod
    def load(cls, data: bytes, **options: Any) -> Any:
        """A new index holding what snapshot ``data`` (from :meth:`dump`) holds, configured
        as the dumping index was; ``options`` override constructor arguments (e.g.
        ``max_bytes``). Bulk: about 0.5 s for 10**6 blocks. Raises
        :class:`~kvstream.routing.snapshot.SnapshotError` for bad bytes, or a snapshot
        this class cannot hold (an engine-keyed one loaded as a token-keyed
        ``EngineKeyIndex``...)."""
        snap = sn.decode(data)
        idx = cls._from_snapshot(snap, options)
        idx._load(snap)
        return idx

    def load_source(self, data: bytes) -> dict[str, Any]:
        """Replace the state of every source in snapshot ``data`` (from :meth:`dump`, of
        one source or all) with the snapshot's; other sources are untouched. Returns
        ``{source: cursor}`` of the sources loaded. Raises
        :class:`~kvstream.routing.snapshot.SnapshotError` (index unchanged) for bad bytes or
        a snapshot of another keying or block size."""
        snap = sn.decode(data)
        self._load(snap)
        return {s.name: s.cursor for s in snap.sources}

    def _options(self) -> Any:
        return sn._Options(self._max_bytes, self._ttl, REANNOUNCE_RULES[self._reannounce])

    def _hasher_spec(self) -> Any:
        h = self._hasher
        if h is None:
            return None
        form = self._keying.hash_form if isinstance(self._keying, EngineHashes) else "int"
        return sn._Hasher(h.algorithm, h.block_size, h.extra_key_style, h.root, form)

    @classmethod
    def _from_snapshot(cls, snap: Any, options: dict[str, Any]) -> "KVIndex":
        o = snap.options
        kw: dict[str, Any] = {"max_bytes": o.max_bytes, "ttl_s": o.ttl_s, "reannounce": o.reannounce}
        hasher = options.pop("hasher", None)
        form = "int"
        try:
            if snap.hasher is not None and hasher is None:
                from kvstream.hashing import BlockHasher

                h = snap.hasher
                hasher = BlockHasher(h.algorithm, h.block_size, extra_key_style=h.extra_key_style, root=h.root)
                form = h.hash_form
            if snap.keying == "engine":
                if hasher is None:
                    raise sn.SnapshotError(
                        "snapshot of an engine-keyed index without its hasher (a damaged snapshot)")
                keying: Any = EngineHashes(hasher, form)
            else:
                keying = TokenKeys(snap.router_block_size)
            kw.update(options)
            return cls._configured(keying, hasher, kw)
        except (IndexUsageError, ValueError) as exc:
            if isinstance(exc, sn.SnapshotError):
                raise
            raise sn.SnapshotError(f"snapshot configuration cannot build an index: {exc}") from None

    @classmethod
    def _configured(cls, keying: Any, hasher: Any, kw: dict[str, Any]) -> "KVIndex":
        return cls(keying=keying, hasher=hasher, **kw)

    def _load(self, snap: Any) -> None:
        if snap.keying != self._keying.name or snap.router_block_size != self._R:
            raise sn.SnapshotError(
                f"snapshot of a {snap.keying!r}-keyed index with {snap.router_block_size}-token blocks; "
                f"this index is {self._keying.name!r}-keyed with {self._R}-token blocks "
                "(load it into an index of the same keying and block size)"
            )
        media = {td.medium for td in snap.tiers} | {r.medium for r in snap.rows} | {
            h[1] for u in snap.unlinked for h in u.holds}
        if len(media | set(self._media)) > self.MAX_MEDIA or len(media) > self.MAX_MEDIA_PER_SOURCE + 2:
            raise sn.SnapshotError(
                f"snapshot holds blocks in {len(media)} media; an index tracks at most {self.MAX_MEDIA} "
                f"({self.MAX_MEDIA_PER_SOURCE} per source)")
        p = sn.prepare(snap, tokens=not self._by_engine, router_block_size=self._R)  # validates: raises before any change
        if len(self._table) or self._unl:
            # Not the bulk path (which finds a listed-twice hash for free, holding nothing).
            for medium, hs, _ks, _m in p.tiers:
                if len(set(hs)) != len(hs):
                    raise sn.SnapshotError(f"snapshot medium {medium!r}: a hash is listed twice (a damaged snapshot)")
        saved = copy.copy(self.stats)
        try:
            self._load_prepared(snap, p)
        finally:
            self.stats = saved  # loading is not ingest
        if self._max_bytes is not None and self.estimated_bytes() > self._max_bytes:
            # The native tables' room depends on their history: a loaded index may hold
            # more than the one that dumped it. The bound holds after a load too.
            self._evict(int(self._max_bytes * 0.9))

    def _load_tier_native(self, medium: str, t: int, hs: array, ks: array, masks: array) -> bool:
        """A snapshot tier of one-word masks into empty native maps in one native call
        (``kvstream._native.load_tier``: both maps, the per-source counts, the shared
        hashes' holder counts); False when this tier takes the general path below (other
        maps, or a key of two hashes to merge). Raises :class:`SnapshotError` for a hash
        listed twice or 0 (the maps left empty)."""
        held = self._held[t]
        table = None if self._by_engine else self._table
        if type(held) is not NativeMap or len(held) or (table is not None and (type(table) is not NativeMap or len(table))):
            return False
        try:
            counts = _load_tier(table, held, hs, ks, masks, self._href)
        except ValueError as exc:
            raise sn.SnapshotError(f"snapshot medium {medium!r}: a hash is listed twice or is 0 ({exc}; a damaged snapshot)") from None
        if counts is None:
            if self._by_engine:
                raise sn.SnapshotError(f"snapshot medium {medium!r}: a hash is listed twice (a damaged snapshot)")
            return False  # a key shared by two hashes: merged pair by pair
        for x, c in enumerate(counts):
            if c:
                self._src[x].count[t] += c  # type: ignore[union-attr]
        return True

    def _load_prepared(self, snap: Any, p: Any) -> None:
        ours: dict[int, _Source] = {}
        for sd in snap.sources:
            s = self._source(sd.name)
            self._drop_source(s, range(len(self._media)))
            if s.per is not None:
                self._per_mask[s.per] &= ~s.bit
            s.block_size = sd.block_size
            s.per = sd.per
            if sd.per is not None:
                self._per_mask[sd.per] = self._per_mask.get(sd.per, 0) | s.bit
            self._set_stale(s, sd.stale)
            s.reannounce = _reannounce_code(sd.reannounce)
            ours[sd.slot] = s
        same = all(s.slot == x for x, s in ours.items())
        # A source that held two block sizes when dumped (``two_sizes``), or holds blocks
        # of another size than its own (a snapshot written before the flag), is tracked
        # by its records.
        two = {sd.slot for sd in snap.sources if sd.two_sizes}
        two.update(x for _medium, _eh, keys, m in p.rows if keys is not None
                   for x in _bits(m) if ours[x].per is not None and len(keys) != ours[x].per)
        two.update(slot for u in p.unlinked if u.per for slot, *_ in u.holds
                   if ours[slot].per is not None and u.per != ours[slot].per)
        for x in two:
            ours[x].multi = True
            self._multi |= ours[x].bit
            self._roster_reset()

        def remap(m: int) -> int:
            out = 0
            for x in _bits(m):
                out |= ours[x].bit
            return out

        table = self._table
        href = self._href
        touched = self._touched
        for eh, per, x in p.sizes:
            self._xbs.setdefault(eh, {})[per] = x
            self._xrev[x] = (eh, per)
        for medium, hs, ks, masks in p.tiers:
            t = self._tier(medium)
            if same and type(masks) is array and self._load_tier_native(medium, t, hs, ks, masks):
                if touched is not None:
                    touched.update(hs)
                continue
            if not same:
                masks = [remap(m) for m in masks]
            # One int object per distinct mask; a lone holder's mask is its source's bit.
            canon = {m: m for m in set(masks)}
            for s in ours.values():
                if s.bit in canon:
                    canon[s.bit] = s.bit
            masks = list(map(canon.__getitem__, masks))
            for m, c in Counter(masks).items():
                for x in _bits(m):
                    self._src[x].count[t] += c  # type: ignore[union-attr]
            held = self._held[t]
            if self._by_engine:
                if not held:
                    _fill_empty(held, hs, masks)
                    if len(held) != len(hs):
                        held.clear()
                        raise sn.SnapshotError(
                            f"snapshot medium {medium!r}: a hash is listed twice (a damaged snapshot)")
                else:
                    for eh, m in zip(hs, masks):
                        old = held.get(eh, 0)
                        held[eh] = old | m if old else m
            else:
                bulk = not held and not len(table)
                if bulk:
                    _fill_empty(held, ks, masks)
                    if len(held) != len(ks):  # a key shared by two hashes: merge below
                        held.clear()
                        bulk = False
                if bulk:
                    try:
                        table.load_u64(hs, ks)
                    except ValueError as exc:
                        held.clear()
                        raise sn.SnapshotError(f"snapshot medium {medium!r}: a hash is listed twice or is 0 ({exc}; a damaged snapshot)") from None
                    shared = {m for m in canon if m & (m - 1)}  # masks of two or more sources
                    if shared:
                        for eh, m in zip(compress(hs, map(shared.__contains__, masks)),
                                         filter(shared.__contains__, masks)):
                            href[eh] = m.bit_count()
                else:
                    for eh, v, m in zip(hs, ks, masks):
                        n = m.bit_count()
                        if type(table.get(eh, 0)) is not int:  # another block size's hash
                            eh = self._size_id(eh, 1)
                            if touched is not None:
                                touched.add(eh)
                        if eh in table:
                            href[eh] = href.get(eh, 1) + n
                        else:
                            table[eh] = v
                            if n > 1:
                                href[eh] = n
                        old = held.get(v, 0)
                        held[v] = old | m if old else m
            if touched is not None:
                touched.update(hs)
        for medium, eh, keys, m in p.rows:
            t = self._tier(medium)
            if type(eh) is bytes:
                self._wide = True
            v = eh if keys is None else keys[0] if len(keys) == 1 else tuple(keys)
            if keys is not None:
                eh = self._size_id(eh, len(keys))  # another block size's hash: its own id
            for x in _bits(m):
                s = ours[x]
                fresh = eh not in table
                if fresh:
                    table[eh] = v
                self._hold(s, eh, v, t, 0, fresh, new=True)
            if touched is not None:
                touched.add(eh)
        for slot, medium, eh, groups in p.copies:
            t = self._tier(medium)
            per = ours[slot].per
            if per is not None and not self._by_engine:
                eh = self._size_ids((eh,), per, create=False)[0]
            key = (eh, ours[slot].slot, t)
            if groups != {0: 1} or ours[slot].multi:
                self._copies[key] = groups
        for u in p.unlinked:
            uh, up = u.hash, u.parent
            if u.per:  # another block size's hash: its own id
                uh = self._size_id(uh, u.per)
                if up is not None:
                    up = self._size_id(up, u.per)
            cur = self._unl.get(uh)
            if uh in table:
                continue
            for slot, medium, g, c in u.holds:
                t = self._tier(medium)
                if cur is None:
                    cur = _Unlinked(up, u.tokens, u.extras, u.per, self._gen)
                    self._unl_put(uh, cur)
                    if u.tokens is not None:
                        self._waiting.setdefault(up, []).append(uh)
                elif cur.raw is None and u.tokens is not None:
                    self._unl_set(cur, up, u.tokens, u.extras, u.per)
                    self._waiting.setdefault(up, []).append(uh)
                for _ in range(c):
                    self._hold_unlinked(self._src[ours[slot].slot], cur, t, g)  # type: ignore[arg-type]
        for parent in [q for q in self._waiting if q in table]:
            self._link(parent)


_NATIVE, _GENERIC = 0, 2


_DECODER = EventDecoder()
_CLEARED = AllBlocksCleared()
_NO_LIMIT = 1 << 62  # a payload given with its decoded batch was already admitted
# Below this (bytes), a payload given with its decoded batch is not read again: for a few
# events the extra call costs what reading it natively saves (bench: allocator batches of
# ~570 B apply as fast or faster from their decoded events, engine keying 1.3-2x faster).
_RAW_MIN_BYTES = 1024


class _Fallback:
    """A natively decoded payload's events as Python objects, for the events the native
    rules leave to the Python ones: decoded by the payload's decoder on first need
    (``AllBlocksCleared`` needs no decode: it has no fields)."""

    __slots__ = ("_data", "_dec", "_events")

    def __init__(self, data: bytes, dec: EventDecoder, events: list[Any] | None = None) -> None:
        self._data = data
        self._dec = dec
        self._events = events  # already decoded (the caller's batch), or None

    def events(self) -> list[Any]:
        if self._events is None:
            # The native reader took this payload, so the decoder does too (the tests
            # check it); its events are the same, position for position.
            self._events = self._dec.decode(self._data).events
        return self._events

    def event(self, raw: RawBatch, i: int) -> Any:
        if raw.kind(i) == 2:
            return _CLEARED
        return self.events()[i]


def _fill_empty(held: Any, keys: Any, masks: list[int]) -> None:
    """``held.update(zip(keys, masks))`` into an empty map (a snapshot's tier): one native
    call for a :class:`NativeMap` when every key is a distinct non-zero u64 and every mask
    fits 64 bits (a million pairs one by one took 1.7 s of a 2.3 s load); anything else,
    pair by pair as before."""
    if type(held) is NativeMap:
        try:
            cols = array("Q", masks)
            held.load_u64(keys if type(keys) is array and keys.typecode == "Q" else array("Q", keys), cols)
            return
        except (OverflowError, ValueError, TypeError):  # a wide mask, a repeated or 0 key: pair by pair
            held.clear()
    held.update(zip(keys, masks))


class _PayloadFallback(_Fallback):
    """:class:`_Fallback` of a :class:`~kvstream.routing.payloads.PayloadBatch`: its
    events as it decodes them (once, shared with whoever else asks)."""

    __slots__ = ("_pb",)

    def __init__(self, pb: PayloadBatch) -> None:
        self._pb = pb

    def events(self) -> list[Any]:
        return self._pb.decoded().events


def _new_table(table: Any) -> BlockTable:
    """The block table ``KVIndex(table=...)`` names (see :class:`KVIndex`)."""
    if table is None:
        table = "native"
    if isinstance(table, str):
        cls = TABLES.get(table)
        if cls is None:
            raise IndexUsageError(
                f"table must be one of {sorted(TABLES)} or a BlockTable instance, got {table!r:.80}")
        return cls()
    missing = [m for m in ("get", "__contains__", "__setitem__", "__delitem__", "pop", "__len__",
                           "__iter__", "items", "nbytes", "shrink", "export_u64", "load_u64")
               if not callable(getattr(table, m, None))]
    if missing:
        raise IndexUsageError(
            f"table={type(table).__name__} is not a BlockTable (kvstream.routing.table): "
            f"it lacks {', '.join(missing)}")
    if len(table):
        raise IndexUsageError(f"table={type(table).__name__} holds {len(table)} entries; give an empty one "
                              "(load a snapshot to start from a state)")
    return table


class _HeldKeys:
    """The block table of engine keying: a hash is its own key, so there is nothing to
    store; lookups read the held maps (a hash is known while some source holds it)."""

    __slots__ = ("_held",)

    def __init__(self, held: list[dict[Any, int]]) -> None:
        self._held = held

    def get(self, key: Any, default: Any = None) -> Any:
        for h in self._held:
            if key in h:
                return key
        return default

    def __contains__(self, key: Any) -> bool:
        for h in self._held:
            if key in h:
                return True
        return False

    def __setitem__(self, key: Any, value: Any) -> None:
        pass  # the held maps are the table

    def __delitem__(self, key: Any) -> None:
        pass

    def pop(self, key: Any, default: Any = None) -> Any:
        return default

    def __len__(self) -> int:
        held = [h for h in self._held if h]
        if len(held) <= 1:
            return len(held[0]) if held else 0
        return len(set().union(*held))

    def __iter__(self) -> Iterator[Any]:
        held = self._held
        for t, h in enumerate(held):
            if t == 0:
                yield from h
            else:
                for k in h:
                    if not any(k in held[u] for u in range(t)):
                        yield k

    def items(self) -> Iterator[tuple[Any, Any]]:
        return ((k, k) for k in self)

    def nbytes(self) -> int:
        return 0

    def shrink(self) -> None:
        pass

    def export_u64(self) -> tuple[array, array, dict[Any, Any]]:
        return array("Q"), array("Q"), {}

    def load_u64(self, keys: array, values: array, other: Iterable[tuple[Any, Any]] = ()) -> None:
        pass


gs_dict = sys.getsizeof

MAX_HASH_BYTES = 64
"""Longest bytes block hash accepted (vLLM's digests are 16 or 32 bytes); a longer one
makes its event malformed (``stats.rejected_events``), so the memory bound holds."""


def _check_hash_sizes(hashes: Sequence[Any], parent: Any) -> None:
    for h in (*hashes, parent):
        if type(h) is bytes and len(h) > MAX_HASH_BYTES:
            raise RouterKeyError(f"a {len(h)}-byte block hash; digests are at most {MAX_HASH_BYTES} bytes")


def _dict_floor(n: int) -> int:
    """About ``sys.getsizeof`` of a dict sized for ``n`` entries (CPython's layout: a
    power-of-two index of 1-8 byte slots, 2/3 of it usable 24-byte entries), in bytes."""
    size = 8
    while size * 2 // 3 < n:
        size *= 2
    ib = 1 if size <= 128 else 2 if size <= 1 << 15 else 4 if size <= 1 << 31 else 8
    return 80 + size * ib + (size * 2 // 3) * 24


_SWEEP_MIN = 1024  # block-size ids kept before the first sweep of unused ones


def _size_alias(eh: Any, per: int) -> Any:
    """The id of engine hash ``eh``'s copy for engine blocks of ``per`` router blocks, when
    another block size holds ``eh``: a u64 for an int hash (never 0), 16 bytes for bytes."""
    tag = b"\xffkvstream-size" + per.to_bytes(4, "little")
    if type(eh) is int:
        b = eh.to_bytes(8, "little") if 0 <= eh <= _M64 else eh.to_bytes((eh.bit_length() + 8) // 8, "little", signed=True)
        return _xxh3_64(b + tag) or 1
    return _xxh3_128(bytes(eh) + tag).to_bytes(16, "little")


def _perturb(v: Any, eh: Any) -> Any:
    """A key (or keys) no token prompt can produce, derived from ``v`` and engine hash ``eh``."""
    tag = eh.to_bytes(8, "little") if type(eh) is int else bytes(eh)
    if type(v) is int:
        return _xxh3_64(v.to_bytes(8, "little") + b"\xffkvstream-alias" + tag) & KEY_MASK
    return tuple(_xxh3_64(k.to_bytes(8, "little") + b"\xffkvstream-alias" + tag) & KEY_MASK for k in v)


_xxh3_64 = xxhash.xxh3_64_intdigest
_xxh3_128 = xxhash.xxh3_128_intdigest
