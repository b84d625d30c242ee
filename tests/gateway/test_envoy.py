"""The real Envoy in front of real engines, asking ``kvstream serve --ext-proc-port`` which
engine takes each request (examples/gateway/envoy.yaml as shipped, ports and addresses
filled in)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.gateway.conftest import DEADLINE_S, EnvoyProc, Stack, render, synced, view
from tests.service.conftest import wait_for

BLOCK = 16


def served(stack: Stack, r: httpx.Response) -> str:
    """The engine that answered (Envoy's %UPSTREAM_HOST%, mapped to the engine's name)."""
    return stack.name_at(r.headers["x-gateway-destination-endpoint-served"])


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def sse(r: httpx.Response) -> list[dict[str, Any]]:
    import json

    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_completions_and_chat_streamed_and_not_reach_the_engine_kvstream_picked(stack: Stack) -> None:
    before = {n: e["proxy"]["served"] if "proxy" in e else 0 for n, e in view(stack.serve.url).items()}
    msgs = [{"role": "system", "content": " ".join(["be brief"] * 30)}, {"role": "user", "content": "hello there"}]
    picked = []
    r = stack.client.post("/v1/completions", json={"prompt": list(range(300, 340)), "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    picked.append((r.headers["x-kvstream-engine"], served(stack, r)))
    r = stack.client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    picked.append((r.headers["x-kvstream-engine"], served(stack, r)))
    for path, body in (("/v1/completions", {"prompt": list(range(400, 450)), "max_tokens": 3}),
                       ("/v1/chat/completions", {"messages": msgs, "max_tokens": 3})):
        with stack.client.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            chunks = sse(r)
            assert len(chunks) >= 3 and chunks[-1]["choices"][0]["finish_reason"] == "length"
            picked.append((r.headers["x-kvstream-engine"], served(stack, r)))
    assert all(want == got for want, got in picked), picked
    # Every answer was followed to its end: counted as served by the engine that gave it.
    def counted() -> bool:
        after = {n: e["proxy"]["served"] for n, e in view(stack.serve.url).items() if "proxy" in e}
        return sum(after.values()) - sum(before.values()) == len(picked)
    wait_for(counted, "serve to count the four answers", DEADLINE_S)
    for n, e in view(stack.serve.url).items():
        assert e["proxy"]["in_flight"] == 0, (n, e["proxy"])


def test_a_repeat_and_an_extension_of_a_prompt_reach_the_engine_holding_its_prefix(stack: Stack) -> None:
    for base in (1000, 2000, 3000):
        prompt = list(range(base, base + 100))
        first = stack.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert first.status_code == 200, first.text
        home = served(stack, first)
        synced(stack.serve.url, stack.engines)
        again = stack.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        longer = stack.client.post("/v1/completions", json={"prompt": prompt + list(range(7, 60)), "max_tokens": 1})
        for r in (again, longer):
            assert r.status_code == 200, r.text
            assert served(stack, r) == home == r.headers["x-kvstream-engine"]
        # The engine found the prefix cached: the answer says so.
        assert cached(again.json()) == (len(prompt) - 1) // BLOCK * BLOCK
        assert cached(longer.json()) == len(prompt) // BLOCK * BLOCK
    # A chat extended by one more turn: the same engine, the conversation so far cached.
    msgs = [{"role": "system", "content": " ".join(["you are fine"] * 20)}, {"role": "user", "content": "hello"}]
    first = stack.client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    home = served(stack, first)
    synced(stack.serve.url, stack.engines)
    more = msgs + [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "how are you"}]
    with stack.client.stream("POST", "/v1/chat/completions",
                             json={"messages": more, "max_tokens": 2, "stream": True,
                                   "stream_options": {"include_usage": True}}) as r:
        assert served(stack, r) == home
        usage = [c for c in sse(r) if c.get("usage")][-1]
    assert cached(usage) >= first.json()["usage"]["prompt_tokens"] // BLOCK * BLOCK - BLOCK
    # Predicted and realized agree (the index is exact): the accuracy serve reports.
    acc = view(stack.serve.url)[home]["proxy"]["routing_accuracy"]
    assert acc["requests"] >= 2 and acc["exact"] == acc["requests"], acc


def test_a_body_that_is_no_openai_request_gets_vllms_400_from_the_gateway(stack: Stack) -> None:
    r = stack.client.post("/v1/completions", content=b'{"prompt": [1, 2,', headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and "JSON" in err["message"]
    assert "x-gateway-destination-endpoint-served" not in r.headers  # no engine saw it
    r = stack.client.post("/v1/chat/completions", json={"messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = stack.client.post("/v1/completions", json=[1, 2, 3])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_requests_it_does_not_understand_pass_through_with_a_pick_by_load(stack: Stack) -> None:
    r = stack.client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "kvstream-emulated"
    # Another path with a body kvstream cannot read: the engine answers it, not the gateway.
    r = stack.client.post("/v1/embeddings", content=b"\x00\x01 not json")
    assert "x-gateway-destination-endpoint-served" in r.headers and r.headers["x-kvstream-engine"] in ("e0", "e1", "e2")
    assert r.status_code < 500


@pytest.fixture
def subset_envoy(stack: Stack, tmp_path: Any) -> Any:
    """A second Envoy before the same serve whose requests carry an endpoint subset in the
    filter metadata (the protocol's envoy.lb.subset_hint), set by Envoy's set_metadata filter."""
    made = []

    def make(subset: list[str]) -> EnvoyProc:
        from tests.gateway.conftest import extproc_address

        cfg = render(stack.engines, extproc_address(stack.serve))
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"].insert(0, {"name": "envoy.filters.http.set_metadata", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": "envoy.lb.subset_hint",
                          "value": {"x-gateway-destination-endpoint-subset": subset}}]}})
        e = EnvoyProc(cfg, tmp_path / f"envoy{len(made)}")
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


def test_the_pick_keeps_to_the_endpoint_subset_the_gateway_passes(stack: Stack, subset_envoy: Any) -> None:
    # The prompt's prefix lives on one engine; the subset allows only another one.
    prompt = list(range(5000, 5080))
    home = served(stack, stack.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}))
    synced(stack.serve.url, stack.engines)
    other = next(e for e in stack.engines if e.name != home)
    gw = subset_envoy([other.url.removeprefix("http://")])
    for body in ({"prompt": prompt, "max_tokens": 1}, {"prompt": list(range(9, 40)), "max_tokens": 1}):
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and served(stack, r) == other.name == r.headers["x-kvstream-engine"]
    # A subset naming no engine kvstream knows: the protocol's 503, from the gateway.
    r = httpx.post(subset_envoy(["127.0.0.1:1"]).url + "/v1/completions", json={"prompt": [1, 2, 3]}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503


def test_a_gateway_sending_the_body_buffered_after_the_headers_gets_the_same_picks(stack: Stack,
                                                                                    tmp_path: Any) -> None:
    # Envoy's other body mode: the headers answered first, the whole body afterwards.
    from tests.gateway.conftest import extproc_address

    cfg = render(stack.engines, extproc_address(stack.serve))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    picker = hcm["http_filters"][0]["typed_config"]
    picker["processing_mode"]["request_body_mode"] = "BUFFERED"
    picker.pop("send_body_without_waiting_for_header_response")
    gw = EnvoyProc(cfg, tmp_path / "buffered")
    try:
        prompt = list(range(7000, 7090))
        home = served(stack, stack.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}))
        synced(stack.serve.url, stack.engines)
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)
        assert r.status_code == 200 and served(stack, r) == home == r.headers["x-kvstream-engine"]
        assert cached(r.json()) == (len(prompt) - 1) // BLOCK * BLOCK
        bad = httpx.post(gw.url + "/v1/chat/completions", content=b"nope", timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
    finally:
        gw.stop()
