"""Time to first byte through the KV-aware proxy vs calling the engine directly.

Starts one emulated engine (``kvstream engine``) and the proxy in front of it (``kvstream
serve --proxy``, KV-aware, following the engine's KV events; its client to the engine is
aiohttp's pool). For each target (the engine
directly, then the proxy, alternating over ``--rounds``), a background process keeps 64
streams open against it (each client sends a streaming completion of 40 tokens at 20
tokens/s, about 2 s, reads it to the end and sends the next: about 1,300 server-sent
events/s pass through), while a probe client in this process sends requests one at a time
and measures time to first byte: from sending the request to receiving the status line
and headers (a streaming response starts as soon as the engine accepted the request; the
tokens' timing is the engine's, not the proxy's). Prints p50/p90 for both and the
proxy's added p50 (budget: <= 1 ms).

    python bench/bench_proxy.py [--streams 64] [--probes 200] [--rounds 2]
    python bench/bench_proxy.py --clients    # the upstream client candidates alone (aiohttp, httpx)

``--watchers`` times the proxy's per-request disconnect watcher alone: an anyio task group
(start a task, cancel the scope), one plain asyncio task (``kvstream.proxy.app._until_disconnect``
under another ASGI server) and the guarded server's disconnect hook (what it uses under
``kvstream serve``), same run, same loop.

``--clients`` runs ``bench/bench_proxy_clients.py``: the two client libraries side by side
against one engine with 64 streams open (CPU per event, time to first byte), the
measurement the proxy's client was chosen by.

Client, background load, proxy and engine share this machine's cores: on a small machine
every hop also waits for CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import anyio
import httpx

from kvstream.emulator.launch import start_engine, start_serve_proxy


async def _load(url: str, streams: int, seconds: float, tokens: int) -> None:
    """Keep ``streams`` streaming completions open against ``url`` for ``seconds``."""
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < end:
                body = {"prompt": list(range(1, 256)) + [w * 100000 + i], "max_tokens": tokens, "stream": True}
                i += 1
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_raw():
                            pass
                except httpx.TransportError:
                    pass

        async with anyio.create_task_group() as tg:
            for w in range(streams):
                tg.start_soon(worker, w)


def _probe(url: str, n: int, offset: int) -> list[float]:
    out = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(n):
            body = {"prompt": list(range(1, 256)) + [offset + i], "max_tokens": 1, "stream": True}
            t0 = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as r:
                out.append(time.perf_counter() - t0)
                for _ in r.iter_raw():
                    pass
    return out


def _measure(url: str, args: argparse.Namespace, offset: int) -> list[float]:
    bg = subprocess.Popen([sys.executable, __file__, "--background", url, "--streams", str(args.streams),
                           "--seconds", str(args.seconds)])
    try:
        time.sleep(args.ramp)  # let the background streams open (a fixed ramp in a benchmark, not a test)
        return _probe(url, args.probes, offset)
    finally:
        bg.wait()


def _watchers(n: int = 20000) -> None:
    """Per-request cost of watching for a disconnect: anyio task group vs one asyncio task."""
    import asyncio

    from kvstream.proxy.app import _until_disconnect
    from kvstream.service.guard import DISCONNECT_EXTENSION, DisconnectHook

    async def main() -> None:
        gate = asyncio.Event()

        async def receive() -> dict[str, str]:
            await gate.wait()
            return {"type": "http.disconnect"}

        async def work() -> None:
            await asyncio.sleep(0)

        async def with_anyio() -> None:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    await receive()
                    tg.cancel_scope.cancel()
                tg.start_soon(watch)
                await work()
                tg.cancel_scope.cancel()

        async def with_task() -> None:
            await _until_disconnect({"type": "http"}, receive, work())

        async def with_hook() -> None:
            # What kvstream serve's guarded server gives each request (a new hook per request).
            scope = {"type": "http", "extensions": {DISCONNECT_EXTENSION: DisconnectHook()}}
            await _until_disconnect(scope, receive, work())

        for rnd in range(2):
            for name, f in (("anyio task group", with_anyio), ("asyncio task", with_task),
                            ("server's hook (kvstream)", with_hook)):
                t = time.perf_counter()
                for _ in range(n):
                    await f()
                print(f"  round {rnd + 1} {name:<24} {1e6 * (time.perf_counter() - t) / n:7.1f} us per request")

    try:
        import uvloop
        loop = "uvloop"
        runner: Any = uvloop.run
    except ImportError:
        loop = "asyncio"
        runner = asyncio.run
    print(f"disconnect watcher per request ({loop} loop, {n} requests per row)")
    runner(main())


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proxied(url: str) -> float:
    """Requests the proxy answered so far (its kvstream_proxy_requests_total, summed)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(m) for m in re.findall(r"^kvstream_proxy_requests_total\{[^}]*\} (\S+)$", text, re.M))


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[int(q * (len(s) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64, help="background streams kept open")
    p.add_argument("--probes", type=int, default=150, help="probe requests per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=40, help="output tokens per background request")
    p.add_argument("--decode", type=float, default=20.0, help="engine decode tokens/s per sequence")
    p.add_argument("--seconds", type=float, default=8.0, help="background load per round (s)")
    p.add_argument("--ramp", type=float, default=2.0, help="seconds of background load before probing")
    p.add_argument("--clients", action="store_true", help="compare the upstream client libraries instead")
    p.add_argument("--watchers", action="store_true", help="time the per-request disconnect watcher alone")
    p.add_argument("--background", metavar="URL", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.clients:
        import runpy

        # the same flags (--streams, --seconds, --tokens, --rounds) mean the same there
        sys.argv = [sys.argv[0].replace("bench_proxy.py", "bench_proxy_clients.py"),
                    *(a for a in sys.argv[1:] if a != "--clients")]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return
    if args.watchers:
        _watchers()
        return
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.background:
        anyio.run(_load, args.background, args.streams, args.seconds, args.tokens)
        return
    logs = tempfile.mkdtemp(prefix="kvstream-bench-proxy-")
    engine = start_engine("engine-0", log_dir=logs, extra=[
        "--decode-tokens-per-s", str(args.decode), "--prefill-tokens-per-s", "1e9", "--max-num-seqs", "256",
        "--num-gpu-blocks", "65536"])
    proxy = start_serve_proxy([engine], log_dir=logs, extra=["--log-level", "warning"])
    try:
        direct: list[float] = []
        proxied: list[float] = []
        _probe(engine.url, 10, 10**8)  # warm-up
        _probe(proxy.url, 10, 2 * 10**8)
        cpu = 0.0
        served = 0.0
        for r in range(args.rounds):
            direct += _measure(engine.url, args, 10**6 * (2 * r + 1))
            c0, n0 = _cpu_s(proxy.pid), _proxied(proxy.url)
            proxied += _measure(proxy.url, args, 10**6 * (2 * r + 2))
            cpu += _cpu_s(proxy.pid) - c0
            served += _proxied(proxy.url) - n0
    finally:
        proxy.stop()
        engine.stop()
    print(f"TTFB of {len(direct)} probe requests per target, with {args.streams} streams open "
          f"({args.tokens} tokens at {args.decode:g} tokens/s each)")
    print(f"  {'':<24}{'p50 (ms)':>10}{'p90 (ms)':>10}{'mean (ms)':>11}")
    via = "through serve --proxy"
    for name, xs in (("engine directly", direct), (via, proxied)):
        print(f"  {name:<24}{1000 * _pct(xs, 0.5):>10.2f}{1000 * _pct(xs, 0.9):>10.2f}"
              f"{1000 * statistics.fmean(xs):>11.2f}")
    # CPU time is far less sensitive to a loaded machine than latency: the proxy's own cost.
    print(f"  proxy CPU per proxied request: {1e6 * cpu / max(served, 1):.0f} us ({served:.0f} requests, "
          f"{args.tokens} tokens streamed each; load average {open('/proc/loadavg').read().split()[0]})")
    added = 1000 * (_pct(proxied, 0.5) - _pct(direct, 0.5))
    print(f"  added by the proxy at p50: {added:.2f} ms (budget 1 ms: {'met' if added <= 1.0 else 'NOT met'})")


if __name__ == "__main__":
    main()
