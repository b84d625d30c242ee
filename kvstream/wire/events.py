"""The KV event schema and its wire codec: vLLM's ``KVEventBatch`` payloads, every vintage.

This module is the whole wire format of a KV event payload. It imports nothing of
kvstream's. Three event types travel in a batch:

* :class:`BlockStored`: a run of consecutive blocks became cached (one event per run).
* :class:`BlockRemoved`: blocks lost their hash (the GPU pool sends one hash per event,
  a CPU offload tier may send several).
* :class:`AllBlocksCleared`: the engine reset its prefix cache.

A batch (:class:`KVEventBatch`) is always a positional msgpack array
``[ts, events, data_parallel_rank]``. Events come in two shapes:

``map`` (vLLM >= 0.26)
    ``{"type": "BlockStored", "block_hashes": [...], ...}``: required fields always
    written (``nil`` when None), optional fields only when set. Field order and the map
    header width are exactly msgspec's, so bytes are identical to vLLM's.
``array`` (vLLM 0.11 and earlier)
    ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    medium]``: tagged positional arrays.

:class:`EventDecoder` accepts both shapes, in any mix within one batch. Anything it cannot
make sense of raises :class:`EventDecodeError`, and nothing else.
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Any, Final, Literal, Union

import msgspec

from kvstream.errors import RemoteProtocolError

__all__ = [
    "MEDIUM_GPU",
    "MEDIUM_CPU",
    "ExternalBlockHash",
    "KVCacheEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEventBatch",
    "EventDecodeError",
    "EventEncoder",
    "EventDecoder",
    "encode_batch",
    "decode_batch",
    "ARRAY_FIELDS_V0_11",
    "DEFAULT_MAX_PAYLOAD_BYTES",
]

MEDIUM_GPU: Final = "GPU"
"""``medium`` of events from the GPU block pool."""
MEDIUM_CPU: Final = "CPU"
"""``medium`` of events from a CPU offload tier."""

ExternalBlockHash = Union[Annotated[int, msgspec.Meta(ge=0)], bytes]
"""A block hash as it travels: the low 64 bits as an unsigned int, or the raw digest.
(Negative ints are rejected on decode; msgpack ints above uint64 cannot exist.)"""

DEFAULT_MAX_PAYLOAD_BYTES: Final = 64 * 1024 * 1024
"""Payloads larger than this (bytes) are rejected before decoding."""


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base class of the three KV cache events (map shape, tag field ``"type"``)."""


# Field order is vLLM 0.33's declaration order; it is the wire order. The required
# fields (no default) are always on the wire, the rest only when set. BlockStored has
# 15 fields: with the tag that is 16 possible entries, which is why msgspec (and so
# vLLM) always writes its map header as map16 (``de 00 NN``).
class BlockStored(KVCacheEvent, tag="BlockStored"):
    """A run of consecutive full blocks was cached.

    ``block_hashes`` lists the run's block hashes in order; ``token_ids`` is the flat
    concatenation of their tokens (``block_size`` tokens per block for GPU events; CPU
    offload events carry no tokens and ``block_size`` 0). ``parent_block_hash`` is the
    hash of the block before the run, or None when the run starts at block 0.
    ``lookahead_token_ids`` (vLLM 0.33, lookahead hashing on) holds one token list per
    entry of ``block_hashes``: the tokens beyond each block that went into its hash.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    """Blocks lost their hash (evicted from ``medium``'s cache)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    """The engine's prefix cache was reset: every GPU block lost its hash."""


AnyEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published step: ``ts`` (seconds since the epoch), the events in order, and the
    data-parallel rank of the engine that produced them (None: not stamped)."""

    ts: float
    events: list[AnyEvent]
    data_parallel_rank: int | None = None


class EventDecodeError(RemoteProtocolError, ValueError):
    """A KV event payload could not be decoded: the peer sent something malformed.

    ``reason`` says what was wrong and where (a msgspec path such as
    ``$[1][3].block_hashes[0]``, or the event index). This is the only exception the
    decoder raises.
    """

    def __init__(self, reason: str, *, payload_len: int | None = None) -> None:
        self.reason = reason
        self.payload_len = payload_len
        where = f" ({payload_len} byte payload)" if payload_len is not None else ""
        super().__init__(f"malformed KV event batch{where}: {reason}")


# -- legacy array shapes (decode side) ------------------------------------------------
# msgspec cannot put array-like and map-like structs in one union, so array events are
# decoded with mirrors of the structs above and converted. The mirrors are derived from
# the map structs (a new field is declared once, above): same fields in the same order,
# but every field after the first has a default, so short arrays from older engines
# decode ("missing trailing slots become None", or an empty list / 0 where the field
# cannot be None); extra trailing slots are ignored by msgspec.


class _ArrayEvent(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


def _empty(tp: Any) -> Any:
    """The default a missing trailing array slot of type ``tp`` decodes to."""
    args = typing.get_args(tp)
    if tp is Any or type(None) in args:
        return None
    origin = typing.get_origin(tp) or tp
    if origin is list:
        return []
    if origin is int:
        return 0
    raise TypeError(f"no empty value for a required field of type {tp!r}; give it a default")


def _array_mirror(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    fields: list[Any] = []
    for i, f in enumerate(msgspec.structs.fields(cls)):
        if i == 0:
            fields.append((f.name, f.type))
        else:
            default = f.default if f.default is not msgspec.NODEFAULT else _empty(f.type)
            fields.append((f.name, f.type, default))
    return msgspec.defstruct(f"_{cls.__name__}Array", fields, bases=(_ArrayEvent,),
                             tag=cls.__struct_config__.tag, module=__name__)


_BlockStoredArray = _array_mirror(BlockStored)
_BlockRemovedArray = _array_mirror(BlockRemoved)
_AllBlocksClearedArray = _array_mirror(AllBlocksCleared)
_AnyArrayEvent = Union[_BlockStoredArray, _BlockRemovedArray, _AllBlocksClearedArray]  # type: ignore[valid-type]


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_AnyArrayEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_STORED_FIELDS: Final = BlockStored.__struct_fields__
_REMOVED_FIELDS: Final = BlockRemoved.__struct_fields__


_astuple = msgspec.structs.astuple


def _from_array(ev: Any) -> AnyEvent:
    cls = type(ev)
    if cls is _BlockStoredArray:
        return BlockStored(*_astuple(ev))
    if cls is _BlockRemovedArray:
        return BlockRemoved(*_astuple(ev))
    return AllBlocksCleared()


DECODED_BYTES_PER_PAYLOAD_BYTE = 12
"""How many bytes a decoded batch holds per byte of its msgpack payload, at most (a
conservative estimate): a token id of 257..65535 is 3 bytes of msgpack and 36 bytes
decoded (an int object and its list slot); measured 3-11x over vLLM-shaped batches (block
hashes, token ids of every range, removals)."""


class EventDecoder:
    """Decodes KV event payloads of any vLLM vintage into :class:`KVEventBatch`.

    Per event, the map shape (vLLM >= 0.26) and the tagged-array shape (0.11) are both
    accepted, in any mix; unknown map keys and extra trailing array slots are ignored;
    missing trailing array slots become None. Hashes may be any unsigned msgpack int up to
    uint64, or bytes.

    ``unknown_events="error"`` (default) rejects a batch holding an event type this
    version does not know; ``"skip"`` drops such events and counts them in
    :attr:`skipped_events` (for forward compatibility with newer engines).

    The common case (a batch of one shape) is a single typed msgspec decode.
    """

    __slots__ = ("_map", "_array", "_raw", "_map_event", "_array_event", "_max",
                 "_prefer_array", "_skip_unknown", "skipped_events")

    held_bytes_per_payload_byte: int = DECODED_BYTES_PER_PAYLOAD_BYTE
    """A bound on the bytes a decoded batch holds per payload byte (for byte bounds on
    what holds decoded batches, see :data:`DECODED_BYTES_PER_PAYLOAD_BYTE`)."""

    def __init__(
        self,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        unknown_events: Literal["error", "skip"] = "error",
    ) -> None:
        if unknown_events not in ("error", "skip"):
            raise ValueError(f"unknown_events must be 'error' or 'skip', got {unknown_events!r}")
        if max_payload_bytes <= 0:
            raise ValueError(f"max_payload_bytes must be positive, got {max_payload_bytes}")
        self._map = msgspec.msgpack.Decoder(KVEventBatch)
        self._array = msgspec.msgpack.Decoder(_ArrayBatch)
        self._raw = msgspec.msgpack.Decoder(_RawBatch)
        self._map_event = msgspec.msgpack.Decoder(AnyEvent)
        self._array_event = msgspec.msgpack.Decoder(_AnyArrayEvent)
        self._max = max_payload_bytes
        self._prefer_array = False
        self._skip_unknown = unknown_events == "skip"
        self.skipped_events = 0
        """Events of unknown type dropped so far (only with ``unknown_events="skip"``)."""

    def decode(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        """Decode one payload. Raises :class:`EventDecodeError` if it is malformed."""
        n = len(payload)
        if n > self._max:
            raise EventDecodeError(
                f"payload is {n} bytes, over the limit of {self._max} bytes "
                "(raise max_payload_bytes if the engine really sends batches this large)",
                payload_len=n,
            )
        try:
            # Try the shape that worked last time first: a stream rarely changes shape.
            if self._prefer_array:
                try:
                    return self._from_array_batch(self._array.decode(payload))
                except msgspec.ValidationError:
                    pass
                batch: KVEventBatch = self._map.decode(payload)
                self._prefer_array = False
                return batch
            try:
                return self._map.decode(payload)
            except msgspec.ValidationError:
                pass
            batch = self._from_array_batch(self._array.decode(payload))
            self._prefer_array = True
            return batch
        except msgspec.ValidationError:
            # Mixed shapes, an unknown event type or a genuinely bad event: go event by
            # event, which also gives the error a precise location.
            return self._decode_per_event(payload)
        except msgspec.DecodeError as exc:
            raise EventDecodeError(f"not valid msgpack: {exc}", payload_len=n) from None
        except Exception as exc:  # noqa: BLE001 - the decoder raises one type only
            raise EventDecodeError(f"{type(exc).__name__}: {exc}", payload_len=n) from None

    @staticmethod
    def _from_array_batch(b: _ArrayBatch) -> KVEventBatch:
        return KVEventBatch(b.ts, [_from_array(e) for e in b.events], b.data_parallel_rank)

    def _decode_per_event(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        n = len(payload)
        try:
            raw = self._raw.decode(payload)
        except msgspec.ValidationError as exc:
            raise EventDecodeError(
                f"batch is not [ts: float, events: array, data_parallel_rank: int|nil]: {exc}",
                payload_len=n,
            ) from None
        except Exception as exc:  # noqa: BLE001
            raise EventDecodeError(f"{type(exc).__name__}: {exc}", payload_len=n) from None
        events: list[AnyEvent] = []
        for i, r in enumerate(raw.events):
            data = bytes(r)
            first = data[0] if data else 0xC1
            is_map = 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)
            is_array = 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)
            try:
                if is_map:
                    events.append(self._map_event.decode(data))
                elif is_array:
                    events.append(_from_array(self._array_event.decode(data)))
                else:
                    raise EventDecodeError(
                        f"event {i}: expected a map or an array, got msgpack type byte 0x{first:02x}",
                        payload_len=n,
                    )
            except msgspec.ValidationError as exc:
                if self._skip_unknown and _is_unknown_tag(data, is_map):
                    self.skipped_events += 1
                    continue
                raise EventDecodeError(f"event {i}: {_name_array_slot(str(exc), data, is_map)}",
                                       payload_len=n) from None
            except EventDecodeError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise EventDecodeError(f"event {i}: {type(exc).__name__}: {exc}", payload_len=n) from None
        return KVEventBatch(raw.ts, events, raw.data_parallel_rank)


_ARRAY_SLOT = re.compile(r"`\$\[(\d+)\]")
_FIELDS_BY_TAG: Final = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}


def _name_array_slot(msg: str, data: bytes, is_map: bool) -> str:
    """msgspec reports array-shaped events by slot index; add the field's name."""
    m = _ARRAY_SLOT.search(msg)
    if is_map or m is None:
        return msg
    try:
        tag = msgspec.msgpack.decode(data)[0]
    except Exception:  # noqa: BLE001
        return msg
    slot = int(m.group(1))
    fields = _FIELDS_BY_TAG.get(tag) if isinstance(tag, str) else None
    if fields and 1 <= slot <= len(fields):
        return f"{msg} (field {fields[slot - 1]!r})"
    return msg


_KNOWN_TAGS: Final = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))


def _is_unknown_tag(data: bytes, is_map: bool) -> bool:
    try:
        obj = msgspec.msgpack.decode(data)
    except Exception:  # noqa: BLE001
        return False
    if is_map and isinstance(obj, dict):
        tag = obj.get("type")
    elif not is_map and isinstance(obj, list) and obj:
        tag = obj[0]
    else:
        return False
    return isinstance(tag, str) and tag not in _KNOWN_TAGS


ARRAY_FIELDS_V0_11: Final = {"BlockStored": 6, "BlockRemoved": 2, "AllBlocksCleared": 0}
"""How many fields (after the tag) vLLM 0.11 puts in each array-shaped event."""

_STORED_N: Final = len(_STORED_FIELDS)
_REMOVED_N: Final = len(_REMOVED_FIELDS)


class EventEncoder:
    """Encodes :class:`KVEventBatch` payloads byte-identically to vLLM.

    ``format="map"`` is vLLM >= 0.26's shape (and the default). ``format="array"`` is the
    0.11 tagged-array shape; ``array_fields`` picks how many fields follow the tag:
    ``"v0.11"`` (default) writes exactly 0.11's field set (BlockStored 6, BlockRemoved 2),
    dropping newer fields; ``"all"`` writes every field up to the last one that is set
    (a kvstream shape: msgspec's array-like structs write every field); an int ``n``
    writes the first ``n`` fields of each event (fewer if the event has fewer).

    A batch whose ``data_parallel_rank`` is None is written with ``nil`` there in the map
    shape (as vLLM's encoder does) and without the slot in the array shape (as engines from
    before the field did); vLLM's publisher never sends a None rank (it stamps its own).
    """

    __slots__ = ("_enc", "_format", "_array_fields")

    def __init__(
        self,
        format: Literal["map", "array"] = "map",
        *,
        array_fields: Literal["v0.11", "all"] | int = "v0.11",
    ) -> None:
        if format not in ("map", "array"):
            raise ValueError(f"format must be 'map' or 'array', got {format!r}")
        if not (array_fields in ("v0.11", "all") or (isinstance(array_fields, int) and array_fields >= 0)):
            raise ValueError(
                f"array_fields must be 'v0.11', 'all' or a non-negative int, got {array_fields!r}"
            )
        self._enc = msgspec.msgpack.Encoder()
        self._format = format
        self._array_fields = array_fields

    @property
    def format(self) -> str:
        """``"map"`` or ``"array"``."""
        return self._format

    def encode(self, batch: KVEventBatch) -> bytes:
        """The msgpack payload for ``batch``."""
        if self._format == "map":
            return self._enc.encode(batch)
        out: list[Any] = [batch.ts, [self._array_event(e) for e in batch.events]]
        if batch.data_parallel_rank is not None:
            out.append(batch.data_parallel_rank)
        return self._enc.encode(out)

    def _array_event(self, ev: AnyEvent) -> list[Any]:
        cls = type(ev)
        if cls is BlockStored:
            fields, total = _STORED_FIELDS, _STORED_N
        elif cls is BlockRemoved:
            fields, total = _REMOVED_FIELDS, _REMOVED_N
        elif cls is AllBlocksCleared:
            return ["AllBlocksCleared"]
        else:
            raise TypeError(f"not a KV event: {ev!r}")
        af = self._array_fields
        if af == "v0.11":
            n = ARRAY_FIELDS_V0_11[cls.__name__]
        elif af == "all":
            n = total
            while n > 0 and getattr(ev, fields[n - 1]) is None and fields[n - 1] not in _REQUIRED:
                n -= 1
        else:
            n = min(int(af), total)
        return [cls.__name__, *[getattr(ev, f) for f in fields[:n]]]


# Fields without a default are always on the wire, even as nil.
_REQUIRED: Final = frozenset(
    _STORED_FIELDS[: _STORED_N - len(BlockStored.__struct_defaults__)]
    + _REMOVED_FIELDS[: _REMOVED_N - len(BlockRemoved.__struct_defaults__)]
)

_DEFAULT_ENCODER = EventEncoder()
_DEFAULT_DECODER = EventDecoder()


def encode_batch(batch: KVEventBatch, format: Literal["map", "array"] = "map") -> bytes:
    """Encode ``batch`` in ``format`` (see :class:`EventEncoder`)."""
    if format == "map":
        return _DEFAULT_ENCODER.encode(batch)
    return EventEncoder(format).encode(batch)


def decode_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode one payload of any vintage (see :class:`EventDecoder`)."""
    return _DEFAULT_DECODER.decode(payload)
