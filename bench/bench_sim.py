"""Simulator speed: requests per second of wall time, Mooncake conversation trace, 8 engines,
virtual time (every KV event into the router index, routing and all; ``--wire``: every
batch also encoded and decoded with the real codec on the way).

Target (issue): >= 10,000 requests/s of wall time for the *cold* end-to-end run: load the
trace, prepare every request (tokens, engine block hashes, router keys) and simulate one
policy (kv-aware). Run:

    python bench/bench_sim.py [TRACE] [--repeat N] [--limit N] [--granularity G] [--policies a,b] [--wire]

Each repeat is a fresh process (so "cold" is cold: no token or hash memo survives). Per
repeat it prints the cold end-to-end time of the first policy, then one warm run of every
policy (preparation shared with the cold run). With ``--repeat`` > 1 it ends with the
range (min-max) of every row: the machine is shared, so single numbers mislead.

Reference, in the same process after the runs: the floor of any cold run, reading the
trace and parsing each line with ``json.loads`` and nothing else.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "examples" / "traces" / "mooncake_conversation.jsonl.xz"


def _child(a: argparse.Namespace) -> None:
    from kvstream.sim.blocks import SegmentHasher
    from kvstream.sim.engine import EngineConfig
    from kvstream.sim.run import SimConfig, SimRun
    from kvstream.sim.workload import load_mooncake

    policies = a.policies.split(",")
    t0 = time.perf_counter()
    reqs = load_mooncake(a.trace, limit=a.limit)
    t_load = time.perf_counter() - t0
    ec = EngineConfig(num_blocks=a.blocks, block_size=a.block_size, token_granularity=a.granularity)
    cfg = SimConfig(engines=a.engines, engine=ec, wire=a.wire)
    hasher = SegmentHasher(ec.block_hasher())
    prepared: dict = {}
    r = SimRun(reqs, policies[0], cfg, hasher=hasher, prepared=prepared).run()
    total = time.perf_counter() - t0
    rows = [{"row": f"{policies[0]} cold (load+prepare+run)", "wall": total, "rps": len(reqs) / total,
             "eps": r.events / total, "hit": r.hit_rate, "load": t_load}]
    for p in policies:
        r = SimRun(reqs, p, cfg, hasher=hasher, prepared=prepared).run()
        rows.append({"row": f"{p} warm", "wall": r.wall_seconds, "rps": r.requests_per_wall_s,
                     "eps": r.events_per_wall_s, "hit": r.hit_rate})
    t0 = time.perf_counter()
    with open(a.trace, "rb") as f:
        parsed = [json.loads(line) for k, line in enumerate(f) if a.limit is None or k < a.limit]
    floor = time.perf_counter() - t0
    rows.append({"row": "reference: json.loads of the trace", "wall": floor, "rps": len(parsed) / floor,
                 "eps": 0.0, "hit": 0.0})
    print(json.dumps({"requests": len(reqs), "rows": rows}))


def _show(row: dict) -> str:
    if row["row"].startswith("reference"):
        return f"{row['row']:34} {row['wall']:6.2f}s wall {row['rps']:8,.0f} req/s"
    return (f"{row['row']:34} {row['wall']:6.2f}s wall {row['rps']:8,.0f} req/s "
            f"{row['eps']:9,.0f} events/s  hit {100 * row['hit']:.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--granularity", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--policies", default="kv-aware,round-robin,kv-load,least-loaded,random")
    ap.add_argument("--repeat", type=int, default=1, help="fresh processes to run (ranges are printed)")
    ap.add_argument("--wire", action="store_true", help="round-trip every batch through the codec (SimConfig.wire)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a)
        return
    args = [sys.executable, __file__, "--child", a.trace, "--engines", str(a.engines),
            "--granularity", str(a.granularity), "--block-size", str(a.block_size),
            "--blocks", str(a.blocks), "--policies", a.policies] + (["--wire"] if a.wire else [])
    if a.limit is not None:
        args += ["--limit", str(a.limit)]
    runs = []
    for k in range(a.repeat):
        out = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
        runs.append(out)
        print(f"run {k + 1}/{a.repeat}: {out['requests']} requests, trace loaded in {out['rows'][0]['load']:.2f}s")
        for row in out["rows"]:
            print("  " + _show(row))
    if a.repeat > 1:
        print(f"ranges over {a.repeat} runs (min-max):")
        for i, row in enumerate(runs[0]["rows"]):
            walls = [r["rows"][i]["wall"] for r in runs]
            rps = [r["rows"][i]["rps"] for r in runs]
            print(f"  {row['row']:34} {min(walls):5.2f}-{max(walls):5.2f}s wall "
                  f"{min(rps):7,.0f}-{max(rps):7,.0f} req/s")


if __name__ == "__main__":
    main()
