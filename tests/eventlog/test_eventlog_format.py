"""The event log format: round trips, rotation, flush policy, crash safety, zstd."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.eventlog import (
    LogControl,
    LogFormatError,
    LogMessage,
    LogReader,
    LogWriter,
    read_log,
)
from kvstream.eventlog.format import decode_header, encode_header


def _messages(n, *, sources=("e0", "e1"), size=40):
    out = []
    for i in range(n):
        out.append(LogMessage(1_700_000_000_000_000_000 + i * 1000, sources[i % len(sources)],
                              b"kv@peer@model", i // len(sources), bytes([i % 251]) * (size + i % 7),
                              i % 5 == 0))
    return out


def _write(path, records, **kw):
    with LogWriter(path, **kw) as w:
        for r in records:
            if isinstance(r, LogMessage):
                w.write_message(r.source, r.topic, r.seq, r.payload, replayed=r.replayed, recv_ns=r.recv_ns)
            else:
                w.write_control(r.source, r.kind, reason=r.reason, seq=r.seq,
                                first_missing_seq=r.first_missing_seq, resume_seq=r.resume_seq,
                                recv_ns=r.recv_ns)
    return path


def _record_ends(path):
    """Byte offset just past each record of an uncompressed single-file log."""
    data = path.read_bytes()
    pos = decode_header(data).size
    ends = []
    kinds = []
    while pos < len(data):
        _, n = struct.unpack_from("<II", data, pos)
        kinds.append(data[pos + 8])
        pos += 8 + n
        ends.append(pos)
    # Name records (kind 3) are not yielded; keep the ends of yielded records only.
    return [e for e, k in zip(ends, kinds) if k != 3], decode_header(data).size


def test_messages_and_controls_round_trip_in_order_with_metadata(tmp_path):
    recs = _messages(50) + [
        LogControl(5, "e0", "reset", "restart", 0),
        LogControl(6, "e1", "stale", "replay buffer overrun", None, 10, 17),
        LogControl(7, "e1", "reset", "snapshot", None),
        LogControl(8, "e1", "live", "", 42),
    ] + _messages(5, sources=("newsource",))
    p = _write(tmp_path / "a.kvlog", recs, metadata={"endpoints": ["tcp://x:1"], "topic": "kv"})
    r = LogReader(p)
    assert list(r) == recs
    assert r.damage == []
    assert r.metadata == {"endpoints": ["tcp://x:1"], "topic": "kv"}
    assert r.headers[0].version == 2 and not r.headers[0].compressed


def test_rotation_by_size_reads_back_as_one_stream_and_each_segment_names_its_sources(tmp_path):
    recs = _messages(400)
    d = _write(tmp_path / "log", recs, rotate_bytes=2000, flush="close")
    segs = sorted(os.listdir(d))
    assert len(segs) > 5 and segs[0] == "000000.kvlog"
    got, damage = read_log(d)
    assert got == recs and damage == []
    # A middle segment alone is readable: it re-declares the names it uses.
    alone, dmg = read_log(d / segs[3])
    assert alone and dmg == [] and {m.source for m in alone} == {"e0", "e1"}


def test_rotation_by_time_starts_a_new_segment(tmp_path):
    w = LogWriter(tmp_path / "log", rotate_seconds=0.001, flush="record")
    w.write_message("e", b"t", 0, b"a")
    import time

    time.sleep(0.005)
    w.write_message("e", b"t", 1, b"b")
    w.close()
    assert len(os.listdir(tmp_path / "log")) >= 2
    assert [m.seq for m in read_log(tmp_path / "log")[0]] == [0, 1]


def test_a_missing_middle_segment_is_reported(tmp_path):
    d = _write(tmp_path / "log", _messages(400), rotate_bytes=2000, flush="close")
    (d / "000002.kvlog").unlink()
    _, damage = read_log(d)
    assert any("segments 2..2 are missing" in x.reason for x in damage)


def test_flush_policy_record_puts_each_record_on_disk_immediately(tmp_path):
    p = tmp_path / "a.kvlog"
    w = LogWriter(p, flush="record")
    w.write_message("e", b"t", 0, b"x" * 10)
    assert [m.seq for m in read_log(p)[0]] == [0]  # readable while the writer is still open
    w.close()


def test_flush_policy_close_keeps_records_in_memory_until_close(tmp_path):
    p = tmp_path / "a.kvlog"
    w = LogWriter(p, flush="close")
    for i in range(10):
        w.write_message("e", b"t", i, b"x" * 10)
    assert read_log(p)[0] == []
    w.close()
    assert len(read_log(p)[0]) == 10


def test_flush_policy_interval_flushes_on_poll_after_the_interval(tmp_path):
    import time

    p = tmp_path / "a.kvlog"
    w = LogWriter(p, flush="interval", flush_interval=0.01)
    w.write_message("e", b"t", 0, b"x")
    w.flush()
    w.write_message("e", b"t", 1, b"x")
    assert len(read_log(p)[0]) == 1
    time.sleep(0.02)
    w.poll()
    assert len(read_log(p)[0]) == 2
    w.close()


def test_existing_log_is_not_overwritten(tmp_path):
    p = _write(tmp_path / "a.kvlog", _messages(3))
    with pytest.raises(FileExistsError, match="resume=True"):
        LogWriter(p)


def test_not_a_log_and_newer_version_are_format_errors(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"hello world, not a log at all" * 3)
    with pytest.raises(LogFormatError, match="not a kvstream event log"):
        list(LogReader(p))
    head = bytearray(encode_header(flags=0, segment_index=0, log_id=1, created_ns=0, metadata={}))
    struct.pack_into("<H", head, 8, 99)
    from kvstream.eventlog.format import checksum

    struct.pack_into("<I", head, len(head) - 4, checksum(head[:-4]))
    p.write_bytes(bytes(head))
    with pytest.raises(LogFormatError, match="version 99 is newer"):
        list(LogReader(p))


def test_writer_resumes_after_a_torn_tail_and_the_log_reads_clean(tmp_path):
    p = _write(tmp_path / "a.kvlog", _messages(20))
    data = p.read_bytes()
    p.write_bytes(data[:-7])  # power cut mid-record
    w = LogWriter(p, resume=True)
    assert len(w.recovered) == 1 and "truncated" in w.recovered[0].reason
    w.write_message("e0", b"kv@peer@model", 99, b"after")
    w.write_message("brand-new", b"kv@peer@model", 0, b"new source after resume")
    w.close()
    got, damage = read_log(p)
    assert damage == []
    assert got[:19] == _messages(20)[:19]
    assert [(m.source, m.seq) for m in got[19:]] == [("e0", 99), ("brand-new", 0)]


def test_directory_log_resumes_in_a_new_segment_after_cutting_the_tail(tmp_path):
    d = _write(tmp_path / "log", _messages(100), rotate_bytes=1500, flush="close")
    last = sorted(d.iterdir())[-1]
    last.write_bytes(last.read_bytes()[:-3])
    w = LogWriter(d, resume=True, rotate_bytes=1500)
    w.write_message("e0", b"kv@peer@model", 1000, b"resumed")
    w.close()
    got, damage = read_log(d)
    assert damage == []
    assert got[-1].seq == 1000 and got[:-2] == _messages(100)[:-1]


def test_zero_filled_tail_is_detected(tmp_path):
    p = _write(tmp_path / "a.kvlog", _messages(5))
    size = p.stat().st_size
    with open(p, "ab") as f:
        f.write(b"\0" * 4096)
    got, damage = read_log(p)
    assert len(got) == 5
    assert damage[0].offset == size and "zero-filled" in damage[0].reason


def test_zstd_segments_round_trip_and_resume(tmp_path):
    pytest.importorskip("zstandard")
    recs = _messages(300)
    p = _write(tmp_path / "z.kvlog", recs, compression="zstd", flush="close")
    plain = _write(tmp_path / "p.kvlog", recs)
    assert p.stat().st_size < plain.stat().st_size
    assert read_log(p) == (recs, [])
    # A torn zstd chunk is dropped as a unit; earlier chunks survive.
    chunk_at = p.stat().st_size
    w = LogWriter(p, resume=True, compression="zstd", flush="close")
    w.write_message("e0", b"t", 1, b"second chunk")
    w.close()
    data = p.read_bytes()
    p.write_bytes(data[:-2])
    got, damage = read_log(p)
    assert got == recs and damage and all(d.offset >= chunk_at for d in damage)


def test_resume_with_different_compression_on_a_single_file_is_refused(tmp_path):
    pytest.importorskip("zstandard")
    p = _write(tmp_path / "a.kvlog", _messages(3))
    with pytest.raises(LogFormatError, match="same compression"):
        LogWriter(p, resume=True, compression="zstd")


# -- crash safety, property-based ---------------------------------------------------

_RECS = _messages(60, sources=("engine-a", "engine-b", "engine-c")) + [
    LogControl(1, "engine-a", "stale", "loss", None, 3, 9)] + _messages(20, sources=("engine-a",))


@pytest.fixture(scope="module")
def intact_log(tmp_path_factory):
    p = _write(tmp_path_factory.mktemp("crash") / "intact.kvlog", _RECS)
    ends, header_size = _record_ends(p)
    return p.read_bytes(), ends, header_size


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.data())
def test_truncation_at_any_offset_recovers_every_complete_record(tmp_path_factory, intact_log, cut):
    data, ends, header_size = intact_log
    at = cut.draw(st.integers(0, len(data)))
    p = tmp_path_factory.mktemp("t") / "cut.kvlog"
    p.write_bytes(data[:at])
    if at < header_size:  # a crash while the header was written: no records, damage at 0
        got, damage = read_log(p)
        assert got == [] and len(damage) == 1 and damage[0].offset == 0
        return
    got, damage = read_log(p)
    complete = sum(1 for e in ends if e <= at)
    assert got == _RECS[:complete]
    last_end = max([header_size] + [e for e in _all_ends(data, header_size) if e <= at])
    if last_end == at:
        assert damage == []
    else:
        assert len(damage) == 1 and damage[0].offset == last_end and damage[0].lost_bytes == at - last_end


def _all_ends(data, pos):
    out = []
    while pos < len(data):
        _, n = struct.unpack_from("<II", data, pos)
        pos += 8 + n
        out.append(pos)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.data())
def test_corruption_at_any_offset_costs_only_the_damaged_record(tmp_path_factory, intact_log, where):
    data, ends, header_size = intact_log
    at = where.draw(st.integers(0, len(data) - 1))
    flip = where.draw(st.integers(1, 255))
    bad = bytearray(data)
    bad[at] ^= flip
    p = tmp_path_factory.mktemp("c") / "bad.kvlog"
    p.write_bytes(bytes(bad))
    if at < header_size:
        try:
            got, damage = read_log(p)
        except LogFormatError as exc:  # the magic itself was hit
            assert at < 8 and "not a kvstream event log" in str(exc)
            return
        # A damaged header costs the header only: every record still verifies and is read.
        assert got == _RECS
        assert len(damage) == 1 and damage[0].offset == 0 and "header" in damage[0].reason
        return
    got, damage = read_log(p)
    starts = [header_size] + _all_ends(data, header_size)
    damaged_start = max(s for s in starts if s <= at)
    damaged_end = min(e for e in starts if e > at)
    assert damage[0].offset == damaged_start
    if data[damaged_start + 8] == 3:  # a name record: the records that use the name are lost too
        assert all(r in _RECS for r in got) and len(got) < len(_RECS)
        return
    index = sum(1 for e in ends if e <= damaged_start)
    assert got == _RECS[:index] + _RECS[index + 1:]
    assert len(damage) == 1 and damage[0].lost_bytes == damaged_end - damaged_start


@pytest.mark.parametrize("flip", [1, 45, 128, 255])
def test_a_damaged_metadata_length_in_the_header_costs_no_record(tmp_path, intact_log, flip):
    # The header's metadata length is the last field before the metadata; a damaged one
    # pointed the salvage at a later record, and the skipped name records took every
    # message with them (found by the property test above: XOR 45 at byte 32).
    data, ends, header_size = intact_log
    for at in range(header_size - 4 - 2 - 4, header_size - 4 - 2):  # the u32 length; metadata b"{}"
        bad = bytearray(data)
        bad[at] ^= flip
        p = tmp_path / f"bad{at}.kvlog"
        p.write_bytes(bytes(bad))
        got, damage = read_log(p)
        assert got == _RECS, at
        assert len(damage) == 1 and damage[0].offset == 0 and "header" in damage[0].reason
