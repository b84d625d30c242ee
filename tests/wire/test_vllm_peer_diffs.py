"""Regressions found by ``bench/vllm_peer/diff_wire.py`` (kvstream against vLLM's own code).

Each expected value below was written down from the real peer's output; the comment above
it names the vLLM release and the call that produced it.
"""

from __future__ import annotations

from kvstream.wire.events import BlockStored, EventDecoder, EventEncoder, KVEventBatch

# vLLM 0.33.0: msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1700000000.0, events=[
#     BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[1, 2, 3, 4],
#                 block_size=2, lora_id=None, medium="GPU", lora_name=None,
#                 extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention",
#                 lookahead_token_ids=[[5, 6], [7]])], data_parallel_rank=0))
# (vllm/distributed/kv_events.py; block_pool.py fills lookahead_token_ids with one token
# list per block in block_hashes.)
V033_LOOKAHEAD = bytes.fromhex(
    "93cb41d954fc4000000091de000ca474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "73920b0cb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f63"
    "6b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472"
    "615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c"
    "6c5f617474656e74696f6eb36c6f6f6b61686561645f746f6b656e5f69647392920506910700"
)


def test_lookahead_token_ids_are_one_token_list_per_block_as_vllm_033_sends_them():
    batch = EventDecoder().decode(V033_LOOKAHEAD)
    ev = batch.events[0]
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [11, 12]
    assert ev.lookahead_token_ids == [[5, 6], [7]]
    assert EventEncoder("map").encode(batch) == V033_LOOKAHEAD


def test_lookahead_token_ids_survive_the_array_shape_with_all_fields():
    ev = BlockStored([11, 12], None, [1, 2, 3, 4], 2, None, "GPU", None, lookahead_token_ids=[[5, 6], [7]])
    batch = KVEventBatch(1.0, [ev], 0)
    assert EventDecoder().decode(EventEncoder("array", array_fields="all").encode(batch)) == batch
