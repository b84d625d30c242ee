"""The async shell around the allocator: one KV event batch per engine step, handed to a sink.

The pool and manager are synchronous and sans-IO. An engine loop calls them between
``await``s and closes each step with :meth:`AsyncKVCacheManager.end_step` (or the awaitable
:meth:`~AsyncKVCacheManager.step_done`), which takes the step's events and hands them to
the sink as one :class:`~kvstream.wire.events.KVEventBatch`: exactly what vLLM's scheduler does
with its publisher. No threads, no locks, no background tasks: everything runs in the
engine's own task, so the sink sees batches in step order.

::

    async with Publisher(config) as pub, AsyncKVCacheManager(manager, pub.publish) as kv:
        while serving:
            ... kv.manager.admit(req) / decode / free ...
            await kv.step_done()

The sink is any callable taking a batch (the transport's ``Publisher.publish``, a list's
``append`` in tests). This module reads the clock (``time.time`` by default, for ``ts``);
the pool and the manager never do.

A sink that raises (a publisher under ``queue_full="raise"`` whose queue is full) never
loses a batch: the shell keeps it, re-raises, and hands it over again, before anything
newer, at the next step. Consumers see every batch, in order, with contiguous seqs. The
backlog is bounded: past ``max_held_events`` it is replaced by one self-contained
resynchronisation batch (``AllBlocksCleared`` + the pool's snapshot), which leaves any
consumer exactly at the engine's state.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, Callable

import anyio.lowlevel

from kvstream.wire.events import AllBlocksCleared, KVEventBatch
from kvstream.allocator.manager import KVCacheManager

__all__ = ["AsyncKVCacheManager", "EventSink"]

EventSink = Callable[[KVEventBatch], Any]
"""Receives one batch per step that produced events (its return value is ignored)."""


class AsyncKVCacheManager:
    """Async facade over a :class:`~kvstream.allocator.manager.KVCacheManager` for an engine loop.

    Args:
        manager: the manager (and through it the pool) this shell publishes for.
        sink: called with each non-empty step's :class:`KVEventBatch`.
        data_parallel_rank: stamped on every batch (vLLM fills in the engine's DP rank;
            None leaves it out of the payload).
        clock: seconds since the epoch for a batch's ``ts`` when ``end_step`` gets none.
        max_held_events: events kept while the sink refuses batches (see the module
            docstring); past it the backlog collapses into one resync batch. Default
            100,000 events (a few MB).

    Use it as ``async with``: leaving the block publishes what the last step left
    pending, then closes the shell (later calls raise ``RuntimeError``).

    Attributes: ``manager``, ``pool``, ``batches_published`` (batches the sink accepted),
    ``events_published`` (events in them), ``resyncs`` (times a backlog collapsed into a
    resync batch); :attr:`held_batches` is the backlog now.
    """

    __slots__ = ("manager", "pool", "data_parallel_rank", "batches_published", "events_published",
                 "max_held_events", "resyncs", "_sink", "_clock", "_closed", "_held", "_held_events")

    def __init__(
        self,
        manager: KVCacheManager,
        sink: EventSink,
        *,
        data_parallel_rank: int | None = 0,
        clock: Callable[[], float] = time.time,
        max_held_events: int = 100_000,
    ) -> None:
        if type(max_held_events) is not int or max_held_events < 1:
            raise ValueError(f"max_held_events must be a positive int (events), got {max_held_events!r}")
        if not callable(sink):
            raise TypeError(
                f"sink must be a callable taking a KVEventBatch (e.g. Publisher.publish or "
                f"list.append), got {type(sink).__name__}"
            )
        self.manager = manager
        self.pool = manager.pool
        self.data_parallel_rank = data_parallel_rank
        self.batches_published = 0
        self.events_published = 0
        self.max_held_events = max_held_events
        self.resyncs = 0
        self._held: list[KVEventBatch] = []  # batches the sink refused, oldest first
        self._held_events = 0
        self._sink = sink
        self._clock = clock
        self._closed = False

    async def __aenter__(self) -> AsyncKVCacheManager:
        if self._closed:
            raise RuntimeError("this AsyncKVCacheManager is closed; build a new one")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            # The events describe state changes that already happened: a consumer needs
            # them even if the engine loop is leaving because of an error.
            self.end_step()
        except Exception:
            if exc is None:
                raise
        finally:
            self._closed = True

    @property
    def held_batches(self) -> int:
        """Batches waiting because the sink raised on them (0 normally)."""
        return len(self._held)

    def end_step(self, ts: float | None = None) -> KVEventBatch | None:
        """Close the step: hand the pending events to the sink as one batch.

        ``ts``: the batch timestamp (seconds since the epoch); default ``clock()``.
        Returns the batch, or None when the step produced no events (nothing is sent,
        as vLLM publishes nothing for an empty step).

        Batches the sink refused earlier go first. If the sink raises, the exception
        propagates and the batch it refused, with any after it, is kept for the next call:
        nothing is lost and nothing is reordered.
        """
        if self._closed:
            raise RuntimeError("end_step() on a closed AsyncKVCacheManager; events after close are lost")
        events = self.manager.take_events()
        batch = None
        if events:
            batch = KVEventBatch(self._clock() if ts is None else ts, events, self.data_parallel_rank)
            self._held.append(batch)
            self._held_events += len(events)
            if self._held_events > self.max_held_events and len(self._held) > 1:
                self._resync(batch.ts)
        self._flush()
        return batch

    def _flush(self) -> None:
        held = self._held
        while held:
            batch = held[0]
            self._sink(batch)  # may raise: the batch stays first in line
            held.pop(0)
            self._held_events -= len(batch.events)
            self.batches_published += 1
            self.events_published += len(batch.events)

    def _resync(self, ts: float) -> None:
        """Replace the backlog with one batch that rebuilds the pool's state from scratch."""
        snap = self.pool.snapshot_events()
        assert isinstance(snap[0], AllBlocksCleared)
        self._held = [KVEventBatch(ts, snap, self.data_parallel_rank)]
        self._held_events = len(snap)
        self.resyncs += 1

    async def step_done(self, ts: float | None = None) -> KVEventBatch | None:
        """:meth:`end_step`, then yield to the event loop once (so a publisher's sender
        task can put the batch on the wire before the next step starts)."""
        batch = self.end_step(ts)
        await anyio.lowlevel.checkpoint()
        return batch

    def snapshot_events(self) -> list[Any]:
        """The events rebuilding the pool's cached state, for a publisher's snapshot.

        Pending events are first published as a batch (:meth:`end_step`), so the snapshot
        is exactly the state after the last batch the sink received. If the sink still
        refuses batches, the backlog becomes one resync batch (it starts with
        ``AllBlocksCleared``), so a consumer that applies this snapshot and later that
        batch ends at the same state. Pass this method as the transport's
        ``snapshot_provider``.
        """
        try:
            self.end_step()
        except Exception:
            self._resync(self._clock())
        return self.pool.snapshot_events()
