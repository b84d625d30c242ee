"""``kvstream relay`` / ``subscribe`` / ``record`` with JetStream, as processes."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio

from kvstream.eventlog.format import LogMessage
from kvstream.eventlog.reader import LogReader
from kvstream.jetstream import Relay

from .engines import Engine


async def _fill(tmp_path, url: str, n: int) -> Engine:
    async with Engine(tmp_path, "e0") as eng, Relay([eng.spec], url) as relay, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        eng.steps(n)
        with anyio.fail_after(30):
            while relay.sources["e0"].pos < n - 1 or relay.stats.inflight:
                await anyio.sleep(0.005)
        tg.cancel_scope.cancel()
    return eng


def _kvstream(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstream", *args], capture_output=True, text=True, timeout=60)


async def test_subscribe_and_record_read_a_nats_url(tmp_path, nats_server) -> None:
    eng = await _fill(tmp_path, nats_server.url, 20)
    r = _kvstream("subscribe", nats_server.url + "/KV_EVENTS?source=e0", "--json", "--count", "20",
                  "--health-interval", "0")
    assert r.returncode == 0, r.stderr
    seqs = sorted({json.loads(line)["seq"] for line in r.stdout.splitlines() if '"event"' in line})
    assert seqs == list(range(20))
    assert "e0: live seq=19" in r.stderr
    log = tmp_path / "run.kvlog"
    r = _kvstream("record", nats_server.url, "-o", str(log), "--max-batches", "20", "--quiet")
    assert r.returncode == 0, r.stderr
    payloads = [rec.payload for rec in LogReader(log) if type(rec) is LogMessage]
    assert payloads == eng.payloads


def test_the_relay_says_what_is_wrong_in_one_line(capsys) -> None:
    from kvstream.cli import main

    def run(*args: str) -> tuple[int, str]:
        code = main(["relay", "e0=ipc:///nonexistent/x.sock", *args])
        return code, capsys.readouterr().err

    code, err = run("--nats", "http://h:4222")
    assert code == 2 and err.startswith("kvstream relay: ") and "nats://HOST" in err
    code, err = run("--nats", "nats://127.0.0.1:1", "--connect-timeout", "0.3")
    assert code == 2 and "no NATS server answered" in err and len(err.splitlines()) == 1
    code, err = run("--nats", "nats://127.0.0.1:1", "--replicas", "9")
    assert code == 2 and "replicas" in err
