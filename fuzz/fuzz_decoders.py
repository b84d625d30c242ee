"""Fuzz the decoders that read remote bytes: the native KV event payload reader and the
index snapshot loader.

    .venv/bin/pip install -e ".[fuzz]"
    .venv/bin/python fuzz/fuzz_decoders.py payload -max_total_time=60
    .venv/bin/python fuzz/fuzz_decoders.py snapshot -max_total_time=60
    .venv/bin/python fuzz/fuzz_decoders.py body -max_total_time=60
    .venv/bin/python fuzz/fuzz_decoders.py payload crash-1234abcd   # re-run one input

atheris (libFuzzer for Python) mutates inputs from a seed corpus written on the first run
(the golden vLLM captures' payloads, encoder output of both vLLM shapes, small dumps)
and checks, per input:

* ``payload``: ``kvstream._native.read_payload`` (rust/src/decode.rs) never raises or
  crashes, and whenever it takes a payload, ``EventDecoder`` decodes it to the same
  events (the differential check of ``tests/routing/test_raw_ingest.py``); then
  ``KVIndex.apply_payload`` either applies it exactly as ``apply_batch(decode(payload))``
  does on an all-Python index, or raises ``EventDecodeError`` and nothing else.
* ``body``: ``kvstream._native.split_body`` (rust/src/json.rs, the query bodies) never
  raises or crashes, and whenever it takes a body that Python's json reads, the packed
  integers are exactly the body's ``token_ids`` (integers only: never 1.0, true or 1e3).
* ``snapshot``: ``KVIndex.load`` / ``EngineKeyIndex.load`` of the bytes either loads or
  raises ``SnapshotError`` (a ``RemoteProtocolError``), never another exception.

Coverage guidance comes from the Python side (atheris instruments the Python modules;
the Rust crate is not built with sanitizer coverage), so the seeds matter: they are real
payloads. A failing input is written by libFuzzer as ``crash-<sha1>`` in the current
directory: copy it to ``tests/data/fuzz/<target>/`` and the normal suite replays it
(``tests/routing/test_fuzz_regressions.py``).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

try:
    import atheris
except ImportError:  # the checks replay saved inputs without it (tests/routing/test_fuzz_regressions.py)
    atheris = None

import contextlib

with atheris.instrument_imports() if atheris is not None else contextlib.nullcontext():
    import msgspec

    from kvstream import _native
    from kvstream.hashing import BlockHasher
    from kvstream.routing.engine_index import EngineKeyIndex
    from kvstream.routing.index import KVIndex
    from kvstream.routing.snapshot import SnapshotError
    from kvstream.wire.capture import CaptureChannel, read_capture
    from kvstream.wire.events import (AllBlocksCleared, BlockRemoved, BlockStored, EventDecodeError,
                                      EventDecoder, EventEncoder, KVEventBatch)
    from kvstream.wire.framing import parse_live

ROOT = Path(__file__).resolve().parent.parent
BS = 16
_BIG = 1 << 30


def facts(ev: object) -> tuple:
    """What the native reader must have read of a decoded event (``RawBatch.describe``)."""
    if type(ev) is AllBlocksCleared:
        return (2, [], [], None, 0, True, True, True, True, False)
    hs = ev.block_hashes  # type: ignore[attr-defined]
    hashes = list(hs) if all(type(h) is int and h > 0 for h in hs) else None
    gpu = ev.medium in (None, "GPU")  # type: ignore[attr-defined]
    group0 = ev.group_idx in (None, 0)  # type: ignore[attr-defined]
    if type(ev) is BlockRemoved:
        return (1, hashes, [], None, 0, gpu, group0, True, True, False)
    assert type(ev) is BlockStored
    toks = ev.token_ids
    tokens = list(toks) if all(0 <= t < 2**32 for t in toks) else None
    p = ev.parent_block_hash
    parent = None if p is None else (p if type(p) is int and p > 0 else -1)
    x = ev.extra_keys
    plain = not x or (len(x) == len(hs) and all(e is None for e in x))
    return (0, hashes, tokens, parent, ev.block_size if ev.block_size >= 0 else None, gpu, group0,
            ev.lora_id is None and ev.lora_name is None, plain, ev.session_id is not None)


def check_payload(data: bytes) -> None:
    """The payload property (see the module docs); raises AssertionError on a finding."""
    raw = _native.read_payload(data, _BIG)
    try:
        batch = EventDecoder().decode(data)
    except EventDecodeError:
        assert raw is None, "the native reader took a payload the decoder rejects"
        idx = KVIndex()
        try:
            idx.apply_payload("a", data)
        except EventDecodeError:
            assert idx.stats.rejected_payloads == 1
            return
        raise AssertionError("apply_payload took a payload the decoder rejects")
    if raw is not None:
        assert raw.ts == batch.ts or (raw.ts != raw.ts and batch.ts != batch.ts)
        assert raw.data_parallel_rank == batch.data_parallel_rank
        assert len(raw) == len(batch.events)
        for i, ev in enumerate(batch.events):
            assert raw.describe(i) == facts(ev), (i, ev)
    from tests.routing.generic_table import BytesStoreTable  # the all-Python oracle table

    native, python = KVIndex(), KVIndex(table=BytesStoreTable())
    for _ in range(2):  # twice: the second time every block is known
        native.apply_payload("a", data)
        python.apply_batch("a", EventDecoder().decode(data))
    assert native.state() == python.state() and native.stats == python.stats
    eng = EngineKeyIndex(BlockHasher("xxhash", BS, seed="0"))
    eng.apply_payload("a", data)


def check_snapshot(data: bytes) -> None:
    """The snapshot property: load or SnapshotError, nothing else."""
    for cls in (KVIndex, EngineKeyIndex):
        try:
            cls.load(data)
        except SnapshotError:
            pass


def check_body(data: bytes) -> None:
    """The query-body property (``rust/src/json.rs``): None or (rest, packed), never an
    exception; when Python's json reads the body and the emptied array was ``token_ids``,
    the packed integers are exactly its values."""
    import json
    from array import array

    for width, code in ((4, "I"), (8, "Q")):
        got = _native.split_body(data, "token_ids", width)
        if got is None:
            continue
        rest, packed = got
        assert len(packed) % width == 0, (width, len(packed))
        try:
            doc, left = json.loads(data), json.loads(rest)
        except (ValueError, RecursionError):
            continue  # a body Python's json refuses: msgspec decides on the rest
        if isinstance(doc, dict) and isinstance(left, dict) and left.get("token_ids") == []:
            ids = array(code)
            ids.frombytes(packed)
            assert all(type(x) is int for x in doc["token_ids"]), data[:200]  # never 1.0, true, 1e3
            assert list(ids) == doc["token_ids"], (data[:200], list(ids)[:10])


TARGETS = {"payload": check_payload, "snapshot": check_snapshot, "body": check_body}


def _seed_payloads() -> list[bytes]:
    out: list[bytes] = []
    for v in ("vllm-0.11.0", "vllm-0.33.0"):
        p = ROOT / "tests" / "data" / "golden" / v / "stream.bin"
        if p.exists():
            out += [parse_live(r.frames).payload for r in read_capture(p) if r.channel == CaptureChannel.LIVE][:40]
    rnd = random.Random(0)
    for enc in (EventEncoder("map"), EventEncoder("array"), EventEncoder("array", array_fields="all")):
        for i in range(10):
            n = rnd.randrange(1, 4)
            hs = [rnd.randrange(1, 2**64) for _ in range(n)]
            evs = [BlockStored(hs, rnd.choice([None, 7]), [rnd.randrange(70_000) for _ in range(n * BS)], BS, None,
                               "GPU", None, [None] * n, 0, session_id=rnd.choice([None, "s"])),
                   BlockRemoved(hs[:1], "GPU", 0), AllBlocksCleared()]
            out.append(enc.encode(KVEventBatch(1.7e9 + i, evs[: rnd.randrange(1, 4)], 0)))
    out.append(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "zzz": [1, {"a": b"x"}], "block_hashes": [b"\x01" * 32],
                                               "parent_block_hash": None, "token_ids": [-1], "block_size": -1,
                                               "lora_id": 1, "medium": "CPU", "lora_name": "l"}], None, 5]))
    return out


def _seed_bodies() -> list[bytes]:
    return [b'{"token_ids": [1, 2, 3, 4294967295], "model": "m"}', b'{"model": "m", "token_ids": []}',
            b'{"token_ids": [0, 18446744073709551615], "extra": {"a": [1, 2]}}', b'{"token_ids": [1.0, -1, 2e3]}',
            b'{"a": "\\u0041\\"", "token_ids": [ 7 , 8 ]}', b'[1, 2, 3]', b'{"token_ids": [1, 2], "token_ids": [3]}']


def _seed_snapshots() -> list[bytes]:
    idx = KVIndex()
    for data in _seed_payloads()[:30]:
        try:
            idx.apply_payload("e0", data)
        except EventDecodeError:
            pass
    eng = EngineKeyIndex(BlockHasher("sha256_cbor", BS))
    for data in _seed_payloads()[:30]:
        try:
            eng.apply_payload("e0", data)
        except EventDecodeError:
            pass
    return [idx.dump(), eng.dump(), KVIndex().dump()]


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(TARGETS)}}} [libFuzzer options or input files]")
    target = sys.argv.pop(1)
    if atheris is None:
        sys.exit("fuzzing needs atheris: .venv/bin/pip install -e '.[fuzz]'")
    sys.path.insert(0, str(ROOT))  # the oracle table lives in the test suite
    check = TARGETS[target]
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    if args and all(os.path.isfile(a) for a in args):
        for a in args:  # re-run given inputs without fuzzing
            check(Path(a).read_bytes())
            print(f"{a}: ok")
        return
    corpus = ROOT / "fuzz" / "corpus" / target
    if not corpus.exists():
        corpus.mkdir(parents=True)
        seeds = {"payload": _seed_payloads, "snapshot": _seed_snapshots, "body": _seed_bodies}[target]()
        for i, s in enumerate(seeds):
            (corpus / f"seed-{i:03d}").write_bytes(s)

    def one(data: bytes) -> None:
        check(data)

    atheris.Setup([sys.argv[0], *sys.argv[1:], str(corpus)], one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
