"""Differential check of kvstream's wire format and stream against vLLM's own code.

Not part of CI: it needs the vLLM sources in the peer cache (``fetch.py``; the first run
downloads them, later runs need no network). Usage, from the repository root::

    .venv/bin/python bench/vllm_peer/diff_wire.py                      # both releases
    .venv/bin/python bench/vllm_peer/diff_wire.py --releases 0.33 --cases 20000 --seed 7
    .venv/bin/python bench/vllm_peer/diff_wire.py --only codec         # codec, framing, stream, reverse

Each vLLM release runs in its own process (``shims`` imports one release per process) and
is checked in four parts:

``codec``
    ``--cases`` seeded random ``KVEventBatch`` es built with vLLM's OWN event classes
    (every field of every event type the release declares, read from the classes
    themselves: a field this tool cannot generate is reported, never skipped), encoded
    with vLLM's encoder (``msgspec.msgpack.Encoder()``, as its publisher thread does).
    kvstream must decode every field to what vLLM's own decoder returns for the same bytes
    (values and container types), and re-encode them byte-identically (map shape for 0.33,
    array shape for 0.11).
``endpoints``
    data-parallel endpoint offsets (``offset_endpoint`` against vLLM's
    ``offset_endpoint_port``) and the bind-or-connect rule (``should_bind`` against 0.33's
    ``_is_bind_endpoint``) over a list of tcp/ipc/inproc endpoints and ranks 0..3.
``framing``
    vLLM's real ``ZmqEventPublisher`` on ipc sockets: a raw DEALER asks its replay socket
    for several starts (inside, at the end, past the end, kvstream's ``SNAPSHOT``) and
    every reply is parsed with ``kvstream.wire.framing`` (frame count, topic frame, seq,
    payload identical to the live one, end marker).
``stream``
    the same publisher feeding kvstream's ``Subscriber``: every batch arrives once, in
    order, with its seq and vLLM's bytes; then a consumer that stalls while the publisher
    runs on (small HWMs: ZMQ drops, the subscriber must replay exactly the missed batches
    from vLLM's replay socket); then publisher restarts (a new vLLM publisher on the same
    endpoints, seq from 0, other bytes, with more and with fewer batches than the old one),
    which must come out as ``SourceReset("restart")`` before any batch of the new
    publisher, never as a silent continuation; a loss beyond vLLM's replay buffer (every
    seq yielded or declared lost by ``SourceStale``, nothing wrong); publishers of another
    topic and of vLLM's default empty topic under a filter (nothing yielded); and vLLM in
    connect mode (its PUB connects, ``SourceSpec(bind=True)``).
``reverse``
    kvstream's ``Publisher`` (configured like the release) feeding a client written
    against vLLM's documented protocol: a SUB decoding with vLLM's own classes, and
    DEALER and REQ replay clients (8-byte big-endian start; replies until seq -1).

Prints one line per check and a summary per release; the exit status is 1 if anything
differs. Known, documented differences (see ``docs/wire-protocol.md``) are counted apart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository (kvstream)

from vllm_peer import fetch  # noqa: E402

RELEASES = ("0.11", "0.33")
PARTS = ("codec", "endpoints", "framing", "stream", "reverse")
TOPIC = "kv@peer@model"


# -- random values, by field name ------------------------------------------------------

_INT_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
_HASH_BYTES_LENGTHS = [0, 1, 7, 8, 16, 31, 32, 33, 64, 255, 256]
_STRINGS = ["", "GPU", "CPU", "STORAGE", "disk", "LOCAL", "REMOTE", "full_attention", "sliding_window",
            "mamba", "adapter-a", "tenant-1", "sess-42", "γ-ü-雪", "x" * 31, "y" * 32, "z" * 255, "w" * 256]


class Gen:
    """Seeded random values at the msgpack encoding boundaries."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def uint(self, hi: int = 2**64 - 1) -> int:
        r = self.r
        if r.random() < 0.5:
            return r.choice([v for v in _INT_EDGES if v <= hi])
        return r.randint(0, hi)

    def sint(self) -> int:
        r = self.r
        v = self.uint(2**63 - 1)
        return -v - (r.random() < 0.5) if r.random() < 0.3 else v

    def hash(self) -> int | bytes:
        r = self.r
        if r.random() < 0.7:
            return self.uint()
        n = r.choice(_HASH_BYTES_LENGTHS + ([65536] if r.random() < 0.01 else []))
        return r.randbytes(n)

    def text(self) -> str:
        r = self.r
        if r.random() < 0.7:
            return r.choice(_STRINGS)
        return "".join(chr(r.choice([r.randint(32, 126), r.randint(0xA0, 0x2FFF)])) for _ in range(r.randint(0, 40)))

    def maybe(self, f: Callable[[], Any], p_none: float = 0.4) -> Any:
        return None if self.r.random() < p_none else f()

    def tokens(self, n: int | None = None) -> list[int]:
        r = self.r
        if n is None:
            n = r.choice([0, 1, 2, 16, 17, 64])
        return [self.uint(2**32 - 1) if r.random() < 0.1 else r.randint(0, 200_000) for _ in range(n)]

    def extra_value(self, depth: int = 0) -> Any:
        r = self.r
        k = r.randrange(6 if depth < 2 else 4)
        if k == 0:
            return self.text()
        if k == 1:
            return self.sint()
        if k == 2:
            return r.randbytes(r.choice([0, 8, 32]))
        if k == 3:
            return r.choice([None, True, False, 0.5])
        items = [self.extra_value(depth + 1) for _ in range(r.randint(0, 3))]
        return tuple(items) if k == 4 else items

    def extra_keys(self, n_blocks: int) -> list[Any]:
        return [self.maybe(lambda: tuple(self.extra_value() for _ in range(self.r.randint(0, 3))), 0.5)
                for _ in range(n_blocks)]


def _field_value(g: Gen, name: str, n_blocks: int) -> Any:
    """A random value for vLLM field ``name``; KeyError if this tool does not know it."""
    r = g.r
    table: dict[str, Callable[[], Any]] = {
        "block_hashes": lambda: [g.hash() for _ in range(n_blocks)],
        "parent_block_hash": lambda: g.maybe(g.hash),
        "token_ids": lambda: g.tokens(),
        "block_size": lambda: r.choice([0, 1, 16, 128, 256, 65536]),
        "lora_id": lambda: g.maybe(lambda: g.uint(2**31 - 1)),
        "lora_name": lambda: g.maybe(g.text),
        "medium": lambda: r.choice([None, "GPU", "CPU", "STORAGE", "", "nvme-0", g.text()]),
        "extra_keys": lambda: g.maybe(lambda: g.extra_keys(n_blocks)),
        "group_idx": lambda: g.maybe(lambda: g.uint(2**31 - 1)),
        "kv_cache_spec_kind": lambda: g.maybe(g.text),
        "kv_cache_spec_sliding_window": lambda: g.maybe(lambda: g.uint(2**31 - 1)),
        "locality": lambda: r.choice([None, "LOCAL", "REMOTE", g.text()]),
        "ownership": lambda: g.maybe(g.text),
        "session_id": lambda: g.maybe(g.text),
        "lookahead_token_ids": lambda: g.maybe(lambda: [g.tokens(r.choice([0, 1, 3])) for _ in range(n_blocks)]),
    }
    if name not in table:
        raise SystemExit(f"vLLM declares an event field {name!r} that diff_wire cannot generate yet: "
                         "add it to _field_value (and to kvstream.wire.events if kvstream lacks it)")
    return table[name]()


def _event(kv: Any, g: Gen, fields_of: dict[type, list[tuple[str, bool]]]) -> Any:
    r = g.r
    cls = r.choice([kv.BlockStored] * 5 + [kv.BlockRemoved] * 3 + [kv.AllBlocksCleared])
    n_blocks = r.choice([0, 1, 1, 2, 4, 9])
    kw = {}
    for name, required in fields_of[cls]:
        if required or r.random() < 0.5:
            kw[name] = _field_value(g, name, n_blocks)
    return cls(**kw)


def _batch(kv: Any, g: Gen, fields_of: dict[type, list[tuple[str, bool]]], rank_none_ok: bool) -> Any:
    r = g.r
    ts = r.choice([0.0, 1700000000.0 + r.randint(0, 10**6), time.time(), r.uniform(0, 2e9), 1e-300, 1.5e300])
    events = [_event(kv, g, fields_of) for _ in range(r.choice([0, 1, 1, 2, 3, 8]))]
    rank: int | None = r.choice([0, 0, 1, 7, 127, 128, 2**16, 2**31 - 1])
    if rank_none_ok and r.random() < 0.1:
        rank = None
    return kv.KVEventBatch(ts=ts, events=events, data_parallel_rank=rank)


def _fields(kv: Any) -> dict[type, list[tuple[str, bool]]]:
    import msgspec

    out = {}
    for cls in (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared):
        out[cls] = [(f.name, f.required) for f in msgspec.structs.fields(cls)]
    return out


# -- comparison --------------------------------------------------------------------------

def _same(a: Any, b: Any, path: str) -> str | None:
    """None if ``a`` (kvstream) and ``b`` (vLLM) are the same value of the same type,
    recursively; else where and how they differ."""
    if type(a) is not type(b):
        return f"{path}: kvstream {type(a).__name__} {a!r:.80} vs vLLM {type(b).__name__} {b!r:.80}"
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _same(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, float):
        return None if struct.pack(">d", a) == struct.pack(">d", b) else f"{path}: {a!r} vs {b!r}"
    return None if a == b else f"{path}: kvstream {a!r:.80} vs vLLM {b!r:.80}"


def _compare_batch(kb: Any, vb: Any) -> str | None:
    d = _same(kb.ts, vb.ts, "ts") or _same(kb.data_parallel_rank, vb.data_parallel_rank, "data_parallel_rank")
    if d:
        return d
    if len(kb.events) != len(vb.events):
        return f"events: {len(kb.events)} vs {len(vb.events)}"
    for i, (ke, ve) in enumerate(zip(kb.events, vb.events)):
        if type(ke).__name__ != type(ve).__name__:
            return f"events[{i}]: kvstream {type(ke).__name__} vs vLLM {type(ve).__name__}"
        vfields = ve.__struct_fields__
        for f in vfields:
            if f not in ke.__struct_fields__:
                return f"events[{i}].{f}: vLLM has the field, kvstream's {type(ke).__name__} does not"
            d = _same(getattr(ke, f), getattr(ve, f), f"events[{i}].{f}")
            if d:
                return d
        for f in ke.__struct_fields__:
            if f not in vfields and getattr(ke, f) is not None:
                return f"events[{i}].{f}: kvstream set {getattr(ke, f)!r:.60}, vLLM has no such field"
    return None


# -- the worker (one release per process) -----------------------------------------------

class Report:
    def __init__(self, release: str) -> None:
        self.release = release
        self.checks = 0
        self.diffs: list[str] = []
        self.known: dict[str, int] = {}
        self.notes: list[str] = []

    def ok(self, cond: bool, what: str) -> bool:
        self.checks += 1
        if not cond:
            self.diffs.append(what)
            print(f"  DIFF {what}", flush=True)
        return cond

    def note(self, what: str) -> None:
        self.notes.append(what)
        print(f"  {what}", flush=True)


def _load(release: str) -> Any:
    from vllm_peer import shims

    kv = shims.load(fetch.ensure(release)).kv_events
    # 0.33's publisher builds a vllm.config KVEventsConfig only to report it back
    # (get_publisher_config); that class is not among the files the peer imports.
    kv.KVEventsConfig = lambda **kw: dict(kw)
    return kv


def check_codec(kv: Any, rel: str, rep: Report, cases: int, seed: int) -> None:
    import msgspec

    from kvstream.wire.events import EventDecoder, EventEncoder

    fmt = "map" if rel == "0.33" else "array"
    fields_of = _fields(kv)
    venc = msgspec.msgpack.Encoder()  # what vLLM's publisher thread uses
    vdec = msgspec.msgpack.Decoder(kv.KVEventBatch)
    kdec = EventDecoder()
    kenc = EventEncoder(fmt)
    g = Gen(seed)
    events = 0
    seen_fields: set[str] = set()
    n_diff_before = len(rep.diffs)
    shown = 0
    for i in range(cases):
        b = _batch(kv, g, fields_of, rank_none_ok=True)
        events += len(b.events)
        for e in b.events:
            seen_fields.update(f for f in e.__struct_fields__ if getattr(e, f) is not None)
        payload = venc.encode(b)
        vb = vdec.decode(payload)
        try:
            kb = kdec.decode(payload)
        except Exception as exc:  # noqa: BLE001 - any failure is a difference
            rep.checks += 1
            rep.diffs.append(f"codec case {i}: kvstream cannot decode vLLM's payload: {exc}")
            if shown < 5:
                print(f"  DIFF codec case {i}: kvstream cannot decode vLLM's payload: {str(exc)[:300]}")
                shown += 1
            continue
        d = _compare_batch(kb, vb)
        rep.checks += 1
        if d:
            rep.diffs.append(f"codec case {i}: {d}")
            if shown < 5:
                print(f"  DIFF codec case {i}: decoded values differ: {d}")
                shown += 1
            continue
        again = kenc.encode(kb)
        rep.checks += 1
        if again != payload:
            if fmt == "array" and b.data_parallel_rank is None and again[:1] == b"\x92" \
                    and payload == b"\x93" + again[1:] + b"\xc0":
                # vLLM 0.11 writes a None rank as nil (msgspec ignores omit_defaults on
                # array-like structs); its publisher always stamps the rank, so a nil rank
                # never reaches the wire. kvstream omits it (documented).
                k = "0.11 batch with data_parallel_rank None: vLLM writes nil, kvstream omits it"
                rep.known[k] = rep.known.get(k, 0) + 1
                continue
            rep.diffs.append(f"codec case {i}: re-encoding differs")
            if shown < 5:
                print(f"  DIFF codec case {i}: re-encoded bytes differ\n    vLLM     {payload.hex()[:200]}\n"
                      f"    kvstream {again.hex()[:200]}")
                shown += 1
    all_fields = {n for fl in fields_of.values() for n, _ in fl}
    missing = sorted(all_fields - seen_fields)
    rep.ok(not missing, f"codec: fields never set by the generator: {missing}")
    n = len(rep.diffs) - n_diff_before
    print(f"  codec: {cases} random batches, {events} events, fields {sorted(all_fields)}: "
          f"{n} differences", flush=True)


_ENDPOINTS = ["tcp://*:5557", "tcp://*:0", "tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://[::]:7000",
              "tcp://host.example:65534", "tcp://*:*", "tcp://host", "tcp://*:x", "ipc:///tmp/kv.sock",
              "ipc:///tmp/tcp.sock", "inproc://cache", "inproc://tcp:1", "udp://*:5557", "", "tcp://::1:5557"]


def check_endpoints(kv: Any, rel: str, rep: Report) -> None:
    from kvstream.transport.config import offset_endpoint, should_bind

    vpub = kv.ZmqEventPublisher
    known = 0
    for ep in _ENDPOINTS:
        for rank in range(4):
            try:
                want: Any = vpub.offset_endpoint_port(ep, rank)
            except ValueError as exc:
                want = ValueError(str(exc))
            try:
                got: Any = offset_endpoint(ep, rank, rel)
            except ValueError as exc:
                got = ValueError(str(exc))
            if isinstance(want, ValueError) and isinstance(got, ValueError):
                continue
            if ep.endswith(":*") and rank and isinstance(want, ValueError) and got == ep:
                known += 1  # kvstream keeps a wildcard port (documented); vLLM cannot parse it
                continue
            rep.ok(want == got, f"endpoints: {ep!r} rank {rank}: vLLM {want!r}, kvstream {got!r}")
        if hasattr(vpub, "_is_bind_endpoint") and ep:
            rep.ok(vpub._is_bind_endpoint(ep) == should_bind(ep),  # noqa: SLF001
                   f"endpoints: bind rule for {ep!r}: vLLM {vpub._is_bind_endpoint(ep)}, kvstream {should_bind(ep)}")
    if known:
        k = "wildcard port tcp://...:* at rank > 0: vLLM raises, kvstream keeps it"
        rep.known[k] = rep.known.get(k, 0) + known
    print(f"  endpoints: {len(_ENDPOINTS)} endpoints x ranks 0..3 against offset_endpoint_port"
          f"{' and _is_bind_endpoint' if hasattr(vpub, '_is_bind_endpoint') else ''}", flush=True)


def _publisher(kv: Any, d: str, name: str, **kw: Any) -> Any:
    return kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{d}/{name}.pub",
                                replay_endpoint=f"ipc://{d}/{name}.replay", topic=TOPIC, **kw)


def _wait_drained(pub: Any, timeout_s: float = 20.0) -> None:
    """Until vLLM's publisher thread has sent everything queued (it calls task_done)."""
    deadline = time.monotonic() + timeout_s
    while pub._event_queue.unfinished_tasks:  # noqa: SLF001 - the peer's own queue
        if time.monotonic() > deadline:
            raise TimeoutError("vLLM's publisher did not drain its queue")
        time.sleep(0.002)


def _dealer_replay(ctx: Any, ep: str, start: bytes, timeout_ms: int = 5000) -> list[list[bytes]]:
    import zmq

    d = ctx.socket(zmq.DEALER)
    d.linger = 0
    d.connect(ep)
    try:
        d.send_multipart([b"", start])
        out = []
        while True:
            if not d.poll(timeout_ms):
                raise TimeoutError(f"no end marker from {ep} for start {start!r}")
            frames = d.recv_multipart()
            out.append(frames)
            if frames[-2] == b"\xff" * 8 and frames[-1] == b"":
                return out
    finally:
        d.close(0)


def check_framing(kv: Any, rel: str, rep: Report, seed: int) -> None:
    import msgspec
    import zmq

    from kvstream.wire.framing import END_SEQ, FrameError, parse_replay_reply

    fields_of = _fields(kv)
    g = Gen(seed + 1)
    ctx = zmq.Context.instance()
    with tempfile.TemporaryDirectory(prefix="kvs-diffwire-") as d:
        pub = _publisher(kv, d, "f")
        sub = ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.subscribe(b"")
        sub.connect(f"ipc://{d}/f.pub")
        try:
            # Slow joiner: wait until a probe batch arrives live, then publish for real.
            probe_payloads: dict[int, bytes] = {}
            while True:
                pub.publish(kv.KVEventBatch(ts=0.0, events=[kv.AllBlocksCleared()]))
                if sub.poll(50):
                    break
            _wait_drained(pub)
            while sub.poll(0):
                fr = sub.recv_multipart()
                probe_payloads[int.from_bytes(fr[1], "big")] = fr[2]
            base = len(pub._buffer)  # noqa: SLF001 - seqs 0..base-1 are the probes
            n = 40
            live = []
            for _ in range(n):
                b = _batch(kv, g, fields_of, rank_none_ok=False)
                pub.publish(b)
            _wait_drained(pub)
            while len(live) < n and sub.poll(2000):
                live.append(sub.recv_multipart())
            rep.ok(len(live) == n, f"framing: {len(live)} of {n} live messages arrived")
            for i, fr in enumerate(live):
                rep.ok(len(fr) == 3 and fr[0] == TOPIC.encode() and fr[1] == (base + i).to_bytes(8, "big"),
                       f"framing: live message {i} frames {[len(f) for f in fr]}")
            payload_of = {base + i: fr[2] for i, fr in enumerate(live)}
            # Probes sent before the SUB joined were dropped live; they are all the same bytes.
            for j in range(base):
                payload_of[j] = probe_payloads.get(j, next(iter(probe_payloads.values())))
            total = base + n
            for start in (0, base + 7, total - 1, total, total + 5, 2**63, "SNAPSHOT"):
                sb = b"SNAPSHOT" if start == "SNAPSHOT" else int(start).to_bytes(8, "big")
                replies = _dealer_replay(ctx, f"ipc://{d}/f.replay", sb)
                parsed = []
                for fr in replies:
                    try:
                        parsed.append(parse_replay_reply(fr))
                    except FrameError as exc:
                        rep.ok(False, f"framing: kvstream rejects vLLM {rel}'s replay reply {fr!r:.120}: {exc}")
                if len(parsed) != len(replies):
                    continue
                want_n = 3 if rel == "0.11" else 4
                rep.ok(all(len(fr) == want_n for fr in replies),
                       f"framing: replay frames {[len(fr) for fr in replies][:5]} (expected {want_n})")
                end = parsed[-1]
                rep.ok(end.end and end.seq == END_SEQ and end.payload == b"",
                       f"framing: start {start}: last reply is not the end marker")
                if rel == "0.33":
                    rep.ok(end.topic == b"", f"framing: end marker topic {end.topic!r}")
                body = parsed[:-1]
                first = int.from_bytes(sb, "big")
                want = [s for s in range(total) if s >= first]
                rep.ok([r.seq for r in body] == want,
                       f"framing: start {start}: replayed seqs {[r.seq for r in body][:8]}... expected {want[:8]}...")
                for r in body:
                    rep.ok(not r.end and r.payload == payload_of.get(r.seq),
                           f"framing: replayed seq {r.seq} payload differs from the live one")
                    rep.ok(r.topic == (None if rel == "0.11" else TOPIC.encode()),
                           f"framing: replayed seq {r.seq} topic {r.topic!r}")
                    if r.seq >= base:
                        msgspec.msgpack.Decoder(kv.KVEventBatch).decode(r.payload)
            print(f"  framing: {n + base} live batches, 7 replay requests ({3 if rel == '0.11' else 4}-frame "
                  f"replies) parsed by kvstream.wire.framing", flush=True)
        finally:
            sub.close(0)
            pub.shutdown()


async def _collect(sub: Any, n_batches: int, timeout_s: float, items: list[Any]) -> None:
    import anyio

    from kvstream.transport import SourceBatch

    got = sum(1 for it in items if type(it) is SourceBatch)
    with anyio.move_on_after(timeout_s):
        async for it in sub:
            items.append(it)
            if type(it) is SourceBatch:
                got += 1
                if got >= n_batches:
                    return


def _summarise(items: list[Any]) -> list[tuple[str, Any]]:
    from kvstream.transport import SourceBatch, SourceLive

    return [("batch", it.seq) if type(it) is SourceBatch else (type(it).__name__, getattr(it, "reason", None))
            for it in items if type(it) is not SourceLive]


async def check_stream(kv: Any, rel: str, rep: Report, seed: int) -> None:
    import anyio
    import msgspec

    from kvstream.transport import SourceBatch, SourceReset, SourceSpec, Subscriber

    fields_of = _fields(kv)
    g = Gen(seed + 2)
    venc = msgspec.msgpack.Encoder()
    with tempfile.TemporaryDirectory(prefix="kvs-diffwire-") as d:
        spec = SourceSpec(f"ipc://{d}/s.pub", f"ipc://{d}/s.replay", name="vllm", topic=TOPIC)

        # 1. in order, once, with vLLM's bytes (empty batches included: vLLM publishes them).
        pub = await anyio.to_thread.run_sync(lambda: _publisher(kv, d, "s"))
        try:
            async with Subscriber([spec], topic=TOPIC, probe_after_s=0.2) as sub:
                await sub.wait_connected("vllm", timeout_s=10)
                n = 300
                want = []
                for _ in range(n):
                    b = _batch(kv, g, fields_of, rank_none_ok=True)
                    pub.publish(b)  # stamps the rank like the engine's
                    want.append(venc.encode(b))
                items: list[Any] = []
                await _collect(sub, n, 20, items)
                got = [it for it in items if type(it) is SourceBatch]
                rep.ok([it.seq for it in got] == list(range(n)),
                       f"stream/live: seqs {[it.seq for it in got][:10]}... (expected 0..{n - 1} once each)")
                rep.ok(all(it.payload == w for it, w in zip(got, want)), "stream/live: payload bytes differ")
                rep.ok(not [it for it in items if type(it) is not SourceBatch and type(it).__name__ != "SourceLive"],
                       f"stream/live: unexpected items {_summarise(items)[:5]}")
                c = sub.counters("vllm")
                print(f"  stream/live: {len(got)}/{n} batches in order (vLLM {rel} ZmqEventPublisher -> "
                      f"kvstream Subscriber), replays {c.replays}, gaps {c.gaps}", flush=True)

                # 2. A consumer that stalls: ZMQ drops beyond the HWMs, the subscriber must
                # replay exactly what it missed from vLLM's replay socket.
            pub.shutdown()
            pub = await anyio.to_thread.run_sync(lambda: _publisher(kv, d, "g", hwm=8))
            gspec = SourceSpec(f"ipc://{d}/g.pub", f"ipc://{d}/g.replay", name="vllm", topic=TOPIC)
            async with Subscriber([gspec], topic=TOPIC, rcvhwm=8, max_buffered_items=8,
                                  probe_after_s=0.2) as sub:
                await sub.wait_connected("vllm", timeout_s=10)
                n = 1500
                want = []
                for _ in range(n):
                    b = _batch(kv, g, fields_of, rank_none_ok=False)
                    pub.publish(b)
                    want.append(venc.encode(b))
                await anyio.to_thread.run_sync(_wait_drained, pub)
                items = []
                await _collect(sub, n, 60, items)
                got = [it for it in items if type(it) is SourceBatch]
                c = sub.counters("vllm")
                rep.ok([it.seq for it in got] == list(range(n)),
                       f"stream/gap: {len(got)} batches, seqs not 0..{n - 1} once each in order "
                       f"(first wrong at {next((i for i, it in enumerate(got) if it.seq != i), None)})")
                rep.ok(all(it.payload == w for it, w in zip(got, want)), "stream/gap: payload bytes differ")
                bad = [s for s in _summarise(items) if s[0] != "batch"]
                rep.ok(not bad, f"stream/gap: unexpected items {bad[:5]}")
                replayed = sum(1 for it in got if it.replayed)
                if c.gaps == 0:
                    rep.note("stream/gap: NOTE no gap was provoked (nothing dropped); inconclusive")
                print(f"  stream/gap: {len(got)}/{n} batches in order; gaps {c.gaps}, replay requests "
                      f"{c.replays}, batches replayed {replayed}, retries {c.retries}, stale marks "
                      f"{c.stale_marks}", flush=True)

                # 3. Restart: a new vLLM publisher on the same endpoints, seq from 0, other
                # bytes; first with more batches than the old one published (seq numbers
                # alone cannot tell), then with fewer.
                for m, label in ((n + 40, "more"), (10, "fewer")):
                    await anyio.to_thread.run_sync(pub.shutdown)
                    for f in ("g.pub", "g.replay"):
                        try:
                            os.unlink(os.path.join(d, f))
                        except FileNotFoundError:
                            pass
                    pub = await anyio.to_thread.run_sync(lambda: _publisher(kv, d, "g", hwm=8))
                    want2 = []
                    items = []
                    # Publish while the subscriber reconnects: early batches are lost live, so
                    # only the replay socket can tell the subscriber who is talking now.
                    for i in range(m):
                        b = _batch(kv, g, fields_of, rank_none_ok=False)
                        b.ts = 2e9 + m + i  # never an old instance's bytes
                        pub.publish(b)
                        want2.append(venc.encode(b))
                        if i % 100 == 0:
                            await anyio.sleep(0)
                    await anyio.to_thread.run_sync(_wait_drained, pub)
                    await _collect(sub, m, 60, items)
                    summary = _summarise(items)
                    first_reset = next((i for i, s in enumerate(summary) if s == ("SourceReset", "restart")), None)
                    before = [s for s in summary[: first_reset if first_reset is not None else len(summary)]
                              if s[0] == "batch"]
                    rep.ok(first_reset is not None and not before,
                           f"stream/restart ({label}): batches of the new publisher yielded before a restart reset: "
                           f"{before[:5]}, items {summary[:6]}")
                    after = [it for it in items[(first_reset or 0):] if type(it) is SourceBatch]
                    # Everything after the last reset must be the new instance from 0, in order.
                    last_reset = max((i for i, it in enumerate(items) if type(it) is SourceReset), default=None)
                    tail = [it for it in items[(last_reset or 0):] if type(it) is SourceBatch]
                    rep.ok([it.seq for it in tail] == list(range(m)) and all(it.payload == want2[it.seq] for it in tail),
                           f"stream/restart ({label}): after the reset: seqs {[it.seq for it in tail][:8]}... "
                           f"(expected 0..{m - 1} with the new publisher's bytes)")
                    c = sub.counters("vllm")
                    print(f"  stream/restart ({label} batches than before): reset at item {first_reset}, then {len(after)} batches of the new "
                          f"publisher (seq {tail[0].seq if tail else '-'}..{tail[-1].seq if tail else '-'}); "
                          f"restarts {c.restarts}, stale marks {c.stale_marks}", flush=True)
            # 4. Loss beyond vLLM's replay buffer: the missed batches rotated out
            # (buffer_steps=50). vLLM answers no snapshots, so the subscriber must say
            # SourceStale for exactly the batches it never yielded, and nothing else.
            await anyio.to_thread.run_sync(pub.shutdown)
            pub = await anyio.to_thread.run_sync(lambda: _publisher(kv, d, "r", hwm=8, buffer_steps=50))
            rspec = SourceSpec(f"ipc://{d}/r.pub", f"ipc://{d}/r.replay", name="vllm", topic=TOPIC)
            async with Subscriber([rspec], topic=TOPIC, rcvhwm=8, max_buffered_items=8,
                                  probe_after_s=0.2) as sub:
                await sub.wait_connected("vllm", timeout_s=10)
                n = 1000
                want = []
                for _ in range(n):
                    b = _batch(kv, g, fields_of, rank_none_ok=False)
                    pub.publish(b)
                    want.append(venc.encode(b))
                await anyio.to_thread.run_sync(_wait_drained, pub)
                items = []
                await _collect(sub, n, 15, items)  # fewer arrive: wait for the last one
                if not any(type(it) is SourceBatch and it.seq == n - 1 for it in items):
                    await _collect(sub, 10**9, 3, items)
                accounted: list[int] = []
                wrong = []
                from kvstream.transport import SourceStale

                for it in items:
                    if type(it) is SourceBatch:
                        accounted.append(it.seq)
                        if it.payload != want[it.seq]:
                            wrong.append(it.seq)
                    elif type(it) is SourceStale:
                        accounted.extend(range(it.first_missing_seq, it.resume_seq))
                rep.ok(not wrong, f"stream/rotated: batches with other bytes than vLLM's: {wrong[:5]}")
                rep.ok(accounted == list(range(n)),
                       f"stream/rotated: every seq must be yielded or declared lost once, in order "
                       f"(first wrong at {next((i for i, s in enumerate(accounted) if s != i), None)})")
                bad = [s for s in _summarise(items) if s[0] not in ("batch", "SourceStale")]
                rep.ok(not bad, f"stream/rotated: unexpected items {bad[:5]}")
                c = sub.counters("vllm")
                n_b = sum(1 for it in items if type(it) is SourceBatch)
                print(f"  stream/rotated: {n_b} batches yielded, {n - n_b} declared lost in "
                      f"{c.stale_marks} SourceStale item(s), snapshot requests {c.snapshots} "
                      f"(vLLM answers none), state {sub.state('vllm')}", flush=True)
            # 5. A publisher of another topic ("zz-other", then vLLM's default ""): its
            # batches reach the subscriber only through replays (0.11's carry no topic
            # frame, 0.33's an empty one for ""); none may be yielded.
            await anyio.to_thread.run_sync(pub.shutdown)
            for k, other in enumerate(("zz-other", "") if TOPIC else ()):
                pub = await anyio.to_thread.run_sync(
                    lambda: kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{d}/t{k}.pub",
                                                 replay_endpoint=f"ipc://{d}/t{k}.replay", topic=other))
                for _ in range(5):
                    pub.publish(_batch(kv, g, fields_of, rank_none_ok=False))
                await anyio.to_thread.run_sync(_wait_drained, pub)
                tspec = SourceSpec(f"ipc://{d}/t{k}.pub", f"ipc://{d}/t{k}.replay", name="vllm")
                async with Subscriber([tspec], topic=TOPIC, probe_after_s=0.05, probe_max_s=0.05) as sub:
                    with anyio.move_on_after(0.5):
                        await sub.wait_state("vllm", "live", "recovering", "stale")
                    for _ in range(5):
                        pub.publish(_batch(kv, g, fields_of, rank_none_ok=False))
                    items = []
                    await _collect(sub, 1, 1.0, items)
                    got = [it for it in items if type(it) is SourceBatch]
                    c = sub.counters("vllm")
                    rep.ok(not got, f"stream/topic: {len(got)} batches of topic {other!r} yielded under "
                                    f"filter {TOPIC!r}")
                    print(f"  stream/topic: publisher of topic {other!r}: {len(got)} batches yielded, state "
                          f"{sub.state('vllm')}, filtered {c.filtered}, "
                          f"unattributed {getattr(c, 'unattributed', '-')}", flush=True)
                await anyio.to_thread.run_sync(pub.shutdown)
            # 6. vLLM in connect mode (its PUB connects to tcp://127.0.0.1:PORT): the
            # subscriber binds (SourceSpec(bind=True)); replay over ipc (vLLM binds it).
            cspec = SourceSpec("tcp://127.0.0.1:0", f"ipc://{d}/c.replay", name="vllm", topic=TOPIC, bind=True)
            async with Subscriber([cspec], topic=TOPIC, probe_after_s=0.2) as sub:
                bound = sub.health()["vllm"].endpoint
                pub = await anyio.to_thread.run_sync(
                    lambda: kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=bound,
                                                 replay_endpoint=f"ipc://{d}/c.replay", topic=TOPIC))
                n = 50
                want = []
                for _ in range(n):
                    b = _batch(kv, g, fields_of, rank_none_ok=False)
                    pub.publish(b)  # the first ones go out before the connection: replayed
                    want.append(venc.encode(b))
                items = []
                await _collect(sub, n, 20, items)
                got = [it for it in items if type(it) is SourceBatch]
                rep.ok([it.seq for it in got] == list(range(n)) and all(it.payload == w for it, w in zip(got, want)),
                       f"stream/connect-mode: seqs {[it.seq for it in got][:8]}... (expected 0..{n - 1})")
                print(f"  stream/connect-mode: vLLM's PUB connects to the subscriber's bound {bound}: "
                      f"{len(got)}/{n} batches in order, {sum(it.replayed for it in got)} by replay", flush=True)
        finally:
            await anyio.to_thread.run_sync(pub.shutdown)


async def check_reverse(kv: Any, rel: str, rep: Report, seed: int) -> None:
    import anyio
    import msgspec
    import zmq

    from kvstream.transport import KVEventsConfig, Publisher
    from kvstream.wire.events import decode_batch

    fields_of = _fields(kv)
    g = Gen(seed + 3)
    vdec = msgspec.msgpack.Decoder(kv.KVEventBatch)
    venc = msgspec.msgpack.Encoder()
    ctx = zmq.Context.instance()
    with tempfile.TemporaryDirectory(prefix="kvs-diffwire-") as d:
        cfg = KVEventsConfig(endpoint=f"ipc://{d}/k.pub", replay_endpoint=f"ipc://{d}/k.replay", topic=TOPIC,
                             encoding="map" if rel == "0.33" else "array", replay_topic_frame=rel != "0.11")
        sub = ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.subscribe(TOPIC.encode())
        sub.connect(cfg.endpoint)
        try:
            async with Publisher(cfg) as kpub:
                # Slow joiner: publish probes until one arrives.
                probes = 0
                while True:
                    kpub.publish(kv_batch_probe())
                    probes += 1
                    await anyio.sleep(0.01)
                    if sub.poll(0):
                        break
                while sub.poll(0):
                    sub.recv_multipart()
                n = 200
                sent = []
                for _ in range(n):
                    vb = _batch(kv, g, fields_of, rank_none_ok=False)
                    vb.events = vb.events or [kv.AllBlocksCleared()]  # kvstream publishes no empty batch
                    payload = venc.encode(vb)
                    seq = kpub.publish(decode_batch(payload))
                    sent.append((seq, payload, vb))
                live = []
                with anyio.move_on_after(10):
                    while len(live) < n:
                        if sub.poll(0):
                            live.append(sub.recv_multipart())
                        else:
                            await anyio.sleep(0.005)
                rep.ok(len(live) == n, f"reverse/live: {len(live)} of {n} arrived")
                for (seq, payload, vb), fr in zip(sent, live):
                    ok = (len(fr) == 3 and fr[0] == TOPIC.encode() and int.from_bytes(fr[1], "big") == seq
                          and fr[2] == payload)
                    rep.ok(ok, f"reverse/live: seq {seq}: frames differ from vLLM's")
                    rep.ok(vdec.decode(fr[2]) == vdec.decode(payload), f"reverse/live: seq {seq}: vLLM decodes other values")
                # The documented replay client: DEALER, 8-byte big-endian start, replies until -1.
                start = sent[50][0]

                def replay_dealer() -> list[list[bytes]]:
                    return _dealer_replay(ctx, cfg.replay_endpoint, start.to_bytes(8, "big"))

                replies = await anyio.to_thread.run_sync(replay_dealer)
                want_frames = 3 if rel == "0.11" else 4
                rep.ok(all(len(fr) == want_frames for fr in replies),
                       f"reverse/replay: frame counts {sorted({len(fr) for fr in replies})}, vLLM {rel} sends {want_frames}")
                body, end = replies[:-1], replies[-1]
                want_end = [b"", b"\xff" * 8, b""] if rel == "0.11" else [b"", b"", b"\xff" * 8, b""]
                rep.ok(end == want_end, f"reverse/replay: end marker {end!r}, vLLM sends {want_end!r}")
                seqs = [int.from_bytes(fr[-2], "big", signed=True) for fr in body]
                rep.ok(seqs == [s for s, _, _ in sent[50:]], f"reverse/replay: seqs {seqs[:5]}...")
                by_seq = {s: p for s, p, _ in sent}
                rep.ok(all(fr[-1] == by_seq.get(s) for s, fr in zip(seqs, body)), "reverse/replay: payloads differ")
                if rel == "0.33":
                    rep.ok(all(fr[1] == TOPIC.encode() for fr in body), "reverse/replay: topic frame differs")
                # Past the end, and kvstream's SNAPSHOT (no provider here): vLLM answers both
                # with the end marker alone.
                for sb in ((sent[-1][0] + 5).to_bytes(8, "big"), b"SNAPSHOT"):
                    only = await anyio.to_thread.run_sync(lambda: _dealer_replay(ctx, cfg.replay_endpoint, sb))
                    rep.ok(only == [want_end], f"reverse/replay: start {sb!r}: {only!r:.120}, vLLM sends {[want_end]!r}")
                # vLLM's example client uses REQ: one request, it reads the first reply.

                def replay_req() -> list[bytes]:
                    r = ctx.socket(zmq.REQ)
                    r.linger = 0
                    r.connect(cfg.replay_endpoint)
                    try:
                        r.send(start.to_bytes(8, "big"))
                        if not r.poll(5000):
                            raise TimeoutError("no reply to REQ")
                        return r.recv_multipart()
                    finally:
                        r.close(0)

                first = await anyio.to_thread.run_sync(replay_req)
                rep.ok(first == body[0][1:], f"reverse/replay: REQ client got {first!r:.80}")
                print(f"  reverse: kvstream Publisher ({cfg.encoding} shape, {want_frames}-frame replies) -> "
                      f"vLLM-protocol SUB/DEALER/REQ clients: {n} batches, replay of {len(body)}", flush=True)
        finally:
            sub.close(0)


def kv_batch_probe() -> Any:
    from kvstream.wire.events import AllBlocksCleared, KVEventBatch

    return KVEventBatch(0.0, [AllBlocksCleared()], 0)


def worker(release: str, parts: list[str], cases: int, seed: int) -> int:
    import anyio

    kv = _load(release)
    rep = Report(release)
    print(f"vLLM {release} ({fetch.source_root(release)})", flush=True)
    if "codec" in parts:
        check_codec(kv, release, rep, cases, seed)
    if "endpoints" in parts:
        check_endpoints(kv, release, rep)
    if "framing" in parts:
        check_framing(kv, release, rep, seed)
    if "stream" in parts:
        anyio.run(check_stream, kv, release, rep, seed)
    if "reverse" in parts:
        anyio.run(check_reverse, kv, release, rep, seed)
    for k, v in rep.known.items():
        print(f"  known (documented in docs/wire-protocol.md): {k}: {v} cases")
    print(f"  => vLLM {release}: {rep.checks} checks, {len(rep.diffs)} differences", flush=True)
    print("SUMMARY " + json.dumps({"release": release, "checks": rep.checks, "diffs": len(rep.diffs),
                                   "known": rep.known}), flush=True)
    return 1 if rep.diffs else 0


def main() -> int:
    global TOPIC
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--releases", default=",".join(RELEASES))
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--cases", type=int, default=5000, help="random batches per release (codec)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topic", default=TOPIC, help="publisher topic and subscriber filter (vLLM's default is '')")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    parts = [p for p in a.only.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; parts are {', '.join(PARTS)}")
    TOPIC = a.topic
    if a.worker:
        return worker(a.worker, parts, a.cases, a.seed)
    rc = 0
    for rel in a.releases.split(","):
        if rel not in RELEASES:
            ap.error(f"unknown release {rel!r}; known: {', '.join(RELEASES)}")
        fetch.ensure(rel)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", rel, "--only", a.only,
                               "--cases", str(a.cases), "--seed", str(a.seed), "--topic", a.topic])
        rc |= proc.returncode != 0
    print("differences found" if rc else "no differences", flush=True)
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
