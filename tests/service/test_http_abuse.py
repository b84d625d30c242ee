"""HTTP/1.1 abuse over raw sockets against ``kvstream serve`` as a process, in both of its
modes (routing only, and ``--proxy``, whose OpenAI paths the fast path frames too), each
with the fast path in front of uvicorn.
Malformed requests get the service's JSON error, never a text page or a hang; heads,
trailers and pipelines are bounded in bytes; slow and idle clients do not hold others up."""

from __future__ import annotations

import socket
import struct
import threading
import time
import weakref
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.service.conftest import ServeProc, dead_port, wait_for



@pytest.fixture(scope="module", params=["fast", "proxy"])
def srv(request: pytest.FixtureRequest) -> Iterator[ServeProc]:
    # --proxy needs an engine with an HTTP API to forward to (none answers here)
    http = f",http=http://127.0.0.1:{dead_port()}" if request.param == "proxy" else ""
    extra = ["--proxy"] if request.param == "proxy" else []
    s = ServeProc(f"e0=tcp://127.0.0.1:{dead_port()}{http}", "--load-interval", "0", "--max-body-bytes", "65536",
                  *extra)
    yield s
    assert s.close() == 0


def _addr(srv: ServeProc) -> tuple[str, int]:
    host, port = srv.url.split("//")[1].rsplit(":", 1)
    return host, int(port)


_LEFT: "weakref.WeakKeyDictionary[socket.socket, bytes]" = weakref.WeakKeyDictionary()
"""Per socket: bytes read past the last response."""


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (Content-Length body) off ``sock``; fails on a timeout."""
    buf = _LEFT.pop(sock, b"")
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {buf!r}"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
    n = int(headers["content-length"])
    while len(rest) < n:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    _LEFT[sock] = rest[n:]
    return int(lines[0].split()[1]), headers, rest[:n]


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


B = b'{"token_ids": [1, 2, 3]}'
MALFORMED = {
    "content_length_not_a_number": b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n" + B,
    "content_length_twice": b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 24\r\nContent-Length: 3\r\n\r\n" + B,
    "content_length_and_chunked": b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n18\r\n" + B + b"\r\n0\r\n\r\n",
    "bad_chunk_size": b"POST /v1/route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "not_http": b"\x00\x01garbage\r\n\r\n",
    "bad_header_name": b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n",
    # Ended by bare LFs: the fast path used to wait for a CRLF CRLF that never came.
    "bare_line_feeds_hot": b"POST /v1/route HTTP/1.1\nHost: x\nContent-Length: 24\n\n" + B,
    "bare_line_feeds_get": b"GET /healthz HTTP/1.1\nHost: x\n\n",
    # Control characters in a header value of a hot POST: uvicorn refuses them, and the
    # fast path used to answer the request as if they were not there.
    "nul_in_header_value_hot": b"POST /v1/route HTTP/1.1\r\nHost: x\r\nX-Trace: a\x00b\r\nContent-Length: 24\r\n\r\n" + B,
    "ctl_in_header_value_hot": b"POST /v1/route HTTP/1.1\r\nHost: x\r\nX-Trace: a\x01b\r\nContent-Length: 24\r\n\r\n" + B,
    "nul_in_content_length_hot": b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 24\x00\r\n\r\n" + B,
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_http_is_a_json_400_naming_the_fault_then_closed(srv: ServeProc, case: str) -> None:
    with socket.create_connection(_addr(srv), timeout=10) as s:
        s.sendall(MALFORMED[case])
        status, headers, body = _read_response(s)
        assert status == 400, body
        assert headers["content-type"] == "application/json"
        err = httpx.Response(200, content=body).json()["error"]
        assert err["code"] == "bad_http" and err["message"].startswith("not a valid HTTP/1.1 request: "), err
        assert len(err["message"]) > len("not a valid HTTP/1.1 request: ")  # the parser's reason
        assert _closed(s)


def _flood(srv: ServeProc, first: bytes, filler: bytes, total: int) -> socket.socket:
    """Send ``first`` then ``filler`` up to ``total`` bytes, stopping when the server closes."""
    s = socket.create_connection(_addr(srv), timeout=10)
    s.sendall(first)
    sent = 0
    try:
        while sent < total:
            s.sendall(filler)
            sent += len(filler)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return s


@pytest.mark.parametrize("first", [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: ",  # a header line without end
    b"GET /v1/engines?" ,  # a request line without end
    b"POST /v1/route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{}x\r\n0\r\nX-Trailer: ",
], ids=["header", "request_line", "trailer"])
def test_an_endless_head_or_trailer_is_refused_with_431_not_buffered(srv: ServeProc, first: bytes) -> None:
    # Before: uvicorn's httptools protocol kept every byte (+200 MB for 123 MB sent).
    s = _flood(srv, first, b"a" * 65536, 64 << 20)
    with s:
        try:
            status, headers, body = _read_response(s)
        except ConnectionResetError:
            pytest.fail("reset without the 431")  # the answer must reach the client
        assert status == 431 and headers["content-type"] == "application/json"
        assert httpx.Response(200, content=body).json()["error"]["code"] == "too_large"
    text = srv.client.get("/metrics").text
    assert 'kvstream_http_rejections_total{code="too_large",status="431"}' in text


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_pipelining_client_that_never_reads_is_held_back_not_queued(srv: ServeProc) -> None:
    # Before: 6 MB of pipelined GETs queued 150 k requests in the server (+270 MB).
    before = _rss_kib(srv.proc.pid)
    one = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    s = socket.create_connection(_addr(srv), timeout=1)  # a send blocked this long: held back
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sent = 0
    with s:
        try:
            while sent < (32 << 20):
                s.sendall(one * 2000)
                sent += len(one) * 2000
        except TimeoutError:
            pass  # the server stopped reading: TCP holds the client back
        assert sent < (32 << 20), "the server read everything a non-reading client sent"
        grown = _rss_kib(srv.proc.pid) - before
        assert grown < 48 * 1024, f"the server grew {grown} KiB for {sent} bytes of pipelined requests"
        s.settimeout(20)
        for _ in range(300):  # and the answers still come, in order
            status, _, body = _read_response(s)
            assert status == 200 and body == b'{"alive":true}'
    # The client left with answers unread: that is not an error of the service.
    assert srv.client.get("/healthz").status_code == 200
    log = srv.stderr()
    assert "Exception in ASGI application" not in log and "internal error" not in log, log[-3000:]


def test_many_pipelined_requests_are_all_answered_in_order(srv: ServeProc) -> None:
    reqs = []
    for i in range(100):
        body = b'{"token_ids": [%d]}' % i
        reqs.append(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        reqs.append(b"GET /v1/engines HTTP/1.1\r\nHost: x\r\n\r\n")
    with socket.create_connection(_addr(srv), timeout=20) as s:
        s.sendall(b"".join(reqs))
        for i in range(200):
            status, _, body = _read_response(s)
            assert status == 200
            assert (b'"matched_tokens"' in body) if i % 2 == 0 else body.startswith(b'{"engines"')


def test_slow_idle_and_reset_clients_do_not_hold_up_others(srv: ServeProc) -> None:
    addr = _addr(srv)
    idle = [socket.create_connection(addr) for _ in range(100)]
    slow = [socket.create_connection(addr) for _ in range(5)]
    stop = threading.Event()
    dripped = [0]

    def drip(s: socket.socket) -> None:  # a byte at a time, never finishing the request
        data = b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 999
        for b in data:
            if stop.wait(0.05):
                return
            s.send(bytes([b]))
            dripped[0] += 1

    threads = [threading.Thread(target=drip, args=(s,)) for s in slow]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: dripped[0] > 100, "the slow clients to be mid-request")
        for _ in range(5):  # abrupt resets mid-body
            r = socket.create_connection(addr)
            r.sendall(b"POST /register HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"endpoint\": ")
            r.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            r.close()
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            t0 = time.monotonic()
            for i in range(20):
                assert c.post("/v1/route", content=B).status_code == 200
                assert c.get("/v1/engines").status_code == 200
            assert time.monotonic() - t0 < 5.0
    finally:
        stop.set()
        for t in threads:
            t.join()
        for s in idle + slow:
            s.close()
    # A client gone mid-body is not an internal error.
    log = srv.stderr()
    assert "ClientDisconnect" not in log and "internal error on POST /register" not in log, log[-3000:]


def test_two_workers_guard_every_connection_the_same_way() -> None:
    srv = ServeProc(f"e0=tcp://127.0.0.1:{dead_port()}", "--load-interval", "0", "--workers", "2")
    try:
        for _ in range(4):  # connections land on either worker
            with socket.create_connection(_addr(srv), timeout=10) as s:
                s.sendall(MALFORMED["bare_line_feeds_hot"])
                status, _, body = _read_response(s)
                assert status == 400 and b'"bad_http"' in body
            s = _flood(srv, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: ", b"a" * 65536, 64 << 20)
            with s:
                assert _read_response(s)[0] == 431
        assert srv.client.get("/healthz").status_code == 200
    finally:
        assert srv.close() == 0


def test_without_httptools_uvicorns_h11_protocol_answers_in_json_too(tmp_path: Path) -> None:
    # `pip install kvstream` without the [fast] extra: uvicorn falls back to h11, which
    # bounds heads itself (16 KiB); its 400 was text/plain too.
    (tmp_path / "httptools.py").write_text('raise ImportError("hidden: run as without kvstream[fast]")\n')
    repo = Path(__file__).resolve().parents[2]
    srv = ServeProc(f"e0=tcp://127.0.0.1:{dead_port()}", "--load-interval", "0",
                    env={"PYTHONPATH": f"{tmp_path}:{repo}"})
    try:
        for raw in (MALFORMED["content_length_not_a_number"], MALFORMED["not_http"]):
            with socket.create_connection(_addr(srv), timeout=10) as s:
                s.sendall(raw)
                status, headers, body = _read_response(s)
                assert status == 400 and headers["content-type"] == "application/json", body
                assert httpx.Response(200, content=body).json()["error"]["code"] == "bad_http"
        s = _flood(srv, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: ", b"a" * 65536, 64 << 20)
        with s:
            status, headers, _ = _read_response(s)
            assert status == 400 and headers["content-type"] == "application/json"
        assert srv.client.post("/v1/route", json={"token_ids": [1, 2]}).status_code == 200
    finally:
        assert srv.close() == 0


PARTIAL = {
    "head_hot": b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Le",
    "body_hot": b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 24\r\n\r\n" + B[:5],
    "chunked_body": b"POST /v1/route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n18\r\n" + B[:5],
    # a whole GET first (on the fast path: handed to uvicorn), then half of the next head
    "head_after_a_request": b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHo",
}
PROXIED = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 24\r\n\r\n" + B[:5]
"""Half of an OpenAI POST (with --proxy, framed by the fast path)."""


@pytest.mark.parametrize("mode", ["fast", "proxy"])
def test_a_partial_request_held_past_the_request_timeout_is_a_json_408_then_closed(mode: str) -> None:
    # Before: a connection could hold half a head or body for ever (a slow-loris client
    # pinning a connection and its buffers); only idle connections between requests closed.
    extra = ["--proxy"] if mode == "proxy" else []
    http = f",http=http://127.0.0.1:{dead_port()}" if mode == "proxy" else ""
    srv = ServeProc(f"e0=tcp://127.0.0.1:{dead_port()}{http}", "--load-interval", "0", "--request-timeout", "1",
                    *extra)
    try:
        partial = {**PARTIAL, "body_proxied": PROXIED} if mode == "proxy" else PARTIAL
        socks = {k: socket.create_connection(_addr(srv), timeout=10) for k in partial}
        t0 = time.monotonic()
        for k, s in socks.items():
            s.sendall(partial[k])
        for k, s in socks.items():
            if k == "head_after_a_request":
                assert _read_response(s)[0] == 200
            status, headers, body = _read_response(s)
            assert (k, status) == (k, 408), body
            assert time.monotonic() - t0 >= 0.9  # not before the deadline
            assert headers["content-type"] == "application/json"
            assert httpx.Response(200, content=body).json()["error"]["code"] == "request_timeout"
            assert _closed(s), k
            s.close()
        # a request that takes its time but finishes within the deadline is answered
        with socket.create_connection(_addr(srv), timeout=10) as s:
            s.sendall(PARTIAL["body_hot"])
            wait_for(lambda: srv.client.get("/healthz").status_code == 200, "a turn of the server")
            s.sendall(B[5:])
            assert _read_response(s)[0] == 200
        metrics = srv.client.get("/metrics").text
        assert 'code="request_timeout"' in metrics
    finally:
        assert srv.close() == 0


def test_the_guard_wraps_the_installed_uvicorn_and_falls_back_on_another(caplog) -> None:
    # The guard overrides hooks of uvicorn's httptools protocol; with the installed uvicorn
    # every hook is there (so the guarded class is used), and a protocol class lacking one
    # is served unguarded with a warning instead of breaking every connection.
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from kvstream.service.guard import _HTTPTOOLS_HOOKS, guarded_protocol

    assert guarded_protocol(HttpToolsProtocol).__name__ == "GuardedHttpToolsProtocol"
    assert all(callable(getattr(HttpToolsProtocol, m, None)) for m in _HTTPTOOLS_HOOKS)

    class Older(HttpToolsProtocol):
        _unset_keepalive_if_required = None  # type: ignore[assignment]

    with caplog.at_level("WARNING", logger="kvstream.service"):
        made = guarded_protocol(Older)
    assert made.__name__ == "GuardedHttpProtocol" and issubclass(made, Older)
    assert "_unset_keepalive_if_required" in caplog.text and "bounds are off" in caplog.text
