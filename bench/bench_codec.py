"""Codec benchmark: decode/encode of a batch of 100 single-block BlockStored events.

Target (issue 2): kvstream's decoder within 1.5x of a plain typed msgspec decode of the same
bytes into vLLM-shaped structs (about 52 us here). Run: python bench/bench_codec.py
"""

from __future__ import annotations

import time
from typing import Any, Union

import msgspec

from kvstream.wire.events import BlockStored, EventDecoder, EventEncoder, KVEventBatch


# The baseline: structs shaped like vLLM 0.33's, decoded with one typed msgspec Decoder and
# nothing else (no validation, no shape fallback).
class _Ev(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class _Stored(_Ev, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Union[tuple[Any, ...], None]], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None
    locality: Any = None
    ownership: Any = None
    session_id: Union[str, None] = None
    lookahead_token_ids: Union[list[list[int]], None] = None


class _Removed(_Ev, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Union[str, None]
    group_idx: Union[int, None] = None


class _Cleared(_Ev, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[_Stored, _Removed, _Cleared]]
    data_parallel_rank: Union[int, None] = None


def _make_batch(n: int = 100) -> KVEventBatch:
    evs = []
    parent = None
    for i in range(n):
        h = (0x9E3779B97F4A7C15 * (i + 1)) & (2**64 - 1)
        evs.append(BlockStored([h], parent, list(range(i * 16, i * 16 + 16)), 16, None, "GPU", None,
                               extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention"))
        parent = h
    return KVEventBatch(1.7e9, evs, 0)


def _time(fn, payload, reps: int) -> float:
    for _ in range(50):
        fn(payload)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn(payload)
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def main() -> None:
    batch = _make_batch()
    reps = 2000
    for fmt in ("map", "array"):
        payload = EventEncoder(fmt).encode(batch)
        base = msgspec.msgpack.Decoder(_Batch)
        ours = EventDecoder()
        if fmt == "map":
            t_base = _time(base.decode, payload, reps)
        t_ours = _time(ours.decode, payload, reps)
        enc = EventEncoder(fmt)
        t_enc = _time(enc.encode, batch, reps)
        print(f"[{fmt}] payload {len(payload)} bytes, 100 BlockStored events")
        if fmt == "map":
            print(f"  plain typed msgspec decode : {t_base * 1e6:8.1f} us")
            print(f"  kvstream EventDecoder      : {t_ours * 1e6:8.1f} us  ratio {t_ours / t_base:.2f}x (target <= 1.5x)")
        else:
            print(f"  kvstream EventDecoder      : {t_ours * 1e6:8.1f} us  ratio {t_ours / t_base:.2f}x of the map baseline")
        print(f"  kvstream EventEncoder      : {t_enc * 1e6:8.1f} us")
        print(f"  decode rate                : {100 / t_ours / 1e6:8.2f} M events/s")


if __name__ == "__main__":
    main()
