"""The fault campaign through a relay and a stream that fills up (see
``stream_campaign.py``; ``bench/soak_faults.py --stream`` runs 100,000+ seeds)."""

from __future__ import annotations

import pytest

from kvstream.jetstream import RelaySource, wire
from kvstream.jetstream.tracking import StreamSource
from kvstream.transport import SourceBatch, SourceReset, SourceStale
from kvstream.wire.events import BlockStored, KVEventBatch, decode_batch, encode_batch

from tests.jetstream.stream_campaign import FAULTS, run_seed
from tests.transport.fault_campaign import Stats


def test_a_few_hundred_seeds_through_a_full_stream_never_leave_a_consumer_live_and_wrong():
    total = Stats()
    for seed in range(300):
        total.add(run_seed(seed))
    assert total.silent_wrong == 0
    assert set(FAULTS) <= set(total.faults), total.faults
    assert total.faults["relay_gave_up"] > 20 and total.states["js_live"] > total.states["js_stale"] > 0


@pytest.mark.parametrize("seed,case", [
    (4, "a snapshot join of a restarted engine tagged below the relay's position is a new instance "
        "(in the old one, consumers took its reset for a late copy and stayed live with the old blocks)"),
    (54, "a restart the relay could not confirm, then a stale notice: the stream says the state is "
         "unverified (it said nothing, and consumers stayed live with the old engine's blocks)"),
    (26, "the same, with a full stream"),
    (9637, "a restarted engine's first batch held while a gap request failed: the subscriber's stale "
           "notice resumed below its next seq, and the relay published the new instance's batches as "
           "the old one's (consumers read the notice as covered and stayed live)"),
    (8, "after a restart the relay doubted, a snapshot exactly at its position is a new instance (its "
        "reset had the id of the one stored before, and the stream dropped it as a copy)"),
    (5071, "the relay's memory of its last stale notice outlived a new instance: a later instance's "
           "batch at the notice's position was taken for one the notice skipped, and the restart "
           "never reached the stream"),
    (91499, "two restarts within a millisecond: the doubting relay found the batch at its position "
            "equal and the engine's seq 0 older by its clock, and kept the first new instance's seq 0 "
            "in the stream; a seq it published with other bytes is now a new engine"),
])
def test_regression_seed(seed, case):
    assert run_seed(seed).silent_wrong == 0, case


def test_with_forwarders_hiding_restarts_no_consumer_is_live_and_wrong():
    """Sources behind a forwarder (``hidden_restarts``) relayed through the full stream: the
    subscriber's restart found late used to leave an old batch in the stream (the known limit
    this campaign excluded)."""
    total = Stats()
    for seed in range(200):
        total.add(run_seed(seed, forwarders=True))
    assert total.silent_wrong == 0
    assert total.faults["hidden_restart"] > 0 and total.states["js_live"] > 0


@pytest.mark.parametrize("seed", [28832, 36063])
def test_forwarder_regression_seed(seed):
    """Behind a forwarder that hides restarts, after a doubted restart, the subscriber's
    join held an older instance's live seqs 1-7 (or 2-6), a newer instance's seq 0 filled
    the gap, and the snapshot the subscriber then asked for was refused: its stale notice
    resumed at 0 and the held batches of two instances followed it (the subscriber stale,
    rightly). The relay found the seq 0 it had published with other bytes, took it for a new
    engine and published a restart reset, which made the stream consumer live again with
    3-4 blocks the engine does not hold. A new instance the relay infers while the
    subscriber is stale is now published stale (a reset, then a notice)."""
    assert run_seed(seed, forwarders=True).silent_wrong == 0


def _b(seq: int, ts: float, h: int, replayed: bool = False) -> SourceBatch:
    batch = KVEventBatch(ts, [BlockStored([h], None, list(range(16)), 16, None, "GPU", None)])
    return SourceBatch("e0", seq, b"kv", encode_batch(batch), batch, replayed)


def test_a_doubted_restart_with_other_bytes_below_the_position_is_a_new_instance():
    """Seed 91499's rule, on the relay alone: the stream has seq 0 of one instance and 1-4
    of the next (a join answered by it); the engine's own seq 0 is older by its clock than
    the stream's last batch, and seq 4 matches. Other bytes at a seq the relay published in
    this instance are another engine: a restart reset, then every batch again."""
    r = RelaySource("e0")
    r.on_item(_b(0, 1.0, 100))
    for q in range(1, 5):
        r.on_item(_b(q, 2.0 + q / 10, 200 + q, replayed=True))
    assert r.on_item(SourceReset("e0", "restart", 1)) == []
    out = r.on_item(_b(0, 2.05, 200, replayed=True))  # older than the last batch (2.4), other bytes
    assert [h.get(wire.H_KIND) for _, h in out] == ["reset", None]
    assert out[1][1][wire.H_INSTANCE] == "1" and out[1][1][wire.H_SEQ] == "0"
    for q in range(1, 5):
        [(_, h)] = r.on_item(_b(q, 2.0 + q / 10, 200 + q, replayed=True))
        assert (h[wire.H_INSTANCE], h[wire.H_SEQ]) == ("1", str(q))


def test_a_doubted_restart_with_the_same_bytes_below_the_position_goes_on_in_the_instance():
    r = RelaySource("e0")
    for q in range(5):
        r.on_item(_b(q, 1.0 + q / 10, 100 + q))
    r.on_item(SourceReset("e0", "restart", 0))
    for q in range(5):
        assert r.on_item(_b(q, 1.0 + q / 10, 100 + q, replayed=True)) == []
    [(_, h)] = r.on_item(_b(5, 1.5, 105))
    assert (h[wire.H_INSTANCE], h[wire.H_SEQ]) == ("0", "5") and r.skipped == 5


def test_the_published_payloads_kept_for_that_check_stay_within_their_byte_bound():
    r = RelaySource("e0")
    r.max_recent_bytes = 10_000
    size = len(_b(0, 1.0, 0).payload)
    for q in range(2_000):
        r.on_item(_b(q, 1.0 + q, q))
        assert r._recent_bytes <= r.max_recent_bytes and r._recent_bytes == sum(map(len, r._recent.values()))
    assert 1_999 in r._recent and len(r._recent) >= 10_000 // 2 // size


def test_a_new_instance_found_while_the_subscriber_is_stale_stays_stale_on_the_stream():
    """28832's rule on the relay alone: after a doubted restart and the subscriber's stale
    notice, a batch with other bytes at a seq the relay published is a new instance; the
    subscriber vouches for none of what follows its notice, so the reset is followed by a
    stale notice (a consumer then holds the batches but is not live) until the subscriber
    rebuilds (its next reset)."""
    r = RelaySource("e0")
    r.on_item(_b(0, 1.0, 100))
    r.on_item(_b(1, 1.1, 101))
    assert r.on_item(SourceReset("e0", "restart", 0)) == []
    [(_, h)] = r.on_item(SourceStale("e0", "gone", 0, 0))
    assert h[wire.H_KIND] == "stale"
    out = r.on_item(_b(0, 3.0, 300))  # other bytes at a published seq: a new engine
    assert [x[1].get(wire.H_KIND) for x in out] == ["reset", "stale", None]
    assert out[1][1][wire.H_INSTANCE] == out[2][1][wire.H_INSTANCE] == "1"
    nxt = r.on_item(_b(1, 2.0, 201))  # an older instance's seq 1 (28832): published unchecked
    assert [h[wire.H_SEQ] for _, h in nxt] == ["1"]
    # A consumer of these messages is stale from the reset on, and so it stays.
    items: list = []
    ss = StreamSource("e0", decode_batch, items)
    for sseq, (p, h) in enumerate(out + nxt, start=1):
        ss.on_message(sseq, h, p, 0.0)
    assert ss.state.stale and ss.state.instance == 1 and ss.state.expected == 2
    # The subscriber rebuilds (its restart found): a reset clears the mark in the relay too.
    r.on_item(SourceReset("e0", "restart", 0))
    out = r.on_item(_b(0, 4.0, 400))  # doubted again; other bytes at seq 0: a new engine, not stale
    assert [x[1].get(wire.H_KIND) for x in out] == ["reset", None]


def test_a_subscriber_stale_at_start_up_keeps_a_relay_inferred_instance_stale():
    """The start-up path (a relay that knows the stream's position, not doubting): the
    subscriber's stale notice is swallowed while joining, and a newer batch at the position
    is a new engine; it is published stale, not live."""
    r = RelaySource("e0", wire.StreamPosition(0, 3, 1.3, None))
    assert r.on_item(SourceStale("e0", "gone", 0, 0)) == []
    out = r.on_item(_b(0, 5.0, 500))  # newer than the stream's last batch: restarted meanwhile
    assert [x[1].get(wire.H_KIND) for x in out] == ["reset", "stale", None]
