"""Codec benchmark: decode/encode of a batch of 100 single-block BlockStored events.

Target (issue 2): kvstream's decoder within 1.5x of a plain typed msgspec decode of the same
bytes into vLLM-shaped structs (about 52 us here). Run: python bench/bench_codec.py

Then the native payload reader (``kvstream._native.read_payload``, what ``kvstream serve``
and the JetStream consumer read payloads with) on one 256-block ``BlockStored`` of 4,096
token ids, for three distributions of ids (their msgpack widths decide the reader's
loop): uniform over 120,000 (``bench_serve.py``'s documents: uint16 and uint32 at
random), Zipf over a 128k vocabulary (Llama 3's size: fixint, uint8, uint16 and uint32
mixed), and uint16 only (a 32k vocabulary); beside the plain typed msgspec decode of the
same bytes.
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
    reader()


def reader() -> None:
    import bisect
    import itertools
    import random

    from kvstream._native import read_payload

    rng = random.Random(1)
    vocab = 128_256
    cum = list(itertools.accumulate(1.0 / (r + 1) for r in range(vocab)))
    ids = list(range(vocab))
    for a in range(0, vocab, 1024):  # a BPE id is near its frequency rank: shuffled locally
        w = ids[a:a + 1024]
        rng.shuffle(w)
        ids[a:a + 1024] = w
    kinds = {
        "uniform 1-120,000": lambda: rng.randrange(1, 120_000),
        "Zipf over 128k": lambda: ids[bisect.bisect(cum, rng.random() * cum[-1])],
        "uint16 only": lambda: rng.randrange(300, 60_000),
    }
    base = msgspec.msgpack.Decoder(_Batch)
    print("native payload reader, one BlockStored of 256 blocks / 4,096 token ids (best of 5 x 20 x 32 payloads):")
    for name, draw in kinds.items():
        payloads = [EventEncoder().encode(KVEventBatch(1.7e9, [BlockStored(
            [rng.randrange(1, 2**63) for _ in range(256)], None, [draw() for _ in range(4096)], 16, None, "GPU",
            None)], 0)) for _ in range(32)]
        t_native = min(_time_all(lambda p: read_payload(p, 1 << 26), payloads) for _ in range(5))
        t_base = min(_time_all(base.decode, payloads) for _ in range(5))
        print(f"  {name:18} read_payload {t_native * 1e6:6.1f} us   plain typed msgspec decode {t_base * 1e6:6.1f} us")


def _time_all(fn, payloads) -> float:
    t = time.perf_counter()
    for _ in range(20):
        for p in payloads:
            fn(p)
    return (time.perf_counter() - t) / (20 * len(payloads))


if __name__ == "__main__":
    main()
