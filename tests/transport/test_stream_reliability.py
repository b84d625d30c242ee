"""Reliability of the stream on real sockets (ipc in the test's tmp dir, bounded in time):
loss behind a small HWM, publisher restarts, late joiners, ranges no longer buffered,
and garbage on the wire."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
import zmq

from kvstream.wire.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from kvstream.wire.framing import END_SEQ_BYTES, encode_seq
from kvstream.transport import (
    KVEventsConfig,
    Publisher,
    SourceBatch,
    SourceLive,
    SourceReset,
    SourceSpec,
    SourceStale,
    Subscriber,
)

from tests.transport.zmq_helpers import (
    ScriptedPublisher,
    StateModel,
    apply_items,
    batches_of,
    collect,
    ipc,
    recv,
)

pytestmark = pytest.mark.anyio



def _step(i: int, width: int = 1) -> KVEventBatch:
    """Step i stores hashes i*width.. and removes those stored 5 steps earlier."""
    evs: list = []
    if i >= 5:
        evs += [BlockRemoved([(i - 5) * width + k], "GPU") for k in range(width)]
    evs.append(BlockStored([i * width + k for k in range(width)], None, list(range(16 * width)), 16, None, "GPU", None))
    return KVEventBatch(float(i), evs)


def _reference(batches) -> StateModel:
    m = StateModel()
    for b in batches:
        m.apply(b)
    return m


async def _sent_to_nobody(pub: Publisher) -> None:
    """Wait (a state, not a time) until the publisher's send queue is empty: everything
    published so far went out live, to nobody."""
    with anyio.fail_after(30):
        while pub.queued:
            await anyio.lowlevel.checkpoint()


def _settled_at(sub: Subscriber, seq: int, source: str = "s"):
    """Items until the source is settled (live, or stale: a stale source says nothing
    more) with every batch up to ``seq`` taken."""
    return lambda items: (sub.state(source) in ("live", "stale") and not sub.ready
                          and sub.health()[source].last_seq == seq)


def _caught_up(seq: int, source: str = "s"):
    return lambda items: any(isinstance(i, SourceBatch) and i.source == source and i.seq == seq for i in items[-8:])


async def test_slow_subscriber_behind_small_hwm_loses_detects_recovers_and_ends_exact(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), hwm=20)
    n = 3000
    published = [_step(i, width=8) for i in range(n)]
    with anyio.fail_after(60):
        async with Publisher(cfg) as pub:
            spec = SourceSpec(pub.endpoint, pub.replay_endpoint, name="s")
            async with Subscriber([spec], rcvhwm=20, max_buffered_items=64) as sub:
                await collect(sub, lambda it: isinstance(it[-1], SourceLive))
                items: list = []

                async def produce() -> None:
                    for i in range(0, n, 100):
                        for b in published[i:i + 100]:
                            pub.publish(b)
                        await anyio.sleep(0.002)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(produce)
                    async for it in sub:  # a slow consumer
                        items.append(it)
                        if len(items) % 40 == 0:
                            await anyio.sleep(0.002)
                        if isinstance(it, SourceBatch) and it.seq == n - 1:
                            break
                health = sub.health()["s"]
    got = batches_of(items)
    assert [b.seq for b in got] == list(range(n))  # every batch, once, in order
    c = health.counters
    assert c["gaps"] > 0 and c["replays"] >= c["gaps"] and c["stale_marks"] == 0
    assert any(b.replayed for b in got) and any(not b.replayed for b in got)
    model, stale = apply_items(items)
    assert not stale and model.state() == _reference(published).state()


async def test_publisher_restart_mid_stream_resets_and_rebuilds_from_the_new_engine(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"))
    first = [_step(i) for i in range(100)]
    second = [_step(1000 + i) for i in range(50)]
    with anyio.fail_after(60):
        async with Subscriber([SourceSpec(cfg.endpoint, cfg.replay_endpoint, name="s")],
                              replay_timeout_s=0.5, backoff_s=0.05) as sub:
            async with Publisher(cfg) as pub:
                await sub.wait_connected()
                for b in first:
                    pub.publish(b)
                items = await collect(sub, _caught_up(99))
            async with Publisher(cfg) as pub2:  # the engine restarts on the same endpoints
                for b in second:  # the first ones are lost: the SUB has not reconnected yet
                    pub2.publish(b)
                items += await collect(sub, _caught_up(49))
            health = sub.health()["s"]
    resets = [i for i in items if isinstance(i, SourceReset)]
    assert len(resets) == 1 and resets[0].reason == "restart"
    after = batches_of(items[items.index(resets[0]):])
    assert [b.seq for b in after] == list(range(50))
    assert [b.batch.events[-1].block_hashes for b in after] == [b.events[-1].block_hashes for b in second]
    assert health.counters["restarts"] == 1
    model, stale = apply_items(items)
    assert not stale and model.state() == _reference(second).state()


async def test_subscriber_started_after_5000_batches_gets_them_all_then_live(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"))
    with anyio.fail_after(60):
        async with Publisher(cfg) as pub:
            published = [_step(i) for i in range(5100)]
            for b in published[:5000]:
                pub.publish(b)
            await _sent_to_nobody(pub)
            async with Subscriber([SourceSpec(pub.endpoint, pub.replay_endpoint, name="s")]) as sub:
                items = await collect(sub, lambda it: isinstance(it[-1], SourceLive))
                for b in published[5000:]:
                    pub.publish(b)
                items += await collect(sub, _caught_up(5099))
    got = batches_of(items)
    assert [b.seq for b in got] == list(range(5100))
    assert all(b.replayed for b in got[:5000])
    assert _reference(published).state() == apply_items(items)[0].state()


@pytest.mark.parametrize("with_snapshot", [True, False])
async def test_a_gap_older_than_the_replay_buffer_uses_a_snapshot_or_marks_stale(tmp_path, with_snapshot):
    model = StateModel()
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), buffer_steps=100)
    provider = model.snapshot_events if with_snapshot else None
    published = [_step(i) for i in range(1050)]
    with anyio.fail_after(30):
        async with Publisher(cfg, snapshot_provider=provider) as pub:
            for b in published[:1000]:
                pub.publish(b)
                model.apply(b)
            await _sent_to_nobody(pub)
            async with Subscriber([SourceSpec(pub.endpoint, pub.replay_endpoint, name="s")]) as sub:
                items = await collect(sub, _settled_at(sub, 999))
                for b in published[1000:]:
                    pub.publish(b)
                    model.apply(b)
                items += await collect(sub, _caught_up(1049))
                health = sub.health()["s"]
    final, stale = apply_items(items)
    if with_snapshot:
        (reset,) = [i for i in items if isinstance(i, SourceReset)]
        assert reset.reason == "snapshot" and reset.seq == 1000
        assert not stale and health.state == "live" and health.counters["snapshots"] == 1
        assert final.state() == model.state()  # rebuilt exactly
        assert [b.seq for b in batches_of(items) if not b.replayed] == list(range(1000, 1050))
    else:
        (st,) = [i for i in items if isinstance(i, SourceStale)]
        assert (st.first_missing_seq, st.resume_seq) == (0, 900)
        assert "snapshot" in st.reason and stale and health.state == "stale"
        assert [b.seq for b in batches_of(items)] == list(range(900, 1050))


async def test_garbage_on_the_wire_is_counted_and_no_good_data_is_lost(tmp_path, caplog):
    """A scripted peer mixes garbage into a good stream: wrong frame counts, short seq
    frames, an undecodable payload that is good in the replay buffer, a stray
    undecodable message, and a malformed replay reply."""
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
    pub.linger = router.linger = 0
    pub.bind(ipc(tmp_path, "p"))
    router.bind(ipc(tmp_path, "r"))
    good = {i: encode_batch(_step(i)) for i in range(6)}

    def live(i: int, payload: bytes | None = None) -> list[bytes]:
        return [b"kv", encode_seq(i), good[i] if payload is None else payload]

    async def serve() -> None:
        while True:
            while router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                ident, _, start = router.recv_multipart(zmq.NOBLOCK)
                s = int.from_bytes(start, "big")
                router.send_multipart([ident, b"", b"junk"])  # malformed reply: 3 frames but bad seq
                for i in sorted(k for k in good if s <= k < sent_upto[0]):
                    router.send_multipart([ident, b"", b"kv", encode_seq(i), good[i]])
                router.send_multipart([ident, b"", b"", END_SEQ_BYTES, b""])
            await anyio.wait_readable(router.FD)

    sent_upto = [0]
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                async with Subscriber([SourceSpec(ipc(tmp_path, "p"), ipc(tmp_path, "r"), name="s")]) as sub:
                    await recv(pub)  # the subscription
                    await collect(sub, lambda it: isinstance(it[-1], SourceLive))
                    sent_upto[0] = 6
                    for frames in (live(0), [b"kv", encode_seq(1)], live(1), [b"kv", b"\x00\x01", good[2]],
                                   live(2), live(3, b"\xc1\xc1garbage"), [b"kv", encode_seq(2**40), b"\x92"],
                                   [b"kv"], live(4), live(5)):
                        pub.send_multipart(frames)
                    items = await collect(sub, _caught_up(5))
                    health = sub.health()["s"]
                tg.cancel_scope.cancel()
    finally:
        pub.close(0)
        router.close(0)
    assert [(b.seq, b.payload) for b in batches_of(items)] == sorted(good.items())
    c = health.counters
    assert c["frame_errors"] >= 4  # 2-frame, short seq, 1-frame, malformed reply(s)
    assert c["decode_errors"] == 2 and c["gaps"] == 1 and c["stale_marks"] == 0
    assert health.state == "live"
    assert "undecodable live batch seq 3" in caplog.text


async def test_replay_request_flood_is_bounded_and_followers_lose_nothing(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), max_replay_jobs=4)
    ctx = zmq.Context.instance()
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            async with Subscriber([SourceSpec(pub.endpoint, pub.replay_endpoint, name="s")]) as sub:
                await collect(sub, lambda it: isinstance(it[-1], SourceLive))
                flood = ctx.socket(zmq.DEALER)
                flood.linger = 0
                flood.connect(pub.replay_endpoint)
                for i in range(500):
                    pub.publish(_step(i))
                    flood.send_multipart([b"", encode_seq(0)] if i % 2 else [b"", b"bad"])
                    if i % 50 == 0:
                        await anyio.sleep(0)
                items = await collect(sub, _caught_up(499))
                flood.close(0)
    assert [b.seq for b in batches_of(items)] == list(range(500))
    st = pub.stats
    assert st.malformed_requests == 250 and st.replay_rejected > 0


# -- issue #15: the promise "exact, or visibly not" -------------------------------------


def _until_seq(seq: int, source: str = "s"):
    return lambda items: any(isinstance(i, SourceBatch) and i.source == source and i.seq == seq for i in items)


async def test_replies_lost_by_a_0_11_router_are_asked_again_not_taken_as_gone(tmp_path):
    """Item 1: a hole in the middle of a replay, then a cut tail (no end marker): the
    batches are still in the publisher's buffer, so they are asked for again."""
    peer = ScriptedPublisher(ipc(tmp_path, "p"), ipc(tmp_path, "r"))
    attempts = []

    def damage(start: int, n: int) -> set[int]:
        if start == 0:
            return set()  # the join
        attempts.append(start)
        if len(attempts) == 1:
            return set(range(50, 80))  # a hole mid-replay (the end marker arrives)
        if len(attempts) == 2:
            return set(range(100, n))  # a cut tail: no end marker
        return set()

    peer.damage = damage
    payloads = [encode_batch(_step(i)) for i in range(300)]
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(peer.serve)
                spec = SourceSpec(peer.pub_ep, peer.replay_ep, name="s", topic="kv")
                async with Subscriber([spec], replay_timeout_s=0.3, backoff_s=0.01, probe_after_s=None) as sub:
                    await peer.wait_subscriber()
                    await sub.wait_connected()
                    for i in range(300):  # only 0..9 and 299 reach the live socket
                        peer.publish(payloads[i], send=i < 10 or i == 299)
                    items = await collect(sub, _until_seq(299))
                    await sub.wait_state("s", "live")
                    health = sub.health()["s"]
                tg.cancel_scope.cancel()
    finally:
        peer.close()
    got = batches_of(items)
    assert [b.seq for b in got] == list(range(300)) and all(b.topic == b"kv" for b in got)
    c = health.counters
    assert c["stale_marks"] == 0 and c["snapshots"] == 0 and c["retries"] >= 2 and c["timeouts"] >= 1
    assert len(attempts) >= 3 and health.state == "live"


async def test_a_lost_tail_is_found_by_an_idle_probe(tmp_path):
    """Item 2: the last batches of a burst are lost and the engine goes idle: a probe of
    the replay socket finds them (vLLM sends no heartbeat)."""
    peer = ScriptedPublisher(ipc(tmp_path, "p"), ipc(tmp_path, "r"))
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(peer.serve)
                spec = SourceSpec(peer.pub_ep, peer.replay_ep, name="s")
                async with Subscriber([spec], probe_after_s=0.2) as sub:
                    await peer.wait_subscriber()
                    await sub.wait_connected()
                    for i in range(10):
                        peer.publish(encode_batch(_step(i)), send=i < 7)  # 7, 8, 9 lost
                    items = await collect(sub, _until_seq(9))
                    health = sub.health()["s"]
                tg.cancel_scope.cancel()
    finally:
        peer.close()
    assert [b.seq for b in batches_of(items)] == list(range(10))
    assert health.counters["probes"] >= 1 and health.counters["gaps"] == 0
    model, stale = apply_items(items)
    assert not stale and model.state() == _reference([_step(i) for i in range(10)]).state()


async def test_a_restart_after_a_snapshot_join_is_detected_and_rebuilt(tmp_path):
    """Item 3: a subscriber that joined by snapshot (no live message seen) must not take
    the next engine's seqs 0..N for duplicates."""
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), buffer_steps=20)
    first = [_step(i) for i in range(100)]
    second = [_step(1000 + i) for i in range(60)]
    model = StateModel()
    with anyio.fail_after(30):
        # The first engine publishes its 100 batches before the subscriber exists (sent
        # live to nobody): the subscriber can only join by snapshot, whatever the timing.
        sent, stop, stopped = anyio.Event(), anyio.Event(), anyio.Event()

        async def first_engine() -> None:
            try:
                async with Publisher(cfg, snapshot_provider=model.snapshot_events) as pub:
                    for b in first:
                        pub.publish(b)
                        model.apply(b)
                    await _sent_to_nobody(pub)
                    sent.set()
                    await stop.wait()
            finally:
                stopped.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(first_engine)
            await sent.wait()
            async with Subscriber([SourceSpec(cfg.endpoint, cfg.replay_endpoint, name="s")],
                                  replay_timeout_s=0.5, backoff_s=0.02) as sub:
                try:
                    # A snapshot join (the buffer holds only the last 20 batches).
                    items = await collect(sub, lambda it: any(isinstance(i, SourceReset) for i in it))
                    await sub.wait_state("s", "live")
                finally:
                    stop.set()
                await stopped.wait()
                model2 = StateModel()
                # The engine restarts on the same endpoints (and its buffer rotates too).
                async with Publisher(cfg, snapshot_provider=model2.snapshot_events) as pub2:
                    for b in second:
                        pub2.publish(b)
                        model2.apply(b)
                    items += await collect(sub, _until_seq(59), timeout=20)
                    await sub.wait_state("s", "live")
                    items += sub.get_nowait()
                    health = sub.health()["s"]
    resets = [i.reason for i in items if isinstance(i, SourceReset)]
    assert resets[0] == "snapshot" and "restart" in resets[1:]
    final, stale = apply_items(items)
    assert not stale and final.state() == _reference(second).state()
    assert health.counters["restarts"] >= 1 and health.state == "live"


async def test_a_snapshot_that_never_ends_trips_its_byte_bound_and_marks_stale(tmp_path):
    """Item 7: a hostile replay server streams snapshot batches forever; memory stays
    bounded by max_snapshot_bytes and the source says so."""
    peer = ScriptedPublisher(ipc(tmp_path, "p"), ipc(tmp_path, "r"), buffer_steps=5)
    peer.snapshot_forever = encode_batch(_step(7, width=64))
    for i in range(20):
        peer.publish(encode_batch(_step(i)), send=False)  # 0..14 rotated out: a snapshot join
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(peer.serve)
                spec = SourceSpec(peer.pub_ep, peer.replay_ep, name="s")
                async with Subscriber([spec], max_snapshot_bytes=1 << 20, probe_after_s=None) as sub:
                    items = await collect(sub, _until_seq(19))
                    health = sub.health()["s"]
                tg.cancel_scope.cancel()
    finally:
        peer.close()
    (st,) = [i for i in items if isinstance(i, SourceStale)]
    assert "max_snapshot_bytes" in st.reason and health.counters["overflows"] == 1
    assert health.state == "stale"
    assert [b.seq for b in batches_of(items)] == list(range(15, 20))


async def test_a_stalled_consumer_of_big_batches_holds_a_bounded_number_of_bytes(tmp_path):
    """Item 7: items waiting for a consumer that does not read are bounded in bytes, not
    just in count; nothing is lost once it reads again."""
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"))
    big = [_step(i, width=256) for i in range(120)]  # ~50 KB each
    limit = 512 << 10
    with anyio.fail_after(60):
        async with Publisher(cfg) as pub:
            async with Subscriber([SourceSpec(pub.endpoint, pub.replay_endpoint, name="s")],
                                  max_buffered_bytes=limit) as sub:
                await sub.wait_connected()
                items = sub.get_nowait()
                for b in big:
                    pub.publish(b)
                with anyio.fail_after(30):  # the subscriber reads until the bound, then stops
                    while sub.ready_bytes < limit:
                        await anyio.sleep(0.01)
                size = len(encode_batch(big[0]))
                assert sub.ready_bytes <= limit + 256 * (size + 64)
                assert sub.ready_bytes < 120 * size // 2
                items += await collect(sub, _until_seq(119))
    assert [b.seq for b in batches_of(items)] == list(range(120))


async def test_natively_read_batches_are_counted_by_the_bytes_they_hold_so_a_burst_that_fits_is_not_shed(tmp_path):
    """The service's decoder (``PayloadDecoder``) reads payloads into native columns: a
    queued batch is counted by its payload and the bytes its columns really allocate, not
    by the Python-object estimate (12 bytes per payload byte), so a burst whose real bytes
    fit ``max_buffered_bytes`` is held whole (nothing shed, no replay), while the same
    burst decoded into Python objects passes the bound and is shed, then replayed."""
    from kvstream.routing.payloads import PayloadBatch, PayloadDecoder
    from kvstream.wire.events import EventDecoder

    big = [_step(i, width=64) for i in range(40)]
    size = len(encode_batch(big[10]))
    limit = 16 * size * 13  # 16 batches by the estimate; about 80 by their real bytes
    results = {}
    for name, dec in (("native", PayloadDecoder(EventDecoder())), ("decoded", None)):
        cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p" + name), replay_endpoint=ipc(tmp_path, "r" + name))
        with anyio.fail_after(60):
            async with Publisher(cfg) as pub:
                spec = SourceSpec(pub.endpoint, pub.replay_endpoint, name="s")
                async with Subscriber([spec], max_buffered_bytes=limit, decoder=dec) as sub:
                    await sub.wait_connected()
                    sub.get_nowait()
                    for b in big:
                        pub.publish(b)
                    with anyio.fail_after(30):  # a state: every batch taken, or the bound reached
                        while sub.ready < len(big) and sub.ready_bytes < limit:
                            await anyio.sleep(0.01)
                    ready, ready_bytes = sub.ready, sub.ready_bytes
                    items = sub.get_nowait()
                    if name == "native":
                        got = [i for i in items if isinstance(i, SourceBatch)]
                        assert all(type(i.batch) is PayloadBatch for i in got)
                        # Counted exactly: payload, measured columns and 64 per item.
                        assert ready_bytes == sum(len(i.payload) + i.batch.held_bytes + 64 for i in got)
                        assert all(i.batch.held_bytes >= i.batch.raw.blocks * 8 for i in got)
                    have = sum(isinstance(i, SourceBatch) for i in items)
                    if have < len(big):  # the shed ones, replayed once the consumer reads
                        await collect(sub, lambda its: have + sum(isinstance(i, SourceBatch) for i in its)
                                      >= len(big))
                    results[name] = (ready, sub.health()["s"].counters["shed"])
    assert results["native"] == (len(big), 0), results
    assert results["decoded"][0] < len(big) and results["decoded"][1] > 0, results


def test_a_natively_read_batch_holding_a_copy_of_its_payload_counts_both() -> None:
    """A decoder given a bytearray reads a bytes copy of it: the queued item then holds
    the frame and the copy, and both count (the same object counts once)."""
    from kvstream.routing.payloads import PayloadDecoder
    from kvstream.transport.subscriber import _held_bytes
    from kvstream.wire.events import EventDecoder

    payload = encode_batch(_step(9, width=64))
    dec = PayloadDecoder(EventDecoder())
    same = dec.decode(payload)
    assert _held_bytes(payload, same, 12) == len(payload) + same.held_bytes
    frame = bytearray(payload)
    copied = dec.decode(frame)
    assert copied.payload is not frame
    assert _held_bytes(frame, copied, 12) == 2 * len(payload) + copied.held_bytes
    decoded = EventDecoder().decode(payload)  # Python objects: the decoder's estimate
    assert _held_bytes(payload, decoded, 12) == 13 * len(payload)
