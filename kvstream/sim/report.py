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

__all__ = ["format_table", "results_json", "write_json", "plot_results", "PlotUnavailableError"]


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
    ("events", "{:>8}"),
    ("events/s", "{:>9}"),
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
        str(r.events),
        f"{r.events_per_wall_s:.0f}" if r.events_per_wall_s else "-",
        f"{1000 * r.router_lag_p99_s:.2f}",
    ]


def format_table(results: Sequence[PolicyResult]) -> str:
    """The side-by-side comparison as fixed-width text (one row per result)."""
    rows = [[name for name, _ in _COLUMNS]] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = []
    for k, row in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def results_json(results: Sequence[PolicyResult], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"meta": ..., "results": [...]}`` as plain JSON-ready data."""
    return {"meta": meta or {}, "results": [msgspec.to_builtins(r) for r in results]}


def write_json(path: str | Path, results: Sequence[PolicyResult], meta: dict[str, Any] | None = None) -> None:
    """Write :func:`results_json` to ``path`` (UTF-8, indented)."""
    Path(path).write_text(json.dumps(results_json(results, meta), indent=2) + "\n", encoding="utf-8")


def plot_results(path: str | Path, results: Sequence[PolicyResult], title: str = "") -> None:
    """Bar charts of hit rate and TTFT (p50 and p99) by policy, one group per engine count.

    The format follows the suffix (``.png``, ``.svg``, ``.pdf``). Raises
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
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(counts))
    for j, n in enumerate(counts):
        xs = [i + j * width for i in range(len(policies))]
        hit = [100 * by[(p, n)].hit_rate if (p, n) in by else 0 for p in policies]
        p50 = [by[(p, n)].ttft_p50_s if (p, n) in by else 0 for p in policies]
        p99 = [by[(p, n)].ttft_p99_s if (p, n) in by else 0 for p in policies]
        ax1.bar(xs, hit, width, label=f"{n} engines")
        ax2.bar(xs, p99, width, alpha=0.35, color=f"C{j}")
        ax2.bar(xs, p50, width, color=f"C{j}", label=f"{n} engines (p50; light: p99)")
    for ax in (ax1, ax2):
        ax.set_xticks([i + width * (len(counts) - 1) / 2 for i in range(len(policies))])
        ax.set_xticklabels(policies, rotation=20)
        ax.legend(fontsize=8)
    ax1.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax2.set_ylabel("time to first token (s)")
    ax2.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)
