"""``kvstream engine`` as a real process: the OpenAI API, vLLM's errors and metrics, timing."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from kvstream.cli import main
from kvstream.emulator.launch import Proc, start_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    with start_engine("e0", extra=["--prefill-tokens-per-s", "2000", "--decode-tokens-per-s", "100",
                                   "--max-model-len", "2048", "--num-gpu-blocks", "256"],
                      log_dir=str(tmp_path_factory.mktemp("logs"))) as proc:
        yield proc


def sse(text: str) -> list[dict]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[6:]))
    return out


def test_completion_reports_cached_tokens_and_is_deterministic(engine: Proc) -> None:
    prompt = list(range(1000, 1040))
    with httpx.Client(base_url=engine.url) as c:
        first = c.post("/v1/completions", json={"model": "kvstream-emulated", "prompt": prompt, "max_tokens": 5})
        second = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5})
    assert first.status_code == 200 and second.status_code == 200
    a, b = first.json(), second.json()
    assert a["object"] == "text_completion" and a["choices"][0]["finish_reason"] == "length"
    assert a["usage"]["prompt_tokens"] == 40 and a["usage"]["completion_tokens"] == 5
    assert "prompt_tokens_details" not in a["usage"]  # vLLM leaves it out when nothing was cached
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and len(a["choices"][0]["text"]) == 5


def test_streaming_chat_sends_one_chunk_per_token_then_usage_and_done(engine: Proc) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    with httpx.Client(base_url=engine.url) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    chunks = sse(r.text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 4 and tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    # The byte tokenizer's ChatML rendering: <|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n
    assert chunks[-1]["usage"]["prompt_tokens"] == len("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")


def test_bad_requests_get_vllm_shaped_json_errors(engine: Proc) -> None:
    with httpx.Client(base_url=engine.url) as c:
        malformed = c.post("/v1/completions", content=b'{"prompt": [1, 2', headers={"content-type": "application/json"})
        unknown = c.post("/v1/completions", json={"model": "gpt-17", "prompt": [1, 2]})
        oversized = c.post("/v1/completions", json={"prompt": [1] * 2040, "max_tokens": 16})
        no_prompt = c.post("/v1/chat/completions", json={"messages": []})
        huge = c.post("/v1/completions", content=b" " * (17 << 20), headers={"content-type": "application/json"})
    for r, status, kind in ((malformed, 400, "BadRequestError"), (unknown, 404, "NotFoundError"),
                            (oversized, 400, "BadRequestError"), (no_prompt, 400, "BadRequestError"),
                            (huge, 413, "BadRequestError")):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == kind and err["code"] == status
    assert "The model `gpt-17` does not exist." == unknown.json()["error"]["message"]
    assert "maximum context length is 2048 tokens" in oversized.json()["error"]["message"]


def test_models_health_and_vllm_metric_names(engine: Proc) -> None:
    with httpx.Client(base_url=engine.url) as c:
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()
        metrics = c.get("/metrics").text
    assert models["data"][0]["id"] == "kvstream-emulated" and models["data"][0]["max_model_len"] == 2048
    for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{",
                 "vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{", "vllm:num_preemptions_total{"):
        assert name in metrics


def test_vllms_latency_histograms_count_finished_requests(engine: Proc) -> None:
    # A vLLM dashboard reads these; the same names, labels and buckets as vLLM's.
    import re

    names = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
             "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
             "inter_token_latency_seconds", "time_per_output_token_seconds")

    def counts(text: str) -> dict[str, float]:
        out = {}
        for n in names:
            m = re.search(rf'^vllm:{n}_count{{engine="0",model_name="kvstream-emulated"}} (\S+)$', text, re.M)
            assert m, n
            out[n] = float(m.group(1))
        return out

    with httpx.Client(base_url=engine.url) as c:
        before = counts(c.get("/metrics").text)
        assert c.post("/v1/completions", json={"prompt": [3] * 100, "max_tokens": 4}).status_code == 200
        text = c.get("/metrics").text
    after = counts(text)
    for n in names[:6]:
        assert after[n] == before[n] + 1, n
    assert after["inter_token_latency_seconds"] == before["inter_token_latency_seconds"] + 3  # 4 tokens, 3 gaps
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="kvstream-emulated"}' in text


def test_batched_prompts_get_one_choice_each_and_usage_summed(engine: Proc) -> None:
    with httpx.Client(base_url=engine.url) as c:
        r = c.post("/v1/completions", json={"prompt": [[1, 2, 3], [4, 5, 6, 7]], "max_tokens": 2})
        texts = c.post("/v1/completions", json={"prompt": ["ab", "cde"], "max_tokens": 1})
    assert r.status_code == 200 and texts.status_code == 200
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    assert [ch["index"] for ch in texts.json()["choices"]] == [0, 1]


def test_time_to_first_token_skips_the_cached_prefix(engine: Proc) -> None:
    prompt = list(range(5000, 6200))  # 1200 tokens: 0.6 s of prefill at 2000 tokens/s

    def ttft(c: httpx.Client) -> float:
        t0 = time.perf_counter()
        with c.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return time.perf_counter() - t0
        raise AssertionError("no token")

    with httpx.Client(base_url=engine.url) as c:
        cold = ttft(c)
        warm = ttft(c)
    assert cold >= 0.6
    assert warm < cold / 2


def test_cli_refuses_bad_configuration_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine", "--kv-events-config", "{nope"]) == 2
    assert "--kv-events-config is not valid JSON" in capsys.readouterr().err
    assert main(["engine", "--kv-events-config", '{"endpont": "tcp://*:1"}']) == 2
    assert "unknown KVEventsConfig keys ['endpont']" in capsys.readouterr().err
    assert main(["engine", "--model-config", "/nonexistent.json", "--gpu-memory", "80"]) == 2
    assert "cannot read --model-config" in capsys.readouterr().err


def test_model_config_sizes_the_cache_as_kvstream_plan_does(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstream.cli import build_parser
    from kvstream.cli.engine import build_config

    cfg_path = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "llama-3-8b.json")
    common = [cfg_path, "--gpu-memory", "80GiB", "--model-weights-gib", "15"]
    assert main(["plan", *common, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["num_blocks"]
    args = build_parser().parse_args(["engine", "--model-config", *common])
    cfg = build_config(args)
    assert cfg.num_gpu_blocks == planned and cfg.max_model_len == 8192


def test_event_port_in_use_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})
        assert main(["engine", "--port", "0", "--kv-events-config", cfg]) == 2
    assert "cannot open the KV event sockets" in capsys.readouterr().err


def test_events_disabled_in_the_config_publish_nothing_whatever_the_publisher_says(tmp_path: Path) -> None:
    """vLLM gives a null publisher when ``enable_kv_cache_events`` is false; so does the
    emulator (it used to bind and publish anyway), and it says so in one line."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {"enable_kv_cache_events": False, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    with start_engine("off", events=None, extra=["--kv-events-config", json.dumps(cfg)],
                      log_dir=str(tmp_path)) as proc:
        assert " events off " in proc.ready_line, proc.ready_line
        r = httpx.post(proc.url + "/v1/completions", json={"prompt": list(range(1, 40)), "max_tokens": 1})
        assert r.status_code == 200
        text = httpx.get(proc.url + "/metrics").text
        assert "kvstream:kv_event_batches_published_total" in text and \
            'kvstream:kv_event_batches_published_total{engine="0",model_name="kvstream-emulated"} 0.0' in text
        with socket.socket() as s:  # nothing bound the endpoint
            s.bind(("127.0.0.1", port))
        assert '"enable_kv_cache_events" is false' in proc.log_tail()
