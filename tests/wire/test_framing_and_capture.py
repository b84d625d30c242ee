"""ZMQ frame shapes and the KVSTRM01 capture reader, against the golden captures."""

from __future__ import annotations

import pytest

from kvstream.wire.capture import CaptureChannel, CaptureFormatError, read_capture, write_capture
from kvstream.wire.framing import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    FrameError,
    decode_seq,
    encode_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
)


def test_golden_011_capture_has_12_live_batches_and_two_replays_without_topic(golden_dir):
    recs = read_capture(golden_dir / "vllm-0.11.0" / "stream.bin")
    live = [parse_live(r.frames) for r in recs if r.channel == CaptureChannel.LIVE]
    assert [m.seq for m in live] == list(range(12))
    assert {m.topic for m in live} == {b"kv@peer@model"}
    requests = [r for r in recs if r.channel == CaptureChannel.REPLAY_REQUEST]
    assert [decode_seq(r.frames[1]) for r in requests] == [6, 17]
    replies = [parse_replay_reply(r.frames) for r in recs if r.channel == CaptureChannel.REPLAY_REPLY]
    assert [x.seq for x in replies if not x.end] == list(range(6, 12))
    assert all(x.topic is None for x in replies)
    assert sum(x.end for x in replies) == 2
    by_seq = {m.seq: m.payload for m in live}
    assert all(x.payload == by_seq[x.seq] for x in replies if not x.end)


def test_golden_033_replies_carry_the_topic_frame(golden_dir):
    recs = read_capture(golden_dir / "vllm-0.33.0" / "stream.bin")
    replies = [parse_replay_reply(r.frames) for r in recs if r.channel == CaptureChannel.REPLAY_REPLY]
    data = [x for x in replies if not x.end]
    assert [x.seq for x in data] == list(range(9, 19))
    assert {x.topic for x in data} == {b"kv@peer@model"}
    ends = [x for x in replies if x.end]
    assert len(ends) == 2 and all(x.topic == b"" and x.seq == END_SEQ for x in ends)


def test_seq_frames_round_trip_and_reject_wrong_lengths():
    assert decode_seq(encode_seq(0)) == 0
    assert decode_seq(encode_seq(2**64 - 1)) == END_SEQ
    with pytest.raises(FrameError, match="8 bytes, got 3"):
        decode_seq(b"\x00\x00\x01")


def test_wrong_frame_counts_are_frame_errors():
    with pytest.raises(FrameError, match="3 frames"):
        parse_live([b"t", encode_seq(1)])
    with pytest.raises(FrameError, match="3 or 4 frames"):
        parse_replay_reply([b"", encode_seq(1)])
    with pytest.raises(FrameError, match="empty delimiter"):
        parse_replay_reply([b"x", encode_seq(1), b"p"])
    with pytest.raises(FrameError, match="empty payload"):
        parse_replay_reply([b"", b"\xff" * 8, b"p"])
    with pytest.raises(FrameError, match="3 frames"):
        parse_replay_request([b"id", encode_seq(1)])


def test_replay_request_parses_start_and_snapshot():
    assert parse_replay_request([b"id", b"", encode_seq(42)]) == (b"id", 42)
    assert parse_replay_request([b"id", b"", SNAPSHOT_REQUEST]) == (b"id", None)


def test_capture_round_trips_and_truncation_is_reported_with_offset(tmp_path):
    path = tmp_path / "c.bin"
    write_capture(path, [(0, [b"t", encode_seq(0), b"abc"]), (2, [b"", encode_seq(0)])])
    recs = read_capture(path)
    assert [(r.channel, r.frames) for r in recs] == [(0, (b"t", encode_seq(0), b"abc")), (2, (b"", encode_seq(0)))]
    data = path.read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-3])
    with pytest.raises(CaptureFormatError, match="truncated"):
        read_capture(tmp_path / "t.bin")
    (tmp_path / "m.bin").write_bytes(b"NOTMAGIC" + data[8:])
    with pytest.raises(CaptureFormatError, match="bad magic"):
        read_capture(tmp_path / "m.bin")


def test_golden_033_replay_requests_ask_9_and_24_and_replies_repeat_the_live_bytes(golden_dir):
    # vLLM 0.33.0 README, "Replay 1" / "Replay 2": start 9 gets seqs 9..18 with the live
    # payloads, then the end marker; start 24 (past the end) gets the end marker alone.
    recs = read_capture(golden_dir / "vllm-0.33.0" / "stream.bin")
    live = {m.seq: m for m in (parse_live(r.frames) for r in recs if r.channel == CaptureChannel.LIVE)}
    assert sorted(live) == list(range(19))
    exchanges: list[tuple[int, list]] = []
    for r in recs:
        if r.channel == CaptureChannel.REPLAY_REQUEST:
            assert r.frames[0] == b"" and len(r.frames) == 2
            exchanges.append((decode_seq(r.frames[1]), []))
        elif r.channel == CaptureChannel.REPLAY_REPLY:
            assert len(r.frames) == 4
            exchanges[-1][1].append(parse_replay_reply(r.frames))
    assert [start for start, _ in exchanges] == [9, 24]
    (_, first), (_, second) = exchanges
    assert [x.seq for x in first[:-1]] == list(range(9, 19)) and first[-1].end
    assert all(x.payload == live[x.seq].payload and x.topic == live[x.seq].topic for x in first[:-1])
    assert len(second) == 1 and second[0].end and second[0].topic == b""
