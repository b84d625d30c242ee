"""The Mooncake KV indexer API (RFC kvcache-ai/Mooncake#1403, Mooncake conductor's
``indexer-api-design.md``), served beside ``/v1/route`` with its field names and shapes.

* ``POST /register`` (``endpoint``, ``replay_endpoint``, ``type``, ``modelname``,
  ``lora_name``, ``tenant_id``, ``instance_id``, ``block_size``, ``dp_rank``,
  ``additionalsalt``) starts following a publisher -> ``{"status": "registered
  successfully", "instance_id": ...}``.
* ``POST /unregister`` (``instance_id``, ``tenant_id``, ``dp_rank``, ...) stops it ->
  ``{"status": "unregistered successfully", "removed_instances": ["inst|tenant|rank"]}``
  (a ``\\`` or ``|`` inside a name is written ``\\\\`` or ``\\|``: :func:`join_names`).
* ``POST /query`` (``model``, ``token_ids``, ``block_size``, ``lora_name``, ``tenant_id``,
  ``instance_id``, ``cache_salt``) and ``POST /query_by_hash`` (``seq_hashes`` instead of
  ``token_ids``) -> ``{tenant: {instance: {"longest_matched": N, "GPU": n, "CPU": n,
  "DISK": n, "DP": {"0": n, ...}}}}``, all in tokens; instances with no cached prefix are
  left out (absent means 0).

Isolation: every registration lands in the index of its (model, tenant, block size,
additional salt, LoRA) group; a query reads only the groups of its model, tenant and block
size whose LoRA is the query's (or the base model) and whose salt is the query's
``cache_salt`` (or none). Publishers of type ``Mooncake`` (RFC #1527 events, standard
hash) are indexed by their ``seq_hashes`` (:class:`~kvstream.routing.engine_index.EngineKeyIndex`),
and ``/query`` computes the standard hash of the tokens; ``vLLM`` and ``SGLang`` publishers
are indexed by tokens (:class:`~kvstream.routing.index.KVIndex`), so their own hash algorithm and
seed do not matter, and ``/query_by_hash`` matches their engine hashes.
"""

from __future__ import annotations

import hmac
import time
from array import array
from typing import Annotated, Any, Callable

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request

from kvstream._native import RowLabels
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.hashing import BlockHasher
from kvstream.routing.keys import RouterKeyError
from kvstream.service.core import DEFAULT_INDEX, ServiceCore
from kvstream.service.errors import ApiError, from_msgspec
from kvstream.hashing.mooncake import MooncakeHasher
from kvstream.service.schema import ENCODER
from kvstream.service.tokenjson import decode_with_tokens
from kvstream.transport.subscriber import SourceSpec

__all__ = ["MooncakeAPI", "RegisterRequest", "UnregisterRequest", "QueryRequest", "QueryByHashRequest",
           "PUBLISHER_TYPES", "MEDIA", "join_names"]

PUBLISHER_TYPES = {"vllm": "vLLM", "sglang": "SGLang", "mooncake": "Mooncake"}
"""Publisher ``type`` values (case-insensitive) and their canonical spelling."""

MEDIA = ("GPU", "CPU", "DISK")
"""Media every per-instance answer lists (others appear when an engine holds them)."""

Name = Annotated[str, Meta(min_length=1, max_length=256)]
Opt = Annotated[str, Meta(max_length=256)]
BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]
Rank = Annotated[int, Meta(ge=0, le=1 << 16)]
U64 = Annotated[int, Meta(ge=0)]  # the upper bound is checked by hand (msgspec bounds are int64)
LoraId = Annotated[int, Meta(ge=0, le=1 << 31)]  # vLLM 0.11's adapter int id, as /v1/route takes it
Tenant = Annotated[str, Meta(max_length=256)] | None  # null (or omitted) is the RFC's default tenant


class _DefaultTenant(Struct):
    """``tenant_id``: "No. Defaults to ``default``" (RFC #1403); a client that serializes an
    unset optional field as ``null`` means the default too."""

    tenant: Tenant = msgspec.field(default="default", name="tenant_id")

    @property
    def tenant_id(self) -> str:
        """The tenant (``default`` when omitted or null)."""
        return "default" if self.tenant is None else self.tenant


class RegisterRequest(_DefaultTenant, kw_only=True):
    """``POST /register`` (RFC #1403 field names)."""

    endpoint: Name
    type: Name
    modelname: Name
    instance_id: Name
    block_size: BlockSize
    dp_rank: Rank
    replay_endpoint: Opt | None = None
    lora_name: Opt | None = None
    additionalsalt: Opt | None = None


class UnregisterRequest(_DefaultTenant, kw_only=True):
    """``POST /unregister``: removes ``(instance_id, tenant_id, dp_rank)`` (every rank when
    ``dp_rank`` is omitted)."""

    instance_id: Name
    dp_rank: Rank | None = None
    type: Opt | None = None
    modelname: Opt | None = None
    lora_name: Opt | None = None
    block_size: BlockSize | None = None


class QueryRequest(_DefaultTenant, kw_only=True):
    """``POST /query``."""

    model: Name
    token_ids: list[int]  # uint32 each, checked by ServiceCore.tokens_of
    block_size: BlockSize
    lora_name: Opt | None = None
    lora_id: LoraId | None = None
    instance_id: Opt | None = None
    cache_salt: Opt | None = None


class QueryByHashRequest(_DefaultTenant, kw_only=True):
    """``POST /query_by_hash`` (``block_hash`` is the earlier drafts' name of ``seq_hashes``)."""

    model: Name
    block_size: BlockSize
    seq_hashes: list[U64] | None = None
    block_hash: list[U64] | None = None
    lora_name: Opt | None = None
    lora_id: LoraId | None = None
    instance_id: Opt | None = None
    cache_salt: Opt | None = None


_REG = msgspec.json.Decoder(RegisterRequest)
_UNREG = msgspec.json.Decoder(UnregisterRequest)
_QUERY = msgspec.json.Decoder(QueryRequest)
_QHASH = msgspec.json.Decoder(QueryByHashRequest)
_ENC = msgspec.json.Encoder()
_COLUMNS = ("GPU", "CPU", "DISK")  # the media of an answer row, in its order


def _decode(dec: msgspec.json.Decoder, body: bytes) -> Any:
    try:
        return dec.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        raise from_msgspec(exc) from None


def _decode_split(dec: msgspec.json.Decoder, body: bytes, field: str, width: int,
                  holders: tuple[str, ...]) -> tuple[Any, array | None, bytes | None]:
    """``(the request, its array packed, the same as bytes)`` when the native reader takes
    the body (:func:`kvstream.service.tokenjson.decode_with_tokens`), else ``(the request,
    None, None)`` decoded by msgspec alone (which words any error)."""
    got = decode_with_tokens(body, dec.type, field, width, holders)  # type: ignore[arg-type]
    if got is not None:
        return got
    return _decode(dec, body), None, None


_NAME_COMMAS = 2048
"""Commas a query's other fields may hold besides its array (names up to 256 characters)."""


def _check_items(body: bytes, most: int, field: str) -> None:
    """Refuse (413) a body whose array ``field`` cannot hold at most ``most`` items, by
    counting its commas (C speed, ~1 ms per MB) before anything is decoded: so a body of
    millions of one-digit items costs a scan, not a decode into millions of Python ints."""
    bound = most + _NAME_COMMAS
    if len(body) > bound and body.count(b",") > bound:  # a shorter body cannot hold more commas: no scan
        raise ApiError(413, "too_large", f"the body holds more than {most} items; {field} takes at most {most} "
                       "(--max-prompt-tokens)", f"$.{field}")


def join_names(*parts: object) -> str:
    """``parts`` joined with ``|``, each ``\\`` and ``|`` inside a part escaped with ``\\``,
    so two different tuples never give the same string (names without either character
    read as before: ``a|default|0``)."""
    return "|".join(str(p).replace("\\", "\\\\").replace("|", "\\|") for p in parts)


def engine_name(instance_id: str, tenant_id: str, dp_rank: int) -> str:
    """The engine (source) name of a registration: ``instance|tenant|rank`` (:func:`join_names`)."""
    return join_names(instance_id, tenant_id, dp_rank)


def group_name(model: str, tenant: str, block_size: int, salt: str, lora: str, kind: str) -> str:
    """The index name of a registration group (shown in ``/v1/engines`` and metrics)."""
    return "mooncake:" + join_names(model, tenant, block_size, salt, lora, kind)


class MooncakeAPI:
    """The Mooncake handlers over a :class:`ServiceCore` (bodies in, bodies out)."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core
        self._token = core.config.register_token()
        # (model, tenant, block_size, salt, lora) -> index name, per publisher kind
        self._groups: dict[tuple[str, str, int, str, str], dict[str, str]] = {}
        # index name -> its group (key, kind), for the registration groups (dropped when empty)
        self._group_of: dict[str, tuple[tuple[str, str, int, str, str], str]] = {}
        self._hashers: dict[int, MooncakeHasher] = {}
        # index name -> (the index, its slot and engine generations, its RowLabels): see _row_labels
        self._slot_labels: dict[str, tuple[Any, tuple[int, int], RowLabels]] = {}
        self.share: Callable[[bytes], None] | None = None
        """Called after each ``/register`` or ``/unregister`` that succeeded over HTTP with
        the message :meth:`apply_shared` takes (``kvstream serve --workers N``: the other
        workers, :mod:`kvstream.service.siblings`)."""
        # The configured engines answer /query as one vLLM group of the configured model.
        cfg = core.config
        self._groups[(cfg.model_name, "default", cfg.router_block_size, "", "")] = {"vLLM": DEFAULT_INDEX}

    # -- auth ------------------------------------------------------------------------

    def check_token(self, request: Request) -> None:
        """Refuse (401) a ``register``, ``unregister`` or ``GET /v1/dump`` without the
        configured bearer token."""
        if self._token is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, tok = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(tok.strip().encode(), self._token.encode()):
            raise ApiError(401, "unauthorized", "/register, /unregister and /v1/dump need 'Authorization: Bearer "
                           "TOKEN' (the token in --register-token-file)")

    # -- registration ----------------------------------------------------------------

    def register(self, body: bytes) -> bytes:
        """``POST /register``."""
        r: RegisterRequest = _decode(_REG, body)
        out = self._register(r)
        if self.share is not None:
            self.share(b"R" + _ENC.encode(r))
        return out

    def apply_shared(self, message: bytes) -> None:
        """Apply a registration another worker accepted (``share``'s message); an unregister
        of an instance this worker does not hold is a no-op."""
        kind, body = message[:1], message[1:]
        if kind == b"R":
            self._register(_REG.decode(body))
        elif kind == b"U":
            try:
                self._unregister(_UNREG.decode(body))
            except ApiError as exc:
                if exc.status != 404:
                    raise
        else:
            raise ValueError(f"unknown shared registration message kind {kind!r}")

    def _register(self, r: RegisterRequest) -> bytes:
        kind = PUBLISHER_TYPES.get(r.type.lower())
        if kind is None:
            raise ApiError(422, "bad_field", f"type must be one of vLLM, SGLang, Mooncake; got {r.type!r}", "$.type")
        for f, v in (("endpoint", r.endpoint), ("replay_endpoint", r.replay_endpoint)):
            if v is not None and "://" not in v:
                raise ApiError(422, "bad_field", f"{f} must be a ZMQ endpoint like tcp://host:5557, got {v!r}",
                               f"$.{f}")
        core = self.core
        name = engine_name(r.instance_id, r.tenant_id, r.dp_rank)
        spec = SourceSpec(r.endpoint, r.replay_endpoint or None, name)
        salt, lora = r.additionalsalt or "", r.lora_name or ""
        key = (r.modelname, r.tenant_id, r.block_size, salt, lora)
        kinds = self._groups.get(key)
        ixname = kinds.get(kind) if kinds is not None else None
        old = core.engines.get(name)
        if old is not None:
            if old.spec == spec and ixname is not None and old.index == ixname:
                return ENCODER.encode({"status": "registered successfully", "instance_id": r.instance_id})
            raise ApiError(409, "engine_exists", f"{r.instance_id!r} rank {r.dp_rank} of tenant {r.tenant_id!r} is "
                           "already registered with other settings; unregister it first", "$.instance_id")
        if ixname is None:
            core.check_room()  # the engine limit's 429 comes before a group is made
            ixname = group_name(*key, kind)
            if ixname not in core.indexes:
                core.indexes[ixname] = self._new_index(kind, r.block_size)
            self._groups.setdefault(key, {})[kind] = ixname
            self._group_of[ixname] = (key, kind)
        meta = {"type": kind, "modelname": r.modelname, "tenant_id": r.tenant_id, "instance_id": r.instance_id,
                "dp_rank": r.dp_rank, "block_size": r.block_size, "lora_name": r.lora_name,
                "additionalsalt": r.additionalsalt}
        try:
            core.add_engine(spec, ixname, meta=meta)
        except BaseException:
            self._drop_if_empty(ixname)  # a group made for this registration goes with it
            raise
        core.metrics.registration("register")
        return ENCODER.encode({"status": "registered successfully", "instance_id": r.instance_id})

    def _drop_if_empty(self, ixname: str) -> None:
        """Forget registration group ``ixname`` and its index once no engine is in it (its
        last engine's remaining items still drain into the index object, which then goes)."""
        group = self._group_of.get(ixname)
        if group is None:  # the configured engines' group (the default index) stays
            return
        core = self.core
        if any(e.index == ixname for e in core.engines.values()):
            return
        key, kind = group
        del self._group_of[ixname]
        kinds = self._groups.get(key)
        if kinds is not None:
            kinds.pop(kind, None)
            if not kinds:
                del self._groups[key]
        core.indexes.pop(ixname, None)
        if kind == "Mooncake" and not any(k[2] == key[2] and "Mooncake" in v for k, v in self._groups.items()):
            self._hashers.pop(key[2], None)

    def _new_index(self, kind: str, block_size: int) -> Any:
        if kind == "Mooncake":
            # Keyed by the publishers' own seq_hashes; the hasher is never used to hash
            # (queries pass the standard hashes as keys), it only fixes the block size.
            return EngineKeyIndex(BlockHasher("xxhash", block_size), max_bytes=self.core.config.index_max_bytes,
                                  ttl_s=self.core.config.index_ttl)
        return self.core.new_index(block_size)

    def unregister(self, body: bytes) -> bytes:
        """``POST /unregister``."""
        r: UnregisterRequest = _decode(_UNREG, body)
        out = self._unregister(r)
        if self.share is not None:
            self.share(b"U" + _ENC.encode(r))
        return out

    def _unregister(self, r: UnregisterRequest) -> bytes:
        core = self.core
        gone = []
        for name, e in list(core.engines.items()):
            m = e.meta
            if (m.get("instance_id") == r.instance_id and m.get("tenant_id") == r.tenant_id
                    and (r.dp_rank is None or m.get("dp_rank") == r.dp_rank)):
                core.remove_engine(name)
                gone.append(name)
                self._drop_if_empty(e.index)
        if not gone:
            raise ApiError(404, "unknown_instance", f"no registered publisher for instance {r.instance_id!r}, "
                           f"tenant {r.tenant_id!r}" + ("" if r.dp_rank is None else f", dp_rank {r.dp_rank}"),
                           "$.instance_id")
        core.metrics.registration("unregister")
        return ENCODER.encode({"status": "unregistered successfully", "removed_instances": gone})

    # -- queries ---------------------------------------------------------------------

    def _targets(self, model: str, tenant: str, block_size: int, lora: str, salt: str) -> list[str]:
        out: list[str] = []
        for (m, t, b, s, lo), kinds in self._groups.items():
            if m == model and t == tenant and b == block_size and lo in ("", lora) and s in ("", salt):
                out.extend(kinds.values())
        return out

    def _instances(self, tenant: str, instance: str | None) -> None:
        if instance is None:
            return
        for name, e in self.core.engines.items():
            if e.meta.get("instance_id", name) == instance and e.meta.get("tenant_id", "default") == tenant:
                return
        raise ApiError(404, "unknown_instance", f"instance {instance!r} is not registered under tenant {tenant!r}",
                       "$.instance_id")

    def _hasher(self, block_size: int) -> MooncakeHasher:
        h = self._hashers.get(block_size)
        if h is None:
            h = self._hashers[block_size] = MooncakeHasher(block_size, self.core.config.mooncake_seed)
        return h

    def query(self, body: bytes) -> bytes:
        """``POST /query``: prefix hits of ``token_ids`` per instance, in tokens."""
        t0 = time.perf_counter()
        _check_items(body, self.core.config.max_prompt_tokens, "token_ids")
        q, packed, raw = _decode_split(_QUERY, body, "token_ids", 4, ("token_ids",))
        ids: list[int] | array
        ids = packed if packed is not None else q.token_ids
        self._check_lora(q.lora_name, q.lora_id)
        core = self.core
        tokens = core.tokens_of(ids, None)
        self._instances(q.tenant_id, q.instance_id)
        lora, salt = q.lora_name or "", q.cache_salt or ""
        result: dict[str, dict[str, Any]] = {}
        std: list[int] | None = None
        targets = self._targets(q.model, q.tenant_id, q.block_size, lora, salt)
        one = len(targets) == 1 and q.instance_id is None
        for ixname in targets:
            ix = core.indexes[ixname]
            got: tuple[int, bytes, int] | None = None
            if isinstance(ix, EngineKeyIndex):
                if std is None:
                    std = self._hasher(q.block_size).seq_hashes(tokens)
                if one:
                    got = self._native_answer(ixname, ix, q.tenant_id, q.block_size, (), keys=std)
                if got is None:
                    _, rows = ix.match_rows((), keys=std)
            else:
                try:
                    lora_key = q.lora_name or (q.lora_id if q.lora_id is not None else None)
                    if one:  # the ids as the body's packed bytes when it had them (the same ids)
                        got = self._native_answer(ixname, ix, q.tenant_id, q.block_size,
                                                  tokens if raw is None else raw, lora_key, q.cache_salt or None)
                    if got is None:
                        _, rows = ix.match_rows(tokens, lora_key, q.cache_salt or None)
                except RouterKeyError as exc:
                    raise ApiError(422, "bad_field", str(exc), "$") from None
            if got is not None:
                core.metrics.routed("query", time.perf_counter() - t0, got[2])
                return got[1]
            self._merge_rows(result, rows, q.block_size, q.instance_id)
        return self._answer("query", t0, q.tenant_id, result)

    def query_by_hash(self, body: bytes) -> bytes:
        """``POST /query_by_hash``: prefix hits of rolling sequence hashes per instance;
        ``longest_matched = block_size * matched hashes``."""
        t0 = time.perf_counter()
        _check_items(body, self.core.config.max_prompt_tokens, "seq_hashes")  # one token per hash at least
        q, packed, raw = _decode_split(_QHASH, body, "seq_hashes", 8, ("seq_hashes", "block_hash"))
        self._check_lora(q.lora_name, q.lora_id)
        hashes: list[int] | None
        if packed is not None:
            count = len(packed)
            hashes = None
            # The array read is seq_hashes' (the serde route, or the flat one's only array)
            # or, when the body has no seq_hashes, block_hash's: the decode below's choice.
            field = "seq_hashes" if q.seq_hashes is not None else "block_hash"
        else:
            hashes = q.seq_hashes if q.seq_hashes is not None else q.block_hash
            if hashes is None:
                raise ApiError(422, "bad_field", "give seq_hashes (rolling sequence hashes, in prefix order)",
                               "$.seq_hashes")
            count = len(hashes)
            field = "seq_hashes" if q.seq_hashes is not None else "block_hash"
        if count * q.block_size > self.core.config.max_prompt_tokens:
            raise ApiError(413, "too_large", f"{count} hashes of {q.block_size} tokens are over the limit of "
                           f"{self.core.config.max_prompt_tokens} tokens (--max-prompt-tokens)", f"$.{field}")
        if hashes and max(hashes) > 0xFFFF_FFFF_FFFF_FFFF:  # max(): C speed; the loop only names the first
            i, h = next((i, h) for i, h in enumerate(hashes) if h > 0xFFFF_FFFF_FFFF_FFFF)
            raise ApiError(422, "bad_field", f"{field}[{i}] is {h}, not an unsigned 64-bit hash",
                           f"$.{field}[{i}]")
        self._instances(q.tenant_id, q.instance_id)
        core = self.core
        result: dict[str, dict[str, Any]] = {}
        targets = self._targets(q.model, q.tenant_id, q.block_size, q.lora_name or "", q.cache_salt or "")
        for ixname in targets:
            ix = core.indexes[ixname]
            if isinstance(ix, EngineKeyIndex):
                keys = hashes if hashes is not None else raw
                if len(targets) == 1 and q.instance_id is None:
                    got = self._native_answer(ixname, ix, q.tenant_id, q.block_size, (), keys=keys)
                    if got is not None:
                        core.metrics.routed("query_by_hash", time.perf_counter() - t0, got[2])
                        return got[1]
                _, rows = ix.match_rows((), keys=keys)
                self._merge_rows(result, rows, q.block_size, q.instance_id)
            else:
                # A token-keyed index knows engine hashes per source but not per medium.
                if hashes is None:
                    assert packed is not None
                    hashes = packed.tolist()
                blocks = ix.match_engine_hashes(hashes)
                self._merge_longest(result, blocks, q.block_size, q.instance_id)
        return self._answer("query_by_hash", t0, q.tenant_id, result)

    @staticmethod
    def _check_lora(name: str | None, lora_id: int | None) -> None:
        if name and lora_id is not None:
            raise ApiError(422, "bad_field", "give lora_name or the deprecated lora_id, not both", "$.lora_id")

    def _row(self, result: dict[str, dict[str, Any]], source: str, only: str | None) -> tuple[dict[str, Any], str] | None:
        e = self.core.engines.get(source)
        if e is None:
            return None
        inst = e.meta.get("instance_id", source)
        if only is not None and inst != only:
            return None
        row = result.get(inst)
        if row is None:
            row = result[inst] = {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {}}
        return row, str(e.meta.get("dp_rank", 0))

    def _merge_rows(self, result: dict[str, dict[str, Any]], rows: list[tuple[str, int, dict[str, int]]], B: int,
                    only: str | None) -> None:
        # Instances with no cached prefix are left out (as Dynamo does): absent means 0.
        # ``rows`` (KVIndex.match_rows) hold only the sources with a prefix.
        engines = self.core.engines
        for source, nb, tiers in rows:
            e = engines.get(source)
            if e is None:
                continue
            meta = e.meta
            inst = meta.get("instance_id", source)
            if only is not None and inst != only:
                continue
            tokens = nb * B
            dpr = meta.get("dp_rank", 0)  # an int (the registration's Rank)
            rank = "0" if dpr == 0 else str(dpr)
            row = result.get(inst)
            if row is None:
                row = result[inst] = {"longest_matched": tokens, "GPU": 0, "CPU": 0, "DISK": 0,
                                      "DP": {rank: tokens}}
                for med, n in tiers.items():  # a new row holds 0 in every medium
                    row[med] = n * B
                continue
            else:
                if tokens > row["longest_matched"]:
                    row["longest_matched"] = tokens
                dp = row["DP"]
                if tokens > dp.get(rank, 0):
                    dp[rank] = tokens
            for med, n in tiers.items():
                if n * B > (row.get(med) or 0):
                    row[med] = n * B

    def _native_answer(self, ixname: str, ix: Any, tenant: str, B: int, tokens: Any, lora: Any = None,
                       salt: str | None = None, *, keys: Any = None) -> tuple[int, bytes, int] | None:
        """The whole answer of one index (every instance) written natively from its walk
        (``KVIndex.match_answer``): byte for byte what :meth:`_merge_rows` of the same rows
        and :meth:`_answer`'s encoder give, without a tuple, a dict or an int object per
        row. None where the index cannot walk natively or holds a medium the answer has no
        column for (take :meth:`_merge_rows` then)."""
        head = b"{" + ENCODER.encode(tenant) + b":{"
        return ix.match_answer(tokens, lora, salt, keys=keys, labels=self._row_labels(ixname, ix),
                               columns=_COLUMNS, block_tokens=B, head=head)

    def _row_labels(self, ixname: str, ix: Any) -> RowLabels:
        """The answer's labels of ``ix``'s source slots (``KVIndex.slot_sources``): per slot
        whose source is a followed engine, the JSON of its instance's head and of its DP
        rank, and a number per instance (its ranks' rows merge). Made again only when a
        slot or an engine changed."""
        gen = (ix.slot_gen, self.core.engines_gen)
        got = self._slot_labels.get(ixname)
        if got is not None and got[0] is ix and got[1] == gen:
            return got[2]
        engines = self.core.engines
        number: dict[str, int] = {}
        slots: list[tuple[bytes, bytes, int] | None] = []
        for name in ix.slot_sources():
            e = engines.get(name) if name is not None else None
            if e is None:
                slots.append(None)
                continue
            inst = e.meta.get("instance_id", name)
            rank = str(e.meta.get("dp_rank", 0))  # an int (the registration's Rank)
            slots.append((ENCODER.encode(inst) + b':{"longest_matched":', ENCODER.encode(rank),
                          number.setdefault(inst, len(number))))
        labels = RowLabels(slots)
        if len(self._slot_labels) > len(self.core.indexes) + 16:  # of indexes gone
            self._slot_labels = {n: v for n, v in self._slot_labels.items() if self.core.indexes.get(n) is v[0]}
        self._slot_labels[ixname] = (ix, gen, labels)
        return labels

    def _merge_longest(self, result: dict[str, dict[str, Any]], blocks: dict[str, int], B: int,
                       only: str | None) -> None:
        for source, n in blocks.items():
            if not n:
                continue
            got = self._row(result, source, only)
            if got is None:
                continue
            row, rank = got
            tokens = n * B
            row["longest_matched"] = max(row["longest_matched"], tokens)
            row["DP"][rank] = max(row["DP"].get(rank, 0), tokens)
            try:
                held = [k for k, v in self.core.indexes[self.core.engines[source].index].source_info(source)
                        .blocks.items() if v]
            except Exception:  # noqa: BLE001
                held = []
            if len(held) == 1:
                # Every block of this source is in one medium: its prefix there is the prefix.
                row[held[0]] = max(row.get(held[0]) or 0, tokens)
            elif len(held) > 1:
                for med in held:
                    row[med] = None  # not known per medium for a token-keyed index

    def _answer(self, api: str, t0: float, tenant: str, result: dict[str, dict[str, Any]]) -> bytes:
        best = max((r["longest_matched"] for r in result.values()), default=0)
        out = ENCODER.encode({tenant: result})
        self.core.metrics.routed(api, time.perf_counter() - t0, best)
        return out
