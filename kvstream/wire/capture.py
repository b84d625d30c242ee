"""Reader and writer for the ``KVSTRM01`` wire-capture format of the golden vLLM captures.

A capture is what a SUB socket and a DEALER replay client saw, frame for frame::

    8 bytes  magic b"KVSTRM01"
    records until EOF:
      u8      channel (0 = received on SUB, 2 = sent by the DEALER, 1 = received by it)
      u32 BE  number of frames, then per frame: u32 BE length, the bytes

This module imports nothing of kvstream's: it is a file format, not a protocol.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import BinaryIO, Iterable, Iterator

from kvstream.errors import RemoteProtocolError

__all__ = ["CaptureChannel", "CaptureRecord", "CaptureFormatError", "read_capture",
           "iter_capture", "write_capture", "CAPTURE_MAGIC"]

CAPTURE_MAGIC = b"KVSTRM01"
_U32 = struct.Struct(">I")
# A frame longer than this is certainly a corrupt length field, not a KV event payload.
_MAX_FRAME = 1 << 30


class CaptureChannel(IntEnum):
    """Which socket a capture record belongs to."""

    LIVE = 0
    """A multipart message received on the SUB socket: ``[topic, seq, payload]``."""
    REPLAY_REPLY = 1
    """A multipart message the DEALER received from the replay ROUTER."""
    REPLAY_REQUEST = 2
    """A multipart message the DEALER sent (a replay request)."""


@dataclass(frozen=True, slots=True)
class CaptureRecord:
    """One multipart message of a capture."""

    channel: CaptureChannel
    frames: tuple[bytes, ...]
    offset: int
    """Byte offset of the record in the file."""


class CaptureFormatError(RemoteProtocolError, ValueError):
    """The capture file is not in ``KVSTRM01`` format or is truncated; says where."""


def iter_capture(f: BinaryIO) -> Iterator[CaptureRecord]:
    """Yield every record of an open capture file, checking the framing as it goes."""
    magic = f.read(8)
    if magic != CAPTURE_MAGIC:
        raise CaptureFormatError(f"bad magic {magic!r} at offset 0, expected {CAPTURE_MAGIC!r}")
    offset = 8
    while True:
        head = f.read(5)
        if not head:
            return
        if len(head) < 5:
            raise CaptureFormatError(f"truncated record header at offset {offset}")
        channel = head[0]
        if channel not in (0, 1, 2):
            raise CaptureFormatError(f"unknown channel {channel} at offset {offset}")
        (nframes,) = _U32.unpack_from(head, 1)
        frames = []
        pos = offset + 5
        for i in range(nframes):
            lb = f.read(4)
            if len(lb) < 4:
                raise CaptureFormatError(f"truncated length of frame {i} at offset {pos}")
            (n,) = _U32.unpack(lb)
            if n > _MAX_FRAME:
                raise CaptureFormatError(f"frame {i} length {n} at offset {pos} is implausible")
            data = f.read(n)
            if len(data) < n:
                raise CaptureFormatError(
                    f"frame {i} at offset {pos} is truncated: {len(data)} of {n} bytes"
                )
            frames.append(data)
            pos += 4 + n
        yield CaptureRecord(CaptureChannel(channel), tuple(frames), offset)
        offset = pos


def read_capture(path: str | os.PathLike[str]) -> list[CaptureRecord]:
    """Read a whole capture file (raises :class:`CaptureFormatError` if damaged)."""
    with open(path, "rb") as f:
        return list(iter_capture(f))


def write_capture(path: str | os.PathLike[str], records: Iterable[tuple[int, Iterable[bytes]]]) -> None:
    """Write ``(channel, frames)`` records as a ``KVSTRM01`` capture."""
    with open(path, "wb") as f:
        f.write(CAPTURE_MAGIC)
        for channel, frames in records:
            frames = list(frames)
            f.write(bytes((int(channel),)) + _U32.pack(len(frames)))
            for fr in frames:
                f.write(_U32.pack(len(fr)))
                f.write(fr)
