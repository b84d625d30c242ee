"""The consumer's bulk paths (a read's deliveries tracked, decoded and applied by the run)
yield exactly what the one-by-one paths yield: same items, counters, states and index."""

from __future__ import annotations

import random
from typing import Any

from kvstream.allocator.manager import KVCacheManager
from kvstream.allocator.pool import BlockPool
from kvstream.hashing import BlockHasher
from kvstream.jetstream import JetStreamSource, StreamSource, wire
from kvstream.jetstream._proto import ProtocolReader
from kvstream.jetstream.source import _BATCH_DELIVERY
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.routing.router import Router, apply_item
from kvstream.transport import SourceBatch, SourceReset, SourceStale
from kvstream.wire.events import KVEventBatch, decode_batch, encode_batch

BS = 16


def _payloads(n: int, seed: int) -> list[bytes]:
    """``n`` consecutive batches of an allocator serving requests with shared prefixes."""
    rng = random.Random(seed)
    m = KVCacheManager(BlockPool(num_gpu_blocks=256, block_size=BS), BlockHasher("xxhash", BS, seed="0"))
    prefixes = [list(range(1000 * p, 1000 * p + 2 * BS)) for p in range(4)]
    running: list[Any] = []
    out = []
    for i in range(n):
        req = m.new_request(i, rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(BS * rng.randint(1, 3))])
        while not m.admit(req) and running:
            m.free(running.pop(0))
        if req.running:
            running.append(req)
        while len(running) > 4:
            m.free(running.pop(0))
        out.append(encode_batch(KVEventBatch(float(i), m.take_events())))
    return out


class _Counting(StreamSource):
    __slots__ = ("one_by_one",)

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.one_by_one = 0

    def on_batch(self, *a: Any) -> None:
        self.one_by_one += 1
        super().on_batch(*a)


def test_a_run_of_batches_gives_the_items_and_counters_of_one_by_one_and_falls_back_on_anything_odd() -> None:
    good = _payloads(40, 1)
    # (sseq, instance, seq, payload): a clean stretch, a gap, a damaged payload, an old
    # duplicate, a 0.11 array-shaped batch, a restart (instance 1, seqs from 0).
    msgs = [(i + 1, 0, i, good[i]) for i in range(12)]
    msgs += [(13, 0, 14, good[12]), (14, 0, 15, good[13])]
    msgs += [(15, 0, 16, b"\xc1damaged"), (16, 0, 17, good[14])]
    msgs += [(17, 0, 3, good[15]), (18, 0, 18, good[16])]
    msgs += [(19, 0, 19, encode_batch(decode_batch(good[17]), "array")), (20, 0, 20, good[18])]
    msgs += [(21 + i, 1, i, good[19 + i]) for i in range(10)]

    def one_by_one() -> tuple[list, dict]:
        out: list = []
        s = StreamSource("e0", decode_batch, out)
        for sseq, inst, seq, p in msgs:
            s.on_batch(sseq, inst, seq, b"kv@e0", p, 5.0)
        return out, s.counters.as_dict()

    def in_runs(size: int) -> tuple[list, dict, int]:
        out: list = []
        s = _Counting("e0", decode_batch, out)
        i = 0
        while i < len(msgs):
            run = [msgs[i]]
            while i + len(run) < len(msgs) and len(run) < size and msgs[i + len(run)][1] == run[0][1]:
                run.append(msgs[i + len(run)])
            s.on_batch_run([m[0] for m in run], run[0][1], [m[2] for m in run], b"kv@e0", [m[3] for m in run], 5.0)
            i += len(run)
        return out, s.counters.as_dict(), s.one_by_one

    expect = one_by_one()
    assert expect[1]["decode_errors"] == 1 and expect[1]["gaps"] == 2 and expect[1]["restarts"] == 1
    for size in (2, 3, 7, 12, 100):
        items, counters, _ = in_runs(size)
        assert (items, counters) == expect, size
    # In runs of 4: the first (no instance known yet), the two with a gap, damage, an old
    # seq or an array-shaped batch, and the restart's first run go one by one; the other
    # four runs take the bulk path.
    assert in_runs(4)[2] == 16


def _delivery(subject: bytes, sseq: int, dseq: int, source: str, inst: int, seq: int, payload: bytes) -> bytes:
    h = wire.batch_headers(source, inst, seq, wire.encode_topic(b"kv@" + source.encode()))
    hdr = ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode()
    reply = b"$JS.ACK.KV_EVENTS.c0nsumer.1.%d.%d.1733000000000000000.0" % (sseq, dseq)
    return b"HMSG %s 1 %s %d %d\r\n%s%s\r\n" % (subject, reply, len(hdr), len(hdr) + len(payload), hdr, payload)


def test_the_consumer_reads_runs_of_two_interleaved_engines_as_it_reads_one_delivery_at_a_time() -> None:
    pa, pb = _payloads(60, 2), _payloads(60, 3)
    parts = []
    sa = sb = 0
    rng = random.Random(4)
    for i in range(110):  # bursts of one engine, then the other
        if (rng.random() < 0.8) == (i // 20 % 2 == 0) and sa < 60 or sb >= 60:
            parts.append(_delivery(b"kv.a", i + 1, i + 1, "a", 0, sa, pa[sa]))
            sa += 1
        else:
            parts.append(_delivery(b"kv.b", i + 1, i + 1, "b", 0, sb, pb[sb]))
            sb += 1
    parts.insert(70, b"PING\r\n")
    lost = parts[:90] + parts[91:]  # delivery 91 never arrives: the consumer must be made again
    for stream, reset in ((b"".join(parts), False), (b"".join(lost), True)):
        results = []
        for bulk in (True, False):
            sub = JetStreamSource("nats://127.0.0.1:4222")
            fast = (sub._on_fast_run if bulk else
                    lambda ms, ps: [sub._on_fast(m, p) for m, p in zip(ms, ps)])  # type: ignore[func-returns-value]
            reader = ProtocolReader(sub._on_raw, (_BATCH_DELIVERY, fast))
            items = []
            for off in range(0, len(stream), 5000):
                reader.feed(stream[off:off + 5000])
                sub._flush()
                items += sub.get_nowait()
            results.append((items, {n: s.as_dict() for n, s in sub.states().items()}, sub.last_sseq,
                            sub._reset.is_set(), reader.fast_hits))
        assert results[0] == results[1]
        items, states, last, was_reset, hits = results[0]
        assert was_reset == reset and hits == len(stream.split(b"HMSG ")) - 1
        if not reset:
            assert [i.seq for i in items if i.source == "a"] == list(range(sa))
            assert last == 110 and states["b"]["expected"] == sb


def test_the_router_applies_runs_of_batches_into_an_index_equal_to_one_by_one() -> None:
    pa, pb = _payloads(80, 5), _payloads(80, 6)
    items: list[Any] = []
    for i in range(80):
        items.append(SourceBatch("a", i, b"kv@a", pa[i], decode_batch(pa[i]), False))
        if i % 3 == 0:
            items.append(SourceBatch("b", i // 3, b"kv@b", pb[i // 3], decode_batch(pb[i // 3]), False))
        if i == 40:
            items.append(SourceStale("b", "test", 14, 20))
        if i == 60:
            items.append(SourceReset("a", "restart", 0))
    more = _payloads(120, 5)[80:]  # then a stretch of one source only (one index call per wake-up)
    items += [SourceBatch("a", 80 + i, b"kv@a", p, decode_batch(p), False) for i, p in enumerate(more)]

    def hasher() -> BlockHasher:
        return BlockHasher("xxhash", BS, seed="0")

    for make in (KVIndex, lambda: EngineKeyIndex(hasher()), lambda: KVIndex(ttl_s=30.0)):
        one = make()
        for item in items:
            apply_item(one, item, 100.0)
        r = Router(index=make(), subscriber=JetStreamSource("nats://127.0.0.1:4222"))
        applied: dict[str, int] = {}
        for off in range(0, len(items), 17):  # what the router takes per wake-up
            r._apply_many(items[off:off + 17], 100.0)
            for item in items[off:off + 17]:
                if type(item) is SourceBatch:
                    applied[item.source] = item.seq
                elif type(item) is SourceReset:
                    applied.pop(item.source, None)
            assert {s: r.applied_seq(s) for s in applied} == applied
        assert r.index.state() == one.state() and r.index.stats == one.stats
        assert r.items_applied == len(items) and r.applied_seq("a") == 119 and r.applied_seq("b") == 26


def test_a_plain_run_hands_over_natively_read_batches_that_apply_and_read_as_the_decoded_ones() -> None:
    from kvstream.routing.payloads import PayloadBatch

    pa = _payloads(70, 8)
    stream = b"".join(_delivery(b"kv.a", i + 1, i + 1, "a", 0, i, p) for i, p in enumerate(pa))
    sub = JetStreamSource("nats://127.0.0.1:4222")
    reader = ProtocolReader(sub._on_raw, (_BATCH_DELIVERY, sub._on_fast_run))
    items: list[Any] = []
    for off in range(0, len(stream), 8000):
        reader.feed(stream[off:off + 8000])
        sub._flush()
        items += sub.get_nowait()
    assert [i.seq for i in items] == list(range(70))
    natively = [i for i in items if type(i.batch) is PayloadBatch]
    # the first run goes the tracker's way (its first batch names the instance), so does any run under 4
    assert len(natively) >= 40
    assert all(i.batch._batch is None for i in natively)  # nothing decoded into Python objects yet
    c = sub.counters("a")
    assert c.batches == 70 and c.events == sum(len(decode_batch(p).events) for p in pa) and c.decode_errors == 0
    for make in (KVIndex, lambda: EngineKeyIndex(BlockHasher("xxhash", BS, seed="0"))):
        ref = make()
        for p in pa:
            ref.apply_batch("a", decode_batch(p), 1.0)
        r = Router(index=make(), subscriber=JetStreamSource("nats://127.0.0.1:4222"))
        for off in range(0, len(items), 25):
            r._apply_many(items[off:off + 25], 1.0)
        assert r.index.state() == ref.state() and r.index.stats == ref.stats
    assert [i.batch for i in items] == [decode_batch(p) for p in pa]  # read as the decoded batches
