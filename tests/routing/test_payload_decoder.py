"""PayloadDecoder: the service's subscriber decoder that reads vLLM payloads natively.

What it accepts is exactly its fallback decoder's; a batch it reads is applied by the
index as the decoded batch would be, and counting its events (as the subscriber does for
every batch) decodes nothing."""

from __future__ import annotations

import pytest

from kvstream.routing.payloads import PayloadBatch, PayloadDecoder
from kvstream.wire.events import EventDecodeError, EventDecoder, EventEncoder, KVEventBatch
from tests.routing.test_shared_prefix_ingest import _both, _doc, _stored, _toks


def test_the_payload_decoder_reads_natively_and_the_index_applies_the_same() -> None:
    enc = EventEncoder()
    dec = PayloadDecoder(EventDecoder())
    native, python = _both()
    prefix = _toks(5, 4)
    for t, (src, d) in enumerate([("a", 0), ("b", 0), ("a", 1), ("b", 2)]):
        payload = enc.encode(KVEventBatch(float(t), [_stored(_doc(prefix, d, 70))]))
        batch = dec.decode(payload)
        assert type(batch) is PayloadBatch and len(batch.events) == 1
        assert batch._batch is None  # counting the events decoded nothing
        native.apply_batch(src, batch, float(t))
        python.apply_batch(src, EventDecoder().decode(payload), float(t))
        assert native.state() == python.state() and native.stats == python.stats
    assert dec.native_batches == 4
    assert list(batch.events) == list(EventDecoder().decode(payload).events)
    assert batch.events == EventDecoder().decode(payload).events


@pytest.mark.parametrize("payload", [b"", b"\x93\x01", b"not msgpack at all", b"\x93\xcb" + b"\x00" * 8 + b"\x91\x01\xc0"])
def test_the_payload_decoder_gives_bad_bytes_the_fallbacks_verdict(payload: bytes) -> None:
    dec = PayloadDecoder(EventDecoder())
    with pytest.raises(EventDecodeError):
        EventDecoder().decode(payload)
    with pytest.raises(EventDecodeError):
        dec.decode(payload)
    assert dec.native_batches == 0


def test_the_payload_decoder_refuses_what_is_over_the_fallbacks_size_limit() -> None:
    payload = EventEncoder().encode(KVEventBatch(0.0, [_stored(_toks(6, 200))]))
    dec = PayloadDecoder(EventDecoder(max_payload_bytes=len(payload) - 1))
    with pytest.raises(EventDecodeError):
        dec.decode(payload)
    assert type(PayloadDecoder(EventDecoder()).decode(payload)) is PayloadBatch
