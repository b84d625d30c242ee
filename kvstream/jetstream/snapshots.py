"""Index snapshots in a JetStream object store, so a new router replica starts warm.

A router replica that reads the stream (:class:`~kvstream.jetstream.JetStreamSource`)
runs a :class:`SnapshotWriter`: every ``interval_s`` seconds, when any source's stream
position moved, it dumps the whole index once (``index.dump(cursors=...)``, format in
:mod:`kvstream.routing.snapshot`) into the object store bucket ``<STREAM>_SNAPSHOTS`` as
one object, :data:`OBJECT_NAME` (the latest replacing the one before). The dump's cursor
for each source is the consumer's position for it
(:class:`~kvstream.jetstream.tracking.SourceState`: engine instance, next seq, stale, and
as stream sequence the last one the consumer read, which every source has got that far);
the object's ``Kv-Sseq`` header holds the last stream sequence read. A
new replica calls :func:`load_snapshots` and reads only the tail::

    index = KVIndex()
    states = await load_snapshots("nats://nats:4222/KV_EVENTS", index)
    async with Router(index=index, subscriber=JetStreamSource(url, state=states)) as router:
        ...

Its start-up time depends on the index size and the tail since the last snapshot, not on
the stream's history. A snapshot of another stream of the same name (deleted and made
again since) or beyond the stream's last sequence is not used (a cold start, logged). The object is read back on a connection of its own (an ephemeral
consumer of the bucket's chunk subject, chunks collected as they arrive, the SHA-256
digest checked): nats-py's object store reader grows one ``bytes`` per chunk and reads at
a fraction of the speed.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from typing import Any, Mapping, Protocol, runtime_checkable

import anyio

from kvstream.jetstream._nats import connect, current_url, open_data_connection
from kvstream.jetstream._proto import NatsProtocolError, ProtocolReader, parse_headers, pub_op
from kvstream.jetstream.config import NatsSource, parse_nats_url
from kvstream.jetstream.errors import RemoteProtocolError
from kvstream.jetstream.tracking import SourceState
from kvstream.transport.lifetime import Lifetime

__all__ = ["SnapshotWriter", "load_snapshots", "bucket_name", "SnapshotIndex", "SnapshotFetchError", "OBJECT_NAME"]

log = logging.getLogger("kvstream.jetstream.snapshots")

_CHUNK = 1 << 20  # bytes per object-store chunk (nats-server's default max payload: 1 MiB)
H_SSEQ = "Kv-Sseq"
H_STREAM_CREATED = "Kv-Stream-Created"
"""When the stream the snapshot's positions refer to was created (a stream deleted and
made again under the same name has another time)."""
OBJECT_NAME = "kvstream.index"
"""The one object holding the latest whole-index snapshot (a subject token never holds a
``.``, so no source's name can collide with it)."""


class SnapshotFetchError(RemoteProtocolError):
    """The snapshot object could not be read back whole (chunks missing, a digest or size
    that does not match its metadata)."""


@runtime_checkable
class SnapshotIndex(Protocol):
    """What snapshots need of a router index (:class:`~kvstream.routing.index.KVIndex` and
    :class:`~kvstream.routing.engine_index.EngineKeyIndex` have it)."""

    def dump(self, source: str | None = None, *, cursors: Mapping[str, Any] | None = None) -> bytes: ...

    def load_source(self, data: bytes) -> dict[str, Any]: ...

    def remove_source(self, source: str) -> None: ...

    @property
    def sources(self) -> list[str]: ...


def bucket_name(stream: str) -> str:
    """The object store bucket holding ``stream``'s snapshots."""
    return f"{stream}_SNAPSHOTS"


async def _store(js: Any, stream: str, *, create: bool, replicas: int = 1) -> Any:
    from nats.js.api import ObjectStoreConfig, StorageType
    from nats.js.errors import BucketNotFoundError, NotFoundError

    try:
        return await js.object_store(bucket_name(stream))
    except (BucketNotFoundError, NotFoundError):
        if not create:
            return None
    return await js.create_object_store(bucket_name(stream), config=ObjectStoreConfig(
        description=f"kvstream index snapshots of stream {stream}",
        storage=StorageType.FILE, replicas=replicas))


class SnapshotWriter:
    """Writes ``index``'s whole-index snapshot for the stream ``source`` reads, every
    ``interval_s`` seconds (only when some source's stream position moved). ``replicas``:
    of the bucket, when this writer creates it. Use as ``async with``; :meth:`write_now`
    forces one round. The index must be the one fed by ``source``'s items (a
    :class:`~kvstream.routing.router.Router`'s ``index`` and ``subscriber``)."""

    def __init__(self, index: SnapshotIndex, source: Any, *, interval_s: float = 30.0, replicas: int = 1) -> None:
        self.index = index
        self.source = source
        self.interval_s = interval_s
        self.replicas = replicas
        self.written = 0
        """Snapshots written so far."""
        self.bytes_written = 0
        """Bytes of snapshots written so far."""
        self.last_error: str | None = None
        self._done: dict[str, int] = {}
        self._created: str | None = None
        self._nc: Any = None
        self._os: Any = None
        self._life = Lifetime()

    async def __aenter__(self) -> "SnapshotWriter":
        spec: NatsSource = self.source.spec
        self._life = life = Lifetime()
        async with life.opening():
            self._nc = await connect(spec.url, name="kvstream-snapshots")
            life.on_close(self._nc.close)
            self._os = await _store(self._nc.jetstream(), spec.stream, create=True, replicas=self.replicas)
            await life.start(self._loop, name="kvstream-snapshot-writer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._life.aclose()

    async def _loop(self) -> None:
        while True:
            await anyio.sleep(self.interval_s)
            try:
                await self.write_now()
            except Exception as exc:  # noqa: BLE001 - NATS away: try again next round
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("snapshot round failed: %s", self.last_error)

    def _chunk(self) -> int:
        """Bytes per object-store chunk: 1 MiB, or less on a server whose ``max_payload``
        is smaller (each chunk is one message)."""
        limit = int(getattr(self._nc, "max_payload", 0) or _CHUNK)
        return max(1024, min(_CHUNK, limit - 256))

    def _take(self) -> tuple[dict[str, int], bytes] | None:
        """Dump the whole index if any source moved, in one synchronous step (consistent
        with the consumer positions read at the same moment)."""
        states = self.source.states()
        # Every message up to the consumer's last stream sequence has been read and applied
        # (the queue is empty): each source's position is that far, not just at its own last
        # message. A replica then reads on from there, not again from the least recently
        # active engine's last message (skipping the others' messages one by one).
        last = int(getattr(self.source, "last_sseq", 0) or 0)
        for st in states.values():
            if st.sseq < last:
                st.sseq = last
        moved = {name: st.sseq for name, st in states.items()}
        if moved == self._done or not moved:
            return None
        self._created = getattr(self.source, "stream_created", None)
        return moved, self.index.dump(cursors={name: st.as_dict() for name, st in states.items()})

    async def write_now(self, *, settle_s: float = 5.0) -> int:
        """Write one round now; returns how many snapshots were written (0 or 1). Waits (at
        most ``settle_s`` seconds) for a moment when every item read has been applied."""
        from nats.js.api import ObjectMeta, ObjectMetaOptions

        with anyio.move_on_after(settle_s):
            while self.source.ready:
                await anyio.sleep(0.002)
        taken = self._take()
        if taken is None:
            return 0
        moved, data = taken
        sseq = max(moved.values())
        headers = {H_SSEQ: str(sseq)}
        if self._created is not None:
            headers[H_STREAM_CREATED] = self._created
        meta = ObjectMeta(name=OBJECT_NAME, description=f"kvstream index of {len(moved)} source(s) at stream seq {sseq}",
                          headers=headers, options=ObjectMetaOptions(max_chunk_size=self._chunk()))
        try:
            await self._os.put(OBJECT_NAME, data, meta=meta)
        except Exception as exc:  # noqa: BLE001 - the bucket may have been deleted: make it again, once
            from nats.errors import NoRespondersError
            from nats.js.errors import NoStreamResponseError, NotFoundError

            if not isinstance(exc, (NoRespondersError, NoStreamResponseError, NotFoundError)):
                raise
            log.warning("snapshot bucket %s unavailable (%s); making it again", bucket_name(self.source.spec.stream),
                        type(exc).__name__)
            self._os = await _store(self._nc.jetstream(), self.source.spec.stream, create=True,
                                    replicas=self.replicas)
            await self._os.put(OBJECT_NAME, data, meta=meta)
        self._done = moved
        self.written += 1
        self.bytes_written += len(data)
        return 1


async def _fetch(nc: Any, url: str, bucket: str, info: Any, timeout_s: float) -> bytes:
    """The object ``info`` describes, read on a data connection of its own (see the module
    docstring). Raises :class:`SnapshotFetchError` or ``TimeoutError``."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    if not info.chunks:
        return b""  # nothing to read (load_source refuses it as no snapshot)
    chunks: list[bytes] = []
    digest = hashlib.sha256()  # fed chunk by chunk, while the next ones are on the way
    got = 0
    done = anyio.Event()
    failed: list[str] = []
    replies: list[bytes] = []

    def on_msg(subject: str, reply: str, hblock: bytes | None, payload: bytes) -> None:
        nonlocal got
        if hblock is not None and hblock[8:9] == b" ":  # flow control or heartbeat
            h = parse_headers(hblock)
            if h.get("Status") == "100":
                if reply:
                    replies.append(pub_op(reply))
            else:
                failed.append(f"status {h.get('Status')} {h.get('Description', '')}".strip())
                done.set()
            return
        chunks.append(payload)
        digest.update(payload)
        got += len(payload)
        if got >= info.size or len(chunks) >= info.chunks:
            done.set()

    reader = ProtocolReader(on_msg)
    inbox = nc.new_inbox()
    with anyio.fail_after(timeout_s):
        async with await open_data_connection(url, "kvstream-snapshot-loader-data", reader, inbox) as stream:
            cinfo = await nc.jsm().add_consumer(f"OBJ_{bucket}", ConsumerConfig(
                deliver_subject=inbox, ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                filter_subject=f"$O.{bucket}.C.{info.nuid}", flow_control=True, idle_heartbeat=1.0,
                mem_storage=True, inactive_threshold=5.0, max_deliver=1))
            try:
                while not done.is_set():
                    try:
                        reader.feed(await stream.receive(1 << 20))
                    except (anyio.EndOfStream, NatsProtocolError) as exc:
                        raise SnapshotFetchError(f"snapshot fetch from {url} broke off: {exc}") from None
                    out = bytes(reader.outgoing) + b"".join(replies)
                    reader.outgoing.clear()
                    replies.clear()
                    if out:
                        await stream.send(out)
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    try:
                        await nc.jsm().delete_consumer(f"OBJ_{bucket}", cinfo.name)
                    except Exception:  # noqa: BLE001 - it expires on its own (inactive threshold)
                        pass
    if failed:
        raise SnapshotFetchError(f"snapshot fetch from {url}: {failed[0]}")
    data = b"".join(chunks)
    if len(data) != info.size or len(chunks) != info.chunks:
        raise SnapshotFetchError(f"snapshot object {info.name!r}: {len(data)} bytes in {len(chunks)} chunks, "
                                 f"its metadata says {info.size} in {info.chunks}")
    want = (info.digest or "").partition("=")[2]
    if want and base64.urlsafe_b64encode(digest.digest()).decode().rstrip("=") != want.rstrip("="):
        raise SnapshotFetchError(f"snapshot object {info.name!r}: SHA-256 digest does not match its metadata")
    return data


async def _foreign(nc: Any, stream: str, info: Any) -> str | None:
    """Why the snapshot ``info`` describes does not belong to ``stream`` as it is now
    (None: it does): written for a stream of that name that was deleted since, or at a
    stream sequence the stream has not reached (its positions would skip what is there)."""
    from nats.js.errors import NotFoundError

    try:
        si = await nc.jetstream().stream_info(stream)
    except NotFoundError:
        return "the stream does not exist"
    h = info.headers or {}
    created = si.created.isoformat() if si.created is not None else None
    if h.get(H_STREAM_CREATED) and created is not None and h[H_STREAM_CREATED] != created:
        return f"written for a stream created {h[H_STREAM_CREATED]}; this one was created {created}"
    try:
        sseq = int(h.get(H_SSEQ, 0))
    except ValueError:
        return f"a bad {H_SSEQ} header {h.get(H_SSEQ)!r}"
    last = int(si.state.last_seq or 0)
    if sseq > last:
        return f"written at stream seq {sseq}, the stream ends at seq {last}"
    return None


async def load_snapshots(url: str | NatsSource, index: SnapshotIndex, *, timeout_s: float = 10.0) -> dict[str, SourceState]:
    """Load the latest whole-index snapshot of the stream ``url`` names into ``index``
    (:meth:`load_source`: the state of every source in it is replaced; sources outside the
    URL's ``?source=`` filter are removed again afterwards) and return the consumer
    positions to start a :class:`JetStreamSource` from (empty when there is no snapshot
    yet). Raises :class:`SnapshotFetchError` for an object that does not read back whole,
    :class:`~kvstream.routing.snapshot.SnapshotError` for bytes that are no snapshot, and
    ``TimeoutError`` after ``timeout_s`` seconds (per step: connect, fetch)."""
    spec = parse_nats_url(url) if isinstance(url, str) else url
    nc = await connect(spec.url, name="kvstream-snapshot-loader", timeout_s=timeout_s)
    try:
        os_ = await _store(nc.jetstream(), spec.stream, create=False)
        if os_ is None:
            return {}
        from nats.js.errors import NotFoundError

        try:
            info = await os_.get_info(OBJECT_NAME)
        except NotFoundError:
            return {}
        why = await _foreign(nc, spec.stream, info)
        if why is not None:
            log.warning("snapshot of stream %s not used (a cold start instead): %s", spec.stream, why)
            return {}
        t0 = time.monotonic()
        data = await _fetch(nc, current_url(nc, spec.url), bucket_name(spec.stream), info, timeout_s)
        t1 = time.monotonic()
        had = set(index.sources)
        states: dict[str, SourceState] = {}
        for src, cursor in index.load_source(data).items():
            if spec.sources and src not in spec.sources:
                if src not in had:
                    index.remove_source(src)
            elif isinstance(cursor, Mapping):
                states[src] = SourceState.from_dict(cursor)
        log.info("snapshot of %d source(s), %d bytes: fetched in %.3fs, loaded in %.3fs", len(states), len(data),
                 t1 - t0, time.monotonic() - t1)
        return states
    finally:
        await nc.close()
