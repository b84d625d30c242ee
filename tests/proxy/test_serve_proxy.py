"""``kvstream serve --proxy`` with real processes: emulated engines behind the service."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from kvstream.emulator.launch import Proc, start_engine, start_serve_proxy
from tests.proxy.test_full_stack import ENGINE_OPTS, published, wait_for
from tests.proxy.test_tokenize import CHATML, _model_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, list[Proc]]]:
    logs = str(tmp_path_factory.mktemp("logs"))
    model = _model_dir(tmp_path_factory.mktemp("tok"), "chatml", CHATML, bos=False)
    engines = [start_engine(f"e{i}", extra=[*ENGINE_OPTS, "--tokenizer", str(model)], log_dir=logs)
               for i in range(2)]
    try:
        serve = start_serve_proxy(engines, log_dir=logs,
                                  extra=["--tokenizer", str(model), "--proxy-backoff", "5", "--load-interval", "0"])
        try:
            yield serve, engines
        finally:
            serve.stop()
    finally:
        for e in engines:
            e.stop()


def view(serve: Proc) -> dict[str, Any]:
    return {e["name"]: e for e in httpx.get(serve.url + "/v1/engines").json()["engines"]}


def synced(serve: Proc, engines: list[Proc]) -> None:
    def ok() -> bool:
        v = view(serve)
        seqs = {n: -1 if e["applied_seq"] is None else e["applied_seq"] for n, e in v.items()}
        return all(published(e) == 0 or seqs[e.name] >= published(e) - 1 for e in engines)
    wait_for(ok, "the service's index to catch up")


def test_the_service_proxies_by_prefix_and_reports_accuracy_beside_its_own_api(
        served: tuple[Proc, list[Proc]]) -> None:
    serve, engines = served
    msgs = [{"role": "system", "content": " ".join(["be brief"] * 40)}, {"role": "user", "content": "hello"}]
    first = httpx.post(serve.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert first.status_code == 200, first.text
    home = first.headers["x-kvstream-engine"]
    synced(serve, engines)
    with httpx.stream("POST", serve.url + "/v1/chat/completions", timeout=30,
                      json={"messages": msgs[:1] + [{"role": "user", "content": "how are you"}], "max_tokens": 3,
                            "stream": True}) as r:
        assert r.headers["x-kvstream-engine"] == home
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 1 + 1 + 3  # role chunk, 3 tokens, DONE
    acc = view(serve)[home]["proxy"]["routing_accuracy"]
    assert acc["requests"] == 2 and acc["exact"] == 2 and acc["realized_tokens"] >= 80
    # The service's own API is still there, and its metrics include the proxy's.
    route = httpx.post(serve.url + "/v1/route", json={"token_ids": list(range(1, 40))})
    assert route.status_code == 200 and route.json()["engine"] in ("e0", "e1")
    assert "kvstream_proxy_predicted_cached_tokens_bucket" in httpx.get(serve.url + "/metrics").text
    assert httpx.get(serve.url + "/v1/models").json()["data"][0]["id"] == "kvstream-emulated"


def test_the_service_fails_over_when_an_engine_dies(served: tuple[Proc, list[Proc]], tmp_path: Path) -> None:
    serve, engines = served
    prompt = list(range(7000, 7100))
    home = httpx.post(serve.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).headers[
        "x-kvstream-engine"]
    synced(serve, engines)
    next(e for e in engines if e.name == home).kill()
    r = httpx.post(serve.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-kvstream-engine"] != home
    v = view(serve)[home]
    # Down for the proxy; its index untouched (only its event stream says what it holds).
    assert v["proxy"]["failures"] == 1 and v["proxy"]["state"] == "down" and v["index_stale"] is False
