"""Simulator speed: requests per second of wall time, Mooncake conversation trace, 8 engines,
virtual time (events through the real codec into the router index, routing and all).

Target (issue): >= 10,000 requests/s of wall time. Run:
    python bench/bench_sim.py [TRACE] [--limit N] [--granularity G] [--policies a,b]

Prints, per policy, the wall time and requests/s of one run. The first run of a workload
also prepares each request once (tokens + engine block hashes, shared by later runs); it
is reported separately ("cold"), later runs reuse it ("warm").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvstream.sim.engine import EngineConfig
from kvstream.sim.run import SimConfig, SimRun
from kvstream.sim.blocks import SegmentHasher
from kvstream.sim.workload import load_mooncake

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--granularity", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--policies", default="round-robin,kv-aware,kv-load,least-loaded,random")
    a = ap.parse_args()
    t = time.perf_counter()
    reqs = load_mooncake(a.trace, limit=a.limit)
    print(f"loaded {len(reqs)} requests in {time.perf_counter() - t:.2f}s")
    ec = EngineConfig(num_blocks=a.blocks, block_size=a.block_size, token_granularity=a.granularity)
    cfg = SimConfig(engines=8, engine=ec)
    hasher = SegmentHasher(ec.block_hasher())
    prepared: dict = {}
    for k, p in enumerate(a.policies.split(",")):
        run = SimRun(reqs, p, cfg, hasher=hasher, prepared=prepared)
        r = run.run()
        tag = "cold" if k == 0 else "warm"
        print(f"{p:13} {tag}: {r.wall_seconds:6.2f}s wall  {r.requests_per_wall_s:8,.0f} req/s  "
              f"{r.events_per_wall_s:9,.0f} events/s  hit {100 * r.hit_rate:.1f}%")


if __name__ == "__main__":
    main()
