"""Block hashes and token ids of simulated requests, without expanding every token.

A simulated request is a list of segments ``(content_key, length)`` (see
:mod:`kvstream.sim.workload`). Hashing a Mooncake-sized prompt token by token (thousands of
tokens, millions over a trace) would dominate a simulation, yet most prompts repeat
prefixes seen before. :class:`SegmentHasher` therefore memoizes block hashes per
``(parent hash, segment, offset)``: a run of full blocks inside one segment is hashed once
and looked up afterwards, so a request costs a few dict lookups per *segment*, and the
hashes are exactly those :class:`~kvstream.hashing.BlockHasher` gives for the expanded
tokens (tested).

:class:`SegmentTokens` is the matching lazy token sequence: it materializes only the
slices asked for (the allocator slices the tokens of blocks it announces in
``BlockStored``), so tokens of prefix-cache hits are never built.
"""

from __future__ import annotations

from array import array
from typing import Iterator, Sequence, overload

from kvstream.hashing import BlockHasher
from kvstream.sim.workload import Segment, _shared_tokens

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
        return self._range(0, self._len).tolist()

    def toarray(self) -> array:
        """Every token as a new ``array('I')`` (the cheapest form for hashing)."""
        return self._range(0, self._len)

    def _range(self, start: int, stop: int) -> array:
        out = array("I")
        if start >= stop:
            return out
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
        while start < stop:
            key, n = self._segments[j]
            s0 = starts[j]
            a = start - s0
            b = min(n, stop - s0)
            toks = _shared_tokens(key, b)
            out.extend(toks[a:b] if a or b != len(toks) else toks)
            start = s0 + b
            j += 1
        return out


class SegmentHasher:
    """Chained block hashes of segment lists, memoized per segment.

    Args:
        hasher: the block hasher (algorithm, block size, root) engines and router share.
        max_entries: the memo is cleared when it grows past this many entries (bounds
            memory on very long traces; results are unaffected).

    ``hashes(segments)`` equals ``hasher.hash_blocks(expand_segments(segments))``.
    """

    __slots__ = ("hasher", "block_size", "max_entries", "_runs", "_mixed", "hits", "misses")

    def __init__(self, hasher: BlockHasher, *, max_entries: int = 2_000_000) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.max_entries = max_entries
        # (parent, key, offset, count) -> hashes of `count` full blocks of segment `key`
        # starting `offset` tokens into it, chained from `parent`.
        self._runs: dict[tuple[bytes, int, int, int], list[bytes]] = {}
        # (parent, spans) -> hash of one block made of pieces of several segments.
        self._mixed: dict[tuple[bytes, tuple[tuple[int, int, int], ...]], bytes] = {}
        self.hits = 0
        self.misses = 0

    def hashes(self, segments: Sequence[Segment], parent: bytes | None = None) -> list[bytes]:
        """Hashes of every full block of the concatenated segments (digests, in order)."""
        bs = self.block_size
        hasher = self.hasher
        runs = self._runs
        prev = parent or hasher.root
        out: list[bytes] = []
        carry: list[tuple[int, int, int]] = []  # (key, start, end) pieces of a partial block
        carry_len = 0
        for key, n in segments:
            off = 0
            if carry_len:
                take = min(bs - carry_len, n)
                carry.append((key, 0, take))
                carry_len += take
                off = take
                if carry_len < bs:
                    continue
                spans = tuple(carry)
                mk = (prev, spans)
                h = self._mixed.get(mk)
                if h is None:
                    self.misses += 1
                    toks = array("I")
                    for k, a, b in spans:
                        toks.extend(_shared_tokens(k, b)[a:b])
                    h = hasher.hash_blocks(toks, prev)[0]
                    self._mixed[mk] = h
                else:
                    self.hits += 1
                out.append(h)
                prev = h
                carry = []
                carry_len = 0
            full = (n - off) // bs
            if full:
                rk = (prev, key, off, full)
                hs = runs.get(rk)
                if hs is None:
                    self.misses += 1
                    toks = _shared_tokens(key, off + full * bs)[off : off + full * bs]
                    hs = hasher.hash_blocks(toks, prev)
                    runs[rk] = hs
                else:
                    self.hits += 1
                out.extend(hs)
                prev = hs[-1]
                off += full * bs
            if off < n:
                carry.append((key, off, n))
                carry_len = n - off
        if len(runs) + len(self._mixed) > self.max_entries:
            runs.clear()
            self._mixed.clear()
        return out
