"""The read side of the router index: the source table, media (tiers), the prefix walk,
ranking and speculative entries.

:class:`kvstream.routing.index.KVIndex` keeps, per medium, ``key -> bitmask of sources`` in
``_held`` (keys are router keys or engine hashes, depending on its keying); everything that
reads those masks (matching a prompt's keys, ranking, ``best``, speculative entries) and the
per-source records live here. The index provides ``_R`` (tokens per scoring block),
``keys(prompt, lora, salt, mm_items)`` and ``_drop_source(s, tiers)``.
"""

from __future__ import annotations

import logging
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from kvstream._native import (NativeMap, RowLabels, answer_tiers_keys, answer_tiers_tokens, slot_ends_keys,
                              slot_ends_tokens, walk_keys, walk_tiers_keys, walk_tiers_tokens, walk_tokens)
from kvstream.errors import LocalProtocolError
from kvstream.routing.keys import namespace
from kvstream.routing.scoring import Load, Policy, PrefixLoadPolicy, ScoreResult, SourceMatch, _GpuPrefixes, rank

__all__ = ["IndexUsageError", "SourceInfo"]

_log = logging.getLogger("kvstream.routing")
_MEDIA_WARNED: set[str] = set()
_M64 = (1 << 64) - 1
_BASE_NS = namespace()  # the chain root of a prompt without LoRA or salt


class IndexUsageError(LocalProtocolError, ValueError):
    """A bad call on the index by its user (unknown source, bad argument); says the fix."""


@dataclass(slots=True)
class SourceInfo:
    """What the index knows about one source."""

    name: str
    stale: bool
    block_size: int | None
    """The engine's block size in tokens (from its events; None until keyed events arrive)."""
    blocks: dict[str, int] = field(default_factory=dict)
    """Per medium, how many engine blocks (hashes) the source holds (unlinked included)."""


REANNOUNCE_RULES = ("count", "detect", "session")
"""``reannounce`` settings, by code 0, 1, 2 (see :class:`kvstream.routing.index.KVIndex`)."""


def _reannounce_code(rule: str) -> int:
    try:
        return REANNOUNCE_RULES.index(rule)
    except ValueError:
        raise IndexUsageError(
            f"reannounce must be one of {REANNOUNCE_RULES} (see docs/router.md, report-mode "
            f"re-announcements), got {rule!r}"
        ) from None


class _Source:
    __slots__ = ("name", "slot", "bit", "stale", "per", "block_size", "count", "reannounce", "multi")

    def __init__(self, name: str, slot: int) -> None:
        self.name = name
        self.slot = slot
        self.bit = 1 << slot
        self.stale = False
        self.per: int | None = None  # router blocks per engine block
        self.block_size: int | None = None
        self.count: list[int] = []  # per tier: engine hashes held
        self.reannounce = 2  # the re-announcement rule's code (REANNOUNCE_RULES)
        # Holds blocks of two engine block sizes: each holding has a copy record and every
        # router key it covers is counted (KVIndex._make_multi), none inferred from masks.
        self.multi = False


def _bits(x: int) -> Iterable[int]:
    while x:
        b = x & -x
        yield b.bit_length() - 1
        x ^= b




def _gpu_prefix_ends(gpu: Any, keys: Sequence[Any], active: int, ends: Any) -> None:
    """Walk ``keys`` through one tier's ``key -> source mask`` map and set ``ends[slot]``
    to the number of leading keys each source in ``active`` holds.

    Sources leave the prefix at up to len(keys) distinct blocks (replicas holding one
    prompt's prefixes to different lengths): the loop notes (block, leavers) and the bits
    are expanded once afterwards, with no generator per block."""
    drops = []
    for i, rk in enumerate(keys):
        na = active & gpu.get(rk, 0)
        if na != active:
            drops.append((i, active ^ na))
            active = na
            if not active:
                break
    drops.append((len(keys), active))
    for i, x in drops:
        while x:
            b = x & -x
            ends[b.bit_length() - 1] = i
            x ^= b


class _IndexCore:
    """Base of the router indexes (see the module docstring); not used directly."""

    # _roster: what scoring reads of the source table, cached (see _roster_now).
    __slots__ = ("_roster",)

    # Set by subclasses (slots or class attributes). mypy checks assignments against this
    # class's empty __slots__, hence the [misc] ignores where the base rebinds _live.
    _R: int
    _by_engine: bool
    _slot_of: dict[str, int]
    _src: list[_Source | None]
    _slot_gen: int
    _free_slots: list[int]
    _live: int
    _media: list[str]
    _tier_of: dict[str, int]
    _held: list[Any]
    _spec: dict[Any, int]
    _spec_n: dict[tuple[int, Any], int]
    _spec_q: deque[tuple[float, int, list[Any]]]
    # (engine hash, source slot, tier) -> {group: copies}, only where a holding is not
    # exactly one copy in group 0 (the common case costs no record).
    _copies: dict[tuple[Any, int, int], dict[int, int]]
    _per_mask: dict[int, int]
    _roster: _Roster

    def _add_copy_record(self, key: tuple[Any, int, int], g: int, held: bool) -> bool:
        """Count one more copy of group ``g`` for a (hash, source, tier) ``key``.

        ``held``: the source already holds the hash in that tier. Returns True when the
        caller must still mark the holding (it was not held before)."""
        if held:
            cp = self._copies.get(key)
            if cp is None:
                cp = self._copies[key] = {0: 1}
            cp[g] = cp.get(g, 0) + 1
            return False
        if g:
            self._copies[key] = {g: 1}
        return True

    def _take_copy(self, key: tuple[Any, int, int], g: int, multi: bool = False) -> int:
        """Remove one copy of group ``g`` for a held (hash, source, tier) ``key``.

        Returns 0 when there is no such copy (nothing changed), 1 when copies remain (the
        holding stays), 2 when it was the last one (the caller releases the holding).
        ``multi``: the source keeps a record for every holding (no implicit one)."""
        cp = self._copies.get(key)
        if cp is None:
            return 0 if g or multi else 2
        n = cp.get(g, 0)
        if not n:
            return 0
        if n > 1:
            cp[g] = n - 1
        else:
            del cp[g]
        if cp:
            if cp == {0: 1} and not multi:
                del self._copies[key]
            return 1
        del self._copies[key]
        return 2

    _gen_start: float | None
    _ttl: float | None

    def _generation_ended(self, now: float) -> bool:
        """TTL bookkeeping shared by the indexes: True when the current generation (``ttl_s``
        seconds, started by the first call) is over and the caller must rotate."""
        if self._gen_start is None:
            self._gen_start = now  # type: ignore[misc]  # a slot of the subclasses
            return False
        return now - self._gen_start >= self._ttl  # type: ignore[operator]

    def keys(self, prompt_tokens: Sequence[int], lora: Any = None, salt: str | None = None,
             mm_items: Sequence[Any] | None = None) -> list[Any]:
        raise NotImplementedError

    def _drop_source(self, s: _Source, tiers: Iterable[int]) -> None:
        raise NotImplementedError

    @property
    def router_block_size(self) -> int:
        """Tokens per router block."""
        return self._R

    @property
    def sources(self) -> list[str]:
        """Names of the sources the index knows, in order of first appearance."""
        return [s.name for s in self._src if s is not None]

    def _new_tier(self, medium: str) -> int:
        t = len(self._media)
        self._media.append(medium)
        self._tier_of[medium] = t
        self._held.append(NativeMap())
        for s in getattr(self, "_src", ()):
            if s is not None:
                s.count.append(0)
        return t

    MAX_MEDIA = 8
    """Media (tiers) an index tracks at once, GPU and CPU included. A tier nobody holds
    anything in is reused for a new medium; beyond that, stores in a new medium are
    rejected (``stats.rejected_media``): a source naming a new medium per batch cannot
    make every score walk more tiers (issue #15 item 10)."""
    MAX_MEDIA_PER_SOURCE = 4
    """Media one source may hold blocks in at once (GPU and CPU included); stores in a
    further medium are rejected and counted (``stats.rejected_media``)."""

    def _tier(self, medium: str | None) -> int:
        """The tier of ``medium`` (created if new: only for trusted callers)."""
        t = self._tier_of.get(medium or "GPU")
        return self._new_tier(medium) if t is None else t  # type: ignore[arg-type]

    def _store_tier(self, s: _Source, medium: str | None) -> int:
        """The tier a store of ``s`` in ``medium`` goes to, or -1 when the medium bounds
        reject it (counted by the caller)."""
        t = self._tier_of.get(medium or "GPU")
        if t is None:
            if not isinstance(medium, str) or len(medium) > 64:
                return -1
            if len(self._media) < self.MAX_MEDIA:
                t = self._new_tier(medium)
            else:
                t = self._reuse_tier(medium)
                if t < 0:
                    self._warn_media(s, medium)
                    return -1
        if t > 1 and not s.count[t] and sum(1 for c in s.count if c) >= self.MAX_MEDIA_PER_SOURCE:
            self._warn_media(s, medium)
            return -1
        return t

    def _reuse_tier(self, medium: str) -> int:
        for t in range(2, len(self._media)):
            if not self._held[t] and not any(x is not None and x.count[t] for x in self._src):
                del self._tier_of[self._media[t]]
                self._media[t] = medium
                self._tier_of[medium] = t
                return t
        return -1

    def _warn_media(self, s: _Source, medium: Any) -> None:
        if s.name not in _MEDIA_WARNED and len(_MEDIA_WARNED) < 256:
            _MEDIA_WARNED.add(s.name)
            _log.warning(
                "source %s: stores in medium %r rejected: the index tracks at most %d media, %d per "
                "source (counted in stats.rejected_media; logged once per source name, for the first 256)",
                s.name, str(medium)[:64], self.MAX_MEDIA, self.MAX_MEDIA_PER_SOURCE)

    def add_source(self, source: str) -> None:
        """Register a source before its first batch (so it can be ranked with no blocks)."""
        self._source(source)

    def _source(self, name: str) -> _Source:
        slot = self._slot_of.get(name)
        if slot is not None:
            return self._src[slot]  # type: ignore[return-value]
        if not isinstance(name, str):
            raise IndexUsageError(f"source names are str, got {name!r}")
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = len(self._src)
            self._src.append(None)
        s = _Source(name, slot)
        s.count = [0] * len(self._media)
        s.reannounce = self._reannounce  # type: ignore[attr-defined]  # the index default
        self._src[slot] = s
        self._slot_gen += 1  # type: ignore[misc]
        self._slot_of[name] = slot
        self._live |= s.bit  # type: ignore[misc]
        return s

    def _known(self, name: str) -> _Source:
        slot = self._slot_of.get(name)
        if slot is None:
            raise IndexUsageError(f"unknown source {name!r}; known sources: {self.sources}")
        return self._src[slot]  # type: ignore[return-value]

    def configure_source(self, source: str, *, reannounce: str) -> None:
        """Set ``source``'s re-announcement rule from what its engine announced (e.g.
        ``"count"`` for an engine that never re-announces, ``"detect"`` for one whose
        requests all use ``kv_cache_report_mode="full"``); registers unknown sources.
        See ``reannounce`` of :class:`~kvstream.routing.index.KVIndex`."""
        self._source(source).reannounce = _reannounce_code(reannounce)

    def clear_source(self, source: str) -> None:
        """Drop everything ``source`` holds, in every medium, and un-stale it (a restart or
        a snapshot follows). Unknown sources are registered (empty). O(index size)."""
        s = self._source(source)
        self._drop_source(s, range(len(self._media)))
        self._set_stale(s, False)

    def mark_stale(self, source: str, stale: bool = True) -> None:
        """Mark ``source`` stale (its blocks stop scoring; it still ranks with 0 prefix) or
        healthy again. Its residency is kept and still updated by its events."""
        self._set_stale(self._source(source), stale)

    def _set_stale(self, s: _Source, stale: bool) -> None:
        s.stale = stale
        if stale:
            self._live &= ~s.bit  # type: ignore[misc]
        else:
            self._live |= s.bit  # type: ignore[misc]

    def source_info(self, source: str) -> SourceInfo:
        """What the index holds for ``source`` (:class:`SourceInfo`)."""
        s = self._known(source)
        return SourceInfo(
            s.name, s.stale, s.block_size,
            {m: s.count[t] for t, m in enumerate(self._media) if s.count[t]},
        )

    # -- speculative entries ---------------------------------------------------------

    def speculate(
        self,
        source: str,
        prompt_tokens: Sequence[int],
        now: float,
        ttl_s: float = 2.0,
        *,
        lora: str | int | None = None,
        salt: str | None = None,
        mm_items: Sequence[Any] | None = None,
        keys: Sequence[Any] | None = None,
    ) -> int:
        """Pretend ``source`` holds the prompt's blocks (GPU) until ``now + ttl_s`` seconds
        (its own events hold the truth after that; they do not end the pretence earlier).
        Returns the router blocks added.
        Call :meth:`expire` (the :class:`kvstream.routing.router.Router` does) to drop old ones.
        ``keys``: the prompt's precomputed :meth:`keys` (then the prompt arguments are
        ignored), so a caller that just scored the prompt does not compute them twice."""
        s = self._source(source)
        keys = self.keys(prompt_tokens, lora, salt, mm_items) if keys is None else list(keys)
        spec = self._spec
        spec_n = self._spec_n
        for rk in keys:
            k = (s.slot, rk)
            spec_n[k] = spec_n.get(k, 0) + 1
            spec[rk] = spec.get(rk, 0) | s.bit
        self._spec_q.append((now + ttl_s, s.slot, keys))
        return len(keys)

    def expire(self, now: float) -> None:
        """Drop speculative entries whose time (seconds, same clock as :meth:`speculate`) is up."""
        q = self._spec_q
        while q and q[0][0] <= now:
            _, slot, keys = q.popleft()
            for rk in keys:
                self._unspec(slot, rk)

    def _unspec(self, slot: int, rk: int) -> None:
        k = (slot, rk)
        n = self._spec_n.get(k, 0) - 1
        if n > 0:
            self._spec_n[k] = n
            return
        self._spec_n.pop(k, None)
        m = self._spec.get(rk, 0) & ~(1 << slot)
        if m:
            self._spec[rk] = m
        else:
            self._spec.pop(rk, None)

    def _drop_spec(self, pred: Any) -> None:
        for (slot, rk) in [k for k in self._spec_n if pred(*k)]:
            self._spec_n.pop((slot, rk), None)
            m = self._spec.get(rk, 0) & ~(1 << slot)
            if m:
                self._spec[rk] = m
            else:
                self._spec.pop(rk, None)

    # -- scoring ---------------------------------------------------------------------

    def match(
        self,
        prompt_tokens: Sequence[int],
        lora: str | int | None = None,
        salt: str | None = None,
        mm_items: Sequence[Any] | None = None,
        *,
        keys: Sequence[int] | None = None,
    ) -> dict[str, SourceMatch]:
        """Every known source's longest cached prefix of the prompt (:class:`SourceMatch`).

        Args:
            prompt_tokens: the prompt's token ids; a trailing partial router block is ignored.
            lora: adapter name (vLLM >= 0.33 engines) or int id (0.11 engines), or None.
            salt: the request's ``cache_salt``, or None.
            mm_items: multimodal items (``identifier``/``offset`` objects or pairs).
            keys: precomputed :meth:`keys` (then the other arguments are ignored).
        """
        if keys is None:
            pre = self._prompt_prefix(prompt_tokens, lora, salt, mm_items)
            if pre is not None:
                return self._walk((), *pre)
            keys = self.keys(prompt_tokens, lora, salt, mm_items)
        return self._walk(keys)

    def match_rows(
        self,
        prompt_tokens: Sequence[int],
        lora: str | int | None = None,
        salt: str | None = None,
        mm_items: Sequence[Any] | None = None,
        *,
        keys: Sequence[Any] | bytes | None = None,
    ) -> tuple[int, list[tuple[str, int, dict[str, int]]]]:
        """The sources that hold a prefix of the prompt, and only those: ``(number of
        keys, [(source, blocks, {medium: blocks}), ...])``, each row :meth:`match`'s
        ``blocks`` and ``tier_blocks`` of one source whose ``blocks`` is not 0, in slot
        order (stale sources hold nothing).

        What a ``/query`` answer needs, without a :class:`SourceMatch` per source: with
        nothing speculative, the native core chains the keys (a plain, LoRA or salted
        prompt) and walks every tier in one call with the GIL released
        (``kvstream._native.walk_tiers_tokens`` / ``walk_tiers_keys``); anything else
        (multimodal items, speculative entries, more than 64 sources, keys that are not
        u64s) goes through :meth:`match`. ``keys``: precomputed :meth:`keys`, or engine
        hashes packed 8 bytes each (little-endian)."""
        got = self._native_rows(prompt_tokens, lora, salt, mm_items, keys)
        if got is not None:
            return got
        if type(keys) is bytes:
            keys = array("Q", keys).tolist()
        matches = self.match(prompt_tokens, lora, salt, mm_items, keys=keys)
        n = len(keys) if keys is not None else len(prompt_tokens) // self._R
        return n, [(m.source, m.blocks, m.tier_blocks) for m in matches.values() if m.blocks]

    @property
    def slot_gen(self) -> int:
        """A number that changes whenever :meth:`slot_sources` would change."""
        return self._slot_gen

    def slot_sources(self) -> list[str | None]:
        """Per source slot, the name of its source (None for a free slot): what the
        ``labels`` of :meth:`match_answer` are indexed by."""
        return [None if s is None else s.name for s in self._src]

    def match_answer(self, prompt_tokens: Sequence[int], lora: str | int | None = None, salt: str | None = None,
                     *, keys: Sequence[Any] | bytes | None = None, labels: RowLabels, columns: Sequence[str],
                     block_tokens: int, head: bytes) -> tuple[int, bytes, int] | None:
        """:meth:`match_rows` written as JSON text in the one native call that walks the
        prompt: ``(number of keys, text, longest match in tokens)``, or None where
        :meth:`match_rows` would not walk natively, or a held medium is not one of
        ``columns`` (then take :meth:`match_rows`).

        The text is ``head``, then per row (slot order) whose slot has a label in
        ``labels`` (a :class:`kvstream._native.RowLabels` over :meth:`slot_sources`: the
        JSON of ``"instance":{"longest_matched":`` and of its DP rank)
        ``...T,"GPU":G,"CPU":C,"DISK":D,"DP":{"rank":T}}`` joined by commas, then ``}}``;
        ``T`` is the row's blocks times ``block_tokens``, each medium's likewise, a source
        whose engine block is several keys counting whole engine blocks (as the rows do).
        ``columns``: the answer's media in that order (3 of them); ``block_tokens`` above
        ``2**31`` takes :meth:`match_rows` too."""
        got = self._native_maps()
        if got is None or not 0 < block_tokens <= 1 << 31:  # the products fit the crate's u64s
            return None
        maps, tiers, live = got
        media = self._media
        try:
            cols = [columns.index(media[t]) for t in tiers]
        except ValueError:
            return None
        multi = getattr(self, "_multi", 0)  # sources of two block sizes: not rounded
        pers = [(p, m & ~multi & _M64) for p, m in self._per_mask.items() if p > 1]  # rows are of live slots, < 64
        if keys is not None:
            return answer_tiers_keys(maps, keys, live, cols, labels, pers, block_tokens, head)
        if self._by_engine:  # engine-keyed: a prompt's keys are the engines' hashes, given in ``keys``
            return None
        seed = _BASE_NS if lora is None and not salt else namespace(lora, salt)
        return answer_tiers_tokens(maps, prompt_tokens, self._R, seed, live, cols, labels, pers, block_tokens, head)

    def _native_maps(self) -> tuple[list[NativeMap], list[int], int] | None:
        """``(the held tiers' maps, their tier numbers, the live mask)`` for a native walk,
        or None when it must be the Python one (speculative entries, more than 64
        sources, a tier that is not a native map)."""
        live = self._live
        if self._spec or not 0 <= live <= _M64:
            return None
        held = self._held
        tiers = [t for t, h in enumerate(held) if h]
        maps = [held[t] for t in tiers]
        if any(type(m) is not NativeMap for m in maps):
            return None
        return maps, tiers, live

    def _native_rows(self, tokens: Sequence[int], lora: Any, salt: str | None, mm_items: Any,
                     keys: Any) -> tuple[int, list[tuple[str, int, dict[str, int]]]] | None:
        got = self._native_maps()
        if got is None:
            return None
        maps, tiers, live = got
        if keys is not None:
            r = walk_tiers_keys(maps, keys, live)
        elif mm_items or self._by_engine:
            return None
        else:
            seed = _BASE_NS if lora is None and not salt else namespace(lora, salt)
            r = walk_tiers_tokens(maps, tokens, self._R, seed, live)
        if r is None:
            return None
        n, rows = r
        media = [self._media[t] for t in tiers]
        src = self._src
        out = []
        one = media[0] if len(media) == 1 else None  # one tier (the usual GPU-only table)
        for slot, b, ends in rows:
            s = src[slot]
            if s is None:
                continue
            per = 1 if s.multi else s.per or 1
            if per > 1:
                b -= b % per
                if not b:
                    continue
                tb = {media[j]: x - x % per for j, x in enumerate(ends) if x - x % per}
            elif one is not None:
                x = ends[0]
                tb = {one: x} if x else {}
            else:
                tb = {media[j]: x for j, x in enumerate(ends) if x}
            out.append((s.name, b, tb))
        return n, out

    def _prompt_prefix(self, tokens: Sequence[int], lora: Any, salt: str | None,
                       mm_items: Any) -> tuple[int, dict[int, int]] | None:
        """A plain prompt's (key count, per-slot GPU prefix ends) from one native call
        (``kvstream._native.walk_tokens``: keys chained and walked, the GIL released), when
        only the GPU tier holds anything and nothing is speculative; else None."""
        if lora is not None or salt or mm_items or self._by_engine or self._spec:
            return None
        held = self._held
        gpu = held[0]
        live = self._live
        if type(gpu) is not NativeMap or not 0 <= live <= _M64 or any(held[t] for t in range(1, len(held))):
            return None
        r = walk_tokens(gpu, tokens, self._R, _BASE_NS, live)
        if r is None:
            return None
        return r[0], dict(r[1])

    def _walk(self, keys: Sequence[int], n: int | None = None,
              pre: dict[int, int] | None = None) -> dict[str, SourceMatch]:
        """Per source, the longest prefix of ``keys`` it holds; ``n``, ``pre``: the key
        count and GPU prefix ends already walked (:meth:`_prompt_prefix`)."""
        live = self._live
        active = live
        if n is None:
            n = len(keys)
        held = self._held
        gpu = held[0]
        spec = self._spec
        others = [(t, h) for t, h in enumerate(held) if t and h]
        end: dict[int, int] = {}
        tier_end: list[dict[int, int]] = [{} for _ in held]
        served_low: dict[tuple[int, int], int] = {}
        spec_served: dict[int, int] = {}
        if pre is not None:
            end = tier_end[0] = pre  # walked natively: GPU only, nothing speculative
        elif not others and not spec:
            _gpu_prefix_ends(gpu, keys, active, end)
            tier_end[0] = end
        else:
            t_active = [0] * len(held)
            t_active[0] = active
            for t, _h in others:
                t_active[t] = active
            # Lower tiers in order of preference (declaration order: GPU, CPU, others).
            for i, rk in enumerate(keys):
                g = gpu.get(rk, 0)
                sg = spec.get(rk, 0) if spec else 0
                anym = g | sg
                ms = []
                for t, h in others:
                    m = h.get(rk, 0)
                    ms.append((t, m))
                    anym |= m
                ta = t_active[0] & g
                if ta != t_active[0]:
                    for slot in _bits(t_active[0] ^ ta):
                        tier_end[0][slot] = i
                    t_active[0] = ta
                for t, m in ms:
                    ta = t_active[t] & m
                    if ta != t_active[t]:
                        for slot in _bits(t_active[t] ^ ta):
                            tier_end[t][slot] = i
                        t_active[t] = ta
                na = active & anym
                if na != active:
                    for slot in _bits(active ^ na):
                        end[slot] = i
                    active = na
                    if not active:
                        break
                low = active & ~g
                if low:
                    x = low & sg
                    for slot in _bits(x):
                        spec_served[slot] = spec_served.get(slot, 0) + 1
                    low &= ~x
                    for t, m in ms:
                        x = low & m
                        if x:
                            for slot in _bits(x):
                                served_low[(slot, t)] = served_low.get((slot, t), 0) + 1
                            low &= ~x
            for slot in _bits(active):
                end[slot] = n
            for t, ta in enumerate(t_active):
                for slot in _bits(ta):
                    tier_end[t][slot] = n
        R = self._R
        media = self._media
        out: dict[str, SourceMatch] = {}
        gpu_end = tier_end[0]
        one_tier = not others and not spec
        for s in self._src:
            if s is None:
                continue
            slot = s.slot
            b = end.get(slot, 0)
            per = 1 if s.multi else s.per or 1  # two block sizes: no one block to round to
            if per > 1:
                # An engine reuses whole blocks only: round down to its block size.
                b -= b % per
            if not b:
                out[s.name] = SourceMatch(s.name, 0, 0, {}, {}, s.stale)
                continue
            if one_tier:  # the GPU prefix is the prefix
                out[s.name] = SourceMatch(s.name, b, b * R, {"GPU": b}, {"GPU": b}, s.stale)
                continue
            tb = {}
            for t, te in enumerate(tier_end):
                x = te.get(slot, 0)
                x -= x % per
                if x:
                    tb[media[t]] = x
            if not served_low and not spec_served:
                out[s.name] = SourceMatch(s.name, b, b * R, tb, {"GPU": b}, s.stale)
                continue
            served: dict[str, int] = {}
            low_total = 0
            for (sl, t), c in served_low.items():
                if sl == slot:
                    served[media[t]] = c
                    low_total += c
            sp = spec_served.get(slot, 0)
            if low_total > b:  # rounding cut blocks served by lower tiers: keep it simple
                served = {m: min(c, b) for m, c in served.items()}
                low_total = min(low_total, b)
            served["GPU"] = b - low_total
            if not served["GPU"]:
                del served["GPU"]
            out[s.name] = SourceMatch(s.name, b, b * R, tb, served, s.stale, sp)
        del gpu_end
        return out

    def _roster_now(self) -> _Roster:
        """The source table as scoring reads it, rebuilt only when a source came, went or
        changed its block size (the slot list and the per-block-size masks compare equal
        in C, item by item by identity; stale flags are the bits missing from ``_live``)."""
        try:
            r = self._roster
        except AttributeError:
            r = None
        src = self._src
        pm = self._per_mask
        if r is not None and r.src == src and r.per_mask == pm:
            return r
        r = self._roster = _Roster(src, pm)
        return r

    def _gpu_prefixes(self, tokens: Sequence[int], lora: Any, salt: str | None, mm_items: Any,
                      keys: Sequence[Any] | None, loads: Mapping[str, Load]) -> tuple[int, _GpuRows] | None:
        """Every source's prefix of the prompt from one native call, when it is all in GPU
        memory (no lower tier holds anything, nothing is speculative, at most 64 sources,
        the keys u64s; a plain prompt or its precomputed ``keys``): ``(number of keys,
        (names, prefix blocks, stale names))`` in :meth:`match`'s order, the sources named
        only in ``loads`` last with 0; else None (the Python walk)."""
        if self._spec:
            return None
        live = self._live
        held = self._held
        gpu = held[0]
        if type(gpu) is not NativeMap or not 0 <= live <= _M64:
            return None
        if len(held) > 1 and any(held[1:]):
            return None
        ro = self._roster_now()
        if keys is not None:
            r = slot_ends_keys(gpu, keys, live, ro.n_slots)
        elif lora is not None or salt or mm_items or self._by_engine:
            return None
        else:
            r = slot_ends_tokens(gpu, tokens, self._R, _BASE_NS, live, ro.n_slots)
        if r is None:
            return None
        n, blocks = r
        if ro.slots is not None:
            blocks = [blocks[i] for i in ro.slots]
        for i, per in ro.per_fix:  # an engine reuses whole blocks only: round down
            b = blocks[i]
            blocks[i] = b - b % per
        dead = ro.mask & ~live
        stale = ro.stale_names(dead) if dead else _NOTHING
        names = ro.names
        if loads and not (type(loads) is dict and loads.keys() <= self._slot_of.keys()):
            slot_of = self._slot_of
            extra = [name for name in loads if name not in slot_of]
            if extra:
                names = names + extra
                blocks = blocks + [0] * len(extra)
        return n, (names, blocks, stale)

    def score(
        self,
        prompt_tokens: Sequence[int],
        lora: str | int | None = None,
        salt: str | None = None,
        mm_items: Sequence[Any] | None = None,
        *,
        loads: Mapping[str, Load] | None = None,
        policy: Policy | None = None,
        keys: Sequence[int] | None = None,
    ) -> ScoreResult:
        """Match the prompt (see :meth:`match`) and rank the sources with ``policy``
        (default :class:`~kvstream.routing.scoring.PrefixLoadPolicy`) and the caller's ``loads``
        (source name -> :class:`~kvstream.routing.scoring.Load`). Sources named only in ``loads``
        are ranked too (with no cached prefix).

        When every cached prefix is in GPU memory and nothing is speculative, one native
        call walks the prompt for every source; the default policy then values the
        sources from that column in one pass and the result builds its ``matches`` and
        full ``ranking`` only when they are read (``.best`` alone needs neither). A custom
        policy gets the same :class:`~kvstream.routing.scoring.SourceMatch` list either way."""
        pol = policy if policy is not None else _DEFAULT_POLICY
        loads = loads or {}
        if keys is None and (lora is not None or salt or mm_items or self._by_engine):
            # Keys the native call cannot chain itself (engine hashes, multimodal items):
            # made here once, then walked like precomputed ones.
            keys = self.keys(prompt_tokens, lora, salt, mm_items)
        got = self._gpu_prefixes(prompt_tokens, lora, salt, mm_items, keys, loads)
        if got is not None:
            n, (names, blocks, stale) = got
            if type(pol) is PrefixLoadPolicy:
                values = pol._gpu_values(names, blocks, loads, n)
                # The loads are copied: a caller changing them later changes no tie-break.
                lazy = _GpuPrefixes(names, blocks, stale, values, dict(loads))
                return ScoreResult._of_gpu_prefixes(n, self._R, lazy)
            matches = _GpuPrefixes(names, blocks, stale, [], loads).matches(self._R)
        else:
            pre = None if keys is not None else self._prompt_prefix(prompt_tokens, lora, salt, mm_items)
            if pre is not None:
                n = pre[0]
                matches = self._walk((), *pre)
            else:
                if keys is None:
                    keys = self.keys(prompt_tokens, lora, salt, mm_items)
                n = len(keys)
                matches = self._walk(keys)
            for name in loads:
                if name not in matches:
                    matches[name] = SourceMatch(name)
        values_l = pol(list(matches.values()), loads, n)
        return ScoreResult(n, self._R, matches, rank(values_l, loads), {s: v for v, s in values_l})

    def best(
        self,
        keys: Sequence[int],
        loads: Mapping[str, Load] | None = None,
        policy: Policy | None = None,
    ) -> str | None:
        """``score(..., keys=keys, loads=loads, policy=policy).best``: the chosen source
        only (None without sources), for callers that route and need nothing else.

        The common case (no speculative entries, nothing in a lower tier, a plain
        :class:`~kvstream.routing.scoring.PrefixLoadPolicy`) is :meth:`score`'s native
        path without its result object; both give the same answer
        (``tests/routing/test_index.py``, ``tests/routing/test_score_fast_path.py``).
        """
        pol = policy if policy is not None else _DEFAULT_POLICY
        loads = loads or {}
        if type(pol) is PrefixLoadPolicy:
            got = self._gpu_prefixes((), None, None, None, keys, loads)
            if got is not None:
                n, (names, blocks, stale) = got
                return _GpuPrefixes(names, blocks, stale, pol._gpu_values(names, blocks, loads, n), loads).best()
        return self.score((), loads=loads, policy=pol, keys=keys).best


_NOTHING: frozenset[str] = frozenset()

_GpuRows = tuple[list[str], list[int], frozenset[str]]


class _Roster:
    """The source table as :meth:`_IndexCore.score` reads it: per present source (slot
    order) its name; the slots when some are free (else the slot is the position); the
    positions whose engine blocks span several router blocks, with that number; every
    present source's bit. ``src`` and ``per_mask`` are the copies it was built from."""

    __slots__ = ("src", "per_mask", "names", "slots", "n_slots", "per_fix", "mask", "_by_slot")

    def __init__(self, src: list[_Source | None], per_mask: dict[int, int]) -> None:
        self.src = list(src)
        self.per_mask = dict(per_mask)
        present = [s for s in src if s is not None]
        self.names = [s.name for s in present]
        self.slots = None if len(present) == len(src) else [s.slot for s in present]
        self.n_slots = len(src)
        self.per_fix = [(i, s.per) for i, s in enumerate(present)
                        if s.per is not None and s.per > 1 and not s.multi]
        mask = 0
        for s in present:
            mask |= s.bit
        self.mask = mask
        self._by_slot = {s.slot: s.name for s in present}

    def stale_names(self, dead: int) -> frozenset[str]:
        """The names of the sources whose bits are in ``dead``."""
        by_slot = self._by_slot
        return frozenset(by_slot[b] for b in _bits(dead))


def _hash_sort_key(eh: Any) -> tuple[int, Any]:
    return (0, eh) if type(eh) is int else (1, eh)


def _sort_key(row: tuple[str, int, Any, int]) -> tuple[Any, ...]:
    return (row[0], row[1], *_hash_sort_key(row[2]), row[3])


_DEFAULT_POLICY = PrefixLoadPolicy()
