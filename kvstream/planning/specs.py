"""Per-layer KV cache specs: how many bytes one block of one layer takes, and how many
bytes one request can need at most.

The kinds follow vLLM's ``kv_cache_interface``:

- :class:`FullAttentionSpec`: every token's K and V stay cached.
- :class:`MLAAttentionSpec`: multi-head latent attention (DeepSeek-V2/V3). One compressed
  latent vector per token replaces K and V, so there is no factor 2 and one "head".
- :class:`SlidingWindowSpec`: only the last ``sliding_window`` tokens are attended to, so
  blocks that fall out of the window are freed.
- :class:`ChunkedLocalAttentionSpec`: attention within fixed chunks (Llama-4 local layers).
- :class:`MambaSpec`: a state-space layer; a request holds a fixed-size state, whatever its
  length.

Specs are frozen value objects: equal specs compare and hash equal, which is what grouping
relies on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import TypeVar, Union

from .errors import KVCachePlanningError

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "dtype_bytes",
    "normalize_dtype",
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "ChunkedLocalAttentionSpec",
    "MambaSpec",
    "LayerSpec",
]

#: vLLM's ``SchedulerConfig`` default for tokens scheduled per step (tokens). Sliding-window
#: and chunked-local layers must hold the window plus one step's new tokens during chunked
#: prefill, so their per-request memory depends on it.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

_DTYPE_ALIASES: dict[str, str] = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "torch.float32": "float32",
    "fp8": "fp8",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}
_DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


def normalize_dtype(name: str) -> str:
    """Canonical dtype name (``bfloat16``, ``float16``, ``float32``, ``fp8``, ``fp8_e4m3``,
    ``fp8_e5m2``) for a user- or config-supplied spelling such as ``bf16`` or ``torch.float16``.
    """
    canonical = _DTYPE_ALIASES.get(str(name).strip().lower())
    if canonical is None:
        known = ", ".join(sorted(_DTYPE_BYTES))
        raise KVCachePlanningError(f"unknown KV cache dtype {name!r}; use one of: {known}")
    return canonical


def dtype_bytes(name: str) -> int:
    """Bytes per element of a KV cache dtype name (any spelling :func:`normalize_dtype` takes)."""
    return _DTYPE_BYTES[normalize_dtype(name)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise KVCachePlanningError(f"{name} must be a positive integer, got {value!r}")


_Spec = TypeVar("_Spec", bound="_AttentionLayer")


@dataclass(frozen=True, slots=True, kw_only=True)
class _AttentionLayer:
    """What every attention layer spec has: its block shape and the bytes of one block."""

    block_size: int
    """Tokens per block."""
    num_kv_heads: int
    """KV heads held by one worker (after tensor parallelism)."""
    head_size: int
    """Elements per head."""
    dtype: str
    """KV cache element type (see :func:`normalize_dtype`)."""

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_size", self.head_size)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: K and V, ``2 * block_size * heads * head_size * dtype``."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_bytes(self.dtype)

    def with_block_size(self: _Spec, block_size: int) -> _Spec:
        """The same spec with another block size (tokens)."""
        return replace(self, block_size=block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttentionSpec(_AttentionLayer):
    """A full-attention layer: K and V of every token stay cached.

    ``sliding_window`` / ``attention_chunk_size`` are set only when hybrid management is
    off and a windowed layer is planned as full attention: the window still limits compute
    but no longer frees memory.
    """

    sliding_window: int | None = None
    """Window kept for compute only (tokens); ``None`` for a real full-attention layer."""
    attention_chunk_size: int | None = None
    """Local-attention chunk kept for compute only (tokens)."""

    kind = "full_attention"

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    ) -> int:
        """Bytes one request of ``max_model_len`` tokens can hold in this layer."""
        return _cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """A multi-head latent attention layer (DeepSeek-V2/V3).

    ``head_size`` is the latent width, ``kv_lora_rank + qk_rope_head_dim`` (576 for
    DeepSeek-V2/V3); ``num_kv_heads`` is 1. The latent is the same on every tensor-parallel
    rank, so tensor parallelism does not shrink it.
    """

    num_kv_heads: int = 1
    kind = "mla_attention"

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block: ``block_size * heads * head_size * dtype`` (no K/V factor 2)."""
        return self.block_size * self.num_kv_heads * self.head_size * dtype_bytes(self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowSpec(_AttentionLayer):
    """A sliding-window attention layer: only the last ``sliding_window`` tokens are attended."""

    sliding_window: int
    """Window (tokens)."""

    kind = "sliding_window"

    def __post_init__(self) -> None:
        _AttentionLayer.__post_init__(self)
        _positive("sliding_window", self.sliding_window)

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    ) -> int:
        """Bytes one request can hold: the window plus one step's new tokens, plus one block.

        During chunked prefill the layer keeps the last ``sliding_window - 1`` computed tokens
        and the tokens scheduled this step, never more than ``max_model_len``. The extra block
        is there because the window need not start on a block boundary.
        """
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (_cdiv(tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkedLocalAttentionSpec(_AttentionLayer):
    """A chunked local attention layer (Llama-4): tokens attend within fixed chunks."""

    attention_chunk_size: int
    """Chunk (tokens)."""

    kind = "chunked_local_attention"

    def __post_init__(self) -> None:
        _AttentionLayer.__post_init__(self)
        _positive("attention_chunk_size", self.attention_chunk_size)

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    ) -> int:
        """Bytes one request can hold: one chunk plus one step's new tokens, capped at
        ``max_model_len``."""
        tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return _cdiv(tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class MambaSpec:
    """A state-space (Mamba) layer: a fixed-size state per request, however long it is.

    ``shapes[i]`` is a state tensor's shape on one worker and ``dtypes[i]`` its element type
    (Mamba-1: conv state ``(d_conv - 1, d_inner)`` and SSM state ``(d_inner, d_state)``).
    ``page_size_padded`` pads the page up to the attention layers' page in a hybrid model.
    """

    block_size: int
    """Tokens one block stands for; vLLM uses ``max_model_len`` (one state per request)."""
    shapes: tuple[tuple[int, ...], ...]
    """State tensor shapes (elements)."""
    dtypes: tuple[str, ...]
    """Element type of each state tensor."""
    page_size_padded: int | None = None
    """Page size after padding (bytes), or ``None`` for the natural size."""
    num_speculative_blocks: int = 0
    """Extra state blocks kept per request for speculative decoding."""

    kind = "mamba"

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise KVCachePlanningError(
                f"MambaSpec needs one dtype per state shape, got {len(self.shapes)} shapes "
                f"and {len(self.dtypes)} dtypes"
            )
        object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in self.shapes))
        object.__setattr__(self, "dtypes", tuple(normalize_dtype(d) for d in self.dtypes))
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise KVCachePlanningError(
                f"page_size_padded={self.page_size_padded} B is smaller than the state itself "
                f"({self.real_page_size_bytes} B)"
            )

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one request's state, before padding."""
        return sum(prod(s) * dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block (one state), padded if ``page_size_padded`` is set."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    ) -> int:
        """Bytes one request holds: one state block plus any speculative ones."""
        return (1 + self.num_speculative_blocks) * self.page_size_bytes

    def with_block_size(self, block_size: int) -> "MambaSpec":
        """The same spec with another block size (tokens)."""
        return replace(self, block_size=block_size)


#: Any one layer's KV cache spec.
LayerSpec = Union[
    FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec
]
