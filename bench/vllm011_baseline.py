"""A re-implementation of vLLM 0.11.0's ``BlockPool`` algorithm, for measurement only.

This is NOT vLLM's code and is not part of kvstream. vLLM cannot be installed here (it
needs torch), so the benchmark baseline was rewritten from reading vLLM 0.11.0's
``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py``, keeping the data structures and
the work each call does, which is what decides the cost:

* blocks are ``@dataclass`` objects (no ``__slots__``) whose ``block_hash`` is a property
  whose setter asserts the block was not already hashed;
* the cache key is ``BlockHashWithGroupId``: the digest with the group id appended as 4
  big-endian bytes (a new bytes object per lookup and per cached block);
* the hash map holds one block, or a ``{block_id: block}`` dict for duplicates;
* the free queue is a doubly linked list with fake head/tail blocks (``popleft_n``,
  ``remove``, ``append_n`` with vLLM's assertions and checks);
* ``get_new_blocks`` pops, then evicts any cached block it popped; ``touch`` takes one
  list per group; ``free_blocks`` decrements all, then appends the ones at zero;
* ``cache_full_blocks`` reads the request's ``block_hashes``, sets each block's key and
  inserts it into the map.

Events are kept in the algorithm but the benchmark runs it with events off, as the issue's
target ("vLLM 0.11.0's pool with events off") asks. :class:`BaselineManager` follows the
call sequence of vLLM 0.11.0's ``KVCacheManager`` for one full-attention group
(``get_computed_blocks``, ``allocate_slots``, ``free``), without the coordinator layers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Optional


def _key(block_hash: bytes, group_id: int) -> bytes:
    return block_hash + group_id.to_bytes(4, "big", signed=False)


@dataclass
class BaselineBlock:
    block_id: int
    ref_cnt: int = 0
    _block_hash: Optional[bytes] = None
    prev_free_block: Optional["BaselineBlock"] = None
    next_free_block: Optional["BaselineBlock"] = None
    is_null: bool = False

    @property
    def block_hash(self) -> Optional[bytes]:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, value: bytes) -> None:
        assert self._block_hash is None, "block already has a hash"
        self._block_hash = value

    def reset_hash(self) -> None:
        self._block_hash = None


class BaselineFreeQueue:
    def __init__(self, blocks: list[BaselineBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for i in range(len(blocks)):
            if i > 0:
                blocks[i].prev_free_block = blocks[i - 1]
            if i < len(blocks) - 1:
                blocks[i].next_free_block = blocks[i + 1]
        self.head = BaselineBlock(block_id=-1)
        self.tail = BaselineBlock(block_id=-1)
        if blocks:
            self.head.next_free_block = blocks[0]
            blocks[0].prev_free_block = self.head
            self.tail.prev_free_block = blocks[-1]
            blocks[-1].next_free_block = self.tail
        else:
            self.head.next_free_block = self.tail
            self.tail.prev_free_block = self.head

    def popleft(self) -> BaselineBlock:
        first = self.head.next_free_block
        if first is None or first is self.tail:
            raise ValueError("no free blocks")
        self.head.next_free_block = first.next_free_block
        first.next_free_block.prev_free_block = self.head  # type: ignore[union-attr]
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[BaselineBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n
        cur = self.head.next_free_block
        out = []
        for _ in range(n):
            assert cur is not None
            out.append(cur)
            last = cur
            cur = cur.next_free_block
            last.prev_free_block = None
            last.next_free_block = None
        if cur is not None:
            self.head.next_free_block = cur
            cur.prev_free_block = self.head
        return out

    def remove(self, block: BaselineBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: list[BaselineBlock]) -> None:
        if len(blocks) == 0:
            return
        last = self.tail.prev_free_block
        assert last is not None
        for b in blocks:
            b.prev_free_block = last
            last.next_free_block = b
            last = b
        last.next_free_block = self.tail
        self.tail.prev_free_block = last
        self.num_free_blocks += len(blocks)


class BaselineHashMap:
    def __init__(self) -> None:
        self._cache: dict[bytes, Any] = {}

    def get_one_block(self, key: bytes) -> Optional[BaselineBlock]:
        blocks = self._cache.get(key)
        if blocks is not None:
            if isinstance(blocks, BaselineBlock):
                return blocks
            if isinstance(blocks, dict):
                return next(iter(blocks.values()))
            raise AssertionError("unexpected blocks type")
        return None

    def insert(self, key: bytes, block: BaselineBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, BaselineBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        elif isinstance(blocks, dict):
            blocks[block.block_id] = block
        else:
            raise AssertionError("unexpected blocks type")

    def pop(self, key: bytes, block_id: int) -> Optional[BaselineBlock]:
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, BaselineBlock):
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        if isinstance(blocks, dict):
            block = blocks.pop(block_id, None)
            if len(blocks) > 0:
                self._cache[key] = blocks
            return block
        raise AssertionError("unexpected blocks type")


class BaselineRequest:
    def __init__(self, request_id: Any, all_token_ids: list[int], block_hashes: list[bytes]) -> None:
        self.request_id = request_id
        self.all_token_ids = all_token_ids
        self.block_hashes = block_hashes
        self.num_computed_tokens = 0
        self.lora_request = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class BaselinePool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [BaselineBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = BaselineFreeQueue(self.blocks)
        self.cached_block_hash_to_block = BaselineHashMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[Any] = []

    def get_cached_block(self, block_hash: bytes, group_ids: list[int]) -> Optional[list[BaselineBlock]]:
        out = []
        for g in group_ids:
            blk = self.cached_block_hash_to_block.get_one_block(_key(block_hash, g))
            if not blk:
                return None
            out.append(blk)
        return out

    def cache_full_blocks(self, request: BaselineRequest, blocks: list[BaselineBlock],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int) -> None:
        if num_cached_blocks == num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        assert len(request.block_hashes) >= num_full_blocks
        new_hashes = request.block_hashes[num_cached_blocks:num_full_blocks]
        ev_hashes: Optional[list[Any]] = [] if self.enable_kv_cache_events else None
        for i, blk in enumerate(new_full_blocks):
            assert blk.block_hash is None
            key = _key(new_hashes[i], kv_cache_group_id)
            blk.block_hash = key
            self.cached_block_hash_to_block.insert(key, blk)
            if ev_hashes is not None:
                ev_hashes.append(new_hashes[i])
        if self.enable_kv_cache_events:
            parent = None if num_cached_blocks == 0 else blocks[num_cached_blocks - 1].block_hash[:-4]  # type: ignore[index]
            self.kv_event_queue.append(("BlockStored", ev_hashes, parent,
                                        request.all_token_ids[num_cached_blocks * block_size:
                                                              num_full_blocks * block_size]))

    def get_new_blocks(self, num_blocks: int) -> list[BaselineBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            for blk in ret:
                self._maybe_evict_cached_block(blk)
                assert blk.ref_cnt == 0
                blk.ref_cnt += 1
        else:
            for blk in ret:
                assert blk.ref_cnt == 0
                blk.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, block: BaselineBlock) -> bool:
        key = block.block_hash
        if key is None:
            return False
        if self.cached_block_hash_to_block.pop(key, block.block_id) is None:
            return False
        block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(("BlockRemoved", [key[:-4]]))
        return True

    def touch(self, blocks: tuple[list[BaselineBlock], ...]) -> None:
        for per_group in blocks:
            for blk in per_group:
                if blk.ref_cnt == 0 and not blk.is_null:
                    self.free_block_queue.remove(blk)
                blk.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[BaselineBlock]) -> None:
        blocks_list = list(ordered_blocks)
        for blk in blocks_list:
            blk.ref_cnt -= 1
        self.free_block_queue.append_n([b for b in blocks_list if b.ref_cnt == 0 and not b.is_null])

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


class BaselineManager:
    """vLLM 0.11.0 ``KVCacheManager``'s call sequence for one full-attention group."""

    def __init__(self, pool: BaselinePool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.req_to_blocks: defaultdict[Any, list[BaselineBlock]] = defaultdict(list)
        self.num_cached_block: dict[Any, int] = {}

    def get_computed_blocks(self, request: BaselineRequest) -> tuple[list[BaselineBlock], int]:
        max_len = request.num_tokens - 1
        hits: list[BaselineBlock] = []
        for h in request.block_hashes[: max_len // self.block_size]:
            cached = self.pool.get_cached_block(h, [0])
            if cached is None:
                break
            hits.append(cached[0])
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: BaselineRequest, num_new_tokens: int,
                       new_computed_blocks: list[BaselineBlock] | None = None) -> Optional[list[BaselineBlock]]:
        new_computed = new_computed_blocks or []
        num_computed = request.num_computed_tokens + len(new_computed) * self.block_size
        num_tokens_need = num_computed + num_new_tokens
        req_blocks = self.req_to_blocks[request.request_id]
        num_new_blocks = _cdiv(num_tokens_need, self.block_size) - len(new_computed) - len(req_blocks)
        evictable = sum(1 for b in new_computed if b.ref_cnt == 0 and not b.is_null)
        if num_new_blocks + evictable > self.pool.get_num_free_blocks():
            return None
        if request.request_id not in self.num_cached_block:
            # save_new_computed_blocks: a new request's hits count as already cached.
            if new_computed:
                self.pool.touch((new_computed,))
                req_blocks.extend(new_computed)
            self.num_cached_block[request.request_id] = len(new_computed)
        new_blocks = []
        if num_new_blocks > 0:
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = min(num_tokens_need, request.num_tokens) // self.block_size
        if num_cached < num_full:
            self.pool.cache_full_blocks(request, req_blocks, num_cached, num_full, self.block_size, 0)
        self.num_cached_block[request.request_id] = max(num_full, num_cached)
        return new_blocks

    def free(self, request: BaselineRequest) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)
