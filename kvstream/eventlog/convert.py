"""Golden ``KVSTRM01`` wire captures as event log records.

A capture is what a SUB socket and a DEALER replay client saw. Converted, it becomes what
a subscriber would have yielded: every live message in arrival order, plus any replay
reply whose seq never arrived live (flagged ``replayed``); replies that repeat a live
message are dropped, as a subscriber drops duplicates. A capture has no receive times, so
each record's ``recv_ns`` is its batch's own ``ts`` (the previous one if the payload does
not decode), which keeps conversions deterministic.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from kvstream.wire.capture import CaptureChannel, read_capture
from kvstream.eventlog.format import LogMessage
from kvstream.eventlog.writer import LogWriter
from kvstream.wire.events import EventDecodeError, EventDecoder
from kvstream.wire.framing import parse_live, parse_replay_reply

__all__ = ["capture_records", "convert_captures", "is_capture"]

def is_capture(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a file starting with the ``KVSTRM01`` magic."""
    from kvstream.wire.capture import CAPTURE_MAGIC

    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(8) == CAPTURE_MAGIC

def capture_records(path: str | os.PathLike[str], source: str) -> Iterator[LogMessage]:
    """The log records equivalent to the capture at ``path``, all from ``source``.

    Raises :class:`~kvstream.wire.capture.CaptureFormatError` if the capture is damaged and
    :class:`~kvstream.wire.framing.FrameError` if a message has the wrong shape.
    """
    decoder = EventDecoder(unknown_events="skip")
    seen: set[int] = set()
    live_topic = b""
    last_ns = 0

    def recv_ns(payload: bytes) -> int:
        nonlocal last_ns
        try:
            last_ns = int(round(decoder.decode(payload).ts * 1e9))
        except EventDecodeError:
            pass
        return last_ns

    for rec in read_capture(path):
        if rec.channel == CaptureChannel.LIVE:
            m = parse_live(rec.frames)
            live_topic = m.topic
            if m.seq in seen:
                continue
            seen.add(m.seq)
            yield LogMessage(recv_ns(m.payload), source, m.topic, m.seq, bytes(m.payload), False)
        elif rec.channel == CaptureChannel.REPLAY_REPLY:
            r = parse_replay_reply(rec.frames)
            if r.end or r.seq in seen:
                continue
            seen.add(r.seq)
            yield LogMessage(recv_ns(r.payload), source, r.topic or live_topic, r.seq, bytes(r.payload), True)

def convert_captures(captures: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], *,
                     sources: Sequence[str] | None = None, metadata: dict[str, Any] | None = None,
                     **writer_options: Any) -> int:
    """Write the records of one or more captures into a new log at ``out``.

    ``sources`` names each capture's source (default: the capture's file name, e.g.
    ``stream.bin``). Records are merged in ``recv_ns`` order (stable, so one capture's
    order is kept). Returns the number of records written. ``writer_options`` go to
    :class:`LogWriter`.
    """
    if sources is not None and len(sources) != len(captures):
        raise ValueError(f"got {len(sources)} source names for {len(captures)} captures; give one per capture")
    names = list(sources) if sources is not None else [Path(c).name for c in captures]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be distinct, got {names}; pass --source NAME per capture")
    recs: list[LogMessage] = []
    for path, name in zip(captures, names):
        recs.extend(capture_records(path, name))
    recs.sort(key=lambda r: r.recv_ns)
    meta = {"converted_from": [str(Path(c).name) for c in captures], "sources": names, **(metadata or {})}
    writer_options.setdefault("flush", "close")
    with LogWriter(out, metadata=meta, **writer_options) as w:
        for r in recs:
            w.write_message(r.source, r.topic, r.seq, r.payload, replayed=r.replayed, recv_ns=r.recv_ns)
    return len(recs)
