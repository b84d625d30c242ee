"""Request-level KV cache management over a :class:`~kvstream.allocator.pool.BlockPool`.

vLLM's ``KVCacheManager`` for one full-attention KV cache group, sans-IO: the engine's
scheduler decides *what* runs; this module says whether it fits and which blocks it gets.

A request's life::

    req = manager.new_request("r1", prompt_token_ids)   # hashes the prompt; no pool change
    if manager.admit(req):                               # prefix hit + slots for the prompt
        ...
        manager.decode(req, token_id)                    # one output token, one slot
        ...
    manager.free(req)                                    # finished or preempted

* :meth:`KVCacheManager.admit` finds the longest cached prefix of the prompt (at most
  ``num_tokens - 1`` tokens, so the last token is always computed), then allocates slots
  for ``num_new_tokens`` (default: the rest of the prompt; less for a chunked prefill)
  and caches the blocks that became full.
* :meth:`KVCacheManager.allocate` adds the next prefill chunk of a running request.
* :meth:`KVCacheManager.decode` appends one token, allocating a block when it starts one
  and caching a block when it completes one; :meth:`KVCacheManager.decode_many` appends
  several as that many decodes would (all or nothing).
* An allocation that does not fit returns False and changes nothing: not the pool, not
  the request (so the engine can preempt someone and retry).
* :meth:`KVCacheManager.free` releases the blocks in reverse order (tail evicted first).

Per-request state is a small ``__slots__`` object: token ids, block hashes, blocks and
two counters.
"""

from __future__ import annotations

import marshal
import operator
from array import array
from collections import deque
from typing import Any, Iterable, Sequence

from kvstream.compat import VllmVersion, version
from kvstream.errors import LocalProtocolError
from kvstream.hashing import BlockHasher, LoRA, MMItem, RequestBlockHasher
from kvstream.allocator.prefix_stats import PrefixCacheStats, PrefixCachingMetrics
from kvstream.allocator.pool import BlockPool, KVCacheBlock

__all__ = ["KVCacheManager", "KVRequest", "KVCacheManagerError"]


class KVCacheManagerError(LocalProtocolError, ValueError):
    """A bad call to the manager (admitting twice, decoding before the prefill finished,
    more new tokens than the request has, a token id that cannot go on the wire, a request
    id already running, ...). Raised before anything changed."""


_WIRE_TOKEN_LIMIT = 1 << 64  # token ids travel as msgpack unsigned ints: [0, 2**64)


def _int_token(t: Any) -> Any:
    """An integer token id of another type (numpy's int64, ...) as an ``int``; anything
    else (a bool, a float, a str) unchanged, for the caller's check to refuse."""
    if type(t) is int or isinstance(t, bool):
        return t
    try:
        return operator.index(t)
    except TypeError:
        return t


def _check_token_ids(request_id: Any, token_ids: list[Any]) -> list[Any]:
    """``token_ids`` as exact ints in [0, 2**64), or raise :class:`KVCacheManagerError`.

    Integers of other types (numpy's int64, what a tokenizer returning arrays gives) are
    ids too: they come back as ``int`` s (hashers and the wire take only those). A
    ``marshal`` pass (C-level) tells a list of exact ints from one holding others.

    One C-level pass (``array('Q').fromlist``, ~3 ns per id; building the array from the
    list instead goes through the generic iterator path, ~5 ns) in the common case; the
    slow scan only names the bad id. ``True``/``False`` pass that pass as 1/0 and are not
    looked for (that would cost a Python-level type test per id);
    :meth:`KVCacheManager.decode` refuses them.
    """
    try:
        array("Q").fromlist(token_ids)
    except (TypeError, OverflowError):
        pass
    else:
        m = marshal.dumps(token_ids, 2)
        n = len(token_ids)
        if len(m) == 5 + 5 * n and m[5::5] == b"i" * n:
            return token_ids  # every id an exact int below 2**31 (see kvstream.hashing.blocks)
        # Integers of other types, or ids >= 2**31: as exact ints (a C-level pass).
        return array("Q", token_ids).tolist()
    for i, t in enumerate(token_ids):
        if type(t) is not int or not 0 <= t < _WIRE_TOKEN_LIMIT:
            raise KVCacheManagerError(
                f"request {request_id!r}: token id {t!r} ({type(t).__name__}) at position {i} cannot "
                "go on the wire; token ids are ints in [0, 2**64), as the tokenizer gives them"
            )
    return token_ids


class KVRequest:
    """One request's KV cache state (create it with :meth:`KVCacheManager.new_request`).

    Attributes:
        request_id: the engine's id (any hashable; a str usually).
        token_ids: every token so far, prompt then outputs (the manager appends to it): a
            list, or an ``array('I')`` when the prompt was given as one.
        block_hashes: digests of every full block the manager has hashed so far.
        blocks: the physical blocks held, in logical order (empty when not admitted).
        num_computed_tokens: tokens with KV slots allocated (tokens).
        num_cached_blocks: leading blocks already cached (blocks).
        num_prefix_hit_tokens: tokens found in the prefix cache at the last admission.
        lora: the request's LoRA adapter, or None.
        session_id: put on every ``BlockStored`` of the request (vLLM 0.33), or None.
        report_full: ``kv_cache_report_mode="full"``: every admission attempt re-announces
            the request's prefix-cache hits (see :meth:`KVCacheManager.admit`).
    """

    __slots__ = ("request_id", "token_ids", "block_hashes", "extra_keys", "hasher", "blocks",
                 "num_computed_tokens", "num_cached_blocks", "num_prefix_hit_tokens", "lora",
                 "lora_id", "lora_name", "running", "session_id", "report_full")

    def __init__(self, request_id: Any, token_ids: list[int], hasher: RequestBlockHasher | None,
                 block_hashes: list[bytes], lora: LoRA | None, session_id: str | None = None,
                 report_full: bool = False) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.hasher = hasher
        self.block_hashes = block_hashes
        self.extra_keys = hasher.wire_extra_keys if hasher is not None and not hasher.keys.empty else None
        self.blocks: list[KVCacheBlock] = []
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0
        self.num_prefix_hit_tokens = 0
        self.lora = lora
        self.lora_id = lora.int_id if lora is not None else None
        self.lora_name = lora.name if lora is not None else None
        self.running = False
        self.session_id = session_id
        self.report_full = report_full

    @property
    def num_tokens(self) -> int:
        """Tokens so far (prompt + outputs)."""
        return len(self.token_ids)

    @property
    def block_ids(self) -> list[int]:
        """Ids of the blocks held, in logical order (the request's block table)."""
        return [b.block_id for b in self.blocks]

    def __repr__(self) -> str:
        return (f"KVRequest({self.request_id!r}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")


class KVCacheManager:
    """Admits, grows and frees requests on a :class:`BlockPool` (one KV cache group).

    Args:
        pool: the block pool (its ``block_size`` must equal the hasher's).
        hasher: how prompts are hashed; default ``BlockHasher("sha256_cbor", pool.block_size)``
            (vLLM's default algorithm; the root follows PYTHONHASHSEED, see
            :func:`kvstream.hashing.none_hash`). Its ``extra_key_style`` picks 0.11 or 0.33
            extra keys (salt, LoRA, multimodal).
        kv_cache_group_id: the pool group this manager's blocks belong to.
        reserve_full_prompt: admit a request only if its *whole* prompt fits, even when
            this step schedules only a chunk of it (vLLM 0.33's default,
            ``scheduler_reserve_full_isl=True``). False: only the scheduled chunk must fit
            (vLLM 0.11). Default: the release's, else True.
        max_recent_requests: window of :attr:`metrics` (requests).
        release: a :class:`~kvstream.compat.VllmVersion` (or its name) giving the defaults
            of ``hasher`` (its hash rules and extra-key style) and ``reserve_full_prompt``.

    Attributes: ``pool``, ``hasher``, ``requests`` (running requests by id), ``stats``
    (cumulative :class:`PrefixCacheStats`), ``metrics`` (:class:`PrefixCachingMetrics`
    over the most recent requests).
    """

    __slots__ = ("pool", "hasher", "kv_cache_group_id", "reserve_full_prompt", "requests",
                 "stats", "_metrics", "_recent", "_bs", "_queue", "_step_stats")

    def __init__(
        self,
        pool: BlockPool,
        hasher: BlockHasher | None = None,
        *,
        kv_cache_group_id: int = 0,
        reserve_full_prompt: bool | None = None,
        max_recent_requests: int = 1000,
        release: VllmVersion | str | None = None,
    ) -> None:
        rel = version(release) if isinstance(release, str) else release
        if reserve_full_prompt is None:
            reserve_full_prompt = rel.reserve_full_prompt if rel is not None else True
        if hasher is None:
            hasher = (rel.hasher("sha256_cbor", pool.block_size) if rel is not None
                      else BlockHasher("sha256_cbor", pool.block_size))
        if hasher.block_size != pool.block_size:
            raise KVCacheManagerError(
                f"the hasher hashes blocks of {hasher.block_size} tokens but the pool's blocks hold "
                f"{pool.block_size}; build both with the same block_size"
            )
        if not 0 <= kv_cache_group_id < pool.num_groups:
            raise KVCacheManagerError(
                f"kv_cache_group_id {kv_cache_group_id} is out of range: the pool has "
                f"{pool.num_groups} group(s)"
            )
        self.pool = pool
        self.hasher = hasher
        self.kv_cache_group_id = kv_cache_group_id
        self.reserve_full_prompt = reserve_full_prompt
        self.requests: dict[Any, KVRequest] = {}
        self.stats = PrefixCacheStats()
        self._metrics = PrefixCachingMetrics(max_recent_requests)
        # Admission attempts not yet folded into the window, as (queries, hits), the newest
        # max_recent_requests at most: an append per admission, and the window is brought up
        # to date when someone reads it (vLLM keeps its window in its stats logger, off the
        # engine loop).
        self._recent: deque[tuple[int, int]] = deque(maxlen=max_recent_requests)
        self._step_stats = PrefixCacheStats()
        self._bs = pool.block_size
        self._queue = pool.free_block_queue

    # -- requests ----------------------------------------------------------------------

    def new_request(
        self,
        request_id: Any,
        prompt_token_ids: Iterable[int],
        *,
        lora: LoRA | None = None,
        mm_items: Iterable[MMItem] = (),
        cache_salt: str | None = None,
        block_hashes: Sequence[bytes] | None = None,
        session_id: str | None = None,
        kv_cache_report_mode: str | None = None,
    ) -> KVRequest:
        """A request's state with its prompt hashed; the pool is not touched.

        ``session_id`` goes on the request's ``BlockStored`` events (vLLM 0.33);
        ``kv_cache_report_mode="full"`` (vLLM 0.33's per-request ``extra_args`` setting)
        makes every admission attempt re-announce the prefix-cache hits; None or
        ``"delta"`` announce only newly cached blocks.

        ``block_hashes``: precomputed digests of the prompt's full blocks (e.g. hashed once
        for many simulated engines); then the request has no hasher, and blocks completed
        by later tokens can only be cached if the list already holds their hashes (give
        the whole prompt+output chain up front, or pass None to hash here).
        """
        if request_id in self.requests:
            raise KVCacheManagerError(
                f"request id {request_id!r} is already running in this manager; free() it first "
                "or give the new request its own id"
            )
        if type(prompt_token_ids) is array and prompt_token_ids.typecode == "I":
            # Kept as an array('I') copy (one memcpy; no int objects, nothing for the cycle
            # collector): long simulated prompts are given this way.
            tokens: Any = prompt_token_ids[:]
        else:
            try:
                tokens = list(prompt_token_ids)
            except TypeError:
                raise KVCacheManagerError(
                    f"request {request_id!r}: the prompt must be an iterable of token ids, got "
                    f"{type(prompt_token_ids).__name__}"
                ) from None
            tokens = _check_token_ids(request_id, tokens)
        if not tokens:
            raise KVCacheManagerError(f"request {request_id!r} has an empty prompt; give at least one token")
        if kv_cache_report_mode not in (None, "delta", "full"):
            raise KVCacheManagerError(
                f"kv_cache_report_mode must be None, 'delta' or 'full', got {kv_cache_report_mode!r}")
        if session_id is not None and not isinstance(session_id, str):
            raise KVCacheManagerError(f"session_id must be a str or None, got {type(session_id).__name__}")
        full = kv_cache_report_mode == "full"
        if block_hashes is not None:
            if lora is not None or cache_salt or tuple(mm_items):
                raise KVCacheManagerError(
                    "with precomputed block_hashes the extra keys (lora, mm_items, cache_salt) are "
                    "already in the hashes; pass lora only via new_request without block_hashes"
                )
            return KVRequest(request_id, tokens, None, list(block_hashes), None, session_id, full)
        rh = RequestBlockHasher(self.hasher, lora=lora, mm_items=mm_items, cache_salt=cache_salt)
        rh.extend(tokens)
        return KVRequest(request_id, tokens, rh, rh.block_hashes, lora, session_id, full)

    def get_computed_blocks(self, request: KVRequest) -> list[KVCacheBlock]:
        """The longest cached prefix of ``request`` (blocks), capped at ``num_tokens - 1``
        tokens so the last prompt token is always computed. Pure query."""
        return self.pool.cached_prefix(request.block_hashes, (len(request.token_ids) - 1) // self._bs,
                                       self.kv_cache_group_id)

    def admit(self, request: KVRequest, num_new_tokens: int | None = None, *, cache: bool = True) -> bool:
        """Start ``request``: reuse its cached prefix and allocate slots for the next tokens.

        ``num_new_tokens`` (tokens) is what this step computes after the cached prefix;
        default all the rest of the prompt. Returns False (nothing changed, except the
        prefix-cache statistics, as in vLLM) if the blocks do not fit.

        ``cache=False`` allocates without caching the blocks that became full; call
        :meth:`cache_computed_blocks` afterwards. A hybrid model admits a request in every
        KV cache group (one manager each, one pool) first and caches in every group after,
        as vLLM's coordinator does, so all the groups' evictions precede their stores.
        """
        if request.running:
            raise KVCacheManagerError(
                f"request {request.request_id!r} is already admitted; use allocate() for its next "
                "chunk, or free() it first"
            )
        if request.request_id in self.requests:
            raise KVCacheManagerError(
                f"another request with id {request.request_id!r} is already running; ids must be "
                "unique among running requests (free() the other one first)"
            )
        bs = self._bs
        hits: list[KVCacheBlock] = []
        if self.pool.enable_caching:
            hits = self.pool.cached_prefix(request.block_hashes, (len(request.token_ids) - 1) // bs,
                                           self.kv_cache_group_id)
        num_tokens = len(request.token_ids)
        nh = len(hits)
        computed = nh * bs
        if nh and request.report_full:
            # vLLM announces the reused prefix while it looks it up: before (and whatever)
            # the admission decides.
            self.pool.announce_cached_prefix(request, nh, self.kv_cache_group_id)
        if num_new_tokens is None:
            num_new = num_tokens - computed
        else:
            num_new = num_new_tokens
            if not 0 < num_new <= num_tokens - computed:
                raise KVCacheManagerError(
                    f"num_new_tokens={num_new_tokens} for request {request.request_id!r}: after a "
                    f"{computed}-token prefix hit it has {num_tokens - computed} tokens left to "
                    "compute; schedule between 1 and that many"
                )
        total = computed + num_new
        stats = self.stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += computed
        self._recent.append((num_tokens, computed))
        reserve = num_tokens if self.reserve_full_prompt else total
        need = -(-reserve // bs) - nh
        free = self._queue.num_free_blocks
        # Hits sitting in the free queue use up a free block each when touched. Counting
        # them is only needed when even counting every hit as free it would be tight.
        if need + nh > free and need + sum(1 for b in hits if b.ref_cnt == 0) > free:
            return False
        pool = self.pool
        request.num_prefix_hit_tokens = computed
        if hits:
            pool.touch(hits)
        blocks = hits
        n = -(-total // bs) - nh
        if n:
            blocks += pool.get_new_blocks(n)
        request.blocks = blocks
        num_full = total // bs
        if num_full > nh and cache:
            self._cache(request, nh, num_full)
            request.num_cached_blocks = num_full
        else:
            request.num_cached_blocks = nh
        request.num_computed_tokens = total
        request.running = True
        self.requests[request.request_id] = request
        return True

    def cache_computed_blocks(self, request: KVRequest) -> None:
        """Cache the running request's blocks that are full but not cached yet (see
        :meth:`admit`'s ``cache=False``); nothing to do is fine."""
        self._check_running(request)
        nf = request.num_computed_tokens // self._bs
        if nf > request.num_cached_blocks:
            self._cache(request, request.num_cached_blocks, nf)
            request.num_cached_blocks = nf

    def allocate(self, request: KVRequest, num_new_tokens: int) -> bool:
        """Allocate slots for the next ``num_new_tokens`` prompt tokens of a running request
        (a chunked prefill). Returns False (nothing changed) if they do not fit."""
        self._check_running(request)
        total = request.num_computed_tokens + num_new_tokens
        if num_new_tokens <= 0 or total > len(request.token_ids):
            raise KVCacheManagerError(
                f"num_new_tokens={num_new_tokens} for request {request.request_id!r}: it has "
                f"{len(request.token_ids) - request.num_computed_tokens} tokens left to compute; "
                "use decode() to add output tokens"
            )
        bs = self._bs
        blocks = request.blocks
        need = -(-total // bs) - len(blocks)
        if need > self._queue.num_free_blocks:
            return False
        if need > 0:
            blocks += self.pool.get_new_blocks(need)
        num_full = total // bs
        if num_full > request.num_cached_blocks:
            self._cache(request, request.num_cached_blocks, num_full)
            request.num_cached_blocks = num_full
        request.num_computed_tokens = total
        return True

    def decode(self, request: KVRequest, token_id: int) -> bool:
        """Append one output token to a running request and give it a slot.

        Allocates a block when the token starts one, caches the block it completes.
        Returns False, changing nothing (the token is not appended), if a block is needed
        and none is free: preempt a request and retry.
        """
        if type(token_id) is not int:
            token_id = _int_token(token_id)  # numpy ints are ids too
        tokens = request.token_ids
        total = request.num_computed_tokens + 1
        # The common case, most tokens: the token lands inside the last block, neither
        # starting one (total % bs == 1) nor completing one (== 0). A running request holds
        # exactly ceil(num_computed_tokens / block_size) blocks, so nothing else can be due.
        # A request that is not running has num_computed_tokens 0, so total % bs == 1 and
        # it takes the checked path below.
        if (total % self._bs > 1 and total == len(tokens) + 1 and type(token_id) is int
                and 0 <= token_id < _WIRE_TOKEN_LIMIT):
            try:
                tokens.append(token_id)
            except OverflowError:  # an array('I') prompt takes only 32-bit ids
                self._bad_token(request, token_id)
            request.num_computed_tokens = total
            return True
        return self._decode_boundary(request, token_id)

    def decode_many(self, request: KVRequest, token_ids: Sequence[int]) -> bool:
        """Append several output tokens to a running request at once (a multi-step decode).

        The same as ``len(token_ids)`` calls of :meth:`decode`, in order, all succeeding:
        the same blocks are taken and cached in the same order, with the same events (a
        ``BlockStored`` per completed block, each after the ``BlockRemoved`` of the
        eviction that made room for it). All or nothing: returns False, changing
        nothing, if the blocks the tokens need (blocks) exceed the free blocks. Bad calls
        raise :class:`KVCacheManagerError` before anything changes (also when a
        precomputed hash chain would run out partway, where single decodes would have
        appended the tokens before it).
        """
        toks = [t if type(t) is int else _int_token(t) for t in token_ids]
        limit = 1 << 32 if type(request.token_ids) is array else _WIRE_TOKEN_LIMIT
        for t in toks:  # a few ids per call: the exact test, bools included
            if type(t) is not int or not 0 <= t < limit:
                self._bad_token(request, t)
        tokens = request.token_ids
        start = request.num_computed_tokens
        if start != len(tokens) or not request.running:
            self._check_running(request)
            raise KVCacheManagerError(
                f"request {request.request_id!r} still has {len(tokens) - start} prompt tokens "
                "to compute; allocate() them before decoding"
            )
        bs = self._bs
        total = start + len(toks)
        blocks = request.blocks
        need = -(-total // bs) - len(blocks)
        if need > self._queue.num_free_blocks:
            return False
        nf = total // bs
        if request.hasher is None and len(request.block_hashes) < nf:
            raise KVCacheManagerError(
                f"request {request.request_id!r} would complete block {nf - 1} but was created "
                f"with {len(request.block_hashes)} precomputed block hashes; pass the whole "
                "prompt+output chain, or let the manager hash"
            )
        if need <= 0 and nf <= request.num_cached_blocks:
            # Within the last block: nothing to allocate or cache (the common case).
            tokens.extend(toks)
            request.num_computed_tokens = total
            return True
        # Block by block, so that allocations and caches interleave as single decodes do.
        pool = self.pool
        group = self.kv_cache_group_id
        h = request.hasher
        pos = start
        while pos < total:
            if pos >= len(blocks) * bs:
                blocks += pool.get_new_blocks(1)
            end = min(total, (pos // bs + 1) * bs)
            tokens.extend(toks[pos - start:end - start])
            request.num_computed_tokens = end
            pos = end
            if end % bs == 0:
                n = end // bs
                if h is not None and len(request.block_hashes) < n:
                    h.extend(tokens[h.num_tokens:])
                pool.cache_blocks_of(request, request.num_cached_blocks, n, group)
                request.num_cached_blocks = n
        return True

    def free(self, request: KVRequest) -> None:
        """Release a finished or preempted request's blocks (in reverse: tail evicted first).

        The request can be admitted again later (its tokens and hashes are kept).
        """
        self._check_running(request)
        blocks = request.blocks
        blocks.reverse()
        self.pool.free_blocks(blocks)
        request.blocks = []
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0
        request.running = False
        del self.requests[request.request_id]

    # -- cache-wide --------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Reset the pool's prefix cache (see :meth:`BlockPool.reset_prefix_cache`); on
        success the hit-rate window restarts too."""
        ok = self.pool.reset_prefix_cache()
        if ok:
            self._recent.clear()
            self._metrics.reset()
            self._step_stats.reset = True
        return ok

    @property
    def metrics(self) -> PrefixCachingMetrics:
        """The prefix-cache hit rate over the most recent ``max_recent_requests`` admission
        attempts (failed ones included, as in vLLM), up to date when read."""
        m = self._metrics
        recent = self._recent
        if recent:
            # The deque keeps the newest attempts only; any it dropped would have been
            # pushed out of the window by these anyway.
            add = m.add
            for queries, hits in recent:
                add(1, queries, hits)
            recent.clear()
        return m

    def take_events(self) -> list[Any]:
        """The pool's events since the last call (see :meth:`BlockPool.take_events`)."""
        return self.pool.take_events()

    def offload_stored(self, request: KVRequest, block_indices: Iterable[int], medium: str = "CPU") -> None:
        """A KV connector finished copying blocks of ``request`` to ``medium`` (e.g. CPU).

        Records vLLM 0.33's offloading events (see :meth:`BlockPool.offload_events`) for the
        request's logical blocks ``block_indices``; the GPU pool is not changed.
        """
        self.pool.offload_events(medium, stored=self._hashes_at(request, block_indices))

    def offload_removed(self, request: KVRequest, block_indices: Iterable[int], medium: str = "CPU") -> None:
        """A KV connector evicted blocks of ``request`` from ``medium``: one ``BlockRemoved``."""
        self.pool.offload_events(medium, removed=self._hashes_at(request, block_indices))

    def _hashes_at(self, request: KVRequest, block_indices: Iterable[int]) -> list[bytes]:
        hashes = request.block_hashes
        idx = list(block_indices)
        bad = [i for i in idx if type(i) is not int or not 0 <= i < len(hashes)]
        if bad:
            raise KVCacheManagerError(
                f"request {request.request_id!r} has {len(hashes)} hashed blocks; block indices {bad} "
                "are out of range")
        return [hashes[i] for i in idx]

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Statistics since the previous call (vLLM's per-step ``PrefixCacheStats``)."""
        base = self._step_stats  # the cumulative counts at the previous call, and the reset flag
        st = self.stats
        out = PrefixCacheStats(st.requests - base.requests, st.queries - base.queries,
                               st.hits - base.hits, base.reset)
        self._step_stats = PrefixCacheStats(st.requests, st.queries, st.hits)
        return out

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 to 1.0)."""
        return self.pool.get_usage()

    # -- internals -----------------------------------------------------------------------

    def _check_running(self, request: KVRequest) -> None:
        if not request.running or self.requests.get(request.request_id) is not request:
            raise KVCacheManagerError(
                f"request {request.request_id!r} is not running in this manager; admit() it first"
            )

    def _bad_token(self, request: KVRequest, token_id: Any) -> None:
        limit = "2**32 (its prompt was an array('I'))" if type(request.token_ids) is array else "2**64"
        raise KVCacheManagerError(
            f"request {request.request_id!r}: token id {token_id!r} ({type(token_id).__name__}) "
            f"cannot go on the wire; token ids are ints in [0, {limit})"
        )

    def _decode_boundary(self, request: KVRequest, token_id: int) -> bool:
        """:meth:`decode` for a token that starts or completes a block (or a bad call)."""
        if type(token_id) is not int or not 0 <= token_id < (
                1 << 32 if type(request.token_ids) is array else _WIRE_TOKEN_LIMIT):
            self._bad_token(request, token_id)
        tokens = request.token_ids
        total = request.num_computed_tokens + 1
        if total != len(tokens) + 1 or not request.running:
            self._check_running(request)
            raise KVCacheManagerError(
                f"request {request.request_id!r} still has {len(tokens) + 1 - total} prompt tokens "
                "to compute; allocate() them before decoding"
            )
        bs = self._bs
        completes = total % bs == 0
        if completes and request.hasher is None and len(request.block_hashes) < total // bs:
            raise KVCacheManagerError(
                f"request {request.request_id!r} would complete block {total // bs - 1} but was "
                f"created with {len(request.block_hashes)} precomputed block hashes; pass the whole "
                "prompt+output chain, or let the manager hash"
            )
        blocks = request.blocks
        if total > len(blocks) * bs:
            if self._queue.num_free_blocks == 0:
                return False
            blocks += self.pool.get_new_blocks(1)
        tokens.append(token_id)
        request.num_computed_tokens = total
        if not completes:
            return True
        nf = total // bs
        h = request.hasher
        if h is not None and len(request.block_hashes) < nf:
            h.extend(tokens[h.num_tokens:])
        self.pool.cache_blocks_of(request, request.num_cached_blocks, nf, self.kv_cache_group_id)
        request.num_cached_blocks = nf
        return True

    def _cache(self, request: KVRequest, nc: int, nf: int) -> None:
        if len(request.block_hashes) < nf:
            raise KVCacheManagerError(
                f"request {request.request_id!r} completed block {nf - 1} but only "
                f"{len(request.block_hashes)} block hashes are known: it was created with "
                "precomputed block_hashes that do not cover its outputs; pass the whole chain, "
                "or let the manager hash"
            )
        self.pool.cache_blocks_of(request, nc, nf, self.kv_cache_group_id)
