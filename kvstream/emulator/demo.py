"""The demo's real stack: emulated engines and proxies as processes, a load generator, a
recorder, and the replay proof.

:func:`run_demo` starts ``engines`` emulated engines (``kvstream engine``: HTTP + KV events
on loopback) and two ``kvstream serve --proxy`` services in front of them (one KV-aware,
one round robin). In this process, a :class:`~kvstream.routing.router.Router` follows every engine's
stream (the "live index") and a :class:`~kvstream.eventlog.recorder.Recorder` writes it to
``OUT/events.kvlog``. The same multi-turn workload then runs through each proxy in turn
(with every engine's prefix cache reset in between), measured by the client. At the end the
log is replayed into a fresh index, which must equal the live one.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import anyio

from kvstream.emulator.launch import Proc, start_engine, start_serve_proxy
from kvstream.emulator.loadgen import ChatWorkload, PhaseResult, TurnResult, run_workload

__all__ = ["DemoConfig", "DemoResult", "PhaseReport", "Progress", "run_demo"]

POLICIES = ("kv-aware", "round-robin")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs: engines, their cache and speed, the workload, where output goes."""

    engines: int = 4
    workload: ChatWorkload = ChatWorkload()
    num_gpu_blocks: int = 1500
    block_size: int = 16
    prefill_tokens_per_s: float = 10000.0
    decode_tokens_per_s: float = 50.0
    transport: str = "tcp"
    out: Path = Path("kvstream-demo")


@dataclass
class Progress:
    """A snapshot for the progress line: the policy running, wall seconds since it started,
    sessions and requests done, prefix hit rate and TTFT p50 so far (seconds)."""

    policy: str
    wall_s: float
    requests_done: int
    requests_total: int
    failed: int
    hit_rate: float
    ttft_p50_s: float


@dataclass
class PhaseReport:
    """One policy's run: the client's measurements and the proxy's routing accuracy."""

    policy: str
    phase: PhaseResult
    routing: dict[str, Any]
    per_engine: dict[str, int]


@dataclass
class DemoResult:
    """Everything the summary shows."""

    phases: list[PhaseReport] = field(default_factory=list)
    log_path: Path = Path()
    batches_recorded: int = 0
    events_recorded: int = 0
    record_wall_s: float = 0.0
    live_index: Any = None
    sources: list[str] = field(default_factory=list)
    interrupted: bool = False


def _accuracy(engines: list[dict[str, Any]]) -> dict[str, Any]:
    """Routing accuracy over every engine of ``kvstream serve --proxy``'s ``/v1/engines``."""
    n = exact = pred = real = 0
    for e in engines:
        a = e.get("proxy", {}).get("routing_accuracy") or {}
        n += a.get("requests", 0)
        exact += a.get("exact", 0)
        pred += a.get("predicted_tokens", 0)
        real += a.get("realized_tokens", 0)
    return {"requests": n, "exact": exact, "exact_rate": exact / n if n else None, "predicted_tokens": pred,
            "realized_tokens": real}


def _published(text: str) -> int:
    m = re.search(r"^kvstream:kv_event_batches_published_total\{[^}]*\} (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


async def run_demo(cfg: DemoConfig, result: DemoResult,
                   progress: Callable[[Progress], None] | None = None,
                   on_started: Callable[[list[Proc], list[Proc]], None] | None = None) -> DemoResult:
    """Run the demo, filling ``result`` as it goes (so an interrupted run still says what
    it kept). Processes are always stopped before this returns or raises."""
    import httpx

    from kvstream.eventlog.recorder import Recorder
    from kvstream.eventlog.writer import LogWriter
    from kvstream.routing.index import KVIndex
    from kvstream.routing.router import Router
    from kvstream.transport.items import SourceBatch
    from kvstream.transport.subscriber import SourceSpec, Subscriber

    out = cfg.out
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = out / "events.kvlog"
    if log_path.exists():
        log_path.unlink()
    result.log_path = log_path
    opts = ["--num-gpu-blocks-override", str(cfg.num_gpu_blocks), "--block-size", str(cfg.block_size),
            "--prefill-tokens-per-s", str(cfg.prefill_tokens_per_s),
            "--decode-tokens-per-s", str(cfg.decode_tokens_per_s), "--max-model-len", "32768"]
    engines: list[Proc] = []
    proxies: list[Proc] = []
    ipc = out.resolve() / "ipc"
    if cfg.transport == "ipc":
        ipc.mkdir(exist_ok=True)
    try:
        for i in range(cfg.engines):
            ev = (f"ipc://{ipc}/e{i}.pub", f"ipc://{ipc}/e{i}.replay") if cfg.transport == "ipc" else \
                ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
            engines.append(start_engine(f"engine-{i}", events=ev[0], replay=ev[1], extra=opts, log_dir=str(logs),
                                        wait=False))
        for e in engines:
            await anyio.to_thread.run_sync(e.wait_ready, abandon_on_cancel=True)
        for pol in POLICIES:
            proxies.append(start_serve_proxy(engines, policy=pol, log_dir=str(logs), wait=False,
                                             extra=["--router-block-size", str(cfg.block_size)]))
        for p in proxies:
            await anyio.to_thread.run_sync(p.wait_ready, abandon_on_cancel=True)
        if on_started is not None:
            on_started(engines, proxies)
        specs = [SourceSpec(e.events or "", e.replay, name=e.name) for e in engines]
        result.sources = [e.name for e in engines]
        recorded: dict[str, int] = {}

        def on_item(item: Any) -> None:
            if type(item) is SourceBatch:
                recorded[item.source] = item.seq
                result.batches_recorded += 1
                result.events_recorded += len(item.batch.events)

        async with contextlib.AsyncExitStack() as stack:
            router = await stack.enter_async_context(
                Router(specs, index=KVIndex(router_block_size=cfg.block_size)))
            result.live_index = router.index
            sub = await stack.enter_async_context(Subscriber(specs))
            writer = stack.enter_context(LogWriter(log_path, metadata={"kvstream": "demo"}))
            recorder = Recorder(sub, writer, on_item=on_item)
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=10))

            async def synced() -> None:
                """Wait until the live index and the log hold every batch published."""
                for e in engines:
                    n = _published((await client.get(e.url + "/metrics")).text)
                    if n:
                        await router.wait_applied(e.name, n - 1, timeout_s=15.0)
                        with anyio.fail_after(15.0):
                            while recorded.get(e.name, -1) < n - 1:
                                await anyio.sleep(0.01)

            async with anyio.create_task_group() as tg:
                tg.start_soon(recorder.run)
                t_rec = time.perf_counter()
                # A subscription takes a moment to reach a PUB socket; events published
                # before it would only be recovered by replay, so wait for a subscriber
                # state instead of racing it.
                with anyio.fail_after(15.0):
                    while any(h.state != "live" for h in router.health().values()) or \
                            any(h.state != "live" for h in sub.health().values()):
                        await anyio.sleep(0.01)
                for pol, proxy in zip(POLICIES, proxies):
                    if result.phases:  # a cold start for every policy
                        for e in engines:
                            r = await client.post(e.url + "/reset_prefix_cache")
                            if r.status_code != 200:
                                raise RuntimeError(f"{e.name} refused to reset its prefix cache: {r.text}")
                    await synced()
                    done: list[TurnResult] = []
                    t0 = time.perf_counter()

                    def on_turn(t: TurnResult, pol: str = pol, t0: float = t0, done: list[TurnResult] = done) -> None:
                        done.append(t)
                        if progress is not None:
                            ok = [x for x in done if x.ok]
                            total = sum(x.prompt_tokens for x in ok)
                            ttfts = sorted(x.ttft_s for x in ok)
                            progress(Progress(pol, time.perf_counter() - t0, len(done), cfg.workload.requests,
                                              len(done) - len(ok),
                                              sum(x.cached_tokens for x in ok) / total if total else 0.0,
                                              ttfts[len(ttfts) // 2] if ttfts else float("nan")))

                    phase = await run_workload(proxy.url, cfg.workload, on_turn=on_turn)
                    view = (await client.get(proxy.url + "/v1/engines")).json()
                    result.phases.append(PhaseReport(pol, phase, _accuracy(view["engines"]),
                                                     {e["name"]: e.get("proxy", {}).get("served", 0)
                                                      for e in view["engines"]}))
                await synced()
                result.record_wall_s = time.perf_counter() - t_rec
                recorder.stop()
                tg.cancel_scope.cancel()
        return result
    finally:
        with anyio.CancelScope(shield=True):
            for p in proxies + engines:
                await anyio.to_thread.run_sync(p.stop)
