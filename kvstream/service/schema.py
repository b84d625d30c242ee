"""The JSON documents of ``kvstream serve``'s own API (``/v1/...``), as msgspec Structs.

The Mooncake indexer API's documents are in :mod:`kvstream.service.mooncake`.
Requests forbid unknown fields (a typo is an error that names the field, not a silent
default); token ids are unsigned 32-bit ints (decoded as ``list[int]`` and range-checked
in one pass by :meth:`~kvstream.service.core.ServiceCore.tokens_of`: msgspec's per-item
bounds cost about 50 us per 4,096 tokens, the check 20 us).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

__all__ = ["MMHash", "LoadIn", "RouteRequest", "EngineScore", "RouteResponse", "TokenId", "EngineState",
           "ErrorDetail", "ErrorResponse", "EngineLoadView", "RoutingAccuracy", "ProxyEngineView", "EngineView",
           "EnginesResponse", "HealthResponse", "ReadyResponse", "RegisterResponse", "UnregisterResponse",
           "InstanceMatch", "QueryResponse", "StateSpan", "Transition", "IndexStatus", "ServiceStatus",
           "StatusResponse", "MAX_MM_ITEMS"]

MAX_MM_ITEMS = 1024
"""Most multimodal items (``mm_hashes``) one ``/v1/route`` request may name: each costs
the router's key computation a pass, ~1.5 us (1,024 items: ~1.6 ms; 10,000 were 0.1 s)."""

TokenId = Annotated[int, Meta(ge=0, le=0xFFFFFFFF)]
Count = Annotated[int, Meta(ge=0, le=1 << 31)]


class MMHash(Struct, forbid_unknown_fields=True):
    """A multimodal item of the prompt: its content hash (vLLM's ``mm_feature.identifier``),
    its first placeholder token (``offset``, tokens from the prompt start) and its
    placeholder count (``length``, tokens)."""

    identifier: Annotated[str, Meta(min_length=1, max_length=1024)]
    offset: Count
    length: Annotated[int, Meta(ge=1, le=1 << 31)] = 1


class LoadIn(Struct, forbid_unknown_fields=True):
    """A load the caller reports for one engine: requests waiting (``queue``), running
    (``running``), and KV cache usage (``kv_usage``, 0..1)."""

    queue: Count = 0
    running: Count = 0
    kv_usage: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0


class RouteRequest(Struct, forbid_unknown_fields=True):
    """``POST /v1/route``: exactly one of ``token_ids`` and ``prompt`` (the latter needs
    ``--tokenizer``). ``lora_name`` (or, for vLLM 0.11 engines, the adapter's int
    ``lora_id``), ``cache_salt`` and ``mm_hashes`` put the request in the same hash
    namespace as the engine would; ``loads`` override the scraped loads per
    engine; ``speculate`` inserts the routed prefix for the chosen engine for
    ``--speculate-ttl`` seconds."""

    token_ids: list[int] | None = None  # uint32 each, checked by ServiceCore.tokens_of
    prompt: str | None = None
    lora_name: Annotated[str, Meta(max_length=1024)] | None = None
    lora_id: Annotated[int, Meta(ge=0, le=1 << 31)] | None = None
    cache_salt: Annotated[str, Meta(max_length=1024)] | None = None
    mm_hashes: Annotated[list[MMHash], Meta(max_length=MAX_MM_ITEMS)] | None = None
    loads: dict[str, msgspec.Raw] | None = None  # each a LoadIn, decoded by name (errors name the engine)
    speculate: bool = False


class EngineScore(Struct):
    """One engine's line of a route answer: its prefix in router blocks and tokens, the
    prefix per medium (tokens), the load routed with, the policy's score and its state."""

    engine: str
    matched_blocks: int
    matched_tokens: int
    tiers: dict[str, int]
    load: dict[str, float]
    score: float
    state: str


class RouteResponse(Struct):
    """``POST /v1/route``'s answer: the chosen ``engine`` (None: no engine), its matched
    prefix in tokens, and every engine's :class:`EngineScore`, the chosen one first."""

    engine: str | None
    matched_tokens: int
    scores: list[EngineScore]


# -- answers, as ``GET /openapi.json`` documents them ----------------------------------
# The handlers build most answers as dicts (the hot paths encode them directly); these
# Structs are their schema: kvstream.service.openapi publishes them, and the tests decode
# live answers with them (every field present, none undocumented) and fuzz the service
# against the document (tests/service/test_openapi.py).

EngineState = Literal["connecting", "live", "recovering", "stale"]
"""An engine's event stream state (the subscriber's)."""


class ErrorDetail(Struct):
    """What was refused: a stable ``code`` (``bad_json``, ``bad_field``, ``too_large``,
    ...), a ``message`` with the fix, and ``where`` in the body (a JSON path) or None."""

    code: str
    message: str
    where: str | None


class ErrorResponse(Struct):
    """Every 4xx answer (and a 500, which would be a bug)."""

    error: ErrorDetail


class EngineLoadView(Struct):
    """An engine's load as ``/v1/route`` scores with it: requests waiting (``queue``),
    running, KV cache usage (0..1), the uncached prompt tokens of the requests this process
    sent it that have not answered yet (``prefill_tokens``, proxy mode), requests in flight
    through this process; whether a scrape of its ``/metrics`` ever succeeded, its age
    (seconds), whether it is stale, the last scrape error; whether its last scrape reached
    it and, if not, for how long (seconds) it has not."""

    queue: int
    running: int
    kv_usage: float
    prefill_tokens: int
    in_flight: int
    scraped: bool
    age_s: float | None
    stale: bool
    error: str | None
    reachable: bool
    unreachable_for_s: float | None


class RoutingAccuracy(Struct):
    """Proxy mode: predicted vs realized cached prompt tokens over answered requests
    (tokens; ``exact_rate``: share predicted exactly, None before any)."""

    requests: int
    predicted_tokens: int
    realized_tokens: int
    exact: int
    exact_rate: float | None
    mean_abs_error_tokens: float | None


class ProxyEngineView(Struct):
    """Proxy mode: what the proxy knows of the engine (``state`` up or down, requests in
    flight, served, failed, seconds it stays marked down, last error, routing accuracy)."""

    state: Literal["up", "down"]
    in_flight: int
    served: int
    failures: int
    down_for_s: float
    last_error: str | None
    routing_accuracy: RoutingAccuracy


class EngineView(Struct):
    """One engine of ``GET /v1/engines``: its stream state and counters, the blocks its
    index holds per medium, its load; ``meta`` for engines registered over ``/register``,
    ``proxy`` in proxy mode once requests went to it."""

    name: str
    state: EngineState
    index: str
    endpoint: str
    replay_endpoint: str | None
    http: str | None
    last_seq: int
    applied_seq: int | None
    resumed_seq: int | None
    lag_s: float
    gaps: int
    replays: int
    snapshots: int
    restarts: int
    decode_errors: int
    events: int
    batches: int
    index_stale: bool
    blocks: dict[str, int]
    load: EngineLoadView
    meta: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    proxy: ProxyEngineView | msgspec.UnsetType = msgspec.UNSET


class EnginesResponse(Struct):
    """``GET /v1/engines``."""

    engines: list[EngineView]


class HealthResponse(Struct):
    """``GET /healthz``: ``alive`` false (a 503) with the ``error`` that stopped the event
    stream runtime."""

    alive: bool
    error: str | msgspec.UnsetType = msgspec.UNSET


class ReadyResponse(Struct):
    """``GET /readyz``: ready (200) when at least one engine is live (else 503)."""

    ready: bool
    live: int
    engines: int


class RegisterResponse(Struct):
    """``POST /register``'s answer (Mooncake RFC #1403)."""

    status: str
    instance_id: str


class UnregisterResponse(Struct):
    """``POST /unregister``'s answer: the engine names removed (``instance|tenant|rank``)."""

    status: str
    removed_instances: list[str]


class InstanceMatch(Struct):
    """One instance of a ``/query`` answer: its longest cached prefix, per medium and per
    data-parallel rank (tokens; a medium is None when a token-keyed index cannot tell it
    per medium); other media appear when an engine holds them."""

    longest_matched: int
    GPU: int | None
    CPU: int | None
    DISK: int | None
    DP: dict[str, int]


QueryResponse = dict[str, dict[str, InstanceMatch]]
"""``POST /query`` and ``/query_by_hash``: tenant -> instance -> :class:`InstanceMatch`
(instances with no cached prefix are left out)."""


class StateSpan(Struct):
    """An engine's current state and since when (``since``: Unix seconds; ``for_s``:
    seconds), as ``GET /v1/status`` reports it."""

    name: str
    state: EngineState
    since: float
    for_s: float


class Transition(Struct):
    """An engine's state change (``at``: Unix seconds). ``from_state`` is None for an
    engine just added; ``to_state`` is ``removed`` for one no longer followed."""

    at: float
    engine: str
    from_state: str | None
    to_state: str


class IndexStatus(Struct):
    """One router index: engines in it, engine blocks held, estimated heap bytes and its
    bound (``max_bytes``, None: unbounded)."""

    name: str
    engines: int
    blocks: int
    estimated_bytes: int
    max_bytes: int | None


class ServiceStatus(Struct):
    """The service at a glance: seconds up, engines followed and live, ready, proxy mode,
    why the event stream runtime stopped (None while it runs)."""

    uptime_s: float
    engines: int
    live: int
    ready: bool
    proxy: bool
    failure: str | None


class StatusResponse(Struct):
    """``GET /v1/status``: what the status page draws beside ``/v1/engines``; ``now``:
    Unix seconds; ``transitions`` newest first (the last ``max_transitions``)."""

    now: float
    service: ServiceStatus
    engines: list[StateSpan]
    indexes: list[IndexStatus]
    transitions: list[Transition]
    max_transitions: int


ENCODER = msgspec.json.Encoder()
"""The service's JSON encoder."""
