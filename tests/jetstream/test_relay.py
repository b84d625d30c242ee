"""The relay and the consumer against a real nats-server and real engines (kvstream's
allocator behind its ZMQ Publisher): payloads unchanged, each batch once, faults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import anyio
import pytest

from kvstream.jetstream import JetStreamSource, Relay, StreamSettings, wire
from kvstream.routing.index import KVIndex
from kvstream.routing.router import Router
from kvstream.transport import SourceBatch, SourceStale

from .engines import Engine
from .helpers import batches, collect, stream_messages


async def _relay_until(relay: Relay, source: str, n: int, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while relay.sources[source].pos < n - 1 or relay.stats.inflight:
            await anyio.sleep(0.005)  # polling a state with a deadline


async def test_relay_publishes_every_batch_byte_identical_with_headers_and_a_late_consumer_gets_all(
        tmp_path, nats_server) -> None:
    async with Engine(tmp_path, "e0") as eng:
        eng.steps(30)  # before the relay starts: fetched by its join-time replay
        async with Relay([eng.spec], nats_server.url) as relay, anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            eng.steps(30)
            await _relay_until(relay, "e0", 60)
            tg.cancel_scope.cancel()
    msgs = [m for m in await stream_messages(nats_server.url) if wire.H_KIND not in m.headers]
    assert [m.data for m in msgs] == eng.payloads
    h = msgs[7].headers
    assert (h[wire.H_MSG_ID], h[wire.H_SEQ], h[wire.H_INSTANCE], h[wire.H_TOPIC]) == ("e0:0:7", "7", "0", "kv@e0")
    assert all(m.subject == "kv.e0" for m in msgs)
    # a consumer started after the engine is gone gets everything retained, in order
    async with JetStreamSource(nats_server.url + "/KV_EVENTS") as sub:
        items = await collect(sub, lambda it: len(batches(it)) == 60)
        assert [b.payload for b in batches(items)] == eng.payloads
        assert [b.seq for b in batches(items)] == list(range(60))
        assert sub.health()["e0"].state == "live" and sub.health()["e0"].counters["batches"] == 60


async def test_two_relays_for_one_engine_store_each_batch_once(tmp_path, nats_server) -> None:
    async with Engine(tmp_path, "e0") as eng:
        async with Relay([eng.spec], nats_server.url) as r1, Relay([eng.spec], nats_server.url) as r2:
            async with anyio.create_task_group() as tg:
                tg.start_soon(r1.run)
                tg.start_soon(r2.run)
                for _ in range(10):
                    eng.steps(20)
                    await anyio.sleep(0)
                await _relay_until(r1, "e0", 200)
                await _relay_until(r2, "e0", 200)
                tg.cancel_scope.cancel()
        assert r1.stats.duplicates + r2.stats.duplicates >= 200  # one of them lost every race
    msgs = [m for m in await stream_messages(nats_server.url) if wire.H_KIND not in m.headers]
    assert [m.data for m in msgs] == eng.payloads


def _spawn_relay(eng: Engine, url: str) -> subprocess.Popen:
    spec = eng.spec
    p = subprocess.Popen([sys.executable, "-m", "kvstream", "relay",
                          f"{spec.source}={spec.endpoint},{spec.replay_endpoint}", "--nats", url,
                          "--status-interval", "0"], stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    line = p.stderr.readline()  # the readiness line
    assert line.startswith("relay ready"), line
    return p


async def test_a_relay_killed_mid_stream_and_restarted_loses_and_repeats_nothing(tmp_path, nats_server) -> None:
    async with Engine(tmp_path, "e0") as eng, JetStreamSource(nats_server.url) as sub:
        proc = _spawn_relay(eng, nats_server.url)
        try:
            eng.steps(100)
            first = await collect(sub, lambda it: len(batches(it)) >= 50)
            proc.send_signal(signal.SIGKILL)  # mid-stream: some batches were still unpublished
            proc.wait()
            eng.steps(100)  # published while no relay runs
            proc = _spawn_relay(eng, nats_server.url)
            eng.steps(50)
            rest = await collect(sub, lambda it: len(batches(first + it)) == 250)
        finally:
            proc.kill()
            proc.wait()
        got = batches(first + rest)
        assert [b.seq for b in got] == list(range(250))
        assert [b.payload for b in got] == eng.payloads
        assert not [i for i in first + rest if type(i) is SourceStale]
        assert sub.counters("e0").duplicates == 0


async def test_consumers_resume_where_they_were_after_the_nats_server_restarts(tmp_path, nats_server) -> None:
    async with Engine(tmp_path, "e0") as eng:
        async with Relay([eng.spec], nats_server.url, ack_timeout_s=1.0) as relay, \
                JetStreamSource(nats_server.url, heartbeat_s=0.2) as sub, anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            eng.steps(100)
            first = await collect(sub, lambda it: len(batches(it)) >= 100)
            nats_server.stop()
            eng.steps(100)  # the relay keeps them until the server is back
            nats_server.start()  # same port, same file store
            eng.steps(100)
            rest = await collect(sub, lambda it: len(batches(first + it)) >= 300, timeout=20)
            tg.cancel_scope.cancel()
        got = batches(first + rest)
        assert [b.seq for b in got] == list(range(300))
        assert [b.payload for b in got] == eng.payloads
        assert not [i for i in first + rest if type(i) is SourceStale]
        assert sub.consumer_health().resets >= 1


async def test_an_engine_restart_reaches_consumers_as_a_reset_then_the_new_engine(tmp_path, nats_server) -> None:
    async with Relay([Engine(tmp_path, "e0").spec], nats_server.url) as relay, \
            JetStreamSource(nats_server.url) as sub, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        async with Engine(tmp_path, "e0", seed=1) as old:
            # Far ahead of where the new engine is when the relay reconnects: seqs going
            # back is how a restart shows over ZMQ.
            old.steps(1000)
            await collect(sub, lambda it: len(batches(it)) == 1000)
        async with Engine(tmp_path, "e0", seed=2) as new:

            async def run_engine() -> None:  # a live engine keeps stepping
                for _ in range(900):  # stays below the old engine's seqs for ~9 s
                    new.step()
                    await anyio.sleep(0.01)

            tg.start_soon(run_engine)
            items = await collect(sub, lambda it: len(batches(it)) >= 25, timeout=20)
            tg.cancel_scope.cancel()
    kinds = [type(i).__name__ for i in items]
    assert "SourceReset" in kinds, kinds
    reset = items[kinds.index("SourceReset")]
    assert reset.reason == "restart" and not batches(items[:kinds.index("SourceReset")])
    after = batches(items)
    assert [b.seq for b in after] == list(range(len(after)))
    assert [b.payload for b in after] == new.payloads[:len(after)]


async def test_a_router_reading_jetstream_routes_like_one_reading_the_engines(tmp_path, nats_server) -> None:
    async with Engine(tmp_path, "e0", seed=3) as e0, Engine(tmp_path, "e1", seed=4) as e1:
        async with Relay([e0.spec, e1.spec], nats_server.url) as relay, \
                Router([e0.spec, e1.spec]) as direct, \
                Router(subscriber=JetStreamSource(nats_server.url)) as via_js, anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            e0.steps(80)
            e1.steps(80)
            for r in (direct, via_js):
                await r.wait_applied("e0", 79)
                await r.wait_applied("e1", 79)
            tg.cancel_scope.cancel()
            assert via_js.index.state() == direct.index.state()
            prompt = e0.prefixes[2] + [1, 2, 3]
            assert via_js.route(prompt).matches == direct.route(prompt).matches
