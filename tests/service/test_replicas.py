"""A second kvstream serve started with --peers loads a running replica's /v1/dump (the
index and each engine's last applied seq) and applies only what came after."""

from __future__ import annotations

import httpx

from kvstream.routing.index import KVIndex
from kvstream.routing.snapshot import read_snapshot
from tests.service.conftest import wait_for

BS = 16


def _state(url: str) -> dict:
    data = httpx.get(url + "/v1/dump").content
    return KVIndex.load(data).state()


def test_a_replica_starts_from_a_peers_dump_and_follows_from_there(engines, serve) -> None:
    e0, e1 = engines("e0"), engines("e1")
    a = serve(e0.arg, e1.arg, "--load-interval", "0")
    doc = list(range(4000, 4000 + 8 * BS))
    a.wait_applied("e0", e0.admit(doc, "r1"))
    seq = e1.admit(list(range(6000, 6000 + 3 * BS)), "r2")
    a.wait_applied("e1", seq)
    info = read_snapshot(httpx.get(a.url + "/v1/dump").content)
    assert info.cursors == {"e0": 0, "e1": 0}

    b = serve(e0.arg, e1.arg, "--load-interval", "0", "--peers", "http://127.0.0.1:1", a.url)
    b.wait_applied("e0", 0)
    b.wait_applied("e1", 0)
    assert {n: e["resumed_seq"] for n, e in b.engines().items()} == {"e0": 0, "e1": 0}
    # each replay socket was asked from the dumped seq (its anchor), not from 0: nothing
    # the dump held came over the wire again
    wait_for(lambda: all(e["state"] == "live" for e in b.engines().values()), "both engines live on b")
    assert {n: (e["batches"], e["last_seq"]) for n, e in b.engines().items()} == {"e0": (0, 0), "e1": (0, 0)}
    assert "loaded the index from " + a.url in b.stderr()
    # the replayed batches the dump already held were skipped, not counted twice
    assert _state(b.url) == _state(a.url)
    assert b.route(token_ids=doc)["engine"] == "e0"

    # and what comes after is applied
    more = list(range(9000, 9000 + 2 * BS))
    seq = e1.admit(more, "r3")
    b.wait_applied("e1", seq)
    r = b.route(token_ids=more)
    assert r["engine"] == "e1" and r["matched_tokens"] == 2 * BS
    wait_for(lambda: _state(b.url) == _state(a.url), "both replicas to agree")


def test_no_peer_answering_means_a_cold_start(engines, serve) -> None:
    e0 = engines("e0")
    seq = e0.admit(list(range(100, 100 + 4 * BS)), "r")
    b = serve(e0.arg, "--load-interval", "0", "--peers", "http://127.0.0.1:1")
    b.wait_applied("e0", seq)
    assert b.engines()["e0"]["resumed_seq"] is None
    assert "no peer answered" in b.stderr()
    assert b.route(token_ids=list(range(100, 100 + 4 * BS)))["matched_tokens"] == 4 * BS


class _BadPeer:
    """A real HTTP peer on loopback whose ``/v1/dump`` is bad in one way: ``"huge"`` (a
    declared length over the bound), ``"endless"`` (chunked, without end), ``"garbage"``
    (not a dump) or ``"stall"`` (headers, then nothing)."""

    def __init__(self, kind: str) -> None:
        import socket
        import threading

        self.kind = kind
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=f"bad-peer-{kind}")
        self.thread.start()

    def _serve(self) -> None:
        import socket

        self.sock.settimeout(0.05)
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(0.05)
                self._answer(conn)

    def _answer(self, conn) -> None:
        import socket

        try:
            conn.recv(65536)
            if self.kind == "huge":
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000000000\r\n\r\n" + b"x" * 4096)
            elif self.kind == "garbage":
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 14\r\n\r\nnot a snapshot")
            elif self.kind == "endless":
                conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                chunk = b"%x\r\n%s\r\n" % (65536, b"y" * 65536)
                while not self.done.is_set():
                    conn.sendall(chunk)
            else:  # stall
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\nabc")
            while not self.done.is_set():  # hold the connection until the client leaves
                try:
                    if conn.recv(65536) == b"":
                        return
                except socket.timeout:
                    continue
        except OSError:  # the client closed on us: what a bounded reader does
            return

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.sock.close()


def test_a_peer_dump_too_large_garbage_or_stalled_means_a_cold_start_in_one_line(engines, serve) -> None:
    # Before: the dump was read whole with no byte bound (a peer sending more than memory
    # grew the process without limit), and a peer trickling bytes held start-up forever.
    e0 = engines("e0")
    seq = e0.admit(list(range(100, 100 + 4 * BS)), "r")
    peers = [_BadPeer(k) for k in ("huge", "endless", "garbage", "stall")]
    try:
        b = serve(e0.arg, "--load-interval", "0", "--max-dump-bytes", "1048576", "--peer-timeout", "2",
                  "--peers", *(p.url for p in peers))
        b.wait_applied("e0", seq)
        assert b.engines()["e0"]["resumed_seq"] is None
        lines = [ln for ln in b.stderr().splitlines() if "no peer answered" in ln]
        assert len(lines) == 1, b.stderr()
        huge, endless, garbage, stall = (p.url for p in peers)
        assert f"{huge}: dump of 100000000000 bytes is over --max-dump-bytes 1048576" in lines[0]
        assert f"{endless}: dump is over --max-dump-bytes 1048576" in lines[0]
        assert f"{garbage}: " in lines[0] and f"{stall}: " in lines[0]
        assert b.route(token_ids=list(range(100, 100 + 4 * BS)))["matched_tokens"] == 4 * BS
    finally:
        for p in peers:
            p.close()
