"""The fault campaign through JetStream, with a stream that stops taking messages.

The world of ``tests/transport/fault_campaign.py`` (real pools and managers as engines,
the real tracker behind a simulated network with its nemesis) feeds a relay: the real
:class:`~kvstream.jetstream.tracking.RelaySource` turns the tracker's items into stream
messages, a simulated stream stores them (de-duplicated by message id) until it is full
(``discard=new`` at a random message limit; purged now and then), and the real
:class:`~kvstream.jetstream.tracking.StreamSource` of a consumer turns what is stored into
items for a second real :class:`~kvstream.routing.index.KVIndex`. The relay's shell is
modelled by its rules (``kvstream.jetstream.relay``): in-order retries with backoff, giving
up after ``MAX_REFUSED_S`` of refusals, status notices to the consumer while blocked, and
the stale notice stored once there is room.

Every quiet moment, besides the ZMQ view's check, every consumer source that is not stale
must be exactly its engine's residency: ``live`` and wrong through a full stream is the
silent wrong this campaign looks for.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvstream.jetstream import wire
from kvstream.jetstream.tracking import RelaySource, StreamSource
from kvstream.routing.index import KVIndex
from kvstream.routing.router import apply_item
from kvstream.wire.events import decode_batch

from tests.transport.fault_campaign import BLOCK, SilentWrong, Stats, World

FAULTS = ("stream_refused", "relay_gave_up", "stream_purge")
"""The stream faults this campaign adds (counted per run)."""

MAX_REFUSED_S = 1.0


def _first_seq(headers: dict[str, str]) -> int:
    v = headers.get(wire.H_SEQ)
    return int(v) if v is not None else int(headers.get(wire.H_POS, "-1")) + 1


class StreamWorld(World):
    """The ZMQ world, relayed through a stream that may fill up."""

    def __init__(self, seed: int, *, forwarders: bool = False, **kw: Any) -> None:
        super().__init__(seed, **kw)
        if not forwarders:
            # The plain scenario: no forwarder in the live path (the RNG draws are the same
            # either way). With forwarders, those sources get hidden_restarts, as
            # SourceSpec(forwarded=True) gives them.
            self.forwarded = set()
        rng = self.rng
        self.cap: int | None = rng.choice((None, 15, 40, 120, 400))
        self.in_stream = 0
        self.sseq = 0
        self.ids: set[str] = set()
        self.rsrc = {n: RelaySource(n) for n in self.pubs}
        self.out: list[Any] = []
        self.ssrc = {n: StreamSource(n, decode_batch, self.out) for n in self.pubs}
        self.cindex = KVIndex(router_block_size=BLOCK)
        self.rq: list[tuple[str, bytes, dict[str, str]]] = []
        self.refused_since: float | None = None
        self.backoff = 0.05
        self.blocked: dict[str, int] = {}
        self.probe_backoff = 0.05
        self._retry_armed = False
        self._probe_armed = False

    # -- the relay ---------------------------------------------------------------------

    def _pump(self, name: str) -> None:
        t = self.trackers[name]
        items, t.out = t.out, []
        for it in items:
            apply_item(self.index, it)  # the ZMQ view is checked as before
            for payload, headers in self.rsrc[name].on_item(it):
                self.rq.append((name, payload, headers))
        self._flush()
        super()._pump(name)

    def _store(self, name: str, payload: bytes, headers: dict[str, str]) -> bool:
        mid = headers[wire.H_MSG_ID]
        if mid in self.ids:
            return True  # a duplicate the stream acks without storing
        if self.cap is not None and self.in_stream >= self.cap:
            return False
        self.ids.add(mid)
        self.in_stream += 1
        self.sseq += 1
        self.ssrc[name].on_message(self.sseq, headers, payload, self.now)
        self._consume()
        return True

    def _consume(self) -> None:
        for it in self.out:
            apply_item(self.cindex, it)
        self.out.clear()

    def _flush(self) -> None:
        while self.rq:
            name, payload, headers = self.rq[0]
            if name in self.blocked:
                del self.rq[0]
                self.blocked[name] = min(self.blocked[name], _first_seq(headers))
                continue
            if not self._store(name, payload, headers):
                if self.refused_since is None:
                    self.refused_since = self.now
                    self.stats.faults["stream_refused"] += 1
                self._arm_retry()
                return
            del self.rq[0]
            self.refused_since = None
            self.backoff = 0.05

    def _arm_retry(self) -> None:
        if self._retry_armed:
            return
        self._retry_armed = True

        def retry() -> None:
            self._retry_armed = False
            if self.refused_since is not None and self.now - self.refused_since > MAX_REFUSED_S:
                self._give_up()
            else:
                self._flush()

        self.at(self.now + self.backoff, retry, tick=True)
        self.backoff = min(self.backoff * 2, 1.0)

    def _give_up(self) -> None:
        for name, _payload, headers in self.rq:
            seq = _first_seq(headers)
            self.blocked[name] = min(self.blocked.get(name, seq), seq)
        self.rq.clear()
        self.refused_since = None
        self.stats.faults["relay_gave_up"] += 1
        self.probe_backoff = 0.05
        self._probe()

    def _notify(self) -> None:
        for name in self.blocked:
            self.ssrc[name].on_blocked("the relay cannot publish")
        self._consume()

    def _probe(self) -> None:
        self._notify()
        for name, first in list(self.blocked.items()):
            payload, headers = self.rsrc[name].gap_message(first, "refused")
            if self._store(name, payload, headers):
                del self.blocked[name]
        if self.blocked and not self._probe_armed:
            self._probe_armed = True

            def again() -> None:
                self._probe_armed = False
                self._probe()

            self.at(self.now + self.probe_backoff, again, tick=True)
            self.probe_backoff = min(self.probe_backoff * 2, 2.0)

    # -- faults, quiet, check ----------------------------------------------------------

    def quiet(self) -> bool:
        return not self.rq and super().quiet()

    def check(self) -> None:
        super().check()
        if self.cap is not None and self.rng.random() < 0.3:
            self.in_stream = 0  # purged: room again (consumers already read it)
            self.stats.faults["stream_purge"] += 1
        state = self.cindex.state()["sources"]
        for name, ss in self.ssrc.items():
            if name not in self.trackers or ss.state.instance is None:
                continue
            if ss.state.stale:
                self.stats.states["js_stale"] += 1
                continue
            self.stats.states["js_live"] += 1
            got: Counter = Counter()
            for medium, _g, eh, n in state.get(name, {}).get("blocks", ()):
                if medium == "GPU":
                    got[eh] += n
            want = self.pubs[name].engine.truth()
            if got != want:
                self.stats.silent_wrong += 1
                raise SilentWrong(
                    f"seed {self.seed}: stream consumer of {name} is live but holds {sum(got.values())} copies "
                    f"({len(set(got) - set(want))} unknown to the engine) against the engine's "
                    f"{sum(want.values())} ({len(set(want) - set(got))} missing); stream cap {self.cap}")


def run_seed(seed: int, **kw: Any) -> Stats:
    """One seed through the stream; raises :class:`SilentWrong` on the broken promise."""
    return StreamWorld(seed, **kw).run()
