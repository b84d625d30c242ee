"""kvstream's manager and pool replay vLLM's scripted workload with identical results.

The golden captures (``golden/vllm-*/``) hold the workload vLLM ran, every batch it
published and a pool snapshot after every step. Here the same ops drive
:class:`~kvstream.allocator.manager.KVCacheManager`; each step must publish the same batch (decoded
events equal *and* re-encoded bytes identical to vLLM's payload) and leave the same free
queue order, cached map, block tables and ref counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvstream.wire.events import EventEncoder, KVEventBatch, decode_batch, encode_batch
from kvstream.hashing import BlockHasher
from kvstream.allocator.manager import KVCacheManager, KVRequest
from kvstream.allocator.pool import BlockPool

TS0 = 1_700_000_000.0

# version folder -> (pool/manager options, hasher options, steps to replay, encoder)
VERSIONS: dict[str, dict[str, Any]] = {
    "vllm-0.11.0": dict(
        pool=dict(event_style="0.11", free_order="v0.11"),
        manager=dict(reserve_full_prompt=False),
        hasher=dict(seed="0", rules="0.11", extra_key_style="0.11"),
        steps=24,
        encode=EventEncoder("array").encode,
    ),
    "vllm-0.33.0": dict(
        pool=dict(event_style="0.33", free_order="v0.33"),
        manager=dict(reserve_full_prompt=True),
        hasher=dict(seed="vllm-none-hash", rules="0.33", extra_key_style="0.33"),
        steps=24,
        encode=encode_batch,
    ),
}


def _snapshot(mgr: KVCacheManager, reqs: dict[str, KVRequest], per_group_keys: bool) -> dict[str, Any]:
    pool = mgr.pool
    cached = {f"{h.hex()}/g{g}": ids for (h, g), ids in pool.cached_blocks().items()}
    suffix = "/g0" if per_group_keys else ""
    return {
        "num_free_blocks": pool.get_num_free_blocks(),
        "free_queue": pool.free_block_ids(),
        "cached": cached,
        "req_blocks": {f"{rid}{suffix}": r.block_ids for rid, r in reqs.items()},
        "ref_cnt": {str(b.block_id): b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt},
    }


def replay(folder: Path, opts: dict[str, Any], free_order: str | None = None):
    """Drive the manager through the workload; yield (step, batch or None, snapshot, results)."""
    workload = json.loads((folder / "workload.json").read_text())
    pool_opts = dict(opts["pool"])
    if free_order is not None:
        pool_opts["free_order"] = free_order
    pool = BlockPool(workload["num_gpu_blocks"], workload["block_size"], **pool_opts)
    hasher = BlockHasher("sha256_cbor", workload["block_size"], **opts["hasher"])
    mgr = KVCacheManager(pool, hasher, **opts["manager"])
    reqs: dict[str, KVRequest] = {}
    for i, step in enumerate(workload["steps"][: opts["steps"]]):
        results = []
        for op in step["ops"]:
            kind = op["op"]
            if kind == "admit":
                req = mgr.new_request(op["req"], op["tokens"], cache_salt=op.get("cache_salt"))
                ok = mgr.admit(req, op.get("num_new_tokens"))
                results.append({"op": kind, "req": op["req"], "ok": ok,
                                "num_prefix_hit_blocks": len(mgr.get_computed_blocks(req))
                                if not ok else req.num_prefix_hit_tokens // pool.block_size})
                if ok:
                    reqs[op["req"]] = req
            elif kind == "prefill":
                assert mgr.allocate(reqs[op["req"]], op["num_new_tokens"])
                results.append({"op": kind, "req": op["req"]})
            elif kind == "decode":
                assert mgr.decode(reqs[op["req"]], op["token"])
                results.append({"op": kind, "req": op["req"]})
            elif kind == "free":
                mgr.free(reqs.pop(op["req"]))
                results.append({"op": kind, "req": op["req"]})
            elif kind == "reset_prefix_cache":
                results.append({"op": kind, "ok": mgr.reset_prefix_cache()})
            else:  # pragma: no cover - the workload has no other ops in these steps
                raise AssertionError(f"unexpected op {kind}")
            pool.check_invariants()
        events = mgr.take_events()
        batch = KVEventBatch(TS0 + i, events, 0) if events else None
        yield i, batch, _snapshot(mgr, reqs, folder.name != "vllm-0.11.0"), results


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_batches_are_byte_identical_to_vllm(golden_dir: Path, version: str) -> None:
    folder = golden_dir / version
    opts = VERSIONS[version]
    stream = json.loads((folder / "stream.json").read_text())
    by_seq = {b["seq"]: b for b in stream["batches"]}
    published = 0
    for i, batch, _, _ in replay(folder, opts):
        seq = stream["steps"][i]["published_seq"]
        if seq is None:
            assert batch is None, f"step {i}: vLLM published nothing, kvstream published {batch}"
            continue
        assert batch is not None, f"step {i}: vLLM published seq {seq}, kvstream nothing"
        payload = bytes.fromhex(by_seq[seq]["payload_hex"])
        assert batch == decode_batch(payload), f"step {i} (seq {seq}): events differ"
        assert opts["encode"](batch) == payload, f"step {i} (seq {seq}): bytes differ"
        published += 1
    expected = sum(1 for s in stream["steps"][: opts["steps"]] if s["published_seq"] is not None)
    assert published == expected


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_pool_state_matches_vllm_after_every_step(golden_dir: Path, version: str) -> None:
    folder = golden_dir / version
    stream = json.loads((folder / "stream.json").read_text())
    for i, _, snap, results in replay(folder, VERSIONS[version]):
        want = stream["steps"][i]
        gold = {k: want["pool_after"][k] for k in snap}
        assert snap == gold, f"step {i} ({want['desc']})"
        for got, exp in zip(results, want["ops_result"]):
            assert got == {k: exp[k] for k in got}, f"step {i}"


def test_v011_free_order_differs_from_033_only_in_hashless_block_position(golden_dir: Path) -> None:
    """The 0.33 workload replayed with free_order='v0.11' gives 0.11's queue at step 22."""
    folder = golden_dir / "vllm-0.33.0"
    v011 = json.loads((golden_dir / "vllm-0.11.0" / "stream.json").read_text())
    snaps = {i: snap for i, _, snap, _ in replay(folder, VERSIONS["vllm-0.33.0"], free_order="v0.11")}
    assert snaps[22]["free_queue"] == v011["steps"][22]["pool_after"]["free_queue"]
    newer = {i: snap for i, _, snap, _ in replay(folder, VERSIONS["vllm-0.33.0"])}
    assert newer[22]["free_queue"] != snaps[22]["free_queue"]
