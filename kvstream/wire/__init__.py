"""The wire: vLLM's KV event schema and codec (``events``), ZMQ frame shapes (``framing``) and
the golden capture file format (``capture``).

Everything that knows how bytes look on vLLM's sockets lives in this package; it imports
nothing of kvstream but :mod:`kvstream.errors`.
"""

from __future__ import annotations

from kvstream.wire.events import (
    MEDIUM_GPU,
    MEDIUM_CPU,
    ExternalBlockHash,
    KVCacheEvent,
    BlockStored,
    BlockRemoved,
    AllBlocksCleared,
    KVEventBatch,
    EventDecodeError,
    EventEncoder,
    EventDecoder,
    encode_batch,
    decode_batch,
    ARRAY_FIELDS_V0_11,
    DEFAULT_MAX_PAYLOAD_BYTES,
)
from kvstream.wire.framing import (
    END_SEQ,
    END_SEQ_BYTES,
    FrameError,
    LiveMessage,
    ReplayReply,
    encode_seq,
    decode_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    SNAPSHOT_REQUEST,
)
from kvstream.wire.capture import (
    CaptureChannel,
    CaptureRecord,
    CaptureFormatError,
    read_capture,
    iter_capture,
    write_capture,
    CAPTURE_MAGIC,
)

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
    "END_SEQ",
    "END_SEQ_BYTES",
    "FrameError",
    "LiveMessage",
    "ReplayReply",
    "encode_seq",
    "decode_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "SNAPSHOT_REQUEST",
    "CaptureChannel",
    "CaptureRecord",
    "CaptureFormatError",
    "read_capture",
    "iter_capture",
    "write_capture",
    "CAPTURE_MAGIC",
]
