"""From available memory to a number of KV cache blocks, per worker and for the engine.

Follows vLLM's ``get_kv_cache_configs``:

1. Merge the specs of all workers (pipeline stages hold different layers; tensor-parallel
   ranks of one stage hold the same ones) into the whole model's specs.
2. Group the whole model's layers (:func:`~kvstream.planning.grouping.group_layers`), so every
   stage uses the same groups.
3. On each worker, check that one request at ``max_model_len`` fits; if not, raise
   :class:`NotEnoughKVCacheMemoryError` with the longest length that does (binary search).
4. Size each worker: ``blocks = available // page_size // layers_per_group`` (one shared
   tensor per layer slot), or ``available // sum(pages)`` for a single group of
   differently-sized layers (one tensor per layer).
5. The scheduler is shared, so every worker gets the smallest block count; tensors shrink
   to match.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from .errors import KVCachePlanningError, NotEnoughKVCacheMemoryError
from .grouping import Grouping, GroupSpec, KVCacheGroup, UniformTypeSpec, group_layers
from .specs import DEFAULT_MAX_NUM_BATCHED_TOKENS, LayerSpec

__all__ = [
    "KVCacheTensor",
    "WorkerPlan",
    "KVCachePlan",
    "plan_kv_cache",
    "request_memory_bytes",
    "estimate_max_model_len",
    "merge_worker_specs",
    "format_gib",
]

_GIB = 1 << 30


def format_gib(num_bytes: int) -> str:
    """``num_bytes`` as GiB with two decimals, e.g. ``'1.50 GiB'``."""
    return f"{num_bytes / _GIB:.2f} GiB"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVCacheTensor:
    """One KV cache tensor a worker allocates, and the layers that store their blocks in it."""

    size_bytes: int
    """Tensor size (bytes)."""
    shared_by: tuple[str, ...]
    """Layers using it: one layer of each group (uniform page size), or a single layer."""


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    """The plan of one worker (one pipeline stage; its tensor-parallel ranks are identical)."""

    index: int
    """Worker (stage) index."""
    available_bytes: int
    """Memory given to the KV cache on this worker (bytes)."""
    layer_names: tuple[str, ...]
    """Layers this worker holds."""
    groups: tuple[KVCacheGroup, ...]
    """The engine's groups restricted to this worker's layers (possibly empty groups)."""
    num_blocks_fit: int
    """Blocks this worker's memory holds on its own, before the override and the minimum."""
    memory_per_request_bytes: int
    """KV bytes one request at ``max_model_len`` needs on this worker."""
    tensors: tuple[KVCacheTensor, ...]
    """Tensors sized for the engine's final block count."""

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes actually allocated for the KV cache on this worker."""
        return sum(t.size_bytes for t in self.tensors)


def _spec_dict(spec: GroupSpec) -> dict[str, Any]:
    if isinstance(spec, UniformTypeSpec):
        return {
            "kind": spec.kind,
            "per_layer": True,
            "block_size": spec.block_size,
            "layers": {name: _spec_dict(s) for name, s in spec.layer_specs},
        }
    out: dict[str, Any] = {"kind": spec.kind}
    for f in fields(spec):
        value = getattr(spec, f.name)
        out[f.name] = [list(v) for v in value] if f.name == "shapes" else (
            list(value) if isinstance(value, tuple) else value
        )
    return out


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """How an engine's KV cache is laid out and how much it holds."""

    grouping: Grouping
    """Groups, padding and warnings from grouping the whole model."""
    workers: tuple[WorkerPlan, ...]
    """Per-worker sizing."""
    num_blocks: int
    """Blocks per group's pool on every worker (after the override and the minimum)."""
    max_model_len: int
    """Longest request planned for (tokens)."""
    max_num_batched_tokens: int
    """Tokens per scheduler step assumed for windowed layers (tokens)."""
    num_gpu_blocks_override: int | None
    """The override used, if any (blocks)."""
    warnings: tuple[str, ...]
    """Grouping warnings plus sizing ones (e.g. the cost of hybrid management off)."""

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        """The engine's KV cache groups."""
        return self.grouping.groups

    @property
    def attention_free(self) -> bool:
        """True when the model has no KV cache at all."""
        return not self.grouping.groups

    @property
    def block_size(self) -> int:
        """Smallest block size over the groups (tokens); 0 when attention-free."""
        return min((g.spec.block_size for g in self.groups), default=0)

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the cache holds, as vLLM reports it: ``num_blocks // groups * block_size``."""
        if not self.groups:
            return 0
        return self.num_blocks // len(self.groups) * self.block_size

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request at ``max_model_len`` takes, summed over the groups."""
        return sum(
            _cdiv(g.spec.max_memory_usage_bytes(self.max_model_len, self.max_num_batched_tokens),
                  g.spec.page_size_bytes)
            for g in self.groups
        )

    @property
    def max_concurrency(self) -> float:
        """Requests of ``max_model_len`` tokens that fit at once (``num_blocks / blocks_per_request``)."""
        per_request = self.blocks_per_request
        return self.num_blocks / per_request if per_request else 0.0

    @property
    def memory_per_request_bytes(self) -> int:
        """KV bytes one request at ``max_model_len`` needs on the most loaded worker."""
        return max((w.memory_per_request_bytes for w in self.workers), default=0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (plain dicts, lists, numbers and strings)."""
        g = self.grouping
        return {
            "rule": g.rule,
            "attention_free": self.attention_free,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "kv_cache_tokens": self.kv_cache_tokens,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "blocks_per_request": self.blocks_per_request,
            "max_concurrency": self.max_concurrency,
            "memory_per_request_bytes": self.memory_per_request_bytes,
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
            "group_size": g.group_size,
            "groups": [
                {
                    "layers": list(grp.layer_names),
                    "num_padding_layers": g.group_size - len(grp.layer_names),
                    "page_size_bytes": grp.spec.page_size_bytes,
                    "max_memory_usage_bytes": grp.spec.max_memory_usage_bytes(
                        self.max_model_len, self.max_num_batched_tokens),
                    "spec": _spec_dict(grp.spec),
                }
                for grp in g.groups
            ],
            "padding": [
                {
                    "kind": p.kind,
                    "num_layers": p.num_layers,
                    "num_padding_layers": p.num_padding_layers,
                    "max_waste_fraction": p.max_waste_fraction,
                }
                for p in g.padding
            ],
            "pool_waste_fraction": g.pool_waste_fraction,
            "workers": [
                {
                    "index": w.index,
                    "available_bytes": w.available_bytes,
                    "num_layers": len(w.layer_names),
                    "num_blocks_fit": w.num_blocks_fit,
                    "memory_per_request_bytes": w.memory_per_request_bytes,
                    "kv_cache_bytes": w.kv_cache_bytes,
                    "tensors": [
                        {"size_bytes": t.size_bytes, "shared_by": list(t.shared_by)}
                        for t in w.tensors
                    ],
                }
                for w in self.workers
            ],
            "warnings": list(self.warnings),
        }


def merge_worker_specs(
    worker_specs: Sequence[Mapping[str, LayerSpec]],
) -> dict[str, LayerSpec]:
    """The whole model's ``layer -> spec`` from every worker's; a layer seen on several
    workers (tensor-parallel ranks) must have the same spec everywhere."""
    merged: dict[str, LayerSpec] = {}
    seen_on: dict[str, int] = {}
    for i, specs in enumerate(worker_specs):
        for name, spec in specs.items():
            if name not in merged:
                merged[name] = spec
                seen_on[name] = i
            elif merged[name] != spec:
                raise KVCachePlanningError(
                    f"layer {name!r} has different KV cache specs on worker {seen_on[name]} "
                    f"({merged[name]}) and worker {i} ({spec}); every rank holding a layer must "
                    "agree on its spec"
                )
    return merged


def _project(grouping: Grouping, layer_names: set[str]) -> tuple[KVCacheGroup, ...]:
    out: list[KVCacheGroup] = []
    for g in grouping.groups:
        names = tuple(n for n in g.layer_names if n in layer_names)
        spec = g.spec
        if names and isinstance(spec, UniformTypeSpec):
            spec = UniformTypeSpec(tuple((n, s) for n, s in spec.layer_specs if n in layer_names))
        out.append(KVCacheGroup(names, spec))
    return tuple(out)


def _is_per_layer(groups: Sequence[KVCacheGroup]) -> bool:
    return len(groups) == 1 and isinstance(groups[0].spec, UniformTypeSpec)


def request_memory_bytes(
    groups: Sequence[KVCacheGroup],
    max_model_len: int,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> int:
    """KV bytes one request of ``max_model_len`` tokens needs with these groups, padding
    included (every group's blocks span all ``group_size`` layer slots)."""
    if not groups:
        return 0
    if _is_per_layer(groups):
        spec = groups[0].spec
        assert isinstance(spec, UniformTypeSpec)
        return sum(
            s.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
            for _, s in spec.layer_specs
        )
    group_size = max(len(g.layer_names) for g in groups)
    page = groups[0].spec.page_size_bytes
    blocks = sum(
        _cdiv(g.spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens), page)
        for g in groups
    )
    return group_size * page * blocks


def estimate_max_model_len(
    groups: Sequence[KVCacheGroup],
    available_bytes: int,
    upper_bound: int,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> int:
    """Longest model length (tokens, at most ``upper_bound``) whose single request fits in
    ``available_bytes``, by binary search; 0 if not even one token fits."""

    def fits(n: int) -> bool:
        return request_memory_bytes(groups, n, max_num_batched_tokens) <= available_bytes

    if upper_bound < 1 or not fits(1):
        return 0
    lo, hi = 1, upper_bound  # invariant: fits(lo)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _check_fits(
    worker: int,
    groups: Sequence[KVCacheGroup],
    available: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> int:
    needed = request_memory_bytes(groups, max_model_len, max_num_batched_tokens)
    if available <= 0:
        raise NotEnoughKVCacheMemoryError(
            f"worker {worker} has no memory left for the KV cache ({available} bytes after "
            "weights and activations). Raise the GPU memory utilization, lower the memory "
            "reserved for weights/activations, or spread the model over more GPUs "
            "(tensor/pipeline parallelism).",
            needed_bytes=needed, available_bytes=available, max_model_len=max_model_len,
            estimated_max_model_len=0, worker=worker,
        )
    if needed > available:
        est = estimate_max_model_len(groups, available, max_model_len, max_num_batched_tokens)
        fit = (
            f"The longest model length that fits is {est} tokens. " if est
            else "Not even a single token fits. "
        )
        raise NotEnoughKVCacheMemoryError(
            f"one request at max_model_len={max_model_len} needs {format_gib(needed)} "
            f"({needed} bytes) of KV cache on worker {worker}, but only {format_gib(available)} "
            f"({available} bytes) is available. {fit}Lower max_model_len"
            + (f" to {est} or less" if est else "")
            + ", raise the GPU memory utilization, use an fp8 KV cache dtype, or add GPUs "
            "(tensor/pipeline parallelism).",
            needed_bytes=needed, available_bytes=available, max_model_len=max_model_len,
            estimated_max_model_len=est, worker=worker,
        )
    return needed


def _blocks_fit(groups: Sequence[KVCacheGroup], available: int) -> int:
    if not groups:
        return 1  # vLLM's pool always keeps one null block, even with no KV cache
    if _is_per_layer(groups):
        return max(available // groups[0].spec.page_size_bytes, 0)
    group_size = max(len(g.layer_names) for g in groups)
    return max(available // groups[0].spec.page_size_bytes // group_size, 0)


def _tensors(groups: Sequence[KVCacheGroup], num_blocks: int) -> tuple[KVCacheTensor, ...]:
    if not groups:
        return ()
    if _is_per_layer(groups):
        spec = groups[0].spec
        assert isinstance(spec, UniformTypeSpec)
        return tuple(KVCacheTensor(s.page_size_bytes * num_blocks, (n,)) for n, s in spec.layer_specs)
    # Tensor i is shared by the i-th layer of every group: groups own different blocks, so
    # their layers never write the same part of the tensor.
    group_size = max(len(g.layer_names) for g in groups)
    page = groups[0].spec.page_size_bytes
    return tuple(
        KVCacheTensor(
            page * num_blocks,
            tuple(g.layer_names[i] for g in groups if i < len(g.layer_names)),
        )
        for i in range(group_size)
    )


def plan_kv_cache(
    specs: Mapping[str, LayerSpec] | Sequence[Mapping[str, LayerSpec]],
    available_bytes: int | Sequence[int],
    max_model_len: int,
    *,
    hybrid: bool = True,
    num_gpu_blocks_override: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> KVCachePlan:
    """Plan the KV cache of an engine.

    ``specs`` is one worker's ``layer name -> spec`` (layers in model order), or a list of
    them, one per worker (pipeline stage). ``available_bytes`` is the memory each worker
    gives to the KV cache (bytes), one number for all or one per worker. ``max_model_len``
    (tokens) is the longest request that must fit. ``hybrid=False`` plans windowed layers as
    full attention. ``num_gpu_blocks_override`` replaces the computed block count (blocks),
    as vLLM's option of that name does.

    Raises :class:`~kvstream.planning.errors.NotEnoughKVCacheMemoryError` when one request
    at ``max_model_len`` does not fit on some worker, and
    :class:`~kvstream.planning.errors.KVCacheGroupingError` when the layers cannot share a pool.
    """
    worker_specs: list[Mapping[str, LayerSpec]] = (
        [specs] if isinstance(specs, Mapping) else list(specs)
    )
    if not worker_specs:
        raise KVCachePlanningError("plan_kv_cache needs the specs of at least one worker")
    if isinstance(available_bytes, int):
        avail = [available_bytes] * len(worker_specs)
    else:
        avail = [int(a) for a in available_bytes]
        if len(avail) != len(worker_specs):
            raise KVCachePlanningError(
                f"got {len(avail)} available-memory values for {len(worker_specs)} workers; "
                "pass one per worker or a single number for all"
            )
    if max_model_len < 1:
        raise KVCachePlanningError(f"max_model_len must be at least 1 token, got {max_model_len}")
    if max_num_batched_tokens < 1:
        raise KVCachePlanningError(
            f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}"
        )
    if num_gpu_blocks_override is not None and num_gpu_blocks_override < 1:
        raise KVCachePlanningError(
            f"num_gpu_blocks_override must be a positive block count, got {num_gpu_blocks_override}"
        )

    merged = merge_worker_specs(worker_specs)
    grouping = group_layers(merged, hybrid=hybrid)
    warnings = list(grouping.warnings)
    if not hybrid and any(grouping.specs[n] != s for n, s in merged.items()):
        before = sum(
            s.max_memory_usage_bytes(max_model_len, max_num_batched_tokens) for s in merged.values()
        )
        after = sum(
            s.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
            for s in grouping.specs.values()
        )
        warnings.append(
            f"with hybrid management off, one request at max_model_len={max_model_len} needs "
            f"{format_gib(after)} of KV cache instead of {format_gib(before)} "
            f"({after / before:.2f}x), so fewer requests fit"
        )

    projected = [_project(grouping, set(ws)) for ws in worker_specs]
    needed: list[int] = []
    for i, (groups, a) in enumerate(zip(projected, avail)):
        if any(g.layer_names for g in groups):
            needed.append(_check_fits(i, groups, a, max_model_len, max_num_batched_tokens))
        else:
            needed.append(0)

    fit = [_blocks_fit(g, a) for g, a in zip(projected, avail)]
    per_worker = [num_gpu_blocks_override if num_gpu_blocks_override is not None else f for f in fit]
    holding = [b for b, g in zip(per_worker, projected) if any(x.layer_names for x in g)]
    num_blocks = min(holding) if holding else min(per_worker)
    if num_gpu_blocks_override is not None and any(num_gpu_blocks_override > f for f, g in zip(fit, projected) if g):
        warnings.append(
            f"num_gpu_blocks_override={num_gpu_blocks_override} exceeds the {min(fit)} blocks "
            "the available memory holds; the engine would allocate more than it was given"
        )

    workers = tuple(
        WorkerPlan(
            index=i,
            available_bytes=a,
            layer_names=tuple(ws),
            groups=groups,
            num_blocks_fit=f,
            memory_per_request_bytes=n,
            tensors=_tensors(groups, num_blocks),
        )
        for i, (ws, a, groups, f, n) in enumerate(zip(worker_specs, avail, projected, fit, needed))
    )
    return KVCachePlan(
        grouping=grouping,
        workers=workers,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        num_gpu_blocks_override=num_gpu_blocks_override,
        warnings=tuple(warnings),
    )
