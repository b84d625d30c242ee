"""What the CLI tests share: running ``python -m kvstream`` as a user would, and the
"one clear line, no traceback" check every bad input must pass."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

KV = [sys.executable, "-m", "kvstream"]


def run(*args: str, timeout: float = 30, cwd: Any = None, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``kvstream ARGS`` as a real process (no stdin), its output captured as text."""
    return subprocess.run([*KV, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          stdin=subprocess.DEVNULL, **kw)


def one_clear_line(r: subprocess.CompletedProcess[str], *needles: str, code: int | None = None) -> None:
    """Failed (with exit status ``code`` if given) with exactly one line on stderr that
    contains every one of ``needles``, and no traceback."""
    assert (r.returncode != 0 if code is None else r.returncode == code), (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
