"""``kvstream plan``: size a deployment's KV cache before starting it.

Reads a Hugging Face ``config.json`` (or explicit model dimensions), GPU memory and
parallelism, and prints vLLM's KV cache plan: groups, blocks, tokens, concurrency.

Memory arithmetic, per GPU (all GiB):

    KV cache memory = gpu_memory * gpu_memory_utilization
                      - non_kv_memory
                      - model_weights / (tensor_parallel * pipeline_parallel)

``--non-kv-memory`` is what one GPU keeps outside the KV cache (weights, activation peak,
CUDA graphs, NCCL buffers) when you know it, e.g. from vLLM's startup log.
``--model-weights-gib`` is the whole checkpoint's size, spread evenly over all GPUs; it
covers weights only, so activations are not subtracted unless ``--non-kv-memory`` adds them.
Without either, the whole utilized budget goes to the KV cache and the plan says so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from kvstream.cli._common import add_deprecated_alias, fraction, non_negative_int, positive_int

_UNITS = {
    "": 1 << 30, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_GIB = 1 << 30


def parse_memory(text: str) -> int:
    """Bytes for a memory size: ``80``, ``80GiB`` and ``80G`` are GiB; ``80GB`` is 10^9-based;
    ``512MiB``, ``1.5TiB`` and ``1024B`` work too."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid memory size {text!r}: use a number of GiB (80) or a number with a unit "
            "(80GiB, 80GB, 512MiB)"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` sub-command to the ``kvstream`` parser."""
    p = sub.add_parser(
        "plan",
        help="plan a model's KV cache: blocks, tokens and concurrency for a GPU budget",
        description=(
            "Plan the KV cache the way vLLM does: group the layers (full, sliding window, "
            "chunked local, MLA, Mamba), turn GPU memory into blocks and report the KV cache "
            "size in tokens and the maximum concurrency at max model length."
        ),
    )
    p.add_argument("config", nargs="?", type=Path,
                   help="a Hugging Face config.json (or a folder holding one)")
    p.add_argument("--model-config", dest="model_config", type=Path, metavar="CONFIG_JSON",
                   help="the same as CONFIG (the name `kvstream simulate` uses)")
    m = p.add_argument_group("model (override or replace config.json)")
    m.add_argument("--layers", type=non_negative_int, help="number of decoder layers")
    m.add_argument("--kv-heads", type=positive_int, help="KV heads per layer (whole model)")
    m.add_argument("--head-dim", type=positive_int, help="elements per attention head")
    m.add_argument("--dtype", help="model dtype (bfloat16, float16, float32); default bfloat16")
    m.add_argument("--sliding-window", type=positive_int,
                   help="sliding window of every layer (tokens), with explicit dimensions")
    c = p.add_argument_group("cache")
    c.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache dtype: auto (= model dtype), fp8, fp8_e4m3, ... (default auto)")
    c.add_argument("--block-size", type=positive_int, default=16,
                   help="tokens per block (default 16)")
    c.add_argument("--max-model-len", type=positive_int,
                   help="longest request in tokens (default: the config's max_position_embeddings)")
    c.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                   help="tokens per scheduler step; windowed layers hold window + this "
                        "(default 2048, vLLM's SchedulerConfig default)")
    c.add_argument("--num-gpu-blocks-override", type=positive_int,
                   help="use this many blocks instead of what memory allows")
    c.add_argument("--no-hybrid", action="store_true",
                   help="disable the hybrid KV cache manager: plan windowed layers as full attention")
    g = p.add_argument_group("hardware")
    g.add_argument("--gpu-memory", type=parse_memory, required=True,
                   help="memory of one GPU, e.g. 80, 80GiB, 141GB")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="share of GPU memory vLLM may use (default 0.9)")
    a = g.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel", type=positive_int, default=1,
                       help="tensor parallel size (vLLM's name): divides KV heads per GPU (default 1)")
    add_deprecated_alias(g, a, "--tensor-parallel")
    a = g.add_argument("--pipeline-parallel-size", "-pp", dest="pipeline_parallel", type=positive_int, default=1,
                       help="pipeline parallel size (vLLM's name): splits layers over stages (default 1)")
    add_deprecated_alias(g, a, "--pipeline-parallel")
    g.add_argument("--model-weights-gib", type=parse_memory, metavar="SIZE",
                   help="whole checkpoint size, spread evenly over TP*PP GPUs and subtracted")
    g.add_argument("--non-kv-memory", type=parse_memory, metavar="SIZE",
                   help="per-GPU memory kept outside the KV cache (weights, activations, graphs)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_run)


def _load_config(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from kvstream.planning import HFConfigError

    if args.model_config is not None:
        if args.config is not None and args.config != args.model_config:
            raise HFConfigError("give the model config once: as CONFIG or as --model-config, not both")
        args.config = args.model_config

    cfg: dict[str, Any] = {}
    source = "explicit dimensions"
    if args.config is not None:
        path = args.config / "config.json" if args.config.is_dir() else args.config
        try:
            cfg = json.loads(path.read_text())
        except OSError as exc:
            raise HFConfigError(f"cannot read {path}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise HFConfigError(f"{path} is not valid JSON: {exc}") from exc
        except UnicodeDecodeError:
            raise HFConfigError(f"{path} is not a text file (config.json is UTF-8 JSON)") from None
        if not isinstance(cfg, dict):
            raise HFConfigError(f"{path} must hold a JSON object")
        source = str(path)
        if isinstance(cfg.get("text_config"), dict):
            from kvstream.planning.hf_config import text_config

            cfg = text_config(cfg)
    elif args.layers is None:
        raise HFConfigError(
            "give a config.json, or the model's dimensions: --layers --kv-heads --head-dim"
        )
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    if args.kv_heads is not None:
        cfg["num_key_value_heads"] = args.kv_heads
        cfg.setdefault("num_attention_heads", args.kv_heads)
    if args.head_dim is not None:
        cfg["head_dim"] = args.head_dim
    if args.dtype is not None:
        cfg["torch_dtype"] = args.dtype
    if args.sliding_window is not None:
        cfg["sliding_window"] = args.sliding_window
    if args.config is None and args.layers:
        missing = [f for f, v in (("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim))
                   if v is None]
        if missing:
            raise HFConfigError(f"explicit dimensions need {' and '.join(missing)} too")
    return cfg, source


def _memory(args: argparse.Namespace) -> dict[str, Any]:
    budget = int(args.gpu_memory * args.gpu_memory_utilization)
    gpus = args.tensor_parallel * args.pipeline_parallel
    weights = args.model_weights_gib // gpus if args.model_weights_gib is not None else 0
    non_kv = args.non_kv_memory or 0
    return {
        "gpu_memory_bytes": args.gpu_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "budget_bytes": budget,
        "weights_per_gpu_bytes": weights,
        "non_kv_memory_bytes": non_kv,
        "kv_cache_bytes": budget - weights - non_kv,
        "reserved_given": args.model_weights_gib is not None or args.non_kv_memory is not None,
    }


def _run(args: argparse.Namespace) -> int:
    from kvstream.planning import (
        KVCachePlanningError,
        NotEnoughKVCacheMemoryError,
        model_max_len,
        plan_kv_cache,
        specs_from_hf_config,
    )

    mem = _memory(args)
    try:
        cfg, source = _load_config(args)
        max_len = args.max_model_len or model_max_len(cfg)
        if max_len is None:
            raise KVCachePlanningError("the model length is unknown: pass --max-model-len")
        stages = specs_from_hf_config(
            cfg,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel,
            pipeline_parallel_size=args.pipeline_parallel,
            max_model_len=max_len,
        )
        plan = plan_kv_cache(
            stages,
            mem["kv_cache_bytes"],
            max_len,
            hybrid=not args.no_hybrid,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    except KVCachePlanningError as exc:
        if args.json:
            err: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc), "memory": mem}
            if isinstance(exc, NotEnoughKVCacheMemoryError):
                err.update(
                    needed_bytes=exc.needed_bytes, available_bytes=exc.available_bytes,
                    max_model_len=exc.max_model_len,
                    estimated_max_model_len=exc.estimated_max_model_len, worker=exc.worker,
                )
            print(json.dumps(err, indent=2))
        else:
            print(f"kvstream plan: error: {exc}", file=sys.stderr)
        return 1

    notes: list[str] = []
    own_len = model_max_len(cfg)
    if own_len is not None and max_len > own_len:
        notes.append(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings {own_len}; "
            "vLLM refuses that unless told otherwise (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)"
        )
    if not mem["reserved_given"]:
        notes.append(
            "no memory reserved for weights/activations: the whole utilized budget is planned "
            "as KV cache; pass --model-weights-gib or --non-kv-memory for a realistic plan"
        )
    if args.json:
        out = plan.to_dict()
        out["notes"] = notes
        out["source"] = source
        out["memory"] = mem
        out["tensor_parallel"] = args.tensor_parallel
        out["pipeline_parallel"] = args.pipeline_parallel
        print(json.dumps(out, indent=2))
    else:
        _print_table(plan, source, mem, args)
        for n in notes:
            print(f"note: {n}")
    return 0


def _gib(n: int) -> str:
    return f"{n / _GIB:,.2f} GiB"


def _print_table(plan: Any, source: str, mem: dict[str, Any], args: argparse.Namespace) -> None:
    from kvstream.planning import UniformTypeSpec

    specs = plan.grouping.specs
    kinds: dict[str, int] = {}
    for s in specs.values():
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    first_attn = next((s for s in specs.values() if hasattr(s, "num_kv_heads")), None)
    model = f"{len(specs)} layers" + (
        ": " + ", ".join(f"{n} {k}" for k, n in kinds.items()) if kinds else " (attention-free)"
    )
    if first_attn is not None:
        model += (f"; {first_attn.num_kv_heads} KV head(s)/GPU x {first_attn.head_size}, "
                  f"{first_attn.dtype}")
    reserved = []
    if mem["weights_per_gpu_bytes"]:
        reserved.append(f"- {_gib(mem['weights_per_gpu_bytes'])} weights")
    if mem["non_kv_memory_bytes"]:
        reserved.append(f"- {_gib(mem['non_kv_memory_bytes'])} non-KV")
    memory = " ".join([f"{_gib(mem['gpu_memory_bytes'])} x {mem['gpu_memory_utilization']:.2f}",
                       *reserved, f"= {_gib(mem['kv_cache_bytes'])} per GPU"])

    rows = [
        ("source", source),
        ("model", model),
        ("parallelism", f"TP {args.tensor_parallel} x PP {args.pipeline_parallel}"),
        ("KV cache memory", memory),
        ("grouping", f"{plan.grouping.rule}: {len(plan.groups)} group(s)"
                     + (f" of {plan.grouping.group_size} layer slots" if plan.groups else "")),
    ]
    if plan.attention_free:
        rows.append(("KV cache", "none: the model keeps no KV cache (1 null block)"))
    else:
        rows += [
            ("block size", f"{plan.block_size} tokens"),
            ("num blocks", f"{plan.num_blocks:,}"
             + (" (override)" if plan.num_gpu_blocks_override is not None else "")),
            ("KV cache size", f"{plan.kv_cache_tokens:,} tokens"),
            ("per request", f"{_gib(plan.memory_per_request_bytes)} ({plan.blocks_per_request:,} "
                            f"blocks) at max_model_len {plan.max_model_len:,}"),
            ("max concurrency", f"{plan.max_concurrency:,.2f}x"),
        ]
    width = max(len(k) for k, _ in rows)
    print("KV cache plan")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")

    if plan.groups:
        print()
        table: list[tuple[str, ...]] = [("group", "kind", "layers", "block", "page B", "blocks/request")]
        for i, g in enumerate(plan.groups):
            per_layer = isinstance(g.spec, UniformTypeSpec)
            table.append((
                str(i),
                g.spec.kind + (" (per-layer sizes)" if per_layer else ""),
                str(len(g.layer_names)),
                str(g.spec.block_size),
                f"{g.spec.page_size_bytes:,}",
                f"{-(-g.spec.max_memory_usage_bytes(plan.max_model_len, plan.max_num_batched_tokens) // g.spec.page_size_bytes):,}",
            ))
        _print_columns(table)
        print()
        table = [("worker", "layers", "KV cache", "blocks fit", "tensors")]
        for w in plan.workers:
            sizes = sorted({t.size_bytes for t in w.tensors})
            shared = max((len(t.shared_by) for t in w.tensors), default=0)
            tensors = (f"{len(w.tensors)} x {_gib(sizes[0])}" if len(sizes) == 1
                       else f"{len(w.tensors)} of {_gib(sizes[0])}..{_gib(sizes[-1])}")
            table.append((str(w.index), str(len(w.layer_names)), _gib(w.kv_cache_bytes),
                          f"{w.num_blocks_fit:,}", f"{tensors}, each shared by <= {shared} layer(s)"))
        _print_columns(table)

    print()
    if plan.grouping.padding:
        for p in plan.grouping.padding:
            print(f"padding: {p.num_padding_layers} layer slot(s) on the {p.num_layers} {p.kind} "
                  f"layers: up to {100 * p.max_waste_fraction:.2f}% of their KV memory wasted")
        print(f"padding: {plan.grouping.num_padding_slots} of "
              f"{len(plan.groups) * plan.grouping.group_size} layer slots are padding "
              f"({100 * plan.grouping.pool_waste_fraction:.2f}% of the pool)")
    else:
        print("padding: none")
    shown = {p.message for p in plan.grouping.padding}
    for w in plan.warnings:
        if w not in shown:
            print(f"warning: {w}")


def _print_columns(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
