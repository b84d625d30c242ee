"""Bounded under abuse (issue #15 item 10): media (tiers) per source and per index, and
``max_bytes``, for both keying strategies."""

from __future__ import annotations

import time

import pytest

from kvstream.hashing import BlockHasher
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.wire.events import BlockRemoved, BlockStored, KVEventBatch

BS = 16


def new_index(keying: str, **kw):
    if keying == "tokens":
        return KVIndex(**kw)
    return EngineKeyIndex(BlockHasher("xxhash", BS, seed="0"), **kw)


def put(idx, source: str, hashes, medium: str = "GPU", base: int = 0) -> None:
    toks = [base + i for i in range(len(hashes) * BS)]
    idx.apply_batch(source, KVEventBatch(1.0, [BlockStored(list(hashes), None, toks, BS, None, medium, None)]))


KEYINGS = ["tokens", "engine"]


@pytest.mark.parametrize("keying", KEYINGS)
def test_a_source_naming_a_new_medium_per_batch_cannot_grow_the_tiers(keying) -> None:
    idx = new_index(keying)
    prompt = list(range(256 * BS))
    put(idx, "e", range(1, 257), base=0)
    keys = idx.keys(prompt)
    t0 = time.perf_counter()
    for _ in range(20):
        idx.score(prompt, keys=keys)
    before = time.perf_counter() - t0
    for i in range(500):
        put(idx, "evil", range(10_000 + 8 * i, 10_008 + 8 * i), medium=f"m{i}", base=10**6 + i * 1000)
    assert len(idx._media) <= idx.MAX_MEDIA
    info = idx.source_info("evil")
    assert len(info.blocks) <= idx.MAX_MEDIA_PER_SOURCE
    assert idx.stats.rejected_media == (500 - idx.MAX_MEDIA_PER_SOURCE) * 8
    t0 = time.perf_counter()
    for _ in range(20):
        idx.score(prompt, keys=keys)
    # Bounded work: at most MAX_MEDIA tiers to walk (was 500 tiers, 2.3 ms a score).
    assert time.perf_counter() - t0 < 10 * before + 0.05


@pytest.mark.parametrize("keying", KEYINGS)
def test_a_medium_nobody_holds_anymore_is_reused_and_removals_never_create_one(keying) -> None:
    idx = new_index(keying)
    n0 = len(idx._media)
    idx.apply_batch("e", KVEventBatch(1.0, [BlockRemoved([5], f"ghost{i}") for i in range(50)]))
    assert len(idx._media) == n0 and idx.stats.unknown_removed == 50
    for i in range(3 * idx.MAX_MEDIA):
        put(idx, f"s{i}", [100 + i], medium=f"x{i}", base=1000 * i)
        idx.apply_batch(f"s{i}", KVEventBatch(1.0, [BlockRemoved([100 + i], f"x{i}")]))
    assert len(idx._media) <= idx.MAX_MEDIA
    assert idx.stats.rejected_media == 0
    # ...but a medium someone holds is never taken away.
    for i in range(idx.MAX_MEDIA - 2):
        put(idx, f"k{i}", [200 + i], medium=f"keep{i}", base=50_000 + 1000 * i)
    put(idx, "late", [300], medium="one-too-many", base=90_000)
    assert idx.stats.rejected_media == 1
    assert all(idx.source_info(f"k{i}").blocks == {f"keep{i}": 1} for i in range(idx.MAX_MEDIA - 2))
