"""``kvstream demo``: simulated engines, a router and a recorder on loopback, then a policy
comparison and a log replay check.

1. Starts ``--engines`` simulated engines (each an async task with a real publisher on
   loopback tcp or ipc), a real router subscribed to them and a recorder writing the
   stream to ``OUT/events.kvlog``; replays the built-in synthetic workload live (about 20 s
   by default) routed by the first policy, with a progress line.
2. Runs every policy on the same workload in virtual time and prints the comparison
   table (the live run is its own row), and writes ``OUT/results.json``.
3. Replays the log into a fresh index and checks it equals the router's live index (exit
   status 1 if not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvstream.cli.simulate import add_engine_args, add_workload_args


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` sub-command."""
    p = sub.add_parser(
        "demo",
        help="run simulated engines + router + recorder on loopback and compare routing policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_args(p)
    add_engine_args(p)
    p.add_argument("--engines", type=int, default=4, help="simulated engines (default 4)")
    p.add_argument("--speed", default="1x",
                   help="live replay speed: '1x' real time, '10x', ... (default 1x; must be finite)")
    p.add_argument("--transport", choices=("tcp", "ipc"), default="tcp", help="loopback transport (default tcp)")
    p.add_argument("--out", default="kvstream-demo", metavar="DIR", help="output directory (default ./kvstream-demo)")
    p.add_argument("--quick", action="store_true", help="a small workload that finishes in a few seconds (for CI)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import anyio

    from kvstream.eventlog.reader import LogReader
    from kvstream.eventlog.replay import replay_into_index
    from kvstream.routing.index import KVIndex
    from kvstream.planning import KVCachePlanningError
    from kvstream.sim.live import LiveProgress, run_live
    from kvstream.sim.report import format_table, write_json
    from kvstream.sim.run import SimConfig, compare
    from kvstream.sim.workload import WorkloadError, parse_speed
    from kvstream.cli.simulate import engine_config, load_workload, parse_policies

    if args.quick:
        args.requests = args.requests or 150
        args.duration = args.duration or 3.0
        if args.speed == "1x":
            args.speed = "2x"
    try:
        policies = parse_policies(args.policies)
        scale = parse_speed(args.speed)
        if scale.virtual:
            raise WorkloadError("the live demo needs a finite --speed such as '1x' or '10x' ('max' is for simulate)")
        ec = engine_config(args)
        reqs, meta = load_workload(args, default_requests=450, default_duration=20.0)
    except (WorkloadError, KVCachePlanningError, OSError, ValueError) as exc:
        print(f"kvstream demo: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "events.kvlog"
    if log_path.exists():
        log_path.unlink()
    span = max((r.arrival for r in reqs), default=0.0)
    print(f"kvstream demo: {args.engines} engines on loopback {args.transport}, {len(reqs)} requests over "
          f"{span:.1f}s simulated at {scale.speed:g}x, live policy {policies[0]}, "
          f"{ec.num_blocks} blocks x {ec.block_size} tokens per engine")
    tty = sys.stdout.isatty()

    def show(p: LiveProgress) -> None:
        line = (f"  t={p.sim_time:6.1f}s  arrived {p.arrived}/{p.total}  done {p.completed}  "
                f"hit {100 * p.hit_rate:5.1f}%  events {p.events}  router lag p50 {p.lag_p50_ms:.2f} ms")
        print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)

    live = anyio.run(lambda: run_live(
        reqs, policies[0], engines=args.engines, config=ec, speed=scale.speed, log_path=log_path,
        transport=args.transport, seed=args.seed, progress=show))
    if tty:
        print()
    lr = live.result
    print(f"live run: {lr.completed}/{lr.requests} requests in {lr.wall_seconds:.1f}s wall, "
          f"{live.batches_published} batches published, {live.batches_recorded} recorded -> {log_path}")

    t0 = time.perf_counter()
    results = compare(reqs, policies, SimConfig(engines=args.engines, engine=ec, seed=args.seed))
    print(f"\npolicies in virtual time ({time.perf_counter() - t0:.2f}s wall for {len(policies)} runs):\n")
    print(format_table([lr] + results))

    reader = LogReader(log_path)
    fresh = KVIndex(router_block_size=ec.sim_block_size)
    n = replay_into_index(reader, fresh)
    for name in live.sources:  # sources known to the router but silent have no records
        fresh.add_source(name)
    equal = fresh.state() == live.router_index.state()
    damage = list(reader.damage)
    blocks = sum(len(s["blocks"]) for s in fresh.state()["sources"].values())
    print(f"\nreplay: {n} log items -> fresh index with {blocks} blocks: "
          f"{'EQUAL to the live router index' if equal and not damage else 'DIFFERENT from the live router index'}"
          + (f" ({len(damage)} damaged places)" if damage else ""))
    meta.update(engines=args.engines, speed=scale.speed, transport=args.transport, live_policy=policies[0],
                replay_equal=equal, log=str(log_path))
    write_json(out / "results.json", [lr] + results, meta)
    print(f"wrote {out / 'results.json'}")
    return 0 if equal and not damage else 1
