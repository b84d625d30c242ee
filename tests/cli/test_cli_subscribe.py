"""``kvstream subscribe`` as a real process against a real publisher."""

from __future__ import annotations

import json
import signal
import sys

import anyio
import pytest

from kvstream.cli._endpoints import parse_source as parse_endpoint
from kvstream.wire.events import BlockRemoved, BlockStored, KVEventBatch
from kvstream.transport import KVEventsConfig, Publisher

from tests.transport.zmq_helpers import ipc

pytestmark = pytest.mark.anyio



def test_endpoint_syntax_takes_replay_and_name_options():
    s = parse_endpoint("tcp://h:5557,replay=tcp://h:5558,name=e0")
    assert (s.endpoint, s.replay_endpoint, s.source) == ("tcp://h:5557", "tcp://h:5558", "e0")
    assert parse_endpoint("tcp://h:1", replay="tcp://h:2").replay_endpoint == "tcp://h:2"
    with pytest.raises(ValueError, match="bad option"):
        parse_endpoint("tcp://h:1,replya=x")
    with pytest.raises(ValueError, match="not an endpoint"):
        parse_endpoint("localhost:5557")


def test_every_command_accepts_the_same_endpoint_forms():
    for text in ("e0=tcp://h:5557,tcp://h:5558", "tcp://h:5557,replay=tcp://h:5558,name=e0",
                 "e0=tcp://h:5557,replay=tcp://h:5558"):
        s = parse_endpoint(text)
        assert (s.endpoint, s.replay_endpoint, s.source) == ("tcp://h:5557", "tcp://h:5558", "e0")
    s = parse_endpoint("ipc:///tmp/x.sock")
    assert (s.endpoint, s.replay_endpoint, s.source) == ("ipc:///tmp/x.sock", None, "ipc:///tmp/x.sock")
    with pytest.raises(ValueError, match="unexpected"):
        parse_endpoint("tcp://h:1,tcp://h:2,tcp://h:3")


async def _read_lines(stream, n: int) -> list[str]:
    buf = b""
    while buf.count(b"\n") < n:
        buf += await stream.receive()
    return buf.decode().splitlines()


async def _read_all(stream) -> str:
    """Everything ``stream`` carries until its end (one receive may hold only part)."""
    chunks = []
    try:
        while True:
            chunks.append(await stream.receive())
    except anyio.EndOfStream:
        return b"".join(chunks).decode()


async def test_json_lines_live_then_sigint_exits_cleanly_with_health(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), topic="kv")
    cmd = [sys.executable, "-m", "kvstream", "subscribe", f"{cfg.endpoint},replay={cfg.replay_endpoint},name=e0",
           "--json", "--topic", "kv", "--health-interval", "0"]
    with anyio.fail_after(60):
        async with Publisher(cfg) as pub:
            pub.publish(KVEventBatch(1.0, [BlockStored([7], None, list(range(16)), 16, None, "GPU", None)]))
            async with await anyio.open_process(cmd) as proc:
                lines = await _read_lines(proc.stdout, 2)  # the replayed event, then "live"
                pub.publish(KVEventBatch(2.0, [BlockRemoved([7], "GPU")]))
                lines += await _read_lines(proc.stdout, 1)
                proc.send_signal(signal.SIGINT)
                rc = await proc.wait()
                err = await _read_all(proc.stderr)
    recs = [json.loads(line) for line in lines]
    assert recs[0]["event"]["type"] == "BlockStored" and recs[0]["seq"] == 0 and recs[0]["replayed"]
    assert recs[0]["event"]["block_hashes"] == ["0000000000000007"] and recs[0]["source"] == "e0" and recs[0]["rank"] == 0
    assert recs[1] == {"source": "e0", "notice": "live", "seq": 0}
    assert recs[2]["event"] == {"type": "BlockRemoved", "block_hashes": ["0000000000000007"], "medium": "GPU"}
    assert recs[2]["replayed"] is False
    assert rc == 0
    assert "[health] e0: live seq=1 batches=2" in err


async def test_text_output_and_count(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"))
    cmd = [sys.executable, "-m", "kvstream", "subscribe", cfg.endpoint, "--replay", cfg.replay_endpoint,
           "--count", "1", "--health-interval", "0"]
    with anyio.fail_after(60):
        async with Publisher(cfg) as pub:
            pub.publish(KVEventBatch(1.0, [BlockStored([255, 256], 17, list(range(32)), 16, None, "GPU", None)]))
            result = await anyio.run_process(cmd)
    out = result.stdout.decode()
    assert result.returncode == 0
    assert f"{cfg.endpoint} #0 r0 BlockStored GPU blocks=2 [00000000000000ff 0000000000000100] " \
           "parent=0000000000000011 tokens=32 (replay)" in out


async def test_idle_probes_are_counted_as_probes_not_as_replays(tmp_path):
    """A quiet, healthy engine is probed (0.5 s after its last batch, then every <= 10 s);
    the health line counts those probes as `probes`, and `replays` stays at the one join
    replay (fetching what was published before the subscriber came) since nothing was lost."""
    import re

    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"))
    cmd = [sys.executable, "-m", "kvstream", "subscribe", f"{cfg.endpoint},replay={cfg.replay_endpoint},name=e0",
           "--health-interval", "0.3"]
    health: list[str] = []
    with anyio.fail_after(60):
        async with Publisher(cfg) as pub:
            pub.publish(KVEventBatch(1.0, [BlockStored([7], None, list(range(16)), 16, None, "GPU", None)]))
            async with await anyio.open_process(cmd) as proc:
                buf = b""
                # wait for the state (two probes answered while live), not for a time
                while not any(re.search(r"live .* probes=([2-9]|\d\d)", h) for h in health):
                    buf += await proc.stderr.receive()
                    *done, rest = buf.split(b"\n")
                    buf = rest
                    health += [ln.decode() for ln in done if ln.startswith(b"[health]")]
                proc.send_signal(signal.SIGINT)
                assert await proc.wait() == 0
    replays = [int(re.search(r" replays=(\d+) ", h).group(1)) for h in health]  # type: ignore[union-attr]
    assert max(replays) == 1 and " replays=1 " in health[-1], health
