"""The subscriber: many sources, topic filter, ordering, health, and the recovery state
machine (sans-IO rules first, then on real sockets)."""

from __future__ import annotations

import anyio
import pytest

from kvstream.errors import LocalProtocolError

from kvstream.wire.events import BlockStored, KVEventBatch, encode_batch
from kvstream.transport import (
    KVEventsConfig,
    Publisher,
    SourceBatch,
    SourceLive,
    SourceReset,
    SourceSpec,
    SourceStale,
    SourceTracker,
    Subscriber,
)

from tests.transport.zmq_helpers import batches_of, collect, ipc

pytestmark = pytest.mark.anyio



def _batch(h: int, ts: float = 1.0) -> KVEventBatch:
    return KVEventBatch(ts, [BlockStored([h], None, list(range(16)), 16, None, "GPU", None)])


# -- the state machine, without sockets ------------------------------------------------


def _live(t: SourceTracker, seq: int, h: int | None = None) -> None:
    b = _batch(seq if h is None else h)
    t.on_live(seq, b"t", encode_batch(b), b, 2.0)


def _reply(t: SourceTracker, seq: int, h: int | None = None) -> None:
    b = _batch(seq if h is None else h)
    t.on_reply(seq, b"t", encode_batch(b), b)


def _sent(t: SourceTracker):
    req = t.inflight
    assert req is not None
    req.sent = True
    return req


def _kinds(out):
    return [(type(i).__name__, getattr(i, "seq", None)) for i in out]


def _serve(t: SourceTracker, published: dict[int, int], *, drop: set[int] = frozenset(), end: bool = True) -> None:
    """Answer the tracker's outstanding replay request like a publisher whose buffer holds
    ``published`` (seq -> hash), losing the replies in ``drop`` (and the end marker if not
    ``end``)."""
    req = _sent(t)
    assert req.kind == "replay"
    for s in sorted(published):
        if s >= req.start and s not in drop:
            _reply(t, s, published[s])
            if t.inflight is not req:
                return
    if end:
        t.on_reply_end()


def test_gap_requests_replay_from_the_anchor_and_drops_overlap():
    t = SourceTracker("s", has_replay=True)
    _live(t, 0)
    _live(t, 1)
    _live(t, 4)  # 2 and 3 lost
    req = t.inflight
    # From the anchor (seq 1, already yielded): its bytes prove the same publisher.
    assert (req.kind, req.start, t.state) == ("replay", 1, "recovering")
    _live(t, 5)  # held while recovering
    _serve(t, {s: s for s in range(5)})
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)] == [0, 1, 2, 3, 4, 5]
    assert [i.replayed for i in t.out if isinstance(i, SourceBatch)] == [False, False, True, True, False, False]
    assert isinstance(t.out[-1], SourceLive) and t.state == "live"
    assert t.counters.gaps == 1 and t.counters.duplicates == 1


def test_live_duplicate_of_a_replayed_batch_is_dropped_but_different_bytes_mean_restart():
    t = SourceTracker("s", has_replay=True)
    t.start()  # joining: replay from 0
    _serve(t, {s: s for s in range(5)})
    _live(t, 3)  # the same batch arriving late on the live socket
    assert t.counters.duplicates == 1 and t.counters.restarts == 0
    _live(t, 4, h=999)  # seq 4 again but other content: a new engine
    assert t.counters.restarts == 1
    assert _kinds(t.out)[-1] == ("SourceReset", 4)
    assert t.inflight is not None and t.inflight.start == 0  # rebuild from the new engine's 0


def test_seq_going_backwards_on_the_live_socket_with_other_bytes_is_a_restart():
    t = SourceTracker("s", has_replay=False)
    for s in range(3):
        _live(t, s)
    _live(t, 0, h=100)
    assert _kinds(t.out)[-2:] == [("SourceReset", 0), ("SourceBatch", 0)]
    assert t.counters.restarts == 1 and t.state == "live"


def test_a_duplicated_or_late_live_message_with_the_same_bytes_is_a_duplicate_not_a_restart():
    """Bytes first (issue 23 item 7): a copy of a yielded seq is dropped, whatever seq
    the live socket reached since."""
    for has_replay in (False, True):
        t = SourceTracker("s", has_replay=has_replay)
        for s in range(5):
            _live(t, s)
            if s:
                _live(t, s - 1)  # a late copy of the previous one
        _live(t, 2)
        assert t.counters.restarts == 0 and t.counters.duplicates == 5 and t.state == "live"
        assert [i.seq for i in t.out if isinstance(i, SourceBatch)] == [0, 1, 2, 3, 4]


def test_a_reordered_live_message_fills_its_gap_checked_by_the_replay():
    t = SourceTracker("s", has_replay=True)
    _live(t, 0)
    _live(t, 2)  # 1 comes later (a forwarder reordered them): a gap for now
    assert t.state == "recovering"
    _live(t, 1)
    assert t.counters.reordered == 1 and t.counters.restarts == 0
    _serve(t, {0: 0, 1: 1, 2: 2})
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)] == [0, 1, 2]
    assert t.counters.restarts == 0 and t.state == "live"


def test_a_reordered_live_message_that_the_replay_contradicts_is_a_restart():
    t = SourceTracker("s", has_replay=True)
    _live(t, 0)
    _live(t, 2)
    _live(t, 1, h=100)  # held: the publisher's replay says otherwise
    _serve(t, {0: 0, 1: 1, 2: 2})
    assert t.counters.restarts == 1


def test_replay_that_starts_late_falls_back_to_snapshot_then_stale_when_unsupported():
    t = SourceTracker("s", has_replay=True)
    _live(t, 0)
    _live(t, 10)
    # 0..4 rotated out of the publisher's buffer: the anchor (0) is not in the reply, so
    # nothing in it is trusted (it could be a new instance's).
    _serve(t, {s: s for s in range(5, 11)})
    req = _sent(t)
    assert req.kind == "snapshot"
    t.on_reply_end()  # end marker only: unsupported (what vLLM answers)
    stale = [i for i in t.out if isinstance(i, SourceStale)]
    assert len(stale) == 1 and (stale[0].first_missing_seq, stale[0].resume_seq) == (1, 10)
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)] == [0, 10]
    assert t.state == "stale"


def test_snapshot_reply_resets_fetches_its_anchor_and_resumes_after_its_seq():
    t = SourceTracker("s", has_replay=True)
    _live(t, 0)
    _live(t, 10)
    _serve(t, {7: 7, 8: 8, 9: 9, 10: 10})  # the anchor (0) is gone: snapshot
    _sent(t)
    _reply(t, 11, h=100)  # snapshot batches, tagged R = 11 (the publisher's next seq)
    _reply(t, 11, h=101)
    _live(t, 11)  # arrives while the snapshot is being answered
    t.on_reply_end()
    assert _kinds(t.out)[1:] == [("SourceReset", 11), ("SourceBatch", 10), ("SourceBatch", 10)]
    req = t.inflight
    assert (req.kind, req.start, req.purpose) == ("replay", 10, "anchor")  # the bytes of R - 1
    _serve(t, {10: 10, 11: 11})
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)][-1:] == [11]
    assert t.state == "live" and not t.stale and t.counters.duplicates == 1


def test_a_snapshot_tagged_below_a_seq_seen_live_is_another_instance():
    """Item 3: the snapshot's publisher had not yet published a seq we had received."""
    t = SourceTracker("s", has_replay=True)
    _live(t, 0)
    _live(t, 10)
    _serve(t, {7: 7})
    _sent(t)
    _reply(t, 3, h=100)  # a restarted engine at seq 3 answers
    t.on_reply_end()
    assert ("SourceReset", 3) in _kinds(t.out) and t.counters.restarts == 1
    assert t.inflight.purpose == "join"


def test_without_replay_endpoint_a_gap_marks_the_source_stale():
    t = SourceTracker("s", has_replay=False)
    _live(t, 0)
    _live(t, 3)
    assert _kinds(t.out) == [("SourceBatch", 0), ("SourceStale", None), ("SourceBatch", 3)]
    assert t.out[1].first_missing_seq == 1 and t.out[1].resume_seq == 3 and t.state == "stale"


# -- on real sockets ---------------------------------------------------------------------


async def test_many_publishers_are_followed_at_once_in_order_per_source(tmp_path):
    cfgs = [KVEventsConfig(endpoint=ipc(tmp_path, f"p{i}"), replay_endpoint=ipc(tmp_path, f"r{i}"), topic="kv")
            for i in range(3)]
    # ipc endpoints cannot be offset for rank > 0 (vLLM's rule): rank 1 uses tcp.
    cfgs[1] = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv")
    with anyio.fail_after(30):
        async with Publisher(cfgs[0], data_parallel_rank=0) as p0, \
                Publisher(cfgs[1], data_parallel_rank=1) as p1, Publisher(cfgs[2]) as p2:
            pubs = [p0, p1, p2]
            for k, p in enumerate(pubs):
                for i in range(20):
                    p.publish(_batch(k * 1000 + i))  # before the subscriber: fetched by replay
            specs = [SourceSpec(p.endpoint, p.replay_endpoint, name=f"e{k}") for k, p in enumerate(pubs)]
            async with Subscriber(specs, topic="kv") as sub:
                await collect(sub, lambda it: sum(isinstance(i, SourceLive) for i in it) == 3)
                for i in range(20, 50):
                    for k, p in enumerate(pubs):
                        p.publish(_batch(k * 1000 + i))
                items = await collect(sub, lambda it: len(batches_of(it)) == 90)
                health = sub.health()
    for k in range(3):
        got = batches_of(items, f"e{k}")
        assert [b.seq for b in got] == list(range(20, 50))
        assert [b.batch.events[0].block_hashes[0] for b in got] == [k * 1000 + i for i in range(20, 50)]
    assert [b.batch.data_parallel_rank for b in batches_of(items, "e1")][:1] == [1]
    assert {h.state for h in health.values()} == {"live"}
    assert health["e0"].counters["batches"] == 50 and health["e0"].last_seq == 49


async def test_topic_filter_ignores_other_topics_live_and_replayed(tmp_path):
    """Item 6: the filter applies to replays too (a joining subscriber used to receive the
    other topic's buffered batches)."""
    ca = KVEventsConfig(endpoint=ipc(tmp_path, "a"), replay_endpoint=ipc(tmp_path, "ra"), topic="kv@a")
    cb = KVEventsConfig(endpoint=ipc(tmp_path, "b"), replay_endpoint=ipc(tmp_path, "rb"), topic="other")
    with anyio.fail_after(30):
        async with Publisher(ca) as a, Publisher(cb) as b:
            b.publish(_batch(10))  # buffered before the subscriber joins: fetched by the join replay
            a.publish(_batch(20))
            specs = [SourceSpec(a.endpoint, a.replay_endpoint, name="a"),
                     SourceSpec(b.endpoint, b.replay_endpoint, name="b")]
            async with Subscriber(specs, topic="kv@") as sub:
                await sub.wait_connected()
                b.publish(_batch(1))
                a.publish(_batch(2))
                items = await collect(sub, lambda it: len(batches_of(it)) == 2)
                # b's replay socket answers (probe after its live message): still nothing of b.
                await sub.wait_state("b", "live")
                health = sub.health()
                assert [i for i in sub.get_nowait() if isinstance(i, SourceBatch)] == []
    got = batches_of(items)
    assert [(i.source, i.topic, i.seq) for i in got] == [("a", b"kv@a", 0), ("a", b"kv@a", 1)]
    assert health["b"].counters["filtered"] >= 1 and health["b"].counters["batches"] == 0


async def test_lag_is_measured_from_receive_time_not_from_the_batch_timestamp(tmp_path):
    """Item 5: a batch recorded long ago (a replayed log) is not "lag"; lag is how long
    the batch waited in the subscriber for the consumer."""
    import time

    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "a"), replay_endpoint=ipc(tmp_path, "ra"))
    with anyio.fail_after(30):
        async with Publisher(cfg) as a:
            async with Subscriber([SourceSpec(a.endpoint, a.replay_endpoint, name="a")]) as sub:
                await sub.wait_connected()
                a.publish(_batch(1, ts=time.time() - 161.0))
                await collect(sub, lambda it: len(batches_of(it)) == 1)
                lag = sub.health()["a"].counters["lag_s"]
    # The batch says 161 s old; its wait here is short (bounded loosely: a loaded machine
    # may hold this process off the CPU for seconds).
    assert 0.0 <= lag < 30.0


async def test_sources_can_be_added_and_removed_while_running(tmp_path):
    ca = KVEventsConfig(endpoint=ipc(tmp_path, "a"), replay_endpoint=ipc(tmp_path, "ra"))
    cb = KVEventsConfig(endpoint=ipc(tmp_path, "b"), replay_endpoint=ipc(tmp_path, "rb"))
    with anyio.fail_after(30):
        async with Publisher(ca) as a, Publisher(cb) as b:
            async with Subscriber([SourceSpec(a.endpoint, a.replay_endpoint, name="a")]) as sub:
                sub.add_source(SourceSpec(b.endpoint, b.replay_endpoint, name="b"))
                await sub.wait_connected()
                a.publish(_batch(1))
                b.publish(_batch(2))
                await collect(sub, lambda it: len(batches_of(it)) == 2)
                sub.remove_source("a")
                items = await collect(sub, lambda it: True)
                assert sub.sources == ["b"]
                with pytest.raises(KeyError, match="no source named 'a'"):
                    sub.remove_source("a")
    assert items == [SourceReset("a", "removed", None)]


async def test_an_unreachable_replay_endpoint_marks_only_that_source_stale(tmp_path):
    cb = KVEventsConfig(endpoint=ipc(tmp_path, "b"), replay_endpoint=ipc(tmp_path, "rb"))
    with anyio.fail_after(30):
        async with Publisher(KVEventsConfig(endpoint=ipc(tmp_path, "a"))) as a, Publisher(cb) as b:
            specs = [SourceSpec(a.endpoint, ipc(tmp_path, "nobody"), name="a"),
                     SourceSpec(b.endpoint, b.replay_endpoint, name="b")]
            async with Subscriber(specs, replay_timeout_s=0.2, max_retries=1, backoff_s=0.01) as sub:
                await sub.wait_connected("b")
                assert sub.state("a") == "connecting"  # nothing heard from a yet
                a.publish(_batch(0))
                a._queue.clear()  # seq 1 never reaches the wire (0 may be lost too: slow joiner)
                a.publish(_batch(1))
                a.publish(_batch(2))
                b.publish(_batch(3))
                # b is not held up by a's recovery
                first = await collect(sub, lambda it: any(isinstance(i, SourceBatch) and i.source == "b" for i in it))
                items = first + await collect(sub, lambda it: any(isinstance(i, SourceStale) for i in it))
                health = sub.health()
    assert any(isinstance(i, SourceBatch) and i.source == "b" for i in first)
    (stale,) = [i for i in items if isinstance(i, SourceStale)]
    assert stale.source == "a" and "no answer" in stale.reason
    assert health["a"].counters["timeouts"] >= 2 and health["b"].state == "live"
    assert health["a"].state == "stale"


async def test_a_source_without_a_publisher_is_connecting_never_live(tmp_path):
    """Item 5: no publisher at all (a port nobody listens on, an unresolvable host, a
    failed CURVE handshake) is "connecting" until something arrives, never "live"."""
    from kvstream.transport import CurveClientConfig, CurveServerConfig
    from kvstream.transport.curve import generate_keypair

    server, wrong, me = generate_keypair(), generate_keypair(), generate_keypair()
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                         curve=CurveServerConfig(secret_key=server[1], public_key=server[0]))
    bad_key = CurveClientConfig(server_public_key=wrong[0], secret_key=me[1], public_key=me[0])
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            pub.publish(_batch(1))
            specs = [SourceSpec(f"ipc://{tmp_path}/nobody.sock", name="no-pub"),
                     SourceSpec("tcp://127.0.0.1:99999", name="port-99999"),  # ZMQ accepts it
                     SourceSpec("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", name="closed-port"),
                     SourceSpec("tcp://no-such-host.invalid:5557", "tcp://no-such-host.invalid:5558",
                                name="no-host"),
                     SourceSpec(pub.endpoint, pub.replay_endpoint, name="bad-curve", curve=bad_key)]
            async with Subscriber(specs, replay_timeout_s=0.2, backoff_s=0.01) as sub:
                for name in sub.sources:
                    with pytest.raises(TimeoutError, match="still 'connecting'"):
                        await sub.wait_state(name, "live", "stale", "recovering", timeout_s=0.6)
                health = sub.health()
    assert {h.state for h in health.values()} == {"connecting"}
    assert all(h.counters["batches"] == 0 and h.counters["stale_marks"] == 0 for h in health.values())
    assert health["closed-port"].counters["timeouts"] >= 1


async def test_wait_state_rejects_unknown_states_and_sources(tmp_path):
    async with Subscriber([SourceSpec(ipc(tmp_path, "x"), name="x")]) as sub:
        with pytest.raises(LocalProtocolError, match="unknown state"):
            await sub.wait_state("x", "alive")
        with pytest.raises(KeyError, match="no source named 'y'"):
            await sub.wait_state("y")


def test_a_hostile_snapshot_tag_cannot_silence_a_source():
    """Item 3: a snapshot tagged 2**63 would make every later seq a "duplicate"; the tag
    must be backed by a batch the publisher holds (the anchor fetch), else it is a restart."""
    t = SourceTracker("s", has_replay=True)
    _live(t, 0)
    _live(t, 10)
    _serve(t, {5: 5})  # the anchor is gone: snapshot
    _sent(t)
    _reply(t, 2**63, h=100)
    t.on_reply_end()
    req = t.inflight
    assert (req.purpose, req.start) == ("anchor", 2**63 - 1)
    _serve(t, {11: 11})  # the publisher has nothing at 2**63 - 1: the tag was a lie
    assert t.counters.restarts == 1 and t.inflight.purpose == "join"
    _serve(t, {s: s + 1000 for s in range(12)})
    _live(t, 12, h=1012)
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)][-13:] == list(range(13))
    assert t.state == "live"


def test_a_live_seq_below_a_snapshot_is_verified_not_assumed_a_duplicate():
    """Item 3: after a snapshot join, the next engine's seqs 0..N used to be dropped as
    duplicates (no bytes compared). A live seq whose bytes are unknown is checked
    against the publisher: the anchor is not there any more, so it is a restart."""
    t = SourceTracker("s", has_replay=True)
    t.start()
    _serve(t, {s: s for s in range(90, 100)})  # joined late: rotated, snapshot
    _sent(t)
    _reply(t, 100, h=7)
    t.on_reply_end()
    _serve(t, {99: 99})  # the anchor: bytes of seq 99
    assert t.state == "live" and t.expected == 100
    _live(t, 0, h=500)  # the engine restarted: its seq 0
    req = t.inflight
    assert (req.purpose, req.start, req.check) == ("verify", 99, hash(encode_batch(_batch(99))))
    _serve(t, {0: 500})  # the new engine has no seq 99
    assert t.counters.restarts == 1


def test_health_states_connecting_recovering_live_stale():
    t = SourceTracker("s", has_replay=True)
    assert t.state == "connecting"
    t.start()
    _sent(t)
    assert t.state == "connecting"  # asked, not answered
    t.on_reply_end()
    assert t.state == "live"
    _live(t, 0)
    _live(t, 2)
    assert t.state == "recovering"
    t2 = SourceTracker("n", has_replay=False)
    assert t2.state == "connecting"
    _live(t2, 0)
    _live(t2, 5)
    assert t2.state == "stale"


def test_replies_dropped_mid_replay_are_asked_again_then_proven_gone_only_by_a_late_start():
    """Item 1, the rule: a complete answer that skips E after sending something before it
    lost replies on the way (ask again); only an answer to a request at or below E whose
    first seq is above E proves the loss."""
    t = SourceTracker("s", has_replay=True, backoff_s=0.01)
    for s in range(3):
        _live(t, s)
    _live(t, 20)
    published = {s: s for s in range(21)}
    _serve(t, published, drop={5, 6, 7})  # a hole: 3, 4 yielded, 5..7 lost, 8.. held
    req = t.inflight
    assert (req.kind, req.start, req.delay_s) == ("replay", 4, 0.01) and t.counters.retries == 1
    _serve(t, published, end=False)  # the end marker is lost: a cut tail
    t.on_timeout()
    assert t.counters.timeouts == 1 and t.inflight.kind == "replay"
    _serve(t, published)
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)] == list(range(21))
    assert t.state == "live" and t.counters.stale_marks == 0 and t.counters.snapshots == 0


def test_an_idle_probe_after_a_quiet_period_finds_a_lost_tail_and_a_clean_one_says_nothing():
    """Item 2: probes are timed by the caller's clock, one tiny request per quiet period
    (doubling up to probe_max_s)."""
    t = SourceTracker("s", has_replay=True, probe_after_s=0.5, probe_max_s=4.0)
    t.start(0.0)
    _serve(t, {})
    b = _batch(0)
    t.on_live(0, b"t", encode_batch(b), b, 10.0)
    assert t.probe_at() == 10.5
    t.on_tick(10.4)
    assert t.inflight is None
    t.on_tick(10.5)
    assert (t.inflight.purpose, t.inflight.start) == ("probe", 0) and t.state == "live"
    _serve(t, {0: 0, 1: 1, 2: 2})  # 1 and 2 were lost: found
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)] == [0, 1, 2]
    # The live socket lost what the probe found: not "live" until it delivers again or a
    # probe finds nothing new.
    assert t.state == "recovering"
    n = len(t.out)
    assert t.probe_at() == 11.0  # found something: look again soon
    t.on_tick(11.0)
    _serve(t, {0: 0, 1: 1, 2: 2})  # clean: live again, said once
    assert _kinds(t.out[n:]) == [("SourceLive", 2)] and t.state == "live" and t.probe_at() == 12.0
    n = len(t.out)
    t.on_tick(12.0)
    _serve(t, {0: 0, 1: 1, 2: 2})  # clean again: no item at all
    assert len(t.out) == n and t.probe_at() == 14.0


def test_a_probe_nobody_answers_leaves_live_within_the_replay_timeout_and_stale_says_so_once():
    """Issue 24 item 1, issue 29 defect 7: an engine that stopped answering is not "live"
    once its probe timed out, and a dead engine's failing probes give one stale notice,
    never a "live" one."""
    t = SourceTracker("s", has_replay=True, probe_after_s=0.5, probe_max_s=4.0, max_retries=2)
    t.start(0.0)
    _serve(t, {})
    _live(t, 0)
    t.on_tick(2.5)
    assert t.inflight.purpose == "probe" and t.state == "live"
    _sent(t)
    t.on_timeout()  # replay_timeout_s of silence
    assert t.state == "recovering"
    for _ in range(2):
        _sent(t)
        t.on_timeout()
    assert t.state == "stale" and t.inflight is None
    for k in range(5):  # the engine stays dead: probe after probe fails
        at = t.probe_at()
        assert at is not None
        t.on_tick(at)
        assert t.state == "stale"
        for _ in range(3):
            _sent(t)
            t.on_timeout()
            assert t.state == "stale"
    notices = [type(i).__name__ for i in t.out if not isinstance(i, SourceBatch)]
    assert notices == ["SourceLive", "SourceStale"]


def test_a_start_seq_asks_from_its_anchor_and_yields_only_what_follows():
    t = SourceTracker("s", has_replay=True)
    t.start(0.0, start_seq=5)
    req = t.inflight
    assert (req.kind, req.start, req.purpose) == ("replay", 4, "anchor")
    assert t.state == "connecting"
    _serve(t, {s: s for s in range(8)})
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)] == [5, 6, 7]
    assert t.state == "live" and t.counters.restarts == 0
    _live(t, 8)
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)][-1] == 8


def test_a_start_seq_the_publisher_never_reached_is_a_restart_from_zero():
    t = SourceTracker("s", has_replay=True)
    t.start(0.0, start_seq=5)
    _serve(t, {0: 0, 1: 1})  # a new instance: its seqs stop before the anchor
    assert _kinds(t.out) == [("SourceReset", 4)]
    req = t.inflight
    assert (req.start, req.purpose) == (0, "join")
    _serve(t, {0: 0, 1: 1})
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)] == [0, 1] and t.state == "live"


def test_a_start_seq_older_than_the_replay_buffer_asks_for_a_snapshot():
    t = SourceTracker("s", has_replay=True)
    t.start(0.0, start_seq=5)
    _serve(t, {7: 7, 8: 8})  # the anchor is gone
    assert t.inflight.kind == "snapshot" and t.state == "recovering"


async def test_add_source_with_a_start_seq_skips_what_the_caller_holds(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"))
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            for i in range(6):
                pub.publish(_batch(100 + i))
            async with Subscriber() as sub:
                sub.add_source(SourceSpec(pub.endpoint, pub.replay_endpoint, name="p"), start_seq=4)
                items = await collect(sub, lambda it: len(batches_of(it)) == 2)
                await sub.wait_connected("p")
                assert sub.health()["p"].counters["replays"] == 1
                with pytest.raises(ValueError, match="start_seq must be >= 0"):
                    sub.add_source(SourceSpec(pub.endpoint, name="q"), start_seq=-1)
    assert [b.seq for b in batches_of(items)] == [4, 5]  # 0-3 were not asked for


def test_a_start_seq_source_nobody_answers_stays_connecting_and_keeps_asking_its_anchor():
    t = SourceTracker("s", has_replay=True, max_retries=2)
    t.start(0.0, start_seq=5)
    for _ in range(6):
        _sent(t)
        t.on_timeout()
    req = t.inflight
    assert (req.start, req.purpose) == (4, "anchor") and t.state == "connecting" and not t.stale


def test_a_stale_notice_never_resumes_below_the_next_seq():
    """Stream campaign seed 9637: a restarted engine's first live batch (seq 0, bytes unknown)
    was held while a gap request was out; when the request failed, the stale notice resumed
    at the held seq 0, below E, and the old state was continued with the new instance's
    batches (a relay then published them as the old instance's)."""
    t = SourceTracker("s", has_replay=True, max_retries=0)
    t.start(0.0, start_seq=10)  # the bytes of seqs below 9 are unknown
    _serve(t, {s: s for s in range(9, 12)})
    assert t.state == "live" and t.expected == 12
    t.out.clear()
    _live(t, 14)  # 12 and 13 lost: a gap request from the anchor 11
    assert t.inflight is not None and t.inflight.start == 11
    _sent(t)
    _live(t, 0, 1000)  # the new instance's first batch: held, its bytes cannot be checked yet
    t.on_timeout()  # the gap request fails: stale
    stale = [i for i in t.out if isinstance(i, SourceStale)]
    assert len(stale) == 1 and stale[0].first_missing_seq == 12 and stale[0].resume_seq >= 12, t.out
    assert all(i.seq != 0 for i in t.out if isinstance(i, SourceBatch)), _kinds(t.out)
    assert t.state != "live"
    # The held seq 0 is checked against whoever answers now: the new instance has no 14.
    _serve(t, {0: 1000})
    assert ("SourceReset", 0) in _kinds(t.out) or ("SourceReset", 14) in _kinds(t.out), _kinds(t.out)


def test_behind_a_forwarder_a_probe_checks_every_batch_taken_live_since_the_last_check():
    """Forwarder campaign seed 105925: a restart the forwarder hid, whose first batch was lost:
    the new instance's seq 1 continued the old instance's seq 0 without a gap, and probes
    from the anchor only saw the new instance's bytes. With ``hidden_restarts`` a probe
    starts where the last complete check ended."""
    t = SourceTracker("s", has_replay=True, hidden_restarts=True)
    t.start(0.0)
    _serve(t, {})  # an empty publisher
    _live(t, 0, 100)  # the old instance's only batch
    t.on_tick(10.0)
    _serve(t, {0: 100})  # a probe: the old instance still; the chain reaches seq 0
    t.out.clear()
    # The engine restarts behind the forwarder; its seq 0 (bytes 200) is lost, 1 and 2 arrive.
    for s in (1, 2):
        _live(t, s, 200 + s)
    assert t.state == "live" and t.expected == 3
    t.on_tick(20.0)
    req = t.inflight
    assert (req.purpose, req.start) == ("probe", 0)  # not from the anchor 2: from the chain's end
    _serve(t, {0: 200, 1: 201, 2: 202})
    assert ("SourceReset", 0) in _kinds(t.out) and t.counters.restarts == 1
    _serve(t, {0: 200, 1: 201, 2: 202})  # the join rebuilds from the new instance
    assert [i.seq for i in t.out if isinstance(i, SourceBatch)][-3:] == [0, 1, 2] and t.state == "live"


def test_behind_a_forwarder_a_span_the_publisher_no_longer_buffers_is_a_snapshot():
    """Forwarder campaign seed 105606: the batches taken live since the last check left a
    4-step buffer before a probe could compare them: nothing proves they are one engine's,
    so the state is rebuilt from a snapshot (stale without one)."""
    t = SourceTracker("s", has_replay=True, hidden_restarts=True)
    t.start(0.0)
    _serve(t, {})
    for s in range(8):
        _live(t, s)
    t.on_tick(10.0)
    assert t.inflight.start == 0
    _serve(t, {s: s for s in range(4, 8)})
    assert t.inflight is not None and t.inflight.kind == "snapshot" and t.state == "recovering"
    # Without the flag (no forwarder: a restart drops the live connection) the same probe
    # is from the anchor and finds the state exact.
    u = SourceTracker("s", has_replay=True)
    u.start(0.0)
    _serve(u, {})
    for s in range(8):
        _live(u, s)
    u.on_tick(10.0)
    assert u.inflight.start == 7
    _serve(u, {s: s for s in range(4, 8)})
    assert u.inflight is None and u.state == "live"
