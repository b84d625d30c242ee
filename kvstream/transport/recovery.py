"""The per-source recovery state machine of the subscriber (sans-IO: no sockets, no clock).

One :class:`SourceTracker` per publisher. The socket shell feeds it what arrives (live
messages, replay replies, end markers, silence, the time) and reads back two things: the
items to yield (:attr:`SourceTracker.out`) and the request to send, if any
(:attr:`SourceTracker.inflight`, with ``sent`` False until the shell sends it, after
``delay_s`` seconds).

The promise: the state a consumer builds from the items is exactly the publisher's, or the
source is visibly not ``live`` (``connecting``, ``recovering`` or ``stale``).

Rules (``E`` is the next seq to yield, ``H`` the highest seq seen on the live socket):

* **Identity by bytes.** vLLM's seqs carry no instance id, so the tracker remembers a hash
  of the payload of the last :data:`RECENT_WINDOW` yielded seqs. A live ``s < E`` is a
  duplicate only if its bytes match what was yielded for ``s``; other bytes mean a new
  engine (restart). If ``s`` is outside the window (or was covered by a snapshot), the
  tracker asks the publisher (a *verify* request, below). Bytes come first: a copy is a
  duplicate whatever ``H`` is (a forwarder duplicates and reorders). A live ``E <= s <= H``
  not held is a reordered message: held like a gap, and checked against the anchored
  replay that fills it (other bytes there: a restart).
* **Anchored requests.** Every replay request after the join starts at ``E - 1`` (the
  *anchor*, whose hash is known) and the first reply must be the anchor with the same
  bytes: otherwise the publisher is a new engine (``SourceReset("restart")``, then a
  replay from 0), or, if the reply starts after the anchor, the publisher no longer
  buffers it (snapshot, else stale). After a snapshot the anchor ``R - 1`` is fetched
  first (a snapshot tag the publisher cannot back with a batch, such as a hostile 2^63,
  is a restart).
* **Holes are retried.** A complete reply (end marker) that skips ``E`` after having sent
  something below ``E`` lost replies on the way (vLLM 0.11's ROUTER drops beyond its HWM):
  ask again from the first missing seq. Only a complete reply to a request at or below
  ``E`` whose first seq is above ``E`` proves the data gone. A reply that stops without its
  end marker is retried the same way when the shell reports silence
  (:meth:`SourceTracker.on_timeout`). Retries without progress are bounded
  (``max_retries``, backoff ``backoff_s`` doubling).
* **Idle probes.** vLLM sends no heartbeat: when a source has been quiet for
  ``probe_after_s`` after live traffic, the tracker asks for a replay from the anchor. An
  anchor and end marker means up to date; more batches are a lost tail, applied; another
  anchor is a restart. While the source stays quiet the wait doubles up to
  ``probe_max_s`` (a burst lost whole re-arms nothing), so an idle source costs one tiny
  request every ``probe_max_s`` seconds. A
  reconnect of the live socket (:meth:`SourceTracker.on_reconnect`: the publisher may have
  restarted and published nothing we received) probes at once.
* **Hidden restarts.** Behind a forwarder (``hidden_restarts``) no reconnect marks a
  restart, and if the new instance's first batches are lost its next seq continues the old
  instance's without a gap: the anchor proves nothing. The tracker keeps a *chain*: the
  seqs from the last rebuild (0 after a restart, R after a snapshot) that overlapping
  complete answers returned with the bytes that were yielded. An idle probe then starts at
  the chain's last seq (within the remembered window), so every batch taken live since is
  compared (other bytes: restart), and its tail is asked again from the anchor (a long
  answer's last replies can be lost unseen). If the publisher no longer buffers the batches
  to compare, nothing proves they are one instance's: a snapshot, else stale; an answer
  that stops before the anchor is asked again (retries end in a snapshot or stale).
* **Topics.** vLLM 0.11 replies carry no topic frame. Under a topic filter, while the
  publisher's topic is unknown (no live message, no ``source_topic``), they are ignored
  (counted ``unattributed``) and the source stays ``connecting``: nothing proves they pass
  the filter. A live message names the topic; the gap before it is then replayed.
* **States.** ``connecting`` until the first live message or replay answer; ``recovering``
  while a (non-probe) request is outstanding, once a probe went unanswered for the shell's
  timeout (no answer is no evidence of ``live``), and after a probe found batches the live
  socket lost (until a live message arrives or a probe finds nothing new); ``stale`` after
  unrecoverable loss until a reset (no ``SourceLive`` while stale, and a failing probe of a
  stale source adds no second ``SourceStale``); else ``live``.
* **Bounds.** Held live messages (``max_held`` messages, ``max_held_bytes``), a
  snapshot being received (``max_snapshot_bytes``, beyond: stale) and the replies of one
  request (``max_replies``, beyond: the request fails) are bounded.
"""

from __future__ import annotations

from array import array
from typing import Any

from kvstream.wire.events import KVEventBatch
from kvstream.transport.items import SourceBatch, SourceLive, SourceReset, SourceStale

__all__ = ["SourceTracker", "Request", "SourceCounters", "STATES", "RECENT_WINDOW"]

REPLAY = "replay"
SNAPSHOT = "snapshot"
# Why a request was made.
JOIN = "join"  # replay from 0 at startup or after a restart
GAP = "gap"  # a seq is missing
PROBE = "probe"  # quiet after traffic: anything lost at the tail?
REPROBE = "reprobe"  # a probe nobody answered in time, asked again: no longer "live"
VERIFY = "verify"  # a live seq below E whose bytes are unknown
ANCHOR = "anchor"  # after a snapshot: fetch the bytes of R - 1

STATES = ("connecting", "live", "recovering", "stale")
"""Every state a source can be in, see :attr:`SourceTracker.state`."""
RECENT_WINDOW = 256
"""Yielded seqs whose payload hash is remembered per source (an 8-byte slot each)."""
_BACKOFF_CAP_S = 2.0
UNANSWERED_RETRY_MAX_S = 10.0
"""Longest wait between requests to a publisher that has never answered (nothing live, no
replay reply): its join is asked again after a doubling wait up to this many seconds, so
engines nobody listens on cost little; one that comes up is joined within this bound."""
_NO_SEQ = 1 << 62  # above any seq: "nothing held"


class Request:
    """A request the shell must send (``sent`` False) or is waiting on (``sent`` True).

    ``kind`` is ``"replay"`` (``start`` = first seq wanted) or ``"snapshot"``; ``purpose``
    says why (join, gap, probe, verify, anchor); ``delay_s``: seconds to wait before
    sending (retry backoff).
    """

    __slots__ = ("kind", "purpose", "start", "check", "checked", "first", "below", "replies",
                 "sent", "delay_s", "e0", "snap", "snap_tag", "snap_bytes", "unattributed", "anchor",
                 "links", "vnext", "lost", "last")

    def __init__(self, kind: str, purpose: str, start: int, check: int | None = None,
                 delay_s: float = 0.0, e0: int = 0) -> None:
        self.kind = kind
        self.purpose = purpose
        self.start = start
        self.check = check  # payload hash the reply's seq ``start`` must have (None: record it)
        self.checked = False  # the reply's first message was the anchor
        self.first: int | None = None  # first seq in the reply
        self.below = False  # the reply sent something below E (so it did not start late)
        self.replies = 0
        self.sent = False
        self.delay_s = delay_s
        self.e0 = e0  # E when the request was made (progress check)
        self.snap: list[tuple[bytes, bytes, KVEventBatch]] = []
        self.snap_tag: int | None = None
        self.snap_bytes = 0
        self.unattributed = 0  # replies without a topic frame from a publisher of unknown topic
        self.anchor = start  # E - 1 when made (a span request starts below it)
        self.links = False  # its start is in the proven chain: a complete answer extends it
        self.vnext = start  # replies start .. vnext - 1 arrived (and matched), contiguous
        self.lost = False  # the publisher no longer buffers seqs of the span that need checking
        self.last = -1  # the highest seq in the reply

    def frame(self) -> int | None:
        """The start seq to put on the wire, None for a snapshot request."""
        return None if self.kind == SNAPSHOT else self.start

    def __repr__(self) -> str:
        return f"Request({self.kind}/{self.purpose}, start={self.start}, sent={self.sent})"


class SourceCounters:
    """Per-source counters (monotonic) and the last measured lag."""

    __slots__ = ("batches", "events", "gaps", "replays", "snapshots", "restarts", "stale_marks",
                 "duplicates", "decode_errors", "frame_errors", "held_dropped", "timeouts",
                 "retries", "probes", "filtered", "unattributed", "overflows", "reordered", "shed", "no_live_warnings",
                 "lag_s")

    def __init__(self) -> None:
        self.batches = 0
        """Batches yielded (live, replayed and snapshot)."""
        self.events = 0
        """Events in yielded batches."""
        self.gaps = 0
        """Seq jumps detected on the live socket."""
        self.replays = 0
        """Replay requests sent (retries and probes included)."""
        self.snapshots = 0
        """Snapshot requests sent."""
        self.restarts = 0
        """Publisher restarts detected (seq went backwards, or other bytes at a known seq)."""
        self.stale_marks = 0
        """Times the source was marked stale (unrecoverable loss)."""
        self.duplicates = 0
        """Batches dropped because they were already yielded (replay overlap)."""
        self.decode_errors = 0
        """Payloads that could not be decoded (dropped, the seq then counts as missing)."""
        self.frame_errors = 0
        """Messages with the wrong shape (frame count, seq length): dropped."""
        self.held_dropped = 0
        """Live messages or replies not held during a recovery because the hold buffer was
        full (``max_held`` / ``max_held_bytes``); they are fetched again by a replay."""
        self.timeouts = 0
        """Requests that got no complete answer in time."""
        self.retries = 0
        """Requests asked again: replies lost on the way (holes, cut tails) or timeouts."""
        self.probes = 0
        """Idle probes sent (a replay from the anchor after a quiet period)."""
        self.filtered = 0
        """Replayed batches of another topic than the subscriber's filter (skipped)."""
        self.unattributed = 0
        """Replies without a topic frame (vLLM 0.11) ignored under a topic filter because the
        publisher's topic was not known yet (no live message, no ``SourceSpec.topic``)."""
        self.overflows = 0
        """Requests given up because an answer exceeded its bound (snapshot bytes, replies)."""
        self.shed = 0
        """Live messages dropped unread while the consumer's queue was full (replayed later)."""
        self.reordered = 0
        """Live messages that arrived after a higher seq and filled a gap (a forwarder or
        network reordering): held and checked by the replay that fills the gap."""
        self.no_live_warnings = 0
        """Times the subscriber warned that batches arrive only by replay, none live (both
        sides of the live endpoint connect, most likely; see
        :attr:`~kvstream.transport.subscriber.Subscriber.no_live_batches`)."""
        self.lag_s = 0.0
        """Seconds between the arrival of the last batch the consumer took and its taking."""

    def as_dict(self) -> dict[str, Any]:
        """The counters as a plain dict."""
        return {k: getattr(self, k) for k in self.__slots__}


_Entry = tuple  # (seq, topic, payload, batch, replayed)


class SourceTracker:
    """Recovery state of one source; see the module docstring for the rules.

    ``has_replay``: whether the source has a replay endpoint (without one, every gap is
    unrecoverable and marks the source stale). ``max_held`` / ``max_held_bytes``: live
    messages (and out-of-order replies) held while a request is outstanding (more are
    dropped and fetched again later). ``max_snapshot_bytes``: payload bytes of one snapshot
    answer. ``max_replies``: replies to one request. ``max_retries``: requests asked again
    without progress before the loss is taken as final (``backoff_s`` seconds, doubling,
    between them). ``probe_after_s``: quiet seconds after live traffic before an idle probe
    (None: no probes); while the source stays quiet the wait doubles up to ``probe_max_s``
    (None: a single probe per quiet period). ``held_factor``: bytes counted per payload byte
    against the byte bounds (what a held message really holds, decoded form included).
    ``topic``: the subscriber's topic filter (a prefix); ``source_topic``:
    the publisher's topic if known (labels vLLM 0.11 replies, which carry none, until a live
    message shows it). ``hidden_restarts``: the live path may hide the publisher's restarts
    (a forwarder keeps its connection up): probes then check every batch taken live since
    the last check (see the module docstring, *Hidden restarts*).
    """

    __slots__ = ("name", "has_replay", "max_held", "max_held_bytes", "max_snapshot_bytes",
                 "max_replies", "max_retries", "backoff_s", "probe_after_s", "topic_filter",
                 "topic", "expected", "live_high", "held", "held_bytes", "inflight", "stale",
                 "connected", "out", "counters", "generation", "_attempts", "_ring", "_ring_lo",
                 "_ring_hi", "_last_live", "_probe_armed", "_recheck", "probe_max_s", "_probe_gap",
                 "_held_min", "_tail_lost", "held_factor", "_base", "_chain_hi", "hidden_restarts")

    def __init__(self, name: str, *, has_replay: bool, max_held: int = 100_000,
                 max_held_bytes: int = 64 << 20, max_snapshot_bytes: int = 256 << 20,
                 max_replies: int = 1_000_000, max_retries: int = 3, backoff_s: float = 0.05,
                 probe_after_s: float | None = 0.5, probe_max_s: float | None = 2.0,
                 topic: bytes = b"",
                 source_topic: bytes | None = None, held_factor: int = 1,
                 hidden_restarts: bool = False) -> None:
        self.name = name
        self.hidden_restarts = hidden_restarts
        """The live path may hide the publisher's restarts (a forwarder between keeps its
        connection up, so no reconnect marks them): probes compare every batch taken live
        since the last check, not only the anchor."""
        self.has_replay = has_replay
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.held_factor = held_factor
        """Bytes counted against ``max_held_bytes`` / ``max_snapshot_bytes`` per payload byte
        (the payload and its decoded form, as the shell estimates it)."""
        self.max_snapshot_bytes = max_snapshot_bytes
        self.max_replies = max_replies
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.probe_after_s = probe_after_s
        self.probe_max_s = probe_max_s
        self._probe_gap = probe_after_s or 0.0
        self.topic_filter = topic
        self.topic: bytes | None = source_topic
        """The publisher's topic: from its live messages, else as configured, else None."""
        self.expected = 0
        """The next seq to yield."""
        self.live_high = -1
        """The highest seq seen on the live socket from the current publisher instance."""
        self.held: dict[int, _Entry] = {}
        self.held_bytes = 0
        # A lower bound of the held seqs: _drain_held scans for held seqs below E only
        # when this is below E (a scan per replay reply is quadratic under overlap).
        self._held_min = _NO_SEQ
        self.inflight: Request | None = None
        """The outstanding request, if any."""
        self.stale = False
        """True after unrecoverable loss, until a snapshot or restart rebuilds the state."""
        self.connected = False
        """True once anything arrived from the publisher (a live message or a replay answer)."""
        self.out: list[Any] = []
        """Items to yield, in order; the shell drains it."""
        self.counters = SourceCounters()
        self.generation = 0
        """Bumped when an outstanding request is abandoned (its late replies must be ignored)."""
        self._attempts = 0  # requests without progress in a row
        # Payload hashes of yielded seqs _ring_lo .. _ring_hi - 1 (a ring of RECENT_WINDOW).
        self._ring: array | None = None
        self._ring_lo = 0
        self._ring_hi = 0
        self._last_live = 0.0
        self._probe_armed = False
        self._recheck = False
        # A probe found batches the live socket never delivered (a PUB that reaches
        # nobody, a forwarder losing messages): "recovering" until a live message arrives
        # or a probe finds nothing new.
        self._tail_lost = False
        # The proven chain: the yielded seqs _base .. _chain_hi - 1 (_base: where the
        # state was last rebuilt, 0 after a restart, R after a snapshot) are known to be
        # one publisher instance's, because complete answers that overlap each other
        # returned them with the bytes that were yielded. Seqs taken live beyond it are
        # not: a restart hidden from the live socket (a forwarder keeps its connection)
        # whose first batches were lost shows only as other bytes at a seq already taken,
        # so probes compare everything from _chain_hi - 1 on.
        self._base = 0
        self._chain_hi = 0

    # -- state -------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"connecting"`` (nothing heard from the publisher yet), ``"recovering"`` (a
        request is outstanding), ``"stale"`` or ``"live"``."""
        if not self.connected:
            return "connecting"
        if self.stale:
            return "stale" if self.inflight is None or self.inflight.purpose in (PROBE, REPROBE) \
                else "recovering"
        req = self.inflight
        if (req is not None and req.purpose != PROBE) or self._tail_lost:
            return "recovering"
        return "live"

    def start(self, now: float = 0.0, start_seq: int = 0) -> None:
        """Ask for everything the publisher still buffers (joining mid-stream); ``now``
        starts the probe clock. ``start_seq`` > 0: the consumer already holds the state up
        to ``start_seq - 1`` (a loaded replica dump), so only what follows is asked for,
        from the anchor ``start_seq - 1``, which the publisher must still buffer (else a
        restart from 0 if it went backwards, a snapshot or stale if its buffer moved on)."""
        if start_seq < 0:
            raise ValueError(f"start_seq must be >= 0, got {start_seq}")
        self._last_live = now
        if start_seq:
            self.expected = start_seq
            self._base = self._chain_hi = start_seq
        if self.has_replay and self.inflight is None:
            self.inflight = self._join()

    def _join(self) -> Request:
        # Before anything was heard, E > 0 only from start(start_seq): resume at its anchor.
        e = self.expected
        return Request(REPLAY, ANCHOR, e - 1, None, 0.0, e) if e else Request(REPLAY, JOIN, 0)

    # -- the ring of recent payload hashes -----------------------------------------------

    def _remember(self, seq: int, h: int) -> None:
        ring = self._ring
        if ring is None:
            ring = self._ring = array("q", bytes(8 * RECENT_WINDOW))
        if seq != self._ring_hi:
            self._ring_lo = seq
        self._ring_hi = seq + 1
        if self._ring_hi - self._ring_lo > RECENT_WINDOW:
            self._ring_lo = self._ring_hi - RECENT_WINDOW
        ring[seq % RECENT_WINDOW] = h

    def _known(self, seq: int) -> int | None:
        """The payload hash yielded for ``seq``, if still remembered."""
        if self._ring is not None and self._ring_lo <= seq < self._ring_hi:
            return self._ring[seq % RECENT_WINDOW]
        return None

    def _forget(self, base: int) -> None:
        """Forget the bytes yielded so far: the state was rebuilt from ``base`` on."""
        self._ring_lo = self._ring_hi = 0
        self._base = self._chain_hi = base

    def _link(self, req: Request) -> None:
        """A complete answer to ``req`` arrived: extend the proven chain with it."""
        if (req.links or req.start <= self._base) and req.vnext > self._chain_hi:
            self._chain_hi = req.vnext

    # -- live --------------------------------------------------------------------------

    def on_live(self, seq: int, topic: bytes, payload: bytes, batch: KVEventBatch, now: float) -> None:
        """A decoded live message arrived at ``now`` (seconds, any monotonic clock)."""
        self.connected = True
        self._last_live = now
        self._probe_armed = True
        self._probe_gap = self.probe_after_s or 0.0
        self._tail_lost = False  # the live socket delivers
        self.topic = topic
        e = self.expected
        if seq < e:
            # Bytes first (the state table): the same bytes at a yielded seq are a copy
            # (a duplicate or a late, reordered message), whatever live_high says.
            h = self._known(seq)
            if h is None:
                # Bytes unknown (older than the window, or covered by a snapshot): ask.
                if seq > self.live_high:
                    self.live_high = seq
                self._hold(seq, (seq, topic, payload, batch, False))
                if self.inflight is None:
                    self._verify()
                return
            if h == hash(payload):
                self.counters.duplicates += 1
                return
            self._restart(seq)
            if self.has_replay:
                # Which instance sent it is unknown (a forwarder may deliver an old copy
                # late): the join fetches the truth from whoever answers now.
                return
            e = 0
        elif seq <= self.live_high:
            # Not yielded yet but at or below the highest live seq: a reordered message
            # filling a gap (held copies are compared byte for byte), or a new instance.
            held = self.held.get(seq)
            if held is not None:
                if held[2] == payload:
                    self.counters.duplicates += 1
                    return
                self._restart(seq)
                if self.has_replay:
                    return  # as above: the join fetches the truth
                e = 0
            elif not self.has_replay:
                # Nobody to check it against: a restart must never be missed.
                self._restart(seq)
                e = 0
            else:
                # Held and checked like a gap: the anchored replay that fills the gap
                # proves (or disproves) the instance, and replies are compared with it.
                self.counters.reordered += 1
                self._hold(seq, (seq, topic, payload, batch, False))
                if self.inflight is None:
                    self._recover()
                return
        if seq > self.live_high:
            self.live_high = seq
        if self.inflight is not None:
            self._hold(seq, (seq, topic, payload, batch, False))
            return
        if seq == e:
            self._yield(seq, topic, payload, batch, False)
            return
        self.counters.gaps += 1
        self._hold(seq, (seq, topic, payload, batch, False))
        self._recover()

    def on_shed(self, seq: int, now: float) -> None:
        """A live message (``seq``) was dropped unread because the consumer's queue was full
        (the shell sheds rather than let ZMQ's queue grow): a gap, replayed once there is
        room (the source is "recovering", or "stale" without a replay endpoint)."""
        self.connected = True
        self._last_live = now
        self.counters.shed += 1
        if seq > self.live_high:
            self.live_high = seq
        if self.inflight is None and seq >= self.expected:
            self._recover()

    def on_pause(self) -> None:
        """The consumer's queue filled while replies of the outstanding replay arrived: the
        shell drops the rest of the answer (it closes that socket) and the request is made
        again from where the yielded batches reached, to be sent once there is room."""
        req = self.inflight
        if req is None or req.kind == SNAPSHOT or not req.sent:
            return
        self._abandon()
        e = self.expected
        if (req.purpose == ANCHOR and e == req.e0) or e == 0:
            self.inflight = Request(req.kind, req.purpose, req.start, req.check, 0.0, req.e0)
        else:
            self.inflight = self._anchored(GAP if req.purpose in (JOIN, ANCHOR, PROBE, REPROBE) else req.purpose)

    def _hold(self, seq: int, entry: _Entry) -> None:
        if seq in self.held:
            return
        n = len(entry[2]) * self.held_factor
        if len(self.held) >= self.max_held or self.held_bytes + n > self.max_held_bytes:
            self.counters.held_dropped += 1
            return
        self.held[seq] = entry
        self.held_bytes += n
        if seq < self._held_min:
            self._held_min = seq

    def _clear_held(self) -> None:
        self.held.clear()
        self.held_bytes = 0
        self._held_min = _NO_SEQ

    def _abandon(self) -> None:
        if self.inflight is not None:
            self.inflight = None
            self.generation += 1

    def _restart(self, seq: int) -> None:
        """A new publisher instance: forget everything, rebuild from its seq 0."""
        self.counters.restarts += 1
        self._abandon()
        self._clear_held()
        self._forget(0)
        self._attempts = 0
        self.out.append(SourceReset(self.name, "restart", seq))
        self.expected = 0
        self.live_high = -1
        self.stale = False
        if self.has_replay:
            self.inflight = Request(REPLAY, JOIN, 0)

    def _yield(self, seq: int, topic: bytes, payload: bytes, batch: KVEventBatch, replayed: bool) -> None:
        self._remember(seq, hash(payload))
        self.expected = seq + 1
        # An empty topic is a topic (vLLM's default): it passes only an empty filter. A reply
        # whose topic is unknown never gets here under a filter (see on_reply).
        if replayed and self.topic_filter and not topic.startswith(self.topic_filter):
            self.counters.filtered += 1
            return
        self.out.append(SourceBatch(self.name, seq, topic, payload, batch, replayed))
        c = self.counters
        c.batches += 1
        c.events += len(batch.events)

    def _drain_held(self) -> bool:
        """Yield held messages that are next in order; drop those already yielded. False
        if a held message contradicts what was yielded (the tracker restarted)."""
        held = self.held
        if not held:
            return True
        e = self.expected
        while e in held:
            seq, topic, payload, batch, replayed = held.pop(e)
            self.held_bytes -= len(payload) * self.held_factor
            self._yield(seq, topic, payload, batch, replayed)
            e += 1
        if self._held_min >= e:
            return True  # nothing held below E
        for s in [s for s in held if s < e]:
            entry = held.pop(s)
            self.held_bytes -= len(entry[2]) * self.held_factor
            h = self._known(s)
            if h is None:
                if not entry[4]:
                    # A live message below E whose bytes are unknown: verify it.
                    held[s] = entry
                    self.held_bytes += len(entry[2]) * self.held_factor
                continue
            if h == hash(entry[2]):
                self.counters.duplicates += 1
            elif not entry[4]:
                self._restart(s)
                return False
        self._held_min = min(held, default=_NO_SEQ)
        return True

    def _ask_again(self, purpose: str, span: bool = False) -> None:
        """One more anchored request after an answer that did not settle the state, with
        back-off; past ``max_retries``, the buffer is taken as gone (snapshot, else stale)."""
        self._attempts += 1
        if self._attempts > self.max_retries:
            self._beyond_buffer()
            return
        self.counters.retries += 1
        delay = min(self.backoff_s * (2 ** (self._attempts - 1)), _BACKOFF_CAP_S)
        self.inflight = self._anchored(purpose, delay, span=span)

    def _anchored(self, purpose: str, delay_s: float = 0.0, span: bool = False) -> Request:
        """A replay request from the anchor ``E - 1`` when its bytes are known, else from E.
        ``span``: from the end of the proven chain instead (within the remembered window),
        so that every seq taken live since is compared."""
        e = self.expected
        h = self._known(e - 1) if e > 0 else None
        if h is None:
            req = Request(REPLAY, purpose, e, None, delay_s, e)
            req.links = e <= self._base
            return req
        start = e - 1
        if span and self.hidden_restarts and self._chain_hi - 1 < start:
            # Overlap the chain by one seq (or start at the base); older than the window:
            # from its oldest remembered seq (the seqs before cannot be compared any more).
            v = max(self._chain_hi - 1, self._base, self._ring_lo)
            hv = self._known(v)
            if hv is not None:
                start, h = v, hv
        req = Request(REPLAY, purpose, start, h, delay_s, e)
        req.anchor = e - 1
        req.links = start < self._chain_hi or start <= max(self._base, self._ring_lo)
        return req

    def _verify(self) -> None:
        e = self.expected
        if not self.has_replay or self._known(e - 1) is None:
            # Nobody to ask, or nothing to compare with: a live seq below E with unknown
            # bytes cannot be told from a restart, and a restart must never be missed.
            self._restart(min([s for s in self.held if s < e], default=max(e - 1, 0)))
            return
        self.inflight = self._anchored(VERIFY)

    def _recover(self) -> None:
        """Yield what is held in order; on a hole, request a replay (or mark stale)."""
        if not self._drain_held():
            return
        if self.inflight is not None:
            return
        held = self.held
        if held and min(held) < self.expected:
            self._verify()
            return
        if not held and self.expected > self.live_high:
            return
        if not self.has_replay:
            self._mark_stale("no replay endpoint configured")
            return
        self.inflight = self._anchored(GAP)

    def _mark_stale(self, reason: str) -> None:
        e = self.expected
        # Resume at the first held seq at or above E. A held seq below E is a live message
        # whose bytes are still unverified (a restarted engine's first batches, say): never
        # a place to resume (a stale notice that goes backwards would have the old state
        # continued with the new instance's seqs); the _recover below settles it.
        ahead = [s for s in self.held if s >= e]
        resume = min(ahead) if ahead else max(e, self.live_high + 1)
        if self.stale and resume == e:
            # Already stale and nothing more skipped (a dead engine's probes failing one
            # after another): no news, no second notice.
            self._forget(e)
            self._attempts = 0
            self._recover()
            return
        self.stale = True
        self.counters.stale_marks += 1
        self.out.append(SourceStale(self.name, reason, e, resume))
        self.expected = resume
        self._forget(resume)
        self._attempts = 0
        self._recover()

    def _live_again(self) -> None:
        # Only a source that is live says so: a stale one stays stale until a reset.
        if self.inflight is None and not self.stale and not self._tail_lost:
            self.out.append(SourceLive(self.name, self.expected - 1))

    def _connect(self) -> None:
        # Probe from now on, even before any live traffic: a first burst lost whole would
        # re-arm nothing.
        self.connected = True
        self._probe_armed = True

    # -- probes ------------------------------------------------------------------------

    def probe_at(self) -> float | None:
        """When (same clock as ``now``) an idle probe is due, or None if none is."""
        if not self.has_replay or self.inflight is not None or not self.connected:
            return None
        if self._recheck:
            return self._last_live
        if not self._probe_armed or self.probe_after_s is None:
            return None
        return self._last_live + self._probe_gap

    def on_reconnect(self, now: float) -> None:
        """The live socket reconnected at ``now``: the publisher may be a new instance
        (that published nothing we received yet). A barrier: held live messages are
        dropped (a replay fetches them again from whoever publishes now), an outstanding
        request is abandoned, and the anchor is verified before anything else is yielded."""
        self._last_live = now
        if not self.has_replay:
            return
        self._clear_held()
        self._abandon()
        self._attempts = 0
        if not self.connected or self.expected == 0:
            self.inflight = self._join()
        elif self._known(self.expected - 1) is None:
            # Nothing to compare with (just after a snapshot or a stale jump): the new
            # connection may be a new instance, so rebuild from it.
            self._restart(self.expected)
        else:
            self.counters.probes += 1
            self.inflight = self._anchored(PROBE, span=True)

    def on_tick(self, now: float) -> None:
        """The clock reached ``now``: send the idle probe if it is due."""
        at = self.probe_at()
        if at is None or now < at:
            return
        self._recheck = False
        # Quiet on: probe again after twice the wait, up to probe_max_s (None: only once).
        # A burst lost whole (nothing arrived to re-arm the probe) is found that way.
        gap = self._probe_gap
        self._last_live = now
        if self.probe_max_s is None or self.probe_after_s is None:
            self._probe_armed = False
        else:
            self._probe_gap = min(2 * gap, max(self.probe_max_s, self.probe_after_s))
        self.counters.probes += 1
        self.inflight = self._anchored(PROBE, span=True)

    # -- replies -----------------------------------------------------------------------

    def on_reply(self, seq: int, topic: bytes | None, payload: bytes, batch: KVEventBatch) -> None:
        """A decoded replay (or snapshot) reply arrived for the outstanding request.

        ``topic`` is None for vLLM 0.11 replies (no topic frame)."""
        req = self.inflight
        if req is None or not req.sent:
            return
        if topic is None and (req.unattributed or (self.topic is None and self.topic_filter)):
            # vLLM 0.11 replies carry no topic frame and its ROUTER answers whatever the
            # requester filters: until a live message (or SourceSpec.topic) names this
            # publisher's topic, nothing here can be checked against the filter. Not
            # yielded, not counted as an answer; the rest of the same answer neither (a
            # partial answer would look like a buffer that starts late). See on_reply_end.
            req.unattributed += 1
            self.counters.unattributed += 1
            return
        if not self.connected:
            self._connect()
        req.replies += 1
        if req.replies > self.max_replies:
            self._overflow(req, f"more than {self.max_replies} replies to one request")
            return
        if topic is None:
            topic = self.topic if self.topic is not None else b""
        if req.kind == SNAPSHOT:
            if req.snap_tag is None:
                req.snap_tag = seq
            req.snap_bytes += len(payload) * self.held_factor
            if req.snap_bytes > self.max_snapshot_bytes:
                self._overflow(req, f"snapshot larger than max_snapshot_bytes={self.max_snapshot_bytes}")
                return
            req.snap.append((topic, payload, batch))
            return
        if seq > req.last:
            req.last = seq
        if req.first is None:
            req.first = seq
            anchored = req.check is not None or req.purpose == ANCHOR
            if anchored and req.start < seq <= req.anchor:
                # A span request whose start the publisher no longer buffers: what it still
                # has up to the anchor is compared; the seqs before cannot be any more (see
                # on_reply_end).
                known = self._known(seq)
                if known is not None and known != hash(payload):
                    self._restart(seq)
                    return
                req.checked = True
                req.below = True
                req.lost = True
                req.vnext = seq + 1
                return
            if anchored and seq != req.start:
                # No anchor first: nothing in this reply can be trusted to continue what
                # was yielded (a new instance, or a publisher that no longer buffers it).
                self._abandon()
                if seq < req.start:
                    self._restart(seq)
                else:
                    self._beyond_buffer()
                return
            if seq == req.start and anchored:
                # The anchor: the same bytes prove the same publisher instance.
                h = hash(payload)
                if req.check is None:
                    self._remember(seq, h)
                elif h != req.check:
                    self._restart(seq)
                    return
                req.checked = True
                req.below = True
                req.vnext = seq + 1
                return
        e = self.expected
        if seq < e:
            req.below = True
            known = self._known(seq)
            if known is not None and known != hash(payload):
                self._restart(seq)
                return
            self.counters.duplicates += 1
            if seq == req.vnext:
                req.vnext = seq + 1
        elif seq == e:
            if seq == req.vnext:
                req.vnext = seq + 1
            self._yield(seq, topic, payload, batch, True)
            self._drain_held()
        else:
            held = self.held.get(seq)
            if held is not None and held[2] != payload:
                # The publisher that proved itself with the anchor holds other bytes than
                # a live message held for this seq: two instances; rebuild.
                self._restart(seq)
                return
            self._hold(seq, (seq, topic, payload, batch, True))

    def _overflow(self, req: Request, reason: str) -> None:
        self.counters.overflows += 1
        self._abandon()
        self._mark_stale(reason)
        self._live_again()

    def on_reply_end(self) -> None:
        """The end marker of the outstanding request arrived."""
        req = self.inflight
        if req is None or not req.sent:
            return
        if req.unattributed:
            self.inflight = None
            if self.topic is None:
                # Every reply was of unknown topic (see on_reply): the publisher has
                # batches, maybe not of our topic. Claim nothing: "connecting" (no probes)
                # until a live message shows its topic, which then finds the gap from E.
                self.connected = False
                self._probe_armed = False
                return
            # A live message named the topic while this answer came in: ask again, now
            # that every reply can be checked against the filter.
            self._recover()
            self._live_again()
            return
        if not self.connected:
            self._connect()
        self.inflight = None
        if req.kind == SNAPSHOT:
            self._end_snapshot(req)
            return
        if req.first is None and (self.live_high >= req.start or any(s >= req.start for s in self.held)):
            # The publisher has nothing from ``start`` on, yet we saw later seqs live: it
            # is not the instance that sent them.
            self._restart(req.start)
            return
        if req.start < req.e0 and not req.checked:
            # The anchor is not in the reply: a new instance that has not reached it (or
            # holds other bytes there), or a publisher that no longer buffers it.
            if req.first is None or req.first < req.start:
                self._restart(req.start)
                return
            self._beyond_buffer()
            return
        if req.checked and req.last < req.anchor:
            # A span answer that stops before the anchor: its last replies were lost on
            # the way (vLLM 0.11's ROUTER), or the publisher does not have the anchor (another
            # instance; the retries then end in a snapshot, which shows it, or stale).
            self._ask_again(REPROBE if req.purpose in (PROBE, REPROBE) else GAP, span=True)
            return
        if req.checked:
            # The publisher is the instance we followed up to the anchor: held live
            # messages below E whose bytes were unknown are duplicates.
            for s in [s for s in self.held if s < req.e0]:
                self.held_bytes -= len(self.held.pop(s)[2]) * self.held_factor
                self.counters.duplicates += 1
        if req.lost:
            # Seqs taken live since the last check left the publisher's buffer before they
            # could be compared (its buffer is shorter than what arrived between two
            # probes): nothing proves they are the instance that answers now (a restart a
            # forwarder hid, whose first batches were lost, looks exactly like this).
            self._beyond_buffer()
            return
        if req.checked or req.check is None:
            self._link(req)
        if not self._drain_held():
            return
        e = self.expected
        if e > req.e0:
            self._attempts = 0
        missing = bool(self.held) or e <= self.live_high
        if missing and self.held and min(self.held) < e:
            self._recover()  # held live messages below E left to verify
            self._live_again()
            return
        if missing:
            gone = req.first is not None and req.first > e and not req.below
            if gone and req.start <= e:
                self._beyond_buffer()
                return
            self._ask_again(GAP)
            return
        self._attempts = 0
        probe = req.purpose in (PROBE, REPROBE)
        if probe and e == req.e0 and req.start < req.anchor:
            # A span probe checked the seqs taken live; it is a long answer, whose last
            # replies a full ROUTER may have dropped unseen (vLLM 0.11, beyond its HWM): the
            # tail is asked for again from the anchor (a short answer cannot be holed).
            self.inflight = self._anchored(req.purpose)
            return
        if probe and e == req.e0:
            # Nothing was missing: the state is exact now. No news for the consumer,
            # unless the source was not "live" (a probe answered late, a lost tail).
            if req.purpose == REPROBE or self._tail_lost:
                self._tail_lost = False
                self._live_again()
            return
        if req.purpose == VERIFY and e == req.e0:
            return  # nothing was missing: no news for the consumer
        if probe:
            # The probe found a lost tail: the live channel is losing messages (or reaches
            # nobody). Not "live" until a live message arrives or a probe finds nothing
            # new; look again soon.
            self._tail_lost = True
            self._probe_gap = self.probe_after_s or 0.0
        self._live_again()

    def _beyond_buffer(self) -> None:
        """The publisher no longer has the missing batches: a snapshot, else stale."""
        self._attempts = 0
        req = self.inflight = Request(SNAPSHOT, GAP, self.expected, e0=self.expected)
        req.check = self.live_high  # seen live before the snapshot was asked for

    def _end_snapshot(self, req: Request) -> None:
        if not req.snap:
            self._mark_stale("batches to replay or to check are older than the publisher's replay "
                             "buffer, and the publisher does not answer snapshot requests")
            self._live_again()
            return
        r = req.snap_tag
        assert r is not None
        if req.check is not None and r <= req.check:
            # The snapshot's publisher had not yet published a seq we received live
            # before asking: another instance (it restarted). Rebuild from it.
            self._restart(r)
            return
        self.out.append(SourceReset(self.name, "snapshot", r))
        c = self.counters
        flt = self.topic_filter
        for topic, payload, batch in req.snap:
            if flt and not topic.startswith(flt):
                c.filtered += 1  # the same filter as replayed batches
                continue
            self.out.append(SourceBatch(self.name, r - 1, topic, payload, batch, True))
            c.batches += 1
            c.events += len(batch.events)
        self.stale = False
        self.expected = r
        self._forget(r)
        for s in [s for s in self.held if s < r]:
            # Held before the snapshot: covered by it (it was made after they were sent).
            self.held_bytes -= len(self.held.pop(s)[2]) * self.held_factor
        if r > 0:
            # Fetch the bytes of R - 1: later live seqs below R are then checked against the
            # publisher, and a tag it cannot back (a restart since, or a lie) shows at once.
            self.inflight = Request(REPLAY, ANCHOR, r - 1, None, 0.0, r)
            return
        self._recover()
        self._live_again()

    def on_timeout(self) -> None:
        """The outstanding request got no complete answer within the shell's timeout (the
        shell must send the next attempt on a fresh socket: late replies to this one must
        not count)."""
        req = self.inflight
        if req is None:
            return
        c = self.counters
        c.timeouts += 1
        self.generation += 1
        if self.expected > req.e0:
            self._attempts = 0
        self._attempts += 1
        if self._attempts <= self.max_retries or (req.purpose in (JOIN, ANCHOR) and not self.connected):
            # Nobody has answered yet (no publisher, a failed handshake): keep asking,
            # slowly; the source stays "connecting".
            c.retries += 1
            cap = _BACKOFF_CAP_S if self.connected else UNANSWERED_RETRY_MAX_S
            delay = min(self.backoff_s * (2 ** (self._attempts - 1)), cap)
            e = self.expected
            # A probe nobody answers is no evidence that the source is live: its retries
            # are "recovering" (or "stale"), within replay_timeout_s of the probe.
            purpose = REPROBE if req.purpose == PROBE else req.purpose
            if req.kind == SNAPSHOT or (req.purpose == ANCHOR and e == req.e0) or e == 0:
                nxt = Request(req.kind, purpose, req.start, req.check, delay, req.e0)
            else:
                nxt = self._anchored(GAP if purpose in (JOIN, ANCHOR) else purpose, delay,
                                     span=purpose == REPROBE)
            self.inflight = nxt
            return
        self.inflight = None
        self._attempts = 0
        reason = f"no answer to a {req.kind} request after {self.max_retries + 1} attempts"
        if req.purpose == JOIN:
            # The publisher's live channel works but its replay endpoint does not answer:
            # anything before the first live seq is unknown, so only a gap is a loss.
            if not self._drain_held():
                return
            if self.held or self.expected <= self.live_high or self.live_high < 0:
                # A gap, or nothing heard live either: the state cannot be vouched for.
                self.on_request_failed(reason)
                return
            self._live_again()
            return
        self.on_request_failed(reason)

    def on_request_failed(self, reason: str) -> None:
        """The outstanding request (if any) cannot be completed: the state can no longer be
        vouched for, so the source is marked stale."""
        if self.inflight is not None:
            self._abandon()
        self._mark_stale(reason)
        self._live_again()
