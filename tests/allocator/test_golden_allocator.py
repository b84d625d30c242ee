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

from kvstream.compat import VLLM_0_11, VLLM_0_33
from kvstream.hashing import LoRA, MMItem
from kvstream.allocator.manager import KVCacheManager, KVRequest
from kvstream.allocator.pool import BlockPool
from kvstream.wire.events import KVEventBatch, decode_batch

TS0 = 1_700_000_000.0

# version folder -> the release, its seed, how many steps to replay, pool extras, manager options
VERSIONS: dict[str, dict[str, Any]] = {
    "vllm-0.11.0": dict(
        release=VLLM_0_11, seed="0", steps=24, pool={},
    ),
    "vllm-0.33.0": dict(
        # Steps 24-30 cover LoRA, multimodal, CPU offload events, a second (sliding-window)
        # KV cache group, report mode "full" and session ids.
        release=VLLM_0_33, seed="vllm-none-hash", steps=31,
        pool=dict(kv_cache_event_metadata=(("full_attention", None), ("sliding_window", 64))),
    ),
}


def _snapshot(pool: BlockPool, reqs: dict[tuple[str, int], KVRequest], per_group_keys: bool) -> dict[str, Any]:
    cached = {f"{h.hex()}/g{g}": ids for (h, g), ids in pool.cached_blocks().items()}
    return {
        "num_free_blocks": pool.get_num_free_blocks(),
        "free_queue": pool.free_block_ids(),
        "cached": cached,
        "req_blocks": {f"{rid}/g{g}" if per_group_keys else rid: r.block_ids for (rid, g), r in reqs.items()},
        "ref_cnt": {str(b.block_id): b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt},
    }


def replay(folder: Path, opts: dict[str, Any], free_order: str | None = None):
    """Drive the manager through the workload; yield (step, batch or None, snapshot, results).

    One manager per KV cache group, on one pool; a request admitted in several groups is
    admitted by each group's manager in turn (vLLM's coordinator does the same).
    """
    workload = json.loads((folder / "workload.json").read_text())
    release = opts["release"]
    pool = BlockPool(workload["num_gpu_blocks"], workload["block_size"], release=release, free_order=free_order,
                     **opts["pool"])
    hasher = release.hasher("sha256_cbor", workload["block_size"], seed=opts["seed"])
    mgrs = [KVCacheManager(pool, hasher, kv_cache_group_id=g, release=release) for g in range(pool.num_groups)]
    reqs: dict[tuple[str, int], KVRequest] = {}
    for i, step in enumerate(workload["steps"][: opts["steps"]]):
        results = []
        for op in step["ops"]:
            kind = op["op"]
            rid = op.get("req")
            if kind == "admit":
                lora = op.get("lora")
                kw = dict(
                    cache_salt=op.get("cache_salt"),
                    lora=LoRA(lora["lora_name"], lora["lora_path"], lora["lora_int_id"]) if lora else None,
                    mm_items=[MMItem(m["identifier"], m["offset"], m["length"]) for m in op.get("mm", ())],
                    session_id=op.get("session_id"),
                    kv_cache_report_mode=op.get("extra_args", {}).get("kv_cache_report_mode"),
                )
                ok = True
                admitted = []
                groups = op.get("groups", [0])
                for g in groups:
                    req = mgrs[g].new_request(rid, op["tokens"], **kw)
                    ok = mgrs[g].admit(req, op.get("num_new_tokens"), cache=len(groups) == 1)
                    if not ok:
                        break
                    admitted.append((g, req))
                if ok and len(groups) > 1:  # every group allocated: now cache them, in order
                    for g, r in admitted:
                        mgrs[g].cache_computed_blocks(r)
                res = {"op": kind, "req": rid, "ok": ok,
                       "num_prefix_hit_blocks": len(mgrs[0].get_computed_blocks(req))
                       if not ok else req.num_prefix_hit_tokens // pool.block_size}
                if "groups" in op:
                    res["groups"] = op["groups"]
                results.append(res)
                if ok:
                    for g, r in admitted:
                        reqs[(rid, g)] = r
            elif kind == "prefill":
                assert mgrs[0].allocate(reqs[(rid, 0)], op["num_new_tokens"])
                results.append({"op": kind, "req": rid})
            elif kind == "decode":
                assert mgrs[0].decode(reqs[(rid, 0)], op["token"])
                results.append({"op": kind, "req": rid})
            elif kind == "free":
                for g, mgr in enumerate(mgrs):
                    if (rid, g) in reqs:
                        mgr.free(reqs.pop((rid, g)))
                results.append({"op": kind, "req": rid})
            elif kind == "reset_prefix_cache":
                results.append({"op": kind, "ok": mgrs[0].reset_prefix_cache()})
            elif kind in ("offload_store", "offload_remove"):
                record = mgrs[0].offload_stored if kind == "offload_store" else mgrs[0].offload_removed
                record(reqs[(rid, 0)], op["blocks"], "CPU")
                results.append({"op": kind, "req": rid, "blocks": op["blocks"]})
            else:  # pragma: no cover - the workload has no other ops
                raise AssertionError(f"unexpected op {kind}")
            pool.check_invariants()
        events = pool.take_events()
        batch = KVEventBatch(TS0 + i, events, 0) if events else None
        yield i, batch, _snapshot(pool, reqs, folder.name != "vllm-0.11.0"), results


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
        assert opts["release"].encoder().encode(batch) == payload, f"step {i} (seq {seq}): bytes differ"
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
