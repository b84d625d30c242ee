"""``GET /openapi.json``: the document names exactly the routes the app serves, every live
answer decodes with the Struct the document publishes for it (no field missing, none
undocumented), and schemathesis fuzzes a live ``kvstream serve`` against the document
(stateless per operation, then stateful along its links): no 5xx, every answer (status,
content type, body) as documented.

The fuzzer never makes the service connect anywhere but loopback: every ``endpoint`` /
``replay_endpoint`` a generated ``/register`` carries is rewritten to a dead loopback port
before it is sent (:func:`_loopback_only`), whatever else the case holds."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterator

import httpx
import msgspec
import pytest

from kvstream.emulator.launch import start_engine, start_serve_proxy
from kvstream.service import schema as S
from kvstream.service.app import create_app
from kvstream.service.config import ServeConfig
from kvstream.service.core import ServiceCore
from kvstream.service.mooncake import QueryRequest
from kvstream.service.openapi import OPENAI_PATHS, OPERATIONS, document, served_operations
from tests.service.conftest import EngineProc, ServeProc, dead_port, wait_for

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis (the test extra) is not installed")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (after the skip)
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.generation.stateful import run_state_machine_as_test  # noqa: E402

BS = 16


def _app_routes(core: ServiceCore, extra: Any = ()) -> list[Any]:
    return list(create_app(core, runtime=False, extra_routes=extra).app.routes)


def test_every_served_route_is_documented_and_every_documented_route_is_served() -> None:
    core = ServiceCore(ServeConfig([]))
    served = set(served_operations(_app_routes(core)))
    doc = document(_app_routes(core))
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == served
    # ... and each with a real entry, not the placeholder an unknown route gets.
    assert served <= set(OPERATIONS), f"routes without an entry in OPERATIONS: {sorted(served - set(OPERATIONS))}"
    assert not [op for ops in doc["paths"].values() for op in ops.values() if op.get("x-undocumented")]
    assert {("POST", "/v1/route"), ("GET", "/v1/engines"), ("POST", "/query"), ("POST", "/query_by_hash"),
            ("POST", "/register"), ("POST", "/unregister"), ("GET", "/healthz"), ("GET", "/readyz"),
            ("GET", "/metrics"), ("GET", "/"), ("GET", "/ui"), ("GET", "/openapi.json")} <= served
    # Every operation documented in the table is one the app serves (none left behind).
    assert set(OPERATIONS) == served


def test_proxy_mode_documents_its_openai_routes_by_reference() -> None:
    from kvstream.proxy.app import KVProxy

    core = ServiceCore(ServeConfig([]))
    proxy = KVProxy.for_service(core)
    routes = _app_routes(core, proxy.openai_routes())
    doc = document(routes)
    served = set(served_operations(routes))
    assert {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops} == served
    assert set(OPENAI_PATHS) <= served and served <= set(OPERATIONS) | set(OPENAI_PATHS)
    for method, path in OPENAI_PATHS:
        op = doc["paths"][path][method.lower()]
        assert op["externalDocs"]["url"].startswith("https://platform.openai.com/docs/api-reference")
        assert "x-undocumented" not in op


def test_the_document_is_openapi_3_1_with_the_handlers_bounds() -> None:
    doc = document(_app_routes(ServiceCore(ServeConfig([]))))
    schemathesis.openapi.from_dict(doc).validate()  # against the OpenAPI 3.1 meta-schema
    comps = doc["components"]["schemas"]
    ids = comps["RouteRequest"]["properties"]["token_ids"]["anyOf"][0]["items"]
    assert ids == {"type": "integer", "minimum": 0, "maximum": 0xFFFFFFFF}
    assert comps["QueryByHashRequest"]["properties"]["seq_hashes"]["anyOf"][0]["items"]["maximum"] == 2**64 - 1
    assert comps["RouteRequest"]["additionalProperties"] is False  # a typo is an error, as the decoder says
    # The request Structs are the handlers' own decoders' types.
    assert doc["paths"]["/query"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/QueryRequest"}
    assert QueryRequest.__name__ in comps


# -- a live service ----------------------------------------------------------------------


class _Live:
    def __init__(self, srv: ServeProc, engine: EngineProc) -> None:
        self.srv = srv
        self.engine = engine


@pytest.fixture(scope="module")
def live() -> Iterator[_Live]:
    """One engine and a ``kvstream serve`` following it (the engine holds a prompt)."""
    e0 = EngineProc("e0")
    srv: ServeProc | None = None
    try:
        srv = ServeProc(e0.arg, "--load-interval", "0.5", "--replay-timeout", "0.5")
        seq = e0.admit(list(range(1, 1 + 4 * BS)), "r1")
        srv.wait_applied("e0", seq)
        yield _Live(srv, e0)
    finally:
        if srv is not None:
            srv.close()
        e0.close()


def _strict(typ: Any, value: Any) -> None:
    """``value`` (decoded JSON) is a ``typ`` and carries no key ``typ`` does not document."""
    msgspec.convert(value, typ)
    if isinstance(value, dict) and hasattr(typ, "__struct_fields__"):
        extra = set(value) - set(typ.__struct_encode_fields__)
        assert not extra, f"{typ.__name__}: undocumented fields {sorted(extra)}"
        hints = msgspec.structs.fields(typ)
        for f in hints:
            sub = value.get(f.encode_name)
            t = f.type
            inner = getattr(t, "__args__", ())
            for cand in (t, *inner):
                if hasattr(cand, "__struct_fields__") and isinstance(sub, dict):
                    _strict(cand, sub)
                elif getattr(cand, "__origin__", None) is list and isinstance(sub, list):
                    (item,) = cand.__args__
                    if hasattr(item, "__struct_fields__"):
                        for x in sub:
                            _strict(item, x)


def test_live_answers_decode_with_their_documented_structs(live: _Live) -> None:
    c = live.srv.client
    _strict(S.EnginesResponse, c.get("/v1/engines").json())
    _strict(S.StatusResponse, c.get("/v1/status").json())
    _strict(S.HealthResponse, c.get("/healthz").json())
    _strict(S.ReadyResponse, c.get("/readyz").json())
    _strict(S.RouteResponse, live.srv.route(token_ids=list(range(1, 1 + 4 * BS))))
    r = c.post("/query", json={"model": "default", "token_ids": list(range(1, 1 + 4 * BS)), "block_size": BS})
    assert r.status_code == 200, r.text
    msgspec.convert(r.json(), S.QueryResponse)
    port = dead_port()
    reg = {"endpoint": f"tcp://127.0.0.1:{port}", "type": "vLLM", "modelname": "m", "instance_id": "doc-1",
           "block_size": BS, "dp_rank": 0}
    r = c.post("/register", json=reg)
    assert r.status_code == 200, r.text
    _strict(S.RegisterResponse, r.json())
    engines = c.get("/v1/engines").json()
    _strict(S.EnginesResponse, engines)  # with a registered engine's meta
    assert any("meta" in e for e in engines["engines"])
    r = c.post("/unregister", json={"instance_id": "doc-1"})
    assert r.status_code == 200, r.text
    _strict(S.UnregisterResponse, r.json())
    r = c.post("/v1/route", json={"token_ids": [-1]})
    assert r.status_code == 422
    _strict(S.ErrorResponse, r.json())
    doc = c.get("/openapi.json").json()
    assert doc["openapi"] == "3.1.0" and "/v1/status" in doc["paths"]


def test_what_the_fuzzing_found_an_integral_float_for_an_integer_field_is_a_422_naming_it(live: _Live) -> None:
    """JSON Schema counts 21.0 an integer, the decoders want an int: the answer is the
    documented 422 naming the field (never a 500, never a silent truncation)."""
    c = live.srv.client
    port = dead_port()
    reg = {"endpoint": f"tcp://127.0.0.1:{port}", "type": "vLLM", "modelname": "m", "instance_id": "f-1",
           "block_size": BS, "dp_rank": 21.0}
    for path, body, where in (
            ("/register", reg, "$.dp_rank"),
            ("/unregister", {"instance_id": "f-1", "dp_rank": 3.0}, "$.dp_rank"),
            ("/query", {"model": "default", "token_ids": [1, 2], "block_size": 16.0}, "$.block_size"),
            ("/v1/route", {"token_ids": [1.0, 2]}, "$.token_ids[0]")):
        r = c.post(path, json=body)
        assert r.status_code == 422, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "bad_field" and err["where"] == where, (path, err)
    # A publisher type in any case is what the document's pattern says /register takes.
    reg.update(dp_rank=0, type="sGlAnG")
    assert c.post("/register", json=reg).status_code == 200
    assert c.post("/unregister", json={"instance_id": "f-1"}).status_code == 200


# -- schemathesis ----------------------------------------------------------------------

_ENDPOINT = re.compile(r"endpoint$")


def _loopback_only(body: Any, port: int) -> Any:
    """``body`` with every string ``*endpoint`` field pointed at a dead loopback port (a
    fuzzer's ``tcp://example:1`` must never make the service resolve or dial it)."""
    if isinstance(body, dict):
        for k in list(body):
            if isinstance(k, str) and _ENDPOINT.search(k) and isinstance(body[k], str) and "://" in body[k]:
                body[k] = f"tcp://127.0.0.1:{port}"
    return body


_DEAD = dead_port()


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: Any) -> None:
    """Every request schemathesis sends from this process (a global hook: stateless and
    stateful runs alike) points its endpoints at loopback."""
    _loopback_only(case.body, _DEAD)  # in place


def _schema(live: _Live) -> Any:
    raw = live.srv.client.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=live.srv.url)
    schema.config.checks.update(excluded_check_names=[c.__name__ for c in _NOT_OURS])
    return schema


# Schema-valid bodies the service rightly refuses: a prompt without --tokenizer, loads naming
# an engine not followed, more tokens than --max-prompt-tokens, an unregister of an instance
# never registered, and 21.0 for an integer field (JSON Schema counts it an integer; the
# decoders want an int and say so in a 422). The schema cannot say most of those (they
# depend on the service's state), so "valid data is accepted" is not a check of this API;
# every other check is.
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

_NOT_OURS = [positive_data_acceptance]

# Examples per operation and mode: a short run in the suite; KVSTREAM_FUZZ_EXAMPLES=500 for a long hunt.
_FUZZ = settings(max_examples=int(os.environ.get("KVSTREAM_FUZZ_EXAMPLES", "30")), deadline=None,
                 derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def test_schemathesis_finds_no_5xx_and_no_answer_off_the_document(live: _Live) -> None:
    schema = _schema(live)
    failures: list[str] = []
    ran = 0
    negated = []
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":
            modes.append(GenerationMode.NEGATIVE)  # a GET without parameters has nothing to negate
        for mode in modes:

            @_FUZZ
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case: Any) -> None:
                case.call_and_validate(base_url=live.srv.url, excluded_checks=_NOT_OURS)

            try:
                fuzz()
            except Unsatisfiable:
                continue  # no schema-invalid body to make (every field optional and of any JSON type)
            except BaseException as exc:  # noqa: BLE001 - collect every operation's failures, then report them all
                failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {exc}"[:3000])
            ran += 1
            if mode is GenerationMode.NEGATIVE:
                negated.append(op.path)
    assert ran >= 14
    assert {"/register", "/unregister", "/query", "/query_by_hash"} <= set(negated), negated
    assert not failures, "\n\n".join(failures)
    # The service is still whole after the fuzzing.
    assert live.srv.client.get("/healthz").status_code == 200
    wait_for(lambda: live.srv.engines()["e0"]["state"] == "live", "e0 live after the fuzzing")


def _registrations(live: _Live) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {"register": 0.0, "unregister": 0.0}
    for fam in text_string_to_metric_families(live.srv.client.get("/metrics").text):
        for s in fam.samples:
            if s.name == "kvstream_registrations_total":
                out[s.labels["action"]] = s.value
    return out


def test_schemathesis_stateful_register_then_unregister_along_the_links(live: _Live) -> None:
    schema = _schema(live)
    before = _registrations(live)
    machine = schema.as_state_machine()
    run_state_machine_as_test(machine, settings=settings(max_examples=20, stateful_step_count=8, deadline=None,
                                                         derandomize=True, database=None,
                                                         suppress_health_check=list(HealthCheck)))
    after = _registrations(live)
    # The machine registered publishers and took the link to unregister them.
    assert after["register"] > before["register"] and after["unregister"] > before["unregister"], (before, after)
    assert live.srv.client.get("/healthz").status_code == 200


def test_the_document_is_served_as_json(live: _Live) -> None:
    r = live.srv.client.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert json.loads(r.content)["info"]["title"] == "kvstream serve"


def test_schemathesis_in_proxy_mode_the_openai_routes_never_answer_5xx_and_engines_match_their_schema(
        tmp_path: Any) -> None:
    """``serve --proxy`` over a ``kvstream engine``: the OpenAI routes (documented by
    reference, bodies any JSON object) proxied to a healthy engine never answer 5xx, and
    ``/v1/engines`` with the proxy's part (:class:`~kvstream.service.schema.ProxyEngineView`)
    matches its schema after them."""
    e0 = start_engine("e0", log_dir=str(tmp_path), timeout_s=60)
    try:
        srv = start_serve_proxy([e0], extra=["--load-interval", "0.5"], log_dir=str(tmp_path), timeout_s=60)
        try:
            raw = _get_json(srv.url + "/openapi.json")
            schema = schemathesis.openapi.from_dict(raw)
            schema.config.update(base_url=srv.url)
            schema.config.checks.update(excluded_check_names=[c.__name__ for c in _NOT_OURS])
            wanted = {(m, p) for m, p in OPENAI_PATHS} | {("GET", "/v1/engines")}
            ops = [r.ok() for r in schema.get_all_operations()]
            ops = [op for op in ops if (op.method.upper(), op.path) in wanted]
            assert len(ops) == len(wanted)
            failures = []
            # The engines' view last, once requests went through the proxy.
            for op in sorted(ops, key=lambda o: o.path == "/v1/engines"):

                @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy())
                def fuzz(case: Any) -> None:
                    case.call_and_validate(base_url=srv.url)

                try:
                    fuzz()
                except BaseException as exc:  # noqa: BLE001 - report every operation's failures together
                    failures.append(f"{op.method.upper()} {op.path}: {exc}"[:3000])
            assert not failures, "\n\n".join(failures)
            engines = _get_json(srv.url + "/v1/engines")
            _strict(S.EnginesResponse, engines)
            assert "proxy" in engines["engines"][0]  # the proxy's part was there to check
        finally:
            srv.stop()
    finally:
        e0.stop()


def _get_json(url: str) -> Any:
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()
