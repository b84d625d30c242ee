"""Appending a new recording to a log without recording anything twice (sans-IO).

A resumed recorder's subscriber joins its engines the usual way, by asking for a replay
from seq 0, so it re-delivers batches the log already holds. Written again, they would be
counted twice by anything that replays the log (the index, ``inspect``), and their seqs
going backwards would look like an engine restart. :class:`ResumeFilter` knows, per
source, the last seq the log holds and a digest of each recent payload, and decides for
every item of the new recording:

* a batch whose seq the log holds with the same payload bytes: already recorded, skipped;
* a batch whose seq the log holds with other bytes: the engine restarted while nothing
  was recording: a ``reset`` control (reason ``restart``) is written before it, so
  replaying the log drops the old instance's blocks;
* batches older than anything the log can compare (before its digest window, or before
  a snapshot it holds) are held, bounded in bytes, until the first comparable seq decides
  between "already recorded" (dropped) and "a new instance" (a reset, then all of them);
* the first batch past the log's last seq with seqs missing in between: a ``stale``
  control naming the missing seqs is written before it (recorded nowhere);
* a ``stale`` item about seqs the log already holds is dropped (nothing is missing from
  the log); one that reaches past them is narrowed to what is really missing.

Once a source's new recording has moved past what the log held, everything passes.
"""

from __future__ import annotations

from array import array
from typing import Any, Iterable

import xxhash

from kvstream.eventlog.format import LogMessage, LogRecord
from kvstream.transport.items import SourceBatch, SourceReset, SourceStale

__all__ = ["ResumeFilter", "DIGEST_WINDOW", "MAX_HELD_BYTES", "MAX_HELD_ITEMS"]

DIGEST_WINDOW = 16_384
"""Recent seqs per source whose payload digest is kept, 8 bytes each (128 KiB per source
at most twice over): more than vLLM's default replay buffer of 10,000 batches, so a join
replay of the same engine is always compared."""

MAX_HELD_BYTES = 8 << 20
"""Payload bytes a source's undecided batches may hold (see :meth:`ResumeFilter.admit`);
past it the source is taken for restarted (everything held is written after a reset)."""
MAX_HELD_ITEMS = 100_000
"""Undecided batches a source may hold."""

_digest = xxhash.xxh3_64_intdigest


class _Tail:
    """The end of one source's recorded stream: its last seq and the payload digests of
    a contiguous window of seqs (``base`` .. ``base + len(digests) - 1``; 0: not held)."""

    __slots__ = ("last", "base", "digests", "open", "window", "held", "held_bytes")

    def __init__(self, window: int) -> None:
        self.last = -1
        self.base = 0
        self.digests = array("Q")
        self.open = True  # still comparing against the log
        self.window = window
        self.held: list[Any] = []  # batches waiting for a comparable seq to decide
        self.held_bytes = 0

    def clear(self) -> None:
        self.last = -1
        self.base = 0
        self.digests = array("Q")

    def record(self, seq: int, digest: int) -> None:
        d = self.digests
        end = self.base + len(d)
        if not d or seq >= end + self.window:
            self.base, self.digests = seq, array("Q", [digest])
            return
        if seq >= end:
            d.extend(array("Q", bytes(8 * (seq - end))))
            d.append(digest)
            if len(d) > 2 * self.window:  # trim in bulk: amortised O(1) per seq
                cut = len(d) - self.window
                del d[:cut]
                self.base += cut
        elif seq >= self.base:
            d[seq - self.base] = digest

    def lookup(self, seq: int) -> int | None:
        """The digest recorded for ``seq``; None if not held; -1 if older than the window."""
        i = seq - self.base
        if i < 0:
            return -1
        if i >= len(self.digests):
            return None
        return self.digests[i] or None


class ResumeFilter:
    """Turns the items of a resumed recording into the ones to write (see module doc).

    Build it with :meth:`from_records` over the existing log, then pass every item to
    :meth:`admit`. ``skipped`` counts batches not written again.
    """

    __slots__ = ("_tails", "skipped", "restarts", "gaps")

    def __init__(self) -> None:
        self._tails: dict[str, _Tail] = {}
        self.skipped = 0
        """Batches the log already held (not written again)."""
        self.restarts = 0
        """Sources found restarted since the log ended (a reset control was written)."""
        self.gaps = 0
        """Sources with seqs missing between the log's end and the new recording."""

    @classmethod
    def from_records(cls, records: Iterable[LogRecord], *, window: int = DIGEST_WINDOW) -> ResumeFilter:
        """The filter for a log holding ``records`` (in order)."""
        f = cls()
        tails = f._tails
        snap: dict[str, int] = {}  # source -> tag of the snapshot being read
        for r in records:
            t = tails.get(r.source)
            if t is None:
                t = tails[r.source] = _Tail(window)
            if type(r) is LogMessage:
                if r.seq < 0:
                    continue
                tag = snap.get(r.source)
                if tag is not None and r.replayed and r.seq == tag - 1:
                    # A snapshot batch: tagged with a seq, but not that seq's batch.
                    t.last = max(t.last, r.seq)
                    continue
                snap.pop(r.source, None)
                t.record(r.seq, _digest(r.payload))
                t.last = max(t.last, r.seq) if r.replayed else r.seq
            elif r.kind == "reset":  # type: ignore[union-attr]
                # A new engine instance (or a snapshot): older seqs say nothing any more.
                t.clear()
                snap.pop(r.source, None)
                if r.reason == "snapshot" and r.seq is not None:  # type: ignore[union-attr]
                    # Seqs below the tag are in the snapshot, not comparable one by one.
                    t.last = r.seq - 1
                    t.base = r.seq
                    snap[r.source] = r.seq
        return f

    @property
    def sources(self) -> list[str]:
        """Sources the log holds."""
        return list(self._tails)

    def last_seq(self, source: str) -> int | None:
        """The last seq the log holds for ``source`` (None: the source is new)."""
        t = self._tails.get(source)
        return None if t is None else t.last

    def admit(self, item: Any) -> list[Any]:
        """The items to write for ``item`` (possibly none, possibly a control first)."""
        t = self._tails.get(item.source)
        if t is None or not t.open:
            return [item]
        cls = type(item)
        if cls is SourceBatch:
            s = item.seq
            if s <= t.last:
                d = t.lookup(s)
                if d == -1:
                    # Older than what the log can compare (before its window, or before a
                    # snapshot it holds): the same engine's buffer or a new engine's first
                    # seqs. Held until a comparable seq decides, within a bound.
                    t.held.append(item)
                    t.held_bytes += len(item.payload)
                    if t.held_bytes > MAX_HELD_BYTES or len(t.held) > MAX_HELD_ITEMS:
                        return self._restarted(t, item.source, [])
                    return []
                if d is None or d == _digest(item.payload):
                    # Recorded with the same bytes, or a seq the log lacks (a hole it
                    # already marked): either way nothing to record again.
                    self.skipped += 1 + len(t.held)
                    t.held.clear()
                    t.held_bytes = 0
                    return []
                return self._restarted(t, item.source, [item])  # other bytes: a new instance
            if t.held:
                # Seqs jumped from below the comparable window to past the log's end: not
                # one engine's contiguous replay, so not provably recorded.
                return self._restarted(t, item.source, [item])
            t.open = False
            if s > t.last + 1:
                self.gaps += 1
                return [SourceStale(item.source, "not recorded: the engine published these while no "
                                    "recorder ran (between the appended log and this recording)",
                                    t.last + 1, s), item]
            return [item]
        if t.held:
            return self._restarted(t, item.source, [item])
        if cls is SourceReset:
            t.open = False
            return [item]
        if cls is SourceStale:
            lo, hi = item.first_missing_seq, item.resume_seq
            if hi <= t.last + 1:
                return []  # the log holds all of it
            t.open = False
            if lo <= t.last:
                return [SourceStale(item.source, item.reason, t.last + 1, hi)]
            return [item]
        return [item]

    def _restarted(self, t: _Tail, source: str, then: list[Any]) -> list[Any]:
        """Decide "a new engine instance": a reset, then everything held, then ``then``."""
        t.open = False
        self.restarts += 1
        held = list(t.held)
        t.held.clear()
        t.held_bytes = 0
        first = held[0] if held else (then[0] if then and type(then[0]) is SourceBatch else None)
        return [SourceReset(source, "restart", first.seq if first is not None else None), *held, *then]
