"""A snapshot's tiers are installed in one native call when they can be (every mask
within 64 bits, every key distinct) and pair by pair otherwise; both end in the dumped
state."""

from __future__ import annotations

import pytest

from kvstream.hashing import BlockHasher
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.wire.events import BlockStored, KVEventBatch


def _make(keying: str):
    return KVIndex() if keying == "tokens" else EngineKeyIndex(BlockHasher("xxhash", 16, seed="0"))


@pytest.mark.parametrize("keying", ["tokens", "engine"])
@pytest.mark.parametrize("sources", [3, 70])  # 70: masks wider than 64 bits, the pair-by-pair path
def test_a_loaded_snapshot_holds_the_dumped_state(keying, sources) -> None:
    a = _make(keying)
    for s in range(sources):
        # block 1000 + s % 3 is held by a third of the sources each; 5000 + s by one
        a.apply_batch(f"s{s}", KVEventBatch(0.0, [BlockStored(
            [1000 + s % 3, 5000 + s], None, list(range(32)), 16, None, "GPU", None)]))
    for s in range(2000):  # a bulk of lone holders
        a.apply_batch("bulk", KVEventBatch(0.0, [BlockStored([10_000 + s], None, [s] * 16, 16, None, "GPU", None)]))
    b = _make(keying)
    b.load_source(a.dump())
    assert b.state() == a.state()
    assert sorted(b.sources) == sorted(a.sources)


@pytest.mark.parametrize("keying", ["tokens", "engine"])
def test_a_bulk_loaded_index_goes_on_as_the_dumped_one(keying) -> None:
    """After the one-call load (``kvstream._native.load_tier``: both maps, the per-source
    counts, the holder counts of shared hashes), removals and stores change the loaded
    index exactly as they change the one that dumped it: a shared block stays held until
    its last holder removes it."""
    from kvstream.wire.events import BlockRemoved

    a = _make(keying)
    for s in range(5):
        a.apply_batch(f"s{s}", KVEventBatch(0.0, [BlockStored(
            [1000 + s % 2, 5000 + s], None, list(range(32)), 16, None, "GPU", None)]))
    b = _make(keying)
    b.load_source(a.dump())
    assert b.state() == a.state()
    steps = [("s0", BlockRemoved([1000], "GPU")), ("s2", BlockRemoved([1000, 5002], "GPU")),
             ("s1", BlockStored([7000], 5001, list(range(16)), 16, None, "GPU", None)),
             ("s4", BlockRemoved([1000], "GPU")), ("s3", BlockRemoved([1001], "GPU"))]
    for src, ev in steps:
        for x in (a, b):
            x.apply_batch(src, KVEventBatch(1.0, [ev]))
        assert b.state() == a.state()
        assert b.source_info(src) == a.source_info(src)
