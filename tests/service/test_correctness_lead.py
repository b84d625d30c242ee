"""What kvstream serve gets right where simpler indexers give false hits, end to end over its
HTTP API: copy-counted residency, 32-byte hashes, vLLM-native cache salts and multimodal
items at query time, restart detection, and replay of lost batches."""

from __future__ import annotations

import os

from kvstream.wire.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from tests.service.conftest import wait_for

BS = 16


def _raw(eng, events, seq=None) -> int:
    cmd = {"raw": encode_batch(KVEventBatch(1.0, events, 0)).hex()}
    if seq is not None:
        cmd["seq"] = seq
    return eng.cmd(**cmd)["seq"]


def _stored(hashes, tokens, parent=None, **kw) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, "GPU", None, **kw)


def test_copy_counts_bytes_hashes_salts_and_images(engines, serve) -> None:
    e0, e1 = engines("e0"), engines("e1")
    srv = serve(e0.arg, e1.arg, "--load-interval", "0")
    srv.wait_applied("e1", -1)
    a = list(range(100, 100 + 2 * BS))
    h = [os.urandom(32), os.urandom(32)]  # vLLM's 32-byte hashes (sha256 without int conversion)
    # block 1 stored twice (a second request hit block 0 and computed block 1 again), then
    # one copy evicted
    _raw(e0, [_stored(h, a)])
    _raw(e0, [_stored(h[1:], a[BS:], parent=h[0])])
    seq = _raw(e0, [BlockRemoved(h[1:], "GPU")])
    srv.wait_applied("e0", seq)
    r = srv.route(token_ids=a)
    assert r["engine"] == "e0" and r["matched_tokens"] == 2 * BS  # one copy is still there

    # a cache salt (vLLM puts it in block 0's extra keys): only requests with that salt hit
    s = list(range(500, 500 + 2 * BS))
    seq = _raw(e1, [_stored([11, 12], s, extra_keys=[["tenant-7"], None])])
    srv.wait_applied("e1", seq)
    assert srv.route(token_ids=s, cache_salt="tenant-7")["matched_tokens"] == 2 * BS
    assert srv.route(token_ids=s)["matched_tokens"] == 0
    assert srv.route(token_ids=s, cache_salt="tenant-8")["matched_tokens"] == 0

    # an image in block 1: only a request with the same image hits past block 0
    m = list(range(900, 900 + 2 * BS))
    seq = _raw(e1, [_stored([21, 22], m, extra_keys=[None, [["img-1", 3]]])])
    srv.wait_applied("e1", seq)
    img = [{"identifier": "img-1", "offset": BS + 3, "length": 4}]
    assert srv.route(token_ids=m, mm_hashes=img)["matched_tokens"] == 2 * BS
    assert srv.route(token_ids=m)["matched_tokens"] == BS
    other = [{"identifier": "img-2", "offset": BS + 3, "length": 4}]
    assert srv.route(token_ids=m, mm_hashes=other)["matched_tokens"] == BS

    # a vLLM 0.11 engine (array-shaped events) caching for LoRA adapter id 3
    lo = list(range(3000, 3000 + 2 * BS))
    cmd = {"raw": encode_batch(KVEventBatch(1.0, [BlockStored([31, 32], None, lo, BS, 3, None, None)], 0),
                               "array").hex()}
    srv.wait_applied("e1", e1.cmd(**cmd)["seq"])
    assert srv.route(token_ids=lo, lora_id=3)["matched_tokens"] == 2 * BS
    assert srv.route(token_ids=lo)["matched_tokens"] == 0
    assert srv.route(token_ids=lo, lora_id=4)["matched_tokens"] == 0


def test_a_restarted_engine_loses_its_blocks_and_lost_batches_are_replayed(engines, serve) -> None:
    e0 = engines("e0")
    srv = serve(e0.arg, "--load-interval", "0")
    srv.wait_applied("e0", -1)
    old = [list(range(k * 1000, k * 1000 + BS)) for k in range(1, 6)]
    for i, t in enumerate(old):
        seq = _raw(e0, [_stored([i + 1], t)])
    srv.wait_applied("e0", seq)
    assert all(srv.route(token_ids=t)["matched_tokens"] == BS for t in old)

    # the engine restarts: its sequence starts again at 0 and its cache is empty
    new = list(range(77_000, 77_000 + BS))
    _raw(e0, [_stored([99], new)], seq=0)
    seq = _raw(e0, [_stored([98], list(range(78_000, 78_000 + BS)))])
    # (the applied seq from before the restart is already past this seq: wait for the reset)
    wait_for(lambda: (e := srv.engines()["e0"])["restarts"] == 1 and e["blocks"] == {"GPU": 2}
             and e["applied_seq"] == seq, "the restart to be applied")
    assert [srv.route(token_ids=t)["matched_tokens"] for t in old] == [0] * 5  # no false hits
    assert srv.route(token_ids=new)["matched_tokens"] == BS

    # a batch lost on the wire (published under a seq the subscriber never saw live) is
    # fetched from the replay socket
    gap = list(range(88_000, 88_000 + BS))
    nxt = seq + 1
    _raw(e0, [_stored([50], gap)], seq=nxt)
    seq = _raw(e0, [_stored([51], list(range(89_000, 89_000 + BS)))])
    srv.wait_applied("e0", seq)
    assert srv.route(token_ids=gap)["matched_tokens"] == BS
