"""Warm start: a replica loads the latest whole-index snapshot and reads only the tail."""

from __future__ import annotations

import anyio

from kvstream.jetstream import JetStreamSource, Relay
from kvstream.jetstream.snapshots import SnapshotWriter, load_snapshots
from kvstream.routing.index import KVIndex
from kvstream.routing.router import Router

from .engines import Engine


async def test_a_replica_started_after_a_long_stream_is_warm_from_snapshot_plus_tail(tmp_path, nats_server) -> None:
    url = nats_server.url + "/KV_EVENTS"
    async with Engine(tmp_path, "e0", seed=5) as e0, Engine(tmp_path, "e1", seed=6) as e1, \
            Relay([e0.spec, e1.spec], nats_server.url) as relay, \
            Router(subscriber=JetStreamSource(url)) as first, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        async with SnapshotWriter(first.index, first.subscriber, interval_s=3600) as writer:
            for _ in range(10):
                e0.steps(100)
                e1.steps(50)
                await anyio.sleep(0)
            await first.wait_applied("e0", 999)
            await first.wait_applied("e1", 499)
            assert await writer.write_now() == 1  # one whole-index object
            assert await writer.write_now() == 0  # nothing moved since
        e0.steps(120)  # the tail after the snapshot
        e1.steps(30)
        await first.wait_applied("e0", 1119)
        await first.wait_applied("e1", 529)
        index = KVIndex()
        states = await load_snapshots(url, index)
        assert {n: s.expected for n, s in states.items()} == {"e0": 1000, "e1": 500}
        # e0's last batch before the snapshot came before e1's last 50: both positions are
        # the consumer's last stream sequence all the same (a replica reads on from there)
        assert len({s.sseq for s in states.values()}) == 1
        only_e0 = KVIndex()
        assert set(await load_snapshots(url + "?source=e0", only_e0)) == {"e0"}
        assert only_e0.sources == ["e0"]  # the snapshot's other sources are not kept
        sub = JetStreamSource(url, state=states)
        async with Router(index=index, subscriber=sub) as replica:
            await replica.wait_applied("e0", 1119)
            await replica.wait_applied("e1", 529)
            assert replica.index.state() == first.index.state()
            assert sub.counters("e0").batches == 120 and sub.counters("e1").batches == 30
            assert not sub.counters("e0").stale_marks
            assert sub.consumer_health().fast_deliveries >= 150  # plain batches: one regex call each
            assert sub.consumer_health().fast_deliveries < 150 + 50  # and not e1's last 50 before the snapshot again
        tg.cancel_scope.cancel()


async def test_no_snapshots_yet_means_an_empty_start(nats_server) -> None:
    assert await load_snapshots(nats_server.url, KVIndex()) == {}
