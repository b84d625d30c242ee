"""The listening socket every kvstream HTTP server binds (serve's proxy, the emulated engine)."""

from __future__ import annotations

import socket

__all__ = ["listen_tcp"]


def listen_tcp(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A non-blocking TCP socket listening on ``host:port`` (port 0: any free port), with
    TCP_NODELAY inherited by accepted connections.

    Raises ``OSError`` with one line naming the address and the fix (pick another port)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port") from None
    sock.listen(backlog)
    sock.setblocking(False)
    return sock
