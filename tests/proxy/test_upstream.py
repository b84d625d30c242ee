"""The proxy's upstream client (aiohttp's pool) against real TCP servers on loopback."""

from __future__ import annotations

import anyio
import anyio.abc
import pytest

from kvstream.proxy.upstream import UpstreamError, UpstreamPool

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio


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
