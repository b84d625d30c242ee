"""Faults around the stream, against a real nats-server, real engines and real relays:
the stream purged, deleted or trimmed under running relays and consumers, the consumer
deleted from outside, a batch over the server's max_payload, snapshots that do not belong
to the stream. The rule in every case: nothing lost or applied twice without the consumer
saying so (a source is ``live`` only while its index is right; otherwise a reset rebuilds
it or it is ``stale``)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import anyio.abc
import pytest

from kvstream.jetstream import JetStreamSource, Relay, StreamSettings
from kvstream.jetstream.snapshots import SnapshotWriter, load_snapshots
from kvstream.routing.index import KVIndex
from kvstream.routing.router import Router
from kvstream.transport import SourceReset, SourceStale
from kvstream.wire.events import BlockStored, KVEventBatch, encode_batch

from .engines import Engine
from .helpers import batches, collect


async def _until(cond: Any, timeout: float = 15.0) -> None:
    """Poll ``cond()`` (a state) until true; fails after ``timeout`` seconds."""
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.005)


async def _js(url: str) -> Any:
    import nats

    return await nats.connect(url)


async def test_a_batch_over_the_servers_max_payload_becomes_a_visible_gap_and_the_relay_goes_on(
        tmp_path, nats_server) -> None:
    async with Engine(tmp_path, "e0") as eng, Relay([eng.spec], nats_server.url) as relay, \
            JetStreamSource(nats_server.url) as sub, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        eng.steps(5)
        # One real batch of ~1.7 MB (20,000 stored blocks): over nats-server's default
        # max_payload of 1 MiB, far under the relay's own payload limit (64 MiB).
        big = encode_batch(KVEventBatch(eng.ts + 1.0, [BlockStored(
            [10_000_000 + i for i in range(20_000)], None, list(range(20_000 * 16)), 16, None, None, None)]))
        assert len(big) > 1 << 20
        eng.payloads.append(big)
        assert eng.pub is not None
        eng.pub.publish_raw(big, 5)
        eng.steps(5)
        items = await collect(sub, lambda it: len(batches(it)) == 10)
        await _until(lambda: relay.sources["e0"].pos == 10 and not relay.stats.inflight)
        tg.cancel_scope.cancel()
    got = batches(items)
    assert [b.seq for b in got] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert [b.payload for b in got] == eng.payloads[:5] + eng.payloads[6:]
    stale = [i for i in items if type(i) is SourceStale]
    assert [(s.first_missing_seq, s.resume_seq) for s in stale] == [(5, 6)]
    assert "max_payload" in stale[0].reason
    assert relay.stats.too_large == 1
    assert sub.health()["e0"].state == "stale"  # the index lacks batch 5: not live


async def test_a_consumer_deleted_from_outside_is_made_again_without_loss_or_repeats(tmp_path, nats_server) -> None:
    async with Engine(tmp_path, "e0") as eng, Relay([eng.spec], nats_server.url) as relay, \
            JetStreamSource(nats_server.url, heartbeat_s=0.2) as sub, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        eng.steps(50)
        first = await collect(sub, lambda it: len(batches(it)) == 50)
        nc = await _js(nats_server.url)
        try:
            # On a loaded machine a missed heartbeat (0.2 s) can have the source making its
            # consumer again right now: wait for one to exist, and delete whichever it is.
            from nats.js.errors import NotFoundError

            for _ in range(50):
                await _until(lambda: sub._consumer is not None, 60)
                try:
                    await nc.jetstream().delete_consumer("KV_EVENTS", sub._consumer)
                    break
                except NotFoundError:
                    continue  # replaced between the read and the delete: delete the new one
            else:
                raise AssertionError("the source's consumer was replaced 50 times in a row")
        finally:
            await nc.close()
        eng.steps(50)
        rest = await collect(sub, lambda it: len(batches(first + it)) == 100)
        tg.cancel_scope.cancel()
    got = batches(first + rest)
    assert [b.seq for b in got] == list(range(100)) and [b.payload for b in got] == eng.payloads
    assert sub.consumer_health().resets >= 1 and sub.counters("e0").duplicates == 0
    assert sub.health()["e0"].state == "live"


async def _restarted_engine_on_the_stream(tmp_path: Any, url: str) -> Engine:
    """Engine instance 1 of source e0 on the stream (an engine that restarted while no
    relay ran), returned open; its first incarnation published 40 batches."""
    async with Engine(tmp_path, "e0", seed=1) as old:
        old.steps(40)
        async with Relay([old.spec], url) as relay, anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            await _until(lambda: relay.sources["e0"].pos == 39 and not relay.stats.inflight)
            tg.cancel_scope.cancel()
    new = Engine(tmp_path, "e0", seed=2)
    await new.__aenter__()
    return new


async def test_a_relay_restarted_after_the_stream_forgot_its_source_is_not_taken_for_an_old_copy(
        tmp_path, nats_server) -> None:
    # The stream is purged (or retention dropped every message of the source) and the
    # relay restarts: it finds no position for its source. Consumers hold a higher engine
    # instance than a relay counting from 0 would use, and must not drop what it sends.
    url = nats_server.url
    new = await _restarted_engine_on_the_stream(tmp_path, url)
    try:
        async with Router(subscriber=JetStreamSource(url)) as via_js:
            new.steps(10)
            async with Relay([new.spec], url) as relay, anyio.create_task_group() as tg:
                tg.start_soon(relay.run)
                await _until(lambda: via_js.subscriber.states().get("e0", None) is not None
                             and via_js.subscriber.states()["e0"].instance == 1)
                await via_js.wait_applied("e0", 9)
                tg.cancel_scope.cancel()
            nc = await _js(url)
            try:
                await nc.jetstream().purge_stream("KV_EVENTS")
            finally:
                await nc.close()
            new.steps(10)
            async with Relay([new.spec], url) as relay, anyio.create_task_group() as tg:
                tg.start_soon(relay.run)
                new.steps(10)
                await via_js.wait_applied("e0", 29)
                tg.cancel_scope.cancel()
            async with Router([new.spec]) as direct:  # the engine itself, over ZMQ
                await direct.wait_applied("e0", 29)
                assert via_js.index.state() == direct.index.state()
            assert via_js.subscriber.health()["e0"].state == "live"
    finally:
        await new.__aexit__(None, None, None)


@pytest.mark.parametrize("writer", ["this one", "without the creation header"])
async def test_a_snapshot_of_a_deleted_and_recreated_stream_is_not_used(tmp_path, nats_server, writer) -> None:
    # "without the creation header": as a writer before the header existed left it; its
    # stream sequence (beyond the new stream's end) gives it away.
    from nats.js.api import ObjectMeta

    from kvstream.jetstream.snapshots import H_SSEQ, OBJECT_NAME, bucket_name

    url = nats_server.url + "/KV_EVENTS"
    async with Engine(tmp_path, "e0", seed=5) as e0, Engine(tmp_path, "e1", seed=6) as e1:
        async with Relay([e0.spec], nats_server.url) as relay, Router(subscriber=JetStreamSource(url)) as first, \
                anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            e0.steps(200)
            await first.wait_applied("e0", 199)
            async with SnapshotWriter(first.index, first.subscriber, interval_s=3600) as writer:
                assert await writer.write_now() == 1  # at stream seq ~200
            tg.cancel_scope.cancel()
        nc = await _js(nats_server.url)
        try:
            js = nc.jetstream()
            await js.delete_stream("KV_EVENTS")  # the bucket stays
            if writer != "this one":
                store = await js.object_store(bucket_name("KV_EVENTS"))
                info = await store.get_info(OBJECT_NAME)
                data = (await store.get(OBJECT_NAME)).data
                await store.put(OBJECT_NAME, data, meta=ObjectMeta(
                    name=OBJECT_NAME, headers={H_SSEQ: info.headers[H_SSEQ]}))
        finally:
            await nc.close()
        async with Relay([e1.spec], nats_server.url) as relay, anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            e1.steps(30)  # stream seqs 1..30 of the new stream
            await _until(lambda: relay.sources["e1"].pos == 29 and not relay.stats.inflight)
            tg.cancel_scope.cancel()
        index = KVIndex()
        states = await load_snapshots(url, index)
        assert states == {} and index.sources == []  # its positions mean nothing on this stream
        async with Router(index=index, subscriber=JetStreamSource(url, state=states)) as replica, \
                Router([e1.spec]) as direct:
            await replica.wait_applied("e1", 29)
            await direct.wait_applied("e1", 29)
            assert replica.index.state() == direct.index.state()


async def test_the_stream_deleted_under_a_running_relay_and_consumer_is_made_again_and_nothing_is_lost(
        tmp_path, nats_server) -> None:
    async with Engine(tmp_path, "e0") as eng, Relay([eng.spec], nats_server.url, ack_timeout_s=0.5) as relay, \
            JetStreamSource(nats_server.url, heartbeat_s=0.2) as sub, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        eng.steps(50)
        first = await collect(sub, lambda it: len(batches(it)) == 50)
        nc = await _js(nats_server.url)
        try:
            await nc.jetstream().delete_stream("KV_EVENTS")
        finally:
            await nc.close()
        eng.steps(50)
        rest = await collect(sub, lambda it: len(batches(first + it)) >= 100, timeout=20)
        tg.cancel_scope.cancel()
    got = batches(first + rest)
    assert [b.seq for b in got] == list(range(100)) and [b.payload for b in got] == eng.payloads
    assert not [i for i in first + rest if type(i) in (SourceStale, SourceReset)]
    assert sub.health()["e0"].state == "live"
    assert relay.stats.streams_created == 1 and sub.consumer_health().new_streams == 1


@pytest.mark.parametrize("limit", ["max_bytes", "max_age"])
async def test_retention_dropping_what_a_late_consumer_needed_is_a_gap_not_silence(
        tmp_path, nats_server, limit) -> None:
    settings = StreamSettings(max_bytes=20_000) if limit == "max_bytes" else StreamSettings(max_age_s=0.5, duplicate_window_s=0.25)
    async with Engine(tmp_path, "e0") as eng, Relay([eng.spec], nats_server.url, settings) as relay, \
            anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        eng.steps(100)
        await _until(lambda: relay.sources["e0"].pos == 99 and not relay.stats.inflight)
        nc = await _js(nats_server.url)
        try:
            js = nc.jetstream()
            if limit == "max_age":  # wait for the server to age the first ones out
                with anyio.fail_after(30):
                    while (await js.stream_info("KV_EVENTS")).state.first_seq == 1:
                        await anyio.sleep(0.05)
                eng.steps(5)
                await _until(lambda: relay.sources["e0"].pos == 104 and not relay.stats.inflight)
            first = (await js.stream_info("KV_EVENTS")).state.first_seq
        finally:
            await nc.close()
        assert first > 1
        last = relay.sources["e0"].pos
        async with JetStreamSource(nats_server.url) as sub:
            items = await collect(sub, lambda it: batches(it) and batches(it)[-1].seq == last)
            stale = [i for i in items if type(i) is SourceStale]
            assert stale and stale[0].first_missing_seq == 0 and items[0] is stale[0]
            assert sub.health()["e0"].state == "stale"
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("new_clock,new_steps", [(-3600.0, 60), (-3600.0, 25), (+3600.0, 0)])
async def test_an_engine_restarted_while_no_relay_ran_is_told_apart_whatever_its_clock_says(
        tmp_path, nats_server, new_clock, new_steps) -> None:
    # The relay decides whether the stream already holds what the engine replays. Engine
    # timestamps are another host's wall clock: a restarted engine whose clock is an hour
    # behind must still be seen as new (not skipped as "already on the stream" and then
    # continued as the old engine), and the old engine's own replay is recognised whatever
    # the relay's clock.
    url = nats_server.url
    async with Engine(tmp_path, "e0", seed=1) as old:
        old.steps(40)
        async with Relay([old.spec], url) as relay, anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            await _until(lambda: relay.sources["e0"].pos == 39 and not relay.stats.inflight)
            tg.cancel_scope.cancel()
        if new_clock > 0:  # the same engine, on: its replay must be skipped, not taken for a restart
            old.steps(10)
            async with Relay([old.spec], url) as relay, Router(subscriber=JetStreamSource(url)) as via_js, \
                    Router([old.spec]) as direct, anyio.create_task_group() as tg:
                tg.start_soon(relay.run)
                await via_js.wait_applied("e0", 49)
                await direct.wait_applied("e0", 49)
                assert relay.stats.skipped == 40 and relay.sources["e0"].instance == 0
                assert via_js.index.state() == direct.index.state()
                tg.cancel_scope.cancel()
            return
    async with Engine(tmp_path, "e0", seed=2, clock_offset_s=new_clock) as new:
        # seqs from 0 again, stamped an hour earlier than the old engine's; past the old
        # engine's last seq (39), or not yet
        new.steps(new_steps)
        last = new_steps - 1
        async with Relay([new.spec], url) as relay, Router(subscriber=JetStreamSource(url)) as via_js, \
                Router([new.spec]) as direct, anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            await _until(lambda: relay.sources["e0"].pos == last and not relay.stats.inflight)
            await direct.wait_applied("e0", last)
            # The consumer reads the old instance's 40 batches first: with fewer new steps
            # its seq ``last`` is also one of the old instance's, so wait for the state the
            # new instance's batches make (a stress run saw the old engine's blocks when it
            # waited for seq ``last`` alone). Were the new engine continued as the old one,
            # or skipped as already on the stream, this state would never come.
            await _until(lambda: via_js.index.state() == direct.index.state())
            tg.cancel_scope.cancel()
            assert relay.sources["e0"].instance == 1
            assert via_js.subscriber.counters("e0").restarts == 1
            assert via_js.subscriber.health()["e0"].state == "live"


class _Link:
    """A TCP forwarder to a port that can be cut and healed (a network partition between
    one client and the NATS server): cutting closes every forwarded connection and
    refuses new ones until healed."""

    def __init__(self, port: int = 0, path: str | None = None) -> None:
        self.port = port
        self.path = path
        """A unix socket path to forward to instead (a ZMQ ``ipc://`` endpoint)."""
        self.cut = False
        self._scopes: set[anyio.CancelScope] = set()

    async def serve(self, listener: Any) -> None:
        async with listener:
            await listener.serve(self._forward)

    async def _forward(self, client: Any) -> None:
        async with client:
            if self.cut:
                return
            try:
                server = await (anyio.connect_unix(self.path) if self.path is not None
                                else anyio.connect_tcp("127.0.0.1", self.port))
            except OSError:
                return
            async with server, anyio.create_task_group() as tg:
                self._scopes.add(tg.cancel_scope)

                async def pipe(a: Any, b: Any) -> None:
                    try:
                        async for data in a:
                            await b.send(data)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(pipe, client, server)
                tg.start_soon(pipe, server, client)
            self._scopes.discard(tg.cancel_scope)

    @property
    def connections(self) -> int:
        """Connections forwarded now."""
        return len(self._scopes)

    def partition(self) -> None:
        self.cut = True
        for s in list(self._scopes):
            s.cancel()


async def _wait_duplicate_window_passed(url: str) -> None:
    """Publish one probe message id until JetStream stores it a second time: the stream's
    duplicate window has then passed for everything published before the first probe."""
    nc = await _js(url)
    try:
        js = nc.jetstream()
        await js.publish("kv.probe", b"", headers={"Nats-Msg-Id": "probe"})
        with anyio.fail_after(60):
            while (await js.publish("kv.probe", b"", headers={"Nats-Msg-Id": "probe"})).duplicate:
                await anyio.sleep(0.05)
    finally:
        await nc.close()


async def test_a_relay_partitioned_longer_than_the_duplicate_window_changes_nothing_when_it_is_back(
        tmp_path, nats_server) -> None:
    settings = StreamSettings(duplicate_window_s=0.5)
    url = nats_server.url
    async with Engine(tmp_path, "e0") as eng, anyio.create_task_group() as outer:
        link = _Link(nats_server.port)
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        outer.start_soon(link.serve, listener)
        via = f"nats://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        async with Relay([eng.spec], via, settings, ack_timeout_s=0.5) as cut_off, \
                Relay([eng.spec], url, settings) as healthy, \
                Router(subscriber=JetStreamSource(url + "/KV_EVENTS?source=e0")) as via_js, \
                anyio.create_task_group() as tg:
            tg.start_soon(cut_off.run)
            tg.start_soon(healthy.run)
            eng.steps(20)
            await via_js.wait_applied("e0", 19)
            await _until(lambda: not cut_off.stats.inflight)
            link.partition()
            eng.steps(50)  # the cut-off relay holds these unacked; the other one publishes them
            await via_js.wait_applied("e0", 69)
            await _until(lambda: cut_off.sources["e0"].pos == 69)
            await _wait_duplicate_window_passed(url)
            link.cut = False  # healed: it sends all 50 again, and the stream takes them
            await _until(lambda: not cut_off.stats.inflight)
            eng.steps(10)
            await via_js.wait_applied("e0", 79)
            async with Router([eng.spec]) as direct:
                await direct.wait_applied("e0", 79)
                assert via_js.index.state() == direct.index.state()
            sub = via_js.subscriber
            assert sub.counters("e0").duplicates >= 1  # the copies are on the stream...
            assert sub.counters("e0").batches == 80  # ...and none was applied twice
            assert sub.health()["e0"].state == "live"
            tg.cancel_scope.cancel()
        outer.cancel_scope.cancel()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
async def test_a_damaged_snapshot_object_is_refused_and_leaves_the_index_as_it_was(
        tmp_path, nats_server, damage) -> None:
    from nats.js.api import ObjectMeta

    from kvstream.jetstream.snapshots import OBJECT_NAME, bucket_name
    from kvstream.routing.snapshot import SnapshotError

    url = nats_server.url + "/KV_EVENTS"
    async with Engine(tmp_path, "e0", seed=8) as e0, Relay([e0.spec], nats_server.url) as relay, \
            Router(subscriber=JetStreamSource(url)) as first, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        e0.steps(50)
        await first.wait_applied("e0", 49)
        tg.cancel_scope.cancel()
        data = first.index.dump(cursors={n: s.as_dict() for n, s in first.subscriber.states().items()})
    # Written whole (its digest matches), but its bytes are no snapshot: a writer that
    # died mid-dump, or someone else's object under the name.
    bad = data[: len(data) // 2] if damage == "truncated" else b"\x93not a kvstream index"
    nc = await _js(nats_server.url)
    try:
        js = nc.jetstream()
        store = await js.create_object_store(bucket_name("KV_EVENTS"))
        await store.put(OBJECT_NAME, bad, meta=ObjectMeta(name=OBJECT_NAME, headers={"Kv-Sseq": "1"}))
    finally:
        await nc.close()
    index = KVIndex()
    index.apply_batch("mine", KVEventBatch(1.0, [BlockStored([7], None, list(range(16)), 16, None, None, None)]))
    before = index.state()
    with pytest.raises(SnapshotError):
        await load_snapshots(url, index)
    assert index.state() == before


async def test_a_replica_started_while_the_relay_is_down_reads_what_is_retained_then_follows(
        tmp_path, nats_server) -> None:
    url = nats_server.url
    async with Engine(tmp_path, "e0") as eng:
        async with Relay([eng.spec], url) as relay, anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            eng.steps(40)
            await _until(lambda: relay.sources["e0"].pos == 39 and not relay.stats.inflight)
            tg.cancel_scope.cancel()
        eng.steps(20)  # while no relay runs
        async with Router(subscriber=JetStreamSource(url)) as replica:
            await replica.wait_applied("e0", 39)
            assert replica.subscriber.health()["e0"].state == "live"
            async with Relay([eng.spec], url) as relay, Router([eng.spec]) as direct, \
                    anyio.create_task_group() as tg:
                tg.start_soon(relay.run)
                eng.steps(10)
                await replica.wait_applied("e0", 69)
                await direct.wait_applied("e0", 69)
                assert replica.index.state() == direct.index.state()
                tg.cancel_scope.cancel()
            assert replica.subscriber.counters("e0").stale_marks == 0
            assert replica.subscriber.counters("e0").duplicates == 0


async def test_the_stream_purged_under_a_running_relay_and_consumer_goes_on_without_a_false_gap(
        tmp_path, nats_server) -> None:
    url = nats_server.url
    async with Engine(tmp_path, "e0") as eng, Relay([eng.spec], url) as relay, \
            Router(subscriber=JetStreamSource(url, heartbeat_s=0.2)) as via_js, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        eng.steps(30)
        await via_js.wait_applied("e0", 29)
        nc = await _js(url)
        try:
            await nc.jetstream().purge_stream("KV_EVENTS")
        finally:
            await nc.close()
        eng.steps(30)
        await via_js.wait_applied("e0", 59)
        async with Router([eng.spec]) as direct:
            await direct.wait_applied("e0", 59)
            assert via_js.index.state() == direct.index.state()
        assert via_js.subscriber.health()["e0"].state == "live"
        tg.cancel_scope.cancel()


async def test_consumers_and_relays_resume_after_the_nats_server_is_killed(tmp_path, nats_server) -> None:
    async with Engine(tmp_path, "e0") as eng, Relay([eng.spec], nats_server.url, ack_timeout_s=0.5) as relay, \
            Router(subscriber=JetStreamSource(nats_server.url, heartbeat_s=0.2)) as via_js, \
            anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        eng.steps(100)
        await via_js.wait_applied("e0", 99)
        nats_server.stop(kill=True)  # SIGKILL: no orderly shutdown of the file store
        eng.steps(100)
        nats_server.start()
        eng.steps(100)
        await via_js.wait_applied("e0", 299, timeout_s=30)
        async with Router([eng.spec]) as direct:
            await direct.wait_applied("e0", 299)
            assert via_js.index.state() == direct.index.state()
        assert via_js.subscriber.counters("e0").stale_marks == 0
        tg.cancel_scope.cancel()


async def test_a_server_with_a_small_max_payload_gets_gaps_for_large_batches_and_snapshots_in_small_chunks(
        tmp_path) -> None:
    from kvstream.jetstream.server import NatsServer

    with NatsServer(tmp_path / "small", config="max_payload: 16384\n") as srv:
        url = srv.url + "/KV_EVENTS"
        async with Engine(tmp_path, "e0", seed=9, blocks=8192) as eng, Relay([eng.spec], srv.url) as relay, \
                Router(subscriber=JetStreamSource(url)) as first, anyio.create_task_group() as tg:
            assert relay.sources["e0"].max_message_bytes == 16384
            tg.start_soon(relay.run)
            eng.steps(3)
            big = encode_batch(KVEventBatch(eng.ts + 1.0, [BlockStored(
                [20_000_000 + i for i in range(600)], None, list(range(600 * 16)), 16, None, None, None)]))
            assert 16384 < len(big) < 1 << 20
            eng.payloads.append(big)
            assert eng.pub is not None
            eng.pub.publish_raw(big, 3)
            eng.steps(400)  # an index big enough for a snapshot of several 16 KiB chunks
            await first.wait_applied("e0", 403)
            assert relay.stats.too_large == 1 and first.subscriber.health()["e0"].state == "stale"
            async with SnapshotWriter(first.index, first.subscriber, interval_s=3600) as writer:
                assert await writer.write_now() == 1
                assert writer.bytes_written > 16384  # more than one chunk
            tg.cancel_scope.cancel()
        index = KVIndex()
        states = await load_snapshots(url, index)
        assert states["e0"].expected == 404 and index.state() == first.index.state()


async def test_the_snapshot_bucket_deleted_under_a_running_writer_is_made_again(tmp_path, nats_server) -> None:
    from kvstream.jetstream.snapshots import bucket_name

    url = nats_server.url + "/KV_EVENTS"
    async with Engine(tmp_path, "e0", seed=10) as e0, Relay([e0.spec], nats_server.url) as relay, \
            Router(subscriber=JetStreamSource(url)) as first, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        async with SnapshotWriter(first.index, first.subscriber, interval_s=3600) as writer:
            e0.steps(20)
            await first.wait_applied("e0", 19)
            assert await writer.write_now() == 1
            nc = await _js(nats_server.url)
            try:
                await nc.jetstream().delete_object_store(bucket_name("KV_EVENTS"))
            finally:
                await nc.close()
            e0.steps(20)
            await first.wait_applied("e0", 39)
            assert await writer.write_now() == 1
        tg.cancel_scope.cancel()
        index = KVIndex()
        states = await load_snapshots(url, index)
        assert states["e0"].expected == 40 and index.state() == first.index.state()


async def test_retention_dropping_what_a_cut_off_consumer_had_not_read_yet_is_a_gap_not_silence(
        tmp_path, nats_server) -> None:
    # A consumer that falls behind (here: cut off from the server) while the stream's
    # byte limit drops the oldest messages it still needed, then catches up.
    url = nats_server.url
    async with Engine(tmp_path, "e0") as eng, anyio.create_task_group() as outer:
        link = _Link(nats_server.port)
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        outer.start_soon(link.serve, listener)
        via = f"nats://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        async with Relay([eng.spec], url, StreamSettings(max_bytes=30_000)) as relay, \
                Router(subscriber=JetStreamSource(via, heartbeat_s=0.2)) as behind, anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            eng.steps(20)
            await behind.wait_applied("e0", 19)
            link.partition()
            eng.steps(200)  # far more than 30 kB: the stream keeps only the newest
            await _until(lambda: relay.sources["e0"].pos == 219 and not relay.stats.inflight)
            await _until(lambda: behind.subscriber.health()["e0"].state == "recovering")  # it noticed
            link.cut = False
            await behind.wait_applied("e0", 219, timeout_s=20)
            sub = behind.subscriber
            assert sub.counters("e0").gaps == 1 and sub.health()["e0"].state == "stale"
            assert behind.index.source_info("e0").stale
            tg.cancel_scope.cancel()
        outer.cancel_scope.cancel()



async def _cut_able(tmp_path: Any, eng: Engine, tag: str, tg: Any) -> tuple[list[_Link], Any]:
    """A relay's ZMQ links to ``eng`` (live and replay) through forwarders that can be cut
    (that relay partitioned from the engine, not from NATS): the links and the spec to use."""
    links, eps = [], []
    for ep, what in ((eng.cfg.endpoint, "pub"), (eng.cfg.replay_endpoint, "replay")):
        links.append(_Link(path=ep.removeprefix("ipc://")))
        path = tmp_path / f"{tag}-{what}.sock"
        tg.start_soon(links[-1].serve, await anyio.create_unix_listener(path))
        eps.append(f"ipc://{path}")
    from kvstream.transport import SourceSpec
    return links, SourceSpec(eps[0], eps[1], name=eng.name)


def _set_cut(links: list[_Link], cut: bool) -> None:
    for link in links:
        if cut:
            link.partition()
        else:
            link.cut = False


async def _heal_replay_then_live(links: list[_Link], relay: Relay) -> None:
    """Heal a relay's replay link, wait until its subscriber has marked the gap it finds
    (a stale mark forgets the bytes it could check the engine with), then heal the live
    link and wait until it is connected again: the engine's next batch shows the
    subscriber a reconnect it cannot verify."""
    links[1].cut = False
    await _until(lambda: relay.subscriber.counters("e0").stale_marks >= 1, 20)
    links[0].cut = False
    await _until(lambda: links[0].connections > 0, 20)


# Relays and direct subscribers that give up quickly on what the engine no longer has.
_FAST = {"replay_timeout_s": 0.3, "max_retries": 1, "backoff_s": 0.05, "probe_after_s": 0.2}


async def _stale_notices(url: str) -> list[Any]:
    from .helpers import stream_messages

    return [m for m in await stream_messages(url) if (m.headers or {}).get("Kv-Kind") == "stale"]


async def test_one_of_two_relays_cut_from_the_engine_does_not_make_consumers_stale(tmp_path, nats_server) -> None:
    # Relay A loses its ZMQ links to the engine (live and replay) for longer than the
    # engine's replay buffer; relay B keeps publishing every batch. A's own recovery
    # notice (the gap it saw) goes onto the stream and must not make the consumer stale:
    # the stream has every batch.
    url = nats_server.url
    async with Engine(tmp_path, "e0", buffer_steps=10) as eng, anyio.create_task_group() as outer:
        links, a_spec = await _cut_able(tmp_path, eng, "a", outer)
        async with Relay([a_spec], url, **_FAST) as a, Relay([eng.spec], url, **_FAST) as b, \
                Router(subscriber=JetStreamSource(url + "/KV_EVENTS?source=e0")) as via_js, \
                Router([eng.spec]) as direct, anyio.create_task_group() as tg:
            tg.start_soon(a.run)
            tg.start_soon(b.run)
            await _until(lambda: all(s.subscriber.health()["e0"].state == "live" for s in (a, b, direct)))
            eng.steps(20)
            await via_js.wait_applied("e0", 19)
            await _until(lambda: a.sources["e0"].pos == 19)
            _set_cut(links, True)
            eng.steps(40)  # beyond the engine's buffer of 10: A can never get 20..49
            await via_js.wait_applied("e0", 59)
            await _heal_replay_then_live(links, a)
            eng.steps(20)
            await _until(lambda: a.sources["e0"].pos == 79 and b.sources["e0"].pos == 79)
            await _until(lambda: not a.stats.inflight and not b.stats.inflight)
            await via_js.wait_applied("e0", 79)
            await direct.wait_applied("e0", 79)
            assert direct.subscriber.health()["e0"].state == "live"
            assert via_js.index.state() == direct.index.state()
            sub = via_js.subscriber
            assert sub.counters("e0").batches == 80 and sub.counters("e0").stale_marks == 0
            assert sub.health()["e0"].state == "live"
            # A's notices are on the stream (the gap it saw while cut off, after B's batches)...
            notices = [(m.headers["Kv-Instance"], json.loads(m.data)) for m in await _stale_notices(url)]
            assert notices and all(i == "0" and n["first_missing_seq"] == 20 for i, n in notices)
            assert max(n["resume_seq"] for _, n in notices) >= 50
            assert sub.counters("e0").duplicates >= 1  # ...and read as covered
            tg.cancel_scope.cancel()
        outer.cancel_scope.cancel()


async def test_both_relays_cut_from_the_engine_beyond_its_buffer_is_a_stale_gap(tmp_path, nats_server) -> None:
    # A genuine loss: every relay misses batches the engine no longer buffers.
    url = nats_server.url
    async with Engine(tmp_path, "e0", buffer_steps=10) as eng, anyio.create_task_group() as outer:
        a_links, a_spec = await _cut_able(tmp_path, eng, "a", outer)
        b_links, b_spec = await _cut_able(tmp_path, eng, "b", outer)
        async with Relay([a_spec], url, **_FAST) as a, Relay([b_spec], url, **_FAST) as b, \
                JetStreamSource(url + "/KV_EVENTS?source=e0") as sub, anyio.create_task_group() as tg:
            tg.start_soon(a.run)
            tg.start_soon(b.run)
            await _until(lambda: all(r.subscriber.health()["e0"].state == "live" for r in (a, b)))
            eng.steps(20)
            first = await collect(sub, lambda it: len(batches(it)) == 20)
            _set_cut(a_links + b_links, True)
            eng.steps(40)
            await _heal_replay_then_live(a_links, a)
            await _heal_replay_then_live(b_links, b)
            eng.steps(20)
            rest = await collect(sub, lambda it: any(b.seq == 79 for b in batches(it)))
            tg.cancel_scope.cancel()
        outer.cancel_scope.cancel()
    # One gap, from 20 to where the relays could read on (the oldest seq the engine's
    # buffer of 10 held when they asked again, 50..70); no restart.
    # (The two relays may have asked at different times: then two notices, the second
    # one only if it landed before the first one's batches.)
    stale = [i for i in first + rest if type(i) is SourceStale]
    assert not [i for i in first + rest if type(i) is SourceReset]
    got = batches(first + rest)
    r = got[20].seq
    assert 50 <= r <= 70 and stale and stale[0].first_missing_seq == 20 and stale[-1].resume_seq == r
    assert [b.seq for b in got] == list(range(20)) + list(range(r, 80))
    assert [b.payload for b in got] == eng.payloads[:20] + eng.payloads[r:]
    assert sub.health()["e0"].state == "stale"


async def test_a_relay_cut_from_the_engine_while_the_other_is_cut_from_nats_leaves_consumers_stale_not_live(
        tmp_path, nats_server) -> None:
    # Two faults at once: A is cut from the engine (past its buffer) while B, which has
    # every batch, is cut from NATS. A's gap notice and its next batches reach the stream
    # first; B's copies of the gap come later, after batches that depend on them. The
    # stream then holds every batch, but not in engine order: the consumer cannot apply
    # them late, and must stay ``stale`` (never ``live`` with a wrong index).
    url = nats_server.url
    async with Engine(tmp_path, "e0", buffer_steps=10) as eng, anyio.create_task_group() as outer:
        a_links, a_spec = await _cut_able(tmp_path, eng, "a", outer)
        nats_link = _Link(nats_server.port)
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        outer.start_soon(nats_link.serve, listener)
        b_url = f"nats://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        async with Relay([a_spec], url, **_FAST) as a, Relay([eng.spec], b_url, ack_timeout_s=0.5, **_FAST) as b, \
                Router(subscriber=JetStreamSource(url + "/KV_EVENTS?source=e0")) as via_js, \
                Router([eng.spec]) as direct, anyio.create_task_group() as tg:
            tg.start_soon(a.run)
            tg.start_soon(b.run)
            await _until(lambda: all(s.subscriber.health()["e0"].state == "live" for s in (a, b, direct)))
            eng.steps(20)
            await via_js.wait_applied("e0", 19)
            await _until(lambda: a.sources["e0"].pos == 19 and not a.stats.inflight and not b.stats.inflight)
            _set_cut(a_links, True)
            nats_link.partition()
            eng.steps(40)
            await _until(lambda: b.sources["e0"].pos == 59)  # B has them all, unacked
            await _heal_replay_then_live(a_links, a)
            eng.steps(20)
            await via_js.wait_applied("e0", 79)  # A's batches, after A's gap notice
            nats_link.cut = False  # B sends 20..79 again: 20..59 are stored now
            await _until(lambda: not b.stats.inflight and not a.stats.inflight, 20)
            await direct.wait_applied("e0", 79)
            sub = via_js.subscriber
            # The stream holds, in order: 0..19; A's gap notice (20..r-1 are gone; r is the
            # oldest seq the engine's buffer of 10 still held when A asked again, 50..70) and
            # A's batches from r on; then B's late copies of what A never had (JetStream drops
            # B's copies of the rest by message id). Under load A can also lose batches
            # after its live link is back and say so in a second notice: the expectation is
            # what the stream holds, read by an independent reader, not a fixed r.
            from .helpers import stream_messages

            msgs = await stream_messages(url)
            notices = [json.loads(m.data) for m in msgs if (m.headers or {}).get("Kv-Kind") == "stale"]
            seqs = [int(m.headers["Kv-Seq"]) for m in msgs if "Kv-Kind" not in (m.headers or {})]
            end = seqs.index(79)
            applied, late = seqs[:end + 1], seqs[end + 1:]
            assert any(n["first_missing_seq"] == 20 and 50 <= n["resume_seq"] <= 70 for n in notices), notices
            assert sorted(applied) == sorted(set(applied)) and set(range(20)) <= set(applied)
            assert late and sorted(late) == sorted(set(range(20, 80)) - set(applied)), (notices, seqs)
            try:
                await _until(lambda: sub.counters("e0").duplicates >= len(late))
            except TimeoutError:
                pytest.fail(f"notices={notices} seqs={seqs} consumer={sub.counters('e0')}")
            assert sub.health()["e0"].state == "stale" and via_js.index.state()["sources"]["e0"]["stale"]
            assert via_js.index.state() != direct.index.state()
            assert sub.counters("e0").batches == len(applied)  # each batch of the stream before B's late copies, once
            tg.cancel_scope.cancel()
        outer.cancel_scope.cancel()
