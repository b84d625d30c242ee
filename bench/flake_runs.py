"""Run the test suite several times in a row with CPU-burning processes beside it.

The suite must not flake under CPU contention (issue #15): tests wait for states, not for
time. This script starts ``--burners`` busy-loop processes (default 2, one per core of the
reference 2-core machine), runs pytest ``--runs`` times (default 5), stops at the first
failing run, and prints each run's result, wall time and the load average.

    python bench/flake_runs.py                       # the whole suite, 5 runs, 2 burners
    python bench/flake_runs.py --runs 3 -- tests/eventlog tests/cli -x -q

Everything after ``--`` goes to pytest (default: ``tests -x -q``). Exit status 0 when every
run passed, 1 otherwise. The burners are killed when the script ends, however it ends.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BURN = "while True: pass"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs in a row (default 5)")
    p.add_argument("--burners", type=int, default=2, help="busy-loop processes beside the suite (default 2)")
    args = p.parse_args(argv)
    pytest_args = rest or ["tests", "-x", "-q"]
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
    passed = 0
    try:
        for run in range(1, args.runs + 1):
            t0 = time.monotonic()
            rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args], cwd=REPO)
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"run {run}/{args.runs}: {'passed' if rc == 0 else f'FAILED (exit {rc})'} in "
                  f"{time.monotonic() - t0:.0f} s; {args.burners} burner(s); load average {load}", flush=True)
            if rc != 0:
                break
            passed += 1
    finally:
        for b in burners:
            b.kill()
        for b in burners:
            b.wait()
    print(f"{passed} of {args.runs} runs passed in a row with {args.burners} CPU burner(s)")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
