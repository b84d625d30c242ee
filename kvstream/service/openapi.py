"""``GET /openapi.json``: the HTTP API of ``kvstream serve`` as an OpenAPI 3.1 document.

Generated, not written: the request bodies are the msgspec Structs the handlers decode
with (:mod:`kvstream.service.schema`, :mod:`kvstream.service.mooncake`), the answers the
Structs of :mod:`kvstream.service.schema`, turned into JSON Schema by
``msgspec.json.schema_components``; the paths are the routes the app actually serves
(:func:`document` walks them), so a route added without an entry in :data:`OPERATIONS`
shows up in the document as ``x-undocumented`` (and fails the test that keeps the two
equal, ``tests/service/test_openapi.py``, which also fuzzes the service against the
document with schemathesis).

A few bounds are checked by hand rather than by msgspec (token ids as uint32 in one pass,
u64 hashes, ``loads`` decoded per engine so errors name it): :data:`_BY_HAND` adds them
to the schema, naming the Struct and field, so a renamed field fails loudly here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import msgspec
from starlette.routing import BaseRoute, Mount, Route

from kvstream.service import schema as S
from kvstream.service.mooncake import PUBLISHER_TYPES, QueryByHashRequest, QueryRequest, RegisterRequest, UnregisterRequest

__all__ = ["Op", "OPERATIONS", "OPENAI_PATHS", "document", "served_operations", "openapi_route"]

JSON = "application/json"


@dataclass(frozen=True)
class Op:
    """One operation: its summary and description, the request Struct (POST bodies),
    answers by status (a type, or ``(media type, JSON schema)`` for non-JSON bodies),
    tags, and per status its OpenAPI ``links`` (what the stateful fuzzing follows)."""

    summary: str
    description: str = ""
    body: type | None = None
    answers: dict[int, Any] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    links: dict[int, dict[str, Any]] = field(default_factory=dict)


# What any POST may be refused with: not JSON / not HTTP the service takes (400), a request
# not sent whole in time (408), a body or prompt too large (413), a head too large (431),
# a field of the wrong type or range (422).
_POST_ERRORS = {400: S.ErrorResponse, 408: S.ErrorResponse, 413: S.ErrorResponse, 422: S.ErrorResponse,
                431: S.ErrorResponse}
_TEXT = ("text/plain", {"type": "string"})
_HTML = ("text/html", {"type": "string"})

_INSTANCE_LINK = {"instance_id": "$request.body#/instance_id", "tenant_id": "$request.body#/tenant_id",
                  "dp_rank": "$request.body#/dp_rank"}

OPERATIONS: dict[tuple[str, str], Op] = {
    ("POST", "/v1/route"): Op(
        "Choose an engine for a prompt",
        "Scores the prompt's cached prefix on every engine of the default index, with its load, "
        "and names the best. Exactly one of token_ids and prompt (prompt needs --tokenizer).",
        S.RouteRequest, {200: S.RouteResponse, **_POST_ERRORS}, ("routing",)),
    ("GET", "/v1/engines"): Op(
        "The engines followed", "Each engine's stream state, counters, blocks per medium and load.",
        answers={200: S.EnginesResponse}, tags=("state",)),
    ("GET", "/v1/status"): Op(
        "The service at a glance (the status page's data)",
        "Each engine's state since when, the indexes against their byte bound, the last state transitions.",
        answers={200: S.StatusResponse}, tags=("state",)),
    ("GET", "/v1/dump"): Op(
        "The default index as a snapshot (replicas load it)",
        "msgpack (kvstream.routing.snapshot); each engine's cursor is the seq of the last batch applied.",
        answers={200: ("application/msgpack", {"type": "string", "contentMediaType": "application/msgpack"})},
        tags=("replicas",)),
    ("GET", "/healthz"): Op(
        "Liveness", "200 while the service follows its engines; 503 once its event stream runtime failed.",
        answers={200: S.HealthResponse, 503: S.HealthResponse}, tags=("health",)),
    ("GET", "/health"): Op(
        "Liveness (vLLM's name for /healthz)", "The same answer as /healthz.",
        answers={200: S.HealthResponse, 503: S.HealthResponse}, tags=("health",)),
    ("GET", "/readyz"): Op(
        "Readiness", "200 when at least one engine is live, else 503.",
        answers={200: S.ReadyResponse, 503: S.ReadyResponse}, tags=("health",)),
    ("GET", "/metrics"): Op(
        "Prometheus metrics", "The text exposition (docs/serve.md lists every metric).",
        answers={200: _TEXT}, tags=("health",)),
    ("POST", "/register"): Op(
        "Follow a KV event publisher (Mooncake indexer API)",
        "RFC kvcache-ai/Mooncake#1403. Needs 'Authorization: Bearer TOKEN' with --register-token-file.",
        RegisterRequest, {200: S.RegisterResponse, 401: S.ErrorResponse, 409: S.ErrorResponse, **_POST_ERRORS},
        ("mooncake",),
        links={200: {
            "Unregister": {"operationId": "post_unregister", "requestBody": dict(_INSTANCE_LINK),
                           "description": "Stop following the publisher just registered."},
        }}),
    ("POST", "/unregister"): Op(
        "Stop following a publisher (Mooncake indexer API)",
        "Every dp_rank of the instance when dp_rank is omitted.",
        UnregisterRequest, {200: S.UnregisterResponse, 401: S.ErrorResponse, 404: S.ErrorResponse,
                            **_POST_ERRORS}, ("mooncake",)),
    ("POST", "/query"): Op(
        "Cached prefix per instance, by token ids (Mooncake indexer API)",
        "tenant -> instance -> longest_matched and per medium and rank, tokens; instances without a "
        "cached prefix are left out.",
        QueryRequest, {200: S.QueryResponse, 404: S.ErrorResponse, **_POST_ERRORS}, ("mooncake",)),
    ("POST", "/query_by_hash"): Op(
        "Cached prefix per instance, by rolling sequence hashes (Mooncake indexer API)",
        "longest_matched = block_size x matched hashes.",
        QueryByHashRequest, {200: S.QueryResponse, 404: S.ErrorResponse, **_POST_ERRORS}, ("mooncake",)),
    ("GET", "/"): Op("The status page", "HTML; refreshes itself from /v1/engines and /v1/status.",
                     answers={200: _HTML}, tags=("ui",)),
    ("GET", "/ui"): Op("The status page", "The same page as /.", answers={200: _HTML}, tags=("ui",)),
    ("GET", "/openapi.json"): Op("This document", answers={200: (JSON, {"type": "object"})}, tags=("meta",)),
}
"""Every operation of the service, by (method, path)."""

_OPENAI = "https://platform.openai.com/docs/api-reference"
_UPSTREAM = {"description": "The engine's answer, status and body unchanged (JSON, or server-sent events "
                            "when the request streams); 'x-kvstream-engine' names the engine.",
             "headers": {"x-kvstream-engine": {"schema": {"type": "string"}}},
             "content": {JSON: {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}}}
OPENAI_PATHS: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/completions"): {"summary": "OpenAI completions, routed to the engine with the most cached prefix",
                                  "externalDocs": {"url": f"{_OPENAI}/completions"}},
    ("POST", "/v1/chat/completions"): {"summary": "OpenAI chat completions, routed like /v1/completions",
                                       "externalDocs": {"url": f"{_OPENAI}/chat"}},
    ("GET", "/v1/models"): {"summary": "The models, from an engine that is up",
                            "externalDocs": {"url": f"{_OPENAI}/models"}},
}
"""Proxy mode's OpenAI routes, documented by reference to OpenAI's API (the engine
validates the bodies; kvstream passes them on)."""

# (Struct, field) -> JSON Schema keys added to the field's schema (for the non-null
# alternative of an optional field): bounds the handlers check by hand.
_UINT32 = {"items": {"type": "integer", "minimum": 0, "maximum": 0xFFFFFFFF}}
_UINT64 = {"items": {"type": "integer", "minimum": 0, "maximum": 0xFFFF_FFFF_FFFF_FFFF}}
_BY_HAND: dict[tuple[type, str], dict[str, Any]] = {
    (S.RouteRequest, "token_ids"): _UINT32,
    (QueryRequest, "token_ids"): _UINT32,
    (QueryByHashRequest, "seq_hashes"): _UINT64,
    (QueryByHashRequest, "block_hash"): _UINT64,
    (S.RouteRequest, "loads"): {"additionalProperties": {"$ref": "#/components/schemas/LoadIn"}},
    # PUBLISHER_TYPES, any case; an endpoint is a ZMQ URL (tcp://host:port, ipc://path)
    (RegisterRequest, "type"): {"pattern": "^(" + "|".join("".join(f"[{c.lower()}{c.upper()}]" for c in k)
                                                          for k in PUBLISHER_TYPES) + ")$",
                                "examples": list(PUBLISHER_TYPES.values())},
    (RegisterRequest, "endpoint"): {"pattern": "://", "examples": ["tcp://10.0.0.1:5557"]},
    (RegisterRequest, "replay_endpoint"): {"pattern": "://", "examples": ["tcp://10.0.0.1:5558"]},
}


def _op_id(method: str, path: str) -> str:
    return method.lower() + "_" + ("root" if path == "/" else
                                   path.strip("/").replace("/", "_").replace(".", "_"))


def served_operations(routes: Iterable[BaseRoute], prefix: str = "") -> list[tuple[str, str]]:
    """``(method, path)`` of every HTTP route in ``routes`` (mounts walked; the HEAD
    Starlette adds to each GET left out)."""
    out: list[tuple[str, str]] = []
    for r in routes:
        if isinstance(r, Route):
            for m in sorted(r.methods or ()):
                if m != "HEAD":
                    out.append((m, prefix + r.path))
        elif isinstance(r, Mount):
            out.extend(served_operations(r.routes, prefix + r.path))
    return out


def _patch(components: dict[str, Any]) -> None:
    for (struct, name), extra in _BY_HAND.items():
        if struct.__name__ not in components:
            continue  # an app without that route
        props = components[struct.__name__]["properties"]
        if name not in props:
            raise KeyError(f"{struct.__name__} has no field {name!r}: update kvstream.service.openapi._BY_HAND")
        target = props[name]
        alts = [a for a in target.get("anyOf", [target]) if a.get("type") != "null"]
        for alt in alts:
            alt.update(copy.deepcopy(extra))


def _content(answer: Any, refs: dict[Any, Any]) -> dict[str, Any]:
    if isinstance(answer, tuple):
        media, sch = answer
        return {media: {"schema": sch}}
    return {JSON: {"schema": refs[answer]}}


_DESCRIPTIONS = {200: "OK", 400: "Not JSON, or not HTTP/1.1 the service accepts", 401: "No or a wrong bearer token",
                 404: "Unknown instance", 408: "The request was not sent whole within --request-timeout",
                 409: "Already registered with other settings", 413: "Over --max-body-bytes or --max-prompt-tokens",
                 422: "A field of the wrong type, range or combination (error.where names it)",
                 431: "A request line or header over 64 KiB",
                 503: "Not healthy / not ready"}


def document(routes: Sequence[BaseRoute], *, title: str = "kvstream serve", version: str | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of an app serving ``routes``."""
    if version is None:
        from kvstream import __version__ as version
    served = served_operations(routes)
    types: list[Any] = []
    for key in served:
        op = OPERATIONS.get(key)
        if op is None:
            continue
        if op.body is not None:
            types.append(op.body)
        types.extend(a for a in op.answers.values() if not isinstance(a, tuple))
    uniq = list(dict.fromkeys(types))
    refs_list, components = msgspec.json.schema_components(uniq, ref_template="#/components/schemas/{name}")
    refs = dict(zip(uniq, refs_list))
    _patch(components)
    paths: dict[str, dict[str, Any]] = {}
    for method, path in served:
        op = OPERATIONS.get((method, path))
        entry: dict[str, Any]
        if op is not None:
            entry = {"operationId": _op_id(method, path), "summary": op.summary, "tags": list(op.tags)}
            if op.description:
                entry["description"] = op.description
            if op.body is not None:
                entry["requestBody"] = {"required": True, "content": {JSON: {"schema": refs[op.body]}}}
            responses: dict[str, Any] = {}
            for status, answer in sorted(op.answers.items()):
                resp: dict[str, Any] = {"description": _DESCRIPTIONS.get(status, "Refused"),
                                        "content": _content(answer, refs)}
                if status in op.links:
                    resp["links"] = copy.deepcopy(op.links[status])
                responses[str(status)] = resp
            entry["responses"] = responses
        elif (method, path) in OPENAI_PATHS:
            entry = {"operationId": _op_id(method, path), "tags": ["openai"], **copy.deepcopy(OPENAI_PATHS[method, path]),
                     "responses": {"default": copy.deepcopy(_UPSTREAM)}}
            if method == "POST":
                entry["requestBody"] = {"required": True, "content": {JSON: {"schema": {"type": "object"}}}}
        else:
            entry = {"operationId": _op_id(method, path), "summary": "(not documented)", "x-undocumented": True,
                     "responses": {"default": {"description": "Not documented"}}}
        paths.setdefault(path, {})[method.lower()] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "kvstream's KV-cache-aware routing service: kvstream's own API, the Mooncake "
                                "indexer API (RFC kvcache-ai/Mooncake#1403), health, metrics and the status page. "
                                "Every refusal is a 4xx JSON error document."},
        "paths": paths,
        "components": {"schemas": components},
    }


def openapi_route(routes: Sequence[BaseRoute]) -> Route:
    """``GET /openapi.json`` for an app serving ``routes`` (this route included; the
    document is built on first call and kept: the routes do not change)."""
    from starlette.requests import Request
    from starlette.responses import Response

    cached: list[bytes] = []

    async def openapi(request: Request) -> Response:
        if not cached:
            served = list(routes) if route in routes else [*routes, route]
            cached.append(msgspec.json.encode(document(served)))
        return Response(cached[0], media_type=JSON)

    route = Route("/openapi.json", openapi, methods=["GET"])
    return route
