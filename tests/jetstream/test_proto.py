"""The consumer's NATS protocol reader, fed every split of a real byte sequence."""

from __future__ import annotations

import pytest

from kvstream.jetstream._proto import NatsProtocolError, ProtocolReader, parse_headers


def _hmsg(subject: bytes, reply: bytes, hdr: bytes, payload: bytes) -> bytes:
    return b"HMSG %s 1 %s %d %d\r\n%s%s\r\n" % (subject, reply, len(hdr), len(hdr) + len(payload), hdr, payload)


STREAM = (b"INFO {\"server_id\":\"x\",\"headers\":true}\r\n"
          b"MSG a.b 1 5\r\nhello\r\n"
          b"PING\r\n"
          + _hmsg(b"kv.e0", b"$JS.ACK.S.C.1.7.1.0.0", b"NATS/1.0\r\nKv-Seq: 3\r\n\r\n", b"data")
          + _hmsg(b"_INBOX.x", b"$JS.FC.S.C.1", b"NATS/1.0 100 FlowControl Request\r\n\r\n", b"")
          + b"+OK\r\nPONG\r\n")


def _run(chunks: list[bytes]) -> tuple[list, ProtocolReader]:
    got: list = []
    r = ProtocolReader(lambda s, rep, h, p: got.append((s, rep, h and parse_headers(h), bytes(p))))
    for c in chunks:
        r.feed(c)
    return got, r


def test_every_split_of_the_stream_parses_the_same() -> None:
    whole, r = _run([STREAM])
    assert whole == [
        ("a.b", "", None, b"hello"),
        ("kv.e0", "$JS.ACK.S.C.1.7.1.0.0", {"Kv-Seq": "3"}, b"data"),
        ("_INBOX.x", "$JS.FC.S.C.1", {"Status": "100", "Description": "FlowControl Request"}, b""),
    ]
    assert r.outgoing == b"PONG\r\n" and r.pongs == 1 and r.info == {"server_id": "x", "headers": True}
    for i in range(1, len(STREAM)):
        assert _run([STREAM[:i], STREAM[i:]])[0] == whole
    assert _run([bytes([b]) for b in STREAM])[0] == whole


def test_server_errors_and_garbage_raise_remote_protocol_errors() -> None:
    with pytest.raises(NatsProtocolError, match="Authorization"):
        _run([b"-ERR 'Authorization Violation'\r\n"])
    with pytest.raises(NatsProtocolError, match="unexpected"):
        _run([b"HELLO\r\n"])
    with pytest.raises(NatsProtocolError, match="bad message line"):
        _run([b"MSG a 1 x\r\n"])
