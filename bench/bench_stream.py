"""The KV event stream's publisher, measured beside its references in one run.

Sections (each prints kvstream and its reference):

1. ``publish() cost``: CPU of the engine's thread per ``publish()`` of a 5-event batch,
   everything included (encoding, seq, replay buffer, sending, the loop's wake-up), with one
   publish per loop turn (an engine step) and 64 per turn (a burst). References: a bare
   pyzmq PUB sending pre-encoded frames on the loop (the ceiling: no encoding, no buffer),
   and vLLM's own ``ZmqEventPublisher`` (0.11 and 0.33, run unmodified from the wheel cached
   by ``bench/vllm_peer``; skipped when that cache is absent), whose ``publish()`` only
   queues and whose thread encodes and sends: both threads' CPU is reported.
2. ``end to end to a SUB``: the publisher in a child process publishes 5-event batches as
   fast as it can; a plain SUB in this process receives them over loopback tcp and checks the
   seqs. Batches/s from the first to the last message, for kvstream, the pyzmq ceiling and
   vLLM's publisher.
3. ``replay port under abuse``: the floods of issue #15 at full size (10,000 buffered
   batches of about 2 KB) against a publisher whose event loop also runs an engine-like loop
   ticking every 2 ms (one batch per tick): lateness of that loop (wall clock and the part
   spent running other code on its thread), the replay bytes held in ZMQ, the process's RSS
   growth, and whether an honest requester got its whole replay.
4. (``--only subscriber``) kvstream's own Subscriber (decode, recovery) at the receiving
   end: 100-event batches and 1-event batches at full rate, steady rates with no replay
   endpoint (any loss would show as a gap), and the per-message receive cost of
   ``zmq.asyncio`` against the transport's NOBLOCK + ``wait_readable`` pattern.

Run: ``.venv/bin/python bench/bench_stream.py [--quick] [--only cost,e2e,abuse,subscriber]``.
Numbers are printed; nothing is asserted (tests assert behaviour, not speed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import anyio
import zmq

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(REPO))

from kvstream.wire.events import BlockStored, KVEventBatch, encode_batch  # noqa: E402
from kvstream.wire.framing import encode_seq  # noqa: E402
from kvstream.transport import KVEventsConfig, Publisher, SourceBatch, SourceSpec, Subscriber  # noqa: E402


# -- workload -----------------------------------------------------------------------------

def step_events(i: int, n_events: int = 5) -> list[BlockStored]:
    """``n_events`` single-block BlockStored events of 16 tokens (vocabulary-sized ids), the
    shape of a decode step's events in vLLM."""
    out = []
    for j in range(n_events):
        k = i * n_events + j
        out.append(BlockStored([k * 0x9E3779B97F4A7C15 % 2**64], None if j == 0 else (k - 1) * 0x9E3779B97F4A7C15 % 2**64,
                               [(k * 31 + t * 7919) % 128_000 for t in range(16)], 16, None, "GPU", None))
    return out


# -- vLLM's own publisher (optional) ------------------------------------------------------

def vllm_kv_events(release: str) -> Any | None:
    """vLLM ``release``'s ``kv_events`` module run unmodified, or None if its sources are not
    in the peer cache (``python bench/vllm_peer/fetch.py`` fetches them)."""
    sys.path.insert(0, str(BENCH))
    try:
        from vllm_peer import fetch, shims  # type: ignore[import-not-found]
    except ImportError:
        return None
    if not fetch.available(release):
        return None
    kv = shims.load(fetch.source_root(release)).kv_events
    # The publisher builds a vllm.config KVEventsConfig only to report it back; the
    # stand-in module has none, so a plain record stands in for it.
    kv.KVEventsConfig = lambda **kw: kw
    return kv


def vllm_batch(kv: Any, i: int) -> Any:
    evs = [kv.BlockStored(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                          token_ids=e.token_ids, block_size=e.block_size, lora_id=None,
                          medium="GPU", **({"lora_name": None} if "lora_name" in kv.BlockStored.__struct_fields__ else {}))
           for e in step_events(i)]
    return kv.KVEventBatch(ts=time.time(), events=evs)


# -- 1. publish() cost --------------------------------------------------------------------

async def _cost_kvstream(n: int, per_turn: int, ep: str) -> dict[str, float]:
    batches = [KVEventBatch(1.7e9, step_events(i)) for i in range(256)]
    cfg = KVEventsConfig(endpoint=ep, hwm=0, max_queue_size=1_000_000)
    async with Publisher(cfg) as pub:
        sub = _drain_sub(pub.endpoint)
        await anyio.sleep(0.2)
        base = await _loop_turns(n // per_turn)
        c0 = time.thread_time()
        i = 0
        for _ in range(n // per_turn):
            for _ in range(per_turn):
                b = batches[i & 255]
                pub.publish(KVEventBatch(b.ts, b.events))
                i += 1
            await anyio.sleep(0)
        used = time.thread_time() - c0 - base
        sub.close(0)
    return {"us_per_publish": used / i * 1e6}


async def _cost_pyzmq(n: int, per_turn: int, ep: str) -> dict[str, float]:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.bind(ep)
    sub = _drain_sub(ep)
    await anyio.sleep(0.2)
    frames = [[b"", encode_seq(i), encode_batch(KVEventBatch(1.7e9, step_events(i)))] for i in range(256)]
    base = await _loop_turns(n // per_turn)
    c0 = time.thread_time()
    i = 0
    for _ in range(n // per_turn):
        for _ in range(per_turn):
            pub.send_multipart(frames[i & 255], zmq.NOBLOCK)
            i += 1
        await anyio.sleep(0)
    used = time.thread_time() - c0 - base
    pub.close(0)
    sub.close(0)
    return {"us_per_publish": used / i * 1e6}


def _cost_vllm(kv: Any, n: int, per_turn: int, ep: str) -> dict[str, float]:
    pub = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=ep, hwm=0, max_queue_size=1_000_000)
    sub = _drain_sub(ep)
    time.sleep(0.2)
    batches = [vllm_batch(kv, i) for i in range(256)]
    p0, c0 = time.process_time(), time.thread_time()
    for i in range(n):
        b = batches[i & 255]
        pub.publish(kv.KVEventBatch(ts=b.ts, events=b.events))
    caller = time.thread_time() - c0
    while not pub._event_queue.empty():
        time.sleep(0.001)
    time.sleep(0.01)
    total = time.process_time() - p0
    pub.shutdown()
    sub.close(0)
    return {"us_per_publish": caller / n * 1e6, "us_per_batch_both_threads": total / n * 1e6}


def _drain_sub(ep: str) -> zmq.Socket:
    """A SUB connected to ``ep`` whose messages pile up in ZMQ (read by nobody: the cost of
    receiving is not the publisher's)."""
    s = zmq.Context.instance().socket(zmq.SUB)
    s.rcvhwm = 0
    s.linger = 0
    s.subscribe(b"")
    s.connect(ep)
    return s


async def _loop_turns(n: int) -> float:
    """Thread CPU of ``n`` empty loop turns (subtracted: the engine's loop turns anyway)."""
    c0 = time.thread_time()
    for _ in range(n):
        await anyio.sleep(0)
    return time.thread_time() - c0


def section_cost(quick: bool) -> None:
    n = 20_000 if quick else 100_000
    print(f"\n## 1. publish() cost: engine-thread CPU per 5-event batch ({n:,} batches, us)")
    with tempfile.TemporaryDirectory() as d:
        for per_turn in (1, 64):
            gc.collect()
            k = anyio.run(_cost_kvstream, n, per_turn, f"ipc://{d}/k{per_turn}")
            z = anyio.run(_cost_pyzmq, n, per_turn, f"ipc://{d}/z{per_turn}")
            row = (f"  {per_turn:>2} per loop turn: kvstream Publisher {k['us_per_publish']:.2f} | "
                   f"pyzmq PUB, pre-encoded (ceiling) {z['us_per_publish']:.2f}")
            print(row)
        for r in ("0.11", "0.33"):
            if not vllm_kv_events_available(r):
                print(f"  vLLM {r} ZmqEventPublisher: not available (python bench/vllm_peer/fetch.py fetches it)")
                continue
            # vLLM's publish() only queues; its thread encodes and sends (with the GIL). One
            # release per process: each runs in a child.
            v = _run_child(["vllm-cost", r, str(n), f"ipc://{d}/v{r}"])
            print(f"  vLLM {r} ZmqEventPublisher: publish() {v['us_per_publish']:.2f} on the caller + its "
                  f"thread = {v['us_per_batch_both_threads']:.2f} per batch in total")


# -- 2. end to end to a SUB ---------------------------------------------------------------

_CPU: list[float] = []  # process CPU at the start and the end of the publishing


async def _e2e_publisher_kvstream(ep: str, n: int) -> None:
    batches = [KVEventBatch(1.7e9, step_events(i)) for i in range(256)]
    cfg = KVEventsConfig(endpoint=ep, hwm=0, max_queue_size=1_000_000)
    async with Publisher(cfg) as pub:
        await _wait_go()
        _CPU.append(time.process_time())
        for i in range(0, n, 64):
            for k in range(i, min(i + 64, n)):
                b = batches[k & 255]
                pub.publish(KVEventBatch(b.ts, b.events))
            await anyio.sleep(0)
        while pub.queued:
            await anyio.sleep(0.001)
        _CPU.append(time.process_time())
        await anyio.sleep(0.5)


async def _e2e_publisher_pyzmq(ep: str, n: int) -> None:
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.sndhwm = 0
    pub.bind(ep)
    frames = [encode_batch(KVEventBatch(1.7e9, step_events(i))) for i in range(256)]
    await _wait_go()
    _CPU.append(time.process_time())
    for i in range(n):
        pub.send_multipart([b"", encode_seq(i), frames[i & 255]], zmq.NOBLOCK)
    _CPU.append(time.process_time())
    await anyio.sleep(0.5)
    pub.close(1000)


def _e2e_publisher_vllm(release: str, ep: str, n: int) -> None:
    kv = vllm_kv_events(release)
    assert kv is not None
    pub = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=ep, hwm=0, max_queue_size=1_000_000)
    batches = [vllm_batch(kv, i) for i in range(256)]
    anyio.run(_wait_go)
    _CPU.append(time.process_time())
    for i in range(n):
        b = batches[i & 255]
        pub.publish(kv.KVEventBatch(ts=b.ts, events=b.events))
    while not pub._event_queue.empty():
        time.sleep(0.001)
    _CPU.append(time.process_time())
    time.sleep(0.5)
    pub.shutdown()


async def _wait_go() -> None:
    """The child waits for the parent's SUB to be connected (a line on stdin)."""
    await anyio.to_thread.run_sync(sys.stdin.readline)


def _e2e(kind: str, n: int) -> dict[str, Any]:
    port = _free_port()
    ep_pub, ep_sub = f"tcp://*:{port}", f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, __file__, "--child", "e2e", kind, ep_pub, str(n)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    s = zmq.Context.instance().socket(zmq.SUB)
    s.rcvhwm = 0
    s.linger = 0
    s.subscribe(b"")
    s.connect(ep_sub)
    time.sleep(1.0)  # the child binds, then the SUB's subscription reaches it
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    got, expected, gaps = 0, 0, 0
    first = last = None
    c0 = time.thread_time()
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    deadline = time.perf_counter() + 60
    while got < n and time.perf_counter() < deadline:
        if not poller.poll(2000):
            break
        while True:
            try:
                frames = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if first is None:
                first = time.perf_counter()
            seq = int.from_bytes(frames[1], "big")
            gaps += seq != expected
            expected = seq + 1
            got += 1
        last = time.perf_counter()
    recv_cpu = time.thread_time() - c0
    s.close(0)
    out, _ = proc.communicate(timeout=30)
    child = json.loads(out.strip().splitlines()[-1])
    dt = (last or 0) - (first or 0)
    return {"received": got, "gaps": gaps, "batches_per_s": round(got / dt) if dt > 0 else None,
            "pub_cpu_us": round(child["cpu_s"] / n * 1e6, 2), "sub_cpu_us": round(recv_cpu / max(got, 1) * 1e6, 2)}


def _free_port() -> int:
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return int(so.getsockname()[1])


def section_e2e(quick: bool) -> None:
    n = 100_000 if quick else 300_000
    print(f"\n## 2. end to end to a SUB: 5-event batches, loopback tcp, publisher in a child ({n:,} batches)")
    kinds = ["kvstream", "pyzmq"] + [f"vllm-{r}" for r in ("0.11", "0.33") if vllm_kv_events_available(r)]
    for kind in kinds:
        r = _e2e(kind, n)
        label = {"kvstream": "kvstream Publisher", "pyzmq": "pyzmq PUB, pre-encoded (ceiling)"}.get(
            kind, f"vLLM {kind[5:]} ZmqEventPublisher")
        print(f"  {label}: {r['batches_per_s']:,} batches/s, received {r['received']:,}/{n:,}, gaps {r['gaps']}; "
              f"publisher process CPU {r['pub_cpu_us']} us/batch (all threads), "
              f"receiver {r['sub_cpu_us']} us/batch")


def vllm_kv_events_available(release: str) -> bool:
    sys.path.insert(0, str(BENCH))
    try:
        from vllm_peer import fetch
    except ImportError:
        return False
    return bool(fetch.available(release))


# -- 3. replay port under abuse -----------------------------------------------------------

FLOODS = [
    ("64 concurrent replays (all read)", "replays", 64, 1, {}, 0),
    ("2,000 snapshot requests (500 requesters x 4)", "snapshots", 2_000, 4, {}, 5_000),
    ("50 requesters that never read", "noread", 50, 1, {}, 0),
    ("8 requesters x 8 requests, never read", "noread", 8, 8, {}, 0),
]


async def _flood(mode: str, n: int, k: int, extra: dict, snapshot_blocks: int, buffered: int) -> dict[str, Any]:
    from tests.transport.replay_flood import Lateness, engine_loop, rss_bytes
    from anyio.streams.text import TextReceiveStream

    state = [BlockStored([h * 7919 + 1], None, list(range(16)), 16, None, "GPU", None)
             for h in range(snapshot_blocks)] if snapshot_blocks else None
    batches = [KVEventBatch(1.7e9, step_events(i)) for i in range(64)]
    with tempfile.TemporaryDirectory() as d:
        cfg = KVEventsConfig(endpoint=f"ipc://{d}/p", replay_endpoint=f"ipc://{d}/r", buffer_steps=buffered * 2, **extra)
        async with Publisher(cfg, snapshot_provider=(lambda: state) if state else None) as pub:
            for i in range(buffered):
                pub.publish(batches[i & 63])
                if i % 1024 == 0:
                    await anyio.sleep(0)
            while pub.queued:
                await anyio.sleep(0.01)
            gc.collect()
            gc.freeze()
            rss0 = rss_bytes()
            lat = Lateness()
            stop = anyio.Event()
            events: dict[str, dict] = {}

            def publish(i: int) -> None:
                b = batches[i & 63]
                pub.publish(KVEventBatch(b.ts, b.events))

            async with await anyio.open_process(
                [sys.executable, "-m", "tests.transport.replay_flood", mode, str(pub.replay_endpoint), str(n), str(k)],
                cwd=REPO,
            ) as proc:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(engine_loop, publish, stop, lat, 0.002, lambda: pub.replay_inflight_bytes)
                    buf = ""
                    assert proc.stdout is not None
                    async for chunk in TextReceiveStream(proc.stdout):
                        buf += chunk
                        while "\n" in buf:
                            line, buf = buf.split("\n", 1)
                            ev = json.loads(line)
                            events[ev["event"]] = ev
                        if "flood" in events:
                            break
                    stop.set()
                gc.unfreeze()
                assert proc.stdin is not None
                await proc.stdin.aclose()
                await proc.wait()
            st = pub.stats.as_dict()
    return {"lateness": lat.summary(), "max_inflight_mib": round(lat.max_inflight / 2**20, 1),
            "rss_growth_mib": round((lat.max_rss - rss0) / 2**20, 1), "honest": events.get("honest"),
            "flood": events.get("flood"), "stats": {k: v for k, v in st.items() if k.startswith(("replay", "snapshot")) and v}}


def section_abuse(quick: bool) -> None:
    buffered = 2_000 if quick else 10_000
    print(f"\n## 3. replay port under abuse ({buffered:,} buffered batches of ~1 KB; engine loop ticks every 2 ms "
          "and publishes one batch per tick; lateness in ms)")
    for label, mode, n, k, extra, snap in FLOODS:
        r = anyio.run(_flood, mode, n, k, extra, snap, buffered)
        lt, h = r["lateness"], r["honest"] or {}
        print(f"  {label}: lateness wall p50/p99/max {lt['wall']['p50']}/{lt['wall']['p99']}/{lt['wall']['max']}, "
              f"busy {lt['busy']['p50']}/{lt['busy']['p99']}/{lt['busy']['max']} ({lt['ticks']} ticks); "
              f"replay bytes in ZMQ max {r['max_inflight_mib']} MiB, RSS growth {r['rss_growth_mib']} MiB; "
              f"honest replay: {h.get('batches')} batches in {h.get('seconds')} s, {h.get('attempts')} request(s); "
              f"{r['stats']}")
    print("  (before #15's fix: 64 replays stalled the loop up to 950 ms, 2,000 snapshot requests 1.7 s, 50 "
          "non-readers pinned 1.3 GB, 8 x 8 non-readers denied the honest replay)")


# -- 4. kvstream's Subscriber at the receiving end ----------------------------------------

async def _sub_publisher(port: int, rport: int, n: int, n_events: int, rate: float) -> None:
    cfg = KVEventsConfig(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}" if rport else None,
                         hwm=1_000_000, max_queue_size=1_000_000, buffer_steps=200_000)
    batches = [KVEventBatch(1.7e9, step_events(i, n_events)) for i in range(256)]
    async with Publisher(cfg) as pub:
        with anyio.fail_after(30):
            await pub.wait_subscribed(1)  # the subscriber has joined
        t0 = time.perf_counter()
        for i in range(0, n, 64):
            for k in range(i, min(i + 64, n)):
                b = batches[k & 255]
                pub.publish(KVEventBatch(time.time(), b.events))
            if rate:
                ahead = (i + 64) / rate - (time.perf_counter() - t0)
                if ahead > 0:
                    await anyio.sleep(ahead)
                    continue
            await anyio.sleep(0)
        while pub.queued:
            await anyio.sleep(0.01)
        await anyio.sleep(2.0)  # answer late replays, let ZMQ flush


async def _sub_run(n: int, n_events: int, rate: float, replay: bool) -> dict[str, Any]:
    port, rport = _free_port(), (_free_port() if replay else 0)
    proc = await anyio.open_process([sys.executable, __file__, "--child", "sub", str(port), str(rport), str(n),
                                     str(n_events), str(rate)], stdout=None, stderr=None)
    got = events = 0
    first = last = None
    try:
        spec = SourceSpec(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}" if rport else None, name="bench")
        async with Subscriber([spec], rcvhwm=1_000_000, max_buffered_items=100_000) as sub:
            with anyio.move_on_after(60):
                async for item in sub:
                    if type(item) is SourceBatch:
                        first = first or time.perf_counter()
                        got += 1
                        events += len(item.batch.events)
                        if got == n:
                            break
            last = time.perf_counter()
            gaps = sub.health()["bench"].counters["gaps"]
    finally:
        await proc.wait()
    dt = (last or 0) - (first or 0)
    return {"batches": got, "batches_per_s": round(got / dt) if dt > 0 else 0,
            "events_per_s": round(events / dt) if dt > 0 else 0, "gaps": gaps}


async def _recv_cost(n: int) -> dict[str, float]:
    """Per-message receive cost in this process: zmq.asyncio's awaitable recv_multipart
    versus the transport's pattern (plain socket, NOBLOCK receives until EAGAIN, then
    anyio.wait_readable on the edge-triggered FD). Messages are queued up front on ipc."""
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
                    await r  # type: ignore[misc]
            await anyio.sleep(0.3)
            t0 = time.perf_counter()
            got = 0
            if mode == "zmq.asyncio":
                while got < n:
                    await pull.recv_multipart()  # type: ignore[misc]
                    got += 1
            else:
                while got < n:
                    try:
                        pull.recv_multipart(zmq.NOBLOCK)
                        got += 1
                    except zmq.Again:
                        if not pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
                            await anyio.wait_readable(pull.FD)
            out[mode] = round((time.perf_counter() - t0) / n * 1e6, 2)
            push.close(0)
            pull.close(0)
            ctx.term()
    return out


def section_subscriber(quick: bool) -> None:
    scale = 0.2 if quick else 1.0
    print("\n## 4. kvstream Publisher -> kvstream Subscriber (decode, recovery), loopback tcp, publisher in a child")
    print(f"  receive cost per message (us): {anyio.run(_recv_cost, int(100_000 * scale))}")
    nb = int(50_000 * scale)
    r = anyio.run(_sub_run, nb, 100, 0.0, True)
    print(f"  batched (100 events/batch), max rate: {r['events_per_s']:,} events/s ({r['batches_per_s']:,} batches/s), {r}")
    nu = int(500_000 * scale)
    r = anyio.run(_sub_run, nu, 1, 0.0, True)
    print(f"  unbatched (1 event/batch), max rate: {r['batches_per_s']:,} batches/s, {r}")
    ns = int(250_000 * scale)
    r = anyio.run(_sub_run, ns, 1, 50_000.0, False)
    print(f"  steady 50,000 batches/s unbatched, no replay: received {r['batches']:,}/{ns:,}, gaps={r['gaps']}")
    ns = int(25_000 * scale)
    r = anyio.run(_sub_run, ns, 100, 5_000.0, False)
    print(f"  steady 500,000 events/s batched, no replay: received {r['batches']:,}/{ns:,} batches, gaps={r['gaps']}")


# -- main ---------------------------------------------------------------------------------

def _run_child(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(args: list[str]) -> None:
    what = args[0]
    if what == "vllm-cost":
        release, n, ep = args[1], int(args[2]), args[3]
        kv = vllm_kv_events(release)
        print(json.dumps(_cost_vllm(kv, n, 1, ep)))
    elif what == "e2e":
        kind, ep, n = args[1], args[2], int(args[3])
        if kind == "kvstream":
            anyio.run(_e2e_publisher_kvstream, ep, n)
        elif kind == "pyzmq":
            anyio.run(_e2e_publisher_pyzmq, ep, n)
        else:
            _e2e_publisher_vllm(kind[5:], ep, n)
        # CPU of the whole publishing process while it published (all threads, ZMQ's I/O
        # thread included; the last messages may still be in flight).
        print(json.dumps({"cpu_s": _CPU[1] - _CPU[0]}))
    elif what == "sub":
        anyio.run(_sub_publisher, int(args[1]), int(args[2]), int(args[3]), int(args[4]), float(args[5]))


SECTIONS: dict[str, Callable[[bool], None]] = {
    "cost": section_cost, "e2e": section_e2e, "abuse": section_abuse, "subscriber": section_subscriber,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs")
    ap.add_argument("--only", default="cost,e2e,abuse", help="comma-separated sections: " + ",".join(SECTIONS))
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args()
    import logging

    logging.getLogger("kvstream").setLevel(logging.ERROR)  # floods are expected here: no warnings
    if a.child:
        _child(a.child)
        return
    print(f"bench_stream: python {sys.version.split()[0]}, pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    for name in a.only.split(","):
        SECTIONS[name.strip()](a.quick)


if __name__ == "__main__":
    main()
