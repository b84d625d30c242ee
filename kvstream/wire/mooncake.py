"""The standardized KV events of RFC kvcache-ai/Mooncake#1527, decoded into kvstream's
event schema, alongside vLLM's.

On the wire a batch is the same three ZMQ frames as vLLM's (topic, big-endian seq,
msgpack payload); the payload is ``[timestamp, [event, ...], dp_rank]`` where each event
is a map with ``event_type`` (``stored``, ``removed``, ``cleared``), ``seq_hashes`` (rolling
XXH3-64 sequence hashes, see :mod:`kvstream.hashing.mooncake`), ``parent_hash``,
``base_block_idx``, optional ``token_ids`` and ``block_size``, lowercase ``medium``
(``gpu``, ``cpu``, ``disk``...), ``backend_id``, ``lora_name``... Publishers that also emit
vLLM's legacy aliases (``block_hashes``, ``parent_block_hash``) are accepted too.

Mapping: ``stored`` -> :class:`~kvstream.wire.events.BlockStored` (hashes = ``seq_hashes``,
medium upper-cased), ``removed`` -> :class:`~kvstream.wire.events.BlockRemoved`, ``cleared``
-> :class:`~kvstream.wire.events.AllBlocksCleared`. Timestamps in milliseconds (as the RFC
writes them) become seconds.

:class:`AnyFormatDecoder` decodes either format: vLLM's first (the common case costs
nothing extra), then RFC #1527's when vLLM's decoder rejects the payload.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvstream.wire.events import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    AnyEvent,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventDecoder,
    KVEventBatch,
)

__all__ = ["MooncakeEvent", "decode_mooncake_batch", "AnyFormatDecoder", "EVENT_TYPES"]

EVENT_TYPES = ("stored", "removed", "cleared")
"""RFC #1527's ``event_type`` values."""

_U64 = msgspec.Meta(ge=0, le=2**64 - 1)


class MooncakeEvent(msgspec.Struct, gc=False):
    """One RFC #1527 event map (the fields kvstream uses; others are ignored)."""

    event_type: str
    seq_hashes: list[int] | None = None
    parent_hash: int | None = None
    base_block_idx: int | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    backend_id: str | None = None
    dp_rank: int | None = None
    event_id: int | None = None
    # vLLM-compatible aliases some publishers add
    block_hashes: list[int] | None = None
    parent_block_hash: int | None = None


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[MooncakeEvent]
    dp_rank: int | None = None


_DEC = msgspec.msgpack.Decoder(_Batch)


def _medium(m: str | None) -> str | None:
    return m.upper() if m else None


def _convert(i: int, ev: MooncakeEvent) -> AnyEvent:
    t = ev.event_type
    if t == "cleared":
        return AllBlocksCleared()
    hashes: list[Any] | None = ev.seq_hashes if ev.seq_hashes is not None else ev.block_hashes
    if hashes is None:
        raise EventDecodeError(f"event {i}: a {t!r} event needs seq_hashes")
    for h in hashes:
        if not 0 <= h < 2**64:
            raise EventDecodeError(f"event {i}: seq_hashes holds {h}, not an unsigned 64-bit int")
    if t == "removed":
        return BlockRemoved(hashes, _medium(ev.medium))
    if t != "stored":
        raise EventDecodeError(f"event {i}: event_type must be one of {', '.join(EVENT_TYPES)}, got {t!r}")
    parent = ev.parent_hash if ev.parent_hash is not None else ev.parent_block_hash
    if parent is None and ev.base_block_idx is None:
        raise EventDecodeError(f"event {i}: a stored event needs parent_hash or base_block_idx (RFC #1527)")
    tokens = ev.token_ids or []
    bs = ev.block_size or 0
    if tokens and parent is None and ev.base_block_idx:
        # Blocks deep in a sequence whose parent we are not told: their tokens cannot be
        # chained from the root, so keep them by hash only.
        tokens = []
    if tokens and bs and len(tokens) != bs * len(hashes):
        raise EventDecodeError(f"event {i}: {len(tokens)} token_ids for {len(hashes)} blocks of {bs} tokens")
    if tokens and not bs:
        if len(tokens) % len(hashes):
            raise EventDecodeError(f"event {i}: {len(tokens)} token_ids do not split into {len(hashes)} blocks")
        bs = len(tokens) // len(hashes)
    return BlockStored(hashes, parent, tokens, bs if tokens or ev.block_size else 0, None,
                       _medium(ev.medium), ev.lora_name)


def decode_mooncake_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode one RFC #1527 payload. Raises :class:`~kvstream.wire.events.EventDecodeError`."""
    try:
        b = _DEC.decode(payload)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"not an RFC #1527 batch [timestamp, [events], dp_rank]: {exc}",
                               payload_len=len(payload)) from None
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not valid msgpack: {exc}", payload_len=len(payload)) from None
    ts = b.ts / 1000.0 if b.ts > 1e11 else b.ts  # milliseconds (RFC) or seconds
    return KVEventBatch(ts, [_convert(i, e) for i, e in enumerate(b.events)], b.dp_rank)


class AnyFormatDecoder:
    """Decodes vLLM payloads (any vintage, :class:`~kvstream.wire.events.EventDecoder`) and RFC
    #1527 payloads: vLLM first; when it rejects a payload, RFC #1527; when both reject it,
    vLLM's error is raised (the usual peer). Same interface as ``EventDecoder``."""

    __slots__ = ("_vllm", "_max", "mooncake_batches")

    def __init__(self, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 unknown_events: Any = "skip") -> None:
        self._vllm = EventDecoder(max_payload_bytes=max_payload_bytes, unknown_events=unknown_events)
        self._max = max_payload_bytes
        self.mooncake_batches = 0
        """Payloads decoded as RFC #1527."""

    @property
    def skipped_events(self) -> int:
        """vLLM events of unknown type dropped so far."""
        return self._vllm.skipped_events

    def decode(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        """Decode one payload of either format; raises ``EventDecodeError``."""
        try:
            return self._vllm.decode(payload)
        except EventDecodeError as first:
            if len(payload) > self._max:
                raise
            try:
                batch = decode_mooncake_batch(payload)
            except EventDecodeError:
                raise first from None
            self.mooncake_batches += 1
            return batch
