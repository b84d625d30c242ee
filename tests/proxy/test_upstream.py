"""The proxy's upstream client (kvstream.proxy.upstream) against real TCP servers on loopback,
on asyncio's own loop and on uvloop (the one ``kvstream serve`` runs)."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, AsyncIterator

import anyio
import anyio.abc
import pytest

from kvstream.proxy.upstream import UpstreamError, UpstreamPool

pytestmark = pytest.mark.anyio


@pytest.fixture(params=[("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    return request.param  # the client is asyncio protocols


async def _read_request(stream: anyio.abc.ByteStream, buf: bytearray) -> bytes | None:
    """One request's head (its body skipped); None if the client closed first."""
    while b"\r\n\r\n" not in buf:
        try:
            data = await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return None
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(rest) < length:
        rest += await stream.receive()
    buf[:] = rest[length:]
    return head


async def _serve(handle: object) -> tuple[anyio.abc.SocketListener, int]:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    return listener, listener.extra(anyio.abc.SocketAttribute.local_port)


@contextlib.asynccontextmanager
async def _pool_to(handle: Any, **kw: float) -> AsyncIterator[UpstreamPool]:
    """A pool to a loopback server answering each connection with ``handle``."""
    listener, port = await _serve(handle)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        pool = UpstreamPool("127.0.0.1", port, **kw)
        try:
            yield pool
        finally:
            await pool.aclose()
            tg.cancel_scope.cancel()


async def test_a_request_the_engine_drops_on_a_kept_alive_connection_is_sent_again_on_a_new_one() -> None:
    # The race of an idle timeout: the engine closes a kept-alive connection just as the
    # next request arrives on it, without answering. The client must not fail (nor take
    # another pooled connection): it sends the request again on a new connection.
    served = []

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            buf = bytearray()
            head = await _read_request(stream, buf)
            if head is None:
                return
            served.append(head.split(b"\r\n")[0])
            await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await _read_request(stream, buf)  # the next request on this connection: dropped

    listener, port = await _serve(handle)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        pool = UpstreamPool("127.0.0.1", port)
        for i in range(3):
            r = await pool.request("POST", f"/v1/completions?{i}", b"{}", [])
            assert r.status_code == 200 and await r.read() == b"ok"
            await r.aclose()
        assert served == [f"POST /v1/completions?{i} HTTP/1.1".encode() for i in range(3)]
        # Request 1 met the dropped connection (sent again on a new one, closed after it);
        # request 2 opened a new kept-alive connection.
        assert pool.fresh_retries == 1
        await pool.aclose()
        tg.cancel_scope.cancel()


async def test_an_engine_that_drops_every_request_is_an_error_before_any_response() -> None:
    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await _read_request(stream, bytearray())

    listener, port = await _serve(handle)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        pool = UpstreamPool("127.0.0.1", port)
        with pytest.raises(UpstreamError) as err:
            await pool.request("POST", "/v1/completions", b"{}", [])
        assert err.value.before_response and pool.fresh_retries == 1
        await pool.aclose()
        tg.cancel_scope.cancel()


async def test_nobody_listening_is_an_error_before_any_response_without_a_retry() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    pool = UpstreamPool("127.0.0.1", port)
    with pytest.raises(UpstreamError) as err:
        await pool.request("GET", "/health", b"", [])
    assert err.value.before_response and pool.fresh_retries == 0
    await pool.aclose()


async def test_an_answer_cut_mid_body_is_an_error_after_the_response_started() -> None:
    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await _read_request(stream, bytearray())
            await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")

    listener, port = await _serve(handle)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        pool = UpstreamPool("127.0.0.1", port)
        r = await pool.request("POST", "/v1/completions", b"{}", [])
        assert r.status_code == 200
        with pytest.raises(UpstreamError) as err:
            await r.read()
        assert not err.value.before_response
        await r.aclose()
        await pool.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("answer,status,body", [
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", 200, b"hello world"),
    (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the close", 200, b"until the close"),
    (b"HTTP/1.1 204 No Content\r\n\r\n", 204, b""),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok", 201, b"ok"),
    (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nRetry-After: 1\r\n\r\nbusy", 503, b"busy"),
], ids=["chunked", "until_close", "no_content", "interim_100", "error_status"])
async def test_each_way_an_engine_frames_an_answer_is_read_whole(answer: bytes, status: int, body: bytes) -> None:
    got_status, headers, got = await _fetch_simple(answer)
    assert (got_status, got) == (status, body)
    if status == 503:  # the header lines as sent, names' case kept
        assert (b"Retry-After", b"1") in headers


async def _fetch_simple(answer: bytes) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            if await _read_request(stream, bytearray()) is not None:
                await stream.send(answer)

    async with _pool_to(handle) as pool:
        r = await pool.request("POST", "/v1/completions", b"{}", [])
        body = await r.read()
        await r.aclose()
        return r.status_code, r.headers, body


async def test_the_request_goes_out_as_one_http_1_1_request_with_its_headers_and_length() -> None:
    got: list[bytes] = []

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            buf = bytearray()
            while len(got) < 2:
                while b"\r\n\r\n" not in buf:
                    buf += await stream.receive()
                head, _, rest = bytes(buf).partition(b"\r\n\r\n")
                n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]) if b"content-length" in head.lower() else 0
                while len(rest) < n:
                    rest += await stream.receive()
                got.append(head + b"\r\n\r\n" + rest[:n])
                buf[:] = rest[n:]
                await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    listener, port = await _serve(handle)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        pool = UpstreamPool("127.0.0.1", port)
        r = await pool.request("POST", "/v1/completions", b'{"a": 1}', [(b"x-request-id", b"r1"), (b"authorization", b"Bearer k")])
        await r.read()
        await r.aclose()
        r = await pool.request("GET", "/v1/models", b"", [])
        await r.read()
        await r.aclose()
        assert pool.connections == 1  # both on one kept-alive connection
        await pool.aclose()
        tg.cancel_scope.cancel()
    host = f"127.0.0.1:{port}".encode()
    assert got == [b"POST /v1/completions HTTP/1.1\r\nhost: " + host + b"\r\nx-request-id: r1\r\nauthorization: Bearer k\r\n"
                   b"content-length: 8\r\n\r\n{\"a\": 1}",
                   b"GET /v1/models HTTP/1.1\r\nhost: " + host + b"\r\n\r\n"]


@pytest.mark.parametrize("answer,needle", [
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not HTTP/1.1"),
    (b"HTTP/1.1 200 OK\r\nx-endless: " + b"a" * (200 * 1024), "response head is over 65536 bytes"),
    (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n", "upgrade"),
], ids=["not_http", "endless_head", "upgrade"])
async def test_an_answer_that_is_not_usable_http_is_an_error_before_the_response_and_not_resent(
        answer: bytes, needle: str) -> None:
    seen = []

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            if await _read_request(stream, bytearray()) is not None:
                seen.append(1)
                try:
                    await stream.send(answer)
                    await stream.receive()  # until the client closes
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    pass

    async with _pool_to(handle) as pool:
        with anyio.fail_after(20), pytest.raises(UpstreamError) as err:
            await pool.request("POST", "/v1/completions", b"{}", [])
        assert err.value.before_response and needle in str(err.value)
        # It answered (badly): the request was taken, so it is not sent again.
        assert pool.fresh_retries == 0 and seen == [1] and pool.connections == 0


async def test_a_body_is_held_at_most_the_read_ahead_bound_ahead_of_a_reader_that_does_not_read() -> None:
    from kvstream.proxy.upstream import READ_AHEAD_BYTES

    total = 64 << 20
    blocked = threading.Event()
    sent = [0]
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:  # exact byte counts: a plain socket, send() says what it took
        conn, _ = srv.accept()
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
            piece = bytes(range(256)) * 256
            conn.settimeout(0.5)  # a send that takes nothing for this long: held back by TCP
            while sent[0] < total:
                try:
                    sent[0] += conn.send(piece[: total - sent[0]])
                except TimeoutError:
                    blocked.set()
                    conn.settimeout(30)
            conn.recv(1)  # until the client closes

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    pool = UpstreamPool("127.0.0.1", srv.getsockname()[1])
    try:
        r = await pool.request("POST", "/v1/completions", b"{}", [])
        with anyio.fail_after(30):
            while not blocked.is_set():
                await anyio.sleep(0.01)
        conn = r._conn
        assert conn is not None and conn.paused
        # held: the bound plus at most one socket read past it
        assert conn.buffered <= READ_AHEAD_BYTES + 256 * 1024, conn.buffered
        assert sent[0] < total
        n = 0
        async for chunk in r.aiter_bytes():
            n += len(chunk)
            assert len(chunk) <= READ_AHEAD_BYTES + 256 * 1024
        assert n == total
        await r.aclose()
        assert pool.connections == 1  # read whole: kept for the next request
    finally:
        await pool.aclose()
        srv.close()
    t.join(10)


@pytest.mark.parametrize("when", ["before_the_answer", "mid_body"])
async def test_a_request_given_up_before_its_answer_is_complete_closes_its_connection(when: str) -> None:
    # vLLM aborts a request when its connection closes: that is how a client that left
    # stops the engine's work.
    closed = anyio.Event()
    asked = anyio.Event()

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await _read_request(stream, bytearray())
            if when == "mid_body":
                await stream.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            asked.set()
            try:
                while await stream.receive():
                    pass
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                closed.set()

    async with _pool_to(handle) as pool:
        if when == "before_the_answer":
            async with anyio.create_task_group() as inner:
                inner.start_soon(pool.request, "POST", "/v1/completions", b"{}", [])
                await asked.wait()
                inner.cancel_scope.cancel()
        else:
            r = await pool.request("POST", "/v1/completions", b"{}", [])
            async for chunk in r.aiter_bytes():
                assert chunk == b"hello"
                break
            await r.aclose()
        with anyio.fail_after(10):
            await closed.wait()
        assert pool.connections == 0


async def test_an_idle_connection_the_engine_closes_leaves_the_pool_when_its_fin_arrives() -> None:
    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:  # answers, then closes the kept-alive connection while idle
            if await _read_request(stream, bytearray()) is not None:
                await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async with _pool_to(handle) as pool:
        r = await pool.request("POST", "/v1/completions", b"{}", [])
        assert await r.read() == b"ok"
        await r.aclose()
        with anyio.fail_after(10):
            while pool.connections:
                await anyio.sleep(0.01)
        r = await pool.request("POST", "/v1/completions", b"{}", [])  # a new connection, no retry
        assert await r.read() == b"ok" and pool.fresh_retries == 0
        await r.aclose()


async def test_a_connection_idle_past_keepalive_is_not_reused() -> None:
    conns = []

    async def handle(stream: anyio.abc.SocketStream) -> None:
        conns.append(1)
        async with stream:
            buf = bytearray()
            while await _read_request(stream, buf) is not None:
                await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    for keepalive, want in ((60.0, 1), (0.0, 2)):
        conns.clear()
        async with _pool_to(handle, keepalive_s=keepalive) as pool:
            for _ in range(2):
                r = await pool.request("POST", "/v1/completions", b"{}", [])
                assert await r.read() == b"ok"
                await r.aclose()
            assert len(conns) == want and pool.fresh_retries == 0


async def test_bytes_after_a_complete_answer_never_join_it_and_the_connection_is_not_kept() -> None:
    # An engine that answers twice to one request: the second answer is not read as the
    # first one's body, and a connection that says more than was asked is not reused.
    conns = []

    async def handle(stream: anyio.abc.SocketStream) -> None:
        conns.append(1)
        async with stream:
            buf = bytearray()
            while await _read_request(stream, buf) is not None:
                await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nextra")

    async with _pool_to(handle) as pool:
        for _ in range(2):
            r = await pool.request("POST", "/v1/completions", b"{}", [])
            assert await r.read() == b"ok"
            await r.aclose()
        assert len(conns) == 2
