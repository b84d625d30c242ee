"""Residency rules every keying strategy and every block table obeys (docs/router.md,
"Index model"), one specification run over all: router token keys (``KVIndex``) with each
block table (the native one, the default, and :class:`BytesStoreTable`, a second backend
written here against the ``BlockTable`` protocol alone), and the engines' own hashes
(``EngineKeyIndex``). Keying-specific behaviour stays in ``test_index.py`` and
``test_engine_index.py``."""

from __future__ import annotations

import pytest

from kvstream.hashing import BlockHasher, RequestBlockHasher, to_external_list
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.routing.keying import EngineHashes, TokenKeys
from kvstream.routing.table import BlockTable, NativeBlockTable
from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.routing.generic_table import BytesStoreTable

BS = 16
HASHER = BlockHasher("xxhash", BS, seed="0")


def test_the_second_table_is_a_block_table() -> None:
    t: BlockTable = BytesStoreTable()  # mypy checks the protocol; the index checks the methods
    t[5] = (1, 2)
    t[b"h"] = 7
    assert t.get(5) == (1, 2) and list(t.items()) == [(5, (1, 2)), (b"h", 7)]
    assert t.pop(b"h") == 7 and len(t) == 1


class Keying:
    """A keying strategy (and block table) under test: how to build the index and which
    hashes its engines' events carry for a prompt."""

    def __init__(self, name: str) -> None:
        self.name = name

    def new(self, **kw):
        if self.name == "tokens":
            return KVIndex(**kw)
        if self.name == "tokens, native table given":
            return KVIndex(table=NativeBlockTable(), **kw)
        if self.name == "tokens, BytesStoreTable":
            return KVIndex(table=BytesStoreTable(), **kw)
        if self.name == "engine":
            return EngineKeyIndex(HASHER, **kw)
        return KVIndex(keying=EngineHashes(HASHER), **kw)  # the same index, unnamed

    def hashes(self, prompt: list[int]) -> list[int]:
        rh = RequestBlockHasher(HASHER)
        rh.extend(prompt)
        return to_external_list(rh.block_hashes)


KEYINGS = ["tokens", "tokens, native table given", "tokens, BytesStoreTable",
           "engine", "engine-keyed KVIndex"]


@pytest.fixture(params=KEYINGS)
def keying(request) -> Keying:
    return Keying(request.param)


def P(base: int, n: int) -> list[int]:
    return [base + i for i in range(n * BS)]


def stored(hashes, tokens, parent=None, medium="GPU", group=0, bs=BS):
    return BlockStored(list(hashes), parent, list(tokens), bs, None, medium, None, None, group)


def cpu(hashes):
    return BlockStored(list(hashes), None, [], 0, None, "CPU", None)


def apply(idx, source: str, *events) -> None:
    idx.apply_batch(source, KVEventBatch(1.0, list(events)))


def blocks(idx, source: str) -> dict:
    return {(m, g, h): n for m, g, h, n in idx.state()["sources"][source]["blocks"]}


def test_a_duplicate_store_needs_two_removes(keying) -> None:
    idx = keying.new()
    p = P(0, 2)
    h = keying.hashes(p)
    apply(idx, "e", stored(h, p))
    apply(idx, "e", stored(h[1:], p[BS:], parent=h[0]))  # a recomputed copy of a cached hash
    assert blocks(idx, "e")[("GPU", 0, h[1])] == 2
    apply(idx, "e", BlockRemoved([h[1]], "GPU"))
    assert idx.match(p)["e"].blocks == 2
    apply(idx, "e", BlockRemoved([h[1]], "GPU"))
    assert idx.match(p)["e"].blocks == 1
    assert idx.stats.unknown_removed == 0


def test_same_hash_in_two_groups_is_two_residencies(keying) -> None:
    idx = keying.new()
    p = P(0, 1)
    h = keying.hashes(p)
    apply(idx, "e", stored(h, p, group=0), stored(h, p, group=1))
    assert blocks(idx, "e") == {("GPU", 0, h[0]): 1, ("GPU", 1, h[0]): 1}
    apply(idx, "e", BlockRemoved(h, "GPU", 1))
    assert blocks(idx, "e") == {("GPU", 0, h[0]): 1}
    apply(idx, "e", BlockRemoved(h, "GPU", 1))
    assert idx.stats.unknown_removed == 1
    assert idx.match(p)["e"].blocks == 1


def test_report_mode_reannouncement_adds_no_copy(keying) -> None:
    idx = keying.new()
    p = P(0, 2)
    h = keying.hashes(p)
    apply(idx, "e", stored(h, p))
    again = stored(h, p)
    again.session_id = "sess-42"  # vLLM kv_cache_report_mode="full": no pool change
    apply(idx, "e", again)
    assert blocks(idx, "e") == {("GPU", 0, h[0]): 1, ("GPU", 0, h[1]): 1}
    assert idx.stats.reannounced_blocks == 2
    counting = keying.new(reannounce="count")
    apply(counting, "e", stored(h, p))
    apply(counting, "e", again)
    assert blocks(counting, "e")[("GPU", 0, h[0])] == 2


def test_removed_unknown_block_is_counted_not_an_error(keying) -> None:
    idx = keying.new()
    apply(idx, "e", BlockRemoved([99], "GPU"), BlockRemoved([98], "CPU"))
    assert idx.stats.unknown_removed == 2


def test_all_blocks_cleared_clears_only_that_sources_gpu_tier(keying) -> None:
    idx = keying.new()
    p = P(0, 2)
    h = keying.hashes(p)
    apply(idx, "a", stored(h, p), cpu(h))
    apply(idx, "b", stored(h, p))
    apply(idx, "a", AllBlocksCleared())
    m = idx.match(p)
    assert m["a"].tier_blocks == {"CPU": 2} and m["a"].blocks == 2 and m["a"].served == {"CPU": 2}
    assert m["b"].tier_blocks == {"GPU": 2}
    assert idx.source_info("a").blocks == {"CPU": 2}


def test_the_keying_is_a_constructor_argument_with_one_index_behind_it() -> None:
    by_name = KVIndex(keying="engine", hasher=HASHER)
    named = EngineKeyIndex(HASHER)
    assert type(by_name.keying) is EngineHashes and by_name.router_block_size == BS
    assert KVIndex(keying=TokenKeys(32)).router_block_size == 32
    k = Keying("engine")
    p = P(0, 3)
    for idx in (by_name, named):
        apply(idx, "e", stored(k.hashes(p), p))
    assert by_name.state() == named.state() and by_name.match(p)["e"].blocks == 3
    # A snapshot of one loads into the other: one format, one index.
    assert EngineKeyIndex.load(by_name.dump()).state() == named.state()
    assert KVIndex.load(named.dump()).state() == named.state()


def test_a_snapshot_round_trip_keeps_the_state(keying) -> None:
    idx = keying.new()
    p, q = P(0, 3), P(1000, 2)
    h = keying.hashes(p)
    apply(idx, "a", stored(h, p), cpu(h[:1]), stored(h[:1], p[:BS], group=1))
    apply(idx, "b", stored(h[:2], p[: 2 * BS]), stored(keying.hashes(q), q))
    apply(idx, "b", BlockRemoved(h[1:2], "GPU"))
    kw = {"table": idx._table.__class__()} if keying.name.startswith("tokens, ") else {}
    again = KVIndex.load(idx.dump(), **kw)
    assert type(again._table) is type(idx._table)
    assert again.state() == idx.state() and again.match(p) == idx.match(p)
    # and it keeps ingesting: remove what the snapshot holds
    for x in (idx, again):
        apply(x, "a", BlockRemoved(h, "GPU"))
    assert again.state() == idx.state() and again.match(p)["a"].tier_blocks == {"GPU": 1, "CPU": 1}  # group 1 stays


@pytest.mark.parametrize("fillers", [0, 68])
def test_the_native_table_holds_what_the_generic_path_holds_through_churn(fillers) -> None:
    """A pool of 9,000 live blocks, with copies, a second source and a clear: the native
    table (whose common cases the native core applies) ends exactly where a table driven
    through the generic Python path does, and so do the scores. With 70 sources the two
    churning ones sit beyond the 64 bits of a native mask (their masks go to the side
    dict and their events to the Python rules)."""
    import random

    def new() -> KVIndex:
        return KVIndex(table=BytesStoreTable()) if table == "BytesStoreTable" else KVIndex()

    rnd = random.Random(7)
    ref, idx = KVIndex(table=BytesStoreTable()), KVIndex()
    for x in (ref, idx):
        for i in range(fillers):
            x.add_source(f"filler{i}")
    live: list[int] = []
    h = 1
    prompts = []
    for step in range(700):
        p = [rnd.randrange(50_000) for _ in range(16 * BS)]
        hs = list(range(h, h + 16))
        h += 16
        evs: list = [stored(hs, p)]
        if step % 5 == 0:
            evs.append(stored(hs[:2], p[: 2 * BS]))  # copies
        live.extend(hs)
        if len(live) > 9000:
            evs += [BlockRemoved([x], "GPU") for x in live[:16]]
            del live[:16]
        src = "a" if step % 3 else "b"
        for x in (ref, idx):
            apply(x, src, *evs)
        if step % 50 == 0:
            prompts.append(p)
        if step == 600:
            for x in (ref, idx):
                apply(x, "b", AllBlocksCleared())
    assert idx.state() == ref.state()
    for p in prompts:
        assert idx.match(p) == ref.match(p)
    assert idx.stats == ref.stats
    assert type(idx.table) is NativeBlockTable
