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
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from kvstream.service.core import ServiceCore
from kvstream.service.load import parse_vllm_metrics
from kvstream.wire.mooncake import AnyFormatDecoder
from kvstream.transport.subscriber import Subscriber

__all__ = ["ServiceRuntime"]

log = logging.getLogger("kvstream.service")

_SCRAPE_MAX_BYTES = 8 * 1024 * 1024


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
        cfg = core.config
        opts: dict[str, Any] = {"topic": cfg.topic, "replay_timeout_s": cfg.replay_timeout,
                                "unknown_events": "skip"}
        opts.update(subscriber_options)
        self._sub = Subscriber((), **opts)
        # Decode RFC #1527 (Mooncake) payloads beside vLLM's. The subscriber has no decoder
        # argument yet, so its decoder is replaced before any source starts.
        self._sub._decoder = AnyFormatDecoder(unknown_events=opts["unknown_events"])  # type: ignore[assignment]
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> "ServiceRuntime":
        if self.core.config.peers:
            await self._load_from_peers(self.core.config.peers)
        await self._sub.__aenter__()
        try:
            self.core.attach(self._sub)
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            self._tg.start_soon(self._pump, name="kvstream-serve-pump")
            if self.core.config.load_interval > 0:
                self._tg.start_soon(self._scrape_loop, name="kvstream-serve-scraper")
        except BaseException:
            self.core.attach(None)
            await self._sub.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        tg, self._tg = self._tg, None
        try:
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
        finally:
            self.core.attach(None)
            await self._sub.__aexit__(None, None, None)

    async def _load_from_peers(self, peers: list[str]) -> None:
        """Load the index from the first replica whose ``/v1/dump`` answers (10 s each)."""
        import httpx

        async with httpx.AsyncClient(timeout=10.0) as client:
            for url in peers:
                try:
                    r = await client.get(url.rstrip("/") + "/v1/dump")
                    r.raise_for_status()
                    resumed = self.core.load_dump(r.content)
                except Exception as exc:  # noqa: BLE001 - try the next peer; none: start cold
                    log.warning("could not load the index from %s: %s", url, exc)
                    continue
                log.info("loaded the index from %s (%d bytes): %d engines resume past their dumped seq",
                         url, len(r.content), len(resumed), extra={"resumed": resumed})
                return
        log.warning("no peer answered; starting from the engines' replay buffers")

    async def _pump(self) -> None:
        apply = self.core.apply
        sub = self._sub
        async for item in sub:
            apply(item)
            # Drain what is already waiting without a trip through the event loop each.
            for it in sub.get_nowait():
                apply(it)

    async def _scrape_loop(self) -> None:
        import httpx

        interval = self.core.config.load_interval
        timeout = min(interval, 5.0)
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client:
            while True:
                targets = [(n, e.http) for n, e in self.core.engines.items() if e.http]
                if targets:
                    async with anyio.create_task_group() as tg:
                        for name, url in targets:
                            tg.start_soon(self._scrape_one, client, name, url, timeout)
                await anyio.sleep(interval)

    async def _scrape_one(self, client: Any, name: str, url: str, timeout: float) -> None:
        core = self.core
        try:
            r = None
            with anyio.move_on_after(timeout):
                r = await client.get(url + "/metrics")
            if r is None:
                raise TimeoutError(f"no answer from {url}/metrics within {timeout:g}s")
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code} from {url}/metrics")
            if len(r.content) > _SCRAPE_MAX_BYTES:
                raise ValueError(f"{url}/metrics sent {len(r.content)} bytes (limit {_SCRAPE_MAX_BYTES})")
            text = r.text
            at = core.clock()
            scrape = await anyio.to_thread.run_sync(parse_vllm_metrics, text, at)
        except Exception as exc:  # noqa: BLE001 - any failure is a failed scrape, reported
            if name in core.engines:
                core.loads.scrape_failed(name, f"{type(exc).__name__}: {exc}"[:300])
                core.metrics.scraped(name, False)
            log.debug("load scrape of %s failed: %s", name, exc)
            return
        if name in core.engines:
            core.loads.scraped(name, scrape)
            core.metrics.scraped(name, True)
