"""A stream that stops taking messages (issue 23 item 2), against a real nats-server: a
pre-created stream with ``discard=new`` at its message limit refuses every further
message. The relay must not retry forever while consumers say ``live`` with a wrong
index: it gives up (bounded, counted), tells the consumers out of band, and once the
stream takes messages again stores a ``stale`` notice so later readers see it too."""

from __future__ import annotations

import time

import anyio
import pytest

from kvstream.jetstream import JetStreamSource, Relay, StreamSettings
from kvstream.transport import SourceStale

from .engines import Engine

LIMIT = 40


async def _full_stream(url: str) -> None:
    import nats
    from nats.js.api import DiscardPolicy, StreamConfig

    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(StreamConfig(
            name="KV_EVENTS", subjects=["kv.>"], discard=DiscardPolicy.NEW, max_msgs=LIMIT,
            duplicate_window=120.0))
    finally:
        await nc.close()


async def _purge(url: str) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        await nc.jetstream().purge_stream("KV_EVENTS")
    finally:
        await nc.close()


async def _wait(pred, timeout: float, what: str) -> None:
    with anyio.fail_after(timeout):
        while not pred():
            await anyio.sleep(0.02)  # polling a state under a deadline


async def test_a_stream_that_refuses_messages_makes_its_consumers_stale_not_live_and_wrong(
        tmp_path, nats_server) -> None:
    await _full_stream(nats_server.url)
    items: list = []
    late_items: list = []
    with anyio.fail_after(90):
        async with Engine(tmp_path, "e0") as eng, \
                Relay([eng.spec], nats_server.url, StreamSettings(), max_refused_s=1.0) as relay, \
                JetStreamSource(nats_server.url + "/KV_EVENTS") as sub, anyio.create_task_group() as tg:
            tg.start_soon(relay.run)

            async def consume(src, out) -> None:
                async for it in src:
                    out.append(it)

            tg.start_soon(consume, sub, items)
            eng.steps(30)  # fits: the consumer follows, live
            await _wait(lambda: "e0" in sub.health() and sub.health()["e0"].last_seq == 29, 20, "first 30")
            assert sub.health()["e0"].state == "live"
            t0 = time.monotonic()
            eng.steps(120)  # 10 more fit, 110 are refused
            await _wait(lambda: sub.health()["e0"].state == "stale", 15, "stale")
            took = time.monotonic() - t0
            # Bounded: no endless retry storm while the stream refuses.
            await _wait(lambda: relay.stats.notices >= 3, 20, "repeated notices")
            refused = relay.stats.refused
            assert relay.blocked.get("e0") is not None and relay.stats.dropped >= 100
            # A consumer that starts now reads the 40 stored batches and must not call
            # them the engine's state: the relay's repeated notice reaches it too.
            async with JetStreamSource(nats_server.url + "/KV_EVENTS", name="late") as late:
                tg2_items = late_items
                async with anyio.create_task_group() as tg2:
                    tg2.start_soon(consume, late, tg2_items)
                    await _wait(lambda: "e0" in late.health() and late.health()["e0"].state == "stale", 15,
                                "late consumer stale")
                    tg2.cancel_scope.cancel()
            # Room again: the relay stores its stale notice, then the engine's new batches.
            await _purge(nats_server.url)
            await _wait(lambda: not relay.blocked, 20, "unblocked")
            last = eng.steps(5)[-1]
            await _wait(lambda: sub.health()["e0"].last_seq == last, 20, "new batches")
            h = sub.health()["e0"]
            tg.cancel_scope.cancel()
    assert took < 20, took
    assert refused < 2_000, refused  # was tens of thousands of retries in ~50 s
    assert h.state == "stale"  # still: the lost batches are lost until a reset rebuilds it
    stale = [i for i in items if isinstance(i, SourceStale)]
    assert stale and stale[0].first_missing_seq <= LIMIT
    # The in-band notice (after the purge) says which batches the stream lacks.
    assert any(s.resume_seq > LIMIT for s in stale), stale
    assert [type(i).__name__ for i in late_items if isinstance(i, SourceStale)][:1] == ["SourceStale"]
