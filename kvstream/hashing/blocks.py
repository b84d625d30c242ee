"""Prefix-cache block hashing, bit-compatible with vLLM's v1 KV cache manager.

A KV block's identity is a hash chained over the token ids of every full block before it:

    block_hash[i] = H((block_hash[i-1] or NONE_HASH, tuple(tokens of block i), extra_keys or None))

``H`` is one of vLLM's four hash functions (``sha256``, ``sha256_cbor``, ``xxhash``,
``xxhash_cbor``) or kvstream's own ``native`` mode (not vLLM-compatible, ~10x faster).
Only full blocks are hashed. ``NONE_HASH`` is the chain's root; :func:`none_hash` derives it
with either vLLM 0.33's or 0.11's rules. Extra keys (LoRA, multimodal items, cache salt,
prompt-embeds digests) come in the 0.33 tagged form or the 0.11 untagged form, see
:class:`RequestExtraKeys`.

The per-block loops (serialize, digest, chain) run in kvstream's native core
(``kvstream._native``, Rust): one call hashes a whole prompt, byte-identical to vLLM's
``pickle``/``cbor2`` + ``hashlib``/``xxhash`` loop, which stays here as the path for the
rare inputs the core hands back. Layout of this module, bottom up: the serializers, the
root seed, :class:`BlockHasher` (one algorithm + block size + root, hashes blocks), the
request-side extra-key description, :class:`RequestBlockHasher` (a request's growing hash
list) and the external (wire) form.

This is kvstream's bottom layer: it imports nothing of kvstream but the errors and the
native core.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
import sys
from bisect import bisect_left
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, NamedTuple, Sequence, get_args, overload

import cbor2
import xxhash

from kvstream import _native
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
# vLLM's serializers and digests. The per-block loops run in the native core
# (kvstream._native.hash_chain: pickle protocol 5 and canonical CBOR emitted byte for byte,
# SHA-256 and xxh3_128 in Rust); these are the definitions it reproduces, and the path for
# the inputs it hands back (int subclasses, numpy ints, floats in CBOR, lone surrogates...).


def _cbor_dumps(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _pickle_dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_xxh3_128 = xxhash.xxh3_128_digest

# name -> (serializer, digest); native has no generic serializer (see BlockHasher).
_VLLM_FNS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickle_dumps, _sha256),
    "sha256_cbor": (_cbor_dumps, _sha256),
    "xxhash": (_pickle_dumps, _xxh3_128),
    "xxhash_cbor": (_cbor_dumps, _xxh3_128),
}

# name -> the native core's algorithm code.
_CODES: dict[str, int] = {"sha256": 0, "sha256_cbor": 1, "xxhash": 2, "xxhash_cbor": 3, "native": 4}


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

_hash_chain = _native.hash_chain
_NativeLocalError = _native.NativeLocalError


class BlockHasher:
    """Hashes full token blocks into chained block hashes with one fixed configuration.

    Immutable after construction; cheap to share between requests and threads. The
    per-block work runs in kvstream's native core, one call per chain of blocks (a prompt,
    or the blocks a decode step completed), with the GIL released for long prompts.

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
        "_code",
    )

    algorithm: str
    block_size: int
    extra_key_style: str
    root: bytes
    digest_size: int
    _serialize: Callable[[Any], bytes] | None
    _digest: Callable[[bytes], bytes]
    _code: int

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
        s(self, "_code", _CODES[algorithm])

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
        if len(tokens) != self.block_size:
            raise HashingError(
                f"hash_block needs exactly block_size={self.block_size} tokens, got {len(tokens)}; "
                "only full blocks are hashed (use hash_blocks for a longer token list)"
            )
        extras = None if extra_keys is None else (extra_keys,)
        if (type(tokens) is list or type(tokens) is tuple) and (not parent or type(parent) is bytes):
            # A decode step completed a block: straight to the native core, one call.
            out = _hash_chain(self._code, self.block_size, parent or self.root, tokens, 1, extras)
            if out is not None:
                return out[0]
        return self.hash_blocks(tokens, parent, extras)[0]

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

        Returns one digest (bytes) per full block, in order, from one call into the native
        core; an input it does not reproduce exactly (an int subclass, a numpy int, a float
        in a CBOR extra key...) is hashed with vLLM's own serializer instead.
        """
        bs = self.block_size
        n = len(tokens) // bs
        if extra_keys_per_block is not None and len(extra_keys_per_block) != n:
            raise HashingError(
                f"extra_keys_per_block has {len(extra_keys_per_block)} entries but tokens hold "
                f"{n} full blocks of {bs}; give one entry (tuple or None) per full block"
            )
        if n == 0:
            return []
        if not parent:
            parent = self.root
        if type(tokens) is not list and type(tokens) is not tuple:
            tokens = tokens.tolist() if type(tokens) is array else list(tokens[: n * bs])
        if type(parent) is bytes:
            try:
                out = _hash_chain(self._code, bs, parent, tokens, n, extra_keys_per_block)
            except _NativeLocalError as exc:  # pragma: no cover - the checks above prevent it
                raise HashingError(str(exc)) from None
            if out is not None:
                return out
        return self._hash_python(tokens, n, parent, extra_keys_per_block)

    def _plain(self, parent: bytes | None, tokens: list[int] | tuple[int, ...], full: int) -> list[bytes]:
        """The hashes of the blocks in ``tokens[:full]`` without extra keys (``full`` a
        multiple of ``block_size``, ``parent`` None or empty for the root): the request
        hasher's call, without :meth:`hash_blocks`' argument handling."""
        n = full // self.block_size
        if not n:
            return []
        prev = parent or self.root
        out = _hash_chain(self._code, self.block_size, prev, tokens, n, None)
        return out if out is not None else self._hash_python(tokens, n, prev, None)

    def _hash_python(
        self,
        tokens: Sequence[int],
        n: int,
        parent: bytes,
        extras: Sequence[Any] | None,
    ) -> list[bytes]:
        """vLLM's definition, one ``serialize((parent, tuple(block), extra_keys))`` + digest
        per block: for the inputs the native core hands back (it serializes them the way
        Python does, errors included)."""
        bs = self.block_size
        if self._serialize is None:
            return self._hash_native_python(tokens, n, parent, extras)
        serialize, digest = self._serialize, self._digest
        out: list[bytes] = []
        prev = parent
        for i in range(n):
            prev = digest(serialize((prev, tuple(tokens[i * bs : (i + 1) * bs]), None if extras is None else extras[i])))
            out.append(prev)
        return out

    def _hash_native_python(
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
        out: list[bytes] = []
        prev = parent
        for i in range(n):
            chunk = prev + raw[i * step : (i + 1) * step]
            ek = None if extras is None else extras[i]
            if ek is not None:
                # The token part has a fixed length, so appending the keys is unambiguous.
                chunk += _cbor_dumps(ek)
            prev = _xxh3_128(chunk)
            out.append(prev)
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

    __slots__ = ("hasher", "_keys", "_bs", "_plain", "_pending", "_hashes", "_wire")
    # The hasher's plain-chain call (BlockHasher._plain) when the request has no extra keys.
    _plain: Callable[[bytes | None, Any, int], list[bytes]] | None

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
                self._plain = hasher._plain  # set: no extra keys (_wire unset: every entry None)
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
            self._plain = hasher._plain
        else:
            self._plain = None
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
        return [None] * len(self._hashes) if self._plain is not None else self._wire

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
        few = self._plain
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
            few = self._plain
            hashes = self._hashes
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
            few = self._plain
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
        if self._plain is not None:  # no extra keys
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
