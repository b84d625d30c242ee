"""Types of kvstream's native core (the Rust crate in ``rust/``, built by maturin).

Internal: the Python layers call it (``kvstream.hashing``, ``kvstream.routing``); users
call their APIs. Every entry point is a coarse call (a whole prompt, a whole batch).
"""

from typing import Any, Sequence

__version__: str

class NativeLocalError(ValueError):
    """A bad call into the native core (the caller's fault)."""

class NativeRemoteError(ValueError):
    """Malformed remote input seen by the native core."""

# -- block hashing (rust/src/hash) ------------------------------------------------------

def hash_chain(
    algorithm: int,
    block_size: int,
    parent: bytes,
    tokens: list[Any] | tuple[Any, ...],
    n_blocks: int,
    extras: Sequence[Any] | None = None,
) -> list[bytes] | None:
    """Chained digests of ``n_blocks`` blocks (algorithm 0 sha256, 1 sha256_cbor, 2 xxhash,
    3 xxhash_cbor, 4 native), or None when an input needs Python's own serializer."""

# -- router keys (rust/src/keys.rs) -----------------------------------------------------

ROUTER_KEY_MASK: int

def router_chain_keys(
    raw: bytes,
    n_blocks: int,
    router_block_size: int,
    seed: int,
    extras: Sequence[bytes | None] | None = None,
) -> list[int]:
    """Chained xxh3_64 keys of ``n_blocks`` router blocks of packed uint32-LE ids."""

def router_prompt_keys(
    tokens: list[int] | tuple[int, ...] | bytes,
    router_block_size: int,
    seed: int,
    extras: Sequence[bytes | None] | None = None,
) -> list[int] | None:
    """Keys of every full router block, or None when an id is not an exact int in [0, 2**32)."""

def router_pack_tokens(tokens: list[int] | tuple[int, ...]) -> bytes | None:
    """Ids as uint32-LE bytes, or None when an id is not an exact int in [0, 2**32)."""
