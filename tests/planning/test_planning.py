"""KV cache planning: specs, vLLM's grouping rules, padding, sizing, errors, per-worker merging."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.planning import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    HFConfigError,
    KVCacheGroupingError,
    KVCachePlanningError,
    MambaSpec,
    MLAAttentionSpec,
    NotEnoughKVCacheMemoryError,
    SlidingWindowSpec,
    UniformTypeSpec,
    estimate_max_model_len,
    group_layers,
    plan_from_hf_config,
    plan_kv_cache,
    request_memory_bytes,
    specs_from_hf_config,
)
from kvstream.planning.hf_config import pipeline_stage_layers

GIB = 1 << 30

LLAMA_3_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
GEMMA_3_1B = {
    "model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "max_position_embeddings": 32768, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
}
JAMBA = {
    "model_type": "jamba", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_period": 8,
    "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
    "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
}


def full(heads: int = 8, head: int = 128, block: int = 16, dtype: str = "bfloat16", **kw):
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype, **kw)


def sliding(window: int, heads: int = 8, head: int = 128, block: int = 16):
    return SlidingWindowSpec(
        block_size=block, num_kv_heads=heads, head_size=head, dtype="bfloat16", sliding_window=window
    )


# --- specs -------------------------------------------------------------------------------


def test_dense_model_numbers_match_a_hand_computation():
    # Llama-3-8B: 32 layers, 8 KV heads, head 128, bf16, block 16, 10 GiB for KV cache.
    page = 2 * 16 * 8 * 128 * 2  # K and V * block_size * kv_heads * head_size * dtype bytes
    assert page == 65_536
    plan = plan_from_hf_config(LLAMA_3_8B, 10 * GIB, 8192)
    assert plan.grouping.rule == "uniform_spec" and len(plan.groups) == 1
    assert plan.groups[0].spec.page_size_bytes == page
    blocks = 10 * GIB // (page * 32)
    assert blocks == 5120
    assert plan.num_blocks == blocks
    assert plan.kv_cache_tokens == blocks * 16 == 81_920
    assert plan.blocks_per_request == 8192 // 16 == 512
    assert plan.max_concurrency == pytest.approx(5120 / 512) == 10.0
    assert plan.memory_per_request_bytes == 512 * page * 32 == 1 * GIB
    tensors = plan.workers[0].tensors
    assert len(tensors) == 32
    assert all(t.size_bytes == page * blocks and len(t.shared_by) == 1 for t in tensors)
    assert plan.workers[0].kv_cache_bytes == 10 * GIB


def test_mla_page_has_no_kv_factor_and_one_latent_head():
    spec = MLAAttentionSpec(block_size=16, head_size=512 + 64, dtype="bf16")
    assert spec.page_size_bytes == 16 * 576 * 2 == 18_432
    stages = specs_from_hf_config(
        {"model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16,
         "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"},
        tensor_parallel_size=4,
    )
    # The latent is replicated on every TP rank, so TP does not shrink the page.
    assert {s.page_size_bytes for s in stages[0].values()} == {18_432}


def test_fp8_kv_cache_halves_the_page():
    assert full(dtype="fp8").page_size_bytes * 2 == full().page_size_bytes


def test_sliding_window_needs_window_plus_a_step_plus_one_block():
    spec = sliding(4096)
    page = spec.page_size_bytes
    # min(4096 - 1 + 2048, 32768) = 6143 tokens -> 384 blocks, +1 for a window that does not
    # start on a block boundary.
    assert spec.max_memory_usage_bytes(32768, 2048) == 385 * page
    # Short requests never need more than their own length (+1 block).
    assert spec.max_memory_usage_bytes(1000, 2048) == (math.ceil(1000 / 16) + 1) * page
    # Full attention grows with the length instead.
    assert full().max_memory_usage_bytes(32768) == 2048 * page


def test_chunked_local_needs_one_chunk_plus_a_step():
    spec = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype="bf16", attention_chunk_size=8192
    )
    assert spec.max_memory_usage_bytes(65536, 2048) == (10240 // 16) * spec.page_size_bytes
    assert spec.max_memory_usage_bytes(4000, 2048) == 250 * spec.page_size_bytes


def test_mamba_state_is_one_block_per_request_whatever_the_length():
    spec = MambaSpec(block_size=4096, shapes=((3, 8192), (8192, 16)), dtypes=("bf16", "bf16"))
    assert spec.page_size_bytes == 3 * 8192 * 2 + 8192 * 16 * 2 == 311_296
    assert spec.max_memory_usage_bytes(4096) == spec.max_memory_usage_bytes(1_000_000)
    assert spec.max_memory_usage_bytes(10) == 311_296


def test_bad_spec_values_raise_typed_errors():
    with pytest.raises(KVCachePlanningError, match="unknown KV cache dtype 'int3'"):
        full(dtype="int3")
    with pytest.raises(KVCachePlanningError, match="block_size must be a positive"):
        full(block=0)
    with pytest.raises(KVCachePlanningError, match="smaller than the state"):
        MambaSpec(block_size=16, shapes=((4, 4),), dtypes=("bf16",), page_size_padded=8)


# --- grouping ----------------------------------------------------------------------------


def test_identical_layers_form_one_group():
    g = group_layers({f"l{i}": full() for i in range(4)})
    assert g.rule == "uniform_spec"
    assert [grp.layer_names for grp in g.groups] == [("l0", "l1", "l2", "l3")]
    assert g.padding == () and g.warnings == ()


def test_same_type_different_sizes_form_one_group_sized_per_layer():
    specs = {"a": full(heads=8), "b": full(heads=4), "c": full(heads=8)}
    g = group_layers(specs)
    assert g.rule == "uniform_type"
    assert len(g.groups) == 1 and isinstance(g.groups[0].spec, UniformTypeSpec)
    total_page = 65_536 + 32_768 + 65_536
    assert g.groups[0].spec.page_size_bytes == total_page

    plan = plan_kv_cache(specs, 100 * total_page + 5, 64)
    assert plan.num_blocks == 100
    sizes = {t.shared_by: t.size_bytes for t in plan.workers[0].tensors}
    assert sizes == {("a",): 65_536 * 100, ("b",): 32_768 * 100, ("c",): 65_536 * 100}
    assert plan.blocks_per_request == 4


def test_sliding_layers_with_different_windows_are_different_types():
    # They need different numbers of blocks per request, so they get their own groups.
    g = group_layers({"a": sliding(512), "b": sliding(1024)})
    assert g.rule == "uniform_page_size"
    assert [(grp.layer_names, grp.spec.sliding_window) for grp in g.groups] == [
        (("a",), 512), (("b",), 1024)]


def test_mixed_types_with_one_page_size_split_into_equal_groups():
    # 10 full + 20 sliding = a (1 full, 2 sliding) pattern: 3 groups of 10 layers.
    specs = {}
    for i in range(30):
        specs[f"l{i}"] = full() if i % 3 == 2 else sliding(1024)
    g = group_layers(specs)
    assert g.rule == "uniform_page_size"
    assert g.group_size == 10
    kinds = [grp.spec.kind for grp in g.groups]
    assert sorted(kinds) == ["full_attention", "sliding_window", "sliding_window"]
    assert all(len(grp.layer_names) == 10 for grp in g.groups)
    # Strided split: the sliding layers alternate between their two groups.
    sw_groups = [grp.layer_names for grp in g.groups if grp.spec.kind == "sliding_window"]
    assert sw_groups[0][:2] == ("l0", "l3") and sw_groups[1][:2] == ("l1", "l4")

    plan = plan_kv_cache(specs, 10 * GIB, 4096)
    page = 65_536
    assert plan.num_blocks == 10 * GIB // page // 10
    # One tensor per layer slot, each shared by one layer of every group.
    assert len(plan.workers[0].tensors) == 10
    assert all(len(t.shared_by) == 3 for t in plan.workers[0].tensors)
    assert plan.kv_cache_tokens == plan.num_blocks // 3 * 16


def test_padding_is_added_and_its_waste_reported():
    # Gemma-3-1B: 22 sliding + 4 full layers -> groups of 4; sliding needs 6 groups = 24 slots.
    plan = plan_from_hf_config(GEMMA_3_1B, 8 * GIB, 32768)
    g = plan.grouping
    assert g.group_size == 4 and len(g.groups) == 7
    assert [len(grp.layer_names) for grp in g.groups] == [4, 4, 4, 4, 3, 3, 4]
    (pad,) = g.padding
    assert (pad.kind, pad.num_layers, pad.num_padding_layers) == ("sliding_window", 22, 2)
    assert pad.max_waste_fraction == pytest.approx(2 / 22)
    assert g.pool_waste_fraction == pytest.approx(2 / 28)
    assert any("9.09%" in w for w in plan.warnings)
    # The padding costs memory per request: every block spans all 4 slots.
    page = 2 * 16 * 1 * 256 * 2
    sw_blocks = math.ceil(min(511 + 2048, 32768) / 16) + 1
    assert plan.memory_per_request_bytes == 4 * page * (6 * sw_blocks + 32768 // 16)


def test_close_layer_counts_pad_the_smaller_type_up():
    # 12 sliding + 13 full (a drafter layer): one group each of 13, not 12 + 2 x 12.
    specs = {f"s{i}": sliding(128) for i in range(12)} | {f"f{i}": full() for i in range(13)}
    g = group_layers(specs)
    assert g.group_size == 13 and len(g.groups) == 2
    (pad,) = g.padding
    assert (pad.kind, pad.num_padding_layers) == ("sliding_window", 1)


def test_different_page_sizes_cannot_share_a_pool():
    with pytest.raises(KVCacheGroupingError, match=r"different page sizes.*65536.*32768"):
        group_layers({"a": full(heads=8), "b": sliding(512, heads=4)})


def test_attention_free_model_has_no_kv_cache():
    plan = plan_kv_cache({}, 10 * GIB, 4096)
    assert plan.attention_free and plan.grouping.rule == "attention_free"
    assert plan.num_blocks == 1  # the pool's null block
    assert plan.kv_cache_tokens == 0 and plan.workers[0].tensors == ()
    assert plan.max_concurrency == 0.0
    # No KV cache means no memory check either.
    assert plan_kv_cache({}, 0, 4096).num_blocks == 1


def test_full_attention_with_a_compute_only_window_still_merges():
    g = group_layers({"a": full(), "b": full(sliding_window=4096)})
    assert g.rule == "uniform_spec"
    assert g.groups[0].spec.sliding_window == 4096


# --- hybrid management off ---------------------------------------------------------------


def test_no_hybrid_plans_sliding_layers_as_full_attention_and_warns_about_memory():
    specs = {f"l{i}": sliding(4096) if i % 2 == 0 else full() for i in range(8)}
    on = plan_kv_cache(specs, 20 * GIB, 32768)
    off = plan_kv_cache(specs, 20 * GIB, 32768, hybrid=False)
    assert on.grouping.rule == "uniform_page_size"
    assert off.grouping.rule == "uniform_spec"
    converted = off.grouping.specs["l0"]
    assert isinstance(converted, FullAttentionSpec) and converted.sliding_window == 4096
    assert off.memory_per_request_bytes > on.memory_per_request_bytes
    assert off.max_concurrency < on.max_concurrency
    assert any("planned as full attention" in w for w in off.warnings)
    assert any("instead of" in w and "x)" in w for w in off.warnings)


def test_no_hybrid_leaves_an_all_sliding_model_alone():
    specs = {f"l{i}": sliding(4096) for i in range(4)}
    plan = plan_kv_cache(specs, 4 * GIB, 32768, hybrid=False)
    assert plan.grouping.rule == "uniform_spec" and plan.warnings == ()


def test_no_hybrid_errors_when_specs_still_cannot_be_unified():
    stages = specs_from_hf_config(JAMBA, max_model_len=4096)
    with pytest.raises(KVCacheGroupingError, match="drop --no-hybrid"):
        plan_kv_cache(stages, 40 * GIB, 4096, hybrid=False)


# --- memory to blocks --------------------------------------------------------------------


def test_not_enough_memory_states_needed_available_and_longest_length():
    specs = specs_from_hf_config(LLAMA_3_8B)[0]
    per_token = 2 * 8 * 128 * 2 * 32  # bytes per token over all layers: 128 KiB
    with pytest.raises(NotEnoughKVCacheMemoryError) as info:
        plan_kv_cache(specs, 2 * GIB, 65536)
    e = info.value
    assert e.needed_bytes == 65536 * per_token == 8 * GIB
    assert e.available_bytes == 2 * GIB
    assert e.estimated_max_model_len == 2 * GIB // per_token == 16384
    msg = str(e)
    assert "8.00 GiB" in msg and "2.00 GiB" in msg and "16384" in msg
    assert "Lower max_model_len" in msg


def test_estimated_length_is_the_exact_boundary():
    specs = specs_from_hf_config(LLAMA_3_8B)[0]
    groups = group_layers(specs).groups
    available = 3 * GIB + 12345
    est = estimate_max_model_len(groups, available, 1_000_000)
    assert request_memory_bytes(groups, est) <= available
    assert request_memory_bytes(groups, est + 1) > available
    # Lengths in the same block cost the same, so the boundary is a block edge.
    assert est % 16 == 0


def test_no_memory_at_all_is_an_error_with_the_fix():
    with pytest.raises(NotEnoughKVCacheMemoryError, match="no memory left") as info:
        plan_kv_cache({"a": full()}, -5, 128)
    assert info.value.estimated_max_model_len == 0
    with pytest.raises(NotEnoughKVCacheMemoryError, match="Not even a single token"):
        plan_kv_cache({"a": full()}, 100, 128)


def test_block_count_override_replaces_the_computed_count():
    specs = {"a": full(), "b": full()}
    plan = plan_kv_cache(specs, GIB, 1024, num_gpu_blocks_override=100)
    assert plan.num_blocks == 100 and plan.workers[0].num_blocks_fit == GIB // (2 * 65_536)
    assert all(t.size_bytes == 100 * 65_536 for t in plan.workers[0].tensors)
    assert plan.warnings == ()
    big = plan_kv_cache(specs, GIB, 1024, num_gpu_blocks_override=10**6)
    assert big.num_blocks == 10**6 and any("exceeds" in w for w in big.warnings)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 80), heads=st.sampled_from([1, 2, 4, 8, 16]),
    head=st.sampled_from([64, 128, 256]), block=st.sampled_from([16, 32, 64]),
    gib=st.integers(1, 80), max_len=st.integers(1, 4096),
)
def test_blocks_fill_memory_without_exceeding_it(layers, heads, head, block, gib, max_len):
    specs = {f"l{i}": full(heads=heads, head=head, block=block) for i in range(layers)}
    per_block = 2 * block * heads * head * 2 * layers
    try:
        plan = plan_kv_cache(specs, gib * GIB, max_len)
    except NotEnoughKVCacheMemoryError as e:
        assert math.ceil(max_len / block) * per_block > gib * GIB
        assert e.estimated_max_model_len < max_len
        return
    assert plan.num_blocks * per_block <= gib * GIB < (plan.num_blocks + 1) * per_block
    assert plan.max_concurrency >= 1.0


# --- workers -----------------------------------------------------------------------------


def test_pipeline_stages_are_planned_per_worker_and_use_the_smallest_count():
    stages = specs_from_hf_config(LLAMA_3_8B, pipeline_parallel_size=2)
    assert [len(s) for s in stages] == [16, 16]
    page = 65_536
    plan = plan_kv_cache(stages, [8 * GIB, 6 * GIB], 8192)
    assert [w.num_blocks_fit for w in plan.workers] == [8 * GIB // (16 * page), 6 * GIB // (16 * page)]
    assert plan.num_blocks == 6 * GIB // (16 * page)
    # Tensors of the roomier worker shrink to the shared count.
    assert plan.workers[0].kv_cache_bytes == plan.workers[1].kv_cache_bytes == 6 * GIB
    assert plan.workers[0].memory_per_request_bytes == 512 * page * 16


def test_tensor_parallel_ranks_with_identical_specs_merge():
    stage = specs_from_hf_config(LLAMA_3_8B, tensor_parallel_size=2)[0]
    plan = plan_kv_cache([stage, dict(stage)], 4 * GIB, 8192)
    assert len(plan.groups[0].layer_names) == 32 and len(plan.workers) == 2


def test_workers_disagreeing_on_a_layer_spec_is_an_error():
    with pytest.raises(KVCachePlanningError, match="'l0' has different KV cache specs"):
        plan_kv_cache([{"l0": full(heads=8)}, {"l0": full(heads=4)}], GIB, 64)


def test_hybrid_groups_are_global_and_balanced_over_stages():
    stages = specs_from_hf_config(GEMMA_3_1B, pipeline_parallel_size=2)
    plan = plan_kv_cache(stages, 4 * GIB, 32768)
    assert len(plan.groups) == 7
    for w in plan.workers:
        assert len(w.groups) == 7  # every stage uses the engine's groups
        assert sum(len(g.layer_names) for g in w.groups) == len(w.layer_names) == 13
    # The strided split keeps each stage's slots per group at most 2 (of the 4 globally).
    assert max(len(g.layer_names) for w in plan.workers for g in w.groups) == 2


def test_memory_error_names_the_worker_that_runs_out():
    stages = specs_from_hf_config(LLAMA_3_8B, pipeline_parallel_size=2)
    with pytest.raises(NotEnoughKVCacheMemoryError) as info:
        plan_kv_cache(stages, [4 * GIB, GIB // 4], 8192)
    assert info.value.worker == 1 and "worker 1" in str(info.value)
    assert info.value.estimated_max_model_len == (GIB // 4) // (16 * 65_536) * 16


# --- Hugging Face configs ----------------------------------------------------------------


def test_gemma2_alternates_sliding_and_full_layers():
    cfg = {"model_type": "gemma2", "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096}
    kinds = [s.kind for s in specs_from_hf_config(cfg)[0].values()]
    assert kinds == ["sliding_window", "full_attention", "sliding_window", "full_attention"]


def test_gemma3_pattern_and_nested_text_config():
    cfg = {"model_type": "gemma3", "torch_dtype": "bfloat16",
           "text_config": {k: v for k, v in GEMMA_3_1B.items() if k != "torch_dtype"}}
    kinds = [s.kind for s in specs_from_hf_config(cfg)[0].values()]
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == [5, 11, 17, 23]


def test_llama4_chunked_local_layers_from_no_rope_layers():
    cfg = {"model_type": "llama4_text", "num_hidden_layers": 8, "num_attention_heads": 40,
           "num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 8192,
           "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0]}
    specs = specs_from_hf_config(cfg)[0]
    assert [s.kind for s in specs.values()].count("chunked_local_attention") == 6
    g = group_layers(specs)
    assert g.rule == "uniform_page_size" and g.group_size == 2 and len(g.groups) == 4


def test_layer_types_list_wins_and_unknown_types_are_rejected():
    cfg = {"num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 64, "sliding_window": 128,
           "layer_types": ["full_attention", "sliding_attention", "full_attention"]}
    assert [s.kind for s in specs_from_hf_config(cfg)[0].values()] == [
        "full_attention", "sliding_window", "full_attention"]
    cfg["layer_types"] = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(HFConfigError, match="linear_attention"):
        specs_from_hf_config(cfg)


def test_jamba_attention_block_grows_until_a_page_holds_a_mamba_state():
    specs = specs_from_hf_config(JAMBA, max_model_len=8192)[0]
    attn = specs["layers.4.attn"]
    mamba = specs["layers.0.mamba"]
    # Mamba-1 state: conv (3 x 8192) + ssm (8192 x 16), bf16 = 311,296 B; one attention
    # token is 2 * 8 * 128 * 2 = 4,096 B -> 16 * ceil(311296 / (16 * 4096)) = 80 tokens.
    assert attn.block_size == 80 and attn.page_size_bytes == 80 * 4096 == 327_680
    assert mamba.real_page_size_bytes == 311_296 and mamba.page_size_bytes == 327_680
    plan = plan_kv_cache(specs, 10 * GIB, 8192)
    assert plan.grouping.rule == "uniform_page_size" and len(plan.groups) == 8
    assert plan.block_size == 80
    assert plan.blocks_per_request == 7 + math.ceil(8192 / 80)


def test_tensor_parallel_divides_kv_heads_and_replicates_when_fewer_heads_than_ranks():
    assert specs_from_hf_config(LLAMA_3_8B, tensor_parallel_size=4)[0]["layers.0.attn"].num_kv_heads == 2
    assert specs_from_hf_config(LLAMA_3_8B, tensor_parallel_size=16)[0]["layers.0.attn"].num_kv_heads == 1
    with pytest.raises(KVCachePlanningError, match="split evenly"):
        specs_from_hf_config(LLAMA_3_8B, tensor_parallel_size=3)
    with pytest.raises(KVCachePlanningError, match="replicated evenly"):
        specs_from_hf_config(dict(LLAMA_3_8B, num_key_value_heads=4), tensor_parallel_size=6)


def test_pipeline_split_gives_the_remainder_to_the_stages_before_the_last():
    assert [len(r) for r in pipeline_stage_layers(27, 2)] == [14, 13]
    assert [len(r) for r in pipeline_stage_layers(10, 4)] == [2, 3, 3, 2]
    with pytest.raises(KVCachePlanningError):
        pipeline_stage_layers(2, 3)


def test_dtype_auto_serves_float32_checkpoints_as_bfloat16_and_kv_dtype_overrides():
    cfg = dict(LLAMA_3_8B, torch_dtype="float32")
    assert specs_from_hf_config(cfg)[0]["layers.0.attn"].dtype == "bfloat16"
    assert specs_from_hf_config(cfg, kv_cache_dtype="fp8")[0]["layers.0.attn"].page_size_bytes == 32_768


def test_missing_config_fields_name_the_field():
    with pytest.raises(HFConfigError, match="num_hidden_layers"):
        specs_from_hf_config({"num_attention_heads": 8})
