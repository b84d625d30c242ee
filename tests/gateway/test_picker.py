"""The endpoint picker's sans-IO core over a real service core and proxy-mode routing (no
sockets; the clock is the test's), and ``serve --ext-proc-port``'s flag and config key."""

from __future__ import annotations

import json
import subprocess
import sys
import os
from pathlib import Path
from typing import Any

import pytest

from kvstream.gateway.picker import EndpointPicker, Pick, Refusal, UsageScanner, endpoint_of
from kvstream.proxy.app import KVProxy
from kvstream.service.config import ServeConfig, parse_engine
from kvstream.service.core import ServiceCore
from tests.service.conftest import REPO, wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def picker(n: int = 3, tokenizer: Any = None) -> tuple[EndpointPicker, KVProxy, Clock]:
    cfg = ServeConfig(engines=[parse_engine(f"e{i}=tcp://127.0.0.1:{5000 + i},http=http://10.0.0.{i + 1}:8000")
                               for i in range(n)]).check()
    proxy = KVProxy.for_service(ServiceCore(cfg), tokenizer=tokenizer)
    clock = Clock()
    return EndpointPicker(proxy, clock=clock, unclaimed_s=5.0), proxy, clock


def in_flight(proxy: KVProxy) -> dict[str, int]:
    return {n: s.in_flight for n, s in proxy.core.engines.items()}


def test_endpoints_are_ip_port_of_the_engines_http_address() -> None:
    assert endpoint_of("http://10.0.0.1:8000") == "10.0.0.1:8000"
    assert endpoint_of("http://[fd00::1]:8000/v1") == "[fd00::1]:8000"
    assert endpoint_of("http://engine-0") == "engine-0:80"
    assert endpoint_of("http://") is None


def test_a_pick_lists_every_engine_to_try_best_first_and_counts_it_in_flight() -> None:
    p, proxy, _ = picker()
    out = p.request("/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode())
    assert isinstance(out, Pick)
    assert out.endpoints == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    assert out.value == ",".join(out.endpoints) and out.engine == "e0"
    assert in_flight(proxy) == {"e0": 1, "e1": 0, "e2": 0}
    # The next request sees that load: another engine first.
    assert isinstance(nxt := p.request("/v1/completions", b'{"prompt": [7, 8, 9]}'), Pick) and nxt.engine != "e0"


def test_the_answer_is_counted_for_the_engine_that_gave_it() -> None:
    p, proxy, _ = picker()
    out = p.request("/v1/completions", b'{"prompt": [1, 2, 3]}')
    assert isinstance(out, Pick)
    ex = p.claim(out.id)
    assert ex is not None and p.claim(out.id) is None  # claimed once
    ex.headers(200, "application/json", "10.0.0.1:8000")
    ex.body(b'{"usage": {"prompt_tokens": 3, "prompt_tokens_details"', False)
    ex.body(b': {"cached_tokens": 0}}}', True)
    acc = proxy.core.engines["e0"].accuracy
    assert (acc.requests, acc.exact) == (1, 1) and in_flight(proxy)["e0"] == 0
    assert proxy.core.engines["e0"].served == 1


def test_a_retry_past_the_first_endpoint_marks_it_down_and_counts_the_fallback() -> None:
    p, proxy, _ = picker()
    out = p.request("/v1/completions", b'{"prompt": [1, 2, 3]}')
    assert isinstance(out, Pick) and out.engine == "e0"
    ex = p.claim(out.id)
    assert ex is not None
    ex.headers(200, "text/event-stream", out.endpoints[1])
    assert in_flight(proxy) == {"e0": 0, "e1": 1, "e2": 0}
    ex.body(b'data: {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}\n\ndata: [DONE]\n\n',
            True)
    assert proxy.core.is_down("e0", proxy.core.engines["e0"].down_until - 0.001)
    assert proxy.core.engines["e1"].accuracy.requests == 1 and p.view()["fallbacks"] == 1
    # While it is down, e0 is not in the list at all.
    again = p.request("/v1/completions", b'{"prompt": [1, 2, 3]}')
    assert isinstance(again, Pick) and "e0" not in again.engines and again.engines


def test_a_pick_no_response_phase_claims_is_ended_after_unclaimed_s() -> None:
    p, proxy, clock = picker()
    out = p.request("/v1/completions", b'{"prompt": [1, 2, 3]}')
    assert isinstance(out, Pick) and in_flight(proxy)["e0"] == 1
    clock.t += 4.9
    p.sweep()
    assert p.view()["pending"] == 1
    clock.t += 0.2
    p.sweep()
    assert p.view() == {"picks": 1, "refused": 0, "fallbacks": 0, "unclaimed": 1, "pending": 0}
    assert in_flight(proxy)["e0"] == 0 and proxy.core.engines["e0"].served == 0
    assert p.claim(out.id) is None


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{nope", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": {"x": 1}}', 400, "prompt"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/completions?x=1", b'{"prompt": []}', 400, "prompt"),
])
def test_a_body_that_is_no_openai_request_is_refused_with_vllms_error(path: str, body: bytes, status: int,
                                                                       param: str | None, model_dir: Path) -> None:
    from kvstream.proxy.tokenize import load_tokenizer

    p, proxy, _ = picker(tokenizer=load_tokenizer(str(model_dir)))
    out = p.request(path, body)
    assert isinstance(out, Refusal) and out.status == status
    err = json.loads(out.body)["error"]
    assert err["code"] == status and err["type"] == "BadRequestError" and err["param"] == param
    assert sum(in_flight(proxy).values()) == 0


def test_other_requests_get_a_pick_by_load() -> None:
    p, _, _ = picker()
    for path, body in (("/v1/embeddings", b"\x00garbage"), ("/v1/models", b""), (None, b"not json")):
        assert isinstance(p.request(path, body), Pick)



def test_without_a_path_the_bodys_fields_say_which_call_it_is(model_dir: Path) -> None:
    from kvstream.proxy.tokenize import load_tokenizer

    p, _, _ = picker(tokenizer=load_tokenizer(str(model_dir)))
    out = p.request(None, b'{"messages": "x"}')
    assert isinstance(out, Refusal) and json.loads(out.body)["error"]["param"] == "messages"
    assert isinstance(p.request(None, b'{"messages": [{"role": "user", "content": "hello"}]}'), Pick)


def test_the_subset_bounds_the_pick_and_an_empty_one_is_a_503() -> None:
    p, _, _ = picker()
    out = p.request("/v1/completions", b'{"prompt": [1, 2, 3]}', ["10.0.0.3:8000", "10.9.9.9:1"])
    assert isinstance(out, Pick) and out.engines == ["e2"]
    for subset in ([], ["10.9.9.9:1"]):
        r = p.request("/v1/completions", b'{"prompt": [1, 2, 3]}', subset)
        assert isinstance(r, Refusal) and r.status == 503


def test_no_engines_means_no_pick() -> None:
    p, _, _ = picker(0)
    assert p.request("/v1/completions", b'{"prompt": [1]}') is None


def test_usage_is_read_from_sse_events_split_anywhere() -> None:
    text = (b'data: {"choices": [{"text": "a"}]}\n\n'
            b'data: {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 48}}}\n\ndata: [DONE]\n\n')
    for cut in range(1, len(text)):
        s = UsageScanner(sse=True)
        s.feed(text[:cut])
        s.feed(text[cut:])
        assert s.close() == 48
    j = UsageScanner(sse=False)
    j.feed(b'{"usage": {"prompt_tokens_details": {"cached_tokens": 16}}}')
    assert j.close() == 16
    bad = UsageScanner(sse=False)
    bad.feed(b"<html>")
    assert bad.close() is None


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstream", "serve", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("args, says", [
    (["--ext-proc-port", "70000", "e0=tcp://h:1"], "ext-proc-port must be 0..65535"),
    (["--ext-proc-port", "0", "--processes", "2", "e0=tcp://h:1"], "--ext-proc-port runs in one process"),
    (["--ext-proc-port", "0", "--proxy-backoff", "0", "e0=tcp://h:1"], "--proxy-backoff"),
])
def test_bad_ext_proc_flags_are_one_line_and_exit_2(args: list[str], says: str) -> None:
    r = _serve(*args)
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_an_ext_proc_port_in_use_is_one_line_and_exit_2() -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        r = _serve("--port", "0", "--load-interval", "0", "--ext-proc-port", str(port), "e0=tcp://127.0.0.1:1")
    assert r.returncode == 2 and f"cannot listen for ext_proc on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert not [line for line in r.stderr.splitlines() if "Traceback" in line], r.stderr


def test_the_config_key_starts_the_picker_beside_the_http_api(engines, serve, tmp_path) -> None:
    e0 = engines("e0")
    f = tmp_path / "serve.toml"
    f.write_text(f'engines = ["{e0.arg}"]\next-proc-port = 0\nload-interval = 0\n')
    srv = serve("--config", str(f))
    assert "ext_proc on 127.0.0.1:" in srv.listening
    # The gRPC port answers the ext_proc service (a real client, one empty stream).
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg

    addr = srv.listening.split("ext_proc on ", 1)[1].rstrip(")\n")
    with grpc.insecure_channel(addr) as ch:
        stub = pbg.ExternalProcessorStub(ch)
        body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"prompt": [1, 2, 3]}', end_of_stream=True))
        (answer,) = list(stub.Process(iter([body]), timeout=20))
    muts = {h.header.key: h.header.raw_value for h in answer.request_body.response.header_mutation.set_headers}
    assert muts["x-kvstream-engine"] == b"e0"
    assert muts["x-gateway-destination-endpoint"] == e0.http.removeprefix("http://").encode()
    meta = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert meta["x-gateway-destination-endpoint"].string_value == muts["x-gateway-destination-endpoint"].decode()
    assert "kvstream_gateway_picks_total 1" in srv.client.get("/metrics").text
    # The protocol's gRPC health services: alive at once, ready once an engine is live.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        hs = health_pb2_grpc.HealthStub(ch)
        serving = health_pb2.HealthCheckResponse.SERVING
        for svc in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            wait_for(lambda: hs.Check(health_pb2.HealthCheckRequest(service=svc), timeout=10).status == serving,
                     f"{svc} to be SERVING")
