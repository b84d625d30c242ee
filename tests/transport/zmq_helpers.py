"""Test helpers for the stream: a scripted vLLM-like peer serving recorded frames, a tiny
reference model of the state a batch sequence builds, and collection utilities.

The scripted peer uses real sockets: an XPUB (a PUB that also tells us when a subscriber
has joined) and a ROUTER that answers replay requests the way vLLM's does, with the exact
recorded reply frames when the request matches a recorded one.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import anyio
import anyio.lowlevel
import zmq

from kvstream.wire.capture import CaptureChannel, read_capture
from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstream.wire.framing import END_SEQ_BYTES, decode_seq
from kvstream.transport import SourceBatch, SourceReset, SourceStale


def ipc(tmp_path: Path, name: str) -> str:
    """An ipc endpoint in the test's own directory (no port collisions between helpers)."""
    return f"ipc://{tmp_path}/{name}.sock"


async def wait_readable(sock: zmq.Socket, timeout: float) -> bool:
    """True when ``sock`` has a message within ``timeout`` seconds (edge-triggered FD aware)."""
    with anyio.move_on_after(timeout):
        while not (sock.getsockopt(zmq.EVENTS) & zmq.POLLIN):
            with anyio.move_on_after(0.05):
                await anyio.wait_readable(sock.FD)
        return True
    return False


async def recv(sock: zmq.Socket, timeout: float = 5.0) -> list[bytes]:
    """Receive one multipart message or fail after ``timeout`` seconds."""
    if not await wait_readable(sock, timeout):
        raise TimeoutError("no message within %.1fs" % timeout)
    return sock.recv_multipart(zmq.NOBLOCK)


class StateModel:
    """What a consumer of a source holds: how many copies of each (medium, group, hash) are
    cached. Applies batches in order; an independent reference, not kvstream's index."""

    def __init__(self) -> None:
        self.copies: Counter = Counter()

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self.copies[(ev.medium, ev.group_idx, h)] += 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    k = (ev.medium, ev.group_idx, h)
                    self.copies[k] -= 1
                    if self.copies[k] <= 0:
                        del self.copies[k]
            elif isinstance(ev, AllBlocksCleared):
                for k in [k for k in self.copies if k[0] in ("GPU", None)]:
                    del self.copies[k]

    def snapshot_events(self) -> list[Any]:
        """Events that rebuild this state: AllBlocksCleared then one BlockStored per copy."""
        out: list[Any] = [AllBlocksCleared()]
        for (medium, group, h), n in sorted(self.copies.items(), key=repr):
            for _ in range(n):
                out.append(BlockStored([h], None, [], 0, None, medium, None, group_idx=group))
        return out

    def state(self) -> dict:
        return dict(self.copies)


def apply_items(items: Iterable[Any], source: str | None = None) -> tuple[StateModel, bool]:
    """Apply subscriber items for one source to a fresh model; returns (model, stale)."""
    m = StateModel()
    stale = False
    for it in items:
        if source is not None and getattr(it, "source", source) != source:
            continue
        if isinstance(it, SourceReset):
            m = StateModel()
            stale = False
        elif isinstance(it, SourceStale):
            stale = True
        elif isinstance(it, SourceBatch):
            m.apply(it.batch)
    return m, stale


async def collect(sub: Any, until: Callable[[list[Any]], bool], timeout: float = 10.0) -> list[Any]:
    """Items from ``sub`` until ``until(items)`` is true; fails after ``timeout`` seconds."""
    items: list[Any] = []
    with anyio.fail_after(timeout):
        async for it in sub:
            items.append(it)
            if until(items):
                break
    return items


def batches_of(items: Iterable[Any], source: str | None = None) -> list[SourceBatch]:
    return [i for i in items if isinstance(i, SourceBatch) and (source is None or i.source == source)]


class GoldenPeer:
    """A scripted vLLM publisher replaying a golden ``stream.bin``.

    ``live`` holds the recorded live messages by seq. :meth:`publish` makes seq ``s`` part
    of the replay buffer and, if ``send`` is True, sends its recorded frames on the XPUB.
    The ROUTER answers ``[id, b"", start]`` with the recorded reply frames when a recorded
    request has the same start frame, and otherwise builds the replies the same way
    (same frame count) from the published records; ``requests`` logs what was asked.
    """

    def __init__(self, capture: Path, pub_ep: str, replay_ep: str) -> None:
        recs = read_capture(capture)
        self.live: dict[int, tuple[bytes, ...]] = {}
        self.recorded: dict[bytes, list[tuple[bytes, ...]]] = {}
        self.requests: list[list[bytes]] = []
        cur: list[tuple[bytes, ...]] | None = None
        for r in recs:
            if r.channel == CaptureChannel.LIVE:
                self.live[decode_seq(r.frames[1])] = r.frames
            elif r.channel == CaptureChannel.REPLAY_REQUEST:
                cur = self.recorded.setdefault(bytes(r.frames[1]), [])
            else:
                assert cur is not None
                cur.append(r.frames)
        any_reply = next(iter(self.recorded.values()))[0]
        self.reply_frames = len(any_reply)  # 3 (vLLM 0.11) or 4 (vLLM >= 0.26)
        self.published: list[int] = []
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.linger = 0
        self.pub.bind(pub_ep)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.bind(replay_ep)
        self.pub_ep, self.replay_ep = pub_ep, replay_ep

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)

    async def wait_subscriber(self, timeout: float = 5.0) -> None:
        """Wait until a SUB has subscribed (XPUB receives the subscription message)."""
        msg = await recv(self.pub, timeout)
        assert msg[0][:1] == b"\x01", msg

    def publish(self, seq: int, send: bool = True) -> None:
        self.published.append(seq)
        if send:
            self.pub.send_multipart(self.live[seq])

    def send_raw(self, frames: Sequence[bytes]) -> None:
        self.pub.send_multipart(list(frames))

    def _reply(self, seq: int) -> list[bytes]:
        topic, seqf, payload = self.live[seq]
        return [b"", topic, seqf, payload] if self.reply_frames == 4 else [b"", seqf, payload]

    async def serve(self) -> None:
        """Answer replay requests until cancelled."""
        r = self.router
        while True:
            while r.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                ident, *rest = r.recv_multipart(zmq.NOBLOCK)
                self.requests.append(rest)
                start_frame = rest[-1]
                # vLLM reads any start frame as a big-endian int (b"SNAPSHOT" is huge).
                start = int.from_bytes(start_frame, "big")
                rec = self.recorded.get(bytes(start_frame))
                wanted = sorted(s for s in self.published if s >= start)
                if rec is not None and [decode_seq(f[-2]) for f in rec[:-1]] == wanted:
                    replies = [list(f) for f in rec]
                else:
                    replies = [self._reply(s) for s in wanted]
                    end = [b"", b"", END_SEQ_BYTES, b""] if self.reply_frames == 4 else [b"", END_SEQ_BYTES, b""]
                    replies.append(end)
                for f in replies:
                    r.send_multipart([ident, *f])
            await anyio.wait_readable(r.FD)


class ScriptedPublisher:
    """A vLLM-0.11-like publisher on real sockets whose replay answers can be damaged.

    ``publish(payload, send=True)`` gives the next seq and buffers it (``buffer_steps``);
    the ROUTER answers ``[id, b"", start]`` with 3-frame replies (no topic frame, like
    0.11) and the end marker. ``damage(start, n)`` returns the indexes of the answer's
    messages to drop (the end marker is index ``n - 1``): vLLM 0.11's ROUTER loses replies
    beyond its HWM without telling anyone. ``snapshot_forever`` answers a snapshot request
    with batches that never end (a hostile peer). ``served`` counts the answers given.
    """

    def __init__(self, pub_ep: str, replay_ep: str, *, topic: bytes = b"kv", buffer_steps: int = 10_000) -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.linger = 0
        self.pub.bind(pub_ep)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.bind(replay_ep)
        self.pub_ep, self.replay_ep = pub_ep, replay_ep
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.buf: list[tuple[int, bytes]] = []
        self.seq = 0
        self.requests: list[bytes] = []
        self.damage: Callable[[int, int], set[int]] = lambda start, n: set()
        self.snapshot_forever: bytes | None = None
        self.served = 0

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)

    async def wait_subscriber(self, timeout: float = 5.0) -> None:
        msg = await recv(self.pub, timeout)
        assert msg[0][:1] == b"\x01", msg

    def publish(self, payload: bytes, send: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        self.buf.append((seq, payload))
        del self.buf[:-self.buffer_steps]
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def serve(self) -> None:
        """Answer replay requests until cancelled."""
        r = self.router
        while True:
            while r.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                ident, _, start_frame = r.recv_multipart(zmq.NOBLOCK)
                self.requests.append(bytes(start_frame))
                if start_frame == b"SNAPSHOT" and self.snapshot_forever is not None:
                    tag = self.seq.to_bytes(8, "big")
                    while True:  # never ends; only the ROUTER's HWM slows it down
                        try:
                            r.send_multipart([ident, b"", tag, self.snapshot_forever], zmq.NOBLOCK)
                        except zmq.Again:
                            await anyio.sleep(0.001)  # the pipe is full: do not spin
                        else:
                            await anyio.lowlevel.checkpoint()
                start = int.from_bytes(start_frame, "big")
                answer = [[b"", s.to_bytes(8, "big"), p] for s, p in self.buf if s >= start]
                answer.append([b"", END_SEQ_BYTES, b""])
                drop = self.damage(start, len(answer))
                for i, frames in enumerate(answer):
                    if i not in drop:
                        r.send_multipart([ident, *frames])
                self.served += 1
            await anyio.wait_readable(r.FD)


class FaultyForwarder:
    """A live-channel forwarder on real sockets (a ZMQ proxy between engines and routers,
    as deployments put one): an XSUB connected to the engine's PUB, an XPUB bound for the
    subscribers, subscriptions passed upstream. Seeded faults on the messages it forwards:
    ``p_dup`` sends a message twice, ``p_reorder`` holds one back until after the next,
    ``drop`` (a callable on the seq frame's int) drops it. Its downstream connection
    survives an engine restart: the subscriber sees no reconnect."""

    def __init__(self, upstream: str, downstream: str, *, seed: int = 0, p_dup: float = 0.0,
                 p_reorder: float = 0.0) -> None:
        import random

        ctx = zmq.Context.instance()
        self.up = ctx.socket(zmq.XSUB)
        self.down = ctx.socket(zmq.XPUB)
        self.up.linger = self.down.linger = 0
        self.up.rcvhwm = self.down.sndhwm = 100_000
        self.down.bind(downstream)
        self.endpoint = self.down.getsockopt_string(zmq.LAST_ENDPOINT)
        self.up.connect(upstream)
        self.rng = random.Random(seed)
        self.p_dup, self.p_reorder = p_dup, p_reorder
        self.drop: Callable[[int], bool] = lambda seq: False
        self.forwarded = self.duplicated = self.reordered = self.dropped = 0
        self.subscribed = anyio.Event()

    async def serve(self) -> None:
        held: list[bytes] | None = None
        while True:
            moved = False
            while self.down.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
                msg = self.down.recv(zmq.NOBLOCK)
                self.up.send(msg)  # a subscription (or unsubscription) goes upstream
                if msg[:1] == b"\x01":
                    self.subscribed.set()
                moved = True
            while self.up.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
                frames = self.up.recv_multipart(zmq.NOBLOCK)
                moved = True
                if len(frames) == 3 and self.drop(decode_seq(frames[1])):
                    self.dropped += 1
                    continue
                if held is None and self.rng.random() < self.p_reorder:
                    held = frames
                    self.reordered += 1
                    continue
                self.down.send_multipart(frames)
                self.forwarded += 1
                if self.rng.random() < self.p_dup:
                    self.down.send_multipart(frames)
                    self.duplicated += 1
                if held is not None:
                    self.down.send_multipart(held)
                    held = None
            if not moved:
                if held is not None:
                    self.down.send_multipart(held)  # nothing followed: send it late
                    held = None
                with anyio.move_on_after(0.05):
                    await anyio.wait_readable(self.up.FD)

    def close(self) -> None:
        self.up.close(0)
        self.down.close(0)
