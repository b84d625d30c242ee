"""AsyncKVCacheManager: one batch per engine step to a sink, flush on exit, snapshots that
follow the last batch; and the same through the real ZMQ publisher."""

from __future__ import annotations

import runpy
from collections import Counter
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import zmq
import zmq.asyncio

from kvstream.allocator.shell import AsyncKVCacheManager
from kvstream.wire.events import AllBlocksCleared, BlockStored, KVEventBatch, decode_batch
from kvstream.hashing import BlockHasher
from kvstream.allocator.manager import KVCacheManager
from kvstream.allocator.pool import BlockPool

BS = 4
REPO = Path(__file__).resolve().parents[2]


def make_manager(num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, BS), BlockHasher("sha256_cbor", BS, seed="0"))


def counts(events) -> Counter:
    c: Counter = Counter()
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            c.clear()
        elif isinstance(ev, BlockStored):
            c.update(ev.block_hashes)
        else:
            c.subtract(ev.block_hashes)
    return +c


async def test_end_step_hands_one_batch_per_step_to_the_sink() -> None:
    mgr = make_manager()
    sink: list[KVEventBatch] = []
    async with AsyncKVCacheManager(mgr, sink.append, data_parallel_rank=3, clock=lambda: 42.0) as kv:
        a = mgr.new_request("a", range(8))
        b = mgr.new_request("b", range(100, 112))
        assert mgr.admit(a) and mgr.admit(b)
        batch = await kv.step_done()
        assert batch is sink[0] and len(sink) == 1
        assert (batch.ts, batch.data_parallel_rank, len(batch.events)) == (42.0, 3, 2)
        assert kv.end_step(ts=7.5) is None  # an empty step publishes nothing
        assert mgr.decode(a, 1)
        assert await kv.step_done(ts=8.0) is None
    assert kv.batches_published == 1 and kv.events_published == 2


async def test_leaving_the_block_flushes_pending_events_and_closes() -> None:
    mgr = make_manager()
    sink: list[KVEventBatch] = []
    async with AsyncKVCacheManager(mgr, sink.append) as kv:
        assert mgr.admit(mgr.new_request("a", range(8)))
    assert len(sink) == 1 and len(sink[0].events) == 1
    with pytest.raises(RuntimeError, match="closed"):
        kv.end_step()


async def test_events_are_flushed_even_when_the_loop_fails() -> None:
    mgr = make_manager()
    sink: list[KVEventBatch] = []
    with pytest.raises(KeyError):
        async with AsyncKVCacheManager(mgr, sink.append):
            assert mgr.admit(mgr.new_request("a", range(8)))
            raise KeyError("engine bug")
    assert len(sink) == 1


async def test_snapshot_flushes_pending_events_first_and_matches_the_state() -> None:
    mgr = make_manager()
    sink: list[KVEventBatch] = []
    async with AsyncKVCacheManager(mgr, sink.append) as kv:
        a = mgr.new_request("a", range(12))
        assert mgr.admit(a)
        await kv.step_done()
        mgr.free(a)
        assert mgr.admit(mgr.new_request("b", range(50, 70)))  # pending, not yet published
        snap = kv.snapshot_events()
        assert len(sink) == 2  # the pending step went out before the snapshot was taken
        live = counts(e for batch in sink for e in batch.events)
        assert counts(snap) == live and isinstance(snap[0], AllBlocksCleared)


def test_a_sink_that_is_not_callable_is_rejected() -> None:
    with pytest.raises(TypeError, match="callable"):
        AsyncKVCacheManager(make_manager(), [])  # type: ignore[arg-type]


async def test_batches_reach_a_real_publisher_and_its_snapshot(tmp_path: Path) -> None:
    transport = pytest.importorskip("kvstream.transport.publisher")
    from kvstream.transport.config import KVEventsConfig

    cfg = KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub.sock", replay_endpoint=f"ipc://{tmp_path}/replay.sock",
                         topic="kv")
    mgr = make_manager()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        async with transport.Publisher(cfg) as pub:
            async with AsyncKVCacheManager(mgr, pub.publish) as kv:
                pub.snapshot_provider = kv.snapshot_events
                a = mgr.new_request("a", range(12))
                assert mgr.admit(a)
                first = await kv.step_done()
                mgr.free(a)
                assert mgr.admit(mgr.new_request("b", range(12)))
                second = await kv.step_done()
                assert mgr.admit(mgr.new_request("c", range(40, 52)))  # left pending
                dealer.connect(pub.replay_endpoint)

                async def ask(start: bytes) -> list[tuple[int, bytes]]:
                    await dealer.send_multipart([b"", start])
                    got = []
                    with anyio.fail_after(30):
                        while True:
                            frames = await dealer.recv_multipart()
                            seq, payload = frames[-2], frames[-1]
                            if seq == b"\xff" * 8:
                                return got
                            got.append((int.from_bytes(seq, "big"), payload))

                replayed = await ask((0).to_bytes(8, "big"))
                assert [decode_batch(p) for _, p in replayed] == [first, second]
                snap = await ask(b"SNAPSHOT")
                # The pending step was published as seq 2 before the snapshot (tagged 3).
                assert kv.batches_published == 3 and {s for s, _ in snap} == {3}
                snap_events = [e for _, p in snap for e in decode_batch(p).events]
                assert counts(snap_events) == Counter(
                    {int.from_bytes(h[-8:], "big"): len(ids) for (h, _), ids in mgr.pool.cached_blocks().items()})
    finally:
        dealer.close()
        ctx.term()


def test_the_engine_loop_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    ns = runpy.run_path(str(REPO / "examples" / "engine_loop.py"))
    batches = anyio.run(ns["main"])
    out = capsys.readouterr().out
    assert "prefix-cache hit rate" in out and "preempt" in out and "finish req-5" in out
    assert batches and all(isinstance(b, KVEventBatch) for b in batches)


async def test_a_refusing_sink_loses_no_batch_and_keeps_the_order() -> None:
    mgr = make_manager()
    sink: list[KVEventBatch] = []
    refuse = [True]

    def flaky(batch: KVEventBatch) -> None:
        if refuse[0]:
            raise OverflowError("queue full")
        sink.append(batch)

    async with AsyncKVCacheManager(mgr, flaky) as kv:
        assert mgr.admit(mgr.new_request("a", range(8)))
        with pytest.raises(OverflowError):
            kv.end_step(ts=1.0)
        assert kv.held_batches == 1 and kv.batches_published == 0
        assert mgr.admit(mgr.new_request("b", range(20, 28)))
        with pytest.raises(OverflowError):
            kv.end_step(ts=2.0)
        refuse[0] = False
        assert kv.end_step(ts=3.0) is None  # nothing new, but the backlog goes out
    assert [b.ts for b in sink] == [1.0, 2.0] and kv.held_batches == 0
    assert counts(e for b in sink for e in b.events) == Counter(
        {int.from_bytes(h[-8:], "big"): len(ids) for (h, _), ids in mgr.pool.cached_blocks().items()})


async def test_a_backlog_past_its_bound_collapses_into_one_resync_batch() -> None:
    mgr = make_manager(num_blocks=64)
    sink: list[KVEventBatch] = []
    refuse = [True]

    def flaky(batch: KVEventBatch) -> None:
        if refuse[0]:
            raise OverflowError("queue full")
        sink.append(batch)

    async with AsyncKVCacheManager(mgr, flaky, max_held_events=3) as kv:
        for i in range(6):
            req = mgr.new_request(f"r{i}", range(100 * i, 100 * i + 8))
            assert mgr.admit(req)
            with pytest.raises(OverflowError):
                kv.end_step()
            mgr.free(req)
        assert kv.held_batches == 1 and kv.resyncs >= 1
        refuse[0] = False
        kv.end_step()
    assert isinstance(sink[0].events[0], AllBlocksCleared)
    assert counts(e for b in sink for e in b.events) == Counter(
        {int.from_bytes(h[-8:], "big"): len(ids) for (h, _), ids in mgr.pool.cached_blocks().items()})


async def test_queue_full_raise_on_a_real_publisher_leaves_no_hole(tmp_path: Path) -> None:
    # issue #15 item 7: a step refused with QueueFullError used to be dropped silently
    # (no seq gap). Now it is published later, in order: seqs stay contiguous and a
    # consumer replaying them ends at the pool's exact state.
    from kvstream.transport.config import KVEventsConfig
    from kvstream.transport.publisher import Publisher, QueueFullError

    cfg = KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub.sock", replay_endpoint=f"ipc://{tmp_path}/replay.sock",
                         topic="kv", max_queue_size=1, queue_full="raise")
    mgr = make_manager(num_blocks=64)
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    refused = 0
    try:
        async with Publisher(cfg) as pub, AsyncKVCacheManager(mgr, pub.publish) as kv:
            for i in range(12):
                req = mgr.new_request(f"r{i}", range(50 * i, 50 * i + 12))
                assert mgr.admit(req)
                mgr.free(req)
                try:
                    kv.end_step()  # no await between steps: the send queue fills up
                except QueueFullError:
                    refused += 1
                if i % 4 == 3:
                    with anyio.fail_after(30):
                        while pub.queued:
                            await anyio.lowlevel.checkpoint()
            with anyio.fail_after(30):
                while kv.held_batches or pub.queued:
                    await anyio.lowlevel.checkpoint()
                    try:
                        kv.end_step()
                    except QueueFullError:
                        pass
            assert refused > 0
            dealer.connect(pub.replay_endpoint)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            got = []
            with anyio.fail_after(30):
                while True:
                    frames = await dealer.recv_multipart()
                    if frames[-2] == b"\xff" * 8:
                        break
                    got.append((int.from_bytes(frames[-2], "big"), decode_batch(frames[-1])))
    finally:
        dealer.close()
        ctx.term()
    assert [s for s, _ in got] == list(range(len(got))) and len(got) == kv.batches_published == 12
    assert counts(e for _, b in got for e in b.events) == Counter(
        {int.from_bytes(h[-8:], "big"): len(ids) for (h, _), ids in mgr.pool.cached_blocks().items()})
