"""Router keys: kvstream's own chained block keys, independent of any engine's hash function.

An engine names a cached block by its own hash (sha256_cbor, xxhash, a seed...). A router
that wants to score a raw token prompt cannot recompute those hashes without knowing the
engine's algorithm and seed, and engines with different block sizes hash different token
spans. So the index gives every cached span of ``router_block_size`` tokens its own key::

    key[-1] = namespace(lora, cache_salt)                      (the chain's root)
    key[i]  = xxh3_64(uint32-LE tokens of router block i + mm bytes of block i,
                      seed=key[i-1])  &  KEY_MASK

* The namespace holds the LoRA adapter and the cache salt. vLLM hashes the salt into block 0
  only and the LoRA into every block; in a chain both reach every later key, so putting
  them in the root is equivalent and costs nothing per block.
* A multimodal item enters the key of the router block where its placeholder *starts*, as
  ``(identifier, start offset within that router block)``; later blocks inherit it through
  the chain. Engines send each overlapping item with an offset relative to their (larger)
  block; :func:`event_block_extras` converts that to the router-block form, so both sides
  agree whatever the engine's block size.
* A prompt-embeddings digest (0.33 ``extra_keys`` bytes entries) goes into every router
  block of its engine block. A token prompt never carries one, so such blocks never match
  a plain token prompt (which is right: the embeddings, not the ids, made the KV).

Keys are masked to 60 bits: CPython stores them in 32 bytes instead of 40, and the chance
of any collision among 10**7 live keys is ~4e-5.

The per-block loop (packing a token list, one xxh3_64 per router block) runs in kvstream's
native core (``kvstream._native``): one call per prompt or per run of blocks. This module
imports nothing of kvstream's but the errors and the native core.
"""

from __future__ import annotations

from array import array
from typing import Any, Final, Sequence

import xxhash

from kvstream import _native
from kvstream.errors import LocalProtocolError

__all__ = [
    "KEY_MASK",
    "RouterKeyError",
    "namespace",
    "event_namespace",
    "pack_tokens",
    "chain_keys",
    "prompt_keys",
    "mm_extras",
    "event_block_extras",
]

KEY_MASK: Final = (1 << 60) - 1
"""Router keys are ints in ``[0, 2**60)``."""

_xxh3_64 = xxhash.xxh3_64_intdigest
_native_chain = _native.router_chain_keys
_native_prompt = _native.router_prompt_keys
_native_pack = _native.router_pack_tokens


class RouterKeyError(LocalProtocolError, ValueError):
    """Tokens or extra keys that router keys cannot represent (says which and why)."""


def namespace(lora: str | int | None = None, salt: str | None = None) -> int:
    """The root of a key chain for a LoRA adapter and a cache salt.

    Args:
        lora: the adapter's *name* (str) for engines that send ``lora_name`` (vLLM >= 0.33),
            or its int id for engines that only send ``lora_id`` (vLLM 0.11). None: base model.
        salt: the request's ``cache_salt``; None or "" means no salt.

    Returns a key (int in ``[0, 2**60)``). The base-model, unsalted namespace is a fixed
    constant, so it is computed once.
    """
    if lora is None and not salt:
        return _BASE_NS
    return _namespace(lora, salt or None)


def _namespace(lora: str | int | None, salt: str | None) -> int:
    parts = [b"kvstream-ns-1"]
    if lora is None:
        parts.append(b"\x00")
    elif isinstance(lora, bool) or not isinstance(lora, (str, int)):
        raise RouterKeyError(
            f"lora must be the adapter name (str), its int id, or None; got {lora!r}"
        )
    elif isinstance(lora, str):
        parts.append(b"\x01" + lora.encode("utf-8", "surrogatepass"))
    else:
        parts.append(b"\x02" + str(lora).encode())
    if salt is None:
        parts.append(b"\x00")
    else:
        parts.append(b"\x01" + salt.encode("utf-8", "surrogatepass"))
    # Length-prefix every part so that no two different inputs give the same bytes.
    data = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
    return _xxh3_64(data) & KEY_MASK


_BASE_NS: Final = _namespace(None, None)


def event_namespace(lora_name: str | None, lora_id: int | None, salt: str | None) -> int:
    """The namespace of a ``BlockStored`` run that starts at block 0 (parent None).

    The name wins when the engine sends both (0.33 sends both; the name is what it hashes).
    """
    if lora_name is not None:
        return namespace(lora_name, salt)
    return namespace(lora_id, salt)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (4 bytes per token).

    An ``array('I')`` (what :meth:`kvstream.service.core.ServiceCore.tokens_of` returns)
    is already packed: its bytes are taken as they are (no per-token work).

    Raises :class:`RouterKeyError` for an id outside ``[0, 2**32)`` or a non-int.
    """
    if type(tokens) is array and tokens.typecode == "I" and tokens.itemsize == 4 and not _BIG_ENDIAN:
        return tokens.tobytes()
    if type(tokens) is list or type(tokens) is tuple:
        raw = _native_pack(tokens)  # None: an id that is not an exact int in range (below says which)
        if raw is not None:
            return raw
    try:
        a = array("I", tokens)
    except OverflowError:
        bad = next(t for t in tokens if not 0 <= t < 1 << 32)
        raise RouterKeyError(
            f"token id {bad} is outside [0, 2**32); router keys pack ids as uint32"
        ) from None
    except TypeError as exc:
        raise RouterKeyError(f"token ids must be ints: {exc}") from None
    if _BIG_ENDIAN:  # pragma: no cover - keep keys identical across hosts
        a.byteswap()
    return a.tobytes()


_BIG_ENDIAN: Final = array("I", [1]).tobytes()[0] == 0


def chain_keys(
    raw: bytes,
    n_blocks: int,
    router_block_size: int,
    seed: int,
    extras: Sequence[bytes | None] | None = None,
) -> list[int]:
    """The chained keys of ``n_blocks`` router blocks of packed tokens ``raw``.

    Args:
        raw: :func:`pack_tokens` output holding at least ``n_blocks * router_block_size`` ids.
        n_blocks: how many router blocks to key.
        router_block_size: tokens per router block.
        seed: the key before the first block (a namespace, or the parent block's key).
        extras: None, or one entry per block: extra bytes (mm items, digest) or None.
    """
    if type(raw) is not bytes:
        raw = bytes(raw)
    try:
        return _native_chain(raw, n_blocks, router_block_size, seed, extras)
    except _native.NativeLocalError as exc:
        raise RouterKeyError(str(exc)) from None


def _mm_bytes(identifier: Any, offset: int) -> bytes:
    ident = identifier if isinstance(identifier, bytes) else str(identifier).encode("utf-8", "surrogatepass")
    return b"\x01" + len(ident).to_bytes(4, "little") + ident + offset.to_bytes(4, "little")


def _digest_bytes(digest: bytes) -> bytes:
    return b"\x02" + len(digest).to_bytes(4, "little") + digest


def mm_extras(
    n_blocks: int,
    router_block_size: int,
    mm_items: Sequence[Any] | None,
) -> list[bytes | None] | None:
    """Per router block, the extra bytes that multimodal items put into its key.

    ``mm_items``: objects with ``identifier`` and ``offset`` (tokens from the prompt start;
    e.g. :class:`kvstream.hashing.MMItem`) or ``(identifier, offset)`` pairs. Items that
    start beyond the last full block do not matter. Returns None when no block has extras.
    """
    if not mm_items:
        return None
    out: list[bytes | None] = [None] * n_blocks
    any_set = False
    R = router_block_size
    for it in mm_items:
        if isinstance(it, (tuple, list)):
            ident, off = it[0], it[1]
        else:
            ident, off = it.identifier, it.offset
        if not isinstance(off, int) or off < 0:
            raise RouterKeyError(f"a multimodal item's offset must be an int >= 0 (tokens), got {off!r}")
        j = off // R
        if j >= n_blocks:
            continue
        b = _mm_bytes(ident, off - j * R)
        out[j] = b if out[j] is None else out[j] + b  # type: ignore[operator]
        any_set = True
    return out if any_set else None


def prompt_keys(
    tokens: Sequence[int],
    router_block_size: int,
    lora: str | int | None = None,
    salt: str | None = None,
    mm_items: Sequence[Any] | None = None,
) -> list[int]:
    """The router keys of every full router block of a prompt (a partial tail is ignored)."""
    n = len(tokens) // router_block_size
    if n == 0:
        return []
    seed = namespace(lora, salt)
    extras = mm_extras(n, router_block_size, mm_items)
    if type(tokens) is array and tokens.typecode == "I" and tokens.itemsize == 4 and not _BIG_ENDIAN:
        return _native_chain(tokens.tobytes(), n, router_block_size, seed, extras)
    keys = _native_prompt(tokens, router_block_size, seed, extras) if type(tokens) is list or type(tokens) is tuple else None
    if keys is None:  # not a plain list of uint32 ids: pack_tokens converts it or says why not
        raw = pack_tokens(tokens[: n * router_block_size] if len(tokens) != n * router_block_size else tokens)
        keys = _native_chain(raw, n, router_block_size, seed, extras)
    return keys


def event_block_extras(
    extra_keys: Sequence[Any] | None,
    lora_name: str | None,
    n_engine_blocks: int,
    per: int,
    router_block_size: int,
    first_is_block0: bool,
) -> tuple[str | None, list[bytes | None] | None]:
    """Parse a ``BlockStored.extra_keys`` list into (salt, per-router-block extra bytes).

    The 0.33 wire form is one entry per engine block: None, or a list of untagged values
    in vLLM's order: the LoRA name (str, when the event has ``lora_name``), multimodal
    items ``[identifier, offset relative to the engine block]``, the cache salt (str, block
    0 only), a prompt-embeddings digest (bytes). ``per`` router blocks make one engine
    block. Returns the salt of block 0 (only when ``first_is_block0``) and the extras
    (None when there are none).

    Raises :class:`RouterKeyError` for an entry it cannot read.
    """
    if not extra_keys:
        return None, None
    if len(extra_keys) != n_engine_blocks:
        raise RouterKeyError(
            f"extra_keys has {len(extra_keys)} entries for {n_engine_blocks} blocks; "
            "vLLM sends one entry (None or a list) per block"
        )
    salt: str | None = None
    out: list[bytes | None] = [None] * (n_engine_blocks * per)
    any_set = False
    R = router_block_size
    for i, entry in enumerate(extra_keys):
        if entry is None:
            continue
        if not isinstance(entry, (list, tuple)):
            raise RouterKeyError(f"extra_keys[{i}] must be None or a list, got {type(entry).__name__}")
        vals = list(entry)
        if lora_name is not None and vals and vals[0] == lora_name:
            vals = vals[1:]
        digest: bytes | None = None
        for v in vals:
            if isinstance(v, (list, tuple)):
                if len(v) != 2 or not isinstance(v[1], int):
                    raise RouterKeyError(
                        f"extra_keys[{i}] multimodal entry must be [identifier, offset], got {v!r:.100}"
                    )
                rel = v[1]
                if rel < 0:
                    continue  # the item started in an earlier block: already in the chain
                j = rel // R
                if j >= per:
                    raise RouterKeyError(
                        f"extra_keys[{i}] multimodal offset {rel} is beyond the block "
                        f"({per * R} tokens)"
                    )
                b = _mm_bytes(v[0], rel - j * R)
                k = i * per + j
                out[k] = b if out[k] is None else out[k] + b  # type: ignore[operator]
                any_set = True
            elif isinstance(v, str):
                if i == 0 and first_is_block0:
                    salt = v
                # A str elsewhere is a 0.11-style bare value with no key meaning for us.
            elif isinstance(v, (bytes, bytearray)):
                digest = bytes(v)
            # Other scalars (0.11 bare ints) carry no information router keys can use.
        if digest is not None:
            d = _digest_bytes(digest)
            for k in range(i * per, (i + 1) * per):
                out[k] = d if out[k] is None else out[k] + d  # type: ignore[operator]
            any_set = True
    return salt, (out if any_set else None)
