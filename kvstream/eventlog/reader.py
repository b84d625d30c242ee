"""Event log reader: every segment of a log as one stream of records, damage reported.

Each segment is read in windows of at most :data:`~kvstream.eventlog.format.WINDOW`
bytes (plus one record, if a record is larger) and scanned with
:class:`~kvstream.eventlog.format.SegmentCursor`. Plain reads, not a memory map: a file
that shrinks under a reader (truncated by another process) ends the segment early, as
a torn tail, where a memory map would kill the process with SIGBUS.

Every record that verifies is yielded: a damaged place (segment, byte offset, reason) is
added to :attr:`LogReader.damage` and reading goes on at the next record that verifies
(a segment whose header is damaged is read from its first record that verifies).
"""

from __future__ import annotations

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
    WINDOW,
    decode_header,
)
from kvstream.eventlog.writer import _zstd_decompressor, list_segments

__all__ = ["LogReader", "read_log", "scan_segment"]


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
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                self.damage.append(LogDamage(str(path), 0, "segment disappeared while the log was read", 0))
                continue
            with f:
                first = f.read(WINDOW)
                if not first:
                    self.damage.append(LogDamage(str(path), 0, "empty segment (crash while creating it)", 0))
                    continue
                cur = SegmentCursor(first, name=str(path), decompress=decompress, salvage=True)
                h = cur.header
                if h is not None:
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
                elif expect is not None:
                    expect += 1
                for rec in _windows(f, cur, first):
                    self.records += 1
                    yield rec
                self.damage.extend(cur.damages)


def scan_segment(path: str | os.PathLike[str], *, records: bool = True) -> SegmentCursor:
    """Scan one segment file to its end in bounded memory and return the cursor (header,
    damage, ``valid_end``, name tables, record count); the records are discarded.
    ``records=False``: read the header only. A damaged header is salvaged (``header`` None)."""
    with open(path, "rb") as f:
        buf = f.read(WINDOW)
        cur = SegmentCursor(buf, name=str(path), decompress=_zstd_decompressor(), salvage=True)
        if records:
            for _ in _windows(f, cur, buf):
                pass
        return cur


def _windows(f: Any, cur: SegmentCursor, first: bytes) -> Iterator[LogRecord]:
    """Feed ``cur`` the file ``f`` window by window (``first``: the bytes from offset 0)."""
    buf, base = first, 0
    final = len(first) < WINDOW
    while True:
        yield from cur.scan(buf, base, final=final)
        pos = cur.next_pos
        if pos is None:
            return
        want = max(WINDOW, cur.need)
        f.seek(pos)
        buf, base = f.read(want), pos
        final = len(buf) < want
        if not buf and cur.need:
            # The last window ended inside a record, and now there is nothing there.
            cur.note_shrunk(pos)
            return


def read_log(path: str | os.PathLike[str]) -> tuple[list[LogRecord], list[LogDamage]]:
    """Every intact record of the log at ``path`` and the damage found (empty if none)."""
    r = LogReader(path)
    recs = list(r)
    return recs, r.damage
