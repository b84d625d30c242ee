"""BlockPool: vLLM's prefix-caching block pool semantics, its events and its error handling."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstream.allocator.pool import BlockPool, BlockPoolError, NoFreeBlocksError

BS = 4


def digests(*names: str) -> list[bytes]:
    return [hashlib.sha256(n.encode()).digest() for n in names]


def tokens(n_blocks: int, base: int = 0) -> list[int]:
    return list(range(base, base + n_blocks * BS))


def state(pool: BlockPool) -> tuple:
    return (pool.free_block_ids(), pool.cached_blocks(), [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks], len(pool._events))


def cache(pool: BlockPool, blocks, hashes, toks=None, nc=0, group=0):
    pool.cache_full_blocks(blocks, hashes, nc, len(hashes), toks or tokens(len(hashes)), group)


def test_null_block_is_never_free_or_counted() -> None:
    pool = BlockPool(8, BS)
    assert pool.get_num_free_blocks() == 7
    assert 0 not in pool.free_block_ids()
    got = pool.get_new_blocks(7)
    assert pool.null_block not in got
    assert pool.get_usage() == 1.0


def test_get_new_blocks_pops_the_lru_head_with_ref_cnt_one() -> None:
    pool = BlockPool(6, BS)
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [1, 2]
    assert [b.ref_cnt for b in got] == [1, 1]
    assert pool.free_block_ids() == [3, 4, 5]
    assert pool.get_usage() == pytest.approx(2 / 5)


def test_more_blocks_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4, BS)
    before = state(pool)
    with pytest.raises(NoFreeBlocksError, match="only 3 are free"):
        pool.get_new_blocks(4)
    assert state(pool) == before


def test_blocks_freed_tail_first_are_evicted_tail_first() -> None:
    pool = BlockPool(6, BS, free_order="v0.11")
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [4, 5, 3, 2, 1]


def test_v033_free_order_puts_hashless_blocks_at_the_head() -> None:
    pool = BlockPool(8, BS)  # default free_order="v0.33"
    blocks = pool.get_new_blocks(4)
    cache(pool, blocks[:2], digests("a", "b"))
    pool.free_blocks(blocks[::-1])
    # unhashed 4, 3 go first (in the order given), hashed 2, 1 to the tail
    assert pool.free_block_ids() == [4, 3, 5, 6, 7, 2, 1]


def test_cached_free_block_stays_findable_until_reused() -> None:
    pool = BlockPool(4, BS)
    (a,) = pool.get_new_blocks(1)
    [ha] = digests("a")
    cache(pool, [a], [ha])
    pool.take_events()
    pool.free_blocks([a])
    assert pool.lookup(ha) is a and a.block_hash == ha  # lazy: still cached while free
    pool.touch([a])  # a prefix hit takes it back out of the free queue, silently
    assert a.ref_cnt == 1 and 1 not in pool.free_block_ids() and pool.take_events() == []
    pool.free_blocks([a])
    pool.get_new_blocks(3)  # reuses block 1 last (LRU) and evicts it then
    assert pool.lookup(ha) is None
    assert pool.take_events() == [BlockRemoved([int.from_bytes(ha[-8:], "big")], "GPU", 0)]


def test_removed_before_stored_within_a_step() -> None:
    pool = BlockPool(3, BS)
    old = pool.get_new_blocks(2)
    cache(pool, old, digests("x", "y"))
    pool.free_blocks(old[::-1])
    pool.take_events()
    new = pool.get_new_blocks(2)
    cache(pool, new, digests("p", "q"))
    kinds = [type(e).__name__ for e in pool.take_events()]
    assert kinds == ["BlockRemoved", "BlockRemoved", "BlockStored"]


def test_stored_event_has_the_chain_parent_and_none_at_block_zero() -> None:
    pool = BlockPool(8, BS, hash_form="bytes")
    blocks = pool.get_new_blocks(3)
    hs = digests("a", "b", "c")
    toks = tokens(3, 100)
    pool.cache_full_blocks(blocks, hs, 0, 1, toks)
    pool.cache_full_blocks(blocks, hs, 1, 3, toks)
    first, second = pool.take_events()
    assert first.parent_block_hash is None and first.block_hashes == [hs[0]]
    assert first.token_ids == toks[:4] and first.block_size == BS
    assert second.parent_block_hash == hs[0] and second.block_hashes == hs[1:]
    assert second.token_ids == toks[4:] and second.extra_keys == [None, None]
    assert (second.group_idx, second.kv_cache_spec_kind, second.medium) == (0, "full_attention", "GPU")


def test_duplicate_physical_copies_are_indexed_and_evicted_one_by_one() -> None:
    pool = BlockPool(4, BS, free_order="v0.11")
    [h] = digests("same")
    a, b = pool.get_new_blocks(2)
    cache(pool, [a], [h])
    cache(pool, [b], [h])
    assert pool.cached_blocks() == {(h, 0): [a.block_id, b.block_id]}
    assert pool.lookup(h) is a  # the first copy cached
    pool.free_blocks([a])
    pool.free_blocks([b])
    pool.get_new_blocks(2)  # block 3, then a
    assert pool.lookup(h) is b
    assert pool.cached_blocks() == {(h, 0): [b.block_id]}
    pool.check_invariants()


def test_group_id_is_part_of_the_index_key() -> None:
    pool = BlockPool(6, BS, kv_cache_event_metadata=(("full_attention", None), ("sliding_window", 64)))
    [h] = digests("h")
    a, b = pool.get_new_blocks(2)
    cache(pool, [a], [h], group=0)
    assert pool.get_cached_block(h, [0]) == [a]
    assert pool.get_cached_block(h, [0, 1]) is None
    cache(pool, [b], [h], group=1)
    assert pool.get_cached_block(h, [0, 1]) == [a, b]
    ev = pool.take_events()[-1]
    assert (ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) == (1, "sliding_window", 64)


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(6, BS)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a])
    before = state(pool)
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free_blocks([b, a])
    assert state(pool) == before
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free_blocks([b, b])  # the same holder twice in one call
    assert state(pool) == before
    pool.check_invariants()


def test_freeing_or_touching_the_null_block_raises_and_changes_nothing() -> None:
    pool = BlockPool(4, BS)
    (a,) = pool.get_new_blocks(1)
    before = state(pool)
    with pytest.raises(BlockPoolError, match="null block"):
        pool.free_blocks([a, pool.null_block])
    with pytest.raises(BlockPoolError, match="null block"):
        pool.touch([a, pool.null_block])
    assert state(pool) == before


def test_touching_free_blocks_then_the_null_block_restores_the_queue_order() -> None:
    pool = BlockPool(8, BS)
    blocks = pool.get_new_blocks(6)
    cache(pool, blocks, digests("a", "b", "c", "d", "e", "f"))
    pool.free_blocks([blocks[3], blocks[0], blocks[5], blocks[1]])
    pool.take_events()
    before = state(pool)
    # Free hits (unlinked from the middle, the head and next to each other), a held one,
    # and one twice: all undone when the null block is met.
    with pytest.raises(BlockPoolError, match="null block"):
        pool.touch([blocks[0], blocks[5], blocks[2], blocks[1], blocks[5], pool.null_block])
    assert state(pool) == before
    pool.check_invariants()


def test_caching_a_block_holding_another_hash_raises_and_changes_nothing() -> None:
    pool = BlockPool(8, BS)
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks[2:], digests("other"), nc=0)
    pool.take_events()
    before = state(pool)
    with pytest.raises(BlockPoolError, match="already holds hash"):
        cache(pool, blocks, digests("a", "b", "c"))  # fails at the third, after two were cached
    assert state(pool) == before
    pool.check_invariants()


def test_caching_a_block_already_holding_the_same_hash_is_not_reannounced() -> None:
    pool = BlockPool(8, BS, hash_form="bytes")
    blocks = pool.get_new_blocks(3)
    hs = digests("a", "b", "c")
    pool.cache_full_blocks(blocks, hs, 1, 2, tokens(3))
    pool.take_events()
    pool.cache_full_blocks(blocks, hs, 0, 3, tokens(3))
    runs = [(e.block_hashes, e.parent_block_hash) for e in pool.take_events()]
    assert runs == [([hs[0]], None), ([hs[2]], hs[1])]
    pool.check_invariants()


def test_caching_a_free_block_raises() -> None:
    pool = BlockPool(4, BS)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(BlockPoolError, match="free"):
        cache(pool, [a], digests("a"))


def test_reset_with_blocks_in_use_returns_false_and_emits_nothing() -> None:
    pool = BlockPool(4, BS)
    (a,) = pool.get_new_blocks(1)
    cache(pool, [a], digests("a"))
    pool.take_events()
    before = state(pool)
    assert pool.reset_prefix_cache() is False
    assert state(pool) == before and pool.take_events() == []


def test_reset_emits_one_all_blocks_cleared_and_keeps_the_queue_order() -> None:
    pool = BlockPool(5, BS)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, digests("a", "b"))
    pool.free_blocks(blocks[::-1])
    pool.take_events()
    order = pool.free_block_ids()
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.free_block_ids() == order and pool.cached_blocks() == {}
    pool.get_new_blocks(4)
    assert pool.take_events() == []  # hashes are gone: reuse emits no BlockRemoved


def test_event_style_011_fills_only_011_fields() -> None:
    pool = BlockPool(4, BS, event_style="0.11")
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, digests("a", "b"))
    pool.free_blocks(blocks[::-1])
    pool.get_new_blocks(3)
    stored, *removed = pool.take_events()
    assert stored.extra_keys is None and stored.group_idx is None and stored.kv_cache_spec_kind is None
    assert all(r.group_idx is None for r in removed) and len(removed) == 2


def test_hash_form_bytes_and_int() -> None:
    [h] = digests("a")
    for form, want in (("bytes", h), ("int", int.from_bytes(h[-8:], "big"))):
        pool = BlockPool(4, BS, hash_form=form)
        (a,) = pool.get_new_blocks(1)
        cache(pool, [a], [h])
        assert pool.take_events()[0].block_hashes == [want]


def test_events_off_records_nothing() -> None:
    pool = BlockPool(4, BS, enable_kv_cache_events=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], digests("a"), 0, 1)
    assert pool.take_events() == [] and pool.lookup(digests("a")[0]) is a


def test_caching_disabled_finds_nothing() -> None:
    pool = BlockPool(4, BS, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    cache(pool, [a], digests("a"))
    assert pool.lookup(digests("a")[0]) is None and pool.take_events() == []


def _mirror(events, counts: Counter) -> None:
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            counts.clear()
        elif isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                counts[(h, ev.group_idx)] += 1
        else:
            for h in ev.block_hashes:
                counts[(h, ev.group_idx)] -= 1
                if not counts[(h, ev.group_idx)]:
                    del counts[(h, ev.group_idx)]


def test_snapshot_events_rebuild_the_cached_state_parents_first() -> None:
    pool = BlockPool(8, BS, hash_form="bytes")
    hs = digests("a", "b", "c")
    r1 = pool.get_new_blocks(3)
    cache(pool, r1, hs)
    r2 = pool.get_new_blocks(3)
    cache(pool, r2, hs[:2] + digests("z"))  # duplicates of a, b
    pool.free_blocks(r1[::-1])
    snap = pool.snapshot_events()
    assert isinstance(snap[0], AllBlocksCleared)
    counts: Counter = Counter()
    _mirror(snap, counts)
    want = Counter({(h, g): len(ids) for (h, g), ids in pool.cached_blocks().items()})
    assert counts == want
    seen = set()
    for ev in snap[1:]:
        assert ev.parent_block_hash is None or ev.parent_block_hash in seen
        seen.update(ev.block_hashes)
        assert len(ev.token_ids) == BS


def test_bad_constructor_arguments_say_what_to_do() -> None:
    with pytest.raises(BlockPoolError, match="null block"):
        BlockPool(1, BS)
    with pytest.raises(BlockPoolError, match="hash_form"):
        BlockPool(4, BS, hash_form="hex")  # type: ignore[arg-type]
    with pytest.raises(BlockPoolError, match="free_order"):
        BlockPool(4, BS, free_order="lifo")  # type: ignore[arg-type]


@pytest.mark.parametrize("call", ["free", "touch", "cache"])
def test_a_block_of_another_pool_is_refused_and_neither_pool_changes(call: str) -> None:
    mine, theirs = BlockPool(8, BS), BlockPool(8, BS)
    held = mine.get_new_blocks(2)
    stranger = theirs.get_new_blocks(1)[0]
    before, their_before = state(mine), state(theirs)
    with pytest.raises(BlockPoolError, match="another BlockPool"):
        if call == "free":
            mine.free_blocks([held[0], stranger, held[1]])
        elif call == "touch":
            mine.touch([held[0], stranger])
        else:
            cache(mine, [held[0], stranger], digests("a", "b"))
    assert state(mine) == before and state(theirs) == their_before
    mine.check_invariants()
    theirs.check_invariants()


def test_hash_index_keeps_copies_oldest_first_and_promotes_the_next() -> None:
    pool = BlockPool(8, BS)
    a, b, c = (pool.get_new_blocks(1) for _ in range(3))
    h = digests("same")
    for blocks in (a, b, c):
        cache(pool, blocks, h)
    assert pool.cached_blocks()[(h[0], 0)] == [a[0].block_id, b[0].block_id, c[0].block_id]
    assert pool.lookup(h[0]) is a[0]
    pool.free_blocks(a + c)  # a then c go to the tail; b stays held
    pool.get_new_blocks(6)  # evicts every free block: a (the first copy) and c
    assert pool.lookup(h[0]) is b[0] and pool.cached_blocks()[(h[0], 0)] == [b[0].block_id]
    pool.check_invariants()


# -- events are recorded compactly and built when taken ------------------------------------


def _u64(d: bytes) -> int:
    return int.from_bytes(d[-8:], "big")


@pytest.mark.parametrize("form", ["int", "bytes"])
def test_a_step_of_evictions_and_stores_is_built_in_order_when_taken(form: str) -> None:
    pool = BlockPool(4, BS, hash_form=form, event_style="0.11", free_order="v0.11")
    ext = _u64 if form == "int" else bytes
    a = digests("a0", "a1", "a2")
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks, a, tokens(3, 100))
    pool.free_blocks(blocks[::-1])
    assert [type(e) for e in pool.take_events()] == [BlockStored]
    # One step: two evictions, a two-block run (chain parent b0), one more eviction, a
    # one-block run extending the first (parent b1).
    b = digests("b0", "b1", "b2")
    got = pool.get_new_blocks(2)
    cache(pool, got, b[:2], tokens(2, 200))
    got += pool.get_new_blocks(1)
    pool.cache_full_blocks(got, b, 2, 3, tokens(3, 200), 0)
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[ext(a[2])], medium="GPU"),
        BlockRemoved(block_hashes=[ext(a[1])], medium="GPU"),
        BlockStored(block_hashes=[ext(h) for h in b[:2]], parent_block_hash=None,
                    token_ids=tokens(2, 200), block_size=BS, lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[ext(a[0])], medium="GPU"),
        BlockStored(block_hashes=[ext(b[2])], parent_block_hash=ext(b[1]),
                    token_ids=tokens(3, 200)[2 * BS:], block_size=BS, lora_id=None, medium="GPU",
                    lora_name=None),
    ]
    assert pool.take_events() == []


def test_lists_changed_after_the_call_do_not_change_events_or_the_snapshot() -> None:
    pool = BlockPool(4, BS)
    h = digests("x0", "x1")
    toks = tokens(2, 7)
    extra = [["salt"], None]
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, h, 0, 2, toks, 0, extra_keys=extra)
    expected = BlockStored(block_hashes=[_u64(d) for d in h], parent_block_hash=None, token_ids=tokens(2, 7),
                           block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                           extra_keys=[("salt",), None], group_idx=0, kv_cache_spec_kind="full_attention")
    toks[:] = [0] * len(toks)  # the caller reuses its lists before the step's events are taken
    h[0] = digests("other")[0]
    extra[0] = ["changed"]
    assert pool.take_events() == [expected]
    snap = pool.snapshot_events()
    assert [e.token_ids for e in snap[1:]] == [tokens(1, 7), tokens(2, 7)[BS:]]
    assert [e.extra_keys for e in snap[1:]] == [[("salt",)], [None]]
    assert [e.parent_block_hash for e in snap[1:]] == [None, _u64(digests("x0")[0])]


def test_an_eviction_in_another_group_keeps_its_place_among_group_zero_events() -> None:
    meta = (("full_attention", None), ("sliding_window", 8))
    pool = BlockPool(4, BS, kv_cache_event_metadata=meta, free_order="v0.11")
    g0, g1 = digests("g0"), digests("g1")
    b0, b1 = pool.get_new_blocks(1), pool.get_new_blocks(1)
    cache(pool, b0, g0, group=0)
    cache(pool, b1, g1, group=1)
    pool.free_blocks(b0 + b1)
    pool.take_events()
    pool.get_new_blocks(3)  # the free block, then the two cached ones in queue order
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[_u64(g0[0])], medium="GPU", group_idx=0),
        BlockRemoved(block_hashes=[_u64(g1[0])], medium="GPU", group_idx=1),
    ]


@pytest.mark.parametrize("order", ["v0.33", "v0.11"])
def test_a_double_free_after_kept_linked_and_unhashed_blocks_changes_nothing(order: str) -> None:
    pool = BlockPool(8, BS, free_order=order)
    shared, cached, plain = pool.get_new_blocks(3)
    pool.touch([shared])  # two holders: freeing once keeps it held
    cache(pool, [cached], digests("c"))
    pool.take_events()
    before = state(pool)
    links = [(b.prev_free, b.next_free) for b in pool.free_block_queue.blocks()]
    with pytest.raises(BlockPoolError, match=f"block {cached.block_id} is already free"):
        pool.free_blocks([shared, cached, plain, cached])
    assert state(pool) == before
    assert [(b.prev_free, b.next_free) for b in pool.free_block_queue.blocks()] == links
    pool.check_invariants()
    pool.free_blocks([shared, cached, plain])
    pool.check_invariants()
    assert shared.ref_cnt == 1 and cached.ref_cnt == 0 and plain.ref_cnt == 0


@pytest.mark.parametrize("form", ["int", "bytes"])
def test_a_cached_blocks_ext_hash_is_its_hash_as_events_carry_it(form: str) -> None:
    pool = BlockPool(4, BS, hash_form=form)
    blk = pool.get_new_blocks(1)
    assert blk[0].ext_hash is None
    cache(pool, blk, digests("e"))
    assert [blk[0].ext_hash] == pool.take_events()[0].block_hashes


@pytest.mark.parametrize("bad", [2.5, "3", True, None])
def test_a_block_count_that_is_not_an_integer_is_a_typed_error_and_changes_nothing(bad: object) -> None:
    pool = BlockPool(8, enable_caching=True)
    free = pool.get_num_free_blocks()
    with pytest.raises(BlockPoolError, match="integer number of blocks"):
        pool.get_new_blocks(bad)  # type: ignore[arg-type]
    assert pool.get_num_free_blocks() == free


def test_a_numpy_integer_block_count_is_a_count() -> None:
    np = pytest.importorskip("numpy")
    pool = BlockPool(8, enable_caching=True)
    assert len(pool.get_new_blocks(np.int64(3))) == 3
