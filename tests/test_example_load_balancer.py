"""The example load balancer runs as written and beats round-robin on its workload."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("engines", [3, 8])
def test_example_load_balancer_runs_and_routes_by_prefix(engines) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "load_balancer.py"), "--engines", str(engines), "--requests", "40"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum(1 for ln in lines if ln.startswith("request ")) == 40
    summary = lines[-1]
    routed = float(summary.split("routed ")[1].split("%")[0])
    robin = float(summary.split("round-robin ")[1].split("%")[0])
    assert routed > robin, summary
    per_engine = ast.literal_eval(summary.split("requests per engine: ")[1])
    assert len(per_engine) == engines and min(per_engine.values()) > 0, summary  # every engine serves


@pytest.mark.parametrize("flag,value", [("--engines", "0"), ("--requests", "-1"), ("--engines", "x")])
def test_example_load_balancer_refuses_counts_below_one_with_a_usage_line(flag, value) -> None:
    out = subprocess.run([sys.executable, str(REPO / "examples" / "load_balancer.py"), flag, value],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"argument {flag}: must be a positive integer" in out.stderr
