"""The deployment shape: a 3-node NATS cluster on loopback holding a 3-replica stream."""

from __future__ import annotations

import anyio
import pytest

from kvstream.jetstream import JetStreamSource, Relay, StreamSettings

from .engines import Engine
from .helpers import batches, collect


async def test_a_replicated_stream_survives_losing_a_node_and_consumers_elsewhere_get_every_batch(
        tmp_path, nats_cluster) -> None:
    urls = nats_cluster.urls
    async with Engine(tmp_path, "e0") as eng, \
            Relay([eng.spec], urls, StreamSettings(replicas=3), ack_timeout_s=1.0) as relay, \
            JetStreamSource(urls[2], heartbeat_s=0.25) as sub, anyio.create_task_group() as tg:
        info = await relay._nc.jetstream().stream_info("KV_EVENTS")
        assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
        tg.start_soon(relay.run)
        eng.steps(100)
        first = await collect(sub, lambda it: len(batches(it)) >= 100, timeout=20)
        nats_cluster.servers[0].stop()  # one node of three: the stream keeps its quorum
        eng.steps(100)
        rest = await collect(sub, lambda it: len(batches(first + it)) >= 200, timeout=30)
        tg.cancel_scope.cancel()
    got = batches(first + rest)
    assert [b.seq for b in got] == list(range(200)) and [b.payload for b in got] == eng.payloads


@pytest.mark.parametrize("who", ["consumer", "relay"])
async def test_a_client_whose_node_dies_goes_on_through_another_node_of_the_cluster(
        tmp_path, nats_cluster, who) -> None:
    # The consumer (or the relay) is given one node's URL; the cluster tells clients about
    # the others. When that node is lost, it must carry on through another node, not stay
    # "recovering" (or keep its batches unpublished) for good.
    urls = nats_cluster.urls
    relay_urls, consumer_url = (urls[:2], urls[2]) if who == "consumer" else ([urls[2]], urls[0])
    async with Engine(tmp_path, "e0") as eng, \
            Relay([eng.spec], relay_urls, StreamSettings(replicas=3), ack_timeout_s=1.0) as relay, \
            JetStreamSource(consumer_url, heartbeat_s=0.25) as sub, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        eng.steps(100)
        first = await collect(sub, lambda it: len(batches(it)) >= 100, timeout=20)
        nats_cluster.servers[2].stop()
        eng.steps(100)
        rest = await collect(sub, lambda it: len(batches(first + it)) >= 200, timeout=30)
        tg.cancel_scope.cancel()
    got = batches(first + rest)
    assert [b.seq for b in got] == list(range(200)) and [b.payload for b in got] == eng.payloads
    assert sub.health()["e0"].state == "live"
