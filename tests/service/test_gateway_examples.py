"""examples/gateway/ works: the curl snippet, and nginx (njs) consulting /v1/route to pick
the engine that holds the prompt's prefix (skipped where nginx with njs is not installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import REPO, wait_for

GW = REPO / "examples" / "gateway"
NJS = Path("/usr/lib/nginx/modules/ngx_http_js_module.so")


def test_the_curl_snippet_prints_the_chosen_engine(engines, serve) -> None:
    e0, e1 = engines("e0"), engines("e1")
    srv = serve(e0.arg, e1.arg, "--load-interval", "0")
    srv.wait_applied("e1", e1.admit(list(range(1000, 1016)), "r"))
    srv.wait_applied("e0", -1)
    out = subprocess.run(["sh", str(GW / "route.sh")], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "KVSTREAM": srv.url})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "e1"


@pytest.mark.skipif(shutil.which("nginx") is None or not NJS.exists(),
                    reason="needs nginx with the njs module (apt-get install nginx-light libnginx-mod-http-js)")
def test_nginx_njs_sends_each_request_to_the_engine_kvstream_chooses(engines, serve, tmp_path) -> None:
    e0, e1 = engines("e0"), engines("e1")
    srv = serve(e0.arg, e1.arg, "--load-interval", "0")
    a, b = list(range(5000, 5064)), list(range(9000, 9064))
    srv.wait_applied("e0", e0.admit(a, "ra"))
    srv.wait_applied("e1", e1.admit(b, "rb"))

    conf = (GW / "nginx.conf").read_text()
    sock = tmp_path / "gw.sock"
    conf = (conf.replace("modules/ngx_http_js_module.so", str(NJS))
                .replace("server 127.0.0.1:8080;", f"server {srv.url.removeprefix('http://')};")
                .replace("e0 127.0.0.1:8000;", f"e0 {e0.http.removeprefix('http://')};")
                .replace("e1 127.0.0.1:8001;", f"e1 {e1.http.removeprefix('http://')};")
                .replace("listen 127.0.0.1:9000;", f"listen unix:{sock};"))
    (tmp_path / "nginx.conf").write_text(conf)
    shutil.copy(GW / "kvstream_route.js", tmp_path)
    (tmp_path / "logs").mkdir()
    nginx = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: sock.exists() or nginx.poll() is not None, "nginx to listen")
        assert nginx.poll() is None, nginx.stderr.read() if nginx.stderr else ""
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://gw", timeout=10) as c:
            for prompt, engine in ((a + [1, 2, 3], "e0"), (b, "e1"), (a[:32], "e0")):
                r = c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200 and r.json() == {"served_by": engine}, r.text
    finally:
        nginx.terminate()
        nginx.wait(10)
        if nginx.stderr:
            nginx.stderr.close()
