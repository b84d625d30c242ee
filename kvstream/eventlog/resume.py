"""Appending a new recording to a log without recording anything twice (sans-IO).

A resumed recorder's subscriber joins its engines the usual way, by asking for a replay
from seq 0, so it re-delivers batches the log already holds. Written again, they would be
counted twice by anything that replays the log (the index, ``inspect``), and their seqs
going backwards would look like an engine restart. :class:`ResumeFilter` knows, per
source, the last seq the log holds and a digest of each recent payload, and decides for
every item of the new recording:

* a batch whose seq the log holds with the same payload bytes: already recorded, skipped;
* a batch whose seq the log holds with other bytes (or too old to compare): the engine
  restarted while nothing was recording: a ``reset`` control (reason ``restart``) is
  written before it, so replaying the log drops the old instance's blocks;
* the first batch past the log's last seq with seqs missing in between: a ``stale``
  control naming the missing seqs is written before it (recorded nowhere);
* a ``stale`` item about seqs the log already holds is dropped (nothing is missing from
  the log); one that reaches past them is narrowed to what is really missing.

Once a source's new recording has moved past what the log held, everything passes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable

import xxhash

from kvstream.eventlog.format import LogMessage, LogRecord
from kvstream.transport.items import SourceBatch, SourceReset, SourceStale

__all__ = ["ResumeFilter", "DIGEST_WINDOW"]

DIGEST_WINDOW = 65_536
"""Recent seqs per source whose payload digest is kept (more than vLLM's default replay
buffer of 10,000 batches, so a join replay of the same engine is always compared)."""

_digest = xxhash.xxh3_64_intdigest


class _Tail:
    __slots__ = ("last", "digests", "open")

    def __init__(self) -> None:
        self.last = -1
        self.digests: OrderedDict[int, int] = OrderedDict()
        self.open = True  # still comparing against the log


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
        for r in records:
            t = tails.get(r.source)
            if t is None:
                t = tails[r.source] = _Tail()
            if type(r) is LogMessage:
                if r.seq < 0:
                    continue
                d = t.digests
                d[r.seq] = _digest(r.payload)
                d.move_to_end(r.seq)
                if len(d) > window:
                    d.popitem(last=False)
                t.last = max(t.last, r.seq) if r.replayed else r.seq
            elif r.kind == "reset":  # type: ignore[union-attr]
                # A new engine instance (or a snapshot): older seqs say nothing any more.
                t.digests.clear()
                t.last = -1
                if r.reason == "snapshot" and r.seq is not None:  # type: ignore[union-attr]
                    t.last = r.seq - 1
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
                d = t.digests.get(s)
                if d is not None and d == _digest(item.payload):
                    self.skipped += 1
                    return []
                t.open = False
                self.restarts += 1
                return [SourceReset(item.source, "restart", s), item]
            t.open = False
            if s > t.last + 1:
                self.gaps += 1
                return [SourceStale(item.source, "not recorded: the engine published these while no "
                                    "recorder ran (between the appended log and this recording)",
                                    t.last + 1, s), item]
            return [item]
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

