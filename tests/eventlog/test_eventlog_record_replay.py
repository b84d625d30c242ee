"""Recording a live multi-engine stream (loss, snapshots, restarts) and replaying it.

Real publishers and a real subscriber on ipc sockets. The recorder writes every item the
subscriber yields; the same items are kept as the live consumer saw them. Replaying the
log must give exactly that item sequence (and so, through ``apply_item``, the same index),
and replaying it onto a socket must put the same frames on the wire.
"""

from __future__ import annotations

import random

import anyio
import pytest
import zmq

from kvstream.eventlog import LogWriter, read_log
from kvstream.eventlog.recorder import Recorder
from kvstream.eventlog.replay import log_items, replay_to_publishers
from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from kvstream.transport import KVEventsConfig, Publisher, SourceSpec, Subscriber
from kvstream.transport.items import SourceBatch, SourceReset, SourceStale

TOPIC = "kv@peer@model"


class _Engine:
    """Just enough of an engine to publish plausible batches and answer snapshots."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.cached: list[int] = []

    def step(self, ts: float) -> KVEventBatch:
        rng = self.rng
        evs: list = []
        if self.cached and rng.random() < 0.4:
            h = self.cached.pop(rng.randrange(len(self.cached)))
            evs.append(BlockRemoved([h], "GPU"))
        new = [rng.getrandbits(64) for _ in range(rng.randint(1, 3))]
        evs.append(BlockStored(new, None, [rng.randrange(1000) for _ in range(16 * len(new))], 16, None, "GPU", None))
        self.cached += new
        return KVEventBatch(ts, evs, None)

    def snapshot(self):
        if not self.cached:
            return [AllBlocksCleared()]
        return [AllBlocksCleared(), BlockStored(list(self.cached), None, [0] * 16 * len(self.cached), 16,
                                                None, "GPU", None)]


def _cfg(tmp, name, **kw):
    return KVEventsConfig(publisher="zmq", endpoint=f"ipc://{tmp}/{name}.pub",
                          replay_endpoint=f"ipc://{tmp}/{name}.rep", topic=TOPIC, **kw)


@pytest.fixture
def short_tmp(tmp_path_factory):
    # ipc paths must stay under ~100 bytes
    import tempfile

    d = tempfile.mkdtemp(prefix="kvl")
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


async def _drained(*pubs) -> None:
    """Wait (a state, with a deadline) until every publisher's send queue is empty."""
    with anyio.fail_after(30):
        while any(p.queued for p in pubs):
            await anyio.sleep(0.001)


async def _record_live(tmp, log_path):
    """Four engines: e0 restarts, e1 loses live messages (replay fills them), e2 loses more
    than its replay buffer (snapshot), e3 too but has no snapshot (stale)."""
    live_items: list = []
    engines = {n: _Engine(i) for i, n in enumerate(["e0", "e1", "e2", "e3"])}
    cfgs = {
        "e0": _cfg(tmp, "e0"),
        "e1": _cfg(tmp, "e1", max_queue_size=2),
        "e2": _cfg(tmp, "e2", max_queue_size=2, buffer_steps=4),
        "e3": _cfg(tmp, "e3", max_queue_size=2, buffer_steps=4),
    }
    specs = [SourceSpec(c.endpoint, c.replay_endpoint, name=n) for n, c in cfgs.items()]
    done = anyio.Event()
    want = {"e0": 0, "e1": 0, "e2": 0, "e3": 0}
    restarted = False

    def on_item(item):
        nonlocal restarted
        live_items.append(item)
        if type(item) is SourceReset and item.source == "e0" and item.reason == "restart":
            restarted = True
        if type(item) is SourceBatch:
            want[item.source] = max(want[item.source], item.seq)
        if restarted and want["e0"] >= 9 and want["e1"] >= 60 and want["e2"] >= 60 and want["e3"] >= 60:
            done.set()

    ts = [1.0]

    def step(pub, name):
        ts[0] += 0.001
        pub.publish(engines[name].step(ts[0]))

    with LogWriter(log_path, metadata={"test": "live"}, flush="interval") as writer:
        async with Subscriber(specs, topic=TOPIC, replay_timeout_s=0.5, backoff_s=0.02) as sub:
            rec = Recorder(sub, writer, on_item=on_item)
            async with anyio.create_task_group() as tg:
                tg.start_soon(rec.run)
                async with Publisher(cfgs["e1"]) as p1, \
                        Publisher(cfgs["e2"], snapshot_provider=engines["e2"].snapshot) as p2, \
                        Publisher(cfgs["e3"]) as p3:
                    async with Publisher(cfgs["e0"]) as p0:
                        with anyio.fail_after(30):  # every SUB socket has joined its publisher
                            for p in (p0, p1, p2, p3):
                                await p.wait_subscribed()
                        for _ in range(30):  # paced: each step is sent before the next
                            for name, p in (("e0", p0), ("e1", p1), ("e2", p2), ("e3", p3)):
                                step(p, name)
                            await _drained(p0, p1, p2, p3)
                        # Bursts with no await between publishes: the tiny queues overflow.
                        for name, p in (("e1", p1), ("e2", p2), ("e3", p3)):
                            for _ in range(30):
                                step(p, name)
                        await _drained(p1, p2, p3)  # what survived the overflow is sent
                        # One more live batch each: the subscriber sees the hole behind it.
                        for name, p in (("e1", p1), ("e2", p2), ("e3", p3)):
                            step(p, name)
                        with anyio.fail_after(30):  # the first e0 has been heard to its end
                            while want["e0"] < 29:
                                await anyio.sleep(0.001)
                    # e0 restarts: a new engine on the same endpoints, seq from 0 again.
                    engines["e0"] = _Engine(99)
                    async with Publisher(cfgs["e0"]) as p0b:
                        with anyio.fail_after(30):  # the SUB has reconnected and re-subscribed
                            await p0b.wait_subscribed()
                        for _ in range(10):
                            step(p0b, "e0")
                            await _drained(p0b)
                        with anyio.move_on_after(10):
                            await done.wait()
                        assert done.is_set(), f"stream incomplete: last seqs {want}, restarted={restarted}"
                rec.stop()
    return live_items, rec.stats


def test_recorded_live_stream_replays_to_the_exact_item_sequence(short_tmp):
    log_path = f"{short_tmp}/live.kvlog"
    live_items, stats = anyio.run(_record_live, short_tmp, log_path)
    # The injections happened:
    kinds = {(type(i).__name__, getattr(i, "source", None), getattr(i, "reason", None)) for i in live_items}
    assert ("SourceReset", "e0", "restart") in kinds
    assert ("SourceReset", "e2", "snapshot") in kinds
    assert any(k[0] == "SourceStale" and k[1] == "e3" for k in kinds)
    assert any(type(i) is SourceBatch and i.replayed and i.source == "e1" for i in live_items)
    records, damage = read_log(log_path)
    assert damage == []
    assert stats.batches == sum(1 for i in live_items if type(i) is SourceBatch)
    replayed = list(log_items(records))
    assert replayed == live_items
    assert list(log_items(read_log(log_path)[0])) == replayed  # deterministic


def test_replay_into_index_matches_the_live_index(short_tmp):
    index_mod = pytest.importorskip("kvstream.routing.index")
    router_mod = pytest.importorskip("kvstream.routing.router")
    from kvstream.eventlog.replay import replay_into_index

    log_path = f"{short_tmp}/live.kvlog"
    live_items, _ = anyio.run(_record_live, short_tmp, log_path)
    live = index_mod.KVIndex()
    for item in live_items:
        router_mod.apply_item(live, item)
    fresh = index_mod.KVIndex()
    replay_into_index(read_log(log_path)[0], fresh)
    assert fresh.state() == live.state()
    again = index_mod.KVIndex()
    replay_into_index(read_log(log_path)[0], again)
    assert again.state() == fresh.state()


async def _sub_frames(pub, n, started):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.linger = 0
    s.connect(pub.endpoint)
    frames = []
    try:
        with anyio.fail_after(30):  # readiness: the publisher has our subscription
            await pub.wait_subscribed()
        started.set()
        with anyio.fail_after(30):
            while len(frames) < n:
                try:
                    frames.append(tuple(s.recv_multipart(zmq.NOBLOCK)))
                except zmq.Again:
                    await anyio.sleep(0.001)
    finally:
        s.close()
    return frames


@pytest.mark.parametrize("version", ["vllm-0.11.0", "vllm-0.33.0"])
def test_golden_capture_replays_onto_a_socket_as_identical_frames(golden_dir, short_tmp, version):
    from kvstream.wire.capture import CaptureChannel, read_capture
    from kvstream.eventlog.convert import convert_captures

    cap = golden_dir / version / "stream.bin"
    live = [r.frames for r in read_capture(cap) if r.channel == CaptureChannel.LIVE]
    out = f"{short_tmp}/g.kvlog"
    convert_captures([cap], out, sources=["engine"])
    records, _ = read_log(out)
    encoding = "array" if version == "vllm-0.11.0" else "map"
    cfg = KVEventsConfig(publisher="zmq", endpoint=f"ipc://{short_tmp}/r.pub",
                         replay_endpoint=f"ipc://{short_tmp}/r.rep", topic=TOPIC, encoding=encoding)

    async def go():
        got = {}
        started = anyio.Event()
        async with Publisher(cfg) as pub, anyio.create_task_group() as tg:
            async def consume():
                got["frames"] = await _sub_frames(pub, len(live), started)

            tg.start_soon(consume)
            await started.wait()
            st = await replay_to_publishers(records, {"engine": pub}, speed=None)
            assert st.sent == len(live)
        return got["frames"]

    frames = anyio.run(go)
    assert frames == [tuple(f) for f in live]


def test_timed_replay_keeps_relative_timing(short_tmp):
    """Records are never sent before their time relative to the first one, at any speed.

    How *late* they are depends on the machine (bench/bench_eventlog.py measures lateness on
    a quiet one); a test on a shared machine can only check the order and the lower bounds."""
    import time

    from kvstream.eventlog.format import LogMessage
    from kvstream.eventlog.replay import Pacer

    # 2,000 records at 10,000/s: 0.2 s of wall time at 1x.
    recs = [LogMessage(i * 100_000, "e", b"t", i, b"") for i in range(2000)]

    def run(speed):
        sent = []

        def send(rec):
            sent.append((time.perf_counter(), rec.seq))

        st = anyio.run(lambda: Pacer(speed).run(recs, send))
        t0 = sent[0][0]
        early = [seq for t, seq in sent if t - t0 < seq * 1e-4 / speed - 1e-4]
        return st, [seq for _, seq in sent], early

    st, order, early = run(1.0)
    assert order == list(range(2000)) and not early
    assert st.elapsed >= 0.19
    fast, order, early = run(10.0)
    assert order == list(range(2000)) and not early
    assert 0.019 <= fast.elapsed < st.elapsed


def test_stale_items_keep_their_seqs_through_the_log(short_tmp):
    path = f"{short_tmp}/s.kvlog"
    from kvstream.eventlog.recorder import write_item
    from kvstream.transport.items import SourceLive

    items = [SourceStale("e", "replay buffer overrun", 5, 9), SourceReset("e", "removed", None),
             SourceLive("e", 12)]
    with LogWriter(path) as w:
        for it in items:
            write_item(w, it)
    assert list(log_items(read_log(path)[0])) == items


@pytest.mark.anyio
async def test_an_engine_logs_its_own_published_stream_through_the_publisher_tap(tmp_path):
    path = tmp_path / "self.kvlog"
    batches = [KVEventBatch(float(i), [BlockStored([i + 1], i or None, list(range(16)), 16, None, "GPU", None)])
               for i in range(5)]
    with LogWriter(path, flush="record", tap_source="engine-0") as writer:
        cfg = KVEventsConfig(endpoint=f"ipc://{tmp_path}/p.sock", topic="kv@e0")
        with anyio.fail_after(30):
            async with Publisher(cfg, tap=writer.tap) as pub:
                seqs = [pub.publish(b) for b in batches]
    records, damage = read_log(path)
    assert damage == []
    assert [(r.source, r.topic, r.seq) for r in records] == [("engine-0", b"kv@e0", s) for s in seqs]
    assert [r.payload for r in records] == [encode_batch(KVEventBatch(b.ts, b.events, 0)) for b in batches]
