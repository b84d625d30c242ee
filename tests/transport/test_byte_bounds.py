"""Byte bounds that hold for big batches (issue 23 item 3), measured as the resident memory
of a real subscriber process fed 4 MiB batches over loopback: the bounds count what is
held, decoded form included, and a full queue sheds (to be replayed) instead of letting
ZMQ's queue grow."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import anyio
import pytest

from kvstream.transport import KVEventsConfig, Publisher
from kvstream.wire.events import BlockStored, KVEventBatch, encode_batch

pytestmark = pytest.mark.anyio

_SUBSCRIBER = textwrap.dedent('''
    import json, resource, sys, time
    import anyio
    from kvstream.transport import SourceBatch, SourceSpec, Subscriber

    def rss_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    async def main(pub, rep, n, consume):
        base = None
        peak_ready = 0
        taken = 0
        async with Subscriber([SourceSpec(pub, rep, name="e")], probe_after_s=None,
                              replay_timeout_s=5.0) as sub:
            await sub.wait_state("e", "live", timeout_s=30)
            base = rss_mb()
            print("ready", flush=True)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                peak_ready = max(peak_ready, sub.ready_bytes)
                if consume:
                    for it in sub.get_nowait():
                        if isinstance(it, SourceBatch):
                            taken = max(taken, it.seq + 1)
                    if taken >= n:
                        break
                else:
                    c = sub.counters("e")
                    if c.batches + c.shed >= n:
                        break
                await anyio.sleep(0.01)
            c = sub.counters("e").as_dict()
        print(json.dumps({"base_mb": base, "peak_mb": rss_mb(), "peak_ready": peak_ready,
                          "taken": taken, "counters": c}), flush=True)

    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
''')


def _big_batch(i: int, rng: random.Random) -> bytes:
    # ~4 MiB of msgpack: token ids over a 150k vocabulary (3-5 bytes each on the wire,
    # 36 bytes each decoded).
    evs = [BlockStored([rng.getrandbits(63) for _ in range(64)], None,
                       [rng.randrange(150_000) for _ in range(64 * 16 * 16)], 16, None, "GPU", None)
           for _ in range(60)]
    return encode_batch(KVEventBatch(float(i), evs))


async def _run(tmp_path, n: int, consume: bool) -> dict:
    rng = random.Random(1)
    payloads = [_big_batch(i, rng) for i in range(n)]
    assert all(3 << 20 < len(p) < 6 << 20 for p in payloads)
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                         buffer_steps=n, max_queue_size=n + 10)
    with anyio.fail_after(180):
        async with Publisher(cfg) as pub:
            proc = await anyio.open_process([sys.executable, "-c", _SUBSCRIBER, pub.endpoint,
                                             pub.replay_endpoint or "", str(n), "1" if consume else "0"])
            try:
                assert proc.stdout is not None
                buf = b""
                while b"ready\n" not in buf:
                    chunk = await proc.stdout.receive()
                    buf += chunk
                for i, p in enumerate(payloads):
                    pub.publish_raw(p, i)
                    if i % 8 == 7:
                        await anyio.sleep(0)  # let the sender stream them
                while b"}" not in buf.split(b"ready\n", 1)[1]:
                    buf += await proc.stdout.receive()
                await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
    return json.loads(buf.split(b"ready\n", 1)[1].decode().strip().splitlines()[-1])


async def test_big_batches_to_a_stalled_consumer_stay_within_the_byte_bound(tmp_path):
    """40 batches of 4 MiB to a consumer that takes nothing: the old code queued them all
    (ready_bytes 160 MB against 64 MiB, 1.4 GB resident); now the queue is full at the
    bound and the rest is shed (to be replayed later)."""
    r = await _run(tmp_path, 40, consume=False)
    bound = 64 << 20
    assert r["peak_ready"] <= bound + bound // 8 + 60 * (1 << 20), r  # the bound, a burst, one batch
    assert r["counters"]["shed"] > 0, r
    assert r["peak_mb"] - r["base_mb"] < 250, r


async def test_big_batches_to_a_fast_consumer_hold_a_bounded_amount(tmp_path):
    """A consumer that keeps up gets every batch (shed ones are replayed) with the
    resident memory bounded (the old code decoded 256 messages per burst before handing
    any over)."""
    r = await _run(tmp_path, 30, consume=True)
    assert r["taken"] == 30, r
    assert r["peak_mb"] - r["base_mb"] < 250, r
