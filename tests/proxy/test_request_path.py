"""The request path in front of engines, with real processes: two ``kvstream engine``s behind
``kvstream serve --proxy`` (and a routing-only ``kvstream serve``), over loopback.

Idle gaps longer than the engines' keep-alive give no false 503s; batched completion
prompts pass; answers without ``prompt_tokens_details`` count as 0 cached; every engine has
a ``proxy`` object from the start; a dead engine is no longer named best within a bounded
time in a routing-only service; the access log, the histograms and the logs say what an
operator needs.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from kvstream.emulator.launch import Proc, start_engine
from tests.proxy.test_full_stack import ENGINE_OPTS, published, wait_for
from tests.service.conftest import ServeProc

KEEP_ALIVE_S = 1  # the engines close idle connections after this (vLLM's server: 5 s)


def _spec(e: Proc) -> str:
    return f"{e.name}={e.events},{e.replay},http={e.url}"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    logs = str(tmp_path_factory.mktemp("logs"))
    procs = [start_engine(f"e{i}", extra=[*ENGINE_OPTS, "--timeout-keep-alive", str(KEEP_ALIVE_S)], log_dir=logs,
                          wait=False) for i in range(2)]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def proxied(engines: list[Proc], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProc, Path]]:
    access = tmp_path_factory.mktemp("access") / "access.jsonl"
    srv = ServeProc(*map(_spec, engines), "--proxy", "--load-interval", "0.5", "--access-log", str(access),
                    "--log-format", "json", "--log-level", "info")
    try:
        yield srv, access
    finally:
        assert srv.close() == 0


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)


def _burst(url: str, n: int, base: int) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: _post(url, {"prompt": [base + i] * 20, "max_tokens": 2}), range(n)))


def _metric(srv: ServeProc, pattern: str) -> float:
    m = re.search(pattern, srv.client.get("/metrics").text, re.M)
    assert m, pattern
    return float(m.group(1))


def test_idle_gaps_longer_than_the_engines_keep_alive_give_no_false_503s(proxied: tuple[ServeProc, Path]) -> None:
    srv, _ = proxied
    for gap in range(3):
        answers = _burst(srv.url, 16, 1000 * (gap + 1))
        assert [r.status_code for r in answers] == [200] * 16, [r.text[:200] for r in answers if r.status_code != 200]
        # The idle gap is the scenario itself: every kept-alive connection to the engines
        # sits idle past their keep-alive timeout and is closed by them.
        time.sleep(KEEP_ALIVE_S + 0.6)
    answers = _burst(srv.url, 16, 9000)
    assert [r.status_code for r in answers] == [200] * 16
    for name, e in srv.engines().items():
        assert e["proxy"]["failures"] == 0 and e["proxy"]["state"] == "up", (name, e["proxy"])
    assert "is down" not in srv.stderr()


def test_batched_prompts_are_answered_one_choice_per_prompt_with_usage_summed(
        proxied: tuple[ServeProc, Path]) -> None:
    srv, _ = proxied
    r = _post(srv.url, {"prompt": [[5, 6, 7, 8], [9, 10, 11]], "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 4
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                      json={"prompt": [[21] * 5, [22] * 6, [23] * 7], "max_tokens": 3, "stream": True}) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sorted(c["choices"][0]["index"] for c in chunks) == [0] * 3 + [1] * 3 + [2] * 3
    assert all(c["choices"] for c in chunks)  # the usage chunk the proxy asked for is not passed on


def test_an_answer_without_prompt_tokens_details_counts_as_0_cached(proxied: tuple[ServeProc, Path],
                                                                     engines: list[Proc]) -> None:
    srv, _ = proxied

    def counted() -> int:
        return sum(e["proxy"]["routing_accuracy"]["requests"] for e in srv.engines().values())

    before = counted()
    r = _post(srv.url, {"prompt": [31337] * 40, "max_tokens": 1})
    assert r.status_code == 200 and "prompt_tokens_details" not in r.json()["usage"]  # as vLLM: nothing cached
    assert counted() == before + 1
    e = srv.engines()[r.headers["x-kvstream-engine"]]["proxy"]["routing_accuracy"]
    assert e["realized_tokens"] >= 0 and e["requests"] >= 1


def test_the_access_log_has_one_json_line_per_request_and_the_request_id_passes_through(
        proxied: tuple[ServeProc, Path]) -> None:
    srv, access = proxied
    r = _post(srv.url, {"prompt": [7] * 40, "max_tokens": 1}, headers={"x-request-id": "req-kvstream-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-kvstream-1"
    mine = _post(srv.url, {"prompt": [8] * 40, "max_tokens": 1}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", mine)  # none given: a new one

    def lines() -> dict[str, dict[str, Any]]:
        out = {}
        for line in access.read_text().splitlines():
            rec = json.loads(line)
            out[rec["request_id"]] = rec
        return out
    got = wait_for(lambda: (lambda ls: ls if "req-kvstream-1" in ls and mine in ls else None)(lines()),
                   "the access log lines")
    rec = got["req-kvstream-1"]
    assert set(rec) == {"time", "method", "path", "status", "engine", "predicted_cached_tokens",
                        "realized_cached_tokens", "ttfb_s", "duration_s", "request_id"}
    assert rec["method"] == "POST" and rec["path"] == "/v1/completions" and rec["status"] == 200
    assert rec["engine"] == r.headers["x-kvstream-engine"] and rec["realized_cached_tokens"] is not None
    assert 0 <= rec["ttfb_s"] <= rec["duration_s"] and abs(rec["time"] - time.time()) < 600


def test_histograms_per_engine_and_the_build_info_are_on_metrics(proxied: tuple[ServeProc, Path]) -> None:
    srv, _ = proxied
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                      json={"prompt": [77] * 30, "max_tokens": 2, "stream": True}) as s:
        name = s.headers["x-kvstream-engine"]
        b"".join(s.iter_raw())
    assert _metric(srv, rf'^kvstream_proxy_time_to_first_token_seconds_count{{engine="{name}"}} (\S+)$') >= 1
    assert _metric(srv, rf'^kvstream_proxy_request_duration_seconds_count{{engine="{name}"}} (\S+)$') >= 1
    assert _metric(srv, r'^kvstream_build_info{python="[^"]+",version="[^"]+"} (\S+)$') == 1.0
    assert _metric(srv, r"^kvstream_proxy_held_bytes (\S+)$") == 0.0


def test_logs_carry_no_ansi_colour_codes_and_say_each_state_change_once(proxied: tuple[ServeProc, Path],
                                                                          engines: list[Proc]) -> None:
    srv, _ = proxied
    for e in engines:  # each engine publishes events: its stream is live
        assert _post(e.url, {"prompt": [4242] * 40, "max_tokens": 1}).status_code == 200
    for e in engines:
        wait_for(lambda: f'"engine {e.name}: stream connecting -> live"' in srv.stderr(), f"{e.name} live")
    err = srv.stderr()
    for e in engines:
        assert err.count(f"engine {e.name}: stream connecting -> live") == 1
    assert err.strip(), "serve logged nothing at info level"
    assert "\x1b[" not in err and "color_message" not in err, err[:2000]
    for line in err.splitlines():
        json.loads(line)  # --log-format json: every line is one object


def test_every_engine_has_a_proxy_object_before_its_first_request(engines: list[Proc]) -> None:
    srv = ServeProc(*map(_spec, engines), "--proxy", "--load-interval", "0")
    try:
        for name, e in srv.engines().items():
            assert e["proxy"]["state"] == "up" and e["proxy"]["served"] == 0, (name, e)
        assert srv.client.get("/health").status_code == 200  # vLLM's health path, beside /healthz
    finally:
        assert srv.close() == 0


def test_a_dead_engine_is_not_named_best_by_routing_only_serve_within_the_scrape_bound(
        tmp_path: Path) -> None:
    logs = str(tmp_path)
    pair = [start_engine(f"d{i}", extra=ENGINE_OPTS, log_dir=logs, wait=False) for i in range(2)]
    srv = None
    try:
        for p in pair:
            p.wait_ready()
        srv = ServeProc(*map(_spec, pair), "--load-interval", "0.5")
        prompt = list(range(500, 564))
        assert _post(pair[0].url, {"prompt": prompt, "max_tokens": 1}).status_code == 200
        wait_for(lambda: srv.route(token_ids=prompt)["engine"] == "d0"
                 and srv.engines()["d0"]["applied_seq"] is not None
                 and srv.engines()["d0"]["applied_seq"] >= published(pair[0]) - 1, "d0 to hold the prompt")
        pair[0].kill()
        t0 = time.monotonic()
        wait_for(lambda: srv.route(token_ids=prompt)["engine"] == "d1", "the dead engine to stop being best")
        took = time.monotonic() - t0
        # The bound: one --load-interval for the refused scrape, plus its answer time. Without
        # it the stream alone took 9-17 s to notice.
        assert took < 5.0, took
        load = srv.engines()["d0"]["load"]
        assert load["reachable"] is False and load["error"]
        # One log line for the change, not one per scrape.
        wait_for(lambda: _metric(srv, r'^kvstream_load_scrapes_total{engine="d0",outcome="error"} (\S+)$') >= 3,
                 "more failed scrapes of d0")
        assert srv.stderr().count("engine d0 is unreachable") == 1, srv.stderr()[-2000:]
    finally:
        if srv is not None:
            srv.close()
        for p in pair:
            p.stop()
