"""The placement model in the request path (``serve --proxy --scoring cost``), real processes:
the proxy counts the prompt tokens each engine still has to compute for what it sent, and
routes the next request by that work, not by engine name."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Iterator

import httpx
import pytest

from kvstream.emulator.launch import Proc
from tests.proxy.stack import engines_and_proxy
from tests.proxy.test_full_stack import wait_for

# 2,000 prompt tokens/s: a 3,000-token prompt keeps an engine prefilling for 1.5 s.
ENGINE_OPTS = ["--num-gpu-blocks", "1024", "--prefill-tokens-per-s", "2000", "--decode-tokens-per-s", "200",
               "--max-model-len", "8192"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, list[Proc]]]:
    with engines_and_proxy(str(tmp_path_factory.mktemp("logs")), ENGINE_OPTS, ["--scoring", "cost"]) as stack:
        yield stack


def loads(proxy: Proc) -> dict[str, Any]:
    body = httpx.get(proxy.url + "/v1/engines").json()
    return {e["name"]: e["load"] for e in body["engines"]}


def test_an_engine_still_prefilling_a_long_prompt_does_not_get_the_next_one(stack: tuple[Proc, list[Proc]]) -> None:
    proxy, _ = stack
    first: dict[str, Any] = {}

    def long_request() -> None:
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": list(range(10_000, 13_000)), "max_tokens": 2},
                       timeout=60)
        first["engine"], first["status"] = r.headers.get("x-kvstream-engine"), r.status_code

    t = threading.Thread(target=long_request)
    t.start()
    try:
        busy = wait_for(lambda: next((n for n, ld in loads(proxy).items() if ld["prefill_tokens"] > 0), None),
                        "the proxy to count the first prompt's prefill")
        assert loads(proxy)[busy]["prefill_tokens"] == 3000
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": list(range(20_000, 23_000)), "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.headers["x-kvstream-engine"] != busy
    finally:
        t.join(60)
    assert first == {"engine": busy, "status": 200}
    # Answered: nothing is waiting any more.
    wait_for(lambda: all(ld["prefill_tokens"] == 0 for ld in loads(proxy).values()), "the prefill counts to drain")


def test_new_prompts_on_idle_engines_are_spread_not_sent_to_the_first_name(stack: tuple[Proc, list[Proc]]) -> None:
    proxy, _ = stack
    seen = Counter()
    with httpx.Client(base_url=proxy.url, timeout=60) as c:
        for i in range(40):
            r = c.post("/v1/completions", json={"prompt": [30_000 + i, 7, 7, 7], "max_tokens": 1})
            assert r.status_code == 200
            seen[r.headers["x-kvstream-engine"]] += 1
    assert set(seen) == {"e0", "e1"} and min(seen.values()) >= 8, seen


def test_a_cached_prefix_is_still_found(stack: tuple[Proc, list[Proc]]) -> None:
    proxy, _ = stack
    prompt = list(range(40_000, 40_640))
    with httpx.Client(base_url=proxy.url, timeout=60) as c:
        home = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).headers["x-kvstream-engine"]

        def reused() -> bool:
            r = c.post("/v1/completions", json={"prompt": prompt + [5], "max_tokens": 1})
            return r.headers["x-kvstream-engine"] == home and r.json()["usage"]["prompt_tokens_details"][
                "cached_tokens"] >= 624

        # The engine's events reach the index within a round trip; then every repeat goes home.
        wait_for(reused, "the cached prefix to be routed to")
        for _ in range(5):
            assert reused()
