"""KVIndex behaviours, one rule per test (see docs/router.md); the rules both keyings
obey are in test_residency_rules.py."""

from __future__ import annotations

import pytest

from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstream.routing.index import KVIndex, IndexUsageError

BS = 16


def P(base: int, n: int) -> list[int]:
    return [base + i for i in range(n * BS)]


def stored(hashes, tokens, parent=None, medium="GPU", group=0, bs=BS, lora_id=None, lora_name=None, extra=None):
    return BlockStored(list(hashes), parent, list(tokens), bs, lora_id, medium, lora_name, extra, group)


def apply(idx: KVIndex, source: str, *events) -> None:
    idx.apply_batch(source, KVEventBatch(1.0, list(events)))


def blocks(idx: KVIndex, source: str) -> dict:
    return {(m, g, h): n for m, g, h, n in idx.state()["sources"][source]["blocks"]}


def test_the_reannounce_rule_is_set_per_source_from_its_engines_configuration() -> None:
    idx = KVIndex()
    p = P(0, 1)
    idx.configure_source("report", reannounce="detect")  # every request in report mode
    for name in ("report", "plain"):
        apply(idx, name, stored([1], p))
        apply(idx, name, stored([1], p))  # no session id
    assert blocks(idx, "report") == {("GPU", 0, 1): 1}
    assert blocks(idx, "plain") == {("GPU", 0, 1): 2}
    with pytest.raises(IndexUsageError, match="reannounce"):
        idx.configure_source("plain", reannounce="sometimes")


def test_child_stored_before_its_parent_is_kept_and_linked_later() -> None:
    idx = KVIndex()
    p = P(0, 3)
    apply(idx, "e", stored([3], p[2 * BS :], parent=2))
    apply(idx, "e", stored([2], p[BS : 2 * BS], parent=1))
    assert idx.match(p)["e"].blocks == 0
    assert idx.state()["unlinked"] == (2, 3)
    assert idx.match_engine_hashes([1, 2, 3])["e"] == 0
    apply(idx, "e", stored([1], p[:BS]))
    assert idx.match(p)["e"].blocks == 3
    assert idx.state()["unlinked"] == ()
    assert idx.stats.linked_blocks == 2


def test_unlinked_blocks_can_be_removed_and_match_by_engine_hash() -> None:
    idx = KVIndex()
    p = P(0, 3)
    apply(idx, "e", stored([2, 3], p[BS:], parent=1))
    assert idx.match_engine_hashes([2, 3])["e"] == 2
    apply(idx, "e", BlockRemoved([3], "GPU"))
    assert blocks(idx, "e") == {("GPU", 0, 2): 1}
    assert idx.stats.unknown_removed == 0


def test_cpu_offload_event_without_tokens_locates_a_known_block() -> None:
    idx = KVIndex()
    p = P(0, 2)
    apply(idx, "e", stored([1, 2], p))
    apply(idx, "e", stored([1], [], medium="CPU", bs=0), stored([2], [], medium="CPU", bs=0))
    apply(idx, "e", BlockRemoved([2], "GPU"))
    m = idx.match(p)["e"]
    assert m.blocks == 2 and m.tier_blocks == {"GPU": 1, "CPU": 2} and m.served == {"GPU": 1, "CPU": 1}
    apply(idx, "e", BlockRemoved([1, 2], "CPU"))
    assert idx.match(p)["e"].tier_blocks == {"GPU": 1}


def test_offload_of_a_block_never_seen_on_gpu_links_when_its_tokens_arrive() -> None:
    idx = KVIndex()
    p = P(0, 1)
    apply(idx, "e", stored([1], [], medium="CPU", bs=0))
    assert idx.match(p)["e"].blocks == 0
    apply(idx, "f", stored([1], p))
    assert idx.match(p)["e"].tier_blocks == {"CPU": 1}


def test_stale_source_stops_scoring_and_clear_source_restores_it() -> None:
    idx = KVIndex()
    p = P(0, 2)
    apply(idx, "e", stored([1, 2], p))
    idx.mark_stale("e")
    assert idx.match(p)["e"].blocks == 0 and idx.match(p)["e"].stale
    apply(idx, "e", BlockRemoved([2], "GPU"))  # still tracked while stale
    idx.mark_stale("e", False)
    assert idx.match(p)["e"].blocks == 1
    idx.clear_source("e")
    assert idx.state()["sources"]["e"]["blocks"] == ()
    idx.remove_source("e")
    assert "e" not in idx.sources


def test_engines_with_block_size_32_share_the_index_with_16() -> None:
    idx = KVIndex(router_block_size=16)
    p = P(0, 4)
    apply(idx, "big", stored([10, 11], p, bs=32))
    apply(idx, "small", stored([1, 2, 3], p[: 3 * BS]))
    m = idx.match(p)
    assert m["big"].blocks == 4 and m["small"].blocks == 3
    assert idx.match(p[: 3 * BS])["big"].blocks == 2  # only whole engine blocks count
    apply(idx, "big", BlockRemoved([11], "GPU"))
    assert idx.match(p)["big"].blocks == 2


def test_block_size_not_a_multiple_of_the_router_block_is_tracked_but_unkeyed() -> None:
    idx = KVIndex(router_block_size=16)
    apply(idx, "odd", stored([5], list(range(24)), bs=24))
    assert idx.stats.unkeyable_blocks == 1
    assert blocks(idx, "odd") == {("GPU", 0, 5): 1}
    assert idx.match_engine_hashes([5])["odd"] == 1


def test_lora_by_name_and_by_id_are_separate_namespaces() -> None:
    idx = KVIndex()
    p = P(0, 2)
    apply(idx, "v033", stored([1, 2], p, lora_id=3, lora_name="ad", extra=[["ad"], ["ad"]]))
    apply(idx, "v011", stored([7, 8], p, lora_id=3))
    assert idx.match(p, lora="ad")["v033"].blocks == 2
    assert idx.match(p, lora=3)["v011"].blocks == 2
    assert idx.match(p, lora="ad")["v011"].blocks == 0
    assert idx.match(p)["v033"].blocks == 0 and idx.match(p)["v011"].blocks == 0


def test_mixed_hash_seeds_on_one_block_size_are_detected_not_conflated() -> None:
    idx = KVIndex()
    p = P(0, 1)
    apply(idx, "a", stored([1], p))
    apply(idx, "b", stored([2], p))  # same tokens, another seed: another hash
    assert idx.stats.family_conflicts == 1
    apply(idx, "a", BlockRemoved([1], "GPU"))
    assert blocks(idx, "b") == {("GPU", 0, 2): 1}
    assert blocks(idx, "a") == {}


def test_malformed_event_is_skipped_and_counted() -> None:
    idx = KVIndex()
    apply(idx, "e", stored([1, 2], list(range(20))), stored([3], P(0, 1)))
    assert idx.stats.rejected_events == 1
    assert blocks(idx, "e") == {("GPU", 0, 3): 1}


def test_memory_bound_drops_least_recently_stored_first() -> None:
    bound = 64 * 1024
    idx = KVIndex(max_bytes=bound)
    for i in range(2000):
        apply(idx, "e", stored([1000 + i], P(10_000 * i, 1)))
        assert idx.estimated_bytes() <= bound
    assert idx.stats.evicted_blocks > 0
    assert idx.match(P(10_000 * 1999, 1))["e"].blocks == 1
    assert idx.match(P(0, 1))["e"].blocks == 0


def test_ttl_drops_blocks_not_restored_for_two_generations() -> None:
    idx = KVIndex(ttl_s=10.0)
    p, q = P(0, 1), P(500, 1)
    idx.apply_batch("e", KVEventBatch(0.0, [stored([1], p)]))
    idx.apply_batch("e", KVEventBatch(11.0, [stored([2], q)]))
    assert idx.match(p)["e"].blocks == 1
    idx.apply_batch("e", KVEventBatch(22.0, []))
    assert idx.match(p)["e"].blocks == 0 and idx.match(q)["e"].blocks == 1
    assert idx.stats.expired_blocks == 1


def test_bad_arguments_raise_with_the_fix() -> None:
    with pytest.raises(IndexUsageError, match="router_block_size"):
        KVIndex(router_block_size=0)
    with pytest.raises(IndexUsageError, match="same setting"):
        KVIndex(16, router_block_size=32)
    with pytest.raises(IndexUsageError, match="unknown source"):
        KVIndex().source_info("nope")
    with pytest.raises(IndexUsageError, match="hasher"):
        KVIndex().engine_hashes([1] * 16)


def test_engine_hash_matching_with_the_engines_hasher() -> None:
    from kvstream.hashing import BlockHasher, RequestBlockHasher, to_external_list

    h = BlockHasher("sha256_cbor", 16, seed="s")
    idx = KVIndex(hasher=h)
    p = P(0, 3)
    rh = RequestBlockHasher(h)
    rh.extend(p)
    hashes = to_external_list(rh.block_hashes)
    apply(idx, "e", stored(hashes[1:], p[BS:], parent=hashes[0]))  # parent never seen
    assert idx.match(p)["e"].blocks == 0  # token keys cannot chain yet
    assert idx.engine_hashes(p) == hashes
    assert idx.match_engine_hashes(idx.engine_hashes(p))["e"] == 0
    apply(idx, "e", stored(hashes[:1], p[:BS]))
    assert idx.match_engine_hashes(hashes)["e"] == 3 and idx.match(p)["e"].blocks == 3


def _best_cases():
    """Indexes in several states (one tier; stale; engine blocks of 2 router blocks; CPU
    tier; speculation) with prompts and loads that tie, differ and name unknown sources."""
    from kvstream.routing.scoring import Load, PrefixLoadPolicy

    policies = [None, PrefixLoadPolicy(), PrefixLoadPolicy(queue_weight=0.25, running_weight=0.05, kv_weight=0.5),
                PrefixLoadPolicy(queue_weight=0.0, running_weight=0.0, kv_weight=0.0),
                PrefixLoadPolicy(tier_weights={"CPU": 0.8}, other_tier_weight=0.3)]
    loads_list = [None, {}, {"a": Load(1, 2, 0.5), "b": Load(0, 1, 0.25)},
                  {"a": Load(0, 0, 0.0), "b": Load(0, 0, 0.0), "c": Load(0, 0, 0.0), "z": Load(0, 0, 0.0)},
                  {"c": Load(3, 0, 0.1), "new": Load(0, 0, 0.0)}]
    p = P(0, 4)
    prompts = [p, p[:2 * BS], p[: 3 * BS + 5], P(500, 3), []]
    one = KVIndex()
    apply(one, "a", stored([1, 2], p[: 2 * BS]))
    apply(one, "b", stored([1, 2, 3], p[: 3 * BS]))
    apply(one, "c", stored([9], P(500, 1)))
    stale = KVIndex()
    apply(stale, "a", stored([1, 2, 3, 4], p))
    apply(stale, "b", stored([1], p[:BS]))
    stale.mark_stale("a")
    coarse = KVIndex(router_block_size=BS // 2)  # every engine block is 2 router blocks
    apply(coarse, "a", stored([1, 2], p[: 2 * BS]))
    apply(coarse, "b", stored([1], p[:BS]))
    # b also holds a block whose first half matches the prompt: that half must not count.
    apply(coarse, "c", stored([1], p[:BS]), stored([7], p[BS:BS + BS // 2] + [999] * (BS // 2), parent=1))
    cpu = KVIndex()
    apply(cpu, "a", stored([1, 2], p[: 2 * BS]), stored([3], [], medium="CPU", bs=0))
    apply(cpu, "b", stored([1, 2, 3], p[: 3 * BS]))
    apply(cpu, "b", stored([1, 2, 3], [], medium="CPU", bs=0))
    spec = KVIndex()
    apply(spec, "a", stored([1], p[:BS]))
    spec.speculate("b", p, now=0.0)
    for idx in (one, stale, coarse, cpu, spec, KVIndex()):
        for pol in policies:
            for loads in loads_list:
                for prompt in prompts:
                    yield idx, pol, loads, prompt


def test_best_names_the_head_of_the_score_ranking() -> None:
    n = 0
    for idx, pol, loads, prompt in _best_cases():
        keys = idx.keys(prompt)
        assert idx.best(keys, loads, pol) == idx.score(prompt, loads=loads, policy=pol).best, (pol, loads, prompt)
        n += 1
    assert n == 6 * 5 * 5 * 5


def test_a_source_that_changed_block_size_is_removed_cleanly() -> None:
    """Hash 1 stored as one router block, then as an engine block of two router blocks
    with a tokenless CPU copy (an offload placeholder of that block), then as one router
    block again: removing the source must release every holding once (found by
    test_score_fast_path on 2026-12-04: the drop inferred the source's holdings from key
    masks by its current block size, so the other size's holdings were skipped and one
    table entry was deleted twice). See test_block_size_families.py for the general case."""
    idx = KVIndex()
    apply(idx, "a", stored([1], P(0, 1)), stored([1], P(0, 1)))
    apply(idx, "a", stored([1], P(0, 2), bs=2 * BS), stored([1], [], medium="CPU", bs=0))
    apply(idx, "a", stored([1], P(0, 1)))
    idx.remove_source("a")
    assert idx.sources == [] and not any(idx._held) and not idx._href and len(idx._table) == 0
