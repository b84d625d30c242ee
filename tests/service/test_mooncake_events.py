"""RFC #1527 event batches decode into kvstream's events, beside vLLM's payloads."""

from __future__ import annotations

import msgspec
import pytest

from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, EventDecodeError, KVEventBatch, encode_batch
from kvstream.wire.mooncake import AnyFormatDecoder, decode_mooncake_batch

ENVELOPE = {"event_id": 42, "timestamp": 1739145600000, "model_name": "llama-3.1-8b", "block_size": 4,
            "additional_salt": None, "lora_name": None, "tenant_id": "default", "backend_id": "worker-0",
            "medium": "gpu", "dp_rank": 0}


def _batch(*events: dict, ts: int = 1739145600000, rank: int = 0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), rank])


def test_stored_removed_and_cleared_map_onto_kvstream_events() -> None:
    stored = {**ENVELOPE, "event_type": "stored", "seq_hashes": [11, 12], "base_block_idx": 5, "parent_hash": 10,
              "token_ids": list(range(8))}
    removed = {**ENVELOPE, "event_type": "removed", "seq_hashes": [12], "base_block_idx": 6, "medium": "cpu"}
    cleared = {**ENVELOPE, "event_type": "cleared"}
    b = decode_mooncake_batch(_batch(stored, removed, cleared, rank=3))
    assert b.ts == 1739145600.0 and b.data_parallel_rank == 3
    s, r, c = b.events
    assert s == BlockStored([11, 12], 10, list(range(8)), 4, None, "GPU", None)
    assert r == BlockRemoved([12], "CPU")
    assert c == AllBlocksCleared()


def test_root_runs_legacy_aliases_and_hash_only_runs() -> None:
    root = {"event_type": "stored", "seq_hashes": [1], "base_block_idx": 0, "parent_hash": None, "medium": "disk"}
    legacy = {"event_type": "stored", "block_hashes": [2], "parent_block_hash": 1, "type": "BlockStored"}
    deep = {"event_type": "stored", "seq_hashes": [9], "base_block_idx": 7, "token_ids": [1, 2, 3, 4], "block_size": 4}
    a, b, c = decode_mooncake_batch(_batch(root, legacy, deep)).events
    assert a == BlockStored([1], None, [], 0, None, "DISK", None)
    assert b.block_hashes == [2] and b.parent_block_hash == 1
    # deep in a sequence with no parent named: kept by hash only (tokens cannot be chained)
    assert c.token_ids == [] and c.block_size == 4


@pytest.mark.parametrize("event, says", [
    ({"event_type": "stored", "seq_hashes": [1]}, "parent_hash or base_block_idx"),
    ({"event_type": "removed"}, "needs seq_hashes"),
    ({"event_type": "evicted", "seq_hashes": [1]}, "event_type must be one of"),
    ({"event_type": "stored", "seq_hashes": [1, 2], "base_block_idx": 0, "token_ids": [1, 2, 3], "block_size": 4},
     "3 token_ids for 2 blocks"),
    ({"seq_hashes": [1]}, "event_type"),
])
def test_malformed_events_are_decode_errors(event: dict, says: str) -> None:
    with pytest.raises(EventDecodeError, match=says):
        decode_mooncake_batch(_batch(event))


def test_any_format_decoder_takes_both_and_keeps_vllms_error() -> None:
    d = AnyFormatDecoder()
    vllm = KVEventBatch(1.5, [BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", None)], 0)
    assert d.decode(encode_batch(vllm)) == vllm
    assert d.decode(encode_batch(vllm, "array")) == vllm
    rfc = d.decode(_batch({"event_type": "removed", "seq_hashes": [5], "medium": "gpu"}))
    assert rfc.events == [BlockRemoved([5], "GPU")] and d.mooncake_batches == 1
    with pytest.raises(EventDecodeError, match="not valid msgpack"):
        d.decode(b"\xc1")


@pytest.mark.anyio
async def test_a_subscriber_given_the_any_format_decoder_reads_rfc_batches_off_the_wire(tmp_path) -> None:
    import anyio

    from kvstream.transport import KVEventsConfig, Publisher, SourceBatch, SourceSpec, Subscriber

    cfg = KVEventsConfig(endpoint=f"ipc://{tmp_path}/p.sock", replay_endpoint=f"ipc://{tmp_path}/r.sock")
    dec = AnyFormatDecoder()
    stored = {**ENVELOPE, "event_type": "stored", "seq_hashes": [7], "base_block_idx": 0, "parent_hash": None}
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub, Subscriber([SourceSpec(pub.endpoint, pub.replay_endpoint, "m")],
                                                    decoder=dec) as sub:
            await sub.wait_connected()
            pub.publish_raw(_batch(stored), 0)
            item = await sub.__anext__()
            while type(item) is not SourceBatch:
                item = await sub.__anext__()
    assert item.batch.events == [BlockStored([7], None, [], 4, None, "GPU", None)] and dec.mooncake_batches == 1
