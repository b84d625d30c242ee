"""Bad input over HTTP: every malformed body, wrong type, oversized prompt, unknown engine or
path is a 4xx JSON error saying what and where (never a 500), fuzzed over a real socket;
an engine nobody answers for is ``connecting``, not ``live``."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service.conftest import ServeProc, dead_port



@pytest.fixture(scope="module")
def srv():
    p1, p2 = dead_port(), dead_port()
    s = ServeProc(f"e0=tcp://127.0.0.1:{p1},tcp://127.0.0.1:{p2}", "e1=tcp://127.0.0.1:1",
                  "--load-interval", "0", "--max-prompt-tokens", "100", "--max-body-bytes", "4096",
                  "--replay-timeout", "0.2")
    yield s
    assert s.close() == 0


CASES = [
    ("/v1/route", b"{", 400, "bad_json", None),
    ("/v1/route", b"", 400, "bad_json", None),
    ("/v1/route", b"[1, 2]", 422, "bad_field", "$"),
    ("/v1/route", b'{"token_ids": [1, "x"]}', 422, "bad_field", "$.token_ids[1]"),
    ("/v1/route", b'{"token_ids": [-1]}', 422, "bad_field", "$.token_ids[0]"),
    ("/v1/route", b'{"token_ids": [4294967296]}', 422, "bad_field", "$.token_ids[0]"),
    ("/v1/route", b'{"token_ids": [1, true]}', 422, "bad_field", "$.token_ids[1]"),
    ("/v1/route", b'{"token_ids": [1, 2.0]}', 422, "bad_field", "$.token_ids[1]"),
    ("/v1/route", b'{"token_ids": [1, 100000000000000000000000]}', 422, "bad_field", "$.token_ids[1]"),
    ("/v1/route", b'{"token_ids": [1], "tokens": [1]}', 422, "bad_field", "$"),
    ("/v1/route", b'{}', 422, "bad_field", "$"),
    ("/v1/route", b'{"token_ids": [1], "prompt": "x"}', 422, "bad_field", "$"),
    ("/v1/route", json.dumps({"token_ids": list(range(101))}).encode(), 413, "too_large", "$.token_ids"),
    ("/v1/route", json.dumps({"token_ids": [1] * 3000}).encode(), 413, "too_large", None),
    ("/v1/route", b'{"token_ids": [1], "loads": {"e9": {"queue": 1}}}', 422, "unknown_engine", "$.loads.e9"),
    ("/v1/route", b'{"token_ids": [1], "loads": {"e0": {"queue": -1}}}', 422, "bad_field", "$.loads.e0.queue"),
    ("/v1/route", b'{"token_ids": [1], "loads": {"e0": {"kv_usage": 2}}}', 422, "bad_field", "$.loads.e0.kv_usage"),
    ("/v1/route", b'{"token_ids": [1], "speculate": "yes"}', 422, "bad_field", "$.speculate"),
    ("/v1/route", b'{"token_ids": [1], "mm_hashes": [{"identifier": "x"}]}', 422, "bad_field", "$.mm_hashes[0]"),
    ("/register", b'{"endpoint": "tcp://h:1"}', 422, "bad_field", "$"),
    ("/register", b'{"endpoint": "nope", "type": "vLLM", "modelname": "m", "instance_id": "i", "block_size": 16, '
                  b'"dp_rank": 0}', 422, "bad_field", "$.endpoint"),
    ("/register", b'{"endpoint": "tcp://h:1", "type": "TGI", "modelname": "m", "instance_id": "i", '
                  b'"block_size": 16, "dp_rank": 0}', 422, "bad_field", "$.type"),
    ("/register", b'{"endpoint": "tcp://h:1", "type": "vLLM", "modelname": "m", "instance_id": "i", '
                  b'"block_size": 0, "dp_rank": 0}', 422, "bad_field", "$.block_size"),
    ("/unregister", b'{"instance_id": "nobody"}', 404, "unknown_instance", "$.instance_id"),
    ("/query", b'{"model": "m", "token_ids": [1]}', 422, "bad_field", "$"),
    ("/query", b'{"model": "m", "token_ids": [1, 2, -3], "block_size": 16}', 422, "bad_field", "$.token_ids[2]"),
    ("/query", b'{"model": "m", "token_ids": [4294967296], "block_size": 16}', 422, "bad_field", "$.token_ids[0]"),
    ("/query", b'{"model": "m", "token_ids": ["1"], "block_size": 16}', 422, "bad_field", "$.token_ids[0]"),
    ("/query", b'{"model": "m", "token_ids": [1], "block_size": 16, "instance_id": "x"}', 404, "unknown_instance",
     "$.instance_id"),
    ("/query", b'{"model": "m", "token_ids": [1], "block_size": 16, "lora_name": "a", "lora_id": 1}', 422,
     "bad_field", "$.lora_id"),
    ("/query_by_hash", b'{"model": "m", "block_size": 16}', 422, "bad_field", "$.seq_hashes"),
    ("/query_by_hash", b'{"model": "m", "block_size": 16, "seq_hashes": [18446744073709551616]}', 422, "bad_field",
     "$.seq_hashes[0]"),
    ("/query_by_hash", json.dumps({"model": "m", "block_size": 16, "seq_hashes": [1] * 7}).encode(), 413,
     "too_large", "$.seq_hashes"),
    # Nested deeper than msgspec decodes (its RecursionError was a 500).
    ("/v1/route", b'{"token_ids": [1], "loads": {"e0": ' + b"[" * 1500 + b"]" * 1500 + b"}}", 400, "bad_json",
     None),
    ("/v1/route", b'{"token_ids": [1], "loads": {"e0": {"queue": ' + b"[" * 1500 + b"]" * 1500 + b"}}}", 400,
     "bad_json", None),
    ("/query", b'{"model": "m", "token_ids": [1], "block_size": 16, "x": ' + b"[" * 1500 + b"]" * 1500 + b"}", 400,
     "bad_json", None),
    ("/query_by_hash", b'{"model": "m", "seq_hashes": [1], "block_size": 16, "x": ' + b"[" * 1500 + b"]" * 1500 + b"}",
     400, "bad_json", None),
    ("/register", b'{"x": ' + b"[" * 1500 + b"]" * 1500 + b"}", 400, "bad_json", None),
    ("/unregister", b'{"x": ' + b"[" * 1500 + b"]" * 1500 + b"}", 400, "bad_json", None),
    # lora_id is vLLM 0.11's adapter int id, bounded as /v1/route bounds it.
    ("/query", b'{"model": "m", "token_ids": [1], "block_size": 16, "lora_id": -1}', 422, "bad_field", "$.lora_id"),
    ("/query", b'{"model": "m", "token_ids": [1], "block_size": 16, "lora_id": 1180591620717411303424}', 422,
     "bad_field", "$.lora_id"),
]


@pytest.mark.parametrize("path, body, status, code, where", CASES)
def test_bad_bodies_are_4xx_json_saying_what_and_where(srv, path, body, status, code, where) -> None:
    r = srv.client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    if where is not None:
        assert err["where"] == where, err


@pytest.mark.parametrize("path, body", [
    ("/query", {"model": "default", "token_ids": [1], "block_size": 16}),
    ("/query_by_hash", {"model": "default", "seq_hashes": [1], "block_size": 16}),
])
def test_a_null_tenant_is_the_default_tenant(srv, path, body) -> None:
    # RFC #1403: tenant_id "No. Defaults to default"; clients send unset optionals as null.
    r = srv.client.post(path, json={**body, "tenant_id": None})
    assert r.status_code == 200 and r.json() == {"default": {}}, r.text
    r = srv.client.post("/unregister", json={"instance_id": "nobody", "tenant_id": None})
    assert r.status_code == 404 and "tenant 'default'" in r.json()["error"]["message"]


@pytest.mark.parametrize("replay", ["tcp://*:5558", "tcp://h", "nats://h:1"])
def test_a_replay_endpoint_that_cannot_be_connected_is_refused_not_fatal(srv, replay: str) -> None:
    # Before: accepted, then the replay task's ZMQError ended the subscriber's task group:
    # one /register stopped the service from following any engine.
    body = {"endpoint": f"tcp://127.0.0.1:{dead_port()}", "replay_endpoint": replay, "type": "vLLM",
            "modelname": "m", "instance_id": "bad-replay", "block_size": 16, "dp_rank": 0}
    r = srv.client.post("/register", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "bad_endpoint" and err["where"] == "$.replay_endpoint" and replay in err["message"]
    assert "bad-replay|default|0" not in {e["name"] for e in srv.client.get("/v1/engines").json()["engines"]}
    assert srv.client.get("/healthz").status_code == 200


def test_unknown_paths_and_methods_are_json_too(srv) -> None:
    r = srv.client.get("/v2/route")
    assert r.status_code == 404 and "/v1/route" in r.json()["error"]["message"]
    r = srv.client.get("/v1/route")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_unreachable_engines_are_connecting_not_live(srv) -> None:
    engines = {e["name"]: e for e in srv.client.get("/v1/engines").json()["engines"]}
    assert {n: e["state"] for n, e in engines.items()} == {"e0": "connecting", "e1": "connecting"}
    r = srv.client.get("/readyz")
    assert r.status_code == 503 and r.json() == {"ready": False, "live": 0, "engines": 2}
    assert srv.client.get("/healthz").json() == {"alive": True}
    # routing still answers (no prefix anywhere)
    assert srv.client.post("/v1/route", json={"token_ids": list(range(32))}).json()["matched_tokens"] == 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=12), kids, max_size=5),
    max_leaves=20,
)
_FIELDS = ["token_ids", "prompt", "lora_name", "cache_salt", "mm_hashes", "loads", "speculate", "endpoint", "type",
           "modelname", "instance_id", "block_size", "dp_rank", "model", "seq_hashes", "tenant_id", "identifier",
           "offset", "queue", "e0", "replay_endpoint", "additionalsalt", "block_hash"]
# Nesting around msgspec's depth limit (about 1,000), at the top or under a field.
_nested = st.builds(lambda n, field, kind: (b'{"%s": ' % field.encode() if field else b"")
                    + (b"[" * n + b"]" * n if kind else b'{"a":' * n + b"1" + b"}" * n) + (b"}" if field else b""),
                    st.integers(990, 1020), st.sampled_from(["", "token_ids", "loads", "x", "mm_hashes"]),
                    st.booleans())
_shaped = st.dictionaries(st.sampled_from(_FIELDS), _json | st.lists(st.integers(0, 2**33), max_size=40), max_size=6)


# Registrations that decode, with endpoints a subscriber may or may not connect to.
_endpoint = st.one_of(st.sampled_from(["tcp://*:1", "tcp://h", "tcp://", "nats://h:1", "pgm://x;y:1", "inproc://x",
                                       "tcp://[::1:5", "tcp://127.0.0.1:1", "ipc:///nonexistent/x"]),
                      st.text(max_size=12).map(lambda t: "tcp://" + t))
_register = st.fixed_dictionaries(
    {"endpoint": _endpoint, "type": st.sampled_from(["vLLM", "SGLang", "Mooncake"]), "modelname": st.just("fz"),
     "instance_id": st.text(min_size=1, max_size=8), "block_size": st.integers(1, 64), "dp_rank": st.integers(0, 2)},
    optional={"replay_endpoint": _endpoint}).map(lambda v: json.dumps(v).encode())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/route", "/query", "/query_by_hash", "/unregister", "/register"]),
       body=st.one_of(st.binary(max_size=64), _json.map(lambda v: json.dumps(v).encode()),
                      _shaped.map(lambda v: json.dumps(v).encode()), _nested, _register))
def test_fuzzed_bodies_never_get_a_5xx(srv, path: str, body: bytes) -> None:
    r = srv.client.post(path, content=body)
    assert r.status_code < 500, (path, body, r.text)
    doc = r.json()
    assert r.status_code == 200 or set(doc["error"]) == {"code", "message", "where"}
    assert srv.client.get("/healthz").status_code == 200, (path, body)  # nothing it sent stopped the service
