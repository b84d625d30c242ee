"""``kvstream serve --proxy``'s OpenAI requests on the service's fast path
(:mod:`kvstream.service.fastpath`), over raw sockets against a real ``kvstream engine``:
pipelined proxied requests are answered in order beside the routing calls and uvicorn's
routes, a stream goes out chunked, ``Connection: close`` closes, and bytes pipelined behind
a stream in progress are held back by TCP. (A client that does not read its stream:
``tests/proxy/test_proxy_faults.py``.)"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Iterator

import pytest

from kvstream.emulator.launch import Proc, start_engine
from tests.service.conftest import ServeProc, wait_for

MODEL = "kvstream-emulated"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProc, Proc]]:
    logs = str(tmp_path_factory.mktemp("logs"))
    eng = start_engine("e0", extra=["--num-gpu-blocks", "4096", "--decode-tokens-per-s", "1000000",
                                    "--prefill-tokens-per-s", "1e9"], log_dir=logs)
    srv = ServeProc(f"e0={eng.events},{eng.replay},http={eng.url}", "--proxy", "--load-interval", "0")
    try:
        yield srv, eng
    finally:
        try:
            assert srv.close() == 0
        finally:
            eng.stop()


def _addr(srv: ServeProc) -> tuple[str, int]:
    host, port = srv.url.split("//")[1].rsplit(":", 1)
    return host, int(port)


def _post(path: bytes, body: dict, extra: bytes = b"") -> bytes:
    raw = json.dumps(body).encode()
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        path, extra, len(raw), raw)


class _Reader:
    """HTTP/1.1 responses off one socket, Content-Length or chunked (linear in the bytes
    read: a stream of 40 MB in small chunks is read in well under a second)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0

    def _more(self) -> None:
        if self.pos > (1 << 20):
            del self.buf[:self.pos]
            self.pos = 0
        chunk = self.sock.recv(1 << 20)
        assert chunk, f"connection closed; unread: {bytes(self.buf[self.pos:self.pos + 200])!r}"
        self.buf += chunk

    def _until(self, sep: bytes) -> bytes:
        while (i := self.buf.find(sep, self.pos)) < 0:
            self._more()
        line = bytes(self.buf[self.pos:i])
        self.pos = i + len(sep)
        return line

    def _take(self, n: int) -> bytes:
        while len(self.buf) - self.pos < n:
            self._more()
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def response(self) -> tuple[int, dict[str, str], bytes]:
        head = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in head[1:])}
        if "content-length" in headers:
            body = self._take(int(headers["content-length"]))
        else:
            assert headers.get("transfer-encoding") == "chunked", headers
            parts = []
            while True:
                size = int(self._until(b"\r\n"), 16)
                parts.append(self._take(size))
                assert self._take(2) == b"\r\n"
                if size == 0:
                    break
            body = b"".join(parts)
        return int(head[0].split()[1]), headers, body


def test_pipelined_proxied_requests_are_answered_in_order_beside_the_other_routes(
        served: tuple[ServeProc, Proc]) -> None:
    srv, _ = served
    reqs = [
        _post(b"/v1/completions", {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 3}),
        _post(b"/v1/completions", {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True}),
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        _post(b"/v1/route", {"token_ids": [1, 2, 3]}),
        _post(b"/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 2}, extra=b"X-Request-Id: mine-1\r\n"),
        _post(b"/v1/completions", {"model": "nope", "prompt": [1], "max_tokens": 1}),
        _post(b"/v1/completions", {"model": MODEL, "prompt": [9, 9], "max_tokens": 1}, extra=b"Connection: close\r\n"),
    ]
    with socket.create_connection(_addr(srv), timeout=20) as s:
        s.sendall(b"".join(reqs))
        r = _Reader(s)
        status, h, body = r.response()
        assert status == 200 and h["x-kvstream-engine"] == "e0" and json.loads(body)["usage"]["completion_tokens"] == 3
        status, h, body = r.response()  # the stream: chunked, events as the engine sent them
        assert status == 200 and h["transfer-encoding"] == "chunked" and h["content-type"].startswith("text/event-stream")
        events = [e for e in body.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and len(events) == 5, body
        assert all(b'"usage"' not in e for e in events)  # the usage chunk the proxy asked for is dropped
        assert r.response()[:1] == (200,)  # /healthz: uvicorn's, in its turn
        status, _, body = r.response()
        assert status == 200 and b'"matched_tokens"' in body  # /v1/route: the service's fast answer
        status, h, body = r.response()
        assert status == 200 and h["x-request-id"] == "mine-1" and json.loads(body)["object"] == "chat.completion"
        status, _, body = r.response()
        assert status == 404 and b"does not exist" in body  # the engine's own error, unchanged
        status, h, _ = r.response()
        assert status == 200 and h.get("connection") == "close"
        assert r.pos == len(r.buf) and s.recv(1) == b""  # and closed
    log = srv.stderr()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_bytes_pipelined_behind_a_stream_in_progress_are_held_back_not_buffered(
        served: tuple[ServeProc, Proc]) -> None:
    srv, _ = served
    before = _rss_kib(srv.proc.pid)
    s = socket.create_connection(_addr(srv), timeout=1)  # a send blocked this long: held back
    one = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    sent = 0
    with s:
        s.sendall(_post(b"/v1/completions", {"model": MODEL, "prompt": [2, 7, 1, 8], "max_tokens": 5000,
                                             "stream": True}))
        try:
            while sent < (32 << 20):
                s.sendall(one * 2000)
                sent += len(one) * 2000
        except TimeoutError:
            pass
        assert sent < (32 << 20), "the service read everything pipelined behind a stream in progress"
        assert _rss_kib(srv.proc.pid) - before < 48 * 1024
        s.settimeout(30)
        r = _Reader(s)
        status, _, body = r.response()
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
        for _ in range(200):  # then the pipelined requests, in order
            assert r.response() == (200, {"content-type": "application/json", "content-length": "14"},
                                    b'{"alive":true}')
