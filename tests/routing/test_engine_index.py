"""EngineKeyIndex: the router index keyed by engine hashes, one rule per test, then against
real vLLM (the golden captures: residency after every batch, every request's score) and
against real allocators under churn (the property run of tests/routing/test_index_property.py)."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.routing.engine_index import BYTES_PER_ENGINE_BLOCK, EngineKeyIndex
from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstream.hashing import BlockHasher, LoRA, MMItem, RequestBlockHasher, to_external_list
from kvstream.routing.index import IndexUsageError, KVIndex
from kvstream.routing.router import apply_item
from kvstream.routing.scoring import Load, PrefixLoadPolicy
from kvstream.transport import SourceBatch, SourceReset, SourceStale

from tests.routing.golden_index import (
    expected_prefix,
    golden_requests,
    index_residency,
    pool_residency,
    read_live_batches,
    workload_prompts,
)
from tests.routing.test_index_property import _Engine, run_against_pools

BS = 16
HASHER = BlockHasher("xxhash", BS, seed="0")


def P(base: int, n: int) -> list[int]:
    return [base + i for i in range(n * BS)]


def H(prompt: list[int], **kw) -> list[int]:
    """The engine's int hashes of a prompt (the hashes its events would carry)."""
    rh = RequestBlockHasher(HASHER, **kw)
    rh.extend(prompt)
    return to_external_list(rh.block_hashes)


def stored(hashes, tokens, parent=None, medium="GPU", group=0, bs=BS):
    return BlockStored(list(hashes), parent, list(tokens), bs, None, medium, None, None, group)


def cpu(hashes):
    return BlockStored(list(hashes), None, [], 0, None, "CPU", None)


def apply(idx, source: str, *events, ts: float = 1.0) -> None:
    idx.apply_batch(source, KVEventBatch(ts, list(events)))


def blocks(idx, source: str) -> dict:
    return {(m, g, h): n for m, g, h, n in idx.state()["sources"][source]["blocks"]}


def new() -> EngineKeyIndex:
    return EngineKeyIndex(HASHER)


# -- rules -------------------------------------------------------------------------------


def test_scoring_computes_the_engines_hashes_and_reports_blocks_and_tokens() -> None:
    idx = new()
    p = P(0, 4)
    h = H(p)
    assert idx.keys(p) == h and idx.router_block_size == BS
    apply(idx, "a", stored(h[:3], p[: 3 * BS]))
    apply(idx, "b", stored(h[:1], p[:BS]))
    m = idx.match(p + [7] * 5)
    assert (m["a"].blocks, m["a"].tokens, m["b"].blocks) == (3, 48, 1)
    assert idx.score(p).ranking == ["a", "b"] and idx.best(h) == "a"


def test_a_block_stored_with_an_unknown_parent_matches_at_once() -> None:
    idx = new()
    p = P(0, 3)
    h = H(p)
    apply(idx, "e", stored(h[1:], p[BS:], parent=h[0]))  # joined late: block 0 never seen
    assert idx.match(p)["e"].blocks == 0  # a prefix starts at block 0
    apply(idx, "f", cpu(h[:1]))
    apply(idx, "e", stored(h[:1], p[:BS]))
    assert idx.match(p)["e"].blocks == 3 and idx.state()["unlinked"] == ()


def test_cpu_offload_of_a_block_never_seen_on_gpu_is_matchable() -> None:
    idx = new()
    p = P(0, 2)
    h = H(p)
    apply(idx, "e", cpu(h))
    m = idx.match(p)["e"]
    assert m.blocks == 2 and m.tier_blocks == {"CPU": 2} and m.served == {"CPU": 2}
    apply(idx, "e", stored(h[:1], p[:BS]))
    m = idx.match(p)["e"]
    assert m.tier_blocks == {"GPU": 1, "CPU": 2} and m.served == {"GPU": 1, "CPU": 1}
    apply(idx, "e", BlockRemoved(h, "CPU"))
    assert idx.match(p)["e"].tier_blocks == {"GPU": 1}


def test_stale_source_stops_scoring_and_clear_and_remove_work() -> None:
    idx = new()
    p = P(0, 2)
    h = H(p)
    apply(idx, "e", stored(h, p))
    idx.mark_stale("e")
    assert idx.match(p)["e"].blocks == 0 and idx.match(p)["e"].stale
    apply(idx, "e", BlockRemoved(h[1:], "GPU"))  # still tracked while stale
    idx.mark_stale("e", False)
    assert idx.match(p)["e"].blocks == 1
    idx.clear_source("e")
    assert idx.state()["sources"]["e"]["blocks"] == ()
    apply(idx, "f", stored(h, p))
    idx.remove_source("f")
    assert "f" not in idx.sources and idx.state()["sources"] == {"e": {"stale": False, "blocks": ()}}
    # Nothing held: only the empty tables and the source table remain.
    assert idx.estimated_bytes() <= EngineKeyIndex(HASHER).estimated_bytes() + 2 * 600 + 400


def test_lora_salt_and_image_are_matched_through_the_engine_hash() -> None:
    idx = new()
    p = P(0, 3)
    ad = LoRA("adapter-a", "/adapters/a", 1)
    img = MMItem("image-1", 4, 20)
    apply(idx, "lora", stored(H(p, lora=ad), p))
    apply(idx, "salt", stored(H(p, cache_salt="t1"), p))
    apply(idx, "mm", stored(H(p, mm_items=[img]), p))
    def best(**kw):
        return {n: m.blocks for n, m in idx.match(p, **kw).items() if m.blocks}
    assert best(lora=ad) == {"lora": 3}
    assert best(lora=LoRA("adapter-a", "/elsewhere", 1)) == {}
    assert best(salt="t1") == {"salt": 3} and best(salt="t2") == {}
    assert best(mm_items=[img]) == {"mm": 3} and best(mm_items=[("image-1", 4, 20)]) == {"mm": 3}
    assert best(mm_items=[MMItem("image-2", 4, 20)]) == {}
    assert best() == {}
    with pytest.raises(IndexUsageError, match="LoRA"):
        idx.keys(p, lora="adapter-a")
    with pytest.raises(IndexUsageError, match="length"):
        idx.keys(p, mm_items=[("image-1", 4)])


def test_a_different_block_size_is_rejected_counted_and_logged_once(caplog) -> None:
    idx = new()
    p = P(0, 2)
    with caplog.at_level(logging.WARNING, logger="kvstream.routing.engine_index"):
        apply(idx, "big", stored([5], p, bs=32))
        apply(idx, "big", stored([6], p, bs=32))
    assert idx.stats.foreign_block_size == 2
    assert blocks(idx, "big") == {}
    assert sum("block_size 32" in r.getMessage() for r in caplog.records) == 1


def test_hashes_in_the_other_form_are_kept_and_counted() -> None:
    idx = new()  # int form
    apply(idx, "e", stored([b"\x01" * 16], P(0, 1)))
    assert idx.stats.foreign_hash_form == 1
    apply(idx, "e", BlockRemoved([b"\x01" * 16], "GPU"))
    assert blocks(idx, "e") == {} and idx.stats.unknown_removed == 0


def test_bytes_form_matches_bytes_hashes() -> None:
    idx = EngineKeyIndex(HASHER, hash_form="bytes")
    p = P(0, 2)
    rh = RequestBlockHasher(HASHER)
    rh.extend(p)
    apply(idx, "e", stored(to_external_list(rh.block_hashes, "bytes"), p))
    assert idx.keys(p) == rh.block_hashes and idx.match(p)["e"].blocks == 2


def test_memory_bound_drops_oldest_stored_first() -> None:
    bound = 200 * BYTES_PER_ENGINE_BLOCK
    idx = EngineKeyIndex(HASHER, max_bytes=bound)
    for i in range(400):
        p = P(10_000 * i, 1)
        apply(idx, "e", stored(H(p), p))
    assert idx.estimated_bytes() <= bound and idx.stats.evicted_blocks > 0
    assert idx.match(P(10_000 * 399, 1))["e"].blocks == 1
    assert idx.match(P(0, 1))["e"].blocks == 0
    assert idx.source_info("e").blocks["GPU"] == len(idx.state()["sources"]["e"]["blocks"])


def test_ttl_drops_blocks_not_restored_for_two_generations() -> None:
    idx = EngineKeyIndex(HASHER, ttl_s=10.0)
    p, q = P(0, 1), P(500, 1)
    apply(idx, "e", stored(H(p), p), ts=0.0)
    apply(idx, "e", stored(H(q), q), ts=11.0)
    assert idx.match(p)["e"].blocks == 1
    apply(idx, "e", ts=22.0)
    assert idx.match(p)["e"].blocks == 0 and idx.match(q)["e"].blocks == 1
    assert idx.stats.expired_blocks == 1


def test_bad_arguments_raise_with_the_fix() -> None:
    with pytest.raises(IndexUsageError, match="BlockHasher"):
        EngineKeyIndex(None)  # type: ignore[arg-type]
    with pytest.raises(IndexUsageError, match="hash_form"):
        EngineKeyIndex(HASHER, hash_form="hex")
    with pytest.raises(IndexUsageError, match="max_bytes"):
        EngineKeyIndex(HASHER, max_bytes=0)
    with pytest.raises(IndexUsageError, match="unknown source"):
        new().source_info("nope")


def test_speculation_marks_the_chosen_source_until_expiry() -> None:
    idx = new()
    p = P(0, 4)
    idx.add_source("a")
    assert idx.speculate("b", p, now=0.0, ttl_s=1.0) == 4
    m = idx.match(p)["b"]
    assert m.blocks == 4 and m.speculative_blocks == 4
    idx.expire(2.0)
    assert idx.match(p)["b"].blocks == 0


def test_best_names_the_head_of_the_score_ranking() -> None:
    p = P(0, 4)
    h = H(p)
    one = new()
    apply(one, "a", stored(h[:2], p[: 2 * BS]))
    apply(one, "b", stored(h[:3], p[: 3 * BS]))
    stale = new()
    apply(stale, "a", stored(h, p))
    apply(stale, "b", stored(h[:1], p[:BS]))
    stale.mark_stale("a")
    tiers = new()
    apply(tiers, "a", stored(h[:2], p[: 2 * BS]), cpu(h[2:3]))
    apply(tiers, "b", cpu(h))
    policies = [None, PrefixLoadPolicy(queue_weight=0.0, running_weight=0.0, kv_weight=0.0)]
    loads_list = [None, {"a": Load(1, 2, 0.5), "b": Load(0, 1, 0.25)}, {"new": Load(0, 0, 0.0)}]
    n = 0
    for idx in (one, stale, tiers, new()):
        for pol in policies:
            for loads in loads_list:
                for prompt in (p, p[: 2 * BS + 3], []):
                    keys = idx.keys(prompt)
                    assert idx.best(keys, loads, pol) == idx.score(prompt, loads=loads, policy=pol).best
                    n += 1
    assert n == 4 * 2 * 3 * 3


def test_apply_item_and_replayed_items_give_an_equal_state() -> None:
    p, q = P(100, 4), P(900, 2)
    hp, hq = H(p), H(q)

    def item(source, seq, events):
        b = KVEventBatch(float(seq), events)
        return SourceBatch(source, seq, b"", b"", b, False)

    items = [
        item("e0", 0, [stored(hp, p)]),
        item("e1", 0, [stored(hq, q), stored(hp[:2], p[: 2 * BS])]),
        item("e0", 1, [BlockRemoved(hp[3:], "GPU"), stored(hp[2:3], p[2 * BS : 3 * BS], parent=hp[1])]),
        SourceStale("e1", "gap", 1, 3),
        item("e1", 3, [AllBlocksCleared()]),
        SourceReset("e0", "restart", 2),
        item("e0", 2, [stored(hp[:1], p[:BS])]),
    ]
    a, b = new(), new()
    for it in items:
        apply_item(a, it)
    for it in items:
        apply_item(b, it)
    assert a.state() == b.state() != new().state()
    assert a.match(p)["e0"].blocks == 1 and a.match(p)["e1"].stale


# -- against real vLLM (golden captures) ----------------------------------------------------

GOLDEN = {
    # 0.11: PYTHONHASHSEED=0, untagged extra keys; 0.33: the default seed.
    "vllm-0.11.0": BlockHasher("sha256_cbor", 16, extra_key_style="0.11", rules="0.11", seed="0"),
    "vllm-0.33.0": BlockHasher("sha256_cbor", 16, seed="vllm-none-hash"),
}


def _request_args(req: dict) -> dict:
    lo = req.get("lora")
    return {
        "lora": LoRA(lo["lora_name"], lo["lora_path"], lo["lora_int_id"]) if lo else None,
        "salt": req.get("cache_salt"),
        "mm_items": [MMItem(it["identifier"], it["offset"], it["length"]) for it in req.get("mm") or []],
    }


@pytest.mark.parametrize("version", sorted(GOLDEN))
def test_residency_equals_the_pool_snapshot_after_every_batch(golden_dir: Path, version: str) -> None:
    d = golden_dir / version
    stream = json.loads((d / "stream.json").read_text())
    batches = read_live_batches(d / "stream.bin")
    index = EngineKeyIndex(GOLDEN[version])
    cpu_expected: Counter = Counter()
    published = 0
    for step in stream["steps"]:
        seq = step["published_seq"]
        if seq is None:
            continue
        index.apply_batch("engine0", batches[seq])
        published += 1
        assert index_residency(index, "engine0", "GPU") == pool_residency(step["pool_after"]), step["step"]
        for op in step["ops_result"]:
            if op["op"] in ("offload_store", "offload_remove"):
                hashes = stream["requests"][op["req"]]["block_hashes_int"]
                for b in op["blocks"]:
                    cpu_expected[(hashes[b], 0)] += 1 if op["op"] == "offload_store" else -1
        assert index_residency(index, "engine0", "CPU") == +cpu_expected, step["step"]
    assert published == len(batches)
    st = index.stats
    assert (st.unknown_removed, st.rejected_events, st.foreign_block_size, st.foreign_hash_form) == (0, 0, 0, 0)


@pytest.mark.parametrize("version", sorted(GOLDEN))
def test_every_request_scores_the_pools_cached_prefix_salts_included(golden_dir: Path, version: str) -> None:
    d = golden_dir / version
    stream = json.loads((d / "stream.json").read_text())
    workload = json.loads((d / "workload.json").read_text())
    prompts = workload_prompts(workload)
    reqs = golden_requests(version, stream, workload)
    batches = read_live_batches(d / "stream.bin")
    index = EngineKeyIndex(GOLDEN[version])
    checked = salted = 0
    for step in stream["steps"]:
        if step["published_seq"] is None:
            continue
        index.apply_batch("engine0", batches[step["published_seq"]])
        cached = pool_residency(step["pool_after"])
        for rid, req in reqs.items():
            prompt = prompts.get(rid)
            if prompt is None:
                continue
            args = _request_args(req)
            keys = index.keys(prompt, **args)
            assert keys == req["block_hashes_int"][: len(prompt) // 16], (version, rid)
            got = index.match(prompt, **args)["engine0"]
            assert got.tier_blocks.get("GPU", 0) == expected_prefix(req, prompt, cached), (version, step["step"], rid)
            checked += 1
            salted += bool(args["salt"] or args["lora"] or args["mm_items"])
    assert checked > 50 and salted > 0


def test_second_data_parallel_rank_is_its_own_source(golden_dir: Path) -> None:
    d = golden_dir / "vllm-0.33.0"
    stream = json.loads((d / "stream.json").read_text())
    index = EngineKeyIndex(GOLDEN["vllm-0.33.0"])
    index.apply_batch("engine0", read_live_batches(d / "stream.bin")[0])
    index.apply_batch("engine0-dp1", read_live_batches(d / "dp1.bin")[0])
    assert index_residency(index, "engine0-dp1", "GPU") == pool_residency(stream["dp1"]["pool_after"])
    prompts = workload_prompts(json.loads((d / "workload.json").read_text()))
    m = index.match(prompts["A"])
    assert m["engine0"].blocks == 4 and m["engine0-dp1"].blocks == 4
    assert index.match(prompts["B"])["engine0-dp1"].blocks == 3


def test_both_indexes_agree_on_the_golden_capture(golden_dir: Path) -> None:
    d = golden_dir / "vllm-0.33.0"
    batches = read_live_batches(d / "stream.bin")
    ek, kv = EngineKeyIndex(GOLDEN["vllm-0.33.0"]), KVIndex()
    for seq in sorted(batches):
        ek.apply_batch("engine0", batches[seq])
        kv.apply_batch("engine0", batches[seq])
        assert ek.state() == kv.state(), seq


# -- against real allocators under churn ------------------------------------------------------

_SEEN = [0]
# The property run's ops, longer and admission-heavy: small pools then evict and reuse
# blocks in most examples (BlockRemoved churn, duplicates via decode and recompute).
CHURN_OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit"] * 4 + ["free", "decode", "decode", "reset", "restart", "gap", "stale"]),
        st.integers(0, 2),
        st.integers(0, 2**32),
    ),
    min_size=20,
    max_size=50,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=CHURN_OPS)
def test_index_scores_every_prompt_like_the_engines_pools(ops) -> None:
    # One hash configuration (the engines' xxhash, seed "0", blocks of 16) per index.
    engines = [_Engine("e0", 16, 7), _Engine("e1", 16, 10), _Engine("e2", 16, 5)]
    # One-block prompts recomputed and report-mode re-announcements are mixed in
    # (test_index_property.py): the default re-announcement rule must stay exact.
    index = EngineKeyIndex(BlockHasher("xxhash", 16, seed="0"))
    run_against_pools(ops, index, engines)
    _SEEN[0] += sum(index.source_info(e.name).blocks.get("GPU", 0) for e in engines if e.name in index.sources)


def test_the_property_run_held_blocks() -> None:
    if not _SEEN[0]:
        test_index_scores_every_prompt_like_the_engines_pools()
    assert _SEEN[0] > 0


def test_random_prompts_score_the_same_as_kvindex() -> None:
    # Same engines, same events: both indexes must give every source the same prefix.
    rnd = random.Random(4)
    ek, kv = new(), KVIndex()
    base = [P(1000 * i, 6) for i in range(4)]
    for s in range(6):
        for _ in range(3):
            p = base[rnd.randrange(4)][: BS * rnd.randrange(1, 7)]
            h = H(p)
            for idx in (ek, kv):
                apply(idx, f"e{s}", stored(h, p))
    for p in base:
        a, b = ek.match(p), kv.match(p)
        assert {n: m.blocks for n, m in a.items()} == {n: m.blocks for n, m in b.items()}


# -- behind the async Router, on real sockets ---------------------------------------------------


@pytest.mark.anyio
async def test_router_routes_by_engine_hashes_from_real_publishers(tmp_path) -> None:
    from kvstream.routing.router import Router
    from kvstream.transport import KVEventsConfig, Publisher, SourceSpec

    def cfg(name: str) -> KVEventsConfig:
        return KVEventsConfig(publisher="zmq", endpoint=f"ipc://{tmp_path}/{name}.sock",
                              replay_endpoint=f"ipc://{tmp_path}/{name}-replay.sock")

    salted, plain = P(1000, 4), P(5000, 4)
    async with Publisher(cfg("a")) as pa, Publisher(cfg("b")) as pb:
        specs = [SourceSpec(pa.endpoint, pa.replay_endpoint, name="a"),
                 SourceSpec(pb.endpoint, pb.replay_endpoint, name="b")]
        async with Router(specs, index=new(), speculative_ttl_s=1.0) as router:
            pa.publish(KVEventBatch(1.0, [stored(H(salted, cache_salt="t1"), salted)]))
            pb.publish(KVEventBatch(1.0, [stored(H(plain)[:3], plain[: 3 * BS])]))
            await router.wait_applied("a", 0)
            await router.wait_applied("b", 0)
            assert router.route(salted, salt="t1").best == "a"
            res = router.route(plain, loads={"a": Load(queue=1)})
            assert res.best == "b" and res.matches["b"].blocks == 3 and res.matches["a"].blocks == 0
            pb.publish(KVEventBatch(2.0, [BlockRemoved(H(plain)[:1], "GPU")]))
            await router.wait_applied("b", 1)
            # Only the speculation (the route just chose b) still claims the prefix.
            m = router.index.match(plain)["b"]
            assert m.blocks == 4 and m.tier_blocks == {} and m.speculative_blocks
            router.index.expire(float("inf"))
            assert router.index.match(plain)["b"].blocks == 0
