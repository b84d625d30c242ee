"""Observability: the one home of kvstream's service counters and their Prometheus export.

:mod:`kvstream.observe.metrics` defines every metric the service exports (names, help,
labels) and collects the per-engine stream counters and index sizes at scrape time.
"""

from kvstream.observe.metrics import ServiceMetrics

__all__ = ["ServiceMetrics"]
