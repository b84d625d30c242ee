"""The per-source recovery state machine of the subscriber (sans-IO: no sockets, no clock).

One :class:`SourceTracker` per publisher. The socket shell feeds it what arrives (live
messages, replay replies, end markers, request failures) and reads back two things: the
items to yield (:attr:`SourceTracker.out`) and the request to send, if any
(:attr:`SourceTracker.inflight`, with ``sent`` False until the shell sends it).

Rules (``E`` is the next seq to yield, ``H`` the highest seq seen on the live socket):

* live ``s == E``: yield it. ``s < E``: a duplicate of a replayed batch, dropped.
  ``s > E``: a gap; hold ``s`` and ask for a replay from ``E``.
* live ``s <= H``: the live channel went backwards, which one publisher never does: the
  engine restarted. Yield ``SourceReset("restart")``, forget everything, ``E = 0``, and
  go on as above (so a restart seen at ``s > 0`` replays ``0..s-1`` from the new engine).
* while a request is outstanding, live messages are held (bounded) and applied after it.
* a replay reply fills ``E, E+1, ...``. If it starts after ``E`` (or skips a seq, or is
  empty although a later seq is known) the publisher no longer has the missing batches:
  ask for a snapshot. A snapshot reply (batches tagged R, the publisher's next seq) yields
  ``SourceReset("snapshot", R)``, the snapshot batches, then resumes at ``E = R``. An empty
  snapshot reply means "unsupported" (that is what vLLM answers): yield ``SourceStale``
  and resume at the next seq held.
* at startup (with a replay endpoint) the tracker asks for a replay from 0: joining
  mid-stream fetches everything the publisher still buffers.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvstream.wire.events import KVEventBatch
from kvstream.transport.items import SourceBatch, SourceLive, SourceReset, SourceStale

__all__ = ["SourceTracker", "Request", "SourceCounters"]

REPLAY = "replay"
SNAPSHOT = "snapshot"


class Request:
    """A request the shell must send (``sent`` False) or is waiting on (``sent`` True).

    ``kind`` is ``"replay"`` (``start`` = first seq wanted) or ``"snapshot"``.
    """

    __slots__ = ("kind", "start", "known_max", "first", "hole", "sent", "snap", "snap_tag")

    def __init__(self, kind: str, start: int, known_max: int) -> None:
        self.kind = kind
        self.start = start
        self.known_max = known_max  # highest seq known when the request was made
        self.first: int | None = None  # first seq in the reply
        self.hole = False  # the reply skipped a seq we needed
        self.sent = False
        self.snap: list[tuple[bytes, bytes, KVEventBatch]] = []
        self.snap_tag: int | None = None

    def __repr__(self) -> str:
        return f"Request({self.kind}, start={self.start}, sent={self.sent})"


class SourceCounters:
    """Per-source counters (monotonic) and the last measured lag."""

    __slots__ = ("batches", "events", "gaps", "replays", "snapshots", "restarts", "stale_marks",
                 "duplicates", "decode_errors", "frame_errors", "held_dropped", "timeouts", "lag_s")

    def __init__(self) -> None:
        self.batches = 0
        """Batches yielded (live, replayed and snapshot)."""
        self.events = 0
        """Events in yielded batches."""
        self.gaps = 0
        """Seq jumps detected on the live socket."""
        self.replays = 0
        """Replay requests sent (retries included)."""
        self.snapshots = 0
        """Snapshot requests sent."""
        self.restarts = 0
        """Publisher restarts detected (seq went backwards)."""
        self.stale_marks = 0
        """Times the source was marked stale (unrecoverable loss)."""
        self.duplicates = 0
        """Batches dropped because they were already yielded (replay overlap)."""
        self.decode_errors = 0
        """Payloads that could not be decoded (dropped, the seq then counts as missing)."""
        self.frame_errors = 0
        """Messages with the wrong shape (frame count, seq length): dropped."""
        self.held_dropped = 0
        """Live messages not held during a recovery because the hold buffer was full
        (they are fetched again by the next replay)."""
        self.timeouts = 0
        """Requests that got no complete answer in time."""
        self.lag_s = 0.0
        """Seconds between the last yielded live batch's ``ts`` and its arrival."""

    def as_dict(self) -> dict[str, Any]:
        """The counters as a plain dict."""
        return {k: getattr(self, k) for k in self.__slots__}


_Entry = tuple  # (seq, topic, payload, batch, replayed)


class SourceTracker:
    """Recovery state of one source; see the module docstring for the rules.

    ``has_replay``: whether the source has a replay endpoint (without one, every gap is
    unrecoverable and marks the source stale). ``max_held``: live messages held while a
    request is outstanding (more are dropped and fetched again later).
    """

    __slots__ = ("name", "has_replay", "max_held", "expected", "live_high", "topic", "held",
                 "inflight", "stale", "out", "counters", "generation", "_replayed", "_snap_floor")

    def __init__(self, name: str, *, has_replay: bool, max_held: int = 100_000, topic: bytes = b"") -> None:
        self.name = name
        self.has_replay = has_replay
        self.max_held = max_held
        self.expected = 0
        """The next seq to yield."""
        self.live_high = -1
        """The highest seq seen on the live socket from the current publisher instance."""
        self.topic = topic
        self.held: dict[int, _Entry] = {}
        self.inflight: Request | None = None
        """The outstanding request, if any."""
        self.stale = False
        """True after unrecoverable loss, until a snapshot or restart rebuilds the state."""
        self.out: list[Any] = []
        """Items to yield, in order; the shell drains it."""
        self.counters = SourceCounters()
        self.generation = 0
        """Bumped when an outstanding request is abandoned (its late replies must be ignored)."""
        # Replayed batches not yet seen live, as (seq, payload): a live message below
        # ``expected`` is a duplicate only if it matches one of them (or lies below a
        # snapshot's seq); otherwise it is a new engine that restarted from 0.
        self._replayed: deque[tuple[int, bytes]] = deque()
        self._snap_floor = -1

    # -- state -------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"recovering"`` (a request is outstanding), ``"stale"`` or ``"live"``."""
        if self.inflight is not None:
            return "recovering"
        return "stale" if self.stale else "live"

    def start(self) -> None:
        """Ask for everything the publisher still buffers (joining mid-stream)."""
        if self.has_replay and self.inflight is None:
            self.inflight = Request(REPLAY, 0, -1)

    # -- live --------------------------------------------------------------------------

    def on_live(self, seq: int, topic: bytes, payload: bytes, batch: KVEventBatch, now: float) -> None:
        """A decoded live message arrived."""
        rp = self._replayed
        while rp and rp[0][0] < seq:
            rp.popleft()
        if seq <= self.live_high or (seq < self.expected and not self._is_duplicate(seq, payload)):
            self._restart(seq)
        self.live_high = seq
        self.topic = topic
        e = self.expected
        if seq < e:
            self.counters.duplicates += 1
            return
        if self.inflight is not None:
            self._hold(seq, (seq, topic, payload, batch, False))
            return
        if seq == e:
            self._yield(seq, topic, payload, batch, False)
            self.counters.lag_s = now - batch.ts
            return
        self.counters.gaps += 1
        self._hold(seq, (seq, topic, payload, batch, False))
        self._recover()

    def _is_duplicate(self, seq: int, payload: bytes) -> bool:
        if seq < self._snap_floor:
            return True
        rp = self._replayed
        if rp and rp[0][0] == seq:
            return rp.popleft()[1] == payload
        return False

    def _hold(self, seq: int, entry: _Entry) -> None:
        if len(self.held) >= self.max_held and seq not in self.held:
            self.counters.held_dropped += 1
            return
        self.held[seq] = entry

    def _restart(self, seq: int) -> None:
        c = self.counters
        c.restarts += 1
        if self.inflight is not None:
            self.inflight = None
            self.generation += 1
        self.held.clear()
        self._replayed.clear()
        self._snap_floor = -1
        self.out.append(SourceReset(self.name, "restart", seq))
        self.expected = 0
        self.live_high = -1
        self.stale = False

    def _yield(self, seq: int, topic: bytes, payload: bytes, batch: KVEventBatch, replayed: bool) -> None:
        self.out.append(SourceBatch(self.name, seq, topic, payload, batch, replayed))
        if replayed and seq > self.live_high:
            self._replayed.append((seq, payload))
        c = self.counters
        c.batches += 1
        c.events += len(batch.events)
        self.expected = seq + 1

    def _drain_held(self) -> None:
        held = self.held
        if not held:
            return
        e = self.expected
        while e in held:
            seq, topic, payload, batch, replayed = held.pop(e)
            self._yield(seq, topic, payload, batch, replayed)
            e += 1
        for s in [s for s in held if s < e]:
            del held[s]
            self.counters.duplicates += 1

    def _recover(self) -> None:
        """Yield what is held in order; on a hole, request a replay (or mark stale)."""
        self._drain_held()
        if not self.held:
            return
        if not self.has_replay:
            self._mark_stale("no replay endpoint configured")
            return
        self.inflight = Request(REPLAY, self.expected, max(self.held))

    def _mark_stale(self, reason: str) -> None:
        e = self.expected
        resume = min(self.held) if self.held else max(e, self.live_high + 1)
        self.stale = True
        self.counters.stale_marks += 1
        self.out.append(SourceStale(self.name, reason, e, resume))
        self.expected = resume
        self._recover()

    # -- replies -----------------------------------------------------------------------

    def on_reply(self, seq: int, topic: bytes | None, payload: bytes, batch: KVEventBatch) -> None:
        """A decoded replay (or snapshot) reply arrived for the outstanding request."""
        req = self.inflight
        if req is None or not req.sent:
            return
        if req.kind == SNAPSHOT:
            if req.snap_tag is None:
                req.snap_tag = seq
            req.snap.append((topic if topic else self.topic, payload, batch))
            return
        if req.first is None:
            req.first = seq
        t = topic if topic else self.topic
        e = self.expected
        if seq < e:
            self.counters.duplicates += 1
        elif seq == e and not req.hole:
            self._yield(seq, t, payload, batch, True)
            self._drain_held()
        else:
            req.hole = req.hole or seq > e
            self._hold(seq, (seq, t, payload, batch, True))

    def on_reply_end(self) -> None:
        """The end marker of the outstanding request arrived."""
        req = self.inflight
        if req is None or not req.sent:
            return
        self.inflight = None
        if req.kind == SNAPSHOT:
            self._end_snapshot(req)
            return
        uncovered = req.hole or (req.first is not None and req.first > req.start) or (
            req.first is None and req.known_max >= req.start and self.expected <= req.known_max)
        self._drain_held()
        if uncovered and self.held:
            self.inflight = Request(SNAPSHOT, self.expected, max(self.held))
            return
        self._recover()
        if self.inflight is None:
            self.out.append(SourceLive(self.name, self.expected - 1))

    def _end_snapshot(self, req: Request) -> None:
        if not req.snap:
            self._mark_stale("gap older than the publisher's replay buffer and the publisher "
                             "does not answer snapshot requests")
            if self.inflight is None:
                self.out.append(SourceLive(self.name, self.expected - 1))
            return
        r = req.snap_tag
        assert r is not None
        self.out.append(SourceReset(self.name, "snapshot", r))
        c = self.counters
        for topic, payload, batch in req.snap:
            self.out.append(SourceBatch(self.name, r - 1, topic, payload, batch, True))
            c.batches += 1
            c.events += len(batch.events)
        self.stale = False
        self.expected = r
        self._snap_floor = r
        self._replayed.clear()
        self._recover()
        if self.inflight is None:
            self.out.append(SourceLive(self.name, self.expected - 1))

    def on_request_failed(self, reason: str) -> None:
        """The outstanding request could not be completed (timeouts, retries exhausted)."""
        req = self.inflight
        if req is None:
            return
        self.inflight = None
        self.generation += 1
        if req.kind == REPLAY and req.start == 0 and req.known_max < 0 and not self.held:
            return  # the join-time replay found nobody; nothing is known to be missing
        self._mark_stale(f"{req.kind} request failed: {reason}")
        if self.inflight is None:
            self.out.append(SourceLive(self.name, self.expected - 1))
