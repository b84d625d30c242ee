"""KV cache planning: layer specs, grouping, and memory to blocks, by vLLM's rules.

``specs`` describes one layer's KV cache, ``grouping`` puts layers into groups that share
a block table, ``sizing`` turns available memory into blocks per worker, ``hf_config``
builds specs from a Hugging Face ``config.json``. The ``kvstream plan`` command and the
simulator sit on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import (
    HFConfigError,
    KVCacheGroupingError,
    KVCachePlanningError,
    NotEnoughKVCacheMemoryError,
)
from .grouping import (
    Grouping,
    KVCacheGroup,
    PaddingReport,
    UniformTypeSpec,
    group_layers,
    unify_hybrid_specs,
)
from .hf_config import DEFAULT_BLOCK_SIZE, model_max_len, specs_from_hf_config
from .sizing import (
    KVCachePlan,
    KVCacheTensor,
    WorkerPlan,
    estimate_max_model_len,
    merge_worker_specs,
    plan_kv_cache,
    request_memory_bytes,
)
from .specs import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    LayerSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    dtype_bytes,
)

__all__ = [
    "ChunkedLocalAttentionSpec",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "FullAttentionSpec",
    "Grouping",
    "HFConfigError",
    "KVCacheGroup",
    "KVCacheGroupingError",
    "KVCachePlan",
    "KVCachePlanningError",
    "KVCacheTensor",
    "LayerSpec",
    "MLAAttentionSpec",
    "MambaSpec",
    "NotEnoughKVCacheMemoryError",
    "PaddingReport",
    "SlidingWindowSpec",
    "UniformTypeSpec",
    "WorkerPlan",
    "dtype_bytes",
    "estimate_max_model_len",
    "group_layers",
    "merge_worker_specs",
    "model_max_len",
    "plan_from_hf_config",
    "plan_kv_cache",
    "request_memory_bytes",
    "specs_from_hf_config",
    "unify_hybrid_specs",
]


def plan_from_hf_config(
    config: Mapping[str, Any],
    available_bytes: int,
    max_model_len: int | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    hybrid: bool = True,
    num_gpu_blocks_override: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> KVCachePlan:
    """Plan the KV cache of a Hugging Face model: :func:`specs_from_hf_config` then
    :func:`plan_kv_cache`.

    ``available_bytes`` is the KV cache memory of each GPU (bytes); ``max_model_len``
    (tokens) defaults to the model's ``max_position_embeddings``.
    """
    if max_model_len is None:
        max_model_len = model_max_len(config)
        if max_model_len is None:
            raise HFConfigError(
                "config.json has no max_position_embeddings; pass max_model_len explicitly"
            )
    stages = specs_from_hf_config(
        config,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        max_model_len=max_model_len,
    )
    return plan_kv_cache(
        stages,
        available_bytes,
        max_model_len,
        hybrid=hybrid,
        num_gpu_blocks_override=num_gpu_blocks_override,
        max_num_batched_tokens=max_num_batched_tokens,
    )
