"""A publisher whose PUB *connects* (vLLM's rule for an endpoint without ``*``), on real
loopback sockets: it says so, it warns once when it reaches nobody, and a router that
hears it only through replay probes never says ``live`` while it is wrong (issue 24
item 1, issue 29 defect 7)."""

from __future__ import annotations

import logging
import socket
import time

import anyio
import pytest

from kvstream.routing.router import Router
from kvstream.transport import KVEventsConfig, Publisher, SourceLive, SourceSpec, SourceStale, Subscriber
from kvstream.transport import publisher as publisher_module
from kvstream.wire.events import BlockStored, KVEventBatch

pytestmark = pytest.mark.anyio


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockStored([1000 + i], None, list(range(16)), 16, None, "GPU", None)])


async def test_a_publisher_says_whether_it_binds_or_connects():
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    async with Publisher(cfg) as pub:
        assert pub.binds is True
    cfg = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{_free_port()}", replay_endpoint="tcp://127.0.0.1:*")
    async with Publisher(cfg) as pub:
        assert pub.binds is False


async def test_a_connecting_publisher_that_reaches_nobody_is_warned_about_once(monkeypatch, caplog):
    monkeypatch.setattr(publisher_module, "_NO_PEER_WARN_S", 0.3)
    caplog.set_level(logging.WARNING, logger="kvstream.transport.publisher")
    ep = f"tcp://127.0.0.1:{_free_port()}"
    with anyio.fail_after(60):
        async with Publisher(KVEventsConfig(endpoint=ep, replay_endpoint="tcp://127.0.0.1:*")) as pub:
            pub.publish(_batch(0))
            while not any("reached no subscriber" in r.getMessage() for r in caplog.records):
                await anyio.sleep(0.05)
            # Once only, however long it stays unheard.
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                await anyio.sleep(0.05)
    warned = [r.getMessage() for r in caplog.records if "reached no subscriber" in r.getMessage()]
    assert len(warned) == 1 and ep in warned[0] and "tcp://*:PORT" in warned[0]


async def test_a_connecting_publisher_heard_by_a_binding_subscriber_warns_nothing(monkeypatch, caplog):
    monkeypatch.setattr(publisher_module, "_NO_PEER_WARN_S", 0.5)
    caplog.set_level(logging.WARNING, logger="kvstream.transport.publisher")
    ep = f"tcp://127.0.0.1:{_free_port()}"
    with anyio.fail_after(60):
        async with Subscriber([SourceSpec(ep, name="e", bind=True)]) as sub:
            async with Publisher(KVEventsConfig(endpoint=ep)) as pub:
                await pub.wait_subscribed()
                pub.publish(_batch(0))
                await sub.wait_state("e", "live")
                deadline = time.monotonic() + 1.0  # past the warning's delay
                while time.monotonic() < deadline:
                    await anyio.sleep(0.05)
    assert not [r for r in caplog.records if "reached no subscriber" in r.getMessage()]


class _Engine:
    """A connecting publisher in a task of its own: publishes batch 0, then (``stop``) 5
    more that nobody hears live, then closes (the engine is gone)."""

    def __init__(self, cfg: KVEventsConfig) -> None:
        self.cfg = cfg
        self.replay: str | None = None
        self.started, self.stop, self.stopped = anyio.Event(), anyio.Event(), anyio.Event()

    async def run(self) -> None:
        try:
            async with Publisher(self.cfg) as pub:
                self.replay = pub.replay_endpoint
                pub.publish(_batch(0))
                self.started.set()
                await self.stop.wait()
                for i in range(1, 6):
                    pub.publish(_batch(i))
        finally:
            self.stopped.set()


_PROBE_AFTER, _TIMEOUT = 0.2, 0.5


def _subscriber(ep: str, replay: str | None) -> Subscriber:
    # max_retries=8: a probe retried as "probe" stayed live for 9 timeouts (and their
    # backoff, ~10 s) before, well past the bound the test allows under load.
    return Subscriber([SourceSpec(ep, replay, name="e")], probe_after_s=_PROBE_AFTER, probe_max_s=1.0,
                      replay_timeout_s=_TIMEOUT, max_retries=8, backoff_s=0.02)


async def test_a_router_that_hears_a_connecting_engine_only_by_replay_leaves_live_within_the_bound():
    """The engine publishes 6 batches; its PUB connects to an address nobody binds, so the
    router (which connects too) gets batch 0 from its join and nothing live. Once the
    engine is gone its probes go unanswered: the source leaves ``live`` within
    probe_max_s + replay_timeout_s (+ scheduling slack) and never says ``live`` again."""
    bound = 1.0 + _TIMEOUT + 4.5  # probe_max_s + replay_timeout_s + slack for a loaded machine
    ep = f"tcp://127.0.0.1:{_free_port()}"
    eng = _Engine(KVEventsConfig(endpoint=ep, replay_endpoint="tcp://127.0.0.1:*"))
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(eng.run)
            await eng.started.wait()
            sub = _subscriber(ep, eng.replay)
            async with Router(subscriber=sub) as router:
                await sub.wait_state("e", "live", timeout_s=10)
                assert router.health()["e"].last_seq == 0
                eng.stop.set()
                await eng.stopped.wait()  # 5 more batches, none heard live; the engine is gone
                t0 = time.monotonic()
                while router.health()["e"].state == "live":
                    assert time.monotonic() - t0 < bound, router.health()["e"]
                    await anyio.sleep(0.02)
                # From now on never live: nothing can prove the state any more.
                deadline = time.monotonic() + 4 * (_PROBE_AFTER + _TIMEOUT) + 1.0
                while time.monotonic() < deadline:
                    h = router.health()["e"]
                    assert h.state != "live", h
                    await anyio.sleep(0.02)
                await sub.wait_state("e", "stale", timeout_s=60)
                h = router.health()["e"]
            tg.cancel_scope.cancel()
    assert h.state == "stale" and h.last_seq < 5


async def test_a_dead_engine_gives_one_stale_notice_and_no_live_one():
    """Issue 29 defect 7: subscribe/record printed a live notice after every stale one."""
    ep = f"tcp://127.0.0.1:{_free_port()}"
    eng = _Engine(KVEventsConfig(endpoint=ep, replay_endpoint="tcp://127.0.0.1:*"))
    items: list = []
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(eng.run)
            await eng.started.wait()
            async with _subscriber(ep, eng.replay) as sub:
                await sub.wait_state("e", "live", timeout_s=10)
                eng.stop.set()
                await eng.stopped.wait()
                await sub.wait_state("e", "stale", timeout_s=60)
                # Several more probe rounds against the dead engine.
                probes = sub.counters("e").probes
                while sub.counters("e").probes < probes + 3:
                    items += sub.get_nowait()
                    await anyio.sleep(0.05)
                    assert sub.state("e") in ("stale", "recovering")
                items += sub.get_nowait()
            tg.cancel_scope.cancel()
    notices = [type(i).__name__ for i in items if isinstance(i, (SourceLive, SourceStale))]
    assert notices == ["SourceLive", "SourceStale"], notices


def test_the_engine_ready_line_says_bind_or_connect():
    """Issue 24 item 1: ``events tcp://127.0.0.1:P replay None`` hid that the PUB
    connects. Real ``kvstream engine`` processes."""
    from kvstream.emulator.launch import start_engine

    with start_engine("bound") as e:
        line = e.ready_line
        assert e.events is not None and e.replay is not None
    assert "(bind) replay" in line and " (connect)" not in line
    ep = f"tcp://127.0.0.1:{_free_port()}"
    with start_engine("connecting", events=ep, replay=None) as e:
        line = e.ready_line
        assert e.events == ep and e.replay is None
    assert f"events {ep} (connect) replay off" in line


def _seqs(items: list) -> list[int]:
    return [i.seq for i in items if type(i).__name__ == "SourceBatch"]


async def _publish_and_take(pub: Publisher, sub: Subscriber, taken: list, first: int, n: int) -> None:
    """Publish batches ``first .. first + n - 1`` and wait until the subscriber yielded them."""
    for i in range(first, first + n):
        pub.publish(_batch(i))
    while not _seqs(taken) or max(_seqs(taken)) < first + n - 1:
        taken += sub.get_nowait()
        await anyio.sleep(0.02)


_NO_LIVE = "arrived only by replay"


async def test_batches_taken_only_by_replay_warn_once_that_both_sides_connect(caplog):
    """vLLM connects its PUB for tcp://HOST:PORT; a subscriber that connects too gets every
    batch by replay probes and none live. Real sockets: a connecting publisher, a connecting
    subscriber, the replay ROUTER bound. After Subscriber.no_live_batches batches in
    no_live_answers answers over no_live_s seconds: one warning naming the endpoint and the
    fix, counted in the source's counters; and no second one however long it lasts."""
    caplog.set_level(logging.WARNING, logger="kvstream.transport.subscriber")
    ep = f"tcp://127.0.0.1:{_free_port()}"
    taken: list = []
    with anyio.fail_after(180):
        async with Publisher(KVEventsConfig(endpoint=ep, replay_endpoint="tcp://127.0.0.1:*")) as pub:
            assert pub.binds is False
            async with _subscriber(ep, pub.replay_endpoint) as sub:
                i = 0
                while not sub.counters("e").no_live_warnings:
                    await _publish_and_take(pub, sub, taken, i, 2)
                    i += 2
                    assert i < 2000, "no warning"
                assert i >= Subscriber.no_live_batches
                # Three more rounds, each by replay: still one warning.
                for _ in range(3):
                    await _publish_and_take(pub, sub, taken, i, 2)
                    i += 2
                c = sub.counters("e")
    assert _seqs(taken) == list(range(i))  # every batch, in order, by replay
    warned = [r.getMessage() for r in caplog.records if _NO_LIVE in r.getMessage()]
    assert len(warned) == 1 and c.no_live_warnings == 1, warned
    assert ep in warned[0] and "both sides connect" in warned[0] and "tcp://*:PORT" in warned[0], warned[0]


async def test_batches_heard_live_from_a_bound_publisher_never_warn(caplog):
    """The same traffic from a publisher that binds: taken live, no warning, counter 0."""
    caplog.set_level(logging.WARNING, logger="kvstream.transport.subscriber")
    taken: list = []
    with anyio.fail_after(120):
        async with Publisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*",
                                            replay_endpoint="tcp://127.0.0.1:*")) as pub:
            async with _subscriber(pub.endpoint, pub.replay_endpoint) as sub:
                await sub.wait_state("e", "live", timeout_s=30)
                for i in range(0, 3 * Subscriber.no_live_batches, 2):
                    await _publish_and_take(pub, sub, taken, i, 2)
                c = sub.counters("e")
    assert c.no_live_warnings == 0
    assert not [r for r in caplog.records if _NO_LIVE in r.getMessage()]


async def test_a_lossy_live_path_whose_gaps_are_replayed_never_warns(tmp_path, caplog):
    """Half the live messages lost on the way (a forwarder dropping odd seqs): every other
    batch comes by replay, for longer than no_live_s and more than no_live_batches, but live
    messages arrive between them, so both sides do not connect: no warning."""
    from tests.transport.zmq_helpers import FaultyForwarder, ipc

    caplog.set_level(logging.WARNING, logger="kvstream.transport.subscriber")
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "pub"), replay_endpoint=ipc(tmp_path, "replay"))
    fwd = FaultyForwarder(cfg.endpoint, ipc(tmp_path, "fwd"))
    fwd.drop = lambda seq: seq % 2 == 1
    taken: list = []
    try:
        with anyio.fail_after(180):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fwd.serve)
                async with _subscriber(fwd.endpoint, cfg.replay_endpoint) as sub:
                    async with Publisher(cfg) as pub:
                        await fwd.subscribed.wait()
                        await pub.wait_subscribed()
                        t0 = time.monotonic()
                        i = 0
                        while i < 2 * Subscriber.no_live_batches + 8 or \
                                time.monotonic() - t0 < 2 * Subscriber.no_live_s:
                            await _publish_and_take(pub, sub, taken, i, 2)
                            i += 2
                        c = sub.counters("e")
                tg.cancel_scope.cancel()
    finally:
        fwd.close()
    assert _seqs(taken) == list(range(i)) and fwd.dropped >= i // 2
    assert c.no_live_warnings == 0, c.as_dict()
    assert not [r for r in caplog.records if _NO_LIVE in r.getMessage()]
