"""Replaying a log: into a router index (deterministic), or onto ZMQ sockets (timed).

* :func:`log_items` turns records back into the items the subscriber yielded
  (``SourceBatch`` / ``SourceReset`` / ``SourceStale`` / ``SourceLive``), in order.
* :func:`replay_into_index` applies them with the router's own ``apply_item``: the same
  item sequence the live router applied, so the same index.
* :func:`replay_to_publishers` re-publishes each source's messages on its own
  :class:`~kvstream.transport.publisher.Publisher` with the original topic, seq and
  payload bytes, paced by :class:`Pacer` at any speed.
"""

from __future__ import annotations

import math
import time
from array import array
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeGuard, TypeVar

import anyio
import anyio.lowlevel

from kvstream.eventlog.format import LogMessage, LogRecord
from kvstream.wire.events import EventDecodeError, EventDecoder
from kvstream.wire.framing import END_SEQ

__all__ = ["log_items", "replay_into_index", "Pacer", "PacingStats", "replay_to_publishers"]


def log_items(records: Iterable[LogRecord], *, decoder: EventDecoder | None = None,
              on_decode_error: Callable[[LogMessage, EventDecodeError], None] | None = None) -> Iterator[Any]:
    """The subscriber items the records stand for, in order.

    A message whose payload does not decode is skipped (the live subscriber never yielded
    such a batch either) and passed to ``on_decode_error`` if given.
    """
    from kvstream.transport.items import SourceBatch, SourceLive, SourceReset, SourceStale

    dec = decoder or EventDecoder()
    decode = dec.decode
    for r in records:
        if type(r) is LogMessage:
            try:
                batch = decode(r.payload)
            except EventDecodeError as exc:
                if on_decode_error is not None:
                    on_decode_error(r, exc)
                continue
            yield SourceBatch(r.source, r.seq, r.topic, r.payload, batch, r.replayed)
        # Not a LogMessage, so a LogControl (mypy cannot narrow on that, hence the ignores).
        elif r.kind == "reset":  # type: ignore[union-attr]
            yield SourceReset(r.source, r.reason, r.seq)  # type: ignore[union-attr]
        elif r.kind == "stale":  # type: ignore[union-attr]
            yield SourceStale(r.source, r.reason, _int(r.first_missing_seq), _int(r.resume_seq))  # type: ignore[union-attr]
        else:
            yield SourceLive(r.source, _int(r.seq))


def _int(x: int | None) -> int:
    return -1 if x is None else x


def replay_into_index(records: Iterable[LogRecord], index: Any, *,
                      apply_item: Callable[[Any, Any], Any] | None = None) -> int:
    """Apply every record of a log to ``index`` (a ``KVIndex``) through the router's
    ``apply_item`` (default ``kvstream.routing.router.apply_item``); returns the items applied.

    Deterministic: the same records always build the same index. Check the reader's
    ``damage`` afterwards: records after a damaged point are missing.
    """
    if apply_item is None:
        from kvstream.routing.router import apply_item as _apply

        apply_item = _apply
    n = 0
    for item in log_items(records):
        apply_item(index, item)
        n += 1
    return n


class PacingStats:
    """How late each paced record was sent versus its scheduled time (seconds)."""

    __slots__ = ("lateness", "sent", "elapsed")

    def __init__(self) -> None:
        self.lateness = array("d")
        """Per record: send time minus scheduled time, seconds (>= 0 in practice)."""
        self.sent = 0
        self.elapsed = 0.0
        """Wall time of the whole replay, seconds."""

    def percentile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of :attr:`lateness`, seconds (0.0 if empty)."""
        if not self.lateness:
            return 0.0
        s = sorted(self.lateness)
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    def as_dict(self) -> dict[str, float]:
        """p50/p99/max lateness in microseconds, records sent, elapsed seconds."""
        m = max(self.lateness) if self.lateness else 0.0
        return {"sent": self.sent, "elapsed_s": self.elapsed,
                "p50_us": self.percentile(0.5) * 1e6, "p99_us": self.percentile(0.99) * 1e6,
                "max_us": m * 1e6}


_Rec = TypeVar("_Rec", bound=LogRecord)


class Pacer:
    """Sends records at their recorded relative times, scaled by ``speed``.

    ``speed`` 1.0 is real time, 10.0 ten times faster, ``None`` as fast as possible.
    Waits longer than ``coarse`` seconds use a timer sleep; the rest of the wait yields to
    the event loop in a tight loop, because timer sleeps are only accurate to about a
    millisecond, and at 10,000 batches/s records are 100 us apart.
    """

    __slots__ = ("speed", "coarse", "clock", "stats")

    def __init__(self, speed: float | None = 1.0, *, coarse: float = 0.002,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if speed is not None and not speed > 0:
            raise ValueError(f"speed must be > 0 (or None for as fast as possible), got {speed}")
        self.speed = speed
        self.coarse = coarse
        self.clock = clock
        self.stats = PacingStats()

    async def run(self, records: Iterable[_Rec], send: Callable[[_Rec], Any],
                  *, yield_every: int = 256) -> PacingStats:
        """Call ``send(record)`` for each record at its time; returns :attr:`stats`.
        ``send`` may return an awaitable (awaited, e.g. for back-pressure)."""
        clock = self.clock
        st = self.stats
        late = st.lateness.append
        t0 = clock()
        base: int | None = None
        speed = self.speed
        checkpoint = anyio.lowlevel.checkpoint
        n = 0
        try:
            for rec in records:
                if speed is not None:
                    if base is None:
                        base = rec.recv_ns
                    target = t0 + (rec.recv_ns - base) / 1e9 / speed
                    wait = target - clock()
                    if wait > self.coarse:
                        await anyio.sleep(wait - self.coarse / 2)
                    while clock() < target:
                        await checkpoint()
                    r = send(rec)
                    late(clock() - target)
                else:
                    r = send(rec)
                if r is not None:
                    await r
                n += 1
                if speed is None and n % yield_every == 0:
                    st.sent += yield_every
                    n = 0
                    await checkpoint()
        finally:
            # Also when cancelled: `sent` says how far a replay got.
            st.sent += n
            st.elapsed += clock() - t0
        return st


async def replay_to_publishers(records: Iterable[LogRecord], publishers: Mapping[str, Any], *,
                               speed: float | None = 1.0, pacer: Pacer | None = None,
                               max_queued: int | None = None) -> PacingStats:
    """Re-publish every message of the sources in ``publishers`` (source name -> open
    Publisher) with its original topic, seq and payload, paced at ``speed``.

    Control records and other sources' messages are skipped, as are replayed messages
    whose seq does not advance the source (the batches of a snapshot: a publisher's live
    stream never carried them). With ``speed=None`` publishing waits while a publisher
    has more than ``max_queued`` batches queued (default: half its queue) so nothing is
    dropped.
    """
    sends = {src: p.publish_raw for src, p in publishers.items()}
    topics = {src: p.config.topic.encode("utf-8") for src, p in publishers.items()}
    last: dict[str, int] = {}
    pacer = pacer or Pacer(speed)
    limits = {src: (max_queued if max_queued is not None else max(1, p.config.max_queue_size // 2))
              for src, p in publishers.items()}

    def wanted(rec: LogRecord) -> TypeGuard[LogMessage]:
        if rec.source not in sends:
            return False
        if type(rec) is not LogMessage:
            # A LogControl (mypy cannot narrow on that, hence the ignores).
            if rec.kind == "reset":  # type: ignore[union-attr]
                if rec.reason == "snapshot" and rec.seq is not None:  # type: ignore[union-attr]
                    # The snapshot's batches (tagged seq - 1) never were live frames.
                    last[rec.source] = rec.seq - 1
                else:
                    last.pop(rec.source, None)  # a new engine: its seqs start over
            return False
        prev = last.get(rec.source)
        if rec.replayed and ((prev is not None and rec.seq <= prev) or rec.seq < 0):
            return False
        last[rec.source] = rec.seq
        return True

    def send_paced(rec: LogMessage) -> Any:
        src = rec.source
        pub = publishers[src]
        if rec.topic != topics[src] or rec.seq >= END_SEQ or rec.seq < 0:
            # What one publisher could not have produced itself (a second topic on the
            # source, the end-marker seq): sent as it was recorded, in order.
            return _send_verbatim(pub, rec)
        sends[src](rec.payload, rec.seq, topic=rec.topic)
        if pub.queued > limits[src]:
            return _drain(pub, limits[src])
        return None

    return await pacer.run((r for r in records if wanted(r)), send_paced)


async def _send_verbatim(pub: Any, rec: LogMessage) -> None:
    await _drain(pub, 0)
    pub.send_verbatim(rec.payload, rec.seq % (1 << 64), rec.topic)


async def _drain(pub: Any, limit: int) -> None:
    while pub.queued > limit:
        await anyio.sleep(0.0005)

