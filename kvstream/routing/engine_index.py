"""The router index keyed by the engines' own block hashes (router configured like the engines).

:class:`EngineKeyIndex` answers the same questions as :class:`kvstream.routing.index.KVIndex`
(which source holds which prefix, per tier; ranked choice) with the same API, but keys
blocks by the engine hash each event carries instead of the router's own token keys. It
needs the engines' hash algorithm, seed and block size (a
:class:`kvstream.hashing.BlockHasher` configured like them), and in return:

* ingest computes nothing per block: a ``BlockStored`` sets one bit per block in
  ``engine hash -> source bitmask`` (per medium), a ``BlockRemoved`` clears it;
* memory is one dict entry and the hash's int object per distinct block and medium
  (:data:`BYTES_PER_ENGINE_BLOCK`), instead of KVIndex's two entries and two ints;
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

Residency rules are KVIndex's (``docs/router.md``): physical copies counted per (source,
medium, KV cache group, hash); report-mode re-announcements add no copy;
``BlockRemoved`` of an unknown block counted; ``AllBlocksCleared`` clears that source's
GPU tier only; stale, clear and remove per source; optional memory bound and TTL.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any, Iterable, Sequence

from kvstream.routing import snapshot as sn
from kvstream.routing.index import _dict_floor
from kvstream.routing._core import REANNOUNCE_RULES, IndexUsageError, _reannounce_code, _bits, _IndexCore, _sort_key, _Source
from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstream.hashing import BlockHasher, LoRA, MMItem, RequestBlockHasher, to_external_list

__all__ = ["EngineKeyIndex", "EngineIndexStats", "BYTES_PER_ENGINE_BLOCK"]

_log = logging.getLogger("kvstream.routing.engine_index")

BYTES_PER_ENGINE_BLOCK = 82
"""Measured heap cost (bytes) of one distinct block held by one source in one medium: one
dict entry (~42 bytes at 10**6 entries) plus the 64-bit hash's int object (40 bytes)
(``bench/bench_index.py --layout engine``; tracemalloc at 10**6 blocks). Every further
source holding the same block adds a bit of the shared mask (an int object of ~32 bytes
per block once more than 8 sources share it). Used by :meth:`EngineKeyIndex.estimated_bytes`."""
_BYTES_PER_COPY_RECORD = 300
_BYTES_PER_SOURCE = 600  # a source's record, name, counts and table slots
_BYTES_PER_TOUCHED = 32  # one set entry per block stored in the current TTL generation


@dataclass(slots=True)
class EngineIndexStats:
    """Counters of everything an :class:`EngineKeyIndex` did (cumulative since construction).
    Names are :class:`kvstream.routing.index.IndexStats`' where the concept is the same."""

    batches: int = 0
    stored_blocks: int = 0
    """Block copies added by ``BlockStored`` (re-announcements excluded)."""
    removed_blocks: int = 0
    """Block copies removed by ``BlockRemoved``."""
    unknown_removed: int = 0
    """``BlockRemoved`` hashes the source did not hold (e.g. stored before we subscribed)."""
    reannounced_blocks: int = 0
    """Blocks of report-mode re-announcements, which add no copy."""
    rejected_events: int = 0
    """Events of an unknown type, skipped."""
    rejected_media: int = 0
    """Blocks stored in a medium beyond the index's media bounds (``MAX_MEDIA``,
    ``MAX_MEDIA_PER_SOURCE``), skipped."""
    foreign_block_size: int = 0
    """Blocks rejected because their ``BlockStored.block_size`` is not the hasher's."""
    foreign_hash_form: int = 0
    """Blocks whose hash is in the other external form (bytes vs int) than configured;
    kept (so removals stay exact) but no prompt can match them."""
    clears: int = 0
    """``AllBlocksCleared`` events applied."""
    evicted_blocks: int = 0
    """Distinct hashes dropped by the memory bound."""
    expired_blocks: int = 0
    """Distinct hashes dropped by the TTL."""


class EngineKeyIndex(_IndexCore):
    """Prefix-aware residency index keyed by engine block hashes (sans-IO).

    Same API as :class:`kvstream.routing.index.KVIndex` (``apply_batch``, ``clear_source``,
    ``mark_stale``, ``remove_source``, ``add_source``, ``keys``, ``match``, ``score``,
    ``best``, ``speculate``, ``expire``, ``state``, ``source_info``...), so it plugs into
    ``Router(index=...)``, :func:`kvstream.routing.router.apply_item` and event-log replay. Its
    scoring unit is the engine block: :attr:`router_block_size` is the hasher's block size.

    Args:
        hasher: a :class:`kvstream.hashing.BlockHasher` with the engines' algorithm, seed
            (root), block size and extra-key style.
        hash_form: how the engines put hashes on the wire: ``"int"`` (the low 64 bits,
            vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or ``"bytes"``.
        max_bytes: optional memory bound (bytes, estimated with measured per-entry costs,
            see :meth:`estimated_bytes`). When a batch leaves the index above it, entries
            are dropped until it is under 90 % of the bound: with a TTL, first blocks not
            stored in the current TTL generation; then blocks in the order they were first
            stored (oldest first, taking from every medium in turn). A dropped block
            disappears from every source and medium.
        ttl_s: optional time to live (seconds) of a block after its last ``BlockStored``
            from any source; dropped between ``ttl_s`` and ``2 * ttl_s`` after it. Time is
            the ``now`` given to :meth:`apply_batch` (default: the batch's ``ts``). Costs
            one set entry (~32 bytes) per block stored within a generation.
        reannounce: ``"session"`` (default), ``"detect"`` or ``"count"``, as in
            :class:`~kvstream.routing.index.KVIndex`.
    """

    __slots__ = (
        "_R", "_hasher", "_form", "_slot_of", "_src", "_free_slots", "_live", "_media",
        "_tier_of", "_held", "_copies", "_spec", "_spec_n", "_spec_q", "_max_bytes", "_ttl",
        "_touched", "_gen_start", "_reannounce", "_warned", "_etype", "stats",
    )

    def __init__(
        self,
        hasher: BlockHasher,
        *,
        hash_form: str = "int",
        max_bytes: int | None = None,
        ttl_s: float | None = None,
        reannounce: str = "session",
    ) -> None:
        if not isinstance(hasher, BlockHasher):
            raise IndexUsageError(
                f"EngineKeyIndex needs hasher=BlockHasher(algorithm, block_size, seed=...) configured "
                f"like the engines, got {hasher!r:.80}"
            )
        if hash_form not in ("int", "bytes"):
            raise IndexUsageError(
                f"hash_form must be 'int' (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM's default) "
                f"or 'bytes', got {hash_form!r}"
            )
        if max_bytes is not None and max_bytes <= 0:
            raise IndexUsageError(f"max_bytes must be positive (bytes) or None, got {max_bytes!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise IndexUsageError(f"ttl_s must be positive (seconds) or None, got {ttl_s!r}")
        self._R = hasher.block_size
        self._hasher = hasher
        self._form = hash_form
        self._etype = int if hash_form == "int" else bytes
        self._slot_of: dict[str, int] = {}
        self._src: list[_Source | None] = []
        self._free_slots: list[int] = []
        self._live = 0
        self._media: list[str] = []
        self._tier_of: dict[str, int] = {}
        self._held: list[dict[Any, int]] = []  # per tier: engine hash -> source mask
        for m in ("GPU", "CPU"):
            self._new_tier(m)
        # (hash, slot, tier) -> {group: copies}, for holdings that are not exactly one copy
        # in group 0 (duplicates, hybrid groups): rare, so kept beside the masks.
        self._copies: dict[tuple[Any, int, int], dict[int, int]] = {}
        self._spec: dict[Any, int] = {}
        self._spec_n: dict[tuple[int, Any], int] = {}
        self._spec_q: deque[tuple[float, int, list[Any]]] = deque()
        self._max_bytes = max_bytes
        self._ttl = ttl_s
        self._touched: set[Any] | None = set() if ttl_s is not None else None
        self._gen_start: float | None = None
        self._reannounce = _reannounce_code(reannounce)
        self._warned: set[tuple[str, str]] = set()
        self.stats = EngineIndexStats()
        """Cumulative counters (:class:`EngineIndexStats`)."""

    @property
    def hasher(self) -> BlockHasher:
        """The engines' block hasher this index scores prompts with."""
        return self._hasher

    @property
    def hash_form(self) -> str:
        """``"int"`` or ``"bytes"``: the external hash form the engines send."""
        return self._form

    @property
    def bytes_per_block(self) -> int:
        """Estimated heap bytes of one distinct block held by one source in one medium
        (:data:`BYTES_PER_ENGINE_BLOCK`)."""
        return BYTES_PER_ENGINE_BLOCK

    def remove_source(self, source: str) -> None:
        """Forget ``source`` entirely (its blocks, stats and name). Unknown names are ignored."""
        slot = self._slot_of.get(source)
        if slot is None:
            return
        s = self._src[slot]
        assert s is not None
        self._drop_source(s, range(len(self._media)))
        self._live &= ~s.bit
        del self._slot_of[source]
        self._src[slot] = None
        self._free_slots.append(slot)

    # -- ingest ----------------------------------------------------------------------

    def apply_batch(self, source: str, batch: KVEventBatch, now: float | None = None) -> None:
        """Apply one decoded batch from ``source`` (events in order).

        Nothing a remote engine sends raises: events of an unknown type, and blocks of
        another block size, are skipped and counted. ``now`` (seconds) drives the TTL; it
        defaults to ``batch.ts``.
        """
        s = self._source(source)
        st = self.stats
        st.batches += 1
        if self._ttl is not None:
            self._tick(batch.ts if now is None else now)
        touched = self._touched
        held = self._held
        gpu = held[0]
        copies = self._copies  # never rebound, only mutated
        bit = s.bit
        slot = s.slot
        count = s.count
        B = self._R
        etype = self._etype
        for ev in batch.events:
            # type() is, not isinstance (speed): mypy does not narrow ev on it, hence the
            # [union-attr] ignores below.
            cls = type(ev)
            if cls is BlockRemoved:
                medium = ev.medium  # type: ignore[union-attr]
                if medium == "GPU" or medium is None:
                    t, h = 0, gpu
                else:
                    t = self._tier_of.get(medium, -1)
                    if t < 0:
                        st.unknown_removed += len(ev.block_hashes)  # type: ignore[union-attr]
                        continue
                    h = held[t]
                g = ev.group_idx  # type: ignore[union-attr]
                n = 0
                for eh in ev.block_hashes:  # type: ignore[union-attr]
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
                hs = ev.block_hashes  # type: ignore[union-attr]
                if not hs:
                    continue
                bsz = ev.block_size  # type: ignore[union-attr]
                if bsz != B and (bsz or ev.token_ids):  # type: ignore[union-attr]
                    # Tier-only events (CPU offload) carry block_size 0 and no tokens.
                    self._foreign(s, "block_size", len(hs),
                                  f"BlockStored with block_size {bsz}, but this EngineKeyIndex hashes "
                                  f"blocks of {B} tokens; its blocks are ignored")
                    continue
                if bsz and s.block_size is None:
                    s.block_size = bsz
                if type(hs[0]) is not int and any(type(x) is bytes and len(x) > 64 for x in hs):
                    st.rejected_events += 1  # longer than any digest: malformed
                    continue
                if type(hs[0]) is not etype:
                    self._foreign(s, "hash_form", len(hs),
                                  f"block hashes are {type(hs[0]).__name__}, but hash_form={self._form!r}; "
                                  "no prompt can match them (set hash_form to what the engines send)")
                medium = ev.medium  # type: ignore[union-attr]
                if medium == "GPU" or medium is None:
                    t, h = 0, gpu
                else:
                    t = self._store_tier(s, medium)
                    if t < 0:
                        st.rejected_media += len(hs)
                        continue
                    h = held[t]
                g = ev.group_idx or 0  # type: ignore[union-attr]
                ra = s.reannounce
                if (ev.parent_block_hash is None and ra and (ra == 1 or ev.session_id is not None)  # type: ignore[union-attr]
                        and h.get(hs[0], 0) & bit
                        and self._holds_all(s, hs, t, g)):
                    st.reannounced_blocks += len(hs)
                    continue
                if touched is not None:
                    touched.update(hs)
                st.stored_blocks += len(hs)
                if g:
                    for eh in hs:
                        self._hold(s, eh, t, g)
                    continue
                n = 0
                for eh in hs:
                    m = h.get(eh, 0)
                    if m & bit:
                        self._hold(s, eh, t, 0)  # another physical copy
                    else:
                        # A lone source's mask is its own bit object (no new int per block).
                        h[eh] = m | bit if m else bit
                        n += 1
                count[t] += n
            elif cls is AllBlocksCleared:
                st.clears += 1
                self._drop_source(s, (0,))
            else:
                st.rejected_events += 1
        if self._max_bytes is not None and self.estimated_bytes() > self._max_bytes:
            self._evict(int(self._max_bytes * 0.9))

    def _foreign(self, s: _Source, what: str, n: int, msg: str) -> None:
        st = self.stats
        if what == "block_size":
            st.foreign_block_size += n
        else:
            st.foreign_hash_form += n
        key = (s.name, what)
        if key not in self._warned:
            self._warned.add(key)
            _log.warning(
                "source %s: %s (hasher %r). Engines with another hash configuration need their own "
                "EngineKeyIndex, or a KVIndex (router keys); counted in stats.foreign_%s, logged once.",
                s.name, msg, self._hasher, what,
            )

    def _holds_all(self, s: _Source, hashes: Sequence[Any], t: int, g: int) -> bool:
        h = self._held[t]
        bit = s.bit
        copies = self._copies
        for eh in hashes:
            if not h.get(eh, 0) & bit:
                return False
            cp = copies.get((eh, s.slot, t)) if copies else None
            if cp is None:
                if g != 0:
                    return False
            elif not cp.get(g):
                return False
        return True

    def _hold(self, s: _Source, eh: Any, t: int, g: int) -> None:
        """Add one physical copy of ``eh`` in (source, tier, group)."""
        h = self._held[t]
        m = h.get(eh, 0)
        if (m & s.bit or g) and not self._add_copy_record((eh, s.slot, t), g, bool(m & s.bit)):
            return
        h[eh] = m | s.bit if m else s.bit
        s.count[t] += 1

    def _remove_copy(self, s: _Source, eh: Any, t: int, g: int) -> bool:
        """Remove one physical copy of ``eh`` in (source, tier, group); False if none."""
        h = self._held[t]
        m = h.get(eh, 0)
        if not m & s.bit:
            return False
        left = self._take_copy((eh, s.slot, t), g)
        if left != 2:
            return left == 1
        m ^= s.bit
        if m:
            h[eh] = m
        else:
            del h[eh]
        s.count[t] -= 1
        return True

    def _drop_source(self, s: _Source, tiers: Iterable[int]) -> None:
        """Drop every holding of ``s`` in ``tiers``. O(index size): only on clears/restarts."""
        tiers = tuple(tiers)
        bit = s.bit
        keep = ~bit
        slot = s.slot
        for t in tiers:
            h = self._held[t]
            if s.count[t]:
                for eh, m in list(h.items()):
                    if m & bit:
                        m &= keep
                        if m:
                            h[eh] = m
                        else:
                            del h[eh]
            s.count[t] = 0
        if self._copies:
            for key in [k for k in self._copies if k[1] == slot and k[2] in tiers]:
                del self._copies[key]
        if self._spec_n:
            self._drop_spec(lambda sl, rk: sl == slot)

    # -- TTL and memory bound ----------------------------------------------------------

    def _tick(self, now: float) -> None:
        if not self._generation_ended(now):
            return
        # Rotate: blocks not stored during the generation that ends expire.
        touched = self._touched
        assert touched is not None
        gone = {eh for h in self._held for eh in h if eh not in touched}
        for eh in gone:
            self._forget(eh)
        self.stats.expired_blocks += len(gone)
        self._touched = set()
        self._gen_start = now

    def estimated_bytes(self) -> int:
        """Heap bytes held by the index (an upper bound): every table as allocated
        (``sys.getsizeof``) plus the objects its entries own at their measured sizes: the
        hash (36 bytes for an int, up to 97 for a bytes hash), a mask int per entry held by
        two or more sources (lone holders share their source's bit), copy records, the
        TTL's set of stored hashes. Costs O(sources x media); ``max_bytes`` calls it once
        per batch."""
        gs = sys.getsizeof
        b = 0
        entries = 0
        for h in self._held:
            b += gs(h)
            entries += len(h)
        b += entries * (36 if self._form == "int" and not self.stats.foreign_hash_form else 97)
        hold = 0
        for s in self._src:
            if s is not None:
                hold += sum(s.count)
        if hold > entries:
            b += (hold - entries) * (24 + 4 * (len(self._src) // 30 + 1))
        b += gs(self._copies) + _BYTES_PER_COPY_RECORD * len(self._copies)
        if self._touched is not None:
            b += gs(self._touched) + 36 * len(self._touched)
        b += gs(self._spec) + gs(self._spec_n) + 96 * len(self._spec_n)
        b += _BYTES_PER_SOURCE * len(self._src) + gs(self._warned) + 160 * len(self._warned)
        return b

    def _evict(self, target: int) -> None:
        """Drop entries until :meth:`estimated_bytes` <= ``target`` (order: see class
        doc), then shrink the tables to what is left (tables do not shrink by themselves)."""
        touched = self._touched
        while True:
            over = self.estimated_bytes() - target
            if over <= 0:
                return
            k = max(64, min(1 << 16, over // 64 + 1))
            gone: list[Any] = []
            if touched is not None:
                for h in self._held:
                    for eh in h:
                        if eh not in touched:
                            gone.append(eh)
                            if len(gone) >= k:
                                break
                    if len(gone) >= k:
                        break
            if not gone:
                live = [h for h in self._held if h]
                for h in live:
                    gone.extend(islice(h, max(1, k // len(live))))
            dropped = 0
            for eh in gone:
                if any(eh in h for h in self._held):
                    self._forget(eh)
                    dropped += 1
            self.stats.evicted_blocks += dropped
            for t, h in enumerate(self._held):
                if sys.getsizeof(h) > 2 * _dict_floor(len(h)):
                    self._held[t] = dict(h)
            if sys.getsizeof(self._copies) > 2 * _dict_floor(len(self._copies)):
                self._copies = dict(self._copies)
            if not dropped:
                return

    def _forget(self, eh: Any) -> None:
        """Drop ``eh`` from every source and tier."""
        src = self._src
        copies = self._copies
        for t, h in enumerate(self._held):
            m = h.pop(eh, 0)
            for slot in _bits(m):
                s = src[slot]
                if s is not None:
                    s.count[t] -= 1
                if copies:
                    copies.pop((eh, slot, t), None)
        if self._touched:
            self._touched.discard(eh)

    # -- scoring keys ------------------------------------------------------------------

    def keys(
        self,
        prompt_tokens: Sequence[int],
        lora: LoRA | int | None = None,
        salt: str | None = None,
        mm_items: Sequence[Any] | None = None,
    ) -> list[Any]:
        """The engines' external block hashes of the prompt's full blocks, computed with
        the configured hasher, in :attr:`hash_form`.

        Args:
            prompt_tokens: token ids; a trailing partial block is ignored.
            lora: a :class:`kvstream.hashing.LoRA` (name, path, int_id: vLLM >= 0.33 hashes
                the name and path), or for ``extra_key_style="0.11"`` hashers the int id.
            salt: the request's ``cache_salt`` (str) or None.
            mm_items: :class:`kvstream.hashing.MMItem` s or ``(identifier, offset, length)``
                triples, sorted by offset.
        """
        hasher = self._hasher
        if lora is None and not mm_items and not salt:
            digests = hasher.hash_blocks(prompt_tokens)
        else:
            rh = RequestBlockHasher(hasher, lora=self._lora(lora), mm_items=_mm(mm_items),
                                    cache_salt=salt or None)
            rh.extend(prompt_tokens)
            digests = rh.block_hashes
        if self._form == "bytes":
            return digests
        return to_external_list(digests)

    def engine_hashes(
        self,
        prompt_tokens: Sequence[int],
        lora: LoRA | int | None = None,
        salt: str | None = None,
        mm_items: Sequence[Any] | None = None,
    ) -> list[Any]:
        """Same as :meth:`keys` (the name :class:`~kvstream.routing.index.KVIndex` uses for it)."""
        return self.keys(prompt_tokens, lora, salt, mm_items)

    def match_engine_hashes(self, hashes: Sequence[Any]) -> dict[str, int]:
        """Per source, the longest prefix of ``hashes`` (one prompt's engine hashes, in
        order) it holds in any medium, in blocks (stale sources: 0)."""
        return {name: m.blocks for name, m in self._walk(list(hashes)).items()}

    def _lora(self, lora: Any) -> LoRA | None:
        if lora is None or isinstance(lora, LoRA):
            return lora
        if type(lora) is int and self._hasher.extra_key_style == "0.11":
            return LoRA("", "", lora)  # 0.11 hashes the int id alone
        raise IndexUsageError(
            f"EngineKeyIndex needs lora=LoRA(name, path, int_id) (the engine hashes the adapter's "
            f"name and path; 0.11-style hashers also take the int id), got {lora!r}"
        )

    # -- canonical state ---------------------------------------------------------------

    def _rows(self) -> dict[int, list[tuple[str, int, Any, int]]]:
        per_src: dict[int, list[tuple[str, int, Any, int]]] = {
            s.slot: [] for s in self._src if s is not None
        }
        media = self._media
        copies = self._copies
        for t, h in enumerate(self._held):
            for eh, m in h.items():
                for slot in _bits(m):
                    cp = copies.get((eh, slot, t)) if copies else None
                    for g, c in (cp.items() if cp is not None else ((0, 1),)):
                        per_src[slot].append((media[t], g, eh, c))
        return per_src

    def state(self) -> dict[str, Any]:
        """Everything the index holds, in the canonical form of :meth:`KVIndex.state`:
        ``{"router_block_size": B, "sources": {name: {"stale": bool, "blocks": ((medium,
        group, engine_hash, copies), ...) sorted}}, "unlinked": ()}`` (no block is ever
        unlinked here). Speculative entries and counters are not part of the state."""
        per_src = self._rows()
        return {
            "router_block_size": self._R,
            "sources": {
                s.name: {"stale": s.stale, "blocks": tuple(sorted(per_src[s.slot], key=_sort_key))}
                for s in self._src
                if s is not None
            },
            "unlinked": (),
        }

    # -- snapshots ---------------------------------------------------------------------

    _keying = "engine"

    def _options(self) -> Any:
        return sn._Options(self._max_bytes, self._ttl, REANNOUNCE_RULES[self._reannounce])

    def _hasher_spec(self) -> Any:
        h = self._hasher
        return sn._Hasher(h.algorithm, h.block_size, h.extra_key_style, h.root, self._form)

    def _dump_keys(self, held: set[Any]) -> tuple[Any, list[Any]]:
        return sn._Keys(), []

    @classmethod
    def _from_snapshot(cls, snap: Any, options: dict[str, Any]) -> "EngineKeyIndex":
        o = snap.options
        kw: dict[str, Any] = {"max_bytes": o.max_bytes, "ttl_s": o.ttl_s, "reannounce": o.reannounce}
        h = snap.hasher
        if h is None and "hasher" not in options:
            raise sn.SnapshotError("snapshot of an engine-keyed index without its hasher (a damaged snapshot)")
        try:
            if h is not None:
                kw["hasher"] = BlockHasher(h.algorithm, h.block_size, extra_key_style=h.extra_key_style, root=h.root)
                kw["hash_form"] = h.hash_form
            kw.update(options)
            return cls(**kw)
        except (IndexUsageError, ValueError) as exc:
            raise sn.SnapshotError(f"snapshot configuration cannot build an index: {exc}") from None

    def _prepare_load(self, snap: Any) -> Any:
        for sd in snap.sources:
            for td in sd.tiers:
                sn.unpack_u64(td.plain, "hashes")
        return None

    def _load_rows(self, s: _Source, t: int, rows: list[tuple[Any, int, int]], prepared: Any) -> None:
        for eh, g, c in rows:
            for _ in range(c):
                self._hold(s, eh, t, g)


def _mm(items: Sequence[Any] | None) -> tuple[MMItem, ...]:
    if not items:
        return ()
    out = []
    for it in items:
        if isinstance(it, MMItem):
            out.append(it)
        elif isinstance(it, (tuple, list)) and len(it) == 3:
            out.append(MMItem(*it))
        else:
            raise IndexUsageError(
                f"mm_items for engine hashes are MMItem(identifier, offset, length) or "
                f"(identifier, offset, length) triples (the engine hashes the item into every "
                f"block it covers, so its length is needed), got {it!r:.80}"
            )
    return tuple(out)

