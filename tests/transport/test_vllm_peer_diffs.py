"""Regressions found by ``bench/vllm_peer/diff_wire.py`` (kvstream's stream against vLLM's
own ``ZmqEventPublisher``).

vLLM 0.11.0's replay replies carry no topic frame: its ROUTER sends ``[b"", seq, payload]``
for every buffered batch whatever the requester's topic filter (``_service_replay`` in
``vllm/distributed/kv_events.py``). Run against the real 0.11 publisher with
``topic="other"``, a ``Subscriber(topic="kv@")`` used to yield all of its batches through
the join replay and the idle probes (labelled with topic ``b""``); vLLM 0.33 (topic frame
in replies) was filtered correctly. kvstream's ``Publisher(replay_topic_frame=False)``
puts 0.11's exact reply frames on the wire (``test_stream_golden.py``), so it stands in for
the 0.11 engine here.

vLLM 0.33.0's default topic is the empty string, and its replies then carry an empty topic
frame: ``[b"", b"", seq, payload]`` at a DEALER (``_service_replay`` sends
``self._topic_bytes``). A ``Subscriber(topic="kv@")`` used to take that empty frame for "no
topic" and yield the batches of such a publisher through replays.
"""

from __future__ import annotations

import anyio
import pytest

from kvstream.transport import (
    KVEventsConfig,
    Publisher,
    SourceBatch,
    SourceLive,
    SourceSpec,
    SourceTracker,
    Subscriber,
)
from kvstream.wire.events import BlockStored, KVEventBatch, encode_batch

from tests.transport.zmq_helpers import batches_of, collect, ipc

pytestmark = pytest.mark.anyio


def _batch(h: int) -> KVEventBatch:
    return KVEventBatch(1.0, [BlockStored([h], None, list(range(16)), 16, None, "GPU", None)], 0)


def _reply_011(t: SourceTracker, seq: int) -> None:
    b = _batch(seq)
    t.on_reply(seq, None, encode_batch(b, "array"), b)  # no topic frame


def _sent(t: SourceTracker):
    req = t.inflight
    assert req is not None
    req.sent = True
    return req


def test_topicless_replies_are_not_yielded_under_a_filter_until_a_live_message_shows_the_topic():
    t = SourceTracker("v", has_replay=True, topic=b"kv@")
    t.start()
    _sent(t)
    for s in range(3):
        _reply_011(t, s)
    t.on_reply_end()
    # Whose topic? Unknown: nothing yielded, and the source does not claim to be live.
    assert not [i for i in t.out if isinstance(i, SourceBatch)]
    assert t.state == "connecting" and t.inflight is None and t.probe_at() is None
    assert t.counters.unattributed == 3
    # A live message of a matching topic names the publisher's topic: the gap before it is
    # fetched again and labelled with it.
    b = _batch(3)
    t.on_live(3, b"kv@peer@model", encode_batch(b, "array"), b, 1.0)
    req = _sent(t)
    assert (req.kind, req.start) == ("replay", 0)
    for s in range(4):
        _reply_011(t, s)
    t.on_reply_end()
    got = [i for i in t.out if isinstance(i, SourceBatch)]
    assert [(i.seq, i.topic) for i in got] == [(s, b"kv@peer@model") for s in range(4)]
    assert t.state == "live"


def test_topicless_replies_are_yielded_when_the_source_topic_is_configured_or_there_is_no_filter():
    for kw in ({"topic": b"kv@", "source_topic": b"kv@peer@model"}, {}):
        t = SourceTracker("v", has_replay=True, **kw)
        t.start()
        _sent(t)
        for s in range(3):
            _reply_011(t, s)
        t.on_reply_end()
        assert [i.seq for i in t.out if isinstance(i, SourceBatch)] == [0, 1, 2]
        assert t.state == "live" and t.counters.unattributed == 0


async def test_a_vllm_011_publisher_of_another_topic_yields_nothing_through_replays(tmp_path):
    other = KVEventsConfig(endpoint=ipc(tmp_path, "o"), replay_endpoint=ipc(tmp_path, "or"), topic="other",
                           encoding="array", replay_topic_frame=False)
    mine = KVEventsConfig(endpoint=ipc(tmp_path, "m"), replay_endpoint=ipc(tmp_path, "mr"), topic="kv@m",
                          encoding="array", replay_topic_frame=False)
    with anyio.fail_after(60):
        async with Publisher(other) as o, Publisher(mine) as m:
            for h in range(3):  # buffered before the subscriber joins
                o.publish(_batch(10 + h))
                m.publish(_batch(20 + h))
            specs = [SourceSpec(o.endpoint, o.replay_endpoint, name="o"),
                     SourceSpec(m.endpoint, m.replay_endpoint, name="m")]
            async with Subscriber(specs, topic="kv@", probe_after_s=0.05, probe_max_s=0.05) as sub:
                # "m" shows its topic only on the live socket: publish until it is live.
                while sub.state("m") != "live":
                    m.publish(_batch(99))
                    o.publish(_batch(98))
                    with anyio.move_on_after(0.05):
                        await sub.wait_state("m", "live")
                items = await collect(sub, lambda it: isinstance(it[-1], SourceLive) and it[-1].source == "m")
                # Idle probes on "o" run meanwhile; it never shows a topic we want.
                assert sub.state("o") == "connecting"
                items += sub.get_nowait()
    got = batches_of(items)
    assert {b.source for b in got} == {"m"}
    assert all(b.topic == b"kv@m" for b in got)
    assert [b.seq for b in got] == list(range(len(got)))


def test_an_empty_topic_frame_is_a_topic_that_the_filter_rejects():
    # vLLM 0.33.0, topic="": every reply is [b"", b"", seq, payload] (topic frame b"").
    t = SourceTracker("v", has_replay=True, topic=b"kv@")
    t.start()
    _sent(t)
    for s in range(3):
        b = _batch(s)
        t.on_reply(s, b"", encode_batch(b), b)
    t.on_reply_end()
    assert not [i for i in t.out if isinstance(i, SourceBatch)]
    assert t.counters.filtered == 3 and t.expected == 3 and t.state == "live"


async def test_a_vllm_033_publisher_with_the_default_empty_topic_yields_nothing_under_a_filter(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "e"), replay_endpoint=ipc(tmp_path, "er"))  # topic ""
    with anyio.fail_after(60):
        async with Publisher(cfg) as pub:
            for h in range(3):  # buffered before the subscriber joins: only a replay brings them
                pub.publish(_batch(h))
            async with Subscriber([SourceSpec(pub.endpoint, pub.replay_endpoint, name="e")], topic="kv@",
                                  probe_after_s=0.05, probe_max_s=0.05) as sub:
                await sub.wait_state("e", "live")
                for h in range(3):  # filtered by the SUB socket; the probes fetch them
                    pub.publish(_batch(10 + h))
                with anyio.fail_after(30):
                    while sub.counters("e").filtered < 6:
                        await anyio.sleep(0.02)
                items = sub.get_nowait()
    assert batches_of(items) == []


def test_snapshot_batches_of_another_topic_are_filtered_like_replayed_ones():
    # Not a vLLM behaviour (vLLM answers no snapshots): kvstream's own publisher answers
    # with its topic frame, and the filter must hold for those batches too.
    t = SourceTracker("v", has_replay=True, topic=b"kv@")
    t.start()
    _sent(t)
    b = _batch(5)
    t.on_reply(5, b"other", encode_batch(b), b)  # the join reply starts late: seq 0..4 rotated out
    t.on_reply_end()
    req = _sent(t)
    assert req.kind == "snapshot"
    t.on_reply(7, b"other", encode_batch(b), b)
    t.on_reply_end()
    assert [type(i).__name__ for i in t.out] == ["SourceReset"]
    assert t.counters.filtered == 1


async def test_a_source_can_bind_for_an_engine_publishing_in_connect_mode(tmp_path):
    # vLLM (0.11.0 and 0.33.0, ZmqEventPublisher._socket_setup) *connects* its PUB when the
    # endpoint has no wildcard ("tcp://router:5557": "bind stable, connect volatile"), so
    # the stable side, the subscriber, must bind. kvstream's Publisher(bind=False) connects
    # the same way (over ipc here; vLLM itself binds ipc).
    spec = SourceSpec(ipc(tmp_path, "sub"), ipc(tmp_path, "rep"), name="e", bind=True)
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "sub"), replay_endpoint=ipc(tmp_path, "rep"), topic="kv@e")
    with anyio.fail_after(60):
        async with Subscriber([spec], topic="kv@") as sub:
            assert sub.health()["e"].endpoint == ipc(tmp_path, "sub")
            async with Publisher(cfg, bind=False) as pub:
                pub.publish(_batch(1))  # before the connection exists: fetched by replay
                await sub.wait_state("e", "live")
                pub.publish(_batch(2))
                items = await collect(sub, lambda it: len(batches_of(it)) == 2)
    got = batches_of(items)
    assert [(b.seq, b.topic, b.batch.events[0].block_hashes) for b in got] == [(0, b"kv@e", [1]), (1, b"kv@e", [2])]


async def test_a_bound_source_reports_the_port_it_got(tmp_path):
    async with Subscriber([SourceSpec("tcp://127.0.0.1:0", name="e", bind=True)]) as sub:
        ep = sub.health()["e"].endpoint
    assert ep.startswith("tcp://127.0.0.1:") and not ep.endswith(":0")


def test_a_topic_learned_while_topicless_replies_arrive_asks_again_rather_than_guess():
    t = SourceTracker("v", has_replay=True, topic=b"kv@")
    t.start()
    _sent(t)
    _reply_011(t, 0)
    _reply_011(t, 1)  # topic unknown: ignored
    b = _batch(3)
    t.on_live(3, b"kv@x", encode_batch(b, "array"), b, 1.0)  # now known; held (request out)
    _reply_011(t, 2)  # the rest of the same answer
    t.on_reply_end()
    # Not "the buffer starts at 2" (that would ask for a snapshot and mark the source
    # stale against vLLM): the whole answer is asked for again.
    req = _sent(t)
    assert (req.kind, req.start) == ("replay", 0)
    for s in range(4):
        _reply_011(t, s)
    t.on_reply_end()
    assert [(i.seq, i.topic) for i in t.out if isinstance(i, SourceBatch)] == [(s, b"kv@x") for s in range(4)]
    assert t.state == "live" and t.counters.stale_marks == 0 and t.counters.snapshots == 0


def test_the_publisher_default_follows_the_release():
    # vLLM 0.11.0 vllm/config/kv_events.py: publisher: str = "null" and no __post_init__,
    # so KVEventsConfig(enable_kv_cache_events=True).publisher == "null" (the factory then
    # makes a NullEventPublisher). vLLM 0.33.0 adds __post_init__: None -> "zmq" when enabled.
    assert KVEventsConfig(enable_kv_cache_events=True, vllm_version="0.11").publisher == "null"
    assert KVEventsConfig(enable_kv_cache_events=True, vllm_version="0.33").publisher == "zmq"
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig(vllm_version="0.33").publisher == "null"
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", vllm_version="0.11").publisher == "zmq"


def test_an_unknown_publisher_name_is_refused():
    # vLLM's EventPublisherFactory raises on a name it has no publisher for ("kafka").
    with pytest.raises(ValueError, match="unknown event publisher 'kafka'"):
        KVEventsConfig(enable_kv_cache_events=True, publisher="kafka")  # type: ignore[arg-type]
