"""The placement model in the simulator, on the engines and workloads of ``bench_routers.py``.

    python bench/sim_placement.py                  # chat, Mooncake and bursts, a few seconds
    python bench/sim_placement.py --seeds 16       # more chat workloads to average over
    python bench/sim_placement.py --grid           # CostPolicy weights around the defaults

``kvstream simulate`` models the engines ``bench_routers.py`` starts (``kvstream engine`` is
the same allocator and scheduler model), so the routing policies can be compared here in
virtual time, in seconds, before a real run confirms them:

* ``chat``: ``bench_routers.py``'s chat sessions, round by round (``ChatWorkload``: 24
  sessions of 4 turns, 4 system prompts of 600 tokens, a 600-1,400-token document per
  session, 40-120-token user messages, 12-24-token answers; a turn follows the last one's
  answer after 0.2-0.8 s; the same random draws as ``chat_run``). Open loop: a turn's
  arrival assumes the answer took its decode time. Engines: 1,500 blocks of 16 tokens,
  10,000 prompt tokens/s, 50 tokens/s per sequence. Averaged over ``--seeds`` rounds
  (round ``i`` with policy seed ``i``).
* ``mooncake``: the first 600 requests of the shipped trace, 4x faster, prompts cut to
  8,192 tokens and outputs to 16 (as ``bench_routers.py`` sends them); engines: 16,384
  blocks of 16 tokens (simulated as 64-token blocks, granularity 16), 50,000 tokens/s.
* ``burst``: 20 groups of 8 requests sharing a new 2,048-token prefix, each group sent
  within 4 ms, with the engines' events reaching the router 20 ms late, with and without
  ``--speculate``.

Printed per policy: hit rate, TTFT mean and p99, and load spread (the busiest engine's
requests over the mean, as ``bench_routers.py`` prints it). Deterministic.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import math  # noqa: E402

from kvstream.routing.scoring import CostPolicy, PrefixLoadPolicy, RecentPlacements  # noqa: E402
from kvstream.sim.engine import EngineConfig  # noqa: E402
from kvstream.sim.run import SimConfig, SimRun  # noqa: E402
from kvstream.sim.workload import SimRequest, compress_arrivals, cut_lengths, load_mooncake  # noqa: E402

CHAT_ENGINE = EngineConfig(num_blocks=1501, block_size=16, prefill_rate=10000, decode_step_s=0.02)
TRACE_ENGINE = EngineConfig(num_blocks=4097, block_size=64, token_granularity=16, prefill_rate=50000,
                            decode_step_s=0.02)
BURST_ENGINE = EngineConfig(num_blocks=4096, block_size=16, prefill_rate=20000, decode_step_s=0.02)


def chat_workload(seed: int, sessions: int = 24) -> list[SimRequest]:
    """``bench_routers.py``'s chat sessions for round ``seed`` (``chat_run``: the same random
    draws, so the same system prompt, document, message and answer lengths per session),
    open loop (see the module docstring)."""
    rng = random.Random(seed)
    for _ in range(4 * 600):
        rng.randrange(1000, 30000)  # the system prompts' tokens, drawn as chat_run draws them
    key = [1 << 40]

    def new() -> int:
        key[0] += 1
        return key[0]

    systems = [(new(), 600) for _ in range(4)]
    raw = []
    for s in range(sessions):
        r = random.Random(seed * 1000 + s)
        t = r.uniform(0, 6.0)
        doc = r.randint(600, 1400)
        system = systems[r.randrange(4)]
        for _ in range(doc):
            r.randrange(1000, 30000)
        history: tuple[tuple[int, int], ...] = (system, (new(), doc))
        for _ in range(4):
            n_user = r.randint(40, 120)
            for _ in range(n_user):
                r.randrange(1000, 30000)
            out_len = r.randint(12, 24)
            prompt = history + ((new(), n_user),)
            out = new()
            raw.append((t, prompt, out, out_len, s))
            history = prompt + ((out, out_len),)
            t += 0.1 + out_len / 50 + r.uniform(0.2, 0.8)
    raw.sort(key=lambda x: x[0])
    return [SimRequest(i, t, p, o, n, session=s) for i, (t, p, o, n, s) in enumerate(raw)]


def burst_workload(groups: int = 20, size: int = 8, prefix: int = 2048) -> list[SimRequest]:
    raw = []
    key = 1 << 41
    for g in range(groups):
        shared = (key, prefix)
        key += 1
        for i in range(size):
            raw.append((g * 0.5 + i * 0.0005, (shared, (key, 64)), key + 1))
            key += 2
    raw.sort()
    return [SimRequest(i, t, p, o, 16) for i, (t, p, o) in enumerate(raw)]


class CountCap(CostPolicy):
    """An experiment, not a shipped policy: bounded load by conversations. A request that
    starts new content (its best cached share is under ``stick_share``, where the placement
    model's balance term applies) may only go to an engine that started fewer than
    ``ceil((started + 1) / engines) + slack`` of them; among those, the least cost without
    the balance term (so the engine holding the system prompt wins) plus ``w_in`` x 256
    tokens per conversation it started. Use with ``placed_weight=0``. The counts are kept
    here, for the engine each call ranks first."""

    __slots__ = ("slack", "w_in", "started", "_new")

    def __init__(self, slack: int = 0, w_in: float = 0.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.slack, self.w_in = slack, w_in
        self.started: dict[str, int] = {}
        self._new = False

    def costs(self, matches: Any, loads: Any, n_blocks: int) -> dict[str, float]:
        out = super().costs(matches, loads, n_blocks)
        prompt = n_blocks * self.block_size
        tw, ow = self.tier_weights, self.other_tier_weight
        best = max((sum(k * tw.get(med, ow) for med, k in m.served.items()) for m in matches), default=0.0)
        self._new = bool(out) and prompt > 0 and best * self.block_size < self.stick_share * prompt
        if self._new:
            started = self.started
            cap = math.ceil((sum(started.get(s, 0) for s in out) + 1) / len(out)) + self.slack
            for s in out:
                c = started.get(s, 0)
                out[s] += (1e9 if c >= cap else 0.0) + self.w_in * c * 256 + 1e-6 * c
        return out

    def __call__(self, matches: Any, loads: Any, n_blocks: int) -> list[tuple[float, str]]:
        ranked = super().__call__(matches, loads, n_blocks)
        if self._new and ranked:
            pick = max(ranked)[1]  # the engine the caller takes
            self.started[pick] = self.started.get(pick, 0) + 1
        return ranked


def run(reqs: Sequence[SimRequest], scoring: Any, cfg: SimConfig) -> dict[str, float]:
    """One simulation with ``scoring`` (a PrefixLoadPolicy or CostPolicy; None: round robin;
    or a (CostPolicy, RecentPlacements) pair: the recent work counted by those settings)."""
    recent = None
    if isinstance(scoring, tuple):
        scoring, recent = scoring
    r = SimRun(reqs, "round-robin" if scoring is None else "kv-cost", cfg)
    if scoring is not None:
        r.policy.scoring = scoring
        r.policy.uses_index = True
        if isinstance(scoring, CostPolicy):
            scoring.block_size = r._R
            if scoring.placed_weight:
                r._recent = recent if recent is not None else RecentPlacements()
    res = r.run()
    per = res.requests_per_engine
    return {"hit": res.hit_rate, "ttft": res.ttft_mean_s, "p99": res.ttft_p99_s,
            "spread": max(per) * len(per) / sum(per)}


def report(label: str, runs: list[dict[str, float]]) -> None:
    m = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
    worst = max(r["spread"] for r in runs)
    print(f"  {label:48} hit {m['hit'] * 100:5.1f} %  TTFT mean {m['ttft'] * 1000:5.0f} p99 {m['p99'] * 1000:5.0f} ms"
          f"  spread {m['spread']:.2f} (worst {worst:.2f})", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8, help="chat rounds (and policy seeds) averaged")
    ap.add_argument("--grid", action="store_true", help="also CostPolicy weights around the defaults")
    args = ap.parse_args(argv)

    policies: list[tuple[str, Callable[[int], Any]]] = [
        ("round robin", lambda sd: None),
        ("prefix (PrefixLoadPolicy, --scoring prefix)", lambda sd: PrefixLoadPolicy()),
        ("cost (CostPolicy defaults, --scoring cost)", lambda sd: CostPolicy(queue_tokens=0.0, seed=sd)),
        ("cost, balanced by tokens only (before 445c08d)",
         lambda sd: (CostPolicy(queue_tokens=0.0, placed_weight=0.5, seed=sd), RecentPlacements(64, request_tokens=0))),
        ("cost, no balance term (placed_weight 0)", lambda sd: CostPolicy(queue_tokens=0.0, placed_weight=0.0, seed=sd)),
        ("cost, waiting requests priced twice", lambda sd: CostPolicy(queue_tokens=512.0, seed=sd)),
        ("cost, last round's weights", lambda sd: CostPolicy(queue_tokens=0.0, prefill_weight=1.0, running_tokens=256,
                                                             placed_weight=0.0, seed=sd)),
        ("cost, conversations capped by count (experiment)",
         lambda sd: CountCap(queue_tokens=0.0, placed_weight=0.0, seed=sd)),
        ("cost, capped by count, one of slack (experiment)",
         lambda sd: CountCap(slack=1, w_in=0.5, queue_tokens=0.0, placed_weight=0.0, seed=sd)),
    ]
    if args.grid:
        for pw in (0.1, 0.25, 0.5):
            for w in (0.25, 0.5, 1.0):
                for ss in (0.6, 0.8):
                    policies.append((f"cost prefill_weight={pw} placed_weight={w} stick={ss}",
                                     lambda sd, pw=pw, w=w, ss=ss: CostPolicy(
                                         queue_tokens=0.0, prefill_weight=pw, placed_weight=w, stick_share=ss, seed=sd)))
        for rt in (0, 128, 256, 512, 1024):
            for w in (0.5, 1.0):
                for h in (64, 256):
                    policies.append((f"cost placed_weight={w} request_tokens={rt} horizon={h}",
                                     lambda sd, rt=rt, w=w, h=h: (CostPolicy(queue_tokens=0.0, placed_weight=w, seed=sd),
                                                                  RecentPlacements(h, request_tokens=rt))))

    print(f"chat (bench_routers.py's sessions of rounds 0-{args.seeds - 1}):")
    chat = [chat_workload(sd) for sd in range(args.seeds)]
    ccfg = SimConfig(engines=4, engine=CHAT_ENGINE)
    for label, mk in policies:
        report(label, [run(w, mk(sd), ccfg) for sd, w in enumerate(chat)])

    print("mooncake (first 600 requests, 4x faster, cut to 8,192 / 16 tokens; 4 policy seeds):")
    trace = compress_arrivals(cut_lengths(
        load_mooncake(REPO / "examples" / "traces" / "mooncake_conversation.jsonl.xz", limit=600),
        max_input=8192, max_output=16), 4.0)
    tcfg = SimConfig(engines=4, engine=TRACE_ENGINE)
    for label, mk in policies:
        report(label, [run(trace, mk(sd), tcfg) for sd in range(4)])

    print("burst (20 x 8 requests sharing a new 2,048-token prefix within 4 ms; events 20 ms late):")
    burst = burst_workload()
    for label, mk in policies[1:3]:
        for spec in (None, 2.0):
            cfg = SimConfig(engines=4, engine=BURST_ENGINE, router_lag_s=0.02, speculate_ttl_s=spec)
            report(f"{label.split(' (')[0]}{', --speculate' if spec else ''}", [run(burst, mk(0), cfg)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
