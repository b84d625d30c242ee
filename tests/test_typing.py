"""The package ships ``py.typed``: its annotations are part of the API, so they must check.

Runs mypy over ``kvstream`` with the ``[tool.mypy]`` settings of pyproject.toml (default
checks plus ``warn_unused_ignores``, so a ``# type: ignore`` that no longer hides anything
fails too).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cache_dir(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # pytest's own cache directory survives between runs, so mypy re-checks only what
    # changed (about 0.2 s instead of about 4 s cold); without the cache plugin, a
    # session-local directory.
    cache = getattr(config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("mypy"))
    return tmp_path_factory.mktemp("mypy_cache")


def test_mypy_reports_no_errors_in_the_package(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytest.importorskip("mypy")
    cache_dir = _cache_dir(request.config, tmp_path_factory)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache_dir), "kvstream"],
        cwd=REPO,  # picks up [tool.mypy] from pyproject.toml
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"mypy kvstream exited with {proc.returncode}; fix the annotations (or, for a "
        f"deliberate speed idiom, add a '# type: ignore[code]' with its error code):\n"
        f"{proc.stdout}{proc.stderr}"
    )


def test_a_program_outside_the_checkout_sees_kvstreams_types(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """With the README's install (``pip install -e .``: maturin's editable install is a
    ``.pth`` path, no import hook), mypy run from another folder on a user's file resolves
    ``kvstream`` to the package and its annotations: a wrong type is an error, not Any."""
    pytest.importorskip("mypy")
    cache_dir = _cache_dir(request.config, tmp_path_factory)
    user = tmp_path / "user_program.py"
    user.write_text(
        "from kvstream import BlockPool, Router\n"
        "pool = BlockPool(num_gpu_blocks=8, block_size=16)\n"
        "wrong: int = pool\n"
        "reveal_type(Router)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache_dir), "--follow-imports", "silent", str(user)],
        cwd=tmp_path,  # not the checkout: only the installed package can be found
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "import-not-found" not in out and "import-untyped" not in out and "py.typed" not in out, out
    assert 'Incompatible types in assignment (expression has type "BlockPool", variable has type "int")' in out, out
    assert 'Revealed type is "def' in out and "kvstream" in out, out
    assert proc.returncode == 1, out
