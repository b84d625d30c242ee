"""Start emulated engines and proxies as real processes and wait until they are ready.

The demo and the tests use these: each process prints one ``... ready URL ...`` line on
stdout once it accepts connections; :func:`start_engine` and :func:`start_proxy` wait for
that line (with a deadline; no fixed sleeps) and return a handle with the addresses.
:meth:`Proc.stop` ends the process (SIGTERM, then SIGKILL after a grace period) and waits
for it. Use them as context managers so that nothing outlives its owner.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Sequence

__all__ = ["LaunchError", "Proc", "start_engine", "start_proxy", "start_serve_proxy"]


class LaunchError(RuntimeError):
    """A process did not become ready (it exited, or its deadline passed); the message
    carries the end of its log."""


class Proc:
    """A started process: ``name``, ``popen``, ``url`` (HTTP base), ``events`` and ``replay``
    (KV event endpoints, engines only), ``log`` (its stderr file)."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path, watch_fd: int | None = None) -> None:
        self.name = name
        self.popen = popen
        self.log = log
        self._watch_fd = watch_fd
        self.url = ""
        self.events: str | None = None
        self.replay: str | None = None
        self.ready_line = ""
        self._kind = ""

    @property
    def pid(self) -> int:
        """The process id."""
        return self.popen.pid

    def alive(self) -> bool:
        """Still running?"""
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would, and wait for the exit."""
        if self.alive():
            self.popen.kill()
        self.popen.wait()
        self._close()

    def stop(self, grace_s: float = 3.0) -> int | None:
        """SIGTERM, wait up to ``grace_s`` seconds, then SIGKILL; returns the exit status."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._close()
        return self.popen.returncode

    def _close(self) -> None:
        if self.popen.stdout is not None and not self.popen.stdout.closed:
            self.popen.stdout.close()
        if self._watch_fd is not None:
            os.close(self._watch_fd)
            self._watch_fd = None

    def wait_ready(self, timeout_s: float = 30.0) -> "Proc":
        """Wait for the ready line (raises :class:`LaunchError`) and read the addresses."""
        if self.url:
            return self
        if self._kind == "engine":
            m = _wait_ready(self, r"ready (http://\S+)(?: events (\S+)(?: \((?:bind|connect)\))? replay (\S+))?",
                            timeout_s)
            self.events, self.replay = m.group(2), m.group(3)
            if self.replay in ("None", "off"):
                self.replay = None
        elif self._kind == "serve":
            m = _wait_ready(self, r"listening on (http://\S+)", timeout_s)
        else:
            m = _wait_ready(self, r"ready (http://\S+)", timeout_s)
        self.url = m.group(1)
        return self

    def log_tail(self, n: int = 2000) -> str:
        """The last ``n`` characters of its stderr log."""
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _wait_ready(proc: Proc, pattern: str, timeout_s: float) -> re.Match[str]:
    out = proc.popen.stdout
    assert out is not None
    sel = selectors.DefaultSelector()
    sel.register(out, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    buf = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                raise LaunchError(f"{proc.name} was not ready after {timeout_s:.0f} s; its log:\n{proc.log_tail()}")
            if sel.select(min(left, 0.5)):
                chunk = os.read(out.fileno(), 4096)
                if not chunk:
                    proc.popen.wait()
                    raise LaunchError(f"{proc.name} exited with status {proc.popen.returncode} before it was "
                                      f"ready; its log:\n{proc.log_tail()}")
                buf += chunk
                for line in buf.decode(errors="replace").splitlines():
                    m = re.search(pattern, line)
                    if m:
                        proc.ready_line = line
                        return m
    finally:
        sel.close()


def _spawn(name: str, argv: Sequence[str], log_dir: str | None) -> Proc:
    folder = Path(log_dir or tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"kvstream-{name}-{os.getpid()}-{time.monotonic_ns()}.log"
    err: IO[bytes] = open(log, "wb")
    # The child ends itself when this process is gone, however it went (SIGKILL included):
    # it inherits only the read end of a pipe whose write end stays here (non-inheritable)
    # until the child is stopped (kvstream.cli._common.exit_with_parent).
    watch_r, watch_w = os.pipe()
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVSTREAM_PARENT_FD=str(watch_r))
    try:
        popen = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=err,
                                 stdin=subprocess.DEVNULL, env=env, start_new_session=True, pass_fds=(watch_r,))
    except BaseException:
        os.close(watch_w)
        raise
    finally:
        err.close()
        os.close(watch_r)
    return Proc(name, popen, log, watch_w)


def start_engine(name: str, *, port: int = 0, events: str | None = "tcp://127.0.0.1:*",
                 replay: str | None = "tcp://127.0.0.1:*", extra: Sequence[str] = (), log_dir: str | None = None,
                 timeout_s: float = 30.0, wait: bool = True) -> Proc:
    """Start ``kvstream engine`` on loopback (``port`` 0: a free one) publishing KV events
    on ``events``/``replay`` (wildcard ports by default; None: no events). ``extra``: more
    ``kvstream engine`` options. Returns once it is ready (``wait=False``: at once; call
    :meth:`Proc.wait_ready` later, to start several in parallel)."""
    argv = ["kvstream", "engine", "--host", "127.0.0.1", "--port", str(port), *extra]
    if events:
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
               "replay_endpoint": replay, "topic": ""}
        argv += ["--kv-events-config", json.dumps(cfg)]
    proc = _spawn(name, argv, log_dir)
    proc._kind = "engine"
    if wait:
        proc.wait_ready(timeout_s)
    return proc


def start_proxy(engines: Sequence[Proc], *, port: int = 0, policy: str = "kv-aware", block_size: int = 16,
                extra: Sequence[str] = (), log_dir: str | None = None, timeout_s: float = 30.0,
                wait: bool = True) -> Proc:
    """Start ``python -m kvstream.proxy`` (which is ``kvstream serve --proxy``) in front of
    ``engines`` (their events, replay and ``http=`` URL each). Returns once it listens
    (``wait=False``: at once)."""
    argv = ["kvstream.proxy", "--host", "127.0.0.1", "--port", str(port), "--proxy-policy", policy,
            "--router-block-size", str(block_size), *extra]
    for e in engines:
        parts = [x for x in (e.events, e.replay) if x]
        argv.append(f"{e.name}={','.join(parts)},http={e.url}")
    proc = _spawn(f"proxy-{policy}", argv, log_dir)
    proc._kind = "serve"
    if wait:
        proc.wait_ready(timeout_s)
    return proc


def start_serve_proxy(engines: Sequence[Proc], *, port: int = 0, policy: str = "kv-aware",
                      extra: Sequence[str] = (), log_dir: str | None = None, timeout_s: float = 30.0,
                      wait: bool = True) -> Proc:
    """Start ``kvstream serve --proxy`` following ``engines`` (events, replay and ``http=``
    URL each). Returns once it listens (``wait=False``: at once)."""
    argv = ["kvstream", "serve", "--host", "127.0.0.1", "--port", str(port), "--proxy", "--proxy-policy", policy,
            *extra]
    for e in engines:
        parts = [x for x in (e.events, e.replay) if x]
        argv.append(f"{e.name}={','.join(parts)},http={e.url}")
    proc = _spawn(f"serve-{policy}", argv, log_dir)
    proc._kind = "serve"
    if wait:
        proc.wait_ready(timeout_s)
    return proc
