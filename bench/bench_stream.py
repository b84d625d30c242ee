"""End-to-end stream benchmark: kvstream Publisher -> loopback tcp -> Subscriber (with decode).

The publisher runs in a child process (its own core), the subscriber in this one; both are
the real classes. Three runs:

* batched: 100 single-block BlockStored events per batch, as fast as possible
  (target >= 1 M events/s received and decoded);
* unbatched: 1 event per batch (target >= 100 k batches/s);
* steady: a fixed rate below capacity (50 k batches/s unbatched; 5 k batches/s = 500 k
  events/s batched) with *no* replay endpoint, so any loss would show as a gap (target: zero
  gaps, every batch received live).

Run: .venv/bin/python bench/bench_stream.py [--quick]
Numbers are printed; nothing is asserted here (tests assert behaviour, not speed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import anyio

from kvstream.wire.events import BlockStored, KVEventBatch
from kvstream.transport import KVEventsConfig, Publisher, SourceBatch, SourceSpec, Subscriber


def _batch(i: int, n_events: int) -> KVEventBatch:
    evs = [BlockStored([(i * n_events + j) & 0xFFFFFFFFFFFF | (1 << 40)], None, list(range(16)), 16, None, "GPU", None)
           for j in range(n_events)]
    return KVEventBatch(1.7e9, evs)


async def _publisher(port_pub: int, port_rep: int | None, n_batches: int, n_events: int, rate: float) -> None:
    cfg = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port_pub}".replace("127.0.0.1", "*"),
                         replay_endpoint=f"tcp://*:{port_rep}" if port_rep else None,
                         hwm=1_000_000, max_queue_size=1_000_000, buffer_steps=200_000)
    batches = [_batch(i, n_events) for i in range(256)]
    async with Publisher(cfg) as pub:
        await anyio.sleep(1.0)  # let the subscriber connect (slow joiner)
        t0 = time.perf_counter()
        step = 64
        for i in range(0, n_batches, step):
            for k in range(i, min(i + step, n_batches)):
                b = batches[k & 255]
                pub.publish(KVEventBatch(time.time(), b.events))
            if rate:
                ahead = (i + step) / rate - (time.perf_counter() - t0)
                if ahead > 0:
                    await anyio.sleep(ahead)
                    continue
            await anyio.sleep(0)
        while pub.queued:
            await anyio.sleep(0.01)
        dt = time.perf_counter() - t0
        print(json.dumps({"pub_s": dt, "published": pub.stats.published, "sent": pub.stats.sent}),
              file=sys.stderr)
        await anyio.sleep(2.0)  # answer late replays, let ZMQ flush


def _free_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


async def _run(n_batches: int, n_events: int, rate: float, replay: bool) -> dict:
    pp = _free_port()
    rp = _free_port() if replay else None
    args = [sys.executable, __file__, "--child", str(pp), str(rp or 0), str(n_batches), str(n_events), str(rate)]
    proc = subprocess.Popen(args)
    try:
        spec = SourceSpec(f"tcp://127.0.0.1:{pp}", f"tcp://127.0.0.1:{rp}" if rp else None, name="bench")
        got = events = 0
        first = last = None
        async with Subscriber([spec], rcvhwm=1_000_000, max_buffered_items=100_000) as sub:
            with anyio.move_on_after(60):
                async for item in sub:
                    if type(item) is SourceBatch:
                        if first is None:
                            first = time.perf_counter()
                        got += 1
                        events += len(item.batch.events)
                        if got == n_batches:
                            last = time.perf_counter()
                            break
            h = sub.health()["bench"]
    finally:
        proc.wait(timeout=30)
    dt = (last or time.perf_counter()) - (first or time.perf_counter())
    return {"batches": got, "events": events, "seconds": round(dt, 3),
            "batches_per_s": round(got / dt) if dt else None, "events_per_s": round(events / dt) if dt else None,
            "gaps": h.counters["gaps"], "replays": h.counters["replays"], "complete": got == n_batches}


async def _recv_cost(n: int) -> dict:
    """Per-message receive cost in this process: zmq.asyncio's awaitable recv_multipart
    versus the transport's pattern (plain socket, NOBLOCK receives until EAGAIN, then
    anyio.wait_readable on the edge-triggered FD). Messages are queued up front on ipc."""
    import os
    import tempfile

    import zmq
    import zmq.asyncio

    out = {}
    frames = [b"kv", (1).to_bytes(8, "big"), b"x" * 200]
    with tempfile.TemporaryDirectory() as d:
        for mode in ("zmq.asyncio", "nonblocking+wait_readable"):
            ep = f"ipc://{os.path.join(d, mode[:3])}.sock"
            ctx = zmq.asyncio.Context() if mode == "zmq.asyncio" else zmq.Context()
            push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
            push.sndhwm = pull.rcvhwm = 0
            pull.bind(ep)
            push.connect(ep)
            for _ in range(n):
                r = push.send_multipart(frames)
                if mode == "zmq.asyncio":
                    await r
            await anyio.sleep(0.3)
            t0 = time.perf_counter()
            got = 0
            if mode == "zmq.asyncio":
                while got < n:
                    await pull.recv_multipart()
                    got += 1
            else:
                while got < n:
                    try:
                        pull.recv_multipart(zmq.NOBLOCK)
                        got += 1
                    except zmq.Again:
                        if not pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            await anyio.wait_readable(pull.FD)
            out[mode] = round((time.perf_counter() - t0) / n * 1e6, 2)
            push.close(0)
            pull.close(0)
            ctx.term()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", nargs=5)
    a = ap.parse_args()
    if a.child:
        pp, rp, n, ne, rate = a.child
        anyio.run(_publisher, int(pp), int(rp) or None, int(n), int(ne), float(rate))
        return
    scale = 0.2 if a.quick else 1.0
    cost = anyio.run(_recv_cost, int(100_000 * scale))
    print(f"receive cost per message (us): {cost}")
    nb = int(50_000 * scale)
    r = anyio.run(_run, nb, 100, 0.0, True)
    print(f"batched (100 events/batch): {r['events_per_s']:,} events/s ({r['batches_per_s']:,} batches/s), "
          f"{r}")
    nu = int(500_000 * scale)
    r = anyio.run(_run, nu, 1, 0.0, True)
    print(f"unbatched (1 event/batch):  {r['batches_per_s']:,} batches/s, {r}")
    rate = 50_000.0
    ns = int(250_000 * scale)
    r = anyio.run(_run, ns, 1, rate, False)
    print(f"steady {rate:,.0f} batches/s unbatched, no replay: received {r['batches']:,}/{ns:,}, "
          f"gaps={r['gaps']}, {r}")
    rate = 5_000.0
    ns = int(25_000 * scale)
    r = anyio.run(_run, ns, 100, rate, False)
    print(f"steady {rate * 100:,.0f} events/s batched, no replay: received {r['batches']:,}/{ns:,} batches, "
          f"gaps={r['gaps']}, {r}")


if __name__ == "__main__":
    main()
