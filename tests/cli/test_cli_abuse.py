"""More abuse of the command line, each found by trying it: flags that contradict each
other or mean nothing without another flag, files that are directories, lists or binary,
an output that cannot be written (full device, file size limit), numbers that are not
finite. Each must end in one line on stderr and a non-zero exit, never a traceback and
never a silently ignored flag. Real ``python -m kvstream`` processes, as a user runs them.
"""

from __future__ import annotations

import resource
import subprocess
import time

import pytest

from kvstream.eventlog import LogWriter
from kvstream.eventlog.reader import LogReader

from tests.cli.helpers import KV, one_clear_line, run

PAYLOAD = b"\x92\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x90"  # a vLLM batch: ts 0.0, no events


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("abuse")
    with LogWriter(d / "two.kvlog") as w:
        for i in range(40):
            w.write_message("e0" if i % 2 == 0 else "e1", b"", i // 2, PAYLOAD,
                            recv_ns=1_700_000_000_000_000_000 + i * 10_000_000)
    with LogWriter(d / "nothing.kvlog"):
        pass  # a log with a header and no records
    (d / "list.json").write_text("[1, 2, 3]")
    (d / "null.json").write_text("null")
    (d / "binary.json").write_bytes(b"\xd2\xff\x00\x81garbage")
    (d / "a_dir").mkdir()
    (d / "cfg.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
                                '"hidden_size": 256, "max_position_embeddings": 4096}')
    return d


BAD = {
    # inspect: filters that cannot match are refused, not answered with an empty listing
    "inspect-since-nan": (["inspect", "{d}/two.kvlog", "--since", "nan"], ["--since"]),
    "inspect-since-after-until": (["inspect", "{d}/two.kvlog", "--since", "10", "--until", "5"],
                                  ["--since 10 is after --until 5"]),
    "inspect-type-without-events": (["inspect", "{d}/two.kvlog", "--type", "reset"], ["add --events"]),
    "inspect-unknown-source": (["inspect", "{d}/two.kvlog", "--source", "e9"], ["no source e9", "e0, e1"]),
    # convert: directories in and out
    "convert-input-is-a-directory": (["convert", "{d}/a_dir", "-o", "out.kvlog"], ["is a directory"]),
    "convert-output-is-a-directory": (["convert", "{d}/two.kvlog", "-o", "{d}/a_dir"], ["-o", "is a directory"]),
    # replay: a log with nothing in it, an infinite speed, one port for PUB and replay
    "replay-log-without-messages": (["replay", "{d}/nothing.kvlog", "--publish", "tcp://127.0.0.1:0"],
                                    ["holds no messages"]),
    "replay-infinite-speed": (["replay", "{d}/two.kvlog", "--source", "e0", "--publish", "tcp://127.0.0.1:0",
                               "--speed", "infx"], ["--speed", "finite"]),
    "replay-nan-speed": (["replay", "{d}/two.kvlog", "--source", "e0", "--publish", "tcp://127.0.0.1:0",
                          "--speed", "nan"], ["--speed", "finite"]),
    "replay-pub-port-is-replay-port": (["replay", "{d}/two.kvlog", "--source", "e0", "--publish",
                                        "tcp://127.0.0.1:6,tcp://127.0.0.1:6"], ["given twice"]),
    # inproc:// never leaves a process, and every peer of a command is another process
    "subscribe-inproc": (["subscribe", "inproc://engine"], ["inproc://", "ipc:///PATH"]),
    "record-inproc": (["record", "inproc://engine", "-o", "never.kvlog"], ["inproc://"]),
    "replay-inproc": (["replay", "{d}/two.kvlog", "--source", "e0", "--publish", "inproc://x"], ["inproc://"]),
    # simulate: flags that would be ignored without the flag they belong to
    "simulate-requests-with-trace": (["simulate", "--trace", "{d}/list.json", "--requests", "10"],
                                     ["--requests", "--limit"]),
    "simulate-limit-without-trace": (["simulate", "--limit", "10"], ["--limit", "--requests"]),
    "simulate-gpu-memory-without-model": (["simulate", "--gpu-memory", "80"], ["--gpu-memory", "--model-config"]),
    "simulate-max-model-len-without-model": (["simulate", "--max-model-len", "10"], ["--max-model-len"]),
    "simulate-gpu-and-kv-memory": (["simulate", "--model-config", "{d}/cfg.json", "--gpu-memory", "80",
                                    "--kv-memory-gib", "3"], ["not both"]),
    "simulate-utilization-without-gpu-memory": (["simulate", "--model-config", "{d}/cfg.json",
                                                 "--gpu-memory-utilization", "0.5"], ["--gpu-memory too"]),
    "simulate-a-million-engines": (["simulate", "--engines", "8,1000000"], ["1000000 engines", "GiB of memory", "fewer engines"]),
    "simulate-engines-empty-entry": (["simulate", "--engines", "1,,2"], ["empty entry"]),
    "simulate-policies-empty-entry": (["simulate", "--policies", "kv-aware,,random"], ["empty entry"]),
    "simulate-model-config-list": (["simulate", "--model-config", "{d}/list.json"], ["JSON object"]),
    "simulate-model-config-null": (["simulate", "--model-config", "{d}/null.json"], ["JSON object"]),
    # plan: a binary file, a negative layer count (bad input: 2, like every other number)
    "plan-binary-config": (["plan", "{d}/binary.json", "--gpu-memory", "80"], ["not a text file"]),
    "plan-negative-layers": (["plan", "--layers", "-1", "--kv-heads", "8", "--head-dim", "128",
                              "--max-model-len", "1000", "--gpu-memory", "80"], ["--layers"]),
    # engine: what vLLM refuses at start-up, and flags that need --model-config
    "engine-unknown-publisher": (["engine", "--port", "0", "--kv-events-config",
                                  '{{"enable_kv_cache_events": true, "publisher": "kafka"}}'],
                                 ["unknown publisher 'kafka'"]),
    "engine-chat-template-missing-file": (["engine", "--port", "0", "--chat-template", "{d}/nope.jinja"],
                                          ["--chat-template", "no file"]),
    "engine-chat-template-directory": (["engine", "--port", "0", "--chat-template", "{d}/a_dir"],
                                       ["a directory"]),
    "engine-chat-template-syntax": (["engine", "--port", "0", "--chat-template", "{{% bogus %}}"],
                                    ["does not compile"]),
    "engine-gpu-memory-without-model": (["engine", "--port", "0", "--gpu-memory", "80"], ["--model-config"]),
    "engine-ten-billion-blocks": (["engine", "--port", "0", "--num-gpu-blocks-override", "10000000000"],
                                  ["10,000,000,000 KV blocks", "GiB of memory", "--num-gpu-blocks-override"]),
    "engine-gpu-utilization-2": (["engine", "--port", "0", "--gpu-memory-utilization", "2"], ["(0, 1]"]),
    # demo: a fleet of processes this machine cannot hold
    "demo-thousand-engines": (["demo", "--engines", "1000"], ["at most 64"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_abuse_is_one_clear_line_and_a_non_zero_exit(case, files, tmp_path):
    args, needles = BAD[case]
    args = [a.format(d=files) for a in args]
    t0 = time.monotonic()
    r = run(*args, cwd=tmp_path, timeout=20)
    one_clear_line(r, *needles)
    assert time.monotonic() - t0 < 15  # refused, not served
    assert list(tmp_path.iterdir()) == []  # and nothing written


def test_record_with_a_bad_endpoint_exits_2_like_every_bad_input(tmp_path):
    r = run("record", "tcp://127.0.0.1:abc", "-o", str(tmp_path / "r.kvlog"))
    one_clear_line(r, "not a port number", code=2)
    assert not (tmp_path / "r.kvlog").exists()


@pytest.mark.parametrize("args", [
    ["version"],
    ["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--max-model-len", "64", "--gpu-memory", "1"],
    ["simulate", "--requests", "20", "--engines", "1", "--policies", "round-robin", "--quiet"],
    ["inspect", "{d}/two.kvlog"],
])
def test_stdout_on_a_full_device_is_one_line_and_exit_1(args, files):
    with open("/dev/full", "w") as full:
        r = subprocess.run([*KV, *(a.format(d=files) for a in args)], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=30)
    one_clear_line(r, "No space left on device", code=1)


def test_simulate_json_on_a_full_device_keeps_the_table(tmp_path):
    r = run("simulate", "--requests", "20", "--engines", "1", "--policies", "round-robin", "--quiet",
             "--json", "/dev/full")
    one_clear_line(r, "/dev/full", "No space left on device", code=1)
    assert "round-robin" in r.stdout


def test_simulate_num_gpu_blocks_override_wins_over_the_model_as_in_vllm(files):
    # vLLM plans the model, then num_gpu_blocks_override replaces the block count.
    r = run("simulate", "--model-config", f"{files}/cfg.json", "--kv-memory-gib", "1",
             "--num-gpu-blocks-override", "37", "--requests", "20", "--engines", "1", "--policies", "round-robin",
             "--quiet")
    assert r.returncode == 0, r.stderr
    assert "1 engines x 37 blocks" in r.stdout


def _fsize_limit(n):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    return apply


def test_record_that_hits_the_file_size_limit_keeps_a_clean_log(files, tmp_path):
    """A full disk mid-recording: one line, exit 1, and the log ends at a complete record
    (the write that failed is cut back), so it reads without damage."""
    out = tmp_path / "rec.kvlog"
    rep = subprocess.Popen([*KV, "replay", f"{files}/two.kvlog", "--source", "e0", "--publish", "tcp://127.0.0.1:0",
                            "--speed", "max", "--wait-subscribers", "1", "--wait-s", "0", "--hold-s", "30"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = rep.stderr.readline()
        assert "e0 -> tcp://127.0.0.1:" in line, line
        endpoint = line.split("-> ")[1].split()[0]
        r = subprocess.run([*KV, "record", endpoint, "-o", str(out), "--quiet", "--flush", "record",
                            "--duration", "20"], capture_output=True, text=True, timeout=40,
                           preexec_fn=_fsize_limit(600))
    finally:
        rep.kill()
        rep.wait()
    one_clear_line(r, f"writing {out} failed", "File too large", code=1)
    reader = LogReader(out)
    recs = list(reader)
    assert reader.damage == []
    assert out.stat().st_size <= 600
    assert any(getattr(rec, "payload", None) == PAYLOAD for rec in recs)  # what fitted is kept


def test_convert_that_runs_out_of_space_keeps_no_half_log(golden_dir, tmp_path):
    out = tmp_path / "golden.kvlog"
    r = subprocess.run([*KV, "convert", str(golden_dir / "vllm-0.33.0" / "stream.bin"), "-o", str(out)],
                       capture_output=True, text=True, timeout=30, preexec_fn=_fsize_limit(400))
    one_clear_line(r, "File too large", "nothing was kept", code=1)
    assert not out.exists()  # a rerun is not told the log "already exists"
    r = run("convert", str(golden_dir / "vllm-0.33.0" / "stream.bin"), "-o", str(out))
    assert r.returncode == 0 and "wrote 19 records" in r.stdout
