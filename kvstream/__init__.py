"""kvstream: the KV cache of LLM serving engines as one asyncio-native library.

Layers, bottom up (imports only flow upward, see ``docs/architecture.md``):
:mod:`kvstream.hashing` and :mod:`kvstream.wire` (the event schema); :mod:`kvstream.allocator`
(block pool, request manager); :mod:`kvstream.transport` (the ZMQ event stream);
:mod:`kvstream.routing` (the router index); :mod:`kvstream.eventlog`; :mod:`kvstream.planning`
and :mod:`kvstream.sim`; the CLI.

This facade imports nothing until a name is used: ``import kvstream`` opens no sockets and
loads no layer; ``from kvstream import BlockPool`` loads only the allocator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstream.allocator import (
        BlockPool,
        BlockPoolError,
        KVCacheManager,
        KVCacheManagerError,
        KVRequest,
        NoFreeBlocksError,
        PrefixCachingMetrics,
    )
    from kvstream.allocator.shell import AsyncKVCacheManager
    from kvstream.errors import KVStreamError, LocalProtocolError, RemoteProtocolError
    from kvstream.eventlog import LogReader, LogWriter, read_log
    from kvstream.hashing import BlockHasher, HashingError, LoRA, MMItem, RequestBlockHasher, RequestExtraKeys
    from kvstream.planning import KVCachePlan, plan_from_hf_config, plan_kv_cache
    from kvstream.routing import EngineKeyIndex, KVIndex, Load, PrefixLoadPolicy, ScoreResult
    from kvstream.routing.router import Router, apply_item
    from kvstream.sim.run import SimConfig, compare, simulate
    from kvstream.transport import KVEventsConfig, Publisher, SourceHealth, SourceSpec, Subscriber
    from kvstream.wire import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventDecodeError,
        EventDecoder,
        EventEncoder,
        FrameError,
        KVEventBatch,
        decode_batch,
        encode_batch,
    )

__version__ = "0.1.0"

# Public name -> the module that defines it. One table: `__all__`, `dir()` and the lazy
# loader below are all derived from it (tests check it against the TYPE_CHECKING imports).
_HOME: dict[str, str] = {
    # errors
    "KVStreamError": "kvstream.errors",
    "LocalProtocolError": "kvstream.errors",
    "RemoteProtocolError": "kvstream.errors",
    # hashing
    "BlockHasher": "kvstream.hashing",
    "RequestBlockHasher": "kvstream.hashing",
    "RequestExtraKeys": "kvstream.hashing",
    "LoRA": "kvstream.hashing",
    "MMItem": "kvstream.hashing",
    "HashingError": "kvstream.hashing",
    # wire
    "BlockStored": "kvstream.wire",
    "BlockRemoved": "kvstream.wire",
    "AllBlocksCleared": "kvstream.wire",
    "KVEventBatch": "kvstream.wire",
    "EventEncoder": "kvstream.wire",
    "EventDecoder": "kvstream.wire",
    "EventDecodeError": "kvstream.wire",
    "encode_batch": "kvstream.wire",
    "decode_batch": "kvstream.wire",
    "FrameError": "kvstream.wire",
    # allocator
    "BlockPool": "kvstream.allocator",
    "BlockPoolError": "kvstream.allocator",
    "NoFreeBlocksError": "kvstream.allocator",
    "KVCacheManager": "kvstream.allocator",
    "KVCacheManagerError": "kvstream.allocator",
    "KVRequest": "kvstream.allocator",
    "PrefixCachingMetrics": "kvstream.allocator",
    "AsyncKVCacheManager": "kvstream.allocator.shell",
    # transport
    "KVEventsConfig": "kvstream.transport",
    "Publisher": "kvstream.transport",
    "Subscriber": "kvstream.transport",
    "SourceSpec": "kvstream.transport",
    "SourceHealth": "kvstream.transport",
    # routing
    "KVIndex": "kvstream.routing",
    "EngineKeyIndex": "kvstream.routing",
    "Load": "kvstream.routing",
    "PrefixLoadPolicy": "kvstream.routing",
    "ScoreResult": "kvstream.routing",
    "Router": "kvstream.routing.router",
    "apply_item": "kvstream.routing.router",
    # event logs
    "LogReader": "kvstream.eventlog",
    "LogWriter": "kvstream.eventlog",
    "read_log": "kvstream.eventlog",
    # planning and simulation
    "KVCachePlan": "kvstream.planning",
    "plan_kv_cache": "kvstream.planning",
    "plan_from_hf_config": "kvstream.planning",
    "SimConfig": "kvstream.sim.run",
    "simulate": "kvstream.sim.run",
    "compare": "kvstream.sim.run",
}

__all__ = ["__version__", *_HOME]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kvstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
