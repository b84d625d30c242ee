"""The async Router on real ZMQ sockets, and apply_item (the one item -> index mapping)."""

from __future__ import annotations

import pytest

from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from kvstream.routing.index import KVIndex
from kvstream.routing.router import Router, apply_item
from kvstream.routing.scoring import Load
from kvstream.transport import (
    KVEventsConfig,
    Publisher,
    SourceBatch,
    SourceLive,
    SourceReset,
    SourceSpec,
    SourceStale,
)

pytestmark = pytest.mark.anyio

BS = 16



def _prompt(base: int, n_blocks: int) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


def _stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, "GPU", None)


def _item(source: str, seq: int, events: list) -> SourceBatch:
    b = KVEventBatch(float(seq), events)
    return SourceBatch(source, seq, b"", encode_batch(b), b, False)


# -- apply_item: the mapping shared by the live router and log replay --------------------


def test_apply_item_maps_every_item_kind_onto_the_index() -> None:
    idx = KVIndex()
    p = _prompt(100, 3)
    apply_item(idx, _item("e0", 0, [_stored([1, 2, 3], p)]))
    assert idx.match(p)["e0"].blocks == 3
    apply_item(idx, SourceStale("e0", "gap", 1, 5))
    assert idx.match(p)["e0"].blocks == 0
    assert idx.state()["sources"]["e0"]["stale"] is True
    # "caught up" after a stale mark does not make lost state exact again
    apply_item(idx, SourceLive("e0", 4))
    assert idx.match(p)["e0"].blocks == 0
    # a reset (restart or snapshot) drops everything and un-stales
    apply_item(idx, SourceReset("e0", "snapshot", 5))
    assert idx.state()["sources"]["e0"] == {"stale": False, "blocks": ()}
    apply_item(idx, _item("e0", 4, [_stored([1, 2], p[: 2 * BS])]))
    assert idx.match(p)["e0"].blocks == 2
    apply_item(idx, SourceReset("e0", "removed", None))
    assert "e0" not in idx.sources
    with pytest.raises(TypeError, match="subscriber items"):
        apply_item(idx, object())


def test_replaying_the_same_items_gives_an_equal_state() -> None:
    p, q = _prompt(100, 4), _prompt(900, 2)
    items = [
        _item("e0", 0, [_stored([1, 2, 3, 4], p)]),
        _item("e1", 0, [_stored([11, 12], q), _stored([1, 2], p[: 2 * BS])]),
        _item("e0", 1, [BlockRemoved([4], "GPU"), _stored([3], p[2 * BS : 3 * BS], parent=2)]),
        SourceStale("e1", "gap", 1, 3),
        _item("e1", 3, [AllBlocksCleared()]),
    ]
    a, b = KVIndex(), KVIndex()
    for it in items:
        apply_item(a, it)
    for it in items:
        apply_item(b, it)
    assert a.state() == b.state()
    assert a.state() != KVIndex().state()


# -- the Router on real sockets -------------------------------------------------------------


async def test_router_follows_two_engines_and_routes_to_the_one_holding_the_prefix(tmp_path) -> None:
    def cfg(name: str) -> KVEventsConfig:
        return KVEventsConfig(
            publisher="zmq",
            endpoint=f"ipc://{tmp_path}/{name}.sock",
            replay_endpoint=f"ipc://{tmp_path}/{name}-replay.sock",
        )

    p, q = _prompt(1000, 6), _prompt(5000, 6)
    async with Publisher(cfg("a")) as pa, Publisher(cfg("b")) as pb:
        specs = [
            SourceSpec(pa.endpoint, pa.replay_endpoint, name="a"),
            SourceSpec(pb.endpoint, pb.replay_endpoint, name="b"),
        ]
        async with Router(specs) as router:
            assert set(router.index.sources) == {"a", "b"}
            pa.publish(KVEventBatch(1.0, [_stored(list(range(1, 7)), p)]))
            pb.publish(KVEventBatch(1.0, [_stored(list(range(101, 104)), q[: 3 * BS])]))
            await router.wait_applied("a", 0)
            await router.wait_applied("b", 0)
            assert router.route(p).best == "a"
            res = router.route(q)
            assert res.best == "b" and res.matches["b"].blocks == 3 and res.matches["a"].blocks == 0
            # load can outweigh a short prefix
            assert router.route(q[: 3 * BS] + [1] * 48, loads={"b": Load(queue=50)}).best == "a"
            # engine b evicts; the router follows
            pb.publish(KVEventBatch(2.0, [BlockRemoved([101], "GPU")]))
            await router.wait_applied("b", 1)
            assert router.index.match(q)["b"].blocks == 0


async def test_router_speculates_the_chosen_engine_until_the_ttl(tmp_path) -> None:
    now = [0.0]
    async with Router([], speculative_ttl_s=1.0, clock=lambda: now[0]) as router:
        router.index.add_source("a")
        router.index.add_source("b")
        p = _prompt(7, 4)
        first = router.route(p, loads={"a": Load(queue=1)})
        assert first.best == "b" and first.matches["b"].blocks == 0
        second = router.route(p, loads={"b": Load(queue=1)})
        assert second.best == "b" and second.matches["b"].speculative_blocks == 4
        now[0] = 5.0
        third = router.route(p, loads={"b": Load(queue=1)})
        assert third.best == "a"


# -- another item source plugged in (e.g. a JetStream consumer) -----------------------------


class _ChannelSource:
    """An item source that is not ZMQ: items pushed through an anyio memory channel (the
    shape a JetStream consumer or a log replayer gives the router)."""

    def __init__(self) -> None:
        import anyio

        self.send, self._recv = anyio.create_memory_object_stream(100)
        self.entered = self.exited = False

    async def __aenter__(self) -> "_ChannelSource":
        self.entered = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.exited = True
        self._recv.close()

    def __aiter__(self):
        return self._recv.__aiter__()

    def health(self) -> dict[str, str]:
        return {"e0": "live"}


async def test_router_reads_items_from_a_plugged_item_source() -> None:
    from kvstream.routing.router import RouterUsageError

    src = _ChannelSource()
    p = _prompt(300, 3)
    async with Router(subscriber=src) as router:
        assert src.entered and router.subscriber is src
        await src.send.send(_item("e0", 0, [_stored([1, 2, 3], p)]))
        await router.wait_applied("e0", 0)
        assert router.route(p).matches["e0"].blocks == 3
        assert router.health() == {"e0": "live"}
        with pytest.raises(RouterUsageError, match="add_source"):
            router.add_endpoint("tcp://127.0.0.1:1")
    assert src.exited


def test_router_refuses_endpoints_beside_a_plugged_item_source() -> None:
    from kvstream.routing.router import RouterUsageError

    with pytest.raises(RouterUsageError, match="one or the other"):
        Router(["tcp://127.0.0.1:1"], subscriber=_ChannelSource())
    with pytest.raises(RouterUsageError, match="async context manager"):
        Router(subscriber=object())  # type: ignore[arg-type]
