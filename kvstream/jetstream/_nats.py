"""Shared nats-py plumbing: connecting, and creating or checking the stream."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from kvstream.jetstream.config import StreamSettings
from kvstream.jetstream.errors import JetStreamConfigError, StreamMismatchError

log = logging.getLogger("kvstream.jetstream")

__all__ = ["connect", "ensure_stream", "open_data_connection", "current_url"]


async def connect(servers: str | Sequence[str], *, name: str, pending_bytes: int = 64 << 20,
                  timeout_s: float = 10.0, **callbacks: Any) -> Any:
    """A nats-py connection that, once made, reconnects forever (every 0.1 s), and logs
    through ``kvstream.jetstream`` instead of printing. Raises
    :class:`JetStreamConfigError` when no server answers within ``timeout_s`` seconds."""
    import anyio
    import nats

    async def _error(exc: Exception) -> None:
        log.debug("nats: %s", exc)

    urls = [servers] if isinstance(servers, str) else list(servers)
    nc = _client_class()()
    try:
        with anyio.fail_after(timeout_s):
            # Subjects are built from escaped tokens (wire.subject_token): no need for
            # nats-py to validate each one again.
            await nc.connect(urls, name=name, error_cb=callbacks.pop("error_cb", _error),
                             reconnect_time_wait=0.1, max_reconnect_attempts=-1, skip_subject_validation=True,
                             connect_timeout=2, pending_size=pending_bytes, **callbacks)
            return nc
    except TimeoutError:
        raise JetStreamConfigError(f"no NATS server answered at {', '.join(urls)} within {timeout_s:g}s; "
                                   "is nats-server running (with -js) there?") from None


def _parse_header_lines(raw: bytes) -> dict[str, str]:
    """``Name: Value`` lines -> dict, without nats-py's per-character name check (a third
    of a consumer's time per message); names with inner whitespace are still dropped."""
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            key = name.strip().decode("ascii", "replace")
            if " " not in key and "\t" not in key:
                out[key] = value.strip().decode("utf-8", "replace")
    return out


_CLIENT: Any = None


def _client_class() -> Any:
    """nats-py's client with the faster header parser (when this nats-py parses headers
    through ``_parse_header_lines``; older ones keep their own)."""
    global _CLIENT
    if _CLIENT is None:
        from nats.aio.client import Client

        attrs = {"_parse_header_lines": staticmethod(_parse_header_lines)} if hasattr(Client, "_parse_header_lines") else {}
        _CLIENT = type("KVStreamNatsClient", (Client,), attrs)
    return _CLIENT


async def ensure_stream(js: Any, s: StreamSettings, *, update: bool = False) -> Any:
    """Create the stream ``s`` describes, or check the existing one: its subjects must
    cover ``<prefix>.>`` and its storage match (else :class:`StreamMismatchError`);
    retention and replicas are updated when ``update``, else differences are logged."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
    from nats.js.errors import NotFoundError

    cfg = StreamConfig(
        name=s.name, subjects=[s.subjects], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE if s.storage == "file" else StorageType.MEMORY,
        max_age=s.max_age_s or None, max_bytes=s.max_bytes, num_replicas=s.replicas,
        duplicate_window=s.duplicate_window_s, discard=DiscardPolicy.OLD,
        description="KV cache events relayed by kvstream",
    )
    try:
        info = await js.stream_info(s.name)
    except NotFoundError:
        return await js.add_stream(cfg)
    have = info.config
    if s.subjects not in (have.subjects or []) and ">" not in (have.subjects or []):
        raise StreamMismatchError(f"stream {s.name} exists with subjects {have.subjects}, which do not "
                                  f"cover {s.subjects}; pick another --stream or --subject-prefix")
    if str(getattr(have.storage, "value", have.storage) or "file") != s.storage:
        raise StreamMismatchError(f"stream {s.name} exists with {have.storage} storage, not {s.storage}; "
                                  "delete it or use another --stream")
    differs = [(k, a, b) for k, a, b in (
        ("replicas", have.num_replicas, s.replicas), ("max_bytes", have.max_bytes, s.max_bytes),
        ("max_age_s", have.max_age or 0.0, s.max_age_s),
        ("duplicate_window_s", have.duplicate_window, s.duplicate_window_s)) if a != b]
    if differs and update:
        cfg.subjects = have.subjects
        return await js.update_stream(cfg)
    for k, a, b in differs:
        log.warning("stream %s keeps %s=%s (asked for %s; pass update=True / --update-stream to change it)",
                    s.name, k, a, b)
    return info


def current_url(nc: Any, configured: str) -> str:
    """The URL of the server the nats-py client ``nc`` is connected to now (with the
    credentials of ``configured``), else ``configured``. In a cluster nats-py reconnects
    to servers it learned from the others, so a data connection made here follows it when
    the configured node is lost."""
    from urllib.parse import urlsplit

    cur = getattr(nc, "connected_url", None)
    if cur is None or not getattr(nc, "is_connected", False) or not cur.hostname:
        return configured
    netloc = urlsplit(configured).netloc.rsplit("@", 1)
    auth = netloc[0] + "@" if len(netloc) == 2 else ""
    return f"nats://{auth}{cur.hostname}:{cur.port or 4222}"


async def open_data_connection(url: str, name: str, reader: Any, subject: str, also: tuple[str, ...] = ()) -> Any:
    """A plain TCP connection to the server of ``url`` for a hot data path, subscribed to
    ``subject`` (sid 1) and the subjects in ``also`` (sids 2, 3, ...): INFO, CONNECT,
    PING/PONG, SUB, PING/PONG (so the server holds the subscription before anything is
    asked of it). ``reader`` is a
    :class:`~kvstream.jetstream._proto.ProtocolReader`. Raises ``OSError`` (a
    ``ConnectionError`` when the connection closes during the handshake), ``TimeoutError``
    or :class:`~kvstream.jetstream._proto.NatsProtocolError`."""
    from urllib.parse import urlsplit

    import anyio

    from kvstream.jetstream._proto import connect_op, sub_op

    parts = urlsplit(url)
    stream = await anyio.connect_tcp(parts.hostname or "127.0.0.1", parts.port or 4222)
    try:
        with anyio.fail_after(5):
            while reader.info is None:
                reader.feed(await stream.receive())
            await stream.send(connect_op(name, parts.username, parts.password) + b"PING\r\n")
            while reader.pongs < 1:
                reader.feed(await stream.receive())
            subs = b"".join(sub_op(s, i) for i, s in enumerate((subject, *also), 1))
            await stream.send(subs + b"PING\r\n")
            while reader.pongs < 2:
                reader.feed(await stream.receive())
    except (anyio.EndOfStream, anyio.BrokenResourceError) as exc:
        # Closed by the server (shutting down) or the network during the handshake: a
        # connection error like any other, for the callers' reconnect loops.
        await stream.aclose()
        raise ConnectionError(f"{url}: the connection closed during the NATS handshake") from exc
    except BaseException:
        await stream.aclose()
        raise
    return stream
