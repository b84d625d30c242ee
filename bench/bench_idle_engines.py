"""What engines nobody listens on cost an idle ``kvstream serve``: CPU share of a core.

Starts ``kvstream serve`` (the installed one, or ``--tree``'s), registers ``--engines`` publishers
on loopback ports nothing listens on (``POST /register``, with a replay endpoint unless
``--no-replay``), waits ``--warmup`` seconds (the retry waits grow to their caps: 2 s
reconnects, 10 s joins) and reports the process's CPU time per wall second over
``--window`` seconds, per thread (Python, ZMQ's I/O and reaper threads). Run it on the
tree before a change and after, in the same session, to compare (240 engines stay under
the default ``--max-engines``)::

    git worktree add /tmp/before <commit> && cp kvstream/_native*.so /tmp/before/kvstream/
    python bench/bench_idle_engines.py --tree /tmp/before
    python bench/bench_idle_engines.py
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import httpx


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _cpu(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/stat") as f:
            text = f.read()
        name = text.split("(", 1)[1].rsplit(")", 1)[0]
        fields = text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--engines", type=int, default=240)
    ap.add_argument("--warmup", type=float, default=40.0, help="seconds before measuring")
    ap.add_argument("--window", type=float, default=10.0, help="seconds measured")
    ap.add_argument("--no-replay", action="store_true", help="register without a replay endpoint")
    ap.add_argument("--tree", help="run the kvstream package in this folder (e.g. an older checkout) instead")
    args = ap.parse_args()
    env = {**os.environ, **({"PYTHONPATH": args.tree} if args.tree else {})}
    p = subprocess.Popen([sys.executable, "-m", "kvstream", "serve", "--port", "0", "--load-interval", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                         cwd=args.tree or None)  # `-m` puts the cwd first on sys.path: the tree's own
    try:
        assert p.stdout is not None
        url = p.stdout.readline().split("listening on ", 1)[1].split()[0]
        with httpx.Client(base_url=url, timeout=30) as c:
            for i in range(args.engines):
                body = {"endpoint": f"tcp://127.0.0.1:{_dead_port()}", "type": "vLLM", "modelname": "m",
                        "instance_id": f"i{i}", "block_size": 16, "dp_rank": 0, "tenant_id": f"t{i}"}
                if not args.no_replay:
                    body["replay_endpoint"] = f"tcp://127.0.0.1:{_dead_port()}"
                r = c.post("/register", json=body)
                if r.status_code != 200:
                    sys.exit(f"registration {i} failed: {r.status_code} {r.text[:200]}")
        time.sleep(args.warmup)
        a, t0 = _cpu(p.pid), time.monotonic()
        time.sleep(args.window)
        b, dt = _cpu(p.pid), time.monotonic() - t0
        per = {k: (b[k] - a.get(k, 0.0)) / dt for k in b}
        print(f"{args.engines} unreachable engines ({'no replay' if args.no_replay else 'with replay'}), "
              f"after {args.warmup:g} s: {sum(per.values()):.1%} of a core "
              + " ".join(f"{k}={v:.1%}" for k, v in sorted(per.items()) if v >= 0.001))
    finally:
        p.terminate()
        p.wait()


if __name__ == "__main__":
    main()
