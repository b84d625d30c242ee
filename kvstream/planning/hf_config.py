"""Layer KV cache specs from a Hugging Face ``config.json``.

Reads the fields vLLM reads for the same purpose and returns one ``layer -> spec`` mapping
per pipeline stage (tensor-parallel ranks of a stage hold identical specs). Supported
layouts:

- dense attention with GQA/MQA (Llama, Qwen, Mistral without window, ...);
- a sliding window on every layer (Mistral-7B-v0.1), on even layers (``gemma2``), on all
  but every ``sliding_window_pattern``-th layer (Gemma-3), on layers from
  ``max_window_layers`` on (Qwen2 with ``use_sliding_window``), or per ``layer_types``;
- chunked local attention (Llama-4: ``attention_chunk_size`` with ``no_rope_layers``, or
  ``layer_types`` entries ``chunked_attention``);
- MLA (DeepSeek-V2/V3: ``kv_lora_rank`` and ``qk_rope_head_dim``);
- Mamba-1 (``mamba``), Mamba-2 (``mamba2``) and Jamba's attention + Mamba-1 interleave.

Tensor parallelism divides KV heads per rank. With fewer KV heads than ranks, vLLM
replicates each head, so every rank holds one head (this needs ``tp % kv_heads == 0``). MLA's
latent is not split. Mamba states are split along their channels/heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import HFConfigError, KVCachePlanningError
from .specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    LayerSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    normalize_dtype,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "HYBRID_BLOCK_ALIGNMENT",
    "text_config",
    "model_dtype",
    "model_max_len",
    "pipeline_stage_layers",
    "specs_from_hf_config",
]

#: vLLM's default KV cache block size on GPUs (tokens).
DEFAULT_BLOCK_SIZE = 16
#: Smallest kernel block size of FlashAttention (tokens); hybrid attention + Mamba models
#: grow the attention block size in multiples of this until a page holds one Mamba state.
HYBRID_BLOCK_ALIGNMENT = 16

_MAMBA1_TYPES = {"mamba", "falcon_mamba"}
_MAMBA2_TYPES = {"mamba2"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language-model part of ``config``: multimodal configs (Gemma-3, Llama-4) nest it
    under ``text_config``; its fields win over the top level's."""
    if not isinstance(config, Mapping):
        raise HFConfigError(f"a model config must be a JSON object (config.json), got {type(config).__name__}")
    out = dict(config)
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        out.update(nested)
    return out


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return default


def _need_int(cfg: Mapping[str, Any], *keys: str) -> int:
    v = _get(cfg, *keys)
    if not isinstance(v, int) or isinstance(v, bool):
        raise HFConfigError(
            f"config.json has no integer {' / '.join(keys)} (got {v!r}); add it, or give the "
            "dimensions explicitly (--layers --kv-heads --head-dim)"
        )
    return v


def model_dtype(config: Mapping[str, Any]) -> str:
    """The dtype vLLM's ``--dtype auto`` picks: the config's ``torch_dtype`` (or ``dtype``),
    with float32 and a missing value served as bfloat16."""
    cfg = text_config(config)
    raw = _get(cfg, "torch_dtype", "dtype", default="bfloat16")
    try:
        name = normalize_dtype(raw)
    except KVCachePlanningError as exc:
        raise HFConfigError(f"config.json has an unsupported torch_dtype {raw!r}") from exc
    return "bfloat16" if name == "float32" else name


def model_max_len(config: Mapping[str, Any]) -> int | None:
    """The model's own context length (tokens) from ``max_position_embeddings`` (or the
    older names), or ``None`` if the config has none."""
    cfg = text_config(config)
    v = _get(cfg, "max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
    return v if isinstance(v, int) and v > 0 else None


def pipeline_stage_layers(num_layers: int, pipeline_parallel_size: int) -> list[range]:
    """Layer index ranges of each pipeline stage, split as vLLM does: equal shares, with the
    remainder given one layer each to the stages just before the last (the last stage also
    runs the LM head)."""
    if pipeline_parallel_size < 1:
        raise KVCachePlanningError(
            f"pipeline_parallel_size must be at least 1, got {pipeline_parallel_size}"
        )
    if num_layers and pipeline_parallel_size > num_layers:
        raise KVCachePlanningError(
            f"pipeline_parallel_size={pipeline_parallel_size} exceeds the {num_layers} layers"
        )
    sizes = [num_layers // pipeline_parallel_size] * pipeline_parallel_size
    for i in range(2, num_layers % pipeline_parallel_size + 2):
        sizes[-i] += 1
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out


def _heads_per_rank(kv_heads: int, tp: int) -> int:
    if kv_heads >= tp:
        if kv_heads % tp:
            raise KVCachePlanningError(
                f"{kv_heads} KV heads cannot be split evenly over tensor_parallel_size={tp}; "
                "use a tensor parallel size that divides the KV head count"
            )
        return kv_heads // tp
    if tp % kv_heads:
        raise KVCachePlanningError(
            f"tensor_parallel_size={tp} is not a multiple of the {kv_heads} KV heads, so the "
            "heads cannot be replicated evenly; use a multiple or a divisor of the head count"
        )
    return 1  # each rank holds one replicated head


def _split(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise KVCachePlanningError(
            f"{what}={total} cannot be split evenly over tensor_parallel_size={tp}"
        )
    return total // tp


def _layer_kinds(cfg: Mapping[str, Any], n: int) -> list[str]:
    """Each layer's kind: ``full``, ``sliding``, ``chunked`` or ``mamba``."""
    model_type = str(cfg.get("model_type", ""))
    if model_type in _MAMBA1_TYPES or model_type in _MAMBA2_TYPES:
        return ["mamba"] * n
    if model_type == "jamba":
        period = _need_int(cfg, "attn_layer_period")
        offset = _need_int(cfg, "attn_layer_offset")
        return ["full" if i % period == offset else "mamba" for i in range(n)]

    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        names = {
            "full_attention": "full", "attention": "full",
            "sliding_attention": "sliding", "sliding_window": "sliding",
            "chunked_attention": "chunked", "mamba": "mamba",
        }
        if len(layer_types) != n:
            raise HFConfigError(
                f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {n}"
            )
        unknown = sorted({t for t in layer_types if t not in names})
        if unknown:
            raise HFConfigError(
                f"unsupported layer_types {unknown}; kvstream plans {sorted(names)}"
            )
        return [names[t] for t in layer_types]

    chunk = cfg.get("attention_chunk_size")
    if chunk:
        no_rope = cfg.get("no_rope_layers")
        if isinstance(no_rope, list) and len(no_rope) == n:
            # Llama-4: a layer without RoPE (flag 0) attends globally; the others are local.
            return ["chunked" if flag else "full" for flag in no_rope]
        return ["chunked"] * n

    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return ["full"] * n
    if model_type == "gemma2":
        return ["sliding" if i % 2 == 0 else "full" for i in range(n)]
    pattern = _get(cfg, "sliding_window_pattern", "sliding_window_period")
    if isinstance(pattern, int) and pattern > 0:
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n)]
    if cfg.get("use_sliding_window") and isinstance(cfg.get("max_window_layers"), int):
        first = cfg["max_window_layers"]
        return ["sliding" if i >= first else "full" for i in range(n)]
    return ["sliding"] * n


def _mamba_spec(cfg: Mapping[str, Any], tp: int, dtype: str, block_size: int) -> MambaSpec:
    model_type = str(cfg.get("model_type", ""))
    hidden = _need_int(cfg, "hidden_size", "d_model")
    shapes: tuple[tuple[int, ...], ...]
    if model_type in _MAMBA2_TYPES:
        heads = _need_int(cfg, "num_heads", "mamba_n_heads")
        head_dim = _need_int(cfg, "head_dim", "mamba_d_head")
        state = _need_int(cfg, "state_size", "mamba_d_state")
        conv = _need_int(cfg, "conv_kernel", "mamba_d_conv")
        groups = int(_get(cfg, "n_groups", "mamba_n_groups", default=1))
        inner = int(_get(cfg, "intermediate_size", default=heads * head_dim))
        # Groups that do not divide over the ranks are replicated up to one per rank.
        if groups % tp:
            groups = tp
        conv_dim = inner + 2 * groups * state
        shapes = (
            (conv - 1, _split(conv_dim, tp, "mamba conv dim")),
            (_split(heads, tp, "mamba heads"), head_dim, state),
        )
    else:
        expand = int(_get(cfg, "mamba_expand", "expand", default=2))
        # Jamba's intermediate_size is its MLP width; its Mamba width is expand * hidden.
        if model_type == "jamba":
            inner = expand * hidden
        else:
            inner = int(_get(cfg, "intermediate_size", default=expand * hidden))
        state = _need_int(cfg, "mamba_d_state", "state_size")
        conv = _need_int(cfg, "mamba_d_conv", "conv_kernel")
        per_rank = _split(inner, tp, "mamba intermediate size")
        shapes = ((conv - 1, per_rank), (per_rank, state))
    return MambaSpec(block_size=block_size, shapes=shapes, dtypes=(dtype, dtype))


def specs_from_hf_config(
    config: Mapping[str, Any],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    max_model_len: int | None = None,
) -> list[dict[str, LayerSpec]]:
    """Per-stage ``layer name -> spec`` for a Hugging Face model config (a parsed ``config.json``).

    ``block_size`` is tokens per block; ``kv_cache_dtype`` is ``auto`` (the model dtype) or a
    dtype name such as ``fp8``; Mamba states always use the model dtype. ``max_model_len``
    (tokens, default the model's own) is the block size of Mamba layers, which hold one
    state per request. In a hybrid attention + Mamba model the attention block size grows in
    multiples of :data:`HYBRID_BLOCK_ALIGNMENT` (at least ``block_size``) until one attention
    page holds a Mamba state, and the Mamba page is padded to the same size, as vLLM does.
    Layers are named ``layers.<i>.attn`` / ``layers.<i>.mamba``.
    """
    cfg = text_config(config)
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp < 1:
        raise KVCachePlanningError(f"tensor_parallel_size must be at least 1, got {tp}")
    if block_size < 1:
        raise KVCachePlanningError(f"block_size must be at least 1 token, got {block_size}")
    n = _need_int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    if n < 0:
        raise HFConfigError(f"num_hidden_layers must not be negative, got {n}")
    mdtype = model_dtype(config)
    kv_dtype = mdtype if kv_cache_dtype == "auto" else normalize_dtype(kv_cache_dtype)
    kinds = _layer_kinds(cfg, n)

    attn: FullAttentionSpec | None = None
    if any(k != "mamba" for k in kinds):
        if _get(cfg, "kv_lora_rank") is not None:
            latent = _need_int(cfg, "kv_lora_rank") + _need_int(cfg, "qk_rope_head_dim")
            attn = MLAAttentionSpec(block_size=block_size, head_size=latent, dtype=kv_dtype)
        else:
            q_heads = _need_int(cfg, "num_attention_heads", "n_head")
            kv_heads = int(_get(cfg, "num_key_value_heads", "num_kv_heads", default=q_heads))
            head_dim = _get(cfg, "head_dim")
            if not isinstance(head_dim, int):
                head_dim = _need_int(cfg, "hidden_size") // q_heads
            attn = FullAttentionSpec(
                block_size=block_size, num_kv_heads=_heads_per_rank(kv_heads, tp),
                head_size=head_dim, dtype=kv_dtype,
            )

    mamba: MambaSpec | None = None
    if "mamba" in kinds:
        mlen = max_model_len or model_max_len(config)
        if not mlen:
            raise HFConfigError(
                "a Mamba model needs max_model_len (the config has no max_position_embeddings); "
                "pass --max-model-len"
            )
        mamba = _mamba_spec(cfg, tp, mdtype, mlen)
        if attn is not None:
            # One pool serves both kinds, so pages must match: grow the attention block
            # until a page holds a whole state, then pad the state up to that page.
            per_token = attn.with_block_size(1).page_size_bytes
            align = max(HYBRID_BLOCK_ALIGNMENT, block_size)
            attn_block = align * _cdiv(mamba.real_page_size_bytes, align * per_token)
            attn = attn.with_block_size(attn_block)
            mamba = MambaSpec(
                block_size=mlen, shapes=mamba.shapes, dtypes=mamba.dtypes,
                page_size_padded=attn.page_size_bytes,
            )

    def spec_for(kind: str) -> LayerSpec:
        if kind == "mamba":
            assert mamba is not None
            return mamba
        assert attn is not None
        if kind == "full":
            return attn
        if isinstance(attn, MLAAttentionSpec):
            raise HFConfigError("windowed MLA layers are not supported")
        if kind == "sliding":
            window = _need_int(cfg, "sliding_window")
            return SlidingWindowSpec(
                block_size=attn.block_size, num_kv_heads=attn.num_kv_heads,
                head_size=attn.head_size, dtype=attn.dtype, sliding_window=window,
            )
        return ChunkedLocalAttentionSpec(
            block_size=attn.block_size, num_kv_heads=attn.num_kv_heads,
            head_size=attn.head_size, dtype=attn.dtype,
            attention_chunk_size=_need_int(cfg, "attention_chunk_size"),
        )

    stages: list[dict[str, LayerSpec]] = []
    for layers in pipeline_stage_layers(n, pp) if n else [range(0)] * pp:
        stages.append(
            {f"layers.{i}.{'mamba' if kinds[i] == 'mamba' else 'attn'}": spec_for(kinds[i])
             for i in layers}
        )
    return stages
