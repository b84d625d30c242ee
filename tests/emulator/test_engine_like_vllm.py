"""Where the emulated engine disagreed with vLLM's OpenAI server as a client sees it,
found by sending it what clients send. A real ``kvstream engine`` process.

Expected behaviour is vLLM's (checked against its sources, vLLM 0.11-0.33):
* ``SamplingParams._verify_args`` refuses out-of-range sampling fields with 400 and
  these messages ("temperature must be non-negative, got -1.0." ...);
* the request models refuse ``stream_options`` without ``stream: true``
  ("Stream options can only be defined when `stream=True`.", param ``stream_options``);
* the input processor refuses a prompt token id outside the vocabulary with 400
  ("Token id X is out of vocabulary"); the emulator answered 500 for ids >= 2**64 (it now
  refuses ids >= 2**32, above any real vocabulary);
* its HTTPException handler answers an unknown path or method in the error shape
  ``{"error": {"message": "Not Found", "type": "Not Found", "param": null, "code": 404}}``
  (``type`` is the HTTP reason phrase);
* ``stream_options: {"include_usage": true, "continuous_usage_stats": true}`` puts the
  counts so far on every chunk.
"""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest

from kvstream.emulator.launch import Proc, start_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    with start_engine("e0", extra=["--max-model-len", "512", "--num-gpu-blocks", "128"],
                      log_dir=str(tmp_path_factory.mktemp("logs"))) as proc:
        yield proc


def _error(r: httpx.Response, status: int, param: str | None, *needles: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param
    for n in needles:
        assert n in err["message"], err["message"]


BAD_SAMPLING = [
    ({"temperature": -1}, "temperature", "temperature must be non-negative, got -1.0."),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0."),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k", "top_k must be 0 (disable), or at least 1, got -2."),
    ({"min_p": 2}, "min_p", "min_p must be in [0, 1], got 2.0."),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must be in [-2, 2], got 3.0."),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be greater than zero, got 0.0."),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "min_tokens must be less than or equal to max_tokens=2"),
    ({"seed": 2**70}, "seed", "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`."),
]


@pytest.mark.parametrize("fields,param,message", BAD_SAMPLING, ids=[c[1] + str(i) for i, c in enumerate(BAD_SAMPLING)])
def test_sampling_fields_vllm_refuses_are_refused_with_its_message(engine: Proc, fields, param, message) -> None:
    with httpx.Client(base_url=engine.url) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, **fields})
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2, **fields})
    _error(r, 400, param, message)
    _error(chat, 400, param, message)


def test_sampling_fields_in_range_are_accepted(engine: Proc) -> None:
    with httpx.Client(base_url=engine.url) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.7, "top_p": 1,
                                            "top_k": -1, "min_p": 0, "presence_penalty": -2, "seed": -5,
                                            "repetition_penalty": 1.1, "min_tokens": 2, "stream": False})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("token_id", [2**32, 2**63, 2**64, 2**64 + 5, 10**30])
def test_a_token_id_outside_any_vocabulary_is_a_400_not_a_500(engine: Proc, token_id: int) -> None:
    with httpx.Client(base_url=engine.url) as c:
        r = c.post("/v1/completions", json={"prompt": [1, token_id], "max_tokens": 2})
        after = c.post("/v1/completions", json={"prompt": [1, 2**32 - 1], "max_tokens": 2})
    _error(r, 400, "prompt", f"Token id {token_id} is out of vocabulary")
    assert after.status_code == 200  # the largest id still accepted, and the engine still serves


@pytest.mark.parametrize("method,path,status,phrase", [
    ("GET", "/v1/no-such-route", 404, "Not Found"),
    ("POST", "/tokenizer_info_that_does_not_exist", 404, "Not Found"),
    ("GET", "/v1/completions", 405, "Method Not Allowed"),
    ("DELETE", "/v1/models", 405, "Method Not Allowed"),
])
def test_unknown_paths_and_methods_answer_in_vllms_error_shape(engine: Proc, method, path, status, phrase) -> None:
    with httpx.Client(base_url=engine.url) as c:
        r = c.request(method, path)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": phrase, "type": phrase, "param": None, "code": status}}


def _sse(text: str) -> list[dict]:
    return [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: ") and b != "data: [DONE]"]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_put_the_counts_so_far_on_every_chunk(engine: Proc, kind: str) -> None:
    body: dict = {"max_tokens": 3, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = [5, 6, 7, 8]
    with httpx.Client(base_url=engine.url) as c:
        r = c.post(f"/v1/{'chat/' if kind == 'chat' else ''}completions", json=body)
    chunks = _sse(r.text)
    assert all("usage" in ch for ch in chunks)
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    outs = [ch["usage"]["completion_tokens"] for ch in chunks if ch["choices"]]
    assert outs == ([0] if kind == "chat" else []) + [1, 2, 3]
    assert all(ch["usage"]["total_tokens"] == prompt + ch["usage"]["completion_tokens"] for ch in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    # without continuous_usage_stats only the last chunk carries usage
    body["stream_options"] = {"include_usage": True}
    with httpx.Client(base_url=engine.url) as c:
        r = c.post(f"/v1/{'chat/' if kind == 'chat' else ''}completions", json=body)
    assert [("usage" in ch) for ch in _sse(r.text)][-2:] == [False, True]


def test_models_lists_a_vllm_model_card(engine: Proc) -> None:
    # vLLM's ModelCard (protocol.py): owned_by "vllm", max_model_len, one ModelPermission.
    with httpx.Client(base_url=engine.url) as c:
        body = c.get("/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    assert card["object"] == "model" and card["owned_by"] == "vllm" and card["max_model_len"] == 512
    assert card["root"] == card["id"] and card["parent"] is None
    (perm,) = card["permission"]
    assert perm["object"] == "model_permission" and perm["allow_sampling"] is True and perm["organization"] == "*"


def test_metrics_read_like_vllms_exporter(engine: Proc) -> None:
    """vLLM's v1 loggers: ``vllm:request_success`` has a ``finished_reason`` label with one
    series per reason from the start; prometheus_client names a counter family with its
    ``_total`` suffix in HELP and TYPE."""
    with httpx.Client(base_url=engine.url) as c:
        assert c.post("/v1/completions", json={"prompt": [9, 9, 9], "max_tokens": 2}).status_code == 200
        text = c.get("/metrics").text
    lines = text.splitlines()
    success = {ln.split("finished_reason=")[1].split('"')[1]: float(ln.rsplit(" ", 1)[1])
               for ln in lines if ln.startswith("vllm:request_success_total{")}
    assert set(success) == {"stop", "length", "abort"} and success["length"] >= 1 and success["stop"] == 0
    assert all('model_name="kvstream-emulated"' in ln and 'engine="0"' in ln
               for ln in lines if ln.startswith("vllm:request_success_total{"))
    for family in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_hits_total"):
        assert f"# TYPE {family} counter" in lines and f"# HELP {family} " in text
    assert "# TYPE vllm:num_requests_running gauge" in lines
