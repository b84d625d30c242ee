"""Errors raised while planning a KV cache; each message says what to change."""

from __future__ import annotations

from kvstream.errors import LocalProtocolError

__all__ = [
    "KVCachePlanningError",
    "KVCacheGroupingError",
    "NotEnoughKVCacheMemoryError",
    "HFConfigError",
]


class KVCachePlanningError(LocalProtocolError, ValueError):
    """Base class: the inputs of a KV cache plan cannot produce a valid plan."""


class KVCacheGroupingError(KVCachePlanningError):
    """The layers' KV cache specs cannot be put into groups sharing one block pool."""


class HFConfigError(KVCachePlanningError):
    """A Hugging Face ``config.json`` lacks a field the plan needs, or has an unsupported layout."""


class NotEnoughKVCacheMemoryError(KVCachePlanningError):
    """One request at ``max_model_len`` does not fit in the memory given to the KV cache.

    Attributes carry the numbers of the message so callers (the simulator, the CLI's JSON
    output) need not parse it.
    """

    def __init__(
        self,
        message: str,
        *,
        needed_bytes: int,
        available_bytes: int,
        max_model_len: int,
        estimated_max_model_len: int,
        worker: int,
    ) -> None:
        super().__init__(message)
        #: KV cache bytes one request at ``max_model_len`` needs on the failing worker.
        self.needed_bytes = needed_bytes
        #: KV cache bytes that worker has.
        self.available_bytes = available_bytes
        #: The requested maximum model length, in tokens.
        self.max_model_len = max_model_len
        #: Longest model length (tokens) that fits on that worker; 0 if not even one token.
        self.estimated_max_model_len = estimated_max_model_len
        #: Index of the worker (pipeline stage) that ran out.
        self.worker = worker
