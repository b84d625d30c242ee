"""Golden vLLM captures convert into event logs that hold exactly the frames vLLM sent."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kvstream.wire.capture import CaptureChannel, read_capture
from kvstream.eventlog import LogReader, read_log
from kvstream.eventlog.convert import capture_records, convert_captures
from kvstream.eventlog.summary import LogSummary
from kvstream.wire.framing import decode_seq

CAPTURES = ["vllm-0.11.0/stream.bin", "vllm-0.33.0/stream.bin", "vllm-0.33.0/dp1.bin"]


def _live_frames(path):
    return [r.frames for r in read_capture(path) if r.channel == CaptureChannel.LIVE]


@pytest.mark.parametrize("name", CAPTURES)
def test_converted_log_holds_every_live_frame_byte_for_byte(golden_dir, tmp_path, name):
    cap = golden_dir / name
    out = tmp_path / "g.kvlog"
    n = convert_captures([cap], out, sources=["engine"])
    recs, damage = read_log(out)
    assert damage == []
    live = _live_frames(cap)
    assert n == len(recs) == len(live)
    assert [(r.topic, r.seq, r.payload) for r in recs] == [(t, decode_seq(s), p) for t, s, p in live]
    assert all(r.source == "engine" and not r.replayed for r in recs)


@pytest.mark.parametrize("name", ["vllm-0.11.0/stream.bin", "vllm-0.33.0/stream.bin"])
def test_converted_log_event_counts_match_the_golden_decoded_batches(golden_dir, name):
    cap = golden_dir / name
    expected = json.loads((cap.parent / "stream.json").read_text())["batches"]
    s = LogSummary().add_all(capture_records(cap, "e")).sources["e"]
    want = Counter()
    stored = removed = 0
    for b in expected:
        for ev in b["events"]:
            medium = ev.get("medium") or "GPU"
            key = (ev["type"], "-" if ev["type"] == "AllBlocksCleared" else medium)
            want[key] += 1
            if ev["type"] == "BlockStored":
                stored += len(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                removed += len(ev["block_hashes"])
    assert dict(s.events) == dict(want)
    assert (s.blocks_stored, s.blocks_removed) == (stored, removed)
    assert s.seq_runs == [[0, len(expected) - 1]] and s.gaps == [] and s.restarts == 0


def test_replay_replies_that_repeat_live_messages_are_not_recorded_twice(golden_dir):
    cap = golden_dir / "vllm-0.33.0/stream.bin"
    replies = [r for r in read_capture(cap) if r.channel == CaptureChannel.REPLAY_REPLY]
    assert len(replies) > 2  # the capture does hold replay replies
    seqs = [r.seq for r in capture_records(cap, "e")]
    assert seqs == sorted(set(seqs))


def test_two_engines_merge_into_one_log_in_receive_order(golden_dir, tmp_path):
    out = tmp_path / "two.kvlog"
    convert_captures([golden_dir / "vllm-0.33.0/stream.bin", golden_dir / "vllm-0.33.0/dp1.bin"], out,
                     sources=["rank0", "rank1"])
    r = LogReader(out)
    recs = list(r)
    assert [x.recv_ns for x in recs] == sorted(x.recv_ns for x in recs)
    assert Counter(x.source for x in recs) == {"rank0": 19, "rank1": 1}
    assert r.metadata["sources"] == ["rank0", "rank1"]


def test_zstd_converted_log_reads_back_identically(golden_dir, tmp_path):
    pytest.importorskip("zstandard")
    cap = golden_dir / "vllm-0.33.0/stream.bin"
    convert_captures([cap], tmp_path / "z.kvlog", sources=["e"], compression="zstd")
    convert_captures([cap], tmp_path / "p.kvlog", sources=["e"])
    assert read_log(tmp_path / "z.kvlog") == read_log(tmp_path / "p.kvlog")
    assert (tmp_path / "z.kvlog").stat().st_size < (tmp_path / "p.kvlog").stat().st_size
