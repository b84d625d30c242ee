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


def test_the_relays_batch_layout_takes_the_fast_path_in_order_at_every_split() -> None:
    from kvstream.jetstream import wire
    from kvstream.jetstream.source import _BATCH_DELIVERY

    def hdr(**kw: object) -> bytes:
        h = wire.batch_headers("e.0", 2, 41, wire.encode_topic(b"kv@e0"), **kw)  # type: ignore[arg-type]
        return ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode()

    reply = b"$JS.ACK.KV_EVENTS.c0nsumer.1.%d.%d.1733000000000000000.0"
    stream = (_hmsg(b"kv.e%2E0", reply % (7, 1), hdr(), b"\x93payload")
              + b"PING\r\n"
              + _hmsg(b"kv.e%2E0", reply % (8, 2), hdr(replayed=True), b"replayed")  # another layout
              + _hmsg(b"kv.e%2E0", reply % (9, 3), hdr(), b""))

    def run(chunks: list[bytes]) -> tuple[list, ProtocolReader]:
        got: list = []
        r = ProtocolReader(lambda s, rep, h, p: got.append(("general", s, bytes(p))),
                           (_BATCH_DELIVERY, lambda ms, ps: got.extend(("fast", m.groups(), bytes(p))
                                                                       for m, p in zip(ms, ps))))
        for c in chunks:
            r.feed(c)
        return got, r

    whole, r = run([stream])
    fast = (b"kv.e%2E0", b"7", b"1", b"80", b"88", b"41", b"2", b"kv@e0")
    assert whole[0] == ("fast", fast, b"\x93payload")
    assert whole[1] == ("general", "kv.e%2E0", b"replayed")
    assert whole[2][0] == "fast" and whole[2][1][1:3] == (b"9", b"3") and whole[2][2] == b""
    assert r.fast_hits == 2 and r.outgoing == b"PONG\r\n"
    for i in range(1, len(stream)):
        assert run([stream[:i], stream[i:]])[0] == whole
