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
