"""The native core's own tests (``cargo test`` in ``rust/``) run with the Python suite, so
the README's test command covers the crate's internals too (the encoders byte by byte, the
table, the error mapping). The Python tests are the crate's contract; these are its parts.

Marked ``slow``: the first run compiles the crate's test build (about half a minute on 2
cores). Without ``cargo`` on the PATH it is one skip line that says so.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RUST = Path(__file__).resolve().parents[1] / "rust"

pytestmark = pytest.mark.slow


def test_cargo_test_passes() -> None:
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("cargo is not on the PATH: the crate's own tests (cargo test in rust/) did not run")
    r = subprocess.run([cargo, "test", "--quiet"], cwd=RUST, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "test result: ok" in r.stdout, r.stdout[-2000:]
