"""The two sans-IO state machines of the JetStream layer (no sockets, no clock reads).

* :class:`RelaySource` (one per engine a relay follows): turns the subscriber's items into
  messages to publish, agreeing with any other relay of the same engine on instance
  numbers and message ids. At start-up it knows where the stream stands for its source
  (:class:`~kvstream.jetstream.wire.StreamPosition`, read from the stream's last message)
  and skips what the stream already holds:

  - a batch with ``seq <= pos`` and a timestamp no newer than the stream's last batch is
    one the stream has: skipped; a *newer* one means the engine restarted meanwhile (its
    seqs began again): instance + 1, a ``restart`` reset, then the batch. Timestamps are
    the engine host's clock, so they are only a first guess: the batch at ``pos`` itself
    is compared byte for byte with the stream's last one, and when they differ the
    engine is new after all (a restarted engine whose clock runs behind). So is a batch
    below ``pos`` whose seq this relay published in the current instance with other bytes
    (it keeps references to the last published payloads, ``max_recent_bytes``, for that:
    one engine sends one batch per seq, whatever its clock says). So is an engine
    whose newest batch (the subscriber's ``SourceLive``) is older than the stream's. Then
    the batches skipped on the guess (held meanwhile, up to ``max_held`` /
    ``max_held_bytes``) are published after the reset, and any that did not fit are a
    ``stale`` gap;
  - ``seq == pos + 1``: the stream continues; ``seq > pos + 1``: the batches between left
    the engine's buffer before any relay got them: a ``stale`` notice, then the batch.

  A ``restart`` the subscriber reports puts it back in that state (nothing published):
  the subscriber may only be unable to rule a restart out (it reconnected after a gap of
  its own), and another relay of the engine may have lost nothing.

  While the subscriber is stale (a ``stale`` notice and no reset since), the batches it
  yields are not vouched for (behind a forwarder, held batches of two instances can follow
  one notice): a new instance this relay infers from them is published stale, its reset
  followed by a ``stale`` notice, until the subscriber rebuilds.

* :class:`StreamSource` (one per source a consumer reads): turns stream messages back into
  the subscriber's items with the same per-engine rules as over ZMQ: in seq order, never
  duplicated; a seq jump is a :class:`SourceStale`; a new instance without its reset
  message is a :class:`SourceReset` ``"restart"``.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter
from typing import Any, Callable, Mapping

import msgspec

from kvstream.wire.events import DEFAULT_MAX_PAYLOAD_BYTES, EventDecodeError, KVEventBatch
from kvstream.jetstream import wire
from kvstream.jetstream.wire import StreamPosition
from kvstream.transport.items import SourceBatch, SourceLive, SourceReset, SourceStale
from kvstream.transport.recovery import SourceCounters

__all__ = ["RelaySource", "StreamSource", "SourceState"]

Message = tuple[bytes, dict[str, str]]

_decode_map = msgspec.msgpack.Decoder(KVEventBatch).decode
_events_of = attrgetter("events")


class RelaySource:
    """What a relay publishes for one source; see the module docstring.

    ``known``: the stream's position for this source (None: nothing on the stream).
    :meth:`on_item` returns ``(payload, headers)`` pairs to publish in order.
    """

    __slots__ = ("source", "instance", "pos", "last_ts", "synced", "_topics", "_snap", "skipped", "max_message_bytes",
                 "_doubted",
                 "too_large", "_near_limit", "_digest", "_digest_pos", "_lb_payload", "_held", "_held_bytes", "max_held",
                 "max_held_bytes", "_jump", "_recent", "_recent_bytes", "max_recent_bytes", "_sub_stale")

    def __init__(self, source: str, known: StreamPosition | None = None, *, first_instance: int = 0,
                 max_message_bytes: int = 1 << 62) -> None:
        self.source = source
        self.instance = known.instance if known is not None else first_instance
        self.pos = known.pos if known is not None else -1
        self.last_ts = known.ts if known is not None else 0.0
        self.synced = known is None
        self._digest = known.digest if known is not None else None  # of the batch at _digest_pos
        self._digest_pos = self.pos
        self._lb_payload: bytes | None = None  # the batch at pos, published (digest computed when needed)
        self._held: list[SourceBatch] = []  # skipped on the timestamp guess, until the guess is checked
        self._held_bytes = 0
        self.max_held = 10_000
        """Batches (and ``max_held_bytes`` bytes) held while that check is pending."""
        self.max_held_bytes = 64 << 20
        self._topics: dict[bytes, str] = {}
        self._snap: list[int] | None = None  # [R, next index] while a snapshot's batches flow
        self.skipped = 0
        self._doubted = False  # the subscriber reported a restart this relay has not confirmed
        """Items not published because the stream already held them."""
        self.max_message_bytes = max_message_bytes
        """The server's ``max_payload`` (bytes, headers included; set at construction): a
        batch that does not fit is published as a gap (a ``stale`` notice) instead."""
        self.too_large = 0
        """Batches not published because they exceed ``max_message_bytes``."""
        self._near_limit = max_message_bytes - 1024  # payloads above it get their size computed
        self._jump: tuple[int, int] | None = None  # (first, resume) of the last stale notice published
        # The payloads of the last batches published in this instance (seq -> bytes, oldest
        # first; references to what was published, no copies): while a restart is doubted,
        # an older seq with other bytes than the stream holds proves a new engine.
        self._recent: dict[int, bytes] = {}
        self._recent_bytes = 0
        self.max_recent_bytes = 4 << 20
        """Bytes of recently published payloads kept for that comparison (at least the last one)."""
        # The subscriber said stale and has not rebuilt since (no reset): the batches it
        # yields meanwhile are not vouched for (28832: a newer instance's seq 0, then an
        # older one's 1-7), so a new instance this relay infers from them is stale too.
        self._sub_stale = False

    def _topic(self, topic: bytes) -> str:
        h = self._topics.get(topic)
        if h is None:
            if len(self._topics) > 64:
                self._topics.clear()
            h = self._topics[topic] = wire.encode_topic(topic)
        return h

    def _control(self, item: SourceReset | SourceStale | SourceLive) -> Message:
        payload, headers = wire.control_message(self.source, self.instance, item, self.pos)
        headers[wire.H_TS] = repr(self.last_ts)
        digest = self._last_digest()
        if digest is not None:
            headers[wire.H_LAST] = digest
        return payload, headers

    def _last_digest(self) -> str | None:
        """The digest of the batch at ``pos``, if known."""
        if self._lb_payload is not None:
            self._digest = wire.payload_digest(self._lb_payload)
            self._digest_pos = self.pos
            self._lb_payload = None
        return self._digest if self._digest_pos == self.pos else None

    def on_item(self, item: Any) -> list[Message]:
        """Messages to publish for one subscriber item (possibly none)."""
        cls = type(item)
        if cls is SourceBatch:
            return self._batch(item)
        self._snap = None
        if cls is SourceReset:
            self._sub_stale = False
            self._drop_held()
            if item.reason == "removed":
                return []
            if item.reason == "restart":
                # This relay's subscriber could not tell the engine it reconnected to from
                # a new one (after its own gap, say). Other relays of the engine may well
                # have seen no restart: believe it only when the engine's batches confirm
                # it (the start-up rules: a seq at or below pos with other bytes or a newer
                # timestamp, or a newest seq below pos), else go on in this instance.
                self.synced = False
                self._doubted = True
                return []
            doubted = self._doubted
            self.synced = True
            self._doubted = False
            self._digest = None  # of the batch at a position this reset voids
            self._lb_payload = None
            r = item.seq if item.seq is not None else 0
            if r - 1 < self.pos or (doubted and r - 1 == self.pos):
                # A snapshot behind what was published: another engine (one engine's seqs
                # only grow; its snapshot is tagged with its next seq). A new instance, so
                # that consumers do not take the reset for a late copy. Right after a
                # restart the subscriber reported, a snapshot exactly at the position may
                # be either engine's: its reset would carry the id of the one already
                # stored (the stream would drop it as a copy), so it is a new instance too
                # (if the engine was the same, consumers rebuild the same state).
                self.instance += 1
            self.pos = r - 1
            self._jump = None
            self._forget_recent()
            self._snap = [self.pos + 1, 0]
            return [self._control(item)]
        if cls is SourceStale:
            self._sub_stale = True
            if not self.synced:
                self.skipped += 1
                if not self._doubted:
                    return []  # joining: the next batch decides what the stream is missing
                # The subscriber could not rule a restart out and has now lost what follows:
                # nothing says whether the stream still shows this engine (it may never
                # publish again). The next batch decides what the stream is missing; until
                # then the stream must not look exact: a notice that the state is
                # unverified from pos + 1 on (a consumer that another relay already took
                # beyond it reads it as covered).
                return [self._control(SourceStale(self.source, item.reason, self.pos + 1, self.pos + 1))]
            self._lb_payload = None
            self._jump = (item.first_missing_seq, item.resume_seq)
            self.pos = item.resume_seq - 1
            return [self._control(item)]
        if cls is SourceLive:
            out: list[Message] = []
            if not self.synced:
                if item.seq > self.pos:
                    return out
                if item.seq < self.pos:
                    # The engine's newest batch is older than the stream's: it is not the
                    # engine that wrote the stream (one engine's seqs only grow), whatever
                    # the timestamps said of the batches skipped so far.
                    out = self._new_engine(self._held[0].seq if self._held else item.seq + 1)
            self.synced = True
            self._doubted = False
            self._drop_held()
            out.append(self._control(SourceLive(self.source, self.pos)))
            return out
        raise TypeError(f"not a subscriber item: {item!r:.80}")

    def gap_message(self, first_missing: int, reason: str) -> Message:
        """The ``stale`` notice for batches ``first_missing .. pos`` that never reached the
        stream (it refused them and the relay gave up), so that the stream says what it
        lacks; the batches after ``pos`` follow it as usual."""
        return self._control(SourceStale(self.source, reason, first_missing, self.pos + 1))

    def _batch(self, b: SourceBatch) -> list[Message]:
        q = b.seq
        snap = self._snap
        if snap is not None and b.replayed and q == snap[0] - 1:
            i = snap[1]
            snap[1] = i + 1
            return [(b.payload, wire.batch_headers(self.source, self.instance, q, self._topic(b.topic),
                                                   replayed=True, snapshot=(snap[0], i)))]
        self._snap = None
        out: list[Message] = []
        if not self.synced:
            j = self._jump
            if j is not None and j[0] <= q <= self.pos == j[1] - 1:
                # A seq the last stale notice skipped, no batch published since: it is
                # newer than last_ts whichever engine sent it. The batches after it decide.
                self.skipped += 1
                self._hold(b)
                return out
            if q <= self.pos:
                last = self._last_digest()
                if q == self.pos and last is not None:
                    new_engine = wire.payload_digest(b.payload) != last  # the one exact test there is
                elif (prev := self._recent.get(q)) is not None:
                    # A seq this relay published in this instance: one engine sends one
                    # batch per seq, so other bytes are another engine (91499: two restarts
                    # within a millisecond, the stream's seq 0 from the first new instance,
                    # the engine's from the second, whose clock said older).
                    new_engine = prev != b.payload
                else:
                    new_engine = b.batch.ts > self.last_ts
                if not new_engine:
                    self.skipped += 1
                    if q == self.pos and last is not None:
                        self._drop_held()  # the same engine: the stream has them all
                        self.synced = True
                        self._doubted = False
                    else:
                        self._hold(b)
                    return out  # the stream has it
                out = self._new_engine(self._held[0].seq if self._held else q)
            self.synced = True
            self._doubted = False
            self._drop_held()
        if q > self.pos + 1:
            out.append(self._control(SourceStale(
                self.source, "batches left the engine's buffer before a relay read them",
                self.pos + 1, q)))
        elif q <= self.pos:
            self.skipped += 1
            return out  # an older batch of this instance (the subscriber never yields one)
        self.pos = q
        self._jump = None  # a batch published since the last stale notice
        self.last_ts = b.batch.ts
        headers = wire.batch_headers(self.source, self.instance, q, self._topic(b.topic), replayed=b.replayed)
        if len(b.payload) > self._near_limit and wire.message_size(b.payload, headers) > self.max_message_bytes:
            # The server would refuse it (and close the connection) on every try: the
            # consumers get a gap they can see instead of a relay stuck on one message.
            self.too_large += 1
            out.append(self._control(SourceStale(
                self.source, f"a batch of {len(b.payload)} bytes is over the NATS server's max_payload of "
                f"{self.max_message_bytes} bytes (raise max_payload in the server's configuration)", q, q + 1)))
            self._lb_payload = None
            return out
        self._lb_payload = b.payload  # the batch at pos (any other change of pos clears it)
        self._recent[q] = b.payload
        self._recent_bytes += len(b.payload)
        if self._recent_bytes > self.max_recent_bytes:
            self._trim_recent()
        out.append((b.payload, headers))
        return out

    def _new_engine(self, first_seq: int) -> list[Message]:
        """The engine restarted while no relay ran (its seqs began again): instance + 1, a
        ``restart`` reset, then the batches skipped meanwhile."""
        self.instance += 1
        self.pos = -1
        self._jump = None
        self._forget_recent()
        self._digest = None
        self._lb_payload = None
        self.synced = True
        self._doubted = False
        held = self._held
        self._drop_held()
        self.skipped -= len(held)
        out = [self._control(SourceReset(self.source, "restart", first_seq))]
        if self._sub_stale:
            # The subscriber is stale (it said so, and has not rebuilt since): what it
            # yields now is not vouched for, whichever instance it looks like (behind a
            # forwarder, held batches of two instances can follow one stale notice). The
            # new instance is unverified from its start until the subscriber rebuilds.
            out.append(self._control(SourceStale(
                self.source, "a new engine instance found while the subscriber's state is unverified",
                0, 0)))
        for hb in held:
            out += self._batch(hb)
        return out

    def _trim_recent(self) -> None:
        # Keep the newest payloads up to half the bound (at least one), in a fresh dict:
        # amortized over the inserts since the last trim, and no deleted slots to skip.
        keep: list[tuple[int, bytes]] = []
        total = 0
        half = self.max_recent_bytes // 2
        for seq, p in reversed(self._recent.items()):
            if keep and total + len(p) > half:
                break
            keep.append((seq, p))
            total += len(p)
        keep.reverse()
        self._recent = dict(keep)
        self._recent_bytes = total

    def _forget_recent(self) -> None:
        if self._recent:
            self._recent = {}
            self._recent_bytes = 0

    def _hold(self, b: SourceBatch) -> None:
        if self._held and b.seq <= self._held[-1].seq:
            self._drop_held()  # seqs went back: whatever was held is not this engine's run
        self._held.append(b)
        self._held_bytes += len(b.payload)
        while len(self._held) > self.max_held or self._held_bytes > self.max_held_bytes:
            self._held_bytes -= len(self._held.pop(0).payload)

    def _drop_held(self) -> None:
        if self._held:
            self._held = []
            self._held_bytes = 0


class SourceState:
    """A consumer's position for one source: engine ``instance`` (None: none seen),
    ``expected`` (next engine seq), ``stale``, and ``sseq`` (the stream sequence of the
    last message applied). Snapshots store and restore exactly this."""

    __slots__ = ("instance", "expected", "stale", "sseq")

    def __init__(self, instance: int | None = None, expected: int = 0, stale: bool = False, sseq: int = 0) -> None:
        self.instance = instance
        self.expected = expected
        self.stale = stale
        self.sseq = sseq

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able form."""
        return {"instance": self.instance, "expected": self.expected, "stale": self.stale, "sseq": self.sseq}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SourceState":
        """Inverse of :meth:`as_dict`."""
        inst = d.get("instance")
        return cls(None if inst is None else int(inst), int(d["expected"]), bool(d["stale"]), int(d["sseq"]))


class StreamSource:
    """Turns one source's stream messages into subscriber items (appended to ``out``).

    ``decode``: payload bytes -> :class:`KVEventBatch` (raises ``EventDecodeError``).
    ``state``: where to start (from a snapshot); messages at or below ``state.sseq`` are
    skipped.
    """

    __slots__ = ("name", "state", "counters", "out", "_decode", "_topics", "_btopics", "max_payload_bytes", "_snap")

    def __init__(self, name: str, decode: Callable[[bytes], KVEventBatch], out: list[Any],
                 state: SourceState | None = None, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self.name = name
        self.state = state if state is not None else SourceState()
        self.counters = SourceCounters()
        self.out = out
        self._decode = decode
        self._topics: dict[str, bytes] = {}
        self._btopics: dict[bytes, bytes] = {}
        self.max_payload_bytes = max_payload_bytes
        """Payloads up to this size (bytes) may take the one-call decode of :meth:`on_batch`
        (larger ones go to ``decode``, which rejects them)."""
        self._snap = -1  # R of the snapshot reset whose batches may follow (-1: none)

    def on_batch(self, sseq: int, instance: int, seq: int, topic_header: bytes, payload: bytes, now: float) -> None:
        """A plain batch message (headers ``Kv-Seq`` ``seq``, ``Kv-Instance`` ``instance``,
        ``Kv-Topic`` ``topic_header``; no ``Kv-Kind``, not replayed), already parsed. The
        common case (the next seq of the current instance) is handled here in a few steps;
        anything else goes through :meth:`on_message` with the same meaning."""
        st = self.state
        if sseq <= st.sseq or instance != st.instance or seq != st.expected:
            self.on_message(sseq, {wire.H_SEQ: str(seq), wire.H_INSTANCE: str(instance),
                                   wire.H_TOPIC: topic_header.decode("utf-8", "replace")}, payload, now)
            return
        st.sseq = sseq
        topic = self._btopics.get(topic_header)
        if topic is None:
            if len(self._btopics) > 64:
                self._btopics.clear()
            topic = self._btopics[topic_header] = wire.decode_topic(topic_header.decode("utf-8", "replace"))
        c = self.counters
        try:
            # The shape vLLM >= 0.26 sends, in one typed call (what ``decode`` tries first
            # too); anything else (0.11 arrays, unknown events, damage) goes to ``decode``.
            if len(payload) > self.max_payload_bytes:
                raise msgspec.DecodeError
            batch = _decode_map(payload)
        except msgspec.MsgspecError:
            try:
                batch = self._decode(payload)
            except EventDecodeError:
                c.decode_errors += 1
                return  # its seq now counts as missing: the next batch marks the gap
        self.out.append(SourceBatch(self.name, seq, topic, payload, batch, False))
        c.batches += 1
        c.events += len(batch.events)
        st.expected = seq + 1
        c.lag_s = now - batch.ts

    def on_batch_run(self, sseqs: list[int], instance: int, seqs: list[int], topic_header: bytes,
                     payloads: list[bytes], now: float) -> None:
        """Consecutive plain batch messages of one engine instance and topic, as
        :meth:`on_batch` takes them one by one (``sseqs`` increasing; ``seqs`` the engine
        seqs): the same items and counters. When they are the next seqs of the current
        instance and every payload decodes in vLLM's map shape, the run is tracked, decoded
        and handed over in a few calls for all of it; otherwise (a gap, a restart, an old
        message, a payload that needs the general decoder or is damaged) it goes through
        :meth:`on_batch` message by message."""
        st = self.state
        k = len(seqs)
        e = st.expected
        if (sseqs[0] <= st.sseq or instance != st.instance or seqs[0] != e or seqs[-1] != e + k - 1
                or seqs != list(range(e, e + k)) or max(map(len, payloads)) > self.max_payload_bytes):
            batches = None
        else:
            try:
                batches = list(map(_decode_map, payloads))
            except msgspec.MsgspecError:
                batches = None
        if batches is None:
            for sseq, seq, payload in zip(sseqs, seqs, payloads):
                self.on_batch(sseq, instance, seq, topic_header, payload, now)
            return
        topic = self._btopics.get(topic_header)
        if topic is None:
            if len(self._btopics) > 64:
                self._btopics.clear()
            topic = self._btopics[topic_header] = wire.decode_topic(topic_header.decode("utf-8", "replace"))
        self.out.extend(map(SourceBatch, repeat(self.name), seqs, repeat(topic), payloads, batches, repeat(False)))
        st.sseq = sseqs[-1]
        st.expected = e + k
        c = self.counters
        c.batches += k
        c.events += sum(map(len, map(_events_of, batches)))
        c.lag_s = now - batches[-1].ts

    def on_blocked(self, reason: str) -> None:
        """A relay said (out of band) that this source's messages do not reach the stream
        any more: what the stream holds is not the engine's state. Stale at once (one
        notice), until a reset; the relay's in-band ``stale`` notice follows once the stream
        takes messages again."""
        st = self.state
        if st.stale:
            return
        st.stale = True
        self.counters.stale_marks += 1
        self.out.append(SourceStale(self.name, reason, st.expected, st.expected))

    def on_message(self, sseq: int, headers: Mapping[str, str] | None, payload: bytes, now: float) -> None:
        """One message of this source's subject, stream sequence ``sseq``."""
        st = self.state
        c = self.counters
        if sseq <= st.sseq:
            c.duplicates += 1
            return
        st.sseq = sseq
        if not headers:
            c.frame_errors += 1
            return
        try:
            inst = int(headers[wire.H_INSTANCE])
            kind = headers.get(wire.H_KIND)
        except (KeyError, ValueError):
            c.frame_errors += 1
            return
        name = self.name
        out = self.out
        fresh = st.instance is None or inst > st.instance  # the first message of this instance
        if st.instance is None:
            st.instance = inst
        elif inst < st.instance:
            c.duplicates += 1  # a late copy from an older engine instance
            return
        elif inst > st.instance:
            st.instance = inst
            if kind != "reset":  # the new instance's reset message is not on the stream
                c.restarts += 1
                out.append(SourceReset(name, "restart", _int(headers.get(wire.H_SEQ), 0)))
                st.expected = 0
                st.stale = False
        if kind is None:
            try:
                seq = int(headers[wire.H_SEQ])
                topic = self._topics.get(headers[wire.H_TOPIC])
                if topic is None:
                    th = headers[wire.H_TOPIC]
                    topic = self._topics[th] = wire.decode_topic(th)
            except (KeyError, ValueError):
                c.frame_errors += 1
                return
            e = st.expected
            if seq < e:
                c.duplicates += 1
                return
            try:
                batch = self._decode(payload)
            except EventDecodeError:
                c.decode_errors += 1
                return  # its seq now counts as missing: the next batch marks the gap
            if seq > e:
                c.gaps += 1
                c.stale_marks += 1
                st.stale = True
                why = ("older batches are not retained in the stream" if c.batches == 0
                       else "batches missing from the stream")
                out.append(SourceStale(name, why, e, seq))
            out.append(SourceBatch(name, seq, topic, payload, batch, wire.H_REPLAYED in headers))
            c.batches += 1
            c.events += len(batch.events)
            st.expected = seq + 1
            c.lag_s = now - batch.ts
            return
        if kind == wire.KIND_SNAPSHOT:
            try:
                seq = int(headers[wire.H_SEQ])
                topic = wire.decode_topic(headers[wire.H_TOPIC])
            except (KeyError, ValueError):
                c.frame_errors += 1
                return
            if seq != self._snap - 1 or st.expected != self._snap:  # not right after its reset: a late copy
                c.duplicates += 1
                return
            try:
                batch = self._decode(payload)
            except EventDecodeError:
                c.decode_errors += 1
                return
            out.append(SourceBatch(name, seq, topic, payload, batch, True))
            c.batches += 1
            c.events += len(batch.events)
            return
        try:
            item = wire.decode_control(name, payload)
        except wire.WireError:
            c.frame_errors += 1
            return
        if type(item) is SourceReset:
            # A reset is the first message of its instance, or a snapshot at or beyond where
            # the consumer is; otherwise it is a late copy (a relay resending after the
            # duplicate window) and must not undo what followed it.
            if item.reason == "restart":
                if not fresh:
                    c.duplicates += 1
                    return
                c.restarts += 1
                st.expected = 0
                self._snap = -1
            else:
                r = item.seq if item.seq is not None else 0
                if not fresh and r < st.expected:
                    c.duplicates += 1
                    return
                c.snapshots += 1
                st.expected = r
                self._snap = r
            st.stale = False
            out.append(item)
        elif type(item) is SourceStale:
            if item.resume_seq < st.expected or (item.resume_seq == st.expected and st.stale):
                # Covered: later batches are applied already (another relay's), or it is stale.
                c.duplicates += 1
                return
            item.first_missing_seq = max(item.first_missing_seq, st.expected)
            st.expected = item.resume_seq
            st.stale = True
            c.stale_marks += 1
            out.append(item)
        else:
            out.append(SourceLive(name, st.expected - 1))


def _int(v: str | None, default: int) -> int:
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default
