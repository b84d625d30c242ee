"""KVCacheManager: admission with prefix hits, chunked prefill, decode, free, statistics."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvstream.hashing import BlockHasher, LoRA
from kvstream.allocator.manager import KVCacheManager, KVCacheManagerError
from kvstream.allocator.prefix_stats import PrefixCacheStats, PrefixCachingMetrics
from kvstream.allocator.pool import BlockPool

BS = 4


def make(num_blocks: int = 16, **kw) -> KVCacheManager:
    pool_kw = {k: kw.pop(k) for k in list(kw) if k in ("free_order", "event_style", "hash_form")}
    pool = BlockPool(num_blocks, BS, **pool_kw)
    return KVCacheManager(pool, BlockHasher("sha256_cbor", BS, seed="0"), **kw)


def pool_state(mgr: KVCacheManager) -> tuple:
    p = mgr.pool
    return (p.free_block_ids(), p.cached_blocks(), [b.ref_cnt for b in p.blocks], len(p._events))


def test_prefix_hit_is_capped_at_num_tokens_minus_one() -> None:
    mgr = make()
    a = mgr.new_request("a", range(12))  # 3 full blocks
    assert mgr.admit(a)
    same = mgr.new_request("b", range(12))
    assert len(mgr.get_computed_blocks(same)) == 2  # the last token must be computed
    assert mgr.admit(same)
    assert same.num_prefix_hit_tokens == 8
    assert same.block_ids[:2] == a.block_ids[:2] and same.block_ids[2] != a.block_ids[2]


def test_admit_that_does_not_fit_returns_false_and_changes_nothing() -> None:
    mgr = make(num_blocks=4)  # 3 usable
    big = mgr.new_request("big", range(13))  # needs 4 blocks
    mgr.pool.take_events()
    before = pool_state(mgr)
    assert mgr.admit(big) is False
    assert pool_state(mgr) == before and big.blocks == [] and not big.running
    assert mgr.requests == {}


def test_hits_in_the_free_queue_count_against_free_blocks() -> None:
    mgr = make(num_blocks=5)  # 4 usable
    a = mgr.new_request("a", range(9))  # 3 blocks, 2 full
    assert mgr.admit(a)
    mgr.free(a)  # all 4 free again; blocks of a stay cached
    b = mgr.new_request("b", list(range(8)) + list(range(100, 109)))  # 2 hits + 3 new = 5 blocks
    assert mgr.admit(b) is False


def test_reserve_full_prompt_needs_room_for_the_whole_prompt() -> None:
    prompt = range(20)  # 5 blocks
    strict = make(num_blocks=4)
    assert strict.admit(strict.new_request("r", prompt), num_new_tokens=8) is False
    lax = make(num_blocks=4, reserve_full_prompt=False)
    assert lax.admit(lax.new_request("r", prompt), num_new_tokens=8) is True


def test_chunked_prefill_then_decode_caches_blocks_as_they_fill() -> None:
    mgr = make(hash_form="bytes")
    r = mgr.new_request("r", range(10))
    assert mgr.admit(r, num_new_tokens=6)
    (first,) = mgr.take_events()
    assert first.block_hashes == r.block_hashes[:1] and r.num_computed_tokens == 6
    assert mgr.allocate(r, 4)
    (second,) = mgr.take_events()
    assert second.block_hashes == r.block_hashes[1:2] and second.parent_block_hash == r.block_hashes[0]
    assert len(r.blocks) == 3
    assert mgr.decode(r, 500) and mgr.take_events() == []
    assert mgr.decode(r, 501)  # token 12 completes block 2
    (third,) = mgr.take_events()
    assert third.token_ids == [8, 9, 500, 501] and third.parent_block_hash == r.block_hashes[1]
    assert r.num_cached_blocks == 3 and len(r.block_hashes) == 3
    assert mgr.decode(r, 502) and len(r.blocks) == 4


def test_decode_without_a_free_block_returns_false_and_appends_nothing() -> None:
    mgr = make(num_blocks=2)  # 1 usable block
    r = mgr.new_request("r", range(4))
    assert mgr.admit(r)
    before = (list(r.token_ids), r.num_computed_tokens, pool_state(mgr))
    assert mgr.decode(r, 9) is False
    assert (list(r.token_ids), r.num_computed_tokens, pool_state(mgr)) == before


def test_free_releases_blocks_in_reverse_order() -> None:
    mgr = make(free_order="v0.11")
    r = mgr.new_request("r", range(12))
    assert mgr.admit(r)
    ids = r.block_ids
    mgr.free(r)
    assert mgr.pool.free_block_ids()[-3:] == ids[::-1]
    assert r.blocks == [] and "r" not in mgr.requests


def test_preempted_request_is_readmitted_with_its_own_cached_blocks() -> None:
    mgr = make()
    r = mgr.new_request("r", range(8))
    assert mgr.admit(r)
    for t in range(100, 105):
        assert mgr.decode(r, t)
    old = r.block_ids
    mgr.free(r)
    assert mgr.admit(r)  # 13 tokens: 3 full blocks, hit capped at 12 tokens
    assert r.num_prefix_hit_tokens == 12 and r.block_ids[:3] == old[:3]


def test_bad_calls_raise_manager_errors() -> None:
    mgr = make()
    r = mgr.new_request("r", range(10))
    with pytest.raises(KVCacheManagerError, match="admit"):
        mgr.decode(r, 1)
    assert mgr.admit(r, num_new_tokens=4)
    with pytest.raises(KVCacheManagerError, match="already admitted"):
        mgr.admit(r)
    with pytest.raises(KVCacheManagerError, match="allocate"):
        mgr.decode(r, 1)
    with pytest.raises(KVCacheManagerError, match="tokens left"):
        mgr.allocate(r, 7)
    with pytest.raises(KVCacheManagerError, match="empty prompt"):
        mgr.new_request("e", [])
    with pytest.raises(KVCacheManagerError, match="block_size"):
        KVCacheManager(BlockPool(4, 8), BlockHasher("sha256_cbor", 16, seed="0"))


def test_num_new_tokens_out_of_range_changes_nothing_not_even_stats() -> None:
    mgr = make()
    r = mgr.new_request("r", range(10))
    with pytest.raises(KVCacheManagerError, match="schedule between"):
        mgr.admit(r, num_new_tokens=11)
    assert mgr.stats == PrefixCacheStats()


def test_precomputed_hashes_behave_like_hashing_here() -> None:
    hashed = make()
    a = hashed.new_request("a", range(12))
    pre = make()
    b = pre.new_request("b", range(12), block_hashes=a.block_hashes)
    assert hashed.admit(a) and pre.admit(b)
    assert hashed.take_events() == pre.take_events()
    with pytest.raises(KVCacheManagerError, match="precomputed"):
        for t in range(4):
            pre.decode(b, t)


def test_lora_and_salt_reach_events_in_the_033_form() -> None:
    mgr = make()
    r = mgr.new_request("r", range(8), lora=LoRA("adapter-a", "/p", 7), cache_salt="tenant")
    assert mgr.admit(r)
    (ev,) = mgr.take_events()
    assert (ev.lora_id, ev.lora_name) == (7, "adapter-a")
    assert ev.extra_keys == [("adapter-a", "tenant"), ("adapter-a",)]
    plain = mgr.new_request("p", range(8))
    assert mgr.get_computed_blocks(plain) == []  # LoRA and salt change the chain


def test_prefix_cache_stats_and_hit_rate_over_recent_requests() -> None:
    mgr = make(max_recent_requests=2)
    a = mgr.new_request("a", range(8))
    assert mgr.admit(a)  # 8 queries, 0 hits
    b = mgr.new_request("b", range(9))
    assert mgr.admit(b)  # 9 queries, 8 hits
    assert mgr.stats == PrefixCacheStats(2, 17, 8)
    assert mgr.metrics.hit_rate == pytest.approx(8 / 17)
    c = mgr.new_request("c", range(100, 104))
    assert mgr.admit(c)  # window keeps the last 2 requests
    assert mgr.metrics.hit_rate == pytest.approx(8 / 13)
    step = mgr.make_prefix_cache_stats()
    assert (step.requests, step.queries, step.hits) == (3, 21, 8)
    assert mgr.make_prefix_cache_stats() == PrefixCacheStats()
    for r in (a, b, c):
        mgr.free(r)
    assert mgr.reset_prefix_cache()
    assert mgr.metrics.hit_rate == 0.0 and mgr.make_prefix_cache_stats().reset


def test_prefix_caching_metrics_observe_and_reset() -> None:
    m = PrefixCachingMetrics(max_recent_requests=10)
    m.observe(PrefixCacheStats(requests=5, queries=100, hits=50))
    m.observe(PrefixCacheStats(requests=6, queries=100, hits=0))  # pushes the first out
    assert m.hit_rate == 0.0 and m.aggregated_requests == 6
    m.observe(PrefixCacheStats(requests=1, queries=10, hits=10, reset=True))
    assert m.hit_rate == 1.0
    with pytest.raises(ValueError):
        PrefixCachingMetrics(0)


# -- decode_many --------------------------------------------------------------------------


def _twin_state(mgr: KVCacheManager, reqs) -> tuple:
    p = mgr.pool
    return (p.free_block_ids(), p.cached_blocks(), [b.ref_cnt for b in p.blocks],
            [(r.block_ids, r.token_ids, r.num_computed_tokens, r.num_cached_blocks) for r in reqs])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(6, 14),
    other=st.integers(1, 12),  # tokens of a request that is cached, then freed (eviction fodder)
    prompt=st.integers(1, 11),
    chunks=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    event_style=st.sampled_from(["0.33", "0.11"]),
    free_order=st.sampled_from(["v0.33", "v0.11"]),
    precomputed=st.booleans(),
)
def test_decode_many_equals_that_many_single_decodes(num_blocks, other, prompt, chunks, event_style,
                                                      free_order, precomputed) -> None:
    twins = []
    for _ in range(2):
        mgr = make(num_blocks, event_style=event_style, free_order=free_order)
        fodder = mgr.new_request("old", range(500, 500 + other))
        if mgr.admit(fodder):
            mgr.free(fodder)
        outputs = list(range(1000, 1000 + sum(chunks)))
        if precomputed:
            chain = BlockHasher("sha256_cbor", BS, seed="0").hash_blocks(list(range(prompt)) + outputs)
            req = mgr.new_request("r", range(prompt), block_hashes=chain)
        else:
            req = mgr.new_request("r", range(prompt))
        assume(mgr.admit(req))
        mgr.pool.take_events()
        twins.append((mgr, req))
    (one, r1), (many, r2) = twins
    pos = 0
    for n in chunks:
        toks = list(range(1000 + pos, 1000 + pos + n))
        before = _twin_state(many, [r2])
        ok = many.decode_many(r2, toks)
        if not ok:
            # All or nothing: refused only when the blocks do not fit, and then unchanged.
            assert _twin_state(many, [r2]) == before and not many.pool.take_events()
            need = -(-(r2.num_computed_tokens + n) // BS) - len(r2.blocks)
            assert need > many.pool.get_num_free_blocks()
            return
        for t in toks:
            assert one.decode(r1, t)
        pos += n
        assert many.pool.take_events() == one.pool.take_events()
        assert _twin_state(many, [r2]) == _twin_state(one, [r1])
        many.pool.check_invariants()
    assert many.pool.snapshot_events() == one.pool.snapshot_events()


def test_decode_many_that_does_not_fit_returns_false_and_changes_nothing() -> None:
    mgr = make(num_blocks=4)  # 3 usable
    req = mgr.new_request("r", range(6))  # 2 blocks
    assert mgr.admit(req)
    mgr.pool.take_events()
    before = pool_state(mgr), list(req.token_ids), req.num_computed_tokens
    assert not mgr.decode_many(req, list(range(100, 107)))  # 13 tokens need 4 blocks
    assert (pool_state(mgr), req.token_ids, req.num_computed_tokens) == before
    assert mgr.decode_many(req, list(range(100, 106)))  # 12 tokens: exactly 3 blocks
    assert req.num_cached_blocks == 3 and mgr.pool.get_num_free_blocks() == 0


def test_decode_many_refuses_bad_calls_before_changing_anything() -> None:
    mgr = make()
    req = mgr.new_request("r", range(9))
    with pytest.raises(KVCacheManagerError, match="not running"):
        mgr.decode_many(req, [1, 2])
    assert mgr.admit(req, 4)  # chunked: 5 prompt tokens still to compute
    with pytest.raises(KVCacheManagerError, match="prompt tokens"):
        mgr.decode_many(req, [1, 2])
    short = mgr.new_request("s", range(3), block_hashes=[])
    assert mgr.admit(short)
    before = pool_state(mgr), list(short.token_ids)
    with pytest.raises(KVCacheManagerError, match="precomputed block hashes"):
        mgr.decode_many(short, [7, 8, 9])  # would complete block 0, which has no hash
    assert (pool_state(mgr), short.token_ids) == before


def test_an_array_prompt_gives_the_same_blocks_and_events_as_a_list() -> None:
    from array import array

    from kvstream.hashing import BlockHasher
    from kvstream.allocator.manager import KVCacheManager
    from kvstream.allocator.pool import BlockPool

    runs = []
    for as_array in (False, True):
        pool = BlockPool(12, 4)
        m = KVCacheManager(pool, BlockHasher(block_size=4))
        toks = list(range(1, 11))
        r = m.new_request("a", array("I", toks) if as_array else toks)
        assert m.admit(r)
        for t in (50, 51, 52, 53, 54):
            assert m.decode(r, t)
        assert m.decode_many(r, [60, 61, 62, 63, 64])
        m.free(r)
        r2 = m.new_request("b", array("I", toks) if as_array else toks)
        assert m.admit(r2) and r2.num_prefix_hit_tokens == 8
        assert list(r.token_ids) == toks + [50, 51, 52, 53, 54, 60, 61, 62, 63, 64]
        runs.append((m.take_events(), pool.snapshot_events(), r.block_hashes))
    assert runs[0] == runs[1]
    assert all(type(e.token_ids) is list for e in runs[1][0] if hasattr(e, "token_ids"))


@pytest.mark.parametrize("bad", [1.5, "7", None, -1, 2**64, [3]])
def test_token_ids_that_cannot_go_on_the_wire_are_refused_when_the_request_is_created(bad) -> None:
    mgr = make()
    before = pool_state(mgr)
    with pytest.raises(KVCacheManagerError, match="cannot go on the wire"):
        mgr.new_request("r", [1, 2, bad, 4])
    assert pool_state(mgr) == before and not mgr.requests


@pytest.mark.parametrize("bad", [1.5, "7", True, -1, 2**64])
def test_an_output_token_that_cannot_go_on_the_wire_is_refused_and_not_appended(bad) -> None:
    mgr = make()
    req = mgr.new_request("r", list(range(6)))
    assert mgr.admit(req)
    before = (pool_state(mgr), list(req.token_ids), req.num_computed_tokens)
    for n in range(BS):  # at a block boundary and inside a block
        with pytest.raises(KVCacheManagerError, match="cannot go on the wire"):
            mgr.decode(req, bad)
        with pytest.raises(KVCacheManagerError, match="cannot go on the wire"):
            mgr.decode_many(req, [5, bad])
        assert (pool_state(mgr), list(req.token_ids), req.num_computed_tokens) == before
        assert mgr.decode(req, 9)
        before = (pool_state(mgr), list(req.token_ids), req.num_computed_tokens)


def test_a_duplicate_running_request_id_is_refused_and_the_first_keeps_its_blocks() -> None:
    mgr = make()
    first = mgr.new_request("same", list(range(10)))
    twin = mgr.new_request("same", list(range(50, 60)))  # allowed while neither runs
    assert mgr.admit(first)
    before = pool_state(mgr)
    with pytest.raises(KVCacheManagerError, match="already running"):
        mgr.admit(twin)
    with pytest.raises(KVCacheManagerError, match="already running"):
        mgr.new_request("same", [1, 2, 3])
    assert pool_state(mgr) == before and mgr.requests["same"] is first and not twin.blocks
    mgr.free(first)
    assert mgr.pool.get_num_free_blocks() == 15  # nothing leaked


@pytest.mark.parametrize("window", [1, 3, 50])
def test_hit_rate_window_read_at_any_moment_equals_one_fed_every_admission(window: int) -> None:
    """The window is brought up to date when read: whenever it is read, it equals a window
    fed each admission attempt (failed ones too) as it happened."""
    import random

    rng = random.Random(window)
    mgr = make(max_recent_requests=window)
    eager = PrefixCachingMetrics(window)
    running = []
    for i in range(300):
        q0, h0 = mgr.stats.queries, mgr.stats.hits
        req = mgr.new_request(i, list(range(rng.randrange(3))) + [rng.randrange(40) for _ in range(rng.randrange(1, 12))])
        if mgr.admit(req):
            running.append(req)
        eager.add(1, mgr.stats.queries - q0, mgr.stats.hits - h0)
        while running and (rng.random() < 0.4 or mgr.pool.get_num_free_blocks() < 3):
            mgr.free(running.pop(rng.randrange(len(running))))
        if rng.random() < 0.05 and not running and mgr.reset_prefix_cache():
            eager.reset()
        if rng.random() < 0.2:
            m = mgr.metrics
            assert (m.aggregated_requests, m.aggregated_query_total, m.aggregated_query_hit) == (
                eager.aggregated_requests, eager.aggregated_query_total, eager.aggregated_query_hit)
            assert m.hit_rate == eager.hit_rate


def test_numpy_token_ids_are_token_ids_with_the_same_hashes_and_events() -> None:
    np = pytest.importorskip("numpy")
    ids = list(range(1, 41))
    runs = []
    for toks, out in ((ids, [7, 8, 9]), (list(np.array(ids, dtype=np.int64)), [np.int64(7), np.int32(8), np.uint16(9)])):
        pool = BlockPool(32, enable_caching=True, enable_kv_cache_events=True)
        m = KVCacheManager(pool, BlockHasher("sha256_cbor", block_size=16))
        r = m.new_request("r", toks)
        assert all(type(t) is int for t in r.token_ids)
        assert m.admit(r)
        assert m.decode(r, out[0]) and m.decode_many(r, out[1:])
        runs.append((r.block_hashes, pool.take_events()))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("bad", [1.5, "3", None])
def test_a_token_id_that_is_not_an_integer_is_a_typed_error(bad: object) -> None:
    m = KVCacheManager(BlockPool(32, enable_caching=True), BlockHasher("sha256_cbor", block_size=16))
    with pytest.raises(KVCacheManagerError, match="cannot go on the wire"):
        m.new_request("r", [1, 2, bad])  # type: ignore[list-item]
