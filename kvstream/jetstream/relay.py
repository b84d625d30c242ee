"""The relay: follow engines over ZMQ (with all of the subscriber's recovery) and publish
every item into a JetStream stream, payload bytes unchanged.

::

    async with Relay([SourceSpec("tcp://e0:5557", "tcp://e0:5558", name="e0")],
                     "nats://nats:4222", StreamSettings()) as relay:
        await relay.run()                        # until cancelled

Messages are published with asynchronous acks: up to ``max_inflight`` messages (and
``max_inflight_bytes`` bytes) await their ack at once, beyond that the relay stops reading
(and the subscriber's own back-pressure takes over). A message whose ack is an error or
does not come while the server stays silent for ``ack_timeout_s`` (or the connection is
lost) is sent again together with every later unacked
one, in order (go-back-N), after a backoff (50 ms doubling to 1 s); its message id makes
JetStream drop copies it already stored.

A stream that *refuses* messages (full: ``discard=new`` at its limits, a full file store)
answers with error acks. After ``max_refused_s`` of refusals without one success the relay
gives up on what it holds (counted ``dropped``) and says so where consumers hear it: a
notice on the core NATS subject :func:`~kvstream.jetstream.wire.status_subject` (outside
the stream), repeated while the stream refuses, makes every consumer mark the sources
stale. Meanwhile the relay drops their messages and tries, with backoff (up to 2 s), to
store a ``stale`` notice for the batches the stream lacks; once one is stored, the stream
says so itself (for consumers that come later) and the sources' batches follow again.
What is published per item, and how two relays of one engine agree, is
:class:`~kvstream.jetstream.tracking.RelaySource`'s business.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import anyio
import anyio.lowlevel
import msgspec

from kvstream.wire.events import DEFAULT_MAX_PAYLOAD_BYTES, EventDecodeError, EventDecoder, KVEventBatch
from kvstream.jetstream import wire
from kvstream.jetstream._nats import connect, current_url, ensure_stream, open_data_connection
from kvstream.jetstream._proto import NatsProtocolError, ProtocolReader, hpub_op
from kvstream.transport._ratelog import RateLimitedLog
from kvstream.jetstream.config import StreamSettings
from kvstream.jetstream.tracking import RelaySource
from kvstream.transport.lifetime import Lifetime
from kvstream.transport.subscriber import SourceSpec, Subscriber

__all__ = ["Relay", "RelayStats", "EnvelopeDecoder"]

log = logging.getLogger("kvstream.jetstream.relay")


@dataclass(slots=True)
class RelayStats:
    """Counters of one relay (cumulative). ``inflight``: messages awaiting their ack now."""

    items: int = 0
    """Subscriber items read."""
    published: int = 0
    """Messages sent (retransmissions excluded)."""
    acked: int = 0
    """Messages JetStream acknowledged (stored, or already held: see ``duplicates``)."""
    duplicates: int = 0
    """Acks saying the stream already held the message id (another relay's copy)."""
    skipped: int = 0
    """Items not published because the stream already held them (start-up catch-up)."""
    ack_errors: int = 0
    """Error acks (the message was sent again)."""
    retransmits: int = 0
    """Messages sent again after an error or an ack timeout."""
    streams_created: int = 0
    """Times the stream was found deleted (publishes refused) and made again."""
    too_large: int = 0
    """Batches over the server's ``max_payload``, published as a gap (a ``stale`` notice) instead."""
    refused: int = 0
    """Error acks saying the stream refuses the message (full, ``discard=new``)."""
    dropped: int = 0
    """Messages given up on because the stream kept refusing (their sources were told stale)."""
    blocked: int = 0
    """Times the relay gave up and told consumers (status notices) it cannot publish."""
    notices: int = 0
    """Status notices sent (repeated while the stream refuses)."""
    inflight: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    """Batches published per source."""

    def line(self) -> str:
        """A one-line summary."""
        return (f"items={self.items} published={self.published} acked={self.acked} dup={self.duplicates} "
                f"skipped={self.skipped} inflight={self.inflight} errors={self.ack_errors} "
                f"retransmits={self.retransmits} too_large={self.too_large} refused={self.refused} "
                f"dropped={self.dropped}")


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Any = None


class EnvelopeDecoder:
    """The relay's payload check: a batch's envelope (``[ts, events, rank]``, either vLLM
    shape) with each event kept as raw msgpack. A relay publishes the engine's bytes
    unchanged and reads only ``ts``; the events are decoded (and a bad one refused) by
    every consumer. A quarter of a full decode. ``decode`` returns a
    :class:`KVEventBatch` whose ``events`` are ``msgspec.Raw`` (their count is right) and
    raises :class:`EventDecodeError` for bytes that are not a batch or exceed
    ``max_payload_bytes``."""

    __slots__ = ("_decode", "max_payload_bytes")

    held_bytes_per_payload_byte: int = 3
    """Bytes a decoded envelope holds per payload byte, at most: its events are views of
    the payload (an object and a list slot each, a few dozen bytes per event of 20+)."""

    def __init__(self, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self._decode = msgspec.msgpack.Decoder(_Envelope).decode
        self.max_payload_bytes = max_payload_bytes

    def decode(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        """The envelope of one payload (see the class docstring)."""
        n = len(payload)
        if n > self.max_payload_bytes:
            raise EventDecodeError(f"payload is {n} bytes, over the limit of {self.max_payload_bytes} bytes "
                                   "(raise max_payload_bytes if the engine really sends batches this large)",
                                   payload_len=n)
        try:
            e = self._decode(payload)
        except msgspec.MsgspecError as exc:
            raise EventDecodeError(f"not a KV event batch: {exc}", payload_len=n) from None
        return KVEventBatch(e.ts, e.events, e.data_parallel_rank)  # type: ignore[arg-type]


class _Pending:
    __slots__ = ("subject", "payload", "headers", "sent", "written", "source", "probe")

    def __init__(self, subject: str, payload: bytes, headers: dict[str, str], sent: float, source: str,
                 probe: bool = False) -> None:
        self.subject = subject
        self.payload = payload
        self.headers = headers
        self.sent = sent
        self.written = False
        self.source = source
        self.probe = probe  # the stale notice of a blocked source: never resent


def _first_seq(headers: dict[str, str]) -> int:
    """The first engine seq a message stands for (a batch's seq; a notice's position + 1)."""
    v = headers.get(wire.H_SEQ)
    if v is not None:
        return int(v)
    return int(headers.get(wire.H_POS, "-1")) + 1


class Relay:
    """Relays engines' KV event streams into JetStream (see the module docstring).

    ``sources``: :class:`SourceSpec` s (or PUB endpoint strings) to follow. ``nats``: the
    server URL(s). ``stream``: the stream to create or check (``update_stream``: apply
    changed retention/replicas to an existing one). ``connect_timeout_s``: seconds to wait
    for a first NATS connection. ``max_refused_s``: seconds of refusals (error acks, no
    success) before the relay gives up on its unacked messages and tells consumers the
    sources are stale (see the module docstring). ``subscriber_options``: passed to
    :class:`~kvstream.transport.subscriber.Subscriber`.
    """

    def __init__(self, sources: Iterable[SourceSpec | str], nats: str | Sequence[str],
                 stream: StreamSettings | None = None, *, max_inflight: int = 8192,
                 max_inflight_bytes: int = 64 << 20, ack_timeout_s: float = 5.0,
                 update_stream: bool = False, name: str = "kvstream-relay", connect_timeout_s: float = 10.0,
                 max_refused_s: float = 2.0, **subscriber_options: Any) -> None:
        if max_refused_s <= 0:
            raise ValueError(f"max_refused_s must be > 0 seconds, got {max_refused_s}")
        self.max_refused_s = max_refused_s
        self.specs = [SourceSpec(s) if isinstance(s, str) else s for s in sources]
        self.servers = nats
        self.settings = stream if stream is not None else StreamSettings()
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self.ack_timeout_s = ack_timeout_s
        self.update_stream = update_stream
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.stats = RelayStats()
        self.sources: dict[str, RelaySource] = {}
        """Per-source relay state (instance, position), by source name."""
        if "decoder" not in subscriber_options:
            subscriber_options["decoder"] = EnvelopeDecoder(
                subscriber_options.get("max_payload_bytes", DEFAULT_MAX_PAYLOAD_BYTES))
        self._sub = Subscriber(self.specs, **subscriber_options)
        self._nc: Any = None
        self._life = Lifetime()
        self._pending: dict[int, _Pending] = {}
        self._failed: dict[int, _Pending] = {}
        self._bytes = 0
        self._token = 0
        self._inbox = ""
        self._space: anyio.Event | None = None
        self._idle = anyio.Event()
        self._idle.set()
        self._resend = anyio.Event()
        self._conn: Any = None
        self._last_ack = 0.0
        self._wbuf = bytearray()
        self._wake = anyio.Event()
        self._rlog = RateLimitedLog(log)
        self._stream_checked = 0.0
        self.last_error: str | None = None
        """The last data-connection error (None: none yet)."""
        self._subjects = {s.source: f"{self.settings.subject_prefix}.{wire.subject_token(s.source)}"
                          for s in self.specs}
        self._backoff = 0.05  # before resending refused or unanswered messages (doubling)
        self._refused_since: float | None = None  # first refusal since the last success
        self._refusal = ""
        self._blocked: dict[str, int] = {}  # source -> first seq the stream lacks
        self._blocked_next: dict[str, int] = {}  # dropped while the source's notice was out
        self._probing: set[str] = set()
        self._next_probe = 0.0
        self._probe_backoff = 0.05
        self._status_subject = wire.status_subject(self.settings.name)

    @property
    def blocked(self) -> dict[str, int]:
        """Sources whose messages the stream refuses (name -> first seq it lacks)."""
        return dict(self._blocked)

    @property
    def subscriber(self) -> Subscriber:
        """The ZMQ subscriber (its ``health()`` shows each engine's state)."""
        return self._sub

    async def __aenter__(self) -> "Relay":
        self._life = life = Lifetime()
        async with life.opening():
            self._nc = await connect(self.servers, name=self.name, timeout_s=self.connect_timeout_s)
            life.on_close(self._nc.close)
            js = self._nc.jetstream()
            await ensure_stream(js, self.settings, update=self.update_stream)
            # The stream's last sequence, read before the sources' last messages: a source
            # the stream holds nothing of (new, purged, aged out) starts at this instance
            # number, above any it had before (an instance is always below the stream
            # sequence of its first message), so consumers that still remember the
            # source take what follows for a new engine, not for late copies of an old one.
            last_sseq = int((await js.stream_info(self.settings.name)).state.last_seq or 0)
            limit = int(self._nc.max_payload or (1 << 20))
            for spec in self.specs:
                known = await self._position(js, spec.source)
                self.sources[spec.source] = RelaySource(spec.source, known, first_instance=last_sseq,
                                                        max_message_bytes=limit)
            self._inbox = self._nc.new_inbox()
            await life.enter(self._sub)
            await life.start(self._connection, name="kvstream-relay-connection")
            await life.start(self._watch_acks, name="kvstream-relay-acks")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._life.aclose()

    # -- the data connection ---------------------------------------------------------------

    async def _connection(self) -> None:
        """Publish on a connection of our own (HPUB with a reply subject per message, acks
        read by the sans-IO protocol reader); on any loss, connect again (alternately to
        the server nats-py is connected to and to the next server of the list) and resend
        every unacked message in order."""
        urls = [self.servers] if isinstance(self.servers, str) else list(self.servers)
        i = 0
        backoff = 0.05
        while True:
            # The server nats-py is on first (in a cluster it moves to nodes the others
            # told it about when a configured one is lost), else the next configured one.
            url = current_url(self._nc, urls[i % len(urls)]) if i % 2 == 0 else urls[i // 2 % len(urls)]
            i += 1
            reader = ProtocolReader(self._on_ack)
            try:
                async with await open_data_connection(url, self.name + "-data", reader, self._inbox + ".*") as stream:
                    backoff = 0.05
                    self._conn = stream
                    self._resend_all()
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._writer, stream)
                        await self._reader(stream, reader)  # returns when the connection is lost
                        tg.cancel_scope.cancel()
            except (OSError, TimeoutError, NatsProtocolError) as exc:  # connecting failed
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                self._conn = None
            log.debug("relay: NATS data connection to %s lost: %s", url, self.last_error)
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _reader(self, stream: Any, reader: ProtocolReader) -> None:
        try:
            while True:
                reader.feed(await stream.receive(1 << 18))
                if reader.outgoing:
                    self._wbuf += reader.outgoing
                    reader.outgoing.clear()
                    self._wake.set()
        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                NatsProtocolError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"

    async def _writer(self, stream: Any) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                if self._wbuf:
                    data, self._wbuf = bytes(self._wbuf), bytearray()
                    await stream.send(data)
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            await stream.aclose()  # the reader sees it and the connection is made again

    def _resend_all(self) -> None:
        """Queue every unacked message again, oldest first (their ids make JetStream drop
        the copies it already stored)."""
        if self._failed:
            self._pending.update(self._failed)
            self._failed.clear()
        self._pending = dict(sorted(self._pending.items()))
        self._wbuf = bytearray()
        if self._conn is None:
            return
        now = time.monotonic()
        inbox = self._inbox
        for t, p in self._pending.items():
            p.sent = now
            self._wbuf += hpub_op(p.subject, f"{inbox}.{t}", p.headers, p.payload)
            if p.written:
                self.stats.retransmits += 1
            p.written = True
        self._wake.set()

    async def _position(self, js: Any, source: str) -> wire.StreamPosition | None:
        from nats.js.errors import NotFoundError

        try:
            m = await js.get_last_msg(self.settings.name, self._subjects[source])
        except NotFoundError:
            return None
        h = m.headers or {}
        ts = 0.0
        try:
            if h.get(wire.H_KIND) in (None, wire.KIND_SNAPSHOT):
                ts = EventDecoder().decode(m.data or b"").ts
            else:
                ts = float(h.get(wire.H_TS, 0.0))
        except Exception:  # noqa: BLE001 - an unreadable last message: trust seqs only
            log.warning("%s: cannot read the timestamp of the stream's last message", source)
        return wire.position_from_headers(h, ts, m.data)

    # -- publishing ----------------------------------------------------------------------

    async def run(self, *, max_items: int | None = None) -> RelayStats:
        """Relay until cancelled, the subscriber ends, or ``max_items`` items were read."""
        sub = self._sub
        st = self.stats
        sources = self.sources
        subjects = self._subjects
        publish = self._publish
        async for item in sub:
            st.items += 1
            name = item.source
            rs = sources.get(name)
            if rs is None:
                continue
            skipped = rs.skipped
            too_large = rs.too_large
            for payload, headers in rs.on_item(item):
                if len(self._pending) >= self.max_inflight or self._bytes >= self.max_inflight_bytes:
                    await self._wait_space()
                publish(subjects[name], payload, headers, name)
            if st.items & 255 == 0:
                await anyio.lowlevel.checkpoint()  # let the writer stream while items keep coming
            st.skipped += rs.skipped - skipped
            st.too_large += rs.too_large - too_large
            if max_items is not None and st.items >= max_items:
                break
        return st

    async def _wait_space(self) -> None:
        while len(self._pending) >= self.max_inflight or self._bytes >= self.max_inflight_bytes:
            ev = self._space = anyio.Event()
            await ev.wait()

    def _publish(self, subject: str, payload: bytes, headers: dict[str, str], source: str,
                 probe: bool = False) -> None:
        """Queue one message (the caller made room: :meth:`_wait_space`). A plain function,
        not a coroutine: one per message would cost as much as the rest of this."""
        if self._blocked and source in self._blocked and not probe:
            self._drop(source, _first_seq(headers))
            return
        self._token = t = self._token + 1
        self._pending[t] = p = _Pending(subject, payload, headers, time.monotonic(), source, probe)
        self._bytes += len(payload)
        st = self.stats
        st.inflight = len(self._pending)
        if self._idle.is_set():
            self._idle = anyio.Event()
        st.published += 1
        if wire.H_KIND not in headers:
            bs = st.by_source
            bs[source] = bs.get(source, 0) + 1
        if self._conn is not None:  # else it goes out when the connection is back
            self._wbuf += hpub_op(subject, f"{self._inbox}.{t}", headers, payload)
            p.written = True
            self._wake.set()

    def _on_ack(self, subject: str, reply: str, hblock: bytes | None, data: bytes) -> None:
        try:
            t = int(subject[len(self._inbox) + 1:])
        except ValueError:
            return
        p = self._pending.pop(t, None)
        if p is None:
            return
        self._last_ack = now = time.monotonic()
        st = self.stats
        ok = False
        refused = False
        if data[:1] == b"{" and b'"seq":' in data and b'"error"' not in data and b'"duplicate"' not in data:
            # A plain PubAck ({"stream":..,"seq":..}): no JSON parse (a third of the ack
            # path); anything else (errors, duplicates) is parsed below.
            ok = True
            st.acked += 1
        elif data:
            try:
                resp = json.loads(data)
            except ValueError:
                resp = {"error": {"description": f"unreadable ack {bytes(data[:80])!r}"}}
            if "error" in resp:
                st.ack_errors += 1
                refused = True
                err = resp["error"] if isinstance(resp["error"], dict) else {}
                self._refusal = str(err.get("description", resp["error"]))
                self._rlog.warning("ackerr", "relay: JetStream refused %s: %s (will resend)",
                                   p.headers.get(wire.H_MSG_ID), self._refusal)
            else:
                ok = True
                st.acked += 1
                if resp.get("duplicate"):
                    st.duplicates += 1
        else:  # a status-only reply: 503 no responders while the stream is unavailable
            st.ack_errors += 1
        if ok:
            self._refused_since = None
            self._backoff = 0.05
            self._bytes -= len(p.payload)
            if p.probe:
                self._unblock(p.source, now)
        elif p.probe:
            # The stale notice of a blocked source was refused too: dropped, tried again later.
            self._bytes -= len(p.payload)
            self._probing.discard(p.source)
            self._blocked_next.pop(p.source, None)
        else:
            if refused:
                st.refused += 1
                if self._refused_since is None:
                    self._refused_since = now
            self._failed[t] = p
            self._resend.set()
        self._after_ack()

    def _after_ack(self) -> None:
        self.stats.inflight = len(self._pending) + len(self._failed)
        sp = self._space
        if sp is not None and len(self._pending) < self.max_inflight // 2 + 1:
            self._space = None
            sp.set()
        if not self._pending and not self._failed:
            self._idle.set()

    async def _watch_acks(self) -> None:
        """Resend, in order, everything unacked after an error or an ack timeout; give up
        on a stream that keeps refusing, and try the blocked sources' notices."""
        tick = min(0.25, self.ack_timeout_s / 4, self.max_refused_s / 4)
        while True:
            with anyio.move_on_after(tick):
                await self._resend.wait()
            now = time.monotonic()
            if self._refused_since is not None and now - self._refused_since > self.max_refused_s \
                    and (self._failed or self._pending):
                self._give_up(now)
            if self._blocked and now >= self._next_probe and self._conn is not None:
                self._probe_blocked(now)
            # Silence, not age: a long queue that is being acked is not a timeout.
            oldest = next(iter(self._pending.values()), None)
            timed_out = oldest is not None and \
                time.monotonic() - max(oldest.sent, self._last_ack) > self.ack_timeout_s
            if not (self._resend.is_set() or timed_out) or self._conn is None:
                continue
            self._resend = anyio.Event()
            if self._failed:
                # Refused or unavailable: give it a moment (longer each time, up to 1 s).
                await anyio.sleep(self._backoff)
                self._backoff = min(self._backoff * 2, 1.0)
                await self._check_stream()
                if self._refused_since is not None and \
                        time.monotonic() - self._refused_since > self.max_refused_s:
                    continue  # given up on at the top of the loop, not sent again
            self._resend_all()

    def _drop(self, source: str, seq: int) -> None:
        """A message of a blocked source is not published: the stream lacks its seq."""
        self.stats.dropped += 1
        book = self._blocked_next if source in self._probing else self._blocked
        if source not in book or seq < book[source]:
            book[source] = seq

    def _give_up(self, now: float) -> None:
        """The stream refused everything for max_refused_s: drop what is unacked, block its
        sources, and tell the consumers."""
        held = sorted({**self._pending, **self._failed}.items())
        self._pending.clear()
        self._failed.clear()
        self._bytes = 0
        for _, p in held:
            if p.probe:
                self._probing.discard(p.source)
                continue
            seq = _first_seq(p.headers)
            self.stats.dropped += 1
            if p.source not in self._blocked or seq < self._blocked[p.source]:
                self._blocked[p.source] = seq
        self._refused_since = None
        self.stats.blocked += 1
        log.warning("relay: stream %s refused every message for %.1f s (%s): gave up on %d; consumers are told "
                    "that %s are stale until it takes messages again", self.settings.name, self.max_refused_s,
                    self._refusal, len(held), sorted(self._blocked))
        self._next_probe = now
        self._probe_backoff = 0.05
        self._after_ack()

    def _probe_blocked(self, now: float) -> None:
        """Tell the consumers (a status notice, out of the stream) and try to store each
        blocked source's stale notice (in the stream)."""
        from kvstream.jetstream._proto import pub_op

        self.stats.notices += 1
        self._wbuf += pub_op(self._status_subject,
                             wire.blocked_notice(self.name, self.settings.name, self._blocked, self._refusal))
        self._wake.set()
        for source, first in list(self._blocked.items()):
            if source in self._probing:
                continue
            rs = self.sources[source]
            payload, headers = rs.gap_message(first, f"the stream refused these batches ({self._refusal})")
            self._probing.add(source)
            self._publish(self._subjects[source], payload, headers, source, probe=True)
        self._next_probe = now + self._probe_backoff
        self._probe_backoff = min(self._probe_backoff * 2, 2.0)

    def _unblock(self, source: str, now: float) -> None:
        """The stream stored ``source``'s stale notice: it says itself what it lacks."""
        self._probing.discard(source)
        nxt = self._blocked_next.pop(source, None)
        if nxt is not None:
            self._blocked[source] = nxt  # dropped more while the notice was out: another one
            self._next_probe = now
            return
        if self._blocked.pop(source, None) is not None and not self._blocked:
            self._probe_backoff = 0.05
            log.warning("relay: stream %s takes messages again", self.settings.name)

    async def _check_stream(self) -> None:
        """After refused publishes: make the stream again if it was deleted (what is
        unacked then goes into the new one; consumers notice it is another stream), at
        most once a second."""
        now = time.monotonic()
        if now - self._stream_checked < 1.0:
            return
        self._stream_checked = now
        from nats.js.errors import NotFoundError

        js = self._nc.jetstream()
        try:
            with anyio.fail_after(2):
                try:
                    await js.stream_info(self.settings.name)
                    return
                except NotFoundError:
                    await ensure_stream(js, self.settings)
        except Exception as exc:  # noqa: BLE001 - NATS away or the stream still unavailable: next round
            self._rlog.warning("stream", "relay: stream %s unavailable: %s", self.settings.name, exc)
            return
        self.stats.streams_created += 1
        log.warning("relay: stream %s was gone; made it again", self.settings.name)

    async def wait_acked(self, timeout_s: float = 10.0) -> None:
        """Wait until every message published so far is acknowledged; ``TimeoutError``
        after ``timeout_s`` seconds."""
        with anyio.fail_after(timeout_s):
            while not self._idle.is_set():
                await self._idle.wait()
