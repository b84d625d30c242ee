"""Soak the subscriber's recovery rules with the deterministic fault campaign.

    python bench/soak_faults.py [--seeds 100000] [--start 0] [--stream]

Runs seeds ``start .. start + seeds - 1`` of ``tests/transport/fault_campaign.py`` (real
block pools and managers as the engines, the real KVIndex as the consumer, a simulated
network with a nemesis) and prints the counts: seeds, engine steps, quiet-moment checks,
faults injected per kind, the states seen at checks, and silent-wrong (a source ``live``
while its index differs from its engine), which must be 0. Failing seeds are listed; each
becomes a named regression test in ``tests/transport/test_fault_campaign.py``.

The campaign puts some sources behind a forwarder (duplicates, reordering, restarts it
hides). ``--stream`` runs the same worlds relayed through a JetStream stream that fills up
(``tests/jetstream/stream_campaign.py``: the real relay and consumer state machines, the
relay shell's give-up and notice rules) and checks the stream consumer's index too.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.transport.fault_campaign import FAULTS, SilentWrong, Stats, run_seed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100_000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--stream", action="store_true", help="relay the worlds through a stream that fills up")
    args = ap.parse_args()
    faults = FAULTS
    run = run_seed
    if args.stream:
        from tests.jetstream import stream_campaign

        run = stream_campaign.run_seed
        faults = FAULTS + stream_campaign.FAULTS
    total = Stats()
    failed: list[tuple[int, str]] = []
    t0 = time.perf_counter()

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    # SIGTERM (or Ctrl-C) ends the run early with the counts so far (a time-boxed soak).
    signal.signal(signal.SIGTERM, stop)
    try:
        for seed in range(args.start, args.start + args.seeds):
            try:
                total.add(run(seed))
            except SilentWrong as exc:
                total.seeds += 1
                total.silent_wrong += 1
                failed.append((seed, str(exc)))
            except AssertionError as exc:  # the world never got quiet
                total.seeds += 1
                failed.append((seed, str(exc)))
            if seed % 10_000 == 0 and seed > args.start:
                print(f"... {seed - args.start} seeds, {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"interrupted  after {total.seeds} of {args.seeds} seeds (from {args.start})")
    return _report(faults, total, failed, time.perf_counter() - t0)


def _report(faults: tuple[str, ...], total: Stats, failed: list[tuple[int, str]], dt: float) -> int:
    print(f"seeds        {total.seeds}  ({dt:.1f}s, {total.seeds / dt:.0f} seeds/s)")
    print(f"steps        {total.steps}")
    print(f"checks       {total.checks}")
    for k in faults:
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
