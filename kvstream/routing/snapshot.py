"""The index snapshot format: ``index.dump()`` bytes, for router replicas and stream snapshots.

A snapshot is one msgpack value (encoded with msgspec), versioned and compact. It holds
what :meth:`state` holds plus what scoring needs (each engine hash's router keys, the
tokens of unlinked blocks) and, per source, an opaque *cursor* the caller passes to
``dump`` (e.g. the seq of the last batch applied), so a replica that loads it knows where
to resume the stream. Counters, speculative entries and TTL ages are not part of it (a
loaded block starts a fresh TTL generation).

Layout (``docs/router.md`` documents it; version :data:`FORMAT_VERSION`), all structs are
positional arrays so a newer minor version may append fields at the end::

    Snapshot  = [magic "kvstream-index", version 1, keying "tokens"|"engine",
                 router_block_size, options, hasher, keys, unlinked, sources]
    options   = [max_bytes|nil, ttl_s|nil, reannounce]
    hasher    = nil | [algorithm, block_size, extra_key_style, root bytes, hash_form]
    keys      = [hashes: u64 LE bytes, keys: u64 LE bytes, other: [[hash, [key, ...]], ...]]
    unlinked  = [[hash, parent|nil, tokens u32 LE bytes|nil, extras|nil, per], ...]
    sources   = [[name, stale, cursor, block_size|nil, per|nil,
                  [[medium, plain: u64 LE bytes, rows: [[hash, group, copies], ...]], ...],
                  reannounce rule], ...]

``plain`` lists the int engine hashes a source holds exactly once, in group 0 (the common
case, 8 bytes each); ``rows`` everything else (bytes hashes, other groups, several
copies). ``keys`` maps engine hashes to router keys: packed pairs where both fit 64 bits
and the block has one key, ``other`` for the rest (token-keyed indexes only).

Bad bytes raise :class:`SnapshotError` (a :class:`~kvstream.errors.RemoteProtocolError`:
the snapshot came from a peer or a stream) and leave the index unchanged.
"""

from __future__ import annotations

from array import array
from typing import Any, Final, Iterable, Mapping, Union

import msgspec

from kvstream.errors import RemoteProtocolError

__all__ = ["FORMAT_VERSION", "MAGIC", "SnapshotError", "SnapshotInfo", "read_snapshot"]

MAGIC: Final = "kvstream-index"
FORMAT_VERSION: Final = 1
"""Snapshot format version written by this kvstream; readers accept exactly the versions
they know (1) and reject others with :class:`SnapshotError`."""

_Hash = Union[int, bytes]
_U64: Final = (1 << 64) - 1
_LE: Final = array("Q", [1]).tobytes()[0] == 1


class SnapshotError(RemoteProtocolError, ValueError):
    """Snapshot bytes that cannot be loaded (damaged, another format or version, or an
    index of another keying or block size); says what and what to do."""


class _Options(msgspec.Struct, array_like=True, frozen=True):
    max_bytes: Union[int, None] = None
    ttl_s: Union[float, None] = None
    reannounce: str = "detect"


class _Hasher(msgspec.Struct, array_like=True, frozen=True):
    algorithm: str
    block_size: int
    extra_key_style: str
    root: bytes
    hash_form: str


class _Keys(msgspec.Struct, array_like=True):
    hashes: bytes = b""
    keys: bytes = b""
    other: list[tuple[_Hash, list[int]]] = []


class _Unlinked(msgspec.Struct, array_like=True):
    hash: _Hash
    parent: Union[_Hash, None]
    tokens: Union[bytes, None]
    extras: Union[list[Union[bytes, None]], None]
    per: int


class _Tier(msgspec.Struct, array_like=True):
    medium: str
    plain: bytes = b""
    rows: list[tuple[_Hash, int, int]] = []


class _Source(msgspec.Struct, array_like=True):
    name: str
    stale: bool
    cursor: Any
    block_size: Union[int, None]
    per: Union[int, None]
    tiers: list[_Tier]
    reannounce: Union[str, None] = None


class _Snapshot(msgspec.Struct, array_like=True):
    magic: str
    version: int
    keying: str
    router_block_size: int
    options: _Options
    hasher: Union[_Hasher, None]
    keys: _Keys
    unlinked: list[_Unlinked]
    sources: list[_Source]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Snapshot)


def pack_u64(xs: Iterable[int]) -> bytes:
    a = array("Q", xs)
    if not _LE:  # pragma: no cover - keep snapshots identical across hosts
        a.byteswap()
    return a.tobytes()


def unpack_u64(b: bytes, what: str) -> array:
    if len(b) % 8:
        raise SnapshotError(f"snapshot {what} is {len(b)} bytes, not a multiple of 8 (a damaged snapshot)")
    a = array("Q")
    a.frombytes(b)
    if not _LE:  # pragma: no cover
        a.byteswap()
    return a


def is_u64(h: Any) -> bool:
    return type(h) is int and 0 <= h <= _U64


def encode(snap: _Snapshot) -> bytes:
    return _encoder.encode(snap)


def decode(data: bytes) -> _Snapshot:
    """Decode and check the header; raises :class:`SnapshotError`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SnapshotError(f"a snapshot is bytes (from index.dump()), got {type(data).__name__}")
    try:
        snap = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        # Tell a newer version apart from damage when the header is readable.
        try:
            head = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            head = None
        if isinstance(head, list) and len(head) >= 2 and head[0] == MAGIC and head[1] != FORMAT_VERSION:
            raise SnapshotError(
                f"snapshot format version {head[1]!r}; this kvstream reads version {FORMAT_VERSION} "
                "(upgrade the reader, or dump with the same kvstream version)"
            ) from None
        raise SnapshotError(f"not a kvstream index snapshot, or a damaged one: {exc}") from None
    if snap.magic != MAGIC:
        raise SnapshotError(f"not a kvstream index snapshot (magic {snap.magic!r:.40}, expected {MAGIC!r})")
    if snap.version != FORMAT_VERSION:
        raise SnapshotError(
            f"snapshot format version {snap.version}; this kvstream reads version {FORMAT_VERSION} "
            "(upgrade the reader, or dump with the same kvstream version)"
        )
    if snap.keying not in ("tokens", "engine"):
        raise SnapshotError(f"snapshot keying {snap.keying!r} is neither 'tokens' nor 'engine'")
    if snap.router_block_size <= 0:
        raise SnapshotError(f"snapshot router_block_size {snap.router_block_size} is not positive")
    for s in snap.sources:
        if s.reannounce is not None and s.reannounce not in ("count", "detect", "session"):
            raise SnapshotError(f"snapshot source {s.name!r}: unknown reannounce rule {s.reannounce!r:.40}")
        for t in s.tiers:
            for row in t.rows:
                if row[1] < 0 or row[2] < 1:
                    raise SnapshotError(
                        f"snapshot source {s.name!r}: row {row!r:.80} has a negative group or no copies")
    return snap


class SnapshotInfo(msgspec.Struct, frozen=True):
    """What a snapshot holds, without loading it (:func:`read_snapshot`).

    Attributes:
        version: format version.
        keying: ``"tokens"`` (:class:`~kvstream.routing.index.KVIndex`) or ``"engine"``
            (:class:`~kvstream.routing.engine_index.EngineKeyIndex`).
        router_block_size: tokens per scoring block.
        cursors: per source, the cursor given to ``dump`` (None when none was given).
        stale: per source, its stale flag.
    """

    version: int
    keying: str
    router_block_size: int
    cursors: dict[str, Any]
    stale: dict[str, bool]


def read_snapshot(data: bytes) -> SnapshotInfo:
    """The header and per-source cursors of snapshot ``data`` (:class:`SnapshotInfo`);
    raises :class:`SnapshotError` for bytes that are not a readable snapshot."""
    snap = decode(data)
    return SnapshotInfo(
        snap.version, snap.keying, snap.router_block_size,
        {s.name: s.cursor for s in snap.sources}, {s.name: s.stale for s in snap.sources},
    )


def cursor_of(cursors: Mapping[str, Any] | None, name: str) -> Any:
    return None if cursors is None else cursors.get(name)
