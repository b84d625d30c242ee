"""granian against today's server stack for ``kvstream serve``, same app, same run.

Today's stack is uvicorn with httptools, kvstream's hand-written fast path for the routing
calls (``service/fastpath.py``) and its guard (``service/guard.py``). granian (a Rust HTTP
server with its own workers) serves the same Starlette app (``bench/_granian_app.py``: the
same core, routes and runtime) through ASGI, one worker, on the same event loop as uvicorn
(asyncio; uvloop when installed is not used by either here). One emulated engine is
followed (its events fill the index with a few prompts) and, in proxy mode, proxied to.

For each server: ``POST /v1/route`` (a 1,024-token prompt) over 1 and 32 connections, and
with ``--proxy`` non-streamed ``POST /v1/completions`` through ``serve --proxy`` over 16
connections; requests/s, p50 and p99. The load client is aiohttp in this process, on the
same cores: compare the two servers with each other, not with other machines.

    python bench/bench_granian.py [--seconds 5] [--proxy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvstream.emulator.launch import Proc, start_engine

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer /healthz within {timeout_s:g} s")


def start(kind: str, engine: Proc, proxy: bool, logs: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    spec = f"e0={engine.events},{engine.replay},http={engine.url}"
    err = open(Path(logs) / f"{kind}-{port}.log", "wb")
    if kind == "uvicorn":
        argv = [sys.executable, "-m", "kvstream", "serve", "--port", str(port), "--load-interval", "0",
                "--log-level", "warning", spec] + (["--proxy"] if proxy else [])
        env = dict(os.environ)
        try:
            import uvloop  # noqa: F401

            print("note: uvloop is installed: serve uses it, granian here does not", file=sys.stderr)
        except ImportError:
            pass
    else:
        argv = [sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port),
                "--workers", "1", "--loop", "asyncio", "--no-log", "_granian_app:app"]
        env = dict(os.environ, PYTHONPATH=str(REPO / "bench"), KVSTREAM_BENCH_ENGINES=spec,
                   KVSTREAM_BENCH_PROXY="1" if proxy else "0")
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=str(REPO))
    url = f"http://127.0.0.1:{port}"
    _wait_http(url)
    return p, url


async def _load(url: str, path: str, bodies: list[bytes], conns: int, seconds: float) -> dict[str, float]:
    import aiohttp

    lat: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(k: int) -> None:
            nonlocal errors
            i = k
            while time.perf_counter() < end:
                t = time.perf_counter()
                body = bodies[i % len(bodies)]
                async with s.post(path, data=body, headers={"content-type": "application/json"}) as r:
                    await r.read()
                    errors += r.status != 200
                lat.append(time.perf_counter() - t)
                i += conns

        t0 = time.perf_counter()
        await asyncio.gather(*(one(k) for k in range(conns)))
        dur = time.perf_counter() - t0
    lat.sort()
    return {"rps": len(lat) / dur, "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))],
            "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--proxy", action="store_true", help="also time completions through serve --proxy")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the servers' order flipped each round (2)")
    args = ap.parse_args()
    logs = tempfile.mkdtemp(prefix="kvstream-bench-granian-")
    engine = start_engine("e0", log_dir=logs, extra=["--num-gpu-blocks", "65536", "--decode-tokens-per-s", "1e6",
                                                     "--prefill-tokens-per-s", "1e9", "--max-num-seqs", "256"])
    prompts = [[(d * 7919 + t) % 50000 + 1 for t in range(1024)] for d in range(8)]
    route = [json.dumps({"token_ids": p}).encode() for p in prompts]
    completion = [json.dumps({"prompt": p[:64] + [i], "max_tokens": 1}).encode() for i, p in enumerate(prompts)]
    for p in prompts:  # the engine caches them: its events fill the index
        httpx.post(engine.url + "/v1/completions", json={"prompt": p, "max_tokens": 1}, timeout=30)
    rows: list[tuple[str, str, dict[str, float]]] = []
    try:
        for rnd in range(args.rounds):
            for kind in (("uvicorn", "granian") if rnd % 2 == 0 else ("granian", "uvicorn")):
                for proxy in ((False, True) if args.proxy else (False,)):
                    p, url = start(kind, engine, proxy, logs)
                    try:
                        label = f"{kind}{' (--proxy)' if proxy else ''}"
                        for conns in (1, 32):
                            rows.append((label, f"/v1/route x{conns}",
                                         asyncio.run(_load(url, "/v1/route", route, conns, args.seconds))))
                        if proxy:
                            rows.append((label, "/v1/completions x16",
                                         asyncio.run(_load(url, "/v1/completions", completion, 16, args.seconds))))
                    finally:
                        p.terminate()
                        p.wait(15)
    finally:
        engine.stop()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    # Mean over the rounds (the order of the servers flips each round, so neither always
    # meets the machine's load first).
    merged: dict[tuple[str, str], list[dict[str, float]]] = {}
    for label, what, r in rows:
        merged.setdefault((label, what), []).append(r)
    rows = [(label, what, {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]})
            for (label, what), rs in sorted(merged.items(), key=lambda kv: (kv[0][0].split()[0] != "uvicorn",
                                                                            kv[0]))]
    print(f"kvstream serve on uvicorn (today's stack) vs granian, {args.seconds:g} s per line, mean of "
          f"{args.rounds} rounds, load average {' '.join(load)}")
    print(f"  {'server':<22}{'calls':<22}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}")
    for label, what, r in rows:
        print(f"  {label:<22}{what:<22}{r['rps']:>9.0f}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['errors']:>8.0f}")
    base = {what: r["rps"] for label, what, r in rows if label.startswith("uvicorn") and "proxy" not in label}
    base_p = {what: r["rps"] for label, what, r in rows if label == "uvicorn (--proxy)"}
    for label, what, r in rows:
        if label.startswith("granian"):
            ref = (base_p if "proxy" in label else base).get(what)
            if ref:
                print(f"  granian / uvicorn, {what}{' (--proxy)' if 'proxy' in label else ''}: {r['rps'] / ref:.2f}x")


if __name__ == "__main__":
    main()
