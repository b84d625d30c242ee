"""KV events through NATS JetStream: relays publish engines' streams into a durable,
replicated log; any number of router replicas read it, starting anywhere.

* :class:`Relay` (``kvstream relay``): engines over ZMQ -> JetStream, payloads unchanged.
* :class:`JetStreamSource`: a consumer with the :class:`~kvstream.transport.Subscriber`
  interface; :func:`open_subscriber` picks it for ``nats://`` endpoints.
* :mod:`.wire`: how items sit on the stream; :mod:`.tracking`: the sans-IO state machines.

Needs the ``nats`` extra (``pip install kvstream[nats]``: the ``nats-py`` client).
"""

from __future__ import annotations

from typing import Any, Iterable

from kvstream.jetstream.config import NatsSource, StreamSettings, is_nats_url, parse_nats_url
from kvstream.jetstream.errors import JetStreamConfigError, StreamMismatchError
from kvstream.jetstream.tracking import RelaySource, SourceState, StreamSource

__all__ = [
    "Relay", "RelayStats", "JetStreamSource", "StreamSettings", "NatsSource", "parse_nats_url",
    "is_nats_url", "open_subscriber", "JetStreamConfigError", "StreamMismatchError", "RelaySource",
    "SourceState", "StreamSource",
]


def __getattr__(name: str) -> Any:
    # The shells import nats-py; keep `import kvstream.jetstream` cheap and optional.
    if name in ("Relay", "RelayStats"):
        from kvstream.jetstream import relay

        return getattr(relay, name)
    if name == "JetStreamSource":
        from kvstream.jetstream.source import JetStreamSource

        return JetStreamSource
    raise AttributeError(name)


def open_subscriber(endpoints: Iterable[Any], **options: Any) -> Any:
    """A :class:`~kvstream.transport.Subscriber` for ZMQ endpoints, or a
    :class:`JetStreamSource` when they are ``nats://`` URLs (one server and stream; several
    URLs add their ``?source=`` filters up). Mixing both kinds raises
    :class:`JetStreamConfigError`. ``options`` go to the chosen class (ZMQ-only options such
    as ``replay_timeout_s`` are ignored for JetStream)."""
    from kvstream.transport.subscriber import SourceSpec, Subscriber

    specs = [SourceSpec(e) if isinstance(e, str) else e for e in endpoints]
    nats_specs = [s for s in specs if is_nats_url(s.endpoint)]
    if not nats_specs:
        return Subscriber(specs, **options)
    if len(nats_specs) != len(specs):
        raise JetStreamConfigError("mix of nats:// and ZMQ endpoints: run `kvstream relay` for the ZMQ "
                                   "engines and read everything from JetStream")
    parsed = [parse_nats_url(s.endpoint) for s in nats_specs]
    # NAME=nats://... names one source of the stream (as `kvstream serve` engines do).
    parsed = [p if not s.name or p.sources else NatsSource(p.url, p.stream, p.subject_prefix, (s.name,))
              for p, s in zip(parsed, nats_specs)]
    first = parsed[0]
    for p in parsed[1:]:
        if (p.url, p.stream, p.subject_prefix) != (first.url, first.stream, first.subject_prefix):
            raise JetStreamConfigError(f"one JetStream source per consumer: {p.url}/{p.stream} differs from "
                                       f"{first.url}/{first.stream}")
    names = [n for p in parsed for n in p.sources]
    if any(not p.sources for p in parsed):
        names = []  # one URL without a filter follows everything
    from kvstream.jetstream.source import JetStreamSource

    keep = {k: v for k, v in options.items() if k in ("max_buffered_items", "unknown_events", "max_payload_bytes",
                                                       "curve", "state", "start_sseq", "heartbeat_s")}
    return JetStreamSource(NatsSource(first.url, first.stream, first.subject_prefix, tuple(names)), **keep)
