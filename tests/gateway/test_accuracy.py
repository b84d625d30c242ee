"""Routing accuracy through Envoy + the ext_proc picker equals proxy mode's on the same
workload: the same engines picked, the same predicted and realized cached tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from kvstream.emulator.launch import start_engine, start_serve_proxy
from tests.gateway.conftest import DEADLINE_S, Stack, synced, view
from tests.proxy.test_full_stack import ENGINE_OPTS


def warmup() -> list[tuple[int, str, dict[str, Any]]]:
    """Prefixes put on chosen engines directly (engine index, path, body), so the workload's
    picks spread over the engines by what they hold."""
    out = []
    for i in range(3):
        out.append((i, "/v1/completions", {"prompt": list(range(2000 + 500 * i, 2000 + 500 * i + 70)), "max_tokens": 1}))
        out.append((i, "/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEMS[i]}], "max_tokens": 1}))
    return out


SYSTEMS = [" ".join([w] * 25) for w in ("be brief", "you are fine", "how are you")]


def workload() -> list[tuple[str, dict[str, Any]]]:
    """Conversations and shared prefixes: completions (token ids) and chat, streamed (with
    usage) and not; each request sent once the index holds the previous ones' blocks."""
    out: list[tuple[str, dict[str, Any]]] = []
    for c in range(3):
        msgs = [{"role": "system", "content": SYSTEMS[(c + 1) % 3]}, {"role": "user", "content": "hello " * (c + 1)}]
        for turn in range(3):
            stream = turn % 2 == 1
            body: dict[str, Any] = {"messages": list(msgs), "max_tokens": 2}
            if stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            out.append(("/v1/chat/completions", body))
            msgs += [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "how are you"}]
    for p in range(3):
        base = list(range(2000 + 500 * p, 2000 + 500 * p + 70))
        for k, tail in enumerate(([], list(range(20, 45)), list(range(20, 90)))):
            body = {"prompt": base + tail, "max_tokens": 1}
            if k == 1:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            out.append(("/v1/completions", body))
    return out


def run(url: str, serve_url: str, engines: list[Any]) -> tuple[list[str], dict[str, Any]]:
    """Send the workload to ``url``; the engines picked, and serve's accuracy per engine."""
    picked = []
    for i, path, body in warmup():
        assert httpx.post(engines[i].url + path, json=body, timeout=60).status_code == 200
    with httpx.Client(base_url=url, timeout=60) as c:
        for path, body in workload():
            synced(serve_url, engines)
            if body.get("stream"):
                with c.stream("POST", path, json=body) as r:
                    assert r.status_code == 200
                    r.read()
            else:
                r = c.post(path, json=body)
                assert r.status_code == 200, r.text
            picked.append(r.headers["x-kvstream-engine"])

    def all_counted() -> dict[str, Any] | None:
        v = view(serve_url)
        acc = {n: e["proxy"]["routing_accuracy"] for n, e in v.items() if "proxy" in e}
        return acc if sum(a["requests"] for a in acc.values()) == len(picked) else None

    from tests.service.conftest import wait_for

    return picked, wait_for(all_counted, "every answer to be counted", DEADLINE_S)


def test_routing_accuracy_through_envoy_equals_proxy_modes(model_dir: Path, tmp_path: Path) -> None:
    logs = str(tmp_path / "logs")
    opts = [*ENGINE_OPTS, "--tokenizer", str(model_dir)]
    engines = [start_engine(f"e{i}", extra=opts, log_dir=logs) for i in range(3)]
    try:
        serve = start_serve_proxy(engines, log_dir=logs, extra=["--tokenizer", str(model_dir), "--load-interval", "0"])
        try:
            proxied, proxy_acc = run(serve.url, serve.url, engines)
        finally:
            serve.stop()
    finally:
        for e in engines:
            e.stop()

    stack = Stack(tmp_path / "gw", model_dir)  # fresh engines: cold caches again
    try:
        assert stack.serve is not None and stack.envoy is not None
        gated, gateway_acc = run(stack.envoy.url, stack.serve.url, stack.engines)
    finally:
        stack.close()

    assert gated == proxied
    assert gateway_acc == proxy_acc
    assert set(gated) == {"e0", "e1", "e2"}  # picked by prefix, not by a tie
    total = sum(a["realized_tokens"] for a in gateway_acc.values())
    assert total > 500 and all(a["exact"] == a["requests"] for a in gateway_acc.values()), gateway_acc
