"""Property: ``KVIndex.score``'s native fast path (one column of prefix ends from
``kvstream._native.slot_ends_*``, the default policy over columns, a result that builds
``matches``/``ranking``/``values`` when read) gives exactly the ScoreResult of the
Python path it stands in for: ``match`` (the Python walk), the policy called on the
SourceMatch list, ``rank`` (the full sort). Random indexes: block sizes spanning several
router blocks, stale and removed sources, CPU copies, speculative entries, loads naming
unknown sources, NaN-free random loads with many ties, custom policies."""

from __future__ import annotations

from array import array
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.hashing import BlockHasher
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.routing.scoring import Load, PrefixLoadPolicy, ScoreResult, SourceMatch, rank
from kvstream.wire.events import BlockRemoved, BlockStored, KVEventBatch

R = 16
PROMPT_BLOCKS = 12
# Two prompts sharing their first 4 blocks.
PROMPTS = [
    [1000 + i for i in range(PROMPT_BLOCKS * R)],
    [1000 + i for i in range(4 * R)] + [5000 + i for i in range((PROMPT_BLOCKS - 4) * R)],
]
NAMES = [f"e{i}" for i in range(6)]


def _oracle(index: KVIndex, prompt: list[int], keys: Any, loads: dict[str, Load], policy: Any) -> ScoreResult:
    """What score returned before its fast path: match, then policy, then rank."""
    if keys is None:
        keys = index.keys(prompt)
    matches = index.match(prompt, keys=list(keys))  # the Python walk over the key list
    for name in loads:
        if name not in matches:
            matches[name] = SourceMatch(name)
    pol = policy if policy is not None else PrefixLoadPolicy()
    values = pol(list(matches.values()), loads, len(keys))
    return ScoreResult(len(keys), index.router_block_size, matches, rank(values, loads), {s: v for v, s in values})


def _same(got: ScoreResult, want: ScoreResult) -> None:
    assert got.best == want.best  # read first: the lazy result answers it without a ranking
    assert got.n_blocks == want.n_blocks and got.router_block_size == want.router_block_size
    assert got.matches == want.matches
    assert got.ranking == want.ranking
    # bit-identical values (repr tells -0.0 from 0.0)
    assert {s: repr(v) for s, v in got.values.items()} == {s: repr(v) for s, v in want.values.items()}
    assert list(got.values) == list(want.values) and list(got.matches) == list(want.matches)
    assert got == want


op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(NAMES), st.integers(0, 1), st.integers(1, PROMPT_BLOCKS),
              st.sampled_from([R, R, 2 * R, 3 * R]), st.sampled_from(["GPU", "GPU", "GPU", "CPU"])),
    st.tuples(st.just("evict"), st.sampled_from(NAMES), st.integers(0, 1), st.integers(0, PROMPT_BLOCKS - 1)),
    st.tuples(st.just("stale"), st.sampled_from(NAMES), st.booleans()),
    st.tuples(st.just("remove"), st.sampled_from(NAMES)),
    st.tuples(st.just("add"), st.sampled_from(NAMES)),
    st.tuples(st.just("speculate"), st.sampled_from(NAMES), st.integers(0, 1)),
)
load = st.builds(Load, queue=st.integers(0, 3), running=st.integers(0, 3),
                 kv_usage=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
loads_st = st.dictionaries(st.sampled_from(NAMES + ["only-in-loads", "zz"]), load, max_size=8)
policy_st = st.sampled_from([
    None,
    PrefixLoadPolicy(),
    PrefixLoadPolicy(tier_weights={"CPU": 0.8}, other_tier_weight=0.3, prefix_weight=2.0),  # no GPU weight
    PrefixLoadPolicy(queue_weight=0.0, running_weight=0.0, kv_weight=0.0),  # ties decided by load, then name
    lambda ms, loads, n: [(float(m.blocks % 3), m.source) for m in ms],  # a custom policy
])


def _apply(index: KVIndex, ops: list[Any], engine_keyed: bool) -> None:
    removed: set[str] = set()
    for o in ops:
        kind, name = o[0], o[1]
        if kind == "store":
            _, _, p, nb, bs, medium = o
            if engine_keyed:
                bs = R  # an engine-keyed index takes one block size (its hasher's)
            per = bs // R
            nb = max(per, nb - nb % per)
            toks = PROMPTS[p][: nb * R]
            hashes = index.keys(toks)[per - 1::per] if engine_keyed else [p * 100 + i for i in range(nb // per)]
            if medium == "CPU":
                index.apply_batch(name, KVEventBatch(0.0, [BlockStored(hashes, None, toks, bs, None, "GPU", None),
                                                           BlockStored(hashes, None, [], 0, None, "CPU", None)]))
            else:
                index.apply_batch(name, KVEventBatch(0.0, [BlockStored(hashes, None, toks, bs, None, "GPU", None)]))
            removed.discard(name)
        elif kind == "evict" and not engine_keyed:
            _, _, p, i = o
            index.apply_batch(name, KVEventBatch(0.0, [BlockRemoved([p * 100 + i], "GPU")]))
        elif kind == "stale" and name in index.sources:
            index.mark_stale(name, o[2])
        elif kind == "remove" and name in index.sources:
            index.remove_source(name)
            removed.add(name)
        elif kind == "add":
            index.add_source(name)
        elif kind == "speculate" and name in index.sources:
            index.speculate(name, PROMPTS[o[2]][: 6 * R], now=0.0, ttl_s=10.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=25), loads_st, policy_st, st.integers(0, 1), st.integers(0, PROMPT_BLOCKS * R + 7),
       st.sampled_from(["list", "array", "keys", "best"]))
def test_fast_path_scores_exactly_like_the_python_path(ops, loads, policy, p, cut, form) -> None:
    index = KVIndex()
    _apply(index, ops, engine_keyed=False)
    prompt = PROMPTS[p][:cut]
    want = _oracle(index, prompt, None, loads, policy)
    if form == "best":
        assert index.best(index.keys(prompt), loads, policy) == want.best
        return
    arg: Any = array("I", prompt) if form == "array" else prompt
    keys = index.keys(prompt) if form == "keys" else None
    _same(index.score(arg, loads=loads, policy=policy, keys=keys), want)


@settings(max_examples=100, deadline=None)
@given(st.lists(op, max_size=20), loads_st, policy_st, st.integers(0, 1))
def test_fast_path_scores_engine_hashes_exactly_like_the_python_path(ops, loads, policy, p) -> None:
    index = EngineKeyIndex(BlockHasher("xxhash", R, seed="0"))
    _apply(index, ops, engine_keyed=True)
    prompt = PROMPTS[p]
    keys = index.keys(prompt)
    want = _oracle(index, prompt, keys, loads, policy)
    _same(index.score(prompt, loads=loads, policy=policy, keys=keys), want)
    _same(index.score(prompt, loads=loads, policy=policy), want)  # the keys made by score
    assert index.best(keys, loads, policy) == want.best


def _two_sources() -> tuple[KVIndex, list[int]]:
    index = KVIndex()
    p = PROMPTS[0]
    index.apply_batch("a", KVEventBatch(0.0, [BlockStored([1, 2, 3], None, p[: 3 * R], R, None, "GPU", None)]))
    index.apply_batch("b", KVEventBatch(0.0, [BlockStored([1], None, p[:R], R, None, "GPU", None)]))
    return index, p


def test_a_lazy_result_shows_the_index_and_loads_as_they_were_when_scored() -> None:
    index, p = _two_sources()
    loads = {"a": Load(queue=1), "b": Load()}
    res = index.score(p, loads=loads)
    assert res._lazy is not None  # the fast path answered (nothing built yet)
    want = _oracle(index, p, None, dict(loads), None)
    index.mark_stale("a")  # after scoring: not seen by the result
    index.apply_batch("b", KVEventBatch(0.0, [BlockStored([2, 3, 4], 1, p[R: 4 * R], R, None, "GPU", None)]))
    loads["a"] = Load(queue=100)
    loads["c"] = Load()
    _same(res, want)
    assert res.matches["a"].blocks == 3 and not res.matches["a"].stale


def test_a_lazy_results_ranking_can_be_reordered_and_best_follows() -> None:
    index, p = _two_sources()
    res = index.score(p)
    assert res.best == "a"
    res.ranking = ["b", "a"]  # what the service does with engines its scrape cannot reach
    assert res.best == "b" and res.ranking == ["b", "a"]
    assert index.score(p).ranking == ["a", "b"]


def test_a_custom_policy_gets_every_source_match_on_the_fast_path_too() -> None:
    index, p = _two_sources()
    index.add_source("cold")
    seen: list[list[SourceMatch]] = []

    def policy(ms: Any, loads: Any, n: int) -> list[tuple[float, str]]:
        seen.append(list(ms))
        return [(-m.blocks, m.source) for m in ms]

    res = index.score(p, loads={"x": Load()}, policy=policy)
    assert [(m.source, m.blocks, m.tier_blocks, m.served, m.stale) for m in seen[0]] == [
        ("a", 3, {"GPU": 3}, {"GPU": 3}, False), ("b", 1, {"GPU": 1}, {"GPU": 1}, False),
        ("cold", 0, {}, {}, False), ("x", 0, {}, {}, False)]
    assert res.best in ("cold", "x") and res.ranking[-1] == "a"


def test_token_ids_the_native_reader_refuses_get_the_python_paths_error() -> None:
    import pytest

    index, p = _two_sources()
    for bad in (-1, 2**32, 1.5, "7"):
        prompt = p[: 2 * R] + [bad] + p[2 * R + 1: 3 * R]
        with pytest.raises(Exception) as want:
            index.keys(prompt)
        with pytest.raises(type(want.value)) as got:
            index.score(prompt)
        assert str(got.value) == str(want.value)
    # a tuple and a list of the same ids score alike
    assert index.score(tuple(p)) == index.score(p) == _oracle(index, p, None, {}, None)


def test_salted_and_lora_prompts_score_like_their_keys() -> None:
    index, p = _two_sources()
    for kw in ({"salt": "tenant-a"}, {"lora": "adapter"}, {"lora": 3}):
        keys = index.keys(p, **kw)
        want = _oracle(index, p, keys, {"a": Load(queue=1)}, None)
        _same(index.score(p, loads={"a": Load(queue=1)}, **kw), want)
