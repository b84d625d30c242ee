"""What a simulation run measures, per routing policy.

:class:`RunMetrics` collects per-request timings and per-engine totals while a run goes,
and :meth:`RunMetrics.summary` turns them into a :class:`PolicyResult`: plain numbers, JSON
ready, identical for identical inputs (nearest-rank percentiles, no wall-clock values
except the ones explicitly named ``wall``).

Definitions (also in ``docs/simulator.md``):

* hit rate: prompt tokens found in the engine's prefix cache / prompt tokens looked up,
  over every admission (a preempted request that is admitted again is looked up again,
  as vLLM counts it).
* prefill tokens: prompt (and, after preemption, generated) tokens actually computed.
* load spread: coefficient of variation (stdev / mean) across engines of the requests
  routed to each and of the prefill tokens each computed; 0 is perfectly even.
* queueing delay: first admission time - arrival (seconds, simulated).
* TTFT: time the first output token is produced - arrival (seconds, simulated); the
  simulated engine produces it at the end of the step that finishes the prompt.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import msgspec

__all__ = ["PolicyResult", "RunMetrics", "percentile", "coefficient_of_variation"]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of already sorted values; 0.0 when empty."""
    n = len(sorted_values)
    if n == 0:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * n))
    return float(sorted_values[min(rank, n) - 1])


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population stdev / mean of ``values``; 0.0 when the mean is 0 or there are none."""
    n = len(values)
    if n == 0:
        return 0.0
    mean = sum(values) / n
    if mean == 0:
        return 0.0
    var = sum((v - mean) ** 2 for v in values) / n
    return math.sqrt(var) / mean


class PolicyResult(msgspec.Struct, kw_only=True):
    """One policy's results on one workload and engine count (units in the names).

    ``wall_seconds`` and the ``*_per_wall_s`` rates are the only fields that vary between
    identical runs; :meth:`deterministic` drops them.
    """

    policy: str
    engines: int
    requests: int
    completed: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    prefill_tokens: int
    output_tokens: int
    preemptions: int
    requests_per_engine: list[int]
    prefill_tokens_per_engine: list[int]
    load_cv_requests: float
    load_cv_prefill: float
    queue_delay_p50_s: float
    queue_delay_p99_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    simulated_seconds: float
    event_batches: int
    events: int
    events_per_sim_s: float
    router_lag_p50_s: float
    router_lag_p99_s: float
    wall_seconds: float = 0.0
    requests_per_wall_s: float = 0.0
    events_per_wall_s: float = 0.0
    mode: str = "virtual"

    def deterministic(self) -> dict[str, Any]:
        """Every field except the wall-clock ones, as a dict (for determinism checks)."""
        d = msgspec.structs.asdict(self)
        for k in ("wall_seconds", "requests_per_wall_s", "events_per_wall_s"):
            d.pop(k)
        return d


class RunMetrics:
    """Accumulates one run's measurements; engines and the driver call the ``on_*`` hooks.

    Args:
        engines: number of engines (per-engine lists are indexed 0..engines-1).
    """

    __slots__ = (
        "engines",
        "routed",
        "prefill_per_engine",
        "prompt_tokens",
        "hit_tokens",
        "output_tokens",
        "preemptions",
        "completed",
        "queue_delays",
        "ttfts",
        "lags",
        "event_batches",
        "events",
        "end_time",
    )

    def __init__(self, engines: int) -> None:
        self.engines = engines
        self.routed = [0] * engines
        self.prefill_per_engine = [0] * engines
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.output_tokens = 0
        self.preemptions = 0
        self.completed = 0
        self.queue_delays: list[float] = []
        self.ttfts: list[float] = []
        self.lags: list[float] = []
        self.event_batches = 0
        self.events = 0
        self.end_time = 0.0

    def on_batch(self, num_events: int, lag_s: float | None = None) -> None:
        """An event batch reached the router index (``lag_s``: publish-to-apply seconds)."""
        self.event_batches += 1
        self.events += num_events
        if lag_s is not None:
            self.lags.append(lag_s)

    def summary(
        self,
        policy: str,
        requests: int,
        *,
        wall_seconds: float = 0.0,
        mode: str = "virtual",
    ) -> PolicyResult:
        """The run's :class:`PolicyResult` (``requests``: how many the workload offered)."""
        qd = sorted(self.queue_delays)
        tt = sorted(self.ttfts)
        lg = sorted(self.lags)
        sim_s = self.end_time
        return PolicyResult(
            policy=policy,
            engines=self.engines,
            requests=requests,
            completed=self.completed,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=self.hit_tokens,
            hit_rate=self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            prefill_tokens=sum(self.prefill_per_engine),
            output_tokens=self.output_tokens,
            preemptions=self.preemptions,
            requests_per_engine=list(self.routed),
            prefill_tokens_per_engine=list(self.prefill_per_engine),
            load_cv_requests=coefficient_of_variation(self.routed),
            load_cv_prefill=coefficient_of_variation(self.prefill_per_engine),
            queue_delay_p50_s=percentile(qd, 50),
            queue_delay_p99_s=percentile(qd, 99),
            ttft_mean_s=sum(tt) / len(tt) if tt else 0.0,
            ttft_p50_s=percentile(tt, 50),
            ttft_p99_s=percentile(tt, 99),
            simulated_seconds=sim_s,
            event_batches=self.event_batches,
            events=self.events,
            events_per_sim_s=self.events / sim_s if sim_s > 0 else 0.0,
            router_lag_p50_s=percentile(lg, 50),
            router_lag_p99_s=percentile(lg, 99),
            wall_seconds=wall_seconds,
            requests_per_wall_s=requests / wall_seconds if wall_seconds > 0 else 0.0,
            events_per_wall_s=self.events / wall_seconds if wall_seconds > 0 else 0.0,
            mode=mode,
        )
