"""Put a model's layers into KV cache groups, by vLLM's rules.

A group is a set of layers that share one block table: the manager allocates a block once
for the group and every layer of the group stores its part of those tokens in it. The
rules, tried in order:

1. No layer has a KV cache (attention-free model): no group.
2. All specs are the same (most dense models): one group.
3. All specs are of one type but differ in size (e.g. full-attention layers with different
   KV head counts): one group whose block spans every layer, each sized on its own.
4. Several types with one page size (e.g. Gemma's interleaved sliding window, Jamba's
   attention + Mamba after page alignment): layers of each type are split into groups of
   equal layer counts; a type whose count is not a multiple gets padding layers, which
   waste part of the memory of that type's blocks.
5. Anything else cannot share one pool: :class:`KVCacheGroupingError`.

With hybrid management off, sliding-window and chunked-local layers are first planned as
full attention (their window still limits compute), at the cost of their memory savings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal, Union

from .errors import KVCacheGroupingError
from .specs import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    LayerSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = [
    "GroupingRule",
    "UniformTypeSpec",
    "GroupSpec",
    "KVCacheGroup",
    "PaddingReport",
    "Grouping",
    "group_layers",
    "unify_hybrid_specs",
]

#: Which grouping rule applied (see the module docstring).
GroupingRule = Literal["attention_free", "uniform_spec", "uniform_type", "uniform_page_size"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class UniformTypeSpec:
    """The spec of a single group whose layers are one type but differ in size.

    A block of this group holds every layer's share, so its page is the sum of the layers'
    pages and each layer gets its own tensor sized ``page * num_blocks``.
    """

    layer_specs: tuple[tuple[str, LayerSpec], ...]
    """``(layer name, spec)`` of every layer, in model order."""

    @property
    def kind(self) -> str:
        """The kind shared by all layers (e.g. ``full_attention``)."""
        return self.layer_specs[0][1].kind

    @property
    def block_size(self) -> int:
        """Tokens per block (the same for every layer)."""
        return self.layer_specs[0][1].block_size

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block across all layers of the group."""
        return sum(spec.page_size_bytes for _, spec in self.layer_specs)

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    ) -> int:
        """Bytes one request can hold: the most blocks any layer needs, times the whole page."""
        blocks = max(
            _cdiv(spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
                  spec.page_size_bytes)
            for _, spec in self.layer_specs
        )
        return blocks * self.page_size_bytes


#: The spec a group is planned with.
GroupSpec = Union[LayerSpec, UniformTypeSpec]


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers sharing one block table, and the spec they are planned with."""

    layer_names: tuple[str, ...]
    """Real layers of the group; fewer than the group size when the group is padded."""
    spec: GroupSpec
    """One layer's spec (or a :class:`UniformTypeSpec` spanning all of them)."""


@dataclass(frozen=True, slots=True)
class PaddingReport:
    """Padding added to the layers of one spec to make the group sizes equal."""

    kind: str
    """Kind of the padded layers (e.g. ``full_attention``)."""
    num_layers: int
    """Real layers of this spec."""
    num_padding_layers: int
    """Empty layer slots added to this spec's last group."""

    @property
    def max_waste_fraction(self) -> float:
        """Upper bound on the share of this spec's KV memory lost to padding (0..1)."""
        return self.num_padding_layers / self.num_layers

    @property
    def message(self) -> str:
        """The operator-facing warning for this padding."""
        return (
            f"{self.num_padding_layers} padding layer(s) added to the {self.num_layers} "
            f"{self.kind} layers: up to {100 * self.max_waste_fraction:.2f}% of their KV cache "
            "memory is wasted"
        )


@dataclass(frozen=True, slots=True)
class Grouping:
    """The outcome of :func:`group_layers`."""

    rule: GroupingRule
    """Which rule applied."""
    groups: tuple[KVCacheGroup, ...]
    """The groups, in a stable order (by first appearance of each spec, then split index)."""
    specs: Mapping[str, LayerSpec]
    """Every layer's spec after hybrid unification (equal to the input when nothing changed)."""
    group_size: int
    """Layer slots per group (the number of shared tensors), 0 when attention-free."""
    padding: tuple[PaddingReport, ...] = ()
    """Padding per spec; empty when no group is padded."""
    warnings: tuple[str, ...] = ()
    """Things an operator should know: each padding's message, then hybrid management off."""

    @property
    def num_padding_slots(self) -> int:
        """Total empty layer slots over all groups."""
        return sum(p.num_padding_layers for p in self.padding)

    @property
    def pool_waste_fraction(self) -> float:
        """Share of all layer slots that are padding (0..1): the pool memory lost to padding
        when blocks are spread evenly over the groups."""
        slots = len(self.groups) * self.group_size
        return self.num_padding_slots / slots if slots else 0.0


def _merge_identical(specs: list[LayerSpec]) -> LayerSpec | None:
    """The one spec standing for all of ``specs``, or ``None`` if they differ.

    Full-attention layers that carry a compute-only window (hybrid off) merge with plain
    full-attention layers, as long as at most one window value and one kind of window appear.
    """
    first = specs[0]
    if isinstance(first, FullAttentionSpec):
        if any(type(s) is not type(first) for s in specs):
            return None
        # All of first's type, so FullAttentionSpecs (a narrowing mypy cannot follow).
        fulls: list[FullAttentionSpec] = specs  # type: ignore[assignment]
        base = replace(first, sliding_window=None, attention_chunk_size=None)
        if any(replace(s, sliding_window=None, attention_chunk_size=None) != base for s in fulls):
            return None
        windows = {s.sliding_window for s in fulls if s.sliding_window is not None}
        chunks = {s.attention_chunk_size for s in fulls if s.attention_chunk_size is not None}
        if len(windows) > 1 or len(chunks) > 1 or (windows and chunks):
            return None
        return replace(
            base,
            sliding_window=next(iter(windows), None),
            attention_chunk_size=next(iter(chunks), None),
        )
    return first if all(s == first for s in specs) else None


def _is_uniform_type(specs: list[LayerSpec]) -> bool:
    """Whether all layers need the same number of token slots (same type, same block size)."""
    first = specs[0]
    if any(s.block_size != first.block_size for s in specs):
        return False
    if isinstance(first, FullAttentionSpec):
        return all(isinstance(s, FullAttentionSpec) for s in specs)
    if isinstance(first, SlidingWindowSpec):
        return all(
            isinstance(s, SlidingWindowSpec) and s.sliding_window == first.sliding_window
            for s in specs
        )
    if isinstance(first, ChunkedLocalAttentionSpec):
        return all(
            isinstance(s, ChunkedLocalAttentionSpec)
            and s.attention_chunk_size == first.attention_chunk_size
            for s in specs
        )
    return all(
        isinstance(s, MambaSpec) and s.num_speculative_blocks == first.num_speculative_blocks
        for s in specs
    )


def unify_hybrid_specs(specs: Mapping[str, LayerSpec]) -> tuple[dict[str, LayerSpec], int]:
    """Plan sliding-window and chunked-local layers as full attention (hybrid management off).

    The conversion happens only when the model also has full-attention layers; a model made
    only of sliding-window layers is already uniform. Returns the new specs and how many
    layers were converted. Raises :class:`KVCacheGroupingError` if the result still cannot
    form one group (e.g. Mamba layers, or different block sizes).
    """
    out = dict(specs)
    values = list(out.values())
    if not values or _merge_identical(values) is not None or _is_uniform_type(values):
        return out, 0
    converted = 0
    if any(isinstance(s, FullAttentionSpec) for s in values):
        for name, s in specs.items():
            if isinstance(s, SlidingWindowSpec):
                out[name] = FullAttentionSpec(
                    block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                    head_size=s.head_size, dtype=s.dtype, sliding_window=s.sliding_window,
                )
                converted += 1
            elif isinstance(s, ChunkedLocalAttentionSpec):
                out[name] = FullAttentionSpec(
                    block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                    head_size=s.head_size, dtype=s.dtype,
                    attention_chunk_size=s.attention_chunk_size,
                )
                converted += 1
    values = list(out.values())
    if _merge_identical(values) is None and not _is_uniform_type(values):
        kinds = sorted({s.kind for s in values})
        raise KVCacheGroupingError(
            "hybrid KV cache management is disabled, but the layers cannot be planned as "
            f"one type (kinds after conversion: {', '.join(kinds)}; block sizes: "
            f"{sorted({s.block_size for s in values})}). Only sliding-window and "
            "chunked-local layers can fall back to full attention; enable hybrid management "
            "(drop --no-hybrid) for this model."
        )
    return out, converted


def group_layers(specs: Mapping[str, LayerSpec], *, hybrid: bool = True) -> Grouping:
    """Group a model's layers (``layer name -> spec``, in model order) by vLLM's rules.

    ``hybrid=False`` is vLLM's ``--disable-hybrid-kv-cache-manager``. Raises
    :class:`KVCacheGroupingError` when the layers cannot share one block pool.
    """
    warnings: list[str] = []
    if not hybrid:
        specs, converted = unify_hybrid_specs(specs)
        if converted:
            warnings.append(
                f"hybrid KV cache management is off: {converted} sliding-window/chunked-local "
                "layers are planned as full attention. Their window still saves compute, but "
                "they now keep every token's KV, so they need as much memory per request as "
                "full attention."
            )
    else:
        specs = dict(specs)
    names = list(specs)
    values = list(specs.values())

    if not values:
        return Grouping("attention_free", (), specs, 0, (), tuple(warnings))

    merged = _merge_identical(values)
    if merged is not None:
        group = KVCacheGroup(tuple(names), merged)
        return Grouping("uniform_spec", (group,), specs, len(names), (), tuple(warnings))

    if _is_uniform_type(values):
        uniform = UniformTypeSpec(tuple(specs.items()))
        group = KVCacheGroup(tuple(names), uniform)
        return Grouping("uniform_type", (group,), specs, len(names), (), tuple(warnings))

    page_sizes = {s.page_size_bytes for s in values}
    if len(page_sizes) != 1:
        by_kind: dict[str, set[int]] = {}
        for s in values:
            by_kind.setdefault(s.kind, set()).add(s.page_size_bytes)
        detail = "; ".join(f"{k}: {sorted(v)} B" for k, v in by_kind.items())
        raise KVCacheGroupingError(
            "the layers mix KV cache types with different page sizes, so they cannot share "
            f"one block pool (page size per block per layer: {detail}). Choose block sizes "
            "that make every layer's page the same size (page = 2 * block_size * kv_heads * "
            "head_size * dtype bytes for attention), or plan the layers separately."
        )

    # Bucket layers by spec, in order of first appearance.
    buckets: dict[LayerSpec, list[str]] = {}
    for name, s in specs.items():
        buckets.setdefault(s, []).append(name)
    counts = [len(v) for v in buckets.values()]
    # Today's hybrids follow an n:1 pattern (Gemma-3 5:1, Llama-4 3:1), so the smallest
    # count is the group size. When the counts are close (within 1.5x, e.g. 12 sliding +
    # 13 full with a drafter layer), the largest count pads less.
    group_size = min(counts)
    if max(counts) < group_size * 1.5:
        group_size = max(counts)

    groups: list[KVCacheGroup] = []
    padding: list[PaddingReport] = []
    for spec, layer_names in buckets.items():
        num_groups = _cdiv(len(layer_names), group_size)
        pad = num_groups * group_size - len(layer_names)
        if pad:
            padding.append(PaddingReport(spec.kind, len(layer_names), pad))
            warnings.append(padding[-1].message)
        # Strided split (layers[i::n], not consecutive runs) keeps every pipeline stage's
        # share of each group balanced, so stages pad no more than the whole model does.
        for i in range(num_groups):
            groups.append(KVCacheGroup(tuple(layer_names[i::num_groups]), spec))
    return Grouping(
        "uniform_page_size", tuple(groups), specs, group_size, tuple(padding), tuple(warnings)
    )
