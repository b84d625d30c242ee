"""The publisher on real sockets: vLLM's wire, config names, DP endpoints, replay,
snapshots, back-pressure and graceful shutdown."""

from __future__ import annotations

import dataclasses

import anyio
import pytest
import zmq

from kvstream.errors import LocalProtocolError
from kvstream.wire.events import AllBlocksCleared, BlockStored, KVEventBatch, decode_batch
from kvstream.wire.framing import END_SEQ_BYTES, decode_seq, encode_seq
from kvstream.transport import (
    EndpointError,
    KVEventsConfig,
    Publisher,
    PublisherClosedError,
    QueueFullError,
    offset_endpoint,
    should_bind,
)
from kvstream.transport.config import check_rank_endpoints

from tests.transport.zmq_helpers import ipc, recv, wait_readable

pytestmark = pytest.mark.anyio


async def wait_state() -> None:
    """One step of polling a publisher's state (callers hold a deadline)."""
    await anyio.sleep(0.005)



def _stored(h: int) -> BlockStored:
    return BlockStored([h], None, list(range(16)), 16, None, "GPU", None)


def _batch(h: int, ts: float = 1.0) -> KVEventBatch:
    return KVEventBatch(ts, [_stored(h)])


@pytest.fixture
def ctx():
    return zmq.Context.instance()


async def _sub(ctx, pub: Publisher) -> zmq.Socket:
    """A SUB on ``pub`` that is subscribed: the publisher has seen its subscription."""
    s = ctx.socket(zmq.SUB)
    s.linger = 0
    s.subscribe(b"")
    joined = pub.stats.subscriptions + 1
    s.connect(pub.endpoint)
    await pub.wait_subscribed(joined)
    return s


def test_config_names_and_defaults_match_vllm():
    c = KVEventsConfig()
    assert (c.enable_kv_cache_events, c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps,
            c.hwm, c.max_queue_size, c.topic) == (False, "null", "tcp://*:5557", None, 10_000,
                                                   100_000, 100_000, "")
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    vllm_dict = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000",
                 "replay_endpoint": "tcp://*:6100", "buffer_steps": 5, "hwm": 7, "max_queue_size": 9,
                 "topic": "t"}
    assert dataclasses.asdict(KVEventsConfig.from_dict(vllm_dict)).items() >= vllm_dict.items()
    with pytest.raises(ValueError, match="unknown KVEventsConfig keys"):
        KVEventsConfig.from_dict({"endpont": "x"})


def test_bind_or_connect_follows_vllms_heuristic():
    assert should_bind("tcp://*:5557") and should_bind("tcp://[::]:5557")
    assert should_bind("ipc:///tmp/x") and should_bind("inproc://x")
    assert not should_bind("tcp://10.0.0.1:5557")


def test_dp_rank_offsets_endpoints_like_vllm():
    assert offset_endpoint("tcp://*:25557", 1) == "tcp://*:25558"
    assert offset_endpoint("tcp://*:25657", 3) == "tcp://*:25660"
    assert offset_endpoint("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint("ipc:///tmp/a.sock", 0) == "ipc:///tmp/a.sock"
    with pytest.raises(EndpointError, match="ipc paths have no port"):
        offset_endpoint("ipc:///tmp/a.sock", 1)
    # dp1.bin's config: tcp://*:25557 / replay tcp://*:25657 at rank 1 -> 25558 / 25658.
    cfg = KVEventsConfig(endpoint="tcp://*:25557", replay_endpoint="tcp://*:25657")
    assert check_rank_endpoints(cfg, 1) == ("tcp://*:25558", "tcp://*:25658")
    assert cfg.endpoint == "tcp://*:25557"  # the caller's config is not mutated


def test_port_zero_at_a_dp_rank_follows_the_selected_vllm_release():
    from kvstream.compat import VLLM_0_11, VLLM_0_33

    # vLLM 0.33 (the default) keeps an ephemeral :0 at every rank; 0.11 adds the rank to it.
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("tcp://*:0", 2, VLLM_0_33) == "tcp://*:0"
    assert offset_endpoint("tcp://*:0", 2, VLLM_0_11) == "tcp://*:2"
    assert offset_endpoint("tcp://*:0", 2, "0.11") == "tcp://*:2"
    assert offset_endpoint("tcp://*:0", 0, VLLM_0_11) == "tcp://*:0"
    # Other ports are offset under both releases.
    assert offset_endpoint("tcp://*:7000", 2, VLLM_0_33) == offset_endpoint("tcp://*:7000", 2, VLLM_0_11) == "tcp://*:7002"
    both_zero = KVEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    assert both_zero.vllm_version == "0.33" and both_zero.vllm is VLLM_0_33
    assert check_rank_endpoints(both_zero, 3) == ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    old = dataclasses.replace(both_zero, vllm_version="v0.11.0")
    assert old.vllm_version == "0.11"
    assert check_rank_endpoints(old, 0) == ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")  # rank 0: ephemeral
    with pytest.raises(EndpointError, match="rank 1 would publish on port 1, which is the replay port of rank 1"):
        check_rank_endpoints(old, 1)  # 0.11 puts both sockets of rank 1 on port 1
    with pytest.raises(LocalProtocolError, match="unknown vLLM version '0.2'"):
        KVEventsConfig(vllm_version="0.2")


async def test_rank_above_zero_binds_ephemeral_ports_under_vllm_0_33(ctx):
    cfg = KVEventsConfig(endpoint="tcp://*:0", replay_endpoint="tcp://*:0")  # "*": bind, like vLLM
    with anyio.fail_after(30):
        async with Publisher(cfg, data_parallel_rank=2) as a, Publisher(cfg, data_parallel_rank=3) as b:
            ports = {ep.rsplit(":", 1)[1] for ep in (a.endpoint, a.replay_endpoint, b.endpoint, b.replay_endpoint)}
    assert len(ports) == 4 and "0" not in ports


def test_pub_port_colliding_with_a_replay_port_is_a_startup_error():
    cfg = KVEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558")
    check_rank_endpoints(cfg, 0)  # fine on its own
    with pytest.raises(EndpointError, match="rank 1 would publish on port 5558, which is the replay port of rank 0"):
        Publisher(cfg, data_parallel_rank=1)
    with pytest.raises(EndpointError, match="replay port at least 4 away"):
        Publisher(dataclasses.replace(cfg, data_parallel_size=4), data_parallel_rank=0)


async def test_live_frames_are_topic_seq_payload_from_zero_without_empty_batches(tmp_path, ctx):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), topic="kv@t")
    with anyio.fail_after(30):
        async with Publisher(cfg, data_parallel_rank=0) as pub:
            s = await _sub(ctx, pub)
            assert pub.publish(_batch(1)) == 0
            assert pub.publish(KVEventBatch(2.0, [])) is None  # empty: not published
            assert pub.publish(KVEventBatch(3.0, [_stored(3)], data_parallel_rank=5)) == 1
            m0, m1 = await recv(s), await recv(s)
            s.close(0)
    assert m0[0] == b"kv@t" and m0[1] == bytes(8) and decode_seq(m1[1]) == 1
    assert decode_batch(m0[2]).data_parallel_rank == 0  # stamped
    assert decode_batch(m1[2]).data_parallel_rank == 5  # kept
    assert pub.stats.published == 2 and pub.stats.sent == 2


async def test_rank_is_stamped_and_tcp_endpoints_are_offset(ctx):
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    with anyio.fail_after(30):
        async with Publisher(cfg, data_parallel_rank=3) as pub:
            s = await _sub(ctx, pub)
            pub.publish(_batch(1))
            (_, _, payload) = await recv(s)
            s.close(0)
    assert decode_batch(payload).data_parallel_rank == 3


async def test_replay_sends_buffered_batches_then_end_marker_with_or_without_topic(tmp_path, ctx):
    for topic_frame in (True, False):
        cfg = KVEventsConfig(endpoint=ipc(tmp_path, f"p{topic_frame}"), replay_endpoint=ipc(tmp_path, f"r{topic_frame}"),
                             topic="kv", buffer_steps=5, replay_topic_frame=topic_frame)
        with anyio.fail_after(30):
            async with Publisher(cfg) as pub:
                for i in range(8):
                    pub.publish(_batch(i))
                d = ctx.socket(zmq.DEALER)
                d.linger = 0
                d.connect(pub.replay_endpoint)
                d.send_multipart([b"", encode_seq(4)])
                replies = [await recv(d) for _ in range(5)]
                d.send_multipart([b"", encode_seq(100)])  # beyond the end
                beyond = await recv(d)
                d.send_multipart([b"", encode_seq(0)])  # 0..2 rotated out: 3..7 come back
                rotated = [decode_seq(f[-2]) for f in [await recv(d) for _ in range(6)]]
                d.close(0)
        if topic_frame:
            assert [len(r) for r in replies] == [4] * 5 and replies[0][1] == b"kv"
            assert replies[-1] == [b"", b"", END_SEQ_BYTES, b""]
        else:
            assert [len(r) for r in replies] == [3] * 5
            assert replies[-1] == [b"", END_SEQ_BYTES, b""]
        assert [decode_seq(r[-2]) for r in replies[:-1]] == [4, 5, 6, 7]
        assert beyond[-2:] == [END_SEQ_BYTES, b""]
        assert rotated == [3, 4, 5, 6, 7, 2**64 - 1]
        assert pub.stats.replay_requests == 3


async def test_malformed_replay_requests_are_counted_and_ignored(tmp_path, ctx):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"))
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            pub.publish(_batch(1))
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.connect(pub.replay_endpoint)
            d.send_multipart([b"", b"\x00\x01"])  # short start frame
            d.send_multipart([b"x", encode_seq(0)])  # no empty delimiter
            d.send_multipart([b"", encode_seq(0), b"extra"])  # too many frames
            d.send_multipart([b"", encode_seq(0)])  # a good one still gets served
            good = [await recv(d), await recv(d)]
            assert not await wait_readable(d, 0.1)
            d.close(0)
    assert pub.stats.malformed_requests == 3
    assert decode_seq(good[0][-2]) == 0 and good[1][-2] == END_SEQ_BYTES


async def test_snapshot_request_returns_full_state_tagged_with_the_next_seq(tmp_path, ctx):
    state = [AllBlocksCleared()] + [_stored(h) for h in range(5)]
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"),
                         snapshot_batch_events=4)
    with anyio.fail_after(30):
        async with Publisher(cfg, snapshot_provider=lambda: state) as pub:
            for i in range(3):
                pub.publish(_batch(i))
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.connect(pub.replay_endpoint)
            d.send_multipart([b"", b"SNAPSHOT"])
            replies = [await recv(d) for _ in range(3)]
            d.close(0)
    assert [decode_seq(r[-2]) for r in replies[:2]] == [3, 3]  # R = next seq
    events = [e for r in replies[:2] for e in decode_batch(r[-1]).events]
    assert events == state
    assert replies[2][-2] == END_SEQ_BYTES and pub.stats.snapshot_batches_sent == 2


async def test_snapshot_request_without_provider_gets_only_the_end_marker_like_vllm(tmp_path, ctx):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"))
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            pub.publish(_batch(1))
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.connect(pub.replay_endpoint)
            d.send_multipart([b"", b"SNAPSHOT"])
            reply = await recv(d)
            d.close(0)
    assert reply == [b"", b"", END_SEQ_BYTES, b""]
    # vLLM reads the 8-byte b"SNAPSHOT" as a start seq far beyond anything it buffered.
    assert int.from_bytes(b"SNAPSHOT", "big") > 2**62


async def test_full_queue_keeps_batches_for_replay_only_and_counts_them(tmp_path, ctx):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), max_queue_size=3)
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            s = await _sub(ctx, pub)
            seqs = [pub.publish(_batch(i)) for i in range(10)]  # no await: the sender cannot run
            live = [decode_seq((await recv(s))[1]) for _ in range(3)]
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.connect(pub.replay_endpoint)
            d.send_multipart([b"", encode_seq(3)])
            replayed = [decode_seq((await recv(d))[-2]) for _ in range(8)]
            s.close(0)
            d.close(0)
    assert seqs == list(range(10)) and live == [0, 1, 2]
    assert replayed[:-1] == list(range(3, 10)) and pub.stats.live_dropped == 7


async def test_full_queue_with_raise_policy_refuses_the_batch(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), max_queue_size=2, queue_full="raise")
    async with Publisher(cfg) as pub:
        pub.publish(_batch(0))
        pub.publish(_batch(1))
        with pytest.raises(QueueFullError, match="max_queue_size=2"):
            pub.publish(_batch(2))
        assert pub.next_seq == 2 and pub.stats.queue_full_errors == 1


async def test_publish_outside_async_with_is_an_error(tmp_path):
    pub = Publisher(KVEventsConfig(endpoint=ipc(tmp_path, "p")))
    with pytest.raises(PublisherClosedError, match="async with"):
        pub.publish(_batch(0))


async def test_graceful_shutdown_sends_everything_queued(tmp_path, ctx):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"))
    s = ctx.socket(zmq.SUB)
    s.linger = 0
    s.rcvhwm = 0
    s.subscribe(b"")
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            s.connect(pub.endpoint)
            await pub.wait_subscribed(1)
            for i in range(2000):
                pub.publish(_batch(i))
            assert pub.queued == 2000  # nothing sent yet; leaving the block must send it all
        got = [decode_seq((await recv(s))[1]) for _ in range(2000)]
    s.close(0)
    assert got == list(range(2000))


async def test_publisher_connects_when_the_endpoint_is_not_a_wildcard(ctx):
    # "bind stable, connect volatile": a concrete host means connect (to a proxy/consumer).
    s = ctx.socket(zmq.SUB)
    s.linger = 0
    s.subscribe(b"")
    port = s.bind_to_random_port("tcp://127.0.0.1")
    with anyio.fail_after(30):
        async with Publisher(KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}")) as pub:
            # Connected, and the SUB's filter has arrived. A SUB attaches new connections only
            # inside a call on it, so it is asked for its events meanwhile.
            while pub.stats.subscriptions < 1:
                s.getsockopt(zmq.EVENTS)
                await wait_state()
            assert pub.publish(_batch(7)) == 0
            msg = await recv(s)
    s.close(0)
    assert decode_seq(msg[1]) == 0 and decode_batch(msg[2]).events[0].block_hashes == [7]


async def test_wait_subscribed_reports_each_joining_subscriber_and_the_first_batch_reaches_it(tmp_path, ctx):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), topic="kv")
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            assert pub.stats.subscriptions == 0
            subs = [await _sub(ctx, pub) for _ in range(3)]
            assert pub.stats.subscriptions == 3
            pub.publish(_batch(1))
            first = [await recv(s) for s in subs]  # no slow joiner: seq 0 reaches every one
            for s in subs:
                s.close(0)
            while pub.stats.unsubscriptions < 1:  # the last one gone: the filter is dropped
                await wait_state()
    assert [decode_seq(m[1]) for m in first] == [0, 0, 0]
    with pytest.raises(PublisherClosedError):
        await pub.wait_subscribed(4)


async def test_replay_request_flood_does_not_stall_live_publishing(tmp_path, ctx):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"),
                         max_replay_jobs=8)
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            s = await _sub(ctx, pub)
            for i in range(2000):
                pub.publish(_batch(i))
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.rcvhwm = 0
            d.connect(pub.replay_endpoint)
            for _ in range(300):
                d.send_multipart([b"", encode_seq(0)])
            st = pub.stats
            while st.replay_requests + st.replay_rejected < 300:  # the flood has been taken in
                await wait_state()
            for i in range(2000, 2100):
                pub.publish(_batch(i))
            got = [decode_seq((await recv(s))[1]) for _ in range(2100)]
            s.close(0)
            d.close(0)
    assert got == list(range(2100))
    st = pub.stats
    assert st.replay_rejected > 0 and st.replay_requests + st.replay_rejected == 300


async def test_publish_raw_sends_given_bytes_and_seq_and_restarts_the_replay_buffer(tmp_path, ctx):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), topic="kv")
    p = [encode_batch_raw(i) for i in range(6)]
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            s = await _sub(ctx, pub)
            pub.publish_raw(p[0], 7)  # a log may start mid-stream
            pub.publish_raw(p[1], 8, topic=b"kv")
            pub.publish_raw(p[2], 0)  # went backwards: a new engine incarnation
            pub.publish_raw(p[3], 1)
            live = [await recv(s) for _ in range(4)]
            assert pub.next_seq == 2
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.connect(pub.replay_endpoint)
            d.send_multipart([b"", encode_seq(0)])
            replayed = [await recv(d) for _ in range(3)]
            with pytest.raises(ValueError, match="differs from this publisher's"):
                pub.publish_raw(p[4], 2, topic=b"other")
            with pytest.raises(ValueError, match="seq must be"):
                pub.publish_raw(p[4], -1)
            s.close(0)
            d.close(0)
    assert [(m[0], decode_seq(m[1]), m[2]) for m in live] == [
        (b"kv", 7, p[0]), (b"kv", 8, p[1]), (b"kv", 0, p[2]), (b"kv", 1, p[3])]
    # only the new incarnation's batches are buffered
    assert [(decode_seq(r[2]), r[3]) for r in replayed[:2]] == [(0, p[2]), (1, p[3])]
    assert replayed[2][2] == END_SEQ_BYTES


async def test_tap_sees_every_seq_and_a_failing_tap_is_counted_not_raised(tmp_path):
    seen = []

    def tap(seq, topic, payload):
        seen.append((seq, topic, decode_batch(payload).events[0].block_hashes))
        if seq == 1:
            raise RuntimeError("disk full")

    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), topic="kv")
    with anyio.fail_after(30):
        async with Publisher(cfg, tap=tap) as pub:
            for i in range(3):
                pub.publish(_batch(10 + i))
    assert seen == [(0, b"kv", [10]), (1, b"kv", [11]), (2, b"kv", [12])]
    assert pub.stats.tap_errors == 1 and pub.stats.published == 3


def encode_batch_raw(i: int) -> bytes:
    from kvstream.wire.events import encode_batch

    return encode_batch(KVEventBatch(float(i), [_stored(100 + i)], 0))
