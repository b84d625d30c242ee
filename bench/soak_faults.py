"""Soak the subscriber's recovery rules with the deterministic fault campaign.

    python bench/soak_faults.py [--seeds 100000] [--start 0]

Runs seeds ``start .. start + seeds - 1`` of ``tests/transport/fault_campaign.py`` (real
block pools and managers as the engines, the real KVIndex as the consumer, a simulated
network with a nemesis) and prints the counts: seeds, engine steps, quiet-moment checks,
faults injected per kind, the states seen at checks, and silent-wrong (a source ``live``
while its index differs from its engine), which must be 0. Failing seeds are listed; each
becomes a named regression test in ``tests/transport/test_fault_campaign.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.transport.fault_campaign import FAULTS, SilentWrong, Stats, run_seed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100_000)
    ap.add_argument("--start", type=int, default=0)
    args = ap.parse_args()
    total = Stats()
    failed: list[tuple[int, str]] = []
    t0 = time.perf_counter()
    for seed in range(args.start, args.start + args.seeds):
        try:
            total.add(run_seed(seed))
        except SilentWrong as exc:
            total.seeds += 1
            total.silent_wrong += 1
            failed.append((seed, str(exc)))
        except AssertionError as exc:  # the world never got quiet
            total.seeds += 1
            failed.append((seed, str(exc)))
        if seed % 10_000 == 0 and seed > args.start:
            print(f"... {seed - args.start} seeds, {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    dt = time.perf_counter() - t0
    print(f"seeds        {total.seeds}  ({dt:.1f}s, {total.seeds / dt:.0f} seeds/s)")
    print(f"steps        {total.steps}")
    print(f"checks       {total.checks}")
    for k in FAULTS:
        print(f"fault {k:<16} {total.faults[k]}")
    for k, v in sorted(total.states.items()):
        print(f"state {k:<16} {v}")
    print(f"silent-wrong {total.silent_wrong}")
    print(f"failed seeds {len(failed)}")
    for seed, msg in failed[:20]:
        print(f"  {seed}: {msg}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
