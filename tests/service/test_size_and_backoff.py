"""Work a client or an unreachable engine can cause is bounded before it is done: a body is
refused by its size (Content-Length, else counted) and by its item count before it is
decoded, ``mm_hashes`` is bounded, and engines that do not answer are asked less and less
often (load scrapes, joins, ZMQ reconnects), up to documented caps.

Found by an adversarial pass (issue #23): a 7.9 MB ``/query_by_hash`` body was decoded
(0.48 s on the event loop, ``/healthz`` up to 979 ms behind it) before its 413;
``/v1/route`` with 10,000 ``mm_hashes`` cost 0.1 s; 240 registered engines nobody listens
on kept an idle ``kvstream serve`` at 15.5 % of a core.
"""

from __future__ import annotations

import os
import re
import socket
import time

import httpx
import pytest

from kvstream.service.app import body_limits
from kvstream.service.config import ServeConfig
from kvstream.service.core import ServiceCore
from kvstream.service.errors import ApiError
from kvstream.service.mooncake import MooncakeAPI
from kvstream.service.runtime import SCRAPE_BACKOFF_MAX_S
from kvstream.transport.recovery import UNANSWERED_RETRY_MAX_S, SourceTracker
from tests.service.conftest import dead_port, wait_for


def _addr(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].rsplit(":", 1)
    return host, int(port)


def _head_only(url: str, path: str, length: int) -> tuple[int, dict]:
    """Send only the head of a POST announcing ``length`` body bytes; the answer."""
    with socket.create_connection(_addr(url), timeout=15) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n\r\n".encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            assert chunk, buf
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        n = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
        while len(rest) < n:
            chunk = s.recv(65536)
            assert chunk
            rest += chunk
        import json

        return int(head.split()[1]), json.loads(rest[:n])


@pytest.mark.parametrize("path", ["/query_by_hash", "/query", "/register", "/unregister"])
def test_a_body_over_its_routes_own_limit_is_refused_by_its_head_alone(serve, path: str) -> None:
    # Under --max-body-bytes (8 MiB), over what the route can take: answered 413 from the
    # Content-Length before a byte of the body is sent, so nothing waits, reads or decodes.
    srv = serve("--load-interval", "0")
    limit = body_limits(ServeConfig(engines=[]))[path]
    assert limit < 8 * 1024 * 1024
    status, body = _head_only(srv.url, path, limit + 1)
    assert status == 413 and body["error"]["code"] == "too_large", body
    assert f"POST {path} takes at most {limit} bytes" in body["error"]["message"]
    assert srv.client.get("/healthz").status_code == 200


def test_a_query_by_hash_of_millions_of_items_is_refused_before_it_is_decoded(serve) -> None:
    srv = serve("--load-interval", "0")
    limit = body_limits(ServeConfig(engines=[]))["/query_by_hash"]
    head = b'{"model":"m","block_size":16,"seq_hashes":['
    items = (limit - len(head) - 2) // 2
    body = head + b"1," * (items - 1) + b"1]}"
    assert len(body) <= limit
    r = srv.client.post("/query_by_hash", content=body)
    assert r.status_code == 413, r.text
    assert "holds more than 262144 items" in r.json()["error"]["message"]  # counted, not decoded
    assert srv.client.get("/healthz").status_code == 200


def test_item_counts_are_checked_before_decoding_in_the_core() -> None:
    mc = MooncakeAPI(ServiceCore(ServeConfig(engines=[], max_prompt_tokens=1000)))
    many = b'{"model":"m","block_size":1,"seq_hashes":[' + b"0," * 5000 + b'0]}'
    for handler in (mc.query_by_hash, mc.query):
        with pytest.raises(ApiError) as err:
            handler(many.replace(b"seq_hashes", b"token_ids") if handler == mc.query else many)
        assert err.value.status == 413 and "more than 1000 items" in err.value.message
    # at the limit: decoded, then the precise check of hashes x block size
    ok = b'{"model":"m","block_size":1,"seq_hashes":[' + b"0," * 999 + b'0]}'
    assert mc.query_by_hash(ok) == b'{"default":{}}'
    with pytest.raises(ApiError) as err:
        mc.query_by_hash(ok.replace(b'"block_size":1', b'"block_size":2'))
    assert err.value.status == 413 and "1000 hashes of 2 tokens" in err.value.message
    with pytest.raises(ApiError) as err:
        mc.query_by_hash(b'{"model":"m","block_size":1,"seq_hashes":[1,18446744073709551616]}')
    assert err.value.status == 422 and err.value.where == "$.seq_hashes[1]"


def test_route_mm_hashes_are_bounded(serve) -> None:
    srv = serve("e0=tcp://127.0.0.1:1", "--load-interval", "0")
    tokens = list(range(20_000))
    mm = [{"identifier": f"img{i}", "offset": i, "length": 1} for i in range(10_000)]
    r = srv.client.post("/v1/route", json={"token_ids": tokens, "mm_hashes": mm})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["where"] == "$.mm_hashes" and "1024" in r.json()["error"]["message"]
    assert srv.client.post("/v1/route", json={"token_ids": tokens, "mm_hashes": mm[:1024]}).status_code == 200


def test_an_engine_that_never_answers_is_asked_less_and_less_often_up_to_the_cap() -> None:
    t = SourceTracker("s", has_replay=True, max_retries=2, backoff_s=0.05)
    t.start(0.0)
    delays = []
    for _ in range(12):
        req = t.inflight
        req.sent = True
        t.on_timeout()
        delays.append(t.inflight.delay_s)
    assert t.state == "connecting"
    assert delays == sorted(delays) and delays[-1] == UNANSWERED_RETRY_MAX_S, delays
    assert UNANSWERED_RETRY_MAX_S >= 10


def _scrapes(c: httpx.Client, engine: str) -> int:
    m = re.search(rf'kvstream_load_scrapes_total{{engine="{engine}",outcome="error"}} (\S+)', c.get("/metrics").text)
    return int(float(m.group(1))) if m else 0


def test_load_scrapes_of_an_unreachable_engine_back_off(serve) -> None:
    # --load-interval 0.1: without backoff ~10 failed scrapes a second; with it the waits
    # double (0.1, 0.2, 0.4, 0.8, 1.6, 3.2 s: ~6 in 6 s), up to SCRAPE_BACKOFF_MAX_S.
    srv = serve(f"e0=tcp://127.0.0.1:{dead_port()},http=http://127.0.0.1:{dead_port()}", "--load-interval", "0.1")
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        wait_for(lambda: _scrapes(c, "e0") >= 3, "three failed scrapes")
        t0 = time.monotonic()
        first = _scrapes(c, "e0")
        time.sleep(4.0)  # a window to count attempts in (the count is the assertion, not a wait for a peer)
        n = _scrapes(c, "e0") - first
        elapsed = time.monotonic() - t0
    assert n <= 4, (n, elapsed)  # 0.8 + 1.6 + 3.2 s of waits at most fit in ~4 s after the third
    assert SCRAPE_BACKOFF_MAX_S == 30.0


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads the process's CPU time from /proc")
def test_an_idle_service_following_240_unreachable_engines_uses_little_cpu(serve, tmp_path) -> None:
    # 240 engines whose PUB nobody serves: before, ZMQ retried each connection every
    # 100 ms, for ever. Now the retries back off to every RECONNECT_MAX_S (2 s). (Joins
    # and load scrapes back off too: the two tests above.)
    engines = [f'"u{i}=tcp://127.0.0.1:{dead_port()}"' for i in range(240)]
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f"engines = [{', '.join(engines)}]\nload-interval = 0\n")
    srv = serve("--config", str(cfg))
    assert len(srv.engines()) == 240
    time.sleep(6.0)  # the reconnect waits grow to their cap (0.1 s doubling to 2 s) in this time
    a, t0 = _cpu_s(srv.proc.pid), time.monotonic()
    time.sleep(6.0)  # the window the CPU time is measured over
    share = (_cpu_s(srv.proc.pid) - a) / (time.monotonic() - t0)
    assert share < 0.025, f"{share:.1%} of a core"
