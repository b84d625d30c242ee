"""The async shell around :class:`~kvstream.service.core.ServiceCore`: the subscriber and
its pump, and the load scraper. One ``async with ServiceRuntime(core):`` owns them all
(a task group inside); the app's lifespan enters it.

::

    core = ServiceCore(config)
    async with ServiceRuntime(core):
        ...   # core now follows its engines; core.route(...) answers from live state
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import anyio
import anyio.to_thread

from kvstream.routing.payloads import PayloadDecoder
from kvstream.service.core import ServiceCore
from kvstream.service.load import parse_vllm_metrics
from kvstream.wire.mooncake import AnyFormatDecoder
from kvstream.transport.lifetime import Lifetime
from kvstream.transport.subscriber import Subscriber

__all__ = ["ServiceRuntime"]

log = logging.getLogger("kvstream.service")

_SCRAPE_MAX_BYTES = 8 * 1024 * 1024
SCRAPE_BACKOFF_MAX_S = 30.0
"""Longest wait between load scrapes of an engine whose scrapes keep failing (seconds):
after each failure in a row the wait doubles from ``load_interval`` up to this."""
RECONNECT_MAX_S = 2.0
"""Longest wait between connection attempts to an engine that does not accept them
(seconds): ZMQ's reconnect interval doubles from 0.1 s up to this (``ZMQ_RECONNECT_IVL_MAX``)."""
_SLICE_S = 0.005
"""Shortest run of applying waiting batches before the pump lets the loop turn (seconds)."""
_MAX_SLICE_S = 0.025
"""Longest run of applying waiting batches before the pump lets HTTP calls in (seconds)."""


class _DumpTooLarge(Exception):
    pass


async def _read_dump(client: Any, url: str, limit: int) -> bytes:
    """The body of ``GET url``, refused (:class:`_DumpTooLarge`) past ``limit`` bytes
    (by ``Content-Length`` before reading, else as it streams in)."""
    async with client.stream("GET", url) as r:
        r.raise_for_status()
        length = r.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _DumpTooLarge(f"dump of {int(length)} bytes is over --max-dump-bytes {limit}")
        buf = bytearray()
        async for chunk in r.aiter_bytes():
            buf += chunk
            if len(buf) > limit:
                raise _DumpTooLarge(f"dump is over --max-dump-bytes {limit}")
        return bytes(buf)


class ServiceRuntime:
    """Runs the core's I/O: subscribes to every engine (items go to
    :meth:`ServiceCore.apply` in order), and scrapes each engine's ``/metrics`` every
    ``config.load_interval`` seconds (parsing in a worker thread, so a large exposition
    never holds up routing; each scrape times out after ``min(interval, 5)`` seconds).

    ``subscriber_options``: extra :class:`~kvstream.transport.subscriber.Subscriber`
    arguments.
    """

    def __init__(self, core: ServiceCore, **subscriber_options: Any) -> None:
        self.core = core
        self._life = Lifetime()
        self._ctx: Any = None  # the ZMQ context this runtime made (and destroys)
        # An engine whose scrapes fail is asked again after twice the last wait, up to
        # SCRAPE_BACKOFF_MAX_S (a success resets it): unreachable engines cost little.
        self._scrape_next: dict[str, tuple[float, float]] = {}  # name -> (next scrape at, wait)
        self._scrape_slow: dict[str, int] = {}  # name -> scrapes timed out in a row
        cfg = core.config
        opts: dict[str, Any] = {"topic": cfg.topic, "replay_timeout_s": cfg.replay_timeout,
                                "unknown_events": "skip"}
        opts.update(subscriber_options)
        specs = [e.source for e in cfg.engines]
        self._sub: Any
        if specs and all(s.endpoint.startswith("nats://") for s in specs):
            # Engines read from a JetStream stream written by `kvstream relay` (one server
            # and stream; each engine NAME=nats://HOST:PORT[/STREAM] is that source).
            from kvstream.jetstream import open_subscriber

            self._sub = open_subscriber(specs, **opts)
            return
        if "context" not in opts:
            opts["context"] = self._ctx = _zmq_context(cfg.max_engines)
        # Decode RFC #1527 (Mooncake) payloads beside vLLM's. vLLM payloads are read once,
        # natively, and applied from those columns (PayloadDecoder): the service never
        # reads their events as Python objects, so it does not make them.
        if "decoder" not in opts:
            limit = {k: opts[k] for k in ("max_payload_bytes",) if k in opts}
            opts["decoder"] = PayloadDecoder(AnyFormatDecoder(unknown_events=opts["unknown_events"], **limit))
        self._sub = Subscriber((), **opts)

    async def __aenter__(self) -> "ServiceRuntime":
        if self.core.config.peers:
            await self._load_from_peers(self.core.config.peers)
        self._life = life = Lifetime()
        async with life.opening():
            if self._ctx is not None:
                life.on_close(self._destroy_context)  # after the subscriber closed its sockets
            await life.enter(self._sub)
            self.core.attach(self._sub)
            life.on_close(self._detach)
            await life.start(self._pump, name="kvstream-serve-pump")
            if self.core.config.load_interval > 0:
                await life.start(self._scrape_loop, name="kvstream-serve-scraper")
            await life.start(self._watch_states, name="kvstream-serve-states")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._life.aclose()

    async def _detach(self) -> None:
        self.core.attach(None)

    async def _destroy_context(self) -> None:
        self._ctx.destroy(linger=0)

    async def _load_from_peers(self, peers: list[str]) -> None:
        """Load the index from the first replica whose ``/v1/dump`` answers with a dump
        this service can load, read within ``max_dump_bytes`` and ``peer_timeout`` seconds
        per peer; none: a cold start, said in one log line naming each peer's fault."""
        import httpx

        cfg = self.core.config
        faults = []
        token = cfg.register_token()  # replicas share the token that guards /v1/dump
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(timeout=cfg.peer_timeout, headers=headers) as client:
            for url in peers:
                with anyio.move_on_after(cfg.peer_timeout) as scope:
                    try:
                        data = await _read_dump(client, url.rstrip("/") + "/v1/dump", cfg.max_dump_bytes)
                        resumed = self.core.load_dump(data)
                    except Exception as exc:  # noqa: BLE001 - try the next peer; none: start cold
                        faults.append(f"{url}: {exc or type(exc).__name__}")
                        continue
                    log.info("loaded the index from %s (%d bytes): %d engines resume past their dumped seq",
                             url, len(data), len(resumed), extra={"resumed": resumed})
                    return
                if scope.cancelled_caught:
                    faults.append(f"{url}: no whole dump within --peer-timeout {cfg.peer_timeout:g} s")
        log.warning("no peer answered with a dump, starting cold from the engines' replay buffers (%s)",
                    "; ".join(faults), extra={"peers": faults})

    async def _pump(self) -> None:
        # A fair share of the event loop: while batches wait, apply them for as long as
        # everything else (the HTTP calls, the sources' receiving) took since the last
        # slice, at least _SLICE_S and at most _MAX_SLICE_S seconds, then let the loop
        # turn. So neither side starves the other under load (about half each), and a
        # backlog (a replay, a burst from 64 engines) never holds a /query for more than
        # _MAX_SLICE_S. Items are taken from the subscriber only once the previous ones
        # are applied, so its item and byte bounds still hold the sources back.
        apply = self.core.apply
        sub = self._sub
        clock = time.perf_counter
        pending: deque[Any] = deque()
        take = pending.popleft
        yielded = clock()
        while True:
            if not pending:
                try:
                    pending.append(await sub.__anext__())
                except StopAsyncIteration:
                    return
                pending.extend(sub.get_nowait())
                yielded = clock()  # waiting for items is not time owed to ingest
            start = clock()
            end = start + min(max(start - yielded, _SLICE_S), _MAX_SLICE_S)
            while pending:
                apply(take())
                if clock() >= end:
                    break
            if pending:
                yielded = clock()
                await anyio.sleep(0)

    async def _watch_states(self) -> None:
        """One log line per change of an engine's stream state (``connecting``, ``live``,
        ``recovering``, ``stale``), seen every 0.5 s: a state that lasts is said once."""
        core = self.core
        last: dict[str, str] = {}
        while True:
            await anyio.sleep(0.5)
            health = self._sub.health()
            for name in list(core.engines):
                state = core.state_of(name, health.get(name))
                prev = last.get(name, "connecting")  # where every engine starts
                last[name] = state
                if state != prev:
                    log.log(logging.INFO if state == "live" else logging.WARNING, "engine %s: stream %s -> %s",
                            name, prev, state, extra={"engine": name, "from": prev, "to": state})
            for name in [n for n in last if n not in core.engines]:
                del last[name]

    async def _scrape_loop(self) -> None:
        import httpx

        interval = self.core.config.load_interval
        timeout = min(interval, 5.0)
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client:
            while True:
                now = time.monotonic()
                nxt = self._scrape_next
                targets = [(n, e.http) for n, e in self.core.engines.items()
                           if e.http and (n not in nxt or nxt[n][0] <= now)]
                for n in [n for n in nxt if n not in self.core.engines]:
                    del nxt[n]
                if targets:
                    async with anyio.create_task_group() as tg:
                        for name, url in targets:
                            tg.start_soon(self._scrape_one, client, name, url, timeout)
                await anyio.sleep(interval)

    def _scrape_failed(self, name: str) -> None:
        interval = self.core.config.load_interval
        prev = self._scrape_next.get(name)
        wait = max(min(2 * prev[1], SCRAPE_BACKOFF_MAX_S), interval) if prev is not None else interval
        self._scrape_next[name] = (time.monotonic() + wait, wait)

    async def _scrape_one(self, client: Any, name: str, url: str, timeout: float) -> None:
        core = self.core
        try:
            text = None
            with anyio.move_on_after(timeout):
                text = await _fetch_metrics(client, url + "/metrics")
            if text is None:
                raise TimeoutError(f"no answer from {url}/metrics within {timeout:g}s")
            at = core.clock()
            scrape = await anyio.to_thread.run_sync(parse_vllm_metrics, text, at)
        except Exception as exc:  # noqa: BLE001 - any failure is a failed scrape, reported
            if name in core.engines:
                import httpx

                # Not reached at all (refused, reset, timed out): the engine is ranked last
                # until a scrape answers again. An error answer means it is there. One slow
                # answer on a busy host is not an engine gone: a timeout counts from the
                # second in a row (and leaves an engine already marked so as it is).
                timed_out = isinstance(exc, (TimeoutError, httpx.TimeoutException))
                slow = self._scrape_slow[name] = (self._scrape_slow.get(name, 0) + 1) if timed_out else 0
                gone: bool | None = isinstance(exc, (httpx.TransportError, TimeoutError, OSError))
                if timed_out and slow < 2:
                    gone = None
                reason = f"{type(exc).__name__}: {exc}"[:300]
                if core.loads.scrape_failed(name, reason, unreachable=gone, at=core.clock()):
                    if gone:  # one line per change, not one per scrape
                        log.warning("engine %s is unreachable (%s): routed to last until it answers", name,
                                    reason, extra={"engine": name, "reachable": False})
                    else:
                        log.warning("engine %s is reachable again", name, extra={"engine": name, "reachable": True})
                core.metrics.scraped(name, False)
                self._scrape_failed(name)
            log.debug("load scrape of %s failed: %s", name, exc)
            return
        self._scrape_next.pop(name, None)
        self._scrape_slow.pop(name, None)
        if name in core.engines:
            if core.loads.scraped(name, scrape):
                log.warning("engine %s is reachable again", name, extra={"engine": name, "reachable": True})
            core.metrics.scraped(name, True)


def _zmq_context(max_engines: int) -> Any:
    """A ZMQ context for the runtime's subscriber: room for the sockets of ``max_engines``
    engines (libzmq's default is 1,023 sockets, about 250 engines), and reconnects to an
    engine that refuses them backing off up to :data:`RECONNECT_MAX_S`."""
    import zmq

    from kvstream.service.config import SOCKETS_PER_ENGINE

    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, max(1024, SOCKETS_PER_ENGINE * max_engines + 64))
    ctx.setsockopt(zmq.RECONNECT_IVL_MAX, int(RECONNECT_MAX_S * 1000))
    return ctx


async def _fetch_metrics(client: Any, url: str) -> str:
    """The exposition text at ``url``, read as it arrives and refused past
    ``_SCRAPE_MAX_BYTES`` (an endless answer is never held whole)."""
    async with client.stream("GET", url) as r:
        if r.status_code != 200:
            raise ValueError(f"HTTP {r.status_code} from {url}")
        parts = []
        size = 0
        async for chunk in r.aiter_bytes():
            size += len(chunk)
            if size > _SCRAPE_MAX_BYTES:
                raise ValueError(f"{url} sent over {_SCRAPE_MAX_BYTES} bytes")
            parts.append(chunk)
        return b"".join(parts).decode(r.encoding or "utf-8", errors="replace")
