"""The event codec against vLLM's own bytes, and its behaviour on hostile input."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.wire.capture import CaptureChannel, read_capture
from kvstream.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventDecoder,
    EventEncoder,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvstream.wire.framing import parse_live

VERSIONS = {"vllm-0.11.0": "array", "vllm-0.33.0": "map"}


def _live_payloads(golden_dir: Path, version: str, name: str = "stream.bin") -> list[bytes]:
    recs = read_capture(golden_dir / version / name)
    return [parse_live(r.frames).payload for r in recs if r.channel == CaptureChannel.LIVE]


def _replay_payloads(golden_dir: Path, version: str) -> list[bytes]:
    recs = read_capture(golden_dir / version / "stream.bin")
    out = []
    for r in recs:
        if r.channel == CaptureChannel.REPLAY_REPLY and r.frames[-1]:
            out.append(r.frames[-1])
    return out


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_every_live_payload_reencodes_byte_identically(golden_dir, version):
    payloads = _live_payloads(golden_dir, version)
    assert payloads, "capture has no live records"
    enc = EventEncoder(VERSIONS[version])
    for p in payloads:
        assert enc.encode(decode_batch(p)) == p


def test_dp1_capture_reencodes_byte_identically(golden_dir):
    payloads = _live_payloads(golden_dir, "vllm-0.33.0", "dp1.bin")
    assert len(payloads) == 1
    batch = decode_batch(payloads[0])
    assert batch.data_parallel_rank == 1
    assert encode_batch(batch) == payloads[0]


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_replayed_payloads_reencode_byte_identically(golden_dir, version):
    enc = EventEncoder(VERSIONS[version])
    payloads = _replay_payloads(golden_dir, version)
    assert payloads
    for p in payloads:
        assert enc.encode(decode_batch(p)) == p


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_decoded_events_match_the_recorded_json(golden_dir, version):
    doc = json.loads((golden_dir / version / "stream.json").read_text())
    payloads = _live_payloads(golden_dir, version)
    assert len(payloads) == len(doc["batches"])
    for p, rec in zip(payloads, doc["batches"]):
        batch = decode_batch(p)
        assert batch.ts == rec["ts"]
        assert batch.data_parallel_rank == rec["data_parallel_rank"]
        assert len(batch.events) == len(rec["events"])
        for ev, want in zip(batch.events, rec["events"]):
            assert type(ev).__name__ == want["type"]
            for field in ev.__struct_fields__:
                got = getattr(ev, field)
                if field == "extra_keys" and got is not None:
                    got = [None if k is None else json.loads(json.dumps(list(k))) for k in got]
                if field in want:
                    assert got == want[field], (rec["seq"], field)


def test_map_events_carry_exactly_the_recorded_wire_keys_in_order(golden_dir):
    # vLLM 0.33.0 stream.json events[].wire_keys: required keys always (nil when None),
    # optional ones only when set, in declaration order, "type" first.
    doc = json.loads((golden_dir / "vllm-0.33.0" / "stream.json").read_text())
    for p, rec in zip(_live_payloads(golden_dir, "vllm-0.33.0"), doc["batches"]):
        raw = msgspec.msgpack.decode(encode_batch(decode_batch(p)))
        assert [list(ev) for ev in raw[1]] == [want["wire_keys"] for want in rec["events"]], rec["seq"]


def test_v011_payloads_convert_to_map_form_and_back_losslessly(golden_dir):
    for p in _live_payloads(golden_dir, "vllm-0.11.0"):
        batch = decode_batch(p)
        as_map = encode_batch(batch, "map")
        assert decode_batch(as_map) == batch
        assert EventEncoder("array").encode(decode_batch(as_map)) == p


def test_map_payload_in_array_form_keeps_only_the_v011_fields_by_default(golden_dir):
    p = _live_payloads(golden_dir, "vllm-0.33.0")[0]
    batch = decode_batch(p)
    legacy = msgspec.msgpack.decode(EventEncoder("array").encode(batch))
    assert legacy[1][0][0] == "BlockStored" and len(legacy[1][0]) == 7
    full = msgspec.msgpack.decode(EventEncoder("array", array_fields="all").encode(batch))
    # all fields up to the last set one (kv_cache_spec_kind, the 10th)
    assert len(full[1][0]) == 1 + 10
    assert decode_batch(EventEncoder("array", array_fields="all").encode(batch)) == batch
    three = msgspec.msgpack.decode(EventEncoder("array", array_fields=3).encode(batch))
    assert len(three[1][0]) == 4


def _stored(**kw):
    base = dict(block_hashes=[1], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                lora_id=None, medium="GPU", lora_name=None)
    base.update(kw)
    return BlockStored(**base)


def test_one_batch_may_mix_map_and_array_events():
    ev_map = msgspec.msgpack.encode({"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"})
    payload = msgspec.msgpack.encode([1.5, [msgspec.Raw(ev_map), ["BlockStored", [7], 5, [1, 2], 2, None, "GPU"],
                                            ["AllBlocksCleared"]], 3])
    batch = decode_batch(payload)
    assert batch == KVEventBatch(1.5, [BlockRemoved([5], "GPU"), _stored(block_hashes=[7], parent_block_hash=5,
                                       token_ids=[1, 2], block_size=2), AllBlocksCleared()], 3)


def test_unknown_map_keys_and_extra_array_slots_are_ignored():
    payload = msgspec.msgpack.encode([2.0, [{"type": "BlockRemoved", "block_hashes": [9], "medium": "CPU",
                                             "from_the_future": {"x": 1}}]])
    assert decode_batch(payload).events == [BlockRemoved([9], "CPU")]
    payload = msgspec.msgpack.encode([2.0, [["BlockRemoved", [9], "GPU", 0, None, None, "extra", 42]]])
    assert decode_batch(payload).events == [BlockRemoved([9], "GPU", group_idx=0)]


def test_missing_trailing_array_slots_become_none():
    payload = msgspec.msgpack.encode([2.0, [["BlockStored", [9], None, [1] * 4, 4, None]]])
    ev = decode_batch(payload).events[0]
    assert ev.medium is None and ev.lora_name is None and ev.extra_keys is None
    payload = msgspec.msgpack.encode([2.0, [["BlockRemoved", [3]]]])
    assert decode_batch(payload).events == [BlockRemoved([3], None)]


def test_batch_without_rank_decodes_with_rank_none_and_reencodes_without_it():
    payload = msgspec.msgpack.encode([2.0, [["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert EventEncoder("array").encode(batch) == payload


@pytest.mark.parametrize("h", [0, 1, 2**32, 2**63, 2**64 - 1, b"\x01" * 32, b""])
def test_hashes_may_be_any_uint64_or_bytes(h):
    for fmt in ("map", "array"):
        batch = KVEventBatch(1.0, [BlockRemoved([h], "GPU")], 0)
        assert decode_batch(encode_batch(batch, fmt)) == batch


def _bad(payload: bytes, match: str) -> None:
    with pytest.raises(EventDecodeError, match=match):
        EventDecoder().decode(payload)


def test_not_msgpack_is_rejected_with_a_clear_error():
    _bad(b"\xc1\xc1", "not valid msgpack")
    _bad(b"", "not valid msgpack")


def test_wrong_batch_shape_is_rejected():
    _bad(msgspec.msgpack.encode({"ts": 1.0}), r"batch is not \[ts")
    _bad(msgspec.msgpack.encode([1.0, "events"]), r"batch is not \[ts")


def test_unknown_event_type_is_rejected_with_its_index():
    payload = msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], "GPU"], {"type": "BlockMoved", "x": 1}]])
    _bad(payload, "event 1")


def test_unknown_event_type_can_be_skipped_and_counted():
    payload = msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], "GPU"], {"type": "BlockMoved", "x": 1}]])
    dec = EventDecoder(unknown_events="skip")
    assert dec.decode(payload).events == [BlockRemoved([1], "GPU")]
    assert dec.skipped_events == 1


@pytest.mark.parametrize("bad_hash", ["abc", 1.5, -1, [1], None, {"a": 1}])
def test_hash_of_wrong_type_is_rejected(bad_hash):
    for ev in (["BlockRemoved", [bad_hash], "GPU"], {"type": "BlockRemoved", "block_hashes": [bad_hash],
                                                      "medium": "GPU"}):
        _bad(msgspec.msgpack.encode([1.0, [ev]]), "block_hashes")


def test_negative_parent_hash_is_rejected():
    _bad(msgspec.msgpack.encode([1.0, [["BlockStored", [1], -5, [], 0, None, "GPU"]]]), "parent_block_hash")


def test_oversized_payload_is_rejected_before_decoding():
    dec = EventDecoder(max_payload_bytes=100)
    payload = encode_batch(KVEventBatch(1.0, [_stored(token_ids=list(range(64)))], 0))
    with pytest.raises(EventDecodeError, match="over the limit of 100 bytes") as ei:
        dec.decode(payload)
    assert ei.value.payload_len == len(payload)


def _golden_payloads() -> list[bytes]:
    from tests.conftest import GOLDEN

    out: list[bytes] = []
    for v in VERSIONS:
        p = GOLDEN / v / "stream.bin"
        if p.exists():
            out += [parse_live(r.frames).payload for r in read_capture(p) if r.channel == 0]
    return out or [encode_batch(KVEventBatch(1.0, [_stored(), BlockRemoved([2], "GPU")], 0))]


_SEEDS = _golden_payloads()


def _decode_only_raises_our_error(payload: bytes) -> None:
    try:
        batch = EventDecoder().decode(payload)
    except EventDecodeError:
        return
    assert isinstance(batch, KVEventBatch)
    for ev in batch.events:
        assert isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_fuzz_random_bytes_raise_only_event_decode_error(data):
    _decode_only_raises_our_error(data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_SEEDS), st.data())
def test_fuzz_mutated_vllm_payloads_raise_only_event_decode_error(seed, data):
    buf = bytearray(seed)
    for _ in range(data.draw(st.integers(1, 8))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if not buf:
            break
        i = data.draw(st.integers(0, len(buf) - 1))
        if kind == "flip":
            buf[i] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del buf[i:i + data.draw(st.integers(1, 16))]
        else:
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    _decode_only_raises_our_error(bytes(buf))


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.binary(max_size=12)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.sampled_from(["type", "block_hashes", "medium", "token_ids", "parent_block_hash", "block_size",
                         "lora_id", "lora_name", "extra_keys", "group_idx"]) | st.text(max_size=5),
        inner, max_size=6),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(allow_nan=False) | st.integers() | st.text(max_size=3), st.lists(_msgpack_values, max_size=5),
       st.none() | st.integers(-5, 5) | st.text(max_size=2))
def test_fuzz_structured_garbage_raises_only_event_decode_error(ts, events, rank):
    try:
        payload = msgspec.msgpack.encode([ts, events, rank])
    except OverflowError:
        return
    _decode_only_raises_our_error(payload)


@pytest.mark.parametrize("cls", [BlockStored, BlockRemoved, AllBlocksCleared])
def test_array_shape_follows_the_struct(cls) -> None:
    """The 0.11 array shape is derived from the struct: a full-length array of every field
    decodes to the same event as the map shape, and a one-slot array decodes too."""
    fields = msgspec.structs.fields(cls)
    values = {f.name: ([7, 8] if f.name == "block_hashes" else [1, 2] if f.name == "token_ids"
                       else [[1], [2]] if f.name == "lookahead_token_ids"
                       else 16 if f.name == "block_size" else None) for f in fields}
    ev = cls(**values)
    tag = cls.__struct_config__.tag
    full = msgspec.msgpack.encode([0.5, [[tag, *values.values()]]])
    assert EventDecoder().decode(full).events == [ev]
    short = msgspec.msgpack.encode([0.5, [[tag, *list(values.values())[:1]]]])
    assert type(EventDecoder().decode(short).events[0]) is cls
