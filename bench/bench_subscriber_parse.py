"""The subscriber's per-message live path: framing through ``kvstream.wire.framing`` (one
place) against the inline parsing it replaced, on vLLM's own recorded frames.

Prints, per message (ns): the old inline check + unpack (the reference), ``split_live``,
and the whole live path after the socket (split, decode, ``SourceTracker.on_live``) with
each. Run: .venv/bin/python bench/bench_subscriber_parse.py
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

from kvstream.transport.recovery import SourceTracker
from kvstream.wire.capture import CaptureChannel, read_capture
from kvstream.wire.events import EventDecoder
from kvstream.wire.framing import FrameError, split_live

_SEQ = struct.Struct(">Q")


def _frames() -> list[list[bytes]]:
    cap = Path(__file__).resolve().parent.parent / "tests" / "data" / "golden" / "vllm-0.33.0" / "stream.bin"
    live = [list(r.frames) for r in read_capture(cap) if r.channel == CaptureChannel.LIVE]
    # Renumber so the tracker sees one long in-order stream.
    out = []
    for i in range(200_000):
        t, _, p = live[i % len(live)]
        out.append([t, _SEQ.pack(i), p])
    return out


def inline(frames: list[list[bytes]]) -> int:
    unpack = _SEQ.unpack
    n = 0
    for f in frames:
        if len(f) != 3 or len(f[1]) != 8:
            continue
        topic, seqf, payload = f
        n += unpack(seqf)[0] & 1
    return n


def framed(frames: list[list[bytes]]) -> int:
    split = split_live
    n = 0
    for f in frames:
        try:
            topic, seq, payload = split(f)
        except FrameError:
            continue
        n += seq & 1
    return n


def path(frames: list[list[bytes]], use_split: bool) -> None:
    t = SourceTracker("s", has_replay=False)
    t.connected = True
    decode = EventDecoder().decode
    unpack = _SEQ.unpack
    split = split_live
    for f in frames:
        if use_split:
            try:
                topic, seq, payload = split(f)
            except FrameError:
                continue
        else:
            if len(f) != 3 or len(f[1]) != 8:
                continue
            topic, seqf, payload = f
            seq = unpack(seqf)[0]
        t.on_live(seq, topic, payload, decode(payload), 0.0)
        if len(t.out) > 4096:
            t.out = []


def _time(fn, *a) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fn(*a)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    frames = _frames()
    n = len(frames)
    print(f"{n} live messages from vLLM 0.33's golden capture; best of 5; ns per message")
    ref = _time(inline, frames) / n * 1e9
    new = _time(framed, frames) / n * 1e9
    print(f"frame check + seq   inline (reference) {ref:7.1f}   framing.split_live {new:7.1f}")
    ref = _time(path, frames, False) / n * 1e9
    new = _time(path, frames, True) / n * 1e9
    print(f"whole live path     inline (reference) {ref:7.1f}   framing.split_live {new:7.1f}"
          f"   ({(new - ref) / ref * 100:+.1f}%)")


if __name__ == "__main__":
    main()
