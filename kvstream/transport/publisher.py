"""The KV event publisher: vLLM's wire protocol (PUB + replay ROUTER), asyncio-native.

::

    async with Publisher(KVEventsConfig(endpoint="tcp://*:5557",
                                        replay_endpoint="tcp://*:5558")) as pub:
        pub.publish(KVEventBatch(ts=time.time(), events=[...]))   # sync, never blocks

Wire (identical to vLLM's ``ZmqEventPublisher``):

* live: ``[topic, seq (8 bytes big-endian), payload]`` on PUB; seq starts at 0 and grows
  by one per batch; empty batches are not published.
* replay: the ROUTER receives ``[identity, b"", start (8 bytes)]`` and sends every buffered
  batch with seq >= start, then the end marker (seq ``ff``*8, empty payload); replies have
  the topic frame (vLLM >= 0.26) or not (0.11), per ``replay_topic_frame``.
* kvstream extension: a request whose start frame is ``b"SNAPSHOT"`` gets the pool's whole
  current state (``snapshot_provider()``) as batches tagged with seq R, the seq of the next
  batch to be published, then the end marker. Without a provider the reply is the end
  marker alone, which is also what vLLM answers (it reads ``b"SNAPSHOT"`` as a huge start).

Concurrency: :meth:`Publisher.publish` assigns the seq, encodes, stores the batch in the
replay buffer and appends the frames to a bounded deque; a sender task drains it to the
PUB socket with non-blocking low-level sends. A replay task waits for the ROUTER's FD to
become readable (ZMQ FDs are edge-triggered: it drains while ``EVENTS & POLLIN``) and
serves replays in chunks of ``replay_chunk`` messages, yielding to the sender between
chunks, so a replay never holds up live publishing for long. Every task belongs to the
task group owned by ``async with``; leaving it sends what is queued, then closes.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

import anyio
import anyio.lowlevel
import zmq

from kvstream.errors import LocalProtocolError
from kvstream.wire.events import AllBlocksCleared, AnyEvent, EventEncoder, KVEventBatch
from kvstream.wire.framing import END_SEQ, END_SEQ_BYTES, FrameError, encode_seq, parse_replay_request
from kvstream.transport._ratelog import RateLimitedLog
from kvstream.transport.config import KVEventsConfig, check_rank_endpoints, should_bind

if TYPE_CHECKING:
    from kvstream.transport.curve import ZapHandler

__all__ = ["Publisher", "PublisherStats", "QueueFullError", "PublisherClosedError"]

log = logging.getLogger(__name__)

SnapshotProvider = Callable[[], "Sequence[AnyEvent]"]


class QueueFullError(LocalProtocolError, RuntimeError):
    """``publish`` found ``max_queue_size`` batches waiting (policy ``queue_full="raise"``);
    the batch was not published. Publish less often, batch more events per step, or raise
    ``max_queue_size``."""


class PublisherClosedError(LocalProtocolError, RuntimeError):
    """``publish`` was called outside ``async with Publisher(...)``."""


class PublisherStats:
    """Counters of one publisher (all monotonic)."""

    __slots__ = ("published", "events", "sent", "live_dropped", "queue_full_errors",
                 "replay_requests", "replay_batches_sent", "replay_rejected", "replay_aborted",
                 "malformed_requests", "snapshot_requests", "snapshot_batches_sent",
                 "snapshot_errors", "tap_errors")

    def __init__(self) -> None:
        self.published = 0
        """Batches given a seq."""
        self.events = 0
        """Events in published batches."""
        self.sent = 0
        """Batches handed to the PUB socket (ZMQ may still drop them past ``hwm``)."""
        self.live_dropped = 0
        """Batches not sent live because the queue was full (still in the replay buffer)."""
        self.queue_full_errors = 0
        """``publish`` calls refused with :class:`QueueFullError`."""
        self.replay_requests = 0
        """Well-formed replay requests received."""
        self.replay_batches_sent = 0
        """Batches sent as replay replies."""
        self.replay_rejected = 0
        """Requests ignored because ``max_replay_jobs`` replays were already running."""
        self.replay_aborted = 0
        """Replays abandoned because the requester disconnected."""
        self.malformed_requests = 0
        """Requests on the ROUTER that were not ``[identity, b"", 8-byte start]``."""
        self.snapshot_requests = 0
        """Snapshot requests received."""
        self.snapshot_batches_sent = 0
        """Batches sent as snapshot replies."""
        self.snapshot_errors = 0
        """Snapshot requests answered with the end marker alone because the provider failed."""
        self.tap_errors = 0
        """Exceptions raised by the ``tap`` callback (logged, never raised to the caller)."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return {k: getattr(self, k) for k in self.__slots__}


class _ReplayJob:
    __slots__ = ("ident", "frames", "pos", "snapshot")

    def __init__(self, ident: bytes, frames: list[tuple[bytes, bytes]], snapshot: bool) -> None:
        self.ident = ident
        self.frames = frames  # (seq frame, payload); the end marker follows them
        self.pos = 0
        self.snapshot = snapshot


class Publisher:
    """Publishes :class:`KVEventBatch` es over ZMQ like vLLM's ``ZmqEventPublisher``.

    ``config``: a :class:`KVEventsConfig` (vLLM names and defaults). ``data_parallel_rank``
    offsets the endpoints (vLLM's rule) and is stamped into batches whose rank is None.
    ``snapshot_provider``: returns the events that rebuild the pool's current state
    (``AllBlocksCleared`` then ``BlockStored`` runs); it is called on the event loop, so
    it sees the state after exactly the batches published so far. ``context``: the ZMQ
    context (default: the process-wide one; a CURVE allow-list gets its own).
    ``tap``: called as ``tap(seq, topic, payload)`` for every batch given a seq (for
    example :meth:`kvstream.eventlog.LogWriter.tap`, so an engine logs its own stream); an
    exception from it is logged and counted in ``stats.tap_errors``, never raised into
    the engine loop. ``bind``: None (default) binds or connects the PUB endpoint by vLLM's
    rule (engine-side publishers); True always binds it (a server, such as ``kvstream
    replay``, that serves exactly the address it is given).
    """

    def __init__(
        self,
        config: KVEventsConfig | None = None,
        *,
        data_parallel_rank: int = 0,
        snapshot_provider: SnapshotProvider | None = None,
        context: zmq.Context | None = None,
        tap: Callable[[int, bytes, bytes], None] | None = None,
        bind: bool | None = None,
    ) -> None:
        self._bind = bind
        self.config = cfg = config if config is not None else KVEventsConfig()
        self.data_parallel_rank = data_parallel_rank
        self._pub_ep, self._replay_ep = check_rank_endpoints(cfg, data_parallel_rank)
        self._snapshot_provider = snapshot_provider
        self._tap = tap
        self._ctx_given = context
        self._ctx: zmq.Context | None = None
        self._own_ctx = False
        self._encoder = EventEncoder(cfg.encoding)
        self._topic = cfg.topic.encode("utf-8")
        self._seq = itertools.count()
        self._next_seq = 0
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._max_queue = cfg.max_queue_size
        self._raise_when_full = cfg.queue_full == "raise"
        self._wake: anyio.Event | None = None
        self._open = False
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._zap: ZapHandler | None = None
        self._denied_at_close = 0
        self._stack: contextlib.AsyncExitStack | None = None
        self._jobs: deque[_ReplayJob] = deque()
        self._rlog = RateLimitedLog(log)
        self.stats = PublisherStats()
        """Counters (:class:`PublisherStats`)."""
        self.endpoint: str = self._pub_ep
        """The PUB endpoint in use (the bound address once open, e.g. the real port of ``:*``)."""
        self.replay_endpoint: str | None = self._replay_ep
        """The replay ROUTER endpoint in use (bound address once open), or None."""

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> "Publisher":
        cfg = self.config
        curve = cfg.curve
        if curve is not None and curve.allowed_clients is not None and self._ctx_given is None:
            # libzmq allows one ZAP handler per context.
            self._ctx, self._own_ctx = zmq.Context(), True
        else:
            self._ctx = self._ctx_given or zmq.Context.instance()
        try:
            self._open_sockets()
        except BaseException:
            self._close_sockets(0)
            raise
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            tg = await stack.enter_async_context(anyio.create_task_group())
            tg.start_soon(self._sender)
            if self._router is not None:
                tg.start_soon(self._replay_loop)
            if self._zap is not None:
                tg.start_soon(self._zap.run)
        except BaseException:
            await stack.aclose()
            self._close_sockets(0)
            raise
        self._stack, self._tg = stack, tg
        self._open = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._open = False
        assert self._stack is not None
        self._tg.cancel_scope.cancel()
        try:
            await self._stack.__aexit__(None, None, None)
        finally:
            self._flush()  # graceful: what was published gets sent
            self._close_sockets(int(self.config.linger_s * 1000))
            if self._own_ctx and self._ctx is not None:
                ctx, self._ctx = self._ctx, None
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(ctx.term)

    def _open_sockets(self) -> None:
        cfg, ctx = self.config, self._ctx
        assert ctx is not None
        curve = cfg.curve
        if curve is not None:
            from kvstream.transport import curve as _curve

            if curve.allowed_clients is not None:
                self._zap = _curve.ZapHandler(ctx, curve.allowed_clients)
                self._zap.start()
        pub = self._pub = ctx.socket(zmq.PUB)
        pub.sndhwm = cfg.hwm
        pub.linger = int(cfg.linger_s * 1000)
        if curve is not None:
            _curve.apply_server(pub, curve)
        if self._bind or (self._bind is None and should_bind(self._pub_ep)):
            pub.bind(self._pub_ep)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            pub.connect(self._pub_ep)
        if self._replay_ep is not None:
            r = self._router = ctx.socket(zmq.ROUTER)
            # A whole replay plus its end marker must fit; ROUTER_MANDATORY turns "peer pipe
            # full" into EAGAIN (we retry later) instead of a silent drop.
            r.sndhwm = 2 * (cfg.buffer_steps + 1) + 1024
            r.router_mandatory = 1
            r.linger = int(cfg.linger_s * 1000)
            if curve is not None:
                _curve.apply_server(r, curve)
            r.bind(self._replay_ep)
            self.replay_endpoint = r.getsockopt_string(zmq.LAST_ENDPOINT)

    def _close_sockets(self, linger_ms: int) -> None:
        for s in (self._pub, self._router):
            if s is not None and not s.closed:
                s.close(linger=linger_ms)
        if self._zap is not None:
            self._denied_at_close = self._zap.denied
            self._zap.close()
            self._zap = None

    # -- publishing --------------------------------------------------------------------

    @property
    def snapshot_provider(self) -> SnapshotProvider | None:
        """Returns the events that rebuild the current state for a snapshot request (None:
        snapshots unsupported, answered with the end marker alone, as vLLM does). Settable
        while open, e.g. ``pub.snapshot_provider = shell.snapshot_events`` once the engine's
        :class:`~kvstream.allocator.shell.AsyncKVCacheManager` exists."""
        return self._snapshot_provider

    @snapshot_provider.setter
    def snapshot_provider(self, provider: SnapshotProvider | None) -> None:
        if provider is not None and not callable(provider):
            raise TypeError(f"snapshot_provider must be callable or None, got {type(provider).__name__}")
        self._snapshot_provider = provider

    @property
    def next_seq(self) -> int:
        """The seq the next published batch will get."""
        return self._next_seq

    @property
    def auth_denied(self) -> int:
        """Subscribers refused by the CURVE allow-list so far (0 without one)."""
        return self._zap.denied if self._zap is not None else self._denied_at_close

    @property
    def queued(self) -> int:
        """Batches waiting to be sent live."""
        return len(self._queue)

    def publish(self, batch: KVEventBatch) -> int | None:
        """Publish one batch; returns its seq, or None if it had no events (not published).

        Non-blocking and synchronous: call it from the engine loop. Stamps
        ``data_parallel_rank`` if it is None (like vLLM), assigns the seq, encodes, keeps the
        batch for replay and queues it. When ``max_queue_size`` batches are already waiting,
        applies ``config.queue_full`` (see :class:`KVEventsConfig`).
        """
        if not self._open:
            raise PublisherClosedError("publish() needs an open publisher: use `async with Publisher(...) as pub:`")
        if not batch.events:
            return None
        full = self._queue_full()
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        payload = self._encoder.encode(batch)
        seq = next(self._seq)
        self._enqueue(seq, payload, len(batch.events), full)
        return seq

    def publish_raw(self, payload: bytes, seq: int, *, topic: bytes | None = None) -> None:
        """Publish an already-encoded payload under a given ``seq`` (re-publishing a log).

        The bytes go out as they are and into the replay buffer. A ``seq`` at or below
        the last one published means a new engine incarnation (as after a restart): the
        replay buffer is cleared. A ``seq`` above the next one skips ahead (the batches in
        between were never seen): the replay buffer is cleared too, since replay can only
        serve a contiguous range. ``topic`` must be the configured topic (None: it is).
        """
        if not self._open:
            raise PublisherClosedError("publish_raw() needs an open publisher: use `async with Publisher(...) as pub:`")
        if topic is not None and topic != self._topic:
            raise ValueError(
                f"topic {topic!r} differs from this publisher's {self._topic!r}: create one Publisher "
                "per topic (KVEventsConfig(topic=...))"
            )
        if not 0 <= seq < END_SEQ:
            raise ValueError(f"seq must be in [0, 2**64 - 1), got {seq}")
        full = self._queue_full()
        if seq != self._next_seq:
            self._buffer.clear()
            self._seq = itertools.count(seq + 1)
        else:
            next(self._seq)
        self._enqueue(seq, payload, 0, full)

    def send_verbatim(self, payload: bytes, seq: int, topic: bytes) -> None:
        """Send one live message exactly as given, outside the seq and replay machinery:
        any topic and any 64-bit ``seq`` (re-publishing a recording whose messages this
        publisher could not have produced itself: a second topic, seq ``2**64 - 1``). Not
        kept for replay. Only while nothing is queued (else :class:`QueueFullError`; wait
        until :attr:`queued` is 0), so messages keep their order."""
        if not self._open or self._pub is None:
            raise PublisherClosedError("send_verbatim() needs an open publisher: use `async with Publisher(...) as pub:`")
        if self._queue:
            raise QueueFullError(f"{len(self._queue)} batches are still queued; send_verbatim() keeps order, "
                                 "so wait until `queued` is 0")
        if not 0 <= seq <= END_SEQ:
            raise ValueError(f"seq must fit 64 bits unsigned, got {seq}")
        more = zmq.SNDMORE | zmq.NOBLOCK
        self._pub.send(bytes(topic), more)
        self._pub.send(encode_seq(seq), more)
        self._pub.send(payload, zmq.NOBLOCK)
        self.stats.sent += 1

    def _queue_full(self) -> bool:
        """Whether the send queue is full; raises under the ``"raise"`` policy."""
        q = self._queue
        full = len(q) >= self._max_queue
        if full and self._raise_when_full:
            self.stats.queue_full_errors += 1
            raise QueueFullError(
                f"{len(q)} batches are waiting to be sent (max_queue_size={self._max_queue}); "
                "the batch was not published. Raise max_queue_size or use queue_full='replay_only'."
            )
        return full

    def _enqueue(self, seq: int, payload: bytes, n_events: int, full: bool) -> None:
        q = self._queue
        self._next_seq = seq + 1
        seqb = encode_seq(seq)
        self._buffer.append((seqb, payload))
        st = self.stats
        st.published += 1
        st.events += n_events
        tap = self._tap
        if tap is not None:
            try:
                tap(seq, self._topic, payload)
            except Exception:  # noqa: BLE001 - a broken tap must not break publishing
                st.tap_errors += 1
                self._rlog.warning("tap", "publisher tap failed for seq %d", seq, exc_info=True)
        if full:
            st.live_dropped += 1
            self._rlog.warning("queue_full", "publisher queue full (%d batches): seq %d goes to the "
                               "replay buffer only", len(q), seq)
            return
        q.append((seqb, payload))
        w = self._wake
        if w is not None:
            self._wake = None
            w.set()

    def _flush(self, limit: int | None = None) -> None:
        """Send up to ``limit`` queued batches (all if None) with non-blocking frame sends."""
        pub, q, topic = self._pub, self._queue, self._topic
        if pub is None or pub.closed:
            return
        send, more, nb = pub.send, zmq.SNDMORE | zmq.NOBLOCK, zmq.NOBLOCK
        n = len(q) if limit is None else min(limit, len(q))
        popleft = q.popleft
        for _ in range(n):
            seqb, payload = popleft()
            # PUB never blocks: past the HWM, ZMQ drops for the slow subscriber itself.
            send(topic, more)
            send(seqb, more)
            send(payload, nb, copy=len(payload) < 65536)
        self.stats.sent += n

    async def _sender(self) -> None:
        q = self._queue
        while True:
            if q:
                # Bounded bursts: the replay task and the engine get the loop in between.
                self._flush(1024)
                await anyio.lowlevel.checkpoint()
                continue
            ev = self._wake = anyio.Event()
            await ev.wait()

    # -- replay ------------------------------------------------------------------------

    async def _replay_loop(self) -> None:
        sock = self._router
        assert sock is not None
        jobs = self._jobs
        while True:
            # getsockopt is typed int | bytes; EVENTS is an int option.
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type, operator]
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_request(frames)
            if not jobs:
                await anyio.wait_readable(sock.FD)
                continue
            progressed = self._serve_round()
            if progressed:
                await anyio.lowlevel.checkpoint()
            else:
                # Every requester's pipe is full: give them time to read.
                with anyio.move_on_after(0.002):
                    await anyio.wait_readable(sock.FD)

    def _on_request(self, frames: list[bytes]) -> None:
        st = self.stats
        try:
            ident, start = parse_replay_request(frames)
        except FrameError as exc:
            st.malformed_requests += 1
            self._rlog.warning("malformed", "ignoring malformed replay request (%d frames): %s", len(frames), exc)
            return
        if len(self._jobs) >= self.config.max_replay_jobs:
            st.replay_rejected += 1
            self._rlog.warning("rejected", "ignoring replay request: %d replays already running "
                               "(max_replay_jobs)", len(self._jobs))
            return
        if start is None:
            st.snapshot_requests += 1
            self._jobs.append(_ReplayJob(ident, self._snapshot_frames(), True))
            return
        st.replay_requests += 1
        buf = self._buffer
        first = self._next_seq - len(buf)
        skip = max(0, start - first)
        frames_out = list(itertools.islice(buf, skip, None)) if skip < len(buf) else []
        self._jobs.append(_ReplayJob(ident, frames_out, False))

    def _snapshot_frames(self) -> list[tuple[bytes, bytes]]:
        provider = self._snapshot_provider
        if provider is None:
            return []
        try:
            events = list(provider())
        except Exception:  # noqa: BLE001 - a provider bug must not end the publisher
            self.stats.snapshot_errors += 1
            log.exception("snapshot provider failed; answering the snapshot request with the end marker only")
            return []
        # Read R after the provider ran: a provider that flushes pending events publishes
        # them first, and the snapshot then includes them.
        tag = encode_seq(self._next_seq)
        if not events or not isinstance(events[0], AllBlocksCleared):
            events.insert(0, AllBlocksCleared())
        n = self.config.snapshot_batch_events
        ts = time.time()
        rank = self.data_parallel_rank
        enc = self._encoder.encode
        out = []
        for i in range(0, len(events), n):
            out.append((tag, enc(KVEventBatch(ts, events[i:i + n], rank))))
        return out

    def _serve_round(self) -> bool:
        """Send up to ``replay_chunk`` messages of each running job; True if any progress."""
        sock = self._router
        assert sock is not None
        jobs, chunk, topic = self._jobs, self.config.replay_chunk, self._topic
        with_topic = self.config.replay_topic_frame
        more = zmq.SNDMORE | zmq.NOBLOCK
        st = self.stats
        send = sock.send
        progressed = False
        for _ in range(len(jobs)):
            job = jobs.popleft()
            frames, ident = job.frames, job.ident
            n = len(frames)
            budget = chunk
            try:
                while budget and job.pos <= n:
                    if job.pos < n:
                        seqb, payload = frames[job.pos]
                        t = topic
                    else:
                        seqb, payload, t = END_SEQ_BYTES, b"", b""
                    # With ROUTER_MANDATORY a full pipe raises EAGAIN on the identity frame,
                    # before anything of the message is queued.
                    send(ident, more)
                    send(b"", more)
                    if with_topic:
                        send(t, more)
                    send(seqb, more)
                    send(payload, zmq.NOBLOCK)
                    if job.pos < n:
                        if job.snapshot:
                            st.snapshot_batches_sent += 1
                        else:
                            st.replay_batches_sent += 1
                    job.pos += 1
                    budget -= 1
                    progressed = True
            except zmq.Again:
                pass  # the requester's pipe is full; resume this job next round
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                st.replay_aborted += 1  # the requester is gone
                continue
            if job.pos <= n:
                jobs.append(job)
        return progressed
