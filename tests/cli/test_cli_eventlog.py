"""The event log commands: convert, inspect (summary, events, filters, damage)."""

from __future__ import annotations

import json

import pytest

from kvstream.cli import main
from kvstream.eventlog import LogWriter
from kvstream.wire.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch


def _batch(ts, stored=(), removed=(), medium="GPU"):
    evs = []
    if stored:
        evs.append(BlockStored(list(stored), None, [1] * 16 * len(stored), 16, None, medium, None))
    if removed:
        evs.append(BlockRemoved(list(removed), medium))
    return encode_batch(KVEventBatch(ts, evs, 0))


@pytest.fixture
def log(tmp_path):
    p = tmp_path / "a.kvlog"
    t0 = 1_700_000_000_000_000_000
    with LogWriter(p, metadata={"endpoints": ["tcp://a:1", "tcp://b:1"]}) as w:
        w.write_message("a", b"kv", 0, _batch(1.0, stored=[1, 2, 3]), recv_ns=t0)
        w.write_message("a", b"kv", 1, _batch(2.0, removed=[1]), recv_ns=t0 + 1_000_000_000)
        w.write_message("a", b"kv", 4, _batch(3.0, stored=[9]), recv_ns=t0 + 2_000_000_000)  # gap 2..3
        w.write_control("a", "stale", reason="replay buffer overrun", first_missing_seq=2, resume_seq=4,
                        recv_ns=t0 + 2_000_000_000)
        w.write_message("b", b"kv", 7, _batch(4.0, stored=[5, 6], medium="CPU"), recv_ns=t0 + 3_000_000_000)
        w.write_control("b", "reset", reason="restart", seq=0, recv_ns=t0 + 4_000_000_000)
        w.write_message("b", b"kv", 0, _batch(5.0, stored=[8]), recv_ns=t0 + 4_000_000_000)
    return p


def test_inspect_summary_reports_gaps_restarts_counts_and_peak_cache(log, capsys):
    assert main(["inspect", str(log), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    a, b = d["sources"]
    assert d["records"] == 7 and d["span_s"] == 4.0
    assert d["metadata"] == {"endpoints": ["tcp://a:1", "tcp://b:1"]}
    assert a["seq_runs"] == [[0, 1], [4, 4]] and a["gaps"] == [[2, 4]]
    assert a["stale"] == [[2, 4, "replay buffer overrun"]]
    assert a["blocks_stored"] == 4 and a["blocks_removed"] == 1
    assert a["peak_cached"] == 3 and a["cached_at_end"] == 3
    assert b["restarts"] == 1 and b["resets"] == {"restart": 1} and b["gaps"] == []
    assert b["events"] == {"BlockStored/CPU": 1, "BlockStored/GPU": 1}
    assert b["peak_cached"] == 2 and b["cached_at_end"] == 1  # the restart dropped the CPU blocks


def test_inspect_human_summary_names_every_source(log, capsys):
    assert main(["inspect", str(log)]) == 0
    out = capsys.readouterr().out
    assert "source a" in out and "source b" in out and "gaps: 2..3" in out and "peak cached: 3" in out


def test_inspect_events_filters_by_source_type_and_time(log, capsys):
    assert main(["inspect", str(log), "--events", "--json", "--source", "a", "--type", "BlockStored"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["seq"], r["block_hashes"]) for r in rows] == [(0, [f"{i:016x}" for i in (1, 2, 3)]),
                                                             (4, [f"{9:016x}"])]
    assert main(["inspect", str(log), "--events", "--json", "--since", "2.5", "--until", "3.5"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["source"], r["seq"], r["medium"]) for r in rows] == [("b", 7, "CPU")]
    assert main(["inspect", str(log), "--events", "--type", "stale", "--type", "reset"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "stale missing 2..4" in lines[0] and "reset seq=0 (restart)" in lines[1]


def test_inspect_damaged_log_shows_the_intact_part_and_exits_3(log, capsys):
    data = log.read_bytes()
    log.write_bytes(data[:-5])
    assert main(["inspect", str(log), "--json"]) == 3
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert d["records"] == 6 and d["damage"][0]["reason"].startswith("truncated record")
    assert "DAMAGED" in captured.err


def test_inspect_rejects_a_file_that_is_not_a_log(tmp_path, capsys):
    p = tmp_path / "x.txt"
    p.write_text("hello")
    assert main(["inspect", str(p)]) == 1
    assert "not a kvstream event log" in capsys.readouterr().err


def test_convert_then_inspect_golden_capture_matches_inspecting_the_capture_directly(golden_dir, tmp_path, capsys):
    cap = golden_dir / "vllm-0.11.0" / "stream.bin"
    out = tmp_path / "g.kvlog"
    assert main(["convert", str(cap), "-o", str(out), "--source", "stream.bin"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    from_log = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(cap), "--json"]) == 0
    from_capture = json.loads(capsys.readouterr().out)
    assert from_log["sources"] == from_capture["sources"]
    assert from_log["sources"][0]["messages"] == 12
    assert main(["convert", str(cap), "-o", str(out)]) == 1  # never overwrites
    assert "already exists" in capsys.readouterr().err


def test_record_and_replay_commands_round_trip_a_golden_capture_over_real_sockets(golden_dir, tmp_path):
    """`kvstream replay` publishes a capture; `kvstream record` (with gap recovery) records
    it; SIGINT stops the recorder cleanly and the log holds every frame, byte for byte."""
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from kvstream.eventlog import read_log
    from kvstream.eventlog.convert import capture_records

    cap = golden_dir / "vllm-0.33.0" / "stream.bin"
    sock = tempfile.mkdtemp(prefix="kvc")
    pub, rep = f"ipc://{sock}/p", f"ipc://{sock}/r"
    out = tmp_path / "rec.kvlog"
    py = [sys.executable, "-m", "kvstream"]
    replayer = subprocess.Popen(py + ["replay", str(cap), "--publish", f"{pub},{rep}", "--speed", "max",
                                      "--wait-subscribers", "1", "--wait-s", "0", "--hold-s", "3"],
                                stderr=subprocess.PIPE, text=True)
    recorder = subprocess.Popen(py + ["record", f"e={pub},{rep}", "-o", str(out), "--quiet"],
                                stderr=subprocess.PIPE, text=True)
    try:
        want = [(m.seq, m.payload) for m in capture_records(cap, "x")]
        deadline = time.monotonic() + 60  # a bound for the state below, generous for a loaded machine
        while time.monotonic() < deadline:
            time.sleep(0.2)  # polling the log for the state (every frame recorded)
            if out.exists() and len(read_log(out)[0]) >= len(want):
                break
        recorder.send_signal(signal.SIGINT)
        assert recorder.wait(30) == 0, recorder.stderr.read()
        assert replayer.wait(30) == 0, replayer.stderr.read()
    finally:
        for p in (recorder, replayer):
            if p.poll() is None:
                p.kill()
    recs, damage = read_log(out)
    assert damage == []
    got = [(m.seq, m.payload) for m in recs if m.__class__.__name__ == "LogMessage"]
    assert got == want
    assert "recorded batches 19" in recorder.stderr.read()


def test_record_append_does_not_record_what_the_log_holds(tmp_path):
    """`kvstream record --append` against the same engine (a `kvstream replay` serving a
    50-batch log from its replay buffer): the second recording is offered all 50 batches
    again by its join replay and records none of them, and says so."""
    import signal
    import subprocess
    import sys
    import tempfile

    from kvstream.eventlog import LogWriter, read_log
    from kvstream.eventlog.format import LogMessage
    from kvstream.wire.events import BlockStored, KVEventBatch, encode_batch

    src = tmp_path / "engine.kvlog"
    with LogWriter(src) as w:
        for i in range(50):
            batch = KVEventBatch(float(i), [BlockStored([i + 1], i or None, list(range(16)), 16, None, "GPU", None)])
            w.write_message("engine", b"", i, encode_batch(batch), recv_ns=i * 1000)
    sock = tempfile.mkdtemp(prefix="kva")
    pub, rep = f"ipc://{sock}/p", f"ipc://{sock}/r"
    py = [sys.executable, "-m", "kvstream"]
    replayer = subprocess.Popen(py + ["replay", str(src), "--publish", f"{pub},{rep}", "--speed", "max",
                                      "--wait-s", "0", "--hold-s", "60"], stderr=subprocess.PIPE, text=True)
    out = tmp_path / "rec.kvlog"
    try:
        err = ""
        while "sent 50 batches" not in err:  # ready: every batch is in its replay buffer
            line = replayer.stderr.readline()
            assert line, err
            err += line
        record = py + ["record", f"e={pub},{rep}", "-o", str(out), "--quiet", "--max-batches", "50"]
        first = subprocess.run(record, capture_output=True, text=True, timeout=30)
        assert first.returncode == 0, first.stderr
        second = subprocess.run(record + ["--append"], capture_output=True, text=True, timeout=30)
        assert second.returncode == 0, second.stderr
    finally:
        replayer.send_signal(signal.SIGINT)
        try:
            replayer.wait(10)
        finally:
            if replayer.poll() is None:
                replayer.kill()
            replayer.stderr.close()
    assert "50 batch(es) the log already held were not recorded again" in second.stderr
    recs, damage = read_log(out)
    assert damage == []
    assert [r.seq for r in recs if isinstance(r, LogMessage)] == list(range(50))


def _two_engine_replayer(tmp_path, names=("a", "b"), n=30):
    """A `kvstream replay` publishing a log of ``n`` batches per source, one PUB/replay
    pair per source, every batch in its replay buffer once it says so."""
    import subprocess
    import sys
    import tempfile

    from kvstream.eventlog import LogWriter
    from kvstream.wire.events import BlockStored, KVEventBatch, encode_batch

    src = tmp_path / "engines.kvlog"
    with LogWriter(src) as w:
        for i in range(n):
            for k, name in enumerate(names):
                batch = KVEventBatch(float(i), [BlockStored([1000 * k + i + 1], (1000 * k + i) or None,
                                                            list(range(16)), 16, None, "GPU", None)])
                w.write_message(name, b"", i, encode_batch(batch), recv_ns=(2 * i + k) * 1000)
    sock = tempfile.mkdtemp(prefix="kv2")
    eps = [(f"ipc://{sock}/p{k}", f"ipc://{sock}/r{k}") for k in range(len(names))]
    cmd = [sys.executable, "-m", "kvstream", "replay", str(src), "--speed", "max", "--wait-s", "0", "--hold-s", "60"]
    for pub, rep in eps:
        cmd += ["--publish", f"{pub},{rep}"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    err = ""
    while f"sent {n * len(names)} batches" not in err:
        line = proc.stderr.readline()
        assert line, err
        err += line
    return proc, eps


def _stop(proc):
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_record_into_a_file_counts_sources_by_state_and_writes_no_carriage_returns(tmp_path):
    """Two healthy sources are "2 live" (not `live=1`, a count of recoveries), and a
    stderr that is not a terminal gets whole lines, never `\\r` redraws."""
    import subprocess
    import sys

    replayer, eps = _two_engine_replayer(tmp_path)
    out = tmp_path / "rec.kvlog"
    try:
        r = subprocess.run([sys.executable, "-m", "kvstream", "record", *(f"{p},{q}" for p, q in eps), "-o", str(out),
                            "--max-batches", "60"], capture_output=True, text=True, timeout=60)
    finally:
        _stop(replayer)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr
    assert "recorded batches 60  sources 2 (2 live)" in r.stderr, r.stderr
    assert "live=" not in r.stderr


def test_record_append_without_names_keeps_the_sources_names_from_the_log(tmp_path):
    """`record e0=A e1=B`, then `record --append A B`: the endpoints keep the names e0 and
    e1 (one source per engine in the log), not a second copy under the endpoint."""
    import subprocess
    import sys

    from kvstream.eventlog import read_log
    from kvstream.eventlog.format import LogMessage

    replayer, eps = _two_engine_replayer(tmp_path)
    out = tmp_path / "rec.kvlog"
    py = [sys.executable, "-m", "kvstream", "record", "-o", str(out), "--quiet", "--max-batches", "60"]
    try:
        first = subprocess.run(py + [f"e{k}={p},{q}" for k, (p, q) in enumerate(eps)],
                               capture_output=True, text=True, timeout=60)
        assert first.returncode == 0, first.stderr
        second = subprocess.run(py + ["--append"] + [f"{p},{q}" for p, q in eps],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 0, second.stderr
    finally:
        _stop(replayer)
    assert f"{eps[0][0]} keeps its name 'e0' from {out}" in second.stderr
    recs, damage = read_log(out)
    assert damage == []
    assert {r.source for r in recs if isinstance(r, LogMessage)} == {"e0", "e1"}
    assert "60 batch(es) the log already held were not recorded again" in second.stderr
