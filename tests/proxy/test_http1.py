"""The proxy's sans-IO HTTP/1.1 response reader: framing, byte-by-byte input, bad input."""

from __future__ import annotations

import pytest

from kvstream.errors import RemoteProtocolError
from kvstream.proxy._http1 import HTTPParseError, ResponseReader, request_bytes

CHUNKED = (b"HTTP/1.1 100 Continue\r\n\r\n"
           b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"F\r\ndata: {\"a\":1}\n\n\r\ne;ext=1\r\ndata: [DONE]\n\n\r\n0\r\nx-trailer: 1\r\n\r\n")


def _read(wire: bytes, step: int, no_body: bool = False) -> tuple[ResponseReader, bytes]:
    r = ResponseReader()
    r.no_body = no_body
    body = b""
    pos = 0
    got_head = False
    while not r.done:
        if not got_head:
            got_head = r.head()
            if got_head:
                continue
        else:
            data = r.body()
            if data is not None:
                body += data
                continue
        r.feed(wire[pos:pos + step])
        pos += step
    return r, body


@pytest.mark.parametrize("step", [1, 3, 7, 4096])
def test_chunked_bodies_come_out_whole_however_the_bytes_arrive(step: int) -> None:
    r, body = _read(CHUNKED, step)
    assert r.status == 200 and (b"content-type", b"text/event-stream") in r.headers
    assert body == b'data: {"a":1}\n\ndata: [DONE]\n\n'
    assert r.keep_alive and r.pending == 0


def test_content_length_then_the_next_response_on_the_same_connection() -> None:
    r = ResponseReader()
    r.feed(b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\nnoHTTP/1.1 204 No Content\r\n\r\n")
    assert r.head() and r.status == 404 and r.body() == b"no" and r.done
    r.reset()
    assert r.head() and r.status == 204 and r.done and r.body() == b""


def test_a_body_until_close_and_connection_close_are_not_kept_alive() -> None:
    r, body = _read(b"HTTP/1.1 200 OK\r\n\r\nabc", 2)
    assert body == b"abc" and not r.keep_alive
    r, body = _read(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx", 64)
    assert body == b"x" and not r.keep_alive
    r, body = _read(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx", 64)
    assert not r.keep_alive


def test_a_head_request_has_no_body() -> None:
    r, body = _read(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", 64, no_body=True)
    assert body == b"" and r.done


@pytest.mark.parametrize("wire", [
    b"HTTP/2 200 OK\r\n\r\n",
    b"HTTP/1.1 20x OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nxyz",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab",  # then the connection closes
    b"HTTP/1.1 200 O",  # closed mid-head
])
def test_bad_or_truncated_responses_are_typed_errors(wire: bytes) -> None:
    r = ResponseReader()
    r.feed(wire)
    r.feed(b"")
    with pytest.raises(HTTPParseError) as err:
        while not r.head():
            pass
        while r.body() is not None and not r.done:
            pass
    assert isinstance(err.value, RemoteProtocolError)


def test_an_oversized_head_is_refused() -> None:
    r = ResponseReader()
    r.feed(b"HTTP/1.1 200 OK\r\nx: " + b"a" * (2 << 20))
    with pytest.raises(HTTPParseError, match="head over"):
        r.head()


def test_request_bytes() -> None:
    assert request_bytes("POST", "/v1/x", [(b"host", b"h:1"), (b"content-length", b"2")], b"{}") == \
        b"POST /v1/x HTTP/1.1\r\nhost: h:1\r\ncontent-length: 2\r\n\r\n{}"
