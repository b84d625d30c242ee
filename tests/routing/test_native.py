"""The native core against its oracles: the router keys it chains equal
``kvstream.routing.keys`` (the Python definition); its prefix walk equals the Python walk;
and an index whose common cases the native core applies (``KVIndex()``) ends exactly
where one driven through the generic Python path ends (``KVIndex(table=BytesStoreTable())``,
every rule in Python), state and counters, for random and adversarial event sequences:
duplicate hashes in a run, hash 0 and the largest u64s, bytes hashes, unknown parents,
token ids out of range, wrong token counts, extra keys, other media and groups, clears,
masks of more than 64 sources, re-announcements. The same for engine keying, against an
engine-keyed index whose ingest is forced through its Python rules."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream import _native
from kvstream.hashing import BlockHasher
from kvstream.routing import _core
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.routing.keys import namespace, prompt_keys
from kvstream.routing.table import NativeBlockTable
from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.routing.generic_table import BytesStoreTable

BS = 16

_tokens = st.lists(st.integers(0, 2**32 - 1), max_size=200)


@settings(max_examples=200, deadline=None)
@given(_tokens, st.sampled_from([1, 3, 16, 64]), st.sampled_from([None, "adapter"]), st.sampled_from([None, "salt"]))
def test_router_keys_equal_the_python_definition(tokens, r, lora, salt) -> None:
    seed = namespace(lora, salt)
    want = prompt_keys(tokens, r, lora, salt)
    assert _native.router_keys(tokens, r, seed) == want
    assert _native.router_keys(array("I", tokens), r, seed) == want
    assert _native.router_keys(tuple(tokens), r, seed) == want


def test_token_ids_the_keys_cannot_pack_take_the_python_path() -> None:
    for bad in ([1, -1], [2**32], [1.5], ["a"]):
        assert _native.router_keys(bad * 16, 16, 0) is None


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(1, 30), st.integers(1, 2**64 - 1), max_size=30),
       st.lists(st.integers(1, 32), max_size=40), st.integers(0, 2**64 - 1))
def test_the_native_walk_equals_the_python_walk(held, keys, active) -> None:
    m = NativeBlockTable()
    m.update(held)
    native: dict[int, int] = {}
    _core._gpu_prefix_ends(m, keys, active, native)
    python: dict[int, int] = {}
    _core._gpu_prefix_ends(dict(held), keys, active, python)  # a dict: the Python loop
    assert native == python


# -- ingest: native common cases vs the Python rules ------------------------------------

def _toks(i: int, n: int) -> list[int]:
    return [(7919 * (i + j)) % 50_000 for j in range(n * BS)]


_hash = st.one_of(st.integers(1, 40), st.integers(1, 40), st.just(0), st.integers(2**64 - 3, 2**64 - 1),
                  st.binary(min_size=1, max_size=4), st.integers(2**63, 2**64 - 1))
_source = st.sampled_from(["a", "b", "c", "wide"])


@st.composite
def _event(draw):
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "remove", "clear", "odd"]))
    if kind == "clear":
        return AllBlocksCleared()
    n = draw(st.integers(0, 5))
    hashes = draw(st.lists(_hash, min_size=n, max_size=n))
    medium = draw(st.sampled_from(["GPU", "GPU", None, "CPU"]))
    group = draw(st.sampled_from([0, 0, None, 1]))
    if kind == "remove":
        return BlockRemoved(hashes, medium, group)
    parent = draw(st.one_of(st.none(), st.none(), _hash))
    base = draw(st.integers(0, 3))
    toks = _toks(base, n)
    shape = draw(st.sampled_from(["plain", "plain", "plain", "bad-token", "short", "extras", "lora",
                                  "session", "big-block", "cpu-only"]))
    bsz, lora, session, extra = BS, None, None, [None] * n
    if shape == "bad-token" and toks:
        toks[0] = draw(st.sampled_from([-1, 2**32]))
    elif shape == "short":
        toks = toks[:-1]
    elif shape == "extras" and n:
        extra = [["salt-x"]] + [None] * (n - 1)
    elif shape == "lora":
        lora = "adapter"
    elif shape == "session":
        session = "s1"
    elif shape == "big-block":
        bsz = 2 * BS
        toks = _toks(base, 2 * n)
    elif shape == "cpu-only":
        bsz, toks, medium = 0, [], "CPU"
    return BlockStored(hashes, parent, toks, bsz, None, medium, lora, extra, group, None, session_id=session)


_steps = st.lists(st.tuples(_source, st.lists(_event(), min_size=1, max_size=6)), min_size=1, max_size=25)


def _fill(idx) -> None:
    # "wide" sits beyond bit 63 of a mask: its events and masks take the Python rules.
    for i in range(64):
        idx.add_source(f"filler{i}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.sampled_from(["session", "detect", "count"]), st.booleans())
def test_native_ingest_equals_the_python_rules(steps, reannounce, ttl) -> None:
    kw = {"reannounce": reannounce, "ttl_s": 3.0 if ttl else None}
    native, python = KVIndex(**kw), KVIndex(table=BytesStoreTable(), **kw)
    for x in (native, python):
        _fill(x)
    for t, (src, events) in enumerate(steps):
        for x in (native, python):
            x.apply_batch(src, KVEventBatch(float(t), list(events)))
        assert native.state() == python.state()
        assert native.stats == python.stats
    prompt = _toks(0, 5)
    assert native.match(prompt) == python.match(prompt)


class _PythonEngineIndex(EngineKeyIndex):
    """An engine-keyed index whose ingest never calls the native core (the oracle)."""

    __slots__ = ()

    def _apply_engine(self, s, events):  # type: ignore[no-untyped-def]
        self._apply_engine_events(s, events)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.sampled_from(["session", "detect", "count"]))
def test_native_engine_ingest_equals_the_python_rules(steps, reannounce) -> None:
    hasher = BlockHasher("xxhash", BS, seed="0")
    native, python = EngineKeyIndex(hasher, reannounce=reannounce), _PythonEngineIndex(hasher, reannounce=reannounce)
    for x in (native, python):
        _fill(x)
    for t, (src, events) in enumerate(steps):
        for x in (native, python):
            x.apply_batch(src, KVEventBatch(float(t), list(events)))
        assert native.state() == python.state()
        assert native.stats == python.stats


def test_a_long_run_and_its_removal_go_native_and_match_the_python_rules() -> None:
    native, python = KVIndex(), KVIndex(table=BytesStoreTable())
    hs = list(range(1, 101))
    evs = [BlockStored(hs[:50], None, _toks(0, 50), BS, None, "GPU", None),
           BlockStored(hs[50:], 50, _toks(50, 50), BS, None, "GPU", None),
           *(BlockRemoved([h], "GPU", 0) for h in hs[::3])]
    for x in (native, python):
        x.apply_batch("a", KVEventBatch(0.0, evs))
    assert native.state() == python.state() and native.stats == python.stats
    assert native.match(_toks(0, 100)) == python.match(_toks(0, 100))
    assert native.native_bytes() > 0


def _stored(hs: list, base: int, bsz: int = BS) -> BlockStored:
    return BlockStored(hs, None, _toks(base, len(hs) * bsz // BS), bsz, None, "GPU", None, [None] * len(hs), 0)


# Two engine hashes under one held key (the mask is per key), then a clear of one holder:
# which hash the clear released followed the table's iteration order (a dict's insertion
# order in the oracle, the native map's column order: freed slots reused, hash 0 in the
# side dict), so the native index kept the other one (and a stale copy record). Found by
# the property tests below and in test_raw_ingest; the clear now releases in a canonical order.
SHARED_KEY_CLEARS = {
    "hash-0-copy-then-alias": [
        ("a", [_stored([0], 0), _stored([0], 0, 2 * BS)]),
        ("b", [_stored([1], 0)]),
        ("a", [_stored([0], 0), AllBlocksCleared()]),
    ],
    "reused-slots": [
        ("a", [_stored([1], 0)]),
        ("b", [_stored([2, 3, 0, 0, 0], 0), AllBlocksCleared(), _stored([3], 1), _stored([0], 0, 2 * BS)]),
        ("a", [_stored([2], 1), AllBlocksCleared()]),
        ("b", [_stored([0], 0)]),
    ],
}


@pytest.mark.parametrize("name", sorted(SHARED_KEY_CLEARS))
@pytest.mark.parametrize("ttl", [None, 3.0])
def test_a_clear_under_a_shared_key_does_not_depend_on_table_order(name, ttl) -> None:
    kw = {"reannounce": "session", "ttl_s": ttl}
    native, python = KVIndex(**kw), KVIndex(table=BytesStoreTable(), **kw)
    for x in (native, python):
        _fill(x)
    for t, (src, events) in enumerate(SHARED_KEY_CLEARS[name]):
        for x in (native, python):
            x.apply_batch(src, KVEventBatch(float(t), list(events)))
        assert native.state() == python.state()
        assert native.stats == python.stats
    assert native._copies == python._copies


@pytest.mark.parametrize("n", [1, 40])
def test_a_run_listing_a_hash_twice_is_left_to_the_python_rules(n) -> None:
    native, python = KVIndex(), KVIndex(table=BytesStoreTable())
    hs = [5] * n + [6]
    for x in (native, python):
        x.apply_batch("a", KVEventBatch(0.0, [BlockStored(hs, None, _toks(0, len(hs)), BS, None, "GPU", None),
                                              BlockRemoved([6, 6], "GPU", 0)]))
    assert native.state() == python.state() and native.stats == python.stats


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.integers(0, 6), st.booleans())
def test_a_prompt_walked_in_one_native_call_scores_like_its_keys(steps, n_blocks, stale) -> None:
    """``match``/``score`` of a plain prompt chain and walk its keys in one native call
    (``walk_tokens``); given the prompt's keys (``keys=``, the Python chain) they must
    answer the same, with stale sources and engine blocks of two router blocks too."""
    idx = KVIndex()
    for t, (src, events) in enumerate(steps):
        idx.apply_batch(src, KVEventBatch(float(t), list(events)))
    if stale and idx.sources:
        idx.mark_stale(idx.sources[0])
    prompt = _toks(0, n_blocks) + [1, 2, 3]  # a partial tail block is ignored
    keys = prompt_keys(prompt, BS)
    assert idx.match(prompt) == idx.match((), keys=keys)
    a, b = idx.score(prompt), idx.score((), keys=keys)
    assert (a.n_blocks, a.matches, a.ranking, a.values) == (b.n_blocks, b.matches, b.ranking, b.values)


def _rows_of(matches) -> list:
    """``match_rows``' form of a ``match`` answer (the oracle): sources with a prefix."""
    return sorted((m.source, m.blocks, m.tier_blocks) for m in matches.values() if m.blocks)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.integers(0, 6), st.booleans(), st.sampled_from([(None, None), ("adapter", None), (None, "salt-x")]),
       st.booleans())
def test_rows_walked_natively_over_every_tier_equal_match(steps, n_blocks, stale, ns, spec) -> None:
    """``match_rows`` (one native call over every tier: ``walk_tiers_tokens``) lists
    exactly the sources ``match`` (the Python walk) gives a prefix, with the same blocks
    and per-medium blocks: CPU-only holdings, engine blocks of two router blocks, stale
    sources, LoRA and salted prompts; with a speculative entry it takes ``match``'s path."""
    idx = KVIndex()
    for t, (src, events) in enumerate(steps):
        idx.apply_batch(src, KVEventBatch(float(t), list(events)))
    if stale and idx.sources:
        idx.mark_stale(idx.sources[0])
    if spec and idx.sources:
        idx.speculate(idx.sources[-1], _toks(0, 2), 0.0)
    for base in range(3):
        prompt = _toks(base, n_blocks) + [1, 2, 3]
        n, rows = idx.match_rows(prompt, *ns)
        assert n == n_blocks
        assert sorted(rows) == _rows_of(idx.match(prompt, *ns))
        keys = idx.keys(prompt, *ns)
        assert sorted(idx.match_rows((), keys=keys)[1]) == _rows_of(idx.match((), keys=keys))
        assert sorted(idx.match_rows(array("I", prompt), *ns)[1]) == sorted(rows)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.integers(0, 5))
def test_engine_keyed_rows_from_packed_hashes_equal_match(steps, n) -> None:
    """Under engine keying ``match_rows(keys=...)`` walks the engines' hashes natively,
    given as ints or packed 8 bytes each (what ``/query_by_hash`` reads a body into);
    bytes hashes and hash 0 take ``match``'s path; the answers are ``match``'s."""
    idx = EngineKeyIndex(BlockHasher("xxhash", BS))
    for t, (src, events) in enumerate(steps):
        idx.apply_batch(src, KVEventBatch(float(t), [e for e in events if not isinstance(e, BlockStored)
                                                     or e.block_size in (BS, 0)]))
    for start in (1, 2, 5):
        hashes = list(range(start, start + n))
        want = _rows_of(idx.match((), keys=hashes))
        assert sorted(idx.match_rows((), keys=hashes)[1]) == want
        assert sorted(idx.match_rows((), keys=array("Q", hashes).tobytes())[1]) == want


def test_tier_walk_refuses_what_only_python_can_walk() -> None:
    m = _native.NativeMap()
    m[5] = 1
    assert _native.walk_tiers_keys([m], [5, 6], 1) == (2, [(0, 1, [1])])
    assert _native.walk_tiers_keys([m], [b"x"], 1) is None  # not a u64: the Python walk
    assert _native.walk_tiers_tokens([m], [2**32], 16, 0, 1) is None
    with pytest.raises(_native.NativeLocalError):
        _native.walk_tiers_keys([m], b"1234567", 1)  # packed keys are 8 bytes each
    m[b"wide"] = 1 << 70
    assert _native.walk_tiers_keys([m], [5], 1) is None  # a side dict: the Python walk


@pytest.mark.parametrize("body, want", [
    (b'{"model": "m", "token_ids": [1, 2, 3], "block_size": 16}', (b'{"model": "m", "token_ids": [], "block_size": 16}',
                                                                  array("I", [1, 2, 3]).tobytes())),
    # two arrays: serde_json's route, the rest re-written with the array last
    (b'{"x": [[]], "token_ids": [7], "block_size": 16}', (b'{"x":[[]],"block_size":16,"token_ids":[]}',
                                                         array("I", [7]).tobytes())),
    (b'{"token_ids": [4294967296]}', None),
    (b'{"token_ids": [1], "token_ids": [1]}', None),
    (b'{"token_ids": [1.0]}', None),
    (b'{"model": "m"}', None),
    (b'[1]', (b'[]', array("I", [1]).tobytes())),  # the caller's msgspec decode refuses the rest
    (b'{"token_ids": [1]} ', (b'{"token_ids": []} ', array("I", [1]).tobytes())),
    (b'{"token_ids": [01]}', None),
])
def test_split_body_reads_the_ids_and_keeps_the_rest_for_msgspec(body, want) -> None:
    assert _native.split_body(body, "token_ids", 4) == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 99), st.integers(10**7, 10**9)), max_size=60),
       st.sampled_from([",", ", ", " ,", ",\n  ", "\t,\r\n"]), st.booleans())
def test_split_body_reads_every_number_as_json_does(ids, sep, wide) -> None:
    """The native reader (its flat route: one array, numbers read 8 digits at a time)
    gives exactly the ids ``json`` reads, for any number length and JSON whitespace; the
    rest keeps the other fields with the array emptied."""
    body = ('{"model": "m", "token_ids": [' + sep.join(map(str, ids)) + '], "block_size": 16}').encode()
    rest, packed = _native.split_body(body, "token_ids", 8 if wide else 4)
    import json as _json
    assert _json.loads(rest) == {"model": "m", "token_ids": [], "block_size": 16}
    assert array("Q" if wide else "I", packed).tolist() == ids
    nested = body.replace(b'"model": "m"', b'"model": "m", "x": {"y": [1]}')  # two arrays: the serde route
    assert array("Q" if wide else "I", _native.split_body(nested, "token_ids", 8 if wide else 4)[1]).tolist() == ids
