"""Workloads for the simulator: Mooncake traces, a synthetic generator, and time scaling.

A workload is a list of :class:`SimRequest`, sorted by arrival time. A request's prompt and
output are described as *segments* ``(content_key, length)`` rather than token lists: a
segment stands for ``length`` deterministic tokens derived from ``content_key`` (see
:func:`segment_tokens`), so equal keys give equal tokens and a prompt built from the same
leading segments as another shares its prefix token for token. Keeping the segment form
lets the simulator memoize block hashes per segment instead of hashing millions of tokens.

Mooncake traces (JSON lines: ``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids`` of 512-token blocks) map each hash id to one 512-token segment; the last one
is cut to ``input_length``. Output tokens come from a per-request key outside the hash-id
key range, so outputs never collide with prompt blocks.

The synthetic generator builds shared system prompts and multi-turn conversations in which
turn *k*'s prompt is turn *k-1*'s prompt plus its output plus a new user message, with
Poisson conversation starts and exponential think times, all from one seed.

This module is pure: no clock reads, no I/O except reading the trace file it is given.
"""

from __future__ import annotations

import gc
import io
import math
import random
from array import array
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import msgspec
import xxhash

from kvstream.errors import LocalProtocolError

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "TOKEN_VOCAB",
    "Segment",
    "cut_lengths",
    "SimRequest",
    "WorkloadError",
    "segment_tokens",
    "segments_u16",
    "widen_tokens",
    "expand_segments",
    "iter_mooncake",
    "load_mooncake",
    "SyntheticConfig",
    "synthetic_workload",
    "compress_arrivals",
    "TimeScale",
    "parse_speed",
    "paused_gc",
]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per Mooncake ``hash_ids`` entry."""

TOKEN_VOCAB = 1 << 16
"""Simulated token ids are in ``[0, TOKEN_VOCAB)``."""

# Content-key namespaces. Mooncake hash ids live below _OUTPUT_NS; generated output and
# synthetic content above it, so no key of one kind can equal a key of another.
_MAX_TRACE_ID = 1 << 60
_OUTPUT_NS = 1 << 61
_SYNTH_NS = 1 << 62

Segment = tuple[int, int]
"""``(content_key, length)``: ``length`` tokens derived from ``content_key`` (tokens)."""


class WorkloadError(LocalProtocolError, ValueError):
    """A workload could not be loaded or built (bad trace line, bad generator setting).

    The message names the file and line (for traces) or the setting, the value seen and
    what is expected.
    """


class SimRequest:
    """One request of a workload.

    Attributes:
        request_id: position in the workload after sorting (0-based, unique).
        arrival: arrival time in seconds since the workload's start (virtual time).
        prompt: the prompt as segments; ``prompt_len`` tokens in total.
        prompt_len: prompt length in tokens (> 0).
        output_key: content key of the generated tokens (see :meth:`output_tokens`).
        output_len: tokens to generate (>= 1).
        session: conversation id (synthetic) or None (traces carry none).
        source_line: line number in the trace file, or None for synthetic requests.
    """

    __slots__ = (
        "request_id",
        "arrival",
        "prompt",
        "prompt_len",
        "output_key",
        "output_len",
        "session",
        "source_line",
    )

    def __init__(
        self,
        request_id: int,
        arrival: float,
        prompt: tuple[Segment, ...],
        output_key: int,
        output_len: int,
        *,
        session: int | None = None,
        source_line: int | None = None,
        prompt_len: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.prompt = prompt
        # prompt_len: the caller's known total (must equal the segments' sum), saves a pass.
        self.prompt_len = sum([n for _, n in prompt]) if prompt_len is None else prompt_len
        self.output_key = output_key
        self.output_len = output_len
        self.session = session
        self.source_line = source_line

    def __repr__(self) -> str:
        return (
            f"SimRequest(id={self.request_id}, arrival={self.arrival:.3f}s, "
            f"prompt_len={self.prompt_len}, output_len={self.output_len}, "
            f"segments={len(self.prompt)})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SimRequest):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[object, ...]:
        return (
            self.request_id,
            self.arrival,
            self.prompt,
            self.output_key,
            self.output_len,
            self.session,
        )

    def prompt_tokens(self) -> list[int]:
        """The prompt's token ids (``prompt_len`` ints); builds the list, so not for hot loops."""
        return expand_segments(self.prompt)

    def output_tokens(self) -> list[int]:
        """The ``output_len`` token ids the simulated engine generates for this request."""
        return segment_tokens(self.output_key, self.output_len).tolist()

    def renumbered(self, request_id: int, arrival: float) -> "SimRequest":
        """A copy with another id and arrival time (seconds)."""
        return SimRequest(
            request_id,
            arrival,
            self.prompt,
            self.output_key,
            self.output_len,
            session=self.session,
            source_line=self.source_line,
        )


# --------------------------------------------------------------------------------------
# Tokens


def segment_tokens(content_key: int, length: int) -> array:
    """The ``length`` deterministic token ids of a segment, as a new ``array('I')``.

    Token *i* of key *k* is the *i*-th little-endian uint16 word of the stream
    ``xxh3_128(k) || xxh3_128(k, seed=1) || ...`` (``k`` as 8 little-endian bytes), so ids
    are in ``[0, TOKEN_VOCAB)``, equal keys give equal tokens, and a shorter segment of a
    key is a prefix of a longer one, which is what a cut-off last trace block needs. The
    array is ``'I'`` (uint32) because block hashers and router keys pack token ids as
    uint32: handing them the same typecode makes that a memcpy. Generated words are cached
    per key (bounded), so repeated prefixes cost a copy.
    """
    return widen_tokens(_u16(content_key, length)[: 2 * length])


def segments_u16(segments: Iterable[Segment]) -> bytes:
    """The concatenated tokens of ``segments`` as little-endian uint16 words (2 bytes per
    token); :func:`widen_tokens` turns them into an ``array('I')``. One join for a whole
    request instead of one array operation per segment."""
    global _cached_tokens
    cache = _U16
    parts: list[bytes] = []
    append = parts.append
    x = _xxh3_128
    new = 0
    for key, n in segments:
        b = cache.get(key)
        if b is None and n <= 16 and _cached_tokens + new < _TOKEN_CACHE_LIMIT:
            # _u16's first-use path for a short segment (every block of a Mooncake trace
            # at the default granularity), inlined: the same 16 words.
            kb = key.to_bytes(8, "little")
            b = cache[key] = x(kb) + x(kb, 1)
            new += 16
        elif b is None or len(b) < 2 * n:
            _cached_tokens += new
            new = 0
            b = _u16(key, n)
        append(b if len(b) == 2 * n else b[: 2 * n])
    _cached_tokens += new
    return b"".join(parts)


def widen_tokens(raw: bytes) -> array:
    """Little-endian uint16 token words (``segments_u16``) as an ``array('I')`` of ids."""
    # Two strided byte copies (C speed) instead of a per-token loop.
    wide = bytearray(2 * len(raw))
    wide[0::4] = raw[0::2]
    wide[1::4] = raw[1::2]
    out = array("I")
    out.frombytes(wide)
    if _BIG_ENDIAN:  # pragma: no cover - keep tokens identical on every host
        out.byteswap()
    return out


def _u16(content_key: int, length: int) -> bytes:
    """At least ``length`` tokens of the key as uint16 words (the cache's own bytes)."""
    global _cached_tokens
    cached = _U16.get(content_key)
    if cached is not None and len(cached) >= 2 * length:
        return cached
    # 8 tokens per xxh3_128 digest, at least 16 tokens (a Mooncake block at the default
    # granularity is exactly that), so a later longer use of the key usually finds enough.
    kb = content_key.to_bytes(8, "little")
    if length <= 16:
        raw = _xxh3_128(kb) + _xxh3_128(kb, 1)
    else:
        raw = b"".join([_xxh3_128(kb, j) for j in range(-(-length // 8))])
    if _cached_tokens + length > _TOKEN_CACHE_LIMIT:
        _U16.clear()
        _cached_tokens = 0
        cached = None
    _U16[content_key] = raw
    _cached_tokens += len(raw) // 2 - (len(cached) // 2 if cached is not None else 0)
    return raw


# content key -> its longest generated tokens as uint16 words; bounded to
# _TOKEN_CACHE_LIMIT tokens in total (cleared wholesale when full: cheap, and results never
# depend on it).
_U16: dict[int, bytes] = {}
_TOKEN_CACHE_LIMIT = 1 << 24
_cached_tokens = 0
_BIG_ENDIAN = array("I", b"\x01\x00\x00\x00")[0] != 1
_xxh3_128 = xxhash.xxh3_128_digest


def expand_segments(segments: Iterable[Segment]) -> list[int]:
    """Concatenated token ids of ``segments`` (a list of ints)."""
    return widen_tokens(segments_u16(segments)).tolist()


# --------------------------------------------------------------------------------------
# Mooncake traces


class _TraceLine(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


_LINE_DECODER = msgspec.json.Decoder(_TraceLine)


def _line_error(path: str | Path, lineno: int, what: str) -> WorkloadError:
    return WorkloadError(
        f"{path}:{lineno}: {what}. Each line must be a JSON object "
        '{"timestamp": <ms>, "input_length": <tokens>, "output_length": <tokens>, '
        '"hash_ids": [<int>, ...]} with one hash id per 512 prompt tokens (Mooncake format)'
    )


def iter_mooncake(
    path: str | Path, *, limit: int | None = None, min_output: int = 1
) -> Iterator[SimRequest]:
    """Stream the requests of a Mooncake trace file, in file order, validating each line.

    Args:
        path: a JSON-lines file (Mooncake format); one ending in ``.xz`` or ``.gz`` (or
            starting with those formats' magic bytes) is decompressed as it is read, so
            the trace shipped in ``examples/traces/`` is read as it is.
        limit: stop after this many requests (None: the whole file).
        min_output: output lengths below this (tokens) are raised to it; an engine always
            emits at least one token for a request.

    ``request_id`` is the 0-based request index in the file, ``arrival`` the timestamp in
    seconds. Blank lines are skipped. Raises :class:`WorkloadError` naming the file and
    line for anything malformed.
    """
    if limit is not None and limit < 0:
        raise WorkloadError(f"limit must be >= 0 requests or None, got {limit}")
    fh = _open_trace(path)
    count = 0
    with fh:
        for lineno, raw in enumerate(_trace_lines(fh, path), 1):
            if limit is not None and count >= limit:
                return
            if not raw.strip():
                continue
            try:
                rec = _LINE_DECODER.decode(raw)
            except msgspec.ValidationError as exc:
                raise _line_error(path, lineno, f"invalid field ({exc})") from None
            except msgspec.DecodeError as exc:
                raise _line_error(path, lineno, f"not valid JSON ({exc})") from None
            if not (rec.timestamp >= 0 and math.isfinite(rec.timestamp)):
                raise _line_error(path, lineno, f"timestamp must be finite and >= 0 ms, got {rec.timestamp}")
            if rec.input_length <= 0:
                raise _line_error(path, lineno, f"input_length must be > 0 tokens, got {rec.input_length}")
            if rec.output_length < 0:
                raise _line_error(path, lineno, f"output_length must be >= 0 tokens, got {rec.output_length}")
            ids = rec.hash_ids
            need = -(-rec.input_length // MOONCAKE_BLOCK_TOKENS)
            if len(ids) != need:
                raise _line_error(
                    path,
                    lineno,
                    f"input_length {rec.input_length} needs {need} hash ids of 512 tokens, "
                    f"got {len(ids)}",
                )
            if min(ids) < 0 or max(ids) >= _MAX_TRACE_ID:
                h = next(h for h in ids if not 0 <= h < _MAX_TRACE_ID)
                raise _line_error(path, lineno, f"hash id {h} out of range [0, 2**60)")
            last = rec.input_length - (need - 1) * MOONCAKE_BLOCK_TOKENS
            # (id, 512) pairs built by zip/repeat at C speed; the cut last block appended.
            prompt = tuple(zip(ids, repeat(MOONCAKE_BLOCK_TOKENS, need - 1))) + ((ids[-1], last),)
            yield SimRequest(
                count,
                rec.timestamp / 1000.0,
                prompt,
                _OUTPUT_NS | count,
                max(rec.output_length, min_output),
                source_line=lineno,
                prompt_len=rec.input_length,
            )
            count += 1


_XZ_MAGIC = b"\xfd7zXZ\x00"
_GZ_MAGIC = b"\x1f\x8b"


def _open_trace(path: str | Path) -> io.BufferedIOBase:
    """The trace file opened for reading bytes, through xz or gzip decompression when its
    first bytes say it is compressed. Raises :class:`WorkloadError`."""
    try:
        raw = open(path, "rb")
    except OSError as exc:
        raise WorkloadError(f"cannot open trace {path}: {exc.strerror or exc}") from None
    try:
        with raw:
            head = raw.read(6)
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    if head.startswith(_XZ_MAGIC):
        try:
            import lzma
        except ImportError:  # a Python built without liblzma
            raise WorkloadError(f"trace {path} is xz-compressed and this Python has no lzma module; "
                                f"decompress it first (xz -dk {path})") from None
        return lzma.LZMAFile(path, "rb")
    if head.startswith(_GZ_MAGIC):
        import gzip

        return gzip.GzipFile(path, "rb")
    return open(path, "rb")


def _trace_lines(fh: io.BufferedIOBase, path: str | Path) -> Iterator[bytes]:
    """The lines of an opened trace; a damaged compressed stream is a :class:`WorkloadError`."""
    import gzip
    import zlib

    errors: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error, gzip.BadGzipFile)
    try:
        import lzma

        errors += (lzma.LZMAError,)
    except ImportError:
        pass
    try:
        yield from fh
    except errors as exc:
        raise WorkloadError(f"trace {path} cannot be decompressed: {exc}") from None


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause CPython's cyclic garbage collector inside the block, restoring its previous
    state after.

    The simulator allocates millions of small acyclic objects (segments, requests, events);
    with the collector on, its generation scans re-walk everything built so far, which
    cost a fifth of a Mooncake run. Nothing the simulator builds needs the cycle collector
    (reference counting frees it), and any cycle made meanwhile is collected after.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_mooncake(
    path: str | Path, *, limit: int | None = None, min_output: int = 1
) -> list[SimRequest]:
    """All requests of a Mooncake trace (see :func:`iter_mooncake`), sorted by arrival.

    Ties keep file order; ``request_id`` is renumbered to the sorted position when the
    file was not already sorted.
    """
    with paused_gc():
        reqs = list(iter_mooncake(path, limit=limit, min_output=min_output))
    if any(reqs[i].arrival > reqs[i + 1].arrival for i in range(len(reqs) - 1)):
        reqs.sort(key=lambda r: (r.arrival, r.request_id))
        reqs = [r.renumbered(i, r.arrival) for i, r in enumerate(reqs)]
    return reqs


# --------------------------------------------------------------------------------------
# Synthetic workload


@dataclass(frozen=True)
class SyntheticConfig:
    """Settings of the built-in synthetic workload.

    Attributes:
        requests: total requests (turns) to generate.
        duration: conversation starts are spread over about this many seconds.
        system_prompts: number of distinct shared system prompts.
        system_prompt_tokens: mean system prompt length (tokens).
        turns_mean: mean turns per conversation (geometric, >= 1).
        user_tokens_mean: mean new user-message length per turn (tokens).
        output_tokens_mean: mean generated length per turn (tokens).
        think_time_mean: mean seconds between a turn's arrival and the next turn's.
        popularity_skew: Zipf exponent of system-prompt popularity (0: uniform).
        seed: random seed; equal configs give identical workloads.
    """

    requests: int = 2000
    duration: float = 20.0
    system_prompts: int = 8
    system_prompt_tokens: int = 1024
    turns_mean: float = 4.0
    user_tokens_mean: int = 192
    output_tokens_mean: int = 160
    think_time_mean: float = 3.0
    popularity_skew: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = (
            ("requests", self.requests >= 1, "an int >= 1"),
            ("duration", self.duration > 0 and math.isfinite(self.duration), "seconds > 0"),
            ("system_prompts", self.system_prompts >= 1, "an int >= 1"),
            ("system_prompt_tokens", self.system_prompt_tokens >= 0, "tokens >= 0"),
            ("turns_mean", self.turns_mean >= 1, ">= 1"),
            ("user_tokens_mean", self.user_tokens_mean >= 1, "tokens >= 1"),
            ("output_tokens_mean", self.output_tokens_mean >= 1, "tokens >= 1"),
            ("think_time_mean", self.think_time_mean >= 0, "seconds >= 0"),
            ("popularity_skew", self.popularity_skew >= 0, ">= 0"),
        )
        for name, ok, want in checks:
            if not ok:
                raise WorkloadError(f"SyntheticConfig.{name} must be {want}, got {getattr(self, name)!r}")


def _length(rng: random.Random, mean: float) -> int:
    """A positive length around ``mean`` (tokens): uniform in [mean/2, 3*mean/2]."""
    lo = max(1, int(mean * 0.5))
    hi = max(lo, int(mean * 1.5))
    return rng.randint(lo, hi)


def synthetic_workload(config: SyntheticConfig | None = None) -> list[SimRequest]:
    """The built-in workload: shared system prompts and multi-turn conversations.

    Each conversation picks a system prompt (Zipf popularity), then runs a geometric
    number of turns; turn *k*'s prompt is the system prompt, every earlier user message and
    output, and a new user message, so consecutive turns share everything but the tail.
    Conversations start uniformly over ``duration`` seconds (Poisson given the count);
    turns follow after exponential think times and stop at ``duration``. Exactly
    ``requests`` requests, all arriving within ``[0, duration)``. Sorted by arrival, ``request_id`` = position. Deterministic for
    a given config (seeded ``random.Random``; no global state).
    """
    cfg = config or SyntheticConfig()
    rng = random.Random(cfg.seed)
    next_key = _SYNTH_NS

    def new_key() -> int:
        nonlocal next_key
        next_key += 1
        return next_key

    systems: list[Segment] = []
    for _ in range(cfg.system_prompts):
        systems.append((new_key(), _length(rng, cfg.system_prompt_tokens) if cfg.system_prompt_tokens else 0))
    weights = [1.0 / (i + 1) ** cfg.popularity_skew for i in range(cfg.system_prompts)]
    p_stop = 1.0 / cfg.turns_mean

    raw: list[tuple[float, int, int, tuple[Segment, ...], int, int]] = []
    seq = 0
    conv = 0
    # Conversations start uniformly over [0, duration) (a Poisson process conditioned on
    # its count); a conversation ends by a geometric stop or when its next turn would
    # arrive after `duration`. Stop as soon as `requests` turns exist.
    while len(raw) < cfg.requests:
        system = rng.choices(systems, weights)[0]
        history: tuple[Segment, ...] = (system,) if system[1] else ()
        arrival = rng.random() * cfg.duration
        while len(raw) < cfg.requests:
            user = (new_key(), _length(rng, cfg.user_tokens_mean))
            prompt = history + (user,)
            out_key = new_key()
            out_len = _length(rng, cfg.output_tokens_mean)
            raw.append((arrival, seq, conv, prompt, out_key, out_len))
            seq += 1
            history = prompt + ((out_key, out_len),)
            if rng.random() < p_stop:
                break
            if cfg.think_time_mean:
                arrival += rng.expovariate(1.0 / cfg.think_time_mean)
            if arrival >= cfg.duration:
                break
        conv += 1
    raw.sort(key=lambda r: (r[0], r[1]))
    return [
        SimRequest(i, arrival, prompt, out_key, out_len, session=c)
        for i, (arrival, _, c, prompt, out_key, out_len) in enumerate(raw)
    ]


# --------------------------------------------------------------------------------------
# Time


def compress_arrivals(requests: Sequence[SimRequest], factor: float) -> list[SimRequest]:
    """The same workload with arrival times divided by ``factor`` (load scaling).

    ``factor`` 2 offers the same requests in half the time: twice the request rate. This
    changes the simulated load, unlike :class:`TimeScale`, which only changes how fast
    simulated time runs against the wall clock.
    """
    if not (factor > 0 and math.isfinite(factor)):
        raise WorkloadError(f"arrival compression factor must be finite and > 0, got {factor}")
    return [r.renumbered(r.request_id, r.arrival / factor) for r in requests]


def cut_lengths(requests: Sequence[SimRequest], max_input: int | None = None,
                max_output: int | None = None) -> list[SimRequest]:
    """The same workload with prompts cut to their first ``max_input`` tokens and outputs to
    ``max_output`` tokens (None: not cut), as ``bench/bench_routers.py`` cuts the trace it
    sends to real engines, so a simulation and a bench run see the same requests."""
    for name, v in (("max_input", max_input), ("max_output", max_output)):
        if v is not None and v < 1:
            raise WorkloadError(f"{name} must be >= 1 token or None, got {v}")
    out = []
    for r in requests:
        prompt = r.prompt
        n = r.prompt_len
        if max_input is not None and n > max_input:
            segs: list[Segment] = []
            left = max_input
            for key, length in prompt:
                if left <= 0:
                    break
                segs.append((key, min(length, left)))
                left -= length
            prompt, n = tuple(segs), max_input
        out_len = r.output_len if max_output is None else min(r.output_len, max_output)
        if prompt is r.prompt and out_len == r.output_len:
            out.append(r)
            continue
        out.append(SimRequest(r.request_id, r.arrival, prompt, r.output_key, out_len, session=r.session,
                              source_line=r.source_line, prompt_len=n))
    return out


@dataclass(frozen=True)
class TimeScale:
    """How simulated time maps onto wall time.

    ``speed`` 1.0 replays in real time, ``N`` runs N times faster than real time, and
    ``math.inf`` runs as fast as possible (pure virtual time: no sleeping at all). The
    simulated results do not depend on it: only the wall-clock pacing does.
    """

    speed: float = math.inf

    def __post_init__(self) -> None:
        if not (self.speed > 0):
            raise WorkloadError(f"speed must be > 0 (1 = real time, inf = as fast as possible), got {self.speed}")

    @property
    def virtual(self) -> bool:
        """True when nothing sleeps (as fast as possible)."""
        return math.isinf(self.speed)

    def wall_seconds(self, sim_seconds: float) -> float:
        """Wall-clock seconds that ``sim_seconds`` of simulated time take (0 when virtual)."""
        return 0.0 if self.virtual else sim_seconds / self.speed


def parse_speed(text: str) -> TimeScale:
    """Parse a speed option: ``"1"``/``"1x"`` real time, ``"10x"`` ten times faster,
    ``"max"``/``"inf"``/``"virtual"`` as fast as possible."""
    s = text.strip().lower()
    if s in ("max", "inf", "virtual", "asap"):
        return TimeScale(math.inf)
    if s.endswith("x"):
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise WorkloadError(
            f"bad speed {text!r}: use a factor such as '1x' (real time) or '10x', or 'max'"
        ) from None
    if not (value > 0):
        raise WorkloadError(f"bad speed {text!r}: the factor must be > 0")
    return TimeScale(value)
