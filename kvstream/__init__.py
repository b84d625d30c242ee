"""kvstream: the KV cache of LLM serving engines as one asyncio-native library.

Layers, bottom up (imports only flow upward): block hashing and the event schema; the
prefix-caching block pool and request manager; the ZMQ event stream; the router index;
event logs; planning and the simulator; the CLI.
"""

from __future__ import annotations

from kvstream.capture import CaptureFormatError, CaptureRecord, read_capture
from kvstream.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventDecoder,
    EventEncoder,
    KVCacheEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvstream.framing import FrameError
from kvstream.hashing import (
    BlockHasher,
    HashingError,
    LoRA,
    MMItem,
    RequestBlockHasher,
    RequestExtraKeys,
    none_hash,
    to_external,
)
from kvstream.pool import BlockPool, BlockPoolError, KVCacheBlock, NoFreeBlocksError
from kvstream.manager import KVCacheManager, KVCacheManagerError, KVRequest
from kvstream.metrics import PrefixCacheStats, PrefixCachingMetrics
from kvstream.engine import AsyncKVCacheManager
from kvstream.eventlog import LogControl, LogDamage, LogFormatError, LogMessage, LogReader, LogWriter, read_log
from kvstream.transport import (
    KVEventsConfig,
    Publisher,
    PublisherClosedError,
    QueueFullError,
    SourceBatch,
    SourceHealth,
    SourceLive,
    SourceReset,
    SourceSpec,
    SourceStale,
    Subscriber,
)
from kvstream.index import KVIndex
from kvstream.engine_index import EngineKeyIndex
from kvstream.scoring import Load, Policy, PrefixLoadPolicy, ScoreResult, SourceMatch
from kvstream.router import Router, apply_item
from kvstream.sim.engine import EngineConfig
from kvstream.sim.metrics import PolicyResult
from kvstream.sim.run import SimConfig, compare, simulate
from kvstream.sim.workload import SyntheticConfig, load_mooncake, synthetic_workload
from kvstream.planning import (
    KVCachePlan,
    KVCachePlanningError,
    NotEnoughKVCacheMemoryError,
    plan_from_hf_config,
    plan_kv_cache,
    specs_from_hf_config,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CaptureFormatError",
    "CaptureRecord",
    "EventDecodeError",
    "EventDecoder",
    "EventEncoder",
    "FrameError",
    "BlockHasher",
    "HashingError",
    "LoRA",
    "MMItem",
    "RequestBlockHasher",
    "RequestExtraKeys",
    "none_hash",
    "BlockPool",
    "BlockPoolError",
    "KVCacheBlock",
    "NoFreeBlocksError",
    "KVCacheManager",
    "KVCacheManagerError",
    "KVRequest",
    "PrefixCacheStats",
    "PrefixCachingMetrics",
    "AsyncKVCacheManager",
    "LogControl",
    "LogDamage",
    "LogFormatError",
    "LogMessage",
    "LogReader",
    "LogWriter",
    "read_log",
    "KVEventsConfig",
    "Publisher",
    "PublisherClosedError",
    "QueueFullError",
    "SourceBatch",
    "SourceHealth",
    "SourceLive",
    "SourceReset",
    "SourceSpec",
    "SourceStale",
    "Subscriber",
    "KVIndex",
    "EngineKeyIndex",
    "Load",
    "Policy",
    "PrefixLoadPolicy",
    "ScoreResult",
    "SourceMatch",
    "Router",
    "apply_item",
    "EngineConfig",
    "PolicyResult",
    "SimConfig",
    "compare",
    "simulate",
    "SyntheticConfig",
    "load_mooncake",
    "synthetic_workload",
    "KVCachePlan",
    "KVCachePlanningError",
    "NotEnoughKVCacheMemoryError",
    "plan_from_hf_config",
    "plan_kv_cache",
    "specs_from_hf_config",
    "to_external",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "read_capture",
]
