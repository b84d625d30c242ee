"""The resume filter's decisions, item by item (sans-IO): what an appended recording
writes for each item its subscriber yields."""

from __future__ import annotations

from kvstream.eventlog.format import LogControl, LogMessage
from kvstream.eventlog.resume import MAX_HELD_ITEMS, ResumeFilter
from kvstream.transport.items import SourceBatch, SourceLive, SourceReset, SourceStale


def _msg(seq, tag=b"a", replayed=False, src="e0"):
    return LogMessage(seq, src, b"", seq, tag + b"%d" % seq, replayed)


def _batch(seq, tag=b"a", src="e0"):
    return SourceBatch(src, seq, b"", tag + b"%d" % seq, None, True)


def _run(f, items):
    out = []
    for it in items:
        out += f.admit(it)
    return out


def test_the_same_engine_replaying_what_the_log_holds_records_only_the_new_seqs():
    f = ResumeFilter.from_records([_msg(i) for i in range(100)])
    out = _run(f, [_batch(i) for i in range(121)])
    assert [b.seq for b in out] == list(range(100, 121)) and f.skipped == 100 and f.restarts == 0


def test_other_bytes_at_a_recorded_seq_is_a_restart_marked_once():
    f = ResumeFilter.from_records([_msg(i) for i in range(10)])
    out = _run(f, [_batch(i, b"new") for i in range(3)])
    assert out[0] == SourceReset("e0", "restart", 0) and [b.seq for b in out[1:]] == [0, 1, 2]
    assert f.restarts == 1


def test_a_gap_between_the_log_and_the_new_recording_is_marked_stale():
    f = ResumeFilter.from_records([_msg(i) for i in range(10)])
    out = _run(f, [_batch(15), _batch(16)])
    assert type(out[0]) is SourceStale and (out[0].first_missing_seq, out[0].resume_seq) == (10, 15)
    assert [b.seq for b in out[1:]] == [15, 16]


def test_stale_items_about_what_the_log_holds_are_dropped_or_narrowed():
    f = ResumeFilter.from_records([_msg(i) for i in range(10)])
    assert f.admit(SourceStale("e0", "gap", 0, 8)) == []
    assert f.admit(SourceStale("e0", "gap", 5, 20)) == [SourceStale("e0", "gap", 10, 20)]


def test_seqs_before_a_recorded_snapshot_wait_for_a_comparable_seq():
    log = [_msg(i) for i in range(10)] + [
        LogControl(0, "e0", "stale", "gap", None, 10, 50), LogControl(0, "e0", "reset", "snapshot", 50),
        _msg(49, b"snapshot", replayed=True), _msg(49, b"snapshot2", replayed=True)] + [_msg(i) for i in range(50, 61)]
    same = ResumeFilter.from_records(log)
    out = _run(same, [_batch(i) for i in range(20, 71)])  # the same engine's buffer: 20..70
    assert [b.seq for b in out] == list(range(61, 71)) and same.restarts == 0
    new = ResumeFilter.from_records(log)
    out = _run(new, [_batch(i, b"new") for i in range(6)] + [SourceLive("e0", 5)])  # a new, short-lived engine
    assert out[0] == SourceReset("e0", "restart", 0) and [b.seq for b in out[1:7]] == list(range(6))
    assert out[-1] == SourceLive("e0", 5)


def test_undecided_batches_are_bounded():
    f = ResumeFilter.from_records([LogControl(0, "e0", "reset", "snapshot", 10 * MAX_HELD_ITEMS)])
    out = []
    for i in range(MAX_HELD_ITEMS + 1):
        out += f.admit(_batch(i))
    assert f.restarts == 1 and len(out) == MAX_HELD_ITEMS + 2 and type(out[0]) is SourceReset


def test_sources_the_log_does_not_know_pass_through():
    f = ResumeFilter.from_records([_msg(i) for i in range(5)])
    assert f.admit(_batch(0, src="e9")) == [_batch(0, src="e9")]
