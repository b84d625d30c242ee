"""Who may change what the service follows, or read its whole index: on a loopback address
(the default) anyone on the machine; on a routable one only holders of the token in
``--register-token-file``, unless the operator opts out with ``--insecure-open-admin``.
With a token, ``GET /v1/dump`` needs it too, and replicas (``--peers``) send it.

Before (issue #23): ``/register`` needed no credentials by default and ``/v1/dump`` gave
anyone the whole index, on whatever address the service bound (the deploy docs show
``0.0.0.0``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from kvstream.service.config import build_config, is_loopback
from kvstream.service.errors import ConfigError
from tests.service.conftest import REPO, dead_port

PROMPT = [9000 + i for i in range(64)]


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstream", "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "router.internal"])
def test_a_routable_host_without_a_token_is_refused_at_start_up(host: str) -> None:
    r = _serve("--host", host, "e0=tcp://127.0.0.1:1")
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--register-token-file" in lines[0] and "--insecure-open-admin" in lines[0] and repr(host) in lines[0]


def test_the_same_from_a_config_file_and_the_explicit_ways_out(tmp_path) -> None:
    f = tmp_path / "serve.toml"
    f.write_text('host = "0.0.0.0"\n')
    with pytest.raises(ConfigError, match="--register-token-file"):
        build_config({}, [], str(f))
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    assert build_config({"register_token_file": str(tok)}, [], str(f)).register_token() == "s3cret"
    assert build_config({"insecure_open_admin": True}, [], str(f)).insecure_open_admin
    f.write_text('host = "0.0.0.0"\ninsecure-open-admin = true\n')
    assert build_config({}, [], str(f)).host == "0.0.0.0"
    for host in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.1", "example.com", ""):
        assert not is_loopback(host), host


def test_with_a_token_dump_register_and_unregister_need_it(engines, serve, tmp_path) -> None:
    e = engines("e0")
    (tmp_path / "token").write_text("s3cret\n")
    srv = serve(e.arg, "--load-interval", "0", "--register-token-file", str(tmp_path / "token"))
    srv.wait_applied("e0", e.admit(PROMPT, "r1"))
    good = {"Authorization": "Bearer s3cret"}
    reg = {"endpoint": f"tcp://127.0.0.1:{dead_port()}", "type": "vLLM", "modelname": "m", "instance_id": "a",
           "block_size": 16, "dp_rank": 0}
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic s3cret"}):
            for method, path, body in (("GET", "/v1/dump", None), ("POST", "/register", reg),
                                       ("POST", "/unregister", {"instance_id": "a"})):
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (path, r.text)
        dump = c.get("/v1/dump", headers=good)
        assert dump.status_code == 200 and dump.headers["content-type"] == "application/msgpack" and dump.content
        assert c.post("/register", json=reg, headers=good).status_code == 200
        assert c.post("/unregister", json={"instance_id": "a"}, headers=good).status_code == 200
        # reads that route stay open
        assert c.post("/v1/route", json={"token_ids": PROMPT}).json()["engine"] == "e0"
        assert c.get("/v1/engines").status_code == 200
    # a replica with the same token file loads the guarded dump
    rep = serve(e.arg, "--load-interval", "0", "--register-token-file", str(tmp_path / "token"), "--peers", srv.url)
    assert rep.engines()["e0"]["resumed_seq"] is not None
    assert "loaded the index from" in rep.stderr()
