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
from typing import Any, Callable, Iterator, Sequence, overload

from kvstream._native import RawBatch, read_payload
from kvstream.wire.events import KVEventBatch

__all__ = ["PayloadBatch", "PayloadDecoder", "read_payload_batch", "read_payload_batches"]

_SELF_BYTES = 96
"""A :class:`PayloadBatch` object itself (five slots and the header: ``sys.getsizeof``
says 72 on CPython 3.11, rounded up)."""


class PayloadBatch:
    """One event batch as the native reader decoded it (``raw``), with its ``payload``
    bytes; quacks like :class:`~kvstream.wire.events.KVEventBatch` (``ts``, ``events``,
    ``data_parallel_rank``; equal to the decoded batch)."""

    __slots__ = ("raw", "payload", "_decode", "_batch", "held_bytes")

    def __init__(self, raw: RawBatch, payload: bytes, decode: Callable[[bytes], KVEventBatch]) -> None:
        self.raw = raw
        self.payload = payload
        self._decode = decode
        self._batch: KVEventBatch | None = None
        self.held_bytes = raw.nbytes + _SELF_BYTES
        """Bytes the batch holds besides its payload while nobody has read its events: the
        native columns' allocations and the two objects (measured, not estimated). A
        subscriber's byte bounds count a queued batch by it: the Python objects of its
        events are made only when they are read, by the consumer that took it."""

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
    def events(self) -> "_Events":
        """The events: their count from the native reader (``len`` decodes nothing: a
        subscriber counts every batch's events), the Python objects decoded on first
        read (see :meth:`decoded`)."""
        return _Events(self)

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


class _Events(Sequence[Any]):
    """A :class:`PayloadBatch`'s events: ``len`` from the native reader, anything else
    from the decoded batch."""

    __slots__ = ("_pb",)

    def __init__(self, pb: PayloadBatch) -> None:
        self._pb = pb

    def __len__(self) -> int:
        return len(self._pb.raw)

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: int | slice) -> Any:
        return self._pb.decoded().events[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._pb.decoded().events)

    def __eq__(self, other: object) -> bool:
        return list(self) == (list(other) if isinstance(other, (list, tuple, _Events)) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._pb.decoded().events)


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


class PayloadDecoder:
    """A subscriber's decoder (``decode(payload)``) for a consumer whose only use of a
    batch is an index's ``apply_batch`` (``kvstream serve``): a :class:`PayloadBatch`
    when the native reader takes the payload (read with the GIL released, no Python
    object per event), else ``fallback.decode(payload)`` (its batch, or its
    ``EventDecodeError``). So what is accepted is exactly ``fallback``'s; its size limit
    (``_max``) bounds what the native reader reads, and its other attributes
    (``skipped_events``, ``mooncake_batches``) are read through."""

    __slots__ = ("fallback", "_max", "native_batches", "held_bytes_per_payload_byte")

    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback
        self._max = int(getattr(fallback, "_max", getattr(fallback, "max_payload_bytes", 1 << 26)))
        self.native_batches = 0
        """Payloads the native reader decoded (the rest went to ``fallback``)."""
        # The events can still be decoded into Python objects (an event read, or one the
        # native rules leave to Python): the subscriber's byte bounds count them as the
        # fallback's own estimate does.
        self.held_bytes_per_payload_byte = int(getattr(fallback, "held_bytes_per_payload_byte", 12))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fallback, name)

    def decode(self, payload: bytes | bytearray | memoryview) -> Any:
        """Decode one payload (see the class docstring)."""
        data = payload if type(payload) is bytes else bytes(payload)
        if len(data) <= self._max:
            raw = read_payload(data, self._max)
            if raw is not None:
                self.native_batches += 1
                return PayloadBatch(raw, data, self.fallback.decode)
        return self.fallback.decode(data)
