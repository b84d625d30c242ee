"""Stateful property test: random admit / allocate / decode / free / reset sequences keep
the allocator's invariants.

* every non-null block is in the free queue with ref_cnt 0, or held with ref_cnt > 0 (and
  then by exactly that many running requests), never both;
* the hash index holds exactly the blocks that have hashes;
* applying the emitted events to a simple mirror gives exactly the cached (hash, group)
  pairs, counted per physical copy; so does a fresh mirror fed ``snapshot_events()``;
* every public call is also made with invalid arguments (bad token ids, a running request
  id, a block of another pool, the null block, out-of-range counts, a request that is not
  running, ...): each raises a typed error and leaves the pool and the requests exactly as
  they were.

CI size is small (a few seconds); ``KVSTREAM_STATEFUL_EXAMPLES=500`` runs it big.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstream.wire.events import AllBlocksCleared, BlockStored
from kvstream.hashing import BlockHasher
from kvstream.errors import LocalProtocolError
from kvstream.allocator.manager import KVCacheManager, KVRequest
from kvstream.allocator.pool import BlockPool

# Token ids that cannot go on the wire (a msgpack uint64), in a prompt or as an output.
BAD_TOKENS = [1.0, "7", None, -1, 2**64, 2**70]

BS = 4
EXAMPLES = int(os.environ.get("KVSTREAM_STATEFUL_EXAMPLES", "25"))
HASHER = BlockHasher("native", BS, seed="invariants")

# Prompts are built from a few shared prefixes so that hits, duplicates and evictions of
# shared blocks are common.
PREFIXES = [list(range(p * 100, p * 100 + 12)) for p in range(3)]


def apply(events, counts: Counter) -> None:
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            counts.clear()
        elif isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                counts[(h, ev.group_idx)] += 1
        else:
            for h in ev.block_hashes:
                key = (h, ev.group_idx)
                assert counts[key] > 0, "BlockRemoved for a hash the mirror does not hold"
                counts[key] -= 1
                if not counts[key]:
                    del counts[key]


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager
        self.waiting: list[KVRequest] = []
        self.running: list[KVRequest] = []
        self.mirror: Counter = Counter()
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(3, 24),
        free_order=st.sampled_from(["v0.33", "v0.11"]),
        reserve=st.booleans(),
    )
    def setup(self, num_blocks: int, free_order: str, reserve: bool) -> None:
        pool = BlockPool(num_blocks, BS, hash_form="bytes", free_order=free_order)  # type: ignore[arg-type]
        self.mgr = KVCacheManager(pool, HASHER, reserve_full_prompt=reserve)

    @rule(prefix=st.integers(0, 2), cut=st.integers(0, 12),
          tail=st.lists(st.integers(0, 3), max_size=9), salt=st.sampled_from([None, None, "t"]))
    def new_request(self, prefix: int, cut: int, tail: list[int], salt: str | None) -> None:
        prompt = PREFIXES[prefix][:cut] + tail
        if not prompt:
            prompt = [7]
        self.waiting.append(self.mgr.new_request(self.next_id, prompt, cache_salt=salt))
        self.next_id += 1

    def admissible(self) -> list[KVRequest]:
        return [w for w in self.waiting if w.request_id not in self.mgr.requests]

    @precondition(lambda self: self.admissible())
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 16), whole=st.booleans())
    def admit(self, i: int, chunk: int, whole: bool) -> None:
        ok = self.admissible()
        req = ok[i % len(ok)]
        n_cached = len(self.mgr.get_computed_blocks(req)) * BS
        left = req.num_tokens - n_cached
        if self.mgr.admit(req, None if whole else min(chunk, left)):
            self.waiting.remove(req)
            self.running.append(req)
        else:
            assert req.blocks == [] and not req.running

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.running))
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 16))
    def prefill(self, i: int, chunk: int) -> None:
        todo = [r for r in self.running if r.num_computed_tokens < r.num_tokens]
        req = todo[i % len(todo)]
        before = (len(req.blocks), req.num_computed_tokens)
        if not self.mgr.allocate(req, min(chunk, req.num_tokens - req.num_computed_tokens)):
            assert (len(req.blocks), req.num_computed_tokens) == before

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running))
    @rule(i=st.integers(0, 100), token=st.integers(0, 3))
    def decode(self, i: int, token: int) -> None:
        ready = [r for r in self.running if r.num_computed_tokens == r.num_tokens]
        req = ready[i % len(ready)]
        n = req.num_tokens
        if not self.mgr.decode(req, token):
            assert req.num_tokens == n

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), requeue=st.booleans())
    def free(self, i: int, requeue: bool) -> None:
        req = self.running.pop(i % len(self.running))
        self.mgr.free(req)
        if requeue:  # preempted: it will be admitted again later
            self.waiting.append(req)

    # -- the same calls with invalid arguments: typed error, nothing changes -----------

    def state(self) -> tuple:
        pool = self.mgr.pool
        return (pool.free_block_ids(), pool.cached_blocks(), [b.ref_cnt for b in pool.blocks],
                len(pool._events), sorted(self.mgr.requests),
                [(r.request_id, len(r.token_ids), r.num_computed_tokens, r.num_cached_blocks,
                  [b.block_id for b in r.blocks], r.running) for r in self.waiting + self.running])

    def refused(self, call, *args, **kwargs) -> None:
        before = self.state()
        with pytest.raises(LocalProtocolError):
            call(*args, **kwargs)
        assert self.state() == before

    @rule(bad=st.sampled_from(BAD_TOKENS), at=st.integers(0, 5))
    def new_request_with_bad_token(self, bad, at: int) -> None:
        prompt = [1, 2, 3, 4, 5]
        prompt.insert(at, bad)
        self.refused(self.mgr.new_request, "bad", prompt)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def new_request_with_a_running_id(self, i: int) -> None:
        self.refused(self.mgr.new_request, self.running[i % len(self.running)].request_id, [1, 2, 3])

    @precondition(lambda self: self.admissible())
    @rule(i=st.integers(0, 100))
    def twin_of_a_waiting_request(self, i: int) -> None:
        # Same id as a waiting request: fine until both are admitted (see admit_twin).
        ok = self.admissible()
        twin = ok[i % len(ok)]
        self.waiting.append(self.mgr.new_request(twin.request_id, [9, 9, 9]))

    @precondition(lambda self: any(w.request_id in self.mgr.requests for w in self.waiting))
    @rule()
    def admit_twin(self) -> None:
        req = next(w for w in self.waiting if w.request_id in self.mgr.requests)
        self.refused(self.mgr.admit, req)

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running))
    @rule(i=st.integers(0, 100), bad=st.sampled_from(BAD_TOKENS + [True]))
    def decode_bad_token(self, i: int, bad) -> None:
        ready = [r for r in self.running if r.num_computed_tokens == r.num_tokens]
        req = ready[i % len(ready)]
        self.refused(self.mgr.decode, req, bad)
        self.refused(self.mgr.decode_many, req, [1, bad])

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 100))
    def calls_on_a_request_that_is_not_running(self, i: int) -> None:
        req = self.waiting[i % len(self.waiting)]
        self.refused(self.mgr.free, req)
        self.refused(self.mgr.decode, req, 1)
        self.refused(self.mgr.allocate, req, 1)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), n=st.sampled_from([0, -1, 10_000]))
    def allocate_a_bad_count(self, i: int, n: int) -> None:
        self.refused(self.mgr.allocate, self.running[i % len(self.running)], n)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), which=st.sampled_from(["free", "touch", "cache"]), where=st.integers(0, 100))
    def pool_calls_with_a_foreign_or_null_block(self, i: int, which: str, where: int) -> None:
        pool = self.mgr.pool
        other = BlockPool(8, BS)
        stranger = other.get_new_blocks(1)[0]
        req = self.running[i % len(self.running)]
        for bad in (stranger, pool.null_block):
            blocks = list(req.blocks)
            blocks.insert(where % (len(blocks) + 1), bad)
            if which == "free":
                self.refused(pool.free_blocks, blocks)
            elif which == "touch":
                self.refused(pool.touch, blocks)
            else:
                hashes = HASHER.hash_blocks(list(range(len(blocks) * BS)))
                self.refused(pool.cache_full_blocks, blocks, hashes, 0, len(blocks),
                             list(range(len(blocks) * BS)))
        other.check_invariants()
        assert other.blocks[stranger.block_id].ref_cnt == 1

    @rule(n=st.sampled_from([-1, 10_000]))
    def get_new_blocks_bad_count(self, n: int) -> None:
        self.refused(self.mgr.pool.get_new_blocks, n)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), nc=st.integers(-2, 8), nf=st.integers(-2, 40))
    def cache_full_blocks_bad_range(self, i: int, nc: int, nf: int) -> None:
        req = self.running[i % len(self.running)]
        if 0 <= nc <= nf <= len(req.blocks) and nf <= len(req.block_hashes) and len(req.token_ids) >= nf * BS:
            return  # a valid range: not this rule's business
        self.refused(self.mgr.pool.cache_full_blocks, req.blocks, req.block_hashes, nc, nf, req.token_ids)

    @rule()
    def reset(self) -> None:
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.running)

    @rule()
    def end_step(self) -> None:
        apply(self.mgr.take_events(), self.mirror)

    @invariant()
    def pool_is_consistent(self) -> None:
        pool = self.mgr.pool
        pool.check_invariants()
        holders: Counter = Counter()
        for r in self.running:
            for b in r.blocks:
                holders[b.block_id] += 1
        assert {b.block_id: b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt} == dict(holders)

    @invariant()
    def events_mirror_the_cache(self) -> None:
        apply(self.mgr.take_events(), self.mirror)
        want = Counter({k: len(ids) for k, ids in self.mgr.pool.cached_blocks().items()})
        assert self.mirror == want
        fresh: Counter = Counter()
        apply(self.mgr.pool.snapshot_events(), fresh)
        assert fresh == want


AllocatorMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=60, deadline=None
)
TestAllocatorInvariants = AllocatorMachine.TestCase
