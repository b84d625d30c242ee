"""Stateful property test: random admit / allocate / decode / free / reset sequences keep
the allocator's invariants.

* every non-null block is in the free queue with ref_cnt 0, or held with ref_cnt > 0 (and
  then by exactly that many running requests), never both;
* the hash index holds exactly the blocks that have hashes;
* applying the emitted events to a simple mirror gives exactly the cached (hash, group)
  pairs, counted per physical copy; so does a fresh mirror fed ``snapshot_events()``.

CI size is small (a few seconds); ``KVSTREAM_STATEFUL_EXAMPLES=500`` runs it big.
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstream.wire.events import AllBlocksCleared, BlockStored
from kvstream.hashing import BlockHasher
from kvstream.allocator.manager import KVCacheManager, KVRequest
from kvstream.allocator.pool import BlockPool

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

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 16), whole=st.booleans())
    def admit(self, i: int, chunk: int, whole: bool) -> None:
        req = self.waiting[i % len(self.waiting)]
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
