"""The replay port under abuse (nobody needs credentials to reach it), on real ipc sockets
with the flood in a separate process: an engine-like loop ticking beside the publisher
stays on time, memory stays within the configured bytes, and an honest requester still
gets its whole replay."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import anyio
import pytest
from anyio.streams.text import TextReceiveStream

from kvstream.wire.events import BlockStored, KVEventBatch
from kvstream.transport import KVEventsConfig, Publisher

from tests.transport.replay_flood import Lateness, engine_loop, rss_bytes
from tests.transport.zmq_helpers import ipc

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
BUFFERED = 2_000


def step_batch(i: int) -> KVEventBatch:
    """A vLLM-like step: 5 BlockStored events of 4 blocks each (about 2 KB encoded)."""
    evs = []
    for e in range(5):
        base = (i * 5 + e) * 4
        evs.append(BlockStored([(base + b) * 0x9E3779B97F4A7C15 % 2**64 for b in range(4)], None,
                               [100_000 + t for t in range(64)], 16, None, "GPU", None))
    return KVEventBatch(1.7e9 + i, evs)


def pool_state(n_blocks: int) -> list:
    return [BlockStored([h * 7919 + 1], None, [100_000 + t for t in range(16)], 16, None, "GPU", None)
            for h in range(n_blocks)]


async def run_flood(cfg: KVEventsConfig, mode: str, n: int, k: int, *, snapshot_blocks: int = 0,
                    tick_s: float = 0.002) -> tuple[dict, dict, dict, Lateness, int, Publisher]:
    """Publisher + engine loop here, flood client in a child process; returns
    ``(honest, flood, stats, lateness, rss_before, publisher)``."""
    state = pool_state(snapshot_blocks) if snapshot_blocks else None
    batches = [step_batch(i) for i in range(64)]
    async with Publisher(cfg, snapshot_provider=(lambda: state) if state else None) as pub:
        for i in range(BUFFERED):
            pub.publish(batches[i & 63])
        with anyio.fail_after(30):
            while pub.queued:  # the burst has gone out (a state, polled)
                await anyio.sleep(0.01)
        # Engines freeze their startup heap (vLLM calls gc.freeze()): a full collection of
        # the test runner's heap would otherwise be measured as the publisher's lateness.
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
            [sys.executable, "-m", "tests.transport.replay_flood", mode, pub.replay_endpoint, str(n), str(k)],
            cwd=REPO,
        ) as proc:
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine_loop, publish, stop, lat, tick_s, lambda: pub.replay_inflight_bytes)
                buf = ""
                assert proc.stdout is not None
                with anyio.fail_after(60):
                    async for chunk in TextReceiveStream(proc.stdout):
                        buf += chunk
                        while "\n" in buf:
                            line, buf = buf.split("\n", 1)
                            ev = json.loads(line)
                            events[ev["event"]] = ev
                        if "flood" in events:
                            break
                    # Enough samples for a p99 (a loaded machine ticks less often than every
                    # tick_s, so a short flood may end first).
                    while len(lat.wall) <= 50:
                        await anyio.sleep(tick_s)
                stop.set()
            gc.unfreeze()
            stats = pub.stats.as_dict()
            assert proc.stdin is not None
            await proc.stdin.aclose()
            await proc.wait()
    return events["honest"], events["flood"], stats, lat, rss0, pub


def _check_on_time(lat: Lateness) -> dict:
    s = lat.summary()
    assert s["ticks"] > 50
    assert s["busy"]["p99"] < 10.0, s  # ms of this thread's time the engine loop lost, p99
    return s


def _check_honest(honest: dict) -> None:
    assert honest["seqs_ok"] and honest["batches"] >= BUFFERED, honest
    assert honest["first"] == 0


async def test_64_concurrent_replays_keep_the_engine_loop_on_time(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), buffer_steps=8_000)
    honest, flood, stats, lat, rss0, pub = await run_flood(cfg, "replays", 64, 1)
    s = _check_on_time(lat)
    _check_honest(honest)
    assert flood["ends"] == 64 and flood["batches"] >= 64 * BUFFERED  # every flood replay was served too
    assert lat.max_inflight <= cfg.replay_max_bytes + cfg.max_replay_jobs * 4096
    print(s, honest, flood)


async def test_2000_snapshot_requests_share_one_state_and_keep_the_loop_on_time(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), buffer_steps=8_000)
    honest, flood, stats, lat, rss0, pub = await run_flood(cfg, "snapshots", 2_000, 4, snapshot_blocks=1_000)
    s = _check_on_time(lat)
    _check_honest(honest)
    # Requests past max_replay_jobs + max_pending_replays are ignored and counted; the rest
    # get the whole state: 1,001 events in 2 batches.
    # Every request kept was answered; a waiting one of a requester with several waiting
    # made room for the honest requester's first (replay_evicted).
    assert flood["ends"] == stats["snapshot_requests"] - stats["replay_evicted"] >= cfg.max_pending_replays - 1
    assert honest["attempts"] <= 2  # first requests go first; a re-ask only if the machine is very busy
    assert flood["batches"] == 2 * flood["ends"]
    # One provider call per snapshot_reuse_s (and per new seq) at most, not one per request.
    assert stats["snapshot_provider_calls"] < 100
    print(s, honest, flood, stats["snapshot_provider_calls"])


async def test_50_requesters_that_never_read_pin_bounded_memory_and_are_dropped(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), buffer_steps=8_000,
                         replay_client_max_bytes=1 * MiB, replay_max_bytes=16 * MiB, replay_client_timeout_s=0.5)
    honest, flood, stats, lat, rss0, pub = await run_flood(cfg, "noread", 50, 1)
    s = _check_on_time(lat)
    _check_honest(honest)
    # Unbounded, 50 x 2,000 x 2 KB = 200 MB would sit in ZMQ's queues.
    assert lat.max_inflight <= cfg.replay_max_bytes + cfg.max_replay_jobs * 4096, lat.max_inflight
    assert lat.max_rss - rss0 < cfg.replay_max_bytes + 48 * MiB, (lat.max_rss - rss0) / MiB
    assert stats["replay_stalled"] + stats["replay_recycles"] > 0
    print(s, honest, stats, (lat.max_rss - rss0) / MiB)


async def test_8_requesters_asking_8_times_cannot_take_every_job_from_an_honest_one(tmp_path):
    cfg = KVEventsConfig(endpoint=ipc(tmp_path, "p"), replay_endpoint=ipc(tmp_path, "r"), buffer_steps=8_000)
    honest, flood, stats, lat, rss0, pub = await run_flood(cfg, "noread", 8, 8)
    s = _check_on_time(lat)
    _check_honest(honest)
    assert honest["attempts"] == 1  # served at once: one job per requester, not 64 for eight of them
    assert lat.max_inflight <= 8 * (cfg.replay_client_max_bytes + 4096) + 4 * MiB
    assert stats["replay_rejected"] == 8 * 4  # each requester may queue 4 requests
    print(s, honest, stats)
