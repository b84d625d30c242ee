"""Presenting simulation results: the comparison table, JSON, and an optional plot.

The plot needs matplotlib (the ``kvstream[plot]`` extra); everything else works without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import msgspec

from kvstream.errors import LocalProtocolError
from kvstream.sim.metrics import PolicyResult

__all__ = ["format_table", "capacity_line", "results_json", "write_json", "plot_results",
           "plotting_available", "PlotUnavailableError"]


class PlotUnavailableError(LocalProtocolError, RuntimeError):
    """matplotlib is not installed; install ``kvstream[plot]`` (or ``pip install matplotlib``)."""


_COLUMNS: tuple[tuple[str, str], ...] = (
    ("policy", "{:<13}"),
    ("eng", "{:>3}"),
    ("hit%", "{:>6}"),
    ("prefill Mtok", "{:>12}"),
    ("TTFT p50 s", "{:>10}"),
    ("TTFT p99 s", "{:>10}"),
    ("queue p99 s", "{:>11}"),
    ("preempt", "{:>7}"),
    ("CV req", "{:>6}"),
    ("CV prefill", "{:>10}"),
    ("index ev/s", "{:>10}"),
    ("lag p99 ms", "{:>10}"),
)


def _row(r: PolicyResult) -> list[str]:
    return [
        r.policy if r.mode == "virtual" else f"{r.policy} ({r.mode})",
        str(r.engines),
        f"{100 * r.hit_rate:.1f}",
        f"{r.prefill_tokens / 1e6:.2f}",
        f"{r.ttft_p50_s:.3f}",
        f"{r.ttft_p99_s:.3f}",
        f"{r.queue_delay_p99_s:.3f}",
        str(r.preemptions),
        f"{r.load_cv_requests:.3f}",
        f"{r.load_cv_prefill:.3f}",
        f"{r.events_per_sim_s:.0f}",
        f"{1000 * r.router_lag_p99_s:.2f}",
    ]


def format_table(results: Sequence[PolicyResult], *, ceiling: float | None = None) -> str:
    """The side-by-side comparison as fixed-width text (one row per result).

    Every column is simulated, so equal inputs give equal tables: ``index ev/s`` is the
    KV events (stores and removals) the router index applied per simulated second, the
    ingest load a policy causes (it churns the cache more when it scatters prefixes).
    Wall-clock speed is not a column; it is in the JSON (``*_per_wall_s``).

    ``ceiling``: the workload's reuse ceiling (hit rate, 0..1, see
    :mod:`kvstream.sim.ceiling`); adds an ``of best %`` column (hit rate / ceiling) next
    to the hit rate."""
    head = [name for name, _ in _COLUMNS]
    body = [_row(r) for r in results]
    if ceiling is not None:
        head.insert(3, "of best %")
        for row, r in zip(body, results):
            row.insert(3, f"{100 * r.hit_rate / ceiling:.0f}" if ceiling > 0 else "-")
    rows = [head] + body
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for k, row in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def capacity_line(engines: int, config: Any, working_set_blocks: int | None = None) -> str:
    """One line saying how much prefix cache a run had: ``engines`` engines of
    ``config`` (an :class:`~kvstream.sim.engine.EngineConfig`), in blocks and tokens, and
    against the workload's working set (distinct blocks) when given."""
    blocks = engines * config.num_blocks
    line = (f"cache capacity: {engines} engines x {config.num_blocks:,} blocks x {config.block_size} tokens "
            f"= {blocks:,} blocks ({blocks * config.block_size:,} tokens)")
    if working_set_blocks:
        line += (f", {100 * blocks / working_set_blocks:.0f}% of the workload's "
                 f"{working_set_blocks:,} distinct blocks")
    return line


def plotting_available() -> bool:
    """True if matplotlib can be imported (``kvstream[plot]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def results_json(results: Sequence[PolicyResult], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"meta": ..., "results": [...]}`` as plain JSON-ready data."""
    return {"meta": meta or {}, "results": [msgspec.to_builtins(r) for r in results]}


def write_json(path: str | Path, results: Sequence[PolicyResult], meta: dict[str, Any] | None = None) -> None:
    """Write :func:`results_json` to ``path`` (UTF-8, indented)."""
    Path(path).write_text(json.dumps(results_json(results, meta), indent=2) + "\n", encoding="utf-8")


def plot_results(path: str | Path, results: Sequence[PolicyResult], title: str = "", *,
                 ceiling: float | None = None) -> None:
    """Bar charts of hit rate and TTFT (p50 and p99) by policy, one group per engine
    count, each bar labelled with its value; ``ceiling`` (0..1) draws the workload's reuse
    ceiling across the hit-rate chart; ``title`` should name the configuration.

    TTFT is on a linear axis (bars on a log axis have no meaningful length). The format
    follows the suffix (``.png``, ``.svg``, ``.pdf``). Raises
    :class:`PlotUnavailableError` without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(
            "plotting needs matplotlib: pip install 'kvstream[plot]' (or drop --plot)"
        ) from None
    policies = list(dict.fromkeys(r.policy for r in results))
    counts = sorted({r.engines for r in results})
    by = {(r.policy, r.engines): r for r in results}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.8 / max(1, len(counts))
    small = 7 if len(counts) * len(policies) <= 12 else 5
    for j, n in enumerate(counts):
        xs = [i + j * width for i in range(len(policies))]
        hit = [100 * by[(p, n)].hit_rate if (p, n) in by else 0 for p in policies]
        p50 = [by[(p, n)].ttft_p50_s if (p, n) in by else 0 for p in policies]
        p99 = [by[(p, n)].ttft_p99_s if (p, n) in by else 0 for p in policies]
        bars = ax1.bar(xs, hit, width, label=f"{n} engines", color=f"C{j}")
        ax1.bar_label(bars, labels=[f"{v:.1f}" for v in hit], fontsize=small, padding=2)
        light = ax2.bar(xs, p99, width, alpha=0.35, color=f"C{j}")
        ax2.bar(xs, p50, width, color=f"C{j}", label=f"{n} engines (dark p50, light p99)")
        ax2.bar_label(light, labels=[f"{a:.2f}/{b:.2f}" for a, b in zip(p50, p99)], fontsize=small, padding=2)
    if ceiling is not None:
        ax1.axhline(100 * ceiling, color="0.3", linestyle="--", linewidth=1,
                    label=f"reuse ceiling {100 * ceiling:.1f}%")
    for ax in (ax1, ax2):
        ax.set_xticks([i + width * (len(counts) - 1) / 2 for i in range(len(policies))])
        ax.set_xticklabels(policies, rotation=20)
        ax.legend(fontsize=8)
        ax.margins(y=0.12)
    ax1.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax1.set_ylim(0, 105)
    ax2.set_ylabel("time to first token (s; labels p50/p99)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)
