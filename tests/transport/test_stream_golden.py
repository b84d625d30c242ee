"""The subscriber against vLLM itself: a scripted PUB/ROUTER plays the golden captures
(vLLM 0.11: 3-frame replay replies; 0.33: 4-frame replies with the topic) and the
subscriber must yield exactly the recorded batches, recovering a gap through the
recorded replay exchange."""

from __future__ import annotations

import anyio
import pytest

from kvstream.wire.capture import CaptureChannel, read_capture
from kvstream.wire.events import EventEncoder, decode_batch
from kvstream.wire.framing import decode_seq
from kvstream.transport import KVEventsConfig, Publisher, SourceLive, SourceSpec, Subscriber

from tests.transport.zmq_helpers import GoldenPeer, batches_of, collect, ipc, recv, wait_readable

pytestmark = pytest.mark.anyio

# (folder, live seqs sent before the hole, recorded replay start, last seq)
CASES = [("vllm-0.11.0", 6, 6, 11), ("vllm-0.33.0", 9, 9, 18)]



@pytest.mark.parametrize("folder,before,start,last", CASES)
async def test_subscriber_yields_exactly_the_recorded_batches_recovering_through_recorded_replay(
        golden_dir, tmp_path, folder, before, start, last):
    peer = GoldenPeer(golden_dir / folder / "stream.bin", ipc(tmp_path, "pub"), ipc(tmp_path, "replay"))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(peer.serve)
            spec = SourceSpec(peer.pub_ep, peer.replay_ep, name="vllm")
            # No idle probes: the recovery must come from the gap, through the recorded exchange.
            async with Subscriber([spec], topic="kv@peer@model", replay_timeout_s=2.0, probe_after_s=None) as sub:
                await peer.wait_subscriber()
                # The join-time replay (from 0) finds an empty buffer: caught up at -1.
                first = await collect(sub, lambda it: isinstance(it[-1], SourceLive))
                assert [type(i) for i in first] == [SourceLive] and first[0].seq == -1
                for s in range(before):
                    peer.publish(s)
                for s in range(before, last):  # lost on the wire: only in the replay buffer
                    peer.publish(s, send=False)
                peer.publish(last)
                items = await collect(sub, lambda it: any(isinstance(i, SourceLive) and i.seq == last for i in it))
                health = sub.health()["vllm"]
            tg.cancel_scope.cancel()
    finally:
        peer.close()
    got = batches_of(items)
    assert [b.seq for b in got] == list(range(last + 1))
    for b in got:
        topic, seqf, payload = peer.live[b.seq]
        assert (b.topic, b.payload) == (topic, payload)
        assert b.batch == decode_batch(payload)
        assert b.source == "vllm" and b.batch.data_parallel_rank == 0
    assert [b.replayed for b in got[before:last]] == [True] * (last - before)
    # The recovery request has the framing of the one vLLM's own client sent, one seq
    # earlier: the anchor (the last batch yielded) proves the publisher is the same instance.
    assert [b"", seqf_for(start - 1)] in peer.requests
    assert health.state == "live" and health.counters["gaps"] == 1
    assert health.counters["decode_errors"] == 0 and health.counters["stale_marks"] == 0


def seqf_for(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


@pytest.mark.parametrize("folder", ["vllm-0.11.0", "vllm-0.33.0"])
async def test_joining_late_replays_the_whole_recorded_stream(golden_dir, tmp_path, folder):
    peer = GoldenPeer(golden_dir / folder / "stream.bin", ipc(tmp_path, "pub"), ipc(tmp_path, "replay"))
    n = len(peer.live)
    for s in range(n):
        peer.publish(s, send=False)  # published before the subscriber existed
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(peer.serve)
            # The filter is a prefix; the publisher's real topic is given with the source.
            spec = SourceSpec(peer.pub_ep, peer.replay_ep, name="v", topic="kv@peer@model")
            async with Subscriber([spec], topic="kv@") as sub:
                items = await collect(sub, lambda it: isinstance(it[-1], SourceLive))
            tg.cancel_scope.cancel()
    finally:
        peer.close()
    got = batches_of(items)
    assert [(b.seq, b.payload) for b in got] == [(s, peer.live[s][2]) for s in range(n)]
    # 0.11 replies carry no topic frame: they are labelled with the source's real topic,
    # never with the filter string.
    assert all(b.topic == b"kv@peer@model" and b.replayed for b in got)


async def test_dp_rank_1_capture_is_yielded_with_its_rank(golden_dir, tmp_path):
    peer = GoldenPeer(golden_dir / "vllm-0.33.0" / "dp1.bin", ipc(tmp_path, "pub"), ipc(tmp_path, "replay"))
    peer.publish(0, send=False)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(peer.serve)
            async with Subscriber([SourceSpec(peer.pub_ep, peer.replay_ep, name="dp1")]) as sub:
                items = await collect(sub, lambda it: isinstance(it[-1], SourceLive))
            tg.cancel_scope.cancel()
    finally:
        peer.close()
    (b,) = batches_of(items)
    assert b.batch.data_parallel_rank == 1 and b.payload == peer.live[0][2]
    assert peer.requests == [[b"", bytes(8)]]  # the recorded request: replay from seq 0


@pytest.mark.parametrize("folder,encoding,topic_frame", [("vllm-0.11.0", "array", False),
                                                         ("vllm-0.33.0", "map", True)])
async def test_publisher_frames_are_byte_identical_to_vllm(golden_dir, tmp_path, folder, encoding, topic_frame):
    """kvstream's Publisher, fed the decoded golden batches, puts vLLM's exact frames on the
    wire: live messages and both recorded replay exchanges (reply framing included)."""
    import zmq

    recs = read_capture(golden_dir / folder / "stream.bin")
    live = [r.frames for r in recs if r.channel == CaptureChannel.LIVE]
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "pub"), replay_endpoint=ipc(tmp_path, "rep"),
                         topic="kv@peer@model", encoding=encoding, replay_topic_frame=topic_frame)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(b"")
    dealer = ctx.socket(zmq.DEALER)
    try:
        with anyio.fail_after(30):
            async with Publisher(cfg) as pub:
                sub.connect(pub.endpoint)
                dealer.connect(pub.replay_endpoint)
                # Readiness, not a sleep: re-send the first recorded batch as seq 0 until
                # the SUB has it (a slow joiner loses what precedes its subscription).
                with anyio.fail_after(30):
                    while True:
                        pub.publish_raw(live[0][2], 0)
                        if await wait_readable(sub, 0.05):
                            break
                pub.publish_raw(live[0][2], 0)  # seq 0 of the incarnation compared below
                for f in live[1:]:
                    b = decode_batch(f[2])
                    assert EventEncoder(encoding).encode(b) == f[2]
                    pub.publish(b)
                got = [tuple(await recv(sub))]
                while got[-1] == tuple(live[0]):  # the warm-up copies of seq 0
                    got.append(tuple(await recv(sub)))
                got = [got[-2], got[-1]] + [tuple(await recv(sub)) for _ in live[2:]]
                assert got == [tuple(f) for f in live]
                # Replay the recorded requests and compare every reply frame.
                expected: list[tuple[bytes, ...]] = []
                for r in recs:
                    if r.channel == CaptureChannel.REPLAY_REQUEST:
                        dealer.send_multipart(list(r.frames))
                    elif r.channel == CaptureChannel.REPLAY_REPLY:
                        expected.append(tuple(r.frames))
                replies = [tuple(await recv(dealer)) for _ in expected]
                assert replies == expected
                assert decode_seq(expected[-1][-2]) == 2**64 - 1
    finally:
        sub.close(0)
        dealer.close(0)
