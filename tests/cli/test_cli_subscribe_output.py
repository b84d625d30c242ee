"""``kvstream subscribe`` output under odd payloads and a reader that goes away
(issue #15, item 11): real publisher, the CLI as a real process."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import msgspec
import pytest

from kvstream.transport import KVEventsConfig, Publisher
from kvstream.wire.events import BlockStored, KVEventBatch
from tests.transport.zmq_helpers import ipc

pytestmark = pytest.mark.anyio

# A msgpack map whose keys are an array, bytes and an int, with bytes and extension values:
# {[1, 2]: b"x", b"k": Ext(5, b"a"), 3: Ext(7, b"ab")}. vLLM's free-form fields (locality,
# ownership) may carry any msgpack value.
ODD = msgspec.Raw(bytes([0x83, 0x92, 0x01, 0x02, 0xC4, 0x01, 0x78, 0xC4, 0x01, 0x6B, 0xD4, 0x05, 0x61,
                         0x03, 0xC7, 0x02, 0x07, 0x61, 0x62]))


def _odd_batch(i: int) -> bytes:
    ev = BlockStored([i + 1, bytes([i % 256]) * 4], None, list(range(16)), 16, None, "GPU", None, locality=ODD)
    return msgspec.msgpack.encode(KVEventBatch(float(i), [ev], 0))


async def test_json_prints_ext_values_bytes_and_array_keys(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"))
    async with Publisher(cfg) as pub:
        pub.publish_raw(_odd_batch(0), 0)
        cmd = [sys.executable, "-m", "kvstream", "subscribe", f"{cfg.endpoint},replay={cfg.replay_endpoint}",
               "--json", "--count", "1", "--health-interval", "0"]
        r = await anyio.run_process(cmd, check=False)
    assert r.returncode == 0, r.stderr.decode()
    ev = json.loads(r.stdout.decode().splitlines()[0])["event"]
    assert ev["block_hashes"] == ["0000000000000001", "00000000"]
    assert ev["locality"] == {"[1,2]": "78", '"6b"': {"ext": 5, "data": "61"}, "3": {"ext": 7, "data": "6162"}}
    assert "Traceback" not in r.stderr.decode()


async def test_a_reader_that_leaves_ends_subscribe_cleanly(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"))
    async with Publisher(cfg) as pub:
        for i in range(300):
            pub.publish_raw(_odd_batch(i), i)
        # `kvstream subscribe --json | head -1`: read one line, then close the pipe.
        p = subprocess.Popen([sys.executable, "-m", "kvstream", "subscribe",
                              f"{cfg.endpoint},replay={cfg.replay_endpoint}", "--json", "--health-interval", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            first = await anyio.to_thread.run_sync(p.stdout.readline)
            p.stdout.close()
            for i in range(300, 600):  # more output for the closed pipe
                pub.publish_raw(_odd_batch(i), i)
            with anyio.fail_after(60):
                rc = await anyio.to_thread.run_sync(p.wait)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        err = p.stderr.read().decode()
        p.stderr.close()
    assert json.loads(first)["seq"] == 0
    assert rc == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
