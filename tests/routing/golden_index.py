"""Reading the golden vLLM captures for router-index tests: live batches, the pool
snapshots as residency counters, the workload's prompts and each request's engine hashes.
Shared by every index class's golden test (``tests/routing/test_index_golden.py``,
``tests/routing/test_engine_index.py``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from kvstream.wire.capture import CaptureChannel, read_capture
from kvstream.wire.events import decode_batch


def read_live_batches(path: Path) -> dict[int, object]:
    """{seq: decoded batch} of every payload the SUB socket received."""
    out = {}
    for rec in read_capture(path):
        if rec.channel == CaptureChannel.LIVE:
            _topic, seq, payload = rec.frames
            out[int.from_bytes(seq, "big")] = decode_batch(payload)
    return out


def hex_to_int_hash(hex32: str) -> int:
    """A digest in hex as events carry it in int mode."""
    return int(hex32[-16:], 16)  # int mode: the low 64 bits of the digest


def pool_residency(pool_after: dict) -> Counter:
    """{(engine hash, group): physical copies} from a pool snapshot."""
    out: Counter = Counter()
    for key, block_ids in pool_after["cached"].items():
        h, g = key.split("/g")
        out[(hex_to_int_hash(h), int(g))] = len(block_ids)
    return out


def index_residency(index: Any, source: str, medium: str) -> Counter:
    out: Counter = Counter()
    for m, g, eh, n in index.state()["sources"][source]["blocks"]:
        if m == medium:
            out[(eh, g)] += n
    return out


def workload_prompts(workload: dict) -> dict[str, list[int]]:
    """{request id: prompt token ids} from the workload's admissions."""
    out = {}
    for step in workload["steps"]:
        for op in step["ops"]:
            if op["op"] == "admit" and "tokens" in op:
                out.setdefault(op["req"], op["tokens"])
    return out


def golden_requests(version: str, stream: dict, workload: dict) -> dict[str, dict]:
    """Per request: its engine block hashes (ints), LoRA name, salt and mm items. 0.33's
    stream.json lists them; for 0.11 they are recomputed with kvstream.hashing (seed "0")."""
    if "requests" in stream:
        return stream["requests"]
    from kvstream.hashing import BlockHasher, RequestBlockHasher, to_external_list

    hasher = BlockHasher("sha256_cbor", 16, extra_key_style="0.11", rules="0.11", seed="0")
    out = {}
    for step in workload["steps"]:
        for op in step["ops"]:
            if op["op"] == "admit" and op["req"] not in out:
                rh = RequestBlockHasher(hasher, cache_salt=op.get("cache_salt"))
                rh.extend(op["tokens"])
                out[op["req"]] = {"block_hashes_int": to_external_list(rh.block_hashes),
                                  "cache_salt": op.get("cache_salt"), "lora": None, "mm": []}
    return out


def expected_prefix(req: dict, prompt: list[int], cached: Counter) -> int:
    """The pool's longest cached prefix (group 0) of the request's prompt, in blocks."""
    n = len(prompt) // 16
    k = 0
    for h in req["block_hashes_int"][:n]:
        if cached.get((h, 0), 0) == 0:
            break
        k += 1
    return k
