"""Scoring: per-tier prefixes, tier weights, load blending, deterministic ties, custom policies."""

from __future__ import annotations

from kvstream.wire.events import BlockStored, KVEventBatch
from kvstream.routing.index import KVIndex
from kvstream.routing.keys import prompt_keys
from kvstream.routing.scoring import Load, PrefixLoadPolicy, SourceMatch, rank

BS = 16


def P(base: int, n: int) -> list[int]:
    return [base + i for i in range(n * BS)]


def _index() -> tuple[KVIndex, list[int]]:
    idx = KVIndex()
    p = P(0, 8)
    idx.apply_batch("gpu4", KVEventBatch(0.0, [BlockStored([1, 2, 3, 4], None, p[: 4 * BS], BS, None, "GPU", None)]))
    idx.apply_batch("cpu4", KVEventBatch(0.0, [
        BlockStored([1, 2, 3, 4], None, p[: 4 * BS], BS, None, "GPU", None),
        BlockStored([1, 2, 3, 4], None, [], 0, None, "CPU", None),
    ]))
    # cpu4 then loses its GPU copies: the prefix is only in CPU memory
    from kvstream.wire.events import BlockRemoved
    idx.apply_batch("cpu4", KVEventBatch(0.0, [BlockRemoved([1, 2, 3, 4], "GPU")]))
    idx.apply_batch("gpu2", KVEventBatch(0.0, [BlockStored([1, 2], None, p[: 2 * BS], BS, None, "GPU", None)]))
    idx.add_source("cold")
    return idx, p


def test_score_reports_every_sources_prefix_per_tier_in_blocks_and_tokens() -> None:
    idx, p = _index()
    r = idx.score(p)
    assert r.n_blocks == 8 and r.router_block_size == 16
    assert (r.matches["gpu4"].blocks, r.matches["gpu4"].tokens) == (4, 64)
    assert r.matches["cpu4"].tier_blocks == {"CPU": 4} and r.matches["cpu4"].served == {"CPU": 4}
    assert r.matches["gpu2"].tier_blocks == {"GPU": 2}
    assert r.matches["cold"].blocks == 0


def test_gpu_prefix_beats_the_same_prefix_in_cpu_which_beats_a_shorter_gpu_one() -> None:
    idx, p = _index()
    assert idx.score(p).ranking == ["gpu4", "cpu4", "gpu2", "cold"]


def test_load_blends_with_prefix_and_ties_break_by_load_then_name() -> None:
    idx, p = _index()
    r = idx.score(p, loads={"gpu4": Load(queue=10), "cpu4": Load(queue=10)})
    assert r.best == "gpu2"
    assert idx.score(P(9000, 2)).ranking == ["cold", "cpu4", "gpu2", "gpu4"]  # all 0: by name
    r = idx.score(P(9000, 2), loads={"cold": Load(running=1)})
    assert r.ranking[-1] == "cold"
    assert idx.score(p, loads={"new": Load()}).matches["new"].blocks == 0  # ranked too


def test_policy_is_any_callable_and_weights_are_configurable() -> None:
    idx, p = _index()
    cpu_first = PrefixLoadPolicy(tier_weights={"GPU": 0.5, "CPU": 1.0})
    assert idx.score(p, policy=cpu_first).best == "cpu4"

    def fewest_blocks(matches, loads, n):
        return [(-m.blocks, m.source) for m in matches]

    assert idx.score(p, policy=fewest_blocks).ranking[0] == "cold"


def test_rank_is_deterministic_for_equal_values() -> None:
    vals = [(1.0, "b"), (1.0, "a"), (1.0, "c")]
    assert rank(vals, {}) == ["a", "b", "c"]
    assert rank(vals, {"a": Load(queue=1)}) == ["b", "c", "a"]
    assert SourceMatch("x", 3, 48, {"GPU": 1}, {"GPU": 1, "CPU": 2}).weighted() == 1.0 + 2 * 0.8


def test_keys_depend_on_lora_salt_and_image_but_not_on_anything_else() -> None:
    p = P(0, 3)
    base = prompt_keys(p, 16)
    assert prompt_keys(p, 16) == base and len(base) == 3
    assert prompt_keys(p, 16, lora="a")[0] != base[0]
    assert prompt_keys(p, 16, salt="s")[2] != base[2]
    img = prompt_keys(p, 16, mm_items=[("img", 20)])
    assert img[0] == base[0] and img[1] != base[1] and img[2] != base[2]
    assert prompt_keys(p + [1, 2, 3], 16) == base  # a partial tail block is ignored
