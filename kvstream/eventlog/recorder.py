"""Recording a live stream: every item a subscriber yields, in order, into a log.

:func:`write_item` is the sans-IO mapping from stream items to log records; the
:class:`Recorder` is the async shell that pulls items from a
:class:`~kvstream.transport.subscriber.Subscriber`, writes them, and keeps the writer's
time-based flushing going while the stream is idle.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable

import anyio

from kvstream.eventlog.resume import ResumeFilter
from kvstream.eventlog.writer import LogWriter
from kvstream.transport.items import SourceBatch, SourceLive, SourceReset, SourceStale

__all__ = ["write_item", "Recorder", "RecorderStats"]

log = logging.getLogger(__name__)


def write_item(writer: LogWriter, item: Any, recv_ns: int | None = None) -> None:
    """Record one subscriber item (``recv_ns``: ns since the epoch, default now).

    ``SourceBatch`` becomes a message record (raw payload bytes, topic, seq, replayed);
    ``SourceReset`` / ``SourceStale`` / ``SourceLive`` become control records with their
    reasons, so replaying the log re-creates the exact item sequence.
    """
    cls = type(item)
    if cls is SourceBatch:
        writer.write_message(item.source, item.topic, item.seq, item.payload, replayed=item.replayed,
                             recv_ns=recv_ns)
    elif cls is SourceReset:
        writer.write_control(item.source, "reset", reason=item.reason, seq=item.seq, recv_ns=recv_ns)
    elif cls is SourceStale:
        writer.write_control(item.source, "stale", reason=item.reason, first_missing_seq=item.first_missing_seq,
                             resume_seq=item.resume_seq, recv_ns=recv_ns)
    elif cls is SourceLive:
        writer.write_control(item.source, "live", seq=item.seq, recv_ns=recv_ns)
    else:
        raise TypeError(f"not a subscriber item: {item!r}")


class RecorderStats:
    """What a recorder wrote: batches and control items, per source."""

    __slots__ = ("batches", "controls", "by_source", "unrecordable")

    def __init__(self) -> None:
        self.unrecordable = 0
        """Items that could not be written (a seq outside 64 bits); logged, not fatal."""
        self.batches = 0
        self.controls: Counter[str] = Counter()
        """Control items by kind: reset/<reason>, stale, live."""
        self.by_source: Counter[str] = Counter()
        """Batches per source."""

    def line(self) -> str:
        """A one-line summary (the CLI's live line)."""
        ctl = " ".join(f"{k}={v}" for k, v in sorted(self.controls.items()))
        return f"batches {self.batches}  sources {len(self.by_source)}" + (f"  {ctl}" if ctl else "")


class Recorder:
    """Writes every item of ``subscriber`` to ``writer`` until stopped.

    ``on_item(item)`` is called after each item is written (e.g. to apply it to a live
    index as well; it gets every item, including those a resumed log already held).
    When the writer appends to an existing log (``writer.resumed``), items pass through a
    :class:`~kvstream.eventlog.resume.ResumeFilter` built from that log (or ``resume``), so
    the join replay does not record what the log already holds. ``poll_interval`` (seconds): how often the writer's time-based flush
    and rotation run while the stream is idle. The writer is not closed by the recorder:
    its owner closes it (``with LogWriter(...)``) after :meth:`run` returns.
    """

    __slots__ = ("subscriber", "writer", "on_item", "poll_interval", "stats", "_stop", "resume")

    def __init__(self, subscriber: Any, writer: LogWriter, *, on_item: Callable[[Any], Any] | None = None,
                 poll_interval: float = 0.01, resume: ResumeFilter | None = None) -> None:
        self.subscriber = subscriber
        self.writer = writer
        self.on_item = on_item
        self.poll_interval = poll_interval
        self.stats = RecorderStats()
        self._stop = anyio.Event()
        if resume is None and writer.resumed:
            from kvstream.eventlog.reader import LogReader

            resume = ResumeFilter.from_records(LogReader(writer.path))
        self.resume = resume
        """What filters a resumed recording (None for a new log)."""

    def stop(self) -> None:
        """Make :meth:`run` return after the item in hand (callable from any task)."""
        self._stop.set()

    async def run(self, *, max_batches: int | None = None) -> RecorderStats:
        """Record until :meth:`stop`, the subscriber ends, or ``max_batches`` batches."""
        st = self.stats
        w = self.writer
        on_item = self.on_item

        async with anyio.create_task_group() as tg:

            async def poll() -> None:
                while True:
                    await anyio.sleep(self.poll_interval)
                    w.poll()

            async def watch_stop() -> None:
                await self._stop.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(poll)
            tg.start_soon(watch_stop)
            resume = self.resume
            async for item in self.subscriber:
                for out in (resume.admit(item) if resume is not None else (item,)):
                    try:
                        write_item(w, out)
                    except ValueError as exc:  # absurd remote seqs must not stop a recording
                        st.unrecordable += 1
                        log.warning("item not recorded: %s", exc)
                cls = type(item)
                if cls is SourceBatch:
                    st.batches += 1
                    st.by_source[item.source] += 1
                elif cls is SourceReset:
                    st.controls[f"reset/{item.reason}"] += 1
                elif cls is SourceStale:
                    st.controls["stale"] += 1
                else:
                    st.controls["live"] += 1
                if on_item is not None:
                    on_item(item)
                if max_batches is not None and st.batches >= max_batches:
                    break
                if self._stop.is_set():
                    break
            tg.cancel_scope.cancel()
        return st
