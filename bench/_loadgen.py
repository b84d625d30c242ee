"""Load generators for the overhead benches, each in processes of its own.

A router's added latency and its most requests/s are only its own when the load that
drives it does not share its process (and its event loop) with the measuring client: a
Python client in the bench's process is the bottleneck long before a Rust router is (every
router measured ~260-310 req/s that way). So the load runs elsewhere:

* :class:`BackgroundStreams`: ``streams`` streaming completions kept open against one or
  more URLs (taken round robin), spread over ``processes`` worker processes (aiohttp, one
  event loop each). It returns once every stream has received its first answer (a state,
  not a pause), and stops them on exit.
* :func:`max_rps`: a closed loop of ``connections`` keep-alive connections sending short
  non-streamed completions for ``seconds``: ``wrk`` (Debian's ``wrk`` package, a C load
  generator, with a Lua script making every prompt unique) when it is on ``PATH``, else
  ``processes`` Python worker processes (aiohttp). Returns requests/s, non-200 answers
  and socket errors, and which generator ran.

Run as a script it is one worker process (what the two above start)::

    python bench/_loadgen.py streams URL[,URL...] --streams 32 --tokens 40
    python bench/_loadgen.py rps URL --connections 32 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

MODEL = "kvstream-emulated"
_PAD = "x" * 200  # every prompt: a unique head, then this (no two requests share a cached prefix)


def stream_body(worker: int, k: int, tokens: int) -> dict[str, Any]:
    """The body of background stream ``worker``'s ``k``-th request (text, streamed)."""
    return {"model": MODEL, "prompt": f"background {worker} {k} {_PAD}", "max_tokens": tokens, "stream": True}


def rps_body(worker: int, k: int) -> dict[str, Any]:
    """The body of a requests/s request (text, one output token, not streamed)."""
    return {"model": MODEL, "prompt": f"rps {worker} {k} " + "z" * 100, "max_tokens": 1}


# --- the worker processes -------------------------------------------------------------------

async def _streams_worker(urls: list[str], streams: int, tokens: int, base: int) -> dict[str, int]:
    import aiohttp

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    started = 0
    done = failed = 0
    ready = asyncio.Event()

    async def worker(session: aiohttp.ClientSession, w: int) -> None:
        nonlocal started, done, failed
        url = urls[w % len(urls)] + "/v1/completions"
        first = True
        k = 0
        while not stop.is_set():
            k += 1
            try:
                async with session.post(url, json=stream_body(base + w, k, tokens)) as r:
                    if first:
                        first = False
                        started += 1
                        if started == streams:
                            ready.set()
                    async for _ in r.content.iter_any():
                        pass
                    done += r.status == 200
                    failed += r.status != 200
            except (aiohttp.ClientError, OSError):
                failed += 1
                await asyncio.sleep(0.05)  # a refused connection is not retried in a hot loop

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.create_task(worker(session, w)) for w in range(streams)]
        try:
            await ready.wait()
            print("ready", flush=True)
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"done": done, "failed": failed}


async def _rps_worker(url: str, connections: int, seconds: float, base: int) -> dict[str, int]:
    import aiohttp

    ok = bad = errors = 0
    end = time.monotonic() + seconds

    async def worker(session: aiohttp.ClientSession, w: int) -> None:
        nonlocal ok, bad, errors
        k = 0
        while time.monotonic() < end:
            k += 1
            try:
                async with session.post(url + "/v1/completions", json=rps_body(base + w, k)) as r:
                    await r.read()
                    ok += r.status == 200
                    bad += r.status != 200
            except (aiohttp.ClientError, OSError):
                errors += 1

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(worker(session, w) for w in range(connections)))
    return {"ok": ok, "non_200": bad, "errors": errors}


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# --- what the benches call ------------------------------------------------------------------

class BackgroundStreams:
    """``with BackgroundStreams(urls, streams=63):`` keeps that many streams open (see the
    module docstring); ``summary`` (after the block): requests done and failed."""

    def __init__(self, urls: Sequence[str], *, streams: int, tokens: int = 40, processes: int = 2,
                 ready_timeout_s: float = 60.0) -> None:
        self.urls = list(urls)
        self.streams = streams
        self.tokens = tokens
        self.processes = max(1, min(processes, streams)) if streams else 0
        self.ready_timeout_s = ready_timeout_s
        self.summary: dict[str, int] = {"done": 0, "failed": 0}
        self._procs: list[subprocess.Popen[str]] = []

    def __enter__(self) -> "BackgroundStreams":
        if not self.streams:
            return self
        share = [self.streams // self.processes + (i < self.streams % self.processes) for i in range(self.processes)]
        try:
            for i, n in enumerate(share):
                self._procs.append(subprocess.Popen(
                    [sys.executable, __file__, "streams", ",".join(self.urls), "--streams", str(n), "--tokens",
                     str(self.tokens), "--base", str(time.time_ns() // 1000 + 10**6 * i)],
                    stdout=subprocess.PIPE, text=True))
            deadline = time.monotonic() + self.ready_timeout_s
            for p in self._procs:  # each says "ready" once all its streams got a first answer
                assert p.stdout is not None
                line = _readline_until(p, deadline)
                if line.strip() != "ready":
                    raise RuntimeError(f"background streams did not open within {self.ready_timeout_s:g} s "
                                       f"(worker said {line!r})")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self._procs:
            try:
                out, _ = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            for line in (out or "").splitlines():
                if line.startswith("{"):
                    got = json.loads(line)
                    for k in self.summary:
                        self.summary[k] += int(got.get(k, 0))
        self._procs = []


def _readline_until(p: subprocess.Popen[str], deadline: float) -> str:
    import selectors

    assert p.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                return p.stdout.readline()
            if p.poll() is not None:
                return ""
    return ""


_WRK_SCRIPT = r"""
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local n = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  n = n + 1
  local body = '{"model":"@MODEL@","prompt":"rps @RUN@ ' .. tid .. ' ' .. n .. ' @PAD@","max_tokens":1}'
  return wrk.format(nil, "/v1/completions", nil, body)
end
"""


def max_rps(url: str, *, connections: int = 64, seconds: float = 10.0, processes: int = 2,
            generator: str = "auto") -> dict[str, Any]:
    """Requests/s of short non-streamed completions through ``url`` (see the module
    docstring). ``generator``: ``"wrk"``, ``"python"`` or ``"auto"`` (wrk if installed).
    Returns ``{"rps", "ok", "non_200", "errors", "generator"}``."""
    wrk = shutil.which("wrk")
    if generator == "wrk" and wrk is None:
        raise RuntimeError("no wrk on PATH (Debian: apt-get install wrk); or use the python generator")
    if generator != "python" and wrk is not None:
        return _wrk(wrk, url, connections, seconds)
    procs = []
    share = [connections // processes + (i < connections % processes) for i in range(processes)]
    t0 = time.perf_counter()
    for i, n in enumerate(share):
        procs.append(subprocess.Popen([sys.executable, __file__, "rps", url, "--connections", str(n), "--seconds",
                                       str(seconds), "--base", str(time.time_ns() // 1000 + 10**6 * i)],
                                      stdout=subprocess.PIPE, text=True))
    total = {"ok": 0, "non_200": 0, "errors": 0}
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 120)
        got = json.loads(out.strip().splitlines()[-1])
        for k in total:
            total[k] += int(got[k])
    wall = max(seconds, time.perf_counter() - t0 - 0.5)  # the workers' start-up is not counted
    return {"rps": total["ok"] / wall, **total, "generator": f"python x{processes}"}


def _wrk(wrk: str, url: str, connections: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "rps.lua"
        script.write_text(_WRK_SCRIPT.replace("@MODEL@", MODEL).replace("@PAD@", "z" * 100)
                          .replace("@RUN@", str(time.time_ns())))
        threads = max(1, min(2, connections))
        r = subprocess.run([wrk, "-t", str(threads), "-c", str(connections), "-d", f"{seconds:g}s", "--timeout",
                            "30s", "-s", str(script), url], capture_output=True, text=True, timeout=seconds + 120)
    out = r.stdout
    m = re.search(r"^\s*(\d+) requests in ([\d.]+)(\w+)", out, re.M)
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    if r.returncode != 0 or m is None or rps is None:
        raise RuntimeError(f"wrk failed ({r.returncode}): {out[-1000:]} {r.stderr[-1000:]}")
    non200 = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    bad = int(non200.group(1)) if non200 else 0
    errors = sum(int(x) for x in sock.groups()) if sock else 0
    requests = int(m.group(1))
    return {"rps": float(rps.group(1)) * (requests - bad) / max(requests, 1), "ok": requests - bad,
            "non_200": bad, "errors": errors, "generator": f"wrk -t{threads}"}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("streams", help="keep streams open until SIGTERM (one worker process)")
    s.add_argument("urls", help="comma-separated base URLs, taken round robin")
    s.add_argument("--streams", type=int, required=True)
    s.add_argument("--tokens", type=int, default=40)
    s.add_argument("--base", type=int, default=0, help="first worker number (keeps prompts unique)")
    r = sub.add_parser("rps", help="closed-loop non-streamed requests for --seconds (one worker process)")
    r.add_argument("url")
    r.add_argument("--connections", type=int, default=32)
    r.add_argument("--seconds", type=float, default=10.0)
    r.add_argument("--base", type=int, default=0)
    args = ap.parse_args(argv)
    if args.mode == "streams":
        out = _run(_streams_worker([u.rstrip("/") for u in args.urls.split(",")], args.streams, args.tokens,
                                   args.base))
    else:
        out = _run(_rps_worker(args.url.rstrip("/"), args.connections, args.seconds, args.base))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
