"""Faults behind and beside the gateway: an engine killed, kvstream killed (real processes;
each test its own stack, as it breaks it)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.gateway.conftest import DEADLINE_S, Stack, synced, view
from tests.gateway.test_envoy import served
from tests.service.conftest import wait_for


@pytest.fixture
def own_stack(model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    # A long mark-down, so the killed engine's state holds for the whole test.
    s = Stack(tmp_path, model_dir, serve_extra=["--proxy-backoff", "10"])
    try:
        yield s
    finally:
        s.close()


def test_a_killed_engine_is_retried_past_then_no_longer_picked(own_stack: Stack) -> None:
    stack = own_stack
    prompt = list(range(6000, 6100))
    home = served(stack, stack.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}))
    synced(stack.serve.url, stack.engines)
    retries = stack.envoy.stat("cluster.engines.upstream_rq_retry") if stack.envoy else 0
    stack.engine(home).kill()
    # kvstream does not know yet: it picks the prefix's home first, its fallbacks after it;
    # the connection is refused and Envoy's retry takes the next endpoint of the pick.
    r = stack.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert served(stack, r) != home
    if r.headers.get("x-kvstream-engine") == home:
        assert stack.envoy is not None and stack.envoy.stat("cluster.engines.upstream_rq_retry") > retries
    # The retry told kvstream: the engine is marked down (its index is the event stream's
    # business: an HTTP failure says nothing about the blocks it holds) ...
    wait_for(lambda: view(stack.serve.url)[home]["proxy"]["state"] == "down", f"{home} to be marked down",
             DEADLINE_S)
    assert view(stack.serve.url)[home]["index_stale"] is False
    # ... and from then on it is not picked, its prefix notwithstanding.
    for body in ({"prompt": prompt, "max_tokens": 1}, {"prompt": prompt + [5, 6, 7], "max_tokens": 1},
                 {"prompt": list(range(10, 50)), "max_tokens": 1}):
        r = stack.client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["x-kvstream-engine"] != home and served(stack, r) != home


def test_a_killed_kvstream_leaves_envoy_balancing_on_its_own(own_stack: Stack) -> None:
    stack = own_stack
    assert stack.serve is not None and stack.envoy is not None
    r = stack.client.post("/v1/completions", json={"prompt": list(range(100, 140)), "max_tokens": 1})
    assert r.status_code == 200 and r.headers.get("x-kvstream-engine")
    stack.serve.proc.kill()
    stack.serve.proc.wait()
    seen = set()
    for i in range(12):
        r = stack.client.post("/v1/completions", json={"prompt": list(range(100 + i, 140)), "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert not r.headers.get("x-kvstream-engine")  # nobody picked: Envoy's own policy did
        seen.add(served(stack, r))
    assert len(seen) >= 2, seen  # least-request balancing over the engines, not one fixed host
    assert stack.envoy.stat("http.gateway.ext_proc.failure_mode_allowed") >= 12
