"""Text prompts without ``--tokenizer`` (real processes): ``serve --proxy`` learns from the
engines' own ``/tokenize`` that they take UTF-8 bytes (``kvstream engine``) and routes text
and chat by cached prefix; in front of an engine with a real tokenizer it says once, with
the fix, that text is routed by load only."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from kvstream.emulator.launch import Proc
from tests.proxy.stack import engines_and_proxy
from tests.proxy.test_full_stack import wait_for
from tests.proxy.test_tokenize import CHATML, _model_dir

OPTS = ["--num-gpu-blocks", "512", "--max-model-len", "4096"]


@pytest.fixture(scope="module")
def byte_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, list[Proc]]]:
    with engines_and_proxy(str(tmp_path_factory.mktemp("logs")), OPTS, ["--log-level", "info"]) as stack:
        yield stack


def test_a_repeated_text_prompt_goes_where_its_prefix_is_and_is_predicted_exactly(
        byte_stack: tuple[Proc, list[Proc]]) -> None:
    proxy, _ = byte_stack
    text = "The quick brown fox jumps over the lazy dog. " * 20  # 900 bytes: 56 blocks
    with httpx.Client(base_url=proxy.url, timeout=60) as c:
        home = c.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).headers["x-kvstream-engine"]

        def reused() -> bool:
            r = c.post("/v1/completions", json={"prompt": text + "Again?", "max_tokens": 1})
            return r.headers["x-kvstream-engine"] == home and r.json()["usage"]["prompt_tokens_details"][
                "cached_tokens"] == 896

        wait_for(reused, "the text prompt's prefix to be routed to")
        accuracy = {e["name"]: e["proxy"]["routing_accuracy"] for e in c.get("/v1/engines").json()["engines"]}
    assert accuracy[home]["predicted_tokens"] >= 896
    assert "routed by cached prefix with the same tokenization" in proxy.log_tail(20000)


def test_chat_without_a_tokenizer_is_routed_by_prefix_too(byte_stack: tuple[Proc, list[Proc]]) -> None:
    proxy, _ = byte_stack
    messages = [{"role": "system", "content": "You answer in haiku. " * 30}, {"role": "user", "content": "Hi"}]
    with httpx.Client(base_url=proxy.url, timeout=60) as c:
        first = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert first.status_code == 200
        home = first.headers["x-kvstream-engine"]

        def reused() -> bool:
            r = c.post("/v1/chat/completions", json={"messages": messages[:1] + [{"role": "user", "content": "Ho"}],
                                                     "max_tokens": 1})
            return r.headers["x-kvstream-engine"] == home and r.json()["usage"]["prompt_tokens_details"][
                "cached_tokens"] >= 640

        wait_for(reused, "the chat's shared system prompt to be routed to")


def test_engines_with_a_real_tokenizer_leave_text_routed_by_load_and_say_how_to_fix_it(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, "m", CHATML, bos=False)
    with engines_and_proxy(str(tmp_path), [*OPTS, "--tokenizer", str(model)], prefix="t") as (proxy, _):
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
        wait_for(lambda: "routed by load only" in proxy.log_tail(20000), "the warning")
        assert "--tokenizer MODEL_DIR" in proxy.log_tail(20000)
        assert proxy.log_tail(20000).count("routed by load only") == 1
        httpx.post(proxy.url + "/v1/completions", json={"prompt": "hello again", "max_tokens": 1}, timeout=60)
        assert proxy.log_tail(20000).count("routed by load only") == 1
