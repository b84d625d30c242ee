"""Where the stream lives: ``nats://`` source URLs and the stream's settings (one source
of truth for the relay, the consumers and the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from kvstream.jetstream.errors import JetStreamConfigError

__all__ = ["StreamSettings", "NatsSource", "parse_nats_url", "is_nats_url",
           "DEFAULT_STREAM", "DEFAULT_SUBJECT_PREFIX"]

DEFAULT_STREAM = "KV_EVENTS"
DEFAULT_SUBJECT_PREFIX = "kv"
URL_SYNTAX = "nats://HOST:PORT[/STREAM][?source=NAME&...&prefix=PREFIX]"


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """The JetStream stream that holds KV events.

    ``name``: the stream; ``subject_prefix``: messages go to ``<prefix>.<source>``;
    ``storage``: ``"file"`` (survives a server restart) or ``"memory"``; ``max_age_s``
    (seconds) and ``max_bytes`` (bytes, -1: no limit): retention, oldest dropped first;
    ``replicas``: copies in a NATS cluster (1, 3 or 5); ``duplicate_window_s`` (seconds):
    how long JetStream remembers message ids to drop a second relay's copy.
    """

    name: str = DEFAULT_STREAM
    subject_prefix: str = DEFAULT_SUBJECT_PREFIX
    storage: str = "file"
    max_age_s: float = 24 * 3600.0
    max_bytes: int = 8 << 30
    replicas: int = 1
    duplicate_window_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in " .*>/\\\t"):
            raise JetStreamConfigError(f"bad stream name {self.name!r}: use letters, digits, - and _ (e.g. KV_EVENTS)")
        if not self.subject_prefix or any(c in self.subject_prefix for c in " *>") or \
                self.subject_prefix.startswith(".") or self.subject_prefix.endswith("."):
            raise JetStreamConfigError(f"bad subject prefix {self.subject_prefix!r}: use dot-separated tokens "
                                       "without wildcards (e.g. kv or fleet.kv)")
        if self.storage not in ("file", "memory"):
            raise JetStreamConfigError(f"storage must be 'file' or 'memory', got {self.storage!r}")
        if self.replicas not in (1, 2, 3, 4, 5):
            raise JetStreamConfigError(f"replicas must be 1..5 (3 for a 3-node cluster), got {self.replicas}")
        if self.max_age_s < 0 or self.duplicate_window_s <= 0:
            raise JetStreamConfigError("max_age_s must be >= 0 (0: no limit) and duplicate_window_s > 0")

    @property
    def subjects(self) -> str:
        """The stream's subject filter, ``<prefix>.>``."""
        return f"{self.subject_prefix}.>"


@dataclass(frozen=True, slots=True)
class NatsSource:
    """A parsed ``nats://`` source: server ``url`` (``nats://HOST:PORT``), ``stream``,
    ``subject_prefix`` and the ``sources`` to follow (empty: all)."""

    url: str
    stream: str = DEFAULT_STREAM
    subject_prefix: str = DEFAULT_SUBJECT_PREFIX
    sources: tuple[str, ...] = field(default=())


def is_nats_url(text: str) -> bool:
    """True for ``nats://...`` (and ``tls://``-less forms are not accepted)."""
    return text.startswith("nats://")


def parse_nats_url(text: str) -> NatsSource:
    """Parse ``nats://HOST:PORT[/STREAM][?source=NAME&prefix=PREFIX]``; raises
    :class:`JetStreamConfigError` with the accepted syntax."""
    if not is_nats_url(text):
        raise JetStreamConfigError(f"{text!r} is not a nats:// URL; expected {URL_SYNTAX}")
    parts = urlsplit(text)
    if not parts.hostname:
        raise JetStreamConfigError(f"no host in {text!r}; expected {URL_SYNTAX}")
    try:
        port = parts.port or 4222
    except ValueError:
        raise JetStreamConfigError(f"bad port in {text!r}; expected {URL_SYNTAX}") from None
    stream = parts.path.strip("/") or DEFAULT_STREAM
    if "/" in stream:
        raise JetStreamConfigError(f"{text!r}: the path is one stream name; expected {URL_SYNTAX}")
    q = parse_qs(parts.query, keep_blank_values=True)
    unknown = set(q) - {"source", "prefix"}
    if unknown:
        raise JetStreamConfigError(f"unknown option(s) {sorted(unknown)} in {text!r}; expected {URL_SYNTAX}")
    prefix = q.get("prefix", [DEFAULT_SUBJECT_PREFIX])[-1]
    sources = tuple(s for s in q.get("source", []) if s)
    netloc = parts.netloc.rsplit("@", 1)
    auth = netloc[0] + "@" if len(netloc) == 2 else ""
    StreamSettings(name=stream, subject_prefix=prefix)  # validates both
    return NatsSource(f"nats://{auth}{parts.hostname}:{port}", stream, prefix, sources)
