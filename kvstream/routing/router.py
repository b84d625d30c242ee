"""The embeddable async router: subscribe to every engine, keep a router index current
(:class:`KVIndex`, or :class:`EngineKeyIndex` when the router hashes like the engines),
answer "where should this prompt go?".

::

    async with Router([SourceSpec("tcp://e0:5557", "tcp://e0:5558", name="e0"), ...]) as router:
        choice = router.route(prompt_tokens, loads={"e0": Load(queue=3)})
        send_to(choice.best)

:func:`apply_item` is the one place that maps subscriber items onto index calls; the live
:class:`Router` and event-log replay both use it, so a replayed index equals the live one.
"""

from __future__ import annotations

import logging
import time
from operator import attrgetter
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import anyio

from kvstream.errors import LocalProtocolError
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.routing.scoring import Load, Policy, ScoreResult
from kvstream.transport.lifetime import Lifetime
from kvstream.transport.items import SourceBatch, SourceLive, SourceReset, SourceStale
from kvstream.transport.subscriber import SourceHealth, SourceSpec, Subscriber

__all__ = ["Router", "RouterUsageError", "ItemSource", "apply_item", "AnyIndex"]

AnyIndex = KVIndex | EngineKeyIndex
"""The router index classes: same API, keyed by router token keys or by engine hashes."""

log = logging.getLogger(__name__)
_source_of = attrgetter("source")
_batch_of = attrgetter("batch")
_payload_of = attrgetter("payload")


class RouterUsageError(LocalProtocolError, ValueError):
    """A bad call on the :class:`Router` (conflicting arguments, an operation the item
    source does not support); says the fix."""


@runtime_checkable
class ItemSource(Protocol):
    """What the :class:`Router` reads stream items from: the ZMQ
    :class:`~kvstream.transport.subscriber.Subscriber` by default, or anything shaped like
    it (a JetStream consumer, a replayed log): an async context manager that, once
    entered, is an async iterator of subscriber items (``SourceBatch``, ``SourceReset``,
    ``SourceStale``, ``SourceLive``) and reports per-source health.

    ``add_source(spec)`` / ``remove_source(name)`` are optional; without them the
    router's :meth:`Router.add_endpoint` / :meth:`Router.remove_endpoint` raise
    :class:`RouterUsageError`."""

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc: Any) -> Any: ...

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def health(self) -> Mapping[str, Any]: ...


def apply_item(index: AnyIndex, item: Any, now: float | None = None) -> None:
    """Apply one subscriber item to ``index`` (a :class:`KVIndex` or :class:`EngineKeyIndex`).

    * :class:`SourceBatch` -> :meth:`KVIndex.apply_batch` (``now``: seconds for the TTL;
      default the batch's ``ts``), with the item's payload, which the native core reads;
    * :class:`SourceReset` -> :meth:`KVIndex.clear_source` (which also un-stales it: the
      reset rebuilds exact state), or :meth:`KVIndex.remove_source` for reason "removed";
    * :class:`SourceStale` -> :meth:`KVIndex.mark_stale`;
    * :class:`SourceLive` -> nothing. It only says the source caught up, and the
      subscriber emits it right after a stale mark too: only a reset makes state exact.

    Anything else raises ``TypeError`` (a programming error, not remote input).
    """
    cls = type(item)
    if cls is SourceBatch:
        # The payload too: the native core reads it faster than it walks decoded events.
        index.apply_batch(item.source, item.batch, now, payload=item.payload)
    elif cls is SourceReset:
        if item.reason == "removed":
            index.remove_source(item.source)
        else:
            index.clear_source(item.source)
    elif cls is SourceStale:
        index.mark_stale(item.source, True)
    elif cls is SourceLive:
        index.add_source(item.source)
    else:
        raise TypeError(f"apply_item takes subscriber items (SourceBatch/Reset/Stale/Live), got {item!r:.100}")


class Router:
    """Subscribes to every engine and keeps a router index (:data:`AnyIndex`) current.

    Args:
        endpoints: :class:`~kvstream.transport.subscriber.SourceSpec` s, or PUB endpoint
            strings (no replay). Source names default to the endpoint.
        index: the index to keep (default ``KVIndex()``); pass one to set the router block
            size, memory bound or TTL, or an ``EngineKeyIndex(hasher=...)`` to match by the
            engines' own hashes (then ``route``'s ``lora`` is a
            :class:`kvstream.hashing.LoRA` and ``mm_items`` carry lengths; see
            ``docs/router.md``).
        policy: the ranking policy (default :class:`~kvstream.routing.scoring.PrefixLoadPolicy`).
        speculative_ttl_s: if set, :meth:`route` pretends the chosen source holds the
            prompt's blocks for this many seconds (until its events say otherwise), so a
            burst of similar prompts follows the first one.
        clock: seconds, for speculation expiry (default ``time.monotonic``).
        subscriber: an already-built :class:`ItemSource` to read items from instead of
            a ZMQ :class:`~kvstream.transport.subscriber.Subscriber` (e.g. a JetStream
            consumer). The router enters and exits it. Give either ``endpoints`` (and
            ``subscriber_options``) or ``subscriber``, not both.
        subscriber_options: passed to :class:`~kvstream.transport.subscriber.Subscriber`
            (``topic``, ``replay_timeout_s``, ...).

    :meth:`route` is a plain synchronous call (no I/O): call it from any task of the
    event loop the router runs in.
    """

    def __init__(
        self,
        endpoints: Iterable[SourceSpec | str] = (),
        *,
        index: AnyIndex | None = None,
        policy: Policy | None = None,
        speculative_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        subscriber: ItemSource | None = None,
        **subscriber_options: Any,
    ) -> None:
        specs = [SourceSpec(e) if isinstance(e, str) else e for e in endpoints]
        if subscriber is not None and (specs or subscriber_options):
            raise RouterUsageError(
                "Router(subscriber=...) reads from the given item source; endpoints and subscriber "
                f"options ({sorted(subscriber_options)}) belong to that source, not the router: give one or the other"
            )
        if subscriber is not None and not isinstance(subscriber, ItemSource):
            raise RouterUsageError(
                f"subscriber must be an async context manager and async iterator of items with health(), "
                f"got {subscriber!r:.80}"
            )
        self.index = index if index is not None else KVIndex()
        """The index (read it freely; it is only written by the router's task)."""
        self.policy = policy
        self.speculative_ttl_s = speculative_ttl_s
        self._clock = clock
        self._sub: Any = subscriber if subscriber is not None else Subscriber(specs, **subscriber_options)
        for s in specs:
            self.index.add_source(s.source)
        self._life = Lifetime()
        self._applied: dict[str, int] = {}
        self._changed = anyio.Event()
        self.items_applied = 0
        """Subscriber items applied so far."""

    async def __aenter__(self) -> "Router":
        self._life = life = Lifetime()
        async with life.opening():
            await life.enter(self._sub)
            await life.start(self._pump, name="kvstream-router-pump")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._life.aclose()

    async def _pump(self) -> None:
        # After each item, whatever else is ready is taken in one step (get_nowait, when
        # the source has it) and waiters are woken once for the lot: per-item wake-ups
        # cost as much as a cheap index apply.
        sub = self._sub
        drain = getattr(sub, "get_nowait", None)
        async for item in sub:
            now = time.time()
            if drain is None:
                self._apply(item, now)
            else:
                more = drain()
                if more:
                    more.insert(0, item)
                    self._apply_many(more, now)
                else:
                    self._apply(item, now)
            ev, self._changed = self._changed, anyio.Event()
            ev.set()

    def _apply_many(self, items: list[Any], now: float) -> None:
        # Consecutive batches of one source go to the index in one call
        # (KVIndex.apply_batches): per batch, the call and its set-up cost as much as
        # applying a small batch.
        bulk = getattr(self.index, "apply_batches", None)
        n = len(items)
        if bulk is not None and list(map(type, items)).count(SourceBatch) == n:
            sources = list(map(_source_of, items))
            if sources.count(sources[0]) == n:  # the common case: one source's batches only
                try:
                    bulk(sources[0], list(map(_batch_of, items)), now, payloads=list(map(_payload_of, items)))
                except Exception:  # noqa: BLE001 - bad items must not stop routing
                    log.exception("router: could not apply %d batches of %s", n, sources[0])
                    return
                self.items_applied += n
                self._applied[sources[0]] = items[-1].seq
                return
        i = 0
        while i < n:
            item = items[i]
            if type(item) is not SourceBatch or bulk is None:
                self._apply(item, now)
                i += 1
                continue
            src = item.source
            j = i + 1
            while j < n:
                nxt = items[j]
                if type(nxt) is not SourceBatch or nxt.source != src:
                    break
                j += 1
            if j - i == 1:
                self._apply(item, now)
                i = j
                continue
            run = items[i:j]
            try:
                bulk(src, [b.batch for b in run], now, payloads=[b.payload for b in run])
            except Exception:  # noqa: BLE001 - bad items must not stop routing
                log.exception("router: could not apply %d batches of %s", j - i, src)
                i = j
                continue
            self.items_applied += j - i
            self._applied[src] = items[j - 1].seq
            i = j

    def _apply(self, item: Any, now: float) -> None:
        try:
            apply_item(self.index, item, now)
        except Exception:  # noqa: BLE001 - one bad item must not stop routing
            log.exception("router: could not apply %r", type(item).__name__)
            return
        self.items_applied += 1
        if type(item) is SourceBatch:
            self._applied[item.source] = item.seq
        elif type(item) is SourceReset:
            self._applied.pop(item.source, None)

    # -- routing ---------------------------------------------------------------------

    def route(
        self,
        prompt_tokens: Sequence[int],
        loads: Mapping[str, Load] | None = None,
        *,
        lora: Any = None,
        salt: str | None = None,
        mm_items: Sequence[Any] | None = None,
    ) -> ScoreResult:
        """Score the prompt against every source and rank them (``.best`` is the choice).
        See :meth:`KVIndex.score`. With ``speculative_ttl_s``, the choice is remembered.
        ``lora``: an adapter name or int id for a :class:`KVIndex`, a
        :class:`kvstream.hashing.LoRA` for an :class:`EngineKeyIndex`."""
        index = self.index
        now = self._clock()
        index.expire(now)
        keys = index.keys(prompt_tokens, lora, salt, mm_items)
        res = index.score(prompt_tokens, loads=loads, policy=self.policy, keys=keys)
        if self.speculative_ttl_s is not None and res.best is not None:
            index.speculate(res.best, prompt_tokens, now, self.speculative_ttl_s, keys=keys)
        return res

    # -- sources ---------------------------------------------------------------------

    def add_endpoint(self, spec: SourceSpec | str) -> None:
        """Start following one more engine (while open)."""
        spec = SourceSpec(spec) if isinstance(spec, str) else spec
        self._optional("add_source")(spec)
        self.index.add_source(spec.source)

    def remove_endpoint(self, name: str) -> None:
        """Stop following ``name`` and forget its blocks (applied in order with its items)."""
        self._optional("remove_source")(name)

    def _optional(self, name: str) -> Callable[..., Any]:
        fn = getattr(self._sub, name, None)
        if fn is None:
            raise RouterUsageError(
                f"this router's item source ({type(self._sub).__name__}) has no {name}(); "
                "change its sources through the source itself"
            )
        return fn

    @property
    def subscriber(self) -> Any:
        """The item source the router reads (its :class:`Subscriber` by default)."""
        return self._sub

    def health(self) -> Mapping[str, SourceHealth]:
        """Per-source stream health (see :meth:`Subscriber.health`; for another item
        source, whatever its ``health()`` returns)."""
        return self._sub.health()

    def applied_seq(self, source: str) -> int | None:
        """The seq of the last batch of ``source`` applied to the index (None: none since
        the last reset)."""
        return self._applied.get(source)

    async def wait_applied(self, source: str, seq: int, timeout_s: float = 5.0) -> None:
        """Wait until batch ``seq`` (or later) of ``source`` is in the index; raises
        ``TimeoutError`` after ``timeout_s`` seconds."""
        with anyio.fail_after(timeout_s):
            while (self._applied.get(source, -1)) < seq:
                await self._changed.wait()
