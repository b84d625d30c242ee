"""A JetStream consumer with the :class:`~kvstream.transport.subscriber.Subscriber`'s
interface: an async context manager and async iterator of the same stream items, with
per-source health and counters.

::

    async with JetStreamSource("nats://nats:4222/KV_EVENTS") as sub:
        async for item in sub:          # SourceBatch / SourceReset / SourceStale / SourceLive
            ...

It reads with an *ordered* push consumer of its own making: ephemeral, no acks, flow
control and idle heartbeats. The stream sequence of every message is checked; on a
delivery gap, a missed heartbeat or a reconnect the consumer is made again from the last
stream sequence applied + 1, so nothing is lost or repeated across NATS restarts. A
consumer started late gets everything still retained, in order, then follows live.
Back-pressure: while more than ``max_buffered_items`` items wait, flow-control replies are
held back, so the server stops sending.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice, repeat
from operator import lt, methodcaller
from typing import Any, AsyncIterator, Iterable, Mapping

import anyio
import anyio.lowlevel

from kvstream.wire.events import DEFAULT_MAX_PAYLOAD_BYTES, EventDecoder
from kvstream.jetstream import wire
from kvstream.jetstream._nats import connect, current_url, open_data_connection
from kvstream.jetstream._proto import NatsProtocolError, ProtocolReader, parse_headers, pub_op
from kvstream.jetstream.config import NatsSource, parse_nats_url
from kvstream.jetstream.errors import JetStreamConfigError
from kvstream.jetstream.tracking import SourceState, StreamSource
from kvstream.routing.payloads import read_payload_batches
from kvstream.transport.items import SourceBatch
from kvstream.transport.items import StreamItem
from kvstream.transport.recovery import SourceCounters
from kvstream.transport.lifetime import Lifetime
from kvstream.transport.subscriber import SourceHealth

__all__ = ["JetStreamSource", "ConsumerHealth"]

log = logging.getLogger("kvstream.jetstream.source")
_RECV = 1 << 20  # bytes per socket read: ~2,000 batch deliveries per wake-up...
# ...parsed and handed to the consumer in slices of this many bytes (~50 deliveries, each
# slice's run tracked and decoded in bulk) with a yield between, so that a batch is applied
# while its decoded objects are still in the CPU cache (about a quarter less per batch than
# decoding 2,000, then applying 2,000), and so that a slice's decoded batches (~10 lists
# each) stay under the garbage collector's young-generation threshold (700 objects): with
# 64 KiB slices a collection ran for nearly every slice (~1,000 per 100,000 batches), with
# 32 KiB about 25.
_SLICE = 1 << 15

# The delivery of a batch exactly as the relay publishes it (wire.batch_headers, in that
# order, not replayed): ``HMSG subject 1 $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.
# <dseq>.<ts>.<pending> hlen total`` and its header block, parsed in one regex call.
# Groups: 1 subject, 2 sseq, 3 dseq, 4 hlen, 5 total, 6 Kv-Seq, 7 Kv-Instance, 8 Kv-Topic.
# Every other message (control, snapshot, replayed, another server's reply layout, a
# message id with non-ASCII bytes) takes the general path. Character classes are ASCII
# ranges (subject tokens and topics are printable ASCII by construction, see wire.py):
# about a sixth cheaper to match than negated sets.
_BATCH_DELIVERY = re.compile(
    rb"HMSG ([!-~]+) 1 \$JS\.ACK\.[!-\-/-~]+\.[!-\-/-~]+\.[0-9]+\.([0-9]+)\.([0-9]+)\.[0-9]+\.[0-9]+ ([0-9]+) ([0-9]+)\r\n"
    rb"NATS/1\.0\r\nNats-Msg-Id: [ -~]*\r\nKv-Seq: ([0-9]+)\r\nKv-Instance: ([0-9]+)\r\nKv-Topic: ([ -~]*)\r\n\r\n")
_groups = methodcaller("group", 1, 2, 3, 6, 7, 8)  # what a run needs of a _BATCH_DELIVERY match


@dataclass(frozen=True, slots=True)
class ConsumerHealth:
    """The stream side of a :class:`JetStreamSource`: ``state`` is ``"live"``,
    ``"connecting"`` or ``"recovering"`` (making its consumer again); ``last_sseq`` the
    last stream sequence applied; ``resets`` how often the consumer was made again."""

    url: str
    stream: str
    state: str
    last_sseq: int
    resets: int
    last_error: str | None
    fast_deliveries: int = 0
    """Deliveries parsed on the fast path (a batch in the relay's exact layout)."""
    new_streams: int = 0
    """Times the stream turned out to be another one than the positions were read from
    (deleted and made again, or older than a snapshot): the positions were dropped."""


class JetStreamSource:
    """Reads kvstream items from a JetStream stream (see the module docstring).

    ``url``: ``nats://HOST:PORT[/STREAM][?source=NAME...]`` (or a parsed
    :class:`NatsSource`); ``sources``: names to follow (added to the URL's; empty: all).
    ``state``: per-source start positions (from a snapshot: :class:`SourceState` by
    source; the stream is read from the lowest ``sseq`` + 1). ``start_sseq``: first stream
    sequence to read when no state says otherwise (default 1: everything retained).
    ``heartbeat_s``: the consumer's idle heartbeat (seconds; three missed ones make it
    again). ``max_buffered_items``, ``unknown_events`` and ``max_payload_bytes`` as for
    :class:`~kvstream.transport.subscriber.Subscriber`; ``curve`` must be None (CURVE is
    ZMQ's; it is accepted so that callers can pass their subscriber options unchanged).
    """

    def __init__(
        self,
        url: str | NatsSource,
        *,
        sources: Iterable[str] = (),
        state: Mapping[str, SourceState] | None = None,
        start_sseq: int = 1,
        heartbeat_s: float = 1.0,
        max_buffered_items: int = 10_000,
        unknown_events: str = "skip",
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        name: str = "kvstream-consumer",
        curve: Any = None,
    ) -> None:
        self.spec = parse_nats_url(url) if isinstance(url, str) else url
        if curve is not None:
            raise JetStreamConfigError("CURVE applies to ZMQ sources; a nats:// URL takes user:password@ "
                                       "credentials instead")
        self._filter = set(self.spec.sources) | set(sources)
        self.heartbeat_s = heartbeat_s
        self.max_buffered_items = max_buffered_items
        self.name = name
        self._decode = EventDecoder(max_payload_bytes=max_payload_bytes,
                                    unknown_events=unknown_events).decode  # type: ignore[arg-type]
        self._max_payload = max_payload_bytes
        self._prefix = self.spec.subject_prefix
        self._plen = len(self._prefix) + 1
        self._src: dict[str, StreamSource] = {}
        self._by_subject: dict[str, StreamSource | None] = {}
        self._by_bsubject: dict[bytes, StreamSource | None] = {}
        self._topics: dict[bytes, bytes] = {}  # Kv-Topic header -> topic frame
        self._now = 0.0
        self._reader: ProtocolReader | None = None
        self._fast_done = 0
        self._pending_out: list[Any] = []
        self._out: deque[StreamItem] = deque()
        self._out_wait: anyio.Event | None = None
        self._closed = True
        self._sseq = start_sseq - 1
        for name_, st in (state or {}).items():
            self._src[name_] = StreamSource(name_, self._decode, self._pending_out, st,
                                            max_payload_bytes=max_payload_bytes)
        if state:
            self._sseq = min(st.sseq for st in state.values())
        self._nc: Any = None
        self._life = Lifetime()
        self._inbox = ""
        self._wire_out = bytearray()
        self._wire_wake = anyio.Event()
        self._consumer: str | None = None
        self._dseq = 0
        self._reset = anyio.Event()
        self._fc_held: str | None = None
        self._last_activity = 0.0
        self._state = "connecting"
        self._resets = 0
        self._last_error: str | None = None
        self._gen = 0
        self._stream_created: str | None = None
        self._new_streams = 0
        self._status_subject = wire.status_subject(self.spec.stream)
        self.relay_notices = 0
        """Status notices of relays that cannot publish into the stream (see
        :func:`kvstream.jetstream.wire.status_subject`)."""

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> "JetStreamSource":
        self._life = life = Lifetime()
        async with life.opening():
            self._nc = await connect(self.spec.url, name=self.name, reconnected_cb=self._on_reconnect)
            life.on_close(self._nc.close)
            self._closed = False
            await life.start(self._drive, name="kvstream-jetstream-consumer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closed = True
        try:
            await self._life.aclose()
        finally:
            w = self._out_wait
            if w is not None:
                w.set()

    @property
    def sources(self) -> list[str]:
        """Names of the sources seen (or asked for) so far."""
        return list(self._src)

    def add_source(self, spec: Any) -> None:
        """Follow one more source (only meaningful with a source filter)."""
        name = getattr(spec, "source", spec)
        if self._filter and name not in self._filter:
            self._filter.add(name)
            self._by_subject.clear()
            self._by_bsubject.clear()
            self._reset.set()  # the consumer's filter changes

    def remove_source(self, name: str) -> None:
        """Stop following ``name``; yields ``SourceReset(reason="removed")`` for it."""
        from kvstream.transport.items import SourceReset

        if self._src.pop(name, None) is None:
            raise KeyError(f"no source named {name!r}; sources: {sorted(self._src)}")
        self._filter.discard(name)
        if not self._filter:
            self._filter = set(self._src)
        self._by_subject.clear()
        self._by_bsubject.clear()
        self._push([SourceReset(name, "removed", None)])

    def health(self) -> dict[str, SourceHealth]:
        """Per-source state and counters, keyed by source name."""
        out = {}
        recovering = self._state != "live"
        for name, s in self._src.items():
            state = "recovering" if recovering else ("stale" if s.state.stale else "live")
            out[name] = SourceHealth(name, self.spec.url, state, s.state.expected - 1, s.counters.as_dict())
        return out

    def consumer_health(self) -> ConsumerHealth:
        """The stream side: connection, consumer, last stream sequence."""
        r = self._reader
        return ConsumerHealth(self.spec.url, self.spec.stream, self._state, self._sseq, self._resets,
                              self._last_error, self._fast_done + (r.fast_hits if r is not None else 0),
                              self._new_streams)

    @property
    def stream_created(self) -> str | None:
        """When the stream the positions (:meth:`states`) refer to was created (ISO 8601,
        as the server reports it; None before the first consumer was made): a stream
        deleted and made again under the same name has another one."""
        return self._stream_created

    def counters(self, name: str) -> SourceCounters:
        """The live counters object of source ``name``."""
        return self._src[name].counters

    def states(self) -> dict[str, SourceState]:
        """Each source's position (what a snapshot stores), copied."""
        return {n: SourceState.from_dict(s.state.as_dict()) for n, s in self._src.items()}

    @property
    def last_sseq(self) -> int:
        """The stream sequence of the last message read (0: none)."""
        return self._sseq

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
        # No await between taking an item and returning it: a snapshot taken while the
        # queue is empty then matches what the consumer has applied.
        if self._fc_held is not None and len(out) <= self.max_buffered_items // 2:
            self._release_fc()
        return item

    @property
    def ready(self) -> int:
        """Items waiting for the consumer right now."""
        return len(self._out)

    def get_nowait(self) -> list[StreamItem]:
        """Every item ready now (possibly none), without waiting."""
        items = list(self._out)
        self._out.clear()
        if self._fc_held is not None:
            self._release_fc()
        return items

    def _push(self, items: list[Any]) -> None:
        self._out.extend(items)
        w = self._out_wait
        if w is not None:
            self._out_wait = None
            w.set()

    def _release_fc(self) -> None:
        reply, self._fc_held = self._fc_held, None
        if reply is not None:
            self._send(pub_op(reply))

    def _send(self, data: bytes) -> None:
        self._wire_out += data
        self._wire_wake.set()

    # -- the consumer ------------------------------------------------------------------

    def _source_for(self, subject: str) -> StreamSource | None:
        s = self._by_subject.get(subject, False)
        if s is False:
            name = wire.source_from_token(subject[self._plen:])
            if self._filter and name not in self._filter:
                s = None
            else:
                s = self._src.get(name)
                if s is None:
                    s = self._src[name] = StreamSource(name, self._decode, self._pending_out,
                                                      max_payload_bytes=self._max_payload)
            self._by_subject[subject] = s
        return s  # type: ignore[return-value]

    def _on_raw(self, subject: str, reply: str, hblock: bytes | None, payload: bytes) -> None:
        """One delivery on the data connection (called by the protocol reader); what it
        yields waits in ``_pending_out`` until the reader's chunk is done (:meth:`_flush`)."""
        if subject == self._status_subject:
            self._on_status(payload)
            return
        if hblock is not None and hblock[8:9] == b" ":  # an inline status: flow control, heartbeat
            h = parse_headers(hblock)
            status = h.get("Status")
            if status == "100" and reply:  # flow control request
                if len(self._out) + len(self._pending_out) > self.max_buffered_items:
                    self._fc_held = reply
                else:
                    self._send(pub_op(reply))
            elif status == "100":  # idle heartbeat: did we miss anything?
                last = h.get("Nats-Last-Consumer")
                if last is not None and last.isdigit() and int(last) != self._dseq:
                    self._reset.set()
            else:  # 409 consumer deleted, leadership change, ...: make it again
                self._last_error = f"status {status} {h.get('Description', '')}".strip()
                self._reset.set()
            return
        # One SUB on this connection: every message is a delivery of our consumer, on its
        # original subject, with the $JS.ACK reply that carries its sequences.
        t = reply.split(".")
        try:
            if len(t) == 9:
                sseq, dseq = int(t[5]), int(t[6])
            else:
                sseq, dseq = int(t[7]), int(t[8])
        except (ValueError, IndexError):
            self._reset.set()
            return
        if dseq != self._dseq + 1:
            self._reset.set()
            return
        self._dseq = dseq
        self._sseq = sseq
        self._state = "live"
        s = self._source_for(subject)
        if s is None:
            return
        s.on_message(sseq, parse_headers(hblock) if hblock is not None else None, payload, self._now)

    def _on_status(self, payload: bytes) -> None:
        """A relay cannot publish into the stream: its sources go stale (never ``live`` while
        the stream lacks their batches)."""
        try:
            blocked, error = wire.decode_blocked_notice(payload)
        except wire.WireError:
            return
        self.relay_notices += 1
        reason = f"the relay cannot publish into stream {self.spec.stream}: {error}"
        for name in blocked:
            if self._filter and name not in self._filter:
                continue
            s = self._source_for(f"{self._prefix}.{wire.subject_token(name)}")
            if s is not None:
                s.on_blocked(reason)

    def _on_fast(self, m: "re.Match[bytes]", payload: bytes) -> None:
        """One batch delivery in the relay's exact layout (see ``_BATCH_DELIVERY``)."""
        subject, sseq_b, dseq_b, _, _, seq, inst, topic = m.groups()
        dseq = int(dseq_b)
        if dseq != self._dseq + 1:
            self._reset.set()
            return
        self._dseq = dseq
        self._sseq = sseq = int(sseq_b)
        self._state = "live"
        s = self._by_bsubject.get(subject, False)
        if s is False:
            s = self._by_bsubject[subject] = self._source_for(subject.decode())
        if s is not None:
            s.on_batch(sseq, int(inst), int(seq), topic, payload, self._now)  # type: ignore[union-attr]

    def _on_fast_run(self, ms: list["re.Match[bytes]"], payloads: list[bytes]) -> None:
        """A run of batch deliveries in the relay's exact layout (see ``_BATCH_DELIVERY``),
        in order. Delivery and stream sequences are checked for the whole run at once, and
        each stretch of one source (engine instance, topic) goes to
        :meth:`StreamSource.on_batch_run`; a run that is not plainly consecutive goes
        message by message (:meth:`_on_fast`), with the same meaning."""
        k = len(ms)
        if k < 4:
            for m, p in zip(ms, payloads):
                self._on_fast(m, p)
            return
        subjects, sseq_b, dseq_b, seq_b, inst_b, topics = zip(*map(_groups, ms))
        d0 = self._dseq + 1
        dseqs = list(map(int, dseq_b))
        sseqs = list(map(int, sseq_b))
        if dseqs != list(range(d0, d0 + k)) or not all(map(lt, sseqs, islice(sseqs, 1, None))):
            for m, p in zip(ms, payloads):
                self._on_fast(m, p)
            return
        self._dseq = d0 + k - 1
        self._sseq = sseqs[-1]
        self._state = "live"
        now = self._now
        seqs = list(map(int, seq_b))
        # Stretches of one (subject, instance, topic), in order; in a stream of one engine
        # (or engines publishing in bursts) that is the whole run or a few stretches.
        if subjects.count(subjects[0]) == k and inst_b.count(inst_b[0]) == k and topics.count(topics[0]) == k:
            src = self._by_bsubject.get(subjects[0], False)
            if src is False:
                src = self._by_bsubject[subjects[0]] = self._source_for(subjects[0].decode())
            if src is not None:
                self._run(src, sseqs, int(inst_b[0]), seqs, topics[0], payloads, now)  # type: ignore[arg-type]
            return
        i = 0
        while i < k:
            subject = subjects[i]
            inst = inst_b[i]
            topic = topics[i]
            j = i + 1
            while j < k and subjects[j] == subject and inst_b[j] == inst and topics[j] == topic:
                j += 1
            src = self._by_bsubject.get(subject, False)
            if src is False:
                src = self._by_bsubject[subject] = self._source_for(subject.decode())
            if src is not None:
                if j - i == 1:
                    src.on_batch(sseqs[i], int(inst), seqs[i], topic, payloads[i], now)  # type: ignore[union-attr]
                else:
                    self._run(src, sseqs[i:j], int(inst), seqs[i:j], topic, payloads[i:j], now)  # type: ignore[arg-type]
            i = j

    def _run(self, src: StreamSource, sseqs: list[int], instance: int, seqs: list[int], topic_header: bytes,
             payloads: list[bytes], now: float) -> None:
        """A run of one source's plain batch deliveries (as :meth:`StreamSource.on_batch_run`
        takes them). When they are the next seqs of its current instance and the native
        reader takes every payload, their items carry
        :class:`~kvstream.routing.payloads.PayloadBatch` es: read natively (about a fifth
        of decoding them into Python objects), applied by the index from their columns,
        decoded only if someone reads ``.events``. Anything else (a gap, a restart, an
        old message, a payload the native reader leaves to the decoder) is the tracker's,
        with the same items and counters either way."""
        st = src.state
        k = len(seqs)
        e = st.expected
        batches = None
        if (sseqs[0] > st.sseq and instance == st.instance and seqs[0] == e and seqs[-1] == e + k - 1
                and seqs == list(range(e, e + k))):
            batches = read_payload_batches(payloads, src.max_payload_bytes, self._decode)
        if batches is None:
            src.on_batch_run(sseqs, instance, seqs, topic_header, payloads, now)
            return
        topic = self._topics.get(topic_header)
        if topic is None:
            if len(self._topics) > 64:
                self._topics.clear()
            topic = self._topics[topic_header] = wire.decode_topic(topic_header.decode("utf-8", "replace"))
        src.out.extend(map(SourceBatch, repeat(src.name), seqs, repeat(topic), payloads, batches, repeat(False)))
        st.sseq = sseqs[-1]
        st.expected = e + k
        c = src.counters
        c.batches += k
        c.events += sum(map(len, batches))
        c.lag_s = now - batches[-1].ts

    def _flush(self) -> None:
        """Hand what the last chunk of deliveries yielded to the consumer, in one step."""
        po = self._pending_out
        if po:
            self._push(po)
            po.clear()

    async def _on_reconnect(self) -> None:
        self._reset.set()

    async def _make_consumer(self) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        js = self._nc.jetstream()
        if self._consumer is not None:
            name, self._consumer = self._consumer, None
            try:
                await js.delete_consumer(self.spec.stream, name)
            except Exception:  # noqa: BLE001 - it expires on its own (inactive threshold)
                pass
        self._dseq = 0
        self._fc_held = None
        info = await js.stream_info(self.spec.stream)
        created = info.created.isoformat() if info.created is not None else None
        last = int(info.state.last_seq or 0)
        if (self._stream_created is not None and created != self._stream_created) or self._sseq > last:
            self._forget_positions(f"stream {self.spec.stream} was made again (created {created}, last seq {last}; "
                                   f"positions were at seq {self._sseq})")
        self._stream_created = created
        subjects = [f"{self._prefix}.{wire.subject_token(n)}" for n in sorted(self._filter)]
        cfg = ConsumerConfig(
            deliver_subject=self._inbox, ack_policy=AckPolicy.NONE, flow_control=True,
            idle_heartbeat=self.heartbeat_s, mem_storage=True, inactive_threshold=max(5.0, 5 * self.heartbeat_s),
            max_deliver=1,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if self._sseq > 0 else DeliverPolicy.ALL,
            opt_start_seq=self._sseq + 1 if self._sseq > 0 else None,
        )
        if len(subjects) == 1:
            cfg.filter_subject = subjects[0]
        elif subjects:
            cfg.filter_subjects = subjects
        else:
            cfg.filter_subject = f"{self._prefix}.>"
        info = await self._nc.jsm().add_consumer(self.spec.stream, cfg)
        self._consumer = info.name
        self._last_activity = time.monotonic()

    def _forget_positions(self, why: str) -> None:
        """The stream is not the one our stream sequences and engine instances came from:
        read it from the start, and let each source's next message say where its engine
        is (its seqs decide between continuing, a gap and repeats, as ever)."""
        log.warning("%s: reading it from the start", why)
        self._last_error = why
        self._new_streams += 1
        self._sseq = 0
        for s in self._src.values():
            s.state.sseq = 0
            s.state.instance = None

    async def _read_loop(self, stream: Any, reader: ProtocolReader) -> None:
        try:
            while True:
                data = await stream.receive(_RECV)
                self._now = time.time()
                self._last_activity = time.monotonic()
                n = len(data)
                for off in range(0, n, _SLICE):
                    try:
                        reader.feed(data[off:off + _SLICE] if n > _SLICE else data)
                    finally:
                        self._flush()
                    if off + _SLICE < n and self._out:
                        await anyio.lowlevel.checkpoint()
                if reader.outgoing:
                    self._send(bytes(reader.outgoing))
                    reader.outgoing.clear()
        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError, NatsProtocolError) as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._reset.set()

    async def _write_loop(self, stream: Any) -> None:
        try:
            while True:
                await self._wire_wake.wait()
                self._wire_wake = anyio.Event()
                data, self._wire_out = bytes(self._wire_out), bytearray()
                if data:
                    await stream.send(data)
        except (OSError, anyio.BrokenResourceError) as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._reset.set()

    async def _drive(self) -> None:
        """Connect, subscribe, make the consumer; again whenever it may have lost its place."""
        backoff = 0.05
        while True:
            self._reset = anyio.Event()
            self._state = "recovering" if self._resets else "connecting"
            try:
                if self._reader is not None:
                    self._fast_done += self._reader.fast_hits
                self._reader = reader = ProtocolReader(self._on_raw, (_BATCH_DELIVERY, self._on_fast_run))
                self._inbox = self._nc.new_inbox()
                url = current_url(self._nc, self.spec.url)
                async with await open_data_connection(url, self.name + "-data", reader, self._inbox,
                                                      (self._status_subject,)) as stream:
                    self._wire_out = bytearray()
                    self._wire_wake = anyio.Event()
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._read_loop, stream, reader)
                        tg.start_soon(self._write_loop, stream)
                        await self._make_consumer()
                        self._state = "live"
                        backoff = 0.05
                        while not self._reset.is_set():
                            with anyio.move_on_after(self.heartbeat_s):
                                await self._reset.wait()
                            if time.monotonic() - self._last_activity > 3 * self.heartbeat_s:
                                self._last_error = "no heartbeat from the consumer"
                                break
                        tg.cancel_scope.cancel()
            except Exception as exc:  # noqa: BLE001 - server away, stream missing, ...: retry
                self._last_error = f"{type(exc).__name__}: {exc}"
                log.debug("consumer for %s/%s not running: %s", self.spec.url, self.spec.stream, self._last_error)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            self._resets += 1
