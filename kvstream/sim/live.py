"""Simulated engines live on loopback: the ``kvstream demo`` machinery.

The same :class:`~kvstream.sim.engine.EngineModel` cores as the virtual-time driver, but
each engine is an async task that sleeps until its next step (simulated time runs at
``speed`` x wall time), and publishes every step's events with a real
:class:`~kvstream.transport.publisher.Publisher` (tcp or ipc on loopback). A real
:class:`~kvstream.routing.router.Router` subscribes to all engines and routes each arrival from
its index; a separate subscriber feeds a :class:`~kvstream.eventlog.recorder.Recorder`
that writes the stream to an event log. Everything runs in one anyio task group.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import anyio

from kvstream.eventlog.recorder import Recorder
from kvstream.eventlog.writer import LogWriter
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.wire.events import KVEventBatch
from kvstream.routing.index import KVIndex
from kvstream.routing.router import Router
from kvstream.routing.scoring import Load
from kvstream.sim.blocks import SegmentHasher
from kvstream.sim.engine import EngineConfig, EngineModel, Prepared, SimRequestState
from kvstream.sim.metrics import PolicyResult, RunMetrics
from kvstream.sim.policies import make_policy
from kvstream.sim.workload import SimRequest, WorkloadError
from kvstream.transport.config import KVEventsConfig
from kvstream.transport.items import SourceBatch
from kvstream.transport.publisher import Publisher
from kvstream.transport.subscriber import SourceSpec, Subscriber

__all__ = ["LiveProgress", "LiveResult", "run_live"]


@dataclass
class LiveProgress:
    """A snapshot for the progress line (simulated seconds, counts)."""

    sim_time: float
    arrived: int
    completed: int
    total: int
    hit_rate: float
    events: int
    lag_p50_ms: float


@dataclass
class LiveResult:
    """What a live run produced: its metrics, the router's index and where the log is."""

    result: PolicyResult
    router_index: KVIndex | EngineKeyIndex
    log_path: Path
    batches_published: int
    batches_recorded: int
    sources: list[str]


async def run_live(
    requests: Sequence[SimRequest],
    policy: str,
    *,
    engines: int,
    config: EngineConfig,
    speed: float,
    log_path: Path,
    transport: str = "tcp",
    seed: int = 0,
    progress: Callable[[LiveProgress], None] | None = None,
    progress_interval_s: float = 0.5,
) -> LiveResult:
    """Run ``requests`` live over loopback sockets; see the module docstring.

    ``speed``: simulated seconds per wall second (must be finite). ``log_path``: the
    event log file to write. Returns once every request finished and both the router and
    the recorder hold every published batch.
    """
    if not (0 < speed < math.inf):
        raise WorkloadError(f"a live run needs a finite speed > 0, got {speed}")
    if transport not in ("tcp", "ipc"):
        raise WorkloadError(f"transport must be 'tcp' or 'ipc', got {transport!r}")
    pol = make_policy(policy, seed)
    hasher = SegmentHasher(config.block_hasher())
    metrics = RunMetrics(engines)
    models = [EngineModel(i, config, hasher, metrics) for i in range(engines)]
    names = [f"engine-{i}" for i in range(engines)]
    name_to_idx = {n: i for i, n in enumerate(names)}
    published = [-1] * engines
    recorded: dict[str, int] = {}
    lags: list[float] = []
    tmp = tempfile.TemporaryDirectory(prefix="kvstream-demo-") if transport == "ipc" else None

    def endpoints(i: int) -> tuple[str, str]:
        if tmp is not None:
            return f"ipc://{tmp.name}/e{i}.pub", f"ipc://{tmp.name}/e{i}.replay"
        return "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"

    log_path.parent.mkdir(parents=True, exist_ok=True)
    wall0 = time.perf_counter()
    try:
        async with contextlib.AsyncExitStack() as stack:
            pubs: list[Publisher] = []
            for i, m in enumerate(models):
                ep, rep = endpoints(i)
                cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=ep, replay_endpoint=rep)
                pubs.append(await stack.enter_async_context(
                    Publisher(cfg, snapshot_provider=m.manager.pool.snapshot_events)))
            specs = [SourceSpec(p.endpoint, p.replay_endpoint, name=names[i]) for i, p in enumerate(pubs)]
            router = await stack.enter_async_context(
                Router(specs, index=KVIndex(router_block_size=config.sim_block_size), policy=pol.scoring))
            sub = await stack.enter_async_context(Subscriber(specs))
            writer = stack.enter_context(LogWriter(log_path, metadata={"kvstream": "demo", "policy": policy}))

            def on_item(item: Any) -> None:
                if type(item) is SourceBatch:
                    recorded[item.source] = item.seq
                    lags.append(max(0.0, time.time() - item.batch.ts))
                    metrics.on_batch(len(item.batch.events), lags[-1])

            recorder = Recorder(sub, writer, on_item=on_item)
            # ZMQ subscriptions propagate asynchronously: let them settle before the
            # first batch (a missed first batch would be recovered by replay anyway).
            await anyio.sleep(0.3)
            t0 = time.perf_counter()
            wakes = [anyio.Event() for _ in models]
            done = anyio.Event()
            state = {"arrived": 0}

            def sim_now() -> float:
                return (time.perf_counter() - t0) * speed

            async def sleep_until(t_sim: float, wake: anyio.Event | None = None) -> None:
                delay = t_sim / speed - (time.perf_counter() - t0)
                if delay > 0:
                    if wake is None:
                        await anyio.sleep(delay)
                    else:
                        with anyio.move_on_after(delay):
                            await wake.wait()
                else:
                    await anyio.sleep(0)  # let the sockets and the router run

            async def engine_task(i: int) -> None:
                m = models[i]
                pub = pubs[i]
                while True:
                    if m.wakeup == math.inf:
                        if done.is_set() and not m.waiting and not m.running:
                            return
                        await wakes[i].wait()
                        wakes[i] = anyio.Event()
                        continue
                    t = m.wakeup
                    await sleep_until(t, wakes[i])
                    if wakes[i].is_set():
                        wakes[i] = anyio.Event()
                    if m.wakeup != t or sim_now() < t - 1e-9:
                        continue  # a run was cut short or we woke early: re-plan
                    events = m.step(t)
                    if events:
                        published[i] = pub.publish(KVEventBatch(time.time(), events))  # type: ignore[assignment]

            async def dispatcher() -> None:
                for req in requests:
                    await sleep_until(req.arrival)
                    loads = [Load(len(m.waiting), len(m.running), m.usage) for m in models]
                    prep = Prepared(req, config, hasher)
                    if pol.uses_index:
                        load_map = {names[i]: ld for i, ld in enumerate(loads)}
                        target = pol.choose(
                            loads, lambda _s: router.route(prep.prompt_tokens, load_map).best, name_to_idx)
                    else:
                        target = pol.choose(loads)
                    m = models[target]
                    st = SimRequestState(req, target, req.arrival)
                    if m.submit(st, req.arrival, prep):
                        metrics.routed[target] += 1
                    state["arrived"] += 1
                    wakes[target].set()
                done.set()
                for w in wakes:
                    w.set()

            async def reporter() -> None:
                while True:
                    await anyio.sleep(progress_interval_s)
                    if progress is not None:
                        sl = sorted(lags)
                        progress(LiveProgress(
                            sim_now(), state["arrived"], metrics.completed, len(requests),
                            metrics.hit_tokens / metrics.prompt_tokens if metrics.prompt_tokens else 0.0,
                            metrics.events, 1000 * sl[len(sl) // 2] if sl else 0.0))

            async with anyio.create_task_group() as outer:
                outer.start_soon(recorder.run)
                outer.start_soon(reporter)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(dispatcher)
                    for i in range(engines):
                        tg.start_soon(engine_task, i)
                end_sim = max((req.arrival for req in requests), default=0.0)
                end_sim = max(end_sim, sim_now())
                # Wait until the router and the recorder hold every published batch.
                for i, n in enumerate(names):
                    if published[i] >= 0:
                        await router.wait_applied(n, published[i], timeout_s=10.0)
                with anyio.fail_after(10.0):
                    while any(published[i] >= 0 and recorded.get(n, -1) < published[i] for i, n in enumerate(names)):
                        await anyio.sleep(0.01)
                recorder.stop()
                outer.cancel_scope.cancel()
            metrics.end_time = end_sim
            wall = time.perf_counter() - wall0
            result = metrics.summary(policy, len(requests), wall_seconds=wall, mode="live")
            return LiveResult(result, router.index, log_path, sum(p + 1 for p in published),
                              recorder.stats.batches, names)
    finally:
        if tmp is not None:
            tmp.cleanup()
