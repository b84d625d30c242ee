"""Raw-payload ingest against its oracles.

The native reader (``kvstream._native.read_payload``, rust/src/decode.rs) is checked
against :class:`kvstream.wire.events.EventDecoder` (the specification of the wire): on
random msgpack close to the schema (both event shapes, every field, wrong types, unknown
keys, extra and missing array slots, ext values), on byte-level mutations of real
payloads and on the golden vLLM captures, whenever the reader takes a payload the decoder
decodes it to the same events, and every payload the schema writes is taken. Then
:meth:`KVIndex.apply_payload` is checked against ``apply_batch(decoder.decode(payload))``
on an index whose every rule runs in Python: same state, same counters, the same
``EventDecodeError`` for malformed payloads (counted, nothing applied).
"""

from __future__ import annotations

import math
import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream import _native
from kvstream.hashing import BlockHasher
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventDecoder,
    EventEncoder,
    KVEventBatch,
    decode_batch,
)
from tests.routing.generic_table import BytesStoreTable
from tests.routing.test_native import BS, SHARED_KEY_CLEARS, _fill, _PythonEngineIndex, _steps
from tests.wire.test_events import VERSIONS, _live_payloads, _replay_payloads

BIG = 1 << 30


def _facts(ev: object) -> tuple:
    """What the native reader must have read of a decoded event (see RawBatch.describe)."""
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


def _same_ts(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _check_reader(payload: bytes, must_take: bool = False) -> msgspec.Struct | None:
    """The reader's verdict on ``payload`` agrees with the decoder's; returns the decoded
    batch (None when the decoder rejects it)."""
    raw = _native.read_payload(payload, BIG)
    try:
        batch = EventDecoder().decode(payload)
    except EventDecodeError:
        assert raw is None, f"the reader took a payload the decoder rejects: {payload.hex()}"
        return None
    if must_take:
        assert raw is not None, f"the reader passed on a plain payload: {payload.hex()}"
    if raw is not None:
        assert _same_ts(raw.ts, batch.ts)
        assert raw.data_parallel_rank == batch.data_parallel_rank
        assert len(raw) == len(batch.events)
        for i, ev in enumerate(batch.events):
            assert raw.describe(i) == _facts(ev), (i, ev)
    return batch


# -- random msgpack close to the schema ------------------------------------------------

_int = st.one_of(st.integers(0, 300), st.integers(-2**63, 2**64 - 1), st.sampled_from([0, 1, 2**32, 2**64 - 1, -1]))
_hash = st.one_of(st.integers(0, 50), st.integers(2**63, 2**64 - 1), st.binary(min_size=0, max_size=33))
_opt_str = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "adapter", "s1", ""]))
_anyv = st.recursive(
    st.one_of(st.none(), st.booleans(), _int, st.floats(allow_nan=False), st.text(max_size=4), st.binary(max_size=4)),
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=3), c, max_size=3)),
    max_leaves=6,
)
_wrong = st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=3), st.binary(max_size=3),
                   st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(-9, 9), max_size=2),
                   st.builds(msgspec.msgpack.Ext, st.integers(0, 5), st.binary(max_size=3)))

_GOOD = {
    "block_hashes": st.lists(_hash, max_size=5),
    "parent_block_hash": st.one_of(st.none(), _hash),
    "token_ids": st.lists(st.one_of(st.integers(0, 70_000), _int), max_size=40),
    "block_size": st.one_of(st.sampled_from([0, 1, 2, 16]), _int),
    "lora_id": st.one_of(st.none(), _int),
    "medium": _opt_str,
    "lora_name": _opt_str,
    "extra_keys": st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(_anyv, max_size=2)), max_size=5)),
    "group_idx": st.one_of(st.none(), st.sampled_from([0, 1]), _int),
    "kv_cache_spec_kind": _opt_str,
    "kv_cache_spec_sliding_window": st.one_of(st.none(), _int),
    "locality": _anyv,
    "ownership": _anyv,
    "session_id": _opt_str,
    "lookahead_token_ids": st.one_of(st.none(), st.lists(st.lists(_int, max_size=3), max_size=3)),
}
_STORED = list(BlockStored.__struct_fields__)
_REMOVED = list(BlockRemoved.__struct_fields__)


@st.composite
def _raw_event(draw):
    """An event as plain msgpack-able objects; returns (obj, plain): ``plain`` when every
    value is of its field's type and the event is of a known shape."""
    tag = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]))
    fields = _STORED if tag == "BlockStored" else _REMOVED if tag == "BlockRemoved" else []
    plain = tag != "Other"
    values = {}
    for f in fields:
        if draw(st.integers(0, 30)) == 0:
            values[f] = draw(_wrong)
            plain = False
        else:
            values[f] = draw(_GOOD[f])
    if any(msgspec.msgpack.Ext in map(type, _leaves(v)) for v in values.values()):
        plain = False  # ext values are the decoder's to judge
    if draw(st.booleans()):  # map shape
        n_req = {"BlockStored": 7, "BlockRemoved": 2}.get(tag, 0)
        keep = [f for i, f in enumerate(fields) if i < n_req or draw(st.booleans())]
        if len(keep) < n_req or draw(st.integers(0, 20)) == 0:
            keep = keep[: draw(st.integers(0, len(keep)))]
            plain = plain and len(keep) >= n_req
        items = [(f, values[f]) for f in keep]
        if draw(st.booleans()):
            items.append((draw(st.sampled_from(["zzz", "type_", "extra"])), draw(_anyv)))
        items.insert(draw(st.integers(0, len(items))), ("type", tag))
        if draw(st.integers(0, 10)) == 0:
            draw(st.randoms()).shuffle(items)
        return dict(items), plain
    n = draw(st.integers(0, len(fields) + 2))
    slots = [values[f] for f in fields[:n]] + [draw(_anyv) for _ in range(max(0, n - len(fields)))]
    if fields and n == 0:
        plain = False  # block_hashes has no default
    return [tag, *slots], plain


def _leaves(v):
    if isinstance(v, (list, tuple)):
        for x in v:
            yield from _leaves(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _leaves(x)
    else:
        yield v


@st.composite
def _raw_batch(draw):
    evs = draw(st.lists(_raw_event(), max_size=6))
    plain = all(p for _, p in evs)
    ts = draw(st.one_of(st.floats(), st.integers(-5, 2**64 - 1), st.just(1.7e9)))
    out: list = [ts, [e for e, _ in evs]]
    k = draw(st.integers(0, 3))
    if k >= 1:
        out.append(draw(st.one_of(st.none(), st.integers(0, 8), st.integers(-2**63, 2**63 - 1))))
    if k >= 2:
        out.append(draw(_anyv))
    if draw(st.integers(0, 25)) == 0:
        out[0] = draw(_wrong)
        plain = False
    return out, plain


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_raw_batch())
def test_the_reader_takes_what_the_decoder_decodes_and_reads_the_same(b) -> None:
    obj, plain = b
    _check_reader(msgspec.msgpack.encode(obj), must_take=plain)


_WIDTHS = {"fixint": (0, 127), "uint8": (128, 255), "uint16": (256, 65_535), "uint32": (65_536, 2**32 - 1)}
_ODD_TOKEN = st.one_of(st.integers(2**32, 2**64 - 1), st.integers(-2**63, -1))  # through rmp: not a u32


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(widths=st.lists(st.sampled_from(sorted(_WIDTHS)), min_size=1, max_size=4, unique=True),
       run=st.integers(1, 40), n=st.integers(0, 700), odd=st.integers(0, 3), data=st.data())
def test_long_token_lists_of_every_width_mix_are_read_as_the_decoder_reads_them(widths, run, n, odd, data) -> None:
    """The token reader has two loops, chosen by how often the first 32 ids change width
    (a branch on the marker while widths repeat; tables with no such branch when they
    mix): lists long enough for either, of one width or a mix, in runs of one width or
    changing at every id, with ids that go through rmp (over u32, negative) anywhere."""
    rnd = data.draw(st.randoms(use_true_random=False))
    ids: list[int] = []
    while len(ids) < n:
        lo, hi = _WIDTHS[rnd.choice(widths)]
        ids += [rnd.choice((lo, hi, rnd.randint(lo, hi))) for _ in range(run)]
    ids = ids[:n]
    for _ in range(odd if ids else 0):
        ids[rnd.randrange(len(ids))] = data.draw(_ODD_TOKEN)
    blocks = max(1, len(ids) // 16)
    ev = ["BlockStored", list(range(1, blocks + 1)), None, ids, 16, None, "GPU", None]
    batch = _check_reader(msgspec.msgpack.encode([1.7e9, [ev], 0]), must_take=True)
    assert batch is not None and list(batch.events[0].token_ids) == ids


def test_extra_keys_are_counted_against_the_listed_hashes_even_when_no_hash_is_a_key() -> None:
    # Found by the property test above: hashes that are not keys (0 here) keep no column, and
    # the reader compared one nil extra key per block against that empty column.
    ev = {"type": "BlockStored", "block_hashes": [0] * 5, "parent_block_hash": None, "token_ids": [],
          "block_size": 0, "lora_id": None, "medium": None, "lora_name": None, "extra_keys": [None] * 5}
    _check_reader(msgspec.msgpack.encode([0.0, [ev]]))
    _check_reader(msgspec.msgpack.encode([0.0, [{**ev, "extra_keys": [None] * 4}]]))


def _vllm_like(rnd: random.Random, i: int) -> KVEventBatch:
    evs: list = []
    for j in range(rnd.randrange(1, 6)):
        n = rnd.randrange(0, 4)
        hs = [rnd.randrange(1, 2**64) for _ in range(n)]
        k = rnd.random()
        if k < 0.5:
            evs.append(BlockStored(hs, rnd.choice([None, rnd.randrange(1, 2**64)]),
                                   [rnd.randrange(50_000) for _ in range(n * BS)], BS, None, "GPU", None,
                                   rnd.choice([None, [None] * n]), rnd.choice([None, 0]),
                                   session_id=rnd.choice([None, "s"])))
        elif k < 0.9:
            evs.append(BlockRemoved(hs, rnd.choice(["GPU", None, "CPU"]), rnd.choice([None, 0, 1])))
        else:
            evs.append(AllBlocksCleared())
    return KVEventBatch(1.7e9 + i, evs, rnd.choice([None, 0, 3]))


@pytest.mark.parametrize("fmt", ["map", "array-0.11", "array-all"])
def test_every_shape_the_encoder_writes_is_read_natively(fmt) -> None:
    enc = EventEncoder("map") if fmt == "map" else EventEncoder("array", array_fields=fmt[6:].replace("0.11", "v0.11"))
    rnd = random.Random(fmt)
    for i in range(300):
        _check_reader(enc.encode(_vllm_like(rnd, i)), must_take=True)


def _mutations(p: bytes, rnd: random.Random, k: int):
    yield from (p[:n] for n in range(len(p)) if n % max(1, len(p) // 40) == 0)
    for _ in range(k):
        b = bytearray(p)
        for _ in range(rnd.randrange(1, 4)):
            op = rnd.random()
            j = rnd.randrange(len(b)) if b else 0
            if op < 0.5 and b:
                b[j] = rnd.randrange(256)
            elif op < 0.75:
                b.insert(j, rnd.choice([0xc0, 0xc1, 0xd9, 0xdc, 0xdd, 0xde, 0xdf, 0xcf, 0xd3, 0xc7, 0xff, 0x00]))
            elif b:
                del b[j]
        yield bytes(b)


def test_mutated_payloads_get_the_decoders_verdict() -> None:
    rnd = random.Random(7)
    enc = [EventEncoder("map"), EventEncoder("array", array_fields="all")]
    for i in range(60):
        p = enc[i % 2].encode(_vllm_like(rnd, i))
        for m in _mutations(p, rnd, 60):
            _check_reader(m)


# -- the golden captures ------------------------------------------------------------------

@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_every_golden_payload_is_read_natively_and_applied_as_decoded(golden_dir, version) -> None:
    payloads = _live_payloads(golden_dir, version) + _replay_payloads(golden_dir, version)
    assert payloads
    native, python = KVIndex(), KVIndex(table=BytesStoreTable())
    hasher = BlockHasher("sha256_cbor", BS)
    eng, eng_py = EngineKeyIndex(hasher), _PythonEngineIndex(hasher)
    for p in payloads:
        _check_reader(p, must_take=True)
        native.apply_payload("e0", p)
        eng.apply_payload("e0", p)
        b = decode_batch(p)
        python.apply_batch("e0", b)
        eng_py.apply_batch("e0", b)
    assert native.state() == python.state() and native.stats == python.stats
    assert eng.state() == eng_py.state() and eng.stats == eng_py.stats
    assert native.stats.stored_blocks > 0


# -- apply_payload against apply_batch(decode(payload)) -------------------------------------

_ENCODERS = [EventEncoder("map"), EventEncoder("array", array_fields="all")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.sampled_from(["session", "detect", "count"]), st.booleans(), st.integers(0, 1))
def test_apply_payload_equals_the_python_rules_on_the_decoded_batch(steps, reannounce, ttl, shape) -> None:
    kw = {"reannounce": reannounce, "ttl_s": 3.0 if ttl else None}
    native, python = KVIndex(**kw), KVIndex(table=BytesStoreTable(), **kw)
    for x in (native, python):
        _fill(x)
    for t, (src, events) in enumerate(steps):
        p = _ENCODERS[shape].encode(KVEventBatch(float(t), list(events)))
        native.apply_payload(src, p)
        python.apply_batch(src, decode_batch(p))
        assert native.state() == python.state()
        assert native.stats == python.stats


@pytest.mark.parametrize("name", sorted(SHARED_KEY_CLEARS))
@pytest.mark.parametrize("shape", [0, 1])
def test_apply_payload_of_a_clear_under_a_shared_key_equals_the_python_rules(name, shape) -> None:
    # The minimal sequences of the failures above (test_native.SHARED_KEY_CLEARS), as payloads.
    native, python = KVIndex(reannounce="session"), KVIndex(table=BytesStoreTable(), reannounce="session")
    for x in (native, python):
        _fill(x)
    for t, (src, events) in enumerate(SHARED_KEY_CLEARS[name]):
        p = _ENCODERS[shape].encode(KVEventBatch(float(t), list(events)))
        native.apply_payload(src, p)
        python.apply_batch(src, decode_batch(p))
        assert native.state() == python.state()
        assert native.stats == python.stats


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.sampled_from(["session", "detect", "count"]), st.integers(0, 1))
def test_engine_keyed_apply_payload_equals_the_python_rules(steps, reannounce, shape) -> None:
    hasher = BlockHasher("xxhash", BS, seed="0")
    native, python = EngineKeyIndex(hasher, reannounce=reannounce), _PythonEngineIndex(hasher, reannounce=reannounce)
    for x in (native, python):
        _fill(x)
    for t, (src, events) in enumerate(steps):
        p = _ENCODERS[shape].encode(KVEventBatch(float(t), list(events)))
        native.apply_payload(src, p)
        python.apply_batch(src, decode_batch(p))
        assert native.state() == python.state()
        assert native.stats == python.stats


def test_a_malformed_payload_raises_the_decoders_error_is_counted_and_changes_nothing() -> None:
    idx, ref = KVIndex(), KVIndex()
    good = EventEncoder("map").encode(_vllm_like(random.Random(1), 0))
    for x in (idx, ref):
        x.apply_batch("a", decode_batch(good))
    before = idx.dump()
    bad = [b"", b"\xc1", good[:-1], good + b"\x00", msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
           msgspec.msgpack.encode([1.0, [["BlockStored", [-1]]]])]
    for n, p in enumerate(bad, 1):
        with pytest.raises(EventDecodeError) as exc:
            idx.apply_payload("a", p)
        with pytest.raises(EventDecodeError) as want:
            EventDecoder().decode(p)
        assert str(exc.value) == str(want.value)
        assert idx.stats.rejected_payloads == n
    assert idx.dump() == before
    # A decoder's own rules apply: unknown event types skipped, a size limit.
    skip = EventDecoder(unknown_events="skip")
    p = msgspec.msgpack.encode([1.0, [{"type": "Nope"}, ["AllBlocksCleared"]]])
    idx.apply_payload("a", p, decoder=skip)
    assert skip.skipped_events == 1 and idx.stats.clears == 1
    with pytest.raises(EventDecodeError, match="over the limit"):
        idx.apply_payload("a", good, decoder=EventDecoder(max_payload_bytes=len(good) - 1))


def test_apply_payload_returns_the_batch_and_takes_bytearray_and_memoryview() -> None:
    b = _vllm_like(random.Random(3), 0)
    p = EventEncoder("map").encode(b)
    for form in (p, bytearray(p), memoryview(p)):
        got = KVIndex().apply_payload("a", form)
        assert got.ts == b.ts and got.data_parallel_rank == b.data_parallel_rank and len(got) == len(b.events)
    # Any other table takes the generic path: the decoder's batch.
    got = KVIndex(table=BytesStoreTable()).apply_payload("a", p)
    assert got == b


def test_a_large_payload_is_read_with_the_gil_released_and_applied() -> None:
    rnd = random.Random(5)
    evs = [BlockStored(list(range(1 + 64 * i, 65 + 64 * i)), None, [rnd.randrange(50_000) for _ in range(64 * BS)],
                       BS, None, "GPU", None) for i in range(40)]
    p = EventEncoder("map").encode(KVEventBatch(0.0, evs, 0))
    raw = _native.read_payload(p, BIG)
    assert raw is not None and raw.blocks == 40 * 64
    idx = KVIndex()
    idx.apply_payload("a", p)
    assert idx.stats.stored_blocks == 40 * 64


# -- the byte bound at 10**7 entries --------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow
def test_the_byte_bound_holds_on_allocated_bytes_through_ten_million_entries() -> None:
    """10**7 (block, source) entries arrive as raw payloads (4 sources, chains of 512
    blocks) into an index bounded at 64 MiB: after every batch the bytes the native tables
    really allocate (counted in Rust) and the index's estimate stay under the bound, and
    the process's RSS grows by no more than the bound and its slack."""
    bound = 64 << 20
    idx = KVIndex(max_bytes=bound)
    toks = list(range(512 * BS))  # the same tokens every run: keys differ by their parent
    enc = EventEncoder("map")
    parents: dict[str, int | None] = {f"e{s}": None for s in range(4)}
    h = 1
    made = 0
    gc_rss = _rss()
    peak_rss = 0
    i = 0
    while made < 10**7:
        src = f"e{i % 4}"
        hashes = list(range(h, h + 512))
        h += 512
        p = enc.encode(KVEventBatch(float(i), [BlockStored(hashes, parents[src], toks, BS, None, "GPU", None)], 0))
        idx.apply_payload(src, p)
        parents[src] = hashes[-1]
        made += 512
        i += 1
        assert idx.native_bytes() <= bound and idx.estimated_bytes() <= bound, (made, idx.native_bytes())
        if i % 64 == 0:
            peak_rss = max(peak_rss, _rss() - gc_rss)
    assert idx.stats.stored_blocks == made and idx.stats.evicted_blocks > made // 2
    assert idx.stats.unlinked_blocks == 0  # every run linked to its parent: the native path
    assert peak_rss <= bound + (64 << 20), peak_rss


# -- the subscriber items' payloads (router.apply_item, apply_batches) -----------------------

@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.booleans(), st.integers(0, 1), st.booleans())
def test_a_batch_applied_with_its_payload_equals_the_batch_alone(steps, ttl, shape, bulk) -> None:
    """What the Router does with a SourceBatch (its payload read natively, the decoded
    events kept for the Python rules) ends where applying the decoded batch alone ends."""
    from unittest import mock

    from kvstream.routing import index as index_module
    from kvstream.routing.router import apply_item
    from kvstream.transport import SourceBatch

    with mock.patch.object(index_module, "_RAW_MIN_BYTES", 0):  # every payload read natively
        _apply_with_and_without_payloads(steps, ttl, shape, bulk, apply_item, SourceBatch)


def _apply_with_and_without_payloads(steps, ttl, shape, bulk, apply_item, SourceBatch) -> None:
    kw = {"ttl_s": 3.0 if ttl else None}
    with_payload, python = KVIndex(**kw), KVIndex(table=BytesStoreTable(), **kw)
    for x in (with_payload, python):
        _fill(x)
    for t, (src, events) in enumerate(steps):
        p = _ENCODERS[shape].encode(KVEventBatch(float(t), list(events)))
        b = decode_batch(p)
        if bulk:
            with_payload.apply_batches(src, [b, b], float(t), payloads=[p, p])
            python.apply_batches(src, [b, b], float(t))
        else:
            apply_item(with_payload, SourceBatch(src, t, b"kv", p, b, False))
            python.apply_batch(src, b)
        assert with_payload.state() == python.state()
        assert with_payload.stats == python.stats


def test_small_payloads_given_with_their_batch_are_applied_from_the_batch() -> None:
    """Under 1 KiB the decoded events are applied (faster for a few events): a payload
    that is not the batch's bytes shows which path ran."""
    b = _vllm_like(random.Random(9), 0)
    other = EventEncoder("map").encode(KVEventBatch(0.0, [AllBlocksCleared()] * len(b.events)))
    a, ref = KVIndex(), KVIndex()
    a.apply_batch("a", b, payload=other)
    ref.apply_batch("a", b)
    assert a.state() == ref.state() and a.stats == ref.stats
