"""A load scrape that times out once is a slow answer, not an engine gone; the second in a
row marks the engine unreachable (ranked last), a refused connection at once. Real serve,
and a real HTTP server standing in for the engine's ``/metrics`` whose answers the test
holds back."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from tests.service.conftest import dead_port, wait_for

METRICS = b'vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'


class MetricsServer:
    """``/metrics`` on loopback; ``hold`` answers wait until it is cleared (each held
    request is counted in ``held``); ``served`` counts the answers sent."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.hold = 0  # answers still to hold back
        self.held = self.served = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                with outer.lock:
                    wait = outer.hold > 0
                    if wait:
                        outer.hold -= 1
                        outer.held += 1
                if wait:
                    outer.gate.wait(30)
                self.send_response(200)
                self.send_header("Content-Length", str(len(METRICS)))
                self.end_headers()
                self.wfile.write(METRICS)
                with outer.lock:
                    outer.served += 1

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def metrics() -> Iterator[MetricsServer]:
    m = MetricsServer()
    yield m
    m.close()


def _reachable(srv, name: str) -> bool:
    return srv.engines()[name]["load"]["reachable"]


def test_one_timed_out_scrape_leaves_the_engine_reachable_two_in_a_row_do_not(serve, metrics) -> None:
    srv = serve(f"e0=tcp://127.0.0.1:{dead_port()},http={metrics.url}", "--load-interval", "0.5")
    wait_for(lambda: metrics.served >= 1 and srv.engines()["e0"]["load"]["error"] is None, "a first good scrape")
    # One answer held past the scrape's timeout (0.5 s), then answers again.
    with metrics.lock:
        metrics.gate.clear()
        metrics.hold = 1
    wait_for(lambda: "no answer" in (srv.engines()["e0"]["load"]["error"] or ""), "the held scrape to time out")
    assert _reachable(srv, "e0"), srv.engines()["e0"]["load"]
    metrics.gate.set()
    done = metrics.served
    wait_for(lambda: metrics.served > done + 1 and srv.engines()["e0"]["load"]["error"] is None, "good scrapes again")
    assert "is unreachable" not in srv.stderr(), srv.stderr()[-2000:]
    # Every answer held: the second timeout in a row ranks it last, with one log line.
    with metrics.lock:
        metrics.gate.clear()
        metrics.hold = 10**6
    wait_for(lambda: not _reachable(srv, "e0"), "two timed-out scrapes to mark e0 unreachable")
    assert srv.stderr().count("engine e0 is unreachable") == 1, srv.stderr()[-2000:]
    metrics.gate.set()
    with metrics.lock:
        metrics.hold = 0
    wait_for(lambda: _reachable(srv, "e0"), "an answer to make e0 reachable again")
