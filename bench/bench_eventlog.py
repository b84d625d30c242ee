"""Event log benchmarks: checksum choice, write and read throughput, size, replay pacing.

Targets (issue: event logs): record >= 200k batches/s to disk, read back >= 1M records/s,
report bytes per event; time-scaled replay within 1 ms at 1x for >= 10,000 batches/s.

References, in the same run: the simplest log a user would write by hand (per record a
``struct`` header with the source, seq and a CRC-32, then the payload, through one buffered
file; read back with the same header), and pacing by sleeping until each record's time
(``anyio.sleep`` per record, the naive replay loop).
Run: python bench/bench_eventlog.py [--records N]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import struct
import tempfile
import time
import timeit
import zlib

import anyio
import xxhash

from kvstream.eventlog import LogReader, LogWriter, zstd_available
from kvstream.eventlog.format import LogMessage
from kvstream.eventlog.replay import Pacer
from kvstream.wire.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch


def make_payloads(n: int, seed: int = 0) -> tuple[list[bytes], int]:
    """Batches like a busy vLLM engine's steps: a BlockStored run of 1-4 new blocks (16
    tokens each, vocab 32k) and, in half of the steps, 1-2 single-block removals."""
    rng = random.Random(seed)
    out, events = [], 0
    for i in range(n):
        k = rng.randint(1, 4)
        evs: list = [BlockStored([rng.getrandbits(64) for _ in range(k)], rng.getrandbits(64),
                                 [rng.randrange(32000) for _ in range(16 * k)], 16, None, "GPU", None)]
        if rng.random() < 0.5:
            evs += [BlockRemoved([rng.getrandbits(64)], "GPU") for _ in range(rng.randint(1, 2))]
        events += len(evs)
        out.append(encode_batch(KVEventBatch(1.7e9 + i * 0.01, evs, 0)))
    return out, events


def bench_checksums() -> None:
    rec = os.urandom(300)
    g = {"zlib": zlib, "xxhash": xxhash, "rec": rec}
    print("checksum of a 300-byte record (ns/call):")
    for stmt in ("zlib.crc32(rec)", "xxhash.xxh32_intdigest(rec)", "xxhash.xxh3_64_intdigest(rec)"):
        n = 1_000_000
        t = timeit.timeit(stmt, globals=g, number=n)
        print(f"  {stmt:34s} {t / n * 1e9:6.0f}")


def bench_write_read(payloads: list[bytes], events: int, tmp: str) -> None:
    n = len(payloads)
    modes = [("plain, flush every 50 ms", {}), ("plain, flush every record", {"flush": "record"})]
    if zstd_available():
        modes += [("zstd-3, flush every 50 ms", {"compression": "zstd"}),
                  ("zstd-3, flush on close/1 MiB", {"compression": "zstd", "flush": "close"})]
    sources = [f"tcp://10.0.0.{i}:5557" for i in range(4)]
    raw = sum(len(p) for p in payloads)
    print(f"\n{n} batches, {events} events, payload {raw / n:.1f} B/batch ({raw / events:.1f} B/event)")
    print(f"  {'mode':32s} {'write k/s':>10s} {'read k/s':>10s} {'B/batch':>8s} {'B/event':>8s}")
    for i, (name, kw) in enumerate(modes):
        path = os.path.join(tmp, f"log{i}.kvlog")
        t = time.perf_counter()
        with LogWriter(path, **kw) as w:
            wm = w.write_message
            for j, p in enumerate(payloads):
                wm(sources[j & 3], b"kv@peer@model", j >> 2, p)
        wt = time.perf_counter() - t
        size = os.path.getsize(path)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            c = 0
            for _r in LogReader(path):
                c += 1
            best = min(best, time.perf_counter() - t)
        assert c == n
        print(f"  {name:32s} {n / wt / 1e3:10.0f} {n / best / 1e3:10.0f} {size / n:8.1f} {size / events:8.1f}")
        os.unlink(path)
    path = os.path.join(tmp, "reference.bin")
    wt, best, size = _reference_write_read(payloads, sources, path)
    print(f"  {'reference: struct + crc32 by hand':32s} {n / wt / 1e3:10.0f} {n / best / 1e3:10.0f} "
          f"{size / n:8.1f} {size / events:8.1f}")
    os.unlink(path)


_REF_HEADER = struct.Struct("<IIQdB")  # payload length, crc32, seq, time, source index


def _reference_write_read(payloads: list[bytes], sources: list[str], path: str) -> tuple[float, float, int]:
    """The hand-written log (see the module docstring): write seconds, best read seconds, size."""
    pack, crc = _REF_HEADER.pack, zlib.crc32
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write("\n".join(sources).encode() + b"\n\n")
        w = f.write
        for j, p in enumerate(payloads):
            w(pack(len(p), crc(p), j >> 2, time.time(), j & 3))
            w(p)
    wt = time.perf_counter() - t
    best = float("inf")
    hsize, unpack = _REF_HEADER.size, _REF_HEADER.unpack_from
    for _ in range(3):
        t = time.perf_counter()
        with open(path, "rb") as f:
            data = f.read()
        pos = data.index(b"\n\n") + 2
        c = 0
        while pos < len(data):
            length, check, _seq, _ts, _src = unpack(data, pos)
            pos += hsize
            p = data[pos : pos + length]
            pos += length
            if crc(p) != check:
                raise ValueError("reference log: bad checksum")
            c += 1
        best = min(best, time.perf_counter() - t)
    assert c == len(payloads)
    return wt, best, os.path.getsize(path)


def bench_pacing(rate: int, seconds: float) -> None:
    n = int(rate * seconds)
    recs = [LogMessage(i * 1_000_000_000 // rate, "e", b"t", i, b"") for i in range(n)]
    sink: list = []

    async def go() -> None:
        st = await Pacer(1.0).run(recs, sink.append)
        d = st.as_dict()
        print(f"\npacing at 1x, {rate} batches/s for {seconds:.0f} s (no-op sink): "
              f"lateness p50 {d['p50_us']:.0f} us, p99 {d['p99_us']:.0f} us, max {d['max_us']:.0f} us; "
              f"elapsed {d['elapsed_s']:.3f} s")

    anyio.run(go)

    async def go_naive() -> list[float]:
        late = []
        start = time.perf_counter()
        for r in recs:
            due = start + r.recv_ns / 1e9
            now = time.perf_counter()
            if due > now:
                await anyio.sleep(due - now)
            late.append(time.perf_counter() - due)
        return late

    late = sorted(anyio.run(go_naive))
    print(f"reference, anyio.sleep per record (no-op sink): lateness p50 {late[len(late) // 2] * 1e6:.0f} us, "
          f"p99 {late[int(len(late) * 0.99)] * 1e6:.0f} us, max {late[-1] * 1e6:.0f} us")
    try:
        from kvstream.transport.config import KVEventsConfig
        from kvstream.transport.publisher import Publisher
    except ImportError:
        return
    payloads, _ = make_payloads(1000, seed=1)
    recs = [LogMessage(i * 1_000_000_000 // rate, "e", b"kv@peer@model", i, payloads[i % 1000]) for i in range(n)]
    tmp = tempfile.mkdtemp()

    async def go_pub() -> None:
        from kvstream.eventlog.replay import replay_to_publishers

        cfg = KVEventsConfig(publisher="zmq", endpoint=f"ipc://{tmp}/pub.sock", replay_endpoint=None,
                             topic="kv@peer@model")
        async with Publisher(cfg) as pub:
            st = await replay_to_publishers(recs, {"e": pub}, speed=1.0)
        d = st.as_dict()
        mode = "publish_raw" if hasattr(pub, "publish_raw") else "publish(decoded) fallback"
        print(f"pacing at 1x, {rate} batches/s onto a real Publisher ({mode}): "
              f"lateness p50 {d['p50_us']:.0f} us, p99 {d['p99_us']:.0f} us, max {d['max_us']:.0f} us")

    try:
        anyio.run(go_pub)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=300_000)
    args = ap.parse_args()
    bench_checksums()
    t = time.perf_counter()
    payloads, events = make_payloads(args.records)
    print(f"(generated payloads in {time.perf_counter() - t:.1f} s)")
    tmp = tempfile.mkdtemp()
    try:
        bench_write_read(payloads, events, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bench_pacing(10_000, 2.0)
    bench_pacing(20_000, 1.0)


if __name__ == "__main__":
    main()
