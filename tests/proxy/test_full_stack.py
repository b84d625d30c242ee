"""The whole stack on loopback with real processes: proxy -> engines -> KV events -> router.

Two emulated engines (``kvstream engine``) and the proxy (``python -m kvstream.proxy``, which
is ``kvstream serve --proxy``), all with the same small real tokenizer; requests go through
the proxy over HTTP.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from kvstream.emulator.launch import Proc, start_engine, start_proxy
from tests.proxy.test_tokenize import CHATML, _model_dir

ENGINE_OPTS = ["--num-gpu-blocks", "512", "--decode-tokens-per-s", "200", "--max-model-len", "4096"]


def wait_for(cond: Callable[[], Any], what: str, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def published(engine: Proc) -> int:
    text = httpx.get(engine.url + "/metrics").text
    m = re.search(r"^kvstream:kv_event_batches_published_total\{[^}]*\} (\S+)$", text, re.M)
    assert m, text
    return int(float(m.group(1)))


def engines_view(proxy: Proc) -> dict[str, Any]:
    body = httpx.get(proxy.url + "/v1/engines").json()
    return {e["name"]: e for e in body["engines"]}


def total_accuracy(proxy: Proc) -> dict[str, int]:
    """The proxy's routing accuracy summed over its engines."""
    accs = [e["proxy"]["routing_accuracy"] for e in engines_view(proxy).values()]
    return {k: sum(a[k] for a in accs) for k in ("requests", "exact", "predicted_tokens", "realized_tokens")}


def metric(proxy: Proc, name: str) -> float:
    text = httpx.get(proxy.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def synced(proxy: Proc, engines: list[Proc]) -> None:
    """Wait until the proxy's index holds every batch each engine published."""
    def ok() -> bool:
        view = engines_view(proxy)
        for e in engines:
            n = published(e)
            seq = view[e.name]["applied_seq"]
            if n and (seq is None or seq < n - 1):
                return False
        return True
    wait_for(ok, "the proxy's index to catch up with the engines")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("tok"), "chatml", CHATML, bos=False)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, list[Proc]]]:
    logs = str(tmp_path_factory.mktemp("logs"))
    ipc = tmp_path_factory.mktemp("ipc")
    opts = [*ENGINE_OPTS, "--tokenizer", str(model_dir)]
    # ipc endpoints always bind (vLLM's rule), so a restarted engine can take the same ones.
    engines = [start_engine(f"e{i}", events=f"ipc://{ipc}/e{i}.pub", replay=f"ipc://{ipc}/e{i}.replay",
                            extra=opts, log_dir=logs) for i in range(2)]
    try:
        proxy = start_proxy(engines, extra=["--tokenizer", str(model_dir), "--proxy-backoff", "0.3"], log_dir=logs)
        try:
            yield proxy, engines
        finally:
            proxy.stop()
    finally:
        for e in engines:
            e.stop()


def complete(proxy: Proc, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(proxy.url + path, json=body, timeout=30)


def cached(r: httpx.Response) -> int:
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_requests_follow_their_prefix_and_predictions_equal_what_engines_reuse(stack: tuple[Proc, list[Proc]]) -> None:
    proxy, engines = stack
    shared = list(range(100, 164))  # 64 tokens = 4 blocks
    first = complete(proxy, {"prompt": shared + [1, 2, 3], "max_tokens": 3})
    assert first.status_code == 200, first.text
    home = first.headers["x-kvstream-engine"]
    synced(proxy, engines)
    for tail in ([4, 5, 6], [7] * 20, [8] * 40):
        r = complete(proxy, {"prompt": shared + tail, "max_tokens": 3})
        assert r.headers["x-kvstream-engine"] == home
        assert cached(r) >= 64
        synced(proxy, engines)
    acc = total_accuracy(proxy)
    assert acc["requests"] >= 4 and acc["exact"] == acc["requests"], acc
    prom = httpx.get(proxy.url + "/metrics").text
    assert f'kvstream_proxy_cached_tokens_error_bucket{{engine="{home}",le="0.0"}}' in prom


def test_streaming_is_passed_through_event_by_event_without_the_usage_chunk_it_added(
        stack: tuple[Proc, list[Proc]]) -> None:
    proxy, _ = stack
    with httpx.stream("POST", proxy.url + "/v1/completions", json={"prompt": [9] * 50, "max_tokens": 5,
                                                                   "stream": True}) as r:
        assert r.status_code == 200 and r.headers["x-kvstream-engine"] in ("e0", "e1")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len(chunks) == 5 and all(c["choices"] for c in chunks)  # no usage-only chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_requests_are_rendered_with_the_template_and_predicted_exactly(stack: tuple[Proc, list[Proc]]) -> None:
    proxy, engines = stack
    msgs = [{"role": "system", "content": " ".join(["be brief"] * 40)}, {"role": "user", "content": "hello there"}]
    a = complete(proxy, {"messages": msgs, "max_tokens": 2}, "/v1/chat/completions")
    assert a.status_code == 200, a.text
    synced(proxy, engines)
    before = total_accuracy(proxy)
    b = complete(proxy, {"messages": msgs + [{"role": "assistant", "content": "fine"},
                                             {"role": "user", "content": "how are you"}], "max_tokens": 2},
                 "/v1/chat/completions")
    assert b.headers["x-kvstream-engine"] == a.headers["x-kvstream-engine"]
    assert cached(b) >= 80  # the system prompt's 80+ tokens
    after = total_accuracy(proxy)
    assert after["exact"] - before["exact"] == 1 and after["requests"] - before["requests"] == 1


def test_engine_errors_come_back_unchanged(stack: tuple[Proc, list[Proc]]) -> None:
    proxy, _ = stack
    r = complete(proxy, {"model": "nope", "prompt": [1, 2, 3]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert r.headers["x-kvstream-engine"] in ("e0", "e1")
    r = httpx.post(proxy.url + "/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = complete(proxy, {"messages": [{"role": "user", "content": 1}]}, "/v1/chat/completions")
    assert r.status_code == 400
    assert httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"] == "kvstream-emulated"


def test_killed_engine_fails_over_keeps_its_index_and_comes_back(stack: tuple[Proc, list[Proc]], model_dir: Path,
                                                                tmp_path: Path) -> None:
    proxy, engines = stack
    prompt = list(range(3000, 3064)) + [1]
    home = complete(proxy, {"prompt": prompt, "max_tokens": 2}).headers["x-kvstream-engine"]
    synced(proxy, engines)
    idx = [e.name for e in engines].index(home)
    victim = engines[idx]
    port = int(victim.url.rsplit(":", 1)[1])
    victim.kill()
    r = complete(proxy, {"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-kvstream-engine"] != home
    view = engines_view(proxy)
    # Marked down (for a 0.3 s backoff, maybe over by now). Its index is not marked stale:
    # an HTTP failure says nothing about which blocks it holds; its event stream decides.
    assert view[home]["proxy"]["failures"] >= 1 and view[home]["proxy"]["last_error"]
    assert view[home]["index_stale"] is False
    assert metric(proxy, "kvstream_proxy_failovers_total") >= 1
    # Same addresses again: the proxy notices by itself once the backoff has passed.
    engines[idx] = start_engine(home, port=port, events=victim.events, replay=victim.replay,
                                extra=[*ENGINE_OPTS, "--tokenizer", str(model_dir)], log_dir=str(tmp_path))

    def served_by_home() -> bool:
        # Long enough to fill a block: the new engine's first events reveal its restart.
        fresh = complete(proxy, {"prompt": [time.monotonic_ns() % 100000] * 40, "max_tokens": 1})
        return fresh.headers.get("x-kvstream-engine") == home
    wait_for(served_by_home, f"{home} to serve again")

    def reset() -> bool:
        # Traffic goes on (a PUB drops what it sends before the subscriber reconnects).
        served_by_home()
        v = engines_view(proxy)[home]
        return v["restarts"] >= 1 and v["state"] == "live"
    wait_for(reset, f"{home}'s restart to be seen on its stream")
    synced(proxy, engines)
    assert engines_view(proxy)[home]["proxy"]["state"] == "up"


def test_a_client_that_goes_away_mid_stream_frees_the_engine_and_the_load(stack: tuple[Proc, list[Proc]]) -> None:
    proxy, engines = stack
    with httpx.stream("POST", proxy.url + "/v1/completions",
                      json={"prompt": [11] * 30, "max_tokens": 2000, "stream": True}, timeout=30) as r:
        name = r.headers["x-kvstream-engine"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token, then hang up
    engine = next(e for e in engines if e.name == name)

    def running() -> float:
        text = httpx.get(engine.url + "/metrics").text
        m = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
        assert m
        return float(m.group(1))
    wait_for(lambda: running() == 0.0, "the engine to drop the abandoned request")
    wait_for(lambda: engines_view(proxy)[name]["proxy"]["in_flight"] == 0, "the proxy to forget it")
