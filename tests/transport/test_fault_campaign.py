"""The deterministic fault campaign (see ``fault_campaign.py``): a few hundred seeds of
simulated engines, network faults and restarts; every quiet moment, every source is its
engine's exact residency or visibly not live. ``bench/soak_faults.py`` runs 100,000+.

The named seeds below each broke the promise once (found by the campaign) and are kept
as regression tests of the rule that fixed them."""

from __future__ import annotations

import pytest

from tests.transport.fault_campaign import FAULTS, Stats, run_seed


def test_a_few_hundred_seeds_never_leave_a_source_live_and_wrong():
    total = Stats()
    for seed in range(300):
        total.add(run_seed(seed))
    assert total.silent_wrong == 0
    # The campaign really injects every kind of fault and checks many quiet moments.
    assert set(total.faults) == set(FAULTS), total.faults
    assert total.checks >= 1000 and total.states["live"] > total.states["stale"] > 0


def test_under_a_topic_filter_with_topicless_replies_no_source_is_live_and_wrong():
    """vLLM 0.11 replies carry no topic frame: under a filter, replies that arrive before a
    live message names the publisher's topic are ignored until it does (found by
    ``bench/vllm_peer/diff_wire.py``). The promise must hold through that rule too."""
    total = Stats()
    for seed in range(150):
        total.add(run_seed(seed, topic_filter=b"kv"))
    assert total.silent_wrong == 0
    assert total.checks >= 500 and total.states["live"] > 0


@pytest.mark.parametrize("seed,case", [
    (9, "restart whose new batches are all lost: the reconnect verifies the anchor"),
    (291, "a burst lost whole while idle: periodic probes after the last one"),
    (20, "a probe timer that fired while a request was out is armed again"),
    (38, "a source joined with an empty buffer probes too (nothing live seen yet)"),
    (320, "live messages held across a restart: the reconnect drops them and verifies"),
    (931, "a reply without the anchor first is never yielded"),
    (525, "a reconnect right after a snapshot (anchor unknown) rebuilds"),
    (4659, "a snapshot tagged below a seq already seen live is another instance"),
    (247, "a probe that found a lost tail looks again soon"),
    (5389, "a probe is a short answer: vLLM's HWM cannot hole it"),
    (95764, "a join after a restart that never gets an answer is stale, not live at -1"),
    (12874, "a live message below the highest seq, not held, while the join is out: held, not "
            "drained unverified (found after bytes-first, issue 23 item 7)"),
    (14811, "the same, behind a forwarder"),
    (30674, "the same, behind a forwarder"),
    (105925, "a restart a forwarder hid whose first batch was lost: the new instance's seq 1 continued "
             "the old seq 0 (probes compare every batch taken live since the last check)"),
    (105606, "the same, after the batches to compare left a 4-step buffer: a snapshot, not live"),
    (100212, "live batches of an instance that restarted again while its join was out, drained after "
             "the next instance's answer: a probe whose answer stops before the anchor asks again"),
    (100822, "a long probe answer's lost tail: the tail is asked for again from the anchor"),
])
def test_regression_seed(seed, case):
    assert run_seed(seed).silent_wrong == 0, case


def test_a_recomputed_one_block_prompt_is_a_second_copy_for_the_default_index():
    """Item 4: real pool traffic. A fully cached one-block prompt is recomputed (vLLM
    always computes the last prompt token), so the block is stored again from block 0
    (parent None) as a second physical copy. The index used to take it for a report-mode
    re-announcement; when one copy was evicted it dropped a block the engine still held."""
    from collections import Counter

    from kvstream.allocator.manager import KVCacheManager
    from kvstream.allocator.pool import BlockPool
    from kvstream.hashing import BlockHasher
    from kvstream.routing.index import KVIndex
    from kvstream.wire.events import KVEventBatch

    pool = BlockPool(6, 4, hash_form="int")
    mgr = KVCacheManager(pool, BlockHasher("native", 4))
    first = mgr.new_request("a", [1, 2, 3, 4])
    assert mgr.admit(first)
    mgr.free(first)
    again = mgr.new_request("b", [1, 2, 3, 4])  # the same one-block prompt: a second copy
    assert mgr.admit(again)
    for i in range(4):  # other prompts evict the free copy
        r = mgr.new_request(f"f{i}", [9 + i] * 4)
        if mgr.admit(r):
            mgr.free(r)
    truth = Counter(b.ext_hash for b in pool.blocks if b.block_hash is not None)
    index = KVIndex(router_block_size=4)
    index.apply_batch("e", KVEventBatch(0.0, mgr.take_events()))
    got: Counter = Counter()
    for _medium, _g, eh, n in index.state()["sources"]["e"]["blocks"]:
        got[eh] += n
    assert got == truth
