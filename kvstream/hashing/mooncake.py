"""The standard block hash of the Mooncake KV Events API (RFC kvcache-ai/Mooncake#1527).

XXH3-64 with a seed ``S``:

* local block hash: ``XXH3(tokens as little-endian u32, concatenated, S)``, one per full
  block of ``block_size`` tokens;
* rolling sequence hash: ``seq[0] = local[0]``; ``seq[i] = XXH3(seq[i-1] as little-endian
  u64 || local[i] as little-endian u64, S)``.

A ``seq_hash`` names the whole prefix up to its block, so equal prefixes give equal hashes
until the first differing block. Publishers that follow the standard put ``seq_hashes``
in their events; ``POST /query_by_hash`` takes them; ``POST /query`` computes them from
token ids with :class:`MooncakeHasher`.
"""

from __future__ import annotations

import struct
from array import array
from typing import Sequence

import xxhash

from kvstream.errors import LocalProtocolError

__all__ = ["MooncakeHasher", "MooncakeHashError"]

_PAIR = struct.Struct("<QQ")


class MooncakeHashError(LocalProtocolError, ValueError):
    """A bad argument to the hasher (block size, seed, token id out of range)."""


class MooncakeHasher:
    """Computes RFC #1527's local and rolling sequence hashes.

    Args:
        block_size: tokens per block (> 0).
        seed: ``S``, an unsigned 64-bit int (default 0).
    """

    __slots__ = ("block_size", "seed")

    def __init__(self, block_size: int, seed: int = 0) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise MooncakeHashError(f"block_size must be a positive int (tokens), got {block_size!r}")
        if type(seed) is not int or not 0 <= seed < 2**64:
            raise MooncakeHashError(f"seed must be an unsigned 64-bit int, got {seed!r}")
        self.block_size = block_size
        self.seed = seed

    def _packed(self, tokens: Sequence[int]) -> bytes:
        try:
            a = array("I", tokens)
        except (OverflowError, TypeError) as exc:
            raise MooncakeHashError(f"token ids must be ints in 0..2**32-1: {exc}") from None
        if a.itemsize != 4:  # pragma: no cover - every platform we run on has a 4-byte "I"
            a = array("L", tokens)
        if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian hosts
            a.byteswap()
        return a.tobytes()

    def local_hashes(self, tokens: Sequence[int]) -> list[int]:
        """The local hash of every full block of ``tokens`` (a partial tail is ignored)."""
        B = self.block_size
        n = len(tokens) // B
        raw = self._packed(tokens[: n * B])
        h = xxhash.xxh3_64_intdigest
        S = self.seed
        step = 4 * B
        return [h(raw[i * step:(i + 1) * step], S) for i in range(n)]

    def seq_hashes(self, tokens: Sequence[int]) -> list[int]:
        """The rolling sequence hash of every full block of ``tokens``."""
        return self.roll(self.local_hashes(tokens))

    def roll(self, local: Sequence[int], prev: int | None = None) -> list[int]:
        """Rolling hashes of consecutive blocks with local hashes ``local``; ``prev``: the
        sequence hash of the block before the first (None: the first is block 0)."""
        h = xxhash.xxh3_64_intdigest
        pack = _PAIR.pack
        S = self.seed
        out = []
        for x in local:
            prev = x if prev is None else h(pack(prev, x), S)
            out.append(prev)
        return out

    def __repr__(self) -> str:
        return f"MooncakeHasher(block_size={self.block_size}, seed={self.seed})"
