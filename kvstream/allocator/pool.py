"""The prefix-caching block pool: physical KV blocks, their LRU free queue and hash index.

Sans-IO and synchronous: calls go in, block objects and KV events come out. Semantics
follow vLLM v1's ``BlockPool`` (names included, so engines can move over):

* Block 0 is the *null block*: never cached, freed, touched or counted as free.
* Free blocks sit in an LRU queue (an intrusive doubly linked list of ``__slots__``
  blocks, O(1) removal from the middle). :meth:`BlockPool.get_new_blocks` pops from the
  head; :meth:`BlockPool.free_blocks` appends at the tail in the order given, so a request
  freed tail-first is evicted tail-first.
* Eviction is lazy: a cached block that becomes free keeps its hash and stays findable
  (a prefix hit can :meth:`~BlockPool.touch` it back). It loses its hash, emitting
  ``BlockRemoved``, only when it is handed out again.
* The hash index is keyed by (block hash, KV cache group) and keeps duplicate physical
  copies (vLLM never de-duplicates: block tables are append-only).

Hashes are opaque ``bytes`` digests here (see :mod:`kvstream.hashing`); the form they take
on events (``int``, the low 64 bits as vLLM sends by default, or ``bytes``) is an option
applied only when an event is built.

Errors from bad calls are :class:`BlockPoolError` (the caller misused the API) and are
raised before any state changes.
"""

from __future__ import annotations

from array import array
from functools import partial
from itertools import takewhile
import operator
from operator import is_not
from typing import Any, Iterable, Literal, Sequence

from kvstream.compat import VllmVersion, version
from kvstream.errors import LocalProtocolError
from kvstream.wire.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvstream.hashing import to_external, to_external_list

__all__ = [
    "BlockPool",
    "BlockPoolError",
    "NoFreeBlocksError",
    "FreeBlockQueue",
    "HashIndex",
    "KVCacheBlock",
    "EventStyle",
    "FreeOrder",
    "HashForm",
    "DEFAULT_EVENT_METADATA",
]

EventStyle = Literal["0.33", "0.11"]
"""Which vLLM release's event fields the pool fills (see :class:`BlockPool`)."""
FreeOrder = Literal["v0.33", "v0.11"]
"""Where :meth:`BlockPool.free_blocks` puts blocks without a hash (see :class:`BlockPool`)."""
HashForm = Literal["int", "bytes"]
"""How block hashes appear on events: low 64 bits as an unsigned int, or the raw digest."""

DEFAULT_EVENT_METADATA: tuple[tuple[str | None, int | None], ...] = (("full_attention", None),)
"""One KV cache group of full attention: vLLM's ``kv_cache_event_metadata`` for a plain model."""


class BlockPoolError(LocalProtocolError, ValueError):
    """A bad call to the block pool (double free, null block, hash conflict, ...).

    Raised before anything changed: the pool is exactly as it was before the call.
    """


def _block_count(n: Any) -> int:
    """``n`` as a block count: any integer (numpy's too), never a float, str or bool."""
    if not isinstance(n, bool):
        try:
            return operator.index(n)
        except TypeError:
            pass
    raise BlockPoolError(f"num_blocks must be an integer number of blocks, got {n!r} "
                         f"({type(n).__name__}); round it yourself if it was computed")


class NoFreeBlocksError(BlockPoolError):
    """More blocks were asked for than are free. Check :meth:`BlockPool.get_num_free_blocks`
    first, or free/preempt requests."""


class KVCacheBlock:
    """One physical KV block.

    Attributes:
        block_id: index in the pool (0 is the null block).
        ref_cnt: number of requests holding the block (0: it is in the free queue).
        block_hash: the digest it is cached under, or None.
        group_id: the KV cache group of that hash (meaningful only with a hash).
        is_null: True for block 0 only.
        prev_free, next_free: free-queue links (None when not in the queue).
        pool: the :class:`BlockPool` the block belongs to.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev_free", "next_free",
                 "is_null", "origin", "pos", "pool")

    def __init__(self, block_id: int, is_null: bool = False, pool: Any = None) -> None:
        self.block_id = block_id
        # The BlockPool that owns the block (None for queue sentinels): a block handed to
        # another pool is refused, not silently linked into the wrong queue.
        self.pool = pool
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group_id = 0
        # Free-queue links, None when the block is not linked. Typed as blocks: they are
        # read only on linked blocks (sentinels bound the queue), never on None.
        self.prev_free: KVCacheBlock = None  # type: ignore[assignment]
        self.next_free: KVCacheBlock = None  # type: ignore[assignment]
        self.is_null = is_null
        # With events on: the record of the run that cached this block (see the comment above
        # _R_START; one tuple shared by the run's blocks) and the block's own logical index.
        # snapshot_events() re-announces tokens, parent and extra keys from the record: the
        # pool keeps the run's token slice, which the event needs anyway, rather than the
        # request's whole token list.
        self.origin: tuple[Any, ...] | None = None
        self.pos = 0

    @property
    def ext_hash(self) -> int | bytes | None:
        """The block's hash as its pool's events carry it (``hash_form``), None without a hash."""
        h = self.block_hash
        if h is None:
            return None
        return to_external(h, self.pool.hash_form if self.pool is not None else "int")

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h}, group={self.group_id})"


# Events are recorded compactly while the pool works and built (as the wire schema's
# structs, by keyword) only when someone takes them: take_events() converts every digest
# of the batch to its event form in one pass. The pending list holds, in order:
#
# * a digest (``bytes``): one GPU block of group 0 evicted, a ``BlockRemoved`` to be;
# * a stored record (a ``tuple``, layout below): a run of blocks cached, a ``BlockStored``;
# * a ready event struct (resets, other groups' evictions, offload tiers: rare).
#
# A stored record is ``(start, end, group, token_ids, digests, parent, lora_id, lora_name,
# extra_keys, session_id)``: logical blocks [start, end) of the request, their flat token
# slice and digests, the parent digest (None at block 0), and the request's per-block wire
# extra keys for [start, end) (None if it has none). Everything in it is copied out of the
# caller's lists during the call (slices), so the caller may change them afterwards. The
# request side a run is cached from travels as ``(token_ids, extra_keys, lora_id,
# lora_name, session_id)``.
_R_START, _R_END, _R_GROUP, _R_TOKENS, _R_DIGESTS, _R_PARENT = 0, 1, 2, 3, 4, 5
_R_LORA_ID, _R_LORA_NAME, _R_EXTRA, _R_SESSION = 6, 7, 8, 9


class FreeBlockQueue:
    """The free blocks in eviction order: an intrusive doubly linked list (LRU).

    Head = evicted first. Two sentinel blocks (ids -1/-2) make every link operation
    branch-free. ``num_free_blocks`` is the length (blocks).
    """

    __slots__ = ("head", "tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-2)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink and return the first ``n`` blocks (caller checked ``n <= len``)."""
        out: list[KVCacheBlock] = []
        if n <= 0:
            return out
        append = out.append
        blk = self.head.next_free
        for _ in range(n):
            append(blk)
            blk = blk.next_free  # the taken block's links go stale: never read while held
        self.head.next_free = blk
        blk.prev_free = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, blk: KVCacheBlock) -> None:
        """Unlink ``blk`` from anywhere in the queue (O(1))."""
        prev = blk.prev_free
        nxt = blk.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        self.num_free_blocks -= 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Append ``blocks`` at the tail, in order (the last one is evicted last)."""
        if not blocks:
            return
        tail = self.tail
        last = tail.prev_free
        for blk in blocks:
            last.next_free = blk
            blk.prev_free = last
            last = blk
        last.next_free = tail
        tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Insert ``blocks`` at the head, in order (the first one is evicted first)."""
        if not blocks:
            return
        head = self.head
        first = head.next_free
        prev = head
        for blk in blocks:
            prev.next_free = blk
            blk.prev_free = prev
            prev = blk
        prev.next_free = first
        first.prev_free = prev
        self.num_free_blocks += len(blocks)

    def blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (next evicted) first. O(n); for tests and snapshots."""
        out: list[KVCacheBlock] = []
        blk = self.head.next_free
        tail = self.tail
        while blk is not tail:
            out.append(blk)  # linked blocks up to the tail sentinel are never None
            blk = blk.next_free
        return out


class HashIndex:
    """One KV cache group's cached blocks by hash; duplicate physical copies allowed.

    vLLM never de-duplicates (block tables are append-only), so a hash can be cached in
    several blocks. ``first`` maps each hash to its oldest cached copy, the one a lookup
    returns; ``dups`` holds the younger copies of the few hashes that have them, oldest
    first. A lookup is one plain ``dict.get`` on ``first``; the per-block hot paths in
    :class:`BlockPool` use :meth:`insert`'s and :meth:`remove`'s common case inline
    (``first.setdefault`` / ``first.pop`` with ``dups`` empty) and call them otherwise.
    """

    __slots__ = ("first", "dups")

    def __init__(self) -> None:
        self.first: dict[bytes, KVCacheBlock] = {}
        self.dups: dict[bytes, list[KVCacheBlock]] = {}

    def __len__(self) -> int:
        """Distinct hashes cached."""
        return len(self.first)

    def get(self, block_hash: bytes) -> KVCacheBlock | None:
        """The oldest cached copy of ``block_hash``, or None."""
        return self.first.get(block_hash)

    def insert(self, block_hash: bytes, blk: KVCacheBlock) -> None:
        """Index ``blk`` under ``block_hash`` (after any copies already there)."""
        v = self.first.setdefault(block_hash, blk)
        if v is not blk:
            self.dups.setdefault(block_hash, []).append(blk)

    def remove(self, block_hash: bytes, blk: KVCacheBlock) -> None:
        """Drop ``blk``'s entry; the next-oldest copy, if any, becomes the first."""
        first = self.first
        more = self.dups.get(block_hash)
        if more is None:
            del first[block_hash]
        elif first[block_hash] is blk:
            first[block_hash] = more.pop(0)
            if not more:
                del self.dups[block_hash]
        else:
            more.remove(blk)
            if not more:
                del self.dups[block_hash]

    def copies(self, block_hash: bytes) -> list[KVCacheBlock]:
        """Every cached copy of ``block_hash``, oldest first."""
        blk = self.first.get(block_hash)
        if blk is None:
            return []
        return [blk, *self.dups.get(block_hash, ())]

    def clear(self) -> None:
        """Forget every hash (in place: managers keep a reference to ``first``)."""
        self.first.clear()
        self.dups.clear()


_is_block = partial(is_not, None)


def _foreign(blk: KVCacheBlock) -> BlockPoolError:
    return BlockPoolError(
        f"block {blk.block_id} belongs to another BlockPool (or none); a pool only takes back "
        "the blocks it handed out: pass each block to the pool it came from"
    )


class BlockPool:
    """vLLM's prefix-caching ``BlockPool``, with its events, sans-IO.

    Args:
        num_gpu_blocks: physical blocks, the null block included (so ``num_gpu_blocks - 1``
            are usable). At least 2.
        block_size: tokens per block (goes on ``BlockStored`` events).
        enable_caching: False turns prefix caching off: nothing is cached or found.
        enable_kv_cache_events: record events for :meth:`take_events`.
        hash_form: ``"int"`` (vLLM's default, low 64 bits) or ``"bytes"`` (raw digests) on events.
        medium: the ``medium`` of events (``"GPU"``).
        event_style: ``"0.33"`` fills vLLM 0.33's fields (``lora_name``, per-block
            ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind`` and the sliding window from
            ``kv_cache_event_metadata``); ``"0.11"`` only the fields vLLM 0.11 had.
        free_order: ``"v0.33"`` (default): blocks without a hash are put at the *head* of
            the free queue when freed (they are worthless to the cache, so they go first),
            hashed blocks at the tail. ``"v0.11"``: every freed block goes to the tail.
        kv_cache_event_metadata: one ``(spec_kind, sliding_window)`` per KV cache group;
            its length is the number of groups (group ids ``0..n-1``).
        release: a :class:`~kvstream.compat.VllmVersion` (or its name, ``"0.11"``) whose
            ``event_style`` and ``free_order`` apply where those are not given.

    Hot-path methods do no per-block allocation beyond the result lists.
    """

    __slots__ = ("num_gpu_blocks", "block_size", "enable_caching", "enable_kv_cache_events",
                 "hash_form", "medium", "event_style", "free_order", "kv_cache_event_metadata",
                 "blocks", "null_block", "free_block_queue", "_index", "_events",
                 "_v033", "_prepend_unhashed", "_gidx", "_int_hashes")

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int = 16,
        *,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = True,
        hash_form: HashForm = "int",
        medium: str = MEDIUM_GPU,
        event_style: EventStyle | None = None,
        free_order: FreeOrder | None = None,
        kv_cache_event_metadata: Sequence[tuple[str | None, int | None]] = DEFAULT_EVENT_METADATA,
        release: VllmVersion | str | None = None,
    ) -> None:
        rel = version(release) if isinstance(release, str) else release
        if event_style is None:
            event_style = rel.event_style if rel is not None else "0.33"
        if free_order is None:
            free_order = rel.free_order if rel is not None else "v0.33"
        if type(num_gpu_blocks) is not int or num_gpu_blocks < 2:
            raise BlockPoolError(
                f"num_gpu_blocks must be an int >= 2 (block 0 is the null block), got {num_gpu_blocks!r}"
            )
        if type(block_size) is not int or block_size <= 0:
            raise BlockPoolError(f"block_size must be a positive int (tokens), got {block_size!r}")
        if hash_form not in ("int", "bytes"):
            raise BlockPoolError(f"hash_form must be 'int' or 'bytes', got {hash_form!r}")
        if event_style not in ("0.33", "0.11"):
            raise BlockPoolError(f"event_style must be '0.33' or '0.11', got {event_style!r}")
        if free_order not in ("v0.33", "v0.11"):
            raise BlockPoolError(f"free_order must be 'v0.33' or 'v0.11', got {free_order!r}")
        # tuple(m) turns a caller's [kind, window] list into a pair (checked just below);
        # mypy only sees a variable-length tuple.
        meta: tuple[tuple[str | None, int | None], ...] = tuple(
            tuple(m) for m in kv_cache_event_metadata)  # type: ignore[misc]
        if not meta or any(len(m) != 2 for m in meta):
            raise BlockPoolError(
                "kv_cache_event_metadata needs one (spec_kind, sliding_window) pair per KV cache "
                f"group, e.g. (('full_attention', None),); got {kv_cache_event_metadata!r}"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.hash_form = hash_form
        self.medium = medium
        self.event_style = event_style
        self.free_order = free_order
        self.kv_cache_event_metadata = meta
        self.blocks = [KVCacheBlock(i, pool=self) for i in range(num_gpu_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self._index: list[HashIndex] = [HashIndex() for _ in meta]
        self._events: list[Any] = []
        self._v033 = event_style == "0.33"
        self._prepend_unhashed = free_order == "v0.33"
        # BlockRemoved.group_idx per group: the group id (0.33), or None, the default that
        # 0.11's events leave out.
        self._gidx = tuple(range(len(meta))) if self._v033 else (None,) * len(meta)
        self._int_hashes = hash_form == "int"

    # -- queries -----------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-but-free blocks included; null block excluded)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (null block excluded) held by requests, 0.0 to 1.0."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_gpu_blocks - 1)

    @property
    def num_groups(self) -> int:
        """Number of KV cache groups (group ids are ``0..num_groups-1``)."""
        return len(self._index)

    def lookup(self, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
        """The first cached copy of ``block_hash`` in ``group_id``, or None. Pure query."""
        return self._index[group_id].first.get(block_hash)

    def cached_prefix(self, block_hashes: Sequence[bytes], max_blocks: int | None = None,
                      kv_cache_group_id: int = 0) -> list[KVCacheBlock]:
        """The longest cached prefix of a hash chain: the first copy of each leading hash
        that is cached, stopping at the first miss, at most ``max_blocks`` (blocks). Pure
        query; one call per request instead of one :meth:`get_cached_block` per block."""
        get = self._index[kv_cache_group_id].first.get
        hs = block_hashes if max_blocks is None else block_hashes[:max_blocks]
        # map/takewhile run the loop in C: one dict lookup per hash, no Python frame.
        return list(takewhile(_is_block, map(get, hs)))  # type: ignore[arg-type]

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """vLLM's form: one cached block per group in ``kv_cache_group_ids``, or None if any
        group misses. With duplicates, the first copy cached is returned."""
        out = []
        index = self._index
        for g in kv_cache_group_ids:
            v = index[g].first.get(block_hash)
            if v is None:
                return None
            out.append(v)
        return out

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (head first). O(n)."""
        return [b.block_id for b in self.free_block_queue.blocks()]

    def cached_blocks(self) -> dict[tuple[bytes, int], list[int]]:
        """``{(digest, group): [block ids of its physical copies, first copy first]}``. O(n)."""
        out: dict[tuple[bytes, int], list[int]] = {}
        for g, idx in enumerate(self._index):
            for h in idx.first:
                out[(h, g)] = [b.block_id for b in idx.copies(h)]
        return out

    # -- allocation ----------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, ``ref_cnt`` 1 each.

        A taken block that was cached loses its hash here (lazy eviction), emitting one
        ``BlockRemoved`` per block, in queue order. Raises :class:`NoFreeBlocksError` if
        fewer than ``num_blocks`` are free (nothing changes).
        """
        if type(num_blocks) is not int:
            num_blocks = _block_count(num_blocks)
        q = self.free_block_queue
        if num_blocks > q.num_free_blocks or num_blocks < 0:
            if num_blocks < 0:
                raise BlockPoolError(f"num_blocks must be >= 0, got {num_blocks}")
            raise NoFreeBlocksError(
                f"asked for {num_blocks} blocks but only {q.num_free_blocks} are free; "
                "check get_num_free_blocks() before allocating, or free/preempt requests"
            )
        head = q.head
        blk = head.next_free
        if num_blocks == 1:
            # The decode path (a token starts a block): the loop below, unrolled.
            nxt = blk.next_free
            head.next_free = nxt
            nxt.prev_free = head
            q.num_free_blocks -= 1
            h = blk.block_hash
            if h is not None:
                idx0 = self._index[0]
                if blk.group_id or idx0.dups:
                    self._evict(blk, h)
                else:
                    del idx0.first[h]  # HashIndex.remove's common case
                    if self.enable_kv_cache_events:
                        self._events.append(h)
                blk.block_hash = None
                blk.origin = None
            blk.ref_cnt = 1
            return [blk]
        ret: list[KVCacheBlock] = []
        if not num_blocks:
            return ret
        append = ret.append
        # Group 0 without duplicate copies is the common case, inline (HashIndex.remove's
        # common case); anything else goes through _evict.
        idx0 = self._index[0]
        first0 = idx0.first
        dups0 = idx0.dups
        # A held block's queue links are stale and never read (only blocks with ref_cnt 0
        # are in the queue), so popping does not clear them: two stores less per block.
        if self.enable_kv_cache_events:
            # Two loops rather than one with an events test per block: this runs for every
            # block handed out, and most of them are evictions under churn.
            emit = self._events.append
            for _ in range(num_blocks):
                h = blk.block_hash
                if h is not None:
                    # Lazy eviction: the block leaves the index only now that it is reused.
                    if blk.group_id or dups0:
                        self._evict(blk, h)
                    else:
                        del first0[h]
                        emit(h)  # a BlockRemoved, built in take_events()
                    blk.block_hash = None
                    blk.origin = None
                blk.ref_cnt = 1
                append(blk)
                blk = blk.next_free
        else:
            for _ in range(num_blocks):
                h = blk.block_hash
                if h is not None:
                    if blk.group_id or dups0:
                        self._evict(blk, h)
                    else:
                        del first0[h]
                    blk.block_hash = None
                blk.ref_cnt = 1
                append(blk)
                blk = blk.next_free
        head.next_free = blk
        blk.prev_free = head
        q.num_free_blocks -= num_blocks
        return ret

    def _evict(self, blk: KVCacheBlock, h: bytes) -> None:
        """Drop ``blk``'s index entry (any group, duplicates too) and record its removal;
        the caller clears the block's hash."""
        g = blk.group_id
        idx = self._index[g]
        if idx.dups:
            idx.remove(h, blk)
        else:
            del idx.first[h]
        if self.enable_kv_cache_events:
            self._events.append(h if not g else self._removed_now(h, g))

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add a holder to each block (a prefix hit); a free one leaves the free queue.

        Emits nothing. Touching the null block or a block of another pool raises
        :class:`BlockPoolError` (nothing changes).
        """
        held = 0  # blocks already held (counted rather than the ones taken off the queue)
        for blk in blocks:
            if blk.pool is not self:
                self._undo_touch(blocks, blk)
            r = blk.ref_cnt
            if r:
                blk.ref_cnt = r + 1
                held += 1
                continue
            # The null block always has ref_cnt 0, so this test finds it without a
            # separate scan of every hit.
            if blk.is_null:
                self._undo_touch(blocks, blk)
            prev = blk.prev_free
            nxt = blk.next_free
            prev.next_free = nxt
            nxt.prev_free = prev
            blk.ref_cnt = 1
        self.free_block_queue.num_free_blocks -= len(blocks) - held

    def _undo_touch(self, blocks: Sequence[KVCacheBlock], bad: KVCacheBlock) -> None:
        """Put back what touch did before meeting a bad block, then raise."""
        done = list(blocks[:[i for i, b in enumerate(blocks) if b is bad][0]])
        # An unlinked block keeps its old links, so relinking in reverse order of removal
        # restores the queue exactly.
        for blk in reversed(done):
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                blk.prev_free.next_free = blk
                blk.next_free.prev_free = blk
        if bad.pool is not self:
            raise _foreign(bad)
        raise BlockPoolError(
            "cannot touch the null block (block 0): it is never cached or counted; "
            "leave it out of the blocks you touch"
        )

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one holder from each block; blocks reaching ``ref_cnt`` 0 enter the free queue.

        ``ordered_blocks`` is in eviction priority (first = evicted first): a request frees
        its blocks in reverse. Hashed blocks keep their hash (lazy eviction). With
        ``free_order="v0.33"`` blocks without a hash go to the queue's head (in the order
        given), hashed ones to the tail; with ``"v0.11"`` all go to the tail.

        Freeing the null block or a block nobody holds raises :class:`BlockPoolError`
        (nothing changes).
        """
        blocks = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        q = self.free_block_queue
        tail = q.tail
        old_last = last = tail.prev_free
        # No per-block index or count: blocks still held are counted (the rarer case), the
        # linked ones follow from it, and a bad entry's index is recovered on the error path.
        kept = 0
        unhashed: list[KVCacheBlock] | None = None
        if self._prepend_unhashed:
            unhashed = []
            for blk in blocks:
                if blk.pool is not self:
                    self._undo_free(blocks, old_last, last, kept, unhashed)
                r = blk.ref_cnt
                if r > 1:
                    blk.ref_cnt = r - 1
                    kept += 1
                    continue
                if r <= 0:  # the null block's ref_cnt is always 0: one test catches both misuses
                    self._undo_free(blocks, old_last, last, kept, unhashed)
                blk.ref_cnt = 0
                if blk.block_hash is None:
                    unhashed.append(blk)
                    continue
                last.next_free = blk
                blk.prev_free = last
                last = blk
            n = len(blocks) - kept - len(unhashed)
        else:
            # free_order "v0.11": the same loop, every block to the tail.
            for blk in blocks:
                if blk.pool is not self:
                    self._undo_free(blocks, old_last, last, kept, None)
                r = blk.ref_cnt
                if r > 1:
                    blk.ref_cnt = r - 1
                    kept += 1
                    continue
                if r <= 0:
                    self._undo_free(blocks, old_last, last, kept, None)
                blk.ref_cnt = 0
                last.next_free = blk
                blk.prev_free = last
                last = blk
            n = len(blocks) - kept
        if n:
            last.next_free = tail
            tail.prev_free = last
            q.num_free_blocks += n
        if unhashed:
            q.prepend_n(unhashed)

    def _undo_free(self, blocks: list[KVCacheBlock], old_last: KVCacheBlock, last: KVCacheBlock, kept: int,
                   unhashed: list[KVCacheBlock] | None) -> None:
        """Put back what free_blocks did before meeting a bad entry, then raise.

        The entries before the bad one were each kept (still held), linked after
        ``old_last`` up to ``last``, or put aside as unhashed: their count is its index.
        """
        linked = 0
        blk = old_last
        while blk is not last:
            blk = blk.next_free
            linked += 1
        failed_at = kept + linked + (len(unhashed) if unhashed is not None else 0)
        old_last.next_free = self.free_block_queue.tail
        for done in blocks[:failed_at]:
            done.ref_cnt += 1  # a block linked by this call is unlinked again above
        bad = blocks[failed_at]
        if bad.pool is not self:
            raise _foreign(bad)
        if bad.is_null:
            raise BlockPoolError(
                "cannot free the null block (block 0): it is never allocated; "
                "leave it out of the blocks you free"
            )
        raise BlockPoolError(
            f"block {bad.block_id} is already free (ref_cnt 0): double free; "
            "each holder must free a block exactly once"
        )

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] | None = None,
        kv_cache_group_id: int = 0,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        session_id: str | None = None,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        Args:
            blocks: the request's blocks in logical order.
            block_hashes: the request's logical hash chain (digests), at least
                ``num_full_blocks`` long; block ``i`` is cached under ``block_hashes[i]``.
            num_cached_blocks, num_full_blocks: the run to cache (blocks).
            token_ids: the request's tokens (at least ``num_full_blocks * block_size``),
                needed only with events on.
            kv_cache_group_id: the group the blocks belong to.
            lora_id, lora_name: the request's LoRA, for the event.
            extra_keys: the request's per-block wire extra keys (``BlockStored.extra_keys``
                entries, indexed like ``block_hashes``), or None.
            session_id: the request's session (vLLM 0.33's ``BlockStored.session_id``), or None.

        Emits one ``BlockStored`` for the run; its parent is ``block_hashes[num_cached_blocks
        - 1]`` (None when the run starts at block 0). A block that already holds this very
        hash is left as it is (not re-announced); one holding a *different* hash raises
        :class:`BlockPoolError` before anything changes. The lists are only read during
        the call: what the event and :meth:`snapshot_events` need later is copied out.
        """
        src = ((token_ids, extra_keys, lora_id, lora_name, session_id)
               if self.enable_kv_cache_events else None)
        self._check_run(blocks, block_hashes, token_ids, num_cached_blocks, num_full_blocks, kv_cache_group_id)
        if num_cached_blocks < num_full_blocks and self.enable_caching:
            self._cache_run(blocks, block_hashes, num_cached_blocks, num_full_blocks, kv_cache_group_id, src)

    def cache_blocks_of(self, source: Any, num_cached_blocks: int, num_full_blocks: int,
                        kv_cache_group_id: int = 0) -> None:
        """:meth:`cache_full_blocks` for an object that carries the request's lists.

        ``source`` needs the attributes ``blocks``, ``block_hashes``, ``token_ids``,
        ``extra_keys``, ``lora_id``, ``lora_name`` and ``session_id`` (as
        :class:`kvstream.allocator.manager.KVRequest` has); it is read during the call only.
        """
        blocks = source.blocks
        hashes = source.block_hashes
        tokens = source.token_ids
        if not (0 <= num_cached_blocks <= num_full_blocks <= len(blocks) and num_full_blocks <= len(hashes)
                and 0 <= kv_cache_group_id < len(self._index) and tokens is not None
                and len(tokens) >= num_full_blocks * self.block_size):
            # Something is off (or token_ids is short with events off, which is allowed):
            # the full check raises with the reason, or lets it pass.
            self._check_run(blocks, hashes, tokens, num_cached_blocks, num_full_blocks, kv_cache_group_id)
        if num_cached_blocks < num_full_blocks and self.enable_caching:
            self._cache_run(blocks, hashes, num_cached_blocks, num_full_blocks, kv_cache_group_id,
                            (tokens, source.extra_keys, source.lora_id, source.lora_name, source.session_id)
                            if self.enable_kv_cache_events else None)

    def _check_run(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                   token_ids: Sequence[int] | None, nc: int, nf: int, g: int) -> None:
        if 0 <= nc <= nf <= len(blocks) and nf <= len(block_hashes) and 0 <= g < len(self._index) and (
            token_ids is not None and len(token_ids) >= nf * self.block_size
            or not self.enable_kv_cache_events
        ):
            return
        if not 0 <= nc <= nf:
            raise BlockPoolError(f"need 0 <= num_cached_blocks <= num_full_blocks, got {nc} and {nf}")
        if nf > len(blocks) or nf > len(block_hashes):
            raise BlockPoolError(
                f"cannot cache blocks [{nc}, {nf}): the request has {len(blocks)} blocks and "
                f"{len(block_hashes)} block hashes; hash a block's tokens before caching it"
            )
        if not 0 <= g < len(self._index):
            raise BlockPoolError(
                f"kv_cache_group_id {g} is out of range: this pool has "
                f"{len(self._index)} group(s) (set kv_cache_event_metadata for more)"
            )
        raise BlockPoolError(
            f"caching blocks [{nc}, {nf}) with events on needs token_ids of at least "
            f"{nf * self.block_size} tokens, got {None if token_ids is None else len(token_ids)}"
        )

    def _cache_run(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes], nc: int, nf: int,
                   g: int, src: Any) -> None:
        """Cache blocks [nc, nf) (arguments already checked).

        ``src`` is the request side for the event (see ``_R_START``); None with events off.
        """
        idx = self._index[g]
        first = idx.first
        if nf - nc == 1:
            # The decode path: one block completed. Same steps as the loop below, unrolled.
            blk = blocks[nc]
            if blk.block_hash is None and blk.ref_cnt > 0 and blk.pool is self:
                h = block_hashes[nc]
                blk.block_hash = h
                blk.group_id = g
                if first.setdefault(h, blk) is not blk:  # HashIndex.insert's common case
                    idx.dups.setdefault(h, []).append(blk)
                if src is not None:
                    rec = self._record(nc, nf, g, src, block_hashes)
                    blk.origin = rec
                    blk.pos = nc
                    self._events.append(rec)
                return
        setdefault = first.setdefault
        skip: list[int] | None = None
        i = nc
        # One pass; a bad block found midway undoes the blocks before it, so a failed call
        # still changes nothing.
        if src is None:
            for blk, h in zip(blocks[nc:nf], block_hashes[nc:nf]):
                if blk.block_hash is not None or blk.ref_cnt <= 0 or blk.pool is not self:
                    if self._cache_conflict(blocks, block_hashes, nc, i, g, skip):
                        if skip is None:
                            skip = []
                        skip.append(i)
                        i += 1
                        continue
                blk.block_hash = h
                blk.group_id = g
                if setdefault(h, blk) is not blk:
                    idx.dups.setdefault(h, []).append(blk)
                i += 1
            return
        # Events on. Blocks point at the run's record (see KVCacheBlock.origin); it is
        # recorded only if the whole run succeeds.
        rec = self._record(nc, nf, g, src, block_hashes)
        for blk, h in zip(blocks[nc:nf], block_hashes[nc:nf]):
            if blk.block_hash is not None or blk.ref_cnt <= 0 or blk.pool is not self:
                if self._cache_conflict(blocks, block_hashes, nc, i, g, skip):
                    if skip is None:
                        skip = []
                    skip.append(i)
                    i += 1
                    continue
            blk.block_hash = h
            blk.group_id = g
            if setdefault(h, blk) is not blk:
                idx.dups.setdefault(h, []).append(blk)
            blk.origin = rec
            blk.pos = i
            i += 1
        if skip is None:
            self._events.append(rec)
            return
        # Blocks that already held their hash split the run: one event per sub-run.
        start = nc
        for i in skip + [nf]:
            if i > start:
                sub = self._record(start, i, g, src, block_hashes)
                for blk in blocks[start:i]:
                    blk.origin = sub
                self._events.append(sub)
            start = i + 1

    def _cache_conflict(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes], nc: int,
                        i: int, g: int, skip: list[int] | None) -> bool:
        """Block ``i`` cannot simply be cached: True if it already holds this very hash (skip
        it); otherwise undo blocks ``nc..i-1`` and raise."""
        blk = blocks[i]
        if blk.pool is self and blk.ref_cnt > 0 and blk.block_hash == block_hashes[i] and blk.group_id == g:
            return True
        idx = self._index[g]
        done = set(skip or ())
        for j in range(nc, i):
            if j in done:
                continue
            b = blocks[j]
            assert b.block_hash is not None  # cached by this very call
            idx.remove(b.block_hash, b)
            b.block_hash = None
            b.origin = None
        if blk.pool is not self:
            raise _foreign(blk)
        if blk.is_null:
            raise BlockPoolError(f"block {i} of the run is the null block; it is never cached")
        if blk.ref_cnt <= 0:
            raise BlockPoolError(
                f"block {blk.block_id} is free (ref_cnt 0); only held blocks can be cached"
            )
        held = blk.block_hash.hex()[:16] if blk.block_hash is not None else None
        raise BlockPoolError(
            f"block {blk.block_id} already holds hash {held}… "
            f"(group {blk.group_id}); cannot cache it as {block_hashes[i].hex()[:16]}… "
            f"(group {g}); a block is cached once, under one hash"
        )

    def _record(self, start: int, end: int, g: int, src: Any, block_hashes: Sequence[bytes]) -> tuple[Any, ...]:
        """The stored record (see the comment above ``_R_START``) of logical blocks [start, end)."""
        bs = self.block_size
        # One slice of the request's own token list: the run's tokens, already flat.
        tok = src[0][start * bs:end * bs]
        if type(tok) is not list:
            tok = tok.tolist() if type(tok) is array else list(tok)
        ek = src[1]
        return (start, end, g, tok, block_hashes[start:end], block_hashes[start - 1] if start else None,
                src[2], src[3], None if ek is None else ek[start:end], src[4])

    def _removed_now(self, digest: bytes, g: int) -> BlockRemoved:
        """The ``BlockRemoved`` of a GPU block of group ``g`` (built at once: groups other
        than 0 are rare, and the pending list keeps only group 0's as bare digests)."""
        return BlockRemoved(block_hashes=[to_external(digest, self.hash_form)], medium=self.medium,
                            group_idx=self._gidx[g])

    def _stored_event(self, rec: tuple[Any, ...], ext: list[Any], parent: Any) -> BlockStored:
        """The ``BlockStored`` of a stored record whose digests' event forms are ``ext``."""
        g = rec[_R_GROUP]
        if not self._v033:
            return BlockStored(block_hashes=ext, parent_block_hash=parent, token_ids=rec[_R_TOKENS],
                               block_size=self.block_size, lora_id=rec[_R_LORA_ID], medium=self.medium,
                               lora_name=None)
        ek = rec[_R_EXTRA]
        # The schema types each entry as a tuple (what a decoder yields); the hasher's wire
        # form is a list.
        extra: list[tuple[Any, ...] | None] = (
            [None if e is None else tuple(e) for e in ek] if ek is not None else [None] * len(ext))
        kind, window = self.kv_cache_event_metadata[g]
        return BlockStored(block_hashes=ext, parent_block_hash=parent, token_ids=rec[_R_TOKENS],
                           block_size=self.block_size, lora_id=rec[_R_LORA_ID], medium=self.medium,
                           lora_name=rec[_R_LORA_NAME], extra_keys=extra, group_idx=g,
                           kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
                           session_id=rec[_R_SESSION])

    def _build_events(self, pending: list[Any]) -> list[Any]:
        """The events of the pending records, in order (see the comment above ``_R_START``)."""
        # Every digest the batch carries, in order, converted to the event form in one pass.
        digests: list[bytes] = []
        add = digests.append
        more = digests.extend
        for r in pending:
            t = type(r)
            if t is bytes:
                add(r)
            elif t is tuple:
                more(r[_R_DIGESTS])
                if r[_R_PARENT] is not None:
                    add(r[_R_PARENT])
            elif not isinstance(r, KVCacheEvent):
                add(r)  # a digest of a bytes subclass
        ext: list[Any] = to_external_list(digests, self.hash_form)
        out: list[Any] = []
        append = out.append
        removed = BlockRemoved
        medium = self.medium
        g0 = self._gidx[0]
        j = 0
        for r in pending:
            t = type(r)
            if t is tuple:
                k = j + len(r[_R_DIGESTS])
                if r[_R_PARENT] is not None:
                    append(self._stored_event(r, ext[j:k], ext[k]))
                    j = k + 1
                else:
                    append(self._stored_event(r, ext[j:k], None))
                    j = k
            elif t is bytes or not isinstance(r, KVCacheEvent):
                append(removed(block_hashes=[ext[j]], medium=medium, group_idx=g0))
                j += 1
            else:
                append(r)
        return out

    def announce_cached_prefix(self, source: Any, num_blocks: int, kv_cache_group_id: int = 0) -> None:
        """Re-announce the first ``num_blocks`` blocks of ``source`` as one ``BlockStored``.

        vLLM 0.33's ``kv_cache_report_mode="full"``: a request's prefix-cache hits are
        announced again (parent None, their tokens, extra keys and session), without any
        change to the pool, so a consumer learns which cached blocks the request reuses.
        ``source`` is read as by :meth:`cache_blocks_of` (its ``blocks`` are not used).
        Emits nothing with events off or for ``num_blocks == 0``.
        """
        if not self.enable_kv_cache_events or num_blocks <= 0:
            return
        hashes = source.block_hashes
        if not 0 <= kv_cache_group_id < len(self._index) or num_blocks > len(hashes) or (
                len(source.token_ids) < num_blocks * self.block_size):
            raise BlockPoolError(
                f"cannot announce {num_blocks} cached blocks in group {kv_cache_group_id}: the "
                f"request has {len(hashes)} hashes and {len(source.token_ids)} tokens; the pool "
                f"has {len(self._index)} group(s)"
            )
        src = (source.token_ids, source.extra_keys, source.lora_id, source.lora_name, source.session_id)
        self._events.append(self._record(0, num_blocks, kv_cache_group_id, src, hashes))

    def offload_events(self, medium: str, *, stored: Sequence[bytes] = (), removed: Sequence[bytes] = (),
                       group_idx: int | None = 0) -> None:
        """Record a KV connector's events for another tier (``medium``, e.g. ``"CPU"``).

        vLLM 0.33's offloading connector reports, after the GPU pool's events of a step, one
        ``BlockRemoved`` carrying every hash the tier evicted and one placeholder
        ``BlockStored`` per hash it stored (no tokens, ``block_size`` 0, no parent): that
        is the shape recorded here, removals first if both are given. ``stored`` and
        ``removed`` are digests; they take the pool's ``hash_form``. The pool's own blocks
        are not touched.
        """
        if not isinstance(medium, str) or not medium:
            raise BlockPoolError(f"medium must be a non-empty str such as 'CPU', got {medium!r}")
        if not self.enable_kv_cache_events:
            return
        form = self.hash_form
        if removed:
            gone: list[Any] = to_external_list(removed, form)
            self._events.append(BlockRemoved(block_hashes=gone, medium=medium, group_idx=group_idx))
        for e in to_external_list(stored, form):
            self._events.append(BlockStored(
                block_hashes=[e], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                medium=medium, lora_name=None, group_idx=group_idx))

    # -- cache-wide operations --------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, if no block is held: emits one ``AllBlocksCleared``, returns True.

        With any block in use it returns False and changes and emits nothing. The free
        queue's order is kept; blocks that had hashes are later reused without a
        ``BlockRemoved``.
        """
        if self.free_block_queue.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        for blk in self.blocks:
            blk.block_hash = None
            blk.origin = None
        for idx in self._index:
            idx.clear()
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[Any]:
        """The events recorded since the last call, in order (and forget them).

        The pool records compactly as it works and builds the event structs here, so the
        cost of events lands on the step that takes them. Treat the events as read-only
        values: a ``BlockStored``'s ``token_ids`` list is shared with the pool's record of
        the run while any of its blocks is cached (:meth:`snapshot_events` re-announces
        tokens from it).
        """
        pending = self._events
        if not pending:
            return []
        self._events = []
        return self._build_events(pending)

    def snapshot_events(self) -> list[Any]:
        """Events that rebuild the current cached state from scratch.

        ``[AllBlocksCleared(), BlockStored...]``: one ``BlockStored`` per physical cached
        block (duplicates included), shallower blocks first so parents precede children.
        Pending events (not yet taken) are not included and not consumed: take them first
        so the snapshot follows the last batch. Needs events on (raises otherwise).
        """
        if not self.enable_kv_cache_events:
            raise BlockPoolError(
                "snapshot_events() needs enable_kv_cache_events=True: the pool keeps the "
                "tokens and parents of cached blocks only when events are on"
            )
        cached = [b for b in self.blocks if b.block_hash is not None]
        cached.sort(key=lambda b: (b.pos, b.block_id))
        out: list[Any] = [AllBlocksCleared()]
        form = self.hash_form
        bs = self.block_size
        for blk in cached:
            rec = blk.origin  # set whenever a block is cached with events on
            assert rec is not None and blk.block_hash is not None
            k = blk.pos - rec[_R_START]  # the block's place in the run its record holds
            parent = rec[_R_PARENT] if k == 0 else rec[_R_DIGESTS][k - 1]
            ek = rec[_R_EXTRA]
            one = (blk.pos, blk.pos + 1, rec[_R_GROUP], rec[_R_TOKENS][k * bs:(k + 1) * bs],
                   [blk.block_hash], parent, rec[_R_LORA_ID], rec[_R_LORA_NAME],
                   None if ek is None else [ek[k]], rec[_R_SESSION])
            out.append(self._stored_event(one, [to_external(blk.block_hash, form)],
                                          None if parent is None else to_external(parent, form)))
        return out

    # -- checking --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify the pool's internal consistency; raise :class:`BlockPoolError` if broken.

        Every non-null block is in the free queue with ``ref_cnt`` 0 or held with
        ``ref_cnt`` > 0, never both; the queue's links and count agree; the index holds
        exactly the blocks that have hashes. O(num blocks); for tests.
        """
        q = self.free_block_queue
        queued = q.blocks()
        ids = [b.block_id for b in queued]
        if len(set(ids)) != len(ids) or len(ids) != q.num_free_blocks:
            raise BlockPoolError(f"free queue corrupt: {len(ids)} linked, count {q.num_free_blocks}")
        prev = q.head
        for b in queued:
            if b.prev_free is not prev:
                raise BlockPoolError(f"free queue back-link of block {b.block_id} is wrong")
            prev = b
        in_queue = set(ids)
        if self.null_block.block_id in in_queue or self.null_block.block_hash is not None:
            raise BlockPoolError("the null block is queued or cached")
        if any(b.pool is not self for b in self.blocks):
            raise BlockPoolError("a block of another pool is in this pool's block list")
        for b in self.blocks[1:]:
            if b.block_id in in_queue:
                if b.ref_cnt != 0:
                    raise BlockPoolError(f"block {b.block_id} is queued with ref_cnt {b.ref_cnt}")
            elif b.ref_cnt <= 0:
                raise BlockPoolError(f"block {b.block_id} is neither queued nor held")
        indexed = set()
        for g, idx in enumerate(self._index):
            if not set(idx.dups) <= set(idx.first) or not all(idx.dups.values()):
                raise BlockPoolError(f"group {g}: duplicate copies listed without a first copy (or empty)")
            for h in idx.first:
                copies = idx.copies(h)
                if len({b.block_id for b in copies}) != len(copies):
                    raise BlockPoolError(f"index lists block copies of {h.hex()[:16]} twice")
                for b in copies:
                    if b.block_hash != h or b.group_id != g:
                        raise BlockPoolError(f"index maps {h.hex()[:16]}/g{g} to block {b.block_id} "
                                             f"holding another hash")
                    indexed.add(b.block_id)
        hashed = {b.block_id for b in self.blocks if b.block_hash is not None}
        if hashed != indexed:
            raise BlockPoolError(f"hashed blocks {sorted(hashed ^ indexed)} are not indexed (or vice versa)")
