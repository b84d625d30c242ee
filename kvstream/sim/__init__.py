"""The trace-driven routing simulator: workloads, simulated engines, policies, metrics.

``workload`` loads Mooncake traces and generates the synthetic workload; the engine model
is a sans-IO discrete-event core on top of kvstream's allocator; ``policies`` routes
requests; ``run`` ties them together in virtual time, and ``live`` runs the same engines as
async tasks publishing on real sockets for ``kvstream demo``. Nothing in kvstream imports
this package.
"""

from __future__ import annotations

from kvstream.sim.workload import (
    MOONCAKE_BLOCK_TOKENS,
    SimRequest,
    SyntheticConfig,
    TimeScale,
    WorkloadError,
    compress_arrivals,
    iter_mooncake,
    load_mooncake,
    parse_speed,
    synthetic_workload,
)

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "SimRequest",
    "SyntheticConfig",
    "TimeScale",
    "WorkloadError",
    "compress_arrivals",
    "iter_mooncake",
    "load_mooncake",
    "parse_speed",
    "synthetic_workload",
]
