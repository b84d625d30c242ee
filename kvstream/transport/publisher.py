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
PUB socket with non-blocking low-level sends. The replay server (:mod:`._replay`) answers
the ROUTER in turns of at most ``replay_slice_s`` seconds and bounds what requesters can
make it hold (jobs, bytes, time; nobody needs credentials to reach a replay port), so
neither replays nor floods of requests hold up the engine loop or live publishing for long.
Every task belongs to the task group owned by ``async with``; leaving it sends what is
queued, then closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import logging
from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

import anyio
import anyio.lowlevel
import zmq

from kvstream.errors import LocalProtocolError
from kvstream.wire.events import AnyEvent, EventEncoder, KVEventBatch
from kvstream.wire.framing import END_SEQ
from kvstream.transport._ratelog import RateLimitedLog
from kvstream.transport._replay import ReplayServer
from kvstream.transport.config import KVEventsConfig, check_rank_endpoints, should_bind

if TYPE_CHECKING:
    from kvstream.transport.curve import ZapHandler

__all__ = ["Publisher", "PublisherStats", "QueueFullError", "PublisherClosedError"]

log = logging.getLogger(__name__)

SnapshotProvider = Callable[[], "Sequence[AnyEvent]"]

_MAX_SUBSCRIPTION_BYTES = 4096
"""Longest subscription message accepted from a SUB (a topic prefix plus one byte)."""

_NO_PEER_WARN_S = 5.0
"""A connecting PUB that has reached no subscriber after this many seconds is warned about
(one log line): what it publishes until one connects reaches nobody live."""

_SUBSCRIPTION_POLL_S = 0.1
"""Sends on the XPUB can consume the wake-up of its edge-triggered FD: look this often."""

# Plain ints: pyzmq's flags are enum.Flag members, and OR-ing two of them costs about 2 us.
_MORE = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_NB = int(zmq.NOBLOCK)
_pack_seq = struct.Struct(">Q").pack  # the seq frame (kvstream.wire.framing.encode_seq, inlined)
_socket_send = zmq.backend.Socket.send  # pyzmq's send without the sugar layer's extra checks


def _asyncio_call_soon() -> Callable[..., asyncio.Handle] | None:
    """The running asyncio loop's ``call_soon`` (None on other event loops)."""
    try:
        return asyncio.get_running_loop().call_soon
    except RuntimeError:
        return None


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
                 "replay_evicted", "replay_stalled", "replay_recycles", "malformed_requests", "snapshot_requests",
                 "snapshot_batches_sent", "snapshot_provider_calls", "snapshot_errors", "tap_errors",
                 "subscriptions", "unsubscriptions")

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
        """Requests ignored because ``max_pending_replays`` requests were already waiting, or
        the requester already had 4 requests running or waiting."""
        self.replay_aborted = 0
        """Replays abandoned because the requester disconnected."""
        self.replay_evicted = 0
        """Waiting requests dropped (unanswered) to make room for another requester's first
        request when ``max_pending_replays`` were waiting; counted in ``replay_requests`` or
        ``snapshot_requests`` too."""
        self.replay_stalled = 0
        """Replays dropped because the requester read nothing for ``replay_client_timeout_s``."""
        self.replay_recycles = 0
        """Times the replay socket was closed and bound again because requesters that do not
        read held more than half of ``replay_max_bytes``."""
        self.malformed_requests = 0
        """Requests on the ROUTER that were not ``[identity, b"", 8-byte start]``."""
        self.snapshot_requests = 0
        """Snapshot requests received."""
        self.snapshot_batches_sent = 0
        """Batches sent as snapshot replies."""
        self.snapshot_provider_calls = 0
        """Times the snapshot provider was called (concurrent requests share one state)."""
        self.snapshot_errors = 0
        """Snapshot requests answered with the end marker alone because the provider failed."""
        self.tap_errors = 0
        """Exceptions raised by the ``tap`` callback (logged, never raised to the caller)."""
        self.subscriptions = 0
        """Subscribe messages received from SUB sockets (one per topic prefix per subscriber
        that joined; a reconnecting subscriber subscribes again)."""
        self.unsubscriptions = 0
        """Unsubscribe messages received (a prefix that no subscriber holds any more)."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return {k: getattr(self, k) for k in self.__slots__}


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
        self._encode = self._encoder.encode
        self._next_seq = 0
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._max_queue = cfg.max_queue_size
        self._raise_when_full = cfg.queue_full == "raise"
        self._wake: anyio.Event | None = None
        self._kicked = False  # a flush is arranged for this loop turn
        self._subscribed: anyio.Event | None = None
        self._call_soon: Callable[..., asyncio.Handle] | None = None
        self._tick_handle: asyncio.Handle | None = None
        self._open = False
        self._pub: zmq.Socket | None = None
        self._zap: ZapHandler | None = None
        self._denied_at_close = 0
        self._stack: contextlib.AsyncExitStack | None = None
        self._epoch = 0  # bumped when the replay buffer restarts (publish_raw)
        self._replay: ReplayServer | None = None
        self._log = log
        self._rlog = RateLimitedLog(log)
        self.stats = PublisherStats()
        """Counters (:class:`PublisherStats`)."""
        self.endpoint: str = self._pub_ep
        """The PUB endpoint in use (the bound address once open, e.g. the real port of ``:*``)."""
        self.binds: bool = bool(bind) or (bind is None and should_bind(self._pub_ep))
        """True if the PUB socket binds :attr:`endpoint` (subscribers connect to it), False
        if it connects to it (vLLM's rule for an endpoint without ``*``: a subscriber must
        bind there, e.g. ``SourceSpec(bind=True)``)."""
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
        self._call_soon = _asyncio_call_soon()
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            tg = await stack.enter_async_context(anyio.create_task_group())
            if self._call_soon is None:
                tg.start_soon(self._sender)
            if self._replay is not None:
                tg.start_soon(self._replay.run)
            if self._zap is not None:
                tg.start_soon(self._zap.run)
            tg.start_soon(self._watch_subscriptions)
            if not self.binds:
                tg.start_soon(self._warn_if_nobody_reached)
        except BaseException:
            await stack.aclose()
            self._close_sockets(0)
            raise
        self._stack, self._tg = stack, tg
        self._open = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._open = False
        if self._subscribed is not None:
            self._subscribed.set()  # waiters see the publisher closed
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
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
        # An XPUB is a PUB on the wire (same frames to every SUB) that also hands us the
        # subscriptions, so readiness ("a subscriber has joined") is observable.
        pub = self._pub = ctx.socket(zmq.XPUB)
        pub.xpub_verbose = 1  # every subscribe, not only a topic's first
        pub.maxmsgsize = _MAX_SUBSCRIPTION_BYTES
        pub.sndhwm = cfg.hwm
        pub.linger = int(cfg.linger_s * 1000)
        if curve is not None:
            _curve.apply_server(pub, curve)
        if self.binds:
            pub.bind(self._pub_ep)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            pub.connect(self._pub_ep)
        if self._replay_ep is not None:
            self._replay = ReplayServer(self, self._make_router)
            self.replay_endpoint = self._replay.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _make_router(self) -> zmq.Socket:
        """A new replay ROUTER bound to the replay endpoint (the resolved one once bound, so
        a recycled socket keeps its port)."""
        cfg, ctx = self.config, self._ctx
        assert ctx is not None
        r = ctx.socket(zmq.ROUTER)
        try:
            # ROUTER_MANDATORY turns "peer pipe full" into EAGAIN (retried later) instead of
            # a silent drop; the replay server bounds what each peer may hold in bytes.
            r.sndhwm = cfg.replay_hwm
            r.router_mandatory = 1
            r.linger = int(cfg.linger_s * 1000)
            r.copy_threshold = 0  # copy=False really is zero-copy: trackers see every reply
            if cfg.curve is not None:
                from kvstream.transport import curve as _curve

                _curve.apply_server(r, cfg.curve)
            ep = self.replay_endpoint if self._replay is not None else self._replay_ep
            assert ep is not None
            r.bind(ep)
        except BaseException:
            r.close(0)
            raise
        return r

    def _close_sockets(self, linger_ms: int) -> None:
        if self._pub is not None and not self._pub.closed:
            self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger_ms)
        if self._zap is not None:
            self._denied_at_close = self._zap.denied
            self._zap.close()
            self._zap = None

    # -- subscribers -------------------------------------------------------------------

    async def wait_subscribed(self, count: int = 1) -> None:
        """Wait until ``stats.subscriptions`` reaches ``count``: a SUB that connected has told
        this publisher its topic filter, so everything published from now on reaches it
        (ZMQ's "slow joiner" is over). Wrap it in ``anyio.fail_after`` for a deadline."""
        while self.stats.subscriptions < count:
            if not self._open:
                raise PublisherClosedError("wait_subscribed() needs an open publisher")
            ev = self._subscribed = self._subscribed or anyio.Event()
            await ev.wait()

    async def _warn_if_nobody_reached(self) -> None:
        """One warning if a connecting PUB has reached no subscriber in _NO_PEER_WARN_S."""
        with anyio.move_on_after(_NO_PEER_WARN_S):
            await anyio.lowlevel.checkpoint()
            try:
                await self.wait_subscribed(1)
            except PublisherClosedError:
                pass
            return
        self._log.warning(
            "the KV event PUB socket connects to %s (an endpoint without '*' is connected to, "
            "vLLM's rule) and has reached no subscriber in %.0f s: batches published until one "
            "binds there reach nobody live (replay still has them). To let subscribers connect, "
            "bind instead: write the endpoint as tcp://*:PORT",
            self.endpoint, _NO_PEER_WARN_S)

    async def _watch_subscriptions(self) -> None:
        pub = self._pub
        assert pub is not None
        st = self.stats
        while True:
            got = False
            for _ in range(256):  # bounded per turn: a subscription flood cannot hold the loop
                try:
                    msg = pub.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = True
                if msg[:1] == b"\x01":
                    st.subscriptions += 1
                elif msg[:1] == b"\x00":
                    st.unsubscriptions += 1
            if got:
                ev, self._subscribed = self._subscribed, None
                if ev is not None:
                    ev.set()
                await anyio.lowlevel.checkpoint()
                continue
            with anyio.move_on_after(_SUBSCRIPTION_POLL_S):
                await anyio.wait_readable(pub.FD)

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
    def replay_inflight_bytes(self) -> int:
        """Replay reply bytes handed to ZMQ that requesters have not yet read (bounded by
        ``replay_max_bytes`` plus one message per running replay; 0 without replay)."""
        return self._replay.inflight_bytes if self._replay is not None else 0

    @property
    def replay_jobs(self) -> tuple[int, int]:
        """``(running, waiting)`` replay/snapshot requests."""
        r = self._replay
        return (r.jobs, r.pending) if r is not None else (0, 0)

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
        # The hot path of the engine loop: everything inline, no per-call allocation beyond
        # the payload, the seq frame and the tuple that holds both.
        if not self._open:
            raise PublisherClosedError("publish() needs an open publisher: use `async with Publisher(...) as pub:`")
        events = batch.events
        if not events:
            return None
        q = self._queue
        full = len(q) >= self._max_queue
        if full and self._raise_when_full:
            self._refuse_full()
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        payload = self._encode(batch)
        seq = self._next_seq
        self._next_seq = seq + 1
        item = (_pack_seq(seq), payload)
        self._buffer.append(item)
        st = self.stats
        st.published += 1
        st.events += len(events)
        if self._tap is not None:
            self._call_tap(seq, payload)
        if full:
            self._drop_live(seq)
        else:
            q.append(item)
            if not self._kicked:
                self._kick()
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
        q = self._queue
        full = len(q) >= self._max_queue
        if full and self._raise_when_full:
            self._refuse_full()
        if seq != self._next_seq:
            self._buffer.clear()
            self._epoch += 1  # running replays end here; their requesters see the new seqs
        self._next_seq = seq + 1
        item = (_pack_seq(seq), payload)
        self._buffer.append(item)
        self.stats.published += 1
        if self._tap is not None:
            self._call_tap(seq, payload)
        if full:
            self._drop_live(seq)
        else:
            q.append(item)
            if not self._kicked:
                self._kick()

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
        self._pub.send(_pack_seq(seq), more)
        self._pub.send(payload, zmq.NOBLOCK)
        self.stats.sent += 1

    def _refuse_full(self) -> None:
        q = self._queue
        self.stats.queue_full_errors += 1
        raise QueueFullError(
            f"{len(q)} batches are waiting to be sent (max_queue_size={self._max_queue}); "
            "the batch was not published. Raise max_queue_size or use queue_full='replay_only'."
        )

    def _call_tap(self, seq: int, payload: bytes) -> None:
        assert self._tap is not None
        try:
            self._tap(seq, self._topic, payload)
        except Exception:  # noqa: BLE001 - a broken tap must not break publishing
            self.stats.tap_errors += 1
            self._rlog.warning("tap", "publisher tap failed for seq %d", seq, exc_info=True)

    def _drop_live(self, seq: int) -> None:
        self.stats.live_dropped += 1
        self._rlog.warning("queue_full", "publisher queue full (%d batches): seq %d goes to the "
                           "replay buffer only", len(self._queue), seq)

    def _kick(self) -> None:
        """Arrange for the queue to be sent once the engine's current callback returns:
        every batch published in one loop turn goes out in one flush."""
        self._kicked = True
        call_soon = self._call_soon
        if call_soon is not None:
            self._tick_handle = call_soon(self._on_tick)
        elif self._wake is not None:
            self._wake.set()

    def _on_tick(self) -> None:
        # A loop callback owned by the publisher (its handle is cancelled on exit); sends
        # are non-blocking, so it cannot wait or fail on a slow subscriber.
        self._kicked = False
        self._tick_handle = None
        self._flush(1024)
        if self._queue and self._open:
            self._kick()  # bounded bursts: other callbacks run in between

    def _flush(self, limit: int | None = None) -> None:
        """Send up to ``limit`` queued batches (all if None) with non-blocking frame sends."""
        pub, q, topic = self._pub, self._queue, self._topic
        if pub is None or pub.closed:
            return
        send, more, nb = _socket_send, _MORE, _NB
        n = len(q) if limit is None else min(limit, len(q))
        popleft = q.popleft
        for _ in range(n):
            seqb, payload = popleft()
            # PUB never blocks: past the HWM, ZMQ drops for the slow subscriber itself.
            # Payloads are copied into ZMQ (cheaper than zero-copy below 64 KiB, pyzmq's
            # own threshold); large ones go zero-copy.
            send(pub, topic, more)
            send(pub, seqb, more)
            if len(payload) < 65536:
                send(pub, payload, nb)
            else:
                send(pub, payload, nb, copy=False)
        self.stats.sent += n

    async def _sender(self) -> None:
        """The sender on event loops other than asyncio's (no ``call_soon``): woken by
        :meth:`_kick` through an event."""
        q = self._queue
        while True:
            self._wake = anyio.Event()
            if not q:
                await self._wake.wait()
            self._kicked = False
            self._flush(1024)
            await anyio.lowlevel.checkpoint()
