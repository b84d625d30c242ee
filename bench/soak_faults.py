"""Soak the subscriber's recovery rules with the deterministic fault campaign.

    python bench/soak_faults.py [--seeds 100000] [--start 0] [--stream [--forwarders]] [--jobs 2]

Runs seeds ``start .. start + seeds - 1`` of ``tests/transport/fault_campaign.py`` (real
block pools and managers as the engines, the real KVIndex as the consumer, a simulated
network with a nemesis) and prints the counts: seeds, engine steps, quiet-moment checks,
faults injected per kind, the states seen at checks, and silent-wrong (a source ``live``
while its index differs from its engine), which must be 0. Failing seeds are listed; each
becomes a named regression test in ``tests/transport/test_fault_campaign.py``.

The campaign puts some sources behind a forwarder (duplicates, reordering, restarts it
hides). ``--stream`` runs the same worlds relayed through a JetStream stream that fills up
(``tests/jetstream/stream_campaign.py``: the real relay and consumer state machines, the
relay shell's give-up and notice rules) and checks the stream consumer's index too; its
worlds have no forwarders unless ``--forwarders``. ``--jobs N`` runs the seeds in N worker
processes (the same counts as one process).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import signal
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.transport.fault_campaign import FAULTS, SilentWrong, Stats, run_seed  # noqa: E402


CHUNK = 500
"""Seeds per work unit with ``--jobs`` > 1 (results are the same as one process's)."""


def _run_chunk(job: tuple[int, int, bool, bool]) -> tuple[Stats, list[tuple[int, str]]]:
    """Seeds ``start .. start + n - 1`` in this process: their summed counts, failed seeds."""
    start, n, stream, forwarders = job
    run: Callable[[int], Stats] = run_seed
    if stream:
        from tests.jetstream import stream_campaign

        run = functools.partial(stream_campaign.run_seed, forwarders=forwarders)
    total = Stats()
    failed: list[tuple[int, str]] = []
    for seed in range(start, start + n):
        try:
            total.add(run(seed))
        except SilentWrong as exc:
            total.seeds += 1
            total.silent_wrong += 1
            failed.append((seed, str(exc)))
        except AssertionError as exc:  # the world never got quiet
            total.seeds += 1
            failed.append((seed, str(exc)))
    return total, failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100_000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--stream", action="store_true", help="relay the worlds through a stream that fills up")
    ap.add_argument("--forwarders", action="store_true", help="with --stream: put some sources behind a forwarder")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (seeds are independent)")
    args = ap.parse_args()
    faults = FAULTS
    if args.stream:
        from tests.jetstream import stream_campaign

        faults = FAULTS + stream_campaign.FAULTS
    total = Stats()
    failed: list[tuple[int, str]] = []
    t0 = time.perf_counter()

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    end = args.start + args.seeds
    jobs = [(s, min(CHUNK, end - s), args.stream, args.forwarders) for s in range(args.start, end, CHUNK)]
    # SIGTERM (or Ctrl-C) ends the run early with the counts so far (a time-boxed soak).
    signal.signal(signal.SIGTERM, stop)
    pool = None
    try:
        if args.jobs > 1:
            # Workers ignore SIGINT/SIGTERM: the parent stops them (terminate) and reports.
            pool = multiprocessing.get_context("fork").Pool(args.jobs, initializer=_worker_init)
            results = pool.imap(_run_chunk, jobs)
        else:
            results = map(_run_chunk, jobs)
        done = 0
        for chunk_total, chunk_failed in results:
            total.add(chunk_total)
            failed.extend(chunk_failed)
            done += chunk_total.seeds
            if done % 10_000 < CHUNK and done >= 10_000:
                print(f"... {done} seeds, {time.perf_counter() - t0:.0f}s, "
                      f"{total.silent_wrong} silent-wrong", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"interrupted  after {total.seeds} of {args.seeds} seeds (from {args.start})")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    failed.sort()
    return _report(faults, total, failed, time.perf_counter() - t0)


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


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
    if len(failed) > 20:
        print("  all: " + " ".join(str(seed) for seed, _ in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
