"""Replay-port floods for the publisher's abuse tests and the stream benchmark.

Two halves:

* :func:`engine_loop`: an engine-like task that ticks every ``tick_s`` on the publisher's
  event loop, publishes one batch per tick (as a vLLM step would) and records how late each
  tick woke: wall-clock lateness, and "busy" lateness (the part of it this thread spent
  running other code: ``min(wall lateness, thread CPU time used by others since the last
  tick)``), which ignores time the OS gave to other processes.
* the flood client (``python -m tests.transport.replay_flood MODE ENDPOINT N K``): a separate
  process (so it competes with the publisher only for cores, not for its event loop) that
  floods the replay endpoint, and alongside the flood runs one honest requester asking for
  a replay from seq 0 (re-asking after 2 s of silence, as kvstream's Subscriber does, at most
  8 times). It prints one JSON
  line per event (``sent``, ``honest``, ``flood``) and exits when its stdin closes.

Modes: ``replays`` (N requesters each replaying the whole buffer and reading it all),
``snapshots`` (N snapshot requests from N/K requesters, K each, all read), ``noread``
(N requesters each sending K replay requests, reading nothing, receive queues of 1
message).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

import zmq

from kvstream.wire.framing import END_SEQ_BYTES, encode_seq

__all__ = ["engine_loop", "Lateness", "rss_bytes", "SILENCE_S"]

SILENCE_S = 2.0
"""Seconds of silence after which the honest requester asks again (kvstream's Subscriber
default ``replay_timeout_s``)."""


def rss_bytes() -> int:
    """This process's resident set size in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Lateness:
    """Lateness samples of an engine loop, in seconds."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.busy: list[float] = []
        self.max_rss = 0
        self.max_inflight = 0

    @staticmethod
    def _pct(xs: list[float], q: float) -> float:
        s = sorted(xs)
        return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0

    def summary(self) -> dict[str, Any]:
        """p50/p99/max of both measures in milliseconds, and the sample count."""
        out: dict[str, Any] = {"ticks": len(self.wall)}
        for name, xs in (("wall", self.wall), ("busy", self.busy)):
            out[name] = {k: round(self._pct(xs, q) * 1e3, 2) for k, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))}
        return out


async def engine_loop(publish: Callable[[int], None], stop: Any, lat: Lateness, tick_s: float = 0.002,
                      sample: Callable[[], int] | None = None) -> None:
    """Tick every ``tick_s`` until ``stop.is_set()``, calling ``publish(i)`` once per tick and
    recording lateness into ``lat`` (and every 25 ticks ``rss_bytes()`` and ``sample()``)."""
    import anyio

    clock, cpu = time.perf_counter, time.thread_time
    next_t = clock()
    cpu_mark = cpu()
    i = 0
    while not stop.is_set():
        next_t += tick_s
        delay = next_t - clock()
        await anyio.sleep(delay if delay > 0 else 0)
        now, c = clock(), cpu()
        late = max(0.0, now - next_t)
        lat.wall.append(late)
        lat.busy.append(min(late, c - cpu_mark))
        if late > tick_s:
            next_t = now  # a late engine does not try to catch up
        publish(i)
        i += 1
        if i % 25 == 0:
            lat.max_rss = max(lat.max_rss, rss_bytes())
            if sample is not None:
                lat.max_inflight = max(lat.max_inflight, sample())
        cpu_mark = cpu()


# -- the flood client (separate process) -------------------------------------------------


class _Reader:
    __slots__ = ("sock", "want_ends", "ends", "batches", "seqs")

    def __init__(self, sock: zmq.Socket, want_ends: int, keep_seqs: bool = False) -> None:
        self.sock = sock
        self.want_ends = want_ends
        self.ends = 0
        self.batches = 0
        self.seqs: list[int] | None = [] if keep_seqs else None

    def drain(self) -> bool:
        """Read what is queued; True if anything arrived."""
        got = False
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return got
            got = True
            if frames[-2] == END_SEQ_BYTES:
                self.ends += 1
            else:
                self.batches += 1
                if self.seqs is not None:
                    self.seqs.append(int.from_bytes(frames[-2], "big"))


def _emit(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def _client(mode: str, endpoint: str, n: int, k: int) -> None:
    ctx = zmq.Context()
    ctx.max_sockets = 4096
    socks: list[zmq.Socket] = []
    readers: list[_Reader] = []
    t0 = time.perf_counter()
    if mode == "replays":
        for _ in range(n):
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.rcvhwm = 0
            d.connect(endpoint)
            d.send_multipart([b"", encode_seq(0)])
            readers.append(_Reader(d, 1))
    elif mode == "snapshots":
        for _ in range(max(1, n // k)):
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.rcvhwm = 0
            d.connect(endpoint)
            for _ in range(k):
                d.send_multipart([b"", b"SNAPSHOT"])
            readers.append(_Reader(d, k))
    elif mode == "noread":
        for _ in range(n):
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.rcvhwm = 1
            d.rcvbuf = 4096
            d.connect(endpoint)
            for _ in range(k):
                d.send_multipart([b"", encode_seq(0)])
            socks.append(d)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    _emit(event="sent", seconds=round(time.perf_counter() - t0, 3))

    honest_sock = ctx.socket(zmq.DEALER)
    honest_sock.linger = 0
    honest_sock.rcvhwm = 0
    honest_sock.connect(endpoint)
    honest = _Reader(honest_sock, 1, keep_seqs=True)
    attempts = 1
    h0 = last = time.perf_counter()
    honest_sock.send_multipart([b"", encode_seq(0)])
    honest_done = False
    poller = zmq.Poller()
    for r in [honest, *readers]:
        poller.register(r.sock, zmq.POLLIN)
    deadline = time.perf_counter() + 60
    flood_last = time.perf_counter()
    while time.perf_counter() < deadline:
        poller.poll(50)
        now = time.perf_counter()
        if not honest_done:
            if honest.drain():
                last = now
            if honest.ends:
                honest_done = True
                _emit(event="honest", batches=honest.batches, seqs_ok=honest.seqs == sorted(set(honest.seqs or [])),
                      first=(honest.seqs or [None])[0], last=(honest.seqs or [None])[-1],
                      seconds=round(now - h0, 3), attempts=attempts)
            elif now - last > SILENCE_S and attempts < 8:
                # Silence: the reply was cut (or never started); ask again on a new connection.
                poller.unregister(honest_sock)
                honest_sock.close(0)
                honest_sock = ctx.socket(zmq.DEALER)
                honest_sock.linger = 0
                honest_sock.rcvhwm = 0
                honest_sock.connect(endpoint)
                honest = _Reader(honest_sock, 1, keep_seqs=True)
                poller.register(honest_sock, zmq.POLLIN)
                honest_sock.send_multipart([b"", encode_seq(0)])
                attempts += 1
                last = now
        for r in readers:
            if r.drain():
                flood_last = now
        if honest_done and all(r.ends >= r.want_ends for r in readers):
            break
        if honest_done and now - flood_last > 1.5:
            break  # the rest of the flood was ignored (counted by the publisher as rejected)
    if not honest_done:
        _emit(event="honest", batches=honest.batches, seqs_ok=False, first=None, last=None,
              seconds=None, attempts=attempts)
    _emit(event="flood", readers=len(readers), ends=sum(r.ends for r in readers),
          batches=sum(r.batches for r in readers), seconds=round(time.perf_counter() - t0, 3))
    sys.stdin.read()  # keep the non-readers connected until the test is done
    for s in [*socks, honest_sock, *(r.sock for r in readers)]:
        s.close(0)
    ctx.term()


if __name__ == "__main__":
    _client(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
