"""HTTP connections that hold every file descriptor of ``kvstream serve`` cannot end its
event stream: the replay socket the subscriber opens for a retry fails with EMFILE, the
source waits (``recovering``, then ``stale`` if it lasts) and asks again with back-off,
and the other engines stay followed.

Found under load (issue #23): with the descriptors used up by clients, a replay request's
fresh DEALER raised ``ZMQError(EMFILE)`` inside the subscriber's task group, and the
runtime ended ("the index no longer follows the engines"); serve then stopped.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from tests.service.conftest import wait_for

PROMPT = [9100 + i for i in range(64)]
LIMIT = 1100  # serve's RLIMIT_NOFILE (soft and hard): --max-engines 2 needs 8 x 2 + 1,024


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _hold(url: str, n: int) -> list[socket.socket]:
    """``n`` connections to ``url``, each with a request head begun and never finished
    (the service keeps such a connection for --request-timeout)."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    held = []
    try:
        for _ in range(n):
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(b"POST /v1/route HTTP/1.1\r\nhost: x\r\n")
            held.append(s)
    except BaseException:
        for s in held:
            s.close()
        raise
    return held


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the service's descriptors in /proc")
def test_http_connections_holding_every_descriptor_do_not_end_the_event_stream(engines, serve) -> None:
    import resource

    e0, e1 = engines("e0"), engines("e1")
    srv = serve(e0.arg.split(",http=")[0], e1.arg.split(",http=")[0], "--load-interval", "0",
                "--max-engines", "2", "--replay-timeout", "0.5", "--request-timeout", "300",
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT)))
    srv.wait_applied("e0", e0.admit(PROMPT, "r1"))
    srv.wait_applied("e1", e1.admit(PROMPT, "r1"))
    pid = srv.proc.pid
    held = _hold(srv.url, LIMIT + 50)  # more than serve may open: the rest wait in its backlog
    stopped = False
    try:
        wait_for(lambda: _fds(pid) >= LIMIT - 2, f"serve holding all {LIMIT} descriptors", timeout=60)
        # e0 stops answering: its idle probe times out and the retry needs a fresh replay
        # socket, which cannot be opened now.
        os.kill(e0.proc.pid, signal.SIGSTOP)
        stopped = True
        wait_for(lambda: "e0: cannot open a replay socket" in srv.stderr() or srv.proc.poll() is not None,
                 "serve failing to open e0's replay socket", timeout=60)
        assert srv.proc.poll() is None, srv.stderr()[-3000:]
        assert "Too many open files" in srv.stderr()
    finally:
        for s in held:
            s.close()
        if stopped:
            os.kill(e0.proc.pid, signal.SIGCONT)
    wait_for(lambda: _fds(pid) < LIMIT - 100, "serve closing the held connections", timeout=60)
    assert srv.proc.poll() is None, srv.stderr()[-3000:]
    assert srv.client.get("/healthz").status_code == 200
    # The runtime still follows both engines: e1's next batch is applied, and e0 is either
    # live again with its next batch or visibly stale (never live without it).
    srv.wait_applied("e1", e1.admit(PROMPT + [1] * 16, "r2"))
    seq = e0.admit(PROMPT + [2] * 16, "r2")

    def settled() -> str | None:
        st = srv.engines()["e0"]
        if st["state"] == "stale" or (st["state"] == "live" and st["applied_seq"] is not None and st["applied_seq"] >= seq):
            return st["state"]
        return None

    wait_for(settled, "e0 live with its new batch, or stale", timeout=60)
    log = srv.stderr()
    assert "event stream runtime stopped" not in log, log[-3000:]
    assert srv.close() == 0
