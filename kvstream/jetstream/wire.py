"""How kvstream's stream items sit in a JetStream stream (sans-IO: bytes and dicts only).

One NATS message per item, on subject ``<prefix>.<source token>``:

* a **batch**: payload = the engine's msgpack bytes, unchanged; headers ``Kv-Seq`` (the
  engine's seq), ``Kv-Instance`` (which incarnation of the engine, see below),
  ``Kv-Topic`` (the ZMQ topic frame, percent-encoded) and ``Nats-Msg-Id`` =
  ``source:instance:seq``, so JetStream's de-duplication keeps one copy when two relays
  follow one engine. Batches of a snapshot reply carry ``Kv-Kind: snapshot`` and the id
  ``source:instance:snapshot:R:i`` (they all share one seq).
* a **control** message (``Kv-Kind`` ``reset``, ``stale`` or ``live``): payload = a small
  JSON object with the item's fields; id ``source:instance:kind:...`` (see
  :func:`control_msg_id`).

Every control message carries ``Kv-Pos``: the last engine seq the consumer's state
reflects after applying it (``-1``: none yet in this instance; for a batch it is its
``Kv-Seq``), ``Kv-Ts``, the engine timestamp of the instance's last batch, and, when the
batch at ``Kv-Pos`` is known, ``Kv-Last-Digest`` (:func:`payload_digest` of it). A relay reads the last message of a
source's subject at start-up to learn where the stream stands (:class:`StreamPosition`).
``Kv-Instance`` starts at 0 and goes up by one at each engine restart the relays see.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import unquote_to_bytes

from kvstream.jetstream.errors import RemoteProtocolError
from kvstream.transport.items import SourceLive, SourceReset, SourceStale

__all__ = [
    "H_SEQ", "H_INSTANCE", "H_TOPIC", "H_KIND", "H_POS", "H_MSG_ID", "H_REPLAYED", "H_TS", "H_LAST", "payload_digest",
    "subject_token", "source_from_token", "batch_headers", "message_size", "control_message", "decode_control",
    "StreamPosition", "position_from_headers", "WireError", "status_subject", "blocked_notice",
    "decode_blocked_notice",
]

H_SEQ = "Kv-Seq"
H_INSTANCE = "Kv-Instance"
H_TOPIC = "Kv-Topic"
H_KIND = "Kv-Kind"
H_POS = "Kv-Pos"
H_REPLAYED = "Kv-Replayed"
H_TS = "Kv-Ts"
H_MSG_ID = "Nats-Msg-Id"
H_LAST = "Kv-Last-Digest"

KIND_SNAPSHOT = "snapshot"
CONTROL_KINDS = ("reset", "stale", "live")

# Characters a NATS subject token cannot hold (separator, wildcards, whitespace) and the
# escape character itself are percent-encoded; everything else is kept readable.
_TOKEN_CHARS = [chr(c) if 33 <= c < 127 and chr(c) not in ".*>%" else f"%{c:02X}" for c in range(256)]
_TOPIC_CHARS = [chr(c) if 32 <= c < 127 and chr(c) != "%" else f"%{c:02X}" for c in range(256)]


class WireError(RemoteProtocolError, ValueError):
    """A message on the stream does not follow this layout (missing or bad header)."""


def status_subject(stream: str) -> str:
    """The core NATS subject (outside the stream) on which relays say they cannot publish
    into ``stream``: consumers of the stream listen there, because a stream that refuses
    messages (full, ``discard=new``) cannot carry the news itself."""
    return f"_kvstream.status.{stream}"


def blocked_notice(relay: str, stream: str, blocked: Mapping[str, int], error: str) -> bytes:
    """A relay's status notice: the ``blocked`` sources (name -> first seq that did not
    reach the stream) and the stream's refusal."""
    return json.dumps({"relay": relay, "stream": stream, "blocked": dict(blocked),
                       "error": error[:300]}).encode()


def decode_blocked_notice(payload: bytes) -> tuple[dict[str, int], str]:
    """``(blocked sources, error)`` of a status notice; :class:`WireError` if malformed."""
    try:
        d = json.loads(payload)
        blocked = {str(k): int(v) for k, v in d["blocked"].items()}
        return blocked, str(d.get("error", ""))[:300]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WireError(f"malformed relay status notice: {exc}") from None


def subject_token(source: str) -> str:
    """The subject token for ``source`` (reversible: :func:`source_from_token`)."""
    if not source:
        raise ValueError("a source name must not be empty")
    t = _TOKEN_CHARS
    return "".join([t[c] for c in source.encode("utf-8")])


def source_from_token(token: str) -> str:
    """The source name a subject token stands for."""
    return unquote_to_bytes(token).decode("utf-8", "replace")


def encode_topic(topic: bytes) -> str:
    """A ZMQ topic frame as a header value."""
    t = _TOPIC_CHARS
    return "".join([t[c] for c in topic])


def decode_topic(value: str) -> bytes:
    """The inverse of :func:`encode_topic`."""
    return unquote_to_bytes(value)


def batch_headers(source: str, instance: int, seq: int, topic_header: str, *, replayed: bool = False,
                  snapshot: tuple[int, int] | None = None) -> dict[str, str]:
    """Headers of one batch message. ``snapshot``: (R, index within the snapshot) for the
    batches of a snapshot reply (their seq is R - 1)."""
    s = str(seq)
    h = {H_MSG_ID: f"{source}:{instance}:{s}", H_SEQ: s, H_INSTANCE: str(instance), H_TOPIC: topic_header}
    if replayed:
        h[H_REPLAYED] = "1"
    if snapshot is not None:
        h[H_KIND] = KIND_SNAPSHOT
        h[H_MSG_ID] = f"{source}:{instance}:snapshot:{snapshot[0]}:{snapshot[1]}"
    return h


def payload_digest(payload: bytes) -> str:
    """A short digest of a batch's payload (BLAKE2b, 16 bytes, hex): what a control
    message's ``Kv-Last-Digest`` says of the batch at its ``Kv-Pos``."""
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def message_size(payload: bytes, headers: Mapping[str, str]) -> int:
    """Bytes a message with ``headers`` and ``payload`` counts against the server's
    ``max_payload`` (the NATS/1.0 header block plus the payload)."""
    return 12 + sum(len(k) + len(v) + 4 for k, v in headers.items()) + len(payload)


def control_msg_id(source: str, instance: int, item: SourceReset | SourceStale | SourceLive) -> str:
    """The de-duplication id of a control message: equal for the same notice from two
    relays following one engine."""
    if type(item) is SourceReset:
        return f"{source}:{instance}:reset:{item.reason}:{item.seq}"
    if type(item) is SourceStale:
        return f"{source}:{instance}:stale:{item.first_missing_seq}:{item.resume_seq}"
    return f"{source}:{instance}:live:{item.seq}"  # type: ignore[union-attr]


def control_message(source: str, instance: int, item: SourceReset | SourceStale | SourceLive,
                    pos: int) -> tuple[bytes, dict[str, str]]:
    """(payload, headers) of a control message for ``item``; ``pos`` as in ``Kv-Pos``."""
    if type(item) is SourceReset:
        body: dict[str, Any] = {"kind": "reset", "reason": item.reason, "seq": item.seq}
    elif type(item) is SourceStale:
        body = {"kind": "stale", "reason": item.reason, "first_missing_seq": item.first_missing_seq,
                "resume_seq": item.resume_seq}
    elif type(item) is SourceLive:
        body = {"kind": "live", "seq": item.seq}
    else:
        raise TypeError(f"not a control item: {item!r:.80}")
    headers = {H_MSG_ID: control_msg_id(source, instance, item), H_KIND: body["kind"],
               H_INSTANCE: str(instance), H_POS: str(pos)}
    return json.dumps(body, separators=(",", ":")).encode(), headers


def decode_control(source: str, payload: bytes) -> SourceReset | SourceStale | SourceLive:
    """The item a control message's payload describes. Raises :class:`WireError`."""
    try:
        d = json.loads(payload)
        kind = d["kind"]
        if kind == "reset":
            seq = d["seq"]
            return SourceReset(source, str(d["reason"]), None if seq is None else int(seq))
        if kind == "stale":
            return SourceStale(source, str(d["reason"]), int(d["first_missing_seq"]), int(d["resume_seq"]))
        if kind == "live":
            return SourceLive(source, int(d["seq"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"bad control message for {source!r}: {exc} in {payload[:100]!r}") from None
    raise WireError(f"unknown control kind {kind!r} for {source!r}")


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """Where the stream stands for one source: its engine ``instance``, ``pos`` (the last
    engine seq reflected, -1: none), ``ts`` (seconds: the engine timestamp of the last
    batch, 0.0 for a control message) and ``digest``."""

    instance: int
    pos: int
    ts: float = 0.0
    digest: str | None = None
    """:func:`payload_digest` of the batch at ``pos`` (None: not known). A relay compares
    the engine's replay of that batch with it: equal bytes, the same engine."""


def position_from_headers(headers: Mapping[str, str] | None, ts: float = 0.0,
                          payload: bytes | None = None) -> StreamPosition:
    """Read ``Kv-Instance`` / ``Kv-Pos`` (a batch: ``Kv-Seq``) (raises :class:`WireError` when absent or bad)."""
    if not headers:
        raise WireError("message has no headers; is this stream written by `kvstream relay`?")
    try:
        pos = headers.get(H_POS)
        if pos is None and H_KIND not in headers:
            digest = payload_digest(payload) if payload is not None else None
        else:
            digest = headers.get(H_LAST)
        return StreamPosition(int(headers[H_INSTANCE]), int(pos if pos is not None else headers[H_SEQ]), ts, digest)
    except (KeyError, ValueError) as exc:
        raise WireError(f"message lacks a valid {H_INSTANCE}/{H_POS} header ({exc})") from None
