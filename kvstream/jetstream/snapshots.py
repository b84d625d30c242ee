"""Index snapshots in a JetStream object store, so a new router replica starts warm.

A router replica that reads the stream (:class:`~kvstream.jetstream.JetStreamSource`)
runs a :class:`SnapshotWriter`: every ``interval_s`` seconds it dumps each source that
changed (``index.dump(source, cursors=...)``, see :mod:`kvstream.routing.snapshot`) into
the object store bucket ``<STREAM>_SNAPSHOTS``, one object per source (named by its
subject token, the latest replacing the one before), with the stream sequence it covers in
the object's ``Kv-Sseq`` header and, as the dump's cursor, the consumer's position for the
source (:class:`~kvstream.jetstream.tracking.SourceState`: engine instance, next seq,
stale, stream sequence). A new replica calls :func:`load_snapshots` and reads only the tail::

    index = KVIndex()
    states = await load_snapshots("nats://nats:4222/KV_EVENTS", index)
    async with Router(index=index, subscriber=JetStreamSource(url, state=states)) as router:
        ...

Its start-up time depends on the index size and the tail since the last snapshot, not on
the stream's history.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Protocol, runtime_checkable

import anyio

from kvstream.jetstream import wire
from kvstream.jetstream._nats import connect
from kvstream.jetstream.config import NatsSource, parse_nats_url
from kvstream.jetstream.tracking import SourceState
from kvstream.transport.lifetime import Lifetime

__all__ = ["SnapshotWriter", "load_snapshots", "bucket_name", "SnapshotIndex"]

log = logging.getLogger("kvstream.jetstream.snapshots")

_CHUNK = 1 << 20  # bytes per object-store chunk (nats-server's default max payload: 1 MiB)
H_SSEQ = "Kv-Sseq"


@runtime_checkable
class SnapshotIndex(Protocol):
    """What snapshots need of a router index (:class:`~kvstream.routing.index.KVIndex` and
    :class:`~kvstream.routing.engine_index.EngineKeyIndex` have it)."""

    def dump(self, source: str | None = None, *, cursors: Mapping[str, Any] | None = None) -> bytes: ...

    def load_source(self, data: bytes) -> dict[str, Any]: ...


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
    """Writes ``index``'s per-source snapshots for the stream ``source`` reads, every
    ``interval_s`` seconds (only sources whose stream position moved). ``replicas``: of
    the bucket, when this writer creates it. Use as ``async with``; :meth:`write_now`
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

    def _take(self) -> list[tuple[str, int, bytes]]:
        """Dump every source that moved, all in one synchronous step (consistent with the
        consumer positions read at the same moment)."""
        out = []
        for name, st in self.source.states().items():
            if st.sseq <= self._done.get(name, 0):
                continue
            try:
                data = self.index.dump(name, cursors={name: st.as_dict()})
            except Exception:  # noqa: BLE001 - the index does not know it (yet)
                continue
            out.append((name, st.sseq, data))
        return out

    async def write_now(self, *, settle_s: float = 5.0) -> int:
        """Write one round now; returns how many snapshots were written. Waits (at most
        ``settle_s`` seconds) for a moment when every item read has been applied."""
        from nats.js.api import ObjectMeta, ObjectMetaOptions

        with anyio.move_on_after(settle_s):
            while self.source.ready:
                await anyio.sleep(0.002)
        taken = self._take()
        for name, sseq, data in taken:
            meta = ObjectMeta(name=wire.subject_token(name), description=f"{name} at stream seq {sseq}",
                              headers={H_SSEQ: str(sseq)}, options=ObjectMetaOptions(max_chunk_size=_CHUNK))
            await self._os.put(meta.name, data, meta=meta)
            self._done[name] = sseq
            self.written += 1
            self.bytes_written += len(data)
        return len(taken)


async def load_snapshots(url: str | NatsSource, index: SnapshotIndex, *, timeout_s: float = 10.0) -> dict[str, SourceState]:
    """Load the latest snapshot of every source of the stream ``url`` names into ``index``;
    returns the consumer positions to start a :class:`JetStreamSource` from (empty when
    there are no snapshots yet). Sources filtered by the URL's ``?source=`` only."""
    import io

    spec = parse_nats_url(url) if isinstance(url, str) else url
    nc = await connect(spec.url, name="kvstream-snapshot-loader", timeout_s=timeout_s)
    try:
        os_ = await _store(nc.jetstream(), spec.stream, create=False)
        if os_ is None:
            return {}
        from nats.js.errors import NotFoundError

        try:
            infos = await os_.list(ignore_deletes=True)
        except NotFoundError:
            return {}
        states: dict[str, SourceState] = {}
        t0 = time.monotonic()
        wanted = [info.name for info in infos
                  if not spec.sources or wire.source_from_token(info.name) in spec.sources]
        blobs: dict[str, bytes] = {}

        async def fetch(name: str) -> None:
            buf = io.BytesIO()
            await os_.get(name, writeinto=buf)
            blobs[name] = buf.getvalue()

        async with anyio.create_task_group() as tg:  # fetched concurrently, loaded in order
            for name in wanted:
                tg.start_soon(fetch, name)
        for name in wanted:
            for src, cursor in index.load_source(blobs.pop(name)).items():
                if isinstance(cursor, Mapping):
                    states[src] = SourceState.from_dict(cursor)
        log.info("loaded %d source snapshot(s) in %.3fs", len(states), time.monotonic() - t0)
        return states
    finally:
        await nc.close()
