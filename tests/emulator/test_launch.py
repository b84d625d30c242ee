"""Processes started by kvstream.emulator.launch do not outlive the process that started
them, even when that one is SIGKILLed (the demo's engines and serve, a test's engines)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

_PARENT = textwrap.dedent("""
    import sys
    from kvstream.emulator.launch import start_engine
    e = start_engine("orphan-check", log_dir=sys.argv[1])
    print(e.pid, flush=True)
    sys.stdin.read()  # until the test kills this process
""")


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for its reaper counts as exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def test_an_engine_ends_when_its_launcher_is_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), line
        engine = int(line)
        assert not _gone(engine)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while not _gone(engine):
            assert time.monotonic() < deadline, "the engine outlived its launcher"
            time.sleep(0.05)  # polling the engine's state with a deadline
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        try:
            os.kill(engine, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_a_stopped_engine_is_not_signalled_twice_and_the_launcher_keeps_no_descriptor(tmp_path: Path) -> None:
    from kvstream.emulator.launch import start_engine

    before = len(os.listdir("/proc/self/fd"))
    with start_engine("fd-check", log_dir=str(tmp_path)) as e:
        assert e.alive()
    assert e.popen.returncode is not None
    assert len(os.listdir("/proc/self/fd")) == before
