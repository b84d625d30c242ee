"""Event log reader: every segment of a log as one stream of records, damage reported.

Each segment is memory-mapped and scanned with :class:`~kvstream.eventlog.format.SegmentCursor`.
A damaged segment yields every intact record before the damage; the damage (segment,
byte offset, reason) lands in :attr:`LogReader.damage` and reading goes on with the next
segment. Nothing is ever yielded from after a damaged point of a segment.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Iterator

from kvstream.eventlog.format import (
    HeaderDamagedError,
    LogDamage,
    LogFormatError,
    LogRecord,
    SegmentCursor,
    SegmentHeader,
    decode_header,
)
from kvstream.eventlog.writer import _zstd_decompressor, list_segments

__all__ = ["LogReader", "read_log"]


class LogReader:
    """Reads an event log (a segment file or a directory of segments).

    Iterate it for :class:`LogMessage` / :class:`LogControl` records in recording order.
    After (or during) iteration, :attr:`damage` lists every damaged place found, and
    :attr:`headers` the header of each segment read. Iterating again starts over.
    """

    __slots__ = ("path", "segments", "damage", "headers", "records")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            self.segments = [p for _, p in list_segments(self.path)]
            if not self.segments:
                raise LogFormatError(f"{self.path} is a directory with no *.kvlog segments")
        elif self.path.exists():
            self.segments = [self.path]
        else:
            raise FileNotFoundError(f"event log {self.path} does not exist")
        self.damage: list[LogDamage] = []
        """Damage found so far, in reading order."""
        self.headers: list[SegmentHeader] = []
        """Header of each segment read so far."""
        self.records = 0
        """Records yielded by the last iteration."""

    @property
    def metadata(self) -> dict[str, Any]:
        """The first segment's metadata (reads its header if not yet read)."""
        if self.headers:
            return self.headers[0].metadata
        with open(self.segments[0], "rb") as f:
            head = f.read(1 << 16)
        try:
            return decode_header(head, name=str(self.segments[0])).metadata
        except HeaderDamagedError:
            return {}

    def __iter__(self) -> Iterator[LogRecord]:
        self.damage = []
        self.headers = []
        self.records = 0
        decompress = _zstd_decompressor()
        log_id = None
        expect = None
        for path in self.segments:
            size = path.stat().st_size
            if size == 0:
                self.damage.append(LogDamage(str(path), 0, "empty segment (crash while creating it)", 0))
                continue
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                try:
                    cur = SegmentCursor(mm, name=str(path), decompress=decompress)
                except HeaderDamagedError as exc:
                    self.damage.append(LogDamage(str(path), 0, str(exc), size))
                    continue
                h = cur.header
                if log_id is None:
                    log_id = h.log_id
                elif h.log_id != log_id:
                    raise LogFormatError(
                        f"{path} belongs to another log (log id {h.log_id:#x}, expected {log_id:#x}); "
                        "keep each log's segments in their own directory"
                    )
                if expect is not None and h.segment_index != expect:
                    self.damage.append(LogDamage(
                        str(path), 0,
                        f"segments {expect}..{h.segment_index - 1} are missing before this one", 0))
                expect = h.segment_index + 1
                self.headers.append(h)
                it = iter(cur)
                try:
                    for rec in it:
                        self.records += 1
                        yield rec
                finally:
                    # The cursor holds a view of the mmap: end it before the mmap closes.
                    it.close()  # type: ignore[attr-defined]
                if cur.damage is not None:
                    self.damage.append(cur.damage)


def read_log(path: str | os.PathLike[str]) -> tuple[list[LogRecord], list[LogDamage]]:
    """Every intact record of the log at ``path`` and the damage found (empty if none)."""
    r = LogReader(path)
    recs = list(r)
    return recs, r.damage
