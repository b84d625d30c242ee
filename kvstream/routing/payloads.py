"""A batch read by the native payload reader and decoded into Python objects only on demand.

A consumer that hands batches to a router index (the JetStream consumer) need not build the
Python objects of every event: the index applies the payload's columns natively
(:meth:`~kvstream.routing.index.KVIndex.apply_batch` takes a :class:`PayloadBatch` as it
takes a :class:`~kvstream.wire.events.KVEventBatch`, without decoding it again). Whoever
reads ``.events`` gets them decoded then, once, by the decoder the payload came with (the
native reader takes a subset of what the decoder takes, and its events are the same,
position for position: the suite checks it).
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Callable

from kvstream._native import RawBatch, read_payload
from kvstream.wire.events import KVEventBatch

__all__ = ["PayloadBatch", "read_payload_batch", "read_payload_batches"]


class PayloadBatch:
    """One event batch as the native reader decoded it (``raw``), with its ``payload``
    bytes; quacks like :class:`~kvstream.wire.events.KVEventBatch` (``ts``, ``events``,
    ``data_parallel_rank``; equal to the decoded batch)."""

    __slots__ = ("raw", "payload", "_decode", "_batch")

    def __init__(self, raw: RawBatch, payload: bytes, decode: Callable[[bytes], KVEventBatch]) -> None:
        self.raw = raw
        self.payload = payload
        self._decode = decode
        self._batch: KVEventBatch | None = None

    @property
    def ts(self) -> float:
        """The engine's timestamp of the batch (seconds)."""
        return self.raw.ts

    @property
    def data_parallel_rank(self) -> int | None:
        """The engine's data-parallel rank (None: not sent)."""
        return self.raw.data_parallel_rank

    def decoded(self) -> KVEventBatch:
        """The batch as the payload's decoder decodes it (decoded once, on first need)."""
        b = self._batch
        if b is None:
            b = self._batch = self._decode(self.payload)
        return b

    @property
    def events(self) -> list[Any]:
        """The events as Python objects (see :meth:`decoded`)."""
        return self.decoded().events

    def __len__(self) -> int:
        return len(self.raw)

    def __eq__(self, other: object) -> bool:
        if type(other) is PayloadBatch:
            return self.payload == other.payload or self.decoded() == other.decoded()
        if isinstance(other, KVEventBatch):
            return self.decoded() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like the decoded batch: mutable lists inside

    def __repr__(self) -> str:
        return f"PayloadBatch(ts={self.ts!r}, events={len(self.raw)}, payload={len(self.payload)} B)"


def read_payload_batch(payload: bytes, max_bytes: int, decode: Callable[[bytes], KVEventBatch]) -> PayloadBatch | None:
    """The native reader's batch of ``payload`` (None: a payload for ``decode`` to decide
    on: malformed, unusual, or over ``max_bytes``)."""
    raw = read_payload(payload, max_bytes)
    return None if raw is None else PayloadBatch(raw, payload, decode)


def read_payload_batches(payloads: list[bytes], max_bytes: int,
                         decode: Callable[[bytes], KVEventBatch]) -> list[PayloadBatch] | None:
    """:func:`read_payload_batch` of each payload, or None when any of them is one for
    ``decode`` to decide on (then none is read: the caller takes them its general way)."""
    raws = list(map(read_payload, payloads, repeat(max_bytes)))
    if raws.count(None):
        return None
    return list(map(PayloadBatch, raws, payloads, repeat(decode)))  # type: ignore[arg-type]  # no None left
