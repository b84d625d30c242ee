"""A deterministic fault campaign for the subscriber's recovery rules (FoundationDB style).

A seeded simulation of engines, publishers, a network and a subscriber shell drives the
sans-IO :class:`~kvstream.transport.recovery.SourceTracker` (one per source) and a
:class:`~kvstream.routing.index.KVIndex` (the consumer). Nothing here is a mock of ours:
the engines are real :class:`~kvstream.allocator.manager.KVCacheManager` s on real
:class:`~kvstream.allocator.pool.BlockPool` s, their events are encoded and decoded with
the real wire codec, and the items go through the router's real ``apply_item``. Only
sockets and the clock are simulated (a heap of timed events), like the shell would see
them.

A nemesis injects, per seed, a random mix of: live batches dropped (a PUB over its HWM),
replay replies dropped in the middle (vLLM 0.11's ROUTER over its HWM), replies cut at the
tail (no end marker), answers delayed beyond the timeout, engine restarts (seqs from 0,
before or after a snapshot join), idling right after a loss, prefix-cache resets, late
subscriber joins (snapshot joins when the buffer has rotated), reconnects without a
restart (network blips), and several sources interleaved. A source may sit behind a
*forwarder* (a ZMQ proxy in the live path): it duplicates and reorders live messages, and
its downstream connection hides the engine's restarts and blips (no reconnect event). It
keeps one queue per upstream connection, so a message of an old engine instance never
arrives after one of the new instance (duplicates and reordering stay within an instance).

The checker runs whenever the world is quiet (no message in flight, no timer pending):
every source must be exactly its engine's residency (block hash -> physical copies) or
visibly not (``connecting``, ``recovering`` or ``stale``). ``live`` and different is a
*silent wrong*, the one outcome the subscriber promises never to produce.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from kvstream.allocator.manager import KVCacheManager
from kvstream.allocator.pool import BlockPool
from kvstream.hashing import BlockHasher
from kvstream.routing.index import KVIndex
from kvstream.routing.router import apply_item
from kvstream.transport.recovery import SourceTracker
from kvstream.wire.events import KVEventBatch, decode_batch, encode_batch

FAULTS = ("live_drop", "reply_hole", "reply_cut", "answer_delay", "restart", "idle_after_loss",
          "reset_cache", "late_join", "reconnect", "fwd_duplicate", "fwd_reorder", "hidden_restart")
"""Every kind of fault the nemesis injects (counted per run)."""

BLOCK = 4
TIMEOUT = 1.0
PROBE = 0.5


class Engine:
    """One engine instance: a real pool and manager, and the requests it runs."""

    def __init__(self, rng: random.Random, blocks: int) -> None:
        self.pool = BlockPool(blocks, BLOCK, hash_form="int")
        self.mgr = KVCacheManager(self.pool, BlockHasher("native", BLOCK))
        self.rng = rng
        self.running: list[Any] = []
        self.n = 0

    def step(self) -> list[Any]:
        """One scheduler step: maybe admit, decode, finish; the events it produced."""
        rng, mgr = self.rng, self.mgr
        if rng.random() < 0.7:
            # Few distinct prompts, often one block long: shared prefixes, recomputed
            # one-block prompts (duplicate copies) and evictions.
            base = rng.randrange(6)
            n = rng.choice((BLOCK, BLOCK, 2 * BLOCK, 3 * BLOCK - 1))
            toks = [(base * 7 + i) % 23 for i in range(n)]
            self.n += 1
            req = mgr.new_request(f"r{self.n}", toks)
            if mgr.admit(req):
                self.running.append(req)
        for req in list(self.running):
            if rng.random() < 0.5:
                if not mgr.decode(req, rng.randrange(23)):
                    self._finish(req)
        while self.running and rng.random() < 0.35:
            self._finish(self.running[rng.randrange(len(self.running))])
        return mgr.take_events()

    def reset_cache(self) -> list[Any]:
        for req in list(self.running):
            self._finish(req)
        self.mgr.reset_prefix_cache()
        return self.mgr.take_events()

    def _finish(self, req: Any) -> None:
        self.running.remove(req)
        self.mgr.free(req)

    def truth(self) -> Counter:
        """Physical cached copies per event hash (what the index must hold for this source)."""
        return Counter(b.ext_hash for b in self.pool.blocks if b.block_hash is not None)


class Publisher:
    """A vLLM-like publisher: seqs, a replay buffer, optional snapshots (kvstream's)."""

    def __init__(self, world: "World", name: str, engine: Engine, *, buffer: int, snapshots: bool) -> None:
        self.world = world
        self.name = name
        self.engine = engine
        self.buffer_steps = buffer
        self.snapshots = snapshots
        self.seq = 0
        self.buf: list[tuple[int, bytes]] = []
        self.instance = 0

    def publish(self, events: list[Any]) -> None:
        if not events:
            return
        w = self.world
        payload = encode_batch(KVEventBatch(w.now + self.instance * 1e6, events))
        seq = self.seq
        self.seq += 1
        self.buf.append((seq, payload))
        if len(self.buf) > self.buffer_steps:
            del self.buf[0]
        w.send_live(self, seq, payload)

    def answer(self, start: int | None, deliver: Callable[[list[tuple[int, bytes] | None]], None]) -> None:
        """Answer a replay request (``start``) or a snapshot request (None)."""
        if start is None:
            if not self.snapshots:
                deliver([None])
                return
            tag = self.seq
            evs = self.engine.pool.snapshot_events()
            out: list[tuple[int, bytes] | None] = []
            for i in range(0, len(evs), 8):
                out.append((tag, encode_batch(KVEventBatch(self.world.now, evs[i:i + 8]))))
            out.append(None)
            deliver(out)
            return
        deliver([(s, p) for s, p in self.buf if s >= start] + [None])

    def restart(self, rng: random.Random, blocks: int) -> None:
        self.engine = Engine(rng, blocks)
        self.seq = 0
        self.buf = []
        self.instance += 1


@dataclass
class Stats:
    """Counts of one run (summed over seeds by the soak script)."""

    seeds: int = 0
    steps: int = 0
    checks: int = 0
    silent_wrong: int = 0
    faults: Counter = field(default_factory=Counter)
    states: Counter = field(default_factory=Counter)

    def add(self, o: "Stats") -> None:
        self.seeds += o.seeds
        self.steps += o.steps
        self.checks += o.checks
        self.silent_wrong += o.silent_wrong
        self.faults.update(o.faults)
        self.states.update(o.states)


class SilentWrong(AssertionError):
    """A source was ``live`` while its index differed from its engine."""


class World:
    """The simulated network, shell and consumer for one seed."""

    def __init__(self, seed: int, *, sources: int | None = None, topic_filter: bytes = b"") -> None:
        rng = self.rng = random.Random(seed)
        self.seed = seed
        # The subscriber's topic filter. Live messages carry topic b"kv", replies none
        # (vLLM 0.11's shape): with a filter, replies before the first live message cannot
        # be attributed to a topic.
        self.topic_filter = topic_filter
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[[], None]]] = []
        self._n = 0
        self.stats = Stats(seeds=1)
        # The nemesis's appetite for this seed.
        self.p_live_drop = rng.choice((0.0, 0.02, 0.1, 0.3))
        self.p_hole = rng.choice((0.0, 0.05, 0.2))
        self.p_cut = rng.choice((0.0, 0.1, 0.3))
        self.p_delay = rng.choice((0.0, 0.05, 0.2))
        self.index = KVIndex(router_block_size=BLOCK)  # the default rule, as routers use it
        self.pubs: dict[str, Publisher] = {}
        self.trackers: dict[str, SourceTracker] = {}
        self.blocks = rng.choice((8, 16, 32))
        n = sources if sources is not None else rng.choice((1, 1, 2, 3))
        for i in range(n):
            name = f"e{i}"
            self.pubs[name] = Publisher(self, name, Engine(rng, self.blocks),
                                        buffer=rng.choice((4, 16, 1000)), snapshots=rng.random() < 0.7)
        # Sources behind a forwarder (duplicates, reordering, restarts it hides).
        self.forwarded = {name for name in self.pubs if rng.random() < 0.3}
        self.p_dup = rng.choice((0.02, 0.1))
        self.p_reorder = rng.choice((0.0, 0.02, 0.1))
        self._live_at: dict[str, float] = {}
        self._fwd_tail: dict[str, float] = {}  # the latest arrival a forwarder scheduled
        self._tick_at: dict[str, float] = {}
        self._sched: dict[str, Any] = {}
        self._busy = 0  # events in the heap other than probe timers
        self._pub_at: dict[str, float] = {}  # when each engine last published (or restarted)
        self._probed: dict[str, float] = {}  # when a probe last got its end marker

    # -- the event heap ------------------------------------------------------------------

    def at(self, t: float, fn: Callable[[], None], tick: bool = False) -> None:
        self._n += 1
        if not tick:
            self._busy += 1

            def run() -> None:
                self._busy -= 1
                fn()

            heapq.heappush(self._q, (t, self._n, run))
        else:
            heapq.heappush(self._q, (t, self._n, fn))

    def quiet(self) -> bool:
        """Nothing in flight, and every source probed since its engine last published
        (without heartbeats, a burst lost whole is only found by a probe)."""
        if self._busy:
            return False
        for name, t in self.trackers.items():
            if t.connected and self._probed.get(name, -1.0) < self._pub_at.get(name, 0.0):
                return False
        return True

    def run_until_quiet(self, max_events: int = 200_000) -> None:
        q = self._q
        n = 0
        while q and not self.quiet():
            t, _, fn = heapq.heappop(q)
            self.now = max(self.now, t)
            fn()
            n += 1
            if n > max_events:
                raise AssertionError(f"seed {self.seed}: the world never gets quiet "
                                     f"(states {[t.state for t in self.trackers.values()]})")

    # -- the subscriber side -----------------------------------------------------------

    def join(self, name: str) -> None:
        # probe_max_s 10 s (not the 2 s default): with answers delayed past the timeout,
        # 2 s probes of a few sources overlap and the world is never quiet to be checked.
        t = SourceTracker(name, has_replay=True, max_retries=3, backoff_s=0.05, probe_after_s=PROBE,
                          probe_max_s=10.0, topic=self.topic_filter,
                          hidden_restarts=name in self.forwarded)
        self.trackers[name] = t
        t.start(self.now)
        self._pump(name)

    def _pump(self, name: str) -> None:
        """What the shell does after feeding the tracker: hand items to the consumer,
        send the pending request, arm the probe timer."""
        t = self.trackers[name]
        for it in t.out:
            apply_item(self.index, it)
        t.out = []
        req = t.inflight
        if req is not None and not req.sent and self._sched.get(name) is not req:
            self._sched[name] = req
            self.at(self.now + req.delay_s, lambda: self._send(name, req))
        at = t.probe_at()
        if at is not None and self._tick_at.get(name) != at:
            self._tick_at[name] = at

            def tick() -> None:
                if self._tick_at.get(name) == at:
                    del self._tick_at[name]
                t.on_tick(self.now)
                self._pump(name)

            self.at(at, tick, tick=True)

    def _send(self, name: str, req: Any) -> None:
        t = self.trackers[name]
        if t.inflight is not req or req.sent:
            return
        req.sent = True
        sent_at = self.now
        gen = t.generation
        rng = self.rng
        pub = self.pubs[name]
        delay = 0.001 + rng.random() * 0.002
        if rng.random() < self.p_delay:
            delay += TIMEOUT * (1.5 + rng.random())
            self.stats.faults["answer_delay"] += 1
        last = [self.now]

        def still() -> bool:
            return t.inflight is req and t.generation == gen

        def deliver(replies: list[tuple[int, bytes] | None]) -> None:
            # One DEALER connection: replies arrive in order, some lost (HWM), maybe cut.
            n = len(replies)
            drop: set[int] = set()
            # Holes only in long replay answers: vLLM 0.11's ROUTER drops beyond its HWM
            # (a short answer never fills the pipe); snapshots come from kvstream's
            # publisher, whose ROUTER_MANDATORY never drops silently (its batches carry no
            # seq of their own, so a hole could not be seen).
            if n > 8 and req.kind == "replay" and rng.random() < self.p_hole:
                a = rng.randrange(1, n - 1)
                drop.update(range(a, min(n - 1, a + rng.randrange(1, 4))))
                self.stats.faults["reply_hole"] += 1
            if rng.random() < self.p_cut:
                drop.update(range(rng.randrange(max(0, n - 3), n), n))
                self.stats.faults["reply_cut"] += 1
            tt = self.now
            for i, r in enumerate(replies):
                tt += 0.0001
                if i in drop:
                    continue

                def arrive(r: tuple[int, bytes] | None = r) -> None:
                    if not still():
                        return  # a fresh DEALER: the abandoned request's replies are gone
                    last[0] = self.now
                    if r is None:
                        if req.purpose == "probe" and t.expected == req.e0 and not t.held:
                            self._probed[name] = sent_at  # a clean probe: nothing was lost
                        t.on_reply_end()
                    else:
                        t.on_reply(r[0], None, r[1], decode_batch(r[1]))
                    self._pump(name)

                self.at(tt, arrive)

        self.at(self.now + delay, lambda: pub.answer(req.frame(), deliver))

        def check_timeout() -> None:
            if not still():
                return
            if self.now - last[0] >= TIMEOUT - 1e-9:
                t.on_timeout()
                self._pump(name)
            else:
                self.at(last[0] + TIMEOUT, check_timeout)

        self.at(self.now + TIMEOUT, check_timeout)

    def _reconnect(self, name: str) -> None:
        """The SUB socket's connection to a restarted publisher drops and comes back."""
        def arrive() -> None:
            tr = self.trackers.get(name)
            if tr is not None:
                tr.on_reconnect(self.now)
                self._pump(name)

        t = max(self._live_at.get(name, 0.0), self.now + 0.0005)
        self._live_at[name] = t
        self.at(t, arrive)

    # -- the live channel ----------------------------------------------------------------

    def send_live(self, pub: Publisher, seq: int, payload: bytes) -> None:
        name = pub.name
        self._pub_at[name] = self.now
        if self.rng.random() < self.p_live_drop:
            self.stats.faults["live_drop"] += 1
            return
        # One PUB connection: live messages arrive in order (a forwarder may reorder them).
        t = max(self._live_at.get(name, 0.0), self.now + 0.0005 + self.rng.random() * 0.001)
        self._live_at[name] = t

        def arrive() -> None:
            tr = self.trackers.get(name)
            if tr is None:
                return  # not subscribed yet: lost, like a slow joiner's
            tr.on_live(seq, b"kv", payload, decode_batch(payload), self.now)
            self._pump(name)

        if name in self.forwarded:
            if self.rng.random() < self.p_reorder:
                self.stats.faults["fwd_reorder"] += 1
                t += 0.002 + self.rng.random() * 0.002  # after the next one or two
            tail = t
            if self.rng.random() < self.p_dup:
                self.stats.faults["fwd_duplicate"] += 1
                tail = t + 0.0001 + self.rng.random() * 0.003
                self.at(tail, arrive)
            self._fwd_tail[name] = max(self._fwd_tail.get(name, 0.0), tail)
        self.at(t, arrive)

    # -- the checker -----------------------------------------------------------------

    def check(self) -> None:
        self.stats.checks += 1
        state = self.index.state()["sources"]
        for name, t in self.trackers.items():
            st = t.state
            self.stats.states[st] += 1
            assert t.inflight is None or t.inflight.sent or st != "live", (self.seed, name, t.inflight)
            if st != "live":
                continue
            got = Counter()
            for medium, _g, eh, n in state.get(name, {}).get("blocks", ()):
                if medium == "GPU":
                    got[eh] += n
            want = self.pubs[name].engine.truth()
            if got != want:
                self.stats.silent_wrong += 1
                raise SilentWrong(
                    f"seed {self.seed}: source {name} is live but its index holds {sum(got.values())} "
                    f"copies ({len(set(got) - set(want))} unknown to the engine) against the "
                    f"engine's {sum(want.values())} ({len(set(want) - set(got))} missing)")

    # -- a scenario --------------------------------------------------------------------

    def run(self, phases: int = 4) -> Stats:
        rng = self.rng
        names = list(self.pubs)
        late = {n for n in names if rng.random() < 0.3}
        for n in names:
            if n not in late:
                self.join(n)
        for _ in range(phases):
            for _step in range(rng.randrange(3, 20)):
                for n in names:
                    pub = self.pubs[n]
                    r = rng.random()
                    if r < 0.03:
                        self.stats.faults["restart"] += 1
                        pub.restart(rng, self.blocks)
                        self._pub_at[n] = self.now
                        if n in self.forwarded:
                            self.stats.faults["hidden_restart"] += 1  # the forwarder's link stays up
                            # Its queue is FIFO per upstream connection: the new instance's
                            # messages come after the old one's late copies.
                            self._live_at[n] = max(self._live_at.get(n, 0.0), self._fwd_tail.get(n, 0.0))
                        else:
                            self._reconnect(n)
                    elif r < 0.04:
                        # A network blip: the connection drops and comes back, same engine.
                        self.stats.faults["reconnect"] += 1
                        if n not in self.forwarded:
                            self._reconnect(n)
                        pub.publish(pub.engine.step())
                    elif r < 0.06:
                        self.stats.faults["reset_cache"] += 1
                        pub.publish(pub.engine.reset_cache())
                    else:
                        pub.publish(pub.engine.step())
                    self.stats.steps += 1
                # Time passes between steps; sometimes less than the probe delay.
                self.at(self.now + rng.choice((0.001, 0.01, 0.2)), lambda: None)
                self._advance_one()
            if rng.random() < 0.3:
                # Idle right after a loss: the last batch of the burst never arrives live.
                n = rng.choice(names)
                pub = self.pubs[n]
                saved = self.p_live_drop
                self.p_live_drop = 1.0
                pub.publish(pub.engine.step())
                self.p_live_drop = saved
                self.stats.faults["idle_after_loss"] += 1
            for n in sorted(late):  # not set order: seeds must not depend on PYTHONHASHSEED
                if rng.random() < 0.7:
                    late.discard(n)
                    self.stats.faults["late_join"] += 1
                    self.join(n)
            self.run_until_quiet()
            self.check()
        for n in sorted(late):
            self.join(n)
        self.run_until_quiet()
        self.check()
        return self.stats

    def _advance_one(self) -> None:
        """Run the heap up to its earliest event (time passing between engine steps)."""
        if self._q:
            t, _, fn = heapq.heappop(self._q)
            self.now = max(self.now, t)
            fn()
            while self._q and self._q[0][0] <= self.now:
                t, _, fn = heapq.heappop(self._q)
                fn()


def run_seed(seed: int, **kw: Any) -> Stats:
    """One seed of the campaign; raises :class:`SilentWrong` on the broken promise."""
    return World(seed, **kw).run()
