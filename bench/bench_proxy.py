"""Time to first byte through the KV-aware proxy vs calling the engine directly.

Starts one emulated engine (``kvstream engine``) and the proxy in front of it (``python -m
kvstream.proxy``, KV-aware, following the engine's KV events), then keeps 64 streams open
against each in alternating rounds: every client sends a streaming completion (40 output
tokens at 20 tokens/s, so about 2 s of streaming), reads it to the end and sends the next,
so the proxy passes about 1,300 SSE events/s while new requests arrive. Time to first byte (TTFB) is measured from sending the request to receiving the
response's status line and headers (a streaming response starts as soon as the engine
accepted the request; the tokens' timing is the engine's, not the proxy's). Prints p50/p90 for both and the proxy's added p50 (budget: <= 1 ms).

    python bench/bench_proxy.py [--streams 64] [--requests 4] [--rounds 2] [--tokens 40]

Everything runs on this machine: client, proxy and engine share its cores, so on a small
machine the proxy's CPU time shows up as added latency.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import anyio
import httpx

from kvstream.emulator.launch import start_engine, start_proxy


errors: list[int] = []


async def _round(url: str, streams: int, requests: int, prompt_len: int, offset: int, tokens: int) -> list[float]:
    out: list[float] = []
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        async def worker(w: int) -> None:
            for i in range(requests):
                # A shared prefix plus a per-request tail: realistic prefix hits.
                prompt = list(range(1, prompt_len)) + [offset + w * 1000 + i]
                body = {"prompt": prompt, "max_tokens": tokens, "stream": True}
                t0 = time.perf_counter()
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        # The status line and headers: the first bytes of the response.
                        out.append(time.perf_counter() - t0)
                        async for _ in r.aiter_raw():
                            pass
                except httpx.TransportError:
                    errors.append(1)

        async with anyio.create_task_group() as tg:
            for w in range(streams):
                tg.start_soon(worker, w)
    return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[int(q * (len(s) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--requests", type=int, default=4, help="requests per stream per round")
    p.add_argument("--tokens", type=int, default=40, help="output tokens per request (streamed)")
    p.add_argument("--decode", type=float, default=20.0, help="engine decode tokens/s per sequence")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=256)
    args = p.parse_args()
    logs = tempfile.mkdtemp(prefix="kvstream-bench-proxy-")
    engine = start_engine("engine-0", log_dir=logs, extra=[
        "--decode-tokens-per-s", str(args.decode), "--prefill-tokens-per-s", "1e9", "--max-num-seqs", "256",
        "--num-gpu-blocks", "65536"])
    proxy = start_proxy([engine], log_dir=logs)
    try:
        direct: list[float] = []
        proxied: list[float] = []
        # Warm-up (connections, caches), then alternate so drift hits both alike.
        anyio.run(_round, engine.url, args.streams, 1, args.prompt_len, 10**8, 2)
        anyio.run(_round, proxy.url, args.streams, 1, args.prompt_len, 2 * 10**8, 2)
        for r in range(args.rounds):
            direct += anyio.run(_round, engine.url, args.streams, args.requests, args.prompt_len,
                                10**6 * (2 * r + 1), args.tokens)
            proxied += anyio.run(_round, proxy.url, args.streams, args.requests, args.prompt_len,
                                 10**6 * (2 * r + 2), args.tokens)
    finally:
        proxy.stop()
        engine.stop()
    n = len(direct)
    print(f"TTFB over {n} streaming requests each, {args.streams} concurrent streams, prompt {args.prompt_len} tokens")
    print(f"  {'':<22}{'p50 (ms)':>10}{'p90 (ms)':>10}{'mean (ms)':>11}")
    for name, xs in (("engine directly", direct), ("through kvstream proxy", proxied)):
        print(f"  {name:<22}{1000 * _pct(xs, 0.5):>10.2f}{1000 * _pct(xs, 0.9):>10.2f}"
              f"{1000 * statistics.fmean(xs):>11.2f}")
    if errors:
        print(f"  ({len(errors)} requests failed with a transport error and are not counted)")
    added = 1000 * (_pct(proxied, 0.5) - _pct(direct, 0.5))
    print(f"  added by the proxy at p50: {added:.2f} ms (budget 1 ms: {'met' if added <= 1.0 else 'NOT met'})")


if __name__ == "__main__":
    main()
