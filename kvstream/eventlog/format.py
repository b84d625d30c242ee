"""The byte layout of a kvstream event log segment (format version 2; 1 still reads), sans-IO.

Every byte is documented in ``docs/eventlog.md``; in short (all integers little-endian)::

    segment header
      8 bytes  magic b"KVEVTLOG"
      u16      format version (2; version 1 has the same layout, without name repeats)
      u16      flags (bit 0: records are packed in zstd chunks)
      u32      segment index (0, 1, 2, ... within one log)
      u64      log id (random, shared by every segment of one log)
      u64      creation time (ns since the epoch)
      u32      metadata length M, then M bytes of JSON (an object)
      u32      checksum of every header byte before it

    records until the end of the segment
      u32      checksum of the next 4 + L bytes
      u32      L, the body length
      L bytes  body: u8 kind, then the kind's fields (see below)

The checksum is the low 32 bits of xxh3-64 (seed 0): the fastest of crc32/xxh32/xxh3 on
records of a few hundred bytes here (see ``bench/bench_eventlog.py``). Because it covers
the length field too, a damaged length is caught like a damaged body, so a reader knows
exactly where a damaged record starts, reports that offset, and finds the next record
that verifies to read on from (a false match has a chance of about 2**-32 per offset).

Names are recoverable (version 2): a source or topic name record precedes its first use
in every *stretch* (each zstd chunk; every :data:`NAME_REPEAT_BYTES` of plain records), and a
plain stretch ends with the name records of every name it used. So a damaged name record
costs no other record: a message whose name id is undefined takes the name from the next
repeat ahead (at most a stretch away), and a chunk never depends on another one.

This module encodes and decodes bytes only: no files, no clocks. :mod:`.writer` and
:mod:`.reader` put it on disk.
"""

from __future__ import annotations

import struct
from typing import Any, Final, Iterator, Literal

import msgspec
import xxhash

from kvstream.errors import RemoteProtocolError

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "FLAG_ZSTD",
    "NO_SEQ",
    "LogMessage",
    "LogControl",
    "LogRecord",
    "ControlKind",
    "SegmentHeader",
    "LogDamage",
    "LogFormatError",
    "HeaderDamagedError",
    "encode_header",
    "decode_header",
    "RecordEncoder",
    "SegmentCursor",
    "find_records_start",
    "MAX_CHUNK_BYTES",
    "NAME_REPEAT_BYTES",
]

MAGIC: Final = b"KVEVTLOG"
"""The first 8 bytes of every segment."""
FORMAT_VERSION: Final = 2
"""The format version this module writes and the highest it reads (1 and 2 share the
layout; 2 repeats name records, see :data:`NAME_REPEAT_BYTES`)."""
NAME_REPEAT_BYTES: Final = 256 << 10
"""Plain records between name repeats (bytes): the names a stretch used are written again
at its end, and again before their first use in the next one."""
FLAG_ZSTD: Final = 1
"""Header flag: the segment's records are packed in zstd chunks (kind 4)."""
NO_SEQ: Final = -(1 << 63)
"""The i64 stored where a control record's seq is None."""
FLAG_REPLAYED: Final = 1
"""Message flag: received from the replay socket (or a snapshot)."""
FLAG_NEGATIVE_SEQ: Final = 2
"""Message flag: the seq is negative (stored as seq + 2**64); a snapshot of a publisher
that has published nothing carries seq -1."""
_TWO64: Final = 1 << 64

KIND_MESSAGE: Final = 1
KIND_CONTROL: Final = 2
KIND_NAME: Final = 3
KIND_CHUNK: Final = 4

NAME_SOURCE: Final = 0
NAME_TOPIC: Final = 1

_CONTROL_CODES: Final = {"reset": 1, "stale": 2, "live": 3}
_CONTROL_NAMES: Final = {v: k for k, v in _CONTROL_CODES.items()}

ControlKind = Literal["reset", "stale", "live"]
"""What a control record says: ``reset`` (drop the source's state; ``reason`` is
"restart", "snapshot" or "removed"), ``stale`` (unrecoverable loss) or ``live`` (healthy)."""

_HEAD_FIXED = struct.Struct("<8sHHIQQI")  # magic .. metadata length: 36 bytes
_U32 = struct.Struct("<I")
_REC = struct.Struct("<II")  # checksum, body length
# length, kind, flags, source id, topic id, recv ns, seq: the checksum covers from length on
_MSG_HEAD = struct.Struct("<IBBHHQQ")
_MSG_BODY = struct.Struct("<BHHQQ")  # flags .. seq, read from body offset 1
MSG_OVERHEAD: Final = 8 + 1 + _MSG_BODY.size  # bytes a message record adds to its payload
_CTL_HEAD = struct.Struct("<IBBHQqq")  # length, kind, control code, source id, recv ns, a, b
_CTL_BODY = struct.Struct("<BHQqq")
_NAME_HEAD = struct.Struct("<IBBH")  # length, kind, table, id
_NAME_BODY = struct.Struct("<BH")
_CHUNK_HEAD = struct.Struct("<IBII")  # length, kind, raw length, record count
_CHUNK_BODY = struct.Struct("<II")

_MIN_BODY: Final = {KIND_MESSAGE: 1 + _MSG_BODY.size, KIND_CONTROL: 1 + _CTL_BODY.size,
                     KIND_NAME: 1 + _NAME_BODY.size, KIND_CHUNK: 1 + _CHUNK_BODY.size}
MAX_BODY: Final = 1 << 30
"""A record body longer than this (bytes) is treated as a damaged length field."""
MAX_NAMES: Final = 0xFFFF
"""Distinct sources (and, separately, topics) one segment can name."""

_M32: Final = 0xFFFFFFFF
_xxh3 = xxhash.xxh3_64_intdigest


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The record/header checksum: the low 32 bits of xxh3-64 (seed 0) of ``data``."""
    return _xxh3(data) & _M32


class LogFormatError(RemoteProtocolError, ValueError):
    """A file is not a kvstream event log, or has a version or layout this reader cannot
    use. (Damage after a good header is not raised: it is reported as :class:`LogDamage`.)"""


class HeaderDamagedError(LogFormatError):
    """A segment header is torn or fails its checksum (a crash while creating the segment,
    or damage). Readers report it as :class:`LogDamage` at offset 0."""


class LogMessage(msgspec.Struct, gc=False):
    """One message a subscriber received, as recorded.

    ``recv_ns`` is the receive time (ns since the epoch), ``source`` the subscriber's name
    for the engine, ``topic`` and ``seq`` the wire frames, ``payload`` the raw msgpack
    bytes exactly as received, ``replayed`` True if it came from the replay socket.
    """

    recv_ns: int
    source: str
    topic: bytes
    seq: int
    payload: bytes
    replayed: bool = False


class LogControl(msgspec.Struct, gc=False):
    """A subscriber control item, as recorded (see ``kvstream.transport.items``).

    ``kind`` is ``"reset"`` (``seq`` optional), ``"stale"`` (``first_missing_seq`` and
    ``resume_seq``) or ``"live"`` (``seq``); unused fields are None. ``reason`` is the
    subscriber's reason string (empty for ``live``).
    """

    recv_ns: int
    source: str
    kind: str
    reason: str = ""
    seq: int | None = None
    first_missing_seq: int | None = None
    resume_seq: int | None = None


LogRecord = LogMessage | LogControl


class SegmentHeader(msgspec.Struct, frozen=True):
    """A decoded segment header. ``size`` is its length in bytes (records start there)."""

    version: int
    flags: int
    segment_index: int
    log_id: int
    created_ns: int
    metadata: dict[str, Any]
    size: int

    @property
    def compressed(self) -> bool:
        """True if the segment's records are in zstd chunks."""
        return bool(self.flags & FLAG_ZSTD)


class LogDamage(msgspec.Struct, frozen=True):
    """Where and how a segment is damaged: reading stopped at ``offset`` (bytes from the
    start of ``segment``); ``lost_bytes`` bytes from there to the end were not used."""

    segment: str
    offset: int
    reason: str
    lost_bytes: int

    def __str__(self) -> str:
        return f"{self.segment}: damage at byte {self.offset} ({self.lost_bytes} bytes unread): {self.reason}"


def encode_header(*, flags: int, segment_index: int, log_id: int, created_ns: int,
                  metadata: dict[str, Any] | None) -> bytes:
    """The bytes of a segment header."""
    meta = msgspec.json.encode(metadata or {})
    head = _HEAD_FIXED.pack(MAGIC, FORMAT_VERSION, flags, segment_index, log_id, created_ns, len(meta)) + meta
    return head + _U32.pack(checksum(head))


def decode_header(buf: bytes | bytearray | memoryview, *, name: str = "segment") -> SegmentHeader:
    """Decode the header at the start of ``buf``.

    Raises :class:`LogFormatError` if it is not an event log, its version is newer than
    this reader, or the header is torn or damaged (``name`` is used in the message).
    """
    n = len(buf)
    if n < 8 or bytes(buf[:8]) != MAGIC:
        if n < 8 and bytes(buf[:n]) == MAGIC[:n]:
            raise HeaderDamagedError(f"{name}: header is torn ({n} bytes): the writer crashed while creating it")
        raise LogFormatError(f"{name}: not a kvstream event log (magic {bytes(buf[:8])!r}, expected {MAGIC!r})")
    if n < _HEAD_FIXED.size + 4:
        raise HeaderDamagedError(f"{name}: header is torn ({n} bytes): the writer crashed while creating it")
    _, version, flags, index, log_id, created, mlen = _HEAD_FIXED.unpack_from(buf, 0)
    end = _HEAD_FIXED.size + mlen
    if end + 4 > n:
        raise HeaderDamagedError(f"{name}: header is torn (needs {end + 4} bytes, file has {n})")
    (stored,) = _U32.unpack_from(buf, end)
    with memoryview(buf) as mv:
        ok = checksum(mv[:end]) == stored
    if not ok:
        raise HeaderDamagedError(f"{name}: header checksum mismatch: the header is damaged")
    if version > FORMAT_VERSION:
        raise LogFormatError(
            f"{name}: format version {version} is newer than this kvstream reads ({FORMAT_VERSION}); "
            "upgrade kvstream"
        )
    try:
        meta = msgspec.json.decode(bytes(buf[_HEAD_FIXED.size:end]))
    except msgspec.DecodeError as exc:  # pragma: no cover - checksum passed, so a writer bug
        raise LogFormatError(f"{name}: header metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise LogFormatError(f"{name}: header metadata must be a JSON object, got {type(meta).__name__}")
    return SegmentHeader(version, flags, index, log_id, created, meta, end + 4)


class RecordEncoder:
    """Encodes records into bytes, assigning per-segment ids to source and topic names.

    A name record is emitted the first time a name is used in a *stretch* (ids stay the
    same for the whole segment), so every segment can be read on its own and a damaged
    name record costs no other record. Call :meth:`reset_names` when a new segment starts,
    :meth:`new_stretch` when a zstd chunk starts and :meth:`end_stretch` every
    :data:`NAME_REPEAT_BYTES` of plain records.
    """

    __slots__ = ("_sources", "_topics", "_all_sources", "_all_topics")

    def __init__(self) -> None:
        # This stretch's names (the hot path's lookups) and the segment's (ids).
        self._sources: dict[str, int] = {}
        self._topics: dict[bytes, int] = {}
        self._all_sources: dict[str, int] = {}
        self._all_topics: dict[bytes, int] = {}

    def reset_names(self) -> None:
        """Forget every name id (a new segment starts)."""
        self._sources.clear()
        self._topics.clear()
        self._all_sources.clear()
        self._all_topics.clear()

    def new_stretch(self) -> None:
        """Names are declared again before their next use (a zstd chunk starts)."""
        self._sources.clear()
        self._topics.clear()

    def end_stretch(self, out: bytearray) -> None:
        """Append the name records of every name this stretch used, then start another."""
        for name, ident in self._sources.items():
            self._name(out, NAME_SOURCE, ident, name.encode())
        for topic, ident in self._topics.items():
            self._name(out, NAME_TOPIC, ident, topic)
        self.new_stretch()

    def preload_names(self, sources: dict[int, str], topics: dict[int, bytes]) -> None:
        """Adopt the names an existing segment already defined (to resume appending)."""
        self._all_sources = {v: k for k, v in sources.items()}
        self._all_topics = {v: k for k, v in topics.items()}
        self.new_stretch()

    def _name(self, out: bytearray, table: int, ident: int, raw: bytes) -> None:
        if ident >= MAX_NAMES:
            kind = "sources" if table == NAME_SOURCE else "topics"
            raise ValueError(f"more than {MAX_NAMES} distinct {kind} in one segment; rotate segments sooner")
        rec = _NAME_HEAD.pack(4 + len(raw), KIND_NAME, table, ident) + raw
        out += _U32.pack(_xxh3(rec) & _M32)
        out += rec

    def _source_id(self, out: bytearray, source: str) -> int:
        sid = self._sources.get(source)
        if sid is None:
            sid = self._all_sources.get(source)
            if sid is None:
                sid = self._all_sources[source] = len(self._all_sources)
            self._name(out, NAME_SOURCE, sid, source.encode())
            self._sources[source] = sid
        return sid

    def _topic_id(self, out: bytearray, topic: bytes) -> int:
        topic = bytes(topic)
        tid = self._all_topics.get(topic)
        if tid is None:
            tid = self._all_topics[topic] = len(self._all_topics)
        self._name(out, NAME_TOPIC, tid, topic)
        self._topics[topic] = tid
        return tid

    def message(self, out: bytearray, recv_ns: int, source: str, topic: bytes, seq: int,
                payload: bytes | bytearray | memoryview, replayed: bool = False) -> None:
        """Append a message record (and any name records it needs) to ``out``."""
        sid = self._sources.get(source)
        if sid is None:
            sid = self._source_id(out, source)
        tid = self._topics.get(topic)
        if tid is None:
            tid = self._topic_id(out, topic)
        flags = 1 if replayed else 0
        if seq < 0:
            flags |= FLAG_NEGATIVE_SEQ
            seq += _TWO64
        if not 0 <= seq < _TWO64:
            raise ValueError(f"seq {seq} does not fit the log's 64-bit seq field (-2**63 < seq < 2**64)")
        rec = _MSG_HEAD.pack(_MSG_BODY.size + 1 + len(payload), KIND_MESSAGE, flags,
                             sid, tid, recv_ns, seq) + payload
        out += _U32.pack(_xxh3(rec) & _M32)
        out += rec

    def control(self, out: bytearray, recv_ns: int, source: str, kind: str, reason: str = "",
                seq: int | None = None, first_missing_seq: int | None = None,
                resume_seq: int | None = None) -> None:
        """Append a control record to ``out`` (fields as in :class:`LogControl`)."""
        code = _CONTROL_CODES.get(kind)
        if code is None:
            raise ValueError(f"control kind must be one of {sorted(_CONTROL_CODES)}, got {kind!r}")
        sid = self._source_id(out, source)
        if kind == "stale":
            a = NO_SEQ if first_missing_seq is None else first_missing_seq
            b = NO_SEQ if resume_seq is None else resume_seq
        else:
            a, b = (NO_SEQ if seq is None else seq), NO_SEQ
        for v in (a, b):
            if v != NO_SEQ and not NO_SEQ < v < -NO_SEQ:
                raise ValueError(f"control seq {v} does not fit the log's signed 64-bit field")
        r = reason.encode()
        rec = _CTL_HEAD.pack(1 + _CTL_BODY.size + len(r), KIND_CONTROL, code, sid, recv_ns, a, b) + r
        out += _U32.pack(_xxh3(rec) & _M32)
        out += rec

    @staticmethod
    def chunk(out: bytearray, compressed: bytes, raw_len: int, count: int) -> None:
        """Append a zstd chunk record holding ``count`` records (``raw_len`` bytes raw)."""
        rec = _CHUNK_HEAD.pack(1 + _CHUNK_BODY.size + len(compressed), KIND_CHUNK, raw_len, count) + compressed
        out += _U32.pack(_xxh3(rec) & _M32)
        out += rec


def _plausible(buf: Any, mv: memoryview, p: int, end: int) -> int:
    """The end offset of a record that starts at ``p`` and verifies (0 if none does, -1 if
    ``buf`` ends before the record would, so more bytes are needed to tell)."""
    if end - p < 9:
        return -1
    crc, n = _REC.unpack_from(buf, p)
    if n == 0 or n > MAX_BODY or n < _MIN_BODY.get(buf[p + 8], MAX_BODY + 1):
        return 0
    stop = p + 8 + n
    if stop > end:
        return -1
    return stop if (_xxh3(mv[p + 4:stop]) & _M32) == crc else 0


def _find_name(buf: Any, mv: memoryview, p: int, end: int, table: int, ident: int) -> tuple[bytes | None, bool]:
    """The name record ``(table, ident)`` among the records from ``p`` on: a repeat of a
    name whose earlier record is damaged (version 2 repeats names at least every
    :data:`NAME_REPEAT_BYTES`). Walks record lengths (checking only name records) up to
    that far, then over the name records right after. Returns ``(raw name or None,
    ran_out)``: ``ran_out`` when ``buf`` ended first (more bytes may hold it)."""
    limit = p + 2 * NAME_REPEAT_BYTES
    while True:
        if end - p < 9:
            return None, True
        crc, n = _REC.unpack_from(buf, p)
        if n == 0 or n > MAX_BODY:
            return None, False
        stop = p + 8 + n
        if stop > end:
            return None, True
        kind = buf[p + 8]
        if kind == KIND_NAME:
            if n >= 4 and (_xxh3(mv[p + 4:stop]) & _M32) == crc:
                t, i = _NAME_BODY.unpack_from(buf, p + 9)
                if t == table and i == ident:
                    return bytes(buf[p + 12:stop]), False
        elif p > limit:
            return None, False
        p = stop


def find_records_start(buf: Any, *, limit: int = 1 << 20) -> int | None:
    """Where the records of a segment whose header is damaged begin: the first offset in
    the first ``limit`` bytes at which a record verifies (its checksum covers its length, so
    a false match has a chance of about 2**-32 per offset). None if there is none."""
    end = len(buf)
    mv = memoryview(buf)
    try:
        # The earliest verifying offset, not the one the header's own metadata length points
        # at: that length may be the damaged byte, and trusting it would skip the records
        # (name records first of all) between the real and the claimed end of the header.
        lo = _HEAD_FIXED.size + 4
        for p in range(lo, min(end, lo + limit)):
            if _plausible(buf, mv, p, end) > 0:
                return p
        return None
    finally:
        mv.release()


MAX_CHUNK_BYTES: Final = 64 << 20
"""The largest decompressed size (bytes) a zstd chunk may declare; a reader rejects a
bigger one before decompressing anything (a zstd bomb), and the writer never packs more
than this into one chunk."""

MAX_DAMAGES: Final = 100
"""Damaged places reported per segment; further ones are merged into the last."""

WINDOW: Final = 16 << 20
"""Bytes a file reader hands the cursor at a time (a record larger than this is read
whole). While resynchronising after damage, a candidate record larger than this is not
considered (memory stays bounded on garbage)."""


class SegmentCursor:
    """Iterates the records of one segment, reporting damage and reading past it.

    Give it the segment's first bytes (the whole segment, or at least its header). Iterate
    the cursor itself to scan a segment held whole in memory, or call :meth:`scan` with
    consecutive windows of a file (see :class:`~kvstream.eventlog.reader.LogReader`): each
    call yields the records that are complete in the window and sets :attr:`next_pos` (the
    file offset to read from next; None when done) and :attr:`need` (bytes the next window
    must at least hold).

    After a damaged place (a record whose checksum fails, a torn or implausible length)
    the cursor looks for the next offset at which a record verifies and goes on from there,
    so one damaged record costs that record only. Every damaged place is in
    :attr:`damages`; :attr:`valid_end` is the offset just past the last intact record
    (where a writer may resume: whatever follows it is unverifiable), and :attr:`sources`
    / :attr:`topics` hold the name tables seen so far.

    ``salvage=True``: a damaged header is reported (at offset 0) and the records after it
    are still read (:attr:`header` is then None); otherwise it raises
    :class:`HeaderDamagedError`.
    """

    __slots__ = ("header", "name", "damages", "valid_end", "sources", "topics", "records",
                 "next_pos", "need", "start", "_decompress", "_max_chunk", "_dmg_start",
                 "_dmg_reason", "_buf")

    def __init__(self, buf: Any, *, name: str = "segment", decompress: Any = None,
                 salvage: bool = False, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        self._buf = buf
        self.name = name
        self.damages: list[LogDamage] = []
        self.header: SegmentHeader | None = None
        self.sources: dict[int, str] = {}
        self.topics: dict[int, bytes] = {}
        self._decompress = decompress
        self._max_chunk = max_chunk_bytes
        self._dmg_start: int | None = None
        self._dmg_reason = ""
        self.records = 0
        """Records yielded so far."""
        self.need = 0
        try:
            self.header = decode_header(buf, name=name)
            self.start = self.header.size
        except HeaderDamagedError as exc:
            if not salvage:
                raise
            found = find_records_start(buf)
            if found is None:
                self.start = len(buf)
                self.damages.append(LogDamage(name, 0, f"{exc}; no intact record found after it", len(buf)))
            else:
                self.start = found
                self.damages.append(LogDamage(
                    name, 0, f"{exc}; the records from byte {found} on verify and were read", found))
        self.valid_end = self.start
        self.next_pos: int | None = self.start

    @property
    def damage(self) -> LogDamage | None:
        """The first damaged place (None if none)."""
        return self.damages[0] if self.damages else None

    def __iter__(self) -> Iterator[LogRecord]:
        if self.next_pos is None:
            return
        yield from self.scan(self._buf, 0, final=True)

    def note_shrunk(self, offset: int) -> None:
        """The file ended at ``offset`` although an earlier read saw more bytes there (it
        was truncated while being read): record the damage and stop."""
        self._close_damage(offset)
        self._add_damage(offset, "the segment shrank while it was read (truncated by another process)", offset)
        self.next_pos = None

    def _add_damage(self, offset: int, reason: str, stop: int) -> None:
        d = self.damages
        if len(d) >= MAX_DAMAGES:
            last = d[-1]
            d[-1] = LogDamage(self.name, last.offset, last.reason.split(" (and ")[0] + " (and more damage after it)",
                              stop - last.offset)
        else:
            d.append(LogDamage(self.name, offset, reason, stop - offset))

    def _open_damage(self, offset: int, reason: str) -> None:
        if self._dmg_start is None:
            self._dmg_start = offset
            self._dmg_reason = reason

    def _close_damage(self, stop: int) -> None:
        if self._dmg_start is not None:
            self._add_damage(self._dmg_start, self._dmg_reason, stop)
            self._dmg_start = None

    def scan(self, buf: Any, base: int = 0, *, final: bool = True) -> Iterator[LogRecord]:
        """Yield the records in ``buf``, which holds the segment's bytes from offset
        ``base``; it must start at or before :attr:`next_pos`. ``final``: ``buf`` reaches
        the end of the segment (an incomplete record there is damage, not "read more")."""
        if self.next_pos is None:
            return
        yield from self._scan(buf, self.next_pos - base, len(buf), outer=True, base=base, final=final)

    def _resync(self, buf: Any, mv: memoryview, pos: int, end: int, final: bool) -> int:
        """The next offset >= ``pos`` where a record verifies; -1: more bytes needed first
        (``self.need`` set); ``end``: none in this buffer."""
        while pos < end:
            r = _plausible(buf, mv, pos, end)
            if r > 0:
                return pos
            if r < 0 and not final:
                n = _REC.unpack_from(buf, pos)[1] if end - pos >= 8 else 0
                if 8 + n <= WINDOW:
                    self.need = max(9, 8 + n)
                    return -1
            pos += 1
        return end

    def _scan(self, buf: Any, pos: int, end: int, *, outer: bool, base: int, final: bool) -> Iterator[LogRecord]:
        # Hot loop: locals only, struct.unpack_from on the big buffer, one checksum call
        # over a memoryview slice (no copy) per record.
        if type(buf) is not bytes:
            buf = bytes(buf)  # one copy of the window, so each record's slice is one copy too
        mv = memoryview(buf)
        valid = -1  # end of the last message record yielded (relative to base), if any
        count = 0
        try:
            unpack_rec = _REC.unpack_from
            unpack_msg = _MSG_BODY.unpack_from
            xxh3 = _xxh3
            sources = self.sources
            topics = self.topics
            msg_min = _MIN_BODY[KIND_MESSAGE]
            rec: LogRecord
            while True:
                if outer and self._dmg_start is not None:
                    p = self._resync(buf, mv, pos, end, final)
                    if p < 0:
                        self.next_pos = base + pos
                        return
                    if p >= end:
                        if final:
                            self._close_damage(base + end)
                            self.next_pos = None
                        else:
                            self.next_pos = base + end
                            self.need = 0
                        return
                    self._close_damage(base + p)
                    pos = p
                if pos >= end:
                    if outer:
                        self.next_pos = None if final else base + pos
                        self.need = 0
                    return
                if end - pos < 8:
                    if outer and not final:
                        self.next_pos, self.need = base + pos, 8
                        return
                    if not outer:
                        self._add_damage(base + pos, f"truncated record header ({end - pos} of 8 bytes)", base + end)
                        return
                    self._open_damage(base + pos, f"truncated record header ({end - pos} of 8 bytes)")
                    continue
                crc, n = unpack_rec(buf, pos)
                body = pos + 8
                stop = body + n
                if n == 0 or n > MAX_BODY:
                    reason = ("zero-filled tail (the file was extended but never written)"
                              if crc == 0 and n == 0 else f"implausible record length {n}")
                    if not outer:
                        self._add_damage(base + pos, reason, base + end)
                        return
                    self._open_damage(base + pos, reason)
                    continue
                if stop > end:
                    if outer and not final:
                        self.next_pos, self.need = base + pos, 8 + n
                        return
                    reason = f"truncated record: {n} byte body, {end - body} bytes left"
                    if not outer:
                        self._add_damage(base + pos, reason, base + end)
                        return
                    self._open_damage(base + pos, reason)
                    continue
                if (xxh3(mv[pos + 4:stop]) & _M32) != crc:
                    if not outer:
                        self._add_damage(base + pos, "checksum mismatch", base + end)
                        return
                    self._open_damage(base + pos, "checksum mismatch")
                    pos += 1
                    continue
                kind = buf[body]
                bad: str | None = None
                if kind == KIND_MESSAGE and n >= msg_min:
                    # The usual record first. valid_end and records are kept in locals
                    # here and stored when the scan returns or is closed (see finally).
                    flags, sid, tid, ts, seq = unpack_msg(buf, body + 1)
                    if flags & FLAG_NEGATIVE_SEQ:
                        seq -= _TWO64
                    src = sources.get(sid)
                    top = topics.get(tid)
                    if src is None or top is None:
                        # Its name record is damaged: take the name from a repeat ahead.
                        ran_out = False
                        if src is None:
                            raw, ran_out = _find_name(buf, mv, stop, end, NAME_SOURCE, sid)
                            if raw is not None:
                                src = sources[sid] = raw.decode("utf-8", "replace")
                        if top is None and not ran_out:
                            top, ran_out = _find_name(buf, mv, stop, end, NAME_TOPIC, tid)
                            if top is not None:
                                topics[tid] = top
                        if (src is None or top is None) and ran_out and outer and not final:
                            # The repeat may be in the next bytes: ask for them first.
                            self.next_pos, self.need = base + pos, (end - pos) + 2 * NAME_REPEAT_BYTES
                            return
                    if src is not None and top is not None:
                        pos = stop
                        valid = pos
                        count += 1
                        yield LogMessage(ts, src, top, seq, buf[body + 22:stop], flags & FLAG_REPLAYED != 0)
                        continue
                    bad = f"message uses undefined source {sid} or topic {tid} (its name record is lost)"
                elif n < _MIN_BODY.get(kind, 1):
                    bad = f"record of kind {kind} is too short ({n} bytes)"
                elif kind == KIND_NAME:
                    table, ident = _NAME_BODY.unpack_from(buf, body + 1)
                    raw = bytes(buf[body + 4:stop])
                    if table == NAME_SOURCE:
                        sources[ident] = raw.decode("utf-8", "replace")
                    else:
                        topics[ident] = raw
                elif kind == KIND_CONTROL:
                    code, sid, ts, a, b = _CTL_BODY.unpack_from(buf, body + 1)
                    cname = _CONTROL_NAMES.get(code)
                    if cname is not None and sid not in sources:
                        raw, ran_out = _find_name(buf, mv, stop, end, NAME_SOURCE, sid)
                        if raw is not None:
                            sources[sid] = raw.decode("utf-8", "replace")
                        elif ran_out and outer and not final:
                            self.next_pos, self.need = base + pos, (end - pos) + 2 * NAME_REPEAT_BYTES
                            return
                    if cname is not None and sid in sources:
                        reason = bytes(buf[body + 1 + _CTL_BODY.size:stop]).decode("utf-8", "replace")
                        if cname == "stale":
                            rec = LogControl(ts, sources[sid], cname, reason, None,
                                             None if a == NO_SEQ else a, None if b == NO_SEQ else b)
                        else:
                            rec = LogControl(ts, sources[sid], cname, reason, None if a == NO_SEQ else a)
                        pos = stop
                        if outer:
                            self.valid_end = base + pos
                        self.records += 1
                        yield rec
                        continue
                    bad = f"bad control record (code {code}, source {sid})"
                elif kind == KIND_CHUNK and outer:
                    yield from self._chunk(buf, body, stop, base + pos)
                else:
                    bad = f"unknown record kind {kind}"
                if bad is not None:
                    # The record verifies, so its bytes are what was written: skip it whole.
                    if not outer:
                        self._add_damage(base + pos, bad, base + end)
                        return
                    self._add_damage(base + pos, bad, base + stop)
                pos = stop
                if outer:
                    self.valid_end = base + pos
        finally:
            self.records += count
            if outer and valid >= 0 and base + valid > self.valid_end:
                self.valid_end = base + valid
            mv.release()

    def _chunk(self, buf: Any, body: int, stop: int, at: int) -> Iterator[LogRecord]:
        raw_len, count = _CHUNK_BODY.unpack_from(buf, body + 1)
        size = stop - body
        if self._decompress is None:
            raise LogFormatError(
                f"{self.name} is zstd-compressed; install the 'zstandard' package "
                "(pip install 'kvstream[zstd]') to read it"
            )
        if raw_len > self._max_chunk:
            self._add_damage(at, f"zstd chunk declares {raw_len} bytes, more than the "
                                 f"{self._max_chunk} a chunk may hold: not decompressed", at + 8 + size)
            return
        try:
            raw = self._decompress(bytes(buf[body + 9:stop]), raw_len)
        except Exception as exc:  # noqa: BLE001 - checksum passed: report, don't crash
            self._add_damage(at, f"zstd chunk does not decompress: {exc}", at + 8 + size)
            return
        before = self.records
        n_damage = len(self.damages)
        # Records inside a chunk are reported at the chunk's offset: a chunk is written and
        # recovered as a unit.
        yield from self._scan(raw, 0, len(raw), outer=False, base=0, final=True)
        if len(self.damages) > n_damage or self.records - before != count:
            inner = self.damages.pop().reason if len(self.damages) > n_damage else "record count"
            self._add_damage(at, f"zstd chunk content is inconsistent ({inner})", at + 8 + size)
