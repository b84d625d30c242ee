"""The KV event subscriber: many publishers, in order per source, never silently drifting.

::

    sources = [SourceSpec("tcp://engine-0:5557", "tcp://engine-0:5558", name="e0"), ...]
    async with Subscriber(sources, topic="kv") as sub:
        async for item in sub:          # SourceBatch / SourceReset / SourceStale / SourceLive
            ...

Each source has its own SUB socket (live) and DEALER socket (replay), served by two tasks
of the subscriber's task group, so one source's recovery never holds up another. The
recovery rules live in the sans-IO :class:`~kvstream.transport.recovery.SourceTracker`;
this module only moves frames. Sockets are plain ``zmq.Socket`` s used with ``NOBLOCK``;
a task waits for the socket's FD with ``anyio.wait_readable`` and, because ZMQ's FD is
edge-triggered, drains while ``EVENTS & POLLIN`` before waiting again.

Requests that get no answer within ``replay_timeout_s`` (of silence, not in total) are
retried ``max_retries`` times with exponential backoff on a fresh DEALER (so late replies to
an abandoned request cannot be mistaken for new ones); then the source is marked stale.

Back-pressure: at most ``max_buffered_items`` items wait for the consumer; beyond that the
tasks stop reading, ZMQ's receive HWM fills, the publisher drops for this subscriber, and
the gaps are recovered by replay once the consumer catches up.
"""

from __future__ import annotations

import logging
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable

import anyio
import anyio.abc
import anyio.lowlevel
import zmq

from kvstream.wire.events import DEFAULT_MAX_PAYLOAD_BYTES, EventDecodeError, EventDecoder
from kvstream.wire.framing import SNAPSHOT_REQUEST, FrameError, encode_seq, parse_replay_reply
from kvstream.transport._ratelog import RateLimitedLog
from kvstream.transport.config import CurveClientConfig
from kvstream.transport.items import SourceReset, StreamItem
from kvstream.transport.recovery import REPLAY, SourceCounters, SourceTracker

__all__ = ["Subscriber", "SourceSpec", "SourceHealth"]

log = logging.getLogger(__name__)
_SEQ = struct.Struct(">Q")
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
# Hand items to the consumer after this many messages or events, whichever comes first:
# decoded batches held in bulk survive young-generation GC passes and get expensive.
_DRAIN_BURST = 256
_EVENT_BURST = 1024


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """One publisher to follow: its PUB ``endpoint``, its replay ROUTER endpoint (None: no
    replay, every gap marks the source stale), a ``name`` for the items (default: the
    endpoint) and optional CURVE client settings (default: the subscriber's)."""

    endpoint: str
    replay_endpoint: str | None = None
    name: str | None = None
    curve: CurveClientConfig | None = None

    @property
    def source(self) -> str:
        """The name items carry."""
        return self.name or self.endpoint


@dataclass(frozen=True, slots=True)
class SourceHealth:
    """A snapshot of one source's health: ``state`` is ``"live"``, ``"recovering"`` or
    ``"stale"``; ``last_seq`` the last yielded seq (-1: none); ``counters`` see
    :class:`~kvstream.transport.recovery.SourceCounters` (``lag_s`` in seconds)."""

    source: str
    endpoint: str
    state: str
    last_seq: int
    counters: dict[str, Any]

    def line(self) -> str:
        """A one-line human summary."""
        c = self.counters
        return (f"{self.source}: {self.state} seq={self.last_seq} batches={c['batches']} "
                f"events={c['events']} gaps={c['gaps']} replays={c['replays']} "
                f"snapshots={c['snapshots']} restarts={c['restarts']} stale={c['stale_marks']} "
                f"dups={c['duplicates']} decode_errors={c['decode_errors']} "
                f"frame_errors={c['frame_errors']} lag={c['lag_s'] * 1000:.1f}ms")


class _Source:
    __slots__ = ("spec", "tracker", "sub", "dealer", "scope", "wake", "wait_scope", "curve")

    def __init__(self, spec: SourceSpec, tracker: SourceTracker, curve: CurveClientConfig | None) -> None:
        self.spec = spec
        self.tracker = tracker
        self.sub: zmq.Socket | None = None
        self.dealer: zmq.Socket | None = None
        self.scope: anyio.CancelScope | None = None
        self.wake = anyio.Event()
        self.wait_scope: anyio.CancelScope | None = None
        self.curve = curve


class Subscriber:
    """Follows many KV event publishers; an async iterator of stream items.

    ``sources``: :class:`SourceSpec` s (or bare endpoint strings, no replay). ``topic``:
    prefix filter on the topic frame. ``replay_timeout_s``: seconds of silence before a
    request is retried; ``max_retries``: retries per request (backoff ``backoff_s``
    doubling); ``max_buffered_items``: items waiting for the consumer before reading
    pauses; ``rcvhwm``: ZMQ receive HWM of each SUB socket (messages); ``unknown_events``
    and ``max_payload_bytes`` go to the :class:`~kvstream.wire.events.EventDecoder`;
    ``curve``: CURVE client settings for every source without its own.
    """

    def __init__(
        self,
        sources: Iterable[SourceSpec | str] = (),
        *,
        topic: str | bytes = "",
        replay_timeout_s: float = 2.0,
        max_retries: int = 3,
        backoff_s: float = 0.05,
        max_buffered_items: int = 10_000,
        max_held: int = 100_000,
        rcvhwm: int = 100_000,
        unknown_events: str = "skip",
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        curve: CurveClientConfig | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.topic = topic.encode("utf-8") if isinstance(topic, str) else bytes(topic)
        self.replay_timeout_s = replay_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_buffered_items = max_buffered_items
        self.max_held = max_held
        self.rcvhwm = rcvhwm
        self._curve = curve
        self._ctx = context
        self._decoder = EventDecoder(max_payload_bytes=max_payload_bytes, unknown_events=unknown_events)  # type: ignore[arg-type]
        self._specs = [SourceSpec(s) if isinstance(s, str) else s for s in sources]
        names = [s.source for s in self._specs]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}; give each SourceSpec a name")
        self._sources: dict[str, _Source] = {}
        self._out: deque[StreamItem] = deque()
        self._out_wait: anyio.Event | None = None
        self._space_wait: anyio.Event | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = True
        self._rlog = RateLimitedLog(log)

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> "Subscriber":
        if self._ctx is None:
            self._ctx = zmq.Context.instance()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._closed = False
        try:
            for spec in self._specs:
                self._start_source(spec)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closed = True
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        for src in list(self._sources.values()):
            self._close_source(src)
        self._sources.clear()
        w = self._out_wait
        if w is not None:
            w.set()

    def add_source(self, spec: SourceSpec | str) -> None:
        """Start following one more publisher (while open)."""
        if self._tg is None:
            raise RuntimeError("add_source needs an open subscriber: use `async with Subscriber(...)`")
        spec = SourceSpec(spec) if isinstance(spec, str) else spec
        self._start_source(spec)

    def remove_source(self, name: str) -> None:
        """Stop following ``name``; yields ``SourceReset(reason="removed")`` for it."""
        src = self._sources.pop(name, None)
        if src is None:
            raise KeyError(f"no source named {name!r}; sources: {sorted(self._sources)}")
        if src.scope is not None:
            src.scope.cancel()  # the source's task closes its sockets as it unwinds
        else:
            self._close_source(src)
        self._push([SourceReset(name, "removed", None)])

    @property
    def sources(self) -> list[str]:
        """Names of the sources followed."""
        return list(self._sources)

    def health(self) -> dict[str, SourceHealth]:
        """Per-source state and counters, keyed by source name."""
        out = {}
        for name, src in self._sources.items():
            t = src.tracker
            out[name] = SourceHealth(name, src.spec.endpoint, t.state, t.expected - 1, t.counters.as_dict())
        return out

    def counters(self, name: str) -> SourceCounters:
        """The live counters object of source ``name``."""
        return self._sources[name].tracker.counters

    # -- iteration ---------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[StreamItem]:
        return self

    async def __anext__(self) -> StreamItem:
        out = self._out
        while not out:
            if self._closed:
                raise StopAsyncIteration
            ev = self._out_wait = anyio.Event()
            await ev.wait()
        item = out.popleft()
        sw = self._space_wait
        if sw is not None and len(out) <= self.max_buffered_items // 2:
            self._space_wait = None
            sw.set()
        return item

    @property
    def ready(self) -> int:
        """Items waiting for the consumer right now."""
        return len(self._out)

    def get_nowait(self) -> list[StreamItem]:
        """Every item ready now (possibly none), without waiting: for consumers that poll."""
        items = list(self._out)
        self._out.clear()
        sw = self._space_wait
        if sw is not None:
            self._space_wait = None
            sw.set()
        return items

    def _push(self, items: list[Any]) -> None:
        self._out.extend(items)
        w = self._out_wait
        if w is not None:
            self._out_wait = None
            w.set()

    async def _wait_space(self) -> None:
        while len(self._out) >= self.max_buffered_items and not self._closed:
            ev = self._space_wait
            if ev is None:
                ev = self._space_wait = anyio.Event()
            await ev.wait()

    # -- sources -----------------------------------------------------------------------

    def _start_source(self, spec: SourceSpec) -> None:
        name = spec.source
        if name in self._sources:
            raise ValueError(f"source {name!r} is already followed")
        assert self._tg is not None and self._ctx is not None
        tracker = SourceTracker(name, has_replay=spec.replay_endpoint is not None,
                                max_held=self.max_held, topic=self.topic)
        src = _Source(spec, tracker, spec.curve or self._curve)
        sub = self._ctx.socket(zmq.SUB)
        sub.rcvhwm = self.rcvhwm
        sub.linger = 0
        if src.curve is not None:
            from kvstream.transport.curve import apply_client

            apply_client(sub, src.curve)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        try:
            sub.connect(spec.endpoint)
        except zmq.ZMQError as exc:
            sub.close(0)
            raise ValueError(f"cannot connect to {spec.endpoint!r}: {exc}") from None
        src.sub = sub
        self._sources[name] = src
        tracker.start()
        self._tg.start_soon(self._run_source, src, name=f"kvstream-source-{name}")

    def _close_source(self, src: _Source) -> None:
        for s in (src.sub, src.dealer):
            if s is not None and not s.closed:
                s.close(linger=0)
        src.sub = src.dealer = None

    async def _run_source(self, src: _Source) -> None:
        try:
            with anyio.CancelScope() as scope:
                src.scope = scope
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._live_loop, src)
                    if src.spec.replay_endpoint is not None:
                        tg.start_soon(self._replay_loop, src)
        finally:
            # Closed only once no task waits on their FDs any more.
            self._close_source(src)

    def _after(self, src: _Source, gen: int) -> None:
        """Publish the tracker's new items and wake the replay task if it has work."""
        t = src.tracker
        if t.out:
            self._push(t.out)
            t.out = []
        req = t.inflight
        if t.generation != gen and src.wait_scope is not None:
            src.wait_scope.cancel()  # the request being waited on was abandoned
        if req is not None and not req.sent:
            src.wake.set()

    async def _live_loop(self, src: _Source) -> None:
        sock = src.sub
        assert sock is not None
        t = src.tracker
        decode = self._decoder.decode
        unpack = _SEQ.unpack
        c = t.counters
        rlog = self._rlog
        name = t.name
        recv = sock.recv_multipart
        nb = zmq.NOBLOCK
        while True:
            n = ev = 0
            gen = t.generation
            while True:
                # Receive until EAGAIN rather than asking EVENTS per message (it costs as
                # much as a receive); EVENTS is read once, before waiting on the FD.
                try:
                    frames = recv(nb)
                except zmq.Again:
                    # getsockopt is typed int | bytes; EVENTS is an int option.
                    if sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
                        continue
                    break
                if len(frames) != 3 or len(frames[1]) != 8:
                    c.frame_errors += 1
                    rlog.warning("frame:" + name, "%s: dropped a live message with %d frame(s) %s "
                                 "(expected [topic, 8-byte seq, payload])", name, len(frames),
                                 [len(f) for f in frames[:4]])
                    continue
                topic, seqf, payload = frames
                try:
                    batch = decode(payload)
                except EventDecodeError as exc:
                    c.decode_errors += 1
                    rlog.warning("decode:" + name, "%s: dropped undecodable live batch seq %d: %s",
                                 name, unpack(seqf)[0], exc)
                    continue
                t.on_live(unpack(seqf)[0], topic, payload, batch, time.time())
                n += 1
                ev += len(batch.events)
                if n >= _DRAIN_BURST or ev >= _EVENT_BURST:
                    self._after(src, gen)
                    gen = t.generation
                    n = ev = 0
                    await self._wait_space()
                    await anyio.lowlevel.checkpoint()
            self._after(src, gen)
            await self._wait_space()
            await anyio.wait_readable(sock.FD)

    # -- replay ------------------------------------------------------------------------

    def _new_dealer(self, src: _Source) -> zmq.Socket:
        if src.dealer is not None and not src.dealer.closed:
            src.dealer.close(linger=0)
        assert self._ctx is not None and src.spec.replay_endpoint is not None
        d = self._ctx.socket(zmq.DEALER)
        d.linger = 0
        d.rcvhwm = 0  # a replay is bounded by the publisher's buffer; never drop its replies
        if src.curve is not None:
            from kvstream.transport.curve import apply_client

            apply_client(d, src.curve)
        d.connect(src.spec.replay_endpoint)
        src.dealer = d
        return d

    async def _replay_loop(self, src: _Source) -> None:
        t = src.tracker
        while True:
            req = t.inflight
            if req is None or req.sent:
                src.wake = anyio.Event()
                if t.inflight is None or t.inflight.sent:
                    await src.wake.wait()
                continue
            await self._serve_request(src)

    async def _serve_request(self, src: _Source) -> None:
        t = src.tracker
        req = t.inflight
        assert req is not None
        c = t.counters
        for attempt in range(self.max_retries + 1):
            if t.inflight is not req:
                return
            d = src.dealer if src.dealer is not None else self._new_dealer(src)
            start = SNAPSHOT_REQUEST if req.kind != REPLAY else encode_seq(req.start)
            try:
                d.send_multipart([b"", start], zmq.NOBLOCK)
            except zmq.Again:
                pass  # not connected yet and nothing queued: counts as a timeout below
            else:
                req.sent = True
                if req.kind == REPLAY:
                    c.replays += 1
                else:
                    c.snapshots += 1
                gen = t.generation
                outcome = await self._receive_replies(src, d, gen)
                if outcome == "done":
                    return
                if outcome == "abandoned":
                    self._new_dealer(src)
                    return
            c.timeouts += 1
            self._rlog.warning("timeout:" + t.name, "%s: no complete answer to a %s request from %s "
                               "within %.1fs (attempt %d of %d)", t.name, req.kind,
                               src.spec.replay_endpoint, self.replay_timeout_s, attempt + 1,
                               self.max_retries + 1)
            req.sent = False
            req.first, req.hole = None, False
            req.snap.clear()
            req.snap_tag = None
            self._new_dealer(src)  # late replies to the abandoned attempt must not count
            if attempt < self.max_retries:
                await anyio.sleep(self.backoff_s * (2 ** attempt))
        if t.inflight is req:
            gen = t.generation
            t.on_request_failed(f"no answer from {src.spec.replay_endpoint} after "
                                f"{self.max_retries + 1} attempts")
            self._after(src, gen)

    async def _receive_replies(self, src: _Source, d: zmq.Socket, gen: int) -> str:
        """Feed replies to the tracker until the end marker: ``"done"``, ``"timeout"`` or
        ``"abandoned"`` (the tracker dropped the request, e.g. on a restart)."""
        t = src.tracker
        c = t.counters
        decode = self._decoder.decode
        name = t.name
        while True:
            n = 0
            while d.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type, operator]  # an int option
                try:
                    frames = d.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if t.generation != gen:
                    return "abandoned"
                try:
                    r = parse_replay_reply(frames)
                except FrameError as exc:
                    c.frame_errors += 1
                    self._rlog.warning("rframe:" + name, "%s: dropped a malformed replay reply: %s", name, exc)
                    continue
                if r.end:
                    t.on_reply_end()
                    self._after(src, gen)
                    return "done"
                try:
                    batch = decode(r.payload)
                except EventDecodeError as exc:
                    c.decode_errors += 1
                    self._rlog.warning("rdecode:" + name, "%s: dropped undecodable replayed batch seq %d: %s",
                                       name, r.seq, exc)
                    continue
                t.on_reply(r.seq, r.topic, r.payload, batch)
                n += 1
                if n >= _DRAIN_BURST:
                    self._after(src, gen)
                    n = 0
                    await self._wait_space()
                    await anyio.lowlevel.checkpoint()
            self._after(src, gen)
            if t.generation != gen or t.inflight is None:
                return "abandoned"
            with anyio.move_on_after(self.replay_timeout_s) as scope:
                src.wait_scope = scope
                await anyio.wait_readable(d.FD)
            src.wait_scope = None
            if t.generation != gen:
                return "abandoned"
            if scope.cancelled_caught and not (d.getsockopt(zmq.EVENTS) & zmq.POLLIN):  # type: ignore[arg-type, operator]
                return "timeout"

