"""``kvstream serve --processes 2`` evens out its connections: the kernel's SO_REUSEPORT
choice is a hash of the addresses, so a worker that accepts a connection while it holds
more than its sibling passes the socket on (kvstream/service/siblings.py). Checked on the
real processes: which worker holds each server-side socket is read from /proc."""

from __future__ import annotations

import json
import os
import socket
from urllib.parse import urlsplit

from tests.service.conftest import wait_for

BS = 16
CONNS = 32
ROUNDS = 3


def _workers(parent: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                pids.append(int(entry))
    return pids


def _established_inodes(port: int) -> set[str]:
    """Socket inodes of the established TCP connections whose local port is ``port``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "01":
                out.add(cols[9])
    return out


def _held(pid: int, inodes: set[str]) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            n += 1
    return n


def _ask(sock: socket.socket, body: bytes) -> bytes:
    sock.sendall(b"POST /v1/route HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        rest += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return rest


def test_two_workers_hold_the_same_number_of_connections(engines, serve) -> None:
    e0 = engines("e0")
    doc = [70_000 + i for i in range(3 * BS)]
    e0.admit(doc, "r")
    srv = serve(e0.arg, "--load-interval", "0", "--processes", "2")
    u = urlsplit(srv.url)
    body = json.dumps({"token_ids": doc}).encode()
    wait_for(lambda: srv.route(token_ids=doc)["matched_tokens"] == 3 * BS, "e0's blocks in a worker")
    workers = _workers(srv.proc.pid)
    assert len(workers) == 2

    def held() -> list[int]:
        inodes = _established_inodes(u.port)  # type: ignore[arg-type]
        return sorted(_held(pid, inodes) for pid in workers)

    # A hash spreads 32 connections within one of even about 1 time in 7: three rounds.
    for _ in range(ROUNDS):
        socks = []
        try:
            for _ in range(CONNS):  # each connection's first request is sent as soon as it connects
                s = socket.create_connection((u.hostname, u.port), timeout=30)
                socks.append(s)
                json.loads(_ask(s, body))
            for s in socks:  # and every connection keeps being served where it ended up
                assert json.loads(_ask(s, body))["engine"] == "e0"

            def spread() -> list[int] | None:
                # ours, and srv.client's keep-alive connection (srv.route above)
                h = held()
                return h if sum(h) >= CONNS and h[1] - h[0] <= 1 else None

            wait_for(spread, f"{CONNS} connections or more, at most one more on one worker than the other")
        finally:
            for s in socks:
                s.close()
        wait_for(lambda: sum(held()) <= 1, "the closed connections gone from the workers")
    assert srv.close() == 0
