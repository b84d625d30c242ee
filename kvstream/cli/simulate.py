"""``kvstream simulate``: compare routing policies on a trace in virtual time.

A grid of policies x engine counts over one workload (a Mooncake trace or the built-in
synthetic one), printed as a table, optionally written as JSON and plotted. Deterministic
for a given seed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

_EPILOG = """\
examples:
  kvstream simulate --trace mooncake_conversation.jsonl --engines 8
  kvstream simulate --trace t.jsonl --engines 4,8,16 --json out.json --plot out.svg
  kvstream simulate --requests 5000 --policies kv-aware,round-robin --seed 3

Trace defaults: 512-token engine blocks (one Mooncake hash id per block) and token
granularity 32 (a 512-token block is simulated as 32 tokens; see docs/simulator.md).
"""


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
    p.add_argument("--router-index", choices=("engine", "token"), default="engine",
                   help="router matches by the engines' block hashes (engine, default, faster) or by its own "
                        "token keys (token); same decisions")
    p.add_argument("--wire", action="store_true",
                   help="round-trip every batch through the wire codec before the router (slower; same results)")
    p.add_argument("--router-lag", type=float, default=0.0, metavar="S",
                   help="simulated seconds between a batch's publication and its application (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="plot hit rate and TTFT by policy (.png/.svg; needs kvstream[plot])")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    p.set_defaults(func=_run)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Workload options shared by ``simulate`` and ``demo``."""
    from kvstream.sim.policies import POLICY_NAMES

    g = p.add_argument_group("workload")
    g.add_argument("--trace", metavar="FILE", help="Mooncake-format JSON-lines trace (default: built-in synthetic workload)")
    g.add_argument("--limit", type=int, metavar="N", help="use only the first N requests of the trace")
    g.add_argument("--requests", type=int, metavar="N", help="synthetic workload size (requests)")
    g.add_argument("--duration", type=float, metavar="S", help="synthetic workload span (seconds of arrivals)")
    g.add_argument("--arrival-scale", type=float, default=1.0, metavar="X",
                   help="offer the workload X times faster (divides arrival times; default 1)")
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload and the random policy (default 0)")
    g.add_argument("--policies", default=",".join(POLICY_NAMES),
                   help=f"comma list of policies (default: {','.join(POLICY_NAMES)}; also: prefix-only)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine-shape options shared by ``simulate`` and ``demo``."""
    g = p.add_argument_group("engines")
    g.add_argument("--blocks", type=int, metavar="N", help="KV blocks per engine (default: 1024 for traces, 2048 synthetic)")
    g.add_argument("--block-size", type=int, metavar="T", help="tokens per block (default: 512 for traces, 16 synthetic)")
    g.add_argument("--token-granularity", type=int, metavar="G",
                   help="real tokens per simulated token (default: 32 for traces, 1 synthetic)")
    g.add_argument("--prefill-rate", type=float, default=16000.0, metavar="TOK/S", help="prefill tokens per second (default 16000)")
    g.add_argument("--decode-step", type=float, default=0.025, metavar="S", help="seconds per engine step (default 0.025)")
    g.add_argument("--max-running", type=int, default=64, help="max running requests per engine (default 64)")
    g.add_argument("--max-batched-tokens", type=int, default=8192, help="token budget per step (default 8192)")
    g.add_argument("--hash-algo", default="native", help="engine block hash algorithm (default native)")
    g.add_argument("--model-config", metavar="CONFIG_JSON",
                   help="size engines from a Hugging Face config.json (with --kv-memory-gib) instead of --blocks")
    g.add_argument("--kv-memory-gib", type=float, default=40.0, metavar="GIB",
                   help="KV cache memory per engine for --model-config (default 40)")


def load_workload(args: argparse.Namespace, *, default_requests: int = 2000, default_duration: float = 20.0) -> tuple[list[Any], dict[str, Any]]:
    """The workload the options describe, and a description of it for the JSON meta."""
    from kvstream.sim.workload import SyntheticConfig, compress_arrivals, load_mooncake, synthetic_workload

    if args.trace:
        reqs = load_mooncake(args.trace, limit=args.limit)
        meta: dict[str, Any] = {"trace": str(args.trace), "limit": args.limit}
    else:
        cfg = SyntheticConfig(
            requests=args.requests or default_requests,
            duration=args.duration or default_duration,
            seed=args.seed,
        )
        reqs = synthetic_workload(cfg)
        meta = {"synthetic": {"requests": cfg.requests, "duration": cfg.duration, "seed": cfg.seed}}
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
        blocks = _blocks_from_model(args.model_config, bs, args.kv_memory_gib)
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


def _blocks_from_model(path: str, block_size: int, gib: float) -> int:
    from kvstream.planning import KVCachePlanningError, plan_kv_cache, specs_from_hf_config
    from kvstream.planning.hf_config import model_max_len

    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    specs = specs_from_hf_config(cfg, block_size=block_size)
    max_len = model_max_len(cfg)
    if max_len is None:
        raise KVCachePlanningError(
            f"{path} gives no context length (max_position_embeddings or similar), which sizing "
            "needs to check that one request fits; add it to the config, or use --blocks instead "
            "of --model-config")
    return plan_kv_cache(specs, int(gib * (1 << 30)), max_len).num_blocks


def parse_policies(text: str) -> list[str]:
    """A comma list of policy names, validated."""
    from kvstream.sim.policies import ALL_POLICY_NAMES
    from kvstream.sim.workload import WorkloadError

    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in ALL_POLICY_NAMES]
    if bad or not names:
        raise WorkloadError(f"unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(ALL_POLICY_NAMES)}")
    return names


def _run(args: argparse.Namespace) -> int:
    from kvstream.planning import KVCachePlanningError
    from kvstream.sim.report import PlotUnavailableError, format_table, plot_results, write_json
    from kvstream.sim.run import SimConfig, compare
    from kvstream.sim.workload import WorkloadError

    try:
        policies = parse_policies(args.policies)
        counts = [int(x) for x in str(args.engines).split(",") if x.strip()]
        ec = engine_config(args)
        reqs, meta = load_workload(args)
        cfg = SimConfig(engines=counts[0], engine=ec, router_lag_s=args.router_lag, seed=args.seed,
                        wire=args.wire, router_index=args.router_index)
    except (WorkloadError, KVCachePlanningError, OSError, ValueError) as exc:
        print(f"kvstream simulate: {exc}", file=sys.stderr)
        return 2

    def progress(r: Any) -> None:
        if not args.quiet:
            print(f"  {r.policy:<13} {r.engines:>3} engines: hit {100 * r.hit_rate:5.1f}%  "
                  f"TTFT p50 {r.ttft_p50_s:.3f}s  ({r.requests_per_wall_s:,.0f} req/s wall)", file=sys.stderr)

    t0 = time.perf_counter()
    results = compare(reqs, policies, cfg, engine_counts=counts, progress=progress)
    wall = time.perf_counter() - t0
    print(format_table(results))
    print(f"\n{len(reqs)} requests x {len(results)} runs in {wall:.2f}s wall "
          f"(block {ec.block_size} tokens, granularity {ec.token_granularity}, {ec.num_blocks} blocks/engine)")
    meta.update(engine=_engine_meta(ec), seed=args.seed, router_lag_s=args.router_lag, wire=args.wire,
                router_index=args.router_index)
    if args.json:
        write_json(args.json, results, meta)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plot_results(args.plot, results, title=str(meta.get("trace", "synthetic workload")))
        except PlotUnavailableError as exc:
            print(f"kvstream simulate: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


def _engine_meta(ec: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(ec)
