"""Router index benchmarks: ingest rate, scoring latency, bytes per entry.

    .venv/bin/python bench/bench_index.py [--quick] [--layout native|reference|engine|all] [--score-only]

Runs the token-keyed ``KVIndex`` (its residency table native: ``kvstream._native``) and, in
the same process, its reference: the last pure-Python index (dicts ``engine hash -> key``
and ``key -> mask``, ``table="dict"``, read unmodified from git history by
``bench/_reference.py``), then ``EngineKeyIndex``. Targets (issue #25): <= 48 bytes per
(block, source) entry at 10**6 entries, in-process apply >= 5 M block events/s, score
4,096 tokens x 64 sources <= 25 us median. Timings on a shared machine are noisy: the
ratios against the reference measured in the same run are the numbers to read.

1. Ingest: msgpack payloads of vLLM-shaped batches (runs of BlockStored with 16-token
   blocks, one BlockRemoved per evicted block) applied to a KVIndex, on one core. Reports
   block events per second (stored + removed blocks), with 4,096, 65,536 and 262,144
   blocks live: raw payload (``KVIndex.apply_payload``: read and applied by the native
   core; the reference decodes with EventDecoder and applies, the same work), decode +
   apply (EventDecoder, then ``apply_batch``) and apply only (decoded up front). Each is
   given per wall second and per CPU second of the process (``time.process_time``: on a
   shared, overloaded machine the wall clock counts other processes' time too).
2. Score: a 4,096-token prompt (256 router blocks of 16) against 64 sources that hold
   prefixes of it of different lengths; key computation included. Reports p50/p99 of
   ``match`` (prefixes only) and ``score`` (prefixes + default policy values), the prompt
   as a list and as an ``array('I')`` (what ``kvstream serve`` parses a body into); then
   ``score(...).best`` (the routing answer: the native index ranks only when the ranking
   is read), ``score`` with its whole answer read (every source's match, the ranking and
   the values: what ``/v1/route`` returns) and ``score(keys=...)`` with the keys
   precomputed (what ``Router.route`` and the service call).
3. Memory: bytes per (block, source) residency at 10**6 entries, for distinct blocks on
   one source and for blocks shared by 8 and by 64 sources: tracemalloc's Python bytes plus
   the bytes the native tables allocate (counted in Rust: tracemalloc cannot see them),
   and the process's RSS growth as a check.
4. Small batches: vLLM-shaped allocator batches of 1-8 events (kvstream's block pool
   serving requests that share system prompts, as ``bench_jetstream.py`` feeds its
   consumer), decoded up front and applied: batches/s and block events/s.
5. Snapshots: ``dump()`` and ``load()`` of a 10**6-block index of 8 sources (a router
   replica's start), in seconds, and the snapshot's size.
6. A source of two block sizes (``--two-sizes`` runs only this): the payloads of 1.
   applied by a source that holds blocks of one block size, by one that also holds a
   block of another (a hybrid model's groups; tracked by explicit records through the
   Python rules), and by a source of one block size beside such a source (which holds a
   block of one router block: the family check then takes the Python rules for every
   source), alternating run by run, best of 3: block events per second.

With ``--layout all`` (the default) the ingest cases run first with the native index and
the reference alternating run by run (best of 3 each), so load drift on a shared machine
hits both alike; then bytes per entry of both, then each layout's own lines.
"""

from __future__ import annotations

import argparse
from array import array
import gc
import os
import random
import sys
import statistics
import time
import tracemalloc

from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.wire.events import BlockRemoved, BlockStored, EventDecoder, KVEventBatch, encode_batch
from kvstream.hashing import BlockHasher
from kvstream.routing.index import KVIndex
from kvstream.routing.scoring import Load, ScoreResult

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _reference import load_reference_index  # noqa: E402
from _workloads import allocator_batches  # noqa: E402

reference_index = load_reference_index()  # the previous layout, read from git history

BS = 16


def _payloads(n_blocks: int, run: int, seed: int = 1, live_blocks: int = 4096) -> list[bytes]:
    """Batches of 8 requests: each stores a `run`-block chain; once `live_blocks` are held,
    later batches evict the oldest blocks (one BlockRemoved per block, as vLLM's GPU pool
    does)."""
    rnd = random.Random(seed)
    out = []
    live: list[int] = []
    h = 1
    made = 0
    while made < n_blocks:
        events = []
        for _ in range(8):
            hashes = list(range(h, h + run))
            h += run
            toks = [rnd.randrange(50_000) for _ in range(run * BS)]
            if len(live) > live_blocks:
                for eh in live[:run]:
                    events.append(BlockRemoved([eh], "GPU", 0))
                del live[:run]
                made += run
            events.append(BlockStored(hashes, None, toks, BS, None, "GPU", None, [None] * run, 0, "full_attention"))
            live.extend(hashes)
            made += run
        out.append(encode_batch(KVEventBatch(time.time(), events, 0)))
    return out


def _new_index(layout: str, hasher: str = "native"):
    if layout == "engine":
        return EngineKeyIndex(BlockHasher(hasher, BS, seed="0"))
    if layout == "reference":
        return reference_index.KVIndex()
    return KVIndex()  # the native table


def bench_ingest(n_blocks: int, layout: str = "native", live_blocks: int = 4096) -> None:
    payloads = _payloads(n_blocks, run=16, live_blocks=live_blocks)
    dec = EventDecoder()
    batches = [dec.decode(p) for p in payloads]
    n = sum(len(e.block_hashes) for b in batches for e in b.events)
    for label, decode in (("decode+apply", True), ("apply only  ", False)):
        index = _new_index(layout)
        gc.collect()
        t0 = time.perf_counter()
        if decode:
            for p in payloads:
                index.apply_batch("e0", dec.decode(p), now=0.0)
        else:
            for b in batches:
                index.apply_batch("e0", b, now=0.0)
        dt = time.perf_counter() - t0
        print(f"ingest {label} ({live_blocks:,} blocks live): {n:,} block events in {dt:.3f} s = "
              f"{n / dt / 1e6:.2f} M block events/s")


def _score_setup(layout: str, hasher: str = "native", n_sources: int = 64, prompt_tokens: int = 4096):
    """The score workload: an index of ``n_sources`` sources each holding a random-length
    prefix of one prompt (plus unrelated blocks), loads for all, and the timed calls."""
    rnd = random.Random(2)
    prompt = [rnd.randrange(50_000) for _ in range(prompt_tokens)]
    nb = prompt_tokens // BS
    index = _new_index(layout, hasher)
    # Every source holds the prompt's blocks under the same engine hashes (replicas of one
    # model hash alike); engine-keyed, they must be the prompt's real engine hashes.
    ek = index.keys(prompt) if layout == "engine" else list(range(1, 1 + nb))
    h = 1 + nb
    for s in range(n_sources):
        k = rnd.randrange(nb + 1)  # this source holds the first k blocks of the prompt
        hashes = list(ek)
        index.apply_batch(
            f"engine-{s:02d}",
            KVEventBatch(0.0, [BlockStored(hashes[:k], None, prompt[: k * BS], BS, None, "GPU", None)] if k else []),
        )
        # plus unrelated blocks, so the dicts are realistically large
        other = [rnd.randrange(50_000) for _ in range(64 * BS)]
        index.apply_batch(
            f"engine-{s:02d}",
            KVEventBatch(0.0, [BlockStored(list(range(h, h + 64)), None, other, BS, None, "GPU", None)]),
        )
        h += 64
    loads = {f"engine-{s:02d}": Load(queue=s % 5, running=s % 7, kv_usage=(s % 10) / 10) for s in range(n_sources)}
    packed = array("I", prompt)
    pkeys = index.keys(prompt)
    rows = [
        ("match", lambda: index.match(prompt)),
        ("score", lambda: index.score(prompt, loads=loads)),
        ("score(...).best", lambda: index.score(prompt, loads=loads).best),
        ("match, array('I') prompt", lambda: index.match(packed)),
        ("score, array('I') prompt", lambda: index.score(packed, loads=loads)),
        ("score(...).best, array('I') prompt", lambda: index.score(packed, loads=loads).best),
        ("score + ranking + matches read, array('I') prompt", lambda: _read_all(index.score(packed, loads=loads))),
        ("score(keys=...).best, keys precomputed", lambda: index.score(prompt, loads=loads, keys=pkeys).best),
    ]
    return index, prompt, loads, rows


def _p50_p99(fn, iters: int) -> tuple[float, float]:
    for _ in range(50):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    return ts[len(ts) // 2] / 1e3, ts[int(len(ts) * 0.99)] / 1e3


def bench_score_interleaved(iters: int = 300, rounds: int = 5) -> None:
    """The score rows of ``KVIndex()`` and the reference, alternating round by round (so
    load drift hits both alike); per row the best p50 of ``rounds`` runs of ``iters`` calls."""
    sides = {layout: _score_setup(layout) for layout in ("native", "reference")}
    n_rows = len(sides["native"][3])
    for i in range(n_rows):
        best = {layout: (float("inf"), 0.0) for layout in sides}
        for _ in range(rounds):
            for layout, (_, _, _, rows) in sides.items():
                got = _p50_p99(rows[i][1], iters)
                if got[0] < best[layout][0]:
                    best[layout] = got
        (nat, nat99), (ref, ref99) = best["native"], best["reference"]
        print(f"{sides['native'][3][i][0]}: native p50 {nat:.1f} us (p99 {nat99:.0f}), reference p50 {ref:.1f} us "
              f"(p99 {ref99:.0f}): {ref / nat:.2f}x")


def bench_score(n_sources: int = 64, prompt_tokens: int = 4096, iters: int = 2000, layout: str = "native",
                hasher: str = "native") -> None:
    index, prompt, loads, rows = _score_setup(layout, hasher, n_sources, prompt_tokens)
    holding = sum(1 for m in index.match(prompt).values() if m.blocks)
    print(f"({holding} of {n_sources} sources hold a prefix of the prompt)")
    for label, fn in rows:
        p50, p99 = _p50_p99(fn, iters)
        print(f"{label} {prompt_tokens} tokens x {n_sources} sources: p50 {p50:.0f} us, p99 {p99:.0f} us")
    keys = index.keys(prompt)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        index.best(index.keys(prompt), loads)
        ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    print(f"best(keys(prompt)): p50 {ts[len(ts) // 2] / 1e3:.0f} us, p99 {ts[int(len(ts) * 0.99)] / 1e3:.0f} us"
          f" (best alone p50 {min(_time_ns(lambda: index.best(keys, loads)) for _ in range(5)) / 1e3:.0f} us)")
    keys_t = []
    for _ in range(500):
        t0 = time.perf_counter_ns()
        index.keys(prompt)
        keys_t.append(time.perf_counter_ns() - t0)
    print(f"  of which key computation: p50 {statistics.median(keys_t) / 1e3:.0f} us")


def _read_all(res: ScoreResult) -> None:
    # What /v1/route's answer reads: every source's match, the ranking, the values.
    for name in res.ranking:
        res.matches[name]
    res.values


def bench_small_batches(n: int, layout: str) -> None:
    payloads = allocator_batches(n, algorithm="native")
    dec = EventDecoder()
    batches = [dec.decode(p) for p in payloads]
    events = sum(len(b.events) for b in batches)
    blocks = sum(len(getattr(e, "block_hashes", ())) for b in batches for e in b.events)
    best = 0.0
    for _ in range(3):
        index = _new_index(layout)
        gc.collect()
        t0 = time.perf_counter()
        for b in batches:
            index.apply_batch("e0", b)
        best = max(best, n / (time.perf_counter() - t0))
    print(f"small batches: {n:,} allocator batches ({events / n:.1f} events, {blocks / n:.1f} block events, "
          f"{sum(map(len, payloads)) / n:.0f} B each), apply only: {best:,.0f} batches/s = "
          f"{best * blocks / n / 1e6:.2f} M block events/s")


def bench_snapshot(n_blocks: int, layout: str, sources: int = 8) -> None:
    """A ``n_blocks``-block index of ``sources`` sources (chains of 64 blocks, each held by
    one source, every 8th chain by two): ``dump()`` and ``load()`` wall time."""
    if layout == "reference":
        return
    rnd = random.Random(4)
    index = _new_index(layout)
    made = 0
    c = 0
    while made < n_blocks:
        hashes = [rnd.getrandbits(63) + 1 for _ in range(64)]
        toks = [rnd.randrange(50_000) for _ in range(64 * BS)]
        ev = KVEventBatch(0.0, [BlockStored(hashes, None, toks, BS, None, "GPU", None)])
        index.apply_batch(f"e{c % sources}", ev)
        if c % 8 == 0:
            index.apply_batch(f"e{(c + 1) % sources}", ev)
        made += 64
        c += 1
    gc.collect()
    t0 = time.perf_counter()
    data = index.dump(cursors={f"e{s}": s for s in range(sources)})
    t_dump = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = type(index).load(data)
    t_load = time.perf_counter() - t0
    assert again.sources == index.sources
    print(f"snapshot of {made:,} blocks x {sources} sources: dump {t_dump:.3f} s, load {t_load:.3f} s, "
          f"{len(data) / 2**20:.1f} MiB ({len(data) / made:.1f} B/block)")


def bench_interleaved(n_blocks: int, n_small: int, rounds: int = 3) -> None:
    """The native index against the reference, alternating run by run (best of ``rounds``
    each), so machine load drifts hit both alike: decode + apply and apply-only rates and
    their ratios."""
    dec = EventDecoder()
    cases = [(f"{live:,} blocks live", _payloads(n_blocks, run=16, live_blocks=live))
             for live in (4096, 65_536, 262_144)]
    cases.append(("small allocator batches", allocator_batches(n_small, algorithm="native")))
    for label, payloads in cases:
        batches = [dec.decode(p) for p in payloads]
        n = sum(len(getattr(e, "block_hashes", ())) for b in batches for e in b.events)
        for how in ("raw payload", "decode+apply", "apply only"):
            best = {"native": 0.0, "reference": 0.0}
            cpu = {"native": 0.0, "reference": 0.0}
            for _ in range(rounds):
                for layout in best:
                    index = _new_index(layout)
                    gc.collect()
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    if how == "apply only":
                        for b in batches:
                            index.apply_batch("e0", b, now=0.0)
                    elif how == "raw payload" and layout == "native":
                        # The payload read and applied by the native core (apply_payload).
                        for p in payloads:
                            index.apply_payload("e0", p, now=0.0)
                    else:
                        for p in payloads:
                            index.apply_batch("e0", dec.decode(p), now=0.0)
                    best[layout] = max(best[layout], n / (time.perf_counter() - t0))
                    cpu[layout] = max(cpu[layout], n / max(1e-9, time.process_time() - c0))
            ref = best["reference"]
            print(f"ingest {how}, {label}: kvstream {best['native'] / 1e6:.2f} M block events/s, "
                  f"reference {ref / 1e6:.2f} M/s, ratio {best['native'] / ref:.2f}; per CPU second: "
                  f"kvstream {cpu['native'] / 1e6:.2f} M/s, reference {cpu['reference'] / 1e6:.2f} M/s"
                  + (f" (batches/s: kvstream {best['native'] * len(payloads) / n:,.0f}, reference "
                     f"{ref * len(payloads) / n:,.0f})" if label.startswith("small") else ""))


def bench_two_sizes(n_blocks: int, rounds: int = 3) -> None:
    payloads = _payloads(n_blocks, run=16)
    n = sum(len(e.block_hashes) for p in payloads for e in EventDecoder().decode(p).events)
    best = {"one block size ": 0.0, "two block sizes": 0.0, "one block size beside one of two": 0.0}
    for _ in range(rounds):
        for label in best:
            index = KVIndex()
            if label != "one block size ":  # one block of 2 router blocks, one of 1: two sizes held
                two = "e0" if label == "two block sizes" else "e1"
                index.apply_batch(two, KVEventBatch(0.0, [BlockStored([-1], None, [1] * 2 * BS, 2 * BS, None, "GPU", None)]))
                index.apply_batch(two, KVEventBatch(0.0, [BlockStored([-2], None, [2] * BS, BS, None, "GPU", None)]))
                assert index.stats.multi_size_sources == 1
            gc.collect()
            t0 = time.perf_counter()
            for p in payloads:
                index.apply_payload("e0", p, now=0.0)
            best[label] = max(best[label], n / (time.perf_counter() - t0))
    for label, rate in best.items():
        print(f"ingest, a source of {label} (raw payloads, 4,096 blocks live): {rate / 1e6:.2f} M block events/s")
    print("(beside one of two: that source holds a block of one router block, so every source's"
          " events take the Python rules)")


def _rss() -> int:
    """Resident set size of this process (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _time_ns(fn) -> int:
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def bench_memory(entries: int, sharers: int, layout: str = "native") -> None:
    """`entries` (block, source) residencies: entries // sharers distinct blocks, each
    held by `sharers` sources."""
    rnd = random.Random(3)
    n_blocks = entries // sharers
    run = 64
    gc.collect()
    rss0 = _rss()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = _new_index(layout)
    h = 1 << 40
    made = 0
    while made < n_blocks:
        toks = [rnd.randrange(50_000) for _ in range(run * BS)]
        if layout == "engine":
            hashes = [rnd.getrandbits(64) for _ in range(run)]  # real hashes are 64-bit ints
        else:
            hashes = list(range(h, h + run))
        h += run
        for s in range(sharers):
            # Each source's event decodes into its own int objects, as off the wire.
            index.apply_batch(
                f"e{s}",
                KVEventBatch(0.0, [BlockStored([x + 0 * s for x in map(int, map(str, hashes))], None, toks, BS, None, "GPU", None)]),
            )
        made += run
    del toks, hashes
    gc.collect()
    py = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    native = index.native_bytes() if hasattr(index, "native_bytes") else 0
    used = py + native
    rss = _rss() - rss0
    total = made * sharers
    # Where the native bytes go (docs/architecture.md, "Where a residency entry's bytes go"):
    # the block table (engine hash -> router key) and the media's key -> source mask maps.
    table = getattr(index, "_table", None)
    split = ""
    if native and hasattr(table, "native_bytes"):
        tb = table.native_bytes()
        split = f", of which block table {tb / total:.1f} and masks {(native - tb) / total:.1f}"
    print(
        f"memory: {total:,} (block, source) entries ({made:,} blocks x {sharers} sources): "
        f"{used / total:.1f} bytes/entry ({used / 2**20:.0f} MiB: {py / 2**20:.0f} Python, "
        f"{native / 2**20:.0f} native{split}; RSS grew {rss / total:.1f} bytes/entry)"
    )
    del index
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--layout", choices=("native", "reference", "engine", "all"), default="all",
                    help="KVIndex() (the native table), the previous pure-Python layout "
                         "(reference), EngineKeyIndex, or all three")
    ap.add_argument("--score-only", action="store_true",
                    help="only the scoring rows (2.), for each layout asked for")
    ap.add_argument("--two-sizes", action="store_true",
                    help="only the ingest of a source of two block sizes (6.)")
    a = ap.parse_args()
    if a.two_sizes:
        print("== ingest: a source of one block size and one of two, alternating (best of 3)")
        bench_two_sizes(50_000 if a.quick else 500_000)
        return
    layouts = ("native", "reference", "engine") if a.layout == "all" else (a.layout,)
    if a.score_only:
        if a.layout == "all":
            print("== score, KVIndex() and the reference interleaved (best p50 of 5 runs of 300 calls)")
            bench_score_interleaved(100 if a.quick else 300)
        for layout in layouts:
            print(f"== score: {layout}")
            for hasher in (("native", "xxhash", "sha256_cbor") if layout == "engine" else ("native",)):
                if layout == "engine":
                    print(f"-- scoring with BlockHasher({hasher!r})")
                bench_score(iters=200 if a.quick else 2000, layout=layout, hasher=hasher)
        return
    n_mem = 100_000 if a.quick else 1_000_000
    if a.layout == "all":
        print("== KVIndex() and the reference, interleaved run by run (best of 3)")
        bench_interleaved(200_000 if a.quick else 1_000_000, 2_000 if a.quick else 20_000)
        print("== bytes per (block, source) entry, 1 source: native, reference")
        for layout in ("native", "reference"):
            print(f"  {layout:9s}", end=" ", flush=True)
            bench_memory(n_mem, 1, layout)
        print("== score, KVIndex() and the reference interleaved (best p50 of 5 runs of 300 calls)")
        bench_score_interleaved(100 if a.quick else 300)
    for layout in layouts:
        title = {"native": "KVIndex() (native residency table)",
                 "reference": "reference: the last pure-Python KVIndex() (dicts), same process",
                 "engine": "EngineKeyIndex"}[layout]
        print(f"== {title}")
        bench_ingest(200_000 if a.quick else 2_000_000, layout)
        bench_ingest(200_000 if a.quick else 2_000_000, layout, live_blocks=65_536)
        for hasher in (("native", "xxhash", "sha256_cbor") if layout == "engine" else ("native",)):
            if layout == "engine":
                print(f"-- scoring with BlockHasher({hasher!r})")
            bench_score(iters=200 if a.quick else 2000, layout=layout, hasher=hasher)
        bench_small_batches(2_000 if a.quick else 20_000, layout)
        if layout == "native":
            bench_two_sizes(50_000 if a.quick else 500_000)
        bench_snapshot(n_mem, layout)
        for sharers in (1, 8, 64):
            bench_memory(n_mem, sharers, layout)


if __name__ == "__main__":
    main()
