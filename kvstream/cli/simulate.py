"""``kvstream simulate``: compare routing policies on a trace in virtual time.

A grid of policies x engine counts over one workload (a Mooncake trace or the built-in
synthetic one), printed as a table next to the workload's reuse ceiling (the hit rate an
infinite cache shared by all engines would get) and the cache capacity simulated,
optionally written as JSON and plotted. Deterministic for a given seed.

Flags that exist in vLLM have vLLM's names (``--block-size``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--num-gpu-blocks-override``, ``--gpu-memory-utilization``,
``--max-model-len``, ``--prefix-caching-hash-algo``), shared with ``kvstream plan`` and
``kvstream engine`` (``--prefill-tokens-per-s``). The older spellings (``--blocks``,
``--max-running``, ``--max-batched-tokens``, ``--hash-algo``, ``--prefill-rate``) still
work, with a warning.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

from kvstream.cli._common import (
    CLIError,
    add_deprecated_alias,
    add_log_level,
    check_block_memory,
    check_output_path,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
)

_EPILOG = """\
examples:
  kvstream simulate --trace examples/traces/mooncake_conversation.jsonl.xz --engines 8
  kvstream simulate --trace t.jsonl --engines 4,8,16 --json out.json --plot out.svg
  kvstream simulate --requests 5000 --policies kv-aware,round-robin --seed 3
  kvstream simulate --kv-overlap-score-weight 2 --queue-weight 0.2
  kvstream simulate --trace examples/traces/mooncake_conversation.jsonl.xz --limit 600 --engines 4 \
      --arrival-scale 4 --max-input 8192 --max-output 16 --block-size 64 --token-granularity 16 \
      --num-gpu-blocks-override 4096 --prefill-tokens-per-s 50000 --decode-step 0.02
      (bench/bench_routers.py's Mooncake run, simulated)

Trace defaults: 512-token engine blocks (one Mooncake hash id per block) and token
granularity 32 (a 512-token block is simulated as 32 tokens; see docs/simulator.md).
"""

PLOT_SUFFIXES = (".png", ".svg", ".pdf")

SYNTHETIC_RATE_PER_ENGINE = 2.0
"""Requests per second per engine the built-in synthetic workload offers by default: what
the default engines serve with room to spare under KV-aware routing (TTFT p99 ~0.1 s, no
preemptions), while KV-blind routing already queues (TTFT p99 1-3 s). A faster workload is
one flag away (--duration, --arrival-scale)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``simulate`` sub-command."""
    p = sub.add_parser(
        "simulate",
        help="compare routing policies on a request trace (virtual time)",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_args(p)
    add_engine_args(p)
    p.add_argument("--engines", default="8", help="engine count, or a comma list for a grid (default 8)")
    add_routing_args(p)
    p.add_argument("--router-index", choices=("engine", "token"), default="engine",
                   help="router matches by the engines' block hashes (engine, default, faster) or by its own "
                        "token keys (token); same decisions")
    p.add_argument("--wire", action="store_true",
                   help="round-trip every batch through the wire codec before the router (slower; same results)")
    p.add_argument("--router-lag", type=non_negative_float, default=0.0, metavar="S",
                   help="simulated seconds between a batch's publication and its application (default 0)")
    p.add_argument("--speculate", action="store_true",
                   help="KV-aware routers assume the chosen engine holds the routed prompt until its events "
                        "arrive or --speculate-ttl passes (as serve --speculate)")
    p.add_argument("--speculate-ttl", type=positive_float, default=2.0, metavar="S",
                   help="life of a speculative entry with --speculate (simulated seconds, default 2)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="plot hit rate and TTFT by policy (.png/.svg/.pdf; needs kvstream[plot])")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    add_log_level(p)
    p.set_defaults(func=_run)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Workload options shared by ``simulate`` and ``demo``."""
    from kvstream.sim.policies import POLICY_NAMES

    g = p.add_argument_group("workload")
    g.add_argument("--trace", metavar="FILE", help="Mooncake-format JSON-lines trace (default: built-in synthetic workload)")
    g.add_argument("--limit", type=positive_int, metavar="N", help="use only the first N requests of the trace")
    g.add_argument("--requests", type=positive_int, metavar="N", help="synthetic workload size (default 2000 requests)")
    g.add_argument("--duration", type=positive_float, metavar="S",
                   help=f"synthetic workload span, seconds of arrivals (default: sized to the engines, "
                        f"{SYNTHETIC_RATE_PER_ENGINE:g} requests/s per engine of the smallest --engines count)")
    g.add_argument("--arrival-scale", type=positive_float, default=1.0, metavar="X",
                   help="offer the workload X times faster (divides arrival times; default 1)")
    g.add_argument("--max-input", type=positive_int, metavar="TOKENS",
                   help="cut every prompt to its first TOKENS tokens (as bench/bench_routers.py does)")
    g.add_argument("--max-output", type=positive_int, metavar="TOKENS",
                   help="cut every output to TOKENS tokens")
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload and the random policy (default 0)")
    g.add_argument("--policies", default=",".join(POLICY_NAMES),
                   help=f"comma list of policies (default: {','.join(POLICY_NAMES)}; also: prefix-only)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine-shape options (vLLM's names where vLLM has the concept; old spellings kept)."""
    from kvstream.cli.plan import parse_memory
    from kvstream.hashing import ALGORITHMS

    g = p.add_argument_group("engines (vLLM's flag names, shared with kvstream engine and kvstream plan)")
    a = g.add_argument("--num-gpu-blocks-override", dest="blocks", type=positive_int, metavar="N",
                       help="KV blocks per engine (default: 1024 for traces, 2048 synthetic)")
    add_deprecated_alias(g, a, "--blocks")
    g.add_argument("--block-size", type=positive_int, metavar="T",
                   help="tokens per block (default: 512 for traces, 16 synthetic)")
    g.add_argument("--token-granularity", type=positive_int, metavar="G",
                   help="real tokens per simulated token (default: 32 for traces, 1 synthetic)")
    a = g.add_argument("--prefill-tokens-per-s", dest="prefill_rate", type=positive_float, default=16000.0,
                       metavar="TOK/S", help="prompt tokens computed per second (default 16000)")
    add_deprecated_alias(g, a, "--prefill-rate")
    g.add_argument("--decode-step", type=positive_float, default=0.025, metavar="S",
                   help="seconds per engine step; each running request decodes one token per step (default 0.025)")
    a = g.add_argument("--max-num-seqs", dest="max_running", type=positive_int, default=64,
                       metavar="N", help="max running requests per engine (default 64)")
    add_deprecated_alias(g, a, "--max-running")
    a = g.add_argument("--max-num-batched-tokens", dest="max_batched_tokens",
                       type=positive_int, default=8192, metavar="T", help="token budget per step (default 8192)")
    add_deprecated_alias(g, a, "--max-batched-tokens")
    a = g.add_argument("--prefix-caching-hash-algo", dest="hash_algo", default="native",
                       choices=ALGORITHMS, metavar="ALGO",
                       help=f"engine block hash algorithm: {', '.join(ALGORITHMS)} (default native)")
    add_deprecated_alias(g, a, "--hash-algo")
    g.add_argument("--model-config", metavar="CONFIG_JSON",
                   help="size engines from a Hugging Face config.json (with --gpu-memory or --kv-memory-gib); "
                        "--num-gpu-blocks-override still wins, as in vLLM")
    g.add_argument("--gpu-memory", type=parse_memory, metavar="SIZE",
                   help="with --model-config: memory of one GPU (80, 80GiB, 141GB); the KV cache gets "
                        "SIZE x --gpu-memory-utilization (as in kvstream plan)")
    g.add_argument("--gpu-memory-utilization", type=fraction, metavar="F",
                   help="with --gpu-memory: share of it for the KV cache (default 0.9)")
    g.add_argument("--kv-memory-gib", type=positive_float, metavar="GIB",
                   help="with --model-config and no --gpu-memory: KV cache memory per engine (default 40)")
    g.add_argument("--max-model-len", type=positive_int, metavar="TOKENS",
                   help="with --model-config: longest request (default: the config's context length)")


def add_routing_args(p: argparse.ArgumentParser) -> None:
    """Weights of the ``kv-aware`` policy's score (the router's
    :class:`~kvstream.routing.scoring.PrefixLoadPolicy`)."""
    g = p.add_argument_group(
        "routing weights of the kv-aware policy: score = W_overlap x cached share of the prompt "
        "- W_queue x waiting - W_running x running - W_kv x KV usage")
    g.add_argument("--kv-overlap-score-weight", type=non_negative_float, metavar="W",
                   help="weight of the cached prefix (Dynamo's name; default 1.0)")
    g.add_argument("--queue-weight", type=non_negative_float, metavar="W",
                   help="penalty per waiting request (default 0.1)")
    g.add_argument("--running-weight", type=non_negative_float, metavar="W",
                   help="penalty per running request (default 0.02)")
    g.add_argument("--kv-usage-weight", type=non_negative_float, metavar="W",
                   help="penalty per unit of KV cache usage, 0..1 (default 0.2)")


def kv_scoring(args: argparse.Namespace) -> Any:
    """The kv-aware policy's scoring with the weights the flags set (None: defaults)."""
    from kvstream.routing.scoring import PrefixLoadPolicy

    flags = {"prefix_weight": "kv_overlap_score_weight", "queue_weight": "queue_weight",
             "running_weight": "running_weight", "kv_weight": "kv_usage_weight"}
    given: dict[str, float] = {}
    for field, flag in flags.items():
        v = getattr(args, flag, None)
        if v is not None:
            given[field] = float(v)
    return PrefixLoadPolicy(**given) if given else None  # type: ignore[arg-type]


def load_workload(args: argparse.Namespace, *, default_requests: int = 2000, engines: int = 8) -> tuple[list[Any], dict[str, Any]]:
    """The workload the options describe, and a description of it for the JSON meta.
    ``engines``: the smallest engine count simulated; the synthetic workload's default span
    offers :data:`SYNTHETIC_RATE_PER_ENGINE` requests per second per engine to it."""
    from kvstream.sim.workload import (
        SyntheticConfig,
        WorkloadError,
        compress_arrivals,
        cut_lengths,
        load_mooncake,
        synthetic_workload,
    )

    if args.trace:
        reqs = load_mooncake(args.trace, limit=args.limit)
        if not reqs:
            raise WorkloadError(f"trace {args.trace} holds no requests; give a Mooncake JSON-lines "
                                "trace with one request per line")
        meta: dict[str, Any] = {"trace": str(args.trace), "limit": args.limit}
    else:
        requests = args.requests or default_requests
        cfg = SyntheticConfig(
            requests=requests,
            duration=args.duration or requests / (SYNTHETIC_RATE_PER_ENGINE * engines),
            seed=args.seed,
        )
        reqs = synthetic_workload(cfg)
        meta = {"synthetic": {"requests": cfg.requests, "duration": cfg.duration, "seed": cfg.seed}}
    if getattr(args, "max_input", None) or getattr(args, "max_output", None):
        reqs = cut_lengths(reqs, args.max_input, args.max_output)
        meta.update(max_input=args.max_input, max_output=args.max_output)
    if args.arrival_scale != 1.0:
        reqs = compress_arrivals(reqs, args.arrival_scale)
    meta["arrival_scale"] = args.arrival_scale
    meta["requests"] = len(reqs)
    return reqs, meta


def engine_config(args: argparse.Namespace) -> Any:
    """The :class:`~kvstream.sim.engine.EngineConfig` the options describe."""
    from kvstream.sim.engine import EngineConfig

    trace = bool(args.trace)
    bs = args.block_size or (512 if trace else 16)
    g = args.token_granularity or (32 if trace and bs % 32 == 0 else 1)
    blocks = args.blocks or (1024 if trace else 2048)
    if args.model_config:
        gpu = getattr(args, "gpu_memory", None)
        util = args.gpu_memory_utilization if args.gpu_memory_utilization is not None else 0.9
        kv_bytes = (int(gpu * util) if gpu is not None
                    else int((args.kv_memory_gib or 40.0) * (1 << 30)))
        planned = _blocks_from_model(args.model_config, bs, kv_bytes, getattr(args, "max_model_len", None))
        # As in vLLM: the model is planned (it must fit), then num_gpu_blocks_override replaces the count.
        blocks = args.blocks or planned
    return EngineConfig(
        num_blocks=blocks,
        block_size=bs,
        prefill_rate=args.prefill_rate,
        decode_step_s=args.decode_step,
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        hash_algorithm=args.hash_algo,
        token_granularity=g,
    )


def _blocks_from_model(path: str, block_size: int, kv_bytes: int, max_model_len: int | None = None) -> int:
    from kvstream.planning import KVCachePlanningError, plan_kv_cache, specs_from_hf_config
    from kvstream.planning.hf_config import model_max_len

    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    specs = specs_from_hf_config(cfg, block_size=block_size)
    max_len = max_model_len or model_max_len(cfg)
    if max_len is None:
        raise KVCachePlanningError(
            f"{path} gives no context length (max_position_embeddings or similar), which sizing "
            "needs to check that one request fits; add it to the config, give --max-model-len, or use "
            "--num-gpu-blocks-override instead of --model-config")
    return plan_kv_cache(specs, kv_bytes, max_len).num_blocks


def parse_policies(text: str) -> list[str]:
    """A comma list of policy names, validated."""
    from kvstream.sim.policies import ALL_POLICY_NAMES
    from kvstream.sim.workload import WorkloadError

    names = [s.strip() for s in text.split(",")]
    bad = [n or "(an empty entry)" for n in names if n not in ALL_POLICY_NAMES]
    if bad or not names:
        raise WorkloadError(f"unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(ALL_POLICY_NAMES)}")
    return names


def check_flag_combinations(args: argparse.Namespace) -> None:
    """Refuse flags that the other flags make meaningless (they would be ignored silently)."""
    def given(*names: str) -> list[str]:
        return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None) is not None]

    if args.trace:
        extra = given("requests", "duration")
        if extra:
            raise CLIError(f"{' and '.join(extra)} size the synthetic workload, not a --trace; use --limit N "
                           "to take the first N requests of the trace")
    elif args.limit is not None:
        raise CLIError("--limit takes the first N requests of a --trace; for the synthetic workload use --requests")
    if not args.model_config:
        extra = given("gpu_memory", "gpu_memory_utilization", "kv_memory_gib", "max_model_len")
        if extra:
            raise CLIError(f"{' and '.join(extra)} size engines from a model and need --model-config CONFIG_JSON "
                           "(without it, give --num-gpu-blocks-override)")
    else:
        if args.gpu_memory is not None and args.kv_memory_gib is not None:
            raise CLIError("give --gpu-memory (x --gpu-memory-utilization) or --kv-memory-gib, not both")
        if args.gpu_memory_utilization is not None and args.gpu_memory is None:
            raise CLIError("--gpu-memory-utilization is a share of --gpu-memory; give --gpu-memory too")
        if args.gpu_memory is not None and args.gpu_memory <= 0:
            raise CLIError(f"--gpu-memory must be more than 0 bytes, got {args.gpu_memory}")


def _engine_counts(text: str) -> list[int]:
    counts = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            raise CLIError(f"--engines {text!r}: an empty entry; write counts like 4 or 4,8,16")
        try:
            n = int(part)
        except ValueError:
            n = 0
        if n < 1:
            raise CLIError(f"--engines {text!r}: each engine count must be a positive integer, got {part!r}")
        counts.append(n)
    if not counts:
        raise CLIError("--engines needs at least one engine count")
    return counts


def check_plot_path(path: str) -> None:
    """Before any work: ``--plot`` can be written and plotting is installed."""
    from kvstream.sim.report import PlotUnavailableError, plotting_available

    check_output_path(path, "--plot", suffixes=PLOT_SUFFIXES)
    if not plotting_available():
        raise PlotUnavailableError("--plot needs matplotlib: pip install 'kvstream[plot]' (or drop --plot)")


def _run(args: argparse.Namespace) -> int:
    from kvstream.planning import KVCachePlanningError
    from kvstream.sim.blocks import SegmentHasher
    from kvstream.sim.ceiling import reuse_ceiling
    from kvstream.sim.report import PlotUnavailableError, capacity_line, format_table, plot_results, write_json
    from kvstream.sim.run import SimConfig, compare
    from kvstream.sim.workload import WorkloadError

    try:
        # Everything the user can get wrong is checked before the first simulated second.
        policies = parse_policies(args.policies)
        counts = _engine_counts(args.engines)
        check_flag_combinations(args)
        if args.json:
            check_output_path(args.json, "--json")
        if args.plot:
            check_plot_path(args.plot)
        scoring = kv_scoring(args)
        if scoring is not None and "kv-aware" not in policies:
            raise CLIError("routing weights apply to the kv-aware policy, which --policies leaves out")
        ec = engine_config(args)
        check_block_memory(max(counts) * ec.num_blocks, f"{max(counts)} engines x {ec.num_blocks:,} blocks",
                           "use fewer engines or blocks (--num-gpu-blocks-override)")
        reqs, meta = load_workload(args, engines=min(counts))
        cfg = SimConfig(engines=counts[0], engine=ec, router_lag_s=args.router_lag, seed=args.seed,
                        wire=args.wire, router_index=args.router_index, kv_scoring=scoring,
                        speculate_ttl_s=args.speculate_ttl if args.speculate else None)
    except (WorkloadError, KVCachePlanningError, PlotUnavailableError, OSError, ValueError) as exc:
        print(f"kvstream simulate: {exc}", file=sys.stderr)
        return 2

    done: list[Any] = []
    total = len(policies) * len(counts)

    interrupted = False

    def on_sigint(signum: int, frame: Any) -> None:
        # Remembered as well as raised: a KeyboardInterrupt that lands inside a C call
        # which swallows errors (seen under CPU contention) would otherwise be lost and the
        # remaining runs would all be simulated; progress() raises it again between runs.
        nonlocal interrupted
        interrupted = True
        raise KeyboardInterrupt

    def progress(r: Any) -> None:
        done.append(r)
        if interrupted:
            raise KeyboardInterrupt
        if not args.quiet:
            print(f"  {r.policy:<13} {r.engines:>3} engines: hit {100 * r.hit_rate:5.1f}%  "
                  f"TTFT p50 {r.ttft_p50_s:.3f}s  ({r.requests_per_wall_s:,.0f} req/s wall)", file=sys.stderr)

    if not args.quiet:
        if "synthetic" in meta:
            syn = meta["synthetic"]
            print(f"built-in synthetic workload: {syn['requests']} requests over {syn['duration']:g} s"
                  + ("" if args.duration else f" ({SYNTHETIC_RATE_PER_ENGINE:g}/s per engine at {min(counts)} engines; "
                     "--duration or --arrival-scale offer more)"), file=sys.stderr)
        print(f"simulating {len(reqs)} requests: {total} run(s) ({len(policies)} policies x "
              f"{len(counts)} engine count(s)); Ctrl-C stops and prints the finished runs", file=sys.stderr)
    t0 = time.perf_counter()
    hasher = SegmentHasher(ec.block_hasher())
    prepared: dict[int, Any] = {}
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main_thread else None
    try:
        ceiling = reuse_ceiling(reqs, ec, hasher=hasher, prepared=prepared)
        results = compare(reqs, policies, cfg, engine_counts=counts, progress=progress,
                          hasher=hasher, prepared=prepared)
    except KeyboardInterrupt:
        if done:
            print(format_table(done))
        kept = (f"the table above shows the {len(done)} finished run(s) of {total}" if done
                else f"none of the {total} runs had finished")
        print(f"kvstream simulate: interrupted; {kept}; nothing was written"
              + (f" ({', '.join(x for x in (args.json, args.plot) if x)} not created)" if args.json or args.plot
                 else ""), file=sys.stderr)
        return 130
    finally:
        if main_thread and previous is not None:
            signal.signal(signal.SIGINT, previous)
    wall = time.perf_counter() - t0
    print(format_table(results, ceiling=ceiling.hit_rate))
    print(f"\nreuse ceiling: {100 * ceiling.hit_rate:.1f}% of prompt tokens (an infinite cache shared by all "
          f"engines; 'of best' = hit / ceiling)")
    for n in counts:
        print(capacity_line(n, ec, ceiling.distinct_blocks))
    print(f"{len(reqs)} requests x {len(results)} runs in {wall:.2f}s wall "
          f"(block {ec.block_size} tokens, granularity {ec.token_granularity})")
    meta.update(engine=_engine_meta(ec), seed=args.seed, router_lag_s=args.router_lag, wire=args.wire,
                speculate_ttl_s=args.speculate_ttl if args.speculate else None,
                router_index=args.router_index, reuse_ceiling=_struct_dict(ceiling),
                kv_scoring=_scoring_meta(scoring))
    try:
        if args.json:
            write_json(args.json, results, meta)
            print(f"wrote {args.json}")
        if args.plot:
            plot_results(args.plot, results, title=_plot_title(meta, ec, counts), ceiling=ceiling.hit_rate)
            print(f"wrote {args.plot}")
    except OSError as exc:
        print(f"kvstream simulate: writing {exc.filename or args.json or args.plot} failed: {exc.strerror or exc} "
              "(the table above is complete)", file=sys.stderr)
        return 1
    return 0


def _plot_title(meta: dict[str, Any], ec: Any, counts: list[int]) -> str:
    import os

    what = os.path.basename(str(meta["trace"])) if "trace" in meta else "synthetic workload"
    return (f"{what}: {meta['requests']} requests, {'/'.join(map(str, counts))} engines x "
            f"{ec.num_blocks} blocks of {ec.block_size} tokens")


def _struct_dict(s: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(s)


def _scoring_meta(scoring: Any) -> dict[str, Any] | None:
    if scoring is None:
        return None
    return {"prefix_weight": scoring.prefix_weight, "queue_weight": scoring.queue_weight,
            "running_weight": scoring.running_weight, "kv_weight": scoring.kv_weight}


def _engine_meta(ec: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(ec)
