"""The traces and the drivers the peer benchmark runs, for vLLM and for kvstream alike.

Every trace is deterministic (fixed seeds), so separate processes build the same one.

* **pool trace** (:func:`make_trace`): 20,000 requests from 64 prefix families (Zipf
  popularity), each a shared prefix of 128..1023 tokens plus a private suffix of 16..511,
  then 1..63 decoded tokens; block hashes precomputed (opaque digests); replayed as
  continuous batching with 32 running requests on 8,192 blocks of 16 tokens.
* **manager trace**: the same requests, but hashing is part of the work: each side hashes
  prompts and completed output blocks with sha256_cbor as its request hasher does (vLLM:
  its ``get_request_block_hasher`` over the request; kvstream: ``KVCacheManager``).

The vLLM driver issues the calls vLLM's ``KVCacheManager`` makes of its ``BlockPool``
(longest cached prefix by ``get_cached_block``, ``touch``, ``get_new_blocks``,
``cache_full_blocks``, ``free_blocks`` in reverse) with none of the manager's own
bookkeeping: the reference is, if anything, flattered.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

BLOCK_SIZE = 16
NUM_BLOCKS = 8192
FAMILIES = 64
RUNNING = 32


class TraceRequest:
    __slots__ = ("prefix", "suffix", "outputs", "hashes")

    def __init__(self, prefix: list[int], suffix: list[int], outputs: list[int], hashes: list[bytes]) -> None:
        self.prefix = prefix
        self.suffix = suffix
        self.outputs = outputs
        self.hashes = hashes


def make_trace(num_requests: int = 20_000, seed: int = 0, hashes: bool = True) -> list[TraceRequest]:
    """The deterministic trace described in the module docstring (hashes: xxh3 digests)."""
    from kvstream.hashing import BlockHasher

    rng = random.Random(seed)
    vocab = list(range(32_000))  # shared int objects: the trace stores pointers only
    hasher = BlockHasher("native", BLOCK_SIZE, seed="bench")
    families = []
    for _ in range(FAMILIES):
        prefix = [vocab[rng.randrange(32_000)] for _ in range(rng.randrange(128, 1024))]
        families.append((prefix, hasher.hash_blocks(prefix) if hashes else []))
    weights = [1.0 / (f + 1) for f in range(FAMILIES)]
    out = []
    for _ in range(num_requests):
        prefix, prefix_hashes = families[rng.choices(range(FAMILIES), weights)[0]]
        suffix = [vocab[rng.randrange(32_000)] for _ in range(rng.randrange(16, 512))]
        outputs = [vocab[rng.randrange(32_000)] for _ in range(rng.randrange(1, 64))]
        hs: list[bytes] = []
        if hashes:
            nfull = len(prefix_hashes)
            rest = prefix[nfull * BLOCK_SIZE:] + suffix + outputs
            parent = prefix_hashes[-1] if prefix_hashes else None
            hs = prefix_hashes + hasher.hash_blocks(rest, parent)
        out.append(TraceRequest(prefix, suffix, outputs, hs))
    return out


# --------------------------------------------------------------------------------------
# vLLM's side.


class PeerRequest:
    """What vLLM's pool and request hasher read of a ``vllm.v1.request.Request``."""

    __slots__ = ("request_id", "all_token_ids", "block_hashes", "lora_request", "mm_features",
                 "cache_salt", "prompt_embeds", "session_id", "_hasher")

    def __init__(self, request_id: Any, token_ids: list[int], block_hashes: list[bytes] | None,
                 hasher: Callable[[Any], list[bytes]] | None) -> None:
        self.request_id = request_id
        self.all_token_ids = token_ids
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = None
        self.prompt_embeds = None
        self.session_id = None
        self._hasher = hasher
        self.block_hashes: list[bytes] = block_hashes if block_hashes is not None else []
        if hasher is not None:
            self.block_hashes.extend(hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token(self, token: int) -> None:
        # vLLM's Request.append_output_token_ids: append, then hash the blocks it completed.
        self.all_token_ids.append(token)
        if self._hasher is not None:
            self.block_hashes.extend(self._hasher(self))


def run_vllm(vl: Any, release: str, trace: list[TraceRequest], events: bool, hashing: bool) -> tuple[float, dict[str, Any]]:
    """Replay ``trace`` on vLLM's real ``BlockPool``; returns (seconds, counters)."""
    BlockPool = vl.block_pool.BlockPool
    if release == "0.11":
        pool = BlockPool(NUM_BLOCKS, True, events)
        touch_one = pool.touch
        def touch(hits: list[Any]) -> None:
            touch_one((hits,))
    else:
        pool = BlockPool(NUM_BLOCKS, True, BLOCK_SIZE, events)
        touch = pool.touch
    hasher = None
    if hashing:
        kcu = vl.kv_cache_utils
        kcu.init_none_hash(vl.hashing.sha256_cbor)
        hasher = kcu.get_request_block_hasher(BLOCK_SIZE, vl.hashing.sha256_cbor)
    bs = BLOCK_SIZE
    get_cached = pool.get_cached_block
    get_new = pool.get_new_blocks
    cache = pool.cache_full_blocks
    free = pool.free_blocks
    num_free = pool.get_num_free_blocks
    take = pool.take_events
    groups = [0]
    running: list[list[Any]] = []  # [request, blocks, num_cached, outputs, i]
    waiting: Any = None  # the next request, created (and hashed) once, as vLLM's waiting queue holds it
    nxt = 0
    n = len(trace)
    hits_tokens = queries = num_events = 0
    t0 = time.perf_counter()
    while nxt < n or running:
        while nxt < n and len(running) < RUNNING:
            tr = trace[nxt]
            if waiting is None:
                waiting = PeerRequest(nxt, tr.prefix + tr.suffix, None if hashing else tr.hashes, hasher)
            req = waiting
            ntok = req.num_tokens
            hits: list[Any] = []
            for h in req.block_hashes[: (ntok - 1) // bs]:
                got = get_cached(h, groups)
                if not got:
                    break
                hits.append(got[0])
            need = -(-ntok // bs) - len(hits)
            if need + sum(1 for b in hits if b.ref_cnt == 0) > num_free():
                break
            queries += ntok
            hits_tokens += len(hits) * bs
            if hits:
                touch(hits)
            blocks = hits + get_new(need)
            nf = ntok // bs
            cache(req, blocks, len(hits), nf, bs, 0)
            running.append([req, blocks, nf, tr.outputs, 0])
            waiting = None
            nxt += 1
        still = []
        for st in running:
            req, blocks, nc, outs, i = st
            req.append_output_token(outs[i])
            total = req.num_tokens
            if total > len(blocks) * bs:
                blocks += get_new(1)
            if total % bs == 0:
                cache(req, blocks, nc, total // bs, bs, 0)
                st[2] = total // bs
            i += 1
            if i == len(outs):
                free(reversed(blocks))
            else:
                st[4] = i
                still.append(st)
        running = still
        if events:
            num_events += len(take())
    dt = time.perf_counter() - t0
    return dt, {"events": num_events, "hit_rate": round(hits_tokens / queries, 6)}


# --------------------------------------------------------------------------------------
# kvstream's side.


def _taker(pool: Any, wire: bool) -> Callable[[], Any]:
    """One step's events as structs (``take_events``), and with ``wire`` also encoded as
    ``Publisher.publish`` encodes them (``EventEncoder``, map format, ``time.time()``)."""
    if not wire:
        return pool.take_events
    from kvstream.wire.events import EventEncoder, KVEventBatch

    encode = EventEncoder().encode
    take_events = pool.take_events
    now = time.time

    def take() -> Any:
        events = take_events()
        if events:
            encode(KVEventBatch(now(), events, None))
        return events
    return take


def run_kvstream_pool(trace: list[TraceRequest], events: bool, free_order: str,
                      wire: bool = False) -> tuple[float, dict[str, Any]]:
    """The same call sequence as :func:`run_vllm` on kvstream's ``BlockPool`` (hashes
    precomputed); the cached prefix is found with ``cached_prefix`` (one call per request,
    kvstream's API for what vLLM's manager asks ``get_cached_block`` block by block).

    With events on, each step's events are taken as event structs (``take_events``), as
    vLLM's pool hands them out; ``wire=True`` also encodes them as ``Publisher.publish``
    does (vLLM encodes in its publisher's thread: the reference does not)."""
    from kvstream.allocator.pool import BlockPool

    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, enable_kv_cache_events=events, free_order=free_order)
    bs = BLOCK_SIZE
    cached_prefix = pool.cached_prefix
    get_new = pool.get_new_blocks
    cache = pool.cache_full_blocks
    free = pool.free_blocks
    touch = pool.touch
    num_free = pool.get_num_free_blocks
    take = _taker(pool, wire)
    running: list[list[Any]] = []  # [tokens, hashes, blocks, num_cached, outputs, i]
    nxt = 0
    n = len(trace)
    hits_tokens = queries = num_events = 0
    t0 = time.perf_counter()
    while nxt < n or running:
        while nxt < n and len(running) < RUNNING:
            tr = trace[nxt]
            tokens = tr.prefix + tr.suffix
            hashes = tr.hashes
            ntok = len(tokens)
            hits = cached_prefix(hashes, (ntok - 1) // bs)  # kvstream's one-call prefix lookup
            need = -(-ntok // bs) - len(hits)
            if need + sum(1 for b in hits if b.ref_cnt == 0) > num_free():
                break
            queries += ntok
            hits_tokens += len(hits) * bs
            if hits:
                touch(hits)
            blocks = hits + get_new(need)
            nf = ntok // bs
            cache(blocks, hashes, len(hits), nf, tokens, 0)
            running.append([tokens, hashes, blocks, nf, tr.outputs, 0])
            nxt += 1
        still = []
        for st in running:
            tokens, hashes, blocks, nc, outs, i = st
            tokens.append(outs[i])
            total = len(tokens)
            if total > len(blocks) * bs:
                blocks += get_new(1)
            if total % bs == 0:
                cache(blocks, hashes, nc, total // bs, tokens, 0)
                st[3] = total // bs
            i += 1
            if i == len(outs):
                blocks.reverse()
                free(blocks)
            else:
                st[5] = i
                still.append(st)
        running = still
        if events:
            num_events += len(take())
    dt = time.perf_counter() - t0
    return dt, {"events": num_events, "hit_rate": round(hits_tokens / queries, 6)}


def run_kvstream_manager(trace: list[TraceRequest], events: bool, free_order: str,
                         hashing: bool, wire: bool = False) -> tuple[float, dict[str, Any]]:
    """Replay through kvstream's ``KVCacheManager`` (admit / decode / free).

    ``hashing``: the manager hashes prompts and outputs with sha256_cbor; otherwise the
    trace's precomputed digests are passed as ``block_hashes=``. Events are taken as in
    :func:`run_kvstream_pool`.
    """
    from kvstream.allocator.manager import KVCacheManager
    from kvstream.allocator.pool import BlockPool
    from kvstream.hashing import BlockHasher

    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, enable_kv_cache_events=events, free_order=free_order)
    mgr = KVCacheManager(pool, BlockHasher("sha256_cbor", BLOCK_SIZE, seed="bench"))
    running: list[list[Any]] = []  # [request, outputs, i], updated in place as the pool driver's
    waiting: Any = None
    nxt = 0
    n = len(trace)
    num_events = 0
    admit, decode, free, new_request = mgr.admit, mgr.decode, mgr.free, mgr.new_request
    take = _taker(pool, wire)
    t0 = time.perf_counter()
    while nxt < n or running:
        while nxt < n and len(running) < RUNNING:
            tr = trace[nxt]
            if waiting is None:
                if hashing:
                    waiting = new_request(nxt, tr.prefix + tr.suffix)
                else:
                    waiting = new_request(nxt, tr.prefix + tr.suffix, block_hashes=tr.hashes)
            req = waiting
            if not admit(req):
                break
            running.append([req, tr.outputs, 0])
            waiting = None
            nxt += 1
        still = []
        for st in running:
            req, outs, i = st
            decode(req, outs[i])
            i += 1
            if i == len(outs):
                free(req)
            else:
                st[2] = i
                still.append(st)
        running = still
        if events:
            num_events += len(take())
    dt = time.perf_counter() - t0
    return dt, {"events": num_events, "hit_rate": round(mgr.stats.hits / mgr.stats.queries, 6)}


# --------------------------------------------------------------------------------------
# Hashing inputs.

HASH_KINDS = ("uniform", "zipf", "repeated")
VOCAB = 128_000


def hash_prompts(kind: str, count: int, tokens: int = 4096, seed: int = 7) -> list[list[int]]:
    """``count`` prompts of ``tokens`` token ids over a 128k vocabulary.

    ``uniform``: ids uniform over the vocabulary, a new prompt each time (a router's usual
    input: prompts it has never seen). ``zipf``: ids drawn log-uniformly (Zipf, s=1: low ids
    frequent), new each time. ``repeated``: one uniform prompt, the same list every time.
    Each id is its own int object, as a tokenizer's output would be.
    """
    rng = random.Random(seed)
    if kind == "uniform":
        return [[rng.randrange(VOCAB) + 0 for _ in range(tokens)] for _ in range(count)]
    if kind == "zipf":
        return [[min(int(VOCAB ** rng.random()) - 1, VOCAB - 1) for _ in range(tokens)] for _ in range(count)]
    if kind == "repeated":
        one = [rng.randrange(VOCAB) for _ in range(tokens)]
        return [one] * count
    raise ValueError(f"unknown prompt kind {kind!r}; use one of {HASH_KINDS}")


def naive_sha256_cbor(tokens: list[int], block_size: int, root: bytes) -> list[bytes]:
    """The obvious implementation: one ``cbor2.dumps`` + ``hashlib.sha256`` per full block."""
    import hashlib

    import cbor2

    out = []
    parent = root
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = hashlib.sha256(
            cbor2.dumps((parent, tuple(tokens[i : i + block_size]), None), canonical=True)
        ).digest()
        out.append(parent)
    return out


def run_kvstream_pool_compat(trace: list[TraceRequest]) -> tuple[float, dict[str, Any]]:
    """:func:`run_kvstream_pool` with ``get_cached_block`` per hash, exactly vLLM's driver
    (for A/B runs against kvstream versions without ``cached_prefix``)."""
    from kvstream.allocator.pool import BlockPool

    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, enable_kv_cache_events=True, free_order="v0.11")
    bs = BLOCK_SIZE
    get_cached = pool.get_cached_block
    groups = [0]
    running: list[list[Any]] = []
    nxt = 0
    n = len(trace)
    t0 = time.perf_counter()
    while nxt < n or running:
        while nxt < n and len(running) < RUNNING:
            tr = trace[nxt]
            tokens = tr.prefix + tr.suffix
            hashes = tr.hashes
            ntok = len(tokens)
            hits: list[Any] = []
            for h in hashes[: (ntok - 1) // bs]:
                got = get_cached(h, groups)
                if not got:
                    break
                hits.append(got[0])
            need = -(-ntok // bs) - len(hits)
            if need + sum(1 for b in hits if b.ref_cnt == 0) > pool.get_num_free_blocks():
                break
            if hits:
                pool.touch(hits)
            blocks = hits + pool.get_new_blocks(need)
            nf = ntok // bs
            pool.cache_full_blocks(blocks, hashes, len(hits), nf, tokens, 0)
            running.append([tokens, hashes, blocks, nf, tr.outputs, 0])
            nxt += 1
        still = []
        for st in running:
            tokens, hashes, blocks, nc, outs, i = st
            tokens.append(outs[i])
            total = len(tokens)
            if total > len(blocks) * bs:
                blocks += pool.get_new_blocks(1)
            if total % bs == 0:
                pool.cache_full_blocks(blocks, hashes, nc, total // bs, tokens, 0)
                st[3] = total // bs
            i += 1
            if i == len(outs):
                blocks.reverse()
                pool.free_blocks(blocks)
            else:
                st[5] = i
                still.append(st)
        running = still
        pool.take_events()
    return time.perf_counter() - t0, {}
