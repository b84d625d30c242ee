"""The publisher's replay server: answers replay and snapshot requests on the ROUTER socket
without stalling the engine loop or letting requesters pin unbounded memory.

Nobody needs to authenticate to reach a replay port, so every resource a requester can make
the publisher spend is bounded:

* **Loop time.** The server works in turns of at most ``replay_slice_s`` seconds (taking
  requests, starting jobs, sending replies), then yields to the event loop, so an engine
  loop sharing it is never held up for longer than about one turn, whatever arrives.
* **Jobs.** At most ``max_replay_jobs`` requests are served at once, one per requester
  (ZMQ routing identity, i.e. per connection); a job keeps its slot until its requester
  has read the whole reply. Further requests wait in a FIFO of at most
  ``max_pending_replays`` (at most :data:`PER_CLIENT_QUEUE` per requester, served in
  order, as vLLM serves them; requesters' first requests go before anyone's next ones);
  beyond that they are ignored and counted, except that a requester's first request takes
  the place of the newest of another requester's next ones (``stats.replay_evicted``).
* **Bytes.** Replies are accounted in bytes from the moment they are handed to ZMQ until
  ZMQ has written them to the kernel: every so often a reply is sent zero-copy with a
  :class:`zmq.MessageTracker`, and since one peer's messages leave in order, a finished
  tracker releases everything sent before it. A requester may have at most
  ``replay_client_max_bytes`` unreleased, all requesters together at most
  ``replay_max_bytes``, each plus at most one reply per running job (the one a job sends,
  tracked, before it waits, so that it learns when its requester has read).
* **Requesters that don't read.** A job that cannot send anything for
  ``replay_client_timeout_s`` (a tenth of it while more than 90% of ``replay_max_bytes`` are
  held) is dropped (``stats.replay_stalled``). Its bytes stay counted until ZMQ releases
  them (the peer reads or disconnects); if dropped requesters hold more than half of
  ``replay_max_bytes`` (or are more than 4,096), the ROUTER socket is closed and bound again
  (``stats.replay_recycles``), which frees every queue at once; honest requesters whose
  reply was cut time out and ask again.
* **Snapshots.** The state a snapshot request gets is computed once and shared: requests
  within ``snapshot_reuse_s`` of the last provider call (while the replay buffer still
  covers its tag) get the same state, batches are encoded lazily as they are sent, and at
  most ``max_snapshot_states`` distinct states are held at once.

The server is driven by :meth:`ReplayServer.run`, a task of the publisher's task group.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import anyio
import anyio.lowlevel
import zmq

from kvstream.wire.events import AllBlocksCleared, AnyEvent, KVEventBatch
from kvstream.wire.framing import END_SEQ_BYTES, FrameError, encode_seq, parse_replay_request

if TYPE_CHECKING:
    from kvstream.transport.publisher import Publisher

__all__ = ["ReplayServer", "PER_CLIENT_QUEUE"]

PER_CLIENT_QUEUE = 4
"""Requests one requester may have running or waiting at once; more are ignored (counted in
``stats.replay_rejected``)."""

_OVERHEAD = 64
"""Bytes counted per reply on top of its frames (ZMQ's per-message bookkeeping)."""

_CKPT_BYTES = 64 * 1024
"""At most this many reply bytes are sent between two tracked replies."""

_MORE = int(zmq.SNDMORE) | int(zmq.NOBLOCK)  # plain ints: OR-ing pyzmq's enum flags costs ~2 us
_NB = int(zmq.NOBLOCK)

_MAX_ZOMBIES = 4096
"""Dropped requesters whose replies ZMQ still holds, at most (then the socket is recycled)."""

_BLOCKED_POLL_S = 0.002
"""How often blocked jobs are looked at again (ZMQ signals no per-peer writability)."""


class _Snapshot:
    """One pool state shared by every snapshot job that asked for it; batches are encoded
    the first time a job needs them."""

    __slots__ = ("tag", "seq", "events", "encoded", "made", "ts", "epoch", "users", "n_batches", "_per", "_enc",
                 "_rank")

    def __init__(self, seq: int, events: list[AnyEvent], per: int, enc: Callable[[Any], bytes],
                 rank: int | None, epoch: int) -> None:
        self.seq = seq
        self.tag = encode_seq(seq)
        self.events = events
        self.encoded: list[bytes] = []
        self.made = time.monotonic()
        self.ts = time.time()
        self.epoch = epoch
        self.users = 0
        self.n_batches = (len(events) + per - 1) // per if events else 0
        self._per, self._enc, self._rank = per, enc, rank

    def batch(self, i: int) -> bytes:
        enc = self.encoded
        while len(enc) <= i:
            k = len(enc) * self._per
            enc.append(self._enc(KVEventBatch(self.ts, self.events[k:k + self._per], self._rank)))
        return enc[i]


class _Job:
    """One request being answered: a replay from seq ``cursor`` or a snapshot."""

    __slots__ = ("ident", "cursor", "snapshot", "pos", "epoch", "done", "sent", "released",
                 "checkpoints", "since_ckpt", "last_progress")

    def __init__(self, ident: bytes, cursor: int, snapshot: _Snapshot | None, epoch: int, now: float) -> None:
        self.ident = ident
        self.cursor = cursor  # next seq to send (replay)
        self.snapshot = snapshot
        self.pos = 0  # next snapshot batch to send
        self.epoch = epoch
        self.done = False  # the end marker was sent
        self.sent = 0  # bytes handed to ZMQ so far
        self.released = 0  # bytes ZMQ is known to have let go of
        self.checkpoints: deque[tuple[zmq.MessageTracker, int]] = deque()
        self.since_ckpt = 0
        self.last_progress = now

    @property
    def inflight(self) -> int:
        return self.sent - self.released

    def poll(self) -> bool:
        """Release the bytes of finished trackers; True if any finished."""
        cps = self.checkpoints
        hit = False
        while cps and cps[0][0].done:
            self.released = cps.popleft()[1]
            hit = True
        if not cps and self.done:
            # Everything sent went out with (or before) the last tracked reply.
            self.released = self.sent
        return hit


class ReplayServer:
    """Serves replay/snapshot requests for one :class:`~kvstream.transport.publisher.Publisher`
    (module docstring). ``make_socket`` creates and binds a fresh ROUTER (used at start and
    when the socket is recycled)."""

    def __init__(self, pub: "Publisher", make_socket: Callable[[], zmq.Socket]) -> None:
        self._pub = pub
        self._make_socket = make_socket
        self.sock: zmq.Socket = make_socket()
        cfg = pub.config
        self._cfg = cfg
        self._jobs: deque[_Job] = deque()
        self._first: deque[tuple[bytes, int | None]] = deque()  # requesters' first requests
        self._more: deque[tuple[bytes, int | None]] = deque()  # their next ones
        self._per_client: dict[bytes, int] = {}  # requests running or waiting, per identity
        self._active: set[bytes] = set()
        self._zombies: list[_Job] = []  # dropped or finished jobs whose bytes ZMQ still holds
        self._snapshots: list[_Snapshot] = []  # alive states, newest last
        # Track a reply at least every _CKPT_BYTES: the finer, the sooner bytes are known
        # to be read (and a reading requester is seen to make progress).
        self._ckpt_bytes = max(1, min(cfg.replay_client_max_bytes // 8, _CKPT_BYTES))

    # -- gauges --------------------------------------------------------------------------

    @property
    def inflight_bytes(self) -> int:
        """Reply bytes handed to ZMQ and not yet released, over all requesters."""
        return sum(j.inflight for j in self._jobs) + sum(j.inflight for j in self._zombies)

    @property
    def jobs(self) -> int:
        """Requests being answered now."""
        return len(self._jobs)

    @property
    def pending(self) -> int:
        """Requests waiting for a free job slot."""
        return len(self._first) + len(self._more)

    def close(self, linger_ms: int) -> None:
        """Close the ROUTER socket."""
        if not self.sock.closed:
            self.sock.close(linger=linger_ms)

    # -- the task ------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until cancelled, in turns of at most ``replay_slice_s`` seconds."""
        slice_s = self._cfg.replay_slice_s
        clock = time.perf_counter
        while True:
            deadline = clock() + slice_s
            more_requests = self._intake(deadline)
            self._start_pending()
            progressed = self._serve(deadline) if self._jobs else False
            recycle = self._reap()
            if recycle:
                await self._recycle()
                continue
            sock = self.sock
            if more_requests or progressed:
                await anyio.lowlevel.checkpoint()
            elif sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type, operator]
                await anyio.lowlevel.checkpoint()
            elif self._jobs or self._zombies or self._first or self._more:
                # Blocked on slow readers: look again soon, or when a request arrives.
                with anyio.move_on_after(_BLOCKED_POLL_S):
                    await anyio.wait_readable(sock.FD)
            else:
                await anyio.wait_readable(sock.FD)

    # -- requests ------------------------------------------------------------------------

    def _intake(self, deadline: float) -> bool:
        """Take requests until none is left or the turn is over; True if some are left."""
        sock, clock = self.sock, time.perf_counter
        n = 0
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type, operator]
            if n and not n & 31 and clock() > deadline:
                return True
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            self._on_request(frames)
        return False

    def _on_request(self, frames: list[bytes]) -> None:
        pub, st = self._pub, self._pub.stats
        try:
            ident, start = parse_replay_request(frames)
        except FrameError as exc:
            st.malformed_requests += 1
            pub._rlog.warning("malformed", "ignoring malformed replay request (%d frames): %s", len(frames), exc)
            return
        queued = self._per_client.get(ident, 0)
        cap = self._cfg.max_pending_replays
        if not queued and self.pending >= cap and self._more:
            # A requester's first request takes the place of another's second to fourth.
            victim = self._more.pop()[0]
            self._release(victim)
            st.replay_evicted += 1
        if queued >= PER_CLIENT_QUEUE or self.pending >= cap:
            st.replay_rejected += 1
            pub._rlog.warning("rejected", "ignoring replay request: %d running, %d waiting, %d from this "
                              "requester (max_replay_jobs, max_pending_replays)", len(self._jobs),
                              self.pending, queued)
            return
        if start is None:
            st.snapshot_requests += 1
        else:
            st.replay_requests += 1
        self._per_client[ident] = queued + 1
        (self._more if queued else self._first).append((ident, start))

    def _release(self, ident: bytes) -> None:
        """One request of ``ident`` is done (answered, dropped or evicted)."""
        n = self._per_client.get(ident, 1) - 1
        if n > 0:
            self._per_client[ident] = n
        else:
            self._per_client.pop(ident, None)

    def _start_pending(self) -> None:
        """Start waiting requests while job slots are free: requesters' first requests
        before anyone's next ones; one requester's requests in the order they came."""
        jobs, active, first = self._jobs, self._active, self._first
        cap = self._cfg.max_replay_jobs
        while first and len(jobs) < cap:
            ident, start = first[0]
            job = self._new_job(ident, start)
            if job is None:
                return  # too many snapshot states alive: wait (and keep the order)
            first.popleft()
            active.add(ident)
            jobs.append(job)
        more = self._more
        if not more or len(jobs) >= cap:
            return
        keep: deque[tuple[bytes, int | None]] = deque()
        while more and len(jobs) < cap:
            ident, start = more.popleft()
            if ident in active:
                keep.append((ident, start))  # served after the running one, in order
                continue
            job = self._new_job(ident, start)
            if job is None:
                keep.append((ident, start))
                break
            active.add(ident)
            jobs.append(job)
        keep.extend(more)
        self._more = keep

    def _new_job(self, ident: bytes, start: int | None) -> _Job | None:
        pub = self._pub
        now = time.monotonic()
        if start is None:
            snap = self._snapshot(now)
            if snap is None:
                return None
            snap.users += 1
            return _Job(ident, 0, snap, pub._epoch, now)
        first = pub._next_seq - len(pub._buffer)
        return _Job(ident, max(start, first), None, pub._epoch, now)

    def _snapshot(self, now: float) -> _Snapshot | None:
        """The state a new snapshot job answers with (shared), or None to wait."""
        pub, cfg = self._pub, self._cfg
        snaps = self._snapshots
        if snaps:
            last = snaps[-1]
            covered = last.epoch == pub._epoch and pub._next_seq - last.seq <= len(pub._buffer)
            # A state tagged R stays a valid answer while the buffer holds R..next: the
            # requester replays the rest.
            if covered and (last.seq == pub._next_seq or now - last.made < cfg.snapshot_reuse_s
                            or len(snaps) >= cfg.max_snapshot_states):
                return last
            if len(snaps) >= cfg.max_snapshot_states:
                return None
        provider = pub._snapshot_provider
        events: list[AnyEvent] = []
        if provider is not None:
            pub.stats.snapshot_provider_calls += 1
            try:
                events = list(provider())
            except Exception:  # noqa: BLE001 - a provider bug must not end the publisher
                pub.stats.snapshot_errors += 1
                pub._log.exception("snapshot provider failed; answering the snapshot request with the end marker only")
                events = []
            if events and not isinstance(events[0], AllBlocksCleared):
                events.insert(0, AllBlocksCleared())
        # Read R after the provider ran: a provider that flushes pending events publishes
        # them first, and the snapshot then includes them.
        snap = _Snapshot(pub._next_seq, events, cfg.snapshot_batch_events, pub._encoder.encode,
                         pub.data_parallel_rank, pub._epoch)
        if provider is None or not events:
            snap.made = now - cfg.snapshot_reuse_s  # nothing to share; never pins a slot
        snaps.append(snap)
        return snap

    # -- replies -------------------------------------------------------------------------

    def _next_reply(self, job: _Job) -> tuple[bytes, bytes, bool]:
        """``(seq frame, payload, is_end)`` of the job's next reply."""
        snap = job.snapshot
        if snap is not None:
            if job.pos < snap.n_batches:
                return snap.tag, snap.batch(job.pos), False
            return END_SEQ_BYTES, b"", True
        pub = self._pub
        if job.epoch == pub._epoch:
            buf = pub._buffer
            nxt = pub._next_seq
            first = nxt - len(buf)
            if job.cursor < first:
                job.cursor = first  # rotated out while we were sending: the requester sees the hole
            if job.cursor < nxt:
                seqb, payload = buf[job.cursor - first]
                return seqb, payload, False
        return END_SEQ_BYTES, b"", True

    def _serve(self, deadline: float) -> bool:
        """Send replies round-robin until the turn is over or every job is blocked/done."""
        sock, cfg, pub = self.sock, self._cfg, self._pub
        jobs = self._jobs
        st = pub.stats
        topic = pub._topic
        with_topic = cfg.replay_topic_frame
        chunk = cfg.replay_chunk
        per_max, all_max = cfg.replay_client_max_bytes, cfg.replay_max_bytes
        ckpt = self._ckpt_bytes
        clock = time.perf_counter
        send = sock.send
        more, nb = _MORE, _NB
        total = self.inflight_bytes
        progressed = False
        now = time.monotonic()
        idle_rounds = 0
        while jobs and idle_rounds < 1:
            idle_rounds = 1
            for _ in range(len(jobs)):
                job = jobs.popleft()
                if job.poll():
                    job.last_progress = now
                if job.done:
                    # Answered; the slot stays taken until the requester has read it all.
                    if job.inflight:
                        jobs.append(job)
                    else:
                        self._finish(job)
                    continue
                budget = chunk
                ended = False
                while budget:
                    seqb, payload, end = self._next_reply(job)
                    size = len(payload) + _OVERHEAD
                    # A reply larger than a whole budget still goes out alone (no deadlock).
                    blocked = (job.inflight and job.inflight + size > per_max) or (total and total + size > all_max)
                    if blocked and not job.since_ckpt:
                        break  # wait until this requester (or everyone) has read some
                    # A job about to wait sends one more reply, tracked, so that it learns
                    # when its requester has read up to there (hence "plus one message").
                    track = blocked or end or job.since_ckpt + size >= ckpt
                    try:
                        send(job.ident, more)
                    except zmq.Again:
                        break  # the requester's pipe is full (HWM)
                    except zmq.ZMQError as exc:
                        if exc.errno != errno.EHOSTUNREACH:
                            raise
                        st.replay_aborted += 1  # the requester is gone
                        ended = True
                        break
                    # The identity frame was accepted, so the rest of the message is too.
                    send(b"", more)
                    if with_topic:
                        send(b"" if end else topic, more)
                    send(seqb, more)
                    if track:
                        tracker = send(payload, nb, copy=False, track=True)
                        assert tracker is not None
                        job.since_ckpt = 0
                    else:
                        send(payload, nb)
                        job.since_ckpt += size
                    job.sent += size
                    total += size
                    if track:
                        job.checkpoints.append((tracker, job.sent))
                    job.last_progress = now
                    progressed = True
                    idle_rounds = 0
                    budget -= 1
                    if end:
                        job.done = True
                        break
                    if job.snapshot is not None:
                        job.pos += 1
                        st.snapshot_batches_sent += 1
                    else:
                        job.cursor += 1
                        st.replay_batches_sent += 1
                    if not budget & 15 and clock() > deadline:
                        break
                if ended:
                    self._finish(job)
                else:
                    jobs.append(job)
                if clock() > deadline:
                    return progressed
        return progressed

    def _finish(self, job: _Job) -> None:
        """The job's last reply went out (or its requester left): free its slot."""
        ident = job.ident
        self._active.discard(ident)
        self._release(ident)
        snap = job.snapshot
        if snap is not None:
            job.snapshot = None
            snap.users -= 1
            self._drop_unused_snapshots()
        job.poll()
        if job.inflight:
            self._zombies.append(job)

    def _drop_unused_snapshots(self) -> None:
        snaps = self._snapshots
        now = time.monotonic()
        keep = [s for s in snaps if s.users > 0]
        if snaps and snaps[-1].users == 0 and now - snaps[-1].made < self._cfg.snapshot_reuse_s:
            keep.append(snaps[-1])  # the newest stays shareable for a moment
        self._snapshots = keep

    def _reap(self) -> bool:
        """Drop requesters that stopped reading; True if the socket must be recycled."""
        now = time.monotonic()
        timeout = self._cfg.replay_client_timeout_s
        if self.inflight_bytes > self._cfg.replay_max_bytes * 0.9:
            # Memory is nearly all held: requesters that read nothing are what keeps honest
            # ones waiting, so they get a tenth of the usual patience.
            timeout /= 10
        st = self._pub.stats
        jobs = self._jobs
        for _ in range(len(jobs)):
            job = jobs.popleft()
            if job.poll() or not job.inflight:
                job.last_progress = now  # read something, or waits on others, not on its reader
            if job.done and not job.inflight:
                self._finish(job)
            elif now - job.last_progress > timeout:
                st.replay_stalled += 1
                self._pub._rlog.warning("stalled", "dropping a replay requester that read nothing for %.2f s "
                                        "(replay_client_timeout_s)", timeout)
                self._finish(job)
            else:
                jobs.append(job)
        if self._zombies:
            zs = []
            for z in self._zombies:
                z.poll()
                if z.inflight:
                    zs.append(z)
            self._zombies = zs
        if self._snapshots:
            self._drop_unused_snapshots()
        # Pipes of dropped requesters cannot be emptied one by one; past half of the global
        # budget, start the socket afresh.
        zombies = self._zombies
        return (len(zombies) > _MAX_ZOMBIES
                or sum(z.inflight for z in zombies) > self._cfg.replay_max_bytes // 2)

    async def _recycle(self) -> None:
        """Close the ROUTER (dropping every queued reply) and bind a new one."""
        pub = self._pub
        pub.stats.replay_recycles += 1
        pub._rlog.warning("recycle", "replay requesters that do not read hold %d bytes: restarting the "
                          "replay socket", sum(z.inflight for z in self._zombies))
        for job in list(self._jobs):
            self._finish(job)
        self._jobs.clear()
        self._first.clear()
        self._more.clear()
        self._per_client.clear()
        self._active.clear()
        self._zombies = []
        self.sock.close(linger=0)
        # The old socket's listener is torn down by ZMQ's I/O thread: retry the bind briefly.
        for attempt in range(100):
            try:
                self.sock = self._make_socket()
                return
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or attempt == 99:
                    raise
                await anyio.sleep(0.01)
