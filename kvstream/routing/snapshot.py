"""The index snapshot format: ``index.dump()`` bytes, for router replicas and stream snapshots.

A snapshot is one msgpack value (encoded with msgspec), versioned and compact. It holds
what :meth:`state` holds plus what scoring needs (each engine hash's router keys, the
tokens of unlinked blocks) and, per source, an opaque *cursor* the caller passes to
``dump`` (e.g. the seq of the last batch applied), so a replica that loads it knows where
to resume the stream. Counters, speculative entries and TTL ages are not part of it (a
loaded block starts a fresh TTL generation).

Layout (``docs/router.md`` documents it; version :data:`FORMAT_VERSION`), all structs are
positional arrays so a newer minor version may append fields at the end::

    Snapshot  = [magic "kvstream-index", version 2, keying "tokens"|"engine",
                 router_block_size, options, hasher, sources, tiers, rows, copies, unlinked,
                 sizes (optional, appended: absent reads as [])]
    options   = [max_bytes|nil, ttl_s|nil, reannounce]
    hasher    = nil | [algorithm, block_size, extra_key_style, root bytes, hash_form]
    sources   = [[name, stale, cursor, block_size|nil, per|nil, reannounce rule, slot,
                  two_sizes (optional, appended: absent reads as false)], ...]
    tiers     = [[medium, hashes: u64 LE bytes, keys: u64 LE bytes, masks: [u64 LE bytes, ...]], ...]
    rows      = [[medium, hash, keys [key, ...]|nil, mask: LE bytes], ...]
    copies    = [[slot, medium, hash, [[group, copies], ...]], ...]
    unlinked  = [[hash, parent|nil, tokens u32 LE bytes|nil, extras|nil, per,
                  [[slot, medium, group, copies], ...]], ...]
    sizes     = [[hash, per, id], ...]

The block table is written as columns, one ``tiers`` entry per medium: entry ``i`` is
engine hash ``hashes[i]``, its router key ``keys[i]`` (token keying; empty under engine
keying, where the hash is the key) and the bitmask of the sources holding it in that
medium, bit ``slot`` of ``masks[0][i] | masks[1][i] << 64 | ...`` (one u64 column per 64
source slots). Dump and load are bulk array operations (well under a second for 10**6
blocks). ``rows`` holds the entries the columns cannot: bytes hashes, and blocks of
several router blocks (a list of keys). A holding is one copy in group 0 unless ``copies``
says otherwise. ``sizes`` lists the engine hashes held under two block sizes (a 64-bit
collision, or a misbehaving engine): the copy of ``hash`` for engine blocks of ``per``
router blocks is written under ``id`` wherever a hash goes. ``two_sizes`` marks a source that
holds (or held, and still holds blocks since) engine blocks of two block sizes: its
holdings are its ``rows`` and ``copies`` entries, one each, not its mask bits. Version 1 (per-source hash lists and a separate key map) is not read.

Bad bytes raise :class:`SnapshotError` (a :class:`~kvstream.errors.RemoteProtocolError`:
the snapshot came from a peer or a stream) and leave the index unchanged.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, Final, Iterable, Mapping, Union

import msgspec

from kvstream.errors import RemoteProtocolError
from kvstream.routing._core import _bits

__all__ = ["FORMAT_VERSION", "MAGIC", "SnapshotError", "SnapshotInfo", "read_snapshot"]

MAGIC: Final = "kvstream-index"
FORMAT_VERSION: Final = 2
"""Snapshot format version written by this kvstream; readers accept exactly the versions
they know (2) and reject others with :class:`SnapshotError`."""

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


class _Source(msgspec.Struct, array_like=True):
    name: str
    stale: bool
    cursor: Any
    block_size: Union[int, None]
    per: Union[int, None]
    reannounce: str
    slot: int
    two_sizes: bool = False  # appended: a source tracked by explicit records (two block sizes)


class _Tier(msgspec.Struct, array_like=True):
    medium: str
    hashes: bytes
    keys: bytes
    masks: list[bytes]


class _Row(msgspec.Struct, array_like=True):
    medium: str
    hash: _Hash
    keys: Union[list[int], None]
    mask: bytes


class _Copies(msgspec.Struct, array_like=True):
    slot: int
    medium: str
    hash: _Hash
    groups: list[tuple[int, int]]


class _Unlinked(msgspec.Struct, array_like=True):
    hash: _Hash
    parent: Union[_Hash, None]
    tokens: Union[bytes, None]
    extras: Union[list[Union[bytes, None]], None]
    per: int
    holds: list[tuple[int, str, int, int]]


class _SizeId(msgspec.Struct, array_like=True):
    hash: _Hash
    per: int
    id: _Hash


class _Snapshot(msgspec.Struct, array_like=True):
    magic: str
    version: int
    keying: str
    router_block_size: int
    options: _Options
    hasher: Union[_Hasher, None]
    sources: list[_Source]
    tiers: list[_Tier]
    rows: list[_Row]
    copies: list[_Copies]
    unlinked: list[_Unlinked]
    sizes: list[_SizeId] = []


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


def pack_masks(masks: list[int], words: int) -> list[bytes]:
    """Source masks as ``words`` u64 columns (bits 0-63, 64-127, ...)."""
    if words == 1:
        return [pack_u64(masks)]
    return [pack_u64([(m >> (64 * w)) & _U64 for m in masks]) for w in range(words)]


def mask_bytes(m: int) -> bytes:
    return m.to_bytes((m.bit_length() + 7) // 8 or 1, "little")


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
        if s.reannounce not in ("count", "detect", "session"):
            raise SnapshotError(f"snapshot source {s.name!r}: unknown reannounce rule {s.reannounce!r:.40}")
    return snap


class Prepared:
    """A decoded snapshot's residency, validated, in the forms the index installs."""

    __slots__ = ("tiers", "rows", "copies", "unlinked", "sizes")

    def __init__(self) -> None:
        self.tiers: list[tuple[str, array, array, Union[array, list[int]]]] = []
        self.rows: list[tuple[str, Any, Union[list[int], None], int]] = []
        self.copies: list[tuple[int, str, Any, dict[int, int]]] = []
        self.unlinked: list[_Unlinked] = []
        self.sizes: list[tuple[Any, int, Any]] = []


_KEY_MAX: Final = (1 << 60) - 1  # router keys (kvstream.routing.keys.KEY_MASK)


_LOW_NIBBLE: Final = bytes(range(16))


def _all_router_keys(ks: array) -> bool:
    """Every value of the u64 column ``ks`` is below 2**60 (its top byte below 0x10): read
    from the bytes, about 40x faster than ``max()`` over a million Python ints."""
    b = ks.tobytes()
    top = b[7::8] if sys.byteorder == "little" else b[0::8]
    return not top.translate(None, _LOW_NIBBLE)


def _has_zero(hs: array) -> bool:
    """The u64 column ``hs`` holds a 0 (eight zero bytes at a value's place)."""
    b = hs.tobytes()
    i = b.find(bytes(8))
    while i != -1:
        if i % 8 == 0:
            return True
        i = b.find(bytes(8), i + 1)
    return False


def prepare(snap: _Snapshot, *, tokens: bool, router_block_size: int) -> Prepared:
    """Unpack and check everything the index will install (raises :class:`SnapshotError`,
    nothing changed): columns of equal length, router keys in range, masks naming only the
    snapshot's sources, copies and unlinked blocks of those sources. That a medium lists a
    hash once is checked while installing (a set of 10**6 hashes costs 0.3 s; the bulk
    build finds a duplicate for free)."""
    slots = [s.slot for s in snap.sources]
    if len(set(slots)) != len(slots) or any(type(x) is not int or not 0 <= x < 1 << 16 for x in slots):
        raise SnapshotError(f"snapshot source slots {slots[:16]!r} are not distinct small ints (a damaged snapshot)")
    names = [s.name for s in snap.sources]
    if len(set(names)) != len(names):
        raise SnapshotError("snapshot names a source twice (a damaged snapshot)")
    for s in snap.sources:
        if s.per is not None and s.per <= 0:
            raise SnapshotError(f"snapshot source {s.name!r}: per {s.per} is not positive")
    everyone = 0
    for x in slots:
        everyone |= 1 << x
    two = 0  # sources of two block sizes: their holdings are rows, each with its copies
    for sd in snap.sources:
        if sd.two_sizes:
            two |= 1 << sd.slot
    p = Prepared()
    for td in snap.tiers:
        hs = unpack_u64(td.hashes, "hashes")
        n = len(hs)
        ks = unpack_u64(td.keys, "keys")
        if tokens:
            if len(ks) != n:
                raise SnapshotError(f"snapshot medium {td.medium!r}: {n} hashes but {len(ks)} keys (a damaged snapshot)")
            if n and not _all_router_keys(ks):
                raise SnapshotError(f"snapshot medium {td.medium!r}: a key >= 2**60 is not a router key")
            if n and _has_zero(hs):
                raise SnapshotError(f"snapshot medium {td.medium!r}: hash 0 in the columns (a damaged snapshot)")
        elif len(ks):
            raise SnapshotError("snapshot of an engine-keyed index with router keys (a damaged snapshot)")
        if not td.masks:
            raise SnapshotError(f"snapshot medium {td.medium!r}: no source masks")
        cols = [unpack_u64(w, "masks") for w in td.masks]
        if any(len(c) != n for c in cols):
            raise SnapshotError(f"snapshot medium {td.medium!r}: mask columns differ in length from the hashes")
        # One column: the array itself (the index loads it natively as it is); wider
        # masks as ints.
        masks: Union[array, list[int]] = cols[0]
        if len(cols) > 1:
            masks = cols[0].tolist()
            for w, c in enumerate(cols[1:], 1):
                masks = [m | (x << (64 * w)) for m, x in zip(masks, c)]
        distinct = set(masks)
        if 0 in distinct or any(m & ~everyone for m in distinct):
            raise SnapshotError(
                f"snapshot medium {td.medium!r}: a mask names no source, or one the snapshot does not list")
        if two and any(m & two for m in distinct):
            raise SnapshotError(f"snapshot medium {td.medium!r}: a source of two block sizes in the columns "
                                "(its holdings are rows; a damaged snapshot)")
        p.tiers.append((td.medium, hs, ks, masks))
    for r in snap.rows:
        m = int.from_bytes(r.mask, "little")
        if not m or m & ~everyone:
            raise SnapshotError(f"snapshot row {r.hash!r:.40}: its mask names no source, or an unlisted one")
        if tokens:
            if not r.keys or any(type(k) is not int or not 0 <= k <= _KEY_MAX for k in r.keys):
                raise SnapshotError(f"snapshot holds {r.hash!r:.40} with no key, or keys that are not router keys "
                                    "(a damaged snapshot)")
        elif r.keys is not None:
            raise SnapshotError("snapshot of an engine-keyed index with router keys (a damaged snapshot)")
        p.rows.append((r.medium, r.hash, r.keys, m))
    rowed = {(medium, eh, x) for medium, eh, _k, m in p.rows if m & two for x in _bits(m & two)} if two else set()
    for cp in snap.copies:
        groups: dict[int, int] = {}
        for g, n in cp.groups:
            if g < 0 or n < 1 or g in groups:
                raise SnapshotError(f"snapshot copies of {cp.hash!r:.40}: group {g} with {n} copies")
            groups[g] = n
        if cp.slot not in slots or not groups:
            raise SnapshotError(f"snapshot copies of {cp.hash!r:.40} for an unlisted source slot {cp.slot}")
        if two >> cp.slot & 1 and (cp.medium, cp.hash, cp.slot) not in rowed:
            raise SnapshotError(f"snapshot copies of {cp.hash!r:.40} for slot {cp.slot}, a source of two block "
                                "sizes that holds no such row (a damaged snapshot)")
        p.copies.append((cp.slot, cp.medium, cp.hash, groups))
    for u in snap.unlinked:
        if not tokens:
            raise SnapshotError("snapshot of an engine-keyed index with unlinked blocks (a damaged snapshot)")
        if u.tokens is not None and (u.per <= 0 or len(u.tokens) != 4 * router_block_size * u.per):
            raise SnapshotError(
                f"snapshot unlinked block {u.hash!r:.40}: {len(u.tokens)} token bytes for per={u.per}")
        for slot, _medium, g, n in u.holds:
            if slot not in slots or g < 0 or n < 1:
                raise SnapshotError(f"snapshot unlinked block {u.hash!r:.40}: bad holding {(slot, g, n)!r}")
        p.unlinked.append(u)
    for z in snap.sizes:
        if not tokens or type(z.per) is not int or z.per <= 0 or not z.id or type(z.id) is not type(z.hash):
            raise SnapshotError(f"snapshot block-size id of {z.hash!r:.40}: per {z.per!r}, id {z.id!r:.40} "
                                "(a damaged snapshot)")
        p.sizes.append((z.hash, z.per, z.id))
    return p


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
