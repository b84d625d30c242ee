"""The proxy's upstream client against the libraries that could be it: kvstream's own
(``kvstream.proxy.upstream``), aiohttp and httpx against one engine.

Starts one emulated engine (``kvstream engine``) and, in this process, keeps ``--streams``
streaming completions open against it with each client library in turn (the proxy's
upstream traffic pattern: many concurrent SSE streams from a few engines), reading every
event. Prints per client the CPU seconds this process spent per SSE event received and
per request, and the time to first byte (status line and headers) of a probe request sent
while the streams run. Lower is better; the client's CPU is what the proxy pays per event.

    python bench/bench_proxy_clients.py [--streams 64] [--seconds 6] [--non-streamed]

pyreqwest (Rust's reqwest under an asyncio API; not a dependency: ``pip install pyreqwest``)
is measured too when it is installed. Before any of that, each client is checked for what
the proxy needs on a client disconnect: cancelling a request whose answer has not begun
must close its connection (vLLM aborts a request only when its connection closes). A
silent server on loopback takes one request, the caller is cancelled after 0.2 s, and the
line says whether the server saw the connection close within 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any, Awaitable, Callable

import anyio
import msgspec

from kvstream.emulator.launch import start_engine


async def _run(url: str, streams: int, seconds: float, tokens: int, client: str,
               stream: bool = True) -> dict[str, float]:
    events = 0
    requests = 0
    ttfb: list[float] = []
    end = time.monotonic() + seconds

    if client == "kvstream":
        from kvstream.proxy.upstream import UpstreamPool

        host, port = url.split("//")[1].rsplit(":", 1)
        pool = UpstreamPool(host, int(port))
        enc = msgspec.json.Encoder()
        json_header = [(b"content-type", b"application/json")]

        async def one(body: dict[str, Any]) -> float:
            nonlocal events
            t0 = time.perf_counter()
            r = await pool.request("POST", "/v1/completions", enc.encode(body), json_header)
            t = time.perf_counter() - t0
            try:
                async for data in r.aiter_bytes():
                    events += data.count(b"\n\n")
            finally:
                await r.aclose()
            return t

        async def close() -> None:
            await pool.aclose()
    elif client == "aiohttp":
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
    elif client == "pyreqwest":
        from pyreqwest.client import ClientBuilder

        rc = ClientBuilder().base_url(url).build()

        async def one(body: dict[str, Any]) -> float:
            nonlocal events
            t0 = time.perf_counter()
            req = rc.post("/v1/completions").body_json(body).streamed_read_buffer_limit(0).build_streamed()
            async with req as r:
                t = time.perf_counter() - t0
                while (data := await r.body_reader.read_chunk()) is not None:
                    events += bytes(data).count(b"\n\n")
            return t

        async def close() -> None:
            await rc.close()
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
            await one({"prompt": list(range(1, 256)) + [w * 100000 + i], "max_tokens": tokens if stream else 1,
                       "stream": stream})
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


async def _closes_on_cancel(client: str) -> bool:
    """Whether cancelling a request that has no answer yet closes its connection."""
    import asyncio

    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            if not await reader.read(1):  # nothing more is sent: EOF is the client closing
                closed.set()
        except asyncio.CancelledError:  # still open when the check ends
            pass
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    if client == "kvstream":
        from kvstream.proxy.upstream import UpstreamPool

        pool = UpstreamPool("127.0.0.1", srv.sockets[0].getsockname()[1])
        send: Any = lambda: pool.request("GET", "/x", b"", [])  # noqa: E731
        done: Any = pool.aclose
    elif client == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession()
        send = lambda: session.get(url + "/x").__aenter__()  # noqa: E731
        done = session.close
    elif client == "pyreqwest":
        from pyreqwest.client import ClientBuilder

        rc = ClientBuilder().build()
        send = lambda: rc.get(url + "/x").streamed_read_buffer_limit(0).build_streamed().__aenter__()  # noqa: E731
        done = rc.close
    else:
        import httpx

        hc = httpx.AsyncClient()
        send = lambda: hc.get(url + "/x")  # noqa: E731
        done = hc.aclose
    task = asyncio.ensure_future(send())
    await asyncio.sleep(0.2)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    try:
        await asyncio.wait_for(closed.wait(), 2.0)
        ok = True
    except asyncio.TimeoutError:
        ok = False
    await done()
    srv.close()
    return ok


def _clients() -> list[str]:
    names = ["kvstream", "aiohttp", "httpx"]
    try:
        import pyreqwest  # noqa: F401

        names.append("pyreqwest")
    except ImportError:
        pass
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--non-streamed", action="store_true",
                   help="requests of 1 token, not streamed (the requests/s pattern): compare us/request")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop",
                   help="the event loop of the runs (kvstream serve runs on uvloop)")
    args = p.parse_args()
    engine = start_engine("engine-0", log_dir=tempfile.mkdtemp(prefix="kvstream-bench-clients-"), extra=[
        "--decode-tokens-per-s", "40", "--prefill-tokens-per-s", "1e9", "--max-num-seqs", "256",
        "--num-gpu-blocks", "65536"])
    import asyncio

    for client in _clients():
        ok = asyncio.run(_closes_on_cancel(client))
        print(f"  {client:<10} a request cancelled before its answer {'closes' if ok else 'does NOT close'} "
              "its connection", flush=True)
    results: dict[str, list[dict[str, float]]] = {c: [] for c in _clients()}
    try:
        for _ in range(args.rounds):
            for client in results:
                results[client].append(anyio.run(_run, engine.url, args.streams, args.seconds, args.tokens, client,
                                                  not args.non_streamed,
                                                  backend_options={"use_uvloop": args.loop == "uvloop"}))
    finally:
        engine.stop()
    what = "connections of 1-token non-streamed requests" if args.non_streamed else f"streams of {args.tokens} tokens"
    print(f"{args.streams} {what}, {args.seconds:g} s per round, {args.rounds} rounds, {args.loop} "
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
