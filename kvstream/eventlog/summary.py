"""What a log holds, per source: the numbers ``kvstream inspect`` prints (sans-IO).

Feed records in order to :meth:`LogSummary.add`; read the totals at any time. Payloads
are decoded with the normal event codec (unknown event types are skipped and counted), so
this needs only :mod:`kvstream.wire.events`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

from kvstream.eventlog.format import LogControl, LogMessage
from kvstream.wire.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventDecoder,
    KVEventBatch,
)

__all__ = ["LogSummary", "SourceSummary", "event_rows", "format_hash"]


class SourceSummary:
    """Counters for one source. Seqs are the publisher's; times are ns since the epoch."""

    __slots__ = ("name", "topics", "messages", "replayed", "first_seq", "last_seq", "seq_runs",
                 "gaps", "restarts", "resets", "stale", "live", "events", "blocks_stored",
                 "blocks_removed", "clears", "peak_cached", "first_ns", "last_ns",
                 "decode_errors", "_cache", "_last")

    def __init__(self, name: str) -> None:
        self.name = name
        self.topics: set[bytes] = set()
        self.messages = 0
        """Message records (batches)."""
        self.replayed = 0
        """Of which came from a replay or snapshot reply."""
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self.seq_runs: list[list[int]] = []
        """Contiguous seq ranges ``[first, last]`` received, in order."""
        self.gaps: list[tuple[int, int]] = []
        """``(first_missing, resume)`` seq holes between consecutive messages."""
        self.restarts = 0
        """Publisher restarts (seq went backwards, or a ``reset`` control with reason restart)."""
        self.resets: Counter[str] = Counter()
        """``reset`` control records by reason."""
        self.stale: list[tuple[int | None, int | None, str]] = []
        """``stale`` control records: (first_missing_seq, resume_seq, reason)."""
        self.live = 0
        """``live`` control records."""
        self.events: Counter[tuple[str, str]] = Counter()
        """Events by (type, medium)."""
        self.blocks_stored = 0
        self.blocks_removed = 0
        self.clears = 0
        """AllBlocksCleared events."""
        self.peak_cached = 0
        """Most blocks cached at once (all media), replaying the events in order."""
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.decode_errors = 0
        """Payloads the codec rejected."""
        self._cache: Counter[tuple[str, Any]] = Counter()
        self._last: int | None = None

    @property
    def cached(self) -> int:
        """Blocks cached (all media) after the last record."""
        return sum(self._cache.values())

    def _seq(self, seq: int, replayed: bool) -> None:
        last = self._last
        if last is None:
            self.seq_runs.append([seq, seq])
        elif seq == last + 1:
            self.seq_runs[-1][1] = seq
        elif seq == last and replayed:
            pass  # the batches of one snapshot share a seq
        else:
            if seq <= last:
                self.restarts += 1
            else:
                self.gaps.append((last + 1, seq))
            self.seq_runs.append([seq, seq])
        self._last = seq
        if self.first_seq is None:
            self.first_seq = seq
        self.last_seq = seq

    def _apply(self, batch: KVEventBatch) -> None:
        cache = self._cache
        for ev in batch.events:
            # type(ev) in each test (not once into a local) so that mypy narrows ev.
            if type(ev) is BlockStored:
                medium = ev.medium or MEDIUM_GPU
                self.events["BlockStored", medium] += 1
                self.blocks_stored += len(ev.block_hashes)
                for h in ev.block_hashes:
                    cache[medium, h] += 1
            elif type(ev) is BlockRemoved:
                medium = ev.medium or MEDIUM_GPU
                self.events["BlockRemoved", medium] += 1
                self.blocks_removed += len(ev.block_hashes)
                for h in ev.block_hashes:
                    k = (medium, h)
                    c = cache.get(k)
                    if c is not None:
                        if c <= 1:
                            del cache[k]
                        else:
                            cache[k] = c - 1
            elif type(ev) is AllBlocksCleared:
                self.events["AllBlocksCleared", "-"] += 1
                self.clears += 1
                # vLLM: a prefix-cache reset clears the GPU pool; other tiers keep theirs.
                for k in [k for k in cache if k[0] == MEDIUM_GPU]:
                    del cache[k]
        n = sum(cache.values())
        if n > self.peak_cached:
            self.peak_cached = n

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able view of every counter."""
        return {
            "source": self.name,
            "topics": sorted(t.decode("utf-8", "replace") for t in self.topics),
            "messages": self.messages,
            "replayed": self.replayed,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "seq_runs": [list(r) for r in self.seq_runs],
            "gaps": [list(g) for g in self.gaps],
            "restarts": self.restarts,
            "resets": dict(self.resets),
            "stale": [list(s) for s in self.stale],
            "live": self.live,
            "events": {f"{t}/{m}": n for (t, m), n in sorted(self.events.items())},
            "blocks_stored": self.blocks_stored,
            "blocks_removed": self.blocks_removed,
            "clears": self.clears,
            "cached_at_end": self.cached,
            "peak_cached": self.peak_cached,
            "first_ns": self.first_ns,
            "last_ns": self.last_ns,
            "decode_errors": self.decode_errors,
        }


class LogSummary:
    """Accumulates :class:`SourceSummary` per source over a stream of log records."""

    __slots__ = ("sources", "records", "first_ns", "last_ns", "_decoder")

    def __init__(self) -> None:
        self.sources: dict[str, SourceSummary] = {}
        """Per source, in order of first appearance."""
        self.records = 0
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self._decoder = EventDecoder(unknown_events="skip")

    def _source(self, name: str) -> SourceSummary:
        s = self.sources.get(name)
        if s is None:
            s = self.sources[name] = SourceSummary(name)
        return s

    def add(self, rec: LogMessage | LogControl) -> KVEventBatch | None:
        """Account for one record; returns the decoded batch of a message (None if it did
        not decode, or for a control record)."""
        self.records += 1
        t = rec.recv_ns
        if self.first_ns is None or t < self.first_ns:
            self.first_ns = t
        if self.last_ns is None or t > self.last_ns:
            self.last_ns = t
        s = self._source(rec.source)
        if s.first_ns is None:
            s.first_ns = t
        s.last_ns = t
        if type(rec) is LogControl:
            if rec.kind == "reset":
                s.resets[rec.reason] += 1
                s._cache.clear()
                if rec.reason == "restart":
                    s.restarts += 1
                # Whatever seq follows a reset (a restart's low seq, a snapshot's tag) is
                # expected: neither a gap nor a second restart.
                s._last = None
            elif rec.kind == "stale":
                s.stale.append((rec.first_missing_seq, rec.resume_seq, rec.reason))
            else:
                s.live += 1
            return None
        # Every record that is not a LogControl is a LogMessage; mypy cannot narrow on
        # `type(rec) is LogControl` failing, hence the ignores.
        s.messages += 1
        s.topics.add(rec.topic)  # type: ignore[union-attr]
        if rec.replayed:  # type: ignore[union-attr]
            s.replayed += 1
        s._seq(rec.seq, rec.replayed)  # type: ignore[arg-type, union-attr]
        try:
            batch = self._decoder.decode(rec.payload)  # type: ignore[union-attr]
        except EventDecodeError:
            s.decode_errors += 1
            return None
        s._apply(batch)
        return batch

    def add_all(self, records: Iterable[LogMessage | LogControl]) -> LogSummary:
        """Add every record; returns self."""
        for r in records:
            self.add(r)
        return self

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able view of the whole summary."""
        first, last = self.first_ns, self.last_ns  # both set by the first record
        return {
            "records": self.records,
            "first_ns": self.first_ns,
            "last_ns": self.last_ns,
            "span_s": ((last - first) / 1e9) if first is not None and last is not None else 0.0,
            "sources": [s.as_dict() for s in self.sources.values()],
        }


def format_hash(h: Any, form: str = "hex", *, short: bool = False) -> Any:
    """A block hash as ``inspect`` and ``subscribe`` show it: ``"hex"`` (a string: 16
    digits for an int, every byte for a bytes hash) or ``"int"`` (an int; a bytes hash
    read big-endian). ``short``: the first 16 hex digits only (text lines)."""
    if isinstance(h, (bytes, bytearray)):
        if form == "int":
            return int.from_bytes(h, "big")
        s = bytes(h).hex()
        return s[:16] if short else s
    if isinstance(h, int):
        return h if form == "int" else f"{h:016x}"
    return str(h)


def event_rows(rec: LogMessage | LogControl, batch: KVEventBatch | None,
               hashes: str = "hex") -> list[dict[str, Any]]:
    """One JSON-able row per event of a message record (one row for a control record,
    one ``"undecodable"`` row for a payload that did not decode). ``hashes``: how block
    hashes are shown, ``"hex"`` or ``"int"`` (:func:`format_hash`)."""

    def _hex(h: Any) -> Any:
        return format_hash(h, hashes)

    base = {"recv_ns": rec.recv_ns, "source": rec.source}
    if type(rec) is LogControl:
        row = {**base, "type": rec.kind, "reason": rec.reason}
        if rec.kind == "stale":
            row["first_missing_seq"] = rec.first_missing_seq
            row["resume_seq"] = rec.resume_seq
        else:
            row["seq"] = rec.seq
        return [row]
    # Not a LogControl, so a LogMessage (mypy cannot narrow on that, hence the ignores).
    base.update(seq=rec.seq, topic=rec.topic.decode("utf-8", "replace"), replayed=rec.replayed)  # type: ignore[union-attr]
    if batch is None:
        return [{**base, "type": "undecodable", "payload_len": len(rec.payload)}]  # type: ignore[union-attr]
    base["ts"] = batch.ts
    base["data_parallel_rank"] = batch.data_parallel_rank
    rows = []
    for ev in batch.events:
        if type(ev) is BlockStored:
            rows.append({**base, "type": "BlockStored", "medium": ev.medium,
                         "block_hashes": [_hex(h) for h in ev.block_hashes],
                         "parent_block_hash": None if ev.parent_block_hash is None else _hex(ev.parent_block_hash),
                         "block_size": ev.block_size, "num_tokens": len(ev.token_ids),
                         "lora_id": ev.lora_id, "lora_name": ev.lora_name})
        elif type(ev) is BlockRemoved:
            rows.append({**base, "type": "BlockRemoved", "medium": ev.medium,
                         "block_hashes": [_hex(h) for h in ev.block_hashes]})
        else:
            rows.append({**base, "type": "AllBlocksCleared"})
    return rows
