"""ZMQ message framing of vLLM's KV event stream (no sockets here, just frames).

Live messages on the PUB socket are ``[topic, seq, payload]`` with ``seq`` an 8-byte
big-endian unsigned counter starting at 0 and incremented per batch. Replay requests to
the ROUTER are ``[b"", start_seq]`` from a DEALER (the ROUTER sees the identity first).
Replay replies are ``[b"", seq, payload]`` (vLLM 0.11) or ``[b"", topic, seq, payload]``
(vLLM >= 0.26); the reply stream ends with a marker whose seq is eight 0xff bytes (-1 as
a signed integer) and whose payload is empty.

Everything here is pure: the transport (sockets) and the event logs both use it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, Sequence

from kvstream.errors import RemoteProtocolError

__all__ = [
    "END_SEQ",
    "END_SEQ_BYTES",
    "FrameError",
    "LiveMessage",
    "ReplayReply",
    "encode_seq",
    "decode_seq",
    "parse_live",
    "split_live",
    "parse_replay_reply",
    "parse_replay_request",
    "SNAPSHOT_REQUEST",
]

_SEQ = struct.Struct(">Q")
END_SEQ: Final = (1 << 64) - 1
"""The seq of the replay end marker, as an unsigned 64-bit value."""
END_SEQ_BYTES: Final = b"\xff" * 8
"""The seq frame of the replay end marker (-1 as a signed 8-byte big-endian integer)."""
SNAPSHOT_REQUEST: Final = b"SNAPSHOT"
"""kvstream extension: a replay request whose start frame is this asks for a snapshot of
the pool's whole current state instead of buffered batches (vLLM's ROUTER ignores it)."""


class FrameError(RemoteProtocolError, ValueError):
    """A multipart message has the wrong shape (a remote protocol error)."""


def encode_seq(seq: int) -> bytes:
    """``seq`` as the 8-byte big-endian frame."""
    return _SEQ.pack(seq)


def decode_seq(frame: bytes) -> int:
    """The unsigned seq in an 8-byte frame; :class:`FrameError` if it is not 8 bytes."""
    if len(frame) != 8:
        raise FrameError(f"seq frame must be 8 bytes, got {len(frame)}")
    return _SEQ.unpack(frame)[0]


@dataclass(frozen=True, slots=True)
class LiveMessage:
    """A live message from the PUB socket."""

    topic: bytes
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ReplayReply:
    """One replay reply; ``end`` is True for the end marker (then ``payload`` is empty)."""

    topic: bytes | None
    seq: int
    payload: bytes
    end: bool


_unpack_seq = _SEQ.unpack


def split_live(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """Check and split ``[topic, seq, payload]`` into ``(topic, seq, payload)``: the
    subscriber's per-message path (no object built); :class:`FrameError` on a bad shape."""
    if len(frames) != 3:
        raise FrameError(f"live message must have 3 frames [topic, 8-byte seq, payload], got "
                         f"{len(frames)} {[len(f) for f in frames[:4]]}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise FrameError(f"live message seq frame must be 8 bytes, got {len(seq)}")
    return topic, _unpack_seq(seq)[0], payload


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    """Check and split ``[topic, seq, payload]`` into a :class:`LiveMessage`."""
    topic, seq, payload = split_live(frames)
    return LiveMessage(bytes(topic), seq, payload)


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayReply:
    """Check and split a reply as a DEALER receives it: ``[b"", seq, payload]`` (0.11)
    or ``[b"", topic, seq, payload]`` (>= 0.26)."""
    n = len(frames)
    if n == 3:
        empty, seq, payload = frames
        topic: bytes | None = None
    elif n == 4:
        empty, topic, seq, payload = frames
        topic = bytes(topic)
    else:
        raise FrameError(f"replay reply must have 3 or 4 frames, got {n}")
    if len(empty) != 0:
        raise FrameError("replay reply must start with an empty delimiter frame")
    s = decode_seq(seq)
    end = s == END_SEQ
    if end and len(payload) != 0:
        raise FrameError("replay end marker must have an empty payload")
    return ReplayReply(topic, s, payload, end)


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int | None]:
    """Split a request as a ROUTER receives it, ``[identity, b"", start]``.

    Returns ``(identity, start_seq)``, with ``start_seq`` None for a snapshot request
    (:data:`SNAPSHOT_REQUEST`).
    """
    if len(frames) != 3:
        raise FrameError(f"replay request must have 3 frames [identity, b'', start], got {len(frames)}")
    ident, empty, start = frames
    if len(empty) != 0:
        raise FrameError("replay request must have an empty delimiter frame")
    if bytes(start) == SNAPSHOT_REQUEST:
        return bytes(ident), None
    return bytes(ident), decode_seq(start)
