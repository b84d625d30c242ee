"""Every bad input a newcomer types gets one clear line and a non-zero exit, before any
work starts; Ctrl-C says what was kept. Each case runs ``python -m kvstream`` as a real
process, as a user would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest

from kvstream.eventlog import LogWriter

from tests.cli.helpers import KV, one_clear_line, run


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """A two-source log whose records span 100 s (so a 1x replay takes that long)."""
    p = tmp_path_factory.mktemp("logs") / "two.kvlog"
    with LogWriter(p) as w:
        for i in range(200):
            src = "e0" if i % 2 == 0 else "e1"
            w.write_message(src, b"", i // 2, b"\x92\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x90",
                            recv_ns=1_700_000_000_000_000_000 + i * 500_000_000)
    return p


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "empty.jsonl").write_text("")
    (d / "three_bytes.key").write_bytes(b"abc")
    (d / "a_dir.json").mkdir()
    return d


BAD = {
    # subscribe: endpoints that cannot work
    "subscribe-no-port": (["subscribe", "tcp://127.0.0.1"], ["has no port"]),
    "subscribe-http": (["subscribe", "http://127.0.0.1:5557"], ["'http' is not supported"]),
    "subscribe-bind-form": (["subscribe", "tcp://*:5557"], ["bind address", "tcp://127.0.0.1:5557"]),
    "subscribe-port-99999": (["subscribe", "tcp://127.0.0.1:99999"], ["'99999' is not a port number"]),
    "subscribe-unresolvable": (["subscribe", "tcp://no-such-host.invalid:5557"], ["cannot resolve host"]),
    "subscribe-bad-replay": (["subscribe", "tcp://127.0.0.1:5557,replay=tcp://127.0.0.1"], ["replay endpoint"]),
    "subscribe-3-byte-key": (["subscribe", "tcp://127.0.0.1:5557", "--curve-server-key", "{d}/three_bytes.key"],
                             ["three_bytes.key"]),
    "record-http": (["record", "http://h:1", "-o", "{d}/never.kvlog"], ["'http' is not supported"]),
    "subscribe-misplaced-replay": (["subscribe", "tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558",
                                    "tcp://127.0.0.1:6557", "--replay", "tcp://127.0.0.1:6558"],
                                   ["two replay endpoints", "same position"]),
    "subscribe-extra-replay": (["subscribe", "tcp://127.0.0.1:5557", "--replay", "tcp://127.0.0.1:5558",
                                "--replay", "tcp://127.0.0.1:5559"], ["2 --replay flags for 1 endpoint"]),
    "subscribe-negative-count": (["subscribe", "tcp://127.0.0.1:5557", "--count", "-1"], ["--count"]),
    # simulate: ranges, choices, outputs, empty inputs
    "simulate-md5": (["simulate", "--prefix-caching-hash-algo", "md5"], ["invalid choice: 'md5'"]),
    "simulate-requests-0": (["simulate", "--requests", "0"], ["--requests", "positive integer"]),
    "simulate-blocks-0": (["simulate", "--num-gpu-blocks-override", "0"], ["positive integer"]),
    "simulate-block-size-0": (["simulate", "--block-size", "0"], ["--block-size", "positive integer"]),
    "simulate-granularity-0": (["simulate", "--token-granularity", "0"], ["positive integer"]),
    "simulate-engines-0": (["simulate", "--engines", "4,0"], ["--engines", "positive integer"]),
    "simulate-duration-negative": (["simulate", "--duration", "-3"], ["--duration"]),
    "simulate-plot-no-dir": (["simulate", "--plot", "{d}/no/such/dir/p.png"], ["--plot", "does not exist"]),
    "simulate-plot-suffix": (["simulate", "--plot", "{d}/p.txt"], ["--plot", ".png or .svg or .pdf"]),
    "simulate-json-no-dir": (["simulate", "--json", "{d}/no/such/r.json"], ["--json", "does not exist"]),
    "simulate-json-is-dir": (["simulate", "--json", "{d}/a_dir.json"], ["--json", "is a directory"]),
    "simulate-empty-trace": (["simulate", "--trace", "{d}/empty.jsonl"], ["holds no requests"]),
    "simulate-missing-trace": (["simulate", "--trace", "{d}/nope.jsonl"], ["nope.jsonl"]),
    "simulate-weights-without-kv-aware": (["simulate", "--policies", "round-robin", "--queue-weight", "1"],
                                          ["kv-aware"]),
    # plan, inspect, replay
    "plan-gpu-util": (["plan", "--gpu-memory", "80", "--gpu-memory-utilization", "2"], ["(0, 1]"]),
    "inspect-missing": (["inspect", "{d}/nope.kvlog"], ["does not exist"]),
    "replay-http": (["replay", "{log}", "--publish", "http://127.0.0.1:5557"], ["not supported"]),
    "replay-port-70000": (["replay", "{log}", "--publish", "tcp://127.0.0.1:70000"], ["not a port number"]),
    "replay-two-sources-one-endpoint": (["replay", "{log}", "--publish", "tcp://127.0.0.1:0"],
                                        ["2 source(s)", "--source e0"]),
    "replay-speed": (["replay", "{log}", "--publish", "tcp://127.0.0.1:0", "--speed", "fast"], ["--speed"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_clear_line_and_a_non_zero_exit(case, files, log, tmp_path):
    args, needles = BAD[case]
    args = [a.format(d=files, log=log) for a in args]
    t0 = time.monotonic()
    r = run(*args, cwd=tmp_path)
    one_clear_line(r, *needles)
    assert time.monotonic() - t0 < 10  # refused before any work
    assert list(tmp_path.iterdir()) == []  # and nothing written


def test_replay_onto_a_port_in_use_says_so(log):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run("replay", str(log), "--source", "e0", "--publish", f"tcp://127.0.0.1:{port}")
    one_clear_line(r, f"tcp://127.0.0.1:{port}", "already serves that address")


def test_replay_binds_the_address_it_is_given(log):
    r = run("replay", str(log), "--source", "e0", "--publish", "tcp://127.0.0.1:0", "--speed", "max",
             "--wait-s", "0", "--hold-s", "0")
    assert r.returncode == 0, r.stderr
    assert "e0 -> tcp://127.0.0.1:" in r.stderr and "replayed 100 batches" in r.stderr


def test_version_flag_names_every_dependency():
    r = run("--version")
    assert r.returncode == 0
    for name in ("kvstream", "anyio", "msgspec", "pyzmq", "libzmq", "cbor2", "xxhash", "zstandard", "matplotlib"):
        assert name in r.stdout
    assert run("version").stdout == r.stdout


def _interrupt(args, ready, *, timeout=30):
    """Start ``kvstream ARGS``, wait until stderr shows ``ready``, send SIGINT."""
    p = subprocess.Popen([*KV, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = ""
    deadline = time.monotonic() + timeout
    try:
        while ready not in err:
            assert time.monotonic() < deadline, err
            line = p.stderr.readline()
            assert line, f"exited early: {err}"
            err += line
        p.send_signal(signal.SIGINT)
        out, rest = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out, err + rest


def test_ctrl_c_in_replay_says_how_far_it_got(log):
    rc, _, err = _interrupt(["replay", str(log), "--source", "e0", "--publish", "tcp://127.0.0.1:0",
                             "--wait-s", "0"], "e0 -> ")
    assert rc == 130
    assert "interrupted after sending" in err and "of 100 messages" in err and "Traceback" not in err


def test_ctrl_c_in_simulate_keeps_the_finished_runs(tmp_path):
    rc, out, err = _interrupt(["simulate", "--requests", "800", "--engines", "2,3,4,5,6,7,8",
                               "--json", str(tmp_path / "r.json")], "kv-aware")
    assert rc == 130 and "Traceback" not in err
    assert "interrupted; the table above shows the" in err and "nothing was written" in err
    assert "kv-aware" in out  # the finished runs
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("command", ["subscribe", "record", "replay", "simulate"])
def test_every_long_running_command_takes_log_level(command):
    r = run(command, "--help")
    assert "--log-level" in r.stdout
    bad = run(command, "--log-level", "loud")
    assert bad.returncode == 2 and "invalid choice: 'loud'" in bad.stderr
