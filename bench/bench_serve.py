"""``kvstream serve`` against NVIDIA Dynamo's standalone indexer, on the same state.

    python bench/bench_serve.py                    # both services, defaults below
    python bench/bench_serve.py --no-dynamo        # kvstream only
    python bench/bench_serve.py --workers 1,2      # kvstream serve --workers 1, then 2, then Dynamo
    python bench/bench_serve.py --stages           # each stage of ingest and /query alone, in-process

The state: ``--engines`` (64) real kvstream publishers in one "farm" process, each
publishing ``--docs`` (17) cached documents of ``--prompt-tokens`` (4096) tokens as vLLM
``BlockStored`` batches (blocks of 16 tokens: 64 x 17 x 256 = 278,528 blocks). Documents
come from a shared pool, so most prompts are cached on several engines.

For each service, in its own run: start the farm and the service (subscribed to every
engine), publish everything, and time until the service has applied the last block of every
engine (**ingest**, block events/s); then load ``/query`` (the Mooncake API both serve)
with 4,096-token prompts over 1 and 32 connections with ``wrk`` (Debian's; a Python
client if wrk is missing) and print requests/s, p50 and p99.

First, the farm's own ceiling: the same rounds into bare SUB sockets in this process (no
decode, no service), printed beside the services: an ingest figure near it is the farm's
limit, not the service's.

Dynamo (``ai-dynamo-runtime==1.6.1``, ``python -m dynamo.indexer``) is installed on demand
into ``~/.cache/kvstream-bench/dynamo-1.6.1`` (a venv); it is not a dependency of kvstream.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("KVSTREAM_BENCH_CACHE", Path.home() / ".cache" / "kvstream-bench"))
DYNAMO_VERSION = "1.6.1"
BS = 16


# -- the workload ---------------------------------------------------------------------


def workload(engines: int, docs: int, tokens: int, seed: int = 7) -> tuple[list[list[int]], list[list[int]]]:
    """(documents, per engine the document indexes it holds). Documents share a 1,024-token
    system prefix in groups of 8 so prompts hit several engines with different depths."""
    rng = random.Random(seed)
    pool = max(engines * docs // 3, docs)
    prefixes = [[rng.randrange(1, 120_000) for _ in range(1024)] for _ in range(pool // 8 + 1)]
    documents = [prefixes[i // 8] + [rng.randrange(1, 120_000) for _ in range(tokens - 1024)] for i in range(pool)]
    held = [rng.sample(range(pool), docs) for _ in range(engines)]
    return documents, held


# -- the farm: every engine's publisher, in one process ----------------------------------


def farm_main(args: argparse.Namespace) -> None:
    import anyio

    from kvstream.hashing import BlockHasher, to_external_list
    from kvstream.transport import KVEventsConfig, Publisher
    from kvstream.wire.events import BlockStored, EventEncoder, KVEventBatch

    enc = EventEncoder()
    hasher = BlockHasher("sha256_cbor", BS, seed="0")

    def encode_round(seed: int) -> list[list[bytes]]:
        documents, held = workload(args.engines, args.docs, args.prompt_tokens, seed)
        hashes = [to_external_list(hasher.hash_blocks(d)) for d in documents]
        return [[enc.encode(KVEventBatch(time.time(), [BlockStored(hashes[d], None, documents[d], BS, None, "GPU",
                                                                   None)], 0)) for d in docs] for docs in held]

    rounds = [encode_round(7), encode_round(8)]

    async def main() -> None:
        from contextlib import AsyncExitStack

        async with AsyncExitStack() as stack:
            pubs = []
            for i in range(args.engines):
                cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                     buffer_steps=args.docs + 8)
                pubs.append(await stack.enter_async_context(Publisher(cfg)))
            print(json.dumps([[p.endpoint, p.replay_endpoint] for p in pubs]), flush=True)
            stdin = anyio.wrap_file(sys.stdin)
            for r, payloads in enumerate(rounds):
                if (await stdin.readline()).strip() != "go":  # EOF: done
                    return
                for j in range(args.docs):
                    for i, p in enumerate(pubs):
                        p.publish_raw(payloads[i][j], r * args.docs + j)
                    await anyio.sleep(0)
                print("published", flush=True)
            await stdin.readline()  # EOF: done

    anyio.run(main)


def _line(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    r, _, _ = select.select([proc.stdout], [], [], timeout)
    if not r:
        raise SystemExit(f"no output from {proc.args!r} in {timeout}s")
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise SystemExit(f"{proc.args!r} exited early ({proc.wait()})")
    return line


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# -- the services -----------------------------------------------------------------------


def dynamo_python() -> Path:
    """The venv Python with Dynamo installed (installed on first use)."""
    venv = CACHE / f"dynamo-{DYNAMO_VERSION}"
    py = venv / "bin" / "python"
    if not (venv / "lib").exists() or subprocess.run([str(py), "-c", "import dynamo.indexer"],
                                                      capture_output=True).returncode:
        print(f"installing ai-dynamo-runtime=={DYNAMO_VERSION} into {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"ai-dynamo-runtime=={DYNAMO_VERSION}"],
                       check=True)
    return py


class Service:
    def __init__(self, kind: str, endpoints: list[list[str]], workers: int, log: Any) -> None:
        self.kind = kind
        self.names = [f"e{i}" for i in range(len(endpoints))]
        if kind == "kvstream":
            args = [sys.executable, "-m", "kvstream", "serve", "--port", "0", "--load-interval", "0",
                    "--model-name", "bench", "--log-level", "warning", "--processes", str(workers)]
            args += [f"e{i}={pub},{rep}" for i, (pub, rep) in enumerate(endpoints)]
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True,
                                         env={**os.environ, "PYTHONPATH": str(REPO)})
            self.url = _line(self.proc).split("listening on ", 1)[1].split()[0]
        else:
            port = _free_port()
            workers_arg = ",".join(f"{i}={pub}" for i, (pub, _rep) in enumerate(endpoints))
            self.proc = subprocess.Popen([str(dynamo_python()), "-m", "dynamo.indexer", "--port", str(port),
                                          "--block-size", str(BS), "--model-name", "bench", "--workers", workers_arg],
                                         stdout=log, stderr=log, text=True)
            self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(base_url=self.url, timeout=30, headers={"Content-Type": "application/json"})
        end = time.monotonic() + 60
        while True:
            try:
                if self.client.post("/query", content=self.query_body([1] * BS)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > end or self.proc.poll() is not None:
                self.close()  # never leave the service running behind a failed start
                log.flush()
                tail = Path(log.name).read_text()[-3000:] if hasattr(log, "name") else ""
                raise SystemExit(f"{kind} did not come up:\n{tail}")
            time.sleep(0.05)

    def query_body(self, tokens: list[int]) -> bytes:
        if self.kind == "kvstream":
            return json.dumps({"model": "bench", "token_ids": tokens, "block_size": BS}).encode()
        return json.dumps({"token_ids": tokens, "model_name": "bench"}).encode()

    def matched_blocks(self, tokens: list[int]) -> dict[str, int]:
        """Per engine name, blocks of ``tokens`` the service says it holds."""
        r = self.client.post("/query", content=self.query_body(tokens))
        r.raise_for_status()
        doc = r.json()
        if self.kind == "kvstream":
            return {k: v["longest_matched"] // BS for k, v in doc["default"].items()}
        out = {}
        for inst, ranks in doc.get("scores", {}).items():
            tokens = max(ranks.values()) if isinstance(ranks, dict) else ranks
            out[f"e{inst}"] = tokens // BS  # Dynamo 1.6 scores in tokens
        return out

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


# -- load -------------------------------------------------------------------------------

_WRK_LUA = """
local bodies = {}
local i = 0
for line in io.lines("%s") do bodies[#bodies + 1] = line end
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  i = i %% #bodies + 1
  return wrk.format(nil, "/query", nil, bodies[i])
end
done = function(summary, latency, requests)
  io.write(string.format("RESULT %%d %%f %%f %%f %%d\\n", summary.requests, summary.duration / 1e6,
    latency:percentile(50) / 1e3, latency:percentile(99) / 1e3,
    summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"""


def load(svc: Service, bodies: list[bytes], conns: int, seconds: float, tmp: Path) -> dict[str, float]:
    """requests/s, p50 and p99 (ms), errors, over ``conns`` connections for ``seconds``."""
    if shutil.which("wrk"):
        return wrk_result(start_wrk(svc, bodies, conns, max(1, round(seconds)), tmp))
    return _py_load(svc, bodies, conns, seconds)


def _py_load(svc: Service, bodies: list[bytes], conns: int, seconds: float) -> dict[str, float]:
    import anyio

    lat: list[float] = []
    errors = 0

    async def one(k: int, end: float) -> None:
        nonlocal errors
        async with httpx.AsyncClient(base_url=svc.url, timeout=30) as c:
            i = k
            while time.perf_counter() < end:
                t = time.perf_counter()
                r = await c.post("/query", content=bodies[i % len(bodies)], headers={"Content-Type": "application/json"})
                lat.append(time.perf_counter() - t)
                errors += r.status_code != 200
                i += conns

    async def main() -> float:
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for k in range(conns):
                tg.start_soon(one, k, t0 + seconds)
        return time.perf_counter() - t0

    dur = anyio.run(main)
    lat.sort()
    return {"rps": len(lat) / dur, "p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
            "errors": errors}


def ingest(svc: Service, farm: subprocess.Popen, last: list[list[int]], args: argparse.Namespace) -> float:
    """Tell the farm to publish a round; seconds until every engine's last document of it
    is fully queryable. One query per poll (the first engine not done yet), so polling
    costs the service little; engines progress in parallel."""
    t0 = time.perf_counter()
    farm.stdin.write("go\n")  # type: ignore[union-attr]
    farm.stdin.flush()  # type: ignore[union-attr]
    want = args.prompt_tokens // BS
    pending = list(range(args.engines))
    while pending:
        if time.perf_counter() - t0 > 180:
            raise SystemExit(f"{svc.kind}: engines {pending[:8]} never caught up")
        i = pending[0]
        if svc.matched_blocks(last[i]).get(f"e{i}", 0) >= want:
            pending.pop(0)
        else:
            time.sleep(0.005)
    return time.perf_counter() - t0


def start_wrk(svc: Service, bodies: list[bytes], conns: int, seconds: int, tmp: Path) -> subprocess.Popen:
    (tmp / "bodies.txt").write_bytes(b"\n".join(bodies) + b"\n")
    (tmp / "q.lua").write_text(_WRK_LUA % (tmp / "bodies.txt"))
    return subprocess.Popen(["wrk", "-t", str(min(conns, 2)), "-c", str(conns), "-d", f"{seconds}s",
                             "-s", str(tmp / "q.lua"), svc.url], stdout=subprocess.PIPE, text=True)


def wrk_result(proc: subprocess.Popen) -> dict[str, float]:
    out, _ = proc.communicate(timeout=120)
    line = next(x for x in out.splitlines() if x.startswith("RESULT"))
    n, dur, p50, p99, errors = line.split()[1:]
    return {"rps": int(n) / float(dur), "p50_ms": float(p50), "p99_ms": float(p99), "errors": int(errors)}


# -- where the time goes: each stage alone, in-process, on the same state ----------------------


def stages(args: argparse.Namespace) -> None:
    """Time each stage of ingest and of one ``/query`` alone on the bench's state (one
    process, no HTTP): what a request and a block cost before any server or client."""
    import gc
    from array import array

    from kvstream.hashing import BlockHasher, to_external_list
    from kvstream.routing.keys import prompt_keys
    from kvstream.service.config import build_config
    from kvstream.service.core import DEFAULT_INDEX, ServiceCore
    from kvstream.service.mooncake import _QUERY, MooncakeAPI
    from kvstream.service.schema import ENCODER
    from kvstream._native import split_body
    from kvstream.wire.events import BlockStored, EventDecoder, EventEncoder, KVEventBatch

    documents, held = workload(args.engines, args.docs, args.prompt_tokens)
    hasher = BlockHasher("sha256_cbor", BS, seed="0")
    names = [f"e{i}" for i in range(args.engines)]
    cfg = build_config({"model_name": "bench", "load_interval": 0},
                       [f"{n}=tcp://127.0.0.1:{20000 + i}" for i, n in enumerate(names)], None)
    core = ServiceCore(cfg)
    mc = core.mooncake = MooncakeAPI(core)
    ix = core.indexes[DEFAULT_INDEX]
    enc, dec = EventEncoder(), EventDecoder()
    hashes: dict[int, list[Any]] = {}
    payloads = []
    for i, docs in enumerate(held):
        for d in docs:
            if d not in hashes:
                hashes[d] = to_external_list(hasher.hash_blocks(documents[d]))
            batch = KVEventBatch(time.time(), [BlockStored(hashes[d], None, documents[d], BS, None, "GPU", None)], 0)
            payloads.append((names[i], enc.encode(batch)))
    blocks = args.engines * args.docs * (args.prompt_tokens // BS)
    gc.collect()
    t = time.perf_counter()
    batches = [(n, dec.decode(p)) for n, p in payloads]
    t_dec = time.perf_counter() - t
    t = time.perf_counter()
    for n, b in batches:
        ix.apply_batch(n, b)
    t_apply = time.perf_counter() - t
    del batches
    # What the service does instead: the native reader (PayloadDecoder), then the apply
    # from its columns, on a fresh index.
    from kvstream._native import read_payload
    from kvstream.routing.payloads import PayloadDecoder

    pdec = PayloadDecoder(EventDecoder())
    t = time.perf_counter()
    for _n, p in payloads:
        read_payload(p, 1 << 26)
    t_read = time.perf_counter() - t
    core2 = ServiceCore(cfg)
    ix2 = core2.indexes[DEFAULT_INDEX]
    gc.collect()
    t = time.perf_counter()
    for n, p in payloads:
        ix2.apply_batch(n, pdec.decode(p))
    t_native = time.perf_counter() - t
    del core2, ix2
    print(f"ingest of {blocks:,} blocks ({len(payloads)} batches of {args.prompt_tokens // BS} blocks), one core:")
    print(f"  decode (msgpack -> events)  {t_dec / blocks * 1e6:6.2f} us/block  {blocks / t_dec:>11,.0f} blocks/s")
    print(f"  index apply                 {t_apply / blocks * 1e6:6.2f} us/block  {blocks / t_apply:>11,.0f} blocks/s")
    both = t_dec + t_apply
    print(f"  both                        {both / blocks * 1e6:6.2f} us/block  {blocks / both:>11,.0f} blocks/s")
    print(f"  the service's path: native read (read_payload) {t_read / len(payloads) * 1e6:6.1f} us/batch; "
          f"read + apply from the columns {t_native / blocks * 1e6:5.2f} us/block  {blocks / t_native:>11,.0f} blocks/s")

    rng = random.Random(3)
    bodies = [json.dumps({"model": "bench", "token_ids": documents[rng.randrange(len(documents))],
                          "block_size": BS}).encode() for _ in range(64)]
    reqs = [_QUERY.decode(b) for b in bodies]
    packed = [array("I", q.token_ids) for q in reqs]
    raw = [p.tobytes() for p in packed]  # what the body's native read hands the walk
    keys = [prompt_keys(p, BS) for p in packed]
    rows = [ix.match_rows(p)[1] for p in packed]
    matches = [ix.match((), keys=k) for k in keys]
    results = []
    for r in rows:
        res: dict[str, Any] = {}
        mc._merge_rows(res, r, BS, None)
        results.append(res)
    n = 64 * max(1, args.stage_rounds)

    def timed(f: Any) -> float:
        """Median us per call (a median: load bursts on a shared machine hit single calls)."""
        for i in range(64):
            f(i)
        ts = []
        clock = time.perf_counter
        for i in range(n):
            t = clock()
            f(i % 64)
            ts.append(clock() - t)
        ts.sort()
        return ts[len(ts) // 2] * 1e6

    # What the handler does now: the native core reads the body (kvstream._native.split_body:
    # the flat route, rust/src/json.rs) and walks every tier from the packed ids
    # (match_rows); the routes it replaces (msgspec + array, pysimdjson + numpy when
    # installed; a SourceMatch per engine) are timed beside it in the same run.
    rows_t = [
        ("JSON read + uint32 pack (native)", timed(lambda i: split_body(bodies[i], "token_ids", 4))),
        ("rest of the fields (msgspec)", timed(lambda i: _QUERY.decode(b'{"model":"bench","block_size":16,'
                                                                       b'"token_ids":[]}'))),
        ("keys + walk + the answer's JSON (match_answer)",
         timed(lambda i: mc._native_answer(DEFAULT_INDEX, ix, "default", BS, raw[i]))),
        ("metrics (counter, 2 histograms)", timed(lambda i: core.metrics.routed("query", 2e-4, 4096))),
    ]
    before = [
        ("keys + walk, every tier, rows (match_rows)", timed(lambda i: ix.match_rows(packed[i]))),
        ("per-instance answer as dicts (merge rows)", timed(lambda i: mc._merge_rows({}, rows[i], BS, None))),
        ("  and their JSON encode", timed(lambda i: ENCODER.encode({"default": results[i]}))),
        ("msgspec decode + array pack", timed(lambda i: array("I", _QUERY.decode(bodies[i]).token_ids))),
        ("router keys (256 x xxh3)", timed(lambda i: prompt_keys(packed[i], BS))),
        ("index walk, a SourceMatch per engine (match)", timed(lambda i: ix.match((), keys=keys[i]))),
        ("match from the prompt (one native GPU walk)", timed(lambda i: ix.match(packed[i]))),
    ]
    try:  # the previous route (pysimdjson, no longer a dependency): when installed
        import numpy as np
        import simdjson

        parser = simdjson.Parser()

        def simd(body: bytes) -> Any:
            doc = parser.parse(body)
            out = array("I", np.frombuffer(doc["token_ids"].as_buffer(of_type="u"), dtype=np.uint64)
                        .astype(np.uint32).tobytes())
            del doc
            return out

        before.insert(0, ("pysimdjson parse + numpy narrowing", timed(lambda i: simd(bodies[i]))))
    except ImportError:
        pass
    total = timed(lambda i: mc.query(bodies[i]))
    held = sum(len(r) for r in rows) / len(rows)
    print(f"\none /query ({args.prompt_tokens}-token prompt, {args.engines} engines, {held:.1f} of them holding a "
          "prefix on average), each stage alone, one core:")
    for name, us in rows_t:
        print(f"  {name:<46} {us:7.1f} us  {us / total * 100:5.1f} %")
    print(f"  {'sum of the stages':<46} {sum(us for _, us in rows_t):7.1f} us")
    print(f"  {'the whole handler (MooncakeAPI.query)':<46} {total:7.1f} us  = {1e6 / total:,.0f} requests/s per "
          "core before HTTP")
    print("the previous routes' stages, same run:")
    for name, us in before:
        print(f"  {name:<46} {us:7.1f} us")
    del matches


# -- the farm's own ceiling ----------------------------------------------------------------


def farm_ceiling(args: argparse.Namespace) -> float:
    """Block events/s the farm delivers into bare SUB sockets (one per engine, in this
    process, receiving without decoding): the most any service can be measured to ingest
    on this machine. The better of its two rounds."""
    import zmq

    farm = subprocess.Popen([sys.executable, __file__, "--farm", "--engines", str(args.engines), "--docs",
                             str(args.docs), "--prompt-tokens", str(args.prompt_tokens)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    ctx = zmq.Context()
    socks = []
    try:
        endpoints = json.loads(_line(farm))
        poller = zmq.Poller()
        for pub, _rep in endpoints:
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(pub)
            socks.append(s)
            poller.register(s, zmq.POLLIN)
        time.sleep(1.0)  # as run_one: let every SUB socket finish connecting
        want = args.engines * args.docs
        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            farm.stdin.write("go\n")  # type: ignore[union-attr]
            farm.stdin.flush()  # type: ignore[union-attr]
            got = 0
            while got < want:
                ready = poller.poll(10_000)
                if not ready:
                    raise SystemExit(f"the farm delivered {got} of {want} batches")
                for sock, _ in ready:
                    while True:
                        try:
                            sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        got += 1
            best = max(best, want * (args.prompt_tokens // BS) / (time.perf_counter() - t0))
            _line(farm)  # "published"
        return best
    finally:
        farm.stdin.close()  # type: ignore[union-attr]
        farm.wait(30)
        for s in socks:
            s.close(linger=0)
        ctx.term()


# -- one run ----------------------------------------------------------------------------


def run_one(kind: str, workers: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    documents, held = workload(args.engines, args.docs, args.prompt_tokens)
    total_blocks = args.engines * args.docs * (args.prompt_tokens // BS)
    farm = subprocess.Popen([sys.executable, __file__, "--farm", "--engines", str(args.engines), "--docs",
                             str(args.docs), "--prompt-tokens", str(args.prompt_tokens)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    log = open(tmp / f"{kind}.log", "w")
    svc = None
    try:
        endpoints = json.loads(_line(farm))
        svc = Service(kind, endpoints, workers, log)
        time.sleep(1.0)  # let every SUB socket finish connecting (a slow joiner loses messages)
        ingest_s = ingest(svc, farm, [documents[h[-1]] for h in held], args)
        rng = random.Random(3)
        bodies = [svc.query_body(documents[rng.randrange(len(documents))]) for _ in range(64)]
        res: dict[str, Any] = {"ingest_blocks_per_s": total_blocks / ingest_s, "ingest_s": ingest_s,
                               "blocks": total_blocks}
        for conns in args.connections:
            load(svc, bodies, conns, 1.0, tmp)  # warm up
            res[f"c{conns}"] = load(svc, bodies, conns, args.seconds, tmp)
        if shutil.which("wrk"):
            # Ingest while serving: a second round of documents while wrk keeps 32
            # connections busy; wrk is stopped once every engine's last block is in.
            docs2, held2 = workload(args.engines, args.docs, args.prompt_tokens, 8)
            wrk = start_wrk(svc, bodies, 32, 60, tmp)
            time.sleep(1.0)  # let the load ramp up before the events start
            res["ingest_serving_blocks_per_s"] = total_blocks / ingest(svc, farm, [docs2[h[-1]] for h in held2], args)
            wrk.send_signal(signal.SIGINT)
            res["c32_during_ingest"] = wrk_result(wrk)
        # same answers for a spot check
        res["spot"] = svc.matched_blocks(documents[held[0][0]])
        return res
    finally:
        if svc is not None:
            svc.close()
        farm.stdin.close()  # type: ignore[union-attr]
        farm.wait(30)
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--docs", type=int, default=17, help="documents cached per engine")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=5.0, help="seconds of load per connection count")
    p.add_argument("--connections", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    p.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="kvstream serve --workers; a list (1,2) runs kvstream once per count")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every service this many times, every other round in the reverse order")
    p.add_argument("--no-dynamo", action="store_true")
    p.add_argument("--only-dynamo", action="store_true")
    p.add_argument("--stages", action="store_true",
                   help="time each stage of ingest and of /query alone, in-process on the same state; no services")
    p.add_argument("--stage-rounds", type=int, default=10, help="rounds of 64 prompts per /query stage")
    p.add_argument("--farm", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.farm:
        farm_main(args)
        return
    if args.stages:
        print(f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        stages(args)
        return
    runs = ([] if args.only_dynamo else [("kvstream", w) for w in args.workers])
    runs += [] if args.no_dynamo else [("dynamo", 1)]
    results = {}
    load_before = os.getloadavg()
    ceiling = farm_ceiling(args)
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(args.rounds):
            # Every other round in the reverse order, so load drift on a shared machine
            # hits every service alike; each round's line is printed.
            for kind, w in (runs if rnd % 2 == 0 else runs[::-1]):
                label = kind if kind == "dynamo" or len(args.workers) == 1 else f"kvstream-w{w}"
                if args.rounds > 1:
                    label += f" r{rnd + 1}"
                results[label] = run_one(kind, w, args, Path(d))
    blocks = args.engines * args.docs * (args.prompt_tokens // BS)
    print(f"\n{args.engines} engines, {blocks:,} blocks, {args.prompt_tokens}-token prompts, POST /query; "
          f"kvstream serve --workers {','.join(map(str, args.workers))}; "
          f"load by {'wrk' if shutil.which('wrk') else 'python'}")
    print(f"load average (1 min) {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, "
          f"on {os.cpu_count()} cores")
    print(f"the farm alone, into bare SUB sockets (no decode, no service): {ceiling:,.0f} block events/s "
          "(the most any service can be measured to ingest in this run)")
    head = f"{'service':<15} {'ingest blocks/s':>16} {'while serving':>14}"
    for c in args.connections:
        head += f" | {'c' + str(c) + ' req/s':>11} {'p50 ms':>7} {'p99 ms':>7}"
    print(head)
    for kind, r in results.items():
        line = f"{kind:<15} {r['ingest_blocks_per_s']:>16,.0f} {r.get('ingest_serving_blocks_per_s', 0):>14,.0f}"
        for c in args.connections:
            x = r[f"c{c}"]
            line += f" | {x['rps']:>11,.0f} {x['p50_ms']:>7.2f} {x['p99_ms']:>7.2f}"
            if x["errors"]:
                line += f" ({x['errors']} errors)"
        print(line)
    for kind, r in results.items():
        x = r.get("c32_during_ingest")
        if x:
            print(f"{kind}: 32 connections while ingesting: {x['rps']:,.0f} req/s, p50 {x['p50_ms']:.2f} ms, "
                  f"p99 {x['p99_ms']:.2f} ms")
    dyn = next((k for k in results if k.startswith("dynamo")), None)
    if dyn is not None and len(results) > 1:
        a, b = next(iter(results.values()))["spot"], results[dyn]["spot"]
        print(f"spot check, blocks matched per engine (first doc of e0): kvstream {dict(sorted(a.items()))} "
              f"dynamo {dict(sorted(b.items()))}")


if __name__ == "__main__":
    main()
