"""The JSON documents of ``kvstream serve``'s own API (``/v1/...``), as msgspec Structs.

The Mooncake indexer API's documents are in :mod:`kvstream.service.mooncake`.
Requests forbid unknown fields (a typo is an error that names the field, not a silent
default); token ids are unsigned 32-bit ints (decoded as ``list[int]`` and range-checked
in one pass by :meth:`~kvstream.service.core.ServiceCore.tokens_of`: msgspec's per-item
bounds cost about 50 us per 4,096 tokens, the check 20 us).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

__all__ = ["MMHash", "LoadIn", "RouteRequest", "EngineScore", "RouteResponse", "TokenId", "MAX_MM_ITEMS"]

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


ENCODER = msgspec.json.Encoder()
"""The service's JSON encoder."""
