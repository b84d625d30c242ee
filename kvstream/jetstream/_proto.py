"""The few NATS client-protocol operations a consumer's data path needs (sans-IO).

nats-py costs a consumer more per message than decoding and indexing the batch together
(a parse, a header dict through a generic parser, a ``Msg`` object, a queue and a task
switch per message). The JetStream consumer therefore reads its deliveries on a connection
of its own with this parser, and keeps nats-py for everything else (creating consumers,
streams, the object store). Only what a subscriber receives is parsed: ``MSG``, ``HMSG``,
``PING``, ``PONG``, ``+OK``, ``-ERR`` and ``INFO``; the only things sent are ``CONNECT``,
``PING``, ``PONG``, ``SUB``, an empty ``PUB`` (a flow-control reply) and, for the relay,
``HPUB`` (a message with headers and a reply subject for its ack).
Protocol reference: the NATS client protocol (docs.nats.io, "Client Protocol").
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from kvstream.jetstream.errors import RemoteProtocolError

__all__ = ["ProtocolReader", "NatsProtocolError", "connect_op", "sub_op", "pub_op", "hpub_op", "parse_headers",
           "MAX_CONTROL_LINE"]

MAX_CONTROL_LINE = 4096
"""Bytes of a control line (``HMSG subject sid reply hlen len``) before it is an error."""

Handler = Callable[[str, str, bytes | None, bytes], None]
FastHandler = Callable[[list["re.Match[bytes]"], list[bytes]], None]


class NatsProtocolError(RemoteProtocolError):
    """The server sent something this reader cannot parse, or an ``-ERR``."""


def parse_headers(block: bytes) -> dict[str, str]:
    """``NATS/1.0[ STATUS[ DESCRIPTION]]\\r\\nName: Value\\r\\n...`` -> dict; an inline
    status becomes ``Status`` (and ``Description``), as nats-py reports it."""
    lines = block.decode("utf-8", "replace").split("\r\n")
    out: dict[str, str] = {}
    first = lines[0]
    if len(first) > 8:  # "NATS/1.0 100 Idle Heartbeat"
        parts = first[9:].split(" ", 1)
        out["Status"] = parts[0]
        if len(parts) > 1:
            out["Description"] = parts[1]
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip()] = value.strip()
    return out


def hpub_op(subject: str, reply: str, headers: dict[str, str], payload: bytes) -> bytes:
    """``HPUB subject reply hlen total`` with ``headers`` (names and values must hold no
    CR/LF: the wire module only writes tokens, numbers and escaped text) and ``payload``."""
    hdr = ("NATS/1.0\r\n" + "".join([f"{k}: {v}\r\n" for k, v in headers.items()]) + "\r\n").encode()
    n = len(hdr)
    return b"".join((f"HPUB {subject} {reply} {n} {n + len(payload)}\r\n".encode(), hdr, payload, b"\r\n"))


def connect_op(name: str, user: str | None = None, password: str | None = None) -> bytes:
    """``CONNECT {...}\\r\\n`` for a subscriber that understands headers."""
    opts: dict[str, Any] = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True,
                            "lang": "python-kvstream", "version": "1", "protocol": 1, "name": name}
    if user is not None:
        opts["user"] = user
        opts["pass"] = password or ""
    return b"CONNECT " + json.dumps(opts, separators=(",", ":")).encode() + b"\r\n"


def sub_op(subject: str, sid: int) -> bytes:
    """``SUB subject sid``."""
    return f"SUB {subject} {sid}\r\n".encode()


def pub_op(subject: str, payload: bytes = b"") -> bytes:
    """``PUB subject len`` with ``payload``."""
    return f"PUB {subject} {len(payload)}\r\n".encode() + payload + b"\r\n"


class ProtocolReader:
    """Feed it bytes; it calls ``on_msg(subject, reply, headers_block | None, payload)`` for
    each message and collects what must be answered (``PONG`` for ``PING``) in
    :attr:`outgoing`. ``info`` is the last ``INFO`` object; ``pongs`` counts ``PONG`` s.
    Raises :class:`NatsProtocolError` on an ``-ERR`` or an unparseable line.

    ``fast``: an optional ``(pattern, handler)`` for the one message shape a hot path
    receives by the thousand. ``pattern`` must match a whole ``HMSG`` control line and
    header block and capture the header length and the total length as groups 4 and 5 (as
    ``HMSG subject sid reply (hlen) (total)``); each message it matches is parsed in one
    regular-expression call, and every run of such messages in a :meth:`feed` goes to
    ``handler(matches, payloads)`` in one call (two lists, in order) instead of ``on_msg``,
    so that the handler can work on the run in bulk. Anything the pattern does not match
    (or a match whose header length disagrees) takes the general path, in order: the run
    before it is handed over first. :attr:`fast_hits` counts the messages that took the
    fast path."""

    __slots__ = ("_buf", "on_msg", "outgoing", "info", "pongs", "_fast", "_on_fast", "fast_hits")

    def __init__(self, on_msg: Handler, fast: tuple["re.Pattern[bytes]", FastHandler] | None = None) -> None:
        self._buf = b""
        self.on_msg = on_msg
        self.outgoing = bytearray()
        self.info: dict[str, Any] | None = None
        self.pongs = 0
        self._fast = fast[0].match if fast is not None else None
        self._on_fast = fast[1] if fast is not None else None
        self.fast_hits = 0

    def feed(self, data: bytes) -> None:
        """Parse ``data`` (any split of the stream)."""
        buf = self._buf + data if self._buf else data
        pos = 0
        end = len(buf)
        on_msg = self.on_msg
        find = buf.find
        fast = self._fast
        on_fast = self._on_fast
        hits = 0
        run: list[re.Match[bytes]] = []
        pays: list[bytes] = []
        try:
            while pos < end:
                c = buf[pos]
                if c == 72 and fast is not None:
                    m = fast(buf, pos)
                    if m is not None:
                        e = m.end()
                        hstart = m.end(5) + 2
                        stop = hstart + int(m[5])
                        if e - hstart == int(m[4]) and stop + 2 <= end:
                            run.append(m)
                            pays.append(buf[e:stop])
                            pos = stop + 2
                            continue
                if run:  # hand the run over before anything that follows it
                    hits += len(run)
                    on_fast(run, pays)  # type: ignore[misc]
                    run = []
                    pays = []
                eol = find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > MAX_CONTROL_LINE:
                        raise NatsProtocolError(
                            f"control line longer than {MAX_CONTROL_LINE} bytes: {buf[pos:pos + 80]!r}")
                    break
                if (c == 72 and buf.startswith(b"HMSG ", pos)) or (c == 77 and buf.startswith(b"MSG ", pos)):
                    parts = buf[pos:eol].split(b" ")
                    try:
                        if c == 72:  # HMSG subject sid [reply] hlen total
                            total = int(parts[-1])
                            hlen = int(parts[-2])
                            reply = parts[3] if len(parts) == 6 else b""
                        else:  # MSG subject sid [reply] len
                            total = int(parts[-1])
                            hlen = 0
                            reply = parts[3] if len(parts) == 5 else b""
                    except (ValueError, IndexError):
                        raise NatsProtocolError(f"bad message line {buf[pos:eol][:200]!r}") from None
                    start = eol + 2
                    stop = start + total
                    if stop + 2 > end:
                        break  # the rest of this message has not arrived
                    if hlen:
                        on_msg(parts[1].decode(), reply.decode(), buf[start:start + hlen], buf[start + hlen:stop])
                    else:
                        on_msg(parts[1].decode(), reply.decode(), None, buf[start:stop])
                    pos = stop + 2
                    continue
                line = buf[pos:eol]
                pos = eol + 2
                if line == b"PING":
                    self.outgoing += b"PONG\r\n"
                elif line == b"PONG":
                    self.pongs += 1
                elif line == b"+OK":
                    pass
                elif line.startswith(b"INFO "):
                    try:
                        self.info = json.loads(line[5:])
                    except ValueError:
                        raise NatsProtocolError(f"bad INFO {line[:200]!r}") from None
                elif line.startswith(b"-ERR"):
                    raise NatsProtocolError(f"server error: {line[5:].decode('utf-8', 'replace').strip()}")
                else:
                    raise NatsProtocolError(f"unexpected line from the server: {line[:200]!r}")
            if run:
                hits += len(run)
                on_fast(run, pays)  # type: ignore[misc]
        finally:
            self.fast_hits += hits
        self._buf = buf[pos:] if pos < end else b""
