"""Prefix-cache block hashing, bit-compatible with vLLM's v1 KV cache manager.

A KV block's identity is a hash chained over the token ids of every full block before it:

    block_hash[i] = H((block_hash[i-1] or NONE_HASH, tuple(tokens of block i), extra_keys or None))

``H`` is one of vLLM's four hash functions (``sha256``, ``sha256_cbor``, ``xxhash``,
``xxhash_cbor``) or kvstream's own ``native`` mode (not vLLM-compatible, ~10x faster).
Only full blocks are hashed. ``NONE_HASH`` is the chain's root; :func:`none_hash` derives it
with either vLLM 0.33's or 0.11's rules. Extra keys (LoRA, multimodal items, cache salt,
prompt-embeds digests) come in the 0.33 tagged form or the 0.11 untagged form, see
:class:`RequestExtraKeys`.

Layout of this module, bottom up: the CBOR fast encoder, the root seed, :class:`BlockHasher`
(one algorithm + block size + root, hashes blocks), the request-side extra-key description,
:class:`RequestBlockHasher` (a request's growing hash list) and the external (wire) form.

This is kvstream's bottom layer: it imports nothing of kvstream.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import pickle
import struct
import sys
from bisect import bisect_left
from array import array
from itertools import accumulate
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, NamedTuple, Sequence, get_args, overload

import cbor2
import xxhash

from kvstream.errors import LocalProtocolError

__all__ = [
    "ALGORITHMS",
    "VLLM_ALGORITHMS",
    "DEFAULT_NONE_HASH_SEED",
    "HashAlgorithm",
    "Rules",
    "ExtraKeyStyle",
    "ExternalForm",
    "HashingError",
    "none_hash",
    "hash_function",
    "BlockHasher",
    "LoRA",
    "MMItem",
    "BlockExtraKeys",
    "PromptEmbedsDigest",
    "RequestExtraKeys",
    "RequestBlockHasher",
    "to_external",
    "to_external_list",
]

HashAlgorithm = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "native"]
"""Block hash algorithm names. The first four are vLLM's ``--prefix-caching-hash-algo``."""

Rules = Literal["0.33", "0.11"]
"""Which vLLM release's rule picks the root seed (NONE_HASH) when no seed is given."""

ExtraKeyStyle = Literal["0.33", "0.11"]
"""Which vLLM release's extra-key form goes into the hash input (tagged 0.33, untagged 0.11)."""

ExternalForm = Literal["int", "bytes"]
"""How a block hash is put on the wire: low 64 bits as an unsigned int, or the raw digest."""

ALGORITHMS: tuple[str, ...] = get_args(HashAlgorithm)
"""Every algorithm name :class:`BlockHasher` accepts."""

VLLM_ALGORITHMS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""The algorithm names that give the same hashes as vLLM."""

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM 0.33's fixed seed for the sha256 variants when PYTHONHASHSEED is unset."""

_RULES: tuple[str, ...] = get_args(Rules)
_STYLES: tuple[str, ...] = get_args(ExtraKeyStyle)
_NATIVE_DIGEST_SIZE = 16  # bytes; xxh3_128


class HashingError(LocalProtocolError, ValueError):
    """A bad argument to the hashing API (unknown algorithm, bad block size, bad token id...).

    The message says what was wrong, the value seen and what to do instead.
    """


# --------------------------------------------------------------------------------------
# Canonical CBOR, by hand, for the shapes a block hash input has.
#
# cbor2.dumps(obj, canonical=True) only differs from plain CBOR for maps, sets and floats,
# none of which appear in a block hash input, so ints, strings, bytes, None, bools and
# arrays are emitted in their (unique) minimal form. Anything else raises _NotFast and the
# caller hands that one block to cbor2.


class _NotFast(Exception):
    """Internal: this value is outside what the hand encoder supports; use cbor2."""


def _head(major: int, n: int) -> bytes:
    """CBOR initial byte(s) for major type ``major`` and argument ``n`` (0 <= n < 2**64)."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return bytes((m | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((m | 26,)) + n.to_bytes(4, "big")
    return bytes((m | 27,)) + n.to_bytes(8, "big")


def _encode_int(n: int) -> bytes:
    """Canonical CBOR of a Python int, bignums (tags 2/3) included, as cbor2 writes it."""
    if n >= 0:
        if n < 0x10000000000000000:
            return _head(0, n)
        raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
        return b"\xc2" + _head(2, len(raw)) + raw
    m = -1 - n
    if m < 0x10000000000000000:
        return _head(1, m)
    raw = m.to_bytes((m.bit_length() + 7) // 8, "big")
    return b"\xc3" + _head(2, len(raw)) + raw


# Token ids in bulk, without cbor2 and without a per-token table. A table of per-token
# encodings is fast only while it sits in CPU cache, and a router mostly hashes prompts it
# has never seen; cbor2 itself spends ~28 ns per id. So a long prompt goes through C-level
# passes over whole byte strings, none of which depends on the vocabulary:
#
# 1. ``marshal.dumps(ids, 2)`` writes every exact int in [-2**31, 2**31) as b"i" + its 4 bytes
#    little-endian, and anything else (a bool, an int subclass, a bigger int, a non-int)
#    another way or not at all. A stream of exactly 5 + 5 * n bytes with b"i" every 5 bytes
#    therefore proves every id is such an int, and slicing it every 5th byte gives the ids'
#    byte columns b0..b3.
# 2. One class key per id from the columns: bit 0 = b0 >= 24, bit 1 = b1 != 0, bit 2 =
#    (b2 | b3) != 0 (each a ``bytes.translate``; ORed as big ints, no carries). The key
#    decides the id's canonical CBOR size (1, 2, 3 or 5 bytes) and header (0x18/0x19/0x1a).
# 3. Each id is laid out as five UTF-16 code units, header b3 b2 b1 b0 (big-endian, CBOR's
#    order); a unit whose byte is not part of the id's encoding gets high byte 1. Decoding
#    that as UTF-16 and encoding it as latin-1 with errors="ignore" drops exactly those units
#    (they are >= U+0100) in one C pass: what remains is every id's canonical CBOR, back to back.
# 4. Block sizes: the per-id sizes read as one big int, times 1 + 256 + ... + 256**(B-1),
#    give every window sum of B sizes in one multiplication (each sum < 256: no carry).
#
# Ids outside [0, 2**31) or not exact ints take cbor2 per block (vLLM's own serializer).

_KEY_B0 = bytes([0] * 24 + [1] * 232)  # bit 0: b0 >= 24
_KEY_B1 = bytes([0] + [2] * 255)  # bit 1: b1 != 0
_KEY_B23 = bytes([0] + [4] * 255)  # bit 2: b2 or b3 != 0


def _by_key(f: Callable[[int], int]) -> bytes:
    """A translate table over class keys 0..7 (the rest of the 256 entries unused)."""
    return bytes(f(k) for k in range(8)) + bytes(248)


# key -> canonical CBOR size of the id in bytes: 1 (< 24), 2 (< 256), 3 (< 65536) or 5.
_CBOR_SIZE = _by_key(lambda k: 5 if k & 4 else 3 if k & 2 else 2 if k & 1 else 1)
# key -> the header byte (ignored for ids < 24, whose header unit is dropped: b0 is the item).
_CBOR_HEAD = _by_key(lambda k: 0x1A if k & 4 else 0x19 if k & 2 else 0x18)
_DROP_HEAD = _by_key(lambda k: int(k == 0))  # id < 24
_DROP_B1 = _by_key(lambda k: int(k < 2))  # id < 256
_DROP_B23 = _by_key(lambda k: int(k < 4))  # id < 65536

# Below this many blocks per call, cbor2 on each block's token list is cheaper than the
# bulk passes' fixed cost (measured: ~10 us for the passes, ~1 us per cbor2 call).
_BULK_MIN_BLOCKS = 12
# Below this many blocks the pickle algorithms use the simple slice loop instead of the
# zip-chunked one (measured: the zip setup costs more than it saves below ~5 blocks).
_PICKLE_FEW_MAX = 5


def _int32_columns(tokens: Sequence[int]) -> tuple[bytes, bytes, bytes, bytes] | None:
    """Little-endian byte columns (b0, b1, b2, b3) of every id, or None.

    None unless every id is an exact ``int`` in [-2**31, 2**31) (see step 1 above).
    """
    seq = tokens if type(tokens) is list or type(tokens) is tuple else list(tokens)
    try:
        m = marshal.dumps(seq, 2)
    except ValueError:  # an object marshal cannot write: certainly not an exact int
        return None
    n = len(seq)
    if len(m) != 5 + 5 * n or m[5::5] != b"i" * n:
        return None
    return m[6::5], m[7::5], m[8::5], m[9::5]


def _cbor_token_runs(tokens: Sequence[int], block_size: int) -> tuple[bytes, Sequence[int]] | None:
    """Canonical CBOR of the token ids of every full block, back to back, and each block's size.

    Returns ``(encoded, sizes)``: block ``i``'s ids are ``encoded[sum(sizes[:i]):][:sizes[i]]``
    (ids after the last full block are encoded too, and not counted). None when an id is not
    an exact int in [0, 2**31) (the caller falls back to cbor2 per block, which decides).
    """
    cols = _int32_columns(tokens)
    if cols is None:
        return None
    c0, c1, c2, c3 = cols
    if not c3.isascii():  # a negative id (b3 >= 0x80): CBOR's major type 1, leave it to cbor2
        return None
    n = len(c0)
    fb = int.from_bytes
    key_i = fb(c0.translate(_KEY_B0), "little") | fb(c1.translate(_KEY_B1), "little")
    if c3.count(0) == n:  # every id < 2**24 (all real vocabularies): b3 adds nothing
        key_i |= fb(c2.translate(_KEY_B23), "little")
    else:
        key_i |= fb(c2.translate(_KEY_B23), "little") | fb(c3.translate(_KEY_B23), "little")
    key = key_i.to_bytes(n, "little")
    # Low bytes first (5 bytes an id), widened to UTF-16 units by a latin-1 round trip
    # (cheaper than writing every low byte into the 10-byte layout), then the high bytes.
    low = bytearray(5 * n)
    low[0::5] = key.translate(_CBOR_HEAD)
    low[1::5] = c3
    low[2::5] = c2
    low[3::5] = c1
    low[4::5] = c0
    units = bytearray(low.decode("latin-1").encode("utf-16-le"))
    units[1::10] = key.translate(_DROP_HEAD)
    drop = key.translate(_DROP_B23)
    units[3::10] = drop
    units[5::10] = drop
    units[7::10] = key.translate(_DROP_B1)
    encoded = units.decode("utf-16-le").encode("latin-1", "ignore")
    blocks = n // block_size
    each = key.translate(_CBOR_SIZE)
    if 5 * block_size < 256:
        # Sliding sums of block_size bytes in one multiplication (each sum < 256: no carry).
        sums = (fb(each, "little") * fb(b"\x01" * block_size, "little")).to_bytes(n + block_size, "little")
        return encoded, sums[block_size - 1 :: block_size][:blocks]
    return encoded, [sum(each[i : i + block_size]) for i in range(0, blocks * block_size, block_size)]


def _encode_into(obj: Any, out: list[bytes]) -> None:
    """Append the canonical CBOR of ``obj`` to ``out``; raise _NotFast if unsupported."""
    t = type(obj)
    if obj is None:
        out.append(b"\xf6")
    elif t is int:
        out.append(_encode_int(obj))
    elif t is str:
        raw = obj.encode("utf-8")
        out.append(_head(3, len(raw)))
        out.append(raw)
    elif t is bytes:
        out.append(_head(2, len(obj)))
        out.append(obj)
    elif t is tuple or t is list:
        out.append(_head(4, len(obj)))
        for item in obj:
            _encode_into(item, out)
    elif t is bool:
        out.append(b"\xf5" if obj else b"\xf4")
    else:
        raise _NotFast


def _encode_extra(extra_keys: Any) -> bytes | None:
    """Canonical CBOR of an extra-keys value, or None when only cbor2 can encode it."""
    if extra_keys is None:
        return b"\xf6"
    out: list[bytes] = []
    try:
        _encode_into(extra_keys, out)
    except _NotFast:
        return None
    return b"".join(out)


def _cbor_dumps(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _pickle_dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_xxh3_128 = xxhash.xxh3_128_digest
_sha256_new = hashlib.sha256
_pickle_dumps_c = pickle.dumps
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL

# name -> (serializer, digest); native has no generic serializer (see BlockHasher).
_VLLM_FNS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickle_dumps, _sha256),
    "sha256_cbor": (_cbor_dumps, _sha256),
    "xxhash": (_pickle_dumps, _xxh3_128),
    "xxhash_cbor": (_cbor_dumps, _xxh3_128),
}


def _check_algorithm(algorithm: object) -> str:
    if algorithm not in ALGORITHMS:
        raise HashingError(
            f"unknown block hash algorithm {algorithm!r}; use one of "
            f"{', '.join(ALGORITHMS)} (the first four match vLLM's --prefix-caching-hash-algo)"
        )
    return algorithm


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's hash function ``algorithm`` for any object: serialize, then digest.

    ``sha256``/``xxhash`` pickle the object (highest protocol); the ``_cbor`` variants use
    ``cbor2.dumps(obj, canonical=True)``. Digests are 32 bytes (sha256) or 16 (xxh3_128).
    ``native`` has no object form (it packs token ids); it raises :class:`HashingError`.
    """
    _check_algorithm(algorithm)
    if algorithm == "native":
        raise HashingError(
            "the 'native' algorithm hashes packed uint32 token ids, not arbitrary objects; "
            "use BlockHasher('native', ...) or one of " + ", ".join(VLLM_ALGORITHMS)
        )
    serialize, digest = _VLLM_FNS[algorithm]
    return lambda obj: digest(serialize(obj))


# --------------------------------------------------------------------------------------
# The chain root.


def none_hash(algorithm: str, *, rules: str = "0.33", seed: str | None = None) -> bytes:
    """The root hash (vLLM's NONE_HASH) that block 0 of every chain uses as its parent.

    ``seed`` given: the algorithm's hash of that string (vLLM: ``hash_fn(seed)``).
    Otherwise ``PYTHONHASHSEED`` is read once, now; if it is set (even to ""), its string
    value is the seed. If it is unset:

    * ``rules="0.33"``: the fixed seed ``"vllm-none-hash"`` for ``sha256``, ``sha256_cbor``
      and ``native``; a random seed string (64 hex digits) for ``xxhash``/``xxhash_cbor``,
      so their random root is a 16-byte digest, as vLLM 0.33's.
    * ``rules="0.11"``: 32 random bytes for every vLLM algorithm (16 for ``native``).

    A random root makes hashes unreproducible across processes: a router or another engine
    can then never match them. Set PYTHONHASHSEED (or pass ``seed``) when they must agree.

    Returns 32 bytes for the sha256 variants and 0.11's random roots, 16 for xxhash-derived ones.
    The native root is ``xxh3_128(seed.encode("utf-8"))``.
    """
    _check_algorithm(algorithm)
    if rules not in _RULES:
        raise HashingError(f"unknown seed rules {rules!r}; use '0.33' or '0.11'")
    if seed is not None and not isinstance(seed, str):
        raise HashingError(
            f"seed must be a str (it is hashed like PYTHONHASHSEED's value), got {type(seed).__name__}; "
            "pass a precomputed root as BlockHasher(root=...) instead"
        )
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        if rules == "0.11":
            return os.urandom(_NATIVE_DIGEST_SIZE if algorithm == "native" else 32)
        if algorithm in ("xxhash", "xxhash_cbor"):
            # vLLM 0.33 hashes a random seed string: the root is a digest like any other.
            seed = os.urandom(32).hex()
        else:
            seed = DEFAULT_NONE_HASH_SEED
    if algorithm == "native":
        return _xxh3_128(seed.encode("utf-8"))
    serialize, digest = _VLLM_FNS[algorithm]
    return digest(serialize(seed))


# --------------------------------------------------------------------------------------
# Block hashing.

_NATIVE_BIG_ENDIAN_HOST = sys.byteorder == "big"
if array("I").itemsize != 4:  # pragma: no cover - no mainstream platform
    raise ImportError("kvstream.hashing needs a 4-byte C unsigned int for native hashing")


def _one_block_fn(algorithm: str, chain_prefix: bytes) -> Callable[[bytes, Sequence[int]], bytes] | None:
    """``f(parent, block)``: the hash of one full block without extra keys, for the decode path.

    ``parent`` must be a digest of this algorithm's size (``chain_prefix`` assumes it);
    ``block`` is read, not kept. The same bytes as :meth:`BlockHasher.hash_blocks`, with
    no per-call checks: a decode step that completes a block pays one call. None for
    ``native`` (it keeps the general path).
    """
    proto = pickle.HIGHEST_PROTOCOL
    pdumps = pickle.dumps
    cdumps = cbor2.dumps
    sha = hashlib.sha256
    xxh = _xxh3_128
    if algorithm == "sha256":
        return lambda parent, block: sha(pdumps((parent, tuple(block), None), proto)).digest()
    if algorithm == "xxhash":
        return lambda parent, block: xxh(pdumps((parent, tuple(block), None), proto))
    # cbor2 encodes a list like the tuple vLLM builds (both are CBOR arrays).
    if algorithm == "sha256_cbor":
        return lambda parent, block: sha(chain_prefix + parent + cdumps(block, canonical=True) + b"\xf6").digest()
    if algorithm == "xxhash_cbor":
        return lambda parent, block: xxh(chain_prefix + parent + cdumps(block, canonical=True) + b"\xf6")
    return None


def _few_blocks_fn(
    algorithm: str,
    block_size: int,
    root: bytes,
    digest_size: int,
    chain_prefix: bytes,
    bulk: Callable[[Sequence[int], int, bytes, None], list[bytes]],
    limit: int,
) -> Callable[[bytes | None, Sequence[int], int], list[bytes]] | None:
    """``f(parent, tokens, full)``: the plain hashes of the blocks in ``tokens[:full]``.

    The naive loop itself, without its per-block Python calls: one serialize + digest per
    block, nothing set up beforehand. Below a few blocks this beats every bulk path (their
    setup costs more than it saves); :class:`BlockHasher` picks it below
    ``_few_max`` blocks. ``tokens`` is a list or tuple (a CBOR block is encoded from its
    slice, which cbor2 writes like vLLM's tuple); ``parent`` None (or empty) chains from
    ``root``; ``full`` is a multiple of ``block_size``. No extra keys. From ``limit``
    tokens on it hands the call to ``bulk`` (the hasher's bulk path, no argument checks).
    None for ``native``.
    """
    proto = pickle.HIGHEST_PROTOCOL
    pdumps = pickle.dumps
    cdumps = cbor2.dumps
    sha = hashlib.sha256
    xxh = _xxh3_128
    bs = block_size
    root_head = b"\x83" + _head(2, len(root))

    if algorithm == "sha256":

        def few(parent: bytes | None, tokens: Sequence[int], full: int) -> list[bytes]:
            prev = parent or root
            if full >= limit:
                return bulk(tokens, full // bs, prev, None)
            if full == bs:
                return [sha(pdumps((prev, tuple(tokens[:bs]), None), proto)).digest()]
            out = []
            for i in range(0, full, bs):
                prev = sha(pdumps((prev, tuple(tokens[i : i + bs]), None), proto)).digest()
                out.append(prev)
            return out

    elif algorithm == "xxhash":

        def few(parent: bytes | None, tokens: Sequence[int], full: int) -> list[bytes]:
            prev = parent or root
            if full >= limit:
                return bulk(tokens, full // bs, prev, None)
            if full == bs:
                return [xxh(pdumps((prev, tuple(tokens[:bs]), None), proto))]
            out = []
            for i in range(0, full, bs):
                prev = xxh(pdumps((prev, tuple(tokens[i : i + bs]), None), proto))
                out.append(prev)
            return out

    elif algorithm in ("sha256_cbor", "xxhash_cbor"):
        is_sha = algorithm == "sha256_cbor"

        def few(parent: bytes | None, tokens: Sequence[int], full: int) -> list[bytes]:
            if full >= limit:
                return bulk(tokens, full // bs, parent or root, None)
            if not parent:
                prev, head = root, root_head
            else:
                prev = parent
                head = chain_prefix if len(parent) == digest_size else b"\x83" + _head(2, len(parent))
            out = []
            if is_sha:
                for i in range(0, full, bs):
                    prev = sha(head + prev + cdumps(tokens[i : i + bs], canonical=True) + b"\xf6").digest()
                    head = chain_prefix
                    out.append(prev)
            else:
                for i in range(0, full, bs):
                    prev = xxh(head + prev + cdumps(tokens[i : i + bs], canonical=True) + b"\xf6")
                    head = chain_prefix
                    out.append(prev)
            return out

    else:
        return None
    return few


class BlockHasher:
    """Hashes full token blocks into chained block hashes with one fixed configuration.

    Immutable after construction; cheap to share between requests and threads.

    Args:
        algorithm: one of :data:`ALGORITHMS`. The vLLM ones give vLLM's exact digests
            (32 bytes for sha256*, 16 for xxhash*); ``native`` gives 16-byte xxh3_128
            digests of packed uint32 token ids, not vLLM-compatible.
        block_size: tokens per block (> 0).
        extra_key_style: ``"0.33"`` (tagged tuples) or ``"0.11"`` (untagged) for the extra
            keys that :class:`RequestBlockHasher` builds. :meth:`hash_block` itself hashes
            whatever ``extra_keys`` it is given.
        rules, seed: how to derive the root when ``root`` is not given; see
            :func:`none_hash` (PYTHONHASHSEED is read once, here).
        root: the chain root (NONE_HASH) bytes, overriding ``rules``/``seed``.

    Attributes: ``algorithm``, ``block_size`` (tokens), ``extra_key_style``, ``root``
    (bytes), ``digest_size`` (bytes per block hash).
    """

    __slots__ = (
        "algorithm",
        "block_size",
        "extra_key_style",
        "root",
        "digest_size",
        "_serialize",
        "_digest",
        "_cbor",
        "_array_head",
        "_chain_prefix",
        "_one",
        "_few",
        "_few_max",
    )

    algorithm: str
    block_size: int
    extra_key_style: str
    root: bytes
    digest_size: int
    _serialize: Callable[[Any], bytes] | None
    _digest: Callable[[bytes], bytes]
    _cbor: bool
    _array_head: bytes
    _chain_prefix: bytes
    _one: Callable[[bytes, Sequence[int]], bytes] | None
    _few: Callable[[bytes | None, Sequence[int], int], list[bytes]]
    _few_max: int

    def __init__(
        self,
        algorithm: str = "sha256_cbor",
        block_size: int = 16,
        *,
        extra_key_style: str = "0.33",
        rules: str = "0.33",
        seed: str | None = None,
        root: bytes | None = None,
    ) -> None:
        _check_algorithm(algorithm)
        if type(block_size) is not int or block_size <= 0:
            raise HashingError(
                f"block_size must be a positive int (tokens per block, vLLM uses 16 by default), "
                f"got {block_size!r}"
            )
        if extra_key_style not in _STYLES:
            raise HashingError(
                f"unknown extra_key_style {extra_key_style!r}; use '0.33' (tagged, vLLM >= 0.33) "
                "or '0.11' (untagged, vLLM 0.11)"
            )
        if root is None:
            root = none_hash(algorithm, rules=rules, seed=seed)
        elif type(root) is not bytes or not root:
            raise HashingError(
                f"root must be non-empty bytes (a NONE_HASH digest), got {root!r:.80}; "
                "use none_hash(...) to derive one"
            )
        s = object.__setattr__
        s(self, "algorithm", algorithm)
        s(self, "block_size", block_size)
        s(self, "extra_key_style", extra_key_style)
        s(self, "root", root)
        s(self, "digest_size", 32 if algorithm.startswith("sha256") else 16)
        if algorithm == "native":
            s(self, "_serialize", None)
            s(self, "_digest", _xxh3_128)
        else:
            serialize, digest = _VLLM_FNS[algorithm]
            s(self, "_serialize", serialize)
            s(self, "_digest", digest)
        s(self, "_cbor", algorithm.endswith("_cbor"))
        s(self, "_array_head", _head(4, block_size))
        # 3-item array + bytes header of a parent of our own digest size.
        s(self, "_chain_prefix", b"\x83" + _head(2, self.digest_size))
        s(self, "_one", _one_block_fn(algorithm, self._chain_prefix))
        # _few(parent, tokens, full): a plain list/tuple's blocks, the simple loop below
        # _few_max blocks, the bulk path from there on (native: hash_blocks, _few_max 0).
        few_max = _BULK_MIN_BLOCKS if self._cbor else _PICKLE_FEW_MAX
        bulk = self._hash_cbor if self._cbor else self._hash_generic
        few = _few_blocks_fn(algorithm, block_size, root, self.digest_size, self._chain_prefix, bulk, few_max * block_size)
        s(self, "_few", few if few is not None else lambda parent, tokens, full: self.hash_blocks(tokens, parent))
        s(self, "_few_max", 0 if few is None else few_max)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"BlockHasher is immutable; build a new one instead of setting {name!r}")

    def __repr__(self) -> str:
        return (
            f"BlockHasher({self.algorithm!r}, block_size={self.block_size}, "
            f"extra_key_style={self.extra_key_style!r}, root={self.root.hex()[:16]}...)"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockHasher):
            return NotImplemented
        return (self.algorithm, self.block_size, self.extra_key_style, self.root) == (
            other.algorithm,
            other.block_size,
            other.extra_key_style,
            other.root,
        )

    def __hash__(self) -> int:
        return hash((self.algorithm, self.block_size, self.extra_key_style, self.root))

    @property
    def vllm_compatible(self) -> bool:
        """True unless the algorithm is kvstream's own ``native`` mode."""
        return self.algorithm != "native"

    # -- one block ---------------------------------------------------------------------

    def hash_block(
        self,
        parent: bytes | None,
        tokens: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
    ) -> bytes:
        """The hash of one full block.

        Args:
            parent: the previous block's hash; None (or b"") for block 0, which chains
                from :attr:`root`.
            tokens: exactly ``block_size`` token ids (ints).
            extra_keys: the block's extra keys in the hash-input form (see
                :meth:`RequestExtraKeys.for_block`), or None.
        """
        if extra_keys is None and len(tokens) == self.block_size:
            # A plain block (a decode step): one serialize + digest, no other checks; the
            # pickle algorithms inline (a caller hashing block by block pays one call a block).
            algorithm = self.algorithm
            if parent:
                if algorithm == "sha256":
                    return _sha256_new(_pickle_dumps_c((parent, tuple(tokens), None), _PICKLE_PROTOCOL)).digest()
                if algorithm == "xxhash":
                    return _xxh3_128(_pickle_dumps_c((parent, tuple(tokens), None), _PICKLE_PROTOCOL))
            if type(tokens) is list or type(tokens) is tuple:
                one = self._one
                if one is not None and parent and len(parent) == self.digest_size:
                    return one(parent, tokens)
                return self._few(parent, tokens, len(tokens))[0]
        if len(tokens) != self.block_size:
            raise HashingError(
                f"hash_block needs exactly block_size={self.block_size} tokens, got {len(tokens)}; "
                "only full blocks are hashed (use hash_blocks for a longer token list)"
            )
        return self.hash_blocks(tokens, parent, None if extra_keys is None else (extra_keys,))[0]

    # -- many blocks -------------------------------------------------------------------

    def hash_blocks(
        self,
        tokens: Sequence[int],
        parent: bytes | None = None,
        extra_keys_per_block: Sequence[tuple[Any, ...] | None] | None = None,
    ) -> list[bytes]:
        """Chained hashes of every full block of ``tokens`` (a trailing partial block is ignored).

        Args:
            tokens: token ids (ints); ``len(tokens) // block_size`` blocks are hashed.
            parent: the hash of the block before ``tokens[0]``; None starts at :attr:`root`.
            extra_keys_per_block: None, or exactly one entry (tuple or None) per full block.

        Returns one digest (bytes) per full block, in order. This is the fast path:
        ``sha256_cbor``/``xxhash_cbor`` emit canonical CBOR by hand (identical bytes to
        ``cbor2.dumps(..., canonical=True)``, cbor2 is used for any block it cannot prove).
        """
        bs = self.block_size
        n = len(tokens) // bs
        if extra_keys_per_block is not None and len(extra_keys_per_block) != n:
            raise HashingError(
                f"extra_keys_per_block has {len(extra_keys_per_block)} entries but tokens hold "
                f"{n} full blocks of {bs}; give one entry (tuple or None) per full block"
            )
        if n < self._few_max and extra_keys_per_block is None and (type(tokens) is list or type(tokens) is tuple):
            return self._few(parent, tokens, n * bs) if n else []  # the simple loop, no bulk setup
        if n == 0:
            return []
        if not parent:
            parent = self.root
        if n == 1 and extra_keys_per_block is None and self._one is not None and len(parent) == self.digest_size:
            # One block (a short prompt): a single serialize + digest, no bulk setup.
            chunk = tokens[:bs]
            return [self._one(parent, chunk if type(chunk) is list or type(chunk) is tuple else list(chunk))]
        if self._cbor:
            return self._hash_cbor(tokens, n, parent, extra_keys_per_block)
        if self._serialize is not None:
            return self._hash_generic(tokens, n, parent, extra_keys_per_block)
        return self._hash_native(tokens, n, parent, extra_keys_per_block)

    def _hash_generic(
        self,
        tokens: Sequence[int],
        n: int,
        parent: bytes,
        extras: Sequence[Any] | None,
    ) -> list[bytes]:
        """The pickle algorithms: vLLM's exact serializer on the real tuple, one C call a block.

        Every block's tuple comes straight out of ``zip(*[iter(tokens)] * block_size)``
        (built in C, no list slice per block) and the serializer and digest are called
        directly. Pickling the whole prompt once and cutting it into blocks was measured
        and lost (see docs/hashing.md): pickle's per-token cost is the same in bulk, and
        the bulk passes cost more than the per-call overhead they save.
        """
        bs = self.block_size
        out: list[bytes] = []
        append = out.append
        prev = parent
        ser, proto = pickle.dumps, pickle.HIGHEST_PROTOCOL
        if n == 1:  # a decode step completed one block: no iterator, no zip
            blocks: Iterable[tuple[int, ...]] = (tuple(tokens[:bs]),)
        else:
            blocks = zip(*[iter(tokens)] * bs)
        if extras is not None:
            digest = self._digest
            for block, ek in zip(blocks, extras):
                prev = digest(ser((prev, block, ek), proto))
                append(prev)
            return out
        if self.algorithm == "sha256":
            new = hashlib.sha256  # called directly: one Python call less per block
            for block in blocks:
                prev = new(ser((prev, block, None), proto)).digest()
                append(prev)
            return out
        digest = self._digest
        for block in blocks:
            prev = digest(ser((prev, block, None), proto))
            append(prev)
        return out

    def _hash_cbor(
        self,
        tokens: Sequence[int],
        n: int,
        parent: bytes,
        extras: Sequence[Any] | None,
    ) -> list[bytes]:
        bs = self.block_size
        ahead = self._array_head
        runs = _cbor_token_runs(tokens, bs) if n >= _BULK_MIN_BLOCKS else None
        chain_prefix = self._chain_prefix
        out: list[bytes] = []
        append = out.append
        prev = parent
        if runs is not None and extras is None and len(parent) == self.digest_size:
            # The common case, a long prompt without extra keys: every block's input is
            # prefix|parent|array head|its ids|None, joined straight from the one encoding.
            encoded, sizes = runs
            a = 0
            join = b"".join
            if self.algorithm == "sha256_cbor":
                new = hashlib.sha256  # called directly: one Python call less per block
                for k in sizes:
                    b = a + k
                    prev = new(join((chain_prefix, prev, ahead, encoded[a:b], b"\xf6"))).digest()
                    append(prev)
                    a = b
            else:
                digest = self._digest
                for k in sizes:
                    b = a + k
                    prev = digest(join((chain_prefix, prev, ahead, encoded[a:b], b"\xf6")))
                    append(prev)
                    a = b
            return out
        if runs is not None:
            encoded, sizes = runs
            ends = accumulate(sizes, initial=0)
            next(ends)
            arrays: Iterable[bytes] = [ahead + encoded[e - k : e] for e, k in zip(ends, sizes)]
        else:
            # Few blocks (a decode step) or unusual ids: cbor2 on each block's token list
            # encodes exactly what vLLM's cbor2.dumps of the token tuple does.
            dumps = cbor2.dumps
            if n == 1:  # a decode step completed one block: no comprehension, no generator
                chunk = tokens[:bs]
                arrays = [dumps(chunk if type(chunk) is list else list(chunk), canonical=True)]
            else:
                arrays = [
                    dumps(chunk if type(chunk) is list else list(chunk), canonical=True)
                    for chunk in (tokens[i : i + bs] for i in range(0, n * bs, bs))
                ]
        if extras is None and len(parent) == self.digest_size:
            if self.algorithm == "sha256_cbor":
                new = hashlib.sha256
                for arr in arrays:
                    prev = new(chain_prefix + prev + arr + b"\xf6").digest()
                    append(prev)
            else:
                digest = self._digest
                for arr in arrays:
                    prev = digest(chain_prefix + prev + arr + b"\xf6")
                    append(prev)
            return out
        digest = self._digest
        dsize = self.digest_size
        for i, arr in enumerate(arrays):
            ek = None if extras is None else extras[i]
            tail = b"\xf6" if ek is None else _encode_extra(ek)
            if tail is None:
                prev = digest(_cbor_dumps((prev, tuple(tokens[i * bs : (i + 1) * bs]), ek)))
            else:
                head = chain_prefix if len(prev) == dsize else b"\x83" + _head(2, len(prev))
                prev = digest(head + prev + arr + tail)
            append(prev)
        return out

    def _hash_native(
        self,
        tokens: Sequence[int],
        n: int,
        parent: bytes,
        extras: Sequence[Any] | None,
    ) -> list[bytes]:
        bs = self.block_size
        try:
            packed = array("I", tokens[: n * bs])
        except OverflowError:
            bad = next(t for t in tokens[: n * bs] if not 0 <= t < 1 << 32)
            raise HashingError(
                f"native hashing packs token ids as uint32 but got token id {bad}; "
                "use a vLLM algorithm (e.g. 'sha256_cbor') for ids outside [0, 2**32)"
            ) from None
        except TypeError as exc:
            raise HashingError(f"native hashing needs int token ids: {exc}") from None
        if _NATIVE_BIG_ENDIAN_HOST:  # pragma: no cover - keep digests portable: little-endian
            packed.byteswap()
        raw = packed.tobytes()
        step = 4 * bs
        digest = _xxh3_128
        out: list[bytes] = []
        append = out.append
        prev = parent
        if extras is None:
            for off in range(0, n * step, step):
                prev = digest(prev + raw[off : off + step])
                append(prev)
            return out
        for i in range(n):
            chunk = prev + raw[i * step : (i + 1) * step]
            ek = extras[i]
            if ek is not None:
                # The token part has a fixed length, so appending the keys is unambiguous.
                enc = _encode_extra(ek)
                chunk += enc if enc is not None else _cbor_dumps(ek)
            prev = digest(chunk)
            append(prev)
        return out


# --------------------------------------------------------------------------------------
# Extra keys: the request-side description and its per-block forms.


@dataclass(frozen=True, slots=True)
class LoRA:
    """A request's LoRA adapter, as it enters block hashes.

    0.33 style hashes ``("lora", name, path)`` on every block and sends ``name`` on the
    wire; 0.11 style hashes ``int_id`` (vLLM's ``lora_int_id``) on every block.
    """

    name: str
    path: str = ""
    int_id: int = 0


@dataclass(frozen=True, slots=True)
class MMItem:
    """One multimodal item's placeholder in the prompt.

    Attributes:
        identifier: the item's content hash (vLLM's ``mm_feature.identifier``), a str.
        offset: index of its first placeholder token in the prompt (tokens).
        length: number of placeholder tokens (> 0).
    """

    identifier: str
    offset: int
    length: int


class BlockExtraKeys(NamedTuple):
    """The two forms of one block's extra keys.

    Attributes:
        hash_input: the tuple that goes into the block hash, or None.
        wire: ``BlockStored.extra_keys`` entry for this block: None or a list of untagged
            values (0.33: ``lora_name``, ``[identifier, offset]``, salt, digest).
    """

    hash_input: tuple[Any, ...] | None
    wire: list[Any] | None


PromptEmbedsDigest = Callable[[int, int], "bytes | None"]
"""``f(start, end)``: digest (bytes) of the prompt embeddings of tokens [start, end), or None."""


@dataclass(frozen=True, slots=True)
class RequestExtraKeys:
    """What, besides token ids, distinguishes a request's blocks.

    Attributes:
        lora: the LoRA adapter, or None.
        mm_items: multimodal placeholders, sorted by offset.
        cache_salt: a per-tenant salt; only block 0 hashes it (empty string = no salt).
        prompt_embeds_digest: ``f(start, end) -> bytes | None``, the digest of the prompt
            embeddings of tokens ``[start, end)`` (vLLM: sha256 of that tensor slice), or
            None for no such key. Called once per hashed block.
    """

    lora: LoRA | None = None
    mm_items: tuple[MMItem, ...] = ()
    cache_salt: str | None = None
    prompt_embeds_digest: PromptEmbedsDigest | None = None

    def __post_init__(self) -> None:
        items = tuple(self.mm_items)
        object.__setattr__(self, "mm_items", items)
        prev = None
        for it in items:
            if not isinstance(it, MMItem):
                raise HashingError(f"mm_items must hold MMItem values, got {it!r}")
            if it.offset < 0 or it.length <= 0:
                raise HashingError(
                    f"MMItem needs offset >= 0 and length > 0 (tokens), got offset={it.offset}, "
                    f"length={it.length} for {it.identifier!r}"
                )
            if prev is not None and it.offset < prev.offset:
                raise HashingError(
                    "mm_items must be sorted by offset (vLLM assumes it); "
                    f"{it.identifier!r} at {it.offset} comes after {prev.identifier!r} at {prev.offset}"
                )
            prev = it
        if self.lora is not None and not isinstance(self.lora, LoRA):
            raise HashingError(f"lora must be a LoRA(name, path, int_id) or None, got {self.lora!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise HashingError(f"cache_salt must be a str or None, got {type(self.cache_salt).__name__}")

    @property
    def empty(self) -> bool:
        """True when no block of the request has extra keys."""
        return (
            self.lora is None
            and not self.mm_items
            and not self.cache_salt
            and self.prompt_embeds_digest is None
        )

    def for_block(self, start: int, end: int, style: str = "0.33") -> BlockExtraKeys:
        """Both forms of the extra keys of the block spanning tokens ``[start, end)``.

        An item counts for the block when its placeholder overlaps ``[start, end)``.
        This equals vLLM for blocks hashed in a request's first hashing pass (its prompt);
        :class:`RequestBlockHasher` also reproduces vLLM's rules for blocks completed
        later (see its docstring).
        """
        items = [
            it for it in self.mm_items if it.offset < end and it.offset + it.length > start
        ]
        return self._build(start, end, items, style)

    def _build(self, start: int, end: int, items: Sequence[MMItem], style: str) -> BlockExtraKeys:
        hash_input: list[Any] = []
        wire: list[Any] = []
        lora = self.lora
        salt = self.cache_salt if start == 0 and self.cache_salt else None
        digest = self.prompt_embeds_digest(start, end) if self.prompt_embeds_digest else None
        if style == "0.33":
            if lora is not None:
                hash_input.append(("lora", lora.name, lora.path))
                wire.append(lora.name)
            for it in items:
                hash_input.append(("mm", it.identifier, it.offset - start))
                wire.append([it.identifier, it.offset - start])
            if salt is not None:
                hash_input.append(("cache_salt", salt))
                wire.append(salt)
            if digest is not None:
                hash_input.append(("prompt_embeds", digest))
                wire.append(digest)
        elif style == "0.11":
            # 0.11 hashes the bare values: lora_int_id, item identifiers, salt. (0.11.0 had
            # no prompt-embeds key; the bare digest is what the untagged releases used.)
            if lora is not None:
                hash_input.append(lora.int_id)
            for it in items:
                hash_input.append(it.identifier)
            if salt is not None:
                hash_input.append(salt)
            if digest is not None:
                hash_input.append(digest)
            wire = list(hash_input)
        else:
            raise HashingError(f"unknown extra-key style {style!r}; use '0.33' or '0.11'")
        if not hash_input:
            return BlockExtraKeys(None, None)
        return BlockExtraKeys(tuple(hash_input), wire)

    def _later_pass_cursor(self, start: int, style: str) -> int:
        """Where vLLM starts the multimodal cursor of a hashing pass that begins at token
        ``start > 0``: 0.11 at the last item (``-1``); 0.33 at the first item ending after
        ``start`` (its ``get_mm_features_in_window``), so a later pass sees every item
        still overlapping the block, as the prompt's pass does."""
        if style == "0.11":
            return -1
        return bisect_left(self.mm_items, start + 1, key=_item_end)

    def _mm_scan(self, start: int, end: int, cursor: int, style: str) -> tuple[list[MMItem], int]:
        """vLLM's per-pass multimodal cursor: the items it attaches to ``[start, end)``.

        Returns the items and the cursor for the next block of the same pass. 0.11's
        comparisons are one token looser than 0.33's at an item's end (a pass that starts
        exactly where the last item ended still attaches it); this reproduces both.
        """
        items = self.mm_items
        if not items:
            return [], cursor
        strict = style == "0.33"
        last = items[-1]
        last_end = last.offset + last.length
        if last_end <= start if strict else last_end < start:
            return [], cursor
        if cursor < 0:
            cursor += len(items)
        found: list[MMItem] = []
        while cursor < len(items):
            it = items[cursor]
            it_end = it.offset + it.length
            if end <= it.offset:
                break
            if start >= it_end if strict else start > it_end:
                cursor += 1
                continue
            found.append(it)
            if end >= it_end:
                cursor += 1
            else:
                break
        return found, cursor


def _item_end(it: MMItem) -> int:
    return it.offset + it.length


_NO_EXTRA_KEYS = RequestExtraKeys()


# --------------------------------------------------------------------------------------
# A request's growing hash list.


class RequestBlockHasher:
    """A request's block hashes, extended as its tokens arrive.

    Call :meth:`extend` with the whole prompt first, then with each batch of output tokens.
    Each call hashes only the blocks it completes; a call that completes no block costs a
    list append (O(1) amortised per decode token). Only the partial tail block's tokens
    are kept (at most ``block_size - 1`` after any call that hashes).

    For one output token at a time, :meth:`appender` gives a callable that appends a token
    id without hashing (a C call, no Python frame): the cheapest way to feed decode steps.

    Multimodal requests follow vLLM's call-dependent rule exactly. Under 0.11 style a call
    that starts past block 0 considers only the *last* item (vLLM 0.11's
    ``start_mm_idx=-1``), and attaches it even when it ended exactly where the call starts.
    Under 0.33 style such a call starts at the first item still overlapping its first
    block, which gives the same keys as plain overlap. Feed tokens in the same calls vLLM
    sees (prompt, then outputs) to get the same hashes. Requests without multimodal items,
    and 0.33-style requests, hash the same however the tokens are split.

    Args:
        hasher: the :class:`BlockHasher` (algorithm, block size, root, extra-key style).
        lora, mm_items, cache_salt, prompt_embeds_digest: see :class:`RequestExtraKeys`.
    """

    __slots__ = ("hasher", "_keys", "_bs", "_few", "_pending", "_hashes", "_wire")
    _few: Callable[[bytes | None, Sequence[int], int], list[bytes]] | None

    def __init__(
        self,
        hasher: BlockHasher,
        lora: LoRA | None = None,
        mm_items: Iterable[MMItem] = (),
        cache_salt: str | None = None,
        prompt_embeds_digest: PromptEmbedsDigest | None = None,
    ) -> None:
        # Creating a request hasher is on every request's path, and on a short prompt it is
        # most of the cost: a plain request (the usual one) sets five fields and builds
        # nothing else (``keys`` is then the shared empty description, see the property).
        self._pending: list[int] = []  # the same list for the request's lifetime (appender())
        self._hashes: list[bytes] = []
        if lora is None and cache_salt is None and prompt_embeds_digest is None and not mm_items:
            try:
                self._few = hasher._few  # set: no extra keys (_wire unset: every entry None)
            except AttributeError:
                raise HashingError(f"hasher must be a BlockHasher, got {type(hasher).__name__}") from None
            self.hasher = hasher
            self._bs = hasher.block_size
            return
        if not isinstance(hasher, BlockHasher):
            raise HashingError(f"hasher must be a BlockHasher, got {type(hasher).__name__}")
        self.hasher = hasher
        self._bs = hasher.block_size
        self._keys = keys = RequestExtraKeys(lora, tuple(mm_items), cache_salt, prompt_embeds_digest)
        if keys.empty:
            self._few = hasher._few
        else:
            self._few = None
            self._wire: list[list[Any] | None] = []

    @property
    def keys(self) -> RequestExtraKeys:
        """The request's extra keys (LoRA, mm items, cache salt, prompt-embeds digests)."""
        try:
            return self._keys
        except AttributeError:  # a plain request: nothing was built
            return _NO_EXTRA_KEYS

    @property
    def block_hashes(self) -> list[bytes]:
        """Hashes of every full block so far, in order (the live list: do not mutate)."""
        if len(self._pending) >= self._bs:  # blocks completed by appender(): hash them now
            self._flush()
        return self._hashes

    @property
    def num_tokens(self) -> int:
        """Tokens received so far (full blocks plus the partial tail)."""
        return len(self._hashes) * self._bs + len(self._pending)

    @property
    def wire_extra_keys(self) -> list[list[Any] | None]:
        """Per full block, its ``BlockStored.extra_keys`` entry (None or untagged list)."""
        if len(self._pending) >= self._bs:
            self._flush()
        return [None] * len(self._hashes) if self._few is not None else self._wire

    def appender(self) -> Callable[[int], None]:
        """A callable that appends one token id to the request without hashing it.

        It is the held-back token list's own ``append`` (a C call, no Python frame: cheaper
        than the naive loop's inline append and block-boundary test), valid for the
        request's lifetime. Get it once per request and call it per decode token. The
        blocks it completes are hashed, and their token ids checked, by the next
        :meth:`extend` (which returns them with its own) or the next read of
        :attr:`block_hashes` or :attr:`wire_extra_keys`, all in one call; with extra keys
        one pass per block, as one ``extend([t])`` per token would. A bad id appended this
        way is refused by that read (:class:`HashingError`, or the serializer's error) and
        stays held back.
        """
        return self._pending.append

    def _flush(self) -> None:
        """Hash the full blocks that :meth:`appender` calls completed."""
        pending = self._pending
        bs = self._bs
        full = len(pending) - len(pending) % bs
        few = self._few
        if few is not None:
            hashes = self._hashes
            hashes += few(hashes[-1] if hashes else None, pending, full)
            del pending[:full]
            return
        # Extra keys: one pass per block, exactly as one extend() per token hashes them
        # (vLLM's multimodal cursor depends on where each hashing call starts).
        for _ in range(full // bs):
            self._hash_full(pending[:bs], bs)
            del pending[:bs]

    def extend(self, new_token_ids: Iterable[int]) -> list[bytes]:
        """Append token ids; return the hashes of the blocks this call completed (maybe [])."""
        pending = self._pending
        if pending:
            bs = self._bs
            if len(pending) >= bs:
                # Blocks that appender() calls completed: hashed first, in passes of their own
                # (as one call per token would), and returned with this call's.
                done = len(self._hashes)
                self._flush()
                return self._hashes[done:] + self.extend(new_token_ids)
            # A decode step (tokens held back): append; hash only when a block fills.
            try:
                pending += new_token_ids
            except TypeError:
                raise HashingError(
                    f"extend() takes an iterable of token ids, got {type(new_token_ids).__name__} "
                    f"{new_token_ids!r:.40}; wrap a single token as [token]"
                ) from None
            after = len(pending)
            if after < bs:  # the usual decode step: no block completed
                return []
            few = self._few
            hashes = self._hashes
            one = self.hasher._one if after == bs and hashes and few is not None else None
            if one is not None:
                # A decode step completed one block: one serialize + digest call.
                try:
                    h = one(hashes[-1], pending)
                except BaseException:
                    if type(new_token_ids) is list or type(new_token_ids) is tuple:
                        del pending[after - len(new_token_ids) :]
                    raise
                pending.clear()
                hashes.append(h)
                return [h]
            full = after - after % bs
            try:
                if few is not None:
                    new = few(hashes[-1] if hashes else None, pending, full)
                    hashes += new
                else:
                    new = self._hash_full(pending, full)
            except BaseException:
                # A bad id: take this call's tokens back out (a sized call's; an iterator's
                # count is unknown, its tokens stay held back).
                if type(new_token_ids) is list or type(new_token_ids) is tuple:
                    del pending[after - len(new_token_ids) :]
                raise
            if full == after:
                pending.clear()
            else:
                del pending[:full]
            return new
        if type(new_token_ids) is list or type(new_token_ids) is tuple:
            # Nothing held back (a prompt, or a call that starts at a block boundary): hash
            # the caller's list where it is and keep only its partial tail, instead of
            # copying the whole prompt into the pending list and out again.
            count = len(new_token_ids)
            bs = self._bs
            full = count - count % bs
            if not full:
                pending += new_token_ids
                return []
            few = self._few
            if few is not None:
                hashes = self._hashes
                new = few(hashes[-1] if hashes else None, new_token_ids, full)
                hashes += new
            else:
                new = self._hash_full(new_token_ids, full)
            if full < count:
                pending += new_token_ids[full:]
            return new
        try:
            pending.extend(new_token_ids)
        except TypeError:
            raise HashingError(
                f"extend() takes an iterable of token ids, got {type(new_token_ids).__name__} "
                f"{new_token_ids!r:.40}; wrap a single token as [token]"
            ) from None
        after = len(pending)
        full = after - after % self._bs
        if not full:
            return []
        new = self._hash_full(pending, full)
        del pending[:full]
        return new

    def _hash_full(self, tokens: Sequence[int], full: int) -> list[bytes]:
        """Hash the ``full // block_size`` full blocks of ``tokens`` onto the request's chain.

        ``tokens`` may hold a partial block after them: hash_blocks ignores it (no slice).
        """
        bs = self._bs
        hashes = self._hashes
        parent = hashes[-1] if hashes else None
        if self._few is not None:  # no extra keys
            new = self.hasher.hash_blocks(tokens, parent)
        else:
            wire_out = self._wire
            start = len(hashes) * bs
            keys = self._keys
            style = self.hasher.extra_key_style
            cursor = 0 if start == 0 else keys._later_pass_cursor(start, style)
            extras: list[tuple[Any, ...] | None] = []
            wire: list[list[Any] | None] = []
            for s in range(start, start + full, bs):
                items, cursor = keys._mm_scan(s, s + bs, cursor, style)
                ek = keys._build(s, s + bs, items, style)
                extras.append(ek.hash_input)
                wire.append(ek.wire)
            new = self.hasher.hash_blocks(tokens, parent, extras)
            wire_out.extend(wire)
        hashes.extend(new)
        return new


# --------------------------------------------------------------------------------------
# External (wire) form.

_LITTLE_ENDIAN = sys.byteorder == "little"
_U64 = struct.Struct(">Q")


def to_external(digest: bytes, form: str = "int") -> int | bytes:
    """A block hash as events carry it.

    ``"int"``: the low 64 bits, i.e. the last 8 digest bytes read big-endian, as an
    unsigned int (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, its default).
    ``"bytes"``: the raw digest.
    """
    if form == "int":
        return _U64.unpack_from(digest, len(digest) - 8)[0]
    if form == "bytes":
        return bytes(digest)
    raise HashingError(f"unknown external form {form!r}; use 'int' or 'bytes'")


@overload
def to_external_list(digests: Sequence[bytes], form: Literal["int"] = ...) -> list[int]: ...
@overload
def to_external_list(digests: Sequence[bytes], form: Literal["bytes"]) -> list[bytes]: ...
@overload
def to_external_list(digests: Sequence[bytes], form: str) -> list[int] | list[bytes]: ...
def to_external_list(digests: Sequence[bytes], form: str = "int") -> list[int] | list[bytes]:
    """:func:`to_external` over a list of digests (one call per batch, not per hash)."""
    if form == "int":
        if not digests:
            return []
        size = len(digests[0])
        w, r = divmod(size, 8)
        if r == 0 and w and len(set(map(len, digests))) == 1:  # one C pass, no generator
            joined = b"".join(digests)
            # Equal-size digests (the normal case): every 64-bit word at once, keep the last
            # word of each digest, read big-endian.
            words = array("Q", joined)
            if _LITTLE_ENDIAN:
                words.byteswap()
            return words[w - 1 :: w].tolist()
        unpack = _U64.unpack_from
        return [unpack(d, len(d) - 8)[0] for d in digests]
    if form == "bytes":
        return [bytes(d) for d in digests]
    raise HashingError(f"unknown external form {form!r}; use 'int' or 'bytes'")
