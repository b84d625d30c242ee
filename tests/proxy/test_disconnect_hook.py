"""The guarded server's disconnect notice (``scope["extensions"]["kvstream.disconnect"]``),
which the proxy cancels a request on, against a real uvicorn on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any, Iterator

import pytest

from tests.service.conftest import wait_for

pytest.importorskip("httptools")


class _App:
    """``/hold`` waits until told its connection is lost; ``/quick`` answers at once. Every
    request's hook is kept, so the test can see which were told."""

    def __init__(self) -> None:
        self.hooks: dict[str, Any] = {}
        self.lost: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        from kvstream.service.guard import DISCONNECT_EXTENSION

        await receive()  # the (empty) body
        name = scope["query_string"].decode()
        hook = scope["extensions"][DISCONNECT_EXTENSION]
        self.hooks[name] = hook
        if scope["path"] == "/hold":
            gone = asyncio.Event()

            def lost() -> None:
                self.lost.append(name)
                gone.set()

            hook.set(lost)
            await gone.wait()
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server() -> Iterator[tuple[_App, int]]:
    import uvicorn

    from kvstream.service.guard import guarded_protocol
    from kvstream.service.listen import listen_tcp

    app = _App()
    sock = listen_tcp("127.0.0.1", 0)
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, http=guarded_protocol(), log_level="warning", lifespan="on"))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    wait_for(lambda: srv.started, "uvicorn to start", timeout=30)
    try:
        yield app, port
    finally:
        srv.should_exit = True
        t.join(30)
        sock.close()


def _get(path: str, name: str) -> bytes:
    return f"GET {path}?{name} HTTP/1.1\r\nhost: x\r\n\r\n".encode()


def _read_answer(c: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"ok"):
        got = c.recv(4096)
        assert got, "the server closed the connection"
        buf += got
    return buf


def test_a_request_whose_client_hangs_up_before_the_answer_is_told_so(server: tuple[_App, int]) -> None:
    app, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(_get("/hold", "held"))
        wait_for(lambda: "held" in app.hooks, "the request to reach the app")
    wait_for(lambda: app.lost == ["held"], "the app to be told the connection is lost", timeout=30)
    assert app.hooks["held"].gone


def test_answered_requests_on_a_kept_alive_connection_are_never_told_lost(server: tuple[_App, int]) -> None:
    app, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        for i in range(50):
            c.sendall(_get("/quick", f"q{i}"))
            assert _read_answer(c).startswith(b"HTTP/1.1 200")
        c.sendall(_get("/hold", "last"))
        wait_for(lambda: "last" in app.hooks, "the last request to reach the app")
    wait_for(lambda: app.lost == ["last"], "the last request to be told", timeout=30)
    assert not any(app.hooks[f"q{i}"].gone for i in range(50))


def test_a_callback_set_after_the_connection_was_lost_is_called_at_once() -> None:
    from kvstream.service.guard import DisconnectHook

    hook = DisconnectHook()
    hook.fire()
    called: list[int] = []
    hook.set(lambda: called.append(1))
    assert called == [1] and hook.gone
    hook2 = DisconnectHook()
    hook2.set(lambda: called.append(2))
    hook2.clear()
    hook2.fire()
    assert called == [1]
