"""The KV event stream: a vLLM-compatible ZMQ publisher with replay and snapshots, and a
subscriber that follows many publishers without ever silently drifting.

Modules: :mod:`.config` (``KVEventsConfig``, endpoint rules), :mod:`.publisher`,
:mod:`.subscriber` (socket shell), :mod:`.recovery` (its sans-IO state machine),
:mod:`.items` (what the subscriber yields), :mod:`.curve` (CURVE keys and auth).
The transport imports the event schema and the framing, nothing else of kvstream's.
"""

from __future__ import annotations

from kvstream.transport.config import (
    CurveClientConfig,
    CurveServerConfig,
    EndpointError,
    KVEventsConfig,
    offset_endpoint,
    should_bind,
)
from kvstream.transport.items import SourceBatch, SourceLive, SourceReset, SourceStale, StreamItem
from kvstream.transport.publisher import Publisher, PublisherClosedError, PublisherStats, QueueFullError
from kvstream.transport.recovery import SourceCounters, SourceTracker
from kvstream.transport.subscriber import SourceHealth, SourceSpec, Subscriber

__all__ = [
    "CurveClientConfig",
    "CurveServerConfig",
    "EndpointError",
    "KVEventsConfig",
    "offset_endpoint",
    "should_bind",
    "SourceBatch",
    "SourceLive",
    "SourceReset",
    "SourceStale",
    "StreamItem",
    "Publisher",
    "PublisherClosedError",
    "PublisherStats",
    "QueueFullError",
    "SourceCounters",
    "SourceTracker",
    "SourceHealth",
    "SourceSpec",
    "Subscriber",
]
