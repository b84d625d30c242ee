"""Fixtures for the service tests: real engines (tests/service/engine_proc.py) and real
``kvstream serve`` processes, on loopback with OS-chosen ports; every wait is on a state
with a deadline."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEADLINE_S = 60.0  # an upper bound for a state to be reached, generous for a loaded 2-core machine


def read_line(proc: subprocess.Popen, timeout: float = DEADLINE_S, err: Any = None) -> str:
    """One line of ``proc``'s stdout, or fail after ``timeout`` seconds (``err``: the file
    its stderr goes to, quoted in the failure)."""
    end = time.monotonic() + timeout
    assert proc.stdout is not None
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no line from {proc.args!r} within {timeout}s")
        r, _, _ = select.select([proc.stdout], [], [], left)
        if r:
            line = proc.stdout.readline()
            if not line:
                text = ""
                if err is not None:
                    err.seek(0)
                    text = err.read()
                raise AssertionError(f"{proc.args!r} exited ({proc.wait()}): {text[-2000:]}")
            return line


def dead_port() -> int:
    """A loopback TCP port nothing listens on (bound once by the OS, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(pred: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> Any:
    """Poll ``pred`` until it returns something truthy; fail naming ``what``."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        last = pred()
        if last:
            return last
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


class EngineProc:
    """A real engine process (allocator + publisher + /metrics)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "engine_proc.py"), name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        info = json.loads(read_line(self.proc, err=self.err))
        self.pub, self.replay, self.http = info["pub"], info["replay"], info["http"]

    @property
    def arg(self) -> str:
        """The ENGINE argument for ``kvstream serve``."""
        return f"{self.name}={self.pub},{self.replay},http={self.http}"

    def cmd(self, **kw: Any) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        return json.loads(read_line(self.proc, err=self.err))

    def admit(self, tokens: list[int], rid: str) -> int:
        """Cache ``tokens`` (a request) and return the seq of the batch that says so."""
        out = self.cmd(admit=tokens, id=rid)
        assert "seq" in out, out
        return out["seq"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.err):
            if f is not None:
                f.close()


class ServeProc:
    """``kvstream serve`` as a subprocess; ``url`` is its base URL once it printed it."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 preexec_fn: Callable[[], Any] | None = None) -> None:
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstream", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                                     preexec_fn=preexec_fn)  # e.g. lower its resource limits
        try:
            line = read_line(self.proc, err=self.err)
            assert "listening on " in line, line
        except BaseException:  # never started: nobody else holds it to stop it
            self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdout, self.err):
                if f is not None:
                    f.close()
            raise
        self.listening = line
        self.url = line.split("listening on ", 1)[1].split()[0]
        self.client = httpx.Client(base_url=self.url, timeout=10.0)

    def engines(self) -> dict[str, dict]:
        return {e["name"]: e for e in self.client.get("/v1/engines").json()["engines"]}

    def wait_applied(self, name: str, seq: int) -> dict:
        """Wait until engine ``name`` is live with batch ``seq`` applied."""
        def ok() -> dict | None:
            e = self.engines().get(name)
            if e and e["state"] == "live" and (e["applied_seq"] if e["applied_seq"] is not None else -1) >= seq:
                return e
            return None
        return wait_for(ok, f"{name} live with seq {seq} applied")

    def route(self, **body: Any) -> dict:
        r = self.client.post("/v1/route", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def stderr(self) -> str:
        """Everything the process logged so far."""
        self.err.seek(0)
        return self.err.read()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def close(self) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)  # a loaded machine may take long; close() == 0 is asserted
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.err):
            if f is not None:
                f.close()
        return self.proc.returncode


@pytest.fixture
def engines() -> Iterator[Callable[[str], EngineProc]]:
    """A factory of real engine processes, all stopped at teardown."""
    made: list[EngineProc] = []

    def make(name: str) -> EngineProc:
        e = EngineProc(name)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., ServeProc]]:
    """A factory of ``kvstream serve`` processes, all stopped at teardown."""
    made: list[ServeProc] = []

    def make(*args: str, **kw: Any) -> ServeProc:
        s = ServeProc(*args, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
