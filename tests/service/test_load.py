"""Load sources: vLLM's /metrics parsed with prometheus-client, the in-flight seam, and
scrapes that hang or fail never holding up routing."""

from __future__ import annotations

import socket
import time

import pytest

from kvstream.routing.scoring import Load, RecentPlacements
from kvstream.service.load import LoadBoard, parse_vllm_metrics
from tests.service.conftest import wait_for

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.5
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5
"""


def test_vllm_gauges_are_summed_over_ranks_and_kv_usage_is_the_highest() -> None:
    s = parse_vllm_metrics(VLLM_METRICS, at=5.0)
    assert (s.running, s.waiting, s.kv_usage, s.at, s.found) == (5, 7, 0.5, 5.0, 3)


@pytest.mark.parametrize("text", ["", "# nothing here\nfoo 1\n", "vllm:num_requests_running{ 3\n"])
def test_expositions_without_the_gauges_are_errors(text: str) -> None:
    with pytest.raises(ValueError):
        parse_vllm_metrics(text, 0.0)


def test_request_loads_win_then_scrapes_then_in_flight() -> None:
    b = LoadBoard(stale_after_s=6.0)
    b.scraped("e0", parse_vllm_metrics(VLLM_METRICS, at=0.0))
    assert b.known()["e0"] == Load(queue=7, running=5, kv_usage=0.5)
    b.started("e0", 9)  # a proxy has 9 requests in flight: more than the engine reported
    b.started("e1")
    assert b.known()["e0"] == Load(queue=7, running=9, kv_usage=0.5)
    assert b.known()["e1"] == Load(running=1)
    assert b.effective({"e0": Load(queue=1)})["e0"] == Load(queue=1)
    b.finished("e0", 9)
    b.finished("e1", 5)  # never below zero
    assert b.known()["e0"].running == 5 and "e1" not in b.known()
    assert b.view("e0", now=1.0)["stale"] is False
    assert b.view("e0", now=7.0)["stale"] is True
    b.scrape_failed("e2", "ValueError: HTTP 500")  # it answered: reachable, load unknown
    assert b.view("e2", now=0.0) | {} == {"queue": 0, "running": 0, "kv_usage": 0.0, "prefill_tokens": 0,
                                          "in_flight": 0, "scraped": False,
                                          "age_s": None, "stale": True, "error": "ValueError: HTTP 500",
                                          "reachable": True, "unreachable_for_s": None}


def test_an_engine_its_scrape_cannot_reach_is_ranked_last_until_a_scrape_answers() -> None:
    b = LoadBoard()
    assert b.reachable_first(["e0", "e1", "e2"]) == ["e0", "e1", "e2"]
    assert b.scrape_failed("e0", "ConnectError", unreachable=True, at=10.0) is True  # a change: one log line
    assert b.scrape_failed("e0", "ConnectError", unreachable=True, at=12.0) is False  # still: no new line
    assert b.reachable_first(["e0", "e1", "e2"]) == ["e1", "e2", "e0"]
    assert b.view("e0", now=13.0)["reachable"] is False and b.view("e0", now=13.0)["unreachable_for_s"] == 3.0
    assert b.scraped("e0", parse_vllm_metrics(VLLM_METRICS, at=14.0)) is True  # back
    assert b.reachable("e0") and b.reachable_first(["e0", "e1"]) == ["e0", "e1"]


def test_a_hanging_metrics_endpoint_is_shown_stale_and_never_stalls_routing(engines, serve) -> None:
    e0 = engines("e0")
    # A listener that never answers: connects succeed, the scrape hangs until its timeout.
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(64)
    try:
        url = f"http://127.0.0.1:{hang.getsockname()[1]}"
        srv = serve(f"e0={e0.pub},{e0.replay},http={url}", "--load-interval", "0.3")
        srv.wait_applied("e0", -1)
        t0 = time.monotonic()
        for _ in range(20):
            srv.route(token_ids=list(range(64)))
        assert time.monotonic() - t0 < 5.0
        view = wait_for(lambda: (v := srv.engines()["e0"]["load"])["error"] and v, "the scrape to time out")
        assert view["stale"] is True and view["scraped"] is False and "Timeout" in view["error"]
        assert srv.engines()["e0"]["state"] == "live"
    finally:
        hang.close()


def test_an_engine_metrics_page_without_end_is_refused_not_held(engines) -> None:
    # Before: the scrape read the whole answer, then compared its size with the limit
    # (1 GiB held for an engine whose Content-Length said 1 GiB).
    from pathlib import Path

    from tests.proxy.test_proxy_faults import BadEngine
    from tests.service.conftest import ServeProc, dead_port, wait_for

    eng = BadEngine()
    eng.mode = "endless"
    try:
        srv = ServeProc(f"e0=tcp://127.0.0.1:{dead_port()},http={eng.url}", "--load-interval", "5")
        try:
            load = wait_for(lambda: srv.engines()["e0"]["load"]["error"], "the scrape to fail")
            assert "over 8388608 bytes" in load, load
            rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{srv.proc.pid}/status").read_text()
                           .splitlines() if line.startswith("VmRSS:"))
            assert rss_kib < 300 * 1024, f"{rss_kib} KiB"
        finally:
            assert srv.close() == 0
    finally:
        eng.close()


def test_a_proxys_sends_are_placements_that_age_with_every_send() -> None:
    b = LoadBoard(stale_after_s=6.0)
    b.scraped("e0", parse_vllm_metrics(VLLM_METRICS, at=0.0))
    b.started("e0")
    per = RecentPlacements()  # the defaults the board uses: a placement weighs its tokens + request_tokens
    b.prefill("e0", 3000)  # sent: 3,000 prompt tokens to compute there
    placed = 3000 + per.request_tokens
    assert b.known()["e0"].prefill_tokens == 3000 and b.known()["e0"].placed_tokens == placed
    b.prefill("e0", -3000)  # answered: no prefill waiting, the placement stays
    assert b.known()["e0"].prefill_tokens == 0 and b.known()["e0"].placed_tokens == placed
    b.started("e1")
    b.prefill("e1", 100)  # every send ages every engine's placements
    assert b.known()["e0"].placed_tokens == pytest.approx(placed * (1 - 1 / per.horizon))
    assert b.known()["e1"].placed_tokens == 100 + per.request_tokens
    b.forget("e1")
    assert "e1" not in b.known()


def test_a_proxy_in_front_stops_the_cost_policy_pricing_waiting_requests_twice() -> None:
    from kvstream.routing.scoring import CostPolicy
    from kvstream.service.config import ServeConfig
    from kvstream.service.core import ServiceCore

    core = ServiceCore(ServeConfig([], scoring="cost"))
    assert isinstance(core.policy, CostPolicy) and core.policy.queue_tokens == 512
    core.proxy_counts_prefill()
    assert core.policy.queue_tokens == 0
    prefix = ServiceCore(ServeConfig([]))
    prefix.proxy_counts_prefill()  # the prefix scoring keeps its queue weight
    assert prefix.policy.queue_weight == 0.1
