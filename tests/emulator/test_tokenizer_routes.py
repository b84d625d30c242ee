"""``kvstream engine``'s tokenizer routes, as routers call them (vLLM's shapes): a real process."""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from kvstream.emulator.launch import Proc, start_engine

CHATML = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    with start_engine("e0", events=None, extra=["--max-model-len", "4096"],
                      log_dir=str(tmp_path_factory.mktemp("logs"))) as proc:
        yield proc


def test_tokenize_gives_the_ids_a_completion_of_the_same_text_computes(engine: Proc) -> None:
    with httpx.Client(base_url=engine.url) as c:
        tok = c.post("/tokenize", json={"model": "kvstream-emulated", "prompt": "hello"}).json()
        done = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1}).json()
    assert tok == {"count": 5, "max_model_len": 4096, "tokens": list(b"hello"), "token_strs": None}
    assert done["usage"]["prompt_tokens"] == tok["count"]


def test_tokenize_messages_renders_the_chat_template(engine: Proc) -> None:
    with httpx.Client(base_url=engine.url) as c:
        tok = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tok["tokens"] == list(CHATML.encode())


def test_detokenize_is_the_inverse(engine: Proc) -> None:
    with httpx.Client(base_url=engine.url) as c:
        assert c.post("/detokenize", json={"tokens": list(b"round trip")}).json() == {"prompt": "round trip"}
        bad = c.post("/detokenize", json={"tokens": ["x"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_completions_render_answers_one_entry_per_prompt(engine: Proc) -> None:
    with httpx.Client(base_url=engine.url) as c:
        one = c.post("/v1/completions/render", json={"prompt": "ab"}).json()
        many = c.post("/v1/completions/render", json={"prompt": ["ab", [99, 100]]}).json()
    assert one == [{"prompt_token_ids": [97, 98], "prompt": "ab"}]
    assert many == [{"prompt_token_ids": [97, 98], "prompt": "ab"}, {"prompt_token_ids": [99, 100], "prompt": "cd"}]


def test_chat_render_answers_the_conversation_and_the_engine_prompt(engine: Proc) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=engine.url) as c:
        conversation, prompts = c.post("/v1/chat/completions/render", json={"messages": messages}).json()
    assert conversation == messages
    assert prompts == [{"prompt_token_ids": list(CHATML.encode()), "prompt": CHATML}]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions/render"])
def test_an_unknown_model_is_vllms_404(engine: Proc, path: str) -> None:
    with httpx.Client(base_url=engine.url) as c:
        r = c.post(path, json={"model": "another-model", "prompt": "x"})
    assert r.status_code == 404 and "another-model" in r.json()["error"]["message"]


def test_garbage_is_a_json_400_not_a_500(engine: Proc) -> None:
    with httpx.Client(base_url=engine.url) as c:
        for path in ("/tokenize", "/detokenize", "/v1/completions/render", "/v1/chat/completions/render"):
            r = c.post(path, content=b"{not json")
            assert r.status_code == 400 and "error" in r.json(), (path, r.text)
            r = c.post(path, json={"prompt": 5, "messages": 5, "tokens": 5})
            assert r.status_code == 400 and "error" in r.json(), (path, r.text)
