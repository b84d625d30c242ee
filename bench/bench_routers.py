"""kvstream against the Rust routers a user would pick instead, on the same engines.

    python bench/bench_routers.py                         # every router, chat + mooncake, 2 rounds
    python bench/bench_routers.py --workloads chat --rounds 3
    python bench/bench_routers.py --overhead              # added TTFB at 1/64 streams, most req/s
    python bench/bench_routers.py --routers kvstream,sglang --mooncake-requests 300

The peers, installed on demand from PyPI into ``~/.cache/kvstream-bench/routers`` (a venv
outside the tree; they are not dependencies of kvstream): **vllm-router 0.1.17** (Rust;
``kv_aware`` follows the engines' KV events, ``cache_aware``; ``round_robin`` is the
baseline) and **sglang-router 0.3.2** (Rust; ``cache_aware``, an approximate radix tree over
the request text).

Every router gets its own fresh ``kvstream engine`` processes (empty caches, the same
flags), so no router inherits another's cache. Within a round the routers run one after the
other, in reversed order every other round, and the medians over the rounds are printed.

Workloads:

* ``chat``: multi-turn chat with shared system prompts (kvstream.emulator.loadgen's
  ``ChatWorkload``: token-id prompts, each turn the whole history including the engine's
  real answers), streamed.
* ``chat-text``: the same conversations as text prompts (ASCII; the engines' byte
  tokenizer makes one byte one token), so routers that read text see text.
* ``burst``: ``--bursts`` groups of ``--burst-size`` token-id requests sharing a new
  ``--burst-prefix``-token prefix, each group sent at once (faster than the engines' KV
  events reach a router): where ``kvstream-spec`` (``serve --speculate``) should help.
* ``mooncake``: the first ``--mooncake-requests`` requests of the Mooncake conversation
  trace (kvcache-ai/Mooncake, FAST'25; ``--trace``), each ``hash_id`` expanded into a fixed
  512-character text segment (512 byte tokens, the trace's block), prompts cut to
  ``input_length``, arrivals compressed by ``--time-scale``. Also printed: the window's
  ideal hit rate (one infinite cache shared by every engine; whole 512-token segments).

Per router and workload: realized hit rate (sum of ``cached_tokens`` over sum of
``prompt_tokens`` from the responses' usage), TTFT mean/p50/p99, requests/s, load spread
(the busiest engine's requests over the mean, from the engines' own
``vllm:request_success_total``) and failures.

``--overhead`` instead measures each router's own cost: time to first byte added over
calling an engine directly (every router up at once in front of the same engines; at 1
stream one probe per target in turn, then beside 63 background streams of 40 tokens at
20 tokens/s), and the most requests/s each carries in front of 4 fast engines (short
non-streamed completions, 64 connections, one router at a time, rounds in alternating
order). Its load runs in other processes (bench/_loadgen.py: aiohttp workers for the
streams, ``wrk`` for requests/s when installed, Debian's ``wrk`` package), so the routers,
not the bench's client, are what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import anyio
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvstream.emulator.launch import Proc, start_engine, start_serve_proxy  # noqa: E402
from kvstream.emulator.loadgen import ChatWorkload, percentile  # noqa: E402

PEERS = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
ROUTERS = ("kvstream", "kvstream-prefix", "kvstream-spec", "vllm-kv", "vllm-cache", "sglang", "round-robin")
MODEL = "kvstream-emulated"
# sglang-router 0.3.2 refuses a completion whose prompt is a list of token ids (HTTP 422,
# "data did not match any variant of untagged enum StringOrArray"): it routes text only.
TEXT_ONLY = {"sglang"}
ID_WORKLOADS = {"chat", "burst"}
SEGMENT = 512  # the Mooncake trace's block: one hash id = 512 tokens


# --- the peers -------------------------------------------------------------------------

def ensure_peers(cache: Path) -> Path:
    """The venv holding the pinned peer routers (installed from PyPI on first use)."""
    venv = cache / "routers"
    py = venv / "bin" / "python"
    want = [f"{k}=={v}" for k, v in PEERS.items()]
    if py.exists():
        r = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], capture_output=True, text=True)
        have = {p["name"].lower(): p["version"] for p in json.loads(r.stdout or "[]")}
        if all(have.get(k) == v for k, v in PEERS.items()):
            return venv
    print(f"installing {', '.join(want)} into {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *want], check=True)
    return venv


@dataclass
class Router:
    """A router process in front of ``engines``, answering the OpenAI API at ``url``."""

    name: str
    url: str
    proc: Any  # Proc (kvstream) or subprocess.Popen (peers)
    log: Path | None = None
    metrics_url: str | None = None

    def kv_counters(self) -> str:
        """The router's own counters of how it prepared KV-aware decisions (vllm-router)."""
        if not self.metrics_url:
            return ""
        try:
            text = httpx.get(self.metrics_url, timeout=5).text
        except httpx.HTTPError:
            return ""
        return "; ".join(line for line in text.splitlines()
                         if line.startswith(("vllm_router_kv_routing_inputs_total", "vllm_router_kv_placement_lookups",
                                                  "vllm_router_prefix_routing_decisions")))

    def stop(self) -> None:
        if isinstance(self.proc, Proc):
            self.proc.stop()
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 90.0) -> None:
    """Until ``url`` answers a real completion with 200 (a router is ready only once it
    has found its workers healthy)."""
    deadline = time.monotonic() + timeout_s
    body = {"model": MODEL, "prompt": "ready?", "max_tokens": 1}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling a state (the router's readiness), not pacing a peer
    raise RuntimeError(f"router at {url} not ready after {timeout_s:.0f} s: {log.read_text(errors='replace')[-2000:]}")


def start_router(kind: str, engines: Sequence[Proc], venv: Path | None, logs: Path) -> Router:
    """Start router ``kind`` (one of ROUTERS) in front of ``engines``."""
    if kind.startswith("kvstream"):
        scoring = "prefix" if kind == "kvstream-prefix" else "cost"
        extra = ["--scoring", scoring, *(["--speculate"] if kind == "kvstream-spec" else [])]
        p = start_serve_proxy(engines, policy="kv-aware", log_dir=str(logs), extra=extra)
        return Router(kind, p.url or "", p)
    assert venv is not None
    port = _free_port()
    urls = [e.url or "" for e in engines]
    if kind == "sglang":
        argv = [str(venv / "bin" / "sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--policy", "cache_aware", "--worker-urls", *urls, "--log-level", "warn",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]  # not its fixed 29000
    else:
        policy = {"vllm-kv": "kv_aware", "vllm-cache": "cache_aware", "round-robin": "round_robin"}[kind]
        argv = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--worker-urls", *urls, "--log-level", "warning", "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics_port := _free_port())]
        if policy == "kv_aware":
            for e in engines:
                argv += ["--kv-event-source", f"{e.url}={e.events}"]
                if e.replay:
                    argv += ["--kv-event-replay-source", f"{e.url}={e.replay}"]
            argv += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
    log = logs / f"{kind}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    router = Router(kind, url, proc, log, f"http://127.0.0.1:{metrics_port}/metrics" if kind != "sglang" else None)
    try:
        _wait_http(url, proc, log)
    except BaseException:
        router.stop()
        raise
    return router


# --- engines ------------------------------------------------------------------------------

def start_engines(n: int, opts: Sequence[str], logs: Path) -> list[Proc]:
    """``n`` fresh ``kvstream engine``s, started in parallel."""
    engines = [start_engine(f"e{i}", extra=opts, log_dir=str(logs), wait=False) for i in range(n)]
    for e in engines:
        e.wait_ready(60)
    return engines


_SUCCESS = re.compile(r'^vllm:request_success_total\{[^}]*\}\s+([0-9.eE+-]+)', re.M)


def engine_requests(engines: Sequence[Proc]) -> list[float]:
    """Each engine's finished requests, from its own /metrics."""
    out = []
    for e in engines:
        text = httpx.get(f"{e.url}/metrics", timeout=10).text
        out.append(sum(float(x) for x in _SUCCESS.findall(text)))
    return out


# --- workloads ----------------------------------------------------------------------------

@dataclass
class Turn:
    ok: bool
    ttft_s: float = -1.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    spread: float = float("nan")

    def summary(self) -> dict[str, float]:
        ok = [t for t in self.turns if t.ok]
        prompt = sum(t.prompt_tokens for t in ok)
        ttft = [t.ttft_s for t in ok]
        return {
            "hit": sum(t.cached_tokens for t in ok) / prompt if prompt else 0.0,
            "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"),
            "ttft_p50": percentile(ttft, 0.5),
            "ttft_p99": percentile(ttft, 0.99),
            "rps": len(ok) / self.wall_s if self.wall_s else 0.0,
            "spread": self.spread,
            "failed": float(len(self.turns) - len(ok)),
        }


async def _stream_completion(client: httpx.AsyncClient, body: dict[str, Any], timeout_s: float) -> tuple[Turn, str]:
    """One streamed completion: its measurements and the generated text."""
    body = dict(body, stream=True, stream_options={"include_usage": True}, model=MODEL)
    sent = time.perf_counter()
    turn = Turn(False)
    text: list[str] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                turn.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return turn, ""
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices") or []:
                    if turn.ttft_s < 0:
                        turn.ttft_s = time.perf_counter() - sent
                    text.append(c.get("text") or "")
                usage = chunk.get("usage")
                if usage:
                    turn.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    turn.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except httpx.HTTPError as exc:
        turn.error = f"{type(exc).__name__}: {exc}"[:200]
        return turn, ""
    turn.ok = turn.ttft_s >= 0 and turn.prompt_tokens > 0
    if not turn.ok:
        turn.error = "the stream ended without tokens or usage"
    return turn, "".join(text)


def _words(rng: random.Random, n_chars: int) -> str:
    """``n_chars`` of lowercase ASCII words (one byte token each for the byte tokenizer)."""
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


async def chat_run(url: str, seed: int, text: bool, w: ChatWorkload) -> Run:
    """The chat workload, as token-id prompts or as the same shape in text.

    Each turn's prompt is the whole history: the system prompt, the session's document,
    earlier user messages and the engine's real earlier answers. Without a tokenizer
    ``kvstream engine`` answers in byte tokens 97..122 (``a``-``z``), so the answer's text
    *is* its token ids and the history needs no ``return_token_ids`` (which vllm-router
    0.1.17's ``kv_aware`` does not route by: it skips the KV lookup for such requests).
    """
    run = Run()
    rng = random.Random(seed)
    if text:
        systems: list[Any] = [_words(rng, w.system_tokens) for _ in range(w.system_prompts)]
    else:
        systems = [[rng.randrange(1000, 30000) for _ in range(w.system_tokens)] for _ in range(w.system_prompts)]
    t0 = time.perf_counter()

    async def session(i: int, client: httpx.AsyncClient) -> None:
        r = random.Random(seed * 1000 + i)
        await anyio.sleep(r.uniform(0, w.start_spread_s))
        doc_len = r.randint(*w.document_tokens)
        history: Any = systems[r.randrange(len(systems))] + (
            "\n" + _words(r, doc_len) if text else [r.randrange(1000, 30000) for _ in range(doc_len)])
        for _ in range(w.turns):
            n_user = r.randint(*w.user_tokens)
            prompt = history + ("\nuser: " + _words(r, n_user) + "\nassistant:" if text
                                else [r.randrange(1000, 30000) for _ in range(n_user)])
            turn, answer = await _stream_completion(client, {"prompt": prompt, "max_tokens": r.randint(*w.max_tokens)},
                                                    60.0)
            run.turns.append(turn)
            if not turn.ok:
                return
            history = prompt + (answer if text else list(answer.encode()))
            await anyio.sleep(r.uniform(*w.think_s))

    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=None)) as client:
        async with anyio.create_task_group() as tg:
            for i in range(w.sessions):
                tg.start_soon(session, i, client)
    run.wall_s = time.perf_counter() - t0
    return run


def load_trace(path: Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` requests of a Mooncake trace."""
    import gzip
    import lzma

    out = []
    opener: Any = lzma.open if path.suffix == ".xz" else gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if len(out) >= n:
                    break
    return out


def _segment(hash_id: int) -> str:
    return _words(random.Random(hash_id * 7919 + 17), SEGMENT)


def trace_prompt(req: dict[str, Any], max_input: int) -> str:
    """The request's prompt: one fixed text segment per hash id, cut to its input length."""
    n = min(int(req["input_length"]), max_input)
    parts: list[str] = []
    for h in req["hash_ids"]:
        parts.append(_segment(int(h)))
        if len(parts) * SEGMENT >= n:
            break
    return "".join(parts)[:n]


def ideal_hit_rate(reqs: Sequence[dict[str, Any]], max_input: int) -> float:
    """One infinite cache shared by every engine, whole 512-token segments, the last
    prompt token always computed."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for req in reqs:
        n = min(int(req["input_length"]), max_input)
        total += n
        ids = [int(h) for h in req["hash_ids"]][: (n + SEGMENT - 1) // SEGMENT]
        k = 0
        while k < len(ids) and (k + 1) * SEGMENT <= n - 1 and tuple(ids[: k + 1]) in seen:
            k += 1
        hit += k * SEGMENT
        for j in range(len(ids)):
            if (j + 1) * SEGMENT <= n:
                seen.add(tuple(ids[: j + 1]))
    return hit / total if total else 0.0


async def mooncake_run(url: str, reqs: Sequence[dict[str, Any]], time_scale: float, max_input: int,
                       max_output: int) -> Run:
    run = Run()
    t0 = time.perf_counter()
    base = float(reqs[0]["timestamp"])

    async def one(req: dict[str, Any], client: httpx.AsyncClient) -> None:
        await anyio.sleep(max(0.0, (float(req["timestamp"]) - base) / 1000.0 / time_scale - (time.perf_counter() - t0)))
        body = {"prompt": trace_prompt(req, max_input), "max_tokens": max(1, min(int(req["output_length"]), max_output))}
        turn, _ = await _stream_completion(client, body, 120.0)
        run.turns.append(turn)

    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=None)) as client:
        async with anyio.create_task_group() as tg:
            for req in reqs:
                tg.start_soon(one, req, client)
    run.wall_s = time.perf_counter() - t0
    return run


async def burst_run(url: str, seed: int, groups: int, size: int, prefix_tokens: int) -> Run:
    """``groups`` bursts, one after the other: ``size`` requests sharing a new
    ``prefix_tokens``-token prefix (token ids; 32 tokens of their own each), sent at once,
    faster than an engine's KV events can reach a router. Only a router that remembers
    where it sent a burst's first request (kvstream ``--speculate``; sglang-router's tree,
    updated at send time) finds the prefix for the others; the best hit rate is
    ``(size - 1) / size`` of the prefix share."""
    run = Run()
    rng = random.Random(seed + 7331)
    t0 = time.perf_counter()

    async def one(prompt: list[int], client: httpx.AsyncClient) -> None:
        turn, _ = await _stream_completion(client, {"prompt": prompt, "max_tokens": 4}, 60.0)
        run.turns.append(turn)

    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=None)) as client:
        for _ in range(groups):
            prefix = [rng.randrange(1000, 30000) for _ in range(prefix_tokens)]
            async with anyio.create_task_group() as tg:
                for _ in range(size):
                    tg.start_soon(one, prefix + [rng.randrange(1000, 30000) for _ in range(32)], client)
            await anyio.sleep(0.3)  # the workload's pacing between bursts, not a wait for a peer
    run.wall_s = time.perf_counter() - t0
    return run


# --- overhead -------------------------------------------------------------------------------
# The load runs in processes of its own (bench/_loadgen.py): this process only probes, one
# request at a time, so what it measures is the router's hop, not this client.

def _probe_once(client: httpx.Client, run: str, k: int) -> tuple[float, float]:
    """Time to the response headers and to the first byte of the body (the first event,
    which carries the first token) of one streamed text completion (s). Both: a router may
    send its status line before the engine has answered."""
    body = {"model": MODEL, "prompt": f"probe {run} {k} " + "y" * 200, "max_tokens": 1, "stream": True}
    t = time.perf_counter()
    first = float("nan")
    with client.stream("POST", "/v1/completions", json=body) as r:
        head = time.perf_counter() - t
        for chunk in r.iter_raw():
            if chunk and first != first:
                first = time.perf_counter() - t
    return head, first


def _ttfb_alone(targets: dict[str, str], probes: int) -> dict[str, list[tuple[float, float]]]:
    """1 stream: one probe per target in turn, so the machine's drifting load falls on all alike."""
    run = str(time.time_ns())
    clients = {n: httpx.Client(base_url=u, timeout=60) for n, u in targets.items()}
    got: dict[str, list[tuple[float, float]]] = {n: [] for n in targets}
    try:
        for n, c in clients.items():  # warm-up: connections open, tokenizer probes done
            for k in range(5):
                _probe_once(c, run + "w", k)
        for k in range(probes):
            for n, c in clients.items():
                got[n].append(_probe_once(c, f"{run}-{n}", k))
    finally:
        for c in clients.values():
            c.close()
    return got


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its descendants so far (Linux /proc)."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _router_pid(router: Router) -> int:
    return int(router.proc.pid if isinstance(router.proc, Proc) else router.proc.pid)


def _ttfb_loaded(url: str, background_urls: Sequence[str], streams: int, probes: int,
                 tokens: int) -> list[tuple[float, float]]:
    """Probes while ``streams`` - 1 streams (other processes) run through ``background_urls``."""
    import _loadgen

    run = str(time.time_ns())
    with _loadgen.BackgroundStreams(background_urls, streams=streams - 1, tokens=tokens, processes=2):
        with httpx.Client(base_url=url, timeout=60) as c:
            return [_probe_once(c, run, k) for k in range(probes)]


# --- main -----------------------------------------------------------------------------------

def _fmt(v: float, kind: str) -> str:
    if v != v:
        return "-"
    return {"hit": f"{v * 100:.1f} %", "ms": f"{v * 1000:.0f}", "rps": f"{v:.1f}", "x": f"{v:.2f}",
            "n": f"{int(v)}"}[kind]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"comma list of {', '.join(ROUTERS)}")
    ap.add_argument("--workloads", default="chat,mooncake", help="comma list of chat, chat-text, mooncake, burst")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--num-gpu-blocks", type=int, default=1500, help="per engine (the demo's size)")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=10000.0)
    ap.add_argument("--decode-tokens-per-s", type=float, default=50.0)
    ap.add_argument("--hash-algo", default="sha256", help="the engines' --prefix-caching-hash-algo")
    ap.add_argument("--sessions", type=int, default=32, help="chat sessions")
    ap.add_argument("--trace", type=Path, default=None,
                    help="Mooncake trace, JSON lines (.xz/.gz read too; default: the conversation trace that ships "
                         "in examples/traces/)")
    ap.add_argument("--mooncake-requests", type=int, default=1200)
    ap.add_argument("--mooncake-prefill-tokens-per-s", type=float, default=50000.0,
                    help="the engines' prefill rate for the trace (its prompts are long)")
    ap.add_argument("--mooncake-num-gpu-blocks", type=int, default=16384,
                    help="per engine for the trace (262,144 tokens: some 30 of its prompts)")
    ap.add_argument("--time-scale", type=float, default=4.0, help="mooncake arrivals compressed by this factor")
    ap.add_argument("--max-input", type=int, default=8192, help="mooncake prompts cut to this many tokens")
    ap.add_argument("--max-output", type=int, default=16, help="mooncake outputs cut to this many tokens")
    ap.add_argument("--bursts", type=int, default=20, help="burst: groups of requests sharing a new prefix")
    ap.add_argument("--burst-size", type=int, default=8, help="burst: requests per group, sent at once")
    ap.add_argument("--burst-prefix", type=int, default=1024, help="burst: tokens of each group's new prefix")
    ap.add_argument("--overhead", action="store_true", help="measure added TTFB and most req/s instead")
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--overhead-streams", type=int, default=64,
                    help="--overhead: concurrent streams in its loaded runs")
    ap.add_argument("--overhead-tokens", type=int, default=40, help="--overhead: tokens per background stream")
    ap.add_argument("--overhead-decode", type=float, default=20.0,
                    help="--overhead: the TTFB engines' decode tokens/s per sequence")
    ap.add_argument("--overhead-connections", type=int, default=64, help="--overhead: connections for req/s")
    ap.add_argument("--overhead-seconds", type=float, default=10.0, help="--overhead: seconds per req/s run")
    ap.add_argument("--overhead-processes", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
                    help="--overhead: kvstream --processes counts for req/s (comma list)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvstream-bench")
    ap.add_argument("--verbose", action="store_true", help="print the peers' own KV routing counters")
    ap.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (kept anyway on failures)")
    ap.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = ap.parse_args(argv)

    routers = [r for r in args.routers.split(",") if r]
    unknown = set(routers) - set(ROUTERS)
    if unknown:
        ap.error(f"unknown router(s) {sorted(unknown)}; choose from {', '.join(ROUTERS)}")
    venv = ensure_peers(args.cache) if any(not r.startswith("kvstream") for r in routers) else None
    logs = Path(tempfile.mkdtemp(prefix="kvstream-bench-routers-"))
    print(f"logs in {logs}", flush=True)
    if args.overhead:
        return overhead(args, routers, venv, logs)

    trace = args.trace or REPO / "examples" / "traces" / "mooncake_conversation.jsonl.xz"  # ships with kvstream
    workloads = [w for w in args.workloads.split(",") if w]
    reqs: list[dict[str, Any]] = []
    if "mooncake" in workloads:
        if not trace.exists():
            ap.error(f"no trace at {trace}; give --trace FILE")
        reqs = load_trace(trace, args.mooncake_requests)
        print(f"mooncake: {len(reqs)} requests from {trace}; ideal hit rate of the window "
              f"{ideal_hit_rate(reqs, args.max_input) * 100:.1f} %", flush=True)
    opts = ["--num-gpu-blocks", str(args.num_gpu_blocks), "--prefill-tokens-per-s", str(args.prefill_tokens_per_s),
            "--decode-tokens-per-s", str(args.decode_tokens_per_s), "--max-model-len", "32768",
            "--prefix-caching-hash-algo", args.hash_algo]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    keep_logs = args.keep_logs
    for rnd in range(args.rounds):
        order = routers if rnd % 2 == 0 else routers[::-1]
        for wl in workloads:
            for kind in order:
                if wl in ID_WORKLOADS and kind in TEXT_ONLY:
                    if rnd == 0:
                        print(f"{kind} takes no token-id prompts; it skips {wl}", flush=True)
                    continue
                eopts = opts if wl != "mooncake" else [
                    *opts, "--prefill-tokens-per-s", str(args.mooncake_prefill_tokens_per_s),
                    "--num-gpu-blocks", str(args.mooncake_num_gpu_blocks)]
                engines = start_engines(args.engines, eopts, logs)
                router = None
                try:
                    router = start_router(kind, engines, venv, logs)
                    before = engine_requests(engines)
                    if wl == "mooncake":
                        run = anyio.run(mooncake_run, router.url, reqs, args.time_scale, args.max_input,
                                        args.max_output)
                    elif wl == "burst":
                        run = anyio.run(burst_run, router.url, rnd, args.bursts, args.burst_size, args.burst_prefix)
                    else:
                        w = ChatWorkload(sessions=args.sessions, seed=rnd)
                        run = anyio.run(chat_run, router.url, rnd, wl == "chat-text", w)
                    counts = [a - b for a, b in zip(engine_requests(engines), before)]
                    if args.verbose and router.kv_counters():
                        print(f"    {kind}: {router.kv_counters()}")
                    mean = statistics.fmean(counts) if counts else 0.0
                    run.spread = max(counts) / mean if mean else float("nan")
                finally:
                    if router is not None:
                        router.stop()
                    for e in engines:
                        e.stop()
                s = run.summary()
                results.setdefault((wl, kind), []).append(s)
                print(f"round {rnd + 1} {wl:9} {kind:12} hit {_fmt(s['hit'], 'hit'):>7}  TTFT mean "
                      f"{_fmt(s['ttft_mean'], 'ms')} p50 {_fmt(s['ttft_p50'], 'ms')} p99 {_fmt(s['ttft_p99'], 'ms')} ms"
                      f"  {_fmt(s['rps'], 'rps')} req/s  spread {_fmt(s['spread'], 'x')}  failed "
                      f"{_fmt(s['failed'], 'n')}", flush=True)
                errors = [t.error for t in run.turns if not t.ok]
                if errors:
                    print(f"    first failure: {errors[0]}", flush=True)
                    keep_logs = True
    print("\nmedians over rounds")
    print(f"{'workload':9} {'router':12} {'hit':>7} {'TTFT mean':>9} {'p50':>6} {'p99':>6} {'req/s':>7} "
          f"{'spread':>6} {'failed':>6}")
    for (wl, kind), runs in results.items():
        med = {k: statistics.median([r[k] for r in runs]) for k in runs[0]}
        med["failed"] = sum(r["failed"] for r in runs)
        print(f"{wl:9} {kind:12} {_fmt(med['hit'], 'hit'):>7} {_fmt(med['ttft_mean'], 'ms'):>9} "
              f"{_fmt(med['ttft_p50'], 'ms'):>6} {_fmt(med['ttft_p99'], 'ms'):>6} {_fmt(med['rps'], 'rps'):>7} "
              f"{_fmt(med['spread'], 'x'):>6} {_fmt(med['failed'], 'n'):>6}")
    if args.json:
        args.json.write_text(json.dumps({f"{wl}/{k}": v for (wl, k), v in results.items()}, indent=1))
    if keep_logs:
        print(f"logs kept in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    return 0


def overhead(args: argparse.Namespace, routers: list[str], venv: Path | None, logs: Path) -> int:
    """Added TTFB over the engine at 1 and ``--overhead-streams`` streams, and the most req/s
    in front of ``--engines`` fast engines, per router, with the load in other processes."""
    import _loadgen

    if args.routers == ",".join(ROUTERS):  # not chosen: kvstream against the two Rust routers
        routers = ["kvstream", "vllm-kv", "sglang"]
    streams = args.overhead_streams
    print(f"load average {open('/proc/loadavg').read().split()[0]} at the start; the machine's other work "
          "shares these cores", flush=True)
    # Time to first byte: engines that stream slowly (bench_proxy.py's load: 40 tokens at
    # 20 tokens/s a stream), every router up at once in front of them.
    slow = ["--prefill-tokens-per-s", "10000000", "--decode-tokens-per-s", str(args.overhead_decode),
            "--num-gpu-blocks", "65536", "--max-num-seqs", "512"]
    engines = start_engines(args.engines, slow, logs)
    up: list[Router] = []
    alone: dict[str, list[tuple[float, float]]] = {}
    loaded: dict[str, list[tuple[float, float]]] = {}
    try:
        targets = {"engine directly": engines[0].url or ""}
        for kind in routers:
            up.append(start_router(kind, engines, venv, logs))
            targets[kind] = up[-1].url
        alone = _ttfb_alone(targets, args.probes)
        loaded = {n: [] for n in targets}
        for rnd in range(args.rounds):
            for n in (list(targets) if rnd % 2 == 0 else list(targets)[::-1]):
                # The engine directly: the background spread over every engine, as a router spreads it.
                bg = [e.url or "" for e in engines] if n == "engine directly" else [targets[n]]
                loaded[n] += _ttfb_loaded(targets[n], bg, streams, args.probes, args.overhead_tokens)
    finally:
        for r in up:
            r.stop()
        for e in engines:
            e.stop()
    for i, what in enumerate(("the response headers", "the first byte of the body (the first event)")):
        print(f"\ntime to {what}, p50 (p90) in ms: {args.probes} probes at 1 stream (targets in turn), "
              f"{args.rounds} x {args.probes} beside {streams - 1} background streams")
        one = {n: [x[i] for x in v] for n, v in alone.items()}
        many = {n: [x[i] for x in v] for n, v in loaded.items()}
        base1, base64 = percentile(one["engine directly"], 0.5), percentile(many["engine directly"], 0.5)
        for n in one:
            a1, a64 = percentile(one[n], 0.5), percentile(many[n], 0.5)
            added = ("" if n == "engine directly"
                     else f"   added {1000 * (a1 - base1):+.2f} / {1000 * (a64 - base64):+.2f}")
            print(f"  {n:16} 1 stream {1000 * a1:6.2f} ({1000 * percentile(one[n], 0.9):6.2f})   {streams} streams "
                  f"{1000 * a64:6.2f} ({1000 * percentile(many[n], 0.9):6.2f}){added}", flush=True)

    # Most requests/s: fast engines, one router at a time, a closed loop of connections.
    fast = ["--prefill-tokens-per-s", "1e9", "--decode-tokens-per-s", "1e6", "--num-gpu-blocks", "65536",
            "--max-num-seqs", "512"]
    kinds = list(routers)
    for n in args.overhead_processes:
        if n > 1 and "kvstream" in routers:
            kinds.append(f"kvstream --processes {n}")
    engines = start_engines(args.engines, fast, logs)
    rps: dict[str, list[dict[str, Any]]] = {}
    try:
        for rnd in range(args.rounds):
            for kind in (kinds if rnd % 2 == 0 else kinds[::-1]):
                if kind.startswith("kvstream --processes"):
                    p = start_serve_proxy(engines, policy="kv-aware", log_dir=str(logs),
                                          extra=["--scoring", "cost", "--processes", kind.rsplit(" ", 1)[1]])
                    router = Router(kind, p.url or "", p)
                else:
                    router = start_router(kind, engines, venv, logs)
                try:
                    _loadgen.max_rps(router.url, connections=args.overhead_connections, seconds=2)  # warm-up
                    c0 = _tree_cpu_s(_router_pid(router))
                    e0 = sum(_tree_cpu_s(e.pid) for e in engines)
                    got = _loadgen.max_rps(router.url, connections=args.overhead_connections,
                                           seconds=args.overhead_seconds)
                    # CPU per request: what a loaded machine's fair share does not change much.
                    got["cpu_us"] = 1e6 * (_tree_cpu_s(_router_pid(router)) - c0) / max(got["ok"], 1)
                    got["engine_cpu_us"] = 1e6 * (sum(_tree_cpu_s(e.pid) for e in engines) - e0) / max(got["ok"], 1)
                finally:
                    router.stop()
                rps.setdefault(kind, []).append(got)
                print(f"round {rnd + 1} {kind:24} {got['rps']:7.0f} req/s ({got['non_200']} non-200, "
                      f"{got['errors']} socket errors; {got['generator']}, {args.overhead_connections} connections); "
                      f"router CPU {got['cpu_us']:.0f} us/request, engines {got['engine_cpu_us']:.0f}; load average "
                      f"{open('/proc/loadavg').read().split()[0]}", flush=True)
        one = _loadgen.max_rps(engines[0].url or "", connections=args.overhead_connections,
                               seconds=args.overhead_seconds)
    finally:
        for e in engines:
            e.stop()
    print(f"\nmost requests/s in front of {args.engines} fast engines (median of {args.rounds} rounds); one engine "
          f"alone, no router: {one['rps']:.0f}")
    for kind, runs in rps.items():
        print(f"  {kind:24} {statistics.median(r['rps'] for r in runs):7.0f} req/s, router CPU "
              f"{statistics.median(r['cpu_us'] for r in runs):5.0f} us/request (engines "
              f"{statistics.median(r['engine_cpu_us'] for r in runs):.0f}), "
              f"{sum(r['non_200'] + r['errors'] for r in runs)} failed")
    print(f"load average {open('/proc/loadavg').read().split()[0]} at the end")
    shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
