"""Event log benchmarks: checksum choice, write and read throughput, size, replay pacing.

Targets (issue: event logs): record >= 200k batches/s to disk, read back >= 1M records/s,
report bytes per event; time-scaled replay within 1 ms at 1x for >= 10,000 batches/s.
Run: python bench/bench_eventlog.py [--records N]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
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
