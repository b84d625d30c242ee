"""Block hashing: vLLM's chained prefix-cache block hashes, bit for bit, and a fast native mode.

kvstream's bottom layer: it imports nothing of kvstream but :mod:`kvstream.errors` and the native
core (``kvstream._native``), which runs the per-block loops.
``blocks`` holds the algorithms, the root seed, the extra keys and the request hasher.
"""

from __future__ import annotations

from kvstream.hashing.blocks import (
    ALGORITHMS,
    VLLM_ALGORITHMS,
    DEFAULT_NONE_HASH_SEED,
    HashAlgorithm,
    Rules,
    ExtraKeyStyle,
    ExternalForm,
    HashingError,
    none_hash,
    hash_function,
    BlockHasher,
    LoRA,
    MMItem,
    BlockExtraKeys,
    PromptEmbedsDigest,
    RequestExtraKeys,
    RequestBlockHasher,
    to_external,
    to_external_list,
)

__all__ = [
    "ALGORITHMS",
    "VLLM_ALGORITHMS",
    "DEFAULT_NONE_HASH_SEED",
    "HashAlgorithm",
    "Rules",
    "ExtraKeyStyle",
    "ExternalForm",
    "HashingError",
    "none_hash",
    "hash_function",
    "BlockHasher",
    "LoRA",
    "MMItem",
    "BlockExtraKeys",
    "PromptEmbedsDigest",
    "RequestExtraKeys",
    "RequestBlockHasher",
    "to_external",
    "to_external_list",
]
