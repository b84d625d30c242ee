"""The service core: engines, their indexes, loads and the request handlers, without I/O.

:class:`ServiceCore` is what the HTTP layer (:mod:`kvstream.service.app`) calls: each
handler takes the request body (bytes) and returns the response body (bytes), or raises
:class:`~kvstream.service.errors.ApiError`. It never reads a socket or sleeps. The async
shell (:mod:`kvstream.service.runtime`) feeds it subscriber items (:meth:`apply`) and load
scrapes, and attaches the subscriber whose sources it adds and removes
(:meth:`attach`).

Engines live in *indexes*: the engines given on the command line or in the config file share
the ``default`` index that ``/v1/route`` answers from; engines registered through the
Mooncake API (:mod:`kvstream.service.mooncake`) live in one index per (model, tenant, block
size, salt, LoRA), so a query never sees another model's or tenant's blocks.
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

import msgspec

from kvstream.hashing import MMItem
from kvstream.routing.index import KVIndex
from kvstream.routing.keys import RouterKeyError
from kvstream.routing.router import AnyIndex, apply_item
from kvstream.routing.scoring import CostPolicy, Load, PrefixLoadPolicy
from kvstream.service.config import EngineSpec, ServeConfig, check_endpoint
from kvstream.service.errors import ApiError, from_msgspec
from kvstream.service.load import LoadBoard
from kvstream.service.schema import ENCODER, EngineScore, LoadIn, RouteRequest, RouteResponse
from kvstream.service.tokenjson import decode_with_tokens
from kvstream.transport.items import SourceBatch, SourceReset
from kvstream.transport.subscriber import SourceHealth, SourceSpec, Subscriber
from kvstream.observe.metrics import EngineSnapshot, IndexSnapshot, ServiceMetrics

__all__ = ["ServiceCore", "Engine", "SubscriberLike", "DEFAULT_INDEX"]

log = logging.getLogger("kvstream.service")

DEFAULT_INDEX = "default"
"""The name of the index ``/v1/route`` answers from."""


class SubscriberLike(Protocol):
    """What the core needs of the subscriber: add and remove sources, read their health."""

    def add_source(self, spec: SourceSpec | str) -> None: ...
    def remove_source(self, name: str) -> None: ...
    def health(self) -> dict[str, SourceHealth]: ...


@dataclass(slots=True)
class Engine:
    """One followed engine.

    ``index``: the name of the index its events go to; ``http``: its base URL (for load
    scrapes); ``meta``: what registration said about it (Mooncake fields); ``added_at``:
    when it was added (seconds, the core's clock).
    """

    spec: SourceSpec
    index: str
    http: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    added_at: float = 0.0

    @property
    def name(self) -> str:
        """The engine's (source) name."""
        return self.spec.source


_ROUTE = msgspec.json.Decoder(RouteRequest)
_LOAD = msgspec.json.Decoder(LoadIn)


class ServiceCore:
    """The sans-IO core of ``kvstream serve`` (see the module docstring).

    Args:
        config: the service configuration (engines, limits, weights).
        tokenizer: an object with ``encode(text).ids`` (HF ``tokenizers``), for ``prompt``
            requests; None: only ``token_ids``.
        clock: seconds, monotonic (speculation expiry, scrape ages).
    """

    def __init__(self, config: ServeConfig, *, tokenizer: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.clock = clock
        self.policy: PrefixLoadPolicy | CostPolicy
        if config.scoring == "cost":
            self.policy = CostPolicy(block_size=config.router_block_size)
        else:
            self.policy = PrefixLoadPolicy(prefix_weight=config.prefix_weight, queue_weight=config.queue_weight,
                                           running_weight=config.running_weight, kv_weight=config.kv_weight)
        self.indexes: dict[str, AnyIndex] = {DEFAULT_INDEX: self.new_index(config.router_block_size)}
        self.engines: dict[str, Engine] = {}
        self.engines_gen = 0
        """Bumped whenever an engine is added or removed, or its HTTP URL changes (what caches
        of ``engines`` check)."""
        self.loads = LoadBoard(stale_after_s=max(3 * config.load_interval, 1.0))
        self.metrics = ServiceMetrics(self._engine_snapshots, self._index_snapshots)
        self.applied: dict[str, int] = {}
        """Per engine, the seq of the last batch applied (the replica dump's resume point)."""
        self._route_of: dict[str, AnyIndex] = {}
        self._leaving: dict[str, AnyIndex] = {}
        self._sub: SubscriberLike | None = None
        self._resume: dict[str, int] = {}
        self.resumed: dict[str, int] = {}
        """Per engine, the seq a loaded replica dump resumed it from."""
        self.engine_view_extras: list[Callable[[str], dict[str, Any]]] = []
        """Seam for layers on top (the proxy mode): each adds keys to an engine's
        ``/v1/engines`` entry."""
        self.metrics_extras: list[Callable[[], bytes]] = []
        """Seam for layers on top (the proxy mode): more Prometheus text for ``/metrics``."""
        self.mooncake: Any = None
        """The :class:`~kvstream.service.mooncake.MooncakeAPI` over this core, once routes exist."""
        self.failure: str | None = None
        """Why the event stream runtime stopped (None while it runs): ``/healthz`` then
        answers 503, and ``kvstream serve`` exits 1 rather than answer from a frozen index."""
        self.on_failure: list[Callable[[str], None]] = []
        """Called with :attr:`failure` when the runtime stops on an error (``kvstream serve``
        stops the server)."""
        self.items_applied = 0
        self.items_skipped = 0
        """Batches not applied because a loaded replica dump already held them."""
        for e in config.engines:
            self.add_engine(e.source, DEFAULT_INDEX, http=e.http)

    def proxy_counts_prefill(self) -> None:
        """A proxy in front of the engines (``serve --proxy``) counts every request it sent
        and that has not answered yet in the engine's ``prefill_tokens``
        (:meth:`LoadBoard.prefill`); the placement model then stops pricing the scraped
        waiting count as well (``CostPolicy.queue_tokens`` 0), which would count those
        requests twice and, scraped late, push requests away from the engine holding their
        prefix (``bench/sim_placement.py``, the trace: 16.1 % against 14.0 % of the prompt
        tokens reused)."""
        if isinstance(self.policy, CostPolicy):
            self.policy.queue_tokens = 0.0

    def new_index(self, router_block_size: int) -> KVIndex:
        """A fresh index with the configured block table, memory bound and TTL."""
        return KVIndex(router_block_size=router_block_size, max_bytes=self.config.index_max_bytes,
                       ttl_s=self.config.index_ttl, table=self.config.index_table)

    # -- engines -----------------------------------------------------------------------

    def attach(self, sub: SubscriberLike | None) -> None:
        """Attach the running subscriber (None: detach). Engines already known are added to
        it; later :meth:`add_engine` / :meth:`remove_engine` calls reach it at once."""
        self._sub = sub
        if sub is not None:
            for name, e in self.engines.items():
                seq = self._resume.get(name)
                if seq is not None and isinstance(sub, Subscriber):
                    # Resumed from a replica's dump: ask the replay socket only for what
                    # came after (the seqs up to it are still skipped if they arrive live).
                    sub.add_source(e.spec, start_seq=seq + 1)
                else:
                    sub.add_source(e.spec)

    def check_room(self) -> None:
        """Raise :class:`ApiError` 429 ``too_many_engines`` if ``config.max_engines``
        engines are followed already."""
        cap = self.config.max_engines
        if len(self.engines) >= cap:
            raise ApiError(429, "too_many_engines", f"{len(self.engines)} engines are followed, the limit "
                           f"(--max-engines {cap}); unregister one first, or raise --max-engines", None)

    def add_engine(self, spec: SourceSpec, index: str, *, http: str | None = None,
                   meta: dict[str, Any] | None = None) -> Engine:
        """Start following an engine whose events go to index ``index`` (created by the
        caller with :attr:`indexes`). Raises :class:`ApiError` (4xx; the engine is then not
        followed and nothing else changed): 409 if the name is taken, 429 at
        ``config.max_engines`` engines, 422 for an endpoint the subscriber cannot take,
        429 if the process is out of sockets or file descriptors."""
        name = spec.source
        if name in self.engines:
            raise ApiError(409, "engine_exists", f"an engine named {name!r} is already followed; "
                           "unregister it first or choose another name", None)
        self.check_room()
        for what, ep in (("endpoint", spec.endpoint), ("replay endpoint", spec.replay_endpoint)):
            why = check_endpoint(ep, what) if ep else None
            if why is not None:
                raise ApiError(422, "bad_endpoint", why, "$." + what.replace(" ", "_"))
        ix = self.indexes[index]
        e = Engine(spec, index, http, meta or {}, added_at=self.clock())
        if self._sub is not None:
            try:
                self._sub.add_source(spec)
            except ValueError as exc:  # the subscriber could not connect (bad endpoint)
                where = "$.replay_endpoint" if "replay endpoint" in str(exc) else "$.endpoint"
                raise ApiError(422, "bad_endpoint", str(exc), where) from None
            except Exception as exc:  # noqa: BLE001 - out of sockets or descriptors: refuse this one, keep the rest
                log.error("could not follow engine %r: %s: %s", name, type(exc).__name__, exc)
                raise ApiError(429, "no_capacity", f"cannot follow {name!r} now ({type(exc).__name__}: {exc}); "
                               "the process is out of sockets or file descriptors: unregister engines, or lower "
                               "--max-engines and raise the file limit (ulimit -n)", None) from None
        self.engines[name] = e
        self.engines_gen += 1
        if name not in self._leaving:
            self._route_of[name] = ix
            ix.add_source(name)
        # else: its previous incarnation's items still drain into the old index; the
        # removal's reset (see apply) switches it to ``ix``
        return e

    def remove_engine(self, name: str) -> Engine:
        """Stop following ``name``; its blocks leave its index once the items already
        received from it are applied. Raises :class:`ApiError` 404 for an unknown engine."""
        e = self.engines.pop(name, None)
        if e is None:
            raise ApiError(404, "unknown_engine", f"no engine named {name!r}; engines: {sorted(self.engines)}")
        self.engines_gen += 1
        self.loads.forget(name)
        self.applied.pop(name, None)
        self.resumed.pop(name, None)
        self.metrics.forget(name)
        if self._sub is not None:
            ix = self._route_of.pop(name, None)
            if ix is not None:
                self._leaving[name] = ix
            # else: removed again before its previous removal drained: that removal's reset
            # finds it gone, and its items are dropped
            self._sub.remove_source(name)
        else:
            self._route_of.pop(name).remove_source(name)
        return e

    def set_engines(self, specs: Sequence[EngineSpec]) -> tuple[list[str], list[str], list[str]]:
        """Make the default index follow exactly ``specs`` (a config reload): engines that
        stay keep their index entries; changed ones (other endpoints) are re-followed.
        Returns ``(added, removed, kept)`` names."""
        want = {s.name: s for s in specs}
        # Only configured engines: instances registered over HTTP (they carry meta) may share
        # the default index but are not the config's to drop.
        have = {n: e for n, e in self.engines.items() if e.index == DEFAULT_INDEX and not e.meta}
        added, removed, kept = [], [], []
        for n, e in have.items():
            w = want.get(n)
            if w is None or w.source != e.spec:
                self.remove_engine(n)
                removed.append(n)
            else:
                if e.http != w.http:
                    e.http = w.http
                    self.engines_gen += 1  # the proxy's engine URLs follow the generation
                kept.append(n)
        for n, s in want.items():
            if n not in self.engines:
                self.add_engine(s.source, DEFAULT_INDEX, http=s.http)
                added.append(n)
        return added, removed, kept

    # -- the event stream --------------------------------------------------------------

    def apply(self, item: Any) -> None:
        """Apply one subscriber item to its engine's index (the runtime's pump calls this)."""
        cls = type(item)
        name = item.source
        if self._resume and name in self._resume:
            if cls is SourceBatch and item.seq <= self._resume[name]:
                self.items_skipped += 1  # the loaded dump already holds it
                if name in self.engines:
                    self.applied[name] = item.seq
                return
            if cls is SourceBatch or cls is SourceReset:
                del self._resume[name]  # past the dump, or the state is being rebuilt
        ix = self._leaving.get(name)
        if ix is None:
            ix = self._route_of.get(name)
        if ix is None:
            return  # an engine removed before the subscriber knew it
        e = self.engines.get(name) if name not in self._leaving else None
        try:
            apply_item(ix, item, time.time())
        except Exception:  # noqa: BLE001 - one bad item must not stop the service
            log.exception("could not apply %s from %s", cls.__name__, name)
            return
        self.items_applied += 1
        if cls is SourceBatch:
            if e is not None:
                self.applied[name] = item.seq
        elif cls is SourceReset:
            if item.reason == "removed":
                self._leaving.pop(name, None)
                if name in self.engines:  # re-added while its old items drained
                    new = self.indexes[self.engines[name].index]
                    self._route_of[name] = new
                    new.add_source(name)
            elif e is not None:
                self.applied.pop(name, None)

    def state_of(self, name: str, health: SourceHealth | None) -> str:
        """``connecting`` (nothing heard from it yet), ``live``, ``recovering`` or
        ``stale``: the subscriber's state of the engine's stream."""
        return health.state if health is not None else "connecting"

    # -- replicas ----------------------------------------------------------------------

    def dump(self) -> bytes:
        """``GET /v1/dump``: the default index as an index snapshot
        (:mod:`kvstream.routing.snapshot`), each engine's cursor the seq of the last batch
        applied from it."""
        return self.indexes[DEFAULT_INDEX].dump(cursors=dict(self.applied))

    def load_dump(self, data: bytes) -> dict[str, int]:
        """Load a replica's :meth:`dump` into the default index, before following the
        engines: engines of this service that the dump holds take its state, and batches
        up to its cursor are then skipped as they arrive. Sources the dump holds that this
        service does not follow are dropped. Returns ``{engine: seq}`` resumed from.
        Raises ``SnapshotError`` (the index unchanged) for bytes it cannot load."""
        ix = self.indexes[DEFAULT_INDEX]
        cursors = ix.load_source(data)
        out = {}
        for name, cur in cursors.items():
            e = self.engines.get(name)
            if e is None or e.index != DEFAULT_INDEX:
                ix.remove_source(name)
            elif type(cur) is int:
                out[name] = cur
        self._resume.update(out)
        self.resumed.update(out)
        self.applied.update(out)
        return out

    # -- GET handlers ------------------------------------------------------------------

    def _health(self) -> dict[str, SourceHealth]:
        return self._sub.health() if self._sub is not None else {}

    def engines_view(self) -> bytes:
        """``GET /v1/engines``."""
        health = self._health()
        now = self.clock()
        out = []
        for name, e in self.engines.items():
            h = health.get(name)
            c = h.counters if h is not None else {}
            ix = self.indexes[e.index]
            try:
                info = ix.source_info(name)
                blocks, stale_index = info.blocks, info.stale
            except Exception:  # noqa: BLE001 - not in the index yet
                blocks, stale_index = {}, False
            out.append({
                "name": name,
                "state": self.state_of(name, h),
                "index": e.index,
                "endpoint": e.spec.endpoint,
                "replay_endpoint": e.spec.replay_endpoint,
                "http": e.http,
                "last_seq": h.last_seq if h is not None else -1,
                "applied_seq": self.applied.get(name),
                "resumed_seq": self.resumed.get(name),
                "lag_s": c.get("lag_s", 0.0),
                "gaps": c.get("gaps", 0),
                "replays": c.get("replays", 0),
                "snapshots": c.get("snapshots", 0),
                "restarts": c.get("restarts", 0),
                "decode_errors": c.get("decode_errors", 0),
                "events": c.get("events", 0),
                "batches": c.get("batches", 0),
                "index_stale": stale_index,
                "blocks": blocks,
                "load": self.loads.view(name, now),
                **({"meta": e.meta} if e.meta else {}),
                **{k: v for extra in self.engine_view_extras for k, v in extra(name).items()},
            })
        return ENCODER.encode({"engines": out})

    def ready(self) -> bool:
        """At least one engine is live."""
        health = self._health()
        return any(self.state_of(n, health.get(n)) == "live" for n in self.engines)

    def fail(self, why: str) -> None:
        """The runtime stopped on an error: record it and call :attr:`on_failure`."""
        self.failure = why
        for hook in list(self.on_failure):
            hook(why)

    def healthz(self) -> tuple[int, bytes]:
        """``GET /healthz``: 200 while the service follows its engines; 503 (with the
        reason) once its event stream runtime failed."""
        if self.failure is None:
            return 200, b'{"alive":true}'
        return 503, ENCODER.encode({"alive": False, "error": self.failure})

    def readyz(self) -> tuple[int, bytes]:
        """``GET /readyz``: 200 when at least one engine is live, else 503."""
        health = self._health()
        states = {n: self.state_of(n, health.get(n)) for n in self.engines}
        live = sum(1 for s in states.values() if s == "live")
        body = ENCODER.encode({"ready": live > 0, "live": live, "engines": len(states)})
        return (200 if live else 503), body

    # -- POST /v1/route ----------------------------------------------------------------

    def tokens_of(self, token_ids: list[int] | array | None, prompt: str | None) -> Sequence[int]:
        """The request's tokens: ``token_ids`` as an ``array('I')`` (the check that every id
        is a uint32 is the packing the router keys need, done once; an ``array('I')`` is
        taken as it is), or ``prompt`` through the tokenizer; checks the size limit."""
        if (token_ids is None) == (prompt is None):
            raise ApiError(422, "bad_field", "give exactly one of token_ids and prompt", "$")
        if prompt is not None:
            if self.tokenizer is None:
                raise ApiError(422, "no_tokenizer", "prompt needs a tokenizer: start kvstream serve with "
                               "--tokenizer PATH, or send token_ids", "$.prompt")
            if len(prompt) > 16 * self.config.max_prompt_tokens:
                raise ApiError(413, "too_large", f"prompt is {len(prompt)} characters; the limit is "
                               f"{16 * self.config.max_prompt_tokens} (16 per max-prompt-tokens)", "$.prompt")
            # As vLLM tokenizes a completion's text prompt (and the proxy does): with the
            # special tokens the post-processor adds (a BOS), or no block would ever match.
            token_ids = list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)
        elif type(token_ids) is array and token_ids.typecode == "I":
            packed = token_ids  # packed by the request's decoder (kvstream.service.tokenjson)
        else:
            assert token_ids is not None
            try:
                packed = array("I", token_ids)  # every id a uint32 (C speed)
            except OverflowError:
                i, bad = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t <= 0xFFFFFFFF)
                raise ApiError(422, "bad_field", f"Expected `int` >= 0 and <= 4294967295 (a uint32 token id), "
                               f"got {bad} (at $.token_ids[{i}])", f"$.token_ids[{i}]") from None
        if len(token_ids) > self.config.max_prompt_tokens:
            raise ApiError(413, "too_large", f"the prompt has {len(token_ids)} tokens; the limit is "
                           f"{self.config.max_prompt_tokens} (--max-prompt-tokens)",
                           "$.prompt" if prompt is not None else "$.token_ids")
        return token_ids if prompt is not None else packed

    def check_loads(self, loads: dict[str, Any] | None, index: str) -> dict[str, Load] | None:
        """Request loads as :class:`Load` s; every name must be an engine of ``index``."""
        if not loads:
            return None
        out = {}
        for name, ld in loads.items():
            e = self.engines.get(name)
            if e is None or e.index != index:
                raise ApiError(422, "unknown_engine", f"loads names engine {name!r}, which this index does "
                               f"not follow; engines: {sorted(n for n, x in self.engines.items() if x.index == index)}",
                               f"$.loads.{name}")
            try:
                li = _LOAD.decode(ld)
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
                err = from_msgspec(exc)
                where = f"$.loads.{name}" + (err.where or "$")[1:]
                raise ApiError(422, "bad_field", err.message.replace(f"(at {err.where})", f"(at {where})"),
                               where) from None
            out[name] = Load(li.queue, li.running, li.kv_usage)
        return out

    def route(self, body: bytes) -> bytes:
        """``POST /v1/route``: score the prompt against every engine of the default index and
        choose one (see :class:`~kvstream.service.schema.RouteRequest`)."""
        t0 = time.perf_counter()
        fast = decode_with_tokens(body, RouteRequest)
        ids: list[int] | array | None
        if fast is not None:
            req, ids, _ = fast
        else:
            try:
                req = _ROUTE.decode(body)
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
                raise from_msgspec(exc) from None
            ids = req.token_ids
        tokens = self.tokens_of(ids, req.prompt)
        if req.lora_name is not None and req.lora_id is not None:
            raise ApiError(422, "bad_field", "give lora_name (vLLM >= 0.26) or lora_id (vLLM 0.11), not both",
                           "$.lora_id")
        lora = req.lora_name if req.lora_name is not None else req.lora_id
        requested = self.check_loads(req.loads, DEFAULT_INDEX)
        ix: Any = self.indexes[DEFAULT_INDEX]
        mm = None
        if req.mm_hashes:
            mm = [MMItem(m.identifier, m.offset, m.length) for m in req.mm_hashes]
        now = self.clock()
        ix.expire(now)
        try:
            keys = ix.keys(tokens, lora, req.cache_salt, mm)
        except RouterKeyError as exc:
            raise ApiError(422, "bad_field", str(exc), "$.mm_hashes") from None
        loads = self.loads.effective(requested)
        res = ix.score(tokens, loads=loads, policy=self.policy, keys=keys)
        # An engine its load scrape cannot reach is not named best (its stream may not
        # have noticed yet that it is gone); see kvstream.service.load.
        res.ranking = self.loads.reachable_first(res.ranking)
        best = res.best
        if req.speculate and best is not None:
            ix.speculate(best, tokens, now, self.config.speculate_ttl, keys=keys)
        health = self._health()
        R = res.router_block_size
        scores = []
        for name in res.ranking:
            m = res.matches[name]
            ld = loads.get(name) or _NO_LOAD
            st = self.state_of(name, health.get(name)) if name in self.engines else "unknown"
            scores.append(EngineScore(
                name, m.blocks, m.tokens, {k: v * R for k, v in m.tier_blocks.items()},
                {"queue": ld.queue, "running": ld.running, "kv_usage": ld.kv_usage},
                round(res.values.get(name, 0.0), 9), st,
            ))
        matched = res.matches[best].tokens if best is not None else 0
        out = ENCODER.encode(RouteResponse(best, matched, scores))
        self.metrics.routed("route", time.perf_counter() - t0, matched, best)
        return out

    # -- metrics -----------------------------------------------------------------------

    def _engine_snapshots(self) -> Iterable[EngineSnapshot]:
        health = self._health()
        known = self.loads.known()
        for name, e in list(self.engines.items()):
            h = health.get(name)
            c = h.counters if h is not None else {}
            try:
                blocks = self.indexes[e.index].source_info(name).blocks
            except Exception:  # noqa: BLE001
                blocks = {}
            ld = known.get(name) or _NO_LOAD
            yield EngineSnapshot(
                name, self.state_of(name, h), h.last_seq if h is not None else -1, float(c.get("lag_s", 0.0)),
                c, blocks, {"queue": ld.queue, "running": ld.running, "kv_usage": ld.kv_usage,
                            "in_flight": self.loads.in_flight(name)},
            )

    def _index_snapshots(self) -> Iterable[IndexSnapshot]:
        for name, ix in list(self.indexes.items()):
            n = 0
            for s in ix.sources:
                n += sum(ix.source_info(s).blocks.values())
            yield IndexSnapshot(name, n, ix.estimated_bytes())


_NO_LOAD = Load()
