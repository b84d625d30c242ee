"""``kvstream demo``: the real stack (engine and proxy processes, HTTP load, recorder), reduced."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstream.cli import main


def test_quick_demo_compares_policies_over_http_and_replay_equals_live(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    rc = main(["demo", "--quick", "--sessions", "4", "--transport", "ipc", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "EQUAL to the live router index" in text
    assert "takeaway: " in text and "TTFT p50 (s)" in text
    data = json.loads((out / "results.json").read_text())
    kv, rr = data["results"]
    assert (kv["policy"], rr["policy"]) == ("kv-aware", "round-robin")
    assert kv["answered"] == rr["answered"] == 8
    # Same prompts both times (the workload and the engines' outputs are seeded).
    assert kv["prompt_tokens"] == rr["prompt_tokens"]
    assert kv["cached_tokens"] >= rr["cached_tokens"]
    assert data["meta"]["replay_equal"] is True and (out / "events.kvlog").exists()


@pytest.mark.parametrize("argv, message", [
    (["--engines", "0"], "--engines: must be a positive integer, got 0"),
    (["--engines", "-1"], "--engines: must be a positive integer, got -1"),
    (["--sessions", "x"], "--sessions: 'x' is not a positive integer"),
])
def test_bad_numbers_are_one_line_and_exit_2(argv: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unusable_out_directory_is_refused_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    assert main(["demo", "--quick", "--out", str(afile)]) == 2
    err = capsys.readouterr()
    assert "is a file; give a directory" in err.err and err.out == ""
    assert main(["demo", "--quick", "--out", str(afile / "sub")]) == 2
    assert "is not a writable directory" in capsys.readouterr().err


def test_ctrl_c_during_the_run_exits_130_and_says_what_was_kept(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "kvstream", "demo", "--quick", "--sessions", "20", "--turns", "4",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        for line in proc.stdout:  # the first progress line: engines and proxies are serving
            if line.startswith("  kv-aware"):
                break
            assert time.monotonic() < deadline, "no progress line"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "kvstream demo: interrupted; kept" in err and "engines and services stopped" in err
    assert "Traceback" not in err
