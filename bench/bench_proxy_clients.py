"""The proxy's upstream client candidates side by side: aiohttp and httpx against one engine.

Starts one emulated engine (``kvstream engine``) and, in this process, keeps ``--streams``
streaming completions open against it with each client library in turn (the proxy's
upstream traffic pattern: many concurrent SSE streams from a few engines), reading every
event. Prints per client the CPU seconds this process spent per SSE event received and
per request, and the time to first byte (status line and headers) of a probe request sent
while the streams run. Lower is better; the client's CPU is what the proxy pays per event.

    python bench/bench_proxy_clients.py [--streams 64] [--seconds 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any, Awaitable, Callable

import anyio

from kvstream.emulator.launch import start_engine


async def _run(url: str, streams: int, seconds: float, tokens: int, client: str) -> dict[str, float]:
    events = 0
    requests = 0
    ttfb: list[float] = []
    end = time.monotonic() + seconds

    if client == "aiohttp":
        import aiohttp

        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
        session = aiohttp.ClientSession(url, connector=conn, auto_decompress=False,
                                        cookie_jar=aiohttp.DummyCookieJar())

        async def one(body: dict[str, Any]) -> float:
            nonlocal events
            t0 = time.perf_counter()
            async with session.post("/v1/completions", json=body) as r:
                t = time.perf_counter() - t0
                while True:
                    data = await r.content.readany()
                    if not data:
                        break
                    events += data.count(b"\n\n")
            return t

        async def close() -> None:
            await session.close()
    else:
        import httpx

        limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
        hc = httpx.AsyncClient(base_url=url, limits=limits, timeout=60)

        async def one(body: dict[str, Any]) -> float:
            nonlocal events
            t0 = time.perf_counter()
            async with hc.stream("POST", "/v1/completions", json=body) as r:
                t = time.perf_counter() - t0
                async for data in r.aiter_raw():
                    events += data.count(b"\n\n")
            return t

        async def close() -> None:
            await hc.aclose()

    async def worker(w: int) -> None:
        nonlocal requests
        i = 0
        while time.monotonic() < end:
            await one({"prompt": list(range(1, 256)) + [w * 100000 + i], "max_tokens": tokens, "stream": True})
            requests += 1
            i += 1

    async def probe() -> None:
        i = 0
        await anyio.sleep(1.0)
        while time.monotonic() < end - 0.5:
            ttfb.append(await one({"prompt": list(range(1, 256)) + [10**7 + i], "max_tokens": 1, "stream": True}))
            i += 1

    cpu0 = time.process_time()
    async with anyio.create_task_group() as tg:
        for w in range(streams):
            tg.start_soon(worker, w)
        tg.start_soon(probe)
    cpu = time.process_time() - cpu0
    await close()
    return {"events": events, "requests": requests, "cpu_s": cpu,
            "us_per_event": 1e6 * cpu / max(events, 1), "us_per_request": 1e6 * cpu / max(requests, 1),
            "ttfb_p50_ms": 1000 * statistics.median(ttfb) if ttfb else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    engine = start_engine("engine-0", log_dir=tempfile.mkdtemp(prefix="kvstream-bench-clients-"), extra=[
        "--decode-tokens-per-s", "40", "--prefill-tokens-per-s", "1e9", "--max-num-seqs", "256",
        "--num-gpu-blocks", "65536"])
    results: dict[str, list[dict[str, float]]] = {"aiohttp": [], "httpx": []}
    try:
        for _ in range(args.rounds):
            for client in results:
                results[client].append(anyio.run(_run, engine.url, args.streams, args.seconds, args.tokens, client))
    finally:
        engine.stop()
    print(f"{args.streams} streams of {args.tokens} tokens, {args.seconds:g} s per round, {args.rounds} rounds "
          "(CPU of this process; the engine runs beside it)")
    print(f"  {'client':<10}{'events':>9}{'requests':>10}{'us/event':>10}{'us/request':>12}{'TTFB p50 ms':>13}")
    for client, rs in results.items():
        ev = sum(r["events"] for r in rs)
        rq = sum(r["requests"] for r in rs)
        cpu = sum(r["cpu_s"] for r in rs)
        print(f"  {client:<10}{ev:>9}{rq:>10}{1e6 * cpu / ev:>10.1f}{1e6 * cpu / rq:>12.1f}"
              f"{statistics.median(r['ttfb_p50_ms'] for r in rs):>13.2f}")


if __name__ == "__main__":
    main()
