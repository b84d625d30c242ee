"""Batches read by the native reader and decoded on demand (kvstream.routing.payloads).

The JetStream consumer hands the router :class:`PayloadBatch` es instead of decoded
batches; applying them (one by one, or a run in one ``apply_batches`` call as the Router
does) must end where applying the decoded batches ends on an index whose every rule runs
in Python: same state, same counters. The batch itself reads as the decoded one.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.hashing import BlockHasher
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.routing.payloads import PayloadBatch, read_payload_batch, read_payload_batches
from kvstream.routing.router import apply_item
from kvstream.transport import SourceBatch
from kvstream.wire.events import AllBlocksCleared, BlockStored, EventDecoder, EventEncoder, KVEventBatch, decode_batch
from tests.routing.generic_table import BytesStoreTable
from tests.routing.test_native import BS, _fill, _PythonEngineIndex, _steps

_ENCODERS = [EventEncoder("map"), EventEncoder("array", array_fields="all")]
_DEC = EventDecoder().decode
BIG = 1 << 30


def _runs(steps, shape):
    """The steps as (source, [payload, ...]) runs of one source, as a consumer takes them."""
    out: list[tuple[str, list[bytes]]] = []
    for t, (src, events) in enumerate(steps):
        p = _ENCODERS[shape].encode(KVEventBatch(float(t), list(events)))
        if out and out[-1][0] == src:
            out[-1][1].append(p)
        else:
            out.append((src, [p]))
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.sampled_from(["session", "detect", "count"]), st.booleans(), st.integers(0, 1),
       st.sampled_from(["each", "bulk", "item"]))
def test_payload_batches_apply_as_the_decoded_batches_do(steps, reannounce, ttl, shape, how) -> None:
    kw = {"reannounce": reannounce, "ttl_s": 3.0 if ttl else None}
    native, python = KVIndex(**kw), KVIndex(table=BytesStoreTable(), **kw)
    for x in (native, python):
        _fill(x)
    for src, ps in _runs(steps, shape):
        pbs = read_payload_batches(ps, BIG, _DEC)
        assert pbs is not None  # every payload the schema writes is read natively
        now = None if how == "each" else float(len(ps))
        if how == "bulk":
            native.apply_batches(src, pbs, now)
            python.apply_batches(src, [decode_batch(p) for p in ps], now)
        else:
            for i, (pb, p) in enumerate(zip(pbs, ps)):
                if how == "item":
                    apply_item(native, SourceBatch(src, i, b"kv", p, pb, False), now)  # type: ignore[arg-type]
                else:
                    native.apply_batch(src, pb, now)  # type: ignore[arg-type]
                python.apply_batch(src, decode_batch(p), now)
        assert native.state() == python.state()
        assert native.stats == python.stats


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.sampled_from(["session", "detect", "count"]), st.integers(0, 1))
def test_engine_keyed_payload_batches_apply_as_the_decoded_batches_do(steps, reannounce, shape) -> None:
    hasher = BlockHasher("xxhash", BS, seed="0")
    native, python = EngineKeyIndex(hasher, reannounce=reannounce), _PythonEngineIndex(hasher, reannounce=reannounce)
    for x in (native, python):
        _fill(x)
    for src, ps in _runs(steps, shape):
        pbs = read_payload_batches(ps, BIG, _DEC)
        assert pbs is not None
        native.apply_batches(src, pbs, 1.0)
        python.apply_batches(src, [decode_batch(p) for p in ps], 1.0)
        assert native.state() == python.state()
        assert native.stats == python.stats


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps, st.integers(0, 1))
def test_a_bounded_index_and_a_generic_table_take_payload_batches_too(steps, shape) -> None:
    """With a byte bound (checked after each batch) and over a table of the generic
    path (the events decoded on demand) the result is the decoded batches' too."""
    bounded, ref = KVIndex(max_bytes=40_000), KVIndex(max_bytes=40_000)
    generic, python = KVIndex(table=BytesStoreTable()), KVIndex(table=BytesStoreTable())
    for src, ps in _runs(steps, shape):
        bounded.apply_batches(src, read_payload_batches(ps, BIG, _DEC), 2.0)  # type: ignore[arg-type]
        ref.apply_batches(src, [decode_batch(p) for p in ps], 2.0)
        generic.apply_batches(src, read_payload_batches(ps, BIG, _DEC), 2.0)  # type: ignore[arg-type]
        python.apply_batches(src, [decode_batch(p) for p in ps], 2.0)
    assert bounded.state() == ref.state() and bounded.stats == ref.stats
    assert generic.state() == python.state() and generic.stats == python.stats


def test_a_payload_batch_reads_as_the_decoded_batch() -> None:
    b = KVEventBatch(12.5, [BlockStored([1, 2], None, list(range(2 * BS)), BS, None, "GPU", None),
                            AllBlocksCleared()], 3)
    p = EventEncoder("map").encode(b)
    pb = read_payload_batch(p, BIG, _DEC)
    assert type(pb) is PayloadBatch
    assert (pb.ts, pb.data_parallel_rank, len(pb)) == (12.5, 3, 2)
    assert pb == b and pb.events == b.events and pb.decoded() is pb.decoded()
    assert pb == read_payload_batch(p, BIG, _DEC)
    assert "2 events" not in repr(pb) and "events=2" in repr(pb)


def test_a_payload_the_native_reader_passes_on_is_left_to_the_decoder() -> None:
    good = EventEncoder("map").encode(KVEventBatch(1.0, [AllBlocksCleared()]))
    assert read_payload_batch(b"\xc1garbage", BIG, _DEC) is None
    assert read_payload_batch(good, len(good) - 1, _DEC) is None  # over the size limit
    assert read_payload_batches([good, b"\xc1"], BIG, _DEC) is None  # one is enough: none is read
    assert read_payload_batches([good, good], BIG, _DEC) is not None
