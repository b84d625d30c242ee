"""Append-only event log writer: buffering, flush policy, rotation, crash recovery, zstd.

A log is either a single segment file or, when rotation is on, a directory of numbered
segments (``000000.kvlog``, ``000001.kvlog``, ...) that read back as one stream. The
writer is synchronous and never blocks on anything but the file: an async shell (the
recorder) calls :meth:`LogWriter.poll` now and then so an idle log still gets flushed.
"""

from __future__ import annotations

import errno
import os
import secrets
import time
from pathlib import Path
from typing import Any, Literal

from kvstream.eventlog.format import (
    FLAG_ZSTD,
    MAX_CHUNK_BYTES,
    NAME_REPEAT_BYTES,
    LogDamage,
    LogFormatError,
    RecordEncoder,
    SegmentCursor,
    encode_header,
)

__all__ = ["LogWriter", "FlushPolicy", "SEGMENT_SUFFIX", "segment_name", "list_segments", "zstd_available"]

FlushPolicy = Literal["record", "interval", "close"]
"""When buffered records reach the file: after every record, every ``flush_interval``
seconds (and whenever the buffer fills), or only when the buffer fills and on close."""

SEGMENT_SUFFIX = ".kvlog"
"""File name suffix of the segments of a directory log."""

_MAX_BUFFER = 1 << 20  # bytes buffered before a flush whatever the policy


def segment_name(index: int) -> str:
    """The file name of segment ``index`` inside a directory log."""
    return f"{index:06d}{SEGMENT_SUFFIX}"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """The ``(index, path)`` of every segment file in a directory log, in index order."""
    out = []
    for p in directory.iterdir():
        if p.suffix == SEGMENT_SUFFIX and p.stem.isdigit():
            out.append((int(p.stem), p))
    out.sort()
    return out


def zstd_available() -> bool:
    """True if the optional ``zstandard`` package is installed."""
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


def _zstd_decompressor() -> Any:
    try:
        import zstandard
    except ImportError:
        return None
    d = zstandard.ZstdDecompressor()

    def decompress(data: bytes, raw_len: int) -> bytes:
        # Check the frame's own declared size before decompressing: zstandard allocates
        # what the frame declares, whatever max_output_size says (a zstd bomb).
        declared = zstandard.frame_content_size(data)
        if declared >= 0 and declared != raw_len:
            raise ValueError(f"the zstd frame declares {declared} bytes, the chunk {raw_len}: not decompressed")
        out = d.decompress(data, max_output_size=raw_len)
        if len(out) != raw_len:
            raise ValueError(f"decompressed to {len(out)} bytes, expected {raw_len}")
        return out

    return decompress


class LogWriter:
    """Writes an event log. Use as a context manager, or call :meth:`close`.

    ``path``: a file (single segment) or, with ``rotate_bytes``/``rotate_seconds``, a
    directory of segments. ``metadata``: a JSON-able dict stored in every segment header
    (endpoints, topic, anything). ``flush``/``flush_interval`` (seconds): see
    :data:`FlushPolicy`. ``fsync``: also fsync the file on every flush (survives power
    loss, not only a process crash; slower). ``compression="zstd"`` packs each flush into
    one zstd frame (needs ``kvstream[zstd]``; pays off with ``interval``/``close``
    flushing, not with ``record``). ``resume=True`` appends to an existing log after
    cutting off a torn or damaged tail (reported in :attr:`recovered`).

    ``tap_source`` is the source name :meth:`tap` records under (an engine logging its own
    published stream).
    """

    __slots__ = ("path", "metadata", "_flush_policy", "_flush_interval", "_rotate_bytes",
                 "_rotate_seconds", "_fsync", "_level", "_compressor", "_enc", "_buf",
                 "_buf_records", "_file", "_seg_index", "_seg_bytes", "_seg_start", "_seg_records",
                 "_log_id", "_last_flush", "_dir", "_closed", "tap_source", "recovered",
                 "records", "bytes_written", "segments_opened", "flags", "_clock", "moved_aside",
                 "resumed", "_stretch_at")

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        metadata: dict[str, Any] | None = None,
        flush: FlushPolicy = "interval",
        flush_interval: float = 0.05,
        rotate_bytes: int | None = None,
        rotate_seconds: float | None = None,
        compression: Literal["zstd"] | None = None,
        zstd_level: int = 3,
        fsync: bool = False,
        resume: bool = False,
        tap_source: str = "self",
    ) -> None:
        if flush not in ("record", "interval", "close"):
            raise ValueError(f"flush must be 'record', 'interval' or 'close', got {flush!r}")
        if flush_interval <= 0:
            raise ValueError(f"flush_interval must be > 0 seconds, got {flush_interval}")
        if rotate_bytes is not None and rotate_bytes <= 0:
            raise ValueError(f"rotate_bytes must be > 0, got {rotate_bytes}")
        if rotate_seconds is not None and rotate_seconds <= 0:
            raise ValueError(f"rotate_seconds must be > 0, got {rotate_seconds}")
        if compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
        self._compressor: Any = None
        if compression == "zstd":
            try:
                import zstandard
            except ImportError:
                raise ValueError(
                    "compression='zstd' needs the 'zstandard' package: pip install 'kvstream[zstd]'"
                ) from None
            self._compressor = zstandard.ZstdCompressor(level=zstd_level)
        self.path = Path(path)
        self.metadata = dict(metadata or {})
        self._flush_policy = flush
        self._flush_interval = float(flush_interval)
        self._rotate_bytes = rotate_bytes
        self._rotate_seconds = rotate_seconds
        self._fsync = fsync
        self._level = zstd_level
        self.flags = FLAG_ZSTD if compression else 0
        self._enc = RecordEncoder()
        self._stretch_at = 0  # segment offset where the current stretch of plain records began
        self._buf = bytearray()
        self._buf_records = 0
        self._clock = time.monotonic
        self._last_flush = self._clock()
        self._closed = False
        self.tap_source = tap_source
        self.recovered: list[LogDamage] = []
        """Damage found in the last segment of an existing log when resuming, each saying
        what was done about it (bytes moved aside, or kept in place)."""
        self.moved_aside: list[Path] = []
        """``.damaged`` files this writer moved unreadable bytes into when resuming."""
        self.records = 0
        """Message and control records written (or buffered) by this writer."""
        self.bytes_written = 0
        """Bytes this writer put into files (headers included)."""
        self.segments_opened = 0
        """Segments this writer created or reopened."""
        self._dir = (rotate_bytes is not None or rotate_seconds is not None
                     or (resume and self.path.is_dir()))
        self._file: Any = None
        self._seg_index = 0
        self._seg_bytes = 0
        self._seg_records = 0
        self._seg_start = self._clock()
        self._log_id = secrets.randbits(64)
        exists = self.path.exists() and (not self.path.is_dir() or any(list_segments(self.path)))
        if exists and not resume:
            raise FileExistsError(
                f"event log {self.path} already exists; pass resume=True (CLI: --append) to append "
                "to it, or choose another path"
            )
        self.resumed = exists
        """True if this writer appends to a log that existed."""
        if exists:
            self._resume()
        else:
            if self._dir:
                self.path.mkdir(parents=True, exist_ok=True)
            self._open_segment(0)

    # -- segments --------------------------------------------------------------------

    def _segment_path(self, index: int) -> Path:
        return self.path / segment_name(index) if self._dir else self.path

    def _open_segment(self, index: int) -> None:
        self._seg_index = index
        self._enc.reset_names()
        p = self._segment_path(index)
        self._file = open(p, "wb", buffering=0)
        head = encode_header(flags=self.flags, segment_index=index, log_id=self._log_id,
                             created_ns=time.time_ns(), metadata=self.metadata)
        self._write_all(head)
        if self._fsync:
            os.fsync(self._file.fileno())
        self._seg_bytes = self._stretch_at = len(head)
        self._seg_records = 0
        self._seg_start = self._clock()
        self.bytes_written += len(head)
        self.segments_opened += 1

    def _aside(self, seg: Path) -> Path:
        """A free ``<segment>.damaged[.N]`` path next to ``seg`` (never a segment name)."""
        cand = seg.with_name(seg.name + ".damaged")
        n = 1
        while cand.exists():
            cand = seg.with_name(f"{seg.name}.damaged.{n}")
            n += 1
        return cand

    def _resume(self) -> None:
        # Appending never deletes a record that verifies: bytes the reader cannot use are
        # moved into a `.damaged` file next to the segment, never dropped, and each move
        # is reported in `recovered` and `moved_aside`.
        from kvstream.eventlog.reader import scan_segment

        if self.path.is_dir():
            segs = list_segments(self.path)
            index, p = segs[-1]
        else:
            index, p = 0, self.path
        cur = scan_segment(p)
        size = p.stat().st_size
        if cur.header is None:
            self._resume_damaged_header(index, p, cur, size)
            return
        h = cur.header
        if not self._dir and h.flags != self.flags:
            raise LogFormatError(
                f"{p} was written with flags {h.flags} (zstd={bool(h.flags & FLAG_ZSTD)}) but this "
                f"writer uses zstd={bool(self.flags & FLAG_ZSTD)}; resume with the same compression "
                "setting, or write a new log"
            )
        for d in cur.damages:
            if d.offset + d.lost_bytes <= cur.valid_end:
                self.recovered.append(LogDamage(d.segment, d.offset, d.reason + " (kept in place: readers "
                                                "skip it and read the records after it)", d.lost_bytes))
        if cur.valid_end < size:
            aside = self._aside(p)
            with open(p, "r+b") as f:
                f.seek(cur.valid_end)
                with open(aside, "wb") as out:
                    while chunk := f.read(1 << 20):
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                f.truncate(cur.valid_end)
            self.moved_aside.append(aside)
            tail = [d for d in cur.damages if d.offset + d.lost_bytes > cur.valid_end]
            why = tail[0].reason if tail else "unverifiable bytes"
            self.recovered.append(LogDamage(str(p), cur.valid_end, f"{why}; the {size - cur.valid_end} "
                                            f"bytes from there were moved to {aside}", size - cur.valid_end))
        self._log_id = h.log_id
        if self._dir:
            # Directory logs resume in a fresh segment, so settings such as compression may
            # change between runs.
            self.metadata = {**h.metadata, **self.metadata}
            self._open_segment(index + 1)
            return
        self.metadata = h.metadata
        self._file = open(p, "r+b", buffering=0)
        self._file.seek(cur.valid_end)
        self._enc.preload_names(cur.sources, cur.topics)
        self._seg_index = 0
        self._seg_bytes = cur.valid_end
        self._seg_records = cur.records
        self.segments_opened += 1

    def _resume_damaged_header(self, index: int, p: Path, cur: SegmentCursor, size: int) -> None:
        from kvstream.eventlog.reader import scan_segment

        if self._dir and index > 0:
            prev = scan_segment(list_segments(self.path)[-2][1], records=False)
            if prev.header is not None:
                self._log_id = prev.header.log_id
        head = cur.damages[0]
        if cur.records == 0 and cur.start >= size:
            # Nothing after the header verifies (a crash while the segment was created):
            # there is no record to keep, so the segment is written anew.
            self.recovered.append(LogDamage(str(p), 0, f"{head.reason}; the segment held no "
                                            "record and was written anew", size))
            self._open_segment(index)
            return
        aside = self._aside(p)
        os.replace(p, aside)
        self.moved_aside.append(aside)
        self.metadata = {**self.metadata, "salvaged_from": aside.name}
        self._open_segment(index)
        with open(aside, "rb") as f:
            f.seek(cur.start)
            left = cur.valid_end - cur.start
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                self._file.write(chunk)
                left -= len(chunk)
        copied = cur.valid_end - cur.start
        self._seg_bytes += copied
        self.bytes_written += copied
        self._seg_records = cur.records
        self.recovered.append(LogDamage(
            str(p), 0, f"{head.reason}; the whole segment was moved to {aside} and its {cur.records} "
            f"records that verify were copied under a new header", head.lost_bytes))
        if self._dir:
            self._file.close()
            self._open_segment(index + 1)
        else:
            self._enc.preload_names(cur.sources, cur.topics)

    def _rotate(self) -> None:
        self._file.close()
        self._open_segment(self._seg_index + 1)

    # -- writing ---------------------------------------------------------------------

    def write_message(self, source: str, topic: bytes, seq: int, payload: bytes | bytearray | memoryview,
                      *, replayed: bool = False, recv_ns: int | None = None) -> None:
        """Record one received message (``recv_ns``: ns since the epoch, default now)."""
        if self._closed:
            raise ValueError(f"event log writer for {self.path} is closed")
        self._enc.message(self._buf, time.time_ns() if recv_ns is None else recv_ns,
                          source, topic, seq, payload, replayed)
        self._buf_records += 1
        self.records += 1
        self._after_write()

    def write_control(self, source: str, kind: str, *, reason: str = "", seq: int | None = None,
                      first_missing_seq: int | None = None, resume_seq: int | None = None,
                      recv_ns: int | None = None) -> None:
        """Record a subscriber control item (``kind`` "reset", "stale" or "live")."""
        if self._closed:
            raise ValueError(f"event log writer for {self.path} is closed")
        self._enc.control(self._buf, time.time_ns() if recv_ns is None else recv_ns, source, kind,
                          reason, seq, first_missing_seq, resume_seq)
        self._buf_records += 1
        self.records += 1
        self._after_write()

    def tap(self, seq: int, topic: bytes, payload: bytes) -> None:
        """Record a message this process published itself (a publisher tap), as
        ``tap_source``, received now."""
        self.write_message(self.tap_source, topic, seq, payload)

    def _after_write(self) -> None:
        if self._compressor is None and self._seg_bytes + len(self._buf) - self._stretch_at >= NAME_REPEAT_BYTES:
            # Names again (see kvstream.eventlog.format): a damaged name record then costs
            # no other record.
            self._enc.end_stretch(self._buf)
            self._stretch_at = self._seg_bytes + len(self._buf)
        policy = self._flush_policy
        n = len(self._buf)
        if policy == "record" or n >= _MAX_BUFFER:
            self.flush()
        elif self._rotate_bytes is not None and self._seg_bytes + n >= self._rotate_bytes:
            self.flush()
        elif policy == "interval" and self._clock() - self._last_flush >= self._flush_interval:
            self.flush()

    def poll(self) -> None:
        """Apply the time-based parts of the policy (interval flush, time rotation); call
        it every few ms from the owner's loop, whether or not records arrive."""
        if self._closed:
            return
        now = self._clock()
        if self._buf and self._flush_policy == "interval" and now - self._last_flush >= self._flush_interval:
            self.flush()
        elif (self._rotate_seconds is not None and self._seg_records
              and now - self._seg_start >= self._rotate_seconds):
            self.flush()

    def flush(self) -> None:
        """Write every buffered record to the file now (one zstd chunk if compressing),
        then rotate if the segment is full or old enough."""
        if self._closed:
            return
        self._last_flush = self._clock()
        if self._buf:
            if self._compressor is not None and len(self._buf) <= MAX_CHUNK_BYTES:
                raw = bytes(self._buf)
                out = bytearray()
                RecordEncoder.chunk(out, self._compressor.compress(raw), len(raw), self._buf_records)
                data: bytes | bytearray = out
                self._enc.new_stretch()  # each chunk declares the names it uses
            else:
                # Readers refuse chunks that declare more than MAX_CHUNK_BYTES (zstd bombs),
                # so a bigger flush goes out as plain records, which every reader accepts.
                data = self._buf
            self._write_all(data)
            if self._fsync:
                os.fsync(self._file.fileno())
            self._seg_bytes += len(data)
            self._seg_records += self._buf_records
            self.bytes_written += len(data)
            self._buf = bytearray()
            self._buf_records = 0
            # A new segment re-declares names, so name ids must not leak across chunks of
            # different segments: rotation happens only here, right after a flush.
            if ((self._rotate_bytes is not None and self._seg_bytes >= self._rotate_bytes)
                    or (self._rotate_seconds is not None
                        and self._last_flush - self._seg_start >= self._rotate_seconds)):
                self._rotate()
        elif (self._rotate_seconds is not None and self._seg_records
              and self._last_flush - self._seg_start >= self._rotate_seconds):
            self._rotate()

    def _write_all(self, data: bytes | bytearray) -> None:
        """Write ``data`` whole at the end of the segment, or not at all: an unbuffered write
        can stop short (disk full, file size limit); the rest is written in a loop, and on
        an error the segment is cut back to where this write began (a record boundary), so
        records written later still follow a complete record. The buffer is kept, so a
        later flush or :meth:`close` tries again; the error propagates."""
        f = self._file
        start = f.tell()
        done, total = 0, len(data)
        try:
            while done < total:
                # A slice (a copy) only after a short write; no memoryview stays exported
                # over the buffer, which keeps growing if this write fails.
                n = f.write(data if done == 0 else data[done:])
                if not n:  # None (would block) or 0: not expected for a regular file
                    raise OSError(errno.EIO, "the file accepted no bytes")
                done += n
        except OSError:
            try:
                f.truncate(start)
                f.seek(start)
            except OSError:
                pass
            raise

    def close(self) -> None:
        """Flush everything and close the file (idempotent)."""
        if self._closed:
            return
        try:
            self.flush()
            if not self._fsync:
                # Closing is the moment a clean shutdown promises durability.
                os.fsync(self._file.fileno())
        finally:
            self._closed = True
            self._file.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    @property
    def segment_index(self) -> int:
        """The index of the segment being written."""
        return self._seg_index

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
