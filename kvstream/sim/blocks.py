"""Block hashes, router keys and token ids of simulated requests, computed once per prefix.

A simulated request is a list of segments ``(content_key, length)`` (see
:mod:`kvstream.sim.workload`). Hashing a Mooncake-sized prompt token by token (thousands of
tokens, millions over a trace) would dominate a simulation, yet most prompts repeat
prefixes seen before. :class:`SegmentHasher` therefore memoizes block hashes per
``(parent hash, segment, offset)``: a request costs one dict lookup per segment up to the
first block never seen before, and everything from there on (which cannot have been seen:
its parent is new) is hashed with one ``hash_blocks`` call. The hashes are exactly those
:class:`~kvstream.hashing.BlockHasher` gives for the expanded tokens (tested).
:meth:`SegmentHasher.router_keys` does the same for the router's keys of a prompt, memoized
per engine block hash (both name the same token prefix).

:class:`SegmentTokens` is a lazy token sequence over segments: it materializes only the
slices asked for.
"""

from __future__ import annotations

from array import array
from typing import Iterator, Sequence, overload

from kvstream.hashing import BlockHasher
from kvstream.routing.keys import chain_keys, namespace, pack_tokens
from kvstream.sim.workload import Segment, _u16, segments_u16, widen_tokens

__all__ = ["SegmentHasher", "SegmentTokens"]


class SegmentTokens(Sequence[int]):
    """The tokens of a list of segments as a read-only sequence, built lazily per slice.

    ``len()`` is the total length (tokens); indexing and slicing with step 1 are supported
    and return ints / lists of ints. Appending is done with :meth:`extend_segment`.
    """

    __slots__ = ("_segments", "_starts", "_len")

    def __init__(self, segments: Sequence[Segment] = ()) -> None:
        self._segments: list[Segment] = []
        self._starts: list[int] = []
        self._len = 0
        for seg in segments:
            self.extend_segment(seg)

    def extend_segment(self, segment: Segment) -> None:
        """Append a segment's tokens (only the description is stored)."""
        if segment[1] <= 0:
            return
        self._segments.append(segment)
        self._starts.append(self._len)
        self._len += segment[1]

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                return self.tolist()[i]
            return self._range(start, stop).tolist()
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("SegmentTokens index out of range")
        return self._range(i, i + 1)[0]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def tolist(self) -> list[int]:
        """Every token (a list of ints)."""
        return self.toarray().tolist()

    def toarray(self) -> array:
        """Every token as a new ``array('I')`` (the cheapest form for hashing)."""
        return widen_tokens(segments_u16(self._segments))

    def _range(self, start: int, stop: int) -> array:
        if start >= stop:
            return array("I")
        starts = self._starts
        # Binary search for the segment holding `start`.
        lo, hi = 0, len(starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if starts[mid] <= start:
                lo = mid
            else:
                hi = mid - 1
        j = lo
        parts = []
        while start < stop:
            key, n = self._segments[j]
            s0 = starts[j]
            a = start - s0
            b = min(n, stop - s0)
            parts.append(_u16(key, b)[2 * a : 2 * b])
            start = s0 + b
            j += 1
        return widen_tokens(b"".join(parts))


class SegmentHasher:
    """Chained block hashes (and router keys) of segment lists, memoized per segment.

    Args:
        hasher: the block hasher (algorithm, block size, root) engines and router share.
        max_entries: the memos are cleared when they grow past this many entries (bounds
            memory on very long traces; results are unaffected).

    ``hashes(segments)`` equals ``hasher.hash_blocks(expand_segments(segments))``.
    Attributes ``hits`` / ``misses``: memo lookups that found a run of blocks / calls that
    had to hash.
    """

    __slots__ = ("hasher", "block_size", "max_entries", "_one", "_runs", "_mixed", "_rkeys",
                 "hits", "misses")

    def __init__(self, hasher: BlockHasher, *, max_entries: int = 2_000_000) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.max_entries = max_entries
        # parent + key (8 bytes, little-endian) -> hash of a segment that is exactly one
        # block, starting a block (Mooncake blocks: the common case, kept apart). Keys are
        # bytes, not (parent, key) tuples: a dict of bytes is invisible to the cycle
        # collector, which would otherwise walk ~200k tuples after a cold Mooncake run.
        self._one: dict[bytes, bytes] = {}
        # (parent, key, offset, count) -> hashes of `count` full blocks of segment `key`
        # starting `offset` tokens into it, chained from `parent`.
        self._runs: dict[tuple[bytes, int, int, int], list[bytes]] = {}
        # (parent, spans) -> hash of one block made of pieces of several segments.
        self._mixed: dict[tuple[bytes, tuple[tuple[int, int, int], ...]], bytes] = {}
        # engine block hash -> router key of the same token prefix (see router_keys).
        self._rkeys: dict[bytes, int] = {}
        self.hits = 0
        self.misses = 0

    def hashes(
        self,
        segments: Sequence[Segment],
        parent: bytes | None = None,
        tokens: Sequence[int] | None = None,
    ) -> list[bytes]:
        """Hashes of every full block of the concatenated segments (digests, in order).

        ``tokens``: the segments' expanded tokens if the caller has them (an
        ``array('I')`` is cheapest); built from the segments otherwise, and only from the
        first block the memo does not know.
        """
        bs = self.block_size
        one = self._one
        runs = self._runs
        mixed = self._mixed
        prev = parent or self.hasher.root
        out: list[bytes] = []
        # Once a block misses, every later block misses too (its parent is new): they are
        # hashed in one call into `bulk` (hashes of blocks `base`, `base + 1`, ...), and the
        # rest of the walk only records them in the memos.
        bulk: list[bytes] | None = None
        hs: list[bytes] | None  # a run of block hashes (None: not memoized yet)
        base = 0
        carry: list[tuple[int, int, int]] = []  # (key, start, end) pieces of a partial block
        carry_len = 0
        j = 0
        nseg = len(segments)
        while j < nseg:
            key, n = segments[j]
            j += 1
            if n == bs and not carry_len:
                ok = prev + key.to_bytes(8, "little")
                if bulk is None:
                    h = one.get(ok)
                    if h is not None:
                        self.hits += 1
                        out.append(h)
                        prev = h
                        continue
                    base = len(out)
                    bulk = self._bulk(segments, tokens, base, prev)
                # Record the whole stretch of one-block segments starting here at once.
                m = j
                while m < nseg and segments[m][1] == bs:
                    m += 1
                i = len(out) - base
                hs = bulk[i : i + m - j + 1]
                one.update(zip([p + k.to_bytes(8, "little") for p, (k, _) in zip([prev] + hs[:-1], segments[j - 1 : m])], hs))
                out.extend(hs)
                prev = hs[-1]
                j = m
                continue
            off = 0
            if carry_len:
                take = min(bs - carry_len, n)
                carry.append((key, 0, take))
                carry_len += take
                off = take
                if carry_len < bs:
                    continue
                mk = (prev, tuple(carry))
                h = None
                if bulk is None:
                    h = mixed.get(mk)
                    if h is not None:
                        self.hits += 1
                    else:
                        base = len(out)
                        bulk = self._bulk(segments, tokens, base, prev)
                if h is None:
                    h = bulk[len(out) - base]  # type: ignore[index]
                    mixed[mk] = h
                out.append(h)
                prev = h
                carry = []
                carry_len = 0
            full = (n - off) // bs
            if full:
                rk = (prev, key, off, full)
                hs = None
                if bulk is None:
                    hs = runs.get(rk)
                    if hs is not None:
                        self.hits += 1
                    else:
                        base = len(out)
                        bulk = self._bulk(segments, tokens, base, prev)
                if hs is None:
                    i = len(out) - base
                    hs = bulk[i : i + full]  # type: ignore[index]
                    runs[rk] = hs
                out.extend(hs)
                prev = hs[-1]
                off += full * bs
            if off < n:
                carry.append((key, off, n))
                carry_len = n - off
        if len(one) + len(runs) + len(mixed) > self.max_entries:
            one.clear()
            runs.clear()
            mixed.clear()
        return out

    def _bulk(self, segments: Sequence[Segment], tokens: Sequence[int] | None, first: int,
              prev: bytes) -> list[bytes]:
        """Hashes of every full block from block ``first`` on, chained from ``prev``."""
        self.misses += 1
        bs = self.block_size
        if tokens is None:
            tokens = widen_tokens(segments_u16(segments))
        end = len(tokens) // bs * bs
        return self.hasher.hash_blocks(tokens[first * bs : end], prev)

    def router_keys(self, block_hashes: Sequence[bytes], n: int, tokens: Sequence[int]) -> list[int]:
        """The router keys (:func:`kvstream.routing.keys.prompt_keys`, no LoRA or salt, router
        block = this block size) of the first ``n`` blocks of a request whose engine block
        hashes are ``block_hashes`` and whose tokens are ``tokens`` (at least ``n`` blocks).

        Equal to ``prompt_keys(tokens[:n * block_size], block_size)``; memoized per engine
        block hash, so only blocks never seen before are keyed.
        """
        memo = self._rkeys
        keys = list(map(memo.get, block_hashes[:n]))
        try:
            i = keys.index(None)
        except ValueError:
            return keys  # type: ignore[return-value]
        bs = self.block_size
        seed = keys[i - 1] if i else namespace()
        new = chain_keys(pack_tokens(tokens[i * bs : n * bs]), n - i, bs, seed)  # type: ignore[arg-type]
        keys[i:] = new
        if len(memo) > self.max_entries:
            memo.clear()
        memo.update(zip(block_hashes[i:n], new))
        return keys  # type: ignore[return-value]
