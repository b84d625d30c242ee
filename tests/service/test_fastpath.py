"""The fast path in front of uvicorn: well-formed routing POSTs answered on the connection,
everything else handed to uvicorn with every byte not yet answered (sans-IO framing first,
then a real `kvstream serve` over a raw socket)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from kvstream.service.fastpath import HANDOFF, MAX_HEAD_BYTES, frame_request

HOT = frozenset({b"/query", b"/v1/route"})


def _req(body: bytes = b'{"a":1}', path: bytes = b"/query", extra: bytes = b"", method: bytes = b"POST",
         version: bytes = b"HTTP/1.1", length: bool = True) -> bytes:
    head = b"%s %s %s\r\nHost: x\r\nContent-Type: application/json\r\n" % (method, path, version)
    if length:
        head += b"Content-Length: %d\r\n" % len(body)
    return head + extra + b"\r\n" + body


def test_a_complete_hot_post_is_framed_with_its_body_and_length() -> None:
    raw = _req(b'{"token_ids":[1,2]}')
    assert frame_request(raw, HOT, 1000) == (b"/query", b'{"token_ids":[1,2]}', len(raw), True)
    assert frame_request(_req(extra=b"Connection: close\r\n"), HOT, 1000)[3] is False


def test_pipelined_requests_are_framed_one_at_a_time_and_partial_ones_wait() -> None:
    a, b = _req(b"[1]"), _req(b"[2]", b"/v1/route")
    buf = bytearray(a + b)
    path, body, used, _ = frame_request(buf, HOT, 1000)
    assert (path, body) == (b"/query", b"[1]")
    del buf[:used]
    assert frame_request(buf, HOT, 1000)[:2] == (b"/v1/route", b"[2]")
    for cut in (5, len(a) - 1):  # inside the head, inside the body
        assert frame_request(a[:cut], HOT, 1000) is None


@pytest.mark.parametrize("raw", [
    _req(method=b"GET"),
    _req(path=b"/metrics"),
    _req(path=b"/query?x=1"),
    _req(version=b"HTTP/1.0"),
    _req(length=False),
    _req(extra=b"Transfer-Encoding: chunked\r\n"),
    _req(extra=b"Expect: 100-continue\r\n"),
    _req(extra=b"Connection: Upgrade\r\nUpgrade: h2c\r\n"),
    _req(extra=b"Content-Length: 7\r\n"),  # twice
    _req(extra=b"Bad Header: 1\r\n"),
    _req(extra=b" folded\r\n"),
    _req(extra=b"X-Bare: a\nb\r\n"),
    _req(extra=b"X-Nul: a\x00b\r\n"),  # control characters: uvicorn refuses them (400 bad_http)
    _req(extra=b"X-Ctl: a\x1fb\r\n"),
    _req(extra=b"X-Del: a\x7f\r\n"),
    _req(b"x" * 2000),  # over the limit: HotRoutes answers the 413
    b"POST /query HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    b"garbage\r\n\r\n",
])
def test_anything_unusual_is_handed_to_uvicorn(raw: bytes) -> None:
    assert frame_request(raw, HOT, 1000) is HANDOFF


def test_a_head_that_never_ends_is_handed_off_not_buffered() -> None:
    assert frame_request(b"POST /query HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES, HOT, 1000) is HANDOFF


def _responses(sock: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """``n`` HTTP/1.1 responses (status, body) read off ``sock`` (Content-Length bodies)."""
    buf = b""
    out = []
    sock.settimeout(20)
    while len(out) < n:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = buf[:end].decode("latin-1").split("\r\n")
            length = next(int(h.split(":", 1)[1]) for h in head[1:] if h.lower().startswith("content-length:"))
            if len(buf) >= end + 4 + length:
                out.append((int(head[0].split()[1]), buf[end + 4:end + 4 + length]))
                buf = buf[end + 4 + length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {len(out)} responses"
        buf += chunk
    return out


def test_one_connection_mixes_fast_answers_and_uvicorns_in_order(engines, serve) -> None:
    e0 = engines("e0")
    tokens = list(range(500, 500 + 4 * 16))
    seq = e0.admit(tokens, "r")
    s = serve(e0.arg, "--load-interval", "0")
    s.wait_applied("e0", seq)
    q = json.dumps({"model": "default", "token_ids": tokens, "block_size": 16}).encode()
    host, port = s.url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        # pipelined in one write: fast, fast (a 422), then a GET that hands the connection
        # over mid-buffer, then a /query uvicorn answers
        sock.sendall(_req(q) + _req(b'{"model": 1}') + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + _req(q))
        (s1, b1), (s2, b2), (s3, b3), (s4, b4) = _responses(sock, 4)
    assert (s1, s3, s4) == (200, 200, 200) and b1 == b4
    assert json.loads(b1)["default"]["e0"]["longest_matched"] == 4 * 16
    assert s2 == 422 and json.loads(b2)["error"]["where"] == "$.model"
    assert json.loads(b3) == {"alive": True}
    # rejected calls are counted the same on either path
    metrics = httpx.get(s.url + "/metrics").text
    assert 'kvstream_route_requests_total{api="query",outcome="rejected"} 1.0' in metrics
    assert 'kvstream_route_requests_total{api="query",outcome="ok"} 2.0' in metrics


def test_a_connection_close_request_is_answered_then_closed(engines, serve) -> None:
    s = serve("--load-interval", "0")
    host, port = s.url.split("//")[1].rsplit(":", 1)
    body = json.dumps({"model": "default", "token_ids": [1] * 16, "block_size": 16}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(_req(body, extra=b"Connection: close\r\n"))
        [(status, _)] = _responses(sock, 1)
        assert status == 200 and sock.recv(1) == b""


def test_an_idle_connection_is_closed_after_the_keep_alive_time_and_a_busy_one_is_not() -> None:
    import asyncio
    import time
    from types import SimpleNamespace

    from kvstream.service.fastpath import fast_protocol

    proto = fast_protocol(lambda path, body: (200, b"{}"), [b"/query"], 1000)
    cfg = SimpleNamespace(timeout_keep_alive=0.5)
    state = SimpleNamespace(connections=set(), tasks=set())  # uvicorn's ServerState

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: proto(cfg, state, None, loop), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            # busy, request after request, for longer than the keep-alive time (so the idle
            # timer fires mid-stream and must re-arm): every request answered, never closed
            t_end = time.monotonic() + 0.8
            while time.monotonic() < t_end:
                w.write(_req())
                head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200") and await r.readexactly(2) == b"{}"
            # then idle: the server closes it (EOF well before the deadline)
            t0 = time.monotonic()
            assert await asyncio.wait_for(r.read(1), 5) == b""
            assert 0.3 < time.monotonic() - t0 < 5
            w.close()
            assert not state.connections

    asyncio.run(main())
