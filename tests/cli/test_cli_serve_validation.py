"""``kvstream serve`` checks what it is given before it starts, as the small commands do:
one clear line on stderr and exit status 2, never a uvicorn or ExceptionGroup traceback.
And Ctrl-C while any command starts (the parser imports every command, then the command
sets itself up) is one line and a non-zero exit, never a ``KeyboardInterrupt`` traceback.

Before (issue #24, item 3): a bind-form or ``http://`` engine endpoint gave a ~75-line
traceback (exit 3), a missing ``--register-token-file`` a 40-line one, ``--proxy`` without
any ``http=`` URL started and answered every request 503, ``--workers 0`` was accepted, and
Ctrl-C in the first second printed a ``KeyboardInterrupt`` traceback in 7 commands.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.cli.helpers import KV, one_clear_line, run


@pytest.mark.parametrize("args, says", [
    (["e0=tcp://*:5557"], "is a bind address"),
    (["e0=tcp://0.0.0.0:5557,tcp://10.0.0.1:5558"], "is a bind address"),
    (["e0=tcp://10.0.0.1:5557,tcp://*:5558"], "replay endpoint 'tcp://*:5558' is a bind address"),
    (["e0=http://127.0.0.1:8000"], "is an HTTP URL"),
    (["e0=tcp://127.0.0.1"], "has no port"),
    (["e0=tcp://127.0.0.1:99999"], "is not a port number"),
    (["e0=udp://127.0.0.1:5557"], "scheme 'udp' is not supported"),
    (["--register-token-file", "/nonexistent/token"], "cannot read register-token-file"),
    (["--proxy", "e0=tcp://127.0.0.1:5557"], "no engine has one"),
    (["--processes", "0"], "--processes: must be at least 1 process"),
    (["--workers", "0"], "--workers: must be at least 1 process"),
    (["--max-engines", "0"], "--max-engines: must be a positive integer"),
    (["--max-engines", "10001"], "max-engines must be 1..10000"),
    (["e0=tcp://127.0.0.1:1", "e1=tcp://127.0.0.1:2", "--max-engines", "1"], "more than max-engines 1"),
])
def test_bad_serve_input_is_one_clear_line_and_exit_2(args: list[str], says: str) -> None:
    r = run("serve", "--port", "0", *args)
    one_clear_line(r, says, code=2)


def test_an_empty_token_file_and_a_bad_engine_in_the_config_file(tmp_path) -> None:
    (tmp_path / "token").write_text("\n")
    one_clear_line(run("serve", "--port", "0", "--register-token-file", str(tmp_path / "token")), "is empty", code=2)
    f = tmp_path / "serve.toml"
    f.write_text('engines = ["e0=http://h:8000"]\n')
    one_clear_line(run("serve", "--port", "0", "--config", str(f)), str(f), "is an HTTP URL", code=2)


def _started(p: subprocess.Popen, deadline: float = 30.0) -> None:
    """Wait until ``p`` runs kvstream's own code: libzmq is mapped once the parser imports
    the commands, after Python itself has started (a Ctrl-C before that is the
    interpreter's, not ours)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if p.poll() is not None:
            return
        try:
            with open(f"/proc/{p.pid}/maps") as f:
                if "libzmq" in f.read():
                    return
        except OSError:
            return
        time.sleep(0.005)
    raise AssertionError(f"{p.args!r} did not start within {deadline}s")


def _as_at_a_terminal() -> None:
    """In the child: SIGINT does what it does for a command started at a terminal. A
    command started in the background by a shell without job control (``pytest ... &`` in
    a script, as bench/stress_suite.sh runs the suite) inherits SIGINT ignored, and Python
    then leaves it ignored: the Ctrl-C never arrives and the command runs on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


COMMANDS = [
    ["serve", "--port", "0", "e0=tcp://127.0.0.1:1"],
    ["engine", "--port", "0"],
    ["subscribe", "tcp://127.0.0.1:1"],
    ["record", "-o", "{tmp}/out.kvlog", "tcp://127.0.0.1:1"],
    ["simulate", "--requests", "100000"],
    ["demo", "--quick", "--out", "{tmp}/demo"],
    ["relay", "--nats", "nats://127.0.0.1:1", "tcp://127.0.0.1:1"],
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_ctrl_c_while_a_command_starts_is_one_line_never_a_traceback(cmd: list[str], tmp_path) -> None:
    import os

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("tells that the process runs kvstream's code from /proc/PID/maps")
    for i, after in enumerate((0.0, 0.1, 0.3, 0.6)):
        # A folder per start: an output an earlier start made (record's log) would make this
        # one refuse to start, and a Ctrl-C during that refusal is not the case tested here.
        (tmp_path / str(i)).mkdir()
        args = [a.replace("{tmp}", str(tmp_path / str(i))) for a in cmd]
        p = subprocess.Popen([*KV, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL, preexec_fn=_as_at_a_terminal)
        try:
            _started(p)
            time.sleep(after)  # Ctrl-C at several points of the start-up (the point, not a wait for a peer)
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (after, err)
        # 130 (or killed by SIGINT, which a shell reports as 130), or 0 for a command that
        # stops cleanly on SIGINT once it runs (serve)
        assert p.returncode in (0, 1, 130, -signal.SIGINT), (after, p.returncode, err)
        if p.returncode in (130, -signal.SIGINT):  # said in one line: "interrupted" (engine: "stopped")
            assert f"kvstream {cmd[0]}: interrupted" in err or f"kvstream {cmd[0]}: stopped" in err, err


LOST_INTERRUPT = """
import sys, time
from kvstream.cli import _keep_interrupts
_keep_interrupts()

class Finalizer:  # raises from where Python cannot raise, as the import system's weakref callbacks do
    def __del__(self):
        raise KeyboardInterrupt

try:
    Finalizer()
    time.sleep(60)
    print("lost")
except KeyboardInterrupt:
    print("raised")
"""


def test_a_ctrl_c_that_lands_in_a_finalizer_is_raised_again_without_a_traceback() -> None:
    # Found by the stress run: a Ctrl-C during `kvstream relay`'s start-up landed in
    # importlib's module-lock weakref callback; Python printed "Exception ignored in" with a
    # traceback and the command ran on to its NATS timeout.
    r = subprocess.run([sys.executable, "-c", LOST_INTERRUPT], capture_output=True, text=True, timeout=120,
                       preexec_fn=_as_at_a_terminal)  # SIGINT not ignored, as under a background shell
    assert r.stdout.strip() == "raised", (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


def test_more_engines_than_the_file_limit_allows_is_one_clear_line() -> None:
    import resource

    def low_limit() -> None:  # in the child: a hard limit of 1,500 open files
        resource.setrlimit(resource.RLIMIT_NOFILE, (1500, 1500))

    r = run("serve", "--port", "0", "--max-engines", "256", preexec_fn=low_limit)
    one_clear_line(r, "--max-engines 256 needs about 3072 open files", "lower --max-engines to 59", code=2)
