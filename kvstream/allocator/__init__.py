"""The allocator: vLLM v1's prefix-caching block pool (``pool``: physical blocks, LRU free
queue, hash index), the request manager (``manager``), prefix-cache statistics
(``prefix_stats``) and the async step shell for an engine loop (``shell``).

The pool and the manager are sans-IO: no sockets, no clocks. Import the async shell from
:mod:`kvstream.allocator.shell` (or ``kvstream.AsyncKVCacheManager``); it is not imported here
so that using the pool never loads anyio.
"""

from __future__ import annotations

from kvstream.allocator.pool import (
    BlockPool,
    BlockPoolError,
    NoFreeBlocksError,
    FreeBlockQueue,
    HashIndex,
    KVCacheBlock,
    EventStyle,
    FreeOrder,
    HashForm,
    DEFAULT_EVENT_METADATA,
)
from kvstream.allocator.manager import (
    KVCacheManager,
    KVRequest,
    KVCacheManagerError,
)
from kvstream.allocator.prefix_stats import (
    PrefixCacheStats,
    PrefixCachingMetrics,
)

__all__ = [
    "BlockPool",
    "BlockPoolError",
    "NoFreeBlocksError",
    "FreeBlockQueue",
    "HashIndex",
    "KVCacheBlock",
    "EventStyle",
    "FreeOrder",
    "HashForm",
    "DEFAULT_EVENT_METADATA",
    "KVCacheManager",
    "KVRequest",
    "KVCacheManagerError",
    "PrefixCacheStats",
    "PrefixCachingMetrics",
]
