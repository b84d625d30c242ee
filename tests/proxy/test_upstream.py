"""The proxy's upstream HTTP/1.1 pool against a real TCP server on loopback."""

from __future__ import annotations

import anyio
import anyio.abc
import pytest

from kvstream.proxy.upstream import UpstreamError, UpstreamPool

pytestmark = pytest.mark.anyio


async def _read_request(stream: anyio.abc.ByteStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive()
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(rest) < length:
        rest += await stream.receive()
    return head


async def test_a_connection_closed_while_idle_is_replaced_and_the_request_sent_again() -> None:
    served = []

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            head = await _read_request(stream)
            served.append(head.split(b"\r\n")[0])
            # Answers keep-alive style, then closes anyway (an engine's idle timeout).
            await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        pool = UpstreamPool("127.0.0.1", port)
        for i in range(3):
            r = await pool.request("POST", f"/v1/completions?{i}", b"{}", [])
            assert r.status_code == 200 and await r.read() == b"ok"
            await r.aclose()
            await anyio.wait_all_tasks_blocked()
        assert served == [f"POST /v1/completions?{i} HTTP/1.1".encode() for i in range(3)]
        await pool.aclose()
        tg.cancel_scope.cancel()


async def test_nobody_listening_is_an_error_before_any_response() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    with pytest.raises(UpstreamError) as err:
        await UpstreamPool("127.0.0.1", port).request("GET", "/health", b"", [])
    assert err.value.before_response
