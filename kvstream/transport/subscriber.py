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

Each source is ``connecting`` until its publisher answers (a live message or a replay
answer), then ``live``, ``recovering`` or ``stale`` (see
:mod:`~kvstream.transport.recovery` for the rules). :meth:`Subscriber.wait_state` and
:meth:`Subscriber.wait_connected` wait for a state (tests and startup code should, rather
than sleeping). Requests that get no complete answer within ``replay_timeout_s`` (of
silence, not in total) are asked again on a fresh DEALER (so late replies to an abandoned
request cannot be mistaken for new ones), with exponential backoff; the tracker decides
when a loss is final. Idle probes ask the replay socket, ``probe_after_s`` after the last
live message, whether the tail of a burst was lost.

Every buffer is bounded in the bytes it holds, decoded batches included (estimated
conservatively, see :data:`~kvstream.wire.events.DECODED_BYTES_PER_PAYLOAD_BYTE`): items
waiting for the consumer (``max_buffered_items``, ``max_buffered_bytes``; beyond them live
messages are shed undecoded rather than left to pile up in ZMQ's queue, no replay is asked
for, and the gaps are recovered by replay once the consumer catches up), held messages
(``max_held``, ``max_held_bytes``) and snapshot answers (``max_snapshot_bytes``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable

import anyio
import anyio.abc
import anyio.lowlevel
import zmq
from zmq.utils.monitor import recv_monitor_message

from itertools import repeat

from kvstream.wire.events import (DECODED_BYTES_PER_PAYLOAD_BYTE, DEFAULT_MAX_PAYLOAD_BYTES, EventDecodeError,
                                  EventDecoder)
from kvstream.errors import LocalProtocolError
from kvstream.wire.framing import SNAPSHOT_REQUEST, FrameError, encode_seq, parse_replay_reply, split_live
from kvstream.transport._ratelog import RateLimitedLog
from kvstream.transport.config import CurveClientConfig, EndpointError
from kvstream.transport.items import SourceBatch, SourceReset, StreamItem
from kvstream.transport.recovery import REPLAY, STATES, Request, SourceCounters, SourceTracker

__all__ = ["Subscriber", "SourceSpec", "SourceHealth"]

log = logging.getLogger(__name__)
_EVENTS = int(zmq.EVENTS)
_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
_POLLIN = int(zmq.POLLIN)
# Hand items to the consumer after this many messages or events, whichever comes first:
# decoded batches held in bulk survive young-generation GC passes and get expensive.
_DRAIN_BURST = 256
_EVENT_BURST = 1024
_ENDPOINT_FORMS = "write it as tcp://HOST:PORT (port 1-65535), ipc://PATH or inproc://NAME"


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """One publisher to follow: its PUB ``endpoint``, its replay ROUTER endpoint (None: no
    replay, every gap marks the source stale), a ``name`` for the items (default: the
    endpoint), optional CURVE client settings (default: the subscriber's) and the
    publisher's ``topic`` if known (labels vLLM 0.11 replay replies, which carry no topic
    frame, until a live message shows the topic). ``bind``: the SUB socket binds
    ``endpoint`` instead of connecting to it, for an engine whose PUB connects (vLLM connects
    when its endpoint has no wildcard, ``tcp://router:5557``); one bound endpoint per engine.
    The replay endpoint is always connected to (vLLM's ROUTER binds). ``forwarded``: the live
    endpoint is a forwarder (a ZMQ proxy, an XSUB/XPUB device) that stays connected when
    the engine restarts, so no reconnect marks a restart: idle probes then check every batch
    taken live since the last check (docs/stream.md, *hidden restarts*)."""

    endpoint: str
    replay_endpoint: str | None = None
    name: str | None = None
    curve: CurveClientConfig | None = None
    topic: str | bytes | None = None
    bind: bool = False
    forwarded: bool = False

    @property
    def source(self) -> str:
        """The name items carry."""
        return self.name or self.endpoint


@dataclass(frozen=True, slots=True)
class SourceHealth:
    """A snapshot of one source's health: ``endpoint`` its live endpoint (the address
    actually bound for ``SourceSpec(bind=True)``); ``state`` is ``"connecting"``, ``"live"``,
    ``"recovering"`` or ``"stale"``; ``last_seq`` the last yielded seq (-1: none); ``counters`` see
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
    __slots__ = ("spec", "tracker", "sub", "dealer", "dealer_gen", "scope", "wake", "wait_scope", "curve",
                 "monitor", "handshakes", "auth_failures", "endpoint", "live_n", "live_rx", "replay_only",
                 "replay_answers", "replay_since", "no_live_warned")

    def __init__(self, spec: SourceSpec, tracker: SourceTracker, curve: CurveClientConfig | None) -> None:
        self.spec = spec
        self.tracker = tracker
        self.sub: zmq.Socket | None = None
        self.dealer: zmq.Socket | None = None
        self.dealer_gen = -1
        self.scope: anyio.CancelScope | None = None
        self.wake = anyio.Event()
        self.wait_scope: anyio.CancelScope | None = None
        self.curve = curve
        self.monitor: zmq.Socket | None = None
        self.handshakes = 0
        self.auth_failures = 0
        self.endpoint = spec.endpoint  # the bound address once bound (port 0 resolved)
        # The connect/connect check (Subscriber.no_live_batches): live messages received,
        # and batches / answers taken by replay since the last live one (and when the
        # first of them came; None: none yet).
        self.live_n = 0  # live messages decoded
        self.live_rx = 0  # and shed: what the live socket brought, as last counted
        self.replay_only = 0
        self.replay_answers = 0
        self.replay_since: float | None = None
        self.no_live_warned = False


def _held_bytes(payload: bytes, batch: Any, factor: int) -> int:
    """Bytes a payload and its decoded batch hold: what the batch says it holds
    (``held_bytes``: a natively read batch measures its columns, and keeps the payload,
    counted once unless it is a copy), else ``factor`` bytes per payload byte (the
    decoder's conservative estimate of Python objects)."""
    held = getattr(batch, "held_bytes", None)
    if held is None:
        return len(payload) * (factor + 1)
    own = batch.payload
    return len(payload) + held + (0 if own is payload else len(own))


def _item_bytes(item: Any, factor: int) -> int:
    """Bytes an item holds, at most: its payload and its decoded batch (see
    :func:`_held_bytes`) plus 64."""
    return _held_bytes(item.payload, item.batch, factor) + 64 if type(item) is SourceBatch else 64


class Subscriber:
    """Follows many KV event publishers; an async iterator of stream items.

    Args:
        sources: :class:`SourceSpec` s (or bare endpoint strings, no replay).
        topic: prefix filter on the topic frame, for live messages and replayed batches.
        replay_timeout_s: seconds of silence before a request is asked again.
        max_retries: requests asked again without progress (holes, cut tails, silence)
            before a loss is taken as final; ``backoff_s`` seconds between them, doubling
            (capped at 2 s).
        probe_after_s: quiet seconds after live traffic before a source's replay socket is
            asked whether anything was lost (vLLM sends no heartbeat); None: never.
        probe_max_s: while a source stays quiet the wait between probes doubles up to this
            many seconds (None: one probe per quiet period).
        max_buffered_items / max_buffered_bytes: items (and the bytes they hold, decoded
            form included, see :attr:`ready_bytes`) waiting for the consumer; beyond them
            live messages are shed undecoded (counted ``shed``) and no replay is asked for;
            the gaps are recovered by replay once the consumer has taken half.
        max_held / max_held_bytes: live messages held per source while a request is
            outstanding (more are dropped and fetched again by replay).
        max_snapshot_bytes: payload bytes of one snapshot answer (beyond: the source is
            marked stale).
        rcvhwm: ZMQ receive HWM of each SUB socket (messages); replay_rcvhwm: of each
            DEALER (messages; a full replay of ``buffer_steps`` batches must fit).
        unknown_events / max_payload_bytes: go to the
            :class:`~kvstream.wire.events.EventDecoder`; ZMQ also refuses messages larger
            than ``max_payload_bytes`` + 64 KiB (it drops the connection), so each ZMQ
            queue holds at most HWM x that many bytes.
        curve: CURVE client settings for every source without its own.
        decoder: what turns a payload into a ``KVEventBatch`` (anything with
            ``decode(bytes)`` raising ``EventDecodeError`` for bad bytes, e.g.
            :class:`~kvstream.wire.mooncake.AnyFormatDecoder`); default: an
            :class:`~kvstream.wire.events.EventDecoder` with ``unknown_events`` and
            ``max_payload_bytes``.
    """

    no_live_batches = 16
    """The connect/connect warning (docs/stream.md, *Both sides connect*): a source that has
    taken at least this many batches by replay, in at least :attr:`no_live_answers`
    separate answers over at least :attr:`no_live_s` seconds, and not one message live
    (since it started or since its last live message), logs one warning naming its endpoint
    (again at most every 5 minutes, and only after a live message ended the episode) and
    counts ``no_live_warnings``. A join's one answer, however long, never does."""
    no_live_answers = 3
    no_live_s = 5.0

    def __init__(
        self,
        sources: Iterable[SourceSpec | str] = (),
        *,
        topic: str | bytes = "",
        replay_timeout_s: float = 2.0,
        max_retries: int = 3,
        backoff_s: float = 0.05,
        probe_after_s: float | None = 0.5,
        probe_max_s: float | None = 2.0,
        max_buffered_items: int = 10_000,
        max_buffered_bytes: int = 64 << 20,
        max_held: int = 100_000,
        max_held_bytes: int = 64 << 20,
        max_snapshot_bytes: int = 256 << 20,
        rcvhwm: int = 10_000,
        replay_rcvhwm: int = 20_000,
        unknown_events: str = "skip",
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        curve: CurveClientConfig | None = None,
        context: zmq.Context | None = None,
        decoder: Any = None,
    ) -> None:
        for k, v in (("max_buffered_items", max_buffered_items), ("max_buffered_bytes", max_buffered_bytes),
                     ("max_held", max_held), ("max_held_bytes", max_held_bytes),
                     ("max_snapshot_bytes", max_snapshot_bytes)):
            if v < 1:
                raise ValueError(f"{k} must be >= 1, got {v}")
        if replay_timeout_s <= 0 or backoff_s < 0 or max_retries < 0:
            raise ValueError("replay_timeout_s must be > 0, backoff_s and max_retries >= 0")
        if probe_after_s is not None and probe_after_s <= 0:
            raise ValueError(f"probe_after_s must be > 0 seconds or None, got {probe_after_s}")
        self.topic = topic.encode("utf-8") if isinstance(topic, str) else bytes(topic)
        self.replay_timeout_s = replay_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.probe_after_s = probe_after_s
        self.probe_max_s = probe_max_s
        self.max_buffered_items = max_buffered_items
        self.max_buffered_bytes = max_buffered_bytes
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.max_snapshot_bytes = max_snapshot_bytes
        self.rcvhwm = rcvhwm
        self.replay_rcvhwm = replay_rcvhwm
        self._maxmsg = max_payload_bytes + (64 << 10)
        self._curve = curve
        self._ctx = context
        self._decoder = decoder if decoder is not None else EventDecoder(
            max_payload_bytes=max_payload_bytes, unknown_events=unknown_events)  # type: ignore[arg-type]
        # Byte bounds count what is held, decoded form included (estimated conservatively).
        self._factor = int(getattr(self._decoder, "held_bytes_per_payload_byte", DECODED_BYTES_PER_PAYLOAD_BYTE))
        # A burst of live messages is handed over (and space checked) after this many bytes.
        self._burst_bytes = max(1, max_buffered_bytes // 8)
        self._specs = [SourceSpec(s) if isinstance(s, str) else s for s in sources]
        names = [s.source for s in self._specs]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}; give each SourceSpec a name")
        self._sources: dict[str, _Source] = {}
        self._out: deque[StreamItem] = deque()
        self._out_bytes = 0
        # (items pushed in total after this burst, its receive time, its counters): the
        # lag of the burst is measured when the consumer takes its last item.
        self._marks: deque[tuple[int, float, SourceCounters]] = deque()
        self._pushed = 0
        self._taken = 0
        self._out_wait: anyio.Event | None = None
        self._space_wait: anyio.Event | None = None
        self._state_wait: anyio.Event | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = True
        self._rlog = RateLimitedLog(log)
        self._no_live_log = RateLimitedLog(log, interval_s=300.0)

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
        for w in (self._out_wait, self._state_wait):
            if w is not None:
                w.set()

    def add_source(self, spec: SourceSpec | str, *, start_seq: int = 0) -> None:
        """Start following one more publisher (while open). ``start_seq`` > 0: the caller
        already holds this source's state up to ``start_seq - 1`` (e.g. a replica's dump),
        so the replay socket is asked only from there (the publisher must still buffer
        ``start_seq - 1``; see :meth:`SourceTracker.start`), not from 0."""
        if self._tg is None:
            raise LocalProtocolError("add_source needs an open subscriber: use `async with Subscriber(...)`")
        spec = SourceSpec(spec) if isinstance(spec, str) else spec
        self._start_source(spec, start_seq)

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
            out[name] = SourceHealth(name, src.endpoint, t.state, t.expected - 1, t.counters.as_dict())
        return out

    def state(self, name: str) -> str:
        """The state of source ``name``: one of :data:`~kvstream.transport.recovery.STATES`."""
        src = self._sources.get(name)
        if src is None:
            raise KeyError(f"no source named {name!r}; sources: {sorted(self._sources)}")
        return src.tracker.state

    def counters(self, name: str) -> SourceCounters:
        """The live counters object of source ``name``."""
        return self._sources[name].tracker.counters

    async def wait_state(self, name: str, *states: str, timeout_s: float | None = None) -> str:
        """Wait until source ``name`` is in one of ``states`` (default: anything but
        ``"connecting"``); returns the state. Raises ``TimeoutError`` after ``timeout_s``
        seconds (None: no limit) naming the state it was stuck in."""
        wanted = states or ("live", "recovering", "stale")
        bad = [s for s in wanted if s not in STATES]
        if bad:
            raise LocalProtocolError(f"unknown state(s) {bad}; states are {list(STATES)}")
        try:
            with anyio.fail_after(timeout_s):
                while True:
                    st = self.state(name)
                    if st in wanted:
                        return st
                    if self._closed:
                        raise LocalProtocolError("the subscriber is closed")
                    ev = self._state_wait
                    if ev is None:
                        ev = self._state_wait = anyio.Event()
                    await ev.wait()
        except TimeoutError:
            raise TimeoutError(f"source {name!r} still {self.state(name)!r} after {timeout_s}s, "
                               f"waited for {list(wanted)}") from None

    async def wait_connected(self, name: str | None = None, timeout_s: float | None = None) -> None:
        """Wait until source ``name`` (default: every source) has heard from its publisher
        and is caught up (``"live"``). ``TimeoutError`` after ``timeout_s`` seconds."""
        names = [name] if name is not None else list(self._sources)
        with anyio.fail_after(timeout_s):
            for n in names:
                await self.wait_state(n, "live")

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
        self._out_bytes -= _item_bytes(item, self._factor)
        self._taken += 1
        marks = self._marks
        if marks and marks[0][0] <= self._taken:
            self._took_marks()
        sw = self._space_wait
        if sw is not None and len(out) <= self.max_buffered_items // 2 and \
                self._out_bytes <= self.max_buffered_bytes // 2:
            self._space_wait = None
            sw.set()
        return item

    def _took_marks(self) -> None:
        marks = self._marks
        now = time.monotonic()
        while marks and marks[0][0] <= self._taken:
            _, t, c = marks.popleft()
            c.lag_s = now - t

    @property
    def ready(self) -> int:
        """Items waiting for the consumer right now."""
        return len(self._out)

    @property
    def ready_bytes(self) -> int:
        """Bytes held by the items waiting for the consumer right now: payloads and their
        decoded form (estimated, ``held_bytes_per_payload_byte`` of the decoder, 12 for
        vLLM batches), plus 64 per item; what ``max_buffered_bytes`` bounds."""
        return self._out_bytes

    def get_nowait(self) -> list[StreamItem]:
        """Every item ready now (possibly none), without waiting: for consumers that poll."""
        items = list(self._out)
        self._out.clear()
        self._out_bytes = 0
        self._taken += len(items)
        self._took_marks()
        sw = self._space_wait
        if sw is not None:
            self._space_wait = None
            sw.set()
        return items

    def _push(self, items: list[Any], received: float | None = None, c: SourceCounters | None = None) -> None:
        self._out.extend(items)
        self._out_bytes += sum(map(_item_bytes, items, repeat(self._factor)))
        self._pushed += len(items)
        if received is not None and c is not None:
            self._marks.append((self._pushed, received, c))
        w = self._out_wait
        if w is not None:
            self._out_wait = None
            w.set()

    def _full(self) -> bool:
        return len(self._out) >= self.max_buffered_items or self._out_bytes >= self.max_buffered_bytes

    async def _wait_space(self) -> None:
        while self._full() and not self._closed:
            ev = self._space_wait
            if ev is None:
                ev = self._space_wait = anyio.Event()
            await ev.wait()

    # -- sources -----------------------------------------------------------------------

    def _start_source(self, spec: SourceSpec, start_seq: int = 0) -> None:
        name = spec.source
        if start_seq < 0:
            raise ValueError(f"start_seq must be >= 0, got {start_seq}")
        if name in self._sources:
            raise ValueError(f"source {name!r} is already followed")
        assert self._tg is not None and self._ctx is not None
        st = spec.topic.encode("utf-8") if isinstance(spec.topic, str) else spec.topic
        tracker = SourceTracker(name, has_replay=spec.replay_endpoint is not None,
                                max_held=self.max_held, max_held_bytes=self.max_held_bytes,
                                max_snapshot_bytes=self.max_snapshot_bytes, max_retries=self.max_retries,
                                held_factor=self._factor + 1,
                                backoff_s=self.backoff_s, probe_after_s=self.probe_after_s,
                                probe_max_s=self.probe_max_s,
                                topic=self.topic, source_topic=st, hidden_restarts=spec.forwarded)
        src = _Source(spec, tracker, spec.curve or self._curve)
        sub = src.sub = self._ctx.socket(zmq.SUB)
        try:
            sub.rcvhwm = self.rcvhwm
            sub.linger = 0
            sub.setsockopt(zmq.MAXMSGSIZE, self._maxmsg)
            if src.curve is not None:
                from kvstream.transport.curve import apply_client

                apply_client(sub, src.curve)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            try:
                if spec.bind:
                    sub.bind(spec.endpoint)
                    src.endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
                else:
                    sub.connect(spec.endpoint)
            except zmq.ZMQError as exc:
                raise EndpointError(f"cannot {'bind' if spec.bind else 'connect to'} {spec.endpoint!r}: {exc}; "
                                    f"{_ENDPOINT_FORMS}") from None
            if spec.replay_endpoint is not None:
                # The replay socket connects lazily (in the replay task): refuse an endpoint
                # it could never connect to here.
                probe = self._ctx.socket(zmq.DEALER)
                try:
                    probe.connect(spec.replay_endpoint)
                except zmq.ZMQError as exc:
                    raise EndpointError(f"cannot connect to replay endpoint {spec.replay_endpoint!r}: {exc}; "
                                        f"{_ENDPOINT_FORMS}") from None
                finally:
                    probe.close(0)
                # Reconnects of the live socket: the publisher may have restarted (see
                # SourceTracker.on_reconnect). Failed handshakes (CURVE) are logged.
                src.monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
        except BaseException:
            # A source that cannot start leaves nothing open: out of sockets or descriptors
            # half-way (EMFILE on the probe or the monitor), the SUB would otherwise leak.
            self._close_source(src)
            raise
        self._sources[name] = src
        tracker.start(time.monotonic(), start_seq)
        self._tg.start_soon(self._run_source, src, name=f"kvstream-source-{name}")

    def _close_source(self, src: _Source) -> None:
        if src.monitor is not None:
            if src.sub is not None and not src.sub.closed:
                src.sub.disable_monitor()
            src.monitor.close(linger=0)
            src.monitor = None
        for s in (src.sub, src.dealer):
            if s is not None and not s.closed:
                s.close(linger=0)
        src.sub = src.dealer = None

    async def _run_source(self, src: _Source) -> None:
        if src.sub is None:
            return  # removed (its sockets closed) before this task first ran
        try:
            with anyio.CancelScope() as scope:
                src.scope = scope
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._live_loop, src)
                    if src.spec.replay_endpoint is not None:
                        tg.start_soon(self._replay_loop, src)
                    if src.monitor is not None:
                        tg.start_soon(self._monitor_loop, src)
        finally:
            # Closed only once no task waits on their FDs any more.
            self._close_source(src)

    def _after(self, src: _Source, gen: int, received: float | None = None) -> None:
        """Publish the tracker's new items and wake the replay task if it has work."""
        t = src.tracker
        if t.out:
            self._push(t.out, received, t.counters)
            t.out = []
        req = t.inflight
        if t.generation != gen and src.wait_scope is not None:
            src.wait_scope.cancel()  # the request being waited on was abandoned
        if req is not None and not req.sent:
            src.wake.set()
        sw = self._state_wait
        if sw is not None:
            self._state_wait = None
            sw.set()

    async def _live_loop(self, src: _Source) -> None:
        sock = src.sub
        assert sock is not None
        t = src.tracker
        decode = self._decoder.decode
        c = t.counters
        rlog = self._rlog
        name = t.name
        recv = sock.recv_multipart
        nb = zmq.NOBLOCK
        split = split_live
        now = time.monotonic
        drain_monitor = self._drain_monitor
        full = self._full
        factor = self._factor
        held = _held_bytes
        burst_bytes = self._burst_bytes
        while True:
            drain_monitor(src)
            n = ev = nbytes = 0
            gen = t.generation
            received = now()
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
                try:
                    topic, seq, payload = split(frames)
                except FrameError as exc:
                    c.frame_errors += 1
                    rlog.warning("frame:" + name, "%s: dropped a live message: %s", name, exc)
                    continue
                if n == 0 and full():
                    # The consumer's queue is full: shed what arrives, undecoded, rather than
                    # stop reading (ZMQ's queue would hold up to rcvhwm messages of any size,
                    # then drop too). A gap, replayed once there is room.
                    t.on_shed(seq, received)
                    del frames, payload
                    continue
                try:
                    batch = decode(payload)
                except EventDecodeError as exc:
                    c.decode_errors += 1
                    rlog.warning("decode:" + name, "%s: dropped undecodable live batch seq %d: %s",
                                 name, seq, exc)
                    continue
                t.on_live(seq, topic, payload, batch, received)
                n += 1
                ev += len(batch.events)
                nbytes += held(payload, batch, factor)
                if n >= _DRAIN_BURST or ev >= _EVENT_BURST or nbytes >= burst_bytes:
                    # Handed over by count, events or bytes held (decoded form included), so
                    # the queue never passes max_buffered_bytes by more than one burst.
                    self._live_seen(src, n)
                    self._after(src, gen, received)
                    gen = t.generation
                    n = ev = nbytes = 0
                    await anyio.lowlevel.checkpoint()
                    received = now()
            if n or src.replay_only:
                self._live_seen(src, n)
            self._after(src, gen, received)
            await anyio.wait_readable(sock.FD)

    @staticmethod
    def _live_seen(src: _Source, n: int) -> None:
        """``n`` live messages were taken (shed ones count too: the live path works)."""
        src.live_n += n
        rx = src.live_n + src.tracker.counters.shed
        if rx != src.live_rx:
            src.live_rx = rx
            src.replay_only = src.replay_answers = 0
            src.replay_since = None
            src.no_live_warned = False

    def _replay_only(self, src: _Source, batches: int, live_before: int) -> None:
        """A replay answer yielded ``batches`` batches; warn (once) if every batch for a
        while came that way (see :attr:`no_live_batches`)."""
        self._live_seen(src, 0)  # shed messages since the last burst
        if batches <= 0 or src.live_rx != live_before:
            return
        now = time.monotonic()
        if src.replay_since is None:
            src.replay_since = now
        src.replay_only += batches
        src.replay_answers += 1
        if src.no_live_warned or src.replay_only < self.no_live_batches or \
                src.replay_answers < self.no_live_answers or now - src.replay_since < self.no_live_s:
            return
        src.no_live_warned = True
        t = src.tracker
        t.counters.no_live_warnings += 1
        how = ("the SUB socket binds it and no engine connected to it" if src.spec.bind else
               "the SUB socket never completed a connection there" if src.handshakes == 0 else
               "the SUB socket is connected there, yet nothing arrives")
        self._no_live_log.warning(
            "nolive:" + t.name,
            "%s: the last %d batches (%d replay answers over %.0f s) arrived only by replay from %s, none live "
            "on %s (%s). Most likely both sides connect to the live endpoint: vLLM binds its PUB only for "
            "ipc:// or a wildcard address, and connects for tcp://HOST:PORT. Bind one side: give the engine "
            "tcp://*:PORT (and subscribe to tcp://ENGINE_HOST:PORT), or bind the subscriber "
            "(SourceSpec(bind=True), the engine connecting to it)",
            t.name, src.replay_only, src.replay_answers, now - src.replay_since, src.spec.replay_endpoint,
            src.endpoint, how)

    def _drain_monitor(self, src: _Source) -> None:
        """Apply the live socket's connection events (non-blocking). The I/O thread queues
        a handshake event before the new connection's messages reach the SUB, so the live
        task calls this before each burst: a reconnect is a barrier in message order."""
        mon = src.monitor
        if mon is None:
            return
        t = src.tracker
        while mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type, operator]
            try:
                msg = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                break
            ev = msg["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                src.handshakes += 1
                if src.handshakes > 1:
                    gen = t.generation
                    t.on_reconnect(time.monotonic())
                    self._after(src, gen)
            elif ev != zmq.EVENT_DISCONNECTED:
                src.auth_failures += 1
                self._rlog.warning("handshake:" + t.name, "%s: handshake with %s failed (%s): "
                                   "check the CURVE keys", t.name, src.spec.endpoint, ev)

    async def _monitor_loop(self, src: _Source) -> None:
        mon = src.monitor
        assert mon is not None
        while True:
            self._drain_monitor(src)
            await anyio.wait_readable(mon.FD)

    # -- replay ------------------------------------------------------------------------

    def _dealer(self, src: _Source) -> zmq.Socket:
        """The DEALER for the current request generation (a fresh one after an abandoned
        or timed-out request, so its late replies cannot be mistaken for new ones)."""
        t = src.tracker
        if src.dealer is not None and src.dealer_gen == t.generation:
            return src.dealer
        if src.dealer is not None and not src.dealer.closed:
            src.dealer.close(linger=0)
        src.dealer = None
        assert self._ctx is not None and src.spec.replay_endpoint is not None
        d = self._ctx.socket(zmq.DEALER)
        try:
            d.linger = 0
            d.rcvhwm = self.replay_rcvhwm
            d.setsockopt(zmq.MAXMSGSIZE, self._maxmsg)
            if src.curve is not None:
                from kvstream.transport.curve import apply_client

                apply_client(d, src.curve)
            d.connect(src.spec.replay_endpoint)
        except BaseException:
            d.close(linger=0)
            raise
        src.dealer = d
        src.dealer_gen = t.generation
        return d

    async def _replay_loop(self, src: _Source) -> None:
        t = src.tracker
        clock = time.monotonic
        while True:
            req = t.inflight
            if req is not None and not req.sent:
                await self._serve_request(src, req)
                continue
            src.wake = anyio.Event()
            req = t.inflight
            if req is not None and not req.sent:
                continue
            at = t.probe_at()
            if at is None:
                await src.wake.wait()
                continue
            wait = at - clock()
            if wait > 0:
                with anyio.move_on_after(wait):
                    await src.wake.wait()
            gen = t.generation
            t.on_tick(clock())
            self._after(src, gen)

    async def _serve_request(self, src: _Source, req: Request) -> None:
        t = src.tracker
        c = t.counters
        if req.delay_s > 0:
            await anyio.sleep(req.delay_s)
            if t.inflight is not req:
                return
        if self._full():
            # No answer is asked for while the consumer's queue is full: its replies would
            # wait in ZMQ's queue, unbounded in bytes.
            await self._wait_space()
            if t.inflight is not req:
                return
        try:
            d = self._dealer(src)
        except zmq.ZMQError as exc:
            await self._no_socket(src, req, exc)
            return
        start = req.frame()
        gen = t.generation
        try:
            d.send_multipart([b"", SNAPSHOT_REQUEST if start is None else encode_seq(start)], zmq.NOBLOCK)
        except zmq.Again:
            # Not connected (yet): nothing can be queued. Wait up to a timeout for the
            # connection, then send; no connection in time counts as a timeout.
            outcome = "timeout"
            with anyio.move_on_after(self.replay_timeout_s):
                while not (d.getsockopt(zmq.EVENTS) & zmq.POLLOUT):  # type: ignore[arg-type, operator]
                    with anyio.move_on_after(0.05):
                        await anyio.wait_readable(d.FD)
                return  # connected: the replay loop sends the same request again
        else:
            req.sent = True
            if req.kind == REPLAY:
                c.replays += 1
            else:
                c.snapshots += 1
            b0, live0 = c.batches, src.live_rx
            outcome = await self._receive_replies(src, d, gen)
            self._replay_only(src, c.batches - b0, live0)
            # Whatever happened (an abandoned request may have produced items, e.g. a
            # stale mark on an overflow), publish the tracker's items.
            self._after(src, gen)
        if outcome == "timeout" and t.inflight is req:
            self._rlog.warning("timeout:" + t.name, "%s: no complete answer to a %s request from %s "
                               "within %.1fs", t.name, req.kind, src.spec.replay_endpoint,
                               self.replay_timeout_s)
            t.on_timeout()
            self._after(src, gen)

    async def _no_socket(self, src: _Source, req: Request, exc: zmq.ZMQError) -> None:
        """No replay socket could be opened for ``req`` (out of ZMQ sockets or file
        descriptors: EMFILE, e.g. while HTTP connections hold every descriptor). The
        request counts as unanswered after ``replay_timeout_s``, as if it had been sent, so
        it is retried with the same back-off and the source turns ``recovering`` and then
        ``stale``; only this source waits, and the subscriber never ends on it."""
        t = src.tracker
        # One key for every source: out of descriptors, all of them fail at once.
        self._rlog.warning("socket", "%s: cannot open a replay socket for %s (%s); %s request "
                           "counted as unanswered, asked again with back-off", t.name, src.spec.replay_endpoint,
                           exc, req.kind)
        gen = t.generation
        with anyio.move_on_after(self.replay_timeout_s) as scope:
            src.wait_scope = scope  # cancelled if the request is abandoned meanwhile
            await anyio.sleep_forever()
        src.wait_scope = None
        if t.inflight is req and t.generation == gen:
            t.on_timeout()
            self._after(src, gen)

    async def _receive_replies(self, src: _Source, d: zmq.Socket, gen: int) -> str:
        """Feed replies to the tracker until the end marker: ``"done"``, ``"timeout"`` or
        ``"abandoned"`` (the tracker dropped the request, e.g. on a restart)."""
        t = src.tracker
        c = t.counters
        decode = self._decoder.decode
        name = t.name
        factor = self._factor
        held = _held_bytes
        nbytes = 0
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
                    self._after(src, gen, time.monotonic())
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
                nbytes += held(r.payload, batch, factor)
                if n >= _DRAIN_BURST or nbytes >= self._burst_bytes:
                    self._after(src, gen, time.monotonic())
                    n = nbytes = 0
                    if t.generation != gen:
                        return "abandoned"
                    if self._full():
                        # Drop the rest of this answer with its socket (closed by the next
                        # request's fresh DEALER) and ask again from E once there is room.
                        t.on_pause()
                        self._after(src, gen)
                        return "abandoned"
                    await anyio.lowlevel.checkpoint()
            self._after(src, gen, time.monotonic())
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
