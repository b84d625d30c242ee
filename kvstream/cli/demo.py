"""``kvstream demo``: the whole stack on loopback, KV-aware routing against round robin.

1. Starts ``--engines`` emulated vLLM engines (``kvstream engine`` processes: OpenAI HTTP
   API + KV events over ZMQ) and ``kvstream serve`` twice in proxy mode in front of them
   (one KV-aware, one round robin); this process follows every engine's event stream with a router index and
   records it to ``OUT/events.kvlog``.
2. Sends the same multi-turn chat workload over HTTP through each proxy in turn (every
   engine's prefix cache is reset in between) and measures, as a client would, time to
   first token (TTFT) and the share of prompt tokens the engines found cached.
3. Prints a short comparison, writes ``OUT/results.json``, and replays the log into a
   fresh index, which must equal the live one (exit status 1 if not).

About 30 s on 2 cores; ``--quick`` takes a few seconds. Nothing needs a GPU or the network.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kvstream.cli._common import positive_int


MAX_ENGINES = 64
"""Most engine processes ``kvstream demo`` starts (each is a Python process with HTTP and ZMQ)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` sub-command."""
    p = sub.add_parser(
        "demo",
        help="run emulated engines + kvstream serve --proxy on loopback: KV-aware vs round robin",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engines", type=positive_int, default=None, help="emulated engines (default 4; --quick 2)")
    p.add_argument("--sessions", type=positive_int, default=None, help="conversations (default 32; --quick 6)")
    p.add_argument("--turns", type=positive_int, default=None, help="turns per conversation (default 4; --quick 2)")
    p.add_argument("--transport", choices=("tcp", "ipc"), default="tcp", help="KV event transport (default tcp)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--out", default="kvstream-demo", metavar="DIR", help="output directory (default ./kvstream-demo)")
    p.add_argument("--quick", action="store_true", help="a small run that finishes in a few seconds (for CI)")
    p.set_defaults(func=_run)


def _check_out(path: Path) -> str | None:
    """Why ``path`` cannot hold the demo's output, or None if it can."""
    if path.exists() and not path.is_dir():
        return f"--out {str(path)!r} is a file; give a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".kvstream-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"--out {str(path)!r} is not a writable directory: {exc.strerror or exc}"
    return None


def _fmt_s(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.3f}"


def _k(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def summary_table(phases: list[Any]) -> str:
    """The comparison: one column per policy, one labelled row per measure (with units)."""
    rows: list[tuple[str, list[str]]] = []
    ok = [len(p.phase.ok) for p in phases]
    rows.append(("requests answered", [f"{o}/{len(p.phase.turns)}" for o, p in zip(ok, phases)]))
    rows.append(("TTFT p50 (s)", [_fmt_s(p.phase.ttft(0.5)) for p in phases]))
    rows.append(("TTFT p90 (s)", [_fmt_s(p.phase.ttft(0.9)) for p in phases]))
    rows.append(("prompt tokens cached (%)", [f"{100 * p.phase.hit_rate:.1f}" for p in phases]))
    rows.append(("prompt tokens computed", [
        _k(sum(t.prompt_tokens - t.cached_tokens for t in p.phase.ok)) for p in phases]))
    rows.append(("routing predicted exactly (%)", [
        "-" if p.routing.get("exact_rate") is None else f"{100 * p.routing['exact_rate']:.1f}" for p in phases]))
    rows.append(("requests per engine", ["/".join(str(v) for v in p.per_engine.values()) for p in phases]))
    width = max(len(r[0]) for r in rows)
    cols = [max(len(p.policy), *(len(r[1][i]) for r in rows)) for i, p in enumerate(phases)]
    lines = [" " * width + "  " + "  ".join(p.policy.rjust(c) for p, c in zip(phases, cols))]
    for label, vals in rows:
        lines.append(label.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(vals, cols)))
    return "\n".join(lines)


def takeaway(phases: list[Any]) -> str:
    """One line: who won and by how much."""
    by = {p.policy: p.phase for p in phases}
    kv, rr = by.get("kv-aware"), by.get("round-robin")
    if kv is None or rr is None:
        return ""
    a, b = kv.ttft(0.5), rr.ttft(0.5)
    if math.isnan(a) or math.isnan(b):
        return "takeaway: not enough answered requests to compare"
    if a <= b:
        speed = f"{b / a:.1f}x faster" if a > 0 else "faster"
        head = f"kv-aware routing: TTFT p50 {a:.3f} s vs {b:.3f} s with round robin ({speed})"
    else:
        head = f"round robin was faster here: TTFT p50 {b:.3f} s vs {a:.3f} s kv-aware"
    return (f"takeaway: {head}, {100 * kv.hit_rate:.0f} % vs {100 * rr.hit_rate:.0f} % of prompt tokens "
            "served from the prefix cache.")


def _run(args: argparse.Namespace) -> int:
    import anyio

    from kvstream.emulator.demo import DemoConfig, DemoResult, Progress, run_demo
    from kvstream.emulator.launch import LaunchError
    from kvstream.emulator.loadgen import ChatWorkload

    quick = args.quick
    engines = args.engines or (2 if quick else 4)
    sessions = args.sessions or (6 if quick else 32)
    turns = args.turns or (2 if quick else 4)
    out = Path(args.out)
    if engines > MAX_ENGINES:
        print(f"kvstream demo: --engines {engines}: the demo runs every engine as a process on this machine; "
              f"use at most {MAX_ENGINES} (`kvstream simulate --engines N` models large fleets)", file=sys.stderr)
        return 2
    problem = _check_out(out)
    if problem:
        print(f"kvstream demo: {problem}", file=sys.stderr)
        return 2
    workload = ChatWorkload(sessions=sessions, turns=turns, seed=args.seed,
                            system_prompts=2 if quick else 4,
                            document_tokens=(300, 700) if quick else (600, 1400),
                            start_spread_s=1.0 if quick else 6.0,
                            think_s=(0.05, 0.2) if quick else (0.2, 0.8))
    cfg = DemoConfig(engines=engines, workload=workload, transport=args.transport, out=out,
                     num_gpu_blocks=600 if quick else 1500)
    print(f"kvstream demo: {engines} emulated engines (HTTP + KV events over loopback {args.transport}), "
          f"{cfg.num_gpu_blocks} KV blocks x {cfg.block_size} tokens each; {sessions} conversations x {turns} "
          f"turns sent through kvstream serve --proxy, KV-aware, then round robin", flush=True)
    tty = sys.stdout.isatty()
    last: dict[str, float] = {}

    def show(p: Progress) -> None:
        if not tty and p.requests_done < p.requests_total and p.wall_s - last.get(p.policy, 0.0) < 2.0:
            return
        last[p.policy] = p.wall_s
        line = (f"  {p.policy:<11} {p.wall_s:5.1f} s wall  requests {p.requests_done}/{p.requests_total}"
                f"{f' ({p.failed} failed)' if p.failed else ''}  cached {100 * p.hit_rate:5.1f} % of prompt tokens"
                f"  TTFT p50 {_fmt_s(p.ttft_p50_s)} s")
        end = "\n" if not tty or p.requests_done == p.requests_total else ""
        print(("\r\033[K" + line) if tty else line, end=end, flush=True)

    result = DemoResult()

    async def guarded() -> None:
        # Ctrl-C (or SIGTERM) cancels the run wherever it is, starting processes included;
        # run_demo stops every process it started before returning.
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        result.interrupted = True
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            await run_demo(cfg, result, show)
            tg.cancel_scope.cancel()

    try:
        anyio.run(guarded)
    except KeyboardInterrupt:  # before the signal watcher was in place
        result.interrupted = True
    except (LaunchError, OSError, RuntimeError, TimeoutError) as exc:
        print(f"kvstream demo: {exc}", file=sys.stderr)
        return 1
    if result.interrupted:
        if tty:
            print()
        kept = (f"kept {result.log_path} ({result.batches_recorded} event batches recorded so far)"
                if result.batches_recorded else "nothing was recorded yet")
        print(f"kvstream demo: interrupted; {kept}; engines and services stopped", file=sys.stderr)
        return 130
    return _report(result, cfg, args)


def _report(result: Any, cfg: Any, args: argparse.Namespace) -> int:
    from kvstream.eventlog.reader import LogReader
    from kvstream.eventlog.replay import replay_into_index
    from kvstream.routing.index import KVIndex

    print()
    print(summary_table(result.phases))
    print()
    print(takeaway(result.phases))
    rate = result.events_recorded / result.record_wall_s if result.record_wall_s else 0.0
    print(f"\nKV event stream: {result.batches_recorded} batches ({result.events_recorded} events) recorded live "
          f"over {result.record_wall_s:.1f} s wall ({rate:.0f} events/s) -> {result.log_path}")
    reader = LogReader(result.log_path)
    fresh = KVIndex(router_block_size=cfg.block_size)
    n = replay_into_index(reader, fresh)
    for name in result.sources:
        fresh.add_source(name)
    equal = fresh.state() == result.live_index.state()
    damage = list(reader.damage)
    blocks = sum(len(s["blocks"]) for s in fresh.state()["sources"].values())
    print(f"replay: {n} log items -> a fresh index with {blocks} blocks, "
          f"{'EQUAL to the live router index' if equal and not damage else 'DIFFERENT from the live router index'}"
          + (f" ({len(damage)} damaged places)" if damage else ""))
    results = []
    for p in result.phases:
        ph = p.phase
        results.append({
            "policy": p.policy, "requests": len(ph.turns), "answered": len(ph.ok),
            "ttft_p50_s": ph.ttft(0.5), "ttft_p90_s": ph.ttft(0.9), "ttft_p99_s": ph.ttft(0.99),
            "prompt_tokens": sum(t.prompt_tokens for t in ph.ok),
            "cached_tokens": sum(t.cached_tokens for t in ph.ok), "hit_rate": ph.hit_rate,
            "wall_s": ph.wall_s, "routing_accuracy": p.routing, "requests_per_engine": p.per_engine})
    meta = {"engines": cfg.engines, "transport": cfg.transport, "num_gpu_blocks": cfg.num_gpu_blocks,
            "block_size": cfg.block_size, "prefill_tokens_per_s": cfg.prefill_tokens_per_s,
            "decode_tokens_per_s": cfg.decode_tokens_per_s, "sessions": cfg.workload.sessions,
            "turns": cfg.workload.turns, "seed": cfg.workload.seed, "replay_equal": equal and not damage,
            "log": str(result.log_path), "batches_recorded": result.batches_recorded}
    _write_json(cfg.out / "results.json", results, meta)
    print(f"wrote {cfg.out / 'results.json'}")
    return 0 if equal and not damage else 1


def _write_json(path: Path, results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    import json

    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and math.isnan(v) else v

    rows = [{k: clean(v) for k, v in r.items()} for r in results]
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
